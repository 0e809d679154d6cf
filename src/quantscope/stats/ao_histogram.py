"""torch.ao ``HistogramObserver``'s histogram, state for state: the compat class's statistic.

torch.ao keeps ``bins`` float32 counts between the running ``min_val`` and ``max_val``.
A batch inside that range is added with ``torch.histc`` on the same grid; a batch that
widens the range is binned with ``histc`` over the new range, and the old counts are moved
there approximately (``_upscale_histogram``): each old bin is split into ``upsample_rate``
pieces (the observer's attribute, 16 unless set) of that share of its count at the pieces'
mid points, and each piece goes whole to the new bin holding its mid point (``bucketize``
+ weighted ``bincount``, float32). The result depends on the batch order and is not an
exact histogram of the data, but it is torch.ao's, and its qparams follow from it:
:func:`update` reproduces it bit for bit.

The torch path here is torch.ao's own sequence of ops (the reference, and the path for other
devices, dtypes, degenerate ranges and batches of ``2 ** 24`` values or more, where torch's
float32 counts saturate), its decisions taken on the ends as Python floats (:func:`update`:
torch.ao reads a flag back from the device for each), its ``histc`` of float32, bfloat16 and
float16 batches the op ``quantscope::ao_histc`` (torch.histc of the float32 values; on CUDA
of float32 copies of ``2 ** 24`` values at a time). On CPU the C kernels
(``csrc/ao_hist.c``) do the same float32 arithmetic: the ``histc`` pass
(``trunc((x - lo) * bins / (hi - lo))`` per value, counted in int32 and added as float32,
the way ATen's kernel counts: exact below ``2 ** 24``; split over torch's threads, each
counting its share into its own bins) and the re-binning (torch's binary search and
torch.bincount's in-order float32 sums); ``torch.linspace`` still makes the edges (a few
microseconds, and its vectorized rounding is torch's alone).
:func:`observe` is the observer's whole step on that path, in place on its state (as
torch.ao's ``copy_``): a batch inside the current range (the common case once the range has
settled) takes one read instead of two (:func:`fused`: the min / max and the bins together;
tried after a batch that did not widen the range, since a widening batch must be binned
again), a widening batch a C min / max pass (``torch.aminmax``'s NaN rule) and one C call
that moves the old bins and bins the batch, and the decisions between are taken on Python
floats instead of small tensor ops (right after a batch has streamed through the caches, a
dozen of them cost as much as binning a quarter of it). Tests compare both paths, and the
observer with torch.ao's, bitwise.
"""

from __future__ import annotations

import ctypes
import math
import warnings

import torch
from torch.autograd.graph import increment_version

from .. import kernels
from .._checks import check_number
from .._numerics import _F32_MAX, upload
from .._oplib import define
from . import histogram as _histogram

__all__ = ["NON_FINITE", "UPSAMPLE_RATE", "ao_histc", "check_dense", "ends", "fused", "histc",
           "observe", "rounds_to_inf", "update", "upscale"]

#: torch.ao's default ``upsample_rate``: pieces per old bin when the range grows
UPSAMPLE_RATE = 16

#: what :func:`observe` returns for a batch holding NaN or an infinity (left out of the state)
NON_FINITE = "non-finite"


def _kernel():
    return kernels.lib("ao_hist")


def _check_histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantscope::ao_histc: x must be a float32, bfloat16 or float16 "
                         f"tensor, got {x.dtype}")
    if bins < 1:
        raise ValueError(f"quantscope::ao_histc: bins must be a positive integer, got {bins}")
    # torch.histc's rule (a float32 range; lo == hi allowed: histc takes the data's), here in
    # the fake too, so that a traced call fails where the real one would; Python floats: no
    # device read
    who = "quantscope::ao_histc"
    check_number(who, "lo", lo, -_F32_MAX, _F32_MAX)
    check_number(who, "hi", hi, lo, _F32_MAX)


def _torch_histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """``torch.histc`` of ``x``'s float32 values: float32 ``[bins]``."""
    _check_histc(x, bins, lo, hi)
    return torch.histc(x.float(), bins, min=lo, max=hi)


def _cuda_histc(x, bins, lo, hi):
    _check_histc(x, bins, lo, hi)
    # torch's own CUDA histc (the binning of torch.ao's on the device) of float32 copies of
    # 2 ** 24 values at a time: a bounded copy, and no count saturated by float32 atomics
    return _histogram.exact_histc(x, bins, lo, hi).float()


def _fake_histc(x, bins, lo, hi):
    _check_histc(x, bins, lo, hi)
    return x.new_empty(bins, dtype=torch.float32)


