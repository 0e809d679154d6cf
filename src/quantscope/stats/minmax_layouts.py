"""Per-unit min / max read straight from ``x`` under a layout, where its units are no row
view of ``x`` (a channel axis after the first, groups or blocks along an axis before the last,
tiles, activation-order groups: :mod:`.minmax_actorder`), or ``x`` is a dense permuted view
(a transposed matrix, channels_last), without the copy ``layout.to_units`` would make; and
the padded units' real min / max. The reductions are :mod:`.minmax`'s (its C kernel on the
CPU, the op ``quantscope::unit_minmax`` off it)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.autograd.graph import increment_version

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
from .minmax_actorder import actorder_minmax

__all__ = ["column_minmax", "layout_minmax", "memory_order", "unpad_minmax_"]


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
    _column_kernel(lib, m[None], lo, hi)
    return lo, hi


def _column_kernel(lib, slabs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   group: int = 1) -> None:
    """The C column reduction of every slab of a contiguous ``slabs [runs, R, C]`` (a kernel
    dtype) in one call, into contiguous float32 ``lo`` / ``hi`` of ``runs * C``
    elements in the units' order: slab ``l * group + g``'s column ``c`` at ``(l * C + c) *
    group + g`` (``group=1``: ``[runs, C]``). The threads take whole slabs where there are
    several. Each slab's rows are cut into the shares one slab's threads would take,
    whatever threads run it: the sign of a zero min / max (where -0.0 and +0.0 tie) follows
    that cut alone (csrc/unit_minmax.c)."""
    runs, R, C = slabs.shape
    shares, threads = _threads(R * C, R), _threads(runs * R * C, runs * R)
    work = torch.empty(threads * 5 * C, dtype=torch.float32)  # (csrc: 5C floats a thread)
    failed = lib.qs_col_minmax(slabs.data_ptr(), runs, R, C, lo.data_ptr(), hi.data_ptr(),
                               work.data_ptr(), threads, shares, group,
                               KERNEL_DTYPES[slabs.dtype])
    if failed:  # (sizes the callers never pass)
        raise RuntimeError(f"qs_col_minmax refused slabs {tuple(slabs.shape)}, group {group}")
    increment_version((lo, hi))  # written by the C, as in-place torch ops would


def layout_minmax(x: torch.Tensor, layout, out_for=None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-unit ``(lo, hi)`` (float32) of ``x`` under ``layout`` without a float32 copy of
    its units.

    On the CPU, for float32 / bf16 / fp16 ``x`` and the layouts whose units are not a row view
    of ``x`` (a channel axis other than the first, groups or blocks along an axis before the
    last, blocks with a padded tail, tiles), the C kernel's reductions over reshapes of ``x``
    itself; activation-order groups by their own pass over ``x`` (:mod:`.minmax_actorder`, a
    strided ``x`` too); for a dense ``x`` that is not contiguous (``w.t()``, channels_last),
    every other layout but tokens, the same over ``x``'s memory in its own order
    (:func:`memory_order`). (Blocks with a padded tail: along an axis before the last for one
    leading index; along the last by one pass where the tail is under 32 values
    (:func:`_padded_rows`), else in segments of at least 16.) Elsewhere, any float ``x``: the
    op ``quantscope::unit_minmax`` on a view of ``x`` (the units as ``[U1, U2, E1, E2]`` for
    those layouts), or on its units in its own dtype. Always in the units' order
    (``layout.to_units`` order; tests check both agree); a padded unit's range is its real
    values' (as ``unpad_minmax_`` leaves it). None: no such path here, build the units
    instead. ``out_for(U)``: two ``[U]`` float32 tensors to write into (an observer's
    ``_minmax_out``), which the act-order pass, the padded rows' and the runs along an axis
    before the memory's last (groups / blocks, of ``w.t()`` too) ask for and take where they
    fit (the other paths make new ones: NVFP4 blocks of a 4096 x 4096 ``w.t()`` had faulted
    in 8 MB of fresh pages a call, 2x the contiguous weight's step).
    """
    if x.device.type != "cpu":  # (padded units: the units path takes their zeros out)
        return None if layout.pads_at(x.shape) else _op_layout_minmax(x, layout)
    if getattr(layout, "g_idx", None) is not None:  # act-order groups: their own pass
        return actorder_minmax(x, layout, out_for)
    if not x.is_contiguous():  # a permuted view (w.t(), channels_last): the memory it views
        return _permuted_minmax(x, layout, out_for)
    if isinstance(layout, TensorLayout) or not _use_kernel(x) or _kernel() is None:
        return None  # one unit: a row view already; or torch reads the units
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
        return _segment_minmax(x, layout, out_for)
    if isinstance(layout, Tile) and x.dim() >= 2:
        return _tile_minmax(x, layout)
    return None


