"""Per-unit min / max read straight from ``x`` under a layout, where its units are no row
view of ``x`` (a channel axis after the first, groups or blocks along an axis before the last,
tiles, a transposed matrix), without the float32 copy ``layout.to_units`` would make; and the
padded units' real min / max. The reductions are :mod:`.minmax`'s (its C kernel on the CPU, the
op ``quantscope::unit_minmax`` off it)."""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..kernels import ops
from ..layout import Block, Channel, Group, Tile
from ..layout import Tensor as TensorLayout
from .minmax import (
    KERNEL_DTYPES,
    _kernel,
    _result_dtype,
    _threads,
    _use_kernel,
    op_units,
    unit_minmax,
)

__all__ = ["column_minmax", "layout_minmax", "unpad_minmax_"]


def column_minmax(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of every column of ``m [R, C]`` as two ``[C]`` tensors (NaN propagates),
    of :func:`unit_minmax`'s result dtype."""
    R, C = m.shape
    lib = _kernel() if R >= 2 and _use_kernel(m) else None
    if lib is None:
        dtype = _result_dtype(m.dtype)
        if not R:
            return (m.new_full((C,), float("inf"), dtype=dtype),
                    m.new_full((C,), float("-inf"), dtype=dtype))
        lo, hi = torch.aminmax(m, dim=0)
        return lo.to(dtype), hi.to(dtype)
    lo, hi = kernels.buffer(C), kernels.buffer(C)
    _column_kernel(lib, m, lo, hi)
    return lo, hi


def _column_kernel(lib, m: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """The C column reduction of a contiguous ``m [R >= 2, C]`` (a kernel dtype) into ``lo`` /
    ``hi`` (contiguous float32 ``[C]``, rows of a larger tensor included)."""
    R, C = m.shape
    threads = _threads(R * C, R)
    work = torch.empty(threads * 3 * C, dtype=torch.float32)
    lib.qs_col_minmax(m.data_ptr(), R, C, lo.data_ptr(), hi.data_ptr(), work.data_ptr(), threads,
                      KERNEL_DTYPES[m.dtype])


def layout_minmax(x: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-unit ``(lo, hi)`` (float32) of ``x`` under ``layout`` without a float32 copy of
    its units.

    On the CPU, for float32 / bf16 / fp16 ``x`` and the layouts whose units are not a row view
    of ``x`` (a channel axis other than the first, groups or blocks along an axis before the
    last, tiles, a transposed matrix's channels): the C kernel's reductions over reshapes of
    ``x`` itself. Elsewhere, any float ``x``: the op ``quantscope::unit_minmax`` on a view of
    ``x`` (the units as ``[U1, U2, E1, E2]`` for those layouts), or on its units in its own
    dtype. Always in the units' order (``layout.to_units`` order; tests check both
    agree). None: no such path here, build the units instead.
    """
    if x.device.type != "cpu":
        return _op_layout_minmax(x, layout)
    if isinstance(layout, TensorLayout):  # one unit: a row view already
        return None
    if not _use_kernel(x) or _kernel() is None:
        return _transposed_minmax(x, layout)
    shape = x.shape
    if isinstance(layout, Channel) and x.dim() >= 2:
        a = layout.axis % x.dim()
        A, C = math.prod(shape[:a]), shape[a]
        B = math.prod(shape[a + 1:])
        if A == 1:  # units are rows already
            return None
        if B == 1:  # the last axis: one vertical pass
            return column_minmax(x.view(A, C))
        if B >= 16:  # rows of B, then the (small) [A, C] result over A
            lo, hi = unit_minmax(x.view(A * C, B))
            return lo.view(A, C).amin(0), hi.view(A, C).amax(0)  # amin / amax keep NaN
        return None
    if isinstance(layout, (Group, Block)) and getattr(layout, "g_idx", None) is None:
        return _segment_minmax(x, layout)
    if isinstance(layout, Tile) and x.dim() >= 2:
        R, C = shape[-2:]
        if R % layout.rows or C % layout.cols or layout.cols < 16:
            return None  # padded edges: the units carry zeros
        L = math.prod(shape[:-2])
        rt, ct = R // layout.rows, C // layout.cols
        lo, hi = unit_minmax(x.view(L * R * ct, layout.cols))  # every tile row segment
        lo = lo.view(L * rt, layout.rows, ct).amin(1)
        hi = hi.view(L * rt, layout.rows, ct).amax(1)
        return lo.reshape(-1), hi.reshape(-1)
    return None


#: at most this many runs (groups along an axis before the last) read one kernel call each
MAX_SEGMENT_RUNS = 1024


def _segment_minmax(x: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Groups / blocks along an axis before the last (``group:128:0``, ``block:16:0``), in
    the units' order (leading dims, trailing dims, run): each run of ``size`` along the axis
    is a ``[size, trailing]`` slab of ``x`` whose columns are units, read in place where
    ``to_units`` would copy ``x`` to move the axis last (10x slower, found by probing)."""
    if x.dim() < 2 or not -x.dim() <= layout.axis < x.dim():
        return None  # the units path says what is wrong
    a = layout.axis % x.dim()
    n, size = x.shape[a], layout.size
    lead, trail = math.prod(x.shape[:a]), math.prod(x.shape[a + 1:])
    runs = lead * (n // size)
    if a == x.dim() - 1 or n % size or size < 2 or trail < 16 or runs > MAX_SEGMENT_RUNS:
        return None  # units are rows of x already, a padded tail (zeros), or small slabs
    slabs, lib = x.view(runs, size, trail), _kernel()
    lo, hi = kernels.buffer(runs, trail), kernels.buffer(runs, trail)
    for i in range(runs):  # one C call per run: torch's amin / amax over the view take 2.4x
        _column_kernel(lib, slabs[i], lo[i], hi[i])
    unit_order = lambda t: t.view(lead, n // size, trail).transpose(1, 2).reshape(-1)
    return unit_order(lo), unit_order(hi)


def _transposed_minmax(x: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-channel ranges of a transposed matrix (``w.t()``) read from the memory it views:
    its channels are the columns or the rows of that contiguous matrix."""
    if not (isinstance(layout, Channel) and x.dim() == 2 and -2 <= layout.axis < 2
            and _use_kernel(x.t()) and _kernel() is not None):
        return None  # (an axis out of range: the units path says so)
    m = x.t()
    return column_minmax(m) if layout.axis % 2 == 0 else unit_minmax(m)


def unpad_minmax_(layout, units: torch.Tensor, shape, lo: torch.Tensor, hi: torch.Tensor) -> list:
    """The padded units of ``units = layout.to_units(x)`` (``x.shape == shape``; see
    :meth:`quantscope.layout.Layout.padded_parts`), whose per-unit ``lo`` / ``hi`` become
    their real values' min / max in place: the padding zeros are no data. Returns the parts."""
    parts = layout.padded_parts(units, shape) if shape is not None else []
    for idx, vals in parts:
        real_lo, real_hi = unit_minmax(vals)  # float32 for half units too (no copy of them)
        lo.index_copy_(0, idx, real_lo.to(lo.dtype))
        hi.index_copy_(0, idx, real_hi.to(hi.dtype))
    return parts


def _op_layout_minmax(x: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`layout_minmax` off the CPU: the op reads the units where they lie."""
    units = op_units(x, layout)
    return None if units is None else ops.unit_minmax(units)
