"""A weight the module computes at each forward (torch's weight_norm, as a parametrization or
its older hook; Wav2Vec2 / HuBERT's ``pos_conv_embed``) is no tensor ``apply`` can
fake-quantize: a copy into it is recomputed away, and the layer ran in float without a word
(``calibrate`` already refuses it: no weight parameter). ``apply`` now refuses it by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import quantscope


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 4, 3, padding=1))


def _calibration():
    """Calibrated on the weight_norm folded into a plain weight: the same names and shapes."""
    plain = _model()
    weight_norm(plain[0], dim=2)
    parametrize.remove_parametrizations(plain[0], "weight")
    recipe = quantscope.calibrate.preset("w8a8", "minmax", targets=["Conv1d"])
    return quantscope.calibrate(plain, [torch.randn(2, 8, 20)], recipe, progress=False)


def _parametrized():
    model = _model()
    weight_norm(model[0], dim=2)
    return model


def _legacy_hook():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        torch.nn.utils.weight_norm(model[0], dim=2)
    return model


@pytest.mark.parametrize("make", [_parametrized, _legacy_hook])
def test_apply_refuses_a_computed_weight(make):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"apply: 0\.weight \(\w*Conv1d\) is computed at each "
                                         r"forward \(a parametrization such as weight_norm"):
        _calibration().apply(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model[0])
