"""Float element formats whose rounding step reaches float32's top binade, bitwise.

``FloatFormat.round`` divides by the step ``2 ** (e - mbits)``; the C SIMD ``fqv``
(csrc/qs_fakequant.h) and Triton's ``_jit.fp_round`` multiply by its reciprocal, built as
the bit pattern ``(254 << 23) - step``, which is a normal float32 only up to the step
``2 ** 126``. The step ``2 ** 127`` (``mbits = 0`` with ``|t|`` in ``[2 ** 127, 2 ** 128)``,
inf or NaN; ``min_exp = 127``, which ``mse_price_fp`` takes) and the step inf (inf and NaN
at ``mbits = 0``) must still round as the division does. Here every step from ``2 ** 97`` to
``2 ** 127`` and inf, for mbits 0 .. 3: the C kernel's AVX-512 (native), AVX2 and scalar
builds, Triton (under its interpreter without a GPU), and ``FloatFormat.round``.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
from march_builds import cpu_has
from triton_interpreter import fresh_interpreter_test

from quantscope import kernels
from quantscope.formats import FloatFormat
from quantscope.kernels import ops  # noqa: F401 (registers the quantscope:: ops)
from quantscope.kernels import triton as qs_triton
from quantscope.kernels.price_ops import _FloatBounds, _torch_price

F32_MAX = torch.finfo(torch.float32).max
#: e8m0 (mbits 0 reaches the top binade with 8 exponent bits, the most FloatFormat allows),
#: and the bounds of e8m0 / e7m1 .. e7m3 grids with max raised to float32's (no FloatFormat
#: holds that max: the pricers take any bounds), so the top binade's codes are finite
BOUNDS = [_FloatBounds(2.0 ** 127, -126, 0), _FloatBounds(F32_MAX, -126, 0),
          *(_FloatBounds(F32_MAX, -62, m) for m in (1, 2, 3))] + \
    [_FloatBounds(F32_MAX, 127, m) for m in range(4)]  # min_exp 127 (mse_price_fp's largest):
# every finite t's step is 2 ** (127 - mbits)
IDS = [f"max{b.max:.3g}_minexp{b.min_exp}_m{b.mbits}" for b in BOUNDS]
SCALES = (1.0, 2.0 ** -100, 3.0, 0.7)

if qs_triton.available():
    import triton
    import triton.language as tl

    from quantscope.kernels.triton import mse as triton_mse
    from quantscope.kernels.triton._jit import LAUNCH, fake_quant_fp, fp_round

    @triton.jit
    def _fp_kernel(x_ptr, out_ptr, n, s, fmax, min_exp, mbits, SCALED: tl.constexpr,
                   BLOCK: tl.constexpr):
        """``fp_round(x)``, or ``fake_quant_fp(x, s) - x``, element by element."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if SCALED:
            out = fake_quant_fp(x, s, fmax, min_exp, mbits) - x
        else:
            out = fp_round(x, fmax, min_exp, mbits)
        tl.store(out_ptr + offs, out, mask=mask)

needs_triton = pytest.mark.skipif(not qs_triton.available(), reason="no triton (gpu extra)")
test_in_a_fresh_interpreter = needs_triton(fresh_interpreter_test(__file__))
# numpy (the interpreter) warns where float32 overflows and where inf / inf makes NaN
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _top_binades() -> torch.Tensor:
    """float32 ``t`` of exponents 96 .. 127 (the steps 2 ** 93 .. 2 ** 127 for mbits 0 .. 3):
    every sixteenth of a binade (the ties of mbits <= 3) and an ulp either side, random
    mantissas, float32's max, both signs; with +-inf, NaN, zeros, 1 and the smallest ones
    (which min_exp 127 rounds with the step 2 ** 127 too)."""
    base = torch.exp2(torch.arange(96, 128, dtype=torch.float64))[:, None]
    frac = 1 + torch.arange(16, dtype=torch.float64) / 16
    g = torch.Generator().manual_seed(0)
    m = torch.cat([frac, frac + 2.0 ** -23, frac - 2.0 ** -24,
                   1 + torch.rand(16, generator=g, dtype=torch.float64)])
    t = (base * m[None]).float().flatten()
    t = torch.cat([t, torch.tensor([F32_MAX, float("inf"), float("nan"), 0.0, 1.0,
                                    2.0 ** -126, 1e-45, 2.0 ** -125 * 1.375])])
    return torch.cat([t, -t])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().cpu().view(torch.int32)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, nan_bits: bool = True) -> None:
    """Bit for bit (the sign of zero included); ``nan_bits=False``: any NaN for a NaN (a
    GPU's division returns its canonical NaN where torch on the CPU keeps the payload)."""
    got, want = got.cpu(), want.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), (got[got.isnan() != nan], want[got.isnan() != nan])
    keep = torch.ones_like(nan) if nan_bits else ~nan
    bad = (_bits(got[keep]) != _bits(want[keep])).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ: {got[keep][bad][:4]} vs {want[keep][bad][:4]}"


def _torch_dq(x: torch.Tensor, s: float, b) -> torch.Tensor:
    """``FloatFormat.round(x / s) * s - x``: the torch path's error of each element."""
    return FloatFormat.round(b, x / s) * s - x


# ---- the C kernel: its native (AVX-512), AVX2 and scalar builds ----------------------------

