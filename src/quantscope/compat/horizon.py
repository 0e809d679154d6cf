"""Horizon plugin (observer_v2) observers, with their names, keyword signatures and qparams.

Horizon is symmetric only: ``scale = max(-lo, hi) / ((quant_max - quant_min) / 2)``
(torch.ao's symmetric rule; qint8 divides by 127.5), zero point 0.
``qscheme`` decides the granularity: ``per_tensor_symmetric`` with a negative ``ch_axis``,
``per_channel_symmetric`` with a non-negative one (other pairs raise
:class:`HorizonArgumentError`, as Horizon asserts; Percentile, KL and Mix take
``per_tensor_symmetric`` only). Percentile, MSE and Mix average each batch's signed ends
(``max(min, -clip)``, ``min(max, clip)``), KL ``(-amax, amax)``.
``is_sync_quantize`` is Horizon's sync at read time: ``forward`` stays local (each rank
averages its own batches), and ``calculate_qparams()``, inside an initialised process group
(``sync_group``, default the default group), all-reduces the averaged ends in place (the
min with MIN, the max with MAX) and computes the qparams from them: every call of it is a
collective, and the merged ends are what later batches average into. As Horizon's, a read
takes the ends of the finished intervals (KL's ``update_interval``: the batches of an
unfinished one wait, but quantscope's ``sync_observers`` folds them into the rank's average
first, unless the observer is step-synced: docs/guide/distributed.md), and before there
are any (no data, or no KL interval finished) returns the default ``(1.0, 0)`` with a
warning; such a rank takes no part in the all-reduce, so the other ranks wait for it in
theirs: read once every rank has ends.
``calculate_qparams()`` returns ``(scale, zero_point)``: float32 scale and int64 zero point
of shape ``(1,)`` per tensor, ``(C,)`` per channel. Ends a clip crossed (a constant or narrow
one-signed batch: ``max(min, -clip) > min(max, clip)``) stay as Horizon's, and the scale is
Horizon's ``max(-min_val, max_val)`` clamped at 0 (``calculate_range`` orders them).
``with_args`` is Horizon's (torch.ao's partial constructor); ``min_val`` / ``max_val`` / ``eps``
read as Horizon's; ``state_dict`` keeps quantscope's keys (the whole state), and a Horizon
state ``{min_val, max_val, eps}`` loads (its ends; ``eps`` is float32's here).
A KL interval whose later batches exceed its first batch's ``[0, max |x|]`` grid appends
bins of the same width, as Horizon (the histogram holds more than ``bins`` until the
interval ends, at most ``KLObserver.GROW_LIMIT x bins``: the search costs the square of the
bins).
Known differences: a KL interval that would grow past that bound is re-binned once,
approximately, onto quantscope's power-of-two grid instead (Horizon appends on); MSE with
``stride > 1`` uses the factor ``1 - 0.01 * i * stride`` of the candidate it prices (Horizon's
default path multiplies the candidate's position in the strided list by 0.01, its parallel
path by the right factor); Mix ranks its percentile candidates by the error on its
histogram (Horizon: the exact L2 error on the batch). Data that is all subnormal (the first
grid's float32 width ``max |x| / bins`` underflows) is estimated on the histogram scaled by a
power of two, the range scaled back (:mod:`quantscope.observers.histogram_estimate`;
Horizon's width reads 0 there: its percentile clips to 0, its KL reads linspace's edges).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from .._plainchecks import as_bool
from ..comm import all_reduce, is_distributed
from ..estimators.entropy import horizon_entropy_amax
from ..estimators.mse import SearchResult
from ..formats import as_int
from ..layout import Channel, Tensor
from ..observers import record
from ..observers.histogram import EntropyObserver, HistogramObserverBase
from ..observers.histogram import MixObserver as _NativeMix
from ..observers.histogram import PercentileObserver as _NativePercentile
from ..observers.minmax import MovingAverageMinMaxObserver as _NativeEMA
from ..observers.mse import LinearMSEObserver as _NativeLinearMSE
from ..observers.registry import register
from ..qparams import amax_of_range
from ..spec import QuantSpec
from .torch_ao import with_args

__all__ = [
    "AppendingFirstGrid",
    "HorizonArgumentError",
    "HorizonObserver",
    "KLObserver",
    "MSEObserver",
    "MinMaxObserver",
    "MixObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PercentileObserver",
    "horizon_spec",
]

_FORMATS = {"qint8": "int8", "qint16": "int16", "qint4": "int4", "qint32": None}
#: the state_dict keys Horizon's observers save (its ``eps``: float32's, as here)
_HORIZON_KEYS = ("min_val", "max_val", "eps")
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


class HorizonArgumentError(ValueError, AssertionError):
    """An argument Horizon's observers assert against: an ``AssertionError`` as Horizon's, and
    a ``ValueError`` as quantscope's bad-argument errors."""


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype).lower()


