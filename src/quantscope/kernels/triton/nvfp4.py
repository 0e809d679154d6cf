"""NVFP4's MSE searches (Triton): each distinct fp8 block scale priced once.

An NVFP4 candidate ``k`` scales a unit's range by ``factors[k]``; its e4m3 block scale is
``nvfp4_qparams`` of ``(lo * f, hi * f)`` under the global scale. The grids' factors fall by
0.5-1 % a step, less than e4m3's narrowest gap between rounding midpoints (31 / 29 - 1 =
6.9 %), so a unit's block scale code falls by 0 or 1 a candidate: its distinct scales are
every code from its first candidate's to its last's (~9 for the native grid's 50 factors,
~11 for ``nvfp4_expanded_mse``'s 111), and candidates of one code have one error. Each
program holds a tile of units in registers, prices those codes once, and where the factors
are coarser (or a range NaN) prices every candidate instead. The pricing is
``mse_price_fp``'s (``mse._term``), the selection ``mse_select``'s (``mse.select_step``).

* ``nvfp4_search``: the first lowest error (no patience: ``nvfp4_expanded_mse``), one
  launch: the codes priced in order, then a bisection for the first candidate of the chosen
  code.
* ``nvfp4_mse``: any rules (``mse_select``'s: per-unit patience over plateaus, the global
  rule), two launches without a ``[candidates, units]`` tensor of errors: the first prices
  the codes into a scratch (row ``j``: code ``first - j``) and flags, per program, which of
  the grid's candidates improve one of its units (the global rule's input); the second
  walks the candidates in order, each one's error read from its code's row, and applies
  the rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH
from .block_qparams import _amax, _global_scale, amax_of, nvfp4_block_code
from .mse import MAX_TILE, _term, select_step

__all__ = ["MAX_TILE", "nvfp4_mse", "nvfp4_search"]


@triton.jit
def _code(q, MIN_EXP: tl.constexpr, MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """The index of a non-negative value ``q`` of a small float format (float32 holding it
    exactly) among the format's values in increasing order: 0 for 0, then the subnormals,
    then the normals (``SUB_STEPS = 2 ** (MBITS - MIN_EXP)``, subnormals per unit)."""
    bits = q.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 126 - MIN_EXP) << MBITS) | ((bits >> (23 - MBITS)) & ((1 << MBITS) - 1))
    return tl.where(q < 1.0 / SUB_STEPS * (1 << MBITS), (q * SUB_STEPS).to(tl.int32), normal)


@triton.jit
def _value(c, MIN_EXP: tl.constexpr, MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """The value of index ``c`` (:func:`_code`'s inverse), exactly, as float32."""
    normal = ((((c >> MBITS) + 126 + MIN_EXP) << 23) | ((c & ((1 << MBITS) - 1)) << (23 - MBITS)))
    return tl.where(c < (1 << MBITS), c.to(tl.float32) * (1.0 / SUB_STEPS),
                    normal.to(tl.float32, bitcast=True))


@triton.jit
def _stored(q, min_scale):
    """The block scale ``nvfp4_qparams`` stores for the e4m3 value ``q``: ``min_scale`` where
    ``q`` is not positive (NaN included)."""
    return tl.where(q > 0.0, q, min_scale)


@triton.jit
def _block_error(x, mask, q, gs, min_scale, fmax, min_exp, mbits):
    """Each row's float64 error under the block scale ``q`` (e4m3) of global scale ``gs``:
    the effective scale ``block / gs``, priced as ``mse_price_fp``."""
    s = tl.math.div_rn(_stored(q, min_scale), gs)[:, None]
    return tl.sum(tl.where(mask, _term(x, x, s, s, 0.0, fmax, min_exp, mbits, True, False),
                           0.0), axis=1)


@triton.jit
def _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, B_MIN_EXP: tl.constexpr,
               B_MBITS: tl.constexpr):
    """Candidate ``k``'s e4m3 block scale (before ``min_scale`` replaces 0): the encoding of
    ``(lo * factors[k], hi * factors[k])``."""
    f = tl.load(f_ptr + k)
    return nvfp4_block_code(amax_of(lo * f, hi * f), gs, fmax, bmax, B_MIN_EXP, B_MBITS)


