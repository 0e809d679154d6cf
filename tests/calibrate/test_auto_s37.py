"""Session 37's probe of ``observer="auto"``: the model metric's candidates run only the
``auto`` roles (a hand-named observer and the KV cache's kept), ``Auto(metric="output")``
prices a fusion group's one input under each member's own weight, and a sequential block's
scoring reads the user's attention masks."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from calib_checks import padded_batches
from tiny_models import llama
from torch import nn

import quantscope
from quantscope import presets
from quantscope.calibration import Auto, calibrate_many
from quantscope.calibration.choice.candidates import expand
from quantscope.calibration.choice.score_set import score_plan
from quantscope.calibration.recipe import Recipe, Role, Rule, preset
from quantscope.calibration.results.apply import apply, qdq_tensor
from quantscope.layout import Tensor
from quantscope.spec import QuantSpec

KW = {"progress": False}
TWO = Auto(candidates=("minmax", "percentile"))


def _calibrate(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate(*args, **KW, **kw)


def _hand_weights() -> Recipe:
    return Recipe(Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "memoryless_mse"),
                       input=Role(QuantSpec("int8", Tensor()), "auto")), name="mixed")


def test_model_metric_keeps_a_weight_observer_named_by_hand():
    model, batches = llama()
    recipe = _hand_weights()
    expanded, _, _ = expand(model, {"r": recipe}, ["r"], ["minmax", "percentile"])
    for n in ("minmax", "percentile"):  # each candidate: the auto input only
        (rule,) = expanded[("r", n)].rules
        assert rule.weight == recipe.rules[0].weight and rule.input.observer == n
    calib = _calibrate(model, batches, recipe, auto=TWO)
    for layer, roles in calib.states.items():
        assert roles["weight"].observer == roles["weight"].requested == "memoryless_mse", layer
        assert roles["input"].requested == "auto"
    assert set(calib.info["auto"]["roles"]) == {"input"}
    assert {r["requested"] for r in calib.stats if r["role"] == "weight"} == {"memoryless_mse"}


def test_model_metric_leaves_the_kv_cache_observer_alone():
    model, batches = llama()
    recipe = preset("w8a8", "auto", kv_cache="fp8")
    assert recipe.kv_cache.observer == "minmax"  # "min-max for auto" (preset's docstring)
    expanded, _, _ = expand(model, {"r": recipe}, ["r"], ["minmax", "percentile"])
    assert expanded[("r", "percentile")].kv_cache == recipe.kv_cache
    calib = _calibrate(model, batches, recipe, auto=TWO)
    for role in ("key", "value"):
        st = calib.states["model.layers.0.self_attn"][role]
        assert st.observer == st.requested == "minmax"
    assert set(calib.info["auto"]["roles"]) == {"weight", "input"}


class _Pair(nn.Module):
    """Two Linear layers reading one input: a fusion group, ``a`` its lead."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
        with torch.no_grad():  # a ignores channel 0 (where the outlier is), b reads it alone
            self.a.weight.fill_(1.0)
            self.a.weight[:, 0] = 0.0
            self.b.weight.fill_(0.01)
            self.b.weight[:, 0] = 100.0

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_output_metric_prices_a_fused_input_under_each_members_weight():
    torch.manual_seed(0)
    model = nn.Sequential(_Pair()).eval()
    x = torch.randn(2000, 8)
    x[:, 0] = 0.0
    x[0, 0] = 1000.0  # an outlier percentile clips: good for a's output, ruinous for b's
    recipe = Recipe(Rule(("Linear",), input=Role(QuantSpec("int8", Tensor()), "auto")))
    calib = _calibrate(model, [x], recipe, auto=Auto(candidates=("minmax", "percentile"),
                                                     metric="output"))
    assert calib.info["fusion_groups"], "the pair is one fusion group"
    errors = {}
    for n in ("minmax", "percentile"):
        st = _calibrate(model, [x], recipe, observer=n).states["0.a"]["input"]
        d = qdq_tensor(x, st).float() - x
        errors[n] = {m: float((d @ getattr(model[0], m).weight.T).square().sum())
                     for m in "ab"}
    own = min(errors, key=lambda n: errors[n]["a"] + errors[n]["b"])
    assert own != min(errors, key=lambda n: errors[n]["a"])  # the lead's weight alone differs
    assert calib.states["0.a"]["input"].observer == calib.states["0.b"]["input"].observer == own


