"""An option a run-time role (``dynamic=True``) takes is an option the recipe uses: since
session 44 ``observed`` gives it to that role's run-time observer, but ``check_taken`` counted
only the calibrated roles, so ``preset("w8a8-dynamic", "percentile", non_finite="ignore")``
(percentile's weights then ran ``memoryless_minmax`` with none of percentile's options) was
refused with "it would be dropped". An option no role takes is still refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantscope.calibration import calibrate, preset
from quantscope.calibration.recipe import Recipe


@pytest.mark.parametrize("name", ["w8a8-dynamic", "fp8-dynamic", "mxfp4"])
def test_an_option_only_the_run_time_role_takes_is_kept(name):
    rule = preset(name, "percentile", non_finite="ignore").rules[0]
    assert rule.input.dynamic is True and rule.input.observer == "memoryless_minmax"
    assert dict(rule.input.options) == {"non_finite": "ignore"}
    # percentile's weights run min-max, which takes non_finite too (since session 46:
    # test_histogram_weight_options_s46.py)
    assert rule.weight.observer == "memoryless_minmax" and dict(rule.weight.options) == {
        "non_finite": "ignore"}


def test_with_observer_keeps_it_too():
    rule = Recipe(preset("w8a8-dynamic").rules).with_observer(
        "entropy", non_finite="ignore").rules[0]
    assert dict(rule.input.options) == {"non_finite": "ignore"}


@pytest.mark.parametrize("option", [{"bogus": 1}, {"percentile": 99.0}])
def test_an_option_no_role_takes_is_still_refused(option):
    # percentile: the calibrated roles (weights: min-max) and the run-time one take none
    with pytest.raises(ValueError, match=f"option '{next(iter(option))}' is not one any "
                                         r"observer .*run-time input observer "
                                         r"'memoryless_minmax'.*it would be dropped"):
        preset("w8a8-dynamic", "percentile", **option)


def test_a_scheme_keeps_it_too():
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    rule = scheme("FP8_DYNAMIC", "percentile", non_finite="ignore").rules[0]
    assert rule.input.dynamic is True and dict(rule.input.options) == {"non_finite": "ignore"}
    with pytest.raises(ValueError, match="option 'bogus' .*it would be dropped"):
        scheme("FP8_DYNAMIC", "percentile", bogus=1)


def test_it_calibrates_a_nan_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    batches = [torch.randn(4, 16) for _ in range(2)]
    batches[1][0, 2] = float("nan")
    got = calibrate(model, batches, preset("w8a8-dynamic", "percentile", non_finite="ignore"),
                    progress=False)
    st = got.states["0"]["input"]
    assert st.dynamic is True and dict(st.options) == {"non_finite": "ignore"}