@triton.jit
def _ranges(lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax,
            B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, RATIO: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr):
    """What every NVFP4 kernel starts from: the program's rows and their mask, the ranges,
    the global scale, the incumbent's block scale, and whether the program may enumerate
    codes (``by_codes``).

    Where each factor is below the one before by a ratio under that of the format's
    closest consecutive rounding midpoints (at least ``1 + 2 ** -(B_MBITS + 1)``: e4m3's is
    31 / 29; ``RATIO`` is less 1e-5 for the three float32 roundings before the encoding;
    such factors are finite and of one sign), no two midpoints lie between two candidates:
    a unit's codes fall by 0 or 1 a candidate, and its distinct scales are every code from
    its first candidate's to its last's. A NaN amax (a NaN range or factor, 0 x inf) has
    no code."""
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    lo = tl.load(lo_ptr + rows, mask=rmask, other=0.0)
    hi = tl.load(hi_ptr + rows, mask=rmask, other=0.0)
    gs = _global_scale(tl.load(amax_ptr), bmax * fmax)
    q_inc = nvfp4_block_code(_amax(ilo_ptr, ihi_ptr, rows, rmask), gs, fmax, bmax, B_MIN_EXP,
                             B_MBITS)
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
def _units(x_ptr, rows, rmask, E, stride_u, BLOCK_E: tl.constexpr):
    """The program's tile of units, in registers, and its mask."""
    cols = tl.arange(0, BLOCK_E)
    mask = rmask[:, None] & (cols[None, :] < E)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_u + cols[None, :], mask=mask,
                other=0.0)
    return x, mask


@triton.jit
def _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, B_MIN_EXP: tl.constexpr,
               B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """Each row's first candidate's code and how many codes its candidates fall through
    (0 for masked rows): its distinct scales are codes ``first - j``, ``0 <= j <= span``."""
    first = _code(_candidate(lo, hi, f_ptr, 0, gs, fmax, bmax, B_MIN_EXP, B_MBITS), B_MIN_EXP,
                  B_MBITS, SUB_STEPS)
    last = _code(_candidate(lo, hi, f_ptr, K - 1, gs, fmax, bmax, B_MIN_EXP, B_MBITS),
                 B_MIN_EXP, B_MBITS, SUB_STEPS)
    return first, tl.where(rmask, first - last, 0)


# ---- the first lowest error: one launch ----------------------------------------------------

@triton.jit
def _lowest_by_codes(x, mask, rmask, lo, hi, f_ptr, K, gs, best, fmax, min_exp, mbits, bmax,
                     min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                     SUB_STEPS: tl.constexpr, STEPS: tl.constexpr):
    """``(idx, best)`` of ``by_codes`` programs: every distinct code priced once, in the
    candidates' order (the first lowest is then the first candidate's that has it), then
    the first candidate of the chosen code found by bisection (codes fall with k)."""
    first, span = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                             SUB_STEPS)
    best_code = tl.full(first.shape, -1, tl.int32)
    for j in range(tl.max(span) + 1):
        c = first - j
        err = _block_error(x, mask, _value(c, B_MIN_EXP, B_MBITS, SUB_STEPS), gs, min_scale,
                           fmax, min_exp, mbits)
        better = (j <= span) & (err < best)
        best = tl.where(better, err, best)
        best_code = tl.where(better, c, best_code)
    lo_k = tl.zeros(first.shape, tl.int32)
    hi_k = tl.zeros(first.shape, tl.int32) + (K - 1)
    for _ in range(STEPS):
        mid = (lo_k + hi_k) // 2
        left = _code(_candidate(lo, hi, f_ptr, mid, gs, fmax, bmax, B_MIN_EXP, B_MBITS),
                     B_MIN_EXP, B_MBITS, SUB_STEPS) <= best_code
        hi_k = tl.where(left, mid, hi_k)
        lo_k = tl.where(left, lo_k, mid + 1)
    return tl.where(best_code >= 0, lo_k.to(tl.int64), -1), best