def horizon_spec(dtype="qint8", qscheme=torch.per_tensor_symmetric, ch_axis=-1, quant_min=None,
                 quant_max=None) -> QuantSpec:
    """The :class:`QuantSpec` of Horizon observer keywords (the one translation)."""
    name = _dtype_name(dtype)
    if _FORMATS.get(name) is None:
        supported = [k for k, v in _FORMATS.items() if v]
        raise ValueError(f"horizon: dtype must be one of {supported}, got {dtype!r}")
    if qscheme not in _SYMMETRIC:
        raise HorizonArgumentError(f"horizon: observers are symmetric only; qscheme must be "
                                   f"one of {list(_SYMMETRIC)}, got {qscheme!r}")
    if (quant_min is None) != (quant_max is None):
        raise ValueError(f"horizon: give both quant_min and quant_max, got {quant_min!r} and "
                         f"{quant_max!r}")
    per_channel = qscheme == torch.per_channel_symmetric
    axis = _axis(ch_axis)
    if per_channel != (axis >= 0):  # Horizon's ObserverBase asserts the pair
        want = "non-negative" if per_channel else "negative"
        raise HorizonArgumentError(f"horizon: ch_axis should be {want} with qscheme={qscheme}, "
                                   f"got ch_axis={ch_axis!r}")
    layout = Channel(axis) if per_channel else Tensor()
    return QuantSpec(_FORMATS[name], layout, symmetric=True, quant_min=quant_min,
                     quant_max=quant_max)


def _axis(ch_axis) -> int:
    """``ch_axis`` as an int (None: -1, per tensor); a string or list is refused here, not
    in a bare comparison."""
    axis = -1 if ch_axis is None else as_int(ch_axis)
    if axis is None:
        raise HorizonArgumentError(f"horizon: ch_axis must be an integer (or None), got "
                                   f"{ch_axis!r}")
    return axis


