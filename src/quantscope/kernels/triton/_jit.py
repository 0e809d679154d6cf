"""What every Triton kernel here shares: the launch options and exact rounding helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from . import interpreted


def _launch_options() -> dict:
    """No FMA contraction (the torch ops round each step on its own: ``a * b + c`` must
    round twice, as they do), and libdevice without flush-to-zero where this Triton can say
    so (``enable_reflect_ftz``, an option since late 2025): its default flushes subnormals
    inside libdevice's functions, which makes its ``powf`` differ from the one torch's CUDA
    build calls by an ulp or so (an older Triton refuses an option it does not know)."""
    options = {"enable_fp_fusion": False}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a build without the NVIDIA backend
        return options
    if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
        options["enable_reflect_ftz"] = False
    return options


#: every launch's options
LAUNCH = _launch_options()


# The launchers' grid arithmetic in plain Python: since Triton 3.5 ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions, whose host call imports and unwraps its
# arguments each time (~5 us): the nine of one min / max launch took most of its Python.

def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of integers, ``b > 0`` (``triton.cdiv``'s formula)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1``; 0 for 0 (``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


#: whether the kernels run under Triton's interpreter (a constexpr for :func:`widen`)
INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def widen(x):
    """A loaded input's values as float32, exactly. Under the interpreter a bfloat16 is
    widened by its bits (the upper half of the float32, as torch's ``.float()``): the
    interpreter's own conversion (``_convert_float``) clamps a subnormal's exponent, wrong
    values, so the CPU tests could not prove bfloat16 subnormals. Compiled, ``.to`` is the
    GPU's exact ``cvt.f32.bf16``; the shift there cost the min / max loops ~20 % more
    instructions (their NaN test no longer on packed bfloat16 pairs)."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def rint(t):
    """float32 ``t`` rounded to an integer, half to even (``torch.round``): ``|t| + 2 ** 23``
    rounds the fraction away in the IEEE default mode (exactly, without contraction), below
    ``2 ** 23``; from there every float32 is an integer already (inf, NaN: unchanged). The
    sign is put back from ``t``'s bit, so ``-0.3`` gives ``-0.0`` as torch does. Written in
    plain operations: libdevice's ``rint`` does not run under the interpreter."""
    a = tl.abs(t)
    r = (a + 8388608.0) - 8388608.0
    sign = t.to(tl.int32, bitcast=True) & -2147483648
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(a < 8388608.0, r, t)


@triton.jit
def fake_quant(x, s, z, qmin, qmax, ZERO_SIGN: tl.constexpr = False):
    """``(clamp(rint(x / s + z), qmin, qmax) - z) * s``: ``qdq.fake_quantize_units`` of
    an integer format, each float32 step rounded as its torch op (IEEE division; the clamp
    keeps NaN, as ``torch.clamp``). ``ZERO_SIGN``: the clamp keeps a ``-0`` code at
    ``qmin = 0`` as ``torch.clamp`` does (a compare and a select each side, where IEEE
    min / max are one instruction and return ``+0``: the same value, which an error sum
    cannot tell apart; the fake-quantized output's bits can)."""
    t = rint(tl.math.div_rn(x, s) + z)
    if ZERO_SIGN:
        t = tl.where(t < qmin, qmin, t)
        t = tl.where(t > qmax, qmax, t)
    else:
        t = tl.minimum(tl.maximum(t, qmin, propagate_nan=tl.PropagateNan.ALL), qmax,
                       propagate_nan=tl.PropagateNan.ALL)
    return (t - z) * s


@triton.jit
def fp_round(t, fmax, min_exp, mbits):
    """float32 ``t`` rounded to a float element format (``FloatFormat.round``): the step
    ``2 ** (e - mbits)`` is ``t``'s float32 exponent field masked in place (at least
    ``min_exp``'s: subnormals; at most the top binade's: NaN and inf, whose field is all
    ones, take a finite step, so that inf saturates at ``mbits = 0`` too), ``t / step`` is
    rounded half to even and multiplied back (both exact), and the clamp saturates at
    ``+-fmax`` (inf included; NaN kept, as ``torch.clamp``).

    ``t / step`` is ``t * (1 / step)``: a power of two's reciprocal is one (its field
    ``254 - e_step``), and both round the same real ``t / step`` once, so the product is
    the quotient bit for bit without a division's ~10 instructions per element. That
    reciprocal is normal up to the step ``2 ** 126``; the step ``2 ** 127`` (``mbits = 0``
    in float32's top binade, inf and NaN, or at ``min_exp = 127``) takes
    ``(t * 0.5) * 2 ** -126``: the halving is exact unless ``|t| < 2 ** -125``, where both
    products are a zero."""
    field = tl.minimum(tl.maximum(t.to(tl.int32, bitcast=True) & 0x7F800000,
                                  (min_exp + 127) << 23), 254 << 23)
    step_bits = field - (mbits << 23)
    step = step_bits.to(tl.float32, bitcast=True)
    big = step_bits > 0x7E800000  # 2 ** 127: the reciprocal is not normal
    inv = (0x7F000000 - tl.minimum(step_bits, 0x7E800000)).to(tl.float32, bitcast=True)
    q = rint(tl.where(big, t * 0.5, t) * inv) * step
    return tl.minimum(tl.maximum(q, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fake_quant_fp(x, s, fmax, min_exp, mbits):
    """``fp_round(x / s) * s``: ``qdq.fake_quantize_units`` of a float element format (zero
    point 0) under the effective scale ``s``, each float32 step rounded as its torch op."""
    return fp_round(tl.math.div_rn(x, s), fmax, min_exp, mbits) * s


if interpreted():  # the interpreter runs no libdevice
    @triton.jit
    def _powf(a, n):  # n as the compiled call takes it: a float32 (2.4 is 2.4000000954)
        e = tl.full((), n, tl.float32).to(tl.float64)
        return tl.exp2(tl.log2(a.to(tl.float64)) * e).to(tl.float32)
else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _powf(a, n):
        return libdevice.pow(a, n)


@triton.jit
def norm_term(d, NORM: tl.constexpr):
    """``|d| ** NORM`` in float32 as torch's ``d.abs().pow(NORM)`` computes it on CUDA: the
    exponents torch special-cases (1: ``|d|``; 2: ``d * d``; 3: ``|d| * |d| * |d|``; 0.5:
    the IEEE square root), any other by libdevice's ``__nv_powf``, which came within an ulp
    a term of torch's CUDA ``pow``, not equal to it, on the lent H200 (Triton 3.6, torch
    2.11). Its exponent is a float32 (2.4 is 2.4000000954), as in torch's float32 ``pow``.
    Under the interpreter, which has no libdevice, that ``powf`` is float64 ``exp2(log2)``
    with the exponent rounded to float32, rounded to float32 (within an ulp of the correctly
    rounded power; tests hold the norms other than 0.5, 1, 2, 3 to a tolerance)."""
    if NORM == 2.0:
        t = d * d
    elif NORM == 1.0:
        t = tl.abs(d)
    elif NORM == 3.0:
        a = tl.abs(d)
        t = a * a * a
    elif NORM == 0.5:
        t = tl.sqrt_rn(tl.abs(d))
    else:
        t = _powf(tl.abs(d), NORM)
    return t
