"""Qparams from per-unit ranges (Triton), the float32 steps of ``qparams.qparams_from_range``
bitwise: the integer formats' fp32 scale and zero point (``qparams._affine_qparams``), and
MX (E8M0) and NVFP4 (fp8 e4m3 under a global scale) block scales (``scales.e8m0_scale`` and
the NVFP4 branch).

Integer: with ``lo <= 0 <= hi`` (clamped), symmetric ``max(-lo, hi) / ((qmax - qmin) / 2)``
and a fixed zero point, else ``(hi - lo) / (qmax - qmin)`` (divided first where that
overflows) and ``round(qmin - lo / scale)`` clamped; the scale at least ``min_scale`` and
within float32's subnormal minimum and maximum (``encode_scale``'s fp32). Blocks:

``amax = max(-min(lo, 0), max(hi, 0))`` per block, then

* E8M0: ``2 ** k``, ``k`` from the exponent of ``amax`` read off its bits (frexp; inf reads
  as ``2 ** 128``), per mode (0 floor, 1 ceil, 2 even, 3 rceil; ``scales.E8M0_MODES``'
  order; rceil from the exponents and mantissas of ``amax`` and ``fmax``, no quotient),
  ``-127`` for an all-zero block, clamped to ``[-127, 127]``; NaN for a NaN amax;
* NVFP4: ``e4m3(amax / fmax * gs)`` (``_jit.fp_round``, the rounding of ``FloatFormat.round``
  that the float MSE pricing uses too), ``min_scale`` where not positive; the global scale
  ``gs`` computed in the same launch from the global amax (given, or the blocks' largest,
  found by :func:`global_amax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH, cdiv, fp_round, rint

__all__ = ["amax_of", "e8m0_block_scales", "e8m0_exponent", "e8m0_scale", "exp2i",
           "global_amax", "int_qparams", "nvfp4_block_code", "nvfp4_qparams"]

BLOCK = 1024


@triton.jit
def amax_of(lo, hi):
    """``qparams.amax_of_range`` of the range widened to hold 0, as ``qparams_from_range``
    widens it: ``max(-min(lo, 0), max(hi, 0))``, NaN kept."""
    lo = tl.minimum(lo, 0.0, propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(hi, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(-lo, hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(lo_ptr, hi_ptr, offs, mask):
    return amax_of(tl.load(lo_ptr + offs, mask=mask, other=0.0),
                   tl.load(hi_ptr + offs, mask=mask, other=0.0))


@triton.jit
def _frexp(x):
    """(mantissa in [0.5, 1), exponent) of positive finite float32 x, subnormals included."""
    sub = x < 1.1754943508222875e-38
    b = tl.where(sub, x * 16777216.0, x).to(tl.int32, bitcast=True)
    m = ((b & 0x007FFFFF) | (126 << 23)).to(tl.float32, bitcast=True)
    e = ((b >> 23) & 255) - 126 - tl.where(sub, 24, 0)
    zero = x == 0.0  # frexp(0) = (0, 0)
    return tl.where(zero, 0.0, m), tl.where(zero, 0, e)


@triton.jit
def exp2i(k):
    """Exactly 2 ** k as float32 for integer k in [-149, 127]."""
    normal = ((k + 127) << 23).to(tl.float32, bitcast=True)
    # the shift kept in [0, 22] on both branches: a shift past 31 is undefined on the GPU
    sub = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def e8m0_exponent(amax, emax, fmax, MODE: tl.constexpr, TOP: tl.constexpr):
    """``scales.e8m0_scale``'s exponent ``k`` of the blocks' ``amax`` (the scale is ``2 **
    k``, :func:`exp2i`): per mode (module doc), ``-127`` for an all-zero block, clamped to
    ``[-127, 127]``."""
    tiny = amax <= 0.0
    safe = tl.where(tiny, 1.0, amax)
    m, e = _frexp(safe)
    if MODE == 0:
        k = e - 1 - emax
    elif MODE == 1:
        k = tl.where(m == 0.5, e - 1, e) - emax
    elif MODE == 2:
        carry = tl.floor(m * TOP + 0.5) >= TOP  # TOP = 2 ** (mbits + 1)
        k = e - 1 + carry.to(tl.int32) - emax
    else:  # exact: amax / fmax = (m / mf) * 2 ** (e - ef), m / mf in (0.5, 2); inf: 127
        mf, ef = _frexp(fmax + tl.zeros_like(safe))
        k = tl.where(safe < float("inf"), e - ef + (m > mf).to(tl.int32), 127)
    return tl.minimum(tl.maximum(tl.where(tiny, -127, k), -127), 127)


@triton.jit
def e8m0_scale(amax, emax, fmax, MODE: tl.constexpr, TOP: tl.constexpr):
    """``scales.e8m0_scale``: ``2 ** k`` (:func:`e8m0_exponent`; an inf amax reads its
    exponent field, 2 ** 128), NaN for a NaN amax."""
    k = e8m0_exponent(amax, emax, fmax, MODE, TOP)
    return tl.where(amax != amax, float("nan"), exp2i(k))  # noqa: PLR0124  (NaN test)


@triton.jit
def _e8m0_kernel(lo_ptr, hi_ptr, out_ptr, n, emax, fmax, MODE: tl.constexpr,
                 TOP: tl.constexpr, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    scale = e8m0_scale(_amax(lo_ptr, hi_ptr, offs, mask), emax, fmax, MODE, TOP)
    tl.store(out_ptr + offs, scale, mask=mask)


@triton.jit
def _global_scale(amax, top):
    """``scales.nvfp4_global_scale``: ``top / amax`` as torch computes a number over a tensor
    (the reciprocal, then the product: two roundings), amax past float32's max counted as
    that max, 1 where the quotient is not finite or amax not positive (NaN included)."""
    amax = tl.minimum(amax, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
    gs = tl.math.div_rn(1.0, amax) * top
    return tl.where((tl.abs(gs) < float("inf")) & (amax > 0.0), gs, 1.0)


@triton.jit
def nvfp4_block_code(amax, gs, fmax, bmax, MIN_EXP: tl.constexpr, MBITS: tl.constexpr):
    """``qparams.nvfp4_block_scales``' e4m3 encoding of ``amax / fmax * gs`` (the block scale
    before ``min_scale`` replaces a zero: ``where(q > 0, q, min_scale)``)."""
    return fp_round(tl.math.div_rn(amax, fmax) * gs, bmax, MIN_EXP, MBITS)


@triton.jit
def _nvfp4_kernel(lo_ptr, hi_ptr, amax_ptr, out_ptr, n, fmax, bmax, min_scale, gs_ptr,
                  MIN_EXP: tl.constexpr, MBITS: tl.constexpr, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    # the global scale from the global amax, in every program (one value: cheaper than a
    # launch of its own); the first program stores it
    gs = _global_scale(tl.load(amax_ptr), bmax * fmax)
    if tl.program_id(0) == 0:
        tl.store(gs_ptr, gs)
    q = nvfp4_block_code(_amax(lo_ptr, hi_ptr, offs, mask), gs, fmax, bmax, MIN_EXP, MBITS)
    tl.store(out_ptr + offs, tl.where(q > 0.0, q, min_scale), mask=mask)


@triton.jit
def _global_amax_kernel(lo_ptr, hi_ptr, out_ptr, n, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    amax = _amax(lo_ptr, hi_ptr, offs, mask) + 0.0  # >= +0 (-0 + 0 is +0) or NaN; masked: 0
    # non-negative floats order as their int32 bits, and a positive NaN's lie above them
    # all: the max of the bits (one NaN of any sign made the positive one) is the max
    # that torch's propagates NaN through, taken by one atomic per program, in any order
    bits = tl.where(amax != amax, 0x7FC00000, amax.to(tl.int32, bitcast=True))  # noqa: PLR0124
    tl.atomic_max(out_ptr, tl.max(bits, axis=0))


def global_amax(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``amax_of_range(lo.clamp(max=0), hi.clamp(min=0)).max()`` of contiguous float32 ranges
    (NaN propagated) as a float32 ``[1]`` on their device."""
    out = torch.zeros(1, dtype=torch.int32, device=lo.device)
    n = lo.numel()
    if n:
        _global_amax_kernel[(cdiv(n, BLOCK),)](lo, hi, out, n, BLOCK_N=BLOCK, **LAUNCH)
    return out.view(torch.float32)


