"""``fake_quantize`` in training and in the compilers (probe s33).

- qparams are constants: a scale that requires grad got a gradient of ``sum(q - zp)`` (round's
  zero derivative taken through the division), neither torch's learnable fake-quant (LSQ) nor
  none; and with ``ste=False`` the output still required grad. Now no gradient flows to them,
  as ``torch.fake_quantize_per_tensor_affine`` takes its scale.
- The default ``check=True`` read the qparams back: under ``torch.export`` or
  ``torch.compile(fullgraph=True)`` that failed with torch's internal errors
  (``GuardOnDataDependentSymNode``, "Unsupported: Tensor.tolist()"). Traced, the checks are
  now asserts in the graph: the call exports, and bad qparams raise when the graph runs.
"""

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, dequantize, fake_quantize, presets, qparams_from_range, quantize
from quantscope.layout import Tensor
from quantscope.qparams import QParams


def _x():
    return torch.randn(8, 128, generator=torch.Generator().manual_seed(0)) * 1.5


@pytest.mark.parametrize("ste", [True, False])
def test_qparams_are_constants_to_autograd(ste):
    x = _x()
    spec = QuantSpec("int8", Tensor(), symmetric=False)
    q = qparams_from_range(x.amin().reshape(1) * 0.7, x.amax().reshape(1) * 0.7, spec)
    scale = q.scale.detach().clone().requires_grad_()
    zp = q.zero_point.float().requires_grad_()
    xg = x.clone().requires_grad_()
    out = fake_quantize(xg, QParams(scale, zp), spec, ste=ste, check=False)
    assert torch.equal(out, fake_quantize(x, q, spec))
    assert out.requires_grad == ste
    if ste:
        out.sum().backward()
        assert scale.grad is None and zp.grad is None
        # the input's gradient is torch's own straight-through mask
        ref = x.clone().requires_grad_()
        torch.fake_quantize_per_tensor_affine(ref, q.scale.item(), int(q.zero_point.item()),
                                              spec.qmin, spec.qmax).sum().backward()
        assert torch.equal(xg.grad, ref.grad)


class _FQ(nn.Module):
    def __init__(self, q, spec):
        super().__init__()
        self.q, self.spec = q, spec

    def forward(self, t):
        return fake_quantize(t, self.q, self.spec)  # check=True, the default


def _qparams(spec=presets.INT8_PER_CHANNEL):
    x = _x()
    return x, qparams_from_range(x.amin(1), x.amax(1), spec).reshape(
        spec.layout.qparam_shape(x.shape)), spec


@pytest.mark.parametrize("strict", [False, True])
def test_the_default_check_exports_and_asserts_in_the_graph(strict):
    x, q, spec = _qparams()
    ep = torch.export.export(_FQ(q, spec), (x,), strict=strict)
    assert torch.equal(ep.module()(x), fake_quantize(x, q, spec))
    asserts = [n for n in ep.graph.nodes if "assert_async" in str(n.target)]
    assert asserts, ep.graph
    bad = QParams(q.scale.clone(), q.zero_point)
    bad.scale[3] = 0.0
    ep = torch.export.export(_FQ(bad, spec), (x,), strict=strict)
    with pytest.raises(RuntimeError, match="qparams.scale must be finite, > 0"):
        ep.module()(x)


def test_the_default_check_compiles_in_one_graph_and_raises_on_bad_qparams():
    x, q, spec = _qparams()

    @torch.compile(fullgraph=True, backend="eager")
    def run(t, scale, zero_point):
        return fake_quantize(t, QParams(scale, zero_point), spec)

    assert torch.equal(run(x, q.scale, q.zero_point), fake_quantize(x, q, spec))
    zp = q.zero_point.clone()
    zp[1] = 300  # outside int8's code range
    with pytest.raises(RuntimeError, match=r"qparams.zero_point must be integers in the code "
                                           r"range \[-128, 127\]"):
        run(x, q.scale, zp)
    with pytest.raises(ValueError, match=r"code range \[-128, 127\] of int8"):  # eager: as before
        fake_quantize(x, QParams(q.scale, zp), spec)


@pytest.mark.parametrize("strict", [False, True])
def test_quantize_and_dequantize_export_with_their_input_checks(strict):
    x, q, spec = _qparams()
    codes = quantize(x, q, spec)
    for fn, arg in ((quantize, x), (dequantize, codes)):
        class M(nn.Module):
            def forward(self, t, fn=fn):
                return fn(t, q, spec)

        ep = torch.export.export(M(), (arg,), strict=strict)
        assert torch.equal(ep.module()(arg), fn(arg, q, spec))
    bad = codes.clone()
    bad[0, 0] = 0.5  # not a code
    with pytest.raises(RuntimeError, match=r"dequantize: q must hold codes: integers in "
                                           r"\[-128(\.0)?, 127(\.0)?\]"):
        ep.module()(bad)
