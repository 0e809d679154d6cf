"""Block-scale MSE searches (Triton): each distinct block scale of a unit priced once.

NVFP4 (fp8 e4m3 block scales under a global scale) and MX (E8M0 block scales, ``2 ** k``).
Candidate ``k`` scales a unit's range by ``factors[k]``; its block scale is the format's
encoding of ``(lo * f, hi * f)`` (``nvfp4_qparams`` under the global scale, or
``e8m0_block_scales``), a non-decreasing function of the range's amax. Where the factors
fall by less than the encoding's narrowest gap between rounding points (e4m3: 31 / 29 - 1
= 6.9 %, E8M0: 2x; the grids' factors fall by 0.5-1 % a step), a unit's block scale code
falls by 0 or 1 a candidate: its distinct scales are every code from its first candidate's
to its last's (NVFP4: ~9 for the native grid's 50 factors, ~11 for ``nvfp4_expanded_mse``'s
111; MX: 2-4), and candidates of one code have one error. Each program holds a tile of
units in registers, prices those codes once, and where the factors are coarser (or a
range NaN) prices every candidate instead. The pricing is ``mse_price_fp``'s, or
``mse_price_int``'s for MX's integer elements (MXINT8, BFP; ``mse._term``), the selection
``mse_select``'s (``mse.select_step``). With ``weights`` (an imatrix search's importance,
a ``WEIGHTED`` constexpr) each element's term is weighted as ``mse_price_fp`` weights it.

The encoding is a compile-time constant, ``ENC``: -1 NVFP4, 0-3 E8M0 in ``scales.E8M0_MODES``'
order (floor, ceil, even, rceil); so is the element kind, ``FLOAT``.

* ``nvfp4_search``: the first lowest error (no patience: ``nvfp4_expanded_mse``), one
  launch: the codes priced in order, then a bisection for the first candidate of the chosen
  code.
* ``block_mse`` (NVFP4 or MX, any rules: ``mse_select``'s per-unit patience over plateaus
  and global rule), two launches without a ``[candidates, units]`` tensor of errors: the
  first prices the codes into a scratch (row ``j``: code ``first - j``) and flags, per
  program, which of the grid's candidates improve one of its units (the global rule's
  input); the second walks the candidates in order, each one's error read from its code's
  row, and applies the rules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...formats import FP8_E4M3
from ._jit import LAUNCH, cdiv, next_power_of_2
from .block_qparams import _amax, _global_scale, amax_of, e8m0_scale, exp2i, nvfp4_block_code
from .mse import MAX_TILE, _term, _weights, select_step

__all__ = ["MAX_TILE", "NVFP4", "Encoding", "block_mse", "nvfp4_search"]


@triton.jit
def _code(q, MIN_EXP: tl.constexpr, MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """The index of a non-negative value ``q`` of a small float format (float32 holding it
    exactly) among the format's values in increasing order: 0 for 0, then the subnormals,
    then the normals (``SUB_STEPS = 2 ** (MBITS - MIN_EXP)``, subnormals per unit)."""
    bits = q.to(tl.int32, bitcast=True)
    mantissa = (bits >> (23 - MBITS)) & ((1 << MBITS) - 1)
    normal = (((bits >> 23) - 126 - MIN_EXP) << MBITS) | mantissa
    return tl.where(q < 1.0 / SUB_STEPS * (1 << MBITS), (q * SUB_STEPS).to(tl.int32), normal)


@triton.jit
def _value(c, MIN_EXP: tl.constexpr, MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """The value of index ``c`` (:func:`_code`'s inverse), exactly, as float32."""
    normal = ((((c >> MBITS) + 126 + MIN_EXP) << 23) | ((c & ((1 << MBITS) - 1)) << (23 - MBITS)))
    return tl.where(c < (1 << MBITS), c.to(tl.float32) * (1.0 / SUB_STEPS),
                    normal.to(tl.float32, bitcast=True))


@triton.jit
def _scale_code(q, ENC: tl.constexpr, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                SUB_STEPS: tl.constexpr):
    """The index of block scale ``q`` among the encoding's scales in increasing order: e4m3's
    (:func:`_code`), or E8M0's ``2 ** k`` as ``k + 127`` (its float32 exponent field;
    ``2 ** -127``, a subnormal, reads 0)."""
    if ENC < 0:
        return _code(q, B_MIN_EXP, B_MBITS, SUB_STEPS)
    return (q.to(tl.int32, bitcast=True) >> 23) & 255


@triton.jit
def _scale_value(c, ENC: tl.constexpr, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                 SUB_STEPS: tl.constexpr):
    """The block scale of index ``c`` (:func:`_scale_code`'s inverse), exactly."""
    if ENC < 0:
        return _value(c, B_MIN_EXP, B_MBITS, SUB_STEPS)
    return exp2i(c - 127)


@triton.jit
def _stored(q, min_scale, ENC: tl.constexpr):
    """The block scale the qparams store for ``q``: NVFP4's ``min_scale`` where ``q`` is not
    positive (e4m3 0, NaN included); an E8M0 scale as it is (NaN for a NaN amax)."""
    if ENC < 0:
        return tl.where(q > 0.0, q, min_scale)
    return q


@triton.jit
def _block_error(x, w, mask, q, gs, min_scale, fmax, min_exp, mbits, ENC: tl.constexpr, qmin,
                 FLOAT: tl.constexpr, WEIGHTED: tl.constexpr):
    """Each row's float64 error under the block scale ``q`` of global scale ``gs`` (MX: 1):
    the effective scale ``block / gs``, priced as ``mse_price_fp`` prices float elements
    (``fmax``, ``min_exp``, ``mbits``), or, not ``FLOAT``, as ``mse_price_int`` prices integer
    ones (MXINT8, BFP: ``[qmin, fmax]``, zero point 0); ``WEIGHTED``: each term times its
    weight ``w``."""
    s = tl.math.div_rn(_stored(q, min_scale, ENC), gs)[:, None]
    t = _term(x, w, s, 0.0, qmin, fmax, min_exp, mbits, FLOAT, WEIGHTED, 2.0, False)
    return tl.sum(tl.where(mask, t, 0.0), axis=1)


@triton.jit
def _encode(amax, gs, fmax, bmax, emax, ENC: tl.constexpr, B_MIN_EXP: tl.constexpr,
            B_MBITS: tl.constexpr, TOP: tl.constexpr):
    """The block scale of blocks of ``amax`` (before ``min_scale`` replaces a 0): NVFP4's
    e4m3 encoding of ``amax / fmax * gs``, or E8M0's ``2 ** k`` in mode ``ENC``."""
    if ENC < 0:
        return nvfp4_block_code(amax, gs, fmax, bmax, B_MIN_EXP, B_MBITS)
    return e8m0_scale(amax, emax, fmax, ENC, TOP)


@triton.jit
def _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, emax, ENC: tl.constexpr,
               B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, TOP: tl.constexpr):
    """Candidate ``k``'s block scale: the encoding of ``(lo * factors[k], hi *
    factors[k])``."""
    f = tl.load(f_ptr + k)
    return _encode(amax_of(lo * f, hi * f), gs, fmax, bmax, emax, ENC, B_MIN_EXP, B_MBITS, TOP)


