"""AMD Quark's observers, with their names, ``(qspec, device=None)`` signature and qparams.

``qspec`` is Quark's ``QTensorConfig`` or a dict / object with its fields: dtype,
qscheme (per_tensor / per_channel / per_group), ch_axis, group_size, symmetric,
round_method, scale_type, scale_format (float32 / e8m0 / e4m3),
scale_calculation_mode (even / floor / ceil), mx_element_dtype, is_dynamic.
Enums or their string values both work.

Quark returns ``(scale, zero_point)``: the scale in its ``scale_type`` dtype
(float32 unless float16 / bfloat16 is asked), shaped ``(1,)`` per tensor, ``(C,)``
per channel, ``(rows, groups)`` per group / block; the zero point int32 for
integers, a float zero tensor for float and block formats.

Known differences: ``round_method`` other than half_even is not supported; BFP16
uses the native 'even' E8M0 rule, which bumps the exponent when the block's largest
magnitude rounds to 128 on either sign (Quark checks positive overflow only, and
keeps doubling its running amax across calls).
"""

from __future__ import annotations

import torch

from ..layout import Block, Channel, Group, Tensor
from ..observers.histogram import HistogramObserverBase, L2HistogramObserver
from ..observers.minmax import MemorylessMinMaxObserver, StaticMinMaxObserver
from ..observers.minmax import PlaceholderObserver as _NativePlaceholder
from ..observers.registry import register
from ..qparams import qparams_from_range
from ..spec import QuantSpec
from . import enum_name, field

__all__ = [
    "PerBlockBFPObserver",
    "PerBlockMXObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorMSEObserver",
    "PerTensorMinMaxObserver",
    "PerTensorPercentileObserver",
    "PlaceholderObserver",
    "QuarkObserver",
    "UniformScalingObserver",
    "quark_spec",
]

_INT = {"int2", "int3", "int4", "int8", "int16", "uint4", "uint8"}
_FLOAT = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp6_e3m2": "fp6_e3m2",
          "fp6_e2m3": "fp6_e2m3", "fp4": "fp4_e2m1"}
_CAST = {"float16", "bfloat16"}
_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def quark_spec(qspec) -> QuantSpec:
    """The :class:`QuantSpec` of a Quark ``QTensorConfig`` (object or dict; the one translation).

    Casts (float16 / bfloat16) give an fp32 per-tensor spec: they need no range.
    """
    dtype = enum_name(field(qspec, "dtype"))
    qscheme = enum_name(field(qspec, "qscheme")) or "per_tensor"
    ch_axis = field(qspec, "ch_axis")
    group_size = field(qspec, "group_size")
    symmetric = field(qspec, "symmetric")
    symmetric = True if symmetric is None else bool(symmetric)
    scale_format = enum_name(field(qspec, "scale_format")) or "float32"
    mode = enum_name(field(qspec, "scale_calculation_mode")) or "even"
    round_method = enum_name(field(qspec, "round_method"))
    if round_method not in (None, "half_even", "8"):
        raise ValueError(f"quark: round_method {round_method!r} is not supported; "
                         f"quantscope rounds half to even")
    if dtype in _CAST:
        return QuantSpec("int8", Tensor())
    if dtype == "bfp16":
        return QuantSpec("int8_narrow", Block(group_size or 8, -1 if ch_axis is None else ch_axis),
                         scale="e8m0:even")
    if dtype == "mx":
        element = enum_name(field(qspec, "mx_element_dtype"))
        if element not in _FLOAT and element != "int8":
            raise ValueError(f"quark: mx_element_dtype must be one of {[*_FLOAT, 'int8']}, "
                             f"got {element!r}")
        fmt = "int8_narrow" if element == "int8" else _FLOAT[element]
        return QuantSpec(fmt, Block(group_size or 32, -1 if ch_axis is None else ch_axis),
                         scale=f"e8m0:{mode}")
    if dtype in _FLOAT:
        fmt = _FLOAT[dtype]
    elif dtype in _INT:
        fmt = dtype
    else:
        raise ValueError(f"quark: dtype {dtype!r} is not supported; expected one of "
                         f"{sorted(_INT | set(_FLOAT) | _CAST | {'mx', 'bfp16'})}")
    if scale_format in ("e8m0", "e4m3"):  # block scales: MX via per_group, two-level fp8 (NVFP4)
        if qscheme != "per_group" or not group_size:
            raise ValueError(f"quark: scale_format {scale_format!r} needs qscheme per_group "
                             f"with a group_size, got {qscheme!r}, group_size={group_size!r}")
        scale = f"e8m0:{mode}" if scale_format == "e8m0" else "fp8_e4m3"
        return QuantSpec(fmt, Block(group_size, -1 if ch_axis is None else ch_axis),
                         scale=scale)
    if scale_format != "float32":
        raise ValueError(f"quark: scale_format must be float32, e8m0 or e4m3, got "
                         f"{scale_format!r}")
    if qscheme == "per_tensor":
        layout = Tensor()
    elif qscheme == "per_channel":
        layout = Channel(0 if ch_axis is None else ch_axis)
    elif qscheme == "per_group":
        if not group_size:
            raise ValueError("quark: qscheme per_group needs a group_size")
        layout = Group(group_size, -1 if ch_axis is None else ch_axis)
    else:
        raise ValueError(f"quark: qscheme must be per_tensor, per_channel or per_group, got "
                         f"{qscheme!r}")
    return QuantSpec(fmt, layout, symmetric=symmetric if dtype in _INT else True)