class HorizonObserver:
    """Mixin (put it before the native class): Horizon keywords in, Horizon qparams out.

    Keywords it does not know go to the native observer's constructor.
    """

    @property
    def end_names(self) -> tuple[str, str]:
        """The buffers holding the averaged ends (Horizon's ``min_val`` / ``max_val``): the
        histogram classes average their estimates (``ema_lo`` / ``ema_hi``), the others the
        batches' min / max."""
        if isinstance(self, HistogramObserverBase):
            return ("ema_lo", "ema_hi")
        return ("min_vals", "max_vals")

    def __init__(self, *, ch_axis=-1, dtype="qint8", qscheme=torch.per_tensor_symmetric,
                 quant_min=None, quant_max=None, is_sync_quantize=False, factory_kwargs=None,
                 **native):
        if "spec" in native:  # else "got multiple values for argument 'spec'"
            raise TypeError(f"horizon {type(self).__name__}: takes Horizon's keywords (dtype, "
                            f"qscheme, ch_axis, quant_min, quant_max), not a quantscope spec")
        spec = horizon_spec(dtype, qscheme, ch_axis, quant_min, quant_max)
        if "averaging_constant" in native and native["averaging_constant"] is None:
            # Horizon always averages (the native histogram classes take None as "do not")
            raise HorizonArgumentError(f"horizon {type(self).__name__}: averaging_constant "
                                       f"must be a number in (0, 1], got None")
        # Horizon's histogram classes (KL, Percentile, Mix) assert per_tensor_symmetric
        if isinstance(self, HistogramObserverBase) and qscheme != torch.per_tensor_symmetric:
            raise HorizonArgumentError(f"horizon {type(self).__name__}: only "
                                       f"per_tensor_symmetric qscheme is supported (Horizon "
                                       f"asserts it), got {qscheme!r}")
        super().__init__(spec, **native)
        self.ch_axis, self.dtype, self.qscheme = ch_axis, dtype, qscheme
        self.quant_min, self.quant_max = int(spec.qmin), int(spec.qmax)
        if as_bool(is_sync_quantize) is None and as_int(is_sync_quantize) not in (0, 1):
            raise ValueError(f"horizon {type(self).__name__}: is_sync_quantize must be True / "
                             f"False (or 1 / 0), got {is_sync_quantize!r}")  # bool("no") is True
        self.is_sync_quantize = bool(is_sync_quantize)
        device = (factory_kwargs or {}).get("device")
        if device is not None:
            self.to(device)

    with_args = classmethod(with_args)  # Horizon's is torch.ao's _with_args

    @property
    def min_val(self) -> torch.Tensor:
        """Horizon's ``min_val``: the averaged min (empty before the first finished interval;
        above ``max_val`` where a clip inside one-signed data crossed the ends)."""
        return self._ends()[0]

    @property
    def max_val(self) -> torch.Tensor:
        """Horizon's ``max_val``: the averaged max."""
        return self._ends()[1]

    @property
    def eps(self) -> torch.Tensor:
        """Horizon's ``eps`` buffer: float32's eps, the least scale."""
        return torch.tensor([torch.finfo(torch.float32).eps], device=self.min_val.device)

    def _ends(self):
        return tuple(getattr(self, n) for n in self.end_names)

    def calculate_qparams(self):
        """Horizon's: the qparams of the averaged ends, all-reduced in place first under
        ``is_sync_quantize``; before there are ends (no data, or no KL interval finished) its
        default ``(1.0, 0)`` with a warning (without joining the all-reduce, as Horizon)."""
        lo, hi = self._ends()
        if not lo.numel() and not bool(self.seen_non_finite):  # (NaN / inf: the clear error)
            warnings.warn(f"horizon {type(self).__name__}: no averaged min / max yet (no "
                          f"data, or no update_interval finished); returning the default "
                          f"scale 1.0 and zero point 0", stacklevel=2)
            return (torch.ones(1, device=lo.device),
                    torch.zeros(1, dtype=torch.int64, device=lo.device))
        if self.is_sync_quantize and is_distributed(self.sync_group):
            all_reduce(lo, dist.ReduceOp.MIN, self.sync_group)
            all_reduce(hi, dist.ReduceOp.MAX, self.sync_group)
        qp = self.qparams()
        return qp.scale.reshape(-1), qp.zero_point.reshape(-1).to(torch.int64)

    def calculate_range(self):
        """The averaged ends of the finished intervals, as Horizon's ``min_val`` / ``max_val``
        (the batches of an unfinished KL interval wait for it to finish)."""
        lo, hi = self._ends()
        if not lo.numel():  # the native error, or an unfinished first interval's estimate
            lo, hi = super().calculate_range()
        else:  # NaN / inf seen: quantscope's clear error, not a NaN scale (the count's
            self.check_ready(warn=False)  # warning: once, by the qparams read)
        # ordered for qparams_from_range, with Horizon's max(-lo, hi) clamped at 0: ends a
        # clip crossed (a constant batch: max(min, -clip) > min(max, clip)) meet at the one
        # nearer 0, the one Horizon scales; ordered ends stay as they are
        return torch.minimum(lo, hi.clamp(min=0)), torch.maximum(hi, lo.clamp(max=0))

    def reset_min_max_vals(self) -> None:
        self.reset()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "min_val" in state_dict and prefix + self.end_names[0] not in state_dict:
            state_dict = self._from_horizon_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _from_horizon_state(self, state_dict, prefix):
        """A state Horizon saved (``min_val``, ``max_val``, ``eps``) as this class's: a new
        observer's state with those averaged ends. Horizon keeps no shape nor token count:
        the ends' units stand for the shape (``C`` along ``ch_axis``), one token."""
        horizon = {k: state_dict.get(prefix + k) for k in _HORIZON_KEYS}
        theirs = {prefix + k for k in _HORIZON_KEYS}
        rest = {k: v for k, v in state_dict.items() if k not in theirs}
        if horizon["max_val"] is None:  # not Horizon's either: the strict load names the keys
            return state_dict
        lo, hi = (horizon[k].detach().to(torch.float32).reshape(-1) for k in _HORIZON_KEYS[:2])
        bad = 0 if lo.is_meta else int((~lo.isfinite()).sum() + (~hi.isfinite()).sum())
        if bad:  # else qparams() fails later naming neither the observer nor the state
            raise ValueError(f"{self.describe()}: cannot load Horizon's min_val / max_val: "
                             f"they must be finite (or empty: no data yet), got {bad} NaN / "
                             f"inf values")
        self.reset()
        own = {}
        self._save_to_state_dict(own, prefix, keep_vars=False)
        if lo.numel():
            ends = dict(zip(self.end_names, (lo, hi)))
            if isinstance(self, HistogramObserverBase):  # as after an interval's end, the
                # ends standing for the data's range
                ends.update(min_vals=torch.minimum(lo, hi), max_vals=torch.maximum(lo, hi),
                            linear_grid=torch.tensor(self.grid == "first"))
            axis = self.ch_axis if self.qscheme == torch.per_channel_symmetric else 0
            shape = [1] * axis + [lo.numel()]
            ends.update(observed_tokens=torch.tensor(1), observed_shape=torch.tensor(shape))
            own.update({prefix + k: v for k, v in ends.items()})
        return {**rest, **own}