@triton.jit
def _ranges(lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, emax,
            ENC: tl.constexpr, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
            TOP: tl.constexpr, RATIO: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_U: tl.constexpr):
    """What every kernel here starts from: the program's rows and their mask, the ranges,
    the global scale (MX: 1), the incumbent's block scale, and whether the program may
    enumerate codes (``by_codes``).

    Where each factor is below the one before by a ratio under that of the encoding's
    closest consecutive rounding points (``RATIO``: e4m3's at least ``1 + 2 ** -(B_MBITS +
    1)`` (31 / 29), E8M0's 2, each less 1e-5 for the float32 roundings before the
    encoding; such factors are finite and of one sign), no two rounding points lie between
    two candidates: a unit's codes fall by 0 or 1 a candidate, and its distinct scales are
    every code from its first candidate's to its last's. A NaN amax (a NaN range or
    factor, 0 x inf) has no code."""
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    lo = tl.load(lo_ptr + rows, mask=rmask, other=0.0)
    hi = tl.load(hi_ptr + rows, mask=rmask, other=0.0)
    if ENC < 0:
        gs = _global_scale(tl.load(amax_ptr), bmax * fmax)
    else:
        gs = tl.full([], 1.0, tl.float32)  # no global scale
    q_inc = _encode(_amax(ilo_ptr, ihi_ptr, rows, rmask), gs, fmax, bmax, emax, ENC,
                    B_MIN_EXP, B_MBITS, TOP)
    ks = tl.arange(0, BLOCK_K)
    f = tl.load(f_ptr + ks, mask=ks < K, other=1.0)
    f_next = tl.load(f_ptr + ks + 1, mask=ks + 1 < K, other=0.5)
    fine = (ks + 1 >= K) | ((f_next < f) & (f < f_next * RATIO))
    f0 = tl.load(f_ptr)
    amax = amax_of(lo * f0, hi * f0)
    finite = (amax == amax) | ~rmask  # noqa: PLR0124  (NaN test)
    by_codes = (tl.min(fine.to(tl.int32)) == 1) & (tl.min(finite.to(tl.int32)) == 1)
    return rows, rmask, lo, hi, gs, q_inc, by_codes


