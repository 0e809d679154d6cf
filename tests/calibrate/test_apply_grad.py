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


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_mixtral_experts_3d_get_their_gradient_while_applied():
    """MoE experts held as 3-D parameters run per-expert Linear views while applied; their
    forward reads the 3-D parameters' slices through autograd (probing found the views frozen:
    ``.grad`` stayed None). Weight-only QDQ: the gradient equals the plain model's over the
    same quantized weights (to float sum order: transformers batches its experts otherwise)."""
    pytest.importorskip("transformers")
    from tiny_models import STARVED, mixtral

    model, batches = mixtral()
    calib = calibrate(model, batches, "w4a16", progress=False)
    with calib.apply(model):
        qweights = {k: v.clone() for k, v in model.state_dict().items()}
        _loss(model, batches[0]).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    plain, _ = mixtral()
    plain.load_state_dict(qweights)
    _loss(plain, batches[0]).backward()
    experts = "model.layers.0.mlp.experts."
    for name, p in plain.named_parameters():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    down = got[experts + "down_proj"]
    assert down[STARVED].abs().sum() == 0 and down.abs().sum() > 0


def test_mixtral_experts_3d_gradient_under_activation_qdq():
    pytest.importorskip("transformers")
    from tiny_models import mixtral

    model, batches = mixtral()
    calib = calibrate(model, batches, "w8a8", progress=False)
    with calib.apply(model):
        _loss(model, batches[0]).backward()
    for layer in model.model.layers:
        for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0
