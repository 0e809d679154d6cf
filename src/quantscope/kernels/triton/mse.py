"""The MSE grid search's pricing, fused over candidates (Triton): the squared fake-quant
error of every candidate ``(scale, zero_point)`` on every unit: integer formats
(``mse_price_int``) and float element formats (``mse_price_fp``: fp8 / fp6 / fp4 elements
under per-unit effective scales, MX and NVFP4 blocks; zero point 0). One kernel prices both
(``FLOAT`` picks the element rounding), so their sums cannot drift apart.

``err[k, u] = sum_e float64(d) * float64(d)``, ``d = fake_quant(x, scale[k, u], zp[k, u]) - x``
in float32 rounded as ``qdq.fake_quantize_units`` (``_jit.fake_quant``,
``_jit.fake_quant_fp``), its square taken in float64 (exact) and summed in float64: the terms
of the C kernel (``csrc/mse_search.c``, ``qs_mse_price_w`` / ``qs_mse_price_fp_w``) and of the
torch path (``mse_tiles._tile_error``), so the three agree up to the order of the float64 sum
(tests: 1e-12). With ``weights`` ``w [U, E]`` (a ``WEIGHTED`` constexpr of the same kernel):
``sum_e float64(w) * (float64(d) * float64(d))``, the C kernel's weighted terms.
``float32_squares`` (an ``SQ32`` constexpr) rounds each square to float32 first,
``float64(d * d)``: a compat class's toolkit arithmetic. Another ``norm`` (a ``NORM``
constexpr: llm-compressor's 2.4) prices ``float64(|d| ** norm)``, the float32 power as torch's
CUDA ``pow`` rounds it (``_jit.norm_term``).

The float64 multiply costs nothing measurable where float64 runs at half float32's rate
(H100 / H200, A100); on consumer GPUs (1/32 or 1/64 of the float32 rate) the float64 square
and sum can bind before the fake-quant's float32 work does.

A program takes ``BLOCK_U`` units. Rows that fit one tile (``E <= BLOCK_E``) are loaded
once and every candidate is priced on them in registers; longer rows are walked once per
candidate (the unit's block stays in the cache). The selection rules (patience per unit or
global, ties) then run on the ``[K, U]`` prices: each depends only on the prices of the
candidates before it, so pricing them all and selecting afterwards chooses what a search
that stops early chooses.

The block-scale searches (NVFP4, MX) price and select in kernels of their own
(:mod:`.block_search`), which reuse this module's pricing term (``_term``) and selection
rules (``select_step``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH, cdiv, fake_quant, fake_quant_fp, next_power_of_2, norm_term

__all__ = ["MAX_TILE", "mse_price_fp", "mse_price_int", "mse_select", "select_step"]

#: the longest row priced from registers (one tile per unit)
MAX_TILE = 8192


@triton.jit
def _term(x, w, s, z, qmin, qmax, min_exp, mbits, FLOAT: tl.constexpr,
          WEIGHTED: tl.constexpr, NORM: tl.constexpr, SQ32: tl.constexpr):
    """Each element's float64 term under per-row scales ``s`` (and zero points ``z``, an
    integer format's; not read for a float one), ``[rows, 1]``: ``float64(d) * float64(d)``
    of ``d = fake_quant(x) - x`` (exact, as the C kernel and the torch path square it;
    ``SQ32``: ``float64(d * d)``, rounded to float32; another ``NORM``: ``|d| ** NORM``
    rounded to float32), or weighted ``float64(w) * t`` (the product rounded once: the
    weighted search's arithmetic). An integer format's, or a float element format's (zero
    point 0, ``qmax`` its max)."""
    if FLOAT:
        q = fake_quant_fp(x, s, qmax, min_exp, mbits)
    else:
        q = fake_quant(x, s, z, qmin, qmax)
    if NORM == 2.0 and not SQ32:
        d = (q - x).to(tl.float64)
        t = d * d
    else:
        t = norm_term(q - x, NORM).to(tl.float64)
    if WEIGHTED:
        return t * w.to(tl.float64)
    return t


@triton.jit
def _candidate_term(x, w, s_ptr, z_ptr, k, U, rows, rmask, qmin, qmax, min_exp, mbits,
                    FLOAT: tl.constexpr, WEIGHTED: tl.constexpr, NORM: tl.constexpr,
                    SQ32: tl.constexpr):
    """:func:`_term` under candidate ``k`` of rows ``rows`` (``z_ptr``: int32 zero points,
    not read for a float format)."""
    row = tl.cast(k, tl.int64) * U  # K * U may pass 2 ** 31
    s = tl.load(s_ptr + row + rows, mask=rmask, other=1.0)[:, None]
    z = s
    if not FLOAT:
        z = tl.load(z_ptr + row + rows, mask=rmask, other=0).to(tl.float32)[:, None]
    return _term(x, w, s, z, qmin, qmax, min_exp, mbits, FLOAT, WEIGHTED, NORM, SQ32)


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
                  ONE_TILE: tl.constexpr, FLOAT: tl.constexpr, WEIGHTED: tl.constexpr,
                  NORM: tl.constexpr, SQ32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rmask = rows < U
    U64 = tl.cast(U, tl.int64)  # the output's row offsets: K * U may pass 2 ** 31
    base = x_ptr + rows[:, None].to(tl.int64) * stride_u
    wbase = w_ptr + rows[:, None].to(tl.int64) * stride_w  # not read unless WEIGHTED
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_E)
        mask = rmask[:, None] & (cols[None, :] < E)
        x = tl.load(base + cols[None, :], mask=mask, other=0.0)
        w = _weights(wbase, cols, mask, x, WEIGHTED)
        for k in range(K):
            t = _candidate_term(x, w, s_ptr, z_ptr, k, U, rows, rmask, qmin, qmax, min_exp,
                                mbits, FLOAT, WEIGHTED, NORM, SQ32)
            tl.store(out_ptr + k * U64 + rows, tl.sum(tl.where(mask, t, 0.0), axis=1),
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
                                    mbits, FLOAT, WEIGHTED, NORM, SQ32)
                acc += tl.where(mask, t, 0.0)
            tl.store(out_ptr + k * U64 + rows, tl.sum(acc, axis=1), mask=rmask)


def _price(units, scale, zero_point, qmin, qmax, min_exp, mbits, block_u, block_e,
           weights=None, norm=2.0, float32_squares=False):
    """The launch both element kinds share: ``zero_point`` None for a float format,
    ``weights`` None unweighted."""
    U, E = units.shape
    K = scale.shape[0]
    out = torch.empty((K, U), dtype=torch.float64, device=units.device)
    if not (U and K):
        return out
    one_tile = block_e is None and E <= MAX_TILE
    be = block_e or (next_power_of_2(max(E, 1)) if one_tile else 1024)
    bu = block_u or max(1, min(next_power_of_2(U), 2048 // be))
    is_float, weighted = zero_point is None, weights is not None
    _price_kernel[(cdiv(U, bu),)](
        units, weights if weighted else units, scale, scale if is_float else zero_point, out,
        U, E, K, units.stride(0), weights.stride(0) if weighted else 0, float(qmin),
        float(qmax), int(min_exp), int(mbits), BLOCK_U=bu, BLOCK_E=be, ONE_TILE=one_tile,
        FLOAT=is_float, WEIGHTED=weighted, NORM=float(norm), SQ32=bool(float32_squares),
        **LAUNCH)
    return out


def mse_price_int(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  qmin: float, qmax: float, *, weights: torch.Tensor | None = None,
                  norm: float = 2.0, float32_squares: bool = False,
                  block_u: int | None = None, block_e: int | None = None) -> torch.Tensor:
    """Float64 ``[K, U]`` squared (``norm``: ``|d| ** norm``) errors of candidates ``scale``
    (float32 ``[K, U]``) and ``zero_point`` (int32 ``[K, U]``), both contiguous, on float32
    ``units [U, E]`` whose rows are contiguous (``weights``: float32 ``[U, E]``, rows
    contiguous, or None; ``float32_squares``: the module doc's)."""
    return _price(units, scale, zero_point, qmin, qmax, 0, 0, block_u, block_e, weights, norm,
                  float32_squares)


def mse_price_fp(units: torch.Tensor, scale: torch.Tensor, fmax: float, min_exp: int,
                 mbits: int, *, weights: torch.Tensor | None = None, norm: float = 2.0,
                 float32_squares: bool = False, block_u: int | None = None,
                 block_e: int | None = None) -> torch.Tensor:
    """Float64 ``[K, U]`` squared (``norm``: ``|d| ** norm``) errors of candidate effective
    scales ``scale`` (float32 ``[K, U]``, contiguous) under a float element format
    (``FloatFormat``'s ``max``, ``min_exp`` and ``mbits``; zero point 0) on float32
    ``units [U, E]`` whose rows are contiguous (``weights``: as :func:`mse_price_int`'s)."""
    return _price(units, scale, None, -fmax, fmax, min_exp, mbits, block_u, block_e, weights,
                  norm, float32_squares)


@triton.jit
def select_step(i, e, same, best, idx, stale, stopped, gstop, ext_start, patience,
                PER_UNIT: tl.constexpr, USE_GLOBAL: tl.constexpr, HAS_PATIENCE: tl.constexpr,
                TIE_LAST: tl.constexpr):
    """The rules of ``mse_tiles._State.step`` on candidate ``i`` of errors ``e`` (``same``:
    its qparams equal the previous candidate's; read only with per-unit patience): the
    updated ``(best, idx, stale, stopped)`` of a vector of units."""
    if USE_GLOBAL:  # the global rule: over the grid's rows only
        grid_row = i < ext_start
    else:
        grid_row = i < 0
    g_stopped = (i > gstop) & grid_row
    if not HAS_PATIENCE:
        active = stopped | ~stopped
    elif PER_UNIT:
        # the global rule's grid: a unit stops when it and the global rule have stopped
        # (without it: on its own); the extension's rows: on its own
        active = ~(stopped & (g_stopped | ~grid_row))
    else:
        active = ~(stopped | g_stopped)
    if TIE_LAST:
        better = active & (e <= best) & (e < float("inf"))  # never a non-finite error
    else:
        better = active & (e < best)
    best = tl.where(better, e, best)
    idx = tl.where(better, i, idx)
    if HAS_PATIENCE and PER_UNIT:
        stale = tl.where(better, 0, stale + (active & ~better & ~same).to(tl.int32))
        stopped = stopped | (stale >= patience)
    return best, idx, stale, stopped


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
    U64 = tl.cast(U, tl.int64)  # the tables' row offsets: K * U may pass 2 ** 31
    for i in range(K):
        e = tl.load(err_ptr + i * U64 + rows, mask=rmask, other=0.0)
        same = stopped
        if HAS_PATIENCE and PER_UNIT:
            same = tl.load(same_ptr + i * U64 + rows, mask=rmask, other=0) != 0
        best, idx, stale, stopped = select_step(i, e, same, best, idx, stale, stopped, gstop,
                                                ext_start, patience, PER_UNIT, USE_GLOBAL,
                                                HAS_PATIENCE, TIE_LAST)
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
        _select_kernel[(cdiv(U, block_u),)](
            err, same.view(torch.uint8), incumbent, gstop, idx, best, U, K, ext_start,
            0 if patience is None else int(patience), PER_UNIT=bool(per_unit),
            USE_GLOBAL=bool(use_global), HAS_PATIENCE=patience is not None,
            TIE_LAST=bool(tie_last), BLOCK_U=block_u, **LAUNCH)
    return idx, best