@triton.jit
def _units(x_ptr, w_ptr, rows, rmask, E, stride_u, stride_w, BLOCK_E: tl.constexpr,
           WEIGHTED: tl.constexpr):
    """The program's tile of units, in registers, its weights (``WEIGHTED``; else ``x``,
    never read) and its mask."""
    cols = tl.arange(0, BLOCK_E)
    mask = rmask[:, None] & (cols[None, :] < E)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_u + cols[None, :], mask=mask,
                other=0.0)
    w = _weights(w_ptr + rows[:, None].to(tl.int64) * stride_w, cols, mask, x, WEIGHTED)
    return x, w, mask


@triton.jit
def _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, emax, ENC: tl.constexpr,
               B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr,
               TOP: tl.constexpr):
    """Each row's first candidate's code and how many codes its candidates fall through
    (0 for masked rows): its distinct scales are codes ``first - j``, ``0 <= j <= span``."""
    first = _scale_code(_candidate(lo, hi, f_ptr, 0, gs, fmax, bmax, emax, ENC, B_MIN_EXP,
                                   B_MBITS, TOP), ENC, B_MIN_EXP, B_MBITS, SUB_STEPS)
    last = _scale_code(_candidate(lo, hi, f_ptr, K - 1, gs, fmax, bmax, emax, ENC, B_MIN_EXP,
                                  B_MBITS, TOP), ENC, B_MIN_EXP, B_MBITS, SUB_STEPS)
    return first, tl.where(rmask, first - last, 0)


# ---- the first lowest error, NVFP4: one launch ---------------------------------------------

