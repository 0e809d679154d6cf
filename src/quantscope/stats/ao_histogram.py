"""torch.ao ``HistogramObserver``'s histogram, state for state: the compat class's statistic.

torch.ao keeps ``bins`` float32 counts between the running ``min_val`` and ``max_val``.
A batch inside that range is added with ``torch.histc`` on the same grid; a batch that
widens the range is binned with ``histc`` over the new range, and the old counts are moved
there approximately (``_upscale_histogram``): each old bin is split into ``upsample_rate``
(16) pieces of a sixteenth of its count at the pieces' mid points, and each piece goes whole
to the new bin holding its mid point (``bucketize`` + weighted ``bincount``, float32). The
result depends on the batch order and is not an exact histogram of the data, but it is
torch.ao's, and its qparams follow from it: :func:`update` reproduces it bit for bit.

The torch path here is torch.ao's own sequence of ops (the reference, and the path for
other devices, dtypes, degenerate ranges and batches of ``2 ** 24`` values or more, where
torch's float32 counts saturate). On CPU two C kernels (``csrc/ao_hist.c``) do the same
float32 arithmetic: the ``histc`` pass (``trunc((x - lo) * bins / (hi - lo))`` per value,
counted in int32 and added as float32, the way ATen's kernel counts: exact below
``2 ** 24``; split over torch's threads, each counting its share into its own bins) and the
re-binning (torch's binary search and torch.bincount's in-order
float32 sums); ``torch.linspace`` still makes the mid points and edges (a few microseconds,
and its vectorized rounding is torch's alone). A batch inside the current range (the common
case once the range has settled) takes one read instead of two (:func:`fused`: the min / max
and the bins together; used after a batch that did not widen the range, since a widening
batch must be binned again). Tests compare both paths, and the observer with torch.ao's,
bitwise.
"""

from __future__ import annotations

import torch

from .. import kernels

__all__ = ["UPSAMPLE_RATE", "fused", "histc", "update", "upscale"]

#: torch.ao's ``upsample_rate``: pieces per old bin when the range grows
UPSAMPLE_RATE = 16


def _kernel():
    return kernels.lib("ao_hist")


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def histc(x: torch.Tensor, bins: int, lo: torch.Tensor, hi: torch.Tensor,
          base: torch.Tensor | None = None, backend: str | None = None,
          threads: int | None = None) -> torch.Tensor:
    """``base + torch.histc(x, bins, min=lo, max=hi)`` (float32 ``[bins]``; ``base`` None:
    the histc alone). ``backend``: see :data:`quantscope.kernels.BACKENDS`; ``threads``:
    the kernel's (default torch's; at least ``2 ** 18`` values each)."""
    applies = (_plain(x) and not x.requires_grad
               and (base is None or (_plain(base) and base.shape == (bins,))))
    lib = kernels.choose(backend, "ao_hist", "histc", applies)
    if lib is not None:
        out = torch.empty(bins)
        src = torch.zeros(bins) if base is None else base
        if not lib.qs_ao_histc(x.data_ptr(), x.numel(), float(lo), float(hi), bins,
                               src.data_ptr(), out.data_ptr(), kernels.threads(threads)):
            return out
    h = torch.histc(x, bins, min=float(lo), max=float(hi))
    return h if base is None else base + h


def fused(x: torch.Tensor, bins: int, lo: torch.Tensor, hi: torch.Tensor, base: torch.Tensor,
          threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One read of ``x`` (C): ``(minmax, hist)``, ``minmax`` its ``torch.aminmax`` as a
    ``(2,)`` tensor, ``hist`` ``base + torch.histc(x, bins, min=lo, max=hi)`` when every value
    lies in ``[lo, hi]`` (torch.ao's update on an unchanged range), else None. None where the
    kernel does not apply (the caller reads ``x`` twice, as torch.ao does)."""
    lib = _kernel()
    if (lib is None or not _plain(x) or x.requires_grad or not _plain(base)
            or base.shape != (bins,)):
        return None
    out, mm = torch.empty(bins), torch.empty(2)
    miss = lib.qs_ao_fused(x.data_ptr(), x.numel(), float(lo), float(hi), bins, base.data_ptr(),
                           out.data_ptr(), mm.data_ptr(), kernels.threads(threads))
    return None if miss == 2 else (mm, None if miss else out)


def upscale(hist: torch.Tensor, orig_lo: torch.Tensor, orig_hi: torch.Tensor,
            new_lo: torch.Tensor, new_hi: torch.Tensor, backend: str | None = None
            ) -> torch.Tensor:
    """torch.ao's ``_upscale_histogram``: ``hist`` on ``[orig_lo, orig_hi]`` moved onto
    ``len(hist)`` bins over ``[new_lo, new_hi]`` (see the module doc)."""
    bins = hist.shape[0]
    rate = UPSAMPLE_RATE
    bin_size = (orig_hi - orig_lo) / (bins * rate)
    mids = torch.linspace(orig_lo, orig_hi, bins * rate + 1)[:-1] + 0.5 * bin_size
    bounds = torch.linspace(new_lo, new_hi, bins + 1)
    applies = _plain(hist) and mids.dtype == bounds.dtype == torch.float32
    lib = kernels.choose(backend, "ao_hist", "upscale", applies)
    if lib is not None:
        out = torch.empty(bins)
        lib.qs_ao_upscale(hist.data_ptr(), bins, rate, mids.data_ptr(), bounds.data_ptr(),
                          out.data_ptr())
        return out
    pieces = hist.repeat_interleave(rate) / rate
    where = torch.bucketize(mids, bounds, right=True) - 1
    where[where >= bins] = bins - 1
    where[where < 0] = 0
    return torch.bincount(where, weights=pieces, minlength=bins)


def update(hist: torch.Tensor | None, lo: torch.Tensor | None, hi: torch.Tensor | None,
           x: torch.Tensor, x_lo: torch.Tensor, x_hi: torch.Tensor, bins: int,
           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ao ``HistogramObserver.forward``'s state change: the new ``(histogram, min_val,
    max_val)`` after the finite batch ``x`` with min / max ``x_lo``, ``x_hi`` (0-dim
    float32); ``hist`` None: the first batch (``reset_histogram``). Fresh tensors; the
    inputs are not modified."""
    if hist is None:
        return histc(x, bins, x_lo, x_hi, None, backend), x_lo.clone(), x_hi.clone()
    new_lo, new_hi = torch.min(lo, x_lo), torch.max(hi, x_hi)
    if bool(new_lo == lo) and bool(new_hi == hi):
        return histc(x, bins, new_lo, new_hi, hist, backend), lo.clone(), hi.clone()
    if bool(lo == hi):  # a one-value histogram: its total moves to that value's new bin
        moved = torch.histc(lo, bins=bins, min=float(new_lo), max=float(new_hi)) * hist.sum()
    else:
        moved = upscale(hist, lo, hi, new_lo, new_hi, backend)
    return histc(x, bins, new_lo, new_hi, moved, backend), new_lo, new_hi
