"""What every Triton kernel here shares: the launch options and exact rounding helpers."""

from __future__ import annotations

import triton
import triton.language as tl

#: every launch: no FMA contraction (the torch ops round each step on its own: ``a * b + c``
#: must round twice, as they do)
LAUNCH = {"enable_fp_fusion": False}


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
def fake_quant(x, s, z, qmin, qmax):
    """``(clamp(rint(x / s + z), qmin, qmax) - z) * s``: ``qdq.fake_quantize_units`` of
    an integer format, each float32 step rounded as its torch op (IEEE division; the clamp
    keeps NaN, as ``torch.clamp``)."""
    t = rint(tl.math.div_rn(x, s) + z)
    t = tl.minimum(tl.maximum(t, qmin, propagate_nan=tl.PropagateNan.ALL), qmax,
                   propagate_nan=tl.PropagateNan.ALL)
    return (t - z) * s


@triton.jit
def fp_round(t, fmax, min_exp, mbits):
    """float32 ``t`` rounded to a float element format (``FloatFormat.round``): the step
    ``2 ** (e - mbits)`` is ``t``'s float32 exponent field masked in place (at least
    ``min_exp``'s: subnormals), ``t / step`` is rounded half to even and multiplied back
    (both exact), and the clamp saturates at ``+-fmax`` (inf included; NaN kept, as
    ``torch.clamp``). NaN and inf read the all-ones field: a finite step, as in torch.

    ``t / step`` is ``t * (1 / step)``: a power of two's reciprocal is one (its field
    ``254 - e_step``, normal for ``mbits >= 1``), and both give ``t`` scaled exactly (a
    subnormal ``t`` only grows), so the product is the quotient bit for bit without a
    division's ~10 instructions per element. Inf and NaN keep ``t`` (for ``mbits = 1`` the
    reciprocal of their step is below the normal range)."""
    field = tl.maximum(t.to(tl.int32, bitcast=True) & 0x7F800000, (min_exp + 127) << 23)
    step_bits = field - (mbits << 23)
    step = step_bits.to(tl.float32, bitcast=True)
    inv = (0x7F000000 - step_bits).to(tl.float32, bitcast=True)  # field 254 - e_step
    q = rint(tl.where(field == 0x7F800000, t, t * inv)) * step
    return tl.minimum(tl.maximum(q, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fake_quant_fp(x, s, fmax, min_exp, mbits):
    """``fp_round(x / s) * s``: ``qdq.fake_quantize_units`` of a float element format (zero
    point 0) under the effective scale ``s``, each float32 step rounded as its torch op."""
    return fp_round(tl.math.div_rn(x, s), fmax, min_exp, mbits) * s