@triton.jit
def _lowest_by_codes(x, w, mask, rmask, lo, hi, f_ptr, K, gs, best, fmax, min_exp, mbits,
                     bmax, min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                     SUB_STEPS: tl.constexpr, STEPS: tl.constexpr, WEIGHTED: tl.constexpr):
    """``(idx, best)`` of ``by_codes`` programs: every distinct code priced once, in the
    candidates' order (the first lowest is then the first candidate's that has it), then
    the first candidate of the chosen code found by bisection (codes fall with k)."""
    first, span = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, 0, -1, B_MIN_EXP,
                             B_MBITS, SUB_STEPS, 0.0)
    best_code = tl.full(first.shape, -1, tl.int32)
    for j in range(tl.max(span) + 1):
        c = first - j
        err = _block_error(x, w, mask, _value(c, B_MIN_EXP, B_MBITS, SUB_STEPS), gs,
                           min_scale, fmax, min_exp, mbits, -1, 0.0, True, WEIGHTED)
        better = (j <= span) & (err < best)
        best = tl.where(better, err, best)
        best_code = tl.where(better, c, best_code)
    lo_k = tl.zeros(first.shape, tl.int32)
    hi_k = tl.zeros(first.shape, tl.int32) + (K - 1)
    for _ in range(STEPS):
        mid = (lo_k + hi_k) // 2
        left = _code(_candidate(lo, hi, f_ptr, mid, gs, fmax, bmax, 0, -1, B_MIN_EXP, B_MBITS,
                                0.0), B_MIN_EXP, B_MBITS, SUB_STEPS) <= best_code
        hi_k = tl.where(left, mid, hi_k)
        lo_k = tl.where(left, lo_k, mid + 1)
    return tl.where(best_code >= 0, lo_k.to(tl.int64), -1), best


@triton.jit
def _lowest_by_candidates(x, w, mask, lo, hi, f_ptr, K, gs, best, fmax, min_exp, mbits, bmax,
                          min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                          WEIGHTED: tl.constexpr):
    """``(idx, best)`` with every candidate priced, in order (the first lowest kept)."""
    idx = tl.full(best.shape, -1, tl.int64)
    for k in range(K):
        q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, 0, -1, B_MIN_EXP, B_MBITS, 0.0)
        err = _block_error(x, w, mask, q, gs, min_scale, fmax, min_exp, mbits, -1, 0.0, True,
                           WEIGHTED)
        better = err < best
        best = tl.where(better, err, best)
        idx = tl.where(better, k, idx)
    return idx, best


@triton.jit
def _search_kernel(x_ptr, w_ptr, lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, idx_ptr,
                   best_ptr, U, E, K, stride_u, stride_w, fmax, min_exp, mbits, bmax,
                   min_scale, WEIGHTED: tl.constexpr, B_MIN_EXP: tl.constexpr,
                   B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr, RATIO: tl.constexpr,
                   STEPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, 0, -1, B_MIN_EXP,
        B_MBITS, 0.0, RATIO, BLOCK_K, BLOCK_U)
    x, w, mask = _units(x_ptr, w_ptr, rows, rmask, E, stride_u, stride_w, BLOCK_E, WEIGHTED)
    # the incumbent's error is the running best (index -1)
    best = _block_error(x, w, mask, q_inc, gs, min_scale, fmax, min_exp, mbits, -1, 0.0, True,
                        WEIGHTED)
    if by_codes:
        idx, best = _lowest_by_codes(x, w, mask, rmask, lo, hi, f_ptr, K, gs, best, fmax,
                                     min_exp, mbits, bmax, min_scale, B_MIN_EXP, B_MBITS,
                                     SUB_STEPS, STEPS, WEIGHTED)
    else:  # a NaN range, or factors too far apart (codes may skip)
        idx, best = _lowest_by_candidates(x, w, mask, lo, hi, f_ptr, K, gs, best, fmax, min_exp,
                                          mbits, bmax, min_scale, B_MIN_EXP, B_MBITS, WEIGHTED)
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


# ---- any rules, NVFP4 or MX: the codes priced into a scratch, then the candidates walked ---

