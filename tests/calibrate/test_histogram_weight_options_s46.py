"""A recipe built from a histogram observer gives its weights ``memoryless_minmax``
(docs/guide/calibrating.md), which took none of the options given with it: a weight holding
NaN under ``preset("w8a8", "percentile", non_finite="ignore")`` raised where the user said
ignore. The stand-in takes the options it shares with the named observer (``non_finite``),
not the histogram's own (``bins``, ``percentile``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, preset
from quantscope.calibration.role_observers import observed
from quantscope.observers import registry
from quantscope.observers.base import Observer

HISTOGRAMS = ("percentile", "entropy", "mix", "histogram", "histogram_mse")


def _nan_weight_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    with torch.no_grad():
        model[0].weight[3, 5] = float("nan")
    return model


def _weights(recipe):
    model = _nan_weight_model()
    batches = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN read as zero is warned about
        calib = quantscope.calibrate(model, batches, recipe, progress=False)
    return {name: s["weight"] for name, s in calib.states.items()}


@pytest.mark.parametrize("observer", HISTOGRAMS)
def test_a_nan_weight_is_ignored_as_under_minmax(observer):
    got = _weights(preset("w8a8", observer, non_finite="ignore"))
    want = _weights(preset("w8a8", "minmax", non_finite="ignore"))
    assert sorted(got) == sorted(want) == ["0", "2"]
    for name, w in got.items():
        assert w.observer == "memoryless_minmax"
        assert dict(w.options) == {"non_finite": "ignore"}
        assert torch.isfinite(w.qparams.scale).all()
        for field in ("scale", "zero_point"):
            assert torch.equal(getattr(w.qparams, field), getattr(want[name].qparams, field))
        assert torch.equal(w.lo, want[name].lo) and torch.equal(w.hi, want[name].hi)


def test_without_the_option_a_nan_weight_still_raises():
    with pytest.raises(ValueError, match="NaN or inf"):
        _weights(preset("w8a8", "percentile"))


def test_the_histograms_own_options_stay_with_the_activations():
    rule = preset("w8a8", "percentile", non_finite="ignore", bins=256,
                  percentile=99.9).rules[0]
    assert rule.weight.observer == "memoryless_minmax"
    assert dict(rule.weight.options) == {"non_finite": "ignore"}
    assert dict(rule.input.options) == {"non_finite": "ignore", "bins": 256, "percentile": 99.9}
    _weights(preset("w8a8", "percentile", non_finite="ignore", bins=256, percentile=99.9))


def test_a_recipe_and_a_weight_only_preset_pass_it_too():
    spec = QuantSpec("int8", "channel")
    mine = Recipe((Rule(("Linear",), weight=Role(spec, "minmax"),
                        input=Role(QuantSpec("int8"), "minmax")),), name="mine")
    rule = mine.with_observer("entropy", non_finite="ignore").rules[0]
    assert dict(rule.weight.options) == {"non_finite": "ignore"}
    # weight-only: its one role takes the option now (before: "it would be dropped")
    weight = preset("w4a16", "percentile", non_finite="ignore").rules[0].weight
    assert weight.observer == "memoryless_minmax" and dict(weight.options) == {
        "non_finite": "ignore"}
    with pytest.raises(ValueError, match="option 'bins' is not one any observer"):
        preset("w4a16", "percentile", bins=256)


class _Hist(Observer):
    """A histogram observer declaring an ``extra`` of its own."""

    family = "histogram"

    def __init__(self, spec=None, *, extra=0, non_finite="error"):
        pass


class _MinMax(Observer):
    """A stand-in declaring an ``extra`` too, with another meaning."""

    memoryless = True

    def __init__(self, spec=None, *, extra=0, non_finite="error"):
        pass


def test_a_name_both_declare_apart_is_not_passed(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "s46hist", _Hist)
    monkeypatch.setitem(registry._DISPLAY, "s46hist", "s46hist")  # a miss lists the names
    monkeypatch.setitem(registry._REGISTRY, "memoryless_minmax", _MinMax)
    role = Role(QuantSpec("int8", "channel"), "minmax")
    got = observed(role, "weight", "s46hist", {"extra": 1, "non_finite": "ignore"})
    assert got.observer == "memoryless_minmax"
    assert dict(got.options) == {"non_finite": "ignore"}
