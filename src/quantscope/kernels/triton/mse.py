"""The MSE grid search's pricing, fused over candidates (Triton): the squared fake-quant
error of every candidate ``(scale, zero_point)`` on every unit: integer formats
(``mse_price_int``) and float element formats (``mse_price_fp``: fp8 / fp6 / fp4 elements
under per-unit effective scales, MX and NVFP4 blocks; zero point 0). One kernel prices both
(``FLOAT`` picks the element rounding), so their sums cannot drift apart.

``err[k, u] = sum_e float64(d * d)``, ``d = fake_quant(x, scale[k, u], zp[k, u]) - x`` in
float32 rounded as ``qdq.fake_quantize_units`` (``_jit.fake_quant``, ``_jit.fake_quant_fp``),
its square rounded to float32 and summed in float64: the terms of the C kernel
(``csrc/mse_search.c``, ``qs_mse_price`` / ``qs_mse_price_fp``) and of the torch path
(``mse_tiles._tile_error``), so the three agree up to the order of the float64 sum (tests:
1e-12). With ``weights`` ``w [U, E]`` (a ``WEIGHTED`` constexpr of the same kernel):
``sum_e float64(w) * float64(d * d)``, the C kernel's weighted terms.

A program takes ``BLOCK_U`` units. Rows that fit one tile (``E <= BLOCK_E``) are loaded
once and every candidate is priced on them in registers; longer rows are walked once per
candidate (the unit's block stays in the cache). The selection rules (patience per unit or
global, ties) then run on the ``[K, U]`` prices: each depends only on the prices of the
candidates before it, so pricing them all and selecting afterwards chooses what a search
that stops early chooses.

``nvfp4_search`` fuses an NVFP4 search whose rule is the first lowest error (no patience,
as ``nvfp4_expanded_mse``'s): each program holds a tile of units, computes its candidates'
e4m3 block scales itself and, where the factors fall finely enough that a unit's codes
move by at most one per candidate, prices each distinct code once (~11 of 111 candidates),
then bisects for the first candidate of the chosen code; elsewhere it prices every one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH, fake_quant, fake_quant_fp
from .block_qparams import _amax, _global_scale, nvfp4_block_code

__all__ = ["mse_price_fp", "mse_price_int", "mse_select", "nvfp4_search"]

#: the longest row priced from registers (one tile per unit)
MAX_TILE = 8192


@triton.jit
def _term(x, w, s, z, qmin, qmax, min_exp, mbits, FLOAT: tl.constexpr,
          WEIGHTED: tl.constexpr):
    """Each element's float64 term under per-row scales ``s`` (and zero points ``z``, an
    integer format's; not read for a float one), ``[rows, 1]``: ``float64(d * d)`` of
    ``d = fake_quant(x) - x`` (the square rounded to float32, as the C kernel and the torch
    path round it), or weighted ``float64(w) * float64(d * d)`` (the product rounded once: the
    weighted search's arithmetic). An integer format's, or a float element format's (zero
    point 0, ``qmax`` its max)."""
    if FLOAT:
        q = fake_quant_fp(x, s, qmax, min_exp, mbits)
    else:
        q = fake_quant(x, s, z, qmin, qmax)
    d = q - x
    if WEIGHTED:
        return (d * d).to(tl.float64) * w.to(tl.float64)
    return (d * d).to(tl.float64)


@triton.jit
def _candidate_term(x, w, s_ptr, z_ptr, k, U, rows, rmask, qmin, qmax, min_exp, mbits,
                    FLOAT: tl.constexpr, WEIGHTED: tl.constexpr):
    """:func:`_term` under candidate ``k`` of rows ``rows`` (``z_ptr``: int32 zero points,
    not read for a float format)."""
    s = tl.load(s_ptr + k * U + rows, mask=rmask, other=1.0)[:, None]
    z = s
    if not FLOAT:
        z = tl.load(z_ptr + k * U + rows, mask=rmask, other=0).to(tl.float32)[:, None]
    return _term(x, w, s, z, qmin, qmax, min_exp, mbits, FLOAT, WEIGHTED)


@triton.jit
def _weights(wbase, cols, mask, x, WEIGHTED: tl.constexpr):
    """The tile's weights (WEIGHTED), else ``x`` (never read: one return type)."""
    w = x
    if WEIGHTED:
        w = tl.load(wbase + cols[None, :], mask=mask, other=0.0)
    return w