@triton.jit
def _error_of(scratch_ptr, rows, rmask, U, k, q, first, by_codes, ENC: tl.constexpr,
              B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """Candidate ``k``'s errors (block scale ``q``) from the scratch: its code's row
    (``first - code``) by codes, else its own row ``k``."""
    row = tl.where(by_codes, first - _scale_code(q, ENC, B_MIN_EXP, B_MBITS, SUB_STEPS), k)
    return tl.load(scratch_ptr + row.to(tl.int64) * U + rows, mask=rmask, other=0.0)


@triton.jit
def _price_kernel(x_ptr, w_ptr, lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, inc_ptr,
                  scratch_ptr, flags_ptr, U, E, K, G, stride_u, stride_w, fmax, min_exp, mbits,
                  bmax, emax, min_scale, qmin, TIE_LAST: tl.constexpr, FLOAT: tl.constexpr,
                  WEIGHTED: tl.constexpr, ENC: tl.constexpr,
                  B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr,
                  TOP: tl.constexpr, RATIO: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, emax, ENC,
        B_MIN_EXP, B_MBITS, TOP, RATIO, BLOCK_K, BLOCK_U)
    x, w, mask = _units(x_ptr, w_ptr, rows, rmask, E, stride_u, stride_w, BLOCK_E, WEIGHTED)
    U64 = tl.cast(U, tl.int64)  # row offsets: K * U may pass 2 ** 31
    inc = _block_error(x, w, mask, q_inc, gs, min_scale, fmax, min_exp, mbits, ENC, qmin, FLOAT,
                       WEIGHTED)
    tl.store(inc_ptr + rows, inc, mask=rmask)
    first, span = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, emax, ENC, B_MIN_EXP,
                             B_MBITS, SUB_STEPS, TOP)
    if by_codes:  # code first - j into row j
        for j in range(tl.max(span) + 1):
            q = _scale_value(first - j, ENC, B_MIN_EXP, B_MBITS, SUB_STEPS)
            err = _block_error(x, w, mask, q, gs, min_scale, fmax, min_exp, mbits, ENC, qmin,
                               FLOAT, WEIGHTED)
            tl.store(scratch_ptr + j * U64 + rows, err, mask=rmask)
    else:  # candidate k into row k
        for k in range(K):
            q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, emax, ENC, B_MIN_EXP, B_MBITS, TOP)
            err = _block_error(x, w, mask, q, gs, min_scale, fmax, min_exp, mbits, ENC, qmin,
                               FLOAT, WEIGHTED)
            tl.store(scratch_ptr + k * U64 + rows, err, mask=rmask)
    if G > 0:
        # the global rule's input (ops.improved_rows): which of the grid's first G
        # candidates improve one of this program's units on its running best (every unit
        # searching: the rule decides when they stop), read back from rows other threads
        # stored
        tl.debug_barrier()
        best = inc
        for k in range(G):
            q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, emax, ENC, B_MIN_EXP, B_MBITS, TOP)
            e = _error_of(scratch_ptr, rows, rmask, U64, k, q, first, by_codes, ENC, B_MIN_EXP,
                          B_MBITS, SUB_STEPS)
            if TIE_LAST:
                improved = (e <= best) & (e < float("inf"))  # as select_step
            else:
                improved = e < best
            best = tl.where(e < best, e, best)  # a NaN error never the best: improved_rows
            improved = (improved & rmask).to(tl.int32)
            tl.store(flags_ptr + tl.program_id(0) * G + k, tl.max(improved).to(tl.int8))


