"""Per-unit min and max of a ``[units, elements]`` view in one read (Triton); also of a
``[U1, U2, E1, E2]`` view, so every layout without padding (a channel axis in the middle,
tiles) reads the tensor in place.

Each program takes ``BLOCK_U`` units and one chunk of their elements, keeps elementwise
running extremes in registers and reduces them once at the end; where the units are too
few to fill the GPU (per-tensor, a few channels) the elements are split into chunks whose
partial extremes a small torch reduction joins. bf16 / fp16 / fp32 inputs are read as they
are and widened to float32 in registers (exact); results are float32. NaN propagates: a unit
with a NaN gets NaN for both, as ``torch.aminmax`` gives (an explicit flag: the GPU's
``min`` would drop it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH

__all__ = ["unit_minmax"]

#: programs below which the elements are split into chunks (a few per SM of an H100)
TARGET_PROGRAMS = 512


@triton.jit
def _minmax_kernel(x_ptr, lo_ptr, hi_ptr, U, E, U2, E2, su1, su2, se1, se2, chunk, splits,
                   BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr, FOUR_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    split = tl.program_id(1)
    start = split * chunk
    if FOUR_D:  # unit (u1, u2), element (e1, e2) of a [U1, U2, E1, E2] view
        r64 = rows.to(tl.int64)
        row_off = (r64 // U2) * su1 + (r64 % U2) * su2
    else:
        row_off = rows.to(tl.int64) * su1
    lo = tl.full([BLOCK_U, BLOCK_E], float("inf"), tl.float32)
    hi = tl.full([BLOCK_U, BLOCK_E], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_U, BLOCK_E], tl.int32)
    for e0 in range(0, chunk, BLOCK_E):
        within = e0 + tl.arange(0, BLOCK_E)
        cols = start + within
        mask = (rows[:, None] < U) & (cols[None, :] < E) & (within[None, :] < chunk)
        if FOUR_D:
            c64 = cols.to(tl.int64)
            col_off = (c64 // E2) * se1 + (c64 % E2) * se2
        else:
            col_off = cols.to(tl.int64) * se2
        x = tl.load(x_ptr + row_off[:, None] + col_off[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
        nan = nan | (x != x).to(tl.int32)  # noqa: PLR0124 (the NaN test)
    has_nan = tl.max(nan, axis=1) > 0
    lo_u = tl.where(has_nan, float("nan"), tl.min(lo, axis=1))
    hi_u = tl.where(has_nan, float("nan"), tl.max(hi, axis=1))
    out = rows * splits + split
    tl.store(lo_ptr + out, lo_u, mask=rows < U)
    tl.store(hi_ptr + out, hi_u, mask=rows < U)


def _blocks(U: int, E: int, block_e: int | None, block_u: int | None) -> tuple[int, int]:
    be = block_e or min(triton.next_power_of_2(E), 512)
    bu = block_u or max(1, min(triton.next_power_of_2(U), 4096 // be))
    return bu, be


def _split(U: int, E: int, bu: int, be: int, splits: int | None) -> tuple[int, int]:
    """(chunk, splits): elements per program along a unit, and the number of chunks."""
    if splits is None:
        programs = triton.cdiv(U, bu)
        splits = 1 if programs >= TARGET_PROGRAMS else min(
            triton.cdiv(E, 4 * be), triton.cdiv(TARGET_PROGRAMS, programs))
    splits = max(1, splits)
    chunk = triton.cdiv(triton.cdiv(E, splits), be) * be
    return chunk, triton.cdiv(E, chunk)


def unit_minmax(units: torch.Tensor, *, block_u: int | None = None, block_e: int | None = None,
                splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, float32 ``[U]``, of ``units``: a ``[U, E]`` view, or a ``[U1, U2, E1, E2]``
    view whose units are ``(u1, u2)`` and elements ``(e1, e2)`` (the layouts whose units are
    no row view: a channel axis in the middle, tiles; any strides; ``E >= 1``). The block sizes
    and the split count are chosen from the shape unless given (the tests force small ones
    to cover every loop)."""
    if units.dim() == 2:
        (U, E), (U2, E2) = units.shape, (1, units.shape[1])
        (su1, se2), su2, se1 = units.stride(), 0, 0
    else:
        U1, U2, E1, E2 = units.shape
        U, E = U1 * U2, E1 * E2
        su1, su2, se1, se2 = units.stride()
    bu, be = _blocks(U, E, block_e, block_u)
    chunk, splits = _split(U, E, bu, be, splits)
    lo = torch.empty(U * splits, dtype=torch.float32, device=units.device)
    hi = torch.empty_like(lo)
    grid = (triton.cdiv(U, bu), splits)
    _minmax_kernel[grid](units, lo, hi, U, E, U2, E2, su1, su2, se1, se2, chunk, splits,
                         BLOCK_U=bu, BLOCK_E=be, FOUR_D=units.dim() == 4, **LAUNCH)
    if splits == 1:
        return lo, hi
    return lo.view(U, splits).amin(1), hi.view(U, splits).amax(1)  # amin / amax keep NaN
