"""What a calibration leaves of the user's model: a failed SmoothQuant call its weights, every
entry point each module's own train / eval flag, the fisher metric the parameters' ``.grad``
and ``requires_grad``; and the batches / preset arguments it is given are not misread."""

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Auto, Outliers, preset
from quantscope.calibration.choice.auto import score_batches
from quantscope.calibration.choice.layer_choice import fisher_weights
from quantscope.calibration.choice.smooth import smooth
from quantscope.calibration.run.batches import eval_mode
from quantscope.observers.registry import get_observer


def _llama(seed=0, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, **config)
    return LlamaForCausalLM(cfg).eval()


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 64, (2, 12), generator=g),
             "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(n)]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- smoothing
def test_a_smoothed_calibration_that_fails_on_a_bad_batch_leaves_the_weights():
    model = _llama()
    before = _state(model)

    def batches():  # the first batch is smoothed on; the second's ids are out of range
        yield torch.randint(0, 64, (2, 8))
        yield torch.randint(100, 200, (2, 8))

    with pytest.raises(IndexError):
        quantscope.calibrate(model, batches(), "w8a8", outliers=Outliers(smooth=0.8),
                             progress=False)
    assert _same_state(model, before)


def test_a_smoothed_calibration_that_fails_on_an_observer_option_leaves_the_weights():
    model = _llama()
    before = _state(model)
    with pytest.raises(ValueError, match="maxshrnk"):
        quantscope.calibrate(model, [torch.randint(0, 64, (2, 8))],
                             preset("w8a8", "mse", maxshrnk=0.5),
                             outliers=Outliers(smooth=0.8), progress=False)
    assert _same_state(model, before)
    # the same call that succeeds smooths the model, as before
    quantscope.calibrate(model, [torch.randint(0, 64, (2, 8))], "w8a8",
                         outliers=Outliers(smooth=0.8), progress=False)
    assert not _same_state(model, before)


def test_smoothing_ranges_are_measured_in_eval_mode():
    # dropout active in the user's train mode made the scales random
    scales = []
    for mode in (False, True, True):
        model = _llama(attention_dropout=0.5).train(mode)
        torch.manual_seed(len(scales))
        scales.append(smooth(model, _batches(1), 0.8)["scales"])
        assert model.training == mode
    for s in scales[1:]:
        assert s.keys() == scales[0].keys()
        assert all(torch.equal(s[k], scales[0][k]) for k in s)


# ----------------------------------------------------------------------------- train / eval
def _mixed(model):
    """``model`` in train mode but for one submodule the user set to eval: its flags."""
    model.train()
    next(m for m in model.modules() if isinstance(m, nn.Linear)).eval()
    return {n: m.training for n, m in model.named_modules()}


def test_eval_mode_restores_every_module_flag_even_on_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.1)))
    model.train()
    model[1].eval()
    before = {n: m.training for n, m in model.named_modules()}
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("inside")
    assert {n: m.training for n, m in model.named_modules()} == before


@pytest.mark.parametrize("how", ["plain", "auto-model", "fisher", "smooth", "sequential",
                                 "sensitivity"])
def test_every_entry_point_restores_each_modules_own_mode(how):
    model, batches = _llama(), _batches()
    before = _mixed(model)
    if how == "sensitivity":
        quantscope.sensitivity(model, batches, "w8a8")
    else:
        kw = {"plain": {}, "auto-model": {"observer": "auto"},
              "fisher": {"observer": "auto", "auto": Auto(metric="fisher")},
              "smooth": {"outliers": Outliers(smooth=0.5)},
              "sequential": {"sequential": True}}[how]
        quantscope.calibrate(model, batches, "w8a8", progress=False, **kw)
    assert {n: m.training for n, m in model.named_modules()} == before


@pytest.mark.parametrize("step", ["find_groups", "divergence", "fisher", "layer_errors"])
def test_each_pass_restores_each_modules_own_mode(step):
    from quantscope.calibration.choice import sensitivity
    from quantscope.calibration.choice.auto import OutputDivergence
    from quantscope.calibration.structure.fusion import find_groups

    model, batches = _llama(), _batches(1)
    before = _mixed(model)
    q = "model.layers.0.self_attn.q_proj"
    if step == "find_groups":
        assert find_groups(model, batches[0], [q, q.replace("q_", "k_")])
    elif step == "divergence":
        OutputDivergence(model, batches).on(0)
    elif step == "fisher":
        assert fisher_weights(model, batches, [q])
    else:
        assert sensitivity._layer_errors(model, batches, {})[2] == 1
    assert {n: m.training for n, m in model.named_modules()} == before


