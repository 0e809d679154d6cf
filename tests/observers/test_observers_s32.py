"""Probe s32 (observer x layout x format matrix): ``placeholder``'s qparams are scale 1,
zero point 0 from ``range_and_qparams`` too, the call model calibration makes (it gave the
eps scale of a zero range: a calibrated model quantized to about 0)."""

import torch

import quantscope
from quantscope import QuantSpec, get_observer, presets
from quantscope.layout import Channel, Tensor


def test_placeholder_range_and_qparams_are_its_qparams():
    for spec in (QuantSpec("int8", Tensor()), QuantSpec("int8", Channel(0)), presets.NVFP4):
        obs = get_observer("placeholder", spec)
        obs(torch.randn(4, 32))
        lo, hi, qp = obs.range_and_qparams()
        ref = obs.calculate_qparams()
        assert torch.equal(qp.scale, ref.scale) and bool((qp.scale == 1).all())
        assert torch.equal(qp.zero_point, ref.zero_point)
        assert bool((lo == 0).all()) and bool((hi == 0).all())


def test_calibrate_with_placeholder_keeps_scale_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    calib = quantscope.calibrate(model, [torch.randn(4, 16)], "w8a8", observer="placeholder",
                                 progress=False)
    for role in ("weight", "input"):
        assert bool((calib.states["0"][role].qparams.scale == 1).all()), role
