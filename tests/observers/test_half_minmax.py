"""bf16 / fp16 inputs to the min-max family on the CPU: the C kernel reads them as they are
(widened exactly in its pass, csrc/unit_minmax.c), where they took a float32 copy of the
whole tensor first (3.5-4x the float32 time, found by probing). Every result must equal the
float32 input's bit for bit: every bf16 / fp16 value is a float32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope
from quantscope import Block, Channel, Group, QuantSpec, Tensor, Tile, Token, presets
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

HALVES = (torch.bfloat16, torch.float16)
FAMILIES = {"memoryless_minmax": {}, "static_minmax": {}, "minmax": {"averaging_constant": 0.25}}

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s float32 bit patterns, NaN as one value (the kernel returns its own NaN)."""
    return t.float().nan_to_num(7.0).view(torch.int32)


def assert_bitwise(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def half_rand(shape, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 100
    if specials:  # NaN, infinities, signed zeros, the smallest subnormals of each type
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 6e-8,
                             -6e-8, 1e-39, 60000.0])
        idx = torch.randint(0, x.numel(), (len(vals),), generator=g)
        x.view(-1)[idx] = vals
    return x.to(dtype)


class Spy:
    """The kernel library, recording the element-type code of every min / max call."""

    def __init__(self, lib):
        self.lib, self.codes = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.codes.append(args[-1])
            return fn(*args)
        return call


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_every_bit_pattern_widens_exactly(dtype, monkeypatch):
    """All 65536 patterns, as rows of one element: through the vector conversion (a whole
    call) and through the scalar one (calls of 7 rows, under one vector)."""
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    want = x.float()
    lo, hi = stats.unit_minmax(x.view(-1, 1))
    assert_bitwise(lo, want)
    assert_bitwise(hi, want)
    scalar = torch.cat([stats.unit_minmax(x[i:i + 7].view(-1, 1))[0]
                        for i in range(0, x.numel() - 7, 7)])
    assert_bitwise(scalar, want[:scalar.numel()])


@given(st.sampled_from(HALVES), st.integers(2, 70),
       st.one_of(st.integers(1, 300), st.sampled_from([8, 16, 24, 64, 2047, 2048, 2049, 4100])),
       st.integers(0, 2 ** 16), st.booleans(), st.sampled_from([1, 3]))
@settings(max_examples=60, deadline=None)
def test_kernel_equals_torch_on_the_float32_copy(dtype, U, E, seed, specials, threads):
    """Rows and columns of every length around the kernel's 2048-float pieces, whole rows per
    piece and pieces per row, NaN / inf / -0.0 / subnormals, split over threads."""
    old = stats.KERNEL_MIN_NUMEL, stats.THREAD_MIN_NUMEL, torch.get_num_threads()
    stats.KERNEL_MIN_NUMEL, stats.THREAD_MIN_NUMEL = 0, 1
    torch.set_num_threads(threads)
    try:
        u = half_rand((U, E), dtype, seed, specials)
        ends = torch.empty(2)
        lo, hi = stats.unit_minmax(u, ends=ends)
        clo, chi = minmax_layouts.column_minmax(u.t().contiguous())
    finally:
        stats.KERNEL_MIN_NUMEL, stats.THREAD_MIN_NUMEL = old[:2]
        torch.set_num_threads(old[2])
    rlo, rhi = stats.torch_unit_minmax(u.float())
    for got, want in ((lo, rlo), (hi, rhi), (clo, rlo), (chi, rhi)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))  # -0.0 may tie +0.0
    assert torch.equal(ends.nan_to_num(7.0), torch.stack((rlo.amin(), rhi.amax())).nan_to_num(7.0))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_small_half_units_reduce_in_torch_to_float32(dtype):
    u = half_rand((3, 40), dtype, seed=1, specials=True)  # under the kernel's size
    lo, hi = stats.unit_minmax(u)
    out = (torch.empty(3), torch.empty(3))
    got = stats.unit_minmax(u, out)
    assert got[0] is out[0] and got[1] is out[1]
    rlo, rhi = stats.torch_unit_minmax(u.float())
    for a, b in ((lo, rlo), (hi, rhi), (out[0], rlo), (out[1], rhi)):
        assert_bitwise(a, b)
    clo, chi = minmax_layouts.column_minmax(u.t())
    assert_bitwise(clo, rlo)
    assert_bitwise(chi, rhi)


LAYOUTS = [
    (QuantSpec("int8"), (96, 1024)),
    (QuantSpec("int8", Channel(0)), (96, 1024)),
    (QuantSpec("int8", Channel(-1), symmetric=False), (8, 32, 300)),
    (QuantSpec("int8", Channel(1)), (8, 48, 256)),
    (QuantSpec("int4", Group(128)), (96, 1024)),
    (QuantSpec("int4", Group(32, 0)), (256, 512)),
    (QuantSpec("int8", Token()), (4, 64, 512)),
    (QuantSpec("fp8_e4m3", Tile(32, 32)), (256, 512)),
    (presets.NVFP4, (96, 1024)),
    (presets.MXFP4, (96, 1024)),
    (QuantSpec("int4", Block(16, 0)), (128, 1024)),
]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("spec,shape", LAYOUTS, ids=lambda v: str(getattr(v, "layout", v)))
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_observers_on_half_inputs_equal_their_float32_copy(name, spec, shape, dtype,
                                                           monkeypatch):
    """Every layout (row views, the direct paths read in place, a transposed matrix), the
    fused state updates, and the kernel read the half tensor itself (its element code)."""
    xs = [half_rand(shape, dtype, seed=s) for s in range(3)]
    if len(shape) == 2 and spec.layout == Channel(0):
        xs = [x.t().contiguous().t() for x in xs]  # a transposed weight: its own direct path
    got = quantscope.get_observer(name, spec, **FAMILIES[name])
    want = quantscope.get_observer(name, spec, **FAMILIES[name])
    for x in xs:
        want(x.float())
    spy = Spy(stats._kernel())
    for module in (stats, minmax_layouts):  # the direct paths call it from theirs
        monkeypatch.setattr(module, "_kernel", lambda: spy)
    for x in xs:
        got(x)
    one_unit = isinstance(spec.layout, Tensor)  # torch's whole-tensor reduction, no kernel
    assert set(spy.codes) == (set() if one_unit else {1 if dtype == torch.bfloat16 else 2})
    a, b = got.calculate_qparams(), want.calculate_qparams()
    for f in ("scale", "zero_point", "global_scale"):
        if getattr(b, f, None) is not None:
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(got.min_vals, want.min_vals) and torch.equal(got.max_vals, want.max_vals)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_half_input_is_an_error(bad):
    x = half_rand((96, 1024), torch.bfloat16, seed=2)
    x[50, 7] = bad
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8", Channel(0)))
    obs(x)
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.calculate_qparams()


def test_a_tensor_layout_reads_half_without_a_copy():
    """One unit: torch's whole-tensor reduction in bf16, widened after."""
    x = half_rand((96, 1024), torch.bfloat16, seed=3)
    obs = quantscope.get_observer("memoryless_minmax", QuantSpec("int8", Tensor()))
    obs(x)
    assert obs.min_vals.dtype == torch.float32
    assert torch.equal(obs.min_vals, x.float().amin().reshape(1))
