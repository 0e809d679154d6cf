"""C kernels of the streaming histogram (:mod:`quantscope.stats.histogram`).

Where the time went, per tensor, one batch of 3.1M float32 values (64 x 128 x 384
activations with outlier channels) on one core, torch path: ``add_values`` ~5-7 ms
(chunks of mul / floor / clamp / cast / ``index_add_``, each a pass, and
``index_add_`` serialises on the few bins a batch crowds into), the grid change
~0.7 ms (~60 one-element torch ops: a fixed cost per batch), the min / max read
~0.6 ms (the floor: one ``torch.aminmax`` of the batch). The kernels:

* :func:`bin_values` (``add_values``): per block of 512 values the bin indices are
  computed vectorized (AVX-512 / AVX2) into a buffer, then counted into 8
  interleaved int32 copies of the bins (consecutive values in one bin would be one
  chain of dependent increments; counting straight from the vector register waits
  on each index's store-to-load: both measured 1.5-2x slower), flushed into the
  int64 counts. The 16 adjacent bins that held most of the counts so far (or of a
  sample) are counted in registers instead: 8-bit fields, ``1 << 8 (d - 4a)``
  added to accumulator ``a`` (vpsllvd gives 0 outside the field, so no masks),
  only the other values' indices are compressed out and counted in memory; used
  when those bins hold >= 60 % and dropped mid-span if the batch does not follow.
  One unit's values split over threads, or units over threads;
* :func:`regrid`: ``update``'s range clamp and ``_regrid`` per unit in C
  (microseconds, not the torch ops' fixed cost); a unit whose grid stays is copied, or, in
  place (``update(..., inplace=True)``), not touched: a fresh zeroed ``[U, B]`` every batch
  was 97 % of the time of 4096 units of 8 values, 2048 bins (38 ms a batch, 0.7 in place);
* :func:`fused_update`: a one-unit histogram in ONE read of the batch: the
  min / max and the bins at the CURRENT exponent into a window of aligned bins
  wider than the histogram (absolute bins ``[first - B, first + 2B)``, ``[0, 2B)``
  for ``|x|``; for an empty state the exponent of a sample's range, whose grid
  the batch's can only coarsen, and ``[-4B, 4B)``); then the new grid, and old
  counts and window moved onto it exactly (binning at ``e`` then merging bins by
  ``2 ** m`` equals binning at ``e + m``: multiplying by a power of two is exact).
  A value outside the window, a NaN / inf, or a negative value that rounds to
  ``-0`` at the new exponent (the torch path bins it at 0, the window at -1) is a
  miss: nothing changes and the caller takes the unfused path. A batch of fewer values than
  2x the window's bins is counted straight into the window's int64 bins (the vector index
  and min / max loop is the same): zeroing and flushing the int32 copies, 8 x 3 x 2048 of
  them, took ~8 of the ~12 us the pass took on 2K values (now ~5 us); only the window's bins
  of lo .. hi (``|x|``: 0 .. max |x|) are merged onto the new grid (the others hold none).

Measured (bench_histogram speed(), one thread, shared machine, medians): observe
per batch 1.5-1.7 ms against torch.ao's 18.6-19.2 ms (ratio 11-12.7); the kernel
alone ~0.8-0.9 ms against ~0.55 ms for ``aminmax``; the Python around it ~0.07 ms.

Every kernel mirrors the float32 operations of the torch reference in
:mod:`quantscope.stats.histogram` (built with ``-ffp-contract=off``), so results
are identical (tests compare them bitwise); the torch functions stay the reference
and the path for other devices, dtypes, or without a compiler
(``QUANTSCOPE_NO_KERNEL=1``). Integers returned by the kernels are plain C return
values, not device reads.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from .. import kernels
from .minmax import MINMAX_DTYPES

__all__ = ["bin_values", "fused_update", "regrid", "state_ok", "widens"]

_I64, _F32 = torch.int64, torch.float32


#: bins above which the kernels are not used: a thread's scratch is 8 int32 copies of the
#: bins (of the fused pass's window: up to 8 * bins), 16 MB at this size
MAX_BINS = 1 << 16


def _kernel():
    return kernels.lib("hist_kernel")


#: values widened per call where :func:`bin_values` reads bf16 / fp16 units: a float32 piece
#: that stays in cache (a float32 copy of the whole batch took 4x the float32 batch's time,
#: its fresh pages faulting in)
HALF_PIECE = 1 << 18


def widens(units: torch.Tensor) -> bool:
    """Whether :func:`fused_update` reads ``units`` (bf16 / fp16) as one float32 copy: a batch
    of one piece (:data:`HALF_PIECE` values) at most; a larger one takes the two passes. A
    per-tensor observer's call on one thread (with observers/hist_step.py's cached step): 2K
    bf16 values 125 -> 37 us, 256K 330 -> 200 us."""
    return units.dtype in _HALVES and units.numel() <= HALF_PIECE


_HALVES = (torch.bfloat16, torch.float16)


def bin_values(counts: torch.Tensor, units: torch.Tensor, exp: torch.Tensor,
               first: torch.Tensor, absolute: bool, threads: int | None = None) -> bool:
    """``add_values`` in C (``counts`` updated in place); False: not applicable (no
    kernel, not CPU float32 / bf16 / fp16 ``[U, E]``, ...), nothing done. bf16 / fp16 units
    are widened a piece at a time (exact: every value is a float32)."""
    lib = _kernel()
    U, B = counts.shape
    if (lib is None or units.requires_grad or not units.is_cpu or units.dtype not in MINMAX_DTYPES
            or units.dim() != 2 or units.shape[0] != U or not kernels.writable(counts, torch.int64)
            or not kernels.plain(exp, torch.int64) or not kernels.plain(first, torch.int64)
            or exp.shape != (U,) or first.shape != (U,) or not 1 <= B <= MAX_BINS
            or not kernels.real(units)):  # (a fake or vmap batch: no memory to read)
        return False  # (no bins: the C kernel's last bin, -1, would be written)
    if units.numel() == 0:
        return True
    if units.dtype != torch.float32:
        _bin_pieces(lib, counts, units, exp, first, absolute, threads)
    else:  # a strided layout's units (a transpose): one copy, then the kernel is still
        # several times faster than the torch ops on the strided view
        _bin(lib, counts, units.contiguous(), exp, first, absolute, threads)
    increment_version(counts)  # written by the C, as an in-place torch op would
    return True


def _bin(lib, counts, units, exp, first, absolute, threads) -> None:
    ok = lib.qs_hist_bin(units.data_ptr(), units.shape[0], units.shape[1], counts.shape[1],
                         counts.data_ptr(), exp.data_ptr(), first.data_ptr(), int(absolute),
                         kernels.threads(threads))
    if not ok:
        raise MemoryError("hist_kernel.bin_values: out of memory for the bin copies")


def _bin_pieces(lib, counts, units, exp, first, absolute, threads) -> None:
    """:func:`_bin` over pieces of at most :data:`HALF_PIECE` values (whole rows, or one
    row's columns), each copied into one float32 scratch: counts add, so the pieces give
    the whole's counts."""
    U, E = units.shape
    rows, cols = max(1, HALF_PIECE // E), min(E, HALF_PIECE)
    scratch = torch.empty(min(U, rows) * cols, dtype=torch.float32)
    for r in range(0, U, rows):
        end = min(U, r + rows)
        for c in range(0, E, cols):
            part = units[r:end, c:c + cols]
            dense = scratch[:part.numel()].view(part.shape)
            dense.copy_(part)
            _bin(lib, counts[r:end], dense, exp[r:end], first[r:end], absolute, threads)


def state_ok(state, U: int, B: int) -> bool:
    """Whether the kernels read (and write) the histogram state ``(counts, exp, first, lo,
    hi)`` as it is: int64 ``[U, B]``, int64 ``[U]`` twice, float32 ``[U]`` twice, each
    :func:`~quantscope.kernels.plain_tensor`. The context (:func:`~quantscope.kernels.real`)
    is the caller's to test: this module's through :func:`_kernel` (None where it is not
    real), ``observers/hist_step.py`` once per call."""
    counts, exp, first, lo, hi = state
    plain = kernels.plain_tensor
    return (counts.shape == (U, B) and exp.shape == first.shape == lo.shape == hi.shape == (U,)
            and plain(counts, _I64) and plain(exp, _I64) and plain(first, _I64)
            and plain(lo, _F32) and plain(hi, _F32))


def _new_state(counts):
    U = counts.shape[0]
    return (counts, torch.empty(U, dtype=torch.int64), torch.empty(U, dtype=torch.int64),
            kernels.buffer(U), kernels.buffer(U))


def regrid(state, lo: torch.Tensor, hi: torch.Tensor, absolute: bool, inplace: bool = False):
    """``update``'s grid change in C: the new ``(counts, exp, first, lo, hi)`` for batch
    min / max ``lo``, ``hi``, in fresh tensors (``state`` not modified) or, with ``inplace``,
    in ``state``'s own (the caller gives ``state`` up; a unit whose grid stays then costs
    O(1), not O(bins)). None: the torch path decides (no kernel, NaN / inf, other dtypes or
    devices), and nothing was modified."""
    lib = _kernel()
    U, B = state[0].shape
    if (lib is None or B < 1 or not state_ok(state, U, B) or lo.shape != (U,)
            or hi.shape != (U,) or not kernels.plain(lo, torch.float32)
            or not kernels.plain(hi, torch.float32)
            or inplace and not all(kernels.writable(t, t.dtype) for t in state)):
        return None  # (a write torch would refuse: the torch path raises its error)
    # fresh counts not zero-filled: the kernel writes every row
    new = tuple(state) if inplace else _new_state(torch.empty(U, B, dtype=torch.int64))
    if lib.qs_hist_regrid(U, B, int(absolute), lo.data_ptr(), hi.data_ptr(),
                          *(t.data_ptr() for t in state), *(t.data_ptr() for t in new)):
        return None
    if inplace:
        increment_version(new)  # written by the C, as in-place torch ops would
    return new


def fused_update(state, units: torch.Tensor, absolute: bool, threads: int | None = None,
                 ends: torch.Tensor | None = None):
    """One read of a one-unit batch ``units [1, E]``: ``(new_state, lo, hi)`` equal to
    ``unit_minmax(units, ends=ends)`` followed by ``update`` (see the module doc); None on a
    miss or when not applicable (``state`` is never modified; ``ends``, the smallest min and
    largest max, is written where given, or None is returned). bf16 / fp16 ``units`` are read
    as a float32 copy where :func:`widens` (exact: every value is a float32)."""
    lib = _kernel()
    if lib is None or units.dim() != 2 or units.shape[0] != 1:
        return None
    if widens(units) and units.is_cpu and not units.requires_grad and kernels.real(units):
        units = units.float()  # exact: every value is a float32 (one piece: HALF_PIECE)
    B = state[0].shape[1]
    if (not 1 <= B <= MAX_BINS or units.requires_grad or not kernels.plain(units, torch.float32)
            or not state_ok(state, 1, B)):
        return None
    if ends is not None and (ends.shape != (2,) or not kernels.writable(ends, torch.float32)):
        return None  # the caller reads its ends: the torch path writes them (or says why not)
    ends = kernels.buffer(2) if ends is None else ends
    new = _new_state(torch.zeros(1, B, dtype=torch.int64))  # the kernel adds into it
    lo, hi = kernels.buffer(1), kernels.buffer(1)
    miss = lib.qs_hist_fused(units.data_ptr(), units.shape[1], B, int(absolute),
                             *(s.data_ptr() for s in state), *(s.data_ptr() for s in new),
                             lo.data_ptr(), hi.data_ptr(), ends.data_ptr(),
                             kernels.threads(threads))
    increment_version(ends)  # (may be the caller's: written by the C)
    return None if miss else (new, lo, hi)
