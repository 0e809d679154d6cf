"""SmoothQuant (calibration/choice/smooth.py): the function is kept, the scales are the formula's, a
mapping the probe rejects is left alone, and the static w8a8 output moves closer to float."""

import pytest
import torch
from torch import nn

from quantscope.calibration import apply, calibrate
from quantscope.calibration.choice.smooth import MIN_SCALE, find_mappings, smooth, smoothing_scales


def _llama(seed=0, outlier=100.0):
    """A 2-layer random Llama whose post-attention norm and up_proj give a few channels
    outliers (as real LLMs' MLP inputs have); 3 batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[[3, 17]] = outlier
            layer.mlp.up_proj.weight[[5, 40]] *= outlier
    g = torch.Generator().manual_seed(seed + 1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 12), generator=g),
                "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(3)]
    return model, batches


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def test_mappings_found_in_a_llama():
    model, _ = _llama()
    got = [(m.previous, m.balance) for m in find_mappings(model)]
    assert got == [
        (f"model.layers.{i}.{prev}", tuple(f"model.layers.{i}.{b}" for b in bal))
        for prev, bal in (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",))) for i in range(2)]


def test_smoothing_keeps_the_function_and_uses_the_formula():
    model, batches = _llama()
    before = _logits(model, batches)
    norm0 = model.model.layers[1].post_attention_layernorm.weight.detach().clone()
    gate0 = model.model.layers[1].mlp.gate_proj.weight.detach().clone()
    up0 = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    # the ranges by hand: the gate_proj input of layer 1 on the first batch
    seen = []
    h = model.model.layers[1].mlp.gate_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].reshape(-1, 32).detach().clone()))
    _logits(model, batches[:1])
    h.remove()
    x = seen[0]
    rng = x.amax(0) - x.amin(0)
    w = 2 * torch.maximum(gate0.abs().amax(0), up0.abs().amax(0))
    s = (rng.pow(0.8) / w.pow(0.2)).clamp(min=MIN_SCALE)

    info = smooth(model, batches[:1], 0.8)
    assert info["skipped"] == [] and len(info["smoothed"]) == 6
    layer = model.model.layers[1]
    torch.testing.assert_close(layer.post_attention_layernorm.weight, norm0 / s)
    torch.testing.assert_close(layer.mlp.gate_proj.weight, gate0 * s)
    # the same function, to float rounding
    torch.testing.assert_close(_logits(model, batches), before, rtol=1e-4, atol=1e-4)
    # the outlier channels are flatter than before (what smoothing is for)
    assert float(rng.amax() / rng.median()) > 10 * float((rng / s).amax() / (rng / s).median())


def test_scales_formula_and_its_edges():
    ranges = torch.tensor([4.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, 2.0, 0.0], [-3.0, 0.5, 0.0]])
    w2 = torch.tensor([[0.5, -4.0, 0.0]])
    s = smoothing_scales(ranges, [w1, w2], 0.5)
    # column max |W| over both: 3, 4, 0 -> 2x: 6, 8, 0; the all-zero column keeps its range
    assert torch.allclose(s, torch.tensor([4 ** 0.5 / 6 ** 0.5, MIN_SCALE, 9.0]))


class _OnePlusNorm(nn.Module):
    """Gemma's norm: ``x * (1 + weight)``, which dividing ``weight`` does not scale."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n))

    def forward(self, x):
        return x * (1 + self.weight)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = _OnePlusNorm(8)
        self.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj"):
            setattr(self.self_attn, n, nn.Linear(8, 8))

    def forward(self, x):
        h = self.input_layernorm(x)
        a = self.self_attn
        return a.q_proj(h) + a.k_proj(h) + a.v_proj(h)


