"""Gradients through an applied model: the activations' QDQ passes the straight-through
gradient (probing found it built from ``x.detach()``: the input and every layer before a
quantized activation got no gradient, with no error)."""

import pytest
import torch
from torch import nn

from quantscope import fake_quantize
from quantscope.calibration import calibrate
from quantscope.observers.runtime import runtime_qparams


def _ste(t, state):
    return fake_quantize(t, runtime_qparams(t, state), state.spec, ste=True)


@pytest.mark.parametrize("preset", ["w8a8", "w8a8-dynamic"])
def test_gradients_pass_an_applied_activation_straight_through(preset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    batches = [torch.randn(4, 16) for _ in range(2)]
    calib = calibrate(model, batches, preset, progress=False)
    x = (batches[0] * 3).requires_grad_(True)  # past the static range: some values clipped
    with calib.apply(model):
        with torch.no_grad():
            plain = model(x)
        y = model(x)
        y.sum().backward()
        w0, b0, w2 = (p.detach().clone() for p in (model[0].weight, model[0].bias, model[2].weight))
    assert torch.equal(y.detach(), plain)  # the same forward as without autograd
    assert model[0].weight.grad is not None
    # the reference: each input QDQ by fake_quantize(ste=True), the quantized weights fixed
    s0, s2 = (calib.states[k]["input"] for k in ("0", "2"))
    xr = x.detach().requires_grad_(True)
    (_ste((_ste(xr, s0) @ w0.t() + b0).relu(), s2) @ w2.t()).sum().backward()
    assert torch.equal(x.grad, xr.grad) and xr.grad.abs().sum() > 0