@triton.jit
def _price_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, U, E, K, stride_u, stride_w, qmin, qmax,
                  min_exp, mbits, BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr,
                  ONE_TILE: tl.constexpr, FLOAT: tl.constexpr, WEIGHTED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    base = x_ptr + rows[:, None].to(tl.int64) * stride_u
    wbase = w_ptr + rows[:, None].to(tl.int64) * stride_w  # not read unless WEIGHTED
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_E)
        mask = rmask[:, None] & (cols[None, :] < E)
        x = tl.load(base + cols[None, :], mask=mask, other=0.0)
        w = _weights(wbase, cols, mask, x, WEIGHTED)
        for k in range(K):
            t = _candidate_term(x, w, s_ptr, z_ptr, k, U, rows, rmask, qmin, qmax, min_exp,
                                mbits, FLOAT, WEIGHTED)
            tl.store(out_ptr + k * U + rows, tl.sum(tl.where(mask, t, 0.0), axis=1),
                     mask=rmask)
    else:
        for k in range(K):
            acc = tl.zeros([BLOCK_U, BLOCK_E], tl.float64)
            for e0 in range(0, E, BLOCK_E):
                cols = e0 + tl.arange(0, BLOCK_E)
                mask = rmask[:, None] & (cols[None, :] < E)
                x = tl.load(base + cols[None, :], mask=mask, other=0.0)
                w = _weights(wbase, cols, mask, x, WEIGHTED)
                t = _candidate_term(x, w, s_ptr, z_ptr, k, U, rows, rmask, qmin, qmax, min_exp,
                                    mbits, FLOAT, WEIGHTED)
                acc += tl.where(mask, t, 0.0)
            tl.store(out_ptr + k * U + rows, tl.sum(acc, axis=1), mask=rmask)