#: ``ao_histc(x, bins, lo, hi) -> counts``: ``torch.histc`` of ``x``'s float32 values (fp32 /
#: bf16 / fp16 ``x``; float32 ``[bins]`` counts). On CUDA torch's histc of float32 copies of
#: ``2 ** 24`` values at a time, summed in int64 (a bin holding ``2 ** 24`` values or more in
#: one batch is rounded once, where ATen's float atomics would stop counting it at ``2 ** 24``;
#: under deterministic algorithms, where it raises, its emulation, with histc's range rule)
ao_histc = define("ao_histc(Tensor x, int bins, float lo, float hi) -> Tensor", _torch_histc,
                  cuda=_cuda_histc, fake=_fake_histc)


def histc(x: torch.Tensor, bins: int, lo, hi, base: torch.Tensor | None = None,
          backend: str | None = None, threads: int | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``base + torch.histc(x, bins, min=lo, max=hi)`` (float32 ``[bins]``; ``base`` None:
    the histc alone; any shape of ``bins`` values), into ``out`` when given (the same;
    returned; it may be ``base``); bf16 / fp16 ``x`` binned as its float32 values.
    ``backend``: see :data:`quantscope.kernels.BACKENDS`; ``threads``: the kernel's
    (default torch's; at least ``2 ** 18`` values each)."""
    applies = (kernels.plain(x) and not x.requires_grad
               and (base is None or (kernels.plain(base) and base.numel() == bins))
               and (out is None or (kernels.plain(out) and out.numel() == bins)))
    lib = kernels.choose(backend, "ao_hist", "histc", applies)
    if lib is not None:
        res = kernels.buffer(bins) if out is None else out
        src = base if base is not None else (res.zero_() if out is not None
                                             else kernels.buffer(bins, zero=True))
        if not lib.qs_ao_histc(x.data_ptr(), x.numel(), float(lo), float(hi), bins,
                               src.data_ptr(), res.data_ptr(), kernels.threads(threads)):
            return res
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = ao_histc(x.detach(), bins, float(lo), float(hi))  # counts: no autograd
    else:  # float64: torch.ao bins it in float64
        h = torch.histc(x, bins, min=float(lo), max=float(hi))
    h = h if base is None else base.reshape(bins) + h
    return h if out is None else out.copy_(h.view(out.shape))


def fused(x: torch.Tensor, bins: int, lo, hi, base: torch.Tensor, threads: int | None = None,
          out: torch.Tensor | None = None
          ) -> tuple[tuple[float, float], torch.Tensor | None] | None:
    """One read of ``x`` (C): ``(minmax, hist)``, ``minmax`` its ``torch.aminmax`` as two
    floats, ``hist`` ``base + torch.histc(x, bins, min=lo, max=hi)`` (into ``out`` when
    given, which may be ``base``; both any shape of ``bins`` values) when every value lies in
    ``[lo, hi]`` (torch.ao's update on an unchanged range), else None (``out`` not written).
    None where the kernel does not apply (the caller reads ``x`` twice, as torch.ao
    does)."""
    lib = _kernel()
    if (lib is None or not kernels.plain(x) or not kernels.plain(base) or base.numel() != bins
            or (out is not None and not (kernels.plain(out) and out.numel() == bins))):
        return None
    out, mm = kernels.buffer(bins) if out is None else out, (ctypes.c_float * 2)()
    miss = lib.qs_ao_fused(x.data_ptr(), x.numel(), float(lo), float(hi), bins, base.data_ptr(),
                           out.data_ptr(), mm, kernels.threads(threads))
    return None if miss == 2 else ((mm[0], mm[1]), None if miss else out)


def check_dense(who: str, x: torch.Tensor) -> None:
    """torch.ao's refusal of a sparse, mkldnn or nested batch (its ``aminmax`` has no kernel
    for them; the C path would read their memory as dense values), of torch's type for that
    layout, naming the argument."""
    if x.layout == torch.strided and not x.is_nested:
        return
    kind = "a nested" if x.is_nested else f"a {x.layout}"
    try:
        torch.aminmax(x)  # torch.ao's first op on the batch: its error type
    except (NotImplementedError, RuntimeError) as e:
        cls = NotImplementedError if isinstance(e, NotImplementedError) else RuntimeError
        raise cls(f"{who}: x must be a dense (strided) tensor, got {kind} tensor "
                  f"(torch.ao refuses it too: {str(e).splitlines()[0]})") from e
    raise NotImplementedError(f"{who}: x must be a dense (strided) tensor, got {kind} tensor")


def ends(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> list[float]:
    """``torch.aminmax(x)`` and the state's ``lo``, ``hi``, read back in one transfer (four
    floats: bf16 / fp16 / float32 exact in float32; float64 where the batch or the state is,
    as torch.ao compares them in float64)."""
    wide = torch.float64 if torch.float64 in (x.dtype, lo.dtype, hi.dtype) else torch.float32
    return torch.stack([t.reshape(()).to(wide) for t in (*torch.aminmax(x), lo, hi)]).tolist()


def drop_inf(x: torch.Tensor, stacklevel: int) -> torch.Tensor:
    """torch.ao's answer to a batch holding +-inf: the batch without them, with its warning
    (``stacklevel``: the user's call, seen from the caller)."""
    warnings.warn("torch.inf detected in input tensor, ignoring input",
                  stacklevel=stacklevel + 1)
    return x[x.abs() != math.inf]


def rounds_to_inf(value: float, dtype: torch.dtype) -> bool:
    """Whether torch.ao's ``copy_`` of ``value`` into its ``dtype`` state stores an infinity
    (torch's own conversion: a float64 reaches a 16-bit float through float32, so no bound
    in float64 says it for every value)."""
    return bool(torch.tensor(value, dtype=torch.float64).to(dtype).isinf())


def _c_rate(rate) -> bool:
    """Whether the C kernels take this ``upsample_rate`` (a positive int; torch.ao's own ops
    decide what any other value does, errors included)."""
    return type(rate) is int and rate > 0


def upscale(hist: torch.Tensor, orig_lo, orig_hi, new_lo, new_hi, backend: str | None = None,
            rate=UPSAMPLE_RATE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.ao's ``_upscale_histogram``: ``hist`` on ``[orig_lo, orig_hi]`` moved onto
    ``len(hist)`` bins over ``[new_lo, new_hi]``, ``rate`` pieces per old bin (the observer's
    ``upsample_rate``; see the module doc; the ends are 0-dim tensors or Python floats
    holding values of ``dtype``, the state's: torch.ao computes the pieces' width in it)."""
    bins = hist.shape[0]
    # on the histogram's device, as torch.ao makes them (CUDA's linspace rounds its own way)
    lin = torch.linspace(orig_lo, orig_hi, bins * rate + 1, device=hist.device)
    bounds = torch.linspace(new_lo, new_hi, bins + 1, device=hist.device)
    applies = (kernels.plain(hist) and lin.dtype == bounds.dtype == dtype == torch.float32
               and _c_rate(rate))
    lib = kernels.choose(backend, "ao_hist", "upscale", applies)
    if lib is not None:
        out = kernels.buffer(bins)
        lib.qs_ao_upscale(hist.data_ptr(), bins, rate, lin.data_ptr(), float(orig_lo),
                          float(orig_hi), bounds.data_ptr(), out.data_ptr())
        return out
    orig = upload([float(orig_lo), float(orig_hi)], hist.device, dtype)
    bin_size = (orig[1] - orig[0]) / (bins * rate)
    mids = lin[:-1] + 0.5 * bin_size
    pieces = hist.repeat_interleave(rate) / rate
    # torch.ao's two masked assignments, as one clamp (the same indices, no host read)
    where = (torch.bucketize(mids, bounds, right=True) - 1).clamp_(0, bins - 1)
    return torch.bincount(where, weights=pieces, minlength=bins)


def update(hist: torch.Tensor | None, old: tuple[float, float] | None, x: torch.Tensor,
           x_range: tuple[float, float], bins: int, backend: str | None = None,
           rate=UPSAMPLE_RATE, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, float, float]:
    """torch.ao ``HistogramObserver.forward``'s state change: the new ``(histogram, min_val,
    max_val)`` after the finite batch ``x`` of min / max ``x_range``, from the histogram
    ``hist`` on the range ``old`` (None: the first batch, ``reset_histogram``), a widened
    range re-binned with ``rate`` pieces per old bin (:func:`upscale`), in the state's
    ``dtype`` (``min_val``'s, as torch.ao's). The ends are Python floats, so the decisions
    read nothing back from the device (torch.ao's take a host read each); a fresh histogram,
    the inputs not modified."""
    x_lo, x_hi = x_range
    if old is None:
        return histc(x, bins, x_lo, x_hi, None, backend), x_lo, x_hi
    lo, hi = old
    new_lo, new_hi = min(lo, x_lo), max(hi, x_hi)  # torch.min / max: the first on a tie
    if new_lo == lo and new_hi == hi:
        return histc(x, bins, lo, hi, hist, backend), lo, hi
    if lo == hi:  # a one-value histogram: its total moves to that value's new bin
        one = upload([lo], hist.device, dtype)  # torch.ao bins its min_val, of that dtype
        moved = torch.histc(one, bins=bins, min=new_lo, max=new_hi) * hist.sum()
    else:
        moved = upscale(hist, lo, hi, new_lo, new_hi, backend, rate, dtype)
    return histc(x, bins, new_lo, new_hi, moved, backend), new_lo, new_hi


def observe(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, x: torch.Tensor,
            first: bool = False, one_read: bool = True, threads: int | None = None,
            rate=UPSAMPLE_RATE) -> bool | str | None:
    """torch.ao ``HistogramObserver.forward``'s state change on the C path, in place (as
    torch.ao's ``copy_`` into its buffers): ``hist`` (its counts, float32, any shape of
    ``bins`` values), ``lo`` / ``hi`` (its ``min_val`` / ``max_val``, float32, one value
    each) become the state after the contiguous CPU float32 batch ``x`` (any shape): the
    values :func:`update` gives after ``torch.aminmax(x)``. ``first``: the first batch (the
    state's values are not read). ``one_read``: try the batch on the current range first
    (:func:`fused`; a miss costs one histc pass). ``rate``: the observer's ``upsample_rate``
    (:func:`upscale`).

    Returns whether the range changed (True for the first batch); :data:`NON_FINITE` for a
    batch holding NaN or an infinity, and None where the kernel does not apply: in both,
    nothing is written. No tensor op runs but the two ``linspace`` of a widening batch:
    right after a batch has streamed through the caches and the TLB, a small op costs ten
    times its usual few microseconds (the state's floats are read and written through
    :func:`quantscope.kernels.read` / ``write``)."""
    lib = _kernel()
    n, bins = x.numel(), hist.numel()
    if (lib is None or not kernels.plain(x) or not 0 < n < 1 << 24 or not kernels.plain(hist)
            or bins == 0 or not _c_rate(rate)
            or not (kernels.plain(lo) and kernels.plain(hi) and lo.numel() == hi.numel() == 1)):
        return None

    def done(new_lo: float, new_hi: float) -> bool:  # the counts are in place: the ends
        kernels.write(lo, new_lo)
        kernels.write(hi, new_hi)
        increment_version(hist)  # written by the C, as an in-place op would
        return first or (new_lo, new_hi) != (old_lo, old_hi)

    old_lo, old_hi = (None, None) if first else (kernels.read(lo)[0], kernels.read(hi)[0])
    movable = not first and old_lo < old_hi  # old bins that a wider range moves in C
    got = fused(x, bins, old_lo, old_hi, hist, threads, hist) if movable and one_read else None
    if got is not None and got[1] is not None:
        return done(old_lo, old_hi)
    # a batch after one that widened the range likely widens it too: the old bins' pieces
    # (torch.ao's linspace) are made now, among this call's first ops, rather than after the
    # min / max pass, where an op runs cold (~25 us a batch)
    pieces = bins * rate + 1
    lin = torch.linspace(old_lo, old_hi, pieces) if movable and not one_read else None
    if got is None:
        mm = (ctypes.c_float * 2)()
        lib.qs_ao_minmax(x.data_ptr(), n, mm, kernels.threads(threads))
        got = ((mm[0], mm[1]),)
    x_lo, x_hi = got[0]
    if not (math.isfinite(x_lo) and math.isfinite(x_hi)):
        return NON_FINITE
    if first:
        histc(x, bins, x_lo, x_hi, threads=threads, out=hist)
        return done(x_lo, x_hi)
    new_lo, new_hi = min(old_lo, x_lo), max(old_hi, x_hi)  # torch.min / max: the first on a tie
    if new_lo == old_lo and new_hi == old_hi:
        histc(x, bins, old_lo, old_hi, hist, threads=threads, out=hist)
        return done(old_lo, old_hi)
    if movable:  # the old bins moved and the batch binned in one call
        lin = torch.linspace(old_lo, old_hi, pieces) if lin is None else lin
        bounds = torch.linspace(new_lo, new_hi, bins + 1)
        # the edges are torch.ao's, of torch's default dtype; the kernel reads float32
        if lin.dtype == bounds.dtype == torch.float32 and not lib.qs_ao_widen(
                hist.data_ptr(), bins, rate, lin.data_ptr(), old_lo, old_hi, bounds.data_ptr(),
                x.data_ptr(), n, new_lo, new_hi, hist.data_ptr(), kernels.threads(threads)):
            return done(new_lo, new_hi)
    # rare: a one-value or an infinite range, or another default dtype (torch.ao's linspace)
    moved, new_lo, new_hi = update(hist.view(bins), (old_lo, old_hi), x, (x_lo, x_hi), bins,
                                   rate=rate)
    hist.view(bins).copy_(moved)
    return done(new_lo, new_hi)
