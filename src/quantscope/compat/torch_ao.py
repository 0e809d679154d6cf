"""torch.ao.quantization's observers, exactly: its classes, with quantscope's fast histogram.

Each class here *is* a torch.ao observer: a subclass of torch's own class, so every
behaviour torch.ao has comes with it unchanged (arguments and their checks, ``dtype``
from ``quint8`` to ``qint32`` / ``int32`` / ``int16`` / ``uint16``, ``reduce_range``,
``per_channel_affine_float_qparams``, ``is_dynamic``, the no-data default of scale 1.0
and zero point 0 with a warning, buffers updated in place, the ``state_dict`` keys
``eps`` / ``min_val`` / ``max_val`` (+ ``histogram``), so a state saved by either loads
into the other, and ``torch.jit.script``). What quantscope adds:

* the registry names (``get_observer("torch.ao:HistogramObserver")``) and :attr:`spec`,
  the :class:`QuantSpec` the arguments mean;
* clearer messages for the arguments torch refuses, in torch's order and with its
  exception types (a wrong ``dtype`` is :class:`UnsupportedDtypeError`, torch's
  ``AssertionError`` and a ``ValueError``);
* in :class:`HistogramObserver`, torch.ao's two slow steps replaced by quantscope's,
  bitwise equal: ``forward`` runs :mod:`quantscope.stats.ao_histogram` (one C pass per
  batch, in place on the buffers), and the non-linear search runs
  :func:`quantscope.estimators.l2.l2_range` (vectorized, where torch loops in Python;
  a state of another dtype, after ``.double()``, ``.half()`` or ``.bfloat16()``, runs
  torch.ao's own loop, at its speed).

The min-max classes keep torch's code as it is: one ``aminmax`` per batch is the floor,
and torch's TorchScript-able code is what ``torch.jit.script`` needs.

TorchScript: a scripted :class:`HistogramObserver` reaches quantscope's steps through two
``torch.library`` custom ops (``quantscope::ao_histogram_observe``,
``quantscope::ao_histogram_search``), which TorchScript calls as it calls any op, so a
scripted observer saved with ``torch.jit.save`` needs ``import quantscope.compat.torch_ao``
before ``torch.jit.load``. Outside TorchScript ``forward`` calls the same functions directly.

Non-finite input as torch.ao: the min-max classes record it (their :meth:`qparams` then
raises ``ValueError``); :class:`HistogramObserver` drops ``inf`` with a warning. A batch it
refuses leaves its state as it was, with a ``ValueError`` that is a ``RuntimeError`` as
torch.ao's: NaN (:class:`NonFiniteBatchError`; torch.ao's ``histc`` raises after writing NaN
into its state), no bins (:class:`NoBinsError`), a range rounding to ``inf`` in the state's
dtype (:class:`StateOverflowError`: float64 past float32, 65520 in ``.half()``; torch.ao
raises its overflow ``RuntimeError`` or stores ``inf``, a NaN scale later; one rounding to
max is stored as max, as torch.ao's). Scripted, these reach the caller as TorchScript's plain
``RuntimeError`` (no ``ValueError``), as torch.ao's do. The C path hands such a batch to the
tensor path. Known differences of :class:`HistogramObserver` beyond these: ``bins`` set
after construction takes effect before the first batch, eager or scripted, as torch.ao's
(after it, torch.ao's raises on the size mismatch, quantscope's keeps its bins); a zero
``min_val`` / ``max_val`` may differ from torch.ao's in its sign (equal qparams).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import ClassVar

import torch
from torch.ao.quantization import observer as _ao
from torch.ao.quantization.utils import calculate_qmin_qmax

from .._oplib import never_traced
from ..comm import MAX, MIN
from ..layout import Channel, Tensor
from ..observers.base import dtensor_error, is_dtensor
from ..observers.registry import register
from ..observers.sync import sync_observers
from ..qparams import QParams
from ..spec import QuantSpec
from .torch_ao_steps import (
    NoBinsError,
    NonFiniteBatchError,
    StateOverflowError,
    binned,
    eager_search,
    observe_fast,
    observe_tensors,
)

__all__ = [
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "NoBinsError",
    "NonFiniteBatchError",
    "PerChannelMinMaxObserver",
    "StateOverflowError",
    "TorchAOObserver",
    "UnsupportedDtypeError",
    "torch_ao_spec",
]

EPS = torch.finfo(torch.float32).eps
#: the torch dtypes quantscope has a format for (its integer formats stop at 16 bits)
_FORMATS = {torch.qint8: "int8", torch.quint8: "uint8", torch.int8: "int8", torch.uint8: "uint8",
            torch.quint4x2: "uint4", torch.int16: "int16", torch.uint16: "uint16"}
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
_PER_CHANNEL = (torch.per_channel_symmetric, torch.per_channel_affine,
                torch.per_channel_affine_float_qparams)


def torch_ao_spec(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                  quant_min=None, quant_max=None, eps=EPS, ch_axis=0) -> QuantSpec:
    """The :class:`QuantSpec` of torch.ao observer arguments, with torch.ao's own code range
    (``calculate_qmin_qmax``: ``reduce_range`` drops a bit of the 8-bit defaults and halves
    a custom range; int16 / uint16 keep theirs). 32-bit and float8 dtypes have no quantscope
    format: ``ValueError``."""
    custom = quant_min is not None and quant_max is not None
    qmin, qmax = calculate_qmin_qmax(quant_min, quant_max, custom, dtype, reduce_range)
    return _spec(dtype, qscheme, qmin, qmax, eps, ch_axis)


def _spec(dtype, qscheme, qmin, qmax, eps, ch_axis) -> QuantSpec:
    """The :class:`QuantSpec` of a torch.ao observer's final code range ``[qmin, qmax]``."""
    if dtype not in _FORMATS:
        raise ValueError(f"torch_ao_spec: dtype must be one of {list(_FORMATS)} (quantscope's "
                         f"integer formats stop at 16 bits), got {dtype!r}")
    if qscheme not in (torch.per_tensor_affine, *_SYMMETRIC, *_PER_CHANNEL):  # a typo too
        raise ValueError(f"torch_ao_spec: qscheme must be a torch.qscheme (torch.per_tensor_"
                         f"affine, torch.per_channel_symmetric, ...), got {qscheme!r}")
    layout = Channel(ch_axis) if qscheme in _PER_CHANNEL else Tensor()
    return QuantSpec(_FORMATS[dtype], layout, symmetric=qscheme in _SYMMETRIC, eps=float(eps),
                     quant_min=int(qmin), quant_max=int(qmax))


