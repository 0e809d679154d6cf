"""torch.ao.quantization's observers, with its names, signatures and qparams.

``calculate_qparams()`` returns ``(scale, zero_point)`` as torch.ao does: float32
scale and int64 zero point of shape ``(1,)`` per tensor, ``(C,)`` per channel;
quint8 gets zero point 128 when symmetric; ``reduce_range`` drops one bit.

The classes plug into torch's own pipelines: ``with_args`` binds arguments as torch.ao's
does, and they count as ``torch.ao.quantization.ObserverBase`` (registered as a virtual
subclass: torch.ao's eager and FX ``prepare`` / ``convert`` find observers by that
``isinstance``), so they go in a ``QConfig``; ``convert`` then reads ``dtype``, ``qscheme``,
``ch_axis`` and ``calculate_qparams()`` from them. For torchao's pt2e
(``QuantizationSpec(observer_or_fake_quant_ctr=...)``) import
:mod:`quantscope.integrations.torchao`, which registers them with torchao's ``ObserverBase``.
"""

from __future__ import annotations

import functools

import torch
from torch.ao.quantization.observer import ObserverBase, _PartialWrapper

from .. import kernels
from ..formats import get_format
from ..layout import Channel, Tensor
from ..observers.histogram import L2HistogramObserver
from ..observers.minmax import MovingAverageMinMaxObserver as _NativeEMA
from ..observers.minmax import StaticMinMaxObserver
from ..observers.registry import register
from ..spec import QuantSpec
from ..stats import ao_histogram

__all__ = [
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
    "TorchAOObserver",
    "torch_ao_spec",
]

EPS = torch.finfo(torch.float32).eps
_FORMATS = {torch.qint8: "int8", torch.quint8: "uint8", torch.int8: "int8", torch.uint8: "uint8",
            torch.quint4x2: "uint4", torch.int16: "int16", torch.uint16: "uint16"}
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
_PER_CHANNEL = (torch.per_channel_symmetric, torch.per_channel_affine)
_SUPPORTED = (*_SYMMETRIC, torch.per_tensor_affine, torch.per_channel_affine)


def torch_ao_spec(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                  quant_min=None, quant_max=None, eps=EPS, ch_axis=0) -> QuantSpec:
    """The :class:`QuantSpec` of torch.ao observer arguments (the one translation)."""
    if dtype not in _FORMATS:
        raise ValueError(f"torch.ao: dtype must be one of {list(_FORMATS)}, got {dtype!r}")
    if qscheme not in _SUPPORTED:
        raise ValueError(f"torch.ao: qscheme must be one of {list(_SUPPORTED)}, got {qscheme!r}")
    fmt = _FORMATS[dtype]
    if reduce_range and fmt.startswith("u") and qscheme in _SYMMETRIC:
        raise NotImplementedError("torch.ao: cannot reduce range for symmetric quantization "
                                  "of an unsigned dtype")
    if quant_min is None and quant_max is None:
        if reduce_range:  # one bit less: qint8 [-64, 63], quint8 [0, 127]
            bits = get_format(fmt).bits
            if fmt.startswith("u"):
                quant_min, quant_max = 0, 2 ** (bits - 1) - 1
            else:
                quant_min, quant_max = -(2 ** (bits - 2)), 2 ** (bits - 2) - 1
    elif quant_min is None or quant_max is None:
        raise ValueError(f"torch.ao: give both quant_min and quant_max, got {quant_min!r} and "
                         f"{quant_max!r}")
    elif reduce_range:  # torch.ao halves a custom range too
        quant_min, quant_max = quant_min // 2, quant_max // 2
    layout = Channel(ch_axis) if qscheme in _PER_CHANNEL else Tensor()
    return QuantSpec(fmt, layout, symmetric=qscheme in _SYMMETRIC, eps=float(eps),
                     quant_min=quant_min, quant_max=quant_max)