def test_a_norm_the_probe_rejects_is_left_alone():
    torch.manual_seed(0)
    model = _Block()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    info = smooth(model, [torch.randn(4, 8) * 5], 0.5)
    assert info["smoothed"] == [] and info["skipped"] == ["input_layernorm"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_calibrate_smooth_brings_static_w8a8_closer_to_float():
    model, batches = _llama()
    ref = _logits(model, batches)
    plain = calibrate(model, batches, "w8a8", observer="minmax")
    with apply(model, plain.states):
        err_plain = float((_logits(model, batches) - ref).pow(2).mean())
    smoothed = calibrate(model, batches, "w8a8", observer="minmax", smooth=0.5)
    assert smoothed.info["smooth"]["alpha"] == 0.5
    assert len(smoothed.info["smooth"]["smoothed"]) == 6
    with apply(model, smoothed.states):
        err_smooth = float((_logits(model, batches) - ref).pow(2).mean())
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, "0.5", True, float("nan")])
def test_bad_alpha_is_named(alpha):
    model, batches = _llama()
    with pytest.raises(ValueError, match="alpha"):
        calibrate(model, batches, "w8a8", observer="minmax", smooth=alpha)


def test_smooth_with_sequential_is_refused():
    model, batches = _llama()
    with pytest.raises(ValueError, match="smooth.*sequential"):
        calibrate(model, batches, "w8a8", observer="minmax", smooth=0.5, sequential=True)


def test_a_saved_smoothed_calibration_smooths_a_fresh_model_alike(tmp_path):
    from quantscope.calibration import load
    from quantscope.calibration.choice.smooth import reapply

    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", observer="minmax", smooth=0.8)
    calib.save(tmp_path / "q")
    back = load(tmp_path / "q")
    assert back.info["smooth"]["smoothed"] == calib.info["smooth"]["smoothed"]
    fresh, _ = _llama()
    reapply(fresh, back)
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k
    # and the whole run: qparams applied to the reloaded, re-smoothed model give the same
    with apply(model, calib.states):
        want = _logits(model, batches)
    with apply(fresh, back.states):
        torch.testing.assert_close(_logits(fresh, batches), want, rtol=0, atol=0)


def test_a_smoothing_scale_of_another_length_is_refused_naming_the_module():
    # probing: a hand-edited scale of 3 values failed deep in reapply (a size mismatch)
    from quantscope.calibration.choice.smooth import reapply

    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", observer="minmax", smooth=0.8)
    name = next(iter(calib.smoothing))
    calib.smoothing[name] = torch.ones(3)
    fresh, _ = _llama()
    with pytest.raises(ValueError, match=rf"smooth: the calibration's scale for '{name}' has "
                                         rf"shape \(3,\); this model's .* takes \d+ channels"):
        reapply(fresh, calib)


def test_every_recipe_of_one_pass_carries_the_smoothing():
    from quantscope.calibration import calibrate_many

    model, batches = _llama()
    out = calibrate_many(model, batches, ["w8a8", "fp8"], smooth=0.5)
    a, b = out.values()
    assert a.smoothing.keys() == b.smoothing.keys() and len(a.smoothing) == 6
    assert a.info["smooth"] == b.info["smooth"]


def test_nothing_seen_nothing_smoothed():
    """No batch: no range to go by, the model left as it was, and said (smooth is public:
    an empty list or spent generator would otherwise pass without a word)."""
    model, _ = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"^smooth: no layer it smooths saw a batch"):
        info = smooth(model, iter(()), 0.5)
    assert info["smoothed"] == [] and len(info["skipped"]) == 6 and info["scales"] == {}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("one", ["dict", "tensor"])