@triton.jit
def _select_kernel(lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, inc_ptr, scratch_ptr,
                   gstop_ptr, idx_ptr, best_ptr, U, K, ext_start, patience, fmax, bmax, emax,
                   min_scale, PER_UNIT: tl.constexpr, USE_GLOBAL: tl.constexpr,
                   HAS_PATIENCE: tl.constexpr, TIE_LAST: tl.constexpr, ENC: tl.constexpr,
                   B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr,
                   TOP: tl.constexpr, RATIO: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_U: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, emax, ENC,
        B_MIN_EXP, B_MBITS, TOP, RATIO, BLOCK_K, BLOCK_U)
    U64 = tl.cast(U, tl.int64)
    first, _ = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, emax, ENC, B_MIN_EXP,
                          B_MBITS, SUB_STEPS, TOP)
    best = tl.load(inc_ptr + rows, mask=rmask, other=0.0)
    idx = tl.full([BLOCK_U], -1, tl.int64)
    stale = tl.zeros([BLOCK_U], tl.int32)
    stopped = tl.zeros([BLOCK_U], tl.int1)
    gstop = tl.load(gstop_ptr)
    q_prev = q_inc
    for i in range(K):
        q = _candidate(lo, hi, f_ptr, i, gs, fmax, bmax, emax, ENC, B_MIN_EXP, B_MBITS, TOP)
        e = _error_of(scratch_ptr, rows, rmask, U64, i, q, first, by_codes, ENC, B_MIN_EXP,
                      B_MBITS, SUB_STEPS)
        same = _stored(q, min_scale, ENC) == _stored(q_prev, min_scale, ENC)
        best, idx, stale, stopped = select_step(i, e, same, best, idx, stale, stopped, gstop,
                                                ext_start, patience, PER_UNIT, USE_GLOBAL,
                                                HAS_PATIENCE, TIE_LAST)
        q_prev = q
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


# ---- launchers -----------------------------------------------------------------------------

class Encoding(NamedTuple):
    """A block-scale encoding, as the kernels take it: ``mode`` -1 NVFP4 (e4m3 block scales
    of max ``block_max``, ``block_min_exp``, ``block_mbits``, under a global scale), 0-3
    E8M0 in that mode (``scales.E8M0_MODES``' order) for an element format of ``emax``
    and ``mbits``."""

    mode: int
    block_max: float = 0.0
    block_min_exp: int = 0
    block_mbits: int = 0
    emax: int = 0
    mbits: int = 0

    def constexprs(self) -> dict:
        nvfp4 = self.mode < 0
        return {"ENC": int(self.mode), "B_MIN_EXP": int(self.block_min_exp),
                "B_MBITS": int(self.block_mbits),
                "SUB_STEPS": float(2 ** (self.block_mbits - self.block_min_exp)),
                "TOP": float(2 ** (self.mbits + 1)),
                # the closest rounding points' ratio (module doc), less the roundings' slack
                "RATIO": (1.0 + 2.0 ** -(self.block_mbits + 1) if nvfp4 else 2.0) - 1e-5}


#: NVFP4's encoding: e4m3 block scales under a global scale
NVFP4 = Encoding(-1, FP8_E4M3.max, FP8_E4M3.min_exp, FP8_E4M3.mbits)


def _or(weights, units):
    """The weights' pointer argument: ``units`` where there are none (never read)."""
    return units if weights is None else weights


