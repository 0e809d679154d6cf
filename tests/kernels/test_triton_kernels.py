"""Every Triton kernel (quantscope.kernels.triton) bitwise against the torch path.

Without a GPU they run under Triton's interpreter on CPU tensors, so CI proves them; with
one, compiled on it. The interpreter needs ``TRITON_INTERPRET=1`` before triton's first
import (tests/conftest.py sets it); in a process where something imported triton sooner
(a run that does not load tests/conftest.py first), these tests skip and
:func:`test_in_a_fresh_interpreter` runs this file in a child process. Small shapes, with block sizes
forced small so that every loop, mask and split runs. Skipped without triton (the ``gpu``
extra).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiers import each_value

pytest.importorskip("triton")

import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import fresh_interpreter_test

from quantscope import QuantSpec
from quantscope.formats import get_format
from quantscope.kernels.triton._jit import LAUNCH, fake_quant_fp, fp_round, norm_term
from quantscope.layout import Block
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.scales import E8M0_MODES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# the interpreter computes with numpy, which warns where float32 overflows to inf (a
# candidate past float32's max: the torch path overflows alike, and both saturate) and where
# NaN or inf elements make NaN (inf / inf: torch makes it alike)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().cpu().view(torch.int32)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    # a NaN's sign and payload are no value: compiled for CUDA, a kernel gives the canonical
    # NaN where the CPU's arithmetic kept the input's (the lent H200 found it)
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = got.cpu().isnan() & want.cpu().isnan()
    diff = ((_bits(got) != _bits(want)) & ~nan).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first at {diff[0].tolist()}: " \
        f"{got.cpu().flatten()[0]} vs {want.cpu().flatten()[0]}"


# ---- per-unit min / max --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("U", "E", "blocks"), [
    (5, 37, {}), (3, 100, {"block_e": 8, "splits": 3}), (1, 1000, {}), (1, 1000, {"block_e": 64}),
    (7, 16, {"block_u": 2, "block_e": 4}), (64, 3, {}),
])
def test_unit_minmax_bitwise(device, dtype, U, E, blocks):
    from quantscope.kernels.triton import minmax

    g = torch.Generator().manual_seed(U * 1000 + E)
    x = (torch.randn(U, E, generator=g) * 7).to(dtype)
    x[U // 2, E // 3] = float("nan")  # propagates to its unit only
    x[-1, -1] = float("inf")
    lo, hi = minmax.unit_minmax(x.to(device), **blocks)
    want_lo, want_hi = torch.aminmax(x.float(), dim=1)
    _assert_bitwise(lo, want_lo)
    _assert_bitwise(hi, want_hi)


def test_unit_minmax_of_no_units_is_empty(device):
    # probing: the launcher divided by its program count (0), and the torch path could not
    # reshape a 4-D view of no units
    from quantscope.kernels import ops
    from quantscope.kernels.triton import minmax

    for x in (torch.empty(0, 5), torch.empty(0, 3, 2, 2), torch.empty(2, 0, 2, 2)):
        for lo, hi in (minmax.unit_minmax(x.to(device)), ops._torch_unit_minmax(x)):
            assert lo.shape == hi.shape == (0,) and lo.dtype == torch.float32


def test_unit_minmax_strided(device):
    from quantscope.kernels.triton import minmax

    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(1)).to(device)
    lo, hi = minmax.unit_minmax(x.t(), block_e=16)  # units along the columns
    _assert_bitwise(lo, x.t().amin(1))
    _assert_bitwise(hi, x.t().amax(1))


def _four_d(x: torch.Tensor, layout) -> torch.Tensor:
    """The ``[U1, U2, E1, E2]`` view of ``x`` whose units are ``layout``'s, in its order."""
    from quantscope.layout import Channel, Tile

    if isinstance(layout, Tile):
        C = x.shape[-1]
        rows, cols = layout.rows, layout.cols
        return x.reshape(-1, rows, C // cols, cols).permute(0, 2, 1, 3)
    assert isinstance(layout, Channel)
    a = layout.axis % x.dim()
    A, C = math.prod(x.shape[:a]), x.shape[a]
    return x.reshape(A, C, -1).permute(1, 0, 2).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "layout"), [
    ((3, 8, 24), "tile:4x8"), ((16, 32), "tile:8x16"), ((4, 5, 6), "channel:1"),
    ((6, 7), "channel:-1"), ((2, 3, 4, 5), "channel:2"),
], ids=str)
def test_unit_minmax_four_d_views_are_the_layouts_units(device, dtype, shape, layout):
    """Tiles and a channel axis other than the first, read in place as ``[U1, U2, E1, E2]``
    views: the min / max of ``layout.to_units``' rows, in its order."""
    from quantscope.kernels.triton import minmax
    from quantscope.layout import parse_layout

    lay = parse_layout(layout)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    want_lo, want_hi = torch.aminmax(lay.to_units(x.float()), dim=1)
    view = _four_d(x.to(device), lay)
    lo, hi = minmax.unit_minmax(view, block_e=8)
    _assert_bitwise(lo, want_lo)
    _assert_bitwise(hi, want_hi)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_unit_minmax_one_launch_over_mixed_shapes(device, dtype, aligned):
    """One launch over tensors of mixed shapes (a strided one among them): each tensor's
    rows' min / max in its own lo / hi, NaN kept; ``aligned``: rows of 16-byte multiples,
    the launch that loads 16 bytes at once (a NaN in a last row: the tail rows masked)."""
    from quantscope.kernels.triton import minmax

    g = torch.Generator().manual_seed(4)
    if aligned:
        ts = [torch.randn(5, 64, generator=g), torch.randn(7, 128, generator=g),
              torch.randn(9, 96, generator=g)[:, :32]]
        nan_at = (1, 6, 100)
    else:
        ts = [torch.randn(5, 37, generator=g), torch.randn(64, 8, generator=g),
              torch.randn(1, 300, generator=g), torch.randn(9, 20, generator=g)[:, :13]]
        nan_at = (1, 3, 2)
    ts = [t.to(dtype) for t in ts]
    ts[nan_at[0]][nan_at[1:]] = float("nan")
    ts = [t.to(device) for t in ts]
    assert (minmax._vector_width(ts) > 1) == aligned
    los, his = minmax.grouped_unit_minmax(ts, block_u=4, block_e=16)
    ts = [t.cpu() for t in ts]
    for t, lo, hi in zip(ts, los, his, strict=True):
        want_lo, want_hi = torch.aminmax(t.float(), dim=1)
        _assert_bitwise(lo, want_lo)
        _assert_bitwise(hi, want_hi)
    # each tensor's outputs are their own allocation (an observer keeps them as its state)
    outs = [o for pair in zip(los, his) for o in pair]
    assert len({o.untyped_storage().data_ptr() for o in outs}) == len(outs)
    assert all(o.untyped_storage().nbytes() == o.numel() * 4 for o in outs)


