"""llm-compressor 0.14's observers (the installed generation), computed by quantscope.

``Observer.load_from_registry("minmax", base_name="weight", args=QuantizationArgs(...))``
as in llm-compressor 0.14: calling an observer updates its statistics and returns the
observer; ``get_qparams()`` returns ``{"scale", "zero_point", "global_scale"}`` (and asserts
"No statistics available" before any data); the statistics are plain attributes named by
``_stats_attrs`` (``min_vals`` / ``max_vals``, replaced on every update, never written in
place, assignable), with ``has_statistics``, ``get_statistics``, ``delete_statistics``,
``update_statistics_from_observed`` (on the ``(observations, *qparam_shape, elements)``
view of :func:`flatten_for_calibration`), ``get_global_scale``, ``attach`` / ``detach``,
``sync_activation_stats`` (async all-reduce handles of ``_act_sync_dict``) and a
``fusion_handler``. Integer tensors are observed; scales come in the statistics' float
dtype (float32 for integer data), zero points in compressed-tensors' ``zp_dtype``.

The seed's earlier generation (``forward`` returns ``(scale, zero_point)``) is
:mod:`quantscope.compat.llmcompressor_legacy`, registered in quantscope's registry as
``"llmcompressor:<name>"``; these classes live in this module's own registry
(:meth:`Observer.load_from_registry`), as llm-compressor's do in theirs.

The search (MSE), the qparams formulas and the spec translation are quantscope's
(:func:`~quantscope.estimators.mse.mse_search` in llm-compressor's exact mode,
:func:`~quantscope.qparams.qparams_from_range`, :func:`llmcompressor_spec`). The search is
their eager one bit for bit on the CPU; off it, the same rules on the ``quantscope::`` ops
(Triton on CUDA), which may keep the other candidate of a near tie
(:mod:`quantscope.estimators.mse_ops`). ``triton_error_buffer`` (their CUDA kernel's
per-group patience) is kept, not followed: the rules do not depend on the device.

Where the results differ from llm-compressor's, by choice:

* bfloat16 / float16 statistics: compressed-tensors computes qparams in that dtype (a
  rounding after each operation) and llm-compressor's MSE search prices candidates in it.
  Asymmetric integer scales and zero points are computed so too
  (:func:`~.llmcompressor_base.half_qparams`: ``max - min`` rounded to the dtype before the
  division, the zero point from that scale in it): theirs bit for bit. Symmetric integer
  scales, computed in float32 and rounded once to the dtype (before a ``scale_dtype``, as
  theirs), are equal (one correctly rounded quotient; ``tensor_group``: with their global
  scale, computed in the dtype, as theirs); NVFP4's block scales differ by at most one fp8
  step, its float32 global scale from theirs, computed in the dtype, by one unit of the
  dtype. The MSE and imatrix searches price each candidate as theirs, in the dtype (the
  MSE's error sums too; a float ``scale_dtype`` and MX's E8M0 scales rounded from the
  dtype's scale), so their ranges are theirs bit for bit
  (:func:`~.llmcompressor_imatrix.half_search`). MX scales of blocks whose amax the dtype
  holds only as a subnormal (float16: below 2**-14) are theirs in qparams and searches alike
  (:func:`~.llmcompressor_parts.mx_scale_in_dtype`: 1 below 1.5 * 2**-15, where their
  rounding in the dtype gives 0; never 0). A ``scale_dtype`` wider than the
  statistics' dtype (float32 on bfloat16 / float16, bfloat16 on float16), where their clamp
  to its range raises, gives their formula's scales without the clamp (it changes no value
  there), symmetric and asymmetric alike.
* a ``group_size`` that does not divide the observed columns raises
  :class:`~.llmcompressor_parts.GroupSizeError` naming both (a ``ValueError``, and a
  ``RuntimeError`` as theirs, torch's bare ``unflatten`` error).
* NaN / inf input raises ``ValueError`` ("observed NaN or inf values", naming the observer)
  in ``forward``, as quantscope's native observers refuse it; llm-compressor's give NaN /
  inf scales. float32 statistics: bit for bit (tiny scales kept, only 0 ones made their eps).
* float64 statistics: the scales are float64 (their dtype and eps) but computed in float32
  (quantscope's formulas are float32): within float32's rounding, but an MSE search may
  choose another candidate where candidates tie in float32 and not in float64 (a constant
  row: 12 % off theirs, both near exact on it); finite values beyond float32's range raise
  ``ValueError`` naming the observer.
* MXFP8: compressed-tensors rounds the block amax with fp4's one mantissa bit for every
  element type; quantscope's E8M0 ``even`` rule uses the element's own (three for e4m3),
  so a block whose amax has a mantissa in ``[1.5, 1.9375)`` gets half their scale.
* MX blocks whose amax is 57344 or more in float16, or 1.75 * 2**127 or more in bfloat16 /
  float32: compressed-tensors rounds it to the dtype's inf (an inf scale, NaN after fake
  quantization); quantscope's scale is the finite E8M0 one (fp4: 2**14 / 2**126).
* asymmetric fp8 (``type="float", symmetric=False``) is refused: a float format has no
  zero point in quantscope; so is an integer ``scale_dtype`` outside MX (compressed-tensors
  rounds such scales to integers, a scale encoding quantscope does not have), and a float
  ``zp_dtype`` for an asymmetric integer format (compressed-tensors keeps those zero points
  unrounded, NaN for an all-zero range; quantscope's zero point is a code).
* integer tensors under the MSE searches: llm-compressor casts each fake-quantized
  candidate back to the integer dtype (truncating) before pricing it; quantscope prices
  the float32 fake-quantized values, so the chosen range can differ.
* integer and bool tensors are observed as their float32 values: compressed-tensors takes
  ``max - min`` in an integer dtype (an int8 range of 128 wraps to a negative scale) and
  refuses a bool one (``abs`` / subtraction not implemented), and its ``tensor_group`` rule
  reads ``finfo`` of the dtype (``TypeError``); quantscope's scales are those of the values.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch
from torch.distributed import ReduceOp

from ..estimators.mse import compat_patience, mse_search, shrink_factors
from ..stats.minmax import unit_minmax
from . import enum_name, field
from .llmcompressor_base import (
    HALF_SCALES,
    Observer,
    check_expanded_range,
    lerp,
    statistics_dtype,
    statistics_units,
)
from .llmcompressor_imatrix import IMatrixMixin, half_search, prices_in_dtype
from .llmcompressor_parts import (
    FUSED_LAYER_NAMES,
    FusionHandler,
    flatten_for_calibration,
    fuse_weight_observers,
)
from .llmcompressor_spec import llmcompressor_spec, search_spec, tiny_scales_kept, unit_search_spec

__all__ = [
    "FUSED_LAYER_NAMES",
    "FusionHandler",
    "IMatrixMSEObserver",
    "MemorylessMSEObserver",
    "MemorylessMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedIMatrixObserver",
    "NVFP4ExpandedMSEObserver",
    "Observer",
    "StaticMinMaxObserver",
    "flatten_for_calibration",
    "fuse_weight_observers",
    "llmcompressor_spec",
]


@Observer.register("memoryless_minmax")
class MemorylessMinMaxObserver(Observer):
    """The min / max of the last observed value."""

    _act_sync_dict: ClassVar[dict] = {}

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        self.min_vals, self.max_vals = _min_max(observed)


@Observer.register("static_minmax")
class StaticMinMaxObserver(MemorylessMinMaxObserver):
    """The min / max of every observed value."""

    _act_sync_dict: ClassVar[dict] = {"min_vals": ReduceOp.MIN, "max_vals": ReduceOp.MAX}

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        lo, hi = _min_max(observed)
        if self.has_statistics:  # new tensors: one read before this call keeps its values
            lo, hi = torch.minimum(lo, self.min_vals), torch.maximum(hi, self.max_vals)
        self.min_vals, self.max_vals = lo, hi


@Observer.register("minmax")
class MinMaxObserver(Observer):
    """Moving average of min / max (``averaging_constant``, default 0.01; llm-compressor's lerp)."""

    _act_sync_dict: ClassVar[dict] = {"min_vals": ReduceOp.AVG, "max_vals": ReduceOp.AVG}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.avg_constant = self.args.observer_kwargs.get("averaging_constant", 0.01)

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        self._average(*_min_max(observed))

    def _average(self, lo, hi):
        if self.has_statistics and self.avg_constant != 1.0:
            lo = lerp(self.min_vals, lo, self.avg_constant)
            hi = lerp(self.max_vals, hi, self.avg_constant)
        self.min_vals, self.max_vals = lo, hi


def _min_max(observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-qparam min and max over observations and elements, in the observed dtype."""
    units, shape = statistics_units(observed)
    if not observed.is_floating_point():  # integer data: amin / amax keep its dtype
        return units.amin(-1).reshape(shape), units.amax(-1).reshape(shape)
    lo, hi = unit_minmax(units)  # float32 for bf16 / fp16 units: exact in their dtype
    return lo.reshape(shape).to(units.dtype), hi.reshape(shape).to(units.dtype)


def _default_error_buffer(args) -> float:
    """llm-compressor's per-format default Triton patience (kept as an attribute: the eager
    search, the one quantscope runs, ignores it)."""
    fp4 = enum_name(field(args, "type")) == "float" and field(args, "num_bits") == 4
    return 1.00 if fp4 else 0.30


@Observer.register("memoryless_mse")
class MemorylessMSEObserver(Observer):
    """llm-compressor's MSE grid search, exactly on float tensors (global patience, norm 2.4,
    their error sum)."""

    _act_sync_dict: ClassVar[dict] = {}
    #: (maxshrink, patience, grid, norm, triton_error_buffer, expand) defaults
    _defaults = (0.20, 5, 100.0, 2.4, None, 1.0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kw = self.args.observer_kwargs
        maxshrink, patience, grid, norm, buffer, expand = self._defaults
        self.maxshrink = kw.get("maxshrink", maxshrink)
        self.patience = kw.get("patience", patience)
        self.grid = kw.get("grid", grid)
        self.norm = kw.get("norm", norm)
        self.triton_error_buffer = kw.get(
            "triton_error_buffer", _default_error_buffer(self.args) if buffer is None else buffer)
        self.expand = kw.get("expand", expand)
        if self.expand < 1.0:
            raise ValueError(f"expand value must be at least 1.0, got {self.expand}")
        spec = search_spec(self.args, self.base_name)  # tensor_group's scale_dtype dropped
        strategy = enum_name(field(self.args, "strategy"))
        #: the half-precision dtypes whose candidates are priced as llm-compressor's are
        self._in_dtype = {dt for dt in HALF_SCALES if prices_in_dtype(spec, dt, strategy)}
        self._search_spec = unit_search_spec(spec)
        self._float_search_spec = tiny_scales_kept(self._search_spec)  # (mse_search's)

    def _search(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = statistics_dtype(observed)  # first: it refuses complex data
        observed_units, shape = statistics_units(observed)
        units = observed_units.float()
        lo, hi = unit_minmax(units)
        check_expanded_range(self, lo, hi, self.expand)
        if observed.dtype in self._in_dtype:  # their steps p = 1 - i / grid, i < maxshrink * grid
            factors = shrink_factors(self.maxshrink, self.grid)[1:]  # p = 1: the incumbent
            lo, hi = half_search(observed_units, None, self._search_spec, factors,
                                 norm=self.norm, expand=self.expand,
                                 patience=compat_patience(self.patience), dtype_sums=True)
            return lo.reshape(shape), hi.reshape(shape)
        res = mse_search(units, lo, hi, self._float_search_spec, maxshrink=self.maxshrink,
                         grid=self.grid, norm=self.norm, patience=self.patience,
                         expand=self.expand, per_unit_patience=False,
                         compat="llmcompressor")
        return res.lo.reshape(shape).to(dtype), res.hi.reshape(shape).to(dtype)

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        self.min_vals, self.max_vals = self._search(observed)


@Observer.register("mse")
class MovingAverageMSEObserver(MemorylessMSEObserver):
    """The MSE search, then llm-compressor's lerp (``averaging_constant``, default 0.01)."""

    _act_sync_dict: ClassVar[dict] = {"min_vals": ReduceOp.AVG, "max_vals": ReduceOp.AVG}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.avg_constant = self.args.observer_kwargs.get("averaging_constant", 0.01)

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        MinMaxObserver._average(self, *self._search(observed))


