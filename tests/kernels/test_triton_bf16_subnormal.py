"""bfloat16 subnormals through every Triton kernel that reads bfloat16 input, bitwise against
the torch path: per-unit min / max (2-D, 4-D, grouped), integer fake-quant, histogram
binning (``hist_add``, ``histc``). The MSE pricing and block searches take float32 only.

Triton's interpreter widens a bfloat16 subnormal to a wrong float32 (its ``_convert_float``
clamps the exponent: ``-1e-40`` read as ``0.0``), so the CPU run could not prove these
values until the kernels widened through ``_jit.widen``. float16 runs alongside, as the
control. Run as tests/kernels/test_triton_kernels.py runs (the interpreter on the CPU
without a GPU, compiled with one; a child process where triton was imported first).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from triton_interpreter import fresh_interpreter_test

from quantscope import QuantSpec
from quantscope.kernels.triton._jit import LAUNCH, widen
from quantscope.qdq import fake_quantize_units

DTYPES = [torch.bfloat16, torch.float16]
#: the mantissa bits of each (the smallest normal's bit pattern is 1 << them)
MANT = {torch.bfloat16: 7, torch.float16: 10}

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (the sign of zero included), any NaN for a NaN (a GPU's may differ)."""
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    diff = (got[~nan].view(torch.int32) != want[~nan].view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first: " \
        f"{got[~nan][diff[0]].item()!r} vs {want[~nan][diff[0]].item()!r}"


def _codes(dtype, codes: torch.Tensor) -> torch.Tensor:
    """The 16-bit values of the bit patterns ``codes`` (int, 0 .. 65535)."""
    return torch.where(codes >= 32768, codes - 65536, codes).to(torch.int16).view(dtype)


def _mixed(dtype, U: int, E: int, seed: int) -> torch.Tensor:
    """``[U, E]`` of ``dtype``: unit 0 all subnormal (and +-0), the others normals with
    ~40 % subnormals of both signs among them; units 0 and 1 start with +-the smallest and
    +-the largest subnormal and +-0, unit 1 with the smallest normal too."""
    g = torch.Generator().manual_seed(seed)
    top = 1 << MANT[dtype]  # the smallest normal's code
    sub = torch.randint(1, top, (U, E), generator=g) + 32768 * torch.randint(
        0, 2, (U, E), generator=g)
    pick = torch.rand(U, E, generator=g) < 0.4
    pick[0] = True
    x = torch.where(pick, _codes(dtype, sub), (torch.randn(U, E, generator=g) * 3).to(dtype))
    fixed = _codes(dtype, torch.tensor([1, 32769, top - 1, 32768 + top - 1, 32768, 0, top]))
    x[0, :6] = fixed[:6]
    x[1, :7] = fixed
    return x


@triton.jit
def _widen_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, widen(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_widen_is_torchs_float_on_every_value(device, dtype):
    x = _codes(dtype, torch.arange(65536))
    out = torch.empty(x.shape, dtype=torch.float32, device=device)
    _widen_kernel[(triton.cdiv(x.numel(), 8192),)](x.to(device), out, x.numel(), BLOCK=8192,
                                                   **LAUNCH)
    _assert_bitwise(out, x.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocks", [{}, {"block_e": 8, "splits": 3}])
def test_unit_minmax_of_subnormals(device, dtype, blocks):
    from quantscope.kernels.triton import minmax

    x = _mixed(dtype, 5, 40, seed=1)
    lo, hi = minmax.unit_minmax(x.to(device), **blocks)
    want_lo, want_hi = torch.aminmax(x.float(), dim=1)
    assert want_hi[0] < torch.finfo(dtype).smallest_normal  # unit 0's: subnormals
    _assert_bitwise(lo, want_lo)
    _assert_bitwise(hi, want_hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unit_minmax_four_d_of_subnormals(device, dtype):
    """Units along a middle axis: the ``[U1, U2, E1, E2]`` view ``[C, 1, A, B]``."""
    from quantscope.kernels.triton import minmax

    u = _mixed(dtype, 4, 36, seed=2)
    x = u.reshape(4, 6, 6).permute(1, 0, 2).contiguous()  # [A, C, B]: unit c is x[:, c]
    lo, hi = minmax.unit_minmax(x.to(device).permute(1, 0, 2).unsqueeze(1), block_e=8)
    want_lo, want_hi = torch.aminmax(u.float(), dim=1)
    _assert_bitwise(lo, want_lo)
    _assert_bitwise(hi, want_hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_unit_minmax_of_subnormals(device, dtype):
    from quantscope.kernels.triton import minmax

    ts = [_mixed(dtype, 3, 37, seed=3), _mixed(dtype, 9, 20, seed=4)[:, :13]]
    los, his = minmax.grouped_unit_minmax([t.to(device) for t in ts], block_u=2, block_e=16)
    for t, lo, hi in zip(ts, los, his, strict=True):
        want_lo, want_hi = torch.aminmax(t.float(), dim=1)
        _assert_bitwise(lo, want_lo)
        _assert_bitwise(hi, want_hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("uint8", symmetric=False)],
                         ids=str)
def test_fake_quant_int_of_subnormals(device, dtype, spec):
    """Scales from subnormal float32 up to normal: the codes of subnormal inputs are whole
    numbers, or the signed zeros that ``torch.clamp`` keeps."""
    from quantscope.kernels.triton import fakequant

    u = _mixed(dtype, 6, 40, seed=5)
    scale = torch.tensor([2.0 ** -133, 1e-41, 2.0 ** -126, 3e-39, 0.05, 1.0])
    zp = torch.zeros(6) if spec.symmetric else torch.tensor([0.0, 3.0, 128.0, 0.0, 7.0, 0.0])
    want = fake_quantize_units(u.float(), scale[:, None], zp[:, None], spec)
    got = fakequant.fake_quant_int(u.to(device), scale.to(device), zp.to(device), spec.qmin,
                                   spec.qmax, block_u=4, block_e=16)
    _assert_bitwise(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("absolute", [False, True])
def test_hist_add_of_subnormals(device, dtype, absolute):
    """bfloat16's unit 0 (subnormals only) on the finest grid, ``2 ** -126``: a negative
    subnormal's bin is -1, a positive one's 0; the mixed units on coarser grids."""
    from quantscope.kernels.triton import histogram as tri
    from quantscope.stats import histogram as H

    x = _mixed(dtype, 3, 300, seed=6)
    lo, hi = torch.aminmax(x.float(), dim=1)
    state = H.HistState(*H._update_grid(H.empty_state(3, 64), lo, hi, absolute))
    assert dtype != torch.bfloat16 or int(state.exp[0]) == -126
    want = state.counts.clone()
    H._add_values_torch(want, x.float(), state.exp, state.first, absolute)
    counts = state.counts.to(device)
    tri.hist_add(counts, x.to(device), state.exp.to(device), state.first.to(device), absolute,
                 chunk=128, block_e=64)
    assert torch.equal(counts.cpu(), want) and int(want.sum()) == x.numel()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ends", [(-0.9, 1.1), (-1e38, 2e38)])
def test_histc_of_subnormals(device, dtype, ends, monkeypatch):
    """``torch.histc`` of the float32 values over ends in units of the dtype's smallest
    normal: about its subnormals' range (the bins tell them apart), and far wider (they
    fall beside zero)."""
    from quantscope.stats import ao_histogram, histogram

    monkeypatch.setattr(histogram, "_HISTC_CHUNK", 128)  # in chunks, whose counts are summed
    x = _mixed(dtype, 2, 500, seed=7).flatten()
    tiny = torch.finfo(dtype).smallest_normal
    lo, hi = (float(torch.tensor(e * tiny, dtype=torch.float32)) for e in ends)
    want = torch.histc(x.float(), 50, min=lo, max=hi)
    assert int(want.sum()) >= 400  # the subnormals are counted
    assert torch.equal(ao_histogram._cuda_histc(x.to(device), 50, lo, hi).cpu(), want)