def test_one_batch_not_in_a_list_is_refused_as_calibrate_refuses_it(one):
    """One dict would run as its key strings, one tensor as its rows: each failed inside the
    model, naming neither smooth nor batches; now calibrate's TypeError, before any change."""
    model, batches = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = batches[0] if one == "dict" else batches[0]["input_ids"]
    with pytest.raises(TypeError, match=r"^smooth: batches must be an iterable of batches, "
                                        r"got one (dict|Tensor) \(a single batch\)"):
        smooth(model, batch, 0.5)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_ranges_are_reduced_across_ranks_only_for_a_distributed_calibration(monkeypatch):
    """A process group alone (torchrun, each rank calibrating by itself) is not a reason for
    a collective: one rank smoothing alone would wait for the others forever."""
    from quantscope import comm
    from quantscope.calibration.choice import smooth as sm

    calls = []
    monkeypatch.setattr(comm, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(comm, "group_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(comm, "all_reduce", lambda t, op, group: calls.append(op))
    model, batches = _llama()
    alone = sm.channel_ranges(model, batches[:1], find_mappings(model))
    assert calls == []
    # one collective for all mappings (mins and negated maxes by MIN); a rank alone in its
    # group (the fake all_reduce changes nothing) gets its own ranges back, bit for bit
    got = sm.channel_ranges(model, batches[:1], find_mappings(model), distributed=True)
    assert calls == [torch.distributed.ReduceOp.MIN]
    assert got.keys() == alone.keys() and all(torch.equal(got[k], alone[k]) for k in got)


def test_a_linear_called_by_keyword_is_seen_and_smoothed():
    """``down_proj(input=h)``: the ranges hook reads the input as apply's hooks do."""
    model, batches = _llama()
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda x, m=mlp: m.down_proj(
            input=m.act_fn(m.gate_proj(x)) * m.up_proj(x)))
    ref = _logits(model, batches)
    info = smooth(model, batches[:1], 0.5)
    assert [n for n in info["smoothed"] if n.endswith("mlp.up_proj")] == [
        "model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    torch.testing.assert_close(_logits(model, batches), ref, rtol=1e-3, atol=1e-3)


def test_the_probe_runs_without_the_models_forward_hooks():
    """A user's hook written for ``[batch, seq, hidden]`` (raising on the probe's 2-D rows)
    changes nothing: the same smoothing, and the hooks see only the real batches."""
    from quantscope.calibration import Outliers

    model, batches = _llama()
    want = calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.8), progress=False)
    model, batches = _llama()
    shapes = []

    def logger(module, args, out):
        b, t, h = out.shape  # a ValueError on 2-D data
        shapes.append((b, t, h))

    def spy(module, args):
        shapes.append(tuple(args[0].shape))
    mlps = [layer.mlp for layer in model.model.layers]
    handles = [m.register_forward_hook(logger) for m in mlps]
    handles += [m.up_proj.register_forward_pre_hook(spy) for m in mlps]
    try:
        dicts = [m._forward_hooks for m in mlps]
        got = calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.8), progress=False)
        # the hooks are back where they were: the same dicts, the same hooks
        assert all(m._forward_hooks is d and list(d.values()) == [logger]
                   for m, d in zip(mlps, dicts))
    finally:
        for h in handles:
            h.remove()
    assert got.info["smooth"] == want.info["smooth"] and got.info["smooth"]["skipped"] == []
    assert got.smoothing.keys() == want.smoothing.keys()
    assert all(torch.equal(got.smoothing[k], want.smoothing[k]) for k in want.smoothing)
    assert shapes and set(shapes) == {(2, 12, 32)}


class _TwoArgMLP(nn.Module):
    """A gated MLP whose forward takes a second argument: the probe cannot run it."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x, scale):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)) * scale


def test_a_probe_that_cannot_run_is_named_not_called_a_change():
    torch.manual_seed(0)
    model = nn.Module()
    model.mlp = _TwoArgMLP()
    model.forward = lambda x: model.mlp(x, 2.0)
    info = smooth(model, [torch.randn(4, 8)], 0.5)
    assert info["skipped"] == ["mlp.up_proj"]
    assert info["why"]["mlp.up_proj"].startswith(
        "the probe could not run mlp on one [8, 8] tensor (TypeError: ")


def test_smoothing_inside_autocast_sees_the_new_weights():
    """Autocast caches its casts of the weights the ranges forward read: smoothing changes
    them in place, so the probe, and every later forward of the region, must see the new
    ones (the up_proj -> down_proj probe saw the old weights and was skipped as a change)."""
    model, batches = _llama()
    plain = smooth(_llama()[0], batches[:1], 0.8)
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        info = smooth(model, batches[:1], 0.8)
        after = model(**batches[0]).logits.float()
    assert info["skipped"] == [] and info["smoothed"] == plain["smoothed"]
    reference, _ = _llama()
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        before = reference(**batches[0]).logits.float()
    assert float((after - before).norm() / before.norm()) < 0.05  # bf16 rounding only