class QuarkObserver:
    """Mixin (put it before the native class): a Quark qspec in, Quark's qparams out.

    Keywords after ``device`` go to the native observer's constructor.
    """

    def __init__(self, qspec, device: torch.device | None = None, **native):
        super().__init__(quark_spec(qspec), **native)
        self.qspec = qspec
        self.dtype = field(qspec, "dtype")
        self.is_dynamic = bool(field(qspec, "is_dynamic"))
        self.scale_format = enum_name(field(qspec, "scale_format"))
        self.scale_calculation_mode = enum_name(field(qspec, "scale_calculation_mode"))
        scale_type = enum_name(field(qspec, "scale_type"))
        self.scale_torch_dtype = _SCALE_DTYPES.get(scale_type, torch.float32)
        if device is not None:
            self.to(device)

    @property
    def _num_observed_tokens(self) -> int:
        return int(self.observed_tokens)

    def _calculate_qparams(self):
        qp = self.qparams()
        scale, zp = qp.effective_scale, qp.zero_point
        lay = self.spec.layout
        if isinstance(lay, Tensor | Channel):
            scale, zp = scale.reshape(-1), zp.reshape(-1)
        else:  # groups / blocks: (rows, groups per row)
            scale, zp = scale.reshape(-1, scale.shape[-1]), zp.reshape(-1, zp.shape[-1])
        if self.spec.is_float or self.spec.scale.is_block:
            zp = torch.zeros_like(scale)
        return scale.to(self.scale_torch_dtype), zp

    def calculate_qparams(self, min_val: torch.Tensor | None = None,
                          max_val: torch.Tensor | None = None):
        """Quark's ``calculate_qparams()``; with ``(min_val, max_val)`` it prices a given range."""
        if min_val is None and max_val is None:
            return self._calculate_qparams()
        qp = qparams_from_range(min_val.float(), max_val.float(), self.spec)
        zp = torch.zeros_like(qp.scale) if self.spec.is_float else qp.zero_point
        return qp.effective_scale.to(self.scale_torch_dtype), zp

    def reset_state(self) -> None:
        self.reset()

    def reset_min_max_vals(self) -> None:
        self.reset()


class _DynamicOrStatic(QuarkObserver, StaticMinMaxObserver):
    """Running min / max, or the last call's with ``is_dynamic`` (Quark keeps both in one class)."""

    #: Quark's per-group observer overwrites on every call, dynamic or not
    always_memoryless = False

    @property
    def accumulates(self):
        return not (self.is_dynamic or self.always_memoryless)

    def _observe(self, units, lo, hi):
        if not self.accumulates:
            MemorylessMinMaxObserver._observe(self, units, lo, hi)
        else:
            StaticMinMaxObserver._observe(self, units, lo, hi)

    @property
    def min_val(self):
        return self.min_vals

    @property
    def max_val(self):
        return self.max_vals


