"""Histogram observers: percentile, histogram MSE, entropy (KL), torch.ao's L2 search, mix.

Each keeps a per-unit streaming histogram (:mod:`quantscope.stats.histogram`) for
any layout and hands it to its estimator (:mod:`quantscope.estimators`) when the
range is asked for. Two ways to combine batches:

* default: accumulate one histogram over every batch (exact: int64 counts on a
  power-of-two grid, independent of batch order, mergeable across processes);
  estimate once, at ``calculate_qparams``;
* ``averaging_constant=c`` (Horizon's mode): every ``update_interval`` batches,
  estimate the range on the histogram of those batches (bounded by their own min / max),
  then ``range = torch.lerp(range, estimate, c)`` (the first estimate initialises) and start a
  new histogram (:mod:`.histogram_ema`). This runs the estimator inside ``forward``.

Symmetric specs histogram ``|x|`` (the estimators' reference form), asymmetric ones
the signed values; ``histogram`` (torch.ao's search) always histograms signed values.
Ranges are clipped to the data's min / max (symmetric specs: to +-max |x|), both ends
into that interval and in order, so the range is valid. For asymmetric specs it holds the
data's value when the estimate falls inside one bin (constant data gives ``(x, x)``, as
torch.ao's ``HistogramObserver``); for symmetric ones only ``max |x|`` bounds it, so an
estimate inside one bin can fall short of ``max |x|`` by up to a bin (the percentile's bin
centre; ``histogram``'s signed range: constant -3.0 gives ``(-2.998, -2.969)``). Clipping
to the signed min / max there would move ``histogram``'s ranges wherever an end lies past
the data (a bin edge past min or max: many per-tensor results, by up to a bin).

``grid="first"`` is for the compat classes: the first batch is binned as torch.ao / Quark
bin it (``torch.histc`` over its min / max, or ``[0, max |x|]``); later batches inside that
range are added on the same grid, so results equal the reference's.
The first batch that leaves the range moves the counts once to the native grid (each old
bin to the bin of its centre: the only approximate step; Horizon's KL appends bins of the
first width instead, up to ``GROW_LIMIT x bins``: ``_append_bins``); exact from then on
(host reads). All units leave together, so one can differ a little from itself observed alone.

On CPU the native grid's update runs in C (:mod:`quantscope.stats.hist_kernel`, bitwise equal
to the torch path): a one-unit (per-tensor) histogram takes the min / max and updates its counts
in one read of the batch (``_unit_minmax`` runs the fused pass, ``_observe`` takes its state);
a float32 batch's call (bf16 / fp16: up to ``HALF_PIECE`` values) is one C call, its decisions
cached per input (:mod:`.hist_step`; where that call misses, the two-pass update follows).
"""

from __future__ import annotations

import torch

from .._checks import check_bool, check_int
from ..comm import AVG, MAX, MIN
from ..estimators.entropy import check_options as check_entropy_options
from ..estimators.entropy import entropy_range, spec_bits
from ..estimators.histogram_mse import histogram_mse_range
from ..estimators.l2 import check_dst_nbins, default_dst_nbins, l2_polished_range
from ..estimators.mix import MIX_CANDIDATES, MIX_PERCENTILES, mix_range
from ..estimators.mix import check_options as check_mix_options
from ..estimators.percentile import check_convention, check_percentile, percentile_range
from ..estimators.scorer import tensor_amax
from ..qparams import amax_of_range
from ..stats import hist_kernel
from ..stats import histogram as H
from ..stats.histogram_sync import HistogramSync
from ..stats.minmax_layouts import unpad_minmax_
from . import record
from .base import Observer
from .hist_step import MISSED, cpu_step
from .histogram_ema import WINDOW, IntervalAverage
from .histogram_estimate import ScaledEstimate
from .registry import register

__all__ = [
    "EntropyObserver",
    "HistogramMSEObserver",
    "HistogramObserverBase",
    "L2HistogramObserver",
    "MixObserver",
    "PercentileObserver",
]

_STATE = H.STATE_BUFFERS