def test_grouped_descriptors_go_up_without_a_blocking_copy():
    """The descriptors reach the device by a non-blocking copy (a blocking one makes PyTorch
    synchronize the stream: the host would wait for the GPU at every grouped launch); the
    meta device stands in for a GPU."""
    from op_names import BlockingUploads

    from quantscope.kernels.triton import minmax

    ts = [torch.zeros(5, 3), torch.zeros(2, 9)[:, :4]]
    los, his = [torch.zeros(5), torch.zeros(2)], [torch.zeros(5), torch.zeros(2)]
    host = minmax.grouped_descriptors(ts, los, his, block_u=4)
    assert host.tolist() == [
        [ts[0].data_ptr(), 0, 5, 3, 3, los[0].data_ptr(), his[0].data_ptr()],
        [ts[0].data_ptr(), 4, 5, 3, 3, los[0].data_ptr(), his[0].data_ptr()],
        [ts[1].data_ptr(), 0, 2, 4, 9, los[1].data_ptr(), his[1].data_ptr()]]
    uploads = BlockingUploads()
    with uploads:
        desc = minmax._upload(host, torch.device("meta"))
    assert desc.device.type == "meta" and desc.shape == host.shape
    assert uploads.found == []


def test_grouped_launch_loads_16_bytes_only_where_every_tensor_allows():
    """The grouped kernel's hint (``VEC``: 16-byte loads) only where every tensor's address,
    row stride and row length are multiples of 16 bytes (it reads them from memory, so the
    compiler cannot tell)."""
    from quantscope.kernels.triton import minmax

    full = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert minmax._vector_width([full, torch.zeros(3, 16)]) == 8  # by the first's dtype
    assert minmax._vector_width([torch.zeros(3, 16), torch.zeros(2, 8)]) == 4
    assert minmax._vector_width([full, full[:, :60]]) == 1  # rows of 120 bytes
    assert minmax._vector_width([full, full[:, 1:]]) == 1  # an address off by 2 bytes
    assert minmax._vector_width([torch.zeros(4, 72, dtype=torch.bfloat16)[:, :64]]) == 8
    assert minmax._vector_width([torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64]]) == 1

# ---- integer fake-quant --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", symmetric=False),
                                  QuantSpec("uint8", symmetric=False),
                                  QuantSpec("int8_narrow")], ids=str)
def test_fake_quant_int_bitwise(device, dtype, spec):
    from quantscope.kernels.triton import fakequant

    g = torch.Generator().manual_seed(spec.qmax)
    U, E = 9, 70
    u = (torch.randn(U, E, generator=g) * 3).to(dtype)
    scale = torch.rand(U, generator=g) * 0.2 + 0.01
    scale[0] = 0.25  # a power of two: exact ties x / s = k + 0.5, rounded to even
    u[0, :20] = ((torch.arange(20) - 10 + 0.5) * 0.25).to(dtype)
    zp = torch.randint(int(spec.qmin), int(spec.qmax) + 1, (U,), generator=g).float()
    if spec.symmetric:
        zp.zero_()
    zp[2] = 0.0  # small negatives round to the code -0, which torch.clamp keeps at qmin 0
    u[2, :4] = (-0.1 * scale[2]).to(dtype)
    u[1, 0] = float("nan")
    want = fake_quantize_units(u.float(), scale[:, None], zp[:, None], spec)
    got = fakequant.fake_quant_int(u.to(device), scale.to(device), zp.to(device),
                                   spec.qmin, spec.qmax, block_u=4, block_e=16)
    _assert_bitwise(got, want)


def test_fake_quant_int_grid_fits_cudas_limits(monkeypatch):
    """Found by a compile review: the element blocks went on CUDA's second grid axis (65535
    programs at most), so a unit of 2**26 elements failed to launch on a GPU (the interpreter
    has no limit). Here 70000 element blocks of one element each: the launch is recorded."""
    from quantscope.kernels.triton import fakequant

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(fakequant, "_fake_quant_kernel", Recorder())
    fakequant.fake_quant_int(torch.zeros(2, 70000), torch.ones(2), torch.zeros(2), -8.0, 7.0,
                             block_u=1, block_e=1)
    (grid,) = grids
    assert grid[0] == 2 * 70000 < 2 ** 31 and all(n <= 65535 for n in grid[1:])


# ---- MX (E8M0) and NVFP4 block scales ------------------------------------------------------