def _price(units, scale, zero_point, qmin, qmax, min_exp, mbits, block_u, block_e,
           weights=None):
    """The launch both element kinds share: ``zero_point`` None for a float format,
    ``weights`` None unweighted."""
    U, E = units.shape
    K = scale.shape[0]
    out = torch.empty((K, U), dtype=torch.float64, device=units.device)
    if not (U and K):
        return out
    one_tile = block_e is None and E <= MAX_TILE
    be = block_e or (triton.next_power_of_2(max(E, 1)) if one_tile else 1024)
    bu = block_u or max(1, min(triton.next_power_of_2(U), 2048 // be))
    is_float, weighted = zero_point is None, weights is not None
    _price_kernel[(triton.cdiv(U, bu),)](
        units, weights if weighted else units, scale, scale if is_float else zero_point, out,
        U, E, K, units.stride(0), weights.stride(0) if weighted else 0, float(qmin),
        float(qmax), int(min_exp), int(mbits), BLOCK_U=bu, BLOCK_E=be, ONE_TILE=one_tile,
        FLOAT=is_float, WEIGHTED=weighted, **LAUNCH)
    return out


def mse_price_int(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  qmin: float, qmax: float, *, weights: torch.Tensor | None = None,
                  block_u: int | None = None, block_e: int | None = None) -> torch.Tensor:
    """Float64 ``[K, U]`` squared errors of candidates ``scale`` (float32 ``[K, U]``) and
    ``zero_point`` (int32 ``[K, U]``), both contiguous, on float32 ``units [U, E]`` whose rows
    are contiguous (``weights``: float32 ``[U, E]``, rows contiguous, or None)."""
    return _price(units, scale, zero_point, qmin, qmax, 0, 0, block_u, block_e, weights)


def mse_price_fp(units: torch.Tensor, scale: torch.Tensor, fmax: float, min_exp: int,
                 mbits: int, *, weights: torch.Tensor | None = None,
                 block_u: int | None = None, block_e: int | None = None) -> torch.Tensor:
    """Float64 ``[K, U]`` squared errors of candidate effective scales ``scale`` (float32
    ``[K, U]``, contiguous) under a float element format (``FloatFormat``'s ``max``,
    ``min_exp`` and ``mbits``; zero point 0) on float32 ``units [U, E]`` whose rows are
    contiguous (``weights``: as :func:`mse_price_int`'s)."""
    return _price(units, scale, None, -fmax, fmax, min_exp, mbits, block_u, block_e, weights)


@triton.jit
def _select_kernel(err_ptr, same_ptr, inc_ptr, gstop_ptr, idx_ptr, best_ptr, U, K, ext_start,
                   patience, PER_UNIT: tl.constexpr, USE_GLOBAL: tl.constexpr,
                   HAS_PATIENCE: tl.constexpr, TIE_LAST: tl.constexpr, BLOCK_U: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    best = tl.load(inc_ptr + rows, mask=rmask, other=0.0)
    idx = tl.full([BLOCK_U], -1, tl.int64)
    stale = tl.zeros([BLOCK_U], tl.int32)
    stopped = tl.zeros([BLOCK_U], tl.int1)
    gstop = tl.load(gstop_ptr)
    for i in range(K):
        e = tl.load(err_ptr + i * U + rows, mask=rmask, other=0.0)
        if USE_GLOBAL:  # the global rule: over the grid's rows only
            grid_row = i < ext_start
        else:
            grid_row = i < 0
        g_stopped = (i > gstop) & grid_row
        if not HAS_PATIENCE:
            active = tl.full([BLOCK_U], 1, tl.int1)
        elif PER_UNIT:
            # the global rule's grid: a unit stops when it and the global rule have stopped
            # (without it: on its own); the extension's rows: on its own
            active = ~(stopped & (g_stopped | ~grid_row))
        else:
            active = ~(stopped | g_stopped)
        if TIE_LAST:
            better = active & (e <= best)
        else:
            better = active & (e < best)
        best = tl.where(better, e, best)
        idx = tl.where(better, i, idx)
        if HAS_PATIENCE and PER_UNIT:
            same = tl.load(same_ptr + i * U + rows, mask=rmask, other=0) != 0
            counts = active & ~better & ~same
            stale = tl.where(better, 0, stale + counts.to(tl.int32))
            stopped = stopped | (stale >= patience)
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


def mse_select(err: torch.Tensor, same: torch.Tensor, incumbent: torch.Tensor,
               gstop: torch.Tensor, ext_start: int, patience: int | None, per_unit: bool,
               use_global: bool, tie_last: bool, *, block_u: int = 128
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection rules over priced candidates, unit by unit (see ``kernels.ops``'
    ``mse_select``): ``(idx, best)``. ``gstop``: a one-value int64 tensor, the candidate
    after which the global rule has stopped (computed on the device from ``err``)."""
    K, U = err.shape
    idx = torch.empty(U, dtype=torch.int64, device=err.device)
    best = torch.empty(U, dtype=err.dtype, device=err.device)
    if U:
        _select_kernel[(triton.cdiv(U, block_u),)](
            err, same.view(torch.uint8), incumbent, gstop, idx, best, U, K, ext_start,
            0 if patience is None else int(patience), PER_UNIT=bool(per_unit),
            USE_GLOBAL=bool(use_global), HAS_PATIENCE=patience is not None,
            TIE_LAST=bool(tie_last), BLOCK_U=block_u, **LAUNCH)
    return idx, best


# ---- NVFP4's lowest-error search, fused -----------------------------------------------------

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
def _block_error(x, mask, q, gs, min_scale, fmax, min_exp, mbits):
    """Each row's float64 error under the block scale ``q`` (e4m3, ``min_scale`` for 0) of
    global scale ``gs``: the effective scale ``block / gs``, priced as ``mse_price_fp``."""
    s = tl.math.div_rn(tl.where(q > 0.0, q, min_scale), gs)[:, None]
    return tl.sum(tl.where(mask, _term(x, x, s, s, 0.0, fmax, min_exp, mbits, True, False),
                           0.0), axis=1)


@triton.jit
def _candidate_code(amax, f, gs, fmax, bmax, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                    SUB_STEPS: tl.constexpr):
    """The block-scale code of the candidate of factor ``f`` (``amax_of_range(lo * f,
    hi * f)`` is ``amax * f`` for ``f > 0``)."""
    return _code(nvfp4_block_code(amax * f, gs, fmax, bmax, B_MIN_EXP, B_MBITS), B_MIN_EXP,
                 B_MBITS, SUB_STEPS)


@triton.jit
def _lowest_by_codes(x, mask, rmask, amax, f_ptr, K, gs, best, fmax, min_exp, mbits, bmax,
                     min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                     SUB_STEPS: tl.constexpr, STEPS: tl.constexpr):
    """``(idx, best)`` where each unit's candidate codes fall by 0 or 1 a candidate: every
    code from the first candidate's to the last's priced once, in the candidates' order
    (the first lowest is then the first candidate's that has it), then the first candidate
    of the chosen code found by bisection (codes fall with k)."""
    first = _candidate_code(amax, tl.load(f_ptr), gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                            SUB_STEPS)
    last = _candidate_code(amax, tl.load(f_ptr + K - 1), gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                           SUB_STEPS)
    span = tl.where(rmask, first - last, 0)
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
        left = _candidate_code(amax, tl.load(f_ptr + mid), gs, fmax, bmax, B_MIN_EXP, B_MBITS,
                               SUB_STEPS) <= best_code
        hi_k = tl.where(left, mid, hi_k)
        lo_k = tl.where(left, lo_k, mid + 1)
    return tl.where(best_code >= 0, lo_k.to(tl.int64), -1), best


@triton.jit
def _lowest_by_candidates(x, mask, amax, f_ptr, K, gs, best, fmax, min_exp, mbits, bmax,
                          min_scale, B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr):
    """``(idx, best)`` with every candidate priced, in order (the first lowest kept)."""
    idx = tl.full(best.shape, -1, tl.int64)
    for k in range(K):
        q = nvfp4_block_code(amax * tl.load(f_ptr + k), gs, fmax, bmax, B_MIN_EXP, B_MBITS)
        err = _block_error(x, mask, q, gs, min_scale, fmax, min_exp, mbits)
        better = err < best
        best = tl.where(better, err, best)
        idx = tl.where(better, k, idx)
    return idx, best


@triton.jit
def _nvfp4_search_kernel(x_ptr, lo_ptr, hi_ptr, f_ptr, ilo_ptr, ihi_ptr, amax_ptr, idx_ptr,
                         best_ptr, U, E, K, stride_u, fmax, min_exp, mbits, bmax, min_scale,
                         B_MIN_EXP: tl.constexpr, B_MBITS: tl.constexpr,
                         SUB_STEPS: tl.constexpr, RATIO: tl.constexpr, STEPS: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    cols = tl.arange(0, BLOCK_E)
    mask = rmask[:, None] & (cols[None, :] < E)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_u + cols[None, :], mask=mask,
                other=0.0)
    gs = _global_scale(tl.load(amax_ptr), bmax * fmax)
    amax = _amax(lo_ptr, hi_ptr, rows, rmask)
    # the incumbent's error is the running best (index -1)
    best = _block_error(x, mask, nvfp4_block_code(_amax(ilo_ptr, ihi_ptr, rows, rmask), gs,
                                                  fmax, bmax, B_MIN_EXP, B_MBITS),
                        gs, min_scale, fmax, min_exp, mbits)
    # where each factor is below the one before by a ratio under that of the format's
    # closest consecutive rounding midpoints (at least 1 + 2 ** -(B_MBITS + 1); e4m3's is
    # 31 / 29; less 1e-5 for the three float32 roundings before the encoding), no two
    # midpoints lie between two candidates: a unit's codes fall by 0 or 1 a candidate
    ks = tl.arange(0, BLOCK_K)
    f = tl.load(f_ptr + ks, mask=ks < K, other=1.0)
    f_next = tl.load(f_ptr + ks + 1, mask=ks + 1 < K, other=0.5)
    fine = (ks + 1 >= K) | ((f_next > 0.0) & (f_next < f) & (f < f_next * RATIO))
    finite = (amax == amax) | ~rmask  # noqa: PLR0124  (a NaN range has no code order)
    if (tl.min(fine.to(tl.int32)) == 1) & (tl.min(finite.to(tl.int32)) == 1):
        idx, best = _lowest_by_codes(x, mask, rmask, amax, f_ptr, K, gs, best, fmax, min_exp,
                                     mbits, bmax, min_scale, B_MIN_EXP, B_MBITS, SUB_STEPS,
                                     STEPS)
    else:  # a NaN range, or factors too far apart (codes may skip)
        idx, best = _lowest_by_candidates(x, mask, amax, f_ptr, K, gs, best, fmax, min_exp,
                                          mbits, bmax, min_scale, B_MIN_EXP, B_MBITS)
    tl.store(idx_ptr + rows, idx, mask=rmask)
    tl.store(best_ptr + rows, best, mask=rmask)


def nvfp4_search(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 factors: torch.Tensor, inc_lo: torch.Tensor, inc_hi: torch.Tensor,
                 global_amax: torch.Tensor, fmax: float, min_exp: int, mbits: int,
                 block_max: float, block_min_exp: int, block_mbits: int, min_scale: float,
                 *, block_u: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's lowest-error search in one launch (``kernels.ops``' ``nvfp4_search``):
    ``(idx, best)`` per unit of float32 ``units [U, E]`` (rows contiguous, ``E <=
    MAX_TILE``), ``lo`` / ``hi`` / ``inc_lo`` / ``inc_hi`` float32 ``[U]``, ``factors``
    float32 ``[K]`` falling, ``global_amax`` one float32 value on the device."""
    U, E = units.shape
    K = factors.shape[0]
    idx = torch.empty(U, dtype=torch.int64, device=units.device)
    best = torch.empty(U, dtype=torch.float64, device=units.device)
    if not U:
        return idx, best
    be = triton.next_power_of_2(max(E, 1))
    bu = block_u or max(1, min(triton.next_power_of_2(U), 2048 // be))
    _nvfp4_search_kernel[(triton.cdiv(U, bu),)](
        units, lo, hi, factors, inc_lo, inc_hi, global_amax, idx, best, U, E, K,
        units.stride(0), float(fmax), int(min_exp), int(mbits), float(block_max),
        float(min_scale), B_MIN_EXP=int(block_min_exp), B_MBITS=int(block_mbits),
        SUB_STEPS=float(2 ** (block_mbits - block_min_exp)),
        RATIO=1.0 + 2.0 ** -(block_mbits + 1) - 1e-5, STEPS=max(1, (K - 1).bit_length()) + 1,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_U=bu, BLOCK_E=be, **LAUNCH)
    return idx, best
