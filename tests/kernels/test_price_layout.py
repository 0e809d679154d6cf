"""A price does not depend on the memory layout of the units: a transposed view of the same
values gives the same float64 bits (probing found 1-ulp differences: torch's row sums add in
an order that follows the strides, and the C kernel took only contiguous units)."""

import pytest
import torch

from quantscope.kernels import ops, price_ops

Q = torch.ops.quantscope


def _units(U=24, E=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(U, E, generator=g) * torch.rand(U, 1, generator=g) * 4
    strided = u.t().contiguous().t()
    assert torch.equal(u, strided) and not strided.is_contiguous()
    return u, strided, torch.rand(U, E, generator=g)


def _prices(u, w):
    U = u.shape[0]
    scale = (u.abs().amax(1) / torch.linspace(6.0, 9.0, 5)[:, None]).contiguous()  # [5, U]
    zp = torch.zeros(5, U, dtype=torch.int32)
    out = [ops.mse_price_int(u, scale, zp, -7.0, 7.0, w, n) for n in (2.0, 2.4)]
    out += [ops.mse_price_fp(u, scale, 6.0, 0, 1, w, n) for n in (2.0, 2.4)]
    lo, hi = u.amin(1), u.amax(1)
    factors = torch.linspace(1.0, 0.5, 12)
    ga = u.abs().amax().reshape(1)
    out += list(Q.nvfp4_search(u[:, :16], lo, hi, factors, lo, hi, ga, "fp8_e4m3", 2**-23,
                               w[:, :16]))
    out += list(Q.mx_mse(u, lo, hi, factors, lo, hi, "fp4_e2m1", "even", 6, 3, True, True,
                         False, w))
    return out


@pytest.mark.parametrize("c_kernel", [True, False])
def test_a_transposed_view_prices_as_its_values(c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(price_ops, "_c_lib", lambda name: None)
    u, strided, w = _units()
    for a, b in zip(_prices(u, w), _prices(strided, w), strict=True):
        assert torch.equal(a, b)
