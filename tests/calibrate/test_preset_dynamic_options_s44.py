"""A preset's (or scheme's) ``non_finite`` option reaches its run-time input role
(``dynamic=True``), whose run-time observer takes it: ``preset("w8a8-dynamic", "minmax",
non_finite="ignore")`` gave it to the weights only, and a NaN batch then raised an error
telling the user to give the role ``options={'non_finite': 'ignore'}``, what they had passed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from quantscope.calibration import Role, apply, calibrate, preset
from quantscope.calibration.recipe import Recipe
from quantscope.calibration.role_observers import observed
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).eval()


def _batches():
    g = torch.Generator().manual_seed(1)
    bs = [torch.randn(8, 32, generator=g) for _ in range(3)]
    bs[1][0, 3] = float("nan")
    return bs


@pytest.mark.parametrize("observer", ["minmax", "auto", "mse"])
def test_the_dynamic_input_role_takes_the_non_finite_option(observer):
    r = preset("w8a8-dynamic", observer, non_finite="ignore")
    rule = r.rules[0]
    assert rule.input.dynamic is True and rule.input.observer == "memoryless_minmax"
    assert dict(rule.input.options) == {"non_finite": "ignore"}
    assert dict(rule.weight.options)["non_finite"] == "ignore"


@pytest.mark.parametrize("observer", ["mse", "percentile"])
def test_a_local_role_takes_the_observer_given_as_a_static_one(observer):
    """NVFP4's input (``dynamic="local"``: its global scale calibrated from the amax seen)
    is calibrated, not a run-time role: it runs the observer the preset is given (and its
    options), where a run-time role (``dynamic=True``) keeps its own."""
    for r in (preset("nvfp4", observer, non_finite="ignore"),
              preset("nvfp4").with_observer(observer, non_finite="ignore")):
        inp = r.rules[0].input
        assert inp.dynamic == "local" and inp.observer == observer
        assert dict(inp.options) == {"non_finite": "ignore"}


def test_an_option_the_run_time_observer_does_not_take_stays_off_it():
    rule = preset("w8a8-dynamic", "mse", maxshrink=0.5).rules[0]
    assert dict(rule.input.options) == {} and dict(rule.weight.options) == {"maxshrink": 0.5}
    rule = Recipe(preset("w8a8-dynamic").rules).with_observer("mse", non_finite="ignore",
                                                              maxshrink=0.5).rules[0]
    assert dict(rule.input.options) == {"non_finite": "ignore"}


def _saying_error(role: Role) -> Role:
    return replace(role, options={"non_finite": "error"})


def test_given_options_override_a_run_time_roles_own_as_a_calibrated_roles():
    """The options given with an observer are the run's: they replace a run-time role's own
    (non_finite "error" given "ignore"), as they do a calibrated role's; none given keeps
    its own."""
    runtime = _saying_error(preset("w8a8-dynamic").rules[0].input)
    static = _saying_error(Role(runtime.spec, "minmax"))
    for role in (runtime, static):
        got = observed(role, "input", "minmax", {"non_finite": "ignore"})
        assert dict(got.options) == {"non_finite": "ignore"}, role
    assert observed(runtime, "input", "minmax", {}).options == runtime.options


def test_with_observer_gives_every_role_the_non_finite_option():
    """``with_observer(non_finite="ignore")`` on a recipe whose roles say "error": every role
    ignores NaN / inf, the run-time input too (which keeps its run-time observer)."""
    rule = preset("w8a8-dynamic").rules[0]
    recipe = Recipe((replace(rule, weight=_saying_error(rule.weight),
                             input=_saying_error(rule.input)),), name="r")
    got = recipe.with_observer("minmax", non_finite="ignore").rules[0]
    assert dict(got.weight.options) == dict(got.input.options) == {"non_finite": "ignore"}
    assert got.input.dynamic is True and got.input.observer == "memoryless_minmax"


@pytest.mark.parametrize("observer", ["minmax", "auto"])
def test_a_nan_batch_calibrates_as_the_hand_built_role_does(observer):
    model, bs = _mlp(), _batches()
    got = calibrate(model, bs, preset("w8a8-dynamic", observer, non_finite="ignore"),
                    progress=False)
    base = preset("w8a8-dynamic", "minmax", non_finite="ignore")
    rule = base.rules[0]
    hand = replace(rule, input=replace(preset("w8a8-dynamic").rules[0].input,
                                       options=(("non_finite", "ignore"),)))
    want = calibrate(model, bs, replace(base, rules=(hand,)), progress=False)
    st = got.states["0"]["input"]
    assert st.dynamic is True and dict(st.options) == {"non_finite": "ignore"}
    assert st.options == want.states["0"]["input"].options
    # at run time the per-token scale reads the NaN as 0: each token's int8 range, by hand
    x = bs[1]
    with apply(model, {"0": {"input": st}}):
        seen = []
        h = model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        model(x)
        h.remove()
    z = x.nan_to_num(0.0)
    qp = qparams_from_range(z.min(-1, keepdim=True).values, z.max(-1, keepdim=True).values,
                            st.spec)
    ref = fake_quantize(x, qp, st.spec)
    assert torch.equal(seen[0].isnan(), ref.isnan()) and torch.equal(
        seen[0].nan_to_num(7.0), ref.nan_to_num(7.0))


def test_a_scheme_gives_its_dynamic_role_the_option_too():
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    rule = scheme("FP8_DYNAMIC", "minmax", non_finite="ignore").rules[0]
    assert rule.input.dynamic is True and dict(rule.input.options) == {"non_finite": "ignore"}