def _ranges(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ranges over float32's whole exponent span (subnormals, exact powers of two,
    all-zero and one-sided blocks)."""
    g = torch.Generator().manual_seed(seed)

    def draw():
        mant = torch.randn(n, generator=g)
        return mant * torch.exp2(torch.randint(-140, 120, (n,), generator=g).float())

    a, b = draw(), draw()
    a[:4], b[:2] = 0.0, 0.0
    a[4:8] = torch.exp2(torch.tensor([-130.0, -1.0, 0.0, 3.0]))  # exact powers of two
    b[4:8] = 0.0
    return torch.minimum(a, b), torch.maximum(a, b)


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp6_e2m3", "fp6_e3m2", "fp8_e4m3", "int8_narrow"])
@pytest.mark.parametrize("mode", E8M0_MODES)
def test_e8m0_block_scales_bitwise(device, fmt, mode):
    """Every mode on ranges over float32's span, and on blocks of inf (its exponent field:
    the scale saturates high), NaN (a NaN scale) and a few subnormals (rceil's quotient
    underflows; rceil's is a subnormal just above 2 ** -127, which a rounded quotient took
    onto it): ``scales.e8m0_scale`` bitwise (torchao's, tests/core/test_peers_core.py)."""
    from quantscope.kernels.triton import block_qparams

    f = get_format(fmt)
    lo, hi = _ranges(3000, len(fmt) + E8M0_MODES.index(mode))
    edge = f.max * 2.0 ** torch.tensor([-127.0, -128.0, -126.0])
    lo = torch.cat((lo, torch.zeros(6)))
    hi = torch.cat((hi, edge, torch.nextafter(edge, torch.ones(()))))
    inf, nan, sub = math.inf, math.nan, 2.0 ** -149
    lo = torch.cat((lo, torch.tensor([-inf, 0.0, nan, -1.0, 0.0, -sub])))
    hi = torch.cat((hi, torch.tensor([0.0, inf, 1.0, nan, 3 * sub, 2 * sub])))
    want = qparams_from_range(lo, hi, QuantSpec(fmt, Block(32), scale=f"e8m0:{mode}"),
                              check_finite=False).scale
    assert want[-6:-4].isfinite().all() and want[-4:-2].isnan().all()
    got = block_qparams.e8m0_block_scales(lo.to(device), hi.to(device), E8M0_MODES.index(mode),
                                          f.emax, f.mbits, f.max)
    _assert_bitwise(got, want)


@pytest.mark.parametrize("global_amax", [None, 0.0, 1e-30, 3.0, 1e30, 1e39, float("nan")])
def test_nvfp4_qparams_bitwise(device, global_amax):
    """The block scales with the global scale computed in-kernel from the global amax (given,
    or the ranges' largest found by one atomic per program): NVFP4's branch of
    ``qparams_from_range``, both outputs; an amax of 0, NaN or past float32 included."""
    from quantscope.formats import FP8_E4M3
    from quantscope.kernels.triton import block_qparams
    from quantscope.presets import NVFP4

    lo, hi = _ranges(3000, 9)
    lo, hi = lo.clamp(-1e6, 1e6), hi.clamp(-1e6, 1e6)
    ga = None if global_amax is None else torch.tensor(global_amax)
    want = qparams_from_range(lo, hi, NVFP4, global_amax=ga, check_finite=False)
    amax = (block_qparams.global_amax(lo.to(device), hi.to(device)) if ga is None
            else ga.float().reshape(1).to(device))
    block, gs = block_qparams.nvfp4_qparams(
        lo.to(device), hi.to(device), amax, NVFP4.format.max, FP8_E4M3.max, FP8_E4M3.min_exp,
        FP8_E4M3.mbits, NVFP4.min_scale)
    _assert_bitwise(block, want.scale)
    _assert_bitwise(gs, want.global_scale)


@pytest.mark.parametrize("global_amax", [None, 7.0])
def test_nvfp4_qparams_of_no_blocks_keeps_the_global_scale(device, global_amax):
    """No blocks (an empty tensor): the global scale still comes from ``global_amax``
    (448 * 6 / 7 for 7; 1 for the amax 0 of no ranges), as the CPU op's (found by probing:
    the launcher returned 1 without a launch)."""
    from quantscope.formats import FP8_E4M3
    from quantscope.kernels import ops
    from quantscope.kernels.triton import block_qparams
    from quantscope.presets import NVFP4

    lo = torch.empty(0)
    ga = None if global_amax is None else torch.tensor([global_amax])
    want = ops.nvfp4_qparams(lo, lo, ga, "fp4_e2m1", NVFP4.min_scale)  # the CPU op
    lo = lo.to(device)
    amax = block_qparams.global_amax(lo, lo) if ga is None else ga.to(device)
    block, gs = block_qparams.nvfp4_qparams(lo, lo, amax, NVFP4.format.max, FP8_E4M3.max,
                                            FP8_E4M3.min_exp, FP8_E4M3.mbits, NVFP4.min_scale)
    assert block.shape == (0,)
    _assert_bitwise(gs, want[1])


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -0.0])
def test_global_amax_is_torchs_max(device, bad):
    """The ranges' largest ``max(-min(lo, 0), max(hi, 0))``, NaN propagated (one in a
    thousand ranges), over several programs."""
    from quantscope.kernels.triton import block_qparams
    from quantscope.qparams import amax_of_range

    lo, hi = _ranges(5000, 4)
    if bad is not None:
        lo[1234], hi[4321] = bad, -bad if bad == bad else bad  # noqa: PLR0124
    want = amax_of_range(lo.clamp(max=0), hi.clamp(min=0)).max().reshape(1)
    got = block_qparams.global_amax(lo.to(device), hi.to(device))
    if want.isnan().all():  # a NaN (its payload is not part of the contract)
        assert got.isnan().all()
    else:
        _assert_bitwise(got, want)


INT_SPECS = [QuantSpec("int8"), QuantSpec("int8", symmetric=False), QuantSpec("uint8"),
             QuantSpec("uint8", symmetric=False), QuantSpec("int4", symmetric=False),
             QuantSpec("int2"), QuantSpec("int8_narrow"), QuantSpec("int16", symmetric=False),
             QuantSpec("uint16"), QuantSpec("int8", eps=1e-3),
             QuantSpec("int4", symmetric=False, eps=1e-20),
             QuantSpec("uint8", symmetric=False, quant_min=0, quant_max=127)]


@pytest.mark.parametrize("spec", INT_SPECS, ids=str)
def test_int_qparams_bitwise(device, spec):
    """The integer branch's scale and zero point (``qparams._affine_qparams``) over ranges
    from subnormal to near float32's max (the asymmetric span overflows there, and divides
    first), empty ranges and ranges on one side of zero."""
    from quantscope import kernels
    from quantscope.kernels.triton import block_qparams

    lo, hi = _ranges(3000, len(str(spec)))
    lo[10:20], hi[20:30] = lo[10:20].abs(), -hi[20:30].abs()  # all positive / all negative
    lo[30], hi[30] = -3.0e38, 3.0e38
    want = qparams_from_range(lo, hi, spec, check_finite=False)  # lo > hi among them
    scale, zp = block_qparams.int_qparams(lo.to(device), hi.to(device),
                                          *kernels.qparams_consts(spec))
    _assert_bitwise(scale, want.scale)
    assert torch.equal(zp.cpu(), want.zero_point)


# ---- the MSE search's pricing --------------------------------------------------------------

def _price_reference(units, scale, zp, spec, norm=2.0):
    """float64 sums of the float32 fake-quant errors' squares, exact in float64 (as
    mse_tiles and the C kernel square them; another ``norm``: torch's float32
    ``d.abs().pow(norm)``, as llm-compressor's error), candidate by candidate, on ``units``'
    device."""
    def term(d):
        return d.double().square() if norm == 2.0 else d.abs().pow(norm)

    rows = [term(fake_quantize_units(units, s[:, None], z[:, None].float(), spec) - units)
            .double().sum(1) for s, z in zip(scale, zp, strict=True)]
    return torch.stack(rows)