def _tile_minmax(x: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tiles of a contiguous ``x``, ragged edge tiles included, an edge tile's range its real
    values' (the units path pads it with zeros, then takes them out again: the padding is no
    data), where ``to_units`` had padded and copied the whole tensor (18-25x a divisible
    shape's time on a 2880 x 2880 fp8 ``tile:128x128``, found by probing). Each band of tile
    rows is a slab for the column kernel (the last band shorter), then each tile's columns
    are reduced: a 4000 x 4000 ``tile:128x128`` in 1.0-1.07x a divisible shape's time, where
    row segments ``gcd(C, tile columns)`` wide took 1.3-2.0x. Those segments (at least 16 wide)
    still serve where their results are the fewer (tiles of one row: blocks along the last
    axis whose padded tail :func:`_padded_rows` leaves) or the bands of several leading
    indices are ragged."""
    R, C = x.shape[-2:]
    tr, tc = layout._geometry(x.shape)[4:]  # a tile, or the whole of a smaller dim
    g = math.gcd(C, tc)  # bands where their results are the smaller (or the only)
    if tr > 1 and (tr >= g or g < 16) and (R % tr == 0 or x.numel() == R * C):
        lo, hi = _bands(x.view(-1, R, C), tr)
        return tuple(_runs(t, 2, tc, op).reshape(-1) for t, op in ((lo, torch.amin),
                                                                   (hi, torch.amax)))
    if g < 16:  # short segments: the kernel's rows cost more than the copy saves
        return None
    lo, hi = unit_minmax(x.view(-1, g))
    tiles = lambda t, op: _runs(_runs(t.view(-1, R, C // g), 2, tc // g, op), 1, tr, op)
    return tiles(lo, torch.amin).reshape(-1), tiles(hi, torch.amax).reshape(-1)


def _bands(x3: torch.Tensor, rows: int, across: bool = False, out_for=None):
    """Per-column ``(lo, hi)`` of the bands of ``rows`` rows of a contiguous ``x3 [lead, R,
    C]``, the last band of each lead shorter where ``rows`` does not divide ``R`` (its range
    its real rows'; ragged only for one lead): ``[lead, bands, C]``, or ``across``: ``[lead,
    C, bands]``, a run's units in the order runs along ``R`` take. One kernel call for the
    whole bands, one for the short one; into ``out_for(U)`` (two ``[U]`` tensors, as
    :func:`layout_minmax`'s) where they fit."""
    lead, R, C = x3.shape
    full, rest = divmod(R, rows)
    lib, shape = _kernel(), (lead, C, full) if across else (lead, full + (rest > 0), C)
    lo, hi = (t.view(shape) for t in kernels.out_buffers(math.prod(shape),
                                                         None if rest else out_for))
    if full:
        body = [t if across else t[:, :full] for t in (lo, hi)]  # (contiguous: one lead)
        _column_kernel(lib, x3[:, :full * rows].reshape(lead * full, rows, C), *body,
                       group=full if across else 1)
    if not rest:
        return lo, hi
    end = [kernels.buffer(C) for _ in "lh"] if across else [lo[0, full], hi[0, full]]
    _column_kernel(lib, x3[:, full * rows:].view(1, rest, C), *end)
    if not across:
        return lo, hi
    return tuple(torch.cat((t, e.view(1, C, 1)), 2) for t, e in zip((lo, hi), end))


def _runs(t: torch.Tensor, dim: int, run: int, op) -> torch.Tensor:
    """``op`` (``torch.amin`` / ``amax``: NaN kept) over consecutive runs of ``run`` along
    ``dim`` of ``t``, the last run shorter where ``run`` does not divide its size."""
    n = t.shape[dim]
    full = n // run * run
    if run == 1:
        return t
    parts = [op(t.narrow(dim, 0, full).unflatten(dim, (n // run, run)), dim + 1)] if full else []
    if full < n:
        parts.append(op(t.narrow(dim, full, n - full), dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _segment_minmax(x: torch.Tensor, layout, out_for=None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Groups / blocks along an axis before the last (``group:128:0``, ``block:16:0``), in
    the units' order (leading dims, trailing dims, run): each run of ``size`` along the axis
    is a ``[size, trailing]`` slab of ``x`` whose columns are units, read in place where
    ``to_units`` would copy ``x`` to move the axis last (10x slower, found by probing). A
    block's padded tail too (one leading index: a matrix's axis 0, a transposed weight),
    its range its real values', where ``to_units`` padded and copied ``x`` (12-37x); along
    the last axis, :func:`_padded_rows`, else tiles of one row (:func:`_tile_minmax`).
    ``out_for``: as :func:`_bands`'."""
    if x.dim() < 2 or not -x.dim() <= layout.axis < x.dim():
        return None  # the units path says what is wrong
    a = layout.axis % x.dim()
    n, size = x.shape[a], layout.size
    lead, trail = math.prod(x.shape[:a]), math.prod(x.shape[a + 1:])
    if a == x.dim() - 1 and n % size:  # rows' blocks with a padded tail
        found = _padded_rows(x.view(-1, n), size, out_for)
        return found if found is not None else _tile_minmax(x.view(-1, n), Tile(1, size))
    if a == x.dim() - 1 or size < 2 or trail < 16 or (n % size and lead > 1):
        return None  # units are rows of x already, small slabs, or ragged runs of several
    lo, hi = _bands(x.view(lead, n, trail), size, across=True, out_for=out_for)
    return lo.view(-1), hi.view(-1)


#: a padded block's tail is reduced as torch's ``amin`` / ``amax`` reduce a row (of a
#: strided ``[rows, tail]``: ``unpad_minmax_``'s) of fewer values than this: one at a time, in
#: order, the first of a -0.0 / +0.0 tie winning (longer rows: its vector lanes' order)
SCALAR_TAIL = 32

#: the longest block ``qs_padded_minmax`` takes (its buffer: csrc/unit_minmax.c's PIECE)
PIECE = 2048


def _padded_rows(m: torch.Tensor, size: int, out_for=None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Blocks of ``size`` along the rows of a contiguous ``m [R, W]`` whose last block is
    zero-padded (MXFP4 / NVFP4 blocks of a 2050- or 4008-wide weight), by one C pass over
    ``m`` where it lies (``qs_padded_minmax``), in the units' order, into ``out_for(U)``
    where it fits: the padded copy's per-unit ranges bit for bit (the row kernel's on its
    full blocks, NaN and a tying zero's sign included; a padded block's its real values', as
    ``unpad_minmax_`` leaves it), where ``to_units`` padded and copied ``m`` (11-13x a
    divisible width's CPU time in float32, 2.4-4.0x in bf16, found by probing; now 1.1-1.5x
    and 1.0-1.5x). None where ``unpad_minmax_`` takes another order (a tail of
    ``SCALAR_TAIL`` values or more; one row: a whole-tensor reduction) or a block is longer
    than the kernel's buffer (2048)."""
    R, W = m.shape
    U = R * -(-W // size)
    if R < 2 or W % size >= SCALAR_TAIL or size > PIECE:
        return None
    lo, hi = out = kernels.out_buffers(U, out_for)
    failed = _kernel().qs_padded_minmax(m.data_ptr(), R, W, size, lo.data_ptr(), hi.data_ptr(),
                                        _threads(U * size, U), KERNEL_DTYPES[m.dtype])
    return kernels.wrote(out, failed)  # (-1, sizes it refuses: nothing written)


def memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of ``x`` from the outermost in memory to the innermost, so that
    ``x.permute(order)`` is contiguous: a view of the same memory in its own order; None
    where ``x`` is not dense (a slice: gaps in its memory)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # (stable: size-1 dims tie)
    return order if x.permute(order).is_contiguous() else None


def _permuted_minmax(x: torch.Tensor, layout, out_for=None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`layout_minmax` of a dense ``x`` that is not contiguous (a transposed matrix,
    a channels_last activation or weight, permuted key / value states), read from ``m =
    x.permute(memory_order(x))``, the same memory as a contiguous tensor, where
    ``to_units`` would copy ``x`` first (6-18x the contiguous tensor's time, found by
    probing): the same units under ``m``'s axes, their results put back in ``x``'s unit
    order. None where ``x`` has gaps, the units are no row, column or run of ``m``, or the
    C kernel cannot read ``m`` (the column kernel has no torch twin here). ``out_for``: as
    :func:`_bands`' (runs along an axis before ``m``'s last)."""
    order = memory_order(x)
    if order is None:
        return None
    m = x.permute(order)
    if not _use_kernel(m) or _kernel() is None:
        return None  # torch reads the units (no library; fake, traced or float64 data)
    if isinstance(layout, TensorLayout):  # one unit: min / max take any order
        return unit_minmax(m.view(1, -1))
    if isinstance(layout, Channel) and -x.dim() <= layout.axis < x.dim():
        a = order.index(layout.axis % x.dim())
        if a == 0:  # the channels are m's rows
            return unit_minmax(m.view(m.shape[0], -1))
        return layout_minmax(m, Channel(a))  # units indexed by channel alone: no reorder
    if isinstance(layout, (Group, Block)) and getattr(layout, "g_idx", None) is None \
            and -x.dim() <= layout.axis < x.dim():
        return _permuted_runs(x, m, order, layout, out_for)
    if isinstance(layout, Tile) and order[:-2] == list(range(x.dim() - 2)):  # (x.t())
        return _transposed_tiles(m, layout)
    return None


def _permuted_runs(x, m, order, layout, out_for=None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Groups / blocks of a dense permuted ``x`` from ``m`` (:func:`_permuted_minmax`): the
    runs along the same axis of ``m``, whose units come in ``m``'s order of the other axes,
    then permuted to ``x``'s."""
    a, size = layout.axis % x.dim(), layout.size
    am = order.index(a)
    others = [d for d in order if d != a]  # x's axes in m's order, then the run
    grid = [x.shape[d] for d in others] + [-(-x.shape[a] // size)]
    back = [others.index(d) for d in range(x.dim()) if d != a] + [len(others)]
    if back != sorted(back):  # m's units in another order than x's: results are put back
        out_for = None  # into fresh memory, not the caller's (it would hold m's order)
    if am < m.dim() - 1 or m.shape[-1] % size:  # slabs whose columns are units, or tiles
        found = _segment_minmax(m, replace(layout, axis=am), out_for)
    else:  # runs of m's rows: m's units are rows of its memory
        found = unit_minmax(m.view(-1, size))
    if found is None:
        return None
    return tuple(t.view(grid).permute(back).reshape(-1) for t in found)


def _transposed_tiles(m, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tiles of ``x`` whose last two axes are transposed in memory (``m``: ``x`` with them
    swapped back, contiguous): ``m``'s ``cols x rows`` tiles, their grid transposed."""
    found = layout_minmax(m, Tile(layout.cols, layout.rows))
    if found is None:
        return None
    R, C = m.shape[-2:]
    grid = (-1, -(-R // layout.cols), -(-C // layout.rows))  # (leading, m's tile rows, cols)
    return tuple(t.view(grid).transpose(1, 2).reshape(-1) for t in found)


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
