"""The Triton pricing with weights (``_price_kernel``'s ``WEIGHTED``: the imatrix search off
the CPU) under the interpreter on CPU tensors (on the GPU where there is one): prices equal
the float64 torch reference ``sum float64(w) * float64(d * d)`` up to the order of the sum
(1e-12), bit for bit where every term and partial sum is exact, and the C kernel's weighted
prices to 1e-12."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import fresh_interpreter_test

from quantscope import QuantSpec, kernels
from quantscope.kernels import ops
from quantscope.kernels.price_ops import price_sums
from quantscope.layout import Block
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range

NVFP4 = QuantSpec("fp4_e2m1", Block(16), scale="fp8_e4m3")


test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


def _candidates(units, spec, factors):
    lo, hi = torch.aminmax(units, dim=1)
    f = torch.tensor(factors)[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec,
                            global_amax=torch.maximum(lo.abs().max(), hi.abs().max()))
    scale = qp.effective_scale.expand(len(factors), units.shape[0]).contiguous()
    zp = qp.zero_point.expand(len(factors), units.shape[0]).to(torch.int32).contiguous()
    return scale, zp


def _reference(units, scale, zp, spec, weights):
    rows = [price_sums(fake_quantize_units(units, s[:, None], z[:, None].float(), spec)
                       - units, weights) for s, z in zip(scale, zp, strict=True)]
    return torch.stack(rows)


def _triton_price(device, units, scale, zp, spec, weights, **blocks):
    from quantscope.kernels.triton import mse

    args = [t.to(device) for t in (units, scale)]
    w = weights.to(device)
    if spec.is_float:
        f = spec.format
        return mse.mse_price_fp(*args, f.max, f.min_exp, f.mbits, weights=w, **blocks).cpu()
    return mse.mse_price_int(*args, zp.to(device), spec.qmin, spec.qmax, weights=w,
                             **blocks).cpu()


SPECS = [QuantSpec("int4"), QuantSpec("int8", symmetric=False), NVFP4]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize(("U", "E", "blocks"), [(6, 48, {}), (4, 160, {"block_e": 32}),
                                                (3, 16, {"block_u": 2})])
def test_weighted_prices_equal_the_reference(device, spec, U, E, blocks):
    g = torch.Generator().manual_seed(U * E)
    units = torch.randn(U, E, generator=g) * 3
    weights = torch.rand(U, E, generator=g) ** 2 * 7
    scale, zp = _candidates(units, spec, [1.0, 0.9, 0.75, 0.6])
    got = _triton_price(device, units, scale, zp, spec, weights, **blocks)
    want = _reference(units, scale, zp, spec, weights)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    if kernels.available("mse_search"):  # the C kernel's weighted prices (the CPU op)
        on_cpu = ops.mse_price_fp(units, scale, spec.format.max, spec.format.min_exp,
                                  spec.format.mbits, weights) if spec.is_float else \
            ops.mse_price_int(units, scale, zp, float(spec.qmin), float(spec.qmax), weights)
        torch.testing.assert_close(got, on_cpu, rtol=1e-12, atol=0)


@pytest.mark.parametrize("blocks", [{}, {"block_e": 16}])
def test_weighted_prices_bitwise_where_the_sum_is_exact(device, blocks):
    """Elements on a 1/8 grid, scale 1/2, power-of-two weights: every term and partial sum
    is a short dyadic number, so any order of the sum gives the same bits."""
    g = torch.Generator().manual_seed(7)
    units = torch.randint(-40, 40, (5, 64), generator=g).float() / 8
    weights = torch.exp2(torch.randint(-3, 4, (5, 64), generator=g).float())
    weights[0, :5] = 0.0
    spec = QuantSpec("int4")
    scale = torch.full((2, 5), 0.5)
    zp = torch.zeros(2, 5, dtype=torch.int32)
    zp[1] = 1
    got = _triton_price(device, units, scale, zp, spec, weights, **blocks)
    assert torch.equal(got, _reference(units, scale, zp, spec, weights))


def test_unit_weights_give_the_unweighted_exact_squares(device):
    """w = 1: the C kernel's unweighted terms, the squares exact in float64."""
    g = torch.Generator().manual_seed(3)
    units = torch.randn(4, 32, generator=g)
    spec = QuantSpec("int8")
    scale, zp = _candidates(units, spec, [1.0, 0.8])
    got = _triton_price(device, units, scale, zp, spec, torch.ones_like(units))
    d = [fake_quantize_units(units, s[:, None], z[:, None].float(), spec) - units
         for s, z in zip(scale, zp, strict=True)]
    torch.testing.assert_close(got, torch.stack([x.double().square().sum(1) for x in d]),
                               rtol=1e-12, atol=0)