@pytest.mark.parametrize("spec", [QuantSpec("int4"), QuantSpec("int8", symmetric=False)], ids=str)
@pytest.mark.parametrize(("U", "E", "blocks"), [(6, 50, {}), (5, 300, {"block_e": 64}),
                                                (3, 8, {"block_u": 2})])
def test_mse_price_int(device, spec, U, E, blocks):
    from quantscope.kernels.triton import mse

    g = torch.Generator().manual_seed(U + E)
    units = torch.randn(U, E, generator=g) * 2
    lo, hi = torch.aminmax(units, dim=1)
    f = torch.linspace(1.0, 0.6, 9)[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
    scale, zp = qp.scale.contiguous(), qp.zero_point.contiguous()
    want = _price_reference(units, scale, zp, spec)
    got = mse.mse_price_int(units.to(device), scale.to(device), zp.to(device), spec.qmin,
                            spec.qmax, **blocks)
    assert got.dtype == torch.float64 and got.shape == want.shape
    # the float64 sum of exact squares: equal up to its order (the C kernel's contract)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")  # log2(0)
@pytest.mark.parametrize("norm", [1.0, 2.0, 3.0, 0.5, 1.5, 2.4])
@pytest.mark.parametrize(("spec", "blocks"), [(QuantSpec("int4"), {}),
                                              (QuantSpec("uint8", symmetric=False),
                                               {"block_e": 16}),
                                              (QuantSpec("fp4_e2m1"), {})], ids=str)
def test_mse_price_norms(device, spec, blocks, norm):
    """``|d| ** norm`` terms (llm-compressor's error: norm 2.4): torch's ``d.abs().pow(norm)``
    on the same device, summed in float64. Norms 1, 2 and 3 are exact arithmetic, so equal up
    to the sum's order; on CUDA so is 0.5 (sqrtf). Libdevice's powf without flush-to-zero
    came within an ulp a term of torch's CUDA pow on the lent H200, not equal; the
    interpreter's powf is float64 exp2 / log2 and torch's CPU pow and sqrt are not always
    correctly rounded: an ulp or two a term."""
    from quantscope.kernels.triton import mse

    g = torch.Generator().manual_seed(int(norm * 10))
    units = (torch.randn(5, 40, generator=g) * 3).to(device)
    units[0, :4] = 0.0  # |d| = 0: pow(0, norm) = 0
    lo, hi = torch.aminmax(units, dim=1)
    f = torch.linspace(1.0, 0.6, 6, device=device)[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
    scale, zp = qp.effective_scale.contiguous(), qp.zero_point.to(torch.int32).contiguous()
    want = _price_reference(units, scale, zp, spec, norm)
    if spec.is_float:
        fmt = spec.format
        got = mse.mse_price_fp(units, scale, fmt.max, fmt.min_exp, fmt.mbits, norm=norm,
                               **blocks)
    else:
        got = mse.mse_price_int(units, scale, zp, spec.qmin, spec.qmax, norm=norm, **blocks)
    # a Triton without enable_reflect_ftz flushes subnormals inside powf: an ulp or so off
    # on CUDA sqrtf is torch's; libdevice's powf is not quite (an ulp a term on the H200)
    exact = norm in (1.0, 2.0, 3.0) or (device.type == "cuda" and norm == 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12 if exact else 1e-6, atol=0)


@triton.jit
def _norm_kernel(d_ptr, out_ptr, n, NORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, norm_term(tl.load(d_ptr + offs, mask=mask, other=0.0), NORM),
             mask=mask)


@pytest.mark.parametrize("norm", [2.4, 1.5])
def test_norm_term_raises_to_the_float32_exponent(device, norm):
    """``|d| ** norm`` for a norm libdevice's ``powf`` computes takes the exponent as float32,
    as the compiled call and torch's float32 ``pow`` do: within an ulp of the correctly
    rounded ``|d| ** float32(norm)``. The interpreter multiplied by the float64 norm, 1.7e-6
    off at |d| = 1e8 (a gap of 9.5e-8 x |ln |d||: nothing at the tests' moderate |d|)."""
    d = torch.tensor([99999993.0, -3e-12, 123.456, 1.0, 7e-20, 3.0e15], device=device)
    out = torch.empty_like(d)
    _norm_kernel[(1,)](d, out, d.numel(), NORM=norm, BLOCK=8, **LAUNCH)
    e = float(torch.tensor(norm, dtype=torch.float32))
    want = d.double().abs().cpu().pow(e).float()
    torch.testing.assert_close(out.cpu(), want, rtol=2.0 ** -23, atol=0)


# ---- float element formats: rounding, fake-quant and pricing ------------------------------

FP_FORMATS = ["fp4_e2m1", "fp6_e3m2", "fp6_e2m3", "fp8_e4m3", "fp8_e5m2"]


@triton.jit
def _fp_kernel(x_ptr, s_ptr, out_ptr, n, fmax, min_exp, mbits, SCALED: tl.constexpr,
               BLOCK: tl.constexpr):
    """The jit helpers alone, element by element: ``fp_round(x)`` or ``fake_quant_fp(x, s)``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SCALED:
        s = tl.load(s_ptr + offs, mask=mask, other=1.0)
        out = fake_quant_fp(x, s, fmax, min_exp, mbits)
    else:
        out = fp_round(x, fmax, min_exp, mbits)
    tl.store(out_ptr + offs, out, mask=mask)


def _fp_helper(device, fmt, x, s=None) -> torch.Tensor:
    x = x.to(device)
    out = torch.empty_like(x)
    _fp_kernel[(triton.cdiv(x.numel(), 4096),)](
        x, x if s is None else s.to(device), out, x.numel(), fmt.max, fmt.min_exp, fmt.mbits,
        SCALED=s is not None, BLOCK=4096, **LAUNCH)
    return out


def _every_bfloat16() -> torch.Tensor:
    """All 65536 bfloat16 values as float32: +-0, subnormals, every binade, +-inf, NaNs."""
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return codes.view(torch.bfloat16).float()


def _assert_bitwise_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (the sign of zero included), but any NaN for a NaN: a GPU's division
    returns its canonical NaN where torch on the CPU keeps the payload."""
    got, want = got.cpu(), want.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    _assert_bitwise(got[~nan], want[~nan])


@pytest.mark.parametrize("name", FP_FORMATS)
def test_fp_round_every_bfloat16(device, name):
    """``_jit.fp_round`` is ``FloatFormat.round`` on every bfloat16 value: ties to even,
    subnormals, saturation at +-max (inf too), NaN kept, -0.0 kept."""
    fmt = get_format(name)
    x = _every_bfloat16()
    _assert_bitwise_nan(_fp_helper(device, fmt, x), fmt.round(x))


@pytest.mark.parametrize("name", FP_FORMATS)
def test_fake_quant_fp_every_bfloat16(device, name):
    """``_jit.fake_quant_fp`` is ``fake_quantize_units`` of the float format on every bfloat16
    value, under E8M0-like (powers of two, subnormal ones included) and NVFP4-like (any
    float32) scales, tiny and huge ones (``x / s`` past float32's range: saturated)."""
    fmt = get_format(name)
    x = _every_bfloat16()
    g = torch.Generator().manual_seed(len(name))
    fixed = torch.tensor([2.0 ** -3, 1.0, 2.0 ** 20, 2.0 ** -130, 1e-30, 3e30, 0.0123])
    s = torch.where(torch.rand(x.shape, generator=g) < 0.5,
                    fixed[torch.randint(len(fixed), x.shape, generator=g)],
                    torch.exp2(torch.rand(x.shape, generator=g) * 40 - 20))
    want = fake_quantize_units(x[None], s[None], torch.zeros(1, 1), QuantSpec(name))[0]
    _assert_bitwise_nan(_fp_helper(device, fmt, x, s), want)


def _fp_scales(amax: torch.Tensor, fmt, kind: str, K: int) -> torch.Tensor:
    """Candidate effective scales ``[K, U]`` of the ranges ``amax * f`` (f = 1 .. 0.8):
    ``"mx"`` E8M0 powers of two, ``"nvfp4"`` e4m3 block scales over a global scale."""
    from quantscope.formats import FP8_E4M3

    want = torch.linspace(1.0, 0.8, K)[:, None] * amax[None] / fmt.max
    if kind == "mx":
        return torch.exp2(torch.floor(torch.log2(want)))
    gs = FP8_E4M3.max * fmt.max / amax.max()
    return FP8_E4M3.round(want * gs).clamp(min=2.0 ** -9) / gs


def _fp_units(U: int, E: int, seed: int, specials: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Units of per-unit magnitudes 2 ** -8 .. 2 ** 8, and their absolute maxima before
    ``specials`` put NaN, +-inf, an all-zero row (-0.0 in it), huge and subnormal values in."""
    g = torch.Generator().manual_seed(seed)
    units = torch.randn(U, E, generator=g) * torch.exp2(
        torch.randint(-8, 9, (U, 1), generator=g).float())
    amax = units.abs().amax(1)
    if specials:
        units[0, 1] = float("nan")
        units[1, :2] = torch.tensor([float("inf"), -float("inf")])
        units[2] = 0.0
        units[2, ::2] = -0.0
        units[3, :3] = torch.tensor([3e38, -3e38, 1e-40])
    return units, amax


def _price_fp_reference(units, scale, name):
    """float64 sums of squared fake-quant errors, candidate by candidate (torch's rounding)."""
    return _price_reference(units, scale, torch.zeros_like(scale), QuantSpec(name))


@pytest.mark.parametrize(("U", "E", "blocks", "kind", "name"), each_value(
    [(5, 16, {}), (4, 32, {"block_u": 2}), (6, 40, {}), (4, 40, {"block_e": 16})],
    ["mx", "nvfp4"], FP_FORMATS, ids=lambda v: str(v).replace(" ", "")))
def test_mse_price_fp(device, name, kind, U, E, blocks):
    """Every candidate priced on every unit equals torch's float64 sum of its float32 errors
    up to the order of the sum; NaN, infinite, zero and huge elements as torch."""
    from quantscope.kernels.triton import mse

    fmt = get_format(name)
    units, amax = _fp_units(U, E, U * E + len(name), specials=U >= 4)
    scale = _fp_scales(amax, fmt, kind, 7)
    want = _price_fp_reference(units, scale, name)
    got = mse.mse_price_fp(units.to(device), scale.to(device), fmt.max, fmt.min_exp, fmt.mbits,
                           **blocks)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", FP_FORMATS)
def test_mse_price_fp_bitwise_where_the_sum_is_exact(device, name):
    """Dyadic elements (multiples of 1 / 32) under power-of-two scales: every error, square
    and float64 partial sum is exact, so the kernel's sum is torch's bit for bit."""
    from quantscope.kernels.triton import mse

    fmt = get_format(name)
    g = torch.Generator().manual_seed(len(name))
    units = torch.randint(-96, 97, (5, 40), generator=g).float() / 32
    scale = torch.exp2(torch.randint(-6, 3, (6, 5), generator=g).float())
    got = mse.mse_price_fp(units.to(device), scale.to(device), fmt.max, fmt.min_exp, fmt.mbits)
    assert torch.equal(got.cpu(), _price_fp_reference(units, scale, name))


def test_mse_price_fp_rows_past_one_tile(device):
    """A row longer than ``MAX_TILE`` is walked tile by tile."""
    from quantscope.kernels.triton import mse

    fmt = get_format("fp4_e2m1")
    units, amax = _fp_units(1, mse.MAX_TILE + 40, 3, specials=False)
    scale = _fp_scales(amax, fmt, "nvfp4", 2)
    got = mse.mse_price_fp(units.to(device), scale.to(device), fmt.max, fmt.min_exp, fmt.mbits)
    torch.testing.assert_close(got.cpu(), _price_fp_reference(units, scale, "fp4_e2m1"),
                               rtol=1e-12, atol=0)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(FP_FORMATS), kind=st.sampled_from(["mx", "nvfp4"]),
       U=st.integers(1, 5), E=st.integers(1, 70), K=st.integers(1, 4),
       block_e=st.sampled_from([None, 8, 32]), seed=st.integers(0, 2 ** 16))
def test_mse_price_fp_property(device, name, kind, U, E, K, block_e, seed):
    from quantscope.kernels.triton import mse

    fmt = get_format(name)
    units, amax = _fp_units(U, E, seed, specials=False)
    scale = _fp_scales(amax.clamp(min=1e-3), fmt, kind, K)
    got = mse.mse_price_fp(units.to(device), scale.to(device), fmt.max, fmt.min_exp, fmt.mbits,
                           block_e=block_e)
    torch.testing.assert_close(got.cpu(), _price_fp_reference(units, scale, name), rtol=1e-12,
                               atol=0)


def _select_case(K: int, U: int, seed: int, incumbent: bool):
    """Random prices with ties and plateaus, the qparams that make the plateaus, and the
    reference choice of ``mse_tiles._State``, stepped candidate by candidate."""
    from quantscope.estimators.mse_tiles import _State

    g = torch.Generator().manual_seed(seed)
    err = torch.randint(0, 12, (K, U), generator=g).double() / 4  # many ties
    err -= torch.linspace(0, 1.5, K, dtype=torch.float64)[:, None]  # a trend to improve on
    same = torch.rand(K, U, generator=g) < 0.3
    sc = torch.randint(1, 1000, (K, U), generator=g).float()
    sc[0] = torch.where(same[0], 7.0, sc[0])  # the incumbent's scale is 7
    for k in range(1, K):
        sc[k] = torch.where(same[k], sc[k - 1], sc[k] + 2000)
    inc = torch.full((U,), 1.0 if incumbent else torch.finfo(torch.float64).max,
                     dtype=torch.float64)
    if not incumbent:
        same[0] = False  # llm-compressor: no previous qparams to compare the first with
    return err, same, sc, inc, _State


def _reference_select(err, same, sc, inc, state_cls, ext_start, patience, per_unit,
                      use_global, tie):
    U = err.shape[1]
    zero = torch.zeros(U)
    prev = (torch.full((U,), 7.0), torch.zeros(U)) if inc[0] < 2 else None
    st = state_cls(zero.clone(), zero.clone(), inc.clone(), prev)
    for i in range(err.shape[0]):
        st.step(i, err[i], zero, zero, sc[i], zero, patience=patience, per_unit=per_unit,
                tie=tie, use_global=use_global and i < ext_start)
    return st.idx, st.err


@pytest.mark.parametrize(("per_unit", "use_global", "patience", "incumbent", "ext"), [
    (True, True, 3, True, 14), (True, True, 2, True, 20), (True, False, 3, True, 20),
    (False, True, 2, False, 20), (False, True, 5, False, 20), (True, True, None, True, 20),
])
@pytest.mark.parametrize("tie", ["first", "last"])
def test_mse_select_matches_the_search_state(device, per_unit, use_global, patience,
                                             incumbent, ext, tie):
    from quantscope.kernels import ops, select_ops
    from quantscope.kernels.triton import mse

    err, same, sc, inc, state_cls = _select_case(20, 37, 3 + ext, incumbent)
    want_idx, want_best = _reference_select(err, same, sc, inc, state_cls, ext, patience,
                                            per_unit, use_global, tie)
    p = -1 if patience is None else patience
    cpu = ops.mse_select(err, same, inc, ext, p, per_unit, use_global, tie == "last")
    assert torch.equal(cpu[0], want_idx) and torch.equal(cpu[1], want_best)
    gstop = select_ops._global_stop(err, inc, ext, p, tie == "last").to(device)
    idx, best = mse.mse_select(err.to(device), same.to(device), inc.to(device), gstop, ext,
                               patience, per_unit, use_global, tie == "last", block_u=16)
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(best.cpu(), want_best)


@pytest.mark.parametrize("per_unit", [True, False])
def test_mse_select_passes_over_nan_errors_as_the_search_state(device, per_unit):
    # the global rule's running best followed torch's cummin: after a unit's NaN error none
    # of its later improvements counted, where the search's state (no NaN best) counts them
    from quantscope.kernels import ops, select_ops
    from quantscope.kernels.triton import mse

    err, same, sc, inc, state_cls = _select_case(20, 37, 23, False)
    err[torch.rand(err.shape, generator=torch.Generator().manual_seed(1)) < 0.15] = math.nan
    want = _reference_select(err, same, sc, inc, state_cls, 20, 2, per_unit, True, "first")
    cpu = ops.mse_select(err, same, inc, 20, 2, per_unit, True, False)
    assert torch.equal(cpu[0], want[0]) and torch.equal(cpu[1], want[1])
    gstop = select_ops._global_stop(err, inc, 20, 2, False).to(device)
    idx, best = mse.mse_select(err.to(device), same.to(device), inc.to(device), gstop, 20, 2,
                               per_unit, True, False, block_u=16)
    assert torch.equal(idx.cpu(), want[0]) and torch.equal(best.cpu(), want[1])


# ---- histogram binning ---------------------------------------------------------------------

@pytest.mark.parametrize(("U", "E", "bins", "chunk", "absolute", "dtype", "counted"), each_value(
    [(3, 500, 64, None), (2, 700, 50, 128), (1, 3000, 2048, 1024), (5, 40, 8, 90)],
    [False, True], DTYPES, [True, False]))  # counted: histc's counts, or the private ones
def test_hist_add_bitwise(device, dtype, absolute, U, E, bins, chunk, counted):
    """Counts after two batches, the second one widening the range (the grid coarsens and
    the old counts move onto it: stats.histogram.update), equal the torch path's; by bins
    counted with torch.histc (``chunk`` values a slice: columns of a row, or 2 rows of 40)
    and by private histograms (``chunk`` values a program)."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    g = torch.Generator().manual_seed(U * E + bins)
    batches = [(torch.randn(U, E, generator=g) * s).to(dtype) for s in (1.0, 9.0)]
    batches[1][0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-30])
    want = got = H.empty_state(U, bins)
    for b in batches:
        lo, hi = torch.aminmax(b.float().nan_to_num(0.0, 0.0, 0.0), dim=1)
        want = H.HistState(*H._update_grid(want, lo, hi, absolute))
        H._add_values_torch(want.counts, b.float(), want.exp, want.first, absolute)
        got = H.HistState(*H._update_grid(got, lo, hi, absolute))
        counts = got.counts.to(device)
        tri.hist_add(counts, b.to(device), got.exp.to(device), got.first.to(device), absolute,
                     chunk=chunk, block_e=256, counted=counted)
        got = got._replace(counts=counts.cpu())
    assert torch.equal(got.counts, want.counts) and int(want.counts.sum()) == 2 * U * E


def test_hist_add_counts_privately_past_shared_memory_or_deterministic(monkeypatch):
    # histc counts fast in shared memory only (about 6,100 bins), and its CUDA kernel is
    # flagged nondeterministic: past it, under deterministic algorithms (and while a CUDA
    # graph is captured) the private histograms count (the kernel is not run here)
    from quantscope.kernels.triton import histogram as tri

    taken = []
    monkeypatch.setattr(tri, "_counted_add", lambda *a: taken.append("histc"))
    monkeypatch.setattr(tri, "_hist_kernel", type("K", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: taken.append("private")})())
    args = (torch.zeros(1, 8, dtype=torch.int64), torch.ones(1, 4), torch.zeros(1, dtype=
            torch.int64), torch.zeros(1, dtype=torch.int64), False)
    tri.hist_add(*args)
    many = torch.zeros(3, tri.SHARED_BINS // 2, dtype=torch.int64)  # past shared memory
    tri.hist_add(many, torch.ones(3, 4), *args[2:])
    torch.use_deterministic_algorithms(True)
    try:
        tri.hist_add(*args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert taken == ["histc", "private", "private"]


def test_bin_kernel_writes_its_rows_times_cols_and_nothing_past(device):
    # the histc path's bin numbers, rows x cols of them from row0 / c0 on, each row's last
    # block masked: a slot past them (the next row's first, or past the buffer: on a GPU a
    # race and an out-of-bounds write) must keep its sentinel. Counts alone cannot tell, as
    # histc reads only rows x cols of the buffer
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    U, E, B, rows, C, row0, c0 = 4, 300, 16, 2, 100, 1, 50
    x = torch.randn(U, E, generator=torch.Generator().manual_seed(6))
    exp = torch.full((U,), -4, dtype=torch.int64)
    first = torch.full((U,), -8, dtype=torch.int64)
    idx = torch.full((rows * C + 4,), -7.0, dtype=torch.float64)
    d = idx.to(device)
    tri._bin_kernel[(rows, triton.cdiv(C, 64))](
        x.to(device), d, exp.to(device), first.to(device), row0, c0, C, x.stride(0), B,
        ABSOLUTE=False, BLOCK_E=64, **LAUNCH)
    part = x[row0:row0 + rows, c0:c0 + C]
    want = H._bin(part * H.pow2(-exp[0]), first[0].float(), B, False).double()
    want += torch.arange(rows, dtype=torch.float64)[:, None] * B
    idx = d.cpu()
    assert torch.equal(idx[:rows * C], want.flatten())
    assert idx[rows * C:].tolist() == [-7.0] * 4


def test_histc_of_a_span_past_float32_is_torch_histc(device):
    # finite in float64, inf in float32: the op left it to the kernel, which the interpreter
    # refused (an fp64 span); it is torch's degenerate case, run on the torch path
    from quantscope.stats import ao_histogram

    # (torch's on the same device: CUDA's histc bins these cases its own way, the lent H200
    # found, and torch.ao's observer on CUDA takes its result)
    x = torch.tensor([0.5, -1e38, 2e38], device=device)
    want = torch.histc(x, 4, min=-3e38, max=3e38)
    assert torch.equal(ao_histogram._cuda_histc(x, 4, -3e38, 3e38), want)


def test_histc_whose_bin_position_overflows_float32_is_torch_histc(device):
    """A finite span whose ``(x - lo) * bins`` passes float32's max: the kernel's bin of an
    infinite position lost 4 of 5 values (found by probing); torch's own result there."""
    from quantscope.stats import ao_histogram

    x = torch.tensor([-3.0e38, -1.0e38, -1.0, -0.5, 0.0], device=device)
    want = torch.histc(x, 3, min=-3.4e38, max=0.0)  # (on the same device, as above)
    assert torch.equal(ao_histogram._cuda_histc(x, 3, -3.4e38, 0.0), want)


# ---- an observer's state step: the non-finite flag and the min / max state update ----------

def _state_case(n, seed, bad):
    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(n, generator=g) * 3
    hi = lo + torch.rand(n, generator=g)
    if bad is not None:  # a unit whose min and max hold it (as a real min / max pair does)
        lo[n // 2] = -math.inf if bad == "-inf" else float(bad)
        hi[n // 2] = math.inf if bad == "inf" else (hi[n // 2] if bad == "-inf" else float(bad))
    state_lo = torch.randn(n, generator=g)
    state_hi = state_lo + 2
    state_lo[n - 1] = math.nan  # a state that holds NaN keeps it, as torch.minimum does
    return lo, hi, state_lo, state_hi


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise but for NaN payloads (torch's minimum and Triton's pick different NaN bits)."""
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    _assert_bitwise(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("kind", ["min", "ema", "ema_lerp"])
@pytest.mark.parametrize("c", [0.01, 0.3, 1 / 3])
@pytest.mark.parametrize("n", [1, 1000, 2500])
def test_state_update_is_update_state(device, kind, c, n):
    from quantscope.kernels.triton import minmax
    from quantscope.stats.minmax import UPDATES, update_state

    lo, hi, slo, shi = _state_case(n, n, None)
    want_lo, want_hi = slo.clone(), shi.clone()
    update_state(kind, c, want_lo, want_hi, lo.clone(), hi.clone())  # the torch path (CPU)
    got_lo, got_hi = slo.to(device), shi.to(device)
    minmax.update_state(lo.to(device), hi.to(device), got_lo, got_hi, None, UPDATES[kind], c)
    _same(got_lo, want_lo)
    _same(got_hi, want_hi)


@pytest.mark.parametrize("bad", [None, "nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [1, 3000])
def test_state_records_non_finite_as_the_observers_check(device, bad, n):
    """``seen`` set exactly where the observers' check (smallest min, largest max not finite)
    sets it, and never cleared."""
    from quantscope.kernels.triton import minmax

    lo, hi, _, _ = _state_case(n, 7, bad)
    want = bool(~torch.isfinite(torch.stack((lo.amin(), hi.amax()))).all())
    seen = torch.zeros((), dtype=torch.bool, device=device)
    minmax.update_state(lo.to(device), hi.to(device), None, None, seen, 0, 0.0)
    assert bool(seen) == want
    seen.fill_(True)
    minmax.update_state(lo.isfinite().float().to(device), hi.isfinite().float().to(device), None,
                        None, seen, 0, 0.0)
    assert bool(seen)  # a finite batch does not clear it


# ---- the histogram's grid change (stats.histogram._update_grid) ----------------------------

def _magnitude(draw_exp: int, mant: float) -> float:
    """``mant * 2 ** draw_exp`` as a float32 (subnormals included, 2 ** -149 up)."""
    return float(torch.tensor(math.ldexp(mant, draw_exp), dtype=torch.float32))


_EXPS = st.one_of(st.integers(-149, -120), st.integers(-30, 30), st.integers(110, 125))
_END = st.one_of(st.just(0.0), st.just(-0.0),
                 st.builds(_magnitude, _EXPS, st.floats(1.0, 2.0, exclude_max=True)))


@st.composite
def _batches(draw, U):
    """Per-unit batch min / max pairs: zero ranges, tiny and huge magnitudes, either sign."""
    lo, hi = [], []
    for _ in range(U):
        a = draw(_END) * draw(st.sampled_from([-1.0, 1.0]))
        b = draw(_END) * draw(st.sampled_from([-1.0, 1.0]))
        lo.append(min(a, b))
        hi.append(max(a, b))
    return torch.tensor(lo), torch.tensor(hi)


def _assert_same_state(got, want) -> None:
    for name, a, b in zip(("counts", "exp", "first", "lo", "hi"), got, want):
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        same = (a.view(torch.int32) == b.view(torch.int32)) if a.is_floating_point() else a == b
        assert bool(same.all()), (name, a, b)


@settings(max_examples=15, deadline=None)
@given(U=st.sampled_from([1, 5]), bins=st.sampled_from([2, 16, 128, 2048]),
       absolute=st.booleans(), block=st.sampled_from([64, 1024]), data=st.data())
def test_hist_regrid_is_update_grid(device, U, bins, absolute, block, data):
    """The grid change in one launch equals ``_update_grid`` bit for bit (counts, exponent,
    first bin, running lo / hi) along a run of batches from an empty state (E_MIN, +-inf):
    growing ranges, zero ranges, magnitudes near E_MIN and E_MAX, counts in every bin."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    state = H.empty_state(U, bins)
    for step in range(data.draw(st.integers(1, 4), label="batches")):
        lo, hi = data.draw(_batches(U), label=f"batch {step}")
        want = H._update_grid(state, lo, hi, absolute)
        got = [t.to(device, copy=True) for t in state]
        tri.regrid_(*got, lo.to(device), hi.to(device), absolute, block=block)
        _assert_same_state(got, want)
        seed = data.draw(st.integers(0, 2 ** 31 - 1), label="counts")
        more = torch.randint(0, 1 << 40, (U, bins), generator=torch.Generator().manual_seed(seed))
        state = want._replace(counts=want.counts + more * (torch.rand(U, bins) < 0.5))


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_regrid_in_place_moves_only_the_units_whose_grid_moves(device, absolute):
    """In place, one launch: a unit whose grid stays (its batch inside the range, or a wider
    top inside the grid's slack) keeps its counts as they are; one whose first bin moves at
    the same width (a lower bottom: m = 0) and one whose width grows are re-binned, all as
    ``_update_grid``, and the state's own tensors hold the result."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    # 64 bins over [-1, 1]: width 2 ** -4, bins -16 .. 47 (room above 1, none below -1)
    state = H._update_grid(H.empty_state(4, 64), -torch.ones(4), torch.ones(4), absolute)
    state = state._replace(counts=torch.randint(1, 1000, (4, 64),
                                                generator=torch.Generator().manual_seed(3)))
    lo = torch.tensor([-0.5, -1.0, -1.5, -300.0])  # inside; inside; first moves; width grows
    hi = torch.tensor([0.5, 1.5, 1.0, 1.0])
    want = H._update_grid(state, lo, hi, absolute)
    got = [t.to(device, copy=True) for t in state]
    held = [t.data_ptr() for t in got]
    tri.regrid_(*got, lo.to(device), hi.to(device), absolute, block=16)
    _assert_same_state(got, want)
    assert [t.data_ptr() for t in got] == held
    stays = [0, 1] if not absolute else [0]  # |x|: the wider bottom is a wider top
    assert torch.equal(want.counts[stays], state.counts[stays])
    assert not torch.equal(want.counts[2:], state.counts[2:])
    if not absolute:  # the first bin moved, the width did not
        assert want.exp[2] == state.exp[2] and want.first[2] != state.first[2]


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_regrid_a_width_growing_past_2_to_the_63(device, absolute):
    """A range growing from 2 ** -100 to 2 ** 100 widens the bins by 2 ** 200: the shift
    that re-bins them is clamped (an int64 shift by 64 or more is undefined on the GPU),
    and every count lands in the one or two bins about zero, as ``_update_grid``."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    state = H._update_grid(H.empty_state(2, 64), torch.tensor([-2.0 ** -100, -1e-30]),
                           torch.tensor([2.0 ** -100, 3e-30]), absolute)
    state = state._replace(counts=torch.randint(1, 1000, (2, 64),
                                                generator=torch.Generator().manual_seed(3)))
    lo, hi = torch.tensor([-2.0 ** 100, -1e30]), torch.tensor([2.0 ** 100, 1e30])
    want = H._update_grid(state, lo, hi, absolute)
    assert bool((want.exp - state.exp > 63).all())  # the case
    got = [t.to(device, copy=True) for t in state]
    tri.regrid_(*got, lo.to(device), hi.to(device), absolute, block=16)
    _assert_same_state(got, want)
    assert torch.equal(want.counts.sum(1), state.counts.sum(1))


def test_hist_regrid_constants_are_the_histograms():
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    assert (tri.E_MIN.value, tri.E_MAX.value, tri.MAG_BITS.value) == \
        (H.E_MIN, H.E_MAX, H._MAG_BITS)


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_regrid_collapses_many_bins_into_few(device, absolute):
    """A range that grows by 2 ** 40 moves all 2048 bins into one or two: the adds that land
    on one bin (atomics within the program) sum exactly."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    state = H._update_grid(H.empty_state(3, 2048), torch.tensor([-1.0, 0.0, -1e-3]),
                           torch.tensor([1.0, 2.0, 0.0]), absolute)
    state = state._replace(counts=torch.randint(1, 1 << 50, (3, 2048)))
    lo, hi = torch.tensor([-2.0 ** 40, -3.0, -1e9]), torch.tensor([2.0 ** 41, 1e12, 5.0])
    want = H._update_grid(state, lo, hi, absolute)
    got = [t.to(device, copy=True) for t in state]
    tri.regrid_(*got, lo.to(device), hi.to(device), absolute)
    _assert_same_state(got, want)
    assert (want.counts > 0).sum(1).max() <= 3  # the case it claims: a few bins take all
