"""NVIDIA ModelOpt 0.47 (TensorRT pytorch-quantization) calibrators, with their names,
signatures and ``collect`` / ``compute_amax`` / ``reset`` API.

``MaxCalibrator(num_bits=8, axis=None, unsigned=False, track_amax=False)``: the running
``max |x|``; ``axis`` names the axes KEPT (an int or a tuple, negative ones counted from the end;
``None`` or ``()``: per tensor), and ``compute_amax()`` returns ModelOpt's value, dtype and
shape (the kept axes' sizes, the others 1; a 0-d tensor when it holds one value; None before
data; ``_calib_amax`` reads the same). A batch whose amax shape changes is a ``RuntimeError``,
NaN / inf an :class:`ModelOptArgumentError` (an ``AssertionError``, as ModelOpt asserts), a
bool one an :class:`~quantscope.compat.UnsupportedInputError` (a ``NotImplementedError`` as
ModelOpt's ``abs``). Integer tensors are taken (their amax in their dtype, as ModelOpt's), fp8
ones read as float32 (ModelOpt's upcast); batches of several dtypes give an amax in their
promoted dtype (ModelOpt's ``torch.max``: float32 then fp16 is float32). An axis named twice
(``(1, 1)``, or ``(1, -1)`` on 2-D) is kept once. A meta tensor gives a meta amax of that shape
and dtype (ModelOpt's initialization branch: it replaces what was collected; a real batch after
it is a ``RuntimeError``, as ModelOpt's).

``HistogramCalibrator(num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None,
skip_zeros=False, torch_hist=True)``: per tensor only (``axis`` is ModelOpt's
``NotImplementedError``); a ``num_bins`` histogram of ``|x|`` (integer, bool and fp8 tensors: of
their float32 values, fp8 upcast as ``MaxCalibrator`` upcasts it) over the first batch's
``[0, max |x|]`` (``torch.histc``'s bins), later batches past it append bins of the same width,
``ceil(max |x| / w)`` in all as ModelOpt counts them in float32 (the native ``grid="first"``
histogram, grown as Horizon's KL histogram grows); ``_calib_hist`` / ``_calib_bin_edges`` read
it as ModelOpt's (float32 counts, edges). A batch with NaN / inf is refused at ``collect``: a
first one with ModelOpt's ``RuntimeError``, a later inf with its ``OverflowError``. So is a
finite batch whose grown grid ModelOpt cannot make, ``collect`` and ``forward`` alike, on any
device, nothing changed: a bin count ``ceil(max |x| / w)`` past float32's range (a first grid
of a positive width far below the data: data near float32's max, or a subnormal first batch
then normal data) with ModelOpt's ``OverflowError`` (its ``int(inf)``; ModelOpt's histogram
stays as it was), and an end past it (``max |x| + width`` overflows: data near its max) with
its ``RuntimeError`` (``unsupported range``; ModelOpt keeps its histogram too, but not its
bin count: its next batch inside the grid is binned into the failed batch's count, against
the old edges).
``compute_amax(method, *, stride=1, start_bin=128, percentile=99.99)`` runs quantscope's
estimators on it: ``"entropy"`` (:func:`~quantscope.estimators.entropy.entropy_amax`),
``"percentile"`` (``0 <= percentile <= 100``; the left edge of the bin reaching it, ModelOpt's
``edges[searchsorted]``), ``"mse"``
(:func:`~quantscope.estimators.histogram_mse.histogram_mse_range`: every bin centre from
``start_bin`` scored, unclipped as ModelOpt's; the centre is ModelOpt's float32
``(edges[i] + edges[i + 1]) / 2``); the amaxes are ModelOpt's edges' bits (its linspace's,
then its arange's float32 steps). ``start_bin`` / ``stride`` are entropy's and mse's; a
``start_bin`` that leaves no candidate (entropy: past the bins; mse: at or past them) is a
``ValueError`` (ModelOpt's numpy ``argmin`` of nothing), as is ``qparams()`` on fewer than 128
bins (its entropy starts there, as ModelOpt's default; percentile and mse take any). The
amax is a float32 0-d tensor on the CPU, as ModelOpt's; an unknown method is ModelOpt's
``TypeError``. ``grow_method`` is ignored, as ModelOpt (deprecated there).

``_num_bits``, ``_axis`` and ``_unsigned`` may be set after construction, as ModelOpt's
``TensorQuantizer`` does: the spec follows, and a new axis starts from no data (the state is
per unit of the old one; ModelOpt keeps its amax, and a next batch of another amax shape is
its ``RuntimeError``); the same axis, however spelled for the data's dims (``-1`` and ``1`` on
2-D), keeps it (one axis named as several, ``(1, -1)`` for ``1``, or ``-1`` for ``0`` on
1-D data, views it otherwise: a new axis). ``unsigned`` takes True / False (numpy's too) and
1 / 0. An unpickled state is checked as ``load_state_dict`` checks one: its buffers and amax
shape must fit its arguments (else a ``ValueError`` naming the field).

Both are observers too: ``forward`` / ``qparams()`` run the native observer (the histogram's
estimate is the entropy amax); they register as ``"modelopt:MaxCalibrator"`` and
``"modelopt:HistogramCalibrator"``. ``forward(x)`` is ``collect(x)`` without the checks that
read values on the host: the same state (``MaxCalibrator``: the same view by ``axis``, amax
shape and dtype; ``track_amax`` tracks it too), so ``compute_amax()``, a copy and a pickle read
it; it takes the floating-point tensors the native observer takes (integers:
``collect``), and NaN / inf there is recorded and refused by ``qparams()`` /
``compute_amax()`` (a ``ValueError``), as every observer's. As ModelOpt's calibrators (plain
objects), they save and load no state: a ``TensorQuantizer`` built with one (its config takes a
calibrator class) has ModelOpt's state_dict keys, and loads ModelOpt's strictly. Saved whole
(``torch.save``), they load with ``torch.load(weights_only=True)``, as ModelOpt's: both classes are
torch safe globals (these two only), and their pickles hold ModelOpt's arguments (the spec is
rebuilt from them), no other quantscope class; but ``track_amax=True``'s per-batch numpy amaxes,
which ``weights_only`` refuses in ModelOpt's pickles too.

On the CPU, a ``HistogramCalibrator`` batch on its first grid (float32; bf16 / fp16 read as
their float32 copy; integer and fp8 ones as ``collect`` reads them), growing it or not, takes a
cached step in ``collect`` and ``forward`` (:mod:`quantscope.observers.first_step`, where
``self(x)`` is ``forward``: no hooks): the C min / max pass, the grid grown from floats
(:mod:`.modelopt_grid`) and one C pass of ``torch.histc`` of ``|x|`` into the int64 counts,
the state bit for bit the general path's (``cached_cpu_step = False`` keeps that path). A NaN
/ inf batch changes nothing there (its buffers stay the tensors they were, made under
``torch.inference_mode`` or not) and is refused (``collect``) or recorded (``forward``) as
above. One thread, 256-1K values: 23-25 us a call (ModelOpt's ``collect``: 31-37 us), 48-51
us where each batch grows the grid (ModelOpt's: 49.5-56 us); docs/benchmarks.md, histogram.

Data that is all subnormal (a first grid whose float32 width ``max |x| / num_bins``
underflows) is estimated on that histogram scaled by a power of two
(:mod:`quantscope.observers.histogram_estimate`): the bin found is that of the data scaled
into the normal range, its value ModelOpt's edge. ModelOpt's ``linspace`` step underflows
there too, so its edges read 0 below the middle of the grid and ``max |x|`` above it: an
amax in the lower half is ModelOpt's 0, with a warning that says so.

Known differences: ModelOpt's ``"mse"`` calls ``fake_tensor_quant(centers, amax, num_bits,
unsigned)`` whose third parameter is now ``bias``, so it returns its first candidate
whatever the data; quantscope scores the candidates as documented (all bin centres from
``start_bin``, the first minimum). ``"entropy"`` where a candidate has no counts below it:
ModelOpt picks that NaN divergence, quantscope scores it infinite
(:mod:`~quantscope.estimators.entropy`); where every candidate's divergence is infinite,
ModelOpt keeps its last candidate, quantscope the right edge of the last non-empty bin.
``"percentile"`` where ``p`` percent of the total
is a whole count: quantscope's test is exact, ModelOpt's float64 ``cumsum(hist / total)``
can fall short of it and take the next non-empty bin. The state is float32: float64 amaxes
and integer ones past ``2 ** 24`` are those rounded to float32 (an integer amax rounded past
its dtype's top is the top). A signed integer minimum (int8's -128) is refused by
``MaxCalibrator`` (ModelOpt's ``abs`` keeps it negative and its amax ignores it) and counted
as ``|x|`` by ``HistogramCalibrator`` (ModelOpt drops it). A later histogram batch with NaN is
refused (ModelOpt's ``histc`` drops the NaN silently). ``track_amax`` keeps bf16 amaxes as
float32 arrays (numpy has no bf16: ModelOpt fails). An axis out of range is a
``ValueError`` (ModelOpt reduces every axis), and so is an empty batch at
``MaxCalibrator.collect`` (ModelOpt's torch ``RuntimeError`` / ``IndexError``; it keeps an
empty amax for a ``(0, n)`` batch with ``axis=0``). ``reset()`` restores ``num_bins`` (ModelOpt
keeps the grown count for the next first batch). A first histogram of only zeros, or of a
max ``|x|`` so small that its bin width rounds to 0 in float32 (below ``num_bins * 2 **
-150``: 1.4e-42 at the default 2048 bins; a grid of width 0 holds no later data either),
later grown, and one growing past ``GROW_LIMIT x num_bins`` (a count within float32's range),
move once to quantscope's power-of-two grid of ``num_bins`` bins, approximately (ModelOpt:
``OverflowError`` on every later batch past its grid, keeping its first histogram; appends
on, or fails to allocate them); ``_calib_hist`` /
``_calib_bin_edges`` then read that grid, and the mse method's candidates stop at its top
occupied bin, as ModelOpt's grid ends at the data's max. ``num_bins`` is at least 2
(ModelOpt: any; that grid needs two bins).
``torch_hist`` takes True or 1, as ``unsigned``; ``torch_hist=False`` (ModelOpt's numpy
path, a ``[min |x|, max |x|]`` grid) is not supported. fp8 histogram batches are taken
(ModelOpt's ``histc`` fails on them: torch's ``"min_all" not implemented``).
``num_bits=(E, M)`` (ModelOpt's fp8 / fp4 configs) takes that float format: the amax is the
same max, the entropy method (integer codes) refuses it.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_int
from ..estimators.entropy import check_options as check_entropy_options
from ..estimators.entropy import entropy_amax
from ..estimators.histogram_mse import histogram_mse_range, occupied_range
from ..estimators.percentile import percentile_range
from ..observers.first_step import calls_forward
from ..observers.first_step import cpu_step as first_step
from ..observers.histogram import HistogramObserverBase
from ..observers.minmax import StaticMinMaxObserver
from ..observers.registry import register
from ..qparams import amax_of_range
from ..stats import histogram as H
from ..stats.minmax import holds_non_finite, unit_minmax
from . import UnsupportedInputError
from .horizon import AppendingFirstGrid
from .modelopt_base import (
    ModelOptArgumentError,
    ModelOptCalibrator,
    _as_dtype,
    _float_values,
    _is_integer,
    _squeezed,
    _upcast,
)
from .modelopt_grid import ModelOptGrid
from .modelopt_spec import _check_percentile, _per_tensor, _plan, modelopt_flag, modelopt_spec

__all__ = [
    "HistogramCalibrator",
    "MaxCalibrator",
    "ModelOptArgumentError",
    "ModelOptCalibrator",
    "modelopt_spec",
]

METHODS = ("entropy", "mse", "percentile")
START_BIN = 128  # ModelOpt's first candidate bin by default (compute_amax's; qparams' entropy)


@register("modelopt:MaxCalibrator")
class MaxCalibrator(ModelOptCalibrator, StaticMinMaxObserver):
    """ModelOpt's MaxCalibrator: the running ``max |x|`` over the axes not kept."""

    def __init__(self, num_bits=8, axis=None, unsigned=False, track_amax=False, **kwargs):
        super().__init__(num_bits, axis, unsigned, **kwargs)
        self._track_amax = bool(track_amax)
        if self._track_amax:
            self._amaxs = []
        self._amax_shape = None  # ModelOpt's amax shape of the first batch
        self._dtype = None  # the batches' dtypes promoted (ModelOpt's torch.max of the amaxes)
        self._meta_amax = None  # a meta batch's amax (ModelOpt's initialization branch)

    _ndim: int | None = None  # the batches' dims (_same_axis); a class default: older pickles

    def _same_axis(self, before, after) -> bool:
        # read for the data's dims: -1 and 1 on 2-D are one axis (ModelOpt keeps its amax)
        if self._ndim is None:  # no data: nothing to keep
            return super()._same_axis(before, after)
        try:
            return _plan(before, self._ndim) == _plan(after, self._ndim)
        except ValueError:  # out of range for the data: a new axis (its next batch says so)
            return False

    @property
    def amaxs(self) -> list:
        """Each batch's amax as a numpy array (``track_amax=True`` only, as ModelOpt)."""
        if not self._track_amax:
            raise AttributeError("modelopt MaxCalibrator: amaxs are kept with track_amax=True")
        return self._amaxs

    @property
    def _calib_amax(self) -> torch.Tensor | None:
        """ModelOpt's attribute: the amax so far (:meth:`compute_amax`), read only."""
        return self.compute_amax()

    def _view(self, x: torch.Tensor):
        """``(x as the layout's input, amax shape)`` by :func:`_plan`: several axes named (the
        spec's ``Channel(0)``; one kept too, as ``(1, -1)`` on 2-D) are moved to the front and
        flattened into one; none kept (or all: torch's ``amax`` over no dim reduces every
        one, as ModelOpt's) is per tensor."""
        nd = x.dim()
        kept, how = _plan(self._axis, nd)
        if how == "tensor":
            return x, ()
        if how in ("row", "column"):  # one unit on the layout's channel axis (-1: a column)
            return (x.reshape(-1, 1) if how == "column" else x.reshape(1, -1)), ()
        shape = tuple(n if i in kept else 1 for i, n in enumerate(x.shape))
        if how == "as is":  # the spec's Channel(axis): x as it is
            return x, shape
        rest = [i for i in range(nd) if i not in kept]
        k = torch.Size(x.shape[i] for i in kept).numel()
        return x.permute(*kept, *rest).reshape(k, x.numel() // max(k, 1)), shape

    def _check_values(self, x: torch.Tensor) -> None:
        """ModelOpt's asserts (NaN / inf); an empty batch (ModelOpt's amax of no elements
        fails) and a signed integer minimum, whose ``|x|`` the dtype cannot hold (ModelOpt's
        amax ignores it), are refused too."""
        if not x.numel():
            raise ValueError(f"modelopt MaxCalibrator: collect(x): x has no elements (shape "
                             f"{tuple(x.shape)}); expected a tensor with data, whose max |x| "
                             f"is an amax")
        if x.is_floating_point() and holds_non_finite(x):
            raise ModelOptArgumentError(f"modelopt MaxCalibrator: detected NaN or inf values "
                                        f"in the tensor (NaN: {bool(torch.isnan(x).any())})")
        if _is_integer(x) and x.numel():
            low = torch.iinfo(x.dtype).min
            if low < 0 and bool((x == low).any()):
                raise ValueError(f"modelopt MaxCalibrator: x holds {low}, whose |x| does not "
                                 f"fit its dtype {x.dtype} (ModelOpt's amax ignores it)")

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Take ``x``'s ``max |x|`` over the axes not kept into the running max."""
        if not isinstance(x, torch.Tensor):
            self.check_input(x)  # its TypeError names what x is (before _view reads x.dim())
        if x.dtype == torch.bool:  # ModelOpt's abs of a bool tensor fails
            raise UnsupportedInputError("modelopt MaxCalibrator: collect(x): x is a bool "
                                        "tensor, which has no |x| (ModelOpt's abs raises "
                                        "NotImplementedError); expected numbers")
        if x.is_meta:
            return self._collect_meta(x)
        x = _upcast(x)
        view, shape = self._shaped_view(x)
        self._check_values(x)
        self._step(x, view, shape)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The native observer's step (module doc): ``x`` viewed and kept as :meth:`collect`
        keeps it, so ``compute_amax``, a copy and a pickle read it; without collect's checks,
        which read values on the host (NaN / inf is recorded, and refused by ``qparams()`` /
        ``compute_amax()``), and only on the floating-point tensors the native observer takes.
        Not marked ``only_observes``: the grouped path's per-layout min / max would skip the
        view and the bookkeeping. Returns ``x``."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()) \
                or x.is_meta:  # the native path refuses it, or observes nothing (empty)
            return super().forward(x)
        values = _upcast(x)
        with torch.no_grad():  # as collect: a weight's grad has no place in numpy's amaxs
            self._step(values, *self._shaped_view(values))
        return x

    def _shaped_view(self, x: torch.Tensor):
        """``(x's float values as the layout's input, ModelOpt's amax shape)``; a shape other
        than the batches' before is ModelOpt's ``RuntimeError`` (as is data after a meta
        batch)."""
        if self._meta_amax is not None:  # ModelOpt: its meta amax and the batch's clash
            raise RuntimeError("modelopt MaxCalibrator: a meta tensor was collected (ModelOpt's "
                               "initialization); reset() before collecting data")
        view, shape = self._view(_float_values(x))
        shape = _squeezed(shape)
        if self._amax_shape is not None and shape != self._amax_shape:
            raise RuntimeError("amax shape changed!")  # ModelOpt's words
        return view, shape

    def _step(self, x: torch.Tensor, view: torch.Tensor, shape: tuple) -> None:
        """The native step on ``view``, then ModelOpt's record of ``x`` (collect and forward;
        every check before the state changes: a refused batch leaves it as it was)."""
        tracked = self._batch_amax(view, shape, x.dtype) if self._track_amax else None
        super().forward(view)
        self._amax_shape, self._ndim = shape, x.dim()
        # ModelOpt's torch.max(amax, batch amax) promotes: float32 then fp16 stays float32
        self._dtype = torch.promote_types(self._dtype or x.dtype, x.dtype)
        if tracked is not None:
            self._amaxs.append(tracked)

    def _batch_amax(self, view: torch.Tensor, shape: tuple, dtype):
        # as ModelOpt's amaxs: numpy in the batch's dtype (bf16, which numpy lacks: float32)
        self.check_input(view)  # the native refusals first (bool, complex, device)
        lo, hi = unit_minmax(self.spec.layout.to_units(view))
        amax = self._shaped(amax_of_range(lo, hi), dtype, shape)
        return (amax.float() if amax.dtype == torch.bfloat16 else amax).cpu().numpy()

    def _collect_meta(self, x: torch.Tensor) -> None:
        # ModelOpt keeps the meta amax in place of any (no data, no host read)
        shape = _squeezed(self._view(x)[1])
        self.reset()
        self._meta_amax = torch.empty(shape, dtype=x.dtype, device="meta")
        self._ndim = x.dim()

    def _shaped(self, amax: torch.Tensor, dtype, shape: tuple) -> torch.Tensor:
        # abs: all-zero data reads max(-0, 0) = -0; ModelOpt's max |x| is +0
        return _as_dtype(amax.abs(), dtype).reshape(shape)

    def compute_amax(self) -> torch.Tensor | None:
        """The ``max |x|`` of every tensor collected (ModelOpt's dtype and shape), None before
        any (a meta one after a meta batch)."""
        if self._meta_amax is not None:
            return self._meta_amax
        if self._amax_shape is None:
            return None
        self.check_ready()  # NaN / inf a forward recorded (collect refuses it at once)
        return self._shaped(amax_of_range(self.min_vals, self.max_vals), self._dtype,
                            self._amax_shape)

    def reset(self) -> None:
        super().reset()
        self._amax_shape = self._meta_amax = self._dtype = self._ndim = None

    def _pickled_fields(self, state) -> tuple[str, ...]:
        return (*super()._pickled_fields(state), "_track_amax", "_amax_shape", "_dtype",
                "_meta_amax", *(("_amaxs",) if state.get("_track_amax") else ()))

    def __setstate__(self, state):
        super().__setstate__(state)
        self._check_amax_shape()

    def _check_amax_shape(self) -> None:
        # unpickled: compute_amax reshapes the state to _amax_shape, so it is None exactly
        # before data, else ModelOpt's squeezed shape of one value per unit, 1 off the axes kept
        shape, units = self._amax_shape, self.min_vals.numel()
        if shape is None and not self.has_observed:
            return
        try:
            ok = self.has_observed and shape == _squeezed(shape) and math.prod(shape) == units \
                and all(type(n) is int and n > 0 for n in shape)
            if ok and shape:  # (its axis out of range for those dims: _plan's ValueError)
                kept = _plan(self._axis, len(shape))[0]
                ok = self._ndim in (None, len(shape)) and \
                    all(n == 1 for i, n in enumerate(shape) if i not in kept)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{self.describe()}: cannot unpickle a state whose _amax_shape is "
                             f"{shape!r}; expected None before data, else one value per unit "
                             f"({units}) on the axes kept by axis={self._axis!r} (1 on the "
                             f"others, () for one value)")