CC = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def c_builds(tmp_path_factory):
    """``{march: library}``: the loaded native build and, where this CPU runs them and a
    compiler is here, ``haswell`` (the AVX2 fqv) and ``x86-64`` (fq1 only)."""
    native = kernels.lib("mse_search")
    if native is None:
        pytest.skip("no native C kernel")
    out = {"native": native}
    for march, flag in (("haswell", "avx2"), ("x86-64", "sse2")):
        if CC is None or not cpu_has(flag):
            continue
        flags = [f if f != "-march=native" else f"-march={march}" for f in kernels.FLAGS]
        so = tmp_path_factory.mktemp("fp_top") / f"mse_search_{march}.so"
        subprocess.run([CC, *flags, f"-I{kernels.CSRC}", str(kernels.CSRC / "mse_search.c"),
                        "-o", str(so), "-lm"], check=True, capture_output=True, text=True)
        lib = ctypes.CDLL(str(so))
        fn = lib.qs_mse_dq_fp
        fn.restype, fn.argtypes = ctypes.c_int64, kernels.SIGNATURES["mse_search"]["qs_mse_dq_fp"]
        out[march] = lib
    return out


def _c_dq(lib, x: torch.Tensor, s: float, b) -> torch.Tensor:
    out = torch.empty_like(x)
    assert lib.qs_mse_dq_fp(x.data_ptr(), x.numel(), s, b.max, b.min_exp, b.mbits,
                            out.data_ptr()) == 0
    return out


@pytest.mark.parametrize("b", BOUNDS, ids=IDS)
def test_c_error_is_floatformat_round_bit_for_bit(c_builds, b):
    """``qs_mse_dq_fp`` (fqv on 16 / 8 lanes, fq1 on the tail) is ``FloatFormat.round``'s
    error on every element, for every SIMD branch, under scales that keep ``x / s`` in the
    top binades."""
    t = _top_binades()
    for s in SCALES:
        x = (t * s).contiguous()
        want = _torch_dq(x, s, b)
        for lib in c_builds.values():
            _assert_bitwise(_c_dq(lib, x, s, b), want)


@pytest.mark.parametrize("E", [1, 16, 17, 40])
def test_c_price_of_an_exact_top_code_is_zero(E):
    """``2 ** 27 / 2 ** -100 = 2 ** 127`` is an e8m0 code: every element's error is 0, on the
    SIMD lanes (E >= 16) as on the scalar tail, and the torch path agrees."""
    fmt = FloatFormat("e8m0", 8, 0, 2.0 ** 127)
    x = torch.full((1, E), 2.0 ** 27)
    s = torch.full((1, 1), 2.0 ** -100)
    assert fmt.round(x / s).eq(2.0 ** 127).all()
    zero = torch.zeros(1, 1, dtype=torch.int32)
    assert _torch_price(x, s, zero, _FloatBounds(fmt.max, fmt.min_exp, fmt.mbits)).item() == 0
    got = torch.ops.quantscope.mse_price_fp(x, s, fmt.max, fmt.min_exp, fmt.mbits)
    assert got.item() == 0.0


# ---- Triton ----------------------------------------------------------------------------------

def _triton_fp(device, x: torch.Tensor, b, s: float | None = None) -> torch.Tensor:
    x = x.to(device)
    out = torch.empty_like(x)
    _fp_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, out, x.numel(), 1.0 if s is None else s, b.max, b.min_exp, b.mbits,
        SCALED=s is not None, BLOCK=1024, **LAUNCH)
    return out


@needs_triton
@pytest.mark.parametrize("b", BOUNDS, ids=IDS)
def test_triton_fp_round_is_floatformat_round(device, b):
    """``_jit.fp_round`` and ``fake_quant_fp`` round as ``FloatFormat.round`` bit for bit
    (inf saturating at mbits 0 too: its step is the top binade's, not inf)."""
    t = _top_binades()
    _assert_bitwise(_triton_fp(device, t, b), FloatFormat.round(b, t), nan_bits=False)
    for s in SCALES:
        x = t * s
        _assert_bitwise(_triton_fp(device, x, b, s), _torch_dq(x, s, b), nan_bits=False)


@needs_triton
@pytest.mark.parametrize("E", [1, 16, 40])
def test_triton_price_of_an_exact_top_code_is_zero(device, E):
    """The Triton price of ``x / s = 2 ** 127`` in e8m0 is 0 (the torch path's, exactly)."""
    fmt = FloatFormat("e8m0", 8, 0, 2.0 ** 127)
    x = torch.full((1, E), 2.0 ** 27, device=device)
    s = torch.full((1, 1), 2.0 ** -100, device=device)
    assert triton_mse.mse_price_fp(x, s, fmt.max, fmt.min_exp, fmt.mbits).item() == 0.0


@needs_triton
@pytest.mark.parametrize("mbits", range(4))
def test_triton_and_c_prices_at_min_exp_127_are_the_torch_path(device, mbits):
    """``min_exp = 127`` (``mse_price_fp``'s largest): every step is ``2 ** (127 - mbits)``;
    the prices of the C kernel and of Triton are the torch path's sums."""
    g = torch.Generator().manual_seed(mbits)
    t = torch.exp2(torch.rand(4, 64, generator=g) * 4 + 123) * (torch.rand(4, 64, generator=g) * 2 - 1)
    t[:, :16] = torch.tensor([1.5, 1.0, 0.5, 0.75])[:, None] * 2.0 ** 127  # ties, codes
    s = torch.tensor([[2.0 ** -100, 2.0 ** -80, 2.0 ** -120, 0.75 * 2.0 ** -100]])
    x = (t * s.T).contiguous()
    zero = torch.zeros(1, 4, dtype=torch.int32)
    want = _torch_price(x, s, zero, _FloatBounds(F32_MAX, 127, mbits))
    c = torch.ops.quantscope.mse_price_fp(x, s, F32_MAX, 127, mbits)
    tri = triton_mse.mse_price_fp(x.to(device), s.to(device), F32_MAX, 127, mbits)
    assert want.isfinite().all()
    torch.testing.assert_close(c, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(tri.cpu(), want, rtol=1e-12, atol=0)
