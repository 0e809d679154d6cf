"""NVIDIA ModelOpt 0.47 (TensorRT pytorch-quantization) calibrators, with their names,
signatures and ``collect`` / ``compute_amax`` / ``reset`` API.

``MaxCalibrator(num_bits=8, axis=None, unsigned=False, track_amax=False)``: the running
``max |x|``; ``axis`` names the axes KEPT (an int or a tuple, negative ones counted from the
end; ``None`` or ``()``: per tensor), and ``compute_amax()`` returns ModelOpt's value, dtype
and shape (the kept axes' sizes, the others 1; a 0-d tensor when it holds one value; None
before data). A batch whose amax shape changes is a ``RuntimeError``, NaN / inf an
:class:`ModelOptArgumentError` (an ``AssertionError``, as ModelOpt asserts).

``HistogramCalibrator(num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None,
skip_zeros=False, torch_hist=True)``: per tensor only (``axis`` is ModelOpt's
``NotImplementedError``); a ``num_bins`` histogram of ``|x|`` over the first batch's
``[0, max |x|]`` (``torch.histc``'s bins), later batches past it append bins of the same
width (the native ``grid="first"`` histogram, grown as Horizon's KL histogram grows).
``compute_amax(method, *, stride=1, start_bin=128, percentile=99.99)`` runs quantscope's
estimators on it: ``"entropy"`` (:func:`~quantscope.estimators.entropy.entropy_amax`),
``"percentile"`` (the left edge of the bin reaching it, ModelOpt's ``edges[searchsorted]``),
``"mse"`` (:func:`~quantscope.estimators.histogram_mse.histogram_mse_range`); a float32
0-d tensor on the CPU, as ModelOpt's; an unknown method is ModelOpt's ``TypeError``.
``grow_method`` is ignored, as ModelOpt (deprecated there).

Both are observers too: ``forward`` / ``qparams()`` run the native observer (the histogram's
estimate is the entropy amax); they register as ``"modelopt:MaxCalibrator"`` and
``"modelopt:HistogramCalibrator"``.

Known differences: ModelOpt's ``"mse"`` calls ``fake_tensor_quant(centers, amax, num_bits,
unsigned)`` whose third parameter is now ``bias``, so it returns its first candidate
whatever the data; quantscope scores the candidates as documented (all bin centres from
``start_bin``, the first minimum). ``"entropy"`` where a candidate has no counts below it:
ModelOpt picks that NaN divergence, quantscope scores it infinite
(:mod:`~quantscope.estimators.entropy`). ``"percentile"`` where ``p`` percent of the total
is a whole count: quantscope's test is exact, ModelOpt's float64 ``cumsum(hist / total)``
can fall short of it and take the next non-empty bin. The state is float32: float64 amaxes
and integer ones past ``2 ** 24`` are those rounded to float32. ``track_amax`` keeps bf16 amaxes as
float32 arrays (numpy has no bf16: ModelOpt fails). An axis out of range is a
``ValueError`` (ModelOpt reduces every axis). ``reset()`` restores ``num_bins`` (ModelOpt
keeps the grown count for the next first batch). A first histogram of only zeros, later
grown, and one growing past ``GROW_LIMIT x num_bins``, move once to quantscope's
power-of-two grid, approximately (ModelOpt: ``OverflowError``; appends on).
``torch_hist=False`` (ModelOpt's numpy path, a ``[min |x|, max |x|]`` grid) is not
supported; nor is ``num_bits=(4, 3)``.
"""

from __future__ import annotations

import numbers

import torch

from .._checks import check_int
from ..estimators.entropy import check_options as check_entropy_options
from ..estimators.entropy import entropy_amax
from ..estimators.histogram_mse import histogram_mse_range
from ..estimators.percentile import check_percentile, percentile_range
from ..layout import Channel, Tensor
from ..observers.histogram import HistogramObserverBase
from ..observers.minmax import StaticMinMaxObserver
from ..observers.registry import register
from ..qparams import amax_of_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from .horizon import AppendingFirstGrid

__all__ = [
    "HistogramCalibrator",
    "MaxCalibrator",
    "ModelOptArgumentError",
    "ModelOptCalibrator",
    "modelopt_spec",
]

METHODS = ("entropy", "mse", "percentile")