@register("horizon:MinMaxObserver")
class MinMaxObserver(HorizonObserver, _NativeEMA):
    """Horizon's MinMaxObserver: an EMA (c = 0.01) of the min / max, per tensor or per channel."""

    def __init__(self, averaging_constant=0.01, ch_axis=-1, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, averaging_constant=averaging_constant,
                         **kwargs)


@register("horizon:MovingAverageMinMaxObserver")
class MovingAverageMinMaxObserver(HorizonObserver, _NativeEMA):
    """Horizon's per-tensor EMA min / max observer (``ch_axis``: a negative one only)."""

    def __init__(self, averaging_constant=0.01, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, *, ch_axis=-1,
                 **kwargs):
        if _axis(ch_axis) >= 0:
            raise HorizonArgumentError(f"horizon MovingAverageMinMaxObserver: per tensor only, "
                                       f"ch_axis must be negative, got ch_axis={ch_axis!r}; "
                                       f"use MovingAveragePerChannelMinMaxObserver per channel")
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, averaging_constant=averaging_constant,
                         **kwargs)


@register("horizon:MovingAveragePerChannelMinMaxObserver")
class MovingAveragePerChannelMinMaxObserver(HorizonObserver, _NativeEMA):
    """Horizon's per-channel EMA min / max observer (``ch_axis`` 0 by default)."""

    def __init__(self, averaging_constant=0.01, ch_axis=0, dtype="qint8",
                 qscheme=torch.per_channel_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, averaging_constant=averaging_constant,
                         **kwargs)