@triton.jit
def _lowest_by_candidates(x, mask, lo, hi, f_ptr, K, gs, best, fmax, min_exp, mbits, bmax,
                          min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr):
    """``(idx, best)`` with every candidate priced, in order (the first lowest kept)."""
    idx = tl.full(best.shape, -1, tl.int64)
    for k in range(K):
        q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, B_MIN_EXP, B_MBITS)
        err = _block_error(x, mask, q, gs, min_scale, fmax, min_exp, mbits)
        better = err < best
        best = tl.where(better, err, best)
        idx = tl.where(better, k, idx)
    return idx, best


@triton.jit
def _search_kernel(x_ptr, lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, idx_ptr,
                   best_ptr, U, E, K, stride_u, fmax, min_exp, mbits, bmax, min_scale,
                   B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr,
                   RATIO: tl.constexpr, STEPS: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, B_MIN_EXP,
        B_MBITS, RATIO, BLOCK_K, BLOCK_U)
    x, mask = _units(x_ptr, rows, rmask, E, stride_u, BLOCK_E)
    # the incumbent's error is the running best (index -1)
    best = _block_error(x, mask, q_inc, gs, min_scale, fmax, min_exp, mbits)
    if by_codes:
        idx, best = _lowest_by_codes(x, mask, rmask, lo, hi, f_ptr, K, gs, best, fmax, min_exp,
                                     mbits, bmax, min_scale, B_MIN_EXP, B_MBITS, SUB_STEPS,
                                     STEPS)
    else:  # a NaN range, or factors too far apart (codes may skip)
        idx, best = _lowest_by_candidates(x, mask, lo, hi, f_ptr, K, gs, best, fmax, min_exp,
                                          mbits, bmax, min_scale, B_MIN_EXP, B_MBITS)
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


# ---- any rules: the codes priced into a scratch, then the candidates walked ----------------

@triton.jit
def _error_of(scratch_ptr, rows, rmask, U, k, q, first, by_codes, B_MIN_EXP: tl.constexpr,
              B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr):
    """Candidate ``k``'s errors (block scale ``q``) from the scratch: its code's row
    (``first - code``) by codes, else its own row ``k``."""
    row = tl.where(by_codes, first - _code(q, B_MIN_EXP, B_MBITS, SUB_STEPS), k)
    return tl.load(scratch_ptr + row.to(tl.int64) * U + rows, mask=rmask, other=0.0)


@triton.jit
def _price_kernel(x_ptr, lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, inc_ptr,
                  scratch_ptr, flags_ptr, U, E, K, G, stride_u, fmax, min_exp, mbits, bmax,
                  min_scale, TIE_LAST: tl.constexpr, B_MIN_EXP: tl.constexpr,
                  B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr, RATIO: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, B_MIN_EXP,
        B_MBITS, RATIO, BLOCK_K, BLOCK_U)
    x, mask = _units(x_ptr, rows, rmask, E, stride_u, BLOCK_E)
    U64 = tl.cast(U, tl.int64)  # row offsets: K * U may pass 2 ** 31
    inc = _block_error(x, mask, q_inc, gs, min_scale, fmax, min_exp, mbits)
    tl.store(inc_ptr + rows, inc, mask=rmask)
    first, span = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                             SUB_STEPS)
    if by_codes:  # code first - j into row j
        for j in range(tl.max(span) + 1):
            err = _block_error(x, mask, _value(first - j, B_MIN_EXP, B_MBITS, SUB_STEPS), gs,
                               min_scale, fmax, min_exp, mbits)
            tl.store(scratch_ptr + j * U64 + rows, err, mask=rmask)
    else:  # candidate k into row k
        for k in range(K):
            q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, B_MIN_EXP, B_MBITS)
            err = _block_error(x, mask, q, gs, min_scale, fmax, min_exp, mbits)
            tl.store(scratch_ptr + k * U64 + rows, err, mask=rmask)
    if G > 0:
        # the global rule's input (ops.improved_rows): which of the grid's first G
        # candidates improve one of this program's units on its running best (every unit
        # searching: the rule decides when they stop), read back from rows other threads
        # stored
        tl.debug_barrier()
        best = inc
        for k in range(G):
            q = _candidate(lo, hi, f_ptr, k, gs, fmax, bmax, B_MIN_EXP, B_MBITS)
            e = _error_of(scratch_ptr, rows, rmask, U64, k, q, first, by_codes, B_MIN_EXP,
                          B_MBITS, SUB_STEPS)
            if TIE_LAST:
                improved = e <= best
            else:
                improved = e < best
            best = tl.minimum(best, e, propagate_nan=tl.PropagateNan.ALL)  # torch's cummin
            improved = (improved & rmask).to(tl.int32)
            tl.store(flags_ptr + tl.program_id(0) * G + k, tl.max(improved).to(tl.int8))