def _block_out(model, block, batches, states):
    got = []
    hook = dict(model.named_modules())[block].register_forward_hook(
        lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    try:
        with apply(model, states) if states else contextlib.nullcontext(), \
                torch.inference_mode():
            for b in batches:
                model(**b)
    finally:
        hook.remove()
    return got


def _masked_cos(q, ref, mask):
    m = mask.double().unsqueeze(-1)
    q, ref = ((t.double() * m).sum(1) / m.sum(1).clamp(min=1) for t in (q, ref))
    cos = (nn.functional.normalize(q, dim=-1) * nn.functional.normalize(ref, dim=-1)).sum(-1)
    return float((1 - cos).clamp(min=0).mean())


def test_sequential_scoring_leaves_padded_positions_out():
    model, _ = llama()
    batches = padded_batches()  # most positions padding
    calib = _calibrate(model, batches, "w8a8", observer="auto", sequential=True, auto=TWO)
    singles = calibrate_many(model, batches, {n: preset("w8a8", n) for n in TWO.candidates},
                             **KW)
    plan = score_plan(batches, 1024)
    block = "model.layers.0"
    info = calib.info["auto"]["blocks"][block]
    ref = _block_out(model, block, batches, None)
    for n, c in singles.items():
        out = _block_out(model, block, batches, {k: s for k, s in c.states.items()
                                                 if k.startswith(block + ".")})
        per = [_masked_cos(out[i][a:b], ref[i][a:b], batches[i]["attention_mask"][a:b])
               for i, a, b in plan][:info["pieces_scored"][n]]
        assert info["scores"][n] == pytest.approx(sum(per) / len(per), rel=1e-4), n


def test_imatrix_weights_are_tried_only_where_this_recipes_weights_are_auto(monkeypatch):
    """The input importance is gathered once for every auto recipe of a run: a recipe whose
    weights are named got an imatrix weight trial over them where another recipe's were
    auto, and kept it when it won (observer 'imatrix', requested 'memoryless_mse')."""
    from quantscope.calibration.choice import auto as auto_mod

    real = auto_mod.choose_roles

    def spy(div, configs, best, best_pieces, alive):
        if auto_mod.IMATRIX in configs:  # make the weighted search win where it is tried
            pick, trials = real(div, configs, best, best_pieces, alive)
            return {**pick, "weight": auto_mod.IMATRIX}, trials
        return real(div, configs, best, best_pieces, alive)

    monkeypatch.setattr(auto_mod, "choose_roles", spy)
    model, batches = llama()
    hand = Recipe(Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "memoryless_mse"),
                       input=Role(QuantSpec("int8", Tensor()), "auto")), name="hand")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = calibrate_many(model, batches, {"hand": hand, "auto": preset("w8a8", "auto")},
                             auto=Auto(candidates=("minmax", "mse")), progress=False)
    weights = {(rs["weight"].observer, rs["weight"].requested)
               for rs in out["hand"].states.values() if "weight" in rs}
    assert weights == {("memoryless_mse", "memoryless_mse")}
    assert {rs["weight"].observer for rs in out["auto"].states.values()} == {"imatrix"}


def test_a_mask_of_another_length_than_the_output_pools_every_position():
    """A block's output may be longer than the user's mask (a prefix, memory tokens): its
    positions are pooled unmasked, as the logits' path does, not a shape error."""
    from quantscope.calibration.choice.references import summary as _summary

    hidden = torch.randn(2, 5, 4)
    kind, rows = _summary(hidden, torch.ones(2, 3, dtype=torch.long))
    assert kind == "cos"
    torch.testing.assert_close(rows, nn.functional.normalize(hidden.double().mean(1), dim=-1))
