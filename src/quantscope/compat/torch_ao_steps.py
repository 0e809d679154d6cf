"""torch.ao ``HistogramObserver``'s two steps as quantscope runs them, for
:class:`quantscope.compat.torch_ao.HistogramObserver`: the histogram update (one C pass on
CPU float32 batches, torch.ao's sequence of tensor ops elsewhere) and the non-linear search
(vectorized); each also as a ``torch.library`` custom op (``quantscope::ao_histogram_observe``,
``quantscope::ao_histogram_search``), the way in for a scripted observer. The errors a batch
can raise are ``ValueError`` s that are ``RuntimeError`` s as torch.ao's."""

from __future__ import annotations

import math

import torch
from torch.ao.quantization import observer as _ao

from .. import kernels
from .._checks import write_refused
from .._oplib import never_traced
from ..estimators.l2 import check_dst_nbins, l2_range
from ..stats import ao_histogram
from ..stats.histogram import Hist

__all__ = ["NoBinsError", "NonFiniteBatchError", "StateOverflowError", "binned", "eager_search",
           "observe_fast", "observe_tensors"]


class NonFiniteBatchError(ValueError, RuntimeError):
    """A batch :class:`HistogramObserver` cannot bin (NaN): a ``RuntimeError`` as torch.ao's
    (``torch.histc``'s), and a ``ValueError`` as quantscope's bad-input errors."""


class StateOverflowError(ValueError, RuntimeError):
    """A batch range overflowing :class:`HistogramObserver`'s state dtype, or a state a cast
    overflowed: a ``RuntimeError`` as torch.ao's (its overflow / ``histc``), a ``ValueError``."""


class NoBinsError(ValueError, RuntimeError):
    """``HistogramObserver(bins=0)`` (torch.ao's constructor takes it) observing a batch: a
    ``RuntimeError`` as torch.ao's ``torch.histc``'s, and a ``ValueError`` (a bad argument)."""


def _check_bins(hist: torch.Tensor) -> None:
    if not hist.numel():
        raise NoBinsError("HistogramObserver: bins must be a positive integer to observe a "
                          "batch, got 0 (torch.ao's torch.histc refuses it too)")


def binned(x: torch.Tensor) -> torch.Tensor:
    """The batch as the histogram bins it: bfloat16 / float16 as float32 (every value
    counted; torch.ao's ``histc`` in those dtypes loses counts: see ``HistogramObserver``).
    A float32 copy on the CPU (the C path's input); elsewhere the batch as it is, which
    ``ao_histogram.histc`` bins as float32 (``quantscope::ao_histc``: on CUDA in copies of
    ``2 ** 24`` values at a time)."""
    ao_histogram.check_dense("HistogramObserver", x)
    x = x.detach()  # as torch.ao: the state never joins the autograd graph
    low = x.dtype in (torch.bfloat16, torch.float16)
    return x.float() if low and x.device.type == "cpu" else x


def observe_fast(x: torch.Tensor, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  one_read: bool, rate) -> bool | None:
    """torch.ao's histogram step for a finite float32 CPU batch, in C and in place on the
    buffers (:func:`quantscope.stats.ao_histogram.observe`; ``rate``: the observer's
    ``upsample_rate``): whether the range widened, or None where the C path does not apply
    (nothing written)."""
    if not (x.dtype == torch.float32 and x.is_cpu and hist.is_cpu and lo.dim() == 0
            and kernels.plain(lo) and kernels.plain(hi)):
        return None
    if write_refused(hist):
        return None  # the tensor path raises, as torch.ao's in-place update does
    old_lo, old_hi = kernels.read(lo)[0], kernels.read(hi)[0]
    first = old_lo == math.inf or old_hi == -math.inf  # torch.ao's is_uninitialized
    if not first:
        _refuse_cast_overflow(old_lo, old_hi, lo.dtype)  # a loaded inf end
    got = ao_histogram.observe(hist, lo, hi, kernels.contiguous(x), first, one_read=one_read,
                               rate=rate)
    return None if got is None or got is ao_histogram.NON_FINITE else got


def _refuse_cast_overflow(lo: float, hi: float, dtype: torch.dtype) -> None:
    """Raise where a module cast (``.half()``) turned an observed state's ends inf, or a
    float32 one was loaded so (torch.ao's ``histc`` raises at the next batch; its qparams
    come out NaN)."""
    if not math.isinf(hi - lo):
        return
    if dtype in (torch.float32, torch.float64):  # a loaded state, or a cast there and back
        raise StateOverflowError(f"HistogramObserver: its state's range [{lo}, {hi}] is not "
                                 f"finite: a loaded min_val / max_val held inf, or a module "
                                 f"cast (.half()) overflowed it before a cast back; load a "
                                 f"finite state or reset() it")
    raise StateOverflowError(f"HistogramObserver: a module cast to {dtype} overflowed its "
                             f"state (max {torch.finfo(dtype).max:.6g}); keep the observer "
                             f"in float32 or reset() it")


