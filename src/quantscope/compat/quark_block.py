"""AMD Quark's block observers: ``PerBlockMXObserver`` (MX: E8M0, e4m3 or float32 block
scales) and ``PerBlockBFPObserver`` (BFP16), with Quark's ``amax`` (re-exported by
:mod:`quantscope.compat.quark`, whose docstring says how they follow Quark's)."""

from __future__ import annotations

import math

import torch

from ..observers.registry import register
from ..qparams import amax_of_range
from . import enum_name, field
from .quark_base import QuarkObserver, _DynamicOrStatic
from .quark_scales import (
    QuarkAssertionError,
    StateShapeError,
    UnsupportedElementError,
    _quark_rows,
    quark_bfp16_scale,
    quark_work_dtype,
)
from .quark_spec import _INT

__all__ = ["PerBlockBFPObserver", "PerBlockMXObserver"]


class _BlockAmax(_DynamicOrStatic):
    """Quark's block observers' ``amax`` (and attributes: block_size, axis, eps a float)."""

    _quark_base = "block"
    _quark_qscheme = "per_group"
    _quark_int_priced = ()  # Quark's block classes price their own dtypes
    _quark_fails_on = (torch.bool,)  # Quark's forward takes abs() of the blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Quark's static amax is torch.max(running amax, batch's): the dtypes promote (a
        # float32 amax for integer data: its first max is with a float32 zero)
        keeps = self.accumulates and self.has_observed and not self._starts_over(x)
        running = quark_work_dtype(self._input_dtype)
        kept = None
        if keeps and isinstance(x, torch.Tensor) and tuple(x.shape) != self.shape:
            kept = (self.min_vals.clone(), self.max_vals.clone(), self.shape)
            self._rows_as_in(tuple(x.shape))
        try:
            out = super().forward(x)
        except Exception:  # a refused batch leaves the state as it was, as Quark's
            if kept is not None and self.shape == kept[2]:
                self.min_vals.copy_(kept[0])
                self.max_vals.copy_(kept[1])
            raise
        new = self._input_dtype
        if keeps:
            self._input_dtype = (torch.promote_types(running, new) if new.is_floating_point
                                 else running)
        return out

    def _rows_as_in(self, shape) -> None:
        """Lay the state out in the unit order of ``shape``: Quark merges a batch of another
        shape with the same ``(rows, blocks)`` row by row in its own order (the axis swapped
        with the last dim: :func:`_quark_rows`), which for a 3-D or wider tensor pairs other
        native units. In place (the observers' rule for their buffers)."""
        layout = self.spec.layout

        def rows(of):  # the native unit at each of Quark's (row, block) positions
            ids = torch.arange(self.min_vals.numel()).reshape(layout.qparam_shape(of))
            return _quark_rows(ids, of, layout.axis).reshape(-1)

        perm = torch.empty(self.min_vals.numel(), dtype=torch.int64)
        perm[rows(shape)] = rows(self.shape)
        for t in (self.min_vals, self.max_vals):
            t.copy_(t[perm.to(t.device)])

    def _quark_state_key(self, shape):
        n = shape[self.spec.layout.axis]  # Quark's amax: (rows, blocks), the last padded
        return math.prod(shape) // n, -(-n // self.spec.layout.size)

    @property
    def amax(self) -> torch.Tensor:
        """Per-block absolute maximum, ``(rows, blocks)``; ``tensor(0.)`` before data."""
        self._check_present("amax")
        if not self.has_observed:
            return torch.tensor(0.0)
        # abs: a zero block's +0.0, as Quark's abs().max() (max(-0., 0.) can be -0.0)
        amax = amax_of_range(self.min_vals, self.max_vals).abs().to(self._range_dtype)
        return self._quark_shape(amax)

    @amax.setter
    def amax(self, value) -> None:
        self._refuse_assignment("amax")

    @amax.deleter
    def amax(self) -> None:
        self._delete("amax")


