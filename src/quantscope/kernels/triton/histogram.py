"""Histogram binning on aligned power-of-two grids (Triton): ``stats.histogram.add_values``.

A value ``x`` of unit ``u`` goes to bin ``clamp(floor(x * 2 ** -exp[u]) - first[u], 0, B - 1)``
(``|x|`` for absolute histograms; NaN to bin 0), every step exact in float32 as in the torch
reference. Each program bins one chunk of one unit into a private histogram
(``tl.histogram``: one extra bin takes the padding of the last tile) and adds it to the
unit's int64 counts with one atomic add per non-empty bin: counts are integers, so the
order of the adds cannot change them, and the result equals the torch path bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH

__all__ = ["MAX_BINS", "hist_add"]

#: the most bins a program's private histogram holds (registers)
MAX_BINS = 1 << 14
#: elements a program bins at least (fewer programs per unit above)
MIN_CHUNK = 1 << 13


@triton.jit
def _hist_kernel(x_ptr, counts_ptr, exp_ptr, first_ptr, E, stride_u, chunk, B,
                 ABSOLUTE: tl.constexpr, NB: tl.constexpr, BLOCK_E: tl.constexpr):
    u = tl.program_id(0)
    start = tl.program_id(1) * chunk
    e = tl.load(exp_ptr + u).to(tl.int32)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # exactly 2 ** -e
    first = tl.load(first_ptr + u).to(tl.float32)
    local = tl.zeros([NB], tl.int32)
    for e0 in range(0, chunk, BLOCK_E):
        within = e0 + tl.arange(0, BLOCK_E)
        cols = start + within
        mask = (cols < E) & (within < chunk)
        x = tl.load(x_ptr + u.to(tl.int64) * stride_u + cols, mask=mask, other=0.0)
        t = x.to(tl.float32) * inv
        if ABSOLUTE:
            t = tl.abs(t)
        t = tl.floor(t) - first
        t = tl.minimum(tl.maximum(t, 0.0), B - 1.0)
        t = tl.where(t != t, 0.0, t)  # noqa: PLR0124 (NaN to bin 0)
        idx = tl.where(mask, t.to(tl.int32), B)  # the padding to the extra bin B
        local += tl.histogram(idx, NB)
    bins = tl.arange(0, NB)
    tl.atomic_add(counts_ptr + u.to(tl.int64) * B + bins, local.to(tl.int64),
                  mask=(bins < B) & (local > 0))


def hist_add(counts: torch.Tensor, units: torch.Tensor, exp: torch.Tensor,
             first: torch.Tensor, absolute: bool, *, chunk: int | None = None,
             block_e: int = 1024) -> None:
    """Add ``units [U, E]`` (rows contiguous; bf16 / fp16 / fp32) to ``counts [U, B]`` (int64,
    contiguous, in place) on the grids ``exp``, ``first`` (int64 ``[U]``)."""
    U, E = units.shape
    B = counts.shape[1]
    if B + 1 > MAX_BINS:
        raise ValueError(f"kernels.triton.histogram: at most {MAX_BINS - 1} bins, got {B}")
    if not (U and E):
        return
    if chunk is None:  # enough programs to fill the GPU, each binning a fair share
        per_unit = max(1, min(triton.cdiv(E, MIN_CHUNK), triton.cdiv(1024, U)))
        chunk = triton.cdiv(triton.cdiv(E, per_unit), block_e) * block_e
    chunk = max(1, chunk)
    _hist_kernel[(U, triton.cdiv(E, chunk))](
        units, counts, exp, first, E, units.stride(0), chunk, B, ABSOLUTE=bool(absolute),
        NB=triton.next_power_of_2(B + 1), BLOCK_E=block_e, **LAUNCH)