@register("quark:PlaceholderObserver")
class PlaceholderObserver(QuarkObserver, _NativePlaceholder):
    """For float16 / bfloat16 casts: passes tensors through, no qparams."""

    def _calculate_qparams(self):
        return None


@register("quark:UniformScalingObserver")
class UniformScalingObserver(_DynamicOrStatic):
    """Quark's base of uniform int / fp8 scaling: min / max over the spec's layout."""


@register("quark:PerTensorMinMaxObserver")
class PerTensorMinMaxObserver(_DynamicOrStatic):
    """Running (static) or last (dynamic) per-tensor min / max."""


@register("quark:PerChannelMinMaxObserver")
class PerChannelMinMaxObserver(_DynamicOrStatic):
    """Running (static) or last (dynamic) min / max per channel along ``ch_axis``."""


@register("quark:PerGroupMinMaxObserver")
class PerGroupMinMaxObserver(_DynamicOrStatic):
    """Min / max per group of ``group_size`` along ``ch_axis``, of the last call (as Quark's)."""

    always_memoryless = True


@register("quark:PerBlockMXObserver")
class PerBlockMXObserver(_DynamicOrStatic):
    """MX: per-block absmax, E8M0 shared scale by ``scale_calculation_mode`` (even by default)."""


@register("quark:PerBlockBFPObserver")
class PerBlockBFPObserver(_DynamicOrStatic):
    """BFP16: blocks of 8, shared exponent with the overflow check ('even' E8M0, int8 codes)."""



# ----------------------------------------------------------------------------- histograms
class _QuarkHistogram(QuarkObserver):
    """Quark's histogram family: ``(qspec, device=None)``, 2048 bins, the first batch binned
    as Quark bins it (``|x|`` from 0 when symmetric, else ``[min, max]``); batches inside
    that range add on the same grid (Quark appends bins when the range grows: quantscope
    moves the counts once to its exact fixed-size grid instead)."""

    _num_bins = 2048
    _skip_zeros = False

    def __init__(self, qspec, device: torch.device | None = None, **native):
        native.setdefault("grid", "first")
        native.setdefault("bins", self._num_bins)
        native.setdefault("skip_zeros", self._skip_zeros)
        super().__init__(qspec, device, **native)
        self.symmetric = self.spec.symmetric

    @property
    def calib_hist(self) -> torch.Tensor:
        """Counts as Quark holds them (float32; ``[bins]`` per tensor, ``[units, bins]`` else)."""
        if not self.has_observed:
            return torch.tensor([])
        c = self.current_histogram().counts.float()
        return c[0] if c.shape[0] == 1 else c

    @property
    def calib_bin_edges(self) -> torch.Tensor:
        if not self.has_observed:
            return torch.tensor([])
        e = self.current_histogram().edges()
        return e[0] if e.shape[0] == 1 else e


@register("quark:PerTensorHistogramObserver")
class PerTensorHistogramObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's histogram recorder. Quark's own never sets a range (scale 1); here the range is
    the data's min / max, so the class is usable on its own."""

    def _estimate(self, hist):
        return self.min_vals, self.max_vals


