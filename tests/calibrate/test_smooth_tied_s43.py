"""SmoothQuant on tied parameters (calibration/choice/smooth.py, structure/tied.py): a mapping
whose scaled parameters share memory with a module outside it (a q_proj Parameter tied across
two layers, two Parameters over one memory, an overlapping slice, a norm weight) is skipped
with its reason, so the smoothed float model computes the same function; memory shared only
where the rewrite stays exact (a whole layer under two names, disjoint slices of one fused
tensor, two balanced Linears over one weight) is still smoothed."""

import pytest
import torch
from torch import nn

from quantscope.calibration import Outliers, calibrate
from quantscope.calibration.choice.smooth import reapply, smooth


def _llama(kv_heads=2):
    """A 2-layer random Llama with norms away from 1 (a channel at 30), and 2 batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1, 0.5)
                norm.weight[7] = 30.0
    g = torch.Generator().manual_seed(1)
    return model, [{"input_ids": torch.randint(0, 64, (2, 12), generator=g)} for _ in range(2)]


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def _smooth_keeps_the_function(model, batches) -> dict:
    before = _logits(model, batches)
    info = smooth(model, batches, 0.8)
    torch.testing.assert_close(_logits(model, batches), before, rtol=1e-4, atol=1e-4)
    return info


_L = "model.layers"
_NORMS = [f"{_L}.{i}.input_layernorm" for i in range(2)]
_REST = [f"{_L}.{i}.{n}" for n in ("post_attention_layernorm", "mlp.up_proj") for i in range(2)]


def _tie_qkv(model, how):
    """Layer 1's q / k / v weights: layer 0's Parameters, or new ones over their memory."""
    a0, a1 = (layer.self_attn for layer in model.model.layers)
    for n in ("q_proj", "k_proj", "v_proj"):
        w = getattr(a0, n).weight
        getattr(a1, n).weight = w if how == "same" else nn.Parameter(w.detach())


@pytest.mark.parametrize("how", ["same", "memory"])
def test_qkv_weights_tied_across_layers_leave_both_norms_unsmoothed(how):
    # the probe's finding: both input_layernorm mappings were smoothed, the tied weights
    # scaled by s0 * s1 while each norm was divided by its own: logits off by 1.7x
    model, batches = _llama()
    _tie_qkv(model, how)
    info = _smooth_keeps_the_function(model, batches)
    assert info["smoothed"] == [n for n in _REST]  # in MAPPINGS' order
    assert info["skipped"] == _NORMS
    assert info["why"][_NORMS[0]] == (
        f"{_L}.0.self_attn.q_proj.weight shares memory with {_L}.1.self_attn.q_proj.weight "
        f"(tied), which is outside this mapping: smoothing would change it too")
    assert info["why"][_NORMS[1]].startswith(
        f"{_L}.1.self_attn.q_proj.weight shares memory with {_L}.0.self_attn.q_proj.weight")


def test_an_overlapping_slice_is_shared_memory():
    # layer 1's k_proj ([16, 32]) over the first rows of layer 0's q_proj ([32, 32])
    model, batches = _llama()
    layers = model.model.layers
    layers[1].self_attn.k_proj.weight = nn.Parameter(
        layers[0].self_attn.q_proj.weight.detach()[:16])
    info = _smooth_keeps_the_function(model, batches)
    assert info["skipped"] == _NORMS and "outside this mapping" in info["why"][_NORMS[1]]


def test_a_norm_weight_tied_to_another_layers_norm():
    # layer 1's input_layernorm holds layer 0's post_attention_layernorm weight
    model, batches = _llama()
    layers = model.model.layers
    layers[1].input_layernorm.weight = layers[0].post_attention_layernorm.weight
    info = _smooth_keeps_the_function(model, batches)
    assert sorted(info["skipped"]) == [f"{_L}.0.post_attention_layernorm", _NORMS[1]]
    assert info["why"][_NORMS[1]].startswith(
        f"{_L}.1.input_layernorm.weight shares memory with {_L}.0.post_attention_layernorm.weight")


def test_calibrate_reports_the_skip_and_keeps_the_float_model():
    model, batches = _llama()
    _tie_qkv(model, "same")
    before = _logits(model, batches)
    calib = calibrate(model, batches, "w8a8", observer="minmax", outliers=Outliers(smooth=0.8),
                      progress=False)
    assert set(calib.smoothing) == set(_REST)
    assert "(tied)" in calib.info["smooth"]["why"][_NORMS[0]]
    torch.testing.assert_close(_logits(model, batches), before, rtol=1e-4, atol=1e-4)


def _reapply_refused(tie, match: str):
    """A calibration made where the weights were untied, reapplied to a fresh model that
    ``tie(model)`` ties: refused, matching ``match``, and nothing of the model written."""
    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", observer="minmax", outliers=Outliers(smooth=0.8),
                      progress=False)
    assert set(_NORMS) <= set(calib.smoothing)
    fresh, _ = _llama()
    tie(fresh)
    state = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        reapply(fresh, calib)
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())


def test_reapply_refuses_scales_for_tied_weights_before_writing():
    _reapply_refused(lambda m: _tie_qkv(m, "same"),
                     rf"smooth: the calibration smoothed '{_NORMS[0]}', but in this model "
                     rf".*q_proj.weight shares memory")


def test_reapply_refusing_a_later_mapping_writes_nothing():
    # every check comes before the first write: here the first mappings (the input norms)
    # fit, and a later one (layer 0's post-attention norm: up_proj tied to layer 1's) does not
    def tie_up(model):
        mlp = [layer.mlp for layer in model.model.layers]
        mlp[1].up_proj.weight = mlp[0].up_proj.weight
    _reapply_refused(tie_up, rf"smooth: the calibration smoothed '{_L}\.0\."
                             rf"post_attention_layernorm', .*shares memory")


def test_balanced_weights_over_shifted_memory_are_not_smoothed():
    # layer 0's k_proj views q_proj's memory 16 values on (half a row): its column j is q's
    # column j + 16, which another scale multiplies: the two writes would disagree
    model, batches = _llama()
    a = model.model.layers[0].self_attn
    a.k_proj.weight = nn.Parameter(a.q_proj.weight.detach().view(-1)[16:16 + 16 * 32]
                                   .view(16, 32))
    info = _smooth_keeps_the_function(model, batches)
    assert _NORMS[0] in info["skipped"] and "write it twice" in info["why"][_NORMS[0]]


# memory shared where the rewrite stays exact: still smoothed, the function kept

def test_a_whole_layer_under_two_names_is_smoothed():
    model, batches = _llama()
    model.model.layers[1] = model.model.layers[0]  # the same module twice (ALBERT-like)
    info = _smooth_keeps_the_function(model, batches)
    assert info["skipped"] == [] and len(info["smoothed"]) == 3


def test_disjoint_slices_of_one_fused_tensor_are_smoothed():
    model, batches = _llama()
    for layer in model.model.layers:
        a = layer.self_attn
        fused = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        a.q_proj.weight, a.k_proj.weight, a.v_proj.weight = (
            nn.Parameter(t) for t in fused.split([32, 16, 16]))
    info = _smooth_keeps_the_function(model, batches)
    assert info["skipped"] == [] and len(info["smoothed"]) == 6


def test_two_balanced_linears_over_one_weight_get_one_value():
    model, batches = _llama(kv_heads=4)  # k_proj as wide as q_proj
    a = model.model.layers[0].self_attn
    w = a.q_proj.weight.detach().clone()
    a.k_proj.weight = a.q_proj.weight
    info = _smooth_keeps_the_function(model, batches)
    assert info["skipped"] == [] and len(info["smoothed"]) == 6
    torch.testing.assert_close(a.k_proj.weight, w * info["scales"][_NORMS[0]])