@register("quark:PerBlockMXObserver")
class PerBlockMXObserver(_BlockAmax):
    """Per-block absmax (``amax``, ``(rows, blocks)``); the scale by ``scale_format``: E8M0
    by ``scale_calculation_mode`` (MX, the native rule), else Quark's float32 / e4m3 / e5m3.
    Float elements only, as Quark's: an integer one (MXINT8) raises
    :class:`UnsupportedElementError`, an ``AssertionError`` as Quark's. The last block of an
    axis the group size does not divide is padded with zeros, and a static one starts over
    when its ``(rows, blocks)`` change, as Quark's."""

    _eps_argument = "used"
    _pads_blocks = True

    def _quark_attributes(self, qspec) -> dict:
        return {**super()._quark_attributes(qspec),
                "mx_element_dtype": field(qspec, "mx_element_dtype")}

    def __init__(self, qspec, device: torch.device | None = None, eps: float | None = None,
                 **native):
        if field(qspec, "ch_axis") is None:  # Quark asserts it (the axis of its blocks)
            raise QuarkAssertionError(f"{type(self).__name__}: the qspec needs a ch_axis (the "
                                      f"axis of the blocks), as Quark's asserts")
        dtype = enum_name(field(qspec, "dtype"))
        element = {"mx": enum_name(field(qspec, "mx_element_dtype")), "bfp16": "int8"}.get(
            dtype, dtype)
        if element in _INT:  # Quark asserts fp4 / fp6 / fp8 (checked before the spec, whose
            raise UnsupportedElementError(  # refusals of some of their scales are ValueErrors)
                f"{type(self).__name__}: Quark's PerBlockMXObserver takes float elements only "
                f"(fp4, fp6_e2m3, fp6_e3m2, fp8_e4m3, fp8_e5m2), got {element} elements "
                f"(dtype {dtype!r}); MXINT8 runs natively "
                f"(quantscope.presets.MXINT8), BFP16 as PerBlockBFPObserver")
        super().__init__(qspec, device, eps, **native)

    def _calculate_qparams(self):
        # no scale_format: the rule quark_spec read (E8M0 for the legacy dtype 'mx', else float32)
        fmt = self.scale_format or ("e8m0" if self.spec.scale.is_block else "float32")
        even = fmt == "e8m0" and (self.scale_calculation_mode or "even") == "even"
        if even and self.has_observed:
            # the native MX path (one pass over the state); Quark's even_round gives float32
            scale, zp = QuarkObserver._calculate_qparams(self)
            return scale.float().to(self.scale_torch_dtype), zp.float()
        if self.has_observed:
            self.check_ready()  # NaN / inf raise here too, as on the native path
        scale = self.get_scale(self.amax, self.eps, fmt)
        return scale.to(self.scale_torch_dtype), torch.zeros_like(scale)

    def reset_min_max_vals(self) -> None:
        self._require("amax")
        super().reset_min_max_vals()


@register("quark:PerBlockBFPObserver")
class PerBlockBFPObserver(_BlockAmax):
    """BFP16: blocks of 8, shared exponent with Quark's overflow check (a code of +128 bumps
    it; the native 'even' rule bumps on either end); ``amax`` the per-block absmax (Quark's
    doubles where a block overflows), int32 zeros."""

    _eps_argument = "used"
    _quark_dtype = "bfp16"  # Quark's class never reads the qspec's dtype

    def _starts_over(self, x) -> bool:
        if super()._starts_over(x):  # Quark's torch.max(amax, the batch's) fails there
            raise StateShapeError(
                f"{self.describe()}: the static amax holds (rows, blocks) "
                f"{self._quark_state_key(self.shape)}, a batch of shape {tuple(x.shape)} gives "
                f"{self._quark_state_key(tuple(x.shape))}: Quark's torch.max of the two raises "
                f"RuntimeError (or broadcasts a single row / block over the other); "
                f"reset_state() first")
        return False

    def _calculate_qparams(self):
        if not self.has_observed:  # Quark's formula on its amax tensor(0.): eps
            return (torch.tensor(self.eps).to(self.scale_torch_dtype),
                    torch.tensor(0, dtype=torch.int32))
        native, zp = super()._calculate_qparams()  # float32, with the overflow bump
        amax = self.amax
        scale = quark_bfp16_scale(amax, native.to(amax.dtype), self._quark_shape(self.max_vals),
                                  self.spec.format, self.scale_torch_dtype, self.eps)
        return scale.to(self.scale_torch_dtype), zp.to(torch.int32)