class HistogramObserverBase(ScaledEstimate, IntervalAverage, Observer):
    """Base of the histogram observers: keeps the histogram, asks :meth:`_estimate` for ranges.

    Args:
        spec: the quantization scheme (any layout).
        bins: bins per unit (fixed memory: ``units x bins`` int64).
        averaging_constant: None (accumulate) or Horizon's EMA of ranges (reads back, as "first").
        update_interval: batches per estimate in the EMA mode.
        grid: ``"pow2"`` (native, exact) or ``"first"`` (reference binning of the first batch).
        skip_zeros: do not count exact zeros (Quark's percentile observer).
    """

    family = "histogram"
    unpads = False  # _unit_minmax takes the padding out (_padding): the histogram needs it too

    absolute: bool | None = None  #: histogram of |x| rather than x (None: |x| if symmetric)
    #: sync_every_step: the step's padding zeros per unit (None: none), this rank's, then
    #: every rank's (step_sync sums them; the gathered units no longer tell)
    _step_zeros: torch.Tensor | None = None
    GROW_LIMIT = 1  #: a first grid grows to at most GROW_LIMIT x bins (_append_bins; 1: never)
    MIN_BINS = 16  #: the fewest ``bins`` taken (a toolkit's class whose grids take fewer lowers it)
    cached_cpu_step = True  #: the cached CPU call (:mod:`.hist_step`); False: general forward

    def __init__(self, spec=None, *, bins: int = 2048, averaging_constant: float | None = None,
                 update_interval: int = 1, grid: str = "pow2", skip_zeros: bool = False,
                 **kwargs):
        super().__init__(spec, **kwargs)
        # the checked Python ints kept: numpy's would leak into repr and saved records; more
        # than 2 ** 31 bins would take 16 GiB a unit (a count past float's range: no message)
        bins = check_int(type(self).__name__, "bins", bins, self.MIN_BINS, 2**31 - 1)
        averaging_constant = self._averaging_constant(averaging_constant, optional=True)
        update_interval = check_int(type(self).__name__, "update_interval", update_interval, 1)
        if grid not in ("pow2", "first"):
            raise ValueError(f"{type(self).__name__}: grid must be 'pow2' or 'first', got {grid!r}")
        self.bins, self.averaging_constant = bins, averaging_constant
        self.update_interval, self.grid = update_interval, grid
        # bool("no") is True: a string would turn skipping on silently
        self.skip_zeros = check_bool(type(self).__name__, "skip_zeros", skip_zeros)
        self._absolute = self.spec.symmetric if self.absolute is None else self.absolute
        for name in (*_STATE, "min_vals", "max_vals", "ema_lo", "ema_hi"):
            dtype = torch.int64 if name in _STATE[:3] else torch.float32
            self.register_buffer(name, torch.zeros(0, dtype=dtype))
        self.register_buffer("linear_grid", torch.zeros((), dtype=torch.bool))
        self.register_buffer("pending", torch.zeros((), dtype=torch.int64))
        self._register_window()
        self._pending = 0  # a Python mirror of ``pending``: forward never reads it back
        # [(units, their contiguous copy, the fused pass's state or None, their padded parts)]
        # from _unit_minmax, for _observe (or the cached step's MISSED, for _unit_minmax),
        # and the shape forward read (a list: no setattr)
        self._pass = [None, None]

    def _sized_buffers(self):
        return (*_STATE, "min_vals", "max_vals", "ema_lo", "ema_hi", *WINDOW)

    @property
    def units_in_input_dtype(self) -> bool:
        # the native grid's ops (unit_minmax, hist_regrid_, hist_add) read bf16 / fp16 units
        # exactly; the linear first grid computes in the units' dtype, a step exchange
        # gathers float32 units
        return self.grid == "pow2" and not self.sync_every_step

    @property
    def _linear(self) -> bool:
        # the native grid never reads the flag (no host sync in forward)
        return self.grid == "first" and bool(self.linear_grid)

    # ------------------------------------------------------------------ state
    def _state(self) -> H.HistState:
        return H.HistState(*(self._buffers[n] for n in _STATE))

    def _set_state(self, state: H.HistState) -> None:
        self._store(_STATE, state)  # the same tensors: torch.export / CUDA graphs keep them

    def current_histogram(self) -> H.Hist:
        """The histogram observed so far (since the last estimate in the EMA mode)."""
        if self._linear:
            return H.Hist(self.hist_counts, self.hist_lo, self._linear_top(), self._absolute)
        return H.view(self._state(), self._absolute)

    def _linear_top(self) -> torch.Tensor:  # the first grid's last edge (past any appended)
        return self.hist_hi

    #: the most memory one observer's histograms may take (``units x bins`` int64); more is
    #: an error naming the layout, not an allocation that takes the machine down
    max_hist_bytes: int = 1 << 31

    def _check_size(self, count: int) -> None:
        need = count * self.bins * 8
        if need > self.max_hist_bytes:
            raise ValueError(
                f"{self.describe()}: {count} units x {self.bins} bins need {need / 2**30:.1f} GiB "
                f"of histograms (limit {self.max_hist_bytes / 2**30:.1f} GiB: max_hist_bytes); "
                f"use a coarser layout or fewer bins")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        H.check_state(record.at(self.describe(), prefix), state_dict, prefix, self.bins,
                      self.GROW_LIMIT, self.grid == "first")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        self._pass[1] = getattr(x, "shape", None)  # which units are padded (_padding)
        if cpu_step(self, x, HistogramObserverBase):  # one C pass, its decisions cached
            return x
        return super().forward(x)

    def _unit_minmax(self, units, count, ends):
        self._check_size(count)
        # one read of the batch for a one-unit histogram: the min / max and the histogram
        # update together (stats.hist_kernel.fused_update); strided units (a channel axis
        # that is not the first) copied once for both passes. Kept for _observe. Not tried
        # where the cached step's same fused call just missed on this batch (MISSED).
        missed, self._pass[0] = self._pass[0] is MISSED, None
        if self.sync_every_step:  # step_sync takes this rank's real lo / hi and padding
            lo, hi = super()._unit_minmax(units, count, ends)
            self._step_zeros = H.padding_zeros(units, self._padding(units, lo, hi))
            return lo, hi
        dense = units
        if units.device.type == "cpu" and not units.is_contiguous():
            dense = units.contiguous()
        new = None
        if count == 1 and self.grid == "pow2" and not missed:
            # the state _observe would update (a first batch, or after a reset: empty)
            state = self._state() if self.min_vals.shape[0] == 1 and \
                self.hist_counts.shape[0] == 1 else H.empty_state(1, self.bins)
            new = hist_kernel.fused_update(state, dense, self._absolute, ends=ends)
        if new is not None:
            state, lo, hi = new
            new = H.HistState(*state)
        else:
            lo, hi = super()._unit_minmax(dense, count, ends)
        self._pass[0] = (units, dense, new, self._padding(dense, lo, hi))
        return lo, hi

    def _padding(self, units, lo, hi):
        """The padded parts of ``units`` (``Layout.padded_parts``); a padded unit's ``lo`` /
        ``hi`` become its real values' (the padding zeros are no data), in place."""
        return unpad_minmax_(self.spec.layout, units, self._pass[1], lo, hi)

    def _observe(self, units, lo, hi):
        fused, parts = None, []
        stash, self._pass[0] = self._pass[0], None
        if stash is not None and stash[0] is units:
            _, units, fused, parts = stash
        zeros = self._step_zeros if self.sync_every_step else H.padding_zeros(units, parts)
        U = units.shape[0]
        if not (running := self.min_vals.shape[0] == U):  # a first batch
            self.min_vals, self.max_vals = lo.clone(), hi.clone()
            self._set_state(H.empty_state(U, self.bins, units.device))
            self.linear_grid.fill_(self.grid == "first")
        if self.hist_counts.shape[0] != U:  # after an EMA step reset
            self._set_state(H.empty_state(U, self.bins, units.device))
        if fused is None and self._linear:
            self._observe_linear(units, lo, hi, zeros)
        else:  # fused: the update already ran in _unit_minmax
            # in place: the buffers are given up for the new state (a batch inside the grid then
            # costs its values, not a fresh units x bins)
            self._set_state(fused or H.update(self._state(), units, lo, hi, self._absolute,
                                              inplace=True))
            self._drop_zeros(units, zeros)
        if running:  # after the counts: a grid's growth that refuses the batch changed nothing
            torch.minimum(self.min_vals, lo, out=self.min_vals)
            torch.maximum(self.max_vals, hi, out=self.max_vals)
        if self.averaging_constant is not None:
            self._interval_batch(lo, hi)

    def _observe_linear(self, units, lo, hi, zeros):
        if self._absolute:
            lo, hi = torch.zeros_like(hi), torch.maximum(lo.abs(), hi.abs())
            units = units.abs()
        if bool(torch.isinf(self.hist_lo).all()):  # first batch: its own min / max
            self._store(("hist_lo", "hist_hi"), (lo.clone(), hi.clone()))
        elif bool(((lo < self.hist_lo) | (hi > self._linear_top())).any()) and \
                not self._append_bins(hi):
            self._leave_linear(lo, hi)
            self._set_state(H.update(self._state(), units, lo, hi, self._absolute,
                                     inplace=True))
            self._drop_zeros(units, zeros)
            return
        self.hist_counts += H.linear_counts(units, self.hist_lo, self._linear_top(),
                                            self.hist_counts.shape[1])
        self._drop_zeros(units, zeros, linear=True)

    def _append_bins(self, hi) -> bool:  # True: the first grid grown to hold hi, not left
        return False

    def _leave_linear(self, lo, hi):
        # one approximate step: each first-grid bin moves to the native bin of its centre
        h = self.current_histogram()
        glo = torch.minimum(torch.minimum(h.lo, lo), torch.zeros_like(lo))
        ghi = torch.maximum(torch.maximum(h.hi, hi), torch.zeros_like(hi))
        e = H.grid_exponent(glo, ghi, self.bins)
        first = H.grid_first(glo, e, self._absolute)
        idx = torch.floor(h.centers() * H.pow2(-e)[:, None]).long() - first[:, None]
        counts = h.counts.new_zeros(h.counts.shape[0], self.bins)  # a grown grid's too
        counts.scatter_add_(1, idx.clamp(0, self.bins - 1), h.counts)
        self._set_state(H.HistState(counts, e, first, glo, ghi))
        self.linear_grid.fill_(False)

    def _drop_zeros(self, units, zeros, linear=False):
        """Take zeros back out of the histogram just updated with ``units``: all of them
        (``skip_zeros``), else the padding's (``zeros``: per unit, or None)."""
        n = (units == 0).sum(1) if self.skip_zeros else zeros
        if n is None:
            return
        if linear:  # the bin histc counted a zero in, if any (0 may lie outside the grid)
            hit = H.linear_counts(units.new_zeros(units.shape[0], 1), self.hist_lo,  # (grown)
                                  self._linear_top(), self.hist_counts.shape[1])
            n, zero_bin = n * hit.sum(1), hit.argmax(1)
        else:
            zero_bin = -self.hist_first  # floor(0 * 2 ** -e) - first
        self.hist_counts.scatter_add_(1, zero_bin.clamp(0, self.bins - 1)[:, None], -n[:, None])

    # --------------------------------------------------------------- ranges
    def _bounds(self):
        """The range an estimate is clipped to: the data's min / max (symmetric: +-max |x|),
        in the EMA mode the interval's (:meth:`_data_range`)."""
        lo, hi = self._data_range()
        if self.spec.symmetric:  # the range that matters is max |x|, on either side
            amax = amax_of_range(lo, hi)
            return -amax, amax
        return lo, hi

    def global_amax(self):  # NVFP4's: all batches' max |x| (EMA too); scored under it too
        return tensor_amax(self.spec, self.min_vals, self.max_vals)

    def _clip(self, lo, hi):
        # both ends into [blo, bhi] and in order: a tail estimate inside one bin (constant
        # data, or the lower convention's left edge of the bin holding both percentiles) may
        # lie past the data or cross the other end; clipping each end to its own side alone
        # gave lo > hi, a range without the data's min
        blo, bhi = self._bounds()
        lo, hi = lo.clamp(blo, bhi), hi.clamp(blo, bhi)
        return torch.minimum(lo, hi), torch.maximum(lo, hi)

    def calculate_range(self):
        if not self.has_observed or bool(self.seen_non_finite):
            self.check_ready()  # the error calculate_qparams gives (not an IndexError / NaN)
        if self.averaging_constant is None:
            return self._estimated()
        if self._pending or self.ema_lo.numel() == 0:  # batches since the last estimate
            return self._averaged()  # on temporaries: a read leaves the interval whole
        return self.ema_lo, self.ema_hi

    def _estimate(self, hist: H.Hist) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # (_estimated: ScaledEstimate's)

    #: the largest ``|x|`` a histogram takes: the power-of-two grid's last edge (up to twice
    #: the data's max) and the estimators' scores must stay finite in float32
    MAX_ABS = 2.0 ** 126

    def _check_magnitude(self) -> None:
        if not self.min_vals.numel():
            return
        amax = float(amax_of_range(self.min_vals.amin(), self.max_vals.amax()))
        if amax >= self.MAX_ABS:  # NaN / inf are reported by check_ready
            raise ValueError(
                f"{self.describe()}: observed |x| up to {amax:.4g}; histogram observers take "
                f"|x| < 2**126 = {self.MAX_ABS:.4g} (their grid's edges must stay finite in "
                f"float32); use a min-max or MSE observer for such values")

    def sync_plan(self):
        if self.averaging_constant is not None:  # exact with sync_every_step, else AVG
            # this rank's batches since the last estimate join its average first (none folds
            # its own after the sync); step-synced ranks agree already: their interval goes on
            if self._pending and not self.sync_every_step:
                self._ema_step()
            return [("min_vals", MIN), ("max_vals", MAX), ("ema_lo", AVG), ("ema_hi", AVG)]
        if self.grid == "first":  # a config, the same on every rank: no rank waits
            raise NotImplementedError(f"{self.describe()}: grid='first' histograms (the reference "
                                      f"binning) do not sync exactly; use the native grid")
        # agree on the union's power-of-two grid, re-bin exactly, SUM the counts
        return [("min_vals", MIN), ("max_vals", MAX), HistogramSync(*_STATE, self._absolute)]

    def reset(self):
        super().reset()
        self.linear_grid.fill_(False)
        self._pending = 0

    def extra_repr(self):
        extra = f", averaging_constant={self.averaging_constant}" \
            if self.averaging_constant is not None else ""
        return f"{super().extra_repr()}, bins={self.bins}{extra}"