class _Constructor(_PartialWrapper):
    """torch.ao's partial constructor (what ``with_args`` returns), keeping the class's
    ``__name__`` (torchao's pt2e reads it to decide whether to pass ``ch_axis``)."""

    @property
    def __name__(self) -> str:
        return self.p.func.__name__

    def with_args(self, **kwargs) -> _Constructor:
        out = _Constructor(functools.partial(self.p, **kwargs))
        out.callable_args = dict(self.callable_args)
        return out


class TorchAOObserver:
    """Mixin (put it before the native class): torch.ao keywords in, torch.ao qparams out.

    Keywords it does not know go to the native observer's constructor.
    """

    #: True: per-channel qschemes only; False: per-tensor only (torch.ao splits its classes so)
    per_channel: bool | None = None
    #: the torch.ao class to use instead when a per-tensor class is given a per-channel qscheme
    per_channel_class: str | None = None

    def __init__(self, *, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                 quant_min=None, quant_max=None, factory_kwargs=None, eps=EPS, is_dynamic=False,
                 ch_axis=0, **native):
        name = type(self).__name__
        if self.per_channel is False and qscheme in _PER_CHANNEL:
            use = f"; use {self.per_channel_class}" if self.per_channel_class else ""
            raise NotImplementedError(f"{name}: qscheme must be per_tensor_symmetric or "
                                      f"per_tensor_affine, got {qscheme}{use}")
        if self.per_channel and qscheme not in _PER_CHANNEL:
            raise NotImplementedError(f"{name}: needs a per-channel qscheme, got {qscheme}")
        if is_dynamic:
            raise NotImplementedError(f"{name}: is_dynamic is not supported")
        spec = torch_ao_spec(dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis)
        super().__init__(spec, **native)
        self.dtype, self.qscheme, self.reduce_range = dtype, qscheme, reduce_range
        self.quant_min, self.quant_max = int(spec.qmin), int(spec.qmax)
        self.ch_axis = ch_axis
        self.is_dynamic = is_dynamic
        self.has_customized_qrange = quant_min is not None or quant_max is not None
        device = (factory_kwargs or {}).get("device")
        if device is not None:
            self.to(device)

    @classmethod
    def with_args(cls, **kwargs) -> _Constructor:
        """A constructor with ``kwargs`` bound, as torch.ao's ``Observer.with_args``
        (``QConfig(activation=HistogramObserver.with_args(dtype=torch.quint8), ...)``)."""
        return _Constructor(functools.partial(cls, **kwargs))

    @classmethod
    def with_callable_args(cls, **kwargs) -> _Constructor:
        """As torch.ao's: each value is called at construction time."""
        out = _Constructor(functools.partial(cls))
        out.callable_args = dict(kwargs)
        return out

    def calculate_qparams(self):
        qp = self.qparams()  # torch.ao: int64 zero points when symmetric, int32 when affine
        zp_dtype = torch.int64 if self.spec.symmetric else torch.int32
        zp = qp.zero_point.reshape(-1).to(zp_dtype)
        if self.spec.symmetric and not self.spec.format.signed and self.has_customized_qrange:
            zp.fill_((self.quant_min + self.quant_max) // 2)  # torch.ao's rule for custom ranges
        return qp.scale.reshape(-1), zp

    @property
    def min_val(self) -> torch.Tensor:
        return self._range_view(0)

    @property
    def max_val(self) -> torch.Tensor:
        return self._range_view(1)

    def _range_view(self, i):
        if not self.has_observed:  # torch.ao's initial state
            return torch.tensor(float("inf") if i == 0 else float("-inf"))
        v = self.calculate_range()[i]
        return v.reshape(()) if isinstance(self.spec.layout, Tensor) else v

    def reset_min_max_vals(self) -> None:
        self.reset()


# torch.ao's prepare / convert recognise observers by isinstance(m, ObserverBase)
ObserverBase.register(TorchAOObserver)


@register("torch.ao:MinMaxObserver")
class MinMaxObserver(TorchAOObserver, StaticMinMaxObserver):
    """Running min / max per tensor (torch.ao.quantization.MinMaxObserver)."""

    per_channel, per_channel_class = False, "PerChannelMinMaxObserver"

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                 quant_min=None, quant_max=None, factory_kwargs=None, eps=EPS, is_dynamic=False,
                 **kwargs):
        super().__init__(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range,
                         quant_min=quant_min, quant_max=quant_max, factory_kwargs=factory_kwargs,
                         eps=eps, is_dynamic=is_dynamic, **kwargs)