class ModelOptArgumentError(ValueError, AssertionError):
    """What ModelOpt asserts against: an ``AssertionError`` as ModelOpt's, and a
    ``ValueError`` as quantscope's bad-argument errors."""


def _axes(axis) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"modelopt: axis must be None, an int or a tuple of ints (the "
                             f"axes kept), got {axis!r}")
    return tuple(int(a) for a in axes)


def modelopt_spec(num_bits=8, axis=None, unsigned=False) -> QuantSpec:
    """The :class:`QuantSpec` of ModelOpt calibrator arguments (the one translation):
    ``int{num_bits}_narrow`` symmetric (ModelOpt's ``amax / (2 ** (b - 1) - 1)``, codes +-127 for 8
    bits), or ``uint{num_bits}`` from 0 (``unsigned``), per tensor, or
    per index of ``axis`` when it keeps one axis (several: ``Channel(0)`` of the kept axes
    flattened, :meth:`MaxCalibrator.collect`)."""
    check_int("modelopt", "num_bits", num_bits, 2, 16)  # (4, 3) (fp8) is not supported
    if not isinstance(unsigned, bool):
        raise TypeError(f"modelopt: unsigned must be True or False, got {unsigned!r}")
    axes = _axes(axis)
    layout = Tensor() if not axes else Channel(axes[0] if len(axes) == 1 else 0)
    fmt = f"uint{num_bits}" if unsigned else f"int{num_bits}_narrow"  # amax / (2 ** (b-1) - 1)
    return QuantSpec(fmt, layout, symmetric=not unsigned)


class ModelOptCalibrator:
    """Mixin (put it before the native class): ModelOpt's arguments in, ``_num_bits``,
    ``_axis`` and ``_unsigned`` kept as ModelOpt's ``_Calibrator`` keeps them."""

    def __init__(self, num_bits=8, axis=None, unsigned=False, **native):
        if "spec" in native:
            raise TypeError(f"modelopt {type(self).__name__}: takes ModelOpt's arguments "
                            f"(num_bits, axis, unsigned), not a quantscope spec")
        super().__init__(modelopt_spec(num_bits, axis, unsigned), **native)
        self._num_bits, self._axis, self._unsigned = num_bits, axis, unsigned


