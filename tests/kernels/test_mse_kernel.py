"""The MSE search's C kernel against its torch references: the elementwise fake-quant error
bit for bit, the error sums against float64, and the selection rules against the torch
``_State`` driven by the kernel's own prices (same choices, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from quantscope import kernels, presets
from quantscope.estimators import mse_kernel, mse_search, mse_tiles, range_error
from quantscope.layout import Channel, Group, Tensor
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

pytestmark = pytest.mark.skipif(not kernels.available("mse_search"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): torch path only")

SPECS = {
    "int4-channel": QuantSpec("int4", Channel(0)),
    "int4-g32": QuantSpec("int4", Group(32)),
    "int4-g32-asym": QuantSpec("int4", Group(32), symmetric=False),
    "uint8-tensor-asym": QuantSpec("uint8", Tensor(), symmetric=False),
    "int8-narrow": QuantSpec("int8", Channel(0), quant_min=-127),
    "int4-pow2": QuantSpec("int4", Group(32), scale="pow2:round"),
    "int8-fp16": QuantSpec("int8", Channel(0), scale="fp16"),
}


def weight(shape=(24, 224), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add_(0.1)
    w[1, 3] = 9.0
    w[5, -1] = -7.0
    return w


def units_of(spec, w):
    if not isinstance(spec.layout, Group):  # odd rows: the kernel's scalar tails
        w = w[:, :203]
    u = spec.layout.to_units(w.contiguous())
    return (u, *unit_minmax(u))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_elementwise_error_is_torch_bit_for_bit(name):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 16, 77, 200):  # vector bodies and scalar / masked tails
        x = torch.randn(n, generator=g) * 3
        x[: n // 4] = 0.0
        for s, z in ((0.37, 0.0), (0.37, 3.0), (2.5e-3, -2.0), (1.0, 0.0)):
            if spec.symmetric and spec.format.signed and z:
                continue
            z = min(max(z, spec.qmin), spec.qmax)
            # exact half-way points (round half to even), both edges, far outside the range
            t = torch.tensor([0.5, 1.5, -0.5, -2.5, spec.qmax + 0.5, spec.qmin - 0.5, 1e6, -1e6])
            xx = torch.cat((x, (t - z) * s))
            ref = fake_quantize_units(xx[None], torch.tensor([[s]]), torch.tensor([[z]]),
                                      spec)[0] - xx
            got = mse_kernel.dq(xx, s, z, spec)
            assert torch.equal(got, ref), (name, n, s, z)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_error_sums_match_float64(name):
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight())
    f = torch.tensor([1.0, 0.93, 0.8, 0.61, 0.3])[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
    got = mse_kernel.price(u, qp.scale, qp.zero_point, spec)
    d = fake_quantize_units(u[None], qp.scale[..., None], qp.zero_point.float()[..., None],
                            spec) - u[None]
    ref = (d.double() ** 2).sum(-1)
    # the squares exact in float64, only the float64 sum's order differs
    assert torch.allclose(got, ref, rtol=1e-12, atol=0), (got - ref).abs().max()
    # a subset of units: the same numbers
    sub = torch.tensor([min(3, u.shape[0] - 1), 0, u.shape[0] - 1])
    part = mse_kernel.price(u, qp.scale[:, sub], qp.zero_point[:, sub], spec, sub=sub)
    assert torch.equal(part, got[:, sub])


CONFIGS = [
    {},
    {"patience": 1},
    {"patience": 3, "extend_to": None},
    {"per_unit_patience": False},
    {"per_unit_patience": False, "patience": 1},
    {"patience": 2, "grid": 40},
    {"patience": None, "extend_to": None},
    {"factors": [1 - 0.01 * i for i in range(0, 95, 3)], "patience": None, "tie": "last"},
    {"factors": [4.0, 2.0, 1.0, 0.5, 0.25], "patience": None},
    {"expand": 1.5, "grid": 200, "maxshrink": 0.6, "patience": 7},
]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_rules_are_the_torch_rules(name, monkeypatch):
    """The torch ``_State`` on the kernel's prices makes the same choices as the kernel."""
    spec = SPECS[name]

    def kernel_prices(x, scale, zp, spec, norm, exact, float32_squares=False):
        return mse_kernel.price(x, scale, zp, spec, float32_squares=float32_squares)

    for seed in range(2):
        u, lo, hi = units_of(spec, weight(seed=seed))
        for kw in CONFIGS:
            with monkeypatch.context() as m:
                m.setattr(mse_tiles, "_tile_error", kernel_prices)
                ref = mse_search(u, lo, hi, spec, backend="torch", chunk_elems=1 << 22, **kw)
            got = mse_search(u, lo, hi, spec, backend="kernel", **kw)
            # chunks of 5 units, blocks of 8 candidates: the global rule is guessed, checked
            with monkeypatch.context() as m:  # and, where it stopped in the grid, redone
                m.setattr(mse_kernel, "_MIN_KERNEL_UNITS", 5)
                small = mse_search(u, lo, hi, spec, backend="kernel", chunk_elems=40, **kw)
            for res in (got, small):
                for a, b in zip((res.lo, res.hi, res.index, res.error),
                                (ref.lo, ref.hi, ref.index, ref.error.float())):
                    assert torch.equal(a, b), (name, seed, kw, res is small)