@triton.jit
def _select_kernel(lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, inc_ptr, scratch_ptr,
                   gstop_ptr, idx_ptr, best_ptr, U, K, ext_start, patience, fmax, bmax,
                   min_scale, PER_UNIT: tl.constexpr, USE_GLOBAL: tl.constexpr,
                   HAS_PATIENCE: tl.constexpr, TIE_LAST: tl.constexpr,
                   B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr, SUB_STEPS: tl.constexpr,
                   RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr):
    rows, rmask, lo, hi, gs, q_inc, by_codes = _ranges(
        lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, amax_ptr, f_ptr, U, K, fmax, bmax, B_MIN_EXP,
        B_MBITS, RATIO, BLOCK_K, BLOCK_U)
    U64 = tl.cast(U, tl.int64)
    first, _ = _code_span(lo, hi, rmask, f_ptr, K, gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                          SUB_STEPS)
    best = tl.load(inc_ptr + rows, mask=rmask, other=0.0)
    idx = tl.full([BLOCK_U], -1, tl.int64)
    stale = tl.zeros([BLOCK_U], tl.int32)
    stopped = tl.zeros([BLOCK_U], tl.int1)
    gstop = tl.load(gstop_ptr)
    q_prev = q_inc
    for i in range(K):
        q = _candidate(lo, hi, f_ptr, i, gs, fmax, bmax, B_MIN_EXP, B_MBITS)
        e = _error_of(scratch_ptr, rows, rmask, U64, i, q, first, by_codes, B_MIN_EXP, B_MBITS,
                      SUB_STEPS)
        same = _stored(q, min_scale) == _stored(q_prev, min_scale)
        best, idx, stale, stopped = select_step(i, e, same, best, idx, stale, stopped, gstop,
                                                ext_start, patience, PER_UNIT, USE_GLOBAL,
                                                HAS_PATIENCE, TIE_LAST)
        q_prev = q
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


# ---- launchers -----------------------------------------------------------------------------