@register("percentile")
class PercentileObserver(HistogramObserverBase):
    """The ``percentile`` (99.99) of ``|x|`` (symmetric) or of both tails (asymmetric).

    ``convention``: ``"center"`` (default, Horizon), ``"lower"`` (Quark, ModelOpt) or
    ``"upper"``; see :mod:`quantscope.estimators.percentile`.
    """

    scales_subnormal = True  # (ScaledEstimate; the MSE, entropy and mix observers too)

    def __init__(self, spec=None, *, percentile: float = 99.99, convention: str = "center",
                 **kwargs):
        super().__init__(spec, **kwargs)
        who = type(self).__name__
        self.percentile = check_percentile(who, "percentile", percentile)
        self.convention = check_convention(who, convention)

    def _estimate(self, hist):
        return percentile_range(hist, self.percentile, symmetric=self.spec.symmetric,
                                convention=self.convention)


@register("histogram_mse")
class HistogramMSEObserver(HistogramObserverBase):
    """Clip at the bin centre (from ``start_bin``, every ``stride``, up to the data's range)
    with the least squared quantization error of the histogram (ModelOpt / Quark).
    ``refine``: 16 (default) searches coarse-to-fine, None scores every candidate (the exact
    argmin; see :func:`~quantscope.estimators.histogram_mse.histogram_mse_range`)."""

    scales_subnormal = True

    def __init__(self, spec=None, *, start_bin: int = 128, stride: int = 1,
                 refine: int | None = 16, **kwargs):
        super().__init__(spec, **kwargs)
        self.start_bin = check_int(type(self).__name__, "start_bin", start_bin, 0)
        self.stride = check_int(type(self).__name__, "stride", stride, 1)
        self.refine = None if refine is None else \
            check_int(type(self).__name__, "refine", refine, 1)

    def _estimate(self, hist):
        # bounds: the range _clip keeps, so the range scored is the range that runs
        lo, hi, amax = self._estimate_units(*self._bounds(), self.global_amax())
        return histogram_mse_range(hist, self.spec, start_bin=self.start_bin, stride=self.stride,
                                   refine=self.refine, bounds=(lo, hi), global_amax=amax)


