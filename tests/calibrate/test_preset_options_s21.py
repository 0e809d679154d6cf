"""An observer option no calibrated role takes is a ValueError naming it when the preset is
built (docs/guide/calibrating.md), on presets with calibrated inputs too: w8a8 / w4a8 / fp8
kept a typo on their inputs, failing only at calibrate in Observer.__init__. Options the
roles' observers take still pass on every preset; auto keeps its check at calibrate. And
Outliers.smooth's error names the field as the other option objects' do."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Outliers
from quantscope.calibration.recipe import RECIPES, preset
from quantscope.observers import registry
from quantscope.observers.registry import observer_class

OBSERVERS = (None, "minmax", "static_minmax", "mse", "memoryless_mse", "percentile", "entropy")
#: a value of each option the test gives (build only checks names; these also calibrate)
VALUES = {"averaging_constant": 0.1, "maxshrink": 0.5, "grid": 20, "percentile": 99.9,
          "non_finite": "ignore", "bins": 256, "skip_zeros": True}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)).eval()


def _takes(name: str) -> set[str]:
    """The keyword-only arguments of observer ``name``'s class: the options it documents."""
    return {p.name for c in observer_class(name).__mro__ if "__init__" in c.__dict__
            for p in inspect.signature(c.__init__).parameters.values()
            if p.kind == p.KEYWORD_ONLY}


@pytest.mark.parametrize("name", ["w8a8", "w4a8", "fp8", "fp8-kv", "w4a16", "nvfp4"])
@pytest.mark.parametrize("observer", [None, "minmax", "mse", "percentile"])
def test_a_typo_raises_when_the_preset_is_built(name, observer):
    args = (name,) if observer is None else (name, observer)
    with pytest.raises(ValueError, match=r"option 'maxshrnk' is not one .*observer"):
        preset(*args, maxshrnk=0.5)


@pytest.mark.parametrize("name", ["w8a8", "w4a8", "fp8"])
def test_the_input_role_no_longer_keeps_a_typo_for_calibrate(name):
    with pytest.raises(ValueError, match=rf"recipe '{name}': option 'maxshrnk' is not one any "
                                         r"observer.*input observer 'minmax'.*weight observer "
                                         r"'memoryless_minmax'"):
        preset(name, maxshrnk=0.5)


def test_nvfp4_names_its_own_input_observer():
    # its inputs run static_minmax, not the minmax with_observer is given
    for option in ("maxshrnk", "averaging_constant"):
        with pytest.raises(ValueError, match=f"preset 'nvfp4': option '{option}' is not one the "
                                             f"input observer 'static_minmax'"):
            preset("nvfp4", **{option: 0.1})


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("observer", OBSERVERS)
def test_every_option_a_calibrated_role_takes_still_passes(name, observer):
    args = (name,) if observer is None else (name, observer)
    base = preset(*args)
    roles = {k: r for k, r in base.rules[0].roles().items() if r.needs_data}
    # the calibrated input keeps every option (weights: those their variant takes), so its
    # observer's options are the preset's; weight-only presets: the weight observer's, where
    # it is the given one's variant (a histogram's weights run min-max and take only
    # non_finite: test_histogram_weight_options_s46.py)
    ran = observer or "minmax"
    kind = "input" if "input" in roles else "weight"
    own = kind == "input" or roles[kind].observer in (ran, f"memoryless_{ran}")
    options = _takes(roles[kind].observer) if own else set()
    if base.kv_cache is not None:  # fp8-kv: its KV cache keeps them too
        options &= _takes(base.kv_cache.observer)
    assert "non_finite" in options or not own, (name, observer)
    for option in sorted(options):
        recipe = preset(*args, **{option: VALUES.get(option, 1)})
        rule = recipe.rules[0]
        value = dict(getattr(rule, kind).options)[option]
        assert value == VALUES.get(option, 1), (name, option)
        assert rule.weight.observer == roles["weight"].observer
        if rule.weight.observer in (ran, f"memoryless_{ran}") and option in _takes(ran):
            assert option in dict(rule.weight.options) or option not in _takes(
                rule.weight.observer), (name, option)


@pytest.mark.parametrize(("args", "options"), [
    (("w8a8",), {"averaging_constant": 0.1}),                   # an EMA input observer's
    (("w4a8", "mse"), {"maxshrink": 0.5, "grid": 20}),        # mse weights' and inputs'
    (("fp8", "percentile"), {"percentile": 99.9}),
    (("w4a16", "mse"), {"maxshrink": 0.5}),
    (("nvfp4",), {"non_finite": "ignore"}),
])
def test_documented_options_calibrate(args, options):
    m = _model()
    calib = quantscope.calibrate(m, [torch.randn(4, 128) for _ in range(2)],
                                 preset(*args, **options), progress=False)
    assert sorted(calib.states) == ["0", "2"]


def test_auto_still_checks_options_at_calibrate():
    recipe = preset("w8a8", "auto", maxshrnk=0.5)  # not at build: its candidates decide
    assert dict(recipe.rules[0].input.options) == {"maxshrnk": 0.5}
    with pytest.raises(ValueError, match=r"calibrate: .*'maxshrnk'.*taken by none of its "
                                         r"candidate"):
        quantscope.calibrate(_model(), [torch.randn(4, 128)], recipe, progress=False)


class _Wide:
    """An observer whose memoryless variant takes an option it does not."""

    def __init__(self, spec=None, *, non_finite="raise"):
        pass


class _WideMemoryless(_Wide):
    memoryless = True

    def __init__(self, spec=None, *, extra=0, non_finite="raise"):
        pass


def test_a_role_keeping_an_option_its_observer_does_not_take_raises(monkeypatch):
    # the weight (memoryless_s21wide) takes "extra", the input (s21wide) keeps it and would fail
    monkeypatch.setitem(registry._REGISTRY, "s21wide", _Wide)
    monkeypatch.setitem(registry._REGISTRY, "memoryless_s21wide", _WideMemoryless)
    with pytest.raises(ValueError, match="recipe 'w8a8': option 'extra' is not one the input "
                                         "observer 's21wide' takes"):
        preset("w8a8", "s21wide", extra=1)
    assert dict(preset("w4a16", "s21wide", extra=1).rules[0].weight.options) == {"extra": 1}


@pytest.mark.parametrize("value", [2.0, -0.1, True, "0.5"])
def test_outliers_smooth_error_names_the_field(value):
    with pytest.raises(ValueError, match=r"^calibrate: Outliers\.smooth: alpha must be a number "
                                         r"in \[0, 1\]"):
        Outliers(smooth=value)
    assert Outliers(smooth=0.5).smooth == 0.5
