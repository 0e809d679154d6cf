"""The MSE prices square each float32 fake-quant error exactly, in float64, on every engine:
the C kernel (``quantscope::mse_price_int`` / ``mse_price_fp`` on contiguous CPU units), their
torch path (strided units) and the Triton kernel (CUDA, or the interpreter here).

A float32 ``d * d`` loses precision below ``|d|`` ~ 1e-19 and underflows to 0 below ~3e-23, so
on units of tiny values every candidate priced about 0 and the searches' tie rules chose. The
square of a float32 is exact in float64, so scaling the units and scales by ``2 ** k`` scales
every term, and each sum, by exactly ``4 ** k``: the prices below must be bitwise those of the
unscaled units times ``4 ** k``. ``float32_squares`` (the compat classes' toolkit arithmetic)
keeps the float32 squares: the reference is their float64 sum.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from triton_interpreter import fresh_interpreter_test

from quantscope import QuantSpec, kernels, presets
from quantscope.kernels import ops, price_ops
from quantscope.layout import Channel
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

SPECS = [QuantSpec("int8", "channel:0"), QuantSpec("int4", "group:32", symmetric=False),
         presets.MXFP4, presets.NVFP4]
#: 2 ** -70 ~ 8.5e-22: the errors' float32 squares (~1e-47) were 0 or subnormal
K = -70


def _case(spec, seed=0):
    """Float32 units (one SIMD tail: 100 columns), weights spread over decades, and five
    candidates' effective scales / zero points ``[5, U]``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 100 if isinstance(spec.layout, Channel) else 96, generator=g)
    w[0, 3] = 9.0
    units = spec.layout.to_units(w).contiguous()
    weights = torch.rand(units.shape, generator=g) ** 3 * 10
    lo, hi = torch.aminmax(units, dim=1)
    f = torch.tensor([1.0, 0.95, 0.9, 0.8, 0.55])[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
    scale = qp.effective_scale.expand(5, units.shape[0]).contiguous()
    zp = qp.zero_point.expand(5, units.shape[0]).to(torch.int32).contiguous()
    return units, weights, scale, zp


def _ops_price(spec, units, scale, zp, weights=None, strided=False, **kw):
    """The op's prices on the CPU: the C kernel, or (``strided`` units) its torch path."""
    if strided:
        units = torch.empty(units.shape[1], units.shape[0]).t().copy_(units)
    if spec.is_float:
        f = spec.format
        return ops.mse_price_fp(units, scale, f.max, f.min_exp, f.mbits, weights, **kw)
    return ops.mse_price_int(units, scale, zp, spec.qmin, spec.qmax, weights, **kw)


def _triton_price(device, spec, units, scale, zp, weights=None, **kw):
    from quantscope.kernels.triton import mse

    w = None if weights is None else weights.to(device)
    if spec.is_float:
        f = spec.format
        return mse.mse_price_fp(units.to(device), scale.to(device), f.max, f.min_exp, f.mbits,
                                weights=w, **kw).cpu()
    return mse.mse_price_int(units.to(device), scale.to(device), zp.to(device), spec.qmin,
                             spec.qmax, weights=w, **kw).cpu()


def _scaled_alike(price):
    """``price(units, scale, weights)`` at ``2 ** K`` is bitwise its value at 1 times ``4 ** K``,
    for every spec, with and without weights."""
    for spec in SPECS:
        units, weights, scale, zp = _case(spec)
        for w in (None, weights):
            base = price(spec, units, scale, zp, w)
            tiny = price(spec, units * 2.0 ** K, scale * 2.0 ** K, zp, w)
            assert bool((base > 0).all()), spec
            assert torch.equal(tiny, base * 2.0 ** (2 * K)), (spec, w is None)


def _c_branch(name):
    """The C kernel's SIMD branch ``name`` (the machine's own, AVX2, scalar: a CI machine may
    take another than this one), as tests/kernels/test_price_nan.py builds them."""
    if name == "native":
        return kernels.lib("mse_search")
    csrc = Path(__file__).resolve().with_name("csrc")
    return kernels.load(f"search_{name}_test", kernels.SIGNATURES["mse_search"],
                        source=csrc / f"search_{name}_test.c")


@pytest.mark.parametrize("branch", ["native", "avx2", "scalar"])
def test_c_prices_scale_exactly_with_the_units(branch, monkeypatch):
    lib = _c_branch(branch)
    if lib is None:
        pytest.skip(f"the {branch} build did not load")
    monkeypatch.setattr(price_ops, "_c_lib", lambda name: lib)
    _scaled_alike(_ops_price)


def test_torch_path_prices_scale_exactly_with_the_units():
    _scaled_alike(lambda *a: _ops_price(*a, strided=True))


def test_triton_prices_scale_exactly_with_the_units(device):
    _scaled_alike(lambda *a: _triton_price(device, *a))


def _float32_square_sums(spec, units, scale, zp, weights):
    """The compat arithmetic written out: each square rounded to float32, summed exactly."""
    out = torch.empty(scale.shape, dtype=torch.float64)
    for k in range(scale.shape[0]):
        d = fake_quantize_units(units, scale[k, :, None], zp[k, :, None].float(), spec) - units
        terms = d.square().double() * (1.0 if weights is None else weights.double())
        for u in range(units.shape[0]):
            out[k, u] = math.fsum(terms[u].tolist())
    return out


@pytest.mark.parametrize("engine", ["c_kernel", "torch_path", "triton"])
def test_float32_squares_keep_the_toolkits_arithmetic(engine, request):
    def price(spec, units, scale, zp, w):
        if engine == "triton":
            device = request.getfixturevalue("device")
            return _triton_price(device, spec, units, scale, zp, w, float32_squares=True)
        return _ops_price(spec, units, scale, zp, w, engine == "torch_path",
                          float32_squares=True)

    for spec in SPECS:
        units, weights, scale, zp = _case(spec, seed=1)
        for w in (None, weights):
            want = _float32_square_sums(spec, units, scale, zp, w)
            torch.testing.assert_close(price(spec, units, scale, zp, w), want, rtol=1e-12,
                                       atol=0)
        # at 2 ** -80 (~8e-25) every float32 square underflows: the toolkits price 0
        tiny = price(spec, units * 2.0 ** -80, scale * 2.0 ** -80, zp, None)
        assert bool((tiny == 0).all()), spec
