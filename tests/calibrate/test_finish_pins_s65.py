"""Pins of calibration's finishing step (``calibration.run.finish``: states, fusion groups'
shared scales, the ``missing`` record, report rows and histograms) and of its cross-process
gathers (``calibration.run.gather``: weight ownership, samples, failures and the ranks'
agreement checks) that no existing test held. From a mutation round (s65): every test fails
on a small defect the existing tests let through. No process is spawned: the ranks are the
threads of ``tests/distributed/test_sync_pins_s64.py``'s ``ranks`` harness.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_fusion import _Pair
from test_modules_s34 import A8, W8
from test_probe_fixes_s29_layers import _Attn
from torch import nn

import quantscope
from quantscope import fake_quantize, presets
from quantscope.calibration import Auto, Runtime
from quantscope.calibration.options import Options
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.results.result import RoleState
from quantscope.calibration.run import finish, gather
from quantscope.layout import Block
from quantscope.spec import QuantSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_sync_pins_s64 import _ok, ranks  # noqa: F401 -- ranks: the fixture


def _calibrate(model, batches, recipe, missing="skip"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = quantscope.calibrate(model, batches, recipe, progress=False,
                                   runtime=Runtime(missing=missing))
    return cal, [str(w.message) for w in caught]


# ------------------------------------------------------------------------------ finish
def test_a_constant_samples_histogram_spans_one_unit_from_its_value():
    got = finish._histogram(torch.full((5,), 2.0), "x")
    assert (got["lo"], got["hi"]) == (2.0, 3.0)
    assert len(got["counts"]) == 256 and got["counts"][0] == 5 and sum(got["counts"]) == 5


def test_activation_roles_have_histograms_the_weight_none():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    cal, _ = _calibrate(model, [torch.randn(3, 4)], Recipe((Rule(("Linear",), weight=W8,
                                                                 input=A8, output=A8),)))
    assert sorted(cal.histograms) == [("0", "input"), ("0", "output")]
    assert sum(cal.histograms[("0", "output")]["counts"]) == 12


def test_a_weight_row_spans_the_whole_weight_not_one_channel():
    """Per channel: the row's lo / hi are the least channel minimum and the largest maximum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    cal, _ = _calibrate(model, [torch.randn(3, 8)], Recipe((Rule(("Linear",), weight=W8),)))
    row = next(r for r in cal.stats if r["role"] == "weight")
    w = model[0].weight.detach()
    assert row["lo"] == pytest.approx(float(w.min())) and row["hi"] == pytest.approx(float(w.max()))


def test_a_dynamic_weight_with_one_inf_raises_naming_the_layer():
    """One inf (the minimum still finite) is enough: a run-time weight must be finite."""
    st = RoleState(QuantSpec("int8", "channel"), "minmax", "minmax", True, ())
    w = torch.randn(4, 4)
    w[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layer 'l' weight holds NaN or inf values \(dynamic"):
        finish._stats(("l", "weight"), w, st)


class _OneEmptyCall(nn.Module):
    """``side`` is called once per batch with 0 rows."""

    def __init__(self):
        super().__init__()
        self.side, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.head(x) + self.side(x[:0]).sum()


def test_one_call_with_zero_rows_is_a_call_not_never_called():
    with pytest.raises(ValueError, match=r"'side' input was called 1 times but saw no tokens"):
        _calibrate(_OneEmptyCall(), [torch.randn(2, 4)], "w8a8", missing="error")


class _NoneOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return None


class _CallsNoneOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.t, self.h = _NoneOut(), nn.Linear(4, 4)

    def forward(self, x):
        self.t(x)
        return self.h(x)


def test_an_output_of_none_is_named_none():
    recipe = Recipe((Rule(("_NoneOut",), weight=W8, output=A8),))
    with pytest.raises(ValueError, match=r"layer 't' output was called 1 times but returned "
                                         r"None; the output role needs a floating-point"):
        _calibrate(_CallsNoneOut(), [torch.randn(2, 4)], recipe, missing="error")


def test_a_float_fallback_leaves_no_report_row_of_the_layer():
    torch.manual_seed(0)
    cal, _ = _calibrate(_Attn().eval(), [torch.randn(2, 10, 64)], "w8a8", missing="float")
    assert {r["layer"] for r in cal.stats} == {"head"}


def test_a_dynamic_role_never_called_in_one_batch_is_missing():
    """One batch forwarded is a pass: a run-time role its forward never called is missing."""
    torch.manual_seed(0)
    cal, _ = _calibrate(_Attn().eval(), [torch.randn(2, 10, 64)], "w8a8-dynamic")
    assert cal.info["missing"] == [{"layer": "att.out_proj", "role": "input", "calls": 0,
                                    "fallback": "input not quantized"}]


def test_a_groups_shared_weight_scale_is_reported_with_its_observer():
    """A weight-only recipe: the group's weights share one fp8 scale, its input none."""
    torch.manual_seed(0)
    recipe = Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "minmax")),))
    cal, _ = _calibrate(nn.Sequential(_Pair()), [torch.randn(4, 8)], recipe)
    observer = cal.states["0.a"]["weight"].observer
    assert cal.info["fusion_groups"] == [{"layers": ["0.a", "0.b"], "input": "none",
                                          "weight": f"shared ({observer})"}]