@register("torch.ao:MovingAverageMinMaxObserver")
class MovingAverageMinMaxObserver(TorchAOObserver, _NativeEMA):
    """EMA of the per-tensor min / max, c = 0.01 (torch.ao's MovingAverageMinMaxObserver)."""

    per_channel, per_channel_class = False, "MovingAveragePerChannelMinMaxObserver"

    def __init__(self, averaging_constant=0.01, dtype=torch.quint8,
                 qscheme=torch.per_tensor_affine, reduce_range=False, quant_min=None,
                 quant_max=None, eps=EPS, is_dynamic=False, **kwargs):
        super().__init__(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range,
                         quant_min=quant_min, quant_max=quant_max, eps=eps,
                         is_dynamic=is_dynamic, averaging_constant=averaging_constant, **kwargs)


@register("torch.ao:PerChannelMinMaxObserver")
class PerChannelMinMaxObserver(TorchAOObserver, StaticMinMaxObserver):
    """Running min / max per channel along ``ch_axis`` (torch.ao's PerChannelMinMaxObserver)."""

    per_channel = True

    def __init__(self, ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine,
                 reduce_range=False, quant_min=None, quant_max=None, factory_kwargs=None,
                 eps=EPS, is_dynamic=False, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme,
                         reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max,
                         factory_kwargs=factory_kwargs, eps=eps, is_dynamic=is_dynamic, **kwargs)


@register("torch.ao:MovingAveragePerChannelMinMaxObserver")
class MovingAveragePerChannelMinMaxObserver(TorchAOObserver, _NativeEMA):
    """EMA of the per-channel min / max (torch.ao's MovingAveragePerChannelMinMaxObserver)."""

    per_channel = True

    def __init__(self, averaging_constant=0.01, ch_axis=0, dtype=torch.quint8,
                 qscheme=torch.per_channel_affine, reduce_range=False, quant_min=None,
                 quant_max=None, eps=EPS, is_dynamic=False, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme,
                         reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max,
                         eps=eps, is_dynamic=is_dynamic, averaging_constant=averaging_constant,
                         **kwargs)