@register("entropy", "kl")
class EntropyObserver(HistogramObserverBase):
    """TensorRT's entropy calibration: the ``|x|`` threshold minimising KL(P || Q).

    ``num_bits`` (default: the integer format's bits, else 8), ``start_bin`` 128,
    ``stride`` 1, ``smooth`` (Horizon: 9), ``copy_zero_bin`` (True or False: TensorRT's
    ``h[0] = h[1]``). TensorRT's unsigned mode (``2 ** num_bits`` levels over ``[0, amax]``)
    is for a quantizer whose codes lie on one side of zero: an unsigned format with a free
    zero point (asymmetric). Every other spec gets ``2 ** (num_bits - 1)`` levels per side,
    symmetric unsigned ones too (uint8's zero point 128: the quantizer of int8)
    (:func:`~quantscope.estimators.entropy.spec_bits`).
    """

    absolute = True
    scales_subnormal = True

    def __init__(self, spec=None, *, start_bin: int = 128, stride: int = 1, smooth: int = 1,
                 num_bits: int | None = None, copy_zero_bin: bool = True, **kwargs):
        super().__init__(spec, **kwargs)
        bits, self.unsigned = spec_bits(self.spec)
        self.num_bits, self.start_bin, self.stride, self.smooth = check_entropy_options(
            type(self).__name__, num_bits=bits if num_bits is None else num_bits,
            start_bin=start_bin, stride=stride, smooth=smooth, bins=self.bins,
            copy_zero_bin=copy_zero_bin)
        self.copy_zero_bin = copy_zero_bin

    def _estimate(self, hist):
        return entropy_range(hist, num_bits=self.num_bits, unsigned=self.unsigned,
                             start_bin=self.start_bin, stride=self.stride, smooth=self.smooth,
                             copy_zero_bin=self.copy_zero_bin)