def observe_tensors(x: torch.Tensor, hist: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, rate) -> None:
    """torch.ao's histogram step by tensor ops (any device or dtype; float64 ``x`` binned in
    float64, the others as float32; the reference the C path equals), its decisions on the
    ends read back once: ``inf`` dropped with torch.ao's warning, then no bins a
    :class:`NoBinsError` and NaN a :class:`NonFiniteBatchError`, in torch.ao's order
    (``x`` detached: :func:`binned`'s; ``rate``: the observer's ``upsample_rate``)."""
    x_lo, x_hi, old_lo, old_hi = ao_histogram.ends(x, lo, hi)
    if x_lo == -math.inf or x_hi == math.inf:  # (NaN: aminmax gives NaN at both ends)
        x = ao_histogram.drop_inf(x, stacklevel=3)
        if x.numel() == 0:
            return
        x_lo, x_hi, _, _ = ao_histogram.ends(x, lo, hi)
    _check_bins(hist)  # torch.ao's histc checks its bins before its range
    if math.isnan(x_lo):  # torch.ao's histc raises here too (after poisoning its min / max)
        raise NonFiniteBatchError("HistogramObserver: the batch holds NaN; torch.ao's histogram "
                                  "cannot bin it (torch.histc: range of [nan, nan] is not "
                                  "finite); the observer's state is left as it was")
    first = old_lo == math.inf or old_hi == -math.inf
    top = torch.finfo(lo.dtype).max  # past it: rounded to it, or to inf (torch.ao stores inf)
    if not first:
        _refuse_cast_overflow(old_lo, old_hi, lo.dtype)
    if max(-x_lo, x_hi) > top and ao_histogram.rounds_to_inf(max(-x_lo, x_hi), lo.dtype):
        raise StateOverflowError(
            f"HistogramObserver: the batch's range [{x_lo:.6g}, {x_hi:.6g}] exceeds the "
            f"observer's {lo.dtype} state (rounds to inf past its max {top:.6g}); the "
            f"observer's state is left as it was")
    new, new_lo, new_hi = ao_histogram.update(None if first else hist,
                                              None if first else (old_lo, old_hi), x,
                                              (x_lo, x_hi), hist.numel(), rate=rate,
                                              dtype=lo.dtype)
    hist.copy_(new.reshape(hist.shape))
    lo.fill_(min(max(new_lo, -top), top))  # max as torch.ao's copy_ rounds (fill_ refuses)
    hi.fill_(min(max(new_hi, -top), top))


@torch.library.custom_op("quantscope::ao_histogram_observe",
                         mutates_args=("histogram", "min_val", "max_val"))
def _observe_op(x: torch.Tensor, histogram: torch.Tensor, min_val: torch.Tensor,
                max_val: torch.Tensor, upsample_rate: int = 16) -> None:
    """TorchScript's way into :func:`observe_fast` / :func:`observe_tensors`."""
    if not x.numel():  # torch.ao's first check, as in eager
        return
    x = binned(x)
    if observe_fast(x, histogram, min_val, max_val, True, upsample_rate) is None:
        observe_tensors(x, histogram, min_val, max_val, upsample_rate)


class _AOSearch:
    """torch.ao's own search code, run on given buffers (what :func:`_search` needs for a
    state not all float32: the vectorized search compares and prices in float32, as torch.ao
    does for its float32 buffers only)."""

    _get_norm = _ao.HistogramObserver._get_norm
    _compute_quantization_error = _ao.HistogramObserver._compute_quantization_error
    _non_linear_param_search = _ao.HistogramObserver._non_linear_param_search

    def __init__(self, histogram, min_val, max_val, dst_nbins):
        self.histogram, self.min_val, self.max_val = histogram, min_val, max_val
        self.bins, self.dst_nbins = histogram.numel(), dst_nbins


def _search(histogram: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor,
            dst_nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ao's ``_non_linear_param_search`` (0-dim ``new_min``, ``new_max``), vectorized;
    a state not all float32 (after ``.double()``, ``.half()``, ``.bfloat16()``) runs
    torch.ao's own loop: it compares and prices in the state's dtype there."""
    check_dst_nbins("quantscope::ao_histogram_search", dst_nbins)
    _refuse_cast_overflow(float(min_val), float(max_val), min_val.dtype)
    if any(t.dtype != torch.float32 for t in (histogram, min_val, max_val)):
        ao = _AOSearch(histogram, min_val, max_val, dst_nbins)
        new_lo, new_hi = ao._non_linear_param_search()
        return new_lo.reshape(()).clone(), new_hi.reshape(()).clone()
    hist = Hist(histogram.float().reshape(1, -1), min_val.reshape(1), max_val.reshape(1))
    with torch.inference_mode():
        new_lo, new_hi = l2_range(hist, dst_nbins)
    return new_lo.reshape(()).clone(), new_hi.reshape(()).clone()


eager_search = never_traced(_search)  # the search run eagerly (see ``_forward_eager``)


@torch.library.custom_op("quantscope::ao_histogram_search", mutates_args=())
def _search_op(histogram: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor,
               dst_nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchScript's way into :func:`_search`."""
    return _search(histogram, min_val, max_val, dst_nbins)


@_observe_op.register_fake
def _(x, histogram, min_val, max_val, upsample_rate=16):
    return None


@_search_op.register_fake
def _(histogram, min_val, max_val, dst_nbins):
    check_dst_nbins("quantscope::ao_histogram_search", dst_nbins)
    dtype = torch.promote_types(min_val.dtype, max_val.dtype)  # new_min = min_val + width * bin
    return min_val.new_empty((), dtype=dtype), max_val.new_empty((), dtype=dtype)