@register("torch.ao:HistogramObserver")
class HistogramObserver(TorchAOObserver, L2HistogramObserver):
    """torch.ao's HistogramObserver: its histogram, state for state, and its L2 search.

    The state is torch.ao's: ``bins`` float32 counts between the running min and max
    (``histogram``, ``min_val``, ``max_val``), updated as torch.ao's ``forward`` does,
    including its approximate re-binning when a batch widens the range
    (:mod:`quantscope.stats.ao_histogram`: C on CPU, in place as torch.ao's ``copy_``); the
    search is torch's, vectorized
    (:mod:`quantscope.estimators.l2`). So histogram, scale and zero point equal torch.ao's
    bitwise for float32 inputs, whatever the batches' ranges. Unlike torch.ao, NaN / inf
    are not dropped with a warning: the batch is left out and ``calculate_qparams`` says
    so (the native ``non_finite`` rule; ``non_finite="ignore"`` counts them as zeros).
    """

    per_channel = False

    def __init__(self, bins=2048, dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                 reduce_range=False, quant_min=None, quant_max=None, factory_kwargs=None,
                 eps=EPS, is_dynamic=False, **kwargs):
        for name in ("averaging_constant", "skip_zeros", "grid"):
            if kwargs.get(name) not in (None, False):
                raise ValueError(f"HistogramObserver: {name} is not a torch.ao argument (this "
                                 f"class keeps torch.ao's one histogram), got {kwargs[name]!r}")
            kwargs.pop(name, None)
        kwargs.setdefault("polish", 0)
        kwargs.setdefault("dst_nbins", 2 ** torch.iinfo(dtype).bits)
        super().__init__(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range,
                         quant_min=quant_min, quant_max=quant_max, factory_kwargs=factory_kwargs,
                         eps=eps, is_dynamic=is_dynamic, bins=bins, grid="first", **kwargs)
        self.hist_counts = torch.zeros(0)  # torch.ao's counts are float32 (fractions after growth)
        self._widened = [False]  # the last batch widened the range (then no one-read pass)

    def _fresh(self) -> bool:
        return self.min_vals.shape[0] != 1 or self.hist_counts.shape != (1, self.bins)

    def forward(self, x):
        # a CPU batch: torch.ao's whole step in C, in place on the state, with no tensor op
        # but a widening batch's two linspace (stats.ao_histogram.observe); anything else
        # takes the generic pass
        if (isinstance(x, torch.Tensor) and x.is_floating_point() and x.is_cpu
                and self.hist_counts.is_cpu and self.non_finite == "error"
                and not self.sync_every_step):
            first = self._fresh()
            if first:  # the state's tensors, made before the call (kept only if it runs)
                state = torch.empty(1, self.bins), *torch.empty(2).split(1)
            elif self.hist_lo is self.min_vals and self.hist_hi is self.max_vals:
                state = self.hist_counts, self.min_vals, self.max_vals
            else:  # a state made elsewhere (loaded): the generic pass sets it up for this one
                state = None
            # (the C only reads x's memory: no detach)
            got = None if state is None else ao_histogram.observe(
                *state, kernels.contiguous(x), first, one_read=not self._widened[0])
            if got is not None:
                if got is ao_histogram.NON_FINITE:
                    self.seen_non_finite.fill_(True)  # left out; calculate_qparams says so
                else:
                    self._widened[0] = got
                    if first:
                        self._set_state(*state, True)
                self.count_batch(x, direct=True)
                return x
        return super().forward(x)

    def _observe(self, units, lo, hi):
        self._pass[0] = None  # the base's one-read pass is for the native grid only
        lo, hi = lo.reshape(()), hi.reshape(())
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return  # recorded by forward: calculate_qparams reports it
        fresh = self._fresh()
        self._widened[0] = fresh or bool((lo < self.min_vals[0]) | (hi > self.max_vals[0]))
        hist, mn, mx = ao_histogram.update(
            None if fresh else self.hist_counts[0], None if fresh else self.min_vals[0],
            None if fresh else self.max_vals[0], units.reshape(-1), lo, hi, self.bins)
        self._set_state(hist, mn.reshape(1), mx.reshape(1), fresh)

    def _set_state(self, hist, mn, mx, fresh):
        self._buffers.update(hist_counts=hist if hist.dim() == 2 else hist[None], min_vals=mn,
                             max_vals=mx, hist_lo=mn, hist_hi=mx)
        if fresh:
            self.linear_grid.fill_(True)

    @property
    def histogram(self) -> torch.Tensor:
        """The counts as torch.ao holds them (float32 ``[bins]``)."""
        if not self.has_observed or self.hist_counts.shape[0] != 1:
            return torch.zeros(self.bins)
        return self.hist_counts[0]

    @property
    def min_val(self) -> torch.Tensor:
        return self.min_vals.reshape(()) if self.min_vals.numel() else torch.tensor(float("inf"))

    @property
    def max_val(self) -> torch.Tensor:
        return self.max_vals.reshape(()) if self.max_vals.numel() else \
            torch.tensor(float("-inf"))