# ----------------------------------------------------------------------------- histograms
class AppendingFirstGrid:
    """Mixin (before the native histogram class, ``grid="first"``, an ``|x|`` histogram): a
    batch past the first batch's ``[0, max |x|]`` grid appends zero bins of its width, as
    Horizon's KL histogram and ModelOpt's ``HistogramCalibrator`` grow, up to the class's
    ``GROW_LIMIT x bins`` (and ``max_hist_bytes``); past that, a first top of 0 or non-finite
    data, the counts move once to the native grid, approximately."""

    def _first_width(self):  # in float64, as a Python histc(x, nb, 0, nb * w) reference
        return self.hist_hi.double() / self.bins

    def _linear_top(self):  # float32, as histc's max
        nb = self.hist_counts.shape[-1]
        return self.hist_hi if nb == self.bins else (self._first_width() * nb).float()

    #: the bins a batch past the top appends at least (hi is past the float32 top: one)
    MIN_APPEND = 1

    def _bins_needed(self, hi) -> torch.Tensor:
        # the grid's bins to hold hi: ceil(hi / w) in float64 (ModelOpt's class: float32)
        return torch.ceil(hi.double() / self._first_width()).max()

    def _append_bins(self, hi) -> bool:
        # zero bins of the first width until the grid holds hi; False (the re-bin): a first
        # top of 0, non-finite data, or past the bound
        return self._pad_to(float(self._bins_needed(hi)), hi.numel())  # (one host read)

    def _fits(self, need: float, units: int) -> bool:
        """Whether the grid may grow to ``need`` bins: finite, within ``GROW_LIMIT x bins``
        and ``max_hist_bytes`` for ``units`` units."""
        limit = min(self.GROW_LIMIT * self.bins, self.max_hist_bytes // (8 * units))
        return math.isfinite(need) and int(need) <= limit

    def _pad_to(self, need: float, units: int) -> bool:
        """Zero bins appended until the grid has ``need`` (at least ``MIN_APPEND`` more);
        False, nothing done, where ``need`` is not finite or past the bound (:meth:`_fits`)."""
        if not self._fits(need, units):
            return False
        counts = self._buffers["hist_counts"]
        old = counts.shape[1]
        pad = max(int(need), old + self.MIN_APPEND) - old
        if pad:  # (F.pad's op: zeros past the end)
            self._store(("hist_counts",), (torch.constant_pad_nd(counts, (0, pad)),))
        return True

    def _grown_to(self, nb: int, amax: torch.Tensor) -> bool:
        """Whether data of ``amax`` (per unit) grew this grid to ``nb`` bins (its last growth
        may append ``MIN_APPEND`` more than it needs)."""
        need = float(self._bins_needed(amax))
        return bool((amax > self.hist_hi).all()) and need <= nb <= need + self.MIN_APPEND

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        nb = self.hist_counts.shape[-1]
        # more than bins: a grown first grid, as many bins of width hist_hi / bins as its data
        # needs (else a state of other bins, whose grid would be misread at this width)
        if nb > self.bins and not self.hist_hi.is_meta and not (self._linear and self._grown_to(
                nb, amax_of_range(*self._data_range()))):
            self.reset()
            raise ValueError(f"{record.at(self.describe(), prefix)}: cannot load a histogram "
                             f"of {nb} bins into one of bins={self.bins}; construct the "
                             f"observer with the bins it was saved with (bins={nb}, or fewer "
                             f"where its grid grew past its first batch's top)")


@register("horizon:KLObserver")
class KLObserver(HorizonObserver, AppendingFirstGrid, EntropyObserver):
    """Horizon's KLObserver: a ``bins``-bin ``|x|`` histogram accumulated over
    ``update_interval`` batches, KL threshold (start bin 128, divergences smoothed over 9
    candidates), then an EMA of the thresholds; the interval's histogram grows as Horizon's
    (:class:`AppendingFirstGrid`)."""

    GROW_LIMIT = 16  # the KL search costs the square of the bins

    def __init__(self, bins=512, update_interval=1, averaging_constant=0.01, ch_axis=-1,
                 dtype="qint8", qscheme=torch.per_tensor_symmetric, quant_min=None,
                 quant_max=None, is_sync_quantize=False, factory_kwargs=None, **kwargs):
        if not isinstance(bins, int) or bins < 256:  # Horizon asserts bins >= 256
            raise HorizonArgumentError(f"horizon KLObserver: bins must be an integer >= 256 "
                                       f"(Horizon's minimum; the search starts at start_bin "
                                       f"128), got {bins!r}")
        kwargs.setdefault("smooth", 9)
        kwargs.setdefault("grid", "first")  # Horizon's [0, max |x|] grid of the first batch
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, bins=bins,
                         update_interval=update_interval,
                         averaging_constant=averaging_constant, **kwargs)
        if self.start_bin < 1:  # refused now, not at the first estimate (horizon_entropy_amax)
            raise HorizonArgumentError("horizon KLObserver: start_bin must be >= 1 (threshold 0 "
                                       "holds no bin), got 0")

    def _estimate(self, hist):
        amax = horizon_entropy_amax(hist, num_bits=self.num_bits, start_bin=self.start_bin,
                                    stride=self.stride, smooth=self.smooth)
        return -amax, amax