def test_blocks_threads_and_subsets_do_not_change_the_answer(monkeypatch):
    spec = SPECS["int4-g32"]
    u, lo, hi = units_of(spec, weight(shape=(512, 512), seed=3))
    ref = mse_search(u, lo, hi, spec)
    monkeypatch.setattr(mse_kernel, "_MIN_KERNEL_UNITS", 1)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for chunk in (4096, 40000):  # [candidates, units] blocks of 4096 and 32767
                for early_stop in (True, False):
                    res = mse_search(u, lo, hi, spec, chunk_elems=chunk, early_stop=early_stop)
                    assert torch.equal(res.lo, ref.lo) and torch.equal(res.hi, ref.hi)
                    assert torch.equal(res.index, ref.index)
                    assert torch.equal(res.error, ref.error)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("name", ["int4-channel", "int4-g32", "int4-g32-asym", "int8-fp16"])
def test_kernel_and_torch_paths_agree(name):
    """Both price a candidate as exact squares summed in float64: the same choices, the
    same errors (up to float64 summation order)."""
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight(shape=(64, 256), seed=2))
    a = mse_search(u, lo, hi, spec)
    b = mse_search(u, lo, hi, spec, backend="torch")
    assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)
    assert torch.equal(a.index, b.index)
    assert torch.allclose(a.error, b.error, rtol=1e-6)


def test_near_tie_on_bf16_values_is_broken_alike():
    """Issue 20 #11: a bf16-valued int4 group-32 unit whose two best candidates differ by
    1.4e-8 (relative 7e-8, below a float32 sum's rounding): the torch path summed in float32
    picked the worse one, the kernel the better. Now both pick scale 0.28125."""
    from quantscope import get_observer

    g = torch.Generator().manual_seed(14)
    x = torch.randn(192, 1024, generator=g).bfloat16().float()
    unit = x.reshape(-1, 32)[4503:4504]
    x = torch.cat([unit, x.reshape(-1, 32)[:63]]).reshape(4, 512)
    spec = QuantSpec("int4", Group(32))
    scales = []
    for kernel in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not kernel:
                m.setattr(kernels, "lib", lambda name: None)
            o = get_observer("memoryless_mse", spec)
            o(x)
            scales.append(o.calculate_qparams().scale.reshape(-1))
    assert torch.equal(scales[0], scales[1])
    assert scales[0][0].item() == 0.28125


def test_backend_choice(monkeypatch):
    u, lo, hi = units_of(SPECS["int4-g32"], weight())
    spec = SPECS["int4-g32"]
    assert mse_kernel.usable(u, spec, 2.0)
    assert not mse_kernel.usable(u, spec, 2.4)
    assert mse_kernel.usable(u, presets.NVFP4, 2.0)  # float element formats: issue 35
    assert not mse_kernel.usable(u.double(), spec, 2.0)
    default = mse_search(u, lo, hi, spec)
    assert torch.equal(default.index, mse_search(u, lo, hi, spec, backend="kernel").index)
    with pytest.raises(ValueError, match="backend"):
        mse_search(u, lo, hi, spec, backend="cuda")
    with pytest.raises(ValueError, match="backend='kernel'"):
        mse_search(u, lo, hi, presets.MXFP4, backend="kernel", norm=3.0)
    with pytest.raises(ValueError, match="backend='kernel'"):  # compat: norms it has bounds for
        mse_search(u, lo, hi, spec, backend="kernel", compat="llmcompressor", norm=2.5)
    # no compiler: the torch path, same answer as asking for it
    monkeypatch.setattr(kernels, "lib", lambda name: None)
    assert not kernels.available("mse_search")
    res = mse_search(u, lo, hi, spec)
    ref = mse_search(u, lo, hi, spec, backend="torch")
    assert torch.equal(res.lo, ref.lo) and torch.equal(res.index, ref.index)


def test_kernel_edge_units():
    spec = SPECS["int4-g32-asym"]
    for w in (torch.zeros(3, 32), torch.full((2, 32), -1.5), torch.randn(1, 1).expand(1, 32)):
        u, lo, hi = units_of(spec, w.contiguous())
        res = mse_search(u, lo, hi, spec)
        ref = range_error(u, lo, hi, spec)
        assert torch.isfinite(res.error).all()
        assert (range_error(u, res.lo, res.hi, spec) <= ref * (1 + 1e-6) + 1e-30).all()