@register("modelopt:MaxCalibrator")
class MaxCalibrator(ModelOptCalibrator, StaticMinMaxObserver):
    """ModelOpt's MaxCalibrator: the running ``max |x|`` over the axes not kept."""

    def __init__(self, num_bits=8, axis=None, unsigned=False, track_amax=False, **kwargs):
        super().__init__(num_bits, axis, unsigned, **kwargs)
        self._track_amax = bool(track_amax)
        if self._track_amax:
            self._amaxs = []
        self._amax_shape = None  # the kept axes' shape of the first batch

    @property
    def amaxs(self) -> list:
        """Each batch's amax as a numpy array (``track_amax=True`` only, as ModelOpt)."""
        if not self._track_amax:
            raise AttributeError("modelopt MaxCalibrator: amaxs are kept with track_amax=True")
        return self._amaxs

    def _view(self, x: torch.Tensor):
        """``(x as the layout's input, amax shape)``: several kept axes are moved to the front
        and flattened into one (``Channel(0)``); none kept (or all: torch's ``amax`` over no
        dim reduces every one, as ModelOpt's) is per tensor."""
        axes, nd = _axes(self._axis), x.dim()
        for a in axes or ():
            if not -nd <= a < nd:
                raise ValueError(f"modelopt MaxCalibrator: axis {self._axis!r} is out of range "
                                 f"for a tensor of {nd} dims")
        kept = sorted({a % nd for a in axes or ()})
        if not kept or len(kept) == nd:
            return x.reshape(1, -1) if axes else x, ()
        shape = tuple(n if i in kept else 1 for i, n in enumerate(x.shape))
        if len(kept) == 1:
            return x, shape
        rest = [i for i in range(nd) if i not in kept]
        k = torch.Size(x.shape[i] for i in kept).numel()
        return x.permute(*kept, *rest).reshape(k, x.numel() // max(k, 1)), shape

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Take ``x``'s ``max |x|`` over the axes not kept into the running max."""
        view, shape = self._view(x)
        if self._amax_shape is not None and shape != self._amax_shape:
            raise RuntimeError("amax shape changed!")  # ModelOpt's words
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ModelOptArgumentError(f"modelopt MaxCalibrator: detected NaN or inf values "
                                        f"in the tensor (NaN: {bool(torch.isnan(x).any())})")
        self(view)
        self._amax_shape = shape
        if self._track_amax:
            lo, hi = unit_minmax(self.spec.layout.to_units(view))
            amax = self._shaped(amax_of_range(lo, hi), x.dtype)
            # numpy has no bf16 (ModelOpt fails there): its float32 value
            self._amaxs.append(amax.float().cpu().numpy() if amax.dtype == torch.bfloat16
                               else amax.cpu().numpy())
        self._dtype = x.dtype

    def _shaped(self, amax: torch.Tensor, dtype) -> torch.Tensor:
        amax = amax.to(dtype)
        return amax.reshape(self._amax_shape) if amax.numel() > 1 else amax.reshape(())

    def compute_amax(self) -> torch.Tensor | None:
        """The ``max |x|`` of every tensor collected (ModelOpt's dtype and shape), None before
        any."""
        if self._amax_shape is None:
            return None
        return self._shaped(amax_of_range(self.min_vals, self.max_vals), self._dtype)

    def reset(self) -> None:
        super().reset()
        self._amax_shape = None


@register("modelopt:HistogramCalibrator")
class HistogramCalibrator(ModelOptCalibrator, AppendingFirstGrid, HistogramObserverBase):
    """ModelOpt's HistogramCalibrator: one ``|x|`` histogram from 0, bins of the first
    batch's width appended past it; ``compute_amax`` by entropy, MSE or percentile."""

    absolute = True  # |x| from 0, signed or unsigned
    GROW_LIMIT = 64  # ModelOpt appends without bound; the estimators' cost grows with bins

    def __init__(self, num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None,
                 skip_zeros=False, torch_hist=True, **kwargs):
        if axis is not None:
            raise NotImplementedError("Calibrator histogram collection only supports per "
                                      f"tensor scaling (modelopt HistogramCalibrator: axis must "
                                      f"be None, got {axis!r})")
        if torch_hist is not True:
            raise ValueError(f"modelopt HistogramCalibrator: only torch_hist=True (torch.histc "
                             f"bins) is supported, got torch_hist={torch_hist!r}")
        check_int("modelopt HistogramCalibrator", "num_bins", num_bins, 16)
        self.grow_method = grow_method  # deprecated in ModelOpt, and ignored there
        super().__init__(num_bits, axis, unsigned, bins=num_bins, grid="first",
                         skip_zeros=skip_zeros, **kwargs)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add ``|x|`` to the histogram (bins of the same width appended past its end)."""
        self(x)

    def compute_amax(self, method: str, *, stride: int = 1, start_bin: int = 128,
                     percentile: float = 99.99) -> torch.Tensor | None:
        """ModelOpt's amax of the histogram by ``method`` (a float32 0-d CPU tensor), None
        before data."""
        who = f"modelopt {type(self).__name__}"
        if method not in METHODS:
            raise TypeError(f"Unknown calibration method {method!r} ({who}: method must be "
                            f"one of {list(METHODS)})")
        if method == "percentile":
            check_percentile(who, "percentile", percentile)
        check_entropy_options(who, num_bits=self._num_bits, start_bin=start_bin, stride=stride)
        if not self.has_observed:
            return None
        self.check_ready()
        with torch.inference_mode():
            hist = self.current_histogram()
            if start_bin > hist.counts.shape[1]:
                raise ValueError(f"{who}: start_bin={start_bin} leaves no candidate in a "
                                 f"histogram of {hist.counts.shape[1]} bins")
            if method == "entropy":
                amax = entropy_amax(hist, num_bits=self._num_bits, unsigned=self._unsigned,
                                    start_bin=start_bin, stride=stride, trim=False)
            elif method == "mse":
                amax = histogram_mse_range(hist, self.spec, start_bin=start_bin, stride=stride,
                                           refine=None)[1]
            else:
                amax = percentile_range(hist, percentile, convention="lower")[1]
        return amax.reshape(()).float().cpu().clone()

    def _estimate(self, hist):  # forward / qparams: ModelOpt's default method, entropy
        amax = entropy_amax(hist, num_bits=self._num_bits, unsigned=self._unsigned, trim=False)
        return (torch.zeros_like(amax) if self._unsigned else -amax), amax