class _SignedEnds:
    """Mixin (before the native histogram class): Horizon clips each batch's signed min / max
    at the estimate, ``(max(min, -clip), min(max, clip))``, and averages those ends (the
    interval's min / max: the native EMA mode's window)."""

    signed_ends = True

    def _clip(self, lo, hi):
        # each end on its own side, as Horizon: the native clip's reordering would move ends
        # that cross (a clip inside one-signed data) off Horizon's (calculate_range orders)
        blo, bhi = self._bounds()  # +-max |x|
        wlo, whi = self._data_range()
        return lo.clamp(blo, bhi).maximum(wlo), hi.clamp(blo, bhi).minimum(whi)


@register("horizon:PercentileObserver")
class PercentileObserver(HorizonObserver, _SignedEnds, _NativePercentile):
    """Horizon's PercentileObserver: each batch's ``|x|`` histogram (``bins`` over
    ``[0, max |x|]``, width ``w``), the centre ``(i + 0.5) w`` of the first bin where the
    cumulative share reaches ``percentile``, then an EMA of the signed ends it clips."""

    def __init__(self, percentile=99.99, bins=2048, averaging_constant=0.01, ch_axis=-1,
                 dtype="qint8", qscheme=torch.per_tensor_symmetric, quant_min=None,
                 quant_max=None, is_sync_quantize=False, factory_kwargs=None, **kwargs):
        kwargs.setdefault("convention", "center")
        kwargs.setdefault("grid", "first")  # each batch's own [0, max |x|] grid, as Horizon
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, percentile=percentile, bins=bins,
                         averaging_constant=averaging_constant, **kwargs)


@register("horizon:MixObserver")
class MixObserver(HorizonObserver, _SignedEnds, _NativeMix):
    """Horizon's MixObserver: per batch, the percentile among 99.9 .. 99.9999 with the least
    quantization error, then an EMA of the signed ends it clips (``candidates`` adds
    quantscope's others; ``bins``, keyword only, the histogram's: Horizon's 2048)."""

    def __init__(self, averaging_constant=0.01, ch_axis=-1, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, *, bins=2048, **kwargs):
        kwargs.setdefault("candidates", ("percentile",))
        kwargs.setdefault("grid", "first")  # each batch's own [0, max |x|] grid, as Horizon
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, bins=bins,
                         averaging_constant=averaging_constant, **kwargs)


@register("horizon:MSEObserver")
class MSEObserver(HorizonObserver, _NativeLinearMSE):
    """Horizon's MSEObserver: candidates ``amax * (1 - 0.01 i)``, i in range(0, 95, stride),
    L2 error, the last minimum, then an EMA (c = 0.01) of the batch's signed ends times the
    chosen factor (``min * f``, ``max * f``). Its errors square in float32, as Horizon's
    ``torch.linalg.norm`` of the float32 error does (on tiny values, ``|d|`` below ~3e-23,
    the squares vanish, candidates tie at 0 and the last, 0.06x, wins, as in Horizon)."""

    float32_squares = True

    def __init__(self, stride=1, averaging_constant=0.01, ch_axis=-1, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, stride=stride,
                         averaging_constant=averaging_constant, **kwargs)

    def _search(self, units, lo, hi):
        res = super()._search(units, lo, hi)
        if res.index is None:
            return res
        # Horizon scales the signed ends by the chosen factor: best_min = min * (1 - 0.01 i);
        # index -1: the search kept the min-max incumbent (every candidate priced inf), f = 1
        f = 1.0 - res.index.clamp(min=0).float() * (0.01 * self.stride)  # float32 always
        return SearchResult(lo * f, hi * f, index=res.index)