def _consts(units, factors, enc: Encoding, block_u):
    """``(grid, constexprs)`` the launches share."""
    U, E = units.shape
    be = next_power_of_2(max(E, 1))
    bu = block_u or max(1, min(next_power_of_2(U), 2048 // be))
    consts = enc.constexprs()
    # at least 64: fewer compiled variants (the factors' check is one vector op)
    return (cdiv(U, bu),), {
        **consts, "BLOCK_K": max(64, next_power_of_2(factors.shape[0])), "BLOCK_U": bu,
        **LAUNCH}


def nvfp4_search(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 factors: torch.Tensor, inc_lo: torch.Tensor, inc_hi: torch.Tensor,
                 global_amax: torch.Tensor, fmax: float, min_exp: int, mbits: int,
                 enc: Encoding, min_scale: float, *, weights: torch.Tensor | None = None,
                 block_u: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's lowest-error search in one launch (``kernels.ops``' ``nvfp4_search``):
    ``(idx, best)`` per unit of float32 ``units [U, E]`` (rows contiguous, ``E <=
    MAX_TILE``), ``lo`` / ``hi`` / ``inc_lo`` / ``inc_hi`` float32 ``[U]``, ``factors``
    float32 ``[K]``, ``global_amax`` one float32 value on the device, the element format's
    ``fmax``, ``min_exp``, ``mbits``, and ``enc`` :data:`NVFP4`; ``weights``: float32 ``[U,
    E]``, rows contiguous, or None."""
    (U, E), K = units.shape, factors.shape[0]
    idx = torch.empty(U, dtype=torch.int64, device=units.device)
    best = torch.empty(U, dtype=torch.float64, device=units.device)
    if U:
        grid, consts = _consts(units, factors, enc, block_u)
        del consts["ENC"], consts["TOP"]  # NVFP4 only
        w = _or(weights, units)
        _search_kernel[grid](
            units, w, lo, hi, factors, inc_lo, inc_hi, global_amax, idx, best, U, E, K,
            units.stride(0), w.stride(0), float(fmax),
            int(min_exp), int(mbits), float(enc.block_max), float(min_scale),
            WEIGHTED=weights is not None, STEPS=max(1, (K - 1).bit_length()) + 1,
            BLOCK_E=next_power_of_2(max(E, 1)), **consts)
    return idx, best


def block_mse(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, factors: torch.Tensor,
              inc_lo: torch.Tensor, inc_hi: torch.Tensor, global_amax: torch.Tensor | None,
              fmax: float, min_exp: int, mbits: int, enc: Encoding, min_scale: float,
              ext_start: int, patience: int | None, per_unit: bool, use_global: bool,
              tie_last: bool, global_stop, *, qmin: float | None = None,
              weights: torch.Tensor | None = None, block_u: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scale search under ``mse_select``'s rules (``kernels.ops``' ``nvfp4_mse`` and
    ``mx_mse``), in two launches: ``(idx, best)``; arguments as :func:`nvfp4_search`'s
    (``enc`` NVFP4's or E8M0's; ``global_amax`` None for E8M0), then the rules'
    (``patience`` None: none), and ``global_stop(improved)``: the one-value int64 tensor of
    the candidate after which the global rule stops, from ``improved [G]`` (bool: the grid's
    candidates that improve some unit). ``qmin``: integer elements in ``[qmin, fmax]``
    (MXINT8, BFP; ``min_exp`` and ``mbits`` not read), None for float elements;
    ``weights`` as :func:`nvfp4_search`'s."""
    (U, E), K = units.shape, factors.shape[0]
    dev = units.device
    idx = torch.empty(U, dtype=torch.int64, device=dev)
    best = torch.empty(U, dtype=torch.float64, device=dev)
    if not U:
        return idx, best
    if global_amax is None:
        global_amax = lo  # not read (E8M0 has no global scale): any float32 pointer
    grid, consts = _consts(units, factors, enc, block_u)
    G = ext_start if use_global and patience is not None else 0
    inc = torch.empty(U, dtype=torch.float64, device=dev)
    scratch = torch.empty((K, U), dtype=torch.float64, device=dev)
    flags = torch.zeros((grid[0], max(G, 1)), dtype=torch.int8, device=dev)
    scales = (float(enc.block_max), int(enc.emax), float(min_scale))
    w = _or(weights, units)
    _price_kernel[grid](units, w, lo, hi, factors, inc_lo, inc_hi, global_amax, inc, scratch,
                        flags, U, E, K, G, units.stride(0), w.stride(0), float(fmax),
                        int(min_exp), int(mbits), *scales, 0.0 if qmin is None else float(qmin),
                        TIE_LAST=bool(tie_last), FLOAT=qmin is None,
                        WEIGHTED=weights is not None,
                        BLOCK_E=next_power_of_2(max(E, 1)), **consts)
    gstop = global_stop(flags[:, :G].any(0))
    _select_kernel[grid](lo, hi, factors, inc_lo, inc_hi, global_amax, inc, scratch, gstop, idx,
                         best, U, K, ext_start, 0 if patience is None else int(patience),
                         float(fmax), *scales, PER_UNIT=bool(per_unit),
                         USE_GLOBAL=bool(use_global), HAS_PATIENCE=patience is not None,
                         TIE_LAST=bool(tie_last), **consts)
    return idx, best