#: torch.ao's ``_ALLOWED_DTYPES`` (UniformQuantizationObserverBase)
_ALLOWED_DTYPES = (torch.qint8, torch.quint8, torch.quint4x2, torch.qint32, torch.int8,
                   torch.uint8, torch.int16, torch.int32, torch.float8_e5m2,
                   torch.float8_e4m3fn, torch.uint16)


class UnsupportedDtypeError(ValueError, AssertionError):
    """A ``dtype`` torch.ao's observers refuse: an ``AssertionError`` as torch.ao's, and a
    ``ValueError`` as quantscope's bad-argument errors."""


def _check_qscheme(cls, qscheme) -> None:
    """A clear error for a qscheme of the other class family (torch's terse
    ``NotImplementedError``, the same case and type: torch.ao checks it first too)."""
    name = cls.__name__
    per_channel = qscheme in _PER_CHANNEL
    if cls.per_channel is False and per_channel:
        use = f"; use {cls.per_channel_class}" if cls.per_channel_class else ""
        raise NotImplementedError(f"{name}: qscheme must be per_tensor_symmetric or "
                                  f"per_tensor_affine, got {qscheme}{use}")
    if cls.per_channel and not per_channel:
        raise NotImplementedError(f"{name}: needs a per-channel qscheme, got {qscheme}")


class _Constructor(_ao._PartialWrapper):
    """torch.ao's partial constructor (what ``with_args`` returns), keeping the class's
    ``__name__`` (torchao's pt2e reads it to decide whether to pass ``ch_axis``)."""

    @property
    def __name__(self) -> str:
        return self.p.func.__name__

    def with_args(self, **kwargs) -> _Constructor:
        # nested as torch.ao's (its qconfig_equals compares the outer keywords only)
        return _Constructor(functools.partial(self, **kwargs))

    def with_callable_args(self, **kwargs) -> _Constructor:
        out = _Constructor(self.p)
        out.callable_args = {**self.callable_args, **kwargs}
        return out


def with_args(cls, **kwargs) -> _Constructor:
    """A constructor of ``cls`` with ``kwargs`` bound, as torch.ao's ``with_args`` (the
    classmethod of this module's observers, and of Horizon's, which take torch.ao's)."""
    return _Constructor(functools.partial(cls, **kwargs))