def _consts(units, factors, block_max, block_min_exp, block_mbits, block_u):
    """``(grid, constexprs)`` the NVFP4 launches share."""
    U, E = units.shape
    be = triton.next_power_of_2(max(E, 1))
    bu = block_u or max(1, min(triton.next_power_of_2(U), 2048 // be))
    return (triton.cdiv(U, bu),), {
        "B_MIN_EXP": int(block_min_exp), "B_MBITS": int(block_mbits),
        "SUB_STEPS": float(2 ** (block_mbits - block_min_exp)),
        "RATIO": 1.0 + 2.0 ** -(block_mbits + 1) - 1e-5,
        # at least 64: fewer compiled variants (the factors' check is one vector op)
        "BLOCK_K": max(64, triton.next_power_of_2(factors.shape[0])), "BLOCK_U": bu, **LAUNCH}


def nvfp4_search(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 factors: torch.Tensor, inc_lo: torch.Tensor, inc_hi: torch.Tensor,
                 global_amax: torch.Tensor, fmax: float, min_exp: int, mbits: int,
                 block_max: float, block_min_exp: int, block_mbits: int, min_scale: float,
                 *, block_u: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's lowest-error search in one launch (``kernels.ops``' ``nvfp4_search``):
    ``(idx, best)`` per unit of float32 ``units [U, E]`` (rows contiguous, ``E <=
    MAX_TILE``), ``lo`` / ``hi`` / ``inc_lo`` / ``inc_hi`` float32 ``[U]``, ``factors``
    float32 ``[K]``, ``global_amax`` one float32 value on the device."""
    (U, E), K = units.shape, factors.shape[0]
    idx = torch.empty(U, dtype=torch.int64, device=units.device)
    best = torch.empty(U, dtype=torch.float64, device=units.device)
    if U:
        grid, consts = _consts(units, factors, block_max, block_min_exp, block_mbits, block_u)
        _search_kernel[grid](
            units, lo, hi, factors, inc_lo, inc_hi, global_amax, idx, best, U, E, K,
            units.stride(0), float(fmax), int(min_exp), int(mbits), float(block_max),
            float(min_scale), STEPS=max(1, (K - 1).bit_length()) + 1,
            BLOCK_E=triton.next_power_of_2(max(E, 1)), **consts)
    return idx, best


def nvfp4_mse(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, factors: torch.Tensor,
              inc_lo: torch.Tensor, inc_hi: torch.Tensor, global_amax: torch.Tensor,
              fmax: float, min_exp: int, mbits: int, block_max: float, block_min_exp: int,
              block_mbits: int, min_scale: float, ext_start: int, patience: int | None,
              per_unit: bool, use_global: bool, tie_last: bool, global_stop, *,
              block_u: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's search under ``mse_select``'s rules (``kernels.ops``' ``nvfp4_mse``), in two
    launches: ``(idx, best)``; arguments as :func:`nvfp4_search`'s, then the rules'
    (``patience`` None: none), and ``global_stop(improved)``: the one-value int64 tensor of
    the candidate after which the global rule stops, from ``improved [G]`` (bool: the grid's
    candidates that improve some unit)."""
    (U, E), K = units.shape, factors.shape[0]
    dev = units.device
    idx = torch.empty(U, dtype=torch.int64, device=dev)
    best = torch.empty(U, dtype=torch.float64, device=dev)
    if not U:
        return idx, best
    grid, consts = _consts(units, factors, block_max, block_min_exp, block_mbits, block_u)
    G = ext_start if use_global and patience is not None else 0
    inc = torch.empty(U, dtype=torch.float64, device=dev)
    scratch = torch.empty((K, U), dtype=torch.float64, device=dev)
    flags = torch.zeros((grid[0], max(G, 1)), dtype=torch.int8, device=dev)
    formats = (float(fmax), int(min_exp), int(mbits), float(block_max), float(min_scale))
    _price_kernel[grid](units, lo, hi, factors, inc_lo, inc_hi, global_amax, inc, scratch,
                        flags, U, E, K, G, units.stride(0), *formats, TIE_LAST=bool(tie_last),
                        BLOCK_E=triton.next_power_of_2(max(E, 1)), **consts)
    gstop = global_stop(flags[:, :G].any(0))
    _select_kernel[grid](lo, hi, factors, inc_lo, inc_hi, global_amax, inc, scratch, gstop, idx,
                         best, U, K, ext_start, 0 if patience is None else int(patience),
                         float(fmax), float(block_max), float(min_scale),
                         PER_UNIT=bool(per_unit), USE_GLOBAL=bool(use_global),
                         HAS_PATIENCE=patience is not None, TIE_LAST=bool(tie_last), **consts)
    return idx, best