def test_run_time_weights_of_a_group_keep_their_run_time_scales():
    """``dynamic=True``: nothing calibrated to share, each member's weight stays run-time."""
    torch.manual_seed(0)
    role = Role(presets.FP8_PER_TENSOR, "minmax", True)
    cal, _ = _calibrate(nn.Sequential(_Pair()), [torch.randn(4, 8)],
                        Recipe((Rule(("Linear",), weight=role),)))
    assert [cal.states[m]["weight"].dynamic for m in ("0.a", "0.b")] == [True, True]
    assert cal.info["fusion_groups"][0]["weight"] == "per layer"


class _Rows(nn.Module):
    """Two Linears reading one input: 8 and 16 rows, not whole 16-row blocks for ``a``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 8, bias=False)
        self.b = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.a(x).sum() + self.b(x).sum()


def test_a_local_weights_global_scale_is_shared_where_its_blocks_do_not_split():
    """``dynamic="local"``: only the global amax is shared (the block scales are the
    runtime's), so members whose rows do not split into the blocks still share it."""
    torch.manual_seed(0)
    spec = dataclasses.replace(presets.NVFP4, layout=Block(16, axis=0))
    model = nn.Sequential(_Rows())
    cal, _ = _calibrate(model, [torch.randn(4, 32)],
                        Recipe((Rule(("Linear",), weight=Role(spec, "minmax", "local")),)))
    assert cal.info["fusion_groups"][0]["weight"].startswith("shared (")
    amax = float(torch.cat([model[0].a.weight, model[0].b.weight]).detach().abs().max())
    for m in ("0.a", "0.b"):
        assert float(cal.states[m]["weight"].global_amax) == pytest.approx(amax)


def test_joined_weights_raise_a_lone_candidates_error_and_skip_one_of_several():
    """One candidate: its error is the group's; among several a failing one is passed over."""
    cfg, slot = Role(presets.FP8_PER_TENSOR, "minmax"), SimpleNamespace(observers={})
    with pytest.raises(ValueError, match="unknown observer 'no_such_observer'"):
        finish._joined_state(torch.ones(8, 8), cfg, ("no_such_observer",), slot)
    got = finish._joined_state(torch.ones(8, 8), cfg, ("no_such_observer", "minmax"), slot)
    assert got.observer == "minmax"


@pytest.mark.parametrize("names", [("minmax", "mse"), ("mse", "minmax")])
def test_joined_weights_keep_the_candidate_of_least_qdq_error(names):
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    w[0, 0] = 40.0  # an outlier: min-max's int8 scale is not the best one
    cfg, slot = Role(presets.INT8_PER_TENSOR, "auto"), SimpleNamespace(observers={})

    def error(st):
        return float((fake_quantize(w, st.qparams, st.spec) - w).square().sum())

    alone = {n: error(finish._joined_state(w, cfg, (n,), slot)) for n in names}
    assert len(set(alone.values())) == 2
    assert finish._joined_state(w, cfg, names, slot).observer == min(alone, key=alone.get)


def _one_linear(metric):
    """``_States`` of one non-square Linear ``l`` (4 x 8) with an input sample, its weight
    state (int8 per channel, min-max) and its plan (weight and input)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 4, bias=False), torch.randn(6, 8)
    cfg = Role(presets.INT8_PER_CHANNEL, "minmax")
    state = finish._joined_state(lin.weight.detach(), cfg, ("minmax",),
                                 SimpleNamespace(observers={}))
    built = finish._States({}, metric, None)
    slot = SimpleNamespace(module_of=lambda name: lin)
    built.slots = {("l", "weight"): slot, ("l", "input"): slot}
    built.data = {("l", "input"): x}
    plan = {("l", "weight"): (cfg, ("minmax",)), ("l", "input"): (cfg, ("minmax",))}
    return built, lin.weight.detach(), x, state, plan


def test_auto_output_errors_are_the_errors_in_x_w_transposed():
    """Metric "output": the weight's ``sum((X (W_q - W)^T)^2)``, the input's
    ``sum(((X_q - X) W^T)^2)``, not the tensor errors the stats hold."""
    built, w, x, state, plan = _one_linear("output")
    got = built.auto_error(plan, "l", "weight", ("l", "weight", "k", False), state,
                           {"noise": -1.0})
    want = float((x @ (fake_quantize(w, state.qparams, state.spec) - w).T).square().sum())
    assert got == pytest.approx(want, rel=1e-5)
    a8 = Role(presets.INT8_PER_TENSOR, "minmax")
    state = finish._joined_state(x, a8, ("minmax",), SimpleNamespace(observers={}))
    got = built.auto_error(plan, "l", "input", ("l", "input", "k", False), state,
                           {"noise": -1.0})
    want = float(((fake_quantize(x, state.qparams, state.spec) - x) @ w.T).square().sum())
    assert got == pytest.approx(want, rel=1e-5)


def test_a_weight_only_plan_scores_by_the_tensor_error_after_an_output_one():
    """The errors of one weight state are cached apart: a weight-only plan's is the tensor
    error even where a plan with the input scored the same state on the output first."""
    built, _, _, state, plan = _one_linear("output")
    skey = ("l", "weight", "k", False)
    assert built.auto_error(plan, "l", "weight", skey, state, {"noise": -1.0}) > 0
    alone = {("l", "weight"): plan[("l", "weight")]}
    assert built.auto_error(alone, "l", "weight", skey, state, {"noise": -1.0}) == -1.0


# ------------------------------------------------------------------------------ gather
def test_weight_owners_of_no_named_layer_is_empty():
    """``names`` given (even empty) keeps only those layers: none here."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert gather.weight_owners(model, []) == {}


def test_gathered_samples_keep_the_rows_shape_past_the_first_dim(ranks):  # noqa: F811
    w = ranks(2)
    rows = [torch.arange(12.0).reshape(2, 2, 3), torch.arange(12.0, 24.0).reshape(2, 2, 3)]
    for got in _ok(w.run(lambda r: gather.gather_samples({"k": [rows[r]]}, 8)["k"])):
        assert torch.equal(got[0], torch.cat(rows))


def test_gathered_samples_come_back_in_the_callers_key_order(ranks):  # noqa: F811
    w = ranks(2)
    x = torch.ones(1, 2)
    for got in _ok(w.run(lambda r: gather.gather_samples({"b": [x], "a": [x]}, 8))):
        assert list(got) == ["b", "a"]


def test_gathered_samples_of_other_keys_raise_on_every_rank(ranks):  # noqa: F811
    """As many keys on each rank is not enough: their names must match too."""
    w = ranks(2)
    x = torch.ones(1, 2)
    for e in w.run(lambda r: gather.gather_samples({"ab"[r]: [x]}, 8)):
        assert isinstance(e, ValueError) and "different keys" in str(e), e


def test_the_same_slots_in_another_order_pass(ranks):  # noqa: F811
    w = ranks(2)
    keys = [[("a", "input"), ("b", "weight")], [("b", "weight"), ("a", "input")]]
    assert _ok(w.run(lambda r: gather.check_same_slots(keys[r]))) == [None, None]


def test_different_slots_name_the_first_differing_key(ranks):  # noqa: F811
    w = ranks(2)
    keys = [[("a", "input"), ("b", "input")], [("a", "input"), ("c", "input")]]
    for e in w.run(lambda r: gather.check_same_slots(keys[r])):
        assert isinstance(e, ValueError), e
        assert "layer 'b' input is planned on rank(s) [0] only" in str(e), e


def test_different_weights_name_the_first_differing_layer_and_the_dtypes(ranks):  # noqa: F811
    w = ranks(2)
    dtypes = [torch.float32, torch.float64]

    def check(r):
        gather.check_same_weights({n: torch.full((3,), float(r), dtype=dtypes[r])
                                   for n in ("b", "a")})

    for e in w.run(check):
        assert isinstance(e, ValueError), e
        assert "layer 'a' is float32:" in str(e) and "but float64:" in str(e), e


def test_options_compare_a_loss_by_whether_it_is_given(ranks):  # noqa: F811
    """Each rank's own loss function (a closure: its repr differs) is the same option."""
    w = ranks(2)
    losses = [lambda out, batch: out.sum(), lambda out, batch: out.mean()]
    assert _ok(w.run(lambda r: gather.check_same_options(Options(auto=Auto(loss=losses[r]))))) \
        == [None, None]
    w = ranks(2)
    given = [None, losses[0]]
    for e in w.run(lambda r: gather.check_same_options(Options(auto=Auto(loss=given[r])))):
        assert isinstance(e, ValueError), e
        assert "Auto.loss is False on rank 0, True on rank 1" in str(e), e