@register("modelopt:HistogramCalibrator")
class HistogramCalibrator(ModelOptCalibrator, ModelOptGrid, AppendingFirstGrid,
                          HistogramObserverBase):
    """ModelOpt's HistogramCalibrator: one ``|x|`` histogram from 0, bins of the first
    batch's width appended past it; ``compute_amax`` by entropy, MSE or percentile."""

    absolute = True  # |x| from 0, signed or unsigned
    scales_subnormal = True  # forward / qparams' entropy (observers.histogram_estimate)
    GROW_LIMIT = 64  # ModelOpt appends without bound; the estimators' cost grows with bins
    # ModelOpt takes any count (its tests: 19, 32); 2: the power-of-two grid a histogram may
    # move to spans (bins - 1) widths
    MIN_BINS = 2
    MIN_APPEND = 0  # ModelOpt's ceil(x_max / w) may be the bins it has (its top moves on)

    def __init__(self, num_bits=8, axis=None, unsigned=False, num_bins=2048, grow_method=None,
                 skip_zeros=False, torch_hist=True, **kwargs):
        _per_tensor(axis)
        if modelopt_flag(torch_hist) is not True:  # False: ModelOpt's numpy path
            raise ValueError(f"modelopt HistogramCalibrator: only torch_hist=True or 1 "
                             f"(torch.histc bins) is supported, got torch_hist={torch_hist!r}")
        check_int("modelopt HistogramCalibrator", "num_bins", num_bins, self.MIN_BINS)
        self.grow_method = grow_method  # deprecated in ModelOpt, and ignored there
        super().__init__(num_bits, axis, unsigned, bins=num_bins, grid="first",
                         skip_zeros=skip_zeros, **kwargs)

    def _configure(self, i, value):
        if i == 1:
            _per_tensor(value)
        super()._configure(i, value)

    def collect(self, x: torch.Tensor) -> None:
        """Add ``|x|`` to the histogram (bins of the same width appended past its end)."""
        x = _float_values(_upcast(x))
        # a CPU batch on the grid: forward's cached step, where self(x) is forward (a NaN /
        # inf batch is left to the checks below, nothing changed)
        if calls_forward(self) and first_step(self, x, HistogramObserverBase):
            return
        with torch.no_grad():
            if isinstance(x, torch.Tensor) and x.is_floating_point() and holds_non_finite(x):
                self._refuse_non_finite(x)
            self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one-unit CPU batches on the first grid: the cached C step (observers/first_step.py)
        if first_step(self, x, HistogramObserverBase):
            return x
        return super().forward(x)

    def _refuse_non_finite(self, x: torch.Tensor) -> None:
        nan = bool(torch.isnan(x).any())
        what = f"modelopt HistogramCalibrator: collect(x): x holds {'NaN' if nan else 'inf'}"
        if not self.has_observed:  # ModelOpt: histc's range [0, nan / inf] is not finite
            raise RuntimeError(f"{what}; the histogram's range would not be finite")
        if not nan:  # ModelOpt: int(inf / width) bins
            raise OverflowError(f"{what}; the grid cannot grow to it")
        raise ValueError(f"{what}; refused (ModelOpt's histc drops a later batch's NaN "
                         f"silently)")

    def compute_amax(self, method: str, *, stride: int = 1, start_bin: int = START_BIN,
                     percentile: float = 99.99) -> torch.Tensor | None:
        """ModelOpt's amax of the histogram by ``method`` (a float32 0-d CPU tensor), None
        before data."""
        who = f"modelopt {type(self).__name__}"
        if method not in METHODS:
            raise TypeError(f"Unknown calibration method {method!r} ({who}: method must be "
                            f"one of {list(METHODS)})")
        if method == "percentile":  # start_bin / stride are the entropy / mse candidates'
            percentile = _check_percentile(who, percentile)
        else:  # integer codes for entropy; mse prices the spec's format, (E, M) bits too
            bits = 8 if method == "mse" and isinstance(self._num_bits, tuple) else self._num_bits
            check_entropy_options(who, num_bits=bits, start_bin=start_bin, stride=stride)
        if not self.has_observed:
            return None
        self.check_ready()
        with torch.inference_mode():
            hist = self.current_histogram()
            if method != "percentile":
                self._check_start_bin(method, start_bin, hist.bins, f"compute_amax({method!r})",
                                      "use a smaller start_bin")
            amax = self._method_amax(hist, method, stride, start_bin, percentile)
        # abs: all-zero data reads -0 there; ModelOpt's is +0
        return amax.reshape(()).float().abs().cpu().clone()

    def _method_amax(self, hist, method, stride, start_bin, percentile) -> torch.Tensor:
        if method == "percentile" and percentile == 0:  # ModelOpt's edges[searchsorted(cdf,
            return hist.lo  # 0)]: the first edge
        # a first grid over subnormal-only data: its width underflows float32, so estimated
        # on it scaled by a power of two (the bin found is the same); the values are
        # ModelOpt's edges (_modelopt_value), and the native grid's widths are normal
        hist = H.normal_width(hist)[0]
        if method == "mse":  # bin centres, every one scored unclipped as ModelOpt's (module
            # doc), whose grid ends at the bin of the data's max; the power-of-two grid a
            # histogram moved to runs on past it: its empty top bins are no candidates there
            top = (torch.full_like(hist.hi, math.inf) if bool(self.linear_grid)
                   else occupied_range(hist)[1])
            # ModelOpt's quantizer takes amax / bound down to amax 2**-24 (below it, one
            # degenerate quantizer: those candidates tie and the first wins); the spec's eps
            # (float32's) had tied every candidate under bound * 1.2e-7 (e5m2: 6.8e-3)
            theirs = self.spec.replace(eps=2.0 ** -24 / self.spec.qmax)
            amax = histogram_mse_range(hist, theirs, start_bin=start_bin, stride=stride,
                                       refine=None, bounds=(hist.lo, top))[1]
        elif method == "entropy":
            amax = entropy_amax(hist, num_bits=self._num_bits, unsigned=self._unsigned,
                                start_bin=start_bin, stride=stride, trim=False)
        else:
            amax = percentile_range(hist, percentile, convention="lower")[1]
        return self._modelopt_value(amax, hist, centre=method == "mse")

    def _estimate(self, hist):  # forward / qparams: ModelOpt's default method, entropy
        self._check_start_bin("entropy", START_BIN, hist.bins, "qparams(): the entropy amax, "
                              "as ModelOpt's default", "construct it with num_bins >= "
                              f"{START_BIN}, or call compute_amax('entropy', start_bin=...), "
                              "'percentile' or 'mse' (any num_bins)")
        amax = entropy_amax(hist, num_bits=self._num_bits, unsigned=self._unsigned,
                            start_bin=START_BIN, trim=False)
        return (torch.zeros_like(amax) if self._unsigned else -amax), amax


# as ModelOpt's _Calibrator.__init_subclass__: these two only (their pickles name no other
# quantscope class: ModelOptCalibrator.__getstate__)
torch.serialization.add_safe_globals([MaxCalibrator, HistogramCalibrator])
