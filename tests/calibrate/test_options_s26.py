"""Probe s26 fixes of the calibration options: an ``auto`` role's observer options under a
per-layer ``Auto.metric`` go to each candidate that takes them; option objects whose set
fields would change nothing are refused; ``Recipe.from_dict`` names the rule and role of a
bad field value, as it names a bad key."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Auto, Outliers, Recipe, calibrate_many, preset
from quantscope.calibration.run.observe import make_plan

PER_LAYER = ("tensor", "joint", "output")


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    return model, [torch.randn(8, 32) for _ in range(3)]


@pytest.mark.parametrize("metric", PER_LAYER)
def test_per_layer_auto_gives_each_candidate_the_options_it_takes(metric):
    # probing: averaging_constant went to every candidate, the memoryless weight ones failed
    # on it and calibrate raised "no candidate observer could take ..." (metric="model" ran)
    model, batches = _mlp()
    calib = quantscope.calibrate(model, batches, preset("w8a8", "auto", averaging_constant=0.1),
                                 auto=Auto(metric=metric), progress=False)
    assert set(calib.states) == {"0", "2"}


def test_a_candidate_that_does_not_take_an_option_still_competes():
    # probing: with maxshrink (mse's), minmax got it too, failed and silently left the race
    model, _ = _mlp()
    recipe = preset("w8a8", "auto", maxshrink=0.1)
    slots, _ = make_plan(model, {"r": recipe}, ("minmax", "mse"))
    for role in ("weight", "input"):
        slot = slots[("0", role)]
        assert slot.failed == {}
        options = {key[0]: dict(key[2]) for key in slot.observers}
        prefix = "memoryless_" if role == "weight" else ""
        assert options == {f"{prefix}minmax": {}, f"{prefix}mse": {"maxshrink": 0.1}}


@pytest.mark.parametrize("metric", PER_LAYER)
def test_per_layer_auto_refuses_an_option_no_candidate_takes(metric):
    # probing: every candidate failed on it and the error dumped QuantSpec tuples, naming no
    # option (metric="model" names it)
    model, batches = _mlp()
    with pytest.raises(ValueError, match=r"'auto' option\(s\) \['bogus'\] taken by none"):
        quantscope.calibrate(model, batches, preset("w8a8", "auto", bogus=1),
                             auto=Auto(metric=metric), progress=False)
    with pytest.raises(ValueError, match=r"\['maxshrink'\] taken by none of its "
                                         r"candidate observers \['percentile'\]"):
        quantscope.calibrate(model, batches, preset("w8a8", "auto", maxshrink=0.1),
                             auto=Auto(candidates=("percentile",), metric=metric),
                             progress=False)


@pytest.mark.parametrize(("auto", "field"), [
    (Auto(candidates=("mse",), metric="tensor"), "candidates"),
    (Auto(metric="joint"), "metric"),
    (Auto(score_tokens=16), "score_tokens"),
    (Auto(loss=lambda out, ref, batch: 0.0), "loss"),
])
def test_auto_options_without_an_auto_role_are_refused(auto, field):
    # probing: accepted and dropped without a word (the recipe runs minmax)
    model, batches = _mlp()
    said = rf"Auto\.{field} .*no recipe here has an 'auto' role; it would be ignored"
    with pytest.raises(ValueError, match=said):
        quantscope.calibrate(model, batches, "w8a8", auto=auto, progress=False)
    with pytest.raises(ValueError, match=said):
        calibrate_many(model, batches, ["w8a8", "w4a8"], auto=auto, progress=False)


def test_auto_options_taken_where_a_recipe_has_auto_and_defaults_anywhere():
    model, batches = _mlp()
    out = calibrate_many(model, batches, {"plain": "w8a8", "auto": preset("w8a8", "auto")},
                         auto=Auto(candidates=("minmax", "mse"), metric="tensor"),
                         progress=False)
    assert set(out) == {"plain", "auto"}
    for auto in (Auto(), Auto(metric="model", score_tokens=1024)):  # defaults: not set
        quantscope.calibrate(model, batches, "w8a8", auto=auto, progress=False)


def test_outliers_fallback_without_keep_float_is_refused():
    # probing: Outliers(fallback="float") with keep_float=0 was accepted and did nothing
    with pytest.raises(ValueError, match=r"Outliers\.fallback \('float'\) .*keep_float=0 "
                                         r"keeps none, so it would be ignored"):
        Outliers(fallback="float")
    assert Outliers(keep_float=1, fallback="float").fallback == "float"
    assert Outliers(fallback="dynamic") == Outliers()
    model, batches = _mlp()
    with pytest.raises(ValueError, match=r"Outliers\.fallback"), \
            pytest.warns(DeprecationWarning):
        quantscope.calibrate(model, batches, "w8a8", fallback="float", progress=False)


def _two_rules():
    d = preset("w8a8").to_dict()
    d["rules"].insert(0, copy.deepcopy(d["rules"][0]))
    d["rules"][0]["targets"] = ["lm_head"]
    return d


@pytest.mark.parametrize(("edit", "where", "said"), [
    (lambda r: r["input"].update(observer=3), "Recipe.rules[1].input", "Role.observer"),
    (lambda r: r["input"].update(dynamic="yes"), "Recipe.rules[1].input", "Role.dynamic"),
    (lambda r: r["input"].update(options=[1, 2]), "Recipe.rules[1].input", "Role.options"),
    (lambda r: r.update(targets=5), "Recipe.rules[1]", "Rule.targets"),
])
def test_recipe_from_dict_names_where_a_bad_value_is(edit, where, said):
    # probing: the key errors named the rule and role, a bad value's error did not
    d = _two_rules()
    edit(d["rules"][1])
    with pytest.raises(ValueError) as err:
        Recipe.from_dict(d)
    assert str(err.value).startswith(f"{where}: {said} ")