def nvfp4_qparams(lo: torch.Tensor, hi: torch.Tensor, global_amax: torch.Tensor, fmax: float,
                  block_max: float, block_min_exp: int, block_mbits: int,
                  min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's fp8 block scales of the ranges ``[lo, hi]`` (contiguous float32) and their
    global scale, computed from ``global_amax`` (one float32 value on the device: read there,
    never on the host) in the same launch: ``(block scales, global scale [1])``."""
    out = torch.empty_like(lo)
    gs = torch.empty(1, dtype=torch.float32, device=lo.device)
    n = lo.numel()
    # one program at least: with no blocks it still stores the global scale of global_amax
    _nvfp4_kernel[(max(1, cdiv(n, BLOCK)),)](
        lo, hi, global_amax, out, n, float(fmax), float(block_max), float(min_scale), gs,
        MIN_EXP=int(block_min_exp), MBITS=int(block_mbits), BLOCK_N=BLOCK, **LAUNCH)
    return out, gs


def e8m0_block_scales(lo: torch.Tensor, hi: torch.Tensor, mode: int, emax: int, mbits: int,
                      fmax: float) -> torch.Tensor:
    """Float32 E8M0 scales of the ranges ``[lo, hi]`` (contiguous float32, one shape)."""
    out = torch.empty_like(lo)
    n = lo.numel()
    if n:
        _e8m0_kernel[(cdiv(n, BLOCK),)](lo, hi, out, n, int(emax), float(fmax),
                                               MODE=int(mode), TOP=float(2 ** (mbits + 1)),
                                               BLOCK_N=BLOCK,
                                               **LAUNCH)
    return out


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # NaN kept, as torch's


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _int_kernel(lo_ptr, hi_ptr, scale_ptr, zp_ptr, n, qmin, qmax, min_scale, zsym,
                SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    lo = _min(tl.load(lo_ptr + offs, mask=mask, other=0.0), 0.0)
    hi = _max(tl.load(hi_ptr + offs, mask=mask, other=0.0), 0.0)
    span = qmax - qmin
    if SYMMETRIC:
        scale = tl.math.div_rn(_max(-lo, hi), span * 0.5)  # (qmax - qmin) / 2: exact
    else:
        scale = tl.math.div_rn(hi - lo, span)
        scale = tl.where(scale < float("inf"), scale,
                         tl.math.div_rn(hi, span) - tl.math.div_rn(lo, span))
    # clamp(min=min_scale), then fp32's encoding: its smallest subnormal (as bits: Triton 3.6
    # computes a max with a literal below fp32's normal range in fp64) to its max
    tiny = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)
    scale = _min(_max(_max(scale, min_scale), tiny), 3.4028234663852886e38)
    tl.store(scale_ptr + offs, scale, mask=mask)
    if SYMMETRIC:
        zp = tl.zeros_like(scale) + zsym
    else:
        zp = _min(_max(rint(qmin - tl.math.div_rn(lo, scale)), qmin), qmax)
    tl.store(zp_ptr + offs, zp.to(tl.int32), mask=mask)


def int_qparams(lo: torch.Tensor, hi: torch.Tensor, qmin: float, qmax: float,
                min_scale: float, symmetric: float, zsym: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scales and int32 zero points of the ranges ``[lo, hi]`` (contiguous float32,
    one shape) under ``kernels.qparams_consts``' constants."""
    scale = torch.empty_like(lo)
    zp = torch.empty_like(lo, dtype=torch.int32)
    n = lo.numel()
    if n:
        _int_kernel[(cdiv(n, BLOCK),)](lo, hi, scale, zp, n, float(qmin), float(qmax),
                                              float(min_scale), float(zsym),
                                              SYMMETRIC=bool(symmetric), BLOCK_N=BLOCK,
                                              **LAUNCH)
    return scale, zp