@Observer.register("nvfp4_expanded_mse")
class NVFP4ExpandedMSEObserver(MemorylessMSEObserver):
    """The MSE search from 1.8x the range down to 0.8x (grid 200, patience 1000)."""

    _defaults = (1 - 0.8 / 1.8, 1000, 200.0, 2.4, 1.00, 1.8)


@Observer.register("fouroversix")
def _fouroversix(*args, **kwargs) -> NVFP4ExpandedMSEObserver:
    """llm-compressor's alias of ``nvfp4_expanded_mse`` (it warns the same way)."""
    warnings.warn("The 'fouroversix' observer is an alias for 'nvfp4_expanded_mse'",
                  UserWarning, stacklevel=2)
    return NVFP4ExpandedMSEObserver(*args, **kwargs)


@Observer.register("imatrix_mse")
class IMatrixMSEObserver(IMatrixMixin, Observer):
    """The MSE search weighted by each input channel's importance ``E[x^2]``, collected by
    :meth:`attach` (llm-compressor 0.14's ``imatrix_mse``; see :mod:`.llmcompressor_imatrix`)."""

    _act_sync_dict: ClassVar[dict] = {"_imatrix_sum": ReduceOp.SUM,
                                      "_imatrix_count": ReduceOp.SUM}
    #: option defaults over llm-compressor's imatrix_mse ones
    _imatrix_defaults: ClassVar[dict] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_imatrix(self.args.observer_kwargs, self._imatrix_defaults)

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        self.min_vals, self.max_vals = self.imatrix_range(observed)


@Observer.register("nvfp4_expanded_imatrix")
class NVFP4ExpandedIMatrixObserver(IMatrixMSEObserver):
    """``imatrix_mse`` from 1.8x the range down to 0.8x (grid 200, norm 2.4, patience 1000)."""

    _imatrix_defaults: ClassVar[dict] = {"expand": 1.8, "maxshrink": 1 - 0.8 / 1.8,
                                         "grid": 200, "norm": 2.4, "patience": 1000}