@register("histogram", "l2_histogram")
class L2HistogramObserver(HistogramObserverBase):
    """torch.ao ``HistogramObserver``'s non-linear L2 search, per unit, on a signed histogram.

    ``polish`` (native default 256; 0 in the torch.ao compat class) then moves each end by
    up to that many whole bins where the quantization error on the histogram drops, and
    keeps the search's range unless a move scores lower
    (:func:`~quantscope.estimators.l2.l2_polished_range`): on quantscope's grid the search
    alone can land a bin or two from torch's choice on its own grid.
    """

    absolute = False

    def __init__(self, spec=None, *, dst_nbins: int | None = None, polish: int = 256,
                 **kwargs):
        super().__init__(spec, **kwargs)
        self.dst_nbins = (default_dst_nbins(self.spec) if dst_nbins is None else
                          check_dst_nbins(type(self).__name__, dst_nbins))
        # (True is no count of bins; numpy's integers are)
        self.polish = check_int(type(self).__name__, "polish", polish, 0)

    def _estimate(self, hist):
        return l2_polished_range(hist, self.spec, self.dst_nbins, self.polish, self._bounds(),
                                 self.global_amax())

    def _bounds(self):
        if self.grid == "first":  # torch.ao does not clip (its range ends at the data anyway)
            inf = torch.full_like(self.min_vals, float("inf"))
            return -inf, inf
        return super()._bounds()

    def _clip(self, lo, hi):
        # copies: ordinary tensors out of the inference-mode estimate (see _estimated)
        return (lo.clone(), hi.clone()) if self.grid == "first" else super()._clip(lo, hi)


@register("mix")
class MixObserver(HistogramObserverBase):
    """Per unit, the best of percentiles 99.9 .. 99.9999, min / max, histogram MSE and
    entropy by quantization error on the histogram (Horizon's MixObserver, extended)."""

    scales_subnormal = True

    def __init__(self, spec=None, *, percentiles=MIX_PERCENTILES, candidates=MIX_CANDIDATES,
                 convention: str = "center", start_bin: int = 128, **kwargs):
        super().__init__(spec, **kwargs)
        who = type(self).__name__
        self.candidates, self.percentiles = check_mix_options(
            who, candidates=candidates, percentiles=percentiles, convention=convention)
        self.convention = convention
        self.start_bin = check_int(who, "start_bin", start_bin, 0)
        if "entropy" in self.candidates:  # its search needs a candidate (as EntropyObserver)
            check_entropy_options(who, start_bin=self.start_bin, bins=self.bins)

    def _estimate(self, hist):
        # the interval's in the EMA mode
        lo, hi, amax = self._estimate_units(*self._data_range(), self.global_amax())
        return mix_range(hist, self.spec, lo=lo, hi=hi,
                         percentiles=self.percentiles, candidates=self.candidates,
                         convention=self.convention, start_bin=self.start_bin, global_amax=amax)