class _ScriptName:
    """The TorchScript name of this module's classes: ``__torch__.quantscope.compat.torch_ao.
    quantization.observer.<Class>``. torch.ao finds observers inside a scripted model by the
    words ``quantization.observer`` in their type's name (``prepare_jit``'s
    ``load_observer_state_dict``, ``_is_activation_post_process``); a subclass defined
    elsewhere gets its own name (AttributeError: TorchScript's default)."""

    def __get__(self, obj, owner):
        if owner.__module__ != __name__:
            raise AttributeError("_jit_override_qualname")
        return f"__torch__.{__name__}.quantization.observer.{owner.__name__}"


class TorchAOObserver:
    """Mixin (before the torch.ao class): the argument checks' clear errors, the registry's
    :attr:`spec` and :attr:`has_observed`. TorchScript skips the properties."""

    __jit_unused_properties__: ClassVar[list[str]] = ["spec", "has_observed"]
    _jit_override_qualname = _ScriptName()

    #: True: per-channel qschemes only; False: per-tensor only (torch.ao splits its classes so)
    per_channel: bool | None = None
    #: the torch.ao class to use instead when a per-tensor class is given a per-channel qscheme
    per_channel_class: str | None = None

    def __init__(self, *args, **kwargs):
        torch_class = next(c for c in type(self).__mro__ if c.__module__ == _ao.__name__)
        bound = inspect.signature(torch_class.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        _check_qscheme(type(self), bound.arguments["qscheme"])
        dtype = bound.arguments["dtype"]
        try:  # torch.ao's own order of checks: is_dynamic (NotImplementedError), then dtype
            super().__init__(*args, **kwargs)
        except AssertionError as e:
            if dtype in _ALLOWED_DTYPES:
                raise
            raise UnsupportedDtypeError(f"{type(self).__name__}: dtype must be one of "
                                        f"{list(_ALLOWED_DTYPES)}, got {dtype!r}") from e

    with_args = classmethod(with_args)

    @classmethod
    def with_callable_args(cls, **kwargs) -> _Constructor:
        """As torch.ao's: each value is called at construction time."""
        return _Constructor(functools.partial(cls)).with_callable_args(**kwargs)

    def reset(self) -> None:
        """Back to the state of a new observer, in place (quantscope's name; torch.ao's
        ``reset_min_max_vals`` where torch has one)."""
        for name, start in (("min_val", math.inf), ("max_val", -math.inf)):
            buf = getattr(self, name)
            if buf.dim() == 0:  # per tensor: +-inf; per channel: empty, as torch.ao starts
                buf.fill_(start)
            else:
                buf.resize_(0)
        if "histogram" in self._buffers:
            self.histogram.zero_()

    @property
    def spec(self) -> QuantSpec:
        """The :class:`QuantSpec` these arguments mean (:func:`torch_ao_spec`), on the code
        range torch.ao settled on (``quant_min`` / ``quant_max``)."""
        return _spec(self.dtype, self.qscheme, self.quant_min, self.quant_max, float(self.eps),
                     getattr(self, "ch_axis", 0))

    def qparams(self) -> QParams:
        """torch.ao's ``calculate_qparams()`` as quantscope's :class:`QParams` (one value per
        unit, for :func:`quantscope.fake_quantize` with :attr:`spec`): ``ValueError`` before
        any data, for a NaN / inf range and for a range whose scale overflows float32
        (torch.ao returns its defaults, NaN or inf there)."""
        who = type(self).__name__
        if not self.has_observed:
            raise ValueError(f"{who}: qparams() called before any tensor was observed")
        if not bool(torch.isfinite(self.min_val).all() & torch.isfinite(self.max_val).all()):
            raise ValueError(f"{who}: observed NaN or inf (min_val {self.min_val.tolist()}, "
                             f"max_val {self.max_val.tolist()})")
        if self.qscheme == torch.per_channel_affine_float_qparams:
            raise NotImplementedError(f"{who}: per_channel_affine_float_qparams has float zero "
                                      f"points; use calculate_qparams()")
        _ = self.spec  # ValueError for the dtypes quantscope has no format for
        scale, zero_point = self.calculate_qparams()
        if not bool(torch.isfinite(scale).all()):  # a range wider than float32's max
            raise ValueError(f"{who}: the observed range (min_val {self.min_val.tolist()}, "
                             f"max_val {self.max_val.tolist()}) gives a scale float32 cannot "
                             f"hold ({scale.reshape(-1).tolist()[:4]})")
        return QParams(scale.reshape(-1).float(), zero_point.reshape(-1).to(torch.int32))

    @property
    def has_observed(self) -> bool:
        """Whether a batch has been observed since construction or the last reset (one of
        only +inf leaves ``min_val`` at its start, not ``max_val``)."""
        lo, hi = self.min_val, self.max_val
        return lo.numel() > 0 and bool((lo != math.inf).any() | (hi != -math.inf).any())

    #: why the class's state cannot sync exactly (None: it syncs, :class:`_SyncView`)
    sync_refusal: ClassVar[str | None] = None

    def sync(self, group=None):
        """Make ``min_val`` / ``max_val`` the same on every rank of ``group``: MIN / MAX of
        the ranks' (NaN where any rank's is), what one process that observed every rank's
        batches gets, bitwise; a no-op outside ``torch.distributed``. The moving averages
        and :class:`HistogramObserver` raise ``NotImplementedError``: nothing syncs them
        exactly. Many at once: :func:`quantscope.distributed.sync_observers`."""
        sync_observers([self], group)
        return self

    def _sync_view(self) -> _SyncView:
        """What :func:`~quantscope.observers.sync.sync_observers` syncs for this observer."""
        if self.sync_refusal is not None:
            raise NotImplementedError(f"{type(self).__name__}: the observer does not declare "
                                      f"how its state syncs across processes: "
                                      f"{self.sync_refusal}")
        return _SyncView(self)


class _SyncView:
    """A torch.ao min-max observer as :mod:`quantscope.observers.sync` reads an observer:
    ``min_val`` MIN, ``max_val`` MAX (torch.ao's buffers; NaN, which no reduction carries
    alike on every backend, goes as a per-unit flag, MAX), no counters of its own;
    :meth:`write_back` puts the synced values into the observer's buffers, in place. Every
    sync is a fresh one (MIN / MAX are idempotent: syncing again is exact)."""

    seen_non_finite = torch.tensor(False)  # inf reduces as a value, NaN as ``nan_units``
    sync_every_step, _synced = False, None

    def __init__(self, ao: TorchAOObserver):
        self.ao, lo, hi = ao, ao.min_val.detach(), ao.max_val.detach()
        self.nan_units = lo.isnan() | hi.isnan()
        self.min_val = lo.masked_fill(self.nan_units, math.inf)
        self.max_val = hi.masked_fill(self.nan_units, -math.inf)
        self.has_observed, self.shape = ao.has_observed, tuple(lo.shape)
        self.observed_tokens = torch.tensor(int(self.has_observed))
        self.non_finite_count = torch.tensor(0)
        # what every rank must agree on (sync's signature reads ``spec`` as a string)
        self.spec = (f"{type(ao).__name__}({ao.dtype}, {ao.qscheme}, {ao.quant_min}, "
                     f"{ao.quant_max}, ch_axis={getattr(ao, 'ch_axis', None)}, {lo.dtype})")

    def sync_plan(self) -> dict:
        return {"min_val": MIN, "max_val": MAX, "nan_units": MAX}

    def set_shape(self, shape) -> None:
        self.shape = shape

    def describe(self) -> str:
        return f"torch.ao:{self.spec}"

    def write_back(self) -> None:
        for name in ("min_val", "max_val"):
            buf = getattr(self.ao, name)
            v = getattr(self, name).masked_fill(self.nan_units, math.nan)
            buf.resize_(v.shape).copy_(v)  # per channel: empty before its first batch


@register("torch.ao:MinMaxObserver")
class MinMaxObserver(TorchAOObserver, _ao.MinMaxObserver):
    """Running min / max per tensor: torch.ao.quantization.MinMaxObserver."""

    per_channel, per_channel_class = False, "PerChannelMinMaxObserver"


#: an EMA's value depends on the order of the batches; the ranks' EMAs hold no more
_EMA_REFUSAL = ("torch.ao's moving average of min / max is not the average of the ranks' "
                "averages, nor any reduction of them (it weighs each batch by its position "
                "in one sequence); observe every batch on one rank, or use quantscope's "
                "'minmax' observer (sync_every_step=True syncs its average exactly)")


@register("torch.ao:MovingAverageMinMaxObserver")
class MovingAverageMinMaxObserver(TorchAOObserver, _ao.MovingAverageMinMaxObserver):
    """EMA of the per-tensor min / max (c = 0.01): torch.ao's MovingAverageMinMaxObserver."""

    per_channel, per_channel_class = False, "MovingAveragePerChannelMinMaxObserver"
    sync_refusal = _EMA_REFUSAL


@register("torch.ao:PerChannelMinMaxObserver")
class PerChannelMinMaxObserver(TorchAOObserver, _ao.PerChannelMinMaxObserver):
    """Running min / max per channel along ``ch_axis``: torch.ao's PerChannelMinMaxObserver."""

    per_channel = True


@register("torch.ao:MovingAveragePerChannelMinMaxObserver")
class MovingAveragePerChannelMinMaxObserver(TorchAOObserver,
                                            _ao.MovingAveragePerChannelMinMaxObserver):
    """EMA of the per-channel min / max: torch.ao's MovingAveragePerChannelMinMaxObserver."""

    per_channel = True
    sync_refusal = _EMA_REFUSAL


# ------------------------------------------------------------------ HistogramObserver
@register("torch.ao:HistogramObserver")
class HistogramObserver(TorchAOObserver, _ao.HistogramObserver):
    """torch.ao's HistogramObserver with quantscope's histogram step and search.

    The state is torch.ao's (``histogram``: ``bins`` float32 counts between ``min_val`` and
    ``max_val``), updated as torch.ao's ``forward`` does, including its approximate
    re-binning when a batch widens the range, but in one C pass on CPU
    (:mod:`quantscope.stats.ao_histogram`); the search is torch's, vectorized
    (:func:`quantscope.estimators.l2.l2_range`). Histogram, ``min_val`` / ``max_val``, scale
    and zero point equal torch.ao's bitwise (float32 batches on CPU take the C path; other
    devices torch.ao's own sequence of tensor ops, its ``histc`` on CUDA torch's of float32
    copies of ``2 ** 24`` values at a time: ``quantscope::ao_histc``). After ``.double()``,
    ``.half()`` or ``.bfloat16()`` torch.ao searches in the state's dtype (its thresholds, densities
    and ``new_min`` / ``new_max``) and re-bins a widened range in it (as here); there the search
    is torch.ao's own code, so those equal too, at torch.ao's speed.

    One deliberate difference: a bfloat16 or float16 batch is binned as its float32 values,
    every value once. torch.ao's ``torch.histc`` bins it in its own dtype: positions land on a
    few hundred of 2048 bins and a bin stops counting near 256 (bfloat16) or 2048 (float16)
    values (90 % of 4 M bfloat16 values lost in ``tests/compat/test_torch_ao_exact.py``).
    """

    per_channel = False
    sync_refusal = ("torch.ao's histogram bins depend on the order in which its range grew "
                    "(each widening re-bins the counts approximately), so the ranks' "
                    "histograms do not merge into the one of all batches; observe every "
                    "batch on one rank, or use quantscope's histogram observers "
                    "('percentile', 'entropy', 'l2_histogram'), which sync exactly")
    #: torch.ao drops ``inf`` values with a warning (NaN raises :class:`NonFiniteBatchError`)
    non_finite = "ignore"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the last batch widened the range: the next one skips the one-read try (a list:
        # TorchScript keeps it as an attribute it never reads)
        self._widened = [False]

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            return self._forward_eager(x_orig)
        self._fit_bins(x_orig)
        torch.ops.quantscope.ao_histogram_observe(x_orig, self.histogram, self.min_val,
                                                  self.max_val, self.upsample_rate)
        return x_orig

    def _fit_bins(self, x: torch.Tensor) -> None:
        """A ``bins`` set before the first non-empty batch sizes the histogram, as torch.ao's."""
        if (x.numel() > 0 and self.bins != self.histogram.numel()
                and math.isinf(float(self.min_val))):
            self.histogram.resize_(self.bins).zero_()

    # never traced, as dynamo skips torch.ao's own observers: compiled, its re-binning's
    # linspace rounds otherwise and the histogram stops being torch.ao's
    @never_traced
    def _forward_eager(self, x_orig):
        if is_dtensor(x_orig):  # the kernels read its local shard's memory as the whole
            raise dtensor_error("HistogramObserver", x_orig)
        if x_orig.numel() == 0:
            return x_orig
        self._fit_bins(x_orig)
        x = binned(x_orig)
        rate = self.upsample_rate  # torch.ao's attribute: settable after construction
        widened = observe_fast(x, self.histogram, self.min_val, self.max_val,
                                not self._widened[0], rate)
        if widened is None:
            observe_tensors(x, self.histogram, self.min_val, self.max_val, rate)
        else:
            self._widened[0] = widened
        return x_orig

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.jit.is_scripting():
            return eager_search(self.histogram, self.min_val, self.max_val, self.dst_nbins)
        return torch.ops.quantscope.ao_histogram_search(self.histogram, self.min_val,
                                                        self.max_val, self.dst_nbins)