@register("quark:PerTensorPercentileObserver")
class PerTensorPercentileObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's percentile observer: 4200 bins, zeros skipped, p = 99.99999999, left bin edge."""

    _num_bins = 4200
    _skip_zeros = True

    def __init__(self, qspec, device: torch.device | None = None, **native):
        self.percentile = 99.99999999
        super().__init__(qspec, device, **native)

    def _estimate(self, hist):
        return self.get_min_max_by_percentile(hist.counts, hist.edges(), self.percentile)

    def get_min_max_by_percentile(self, histogram: torch.Tensor, bin_edges: torch.Tensor,
                                  percentile: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's function, vectorized over rows (``[B]`` / ``[B + 1]`` or ``[U, B]`` /
        ``[U, B + 1]``). As in Quark: the asymmetric branch takes the max from the low tail
        (``cdf >= (100 - p) / 200``) and the min from the first bin."""
        if percentile < 0 or percentile > 100:
            raise ValueError("Percentile value must be between 0 and 100.")
        one = histogram.dim() == 1
        h = histogram.float().reshape(-1, histogram.shape[-1])
        edges = bin_edges.float().reshape(-1, bin_edges.shape[-1])
        total = h.sum(-1, keepdim=True)
        cdf = torch.cumsum(h / total, dim=-1)
        B = h.shape[-1]
        ar = torch.arange(B, device=h.device)

        def first(mask, default):
            return torch.where(mask, ar, B).amin(-1).where(mask.any(-1), default)

        if not self.spec.symmetric:
            side = (100.0 - percentile) / 200.0
            up = first(cdf >= torch.tensor(side).float(), B - 1)
            low = first(cdf <= torch.tensor(1 - side).float(), 0)
            mx, mn = edges.gather(1, up[:, None])[:, 0], edges.gather(1, low[:, None])[:, 0]
        else:
            target = torch.minimum(torch.tensor(percentile / 100.0, dtype=torch.float64),
                                   cdf[:, -1].double()).float()
            up = first(cdf >= target[:, None], B - 1)
            mx = edges.gather(1, up[:, None])[:, 0]
            mn = torch.zeros_like(mx)
        empty = total[:, 0] <= 0  # Quark: zero-mass histogram -> (0, 0)
        mn, mx = mn.masked_fill(empty, 0), mx.masked_fill(empty, 0)
        return (mn[0], mx[0]) if one else (mn, mx)


@register("quark:PerTensorMSEObserver")
class PerTensorMSEObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's histogram-MSE observer: candidates ``(0, centre_i)`` for ``i >= start_bin`` (2045)."""

    def _estimate(self, hist):
        return self.get_min_max_by_mse(hist.counts, hist.edges())

    def get_min_max_by_mse(self, calib_hist: torch.Tensor, calib_bin_edges: torch.Tensor,
                           stride: int = 1, start_bin: int = 2045
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's function, vectorized over candidates (and rows): the first centre with the
        least ``sum((q(c) - c) ** 2 * count)``; returns ``(0, amax)``."""
        from ..estimators.error import histogram_error
        from ..stats.histogram import Hist

        if calib_bin_edges.shape[-1] < 2:
            raise ValueError(f"calib_bin_edges must have at least 2 elements, got "
                             f"{calib_bin_edges.shape[-1]}")
        one = calib_hist.dim() == 1
        counts = calib_hist.reshape(-1, calib_hist.shape[-1])
        edges = calib_bin_edges.float().reshape(-1, calib_bin_edges.shape[-1])
        centers = (edges[:, 1:] + edges[:, :-1]) / 2
        n = centers.shape[-1]
        start = min(start_bin, max(0, n - 1))
        idx = torch.arange(start, n, stride, device=centers.device)
        amax = centers[:, idx]
        zero = torch.zeros_like(amax)
        h = Hist(counts.round().long(), edges[:, 0], edges[:, -1], self.spec.symmetric)
        err = histogram_error(h, zero, amax, self.spec, centers=centers)
        best = amax.gather(1, err.argmin(-1, keepdim=True))[:, 0]
        mn = torch.zeros_like(best)
        return (mn[0], best[0]) if one else (mn, best)


@register("quark:PerTensorHistogramObserverPro")
class PerTensorHistogramObserverPro(QuarkObserver, L2HistogramObserver):
    """Quark's wrapper of torch.ao's HistogramObserver (256 bins, non-linear L2 search).

    ``upsample_rate`` is accepted and unused (torch >= 2.5 dropped it too); custom
    quant ranges make torch ignore ``reduce_range``, so it is accepted and unused.
    """

    def __init__(self, qspec, device: torch.device | None = None, bins: int = 256,
                 reduce_range: bool = False, upsample_rate: int = 384, **native):
        native.setdefault("grid", "first")
        native.setdefault("dst_nbins", 256)  # 2 ** iinfo(qint8 / quint8 / quint4x2).bits
        native.setdefault("polish", 0)
        super().__init__(qspec, device, bins=bins, **native)
        if not isinstance(self.spec.layout, Tensor):
            raise ValueError("PerTensorHistogramObserverPro only supports per_tensor")  # noqa: TRY004
        if enum_name(self.dtype) not in ("uint4", "int8", "uint8"):
            raise ValueError("PerTensorHistogramObserverPro only supports 4bit and 8bit")
        self.reduce_range = reduce_range
