"""Horizon plugin (observer_v2) observers, with their names, keyword signatures and qparams.

Horizon is symmetric only: ``scale = max(-lo, hi) / ((quant_max - quant_min) / 2)``
(torch.ao's symmetric rule; qint8 divides by 127.5), zero point 0.
``ch_axis=-1`` means per tensor, any other axis per channel. ``is_sync_quantize``
all-reduces every batch's min (MIN) and max (MAX) across processes before the
statistics are updated. ``calculate_qparams()`` returns ``(scale, zero_point)``:
float32 scale and int64 zero point of shape ``(1,)`` per tensor, ``(C,)`` per channel.
"""

from __future__ import annotations

import torch

from ..layout import Channel, Tensor
from ..observers.histogram import EntropyObserver
from ..observers.histogram import MixObserver as _NativeMix
from ..observers.histogram import PercentileObserver as _NativePercentile
from ..observers.minmax import MovingAverageMinMaxObserver as _NativeEMA
from ..observers.mse import LinearMSEObserver as _NativeLinearMSE
from ..observers.registry import register
from ..spec import QuantSpec

__all__ = [
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
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


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
        raise ValueError(f"horizon: observers are symmetric only; qscheme must be one of "
                         f"{list(_SYMMETRIC)}, got {qscheme!r}")
    if (quant_min is None) != (quant_max is None):
        raise ValueError(f"horizon: give both quant_min and quant_max, got {quant_min!r} and "
                         f"{quant_max!r}")
    layout = Tensor() if ch_axis is None or ch_axis == -1 else Channel(ch_axis)
    return QuantSpec(_FORMATS[name], layout, symmetric=True, quant_min=quant_min,
                     quant_max=quant_max)


class HorizonObserver:
    """Mixin (put it before the native class): Horizon keywords in, Horizon qparams out.

    Keywords it does not know go to the native observer's constructor.
    """

    def __init__(self, *, ch_axis=-1, dtype="qint8", qscheme=torch.per_tensor_symmetric,
                 quant_min=None, quant_max=None, is_sync_quantize=False, factory_kwargs=None,
                 **native):
        spec = horizon_spec(dtype, qscheme, ch_axis, quant_min, quant_max)
        super().__init__(spec, **native)
        self.ch_axis, self.dtype, self.qscheme = ch_axis, dtype, qscheme
        self.quant_min, self.quant_max = int(spec.qmin), int(spec.qmax)
        self.is_sync_quantize = bool(is_sync_quantize)
        # every batch's min / max is all-reduced (MIN / MAX) before the EMA update, through
        # quantscope.distributed's step sync: a rank without data this step calls the
        # observer with an empty tensor instead of leaving the others waiting
        self.sync_every_step = self.is_sync_quantize
        device = (factory_kwargs or {}).get("device")
        if device is not None:
            self.to(device)

    def calculate_qparams(self):
        if self.is_sync_quantize:  # counters and shape (a rank that saw nothing gets them)
            self.sync()
        qp = self.qparams()
        return qp.scale.reshape(-1), qp.zero_point.reshape(-1).to(torch.int64)

    def reset_min_max_vals(self) -> None:
        self.reset()


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
    """Horizon's per-tensor EMA min / max observer."""

    def __init__(self, averaging_constant=0.01, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        super().__init__(ch_axis=-1, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
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
@register("horizon:KLObserver")
class KLObserver(HorizonObserver, EntropyObserver):
    """Horizon's KLObserver: a ``bins``-bin ``|x|`` histogram accumulated over
    ``update_interval`` batches, KL threshold (start bin 128, divergences smoothed over 9
    candidates), then an EMA of the thresholds."""

    def __init__(self, bins=512, update_interval=1, averaging_constant=0.01, ch_axis=-1,
                 dtype="qint8", qscheme=torch.per_tensor_symmetric, quant_min=None,
                 quant_max=None, is_sync_quantize=False, factory_kwargs=None, **kwargs):
        kwargs.setdefault("smooth", 9)
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, bins=bins,
                         update_interval=update_interval,
                         averaging_constant=averaging_constant, **kwargs)


@register("horizon:PercentileObserver")
class PercentileObserver(HorizonObserver, _NativePercentile):
    """Horizon's PercentileObserver: each batch's ``|x|`` histogram (``bins`` over
    ``[0, max |x|]``, width ``w``), the centre ``(i + 0.5) w`` of the first bin where the
    cumulative share reaches ``percentile``, then an EMA."""

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
class MixObserver(HorizonObserver, _NativeMix):
    """Horizon's MixObserver: per batch, the percentile among 99.9 .. 99.9999 with the least
    quantization error, then an EMA (``candidates`` adds quantscope's others)."""

    def __init__(self, averaging_constant=0.01, bins=2048, ch_axis=-1, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        kwargs.setdefault("candidates", ("percentile",))
        kwargs.setdefault("grid", "first")  # each batch's own [0, max |x|] grid, as Horizon
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, bins=bins,
                         averaging_constant=averaging_constant, **kwargs)

    def _estimate(self, hist):
        # Horizon thresholds |x|: both sides clip at max |x| before the EMA (the native mix
        # clips each side at the signed min / max, so the EMA of a skewed batch is lopsided)
        lo, hi = _NativeMix._estimate(self, hist)
        amax = torch.maximum(-lo, hi)
        return -amax, amax


@register("horizon:MSEObserver")
class MSEObserver(HorizonObserver, _NativeLinearMSE):
    """Horizon's MSEObserver: candidates ``amax * (1 - 0.01 i)``, i in range(0, 95, stride),
    L2 error, the last minimum, then an EMA (c = 0.01) of the chosen range."""

    def __init__(self, stride=1, averaging_constant=0.01, ch_axis=-1, dtype="qint8",
                 qscheme=torch.per_tensor_symmetric, quant_min=None, quant_max=None,
                 is_sync_quantize=False, factory_kwargs=None, **kwargs):
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, quant_min=quant_min,
                         quant_max=quant_max, is_sync_quantize=is_sync_quantize,
                         factory_kwargs=factory_kwargs, stride=stride,
                         averaging_constant=averaging_constant, **kwargs)