# ----------------------------------------------------------------------------- fisher
def test_fisher_keeps_the_users_gradients():
    model, batches = _llama(), _batches()
    ids = batches[0]["input_ids"]
    model(**batches[0], labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    quantscope.calibrate(model, batches, "w8a8", observer="auto", auto=Auto(metric="fisher"),
                         progress=False)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


def test_fisher_on_a_frozen_model_equals_the_unfrozen_and_leaves_it_frozen():
    model, batches = _llama(), _batches()
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    want = fisher_weights(model, batches, layers)
    model.requires_grad_(False)
    got = fisher_weights(model, batches, layers)
    assert got.keys() == want.keys() == set(layers)
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=0) for k in layers)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    c = quantscope.calibrate(model, batches, "w8a8", observer="auto",
                             auto=Auto(metric="fisher"), progress=False)
    assert c.states and not any(p.requires_grad for p in model.parameters())


# ----------------------------------------------------------------------------- arguments
def test_one_dict_as_batches_is_refused_naming_batches():
    model, batches = _llama(), _batches(1)
    with pytest.raises(TypeError, match="batches must be an iterable of batches.*list"):
        quantscope.calibrate(model, batches[0], "w8a8", progress=False)
    with pytest.raises(TypeError, match="sensitivity: batches"):
        quantscope.sensitivity(model, batches[0], "w8a8")


@pytest.mark.parametrize("bad", ["a prompt", b"bytes", 8], ids=["str", "bytes", "int"])
def test_batches_that_are_no_iterable_of_batches_are_refused_naming_batches(bad):
    """A string was iterated character by character into the model, an int failed in
    Python's iter(): neither named the argument."""
    model = nn.Sequential(nn.Linear(8, 4))
    for entry in (quantscope.calibrate, quantscope.sensitivity):
        with pytest.raises(TypeError, match=f"{entry.__name__}: batches must be an iterable "
                                            f"of batches .*got {type(bad).__name__}"):
            entry(model, bad, "w8a8")


def test_sensitivity_on_no_batches_names_itself():
    model = nn.Sequential(nn.Linear(8, 4))
    calib = quantscope.calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)
    with pytest.raises(ValueError, match="sensitivity: batches is empty"):
        quantscope.sensitivity(model, [], calibration=calib)


def test_preset_options_reach_the_memoryless_weight_observer():
    r = preset("w8a8", "mse", maxshrink=0.5, grid=10.0, averaging_constant=0.1)
    weight, inp = r.rules[0].weight, r.rules[0].input
    assert (weight.observer, dict(weight.options)) == ("memoryless_mse",
                                                        {"maxshrink": 0.5, "grid": 10.0})
    assert (inp.observer, dict(inp.options)) == ("mse", {"maxshrink": 0.5, "grid": 10.0,
                                                         "averaging_constant": 0.1})
    # the calibrated weight scale is the memoryless MSE search's with those options
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    with torch.no_grad():
        model[0].weight[0, 0] = 20.0
    c = quantscope.calibrate(model, [torch.randn(4, 64)], r, progress=False)
    obs = get_observer("memoryless_mse", weight.spec, maxshrink=0.5, grid=10.0)
    obs(model[0].weight.detach())
    assert torch.equal(c.states["0"]["weight"].qparams.scale, obs.qparams().scale)


def test_preset_of_a_recipe_applies_the_observer_and_refuses_the_rest():
    base = preset("w8a8")
    assert preset(base) is base
    mse = preset(base, "mse", maxshrink=0.5)
    assert mse == preset("w8a8", "mse", maxshrink=0.5)
    for kw in ({"ignore": ["0"]}, {"kv_cache": "fp8"}, {"targets": ("Conv2d",)}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}= given with Recipe 'w8a8'"):
            preset(base, "mse", **kw)
    with pytest.raises(ValueError, match="options without observer="):
        preset(base, maxshrink=0.5)


def test_score_tokens_count_every_token_id_of_a_tensor_batch():
    ids = [torch.randint(0, 64, (2, 32)) for _ in range(6)]  # 64 token ids each
    assert len(score_batches(ids, 64)) == 1
    assert len(score_batches(ids, 65)) == 2
    assert len(score_batches([(i,) for i in ids], 128)) == 2
    feats = [torch.randn(2, 32, 8) for _ in range(3)]  # float features: a token per row
    assert len(score_batches(feats, 64)) == 1
    rows = [torch.randn(4, 8) for _ in range(3)]  # (rows, features): a token per row
    assert len(score_batches(rows, 8)) == 2
