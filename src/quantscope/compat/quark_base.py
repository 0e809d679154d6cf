"""AMD Quark's observer mixin, with the qspec translation (:mod:`.quark_spec`) and scale
rules (:mod:`.quark_scales`) it runs: the core of :mod:`quantscope.compat.quark`, which
re-exports every name here."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..layout import Block, Channel, Group, Tensor
from ..observers.minmax import StaticMinMaxObserver
from ..qparams import amax_of_range, qparams_from_range
from ..scales import e8m0_scale
from ..spec import QuantSpec
from . import SavesNoState, enum_name, field
from .quark_scales import (
    _F32_EPS,
    FP8_E5M3,
    AxisRangeError,
    InvertedRangeError,
    QuarkAssertionError,
    StateShapeError,
    UnsupportedElementError,
    UnsupportedInputError,
    _cast,
    _quark_int_default,
    _quark_int_scale_dtype,
    _quark_rows,
    quark_e8m0_scale,
    quark_float64_scale,
    quark_float_scale,
    quark_half_width,
    quark_token_count,
    quark_work_dtype,
)
from .quark_spec import _CAST, _SCALE_DTYPES, quark_qmin_qmax, quark_spec

__all__ = ["FP8_E5M3", "AxisRangeError", "InvertedRangeError", "QuarkAssertionError",
           "QuarkObserver", "StateShapeError", "UnsupportedElementError",
           "UnsupportedInputError", "quark_e8m0_scale", "quark_float_scale", "quark_qmin_qmax",
           "quark_spec"]


class QuarkObserver(SavesNoState):
    """Mixin (put it before the native class): a Quark qspec in, Quark's qparams out; no key
    in a state_dict, as Quark's (its buffers are non-persistent: :class:`SavesNoState`).

    Keywords after ``device`` go to the native observer's constructor.
    """

    #: Quark keeps min / max in the input's dtype (its histograms bin ``x.float()`` instead:
    #: float32, or the dtype of a module cast, which converts their bin edges)
    _keeps_input_dtype = True
    #: Quark's per-group min_val / max_val are flat ``(rows * groups,)``, in its row order
    _flat_stats = False
    #: Quark's block observers pad the last block of an axis the group size does not divide
    _pads_blocks = False

    #: what the class does with Quark's ``eps`` argument: "used" (Quark's uniform-scaling
    #: base, block MX / BFP), "ignored" (its per-channel / per-group take it and drop it in
    #: their ``super().__init__``), "refused" (the others have none)
    _eps_argument: ClassVar[str] = "refused"
    #: the float dtypes Quark prices with its integer formula (its quant_min assert fails
    #: once data is seen): fp6 (and fp4 in its per-group class; none in its block classes)
    _quark_int_priced: ClassVar[tuple[str, ...]] = ("fp6_e2m3", "fp6_e3m2")
    #: the Quark base whose public attributes the constructor sets: "uniform"
    #: (UniformScalingObserver: symmetric ... quant_min / quant_max, eps a non-persistent
    #: float32 buffer), "block" (PerBlockMX / BFP: block_size, axis, eps a float), None
    _quark_base: ClassVar[str | None] = "uniform"
    #: False: Quark's class never reads ``zero_point_type`` (Pro: torch.ao's zero points)
    _reads_zero_point_type: ClassVar[bool] = True
    #: the granularity Quark's class fixes (its config refuses another qscheme); None: any
    _quark_qscheme: ClassVar[str | None] = None
    #: the dtype Quark's class prices whatever the qspec's is (BFP: bfp16); None: the qspec's
    _quark_dtype: ClassVar[str | None] = None
    #: True: fp4 per tensor / channel takes a block scale_format (Quark's min-max classes)
    _fp4_scale_formats: ClassVar[bool] = False
    #: the non-float input dtypes Quark's forward fails on (its other integer / bool input
    #: is observed, as float32 here: Quark's min-max classes keep the dtype in min_val)
    _quark_fails_on: ClassVar[tuple[torch.dtype, ...]] = ()

    def __init__(self, qspec, device: torch.device | None = None, eps: float | None = None,
                 **native):
        self._check_qspec(qspec)
        spec = quark_spec(qspec, pad_blocks=self._pads_blocks, qscheme=self._quark_qscheme,
                          uniform=self._quark_base == "uniform",
                          fp4_scale_formats=self._fp4_scale_formats, dtype=self._quark_dtype)
        if eps is not None and self._eps_argument == "refused":
            raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword "
                            f"argument 'eps'")
        used = eps is not None and self._eps_argument == "used"
        if used and not spec.scale.is_block:  # the smallest int / float32 scale (Quark's
            # e8m0 / e4m3 block scales never read it: its e4m3 path overwrites its eps fill)
            spec = dataclasses.replace(spec, eps=eps)
        zero_point_type = enum_name(field(qspec, "zero_point_type"))  # float32: Quark's
        if (zero_point_type not in (None, "int32") and self._reads_zero_point_type  # -min/scale
                and not (spec.is_float or spec.symmetric)):
            raise ValueError(f"quark: zero_point_type {zero_point_type!r} is not supported; "
                             f"quantscope's asymmetric zero points are int32")
        super().__init__(spec, **native)
        self.qspec = qspec
        self.dtype = field(qspec, "dtype")
        self.is_dynamic = bool(field(qspec, "is_dynamic"))
        self.scale_format = enum_name(field(qspec, "scale_format"))
        self.scale_calculation_mode = enum_name(field(qspec, "scale_calculation_mode"))
        scale_type = enum_name(field(qspec, "scale_type"))
        #: Quark's: None unless scale_type is float32 / float16 / bfloat16 (then the scale
        #: keeps the dtype Quark computes it in: the input's, float32 for e8m0 'even' / e4m3)
        self.scale_torch_dtype = _SCALE_DTYPES.get(scale_type)
        #: the dtype of Quark's min_val / max_val: the last input's, or a module cast's
        self._input_dtype = torch.float32
        #: set by a two-level scheme on its second stage: float32 scales divide by it too
        self.quant_max_first_level: float | None = None
        for name, value in self._quark_attributes(qspec).items():
            setattr(self, name, value)
        eps = float(eps) if used else _F32_EPS  # the scale of a zero range / block
        if self._quark_base == "uniform":  # Quark's buffer: moves with .to(), never saved
            self.register_buffer("eps", torch.tensor(eps), persistent=False)
        else:
            self.eps = eps
        self._deleted: set[str] = set()
        self._quark_tokens: int | torch.Tensor = 0
        if device is not None:
            self.to(device)

    def _check_qspec(self, qspec) -> None:
        """Quark's refusals of a qspec its class cannot take: a cast dtype (its config:
        PlaceholderObserver only), another granularity than the class's (its config)."""
        name, dtype = type(self).__name__, enum_name(field(qspec, "dtype"))
        if dtype in _CAST and self._quark_base is not None:
            raise ValueError(f"{name}: dtype {dtype!r} is a cast with no range to price; Quark "
                             f"takes it with PlaceholderObserver only")
        qscheme = enum_name(field(qspec, "qscheme"))
        if qscheme not in (None, self._quark_qscheme) and self._quark_qscheme is not None:
            raise ValueError(f"{name}: qscheme {qscheme!r} contradicts the class, which takes "
                             f"{self._quark_qscheme!r} only (Quark's config refuses it)")

    def _quark_attributes(self, qspec) -> dict:
        """The public attributes Quark's constructor of this class sets (eps, dtype,
        is_dynamic and the scale settings apart), with Quark's values; a class adds its own."""
        if self._quark_base == "block":
            return {"block_size": field(qspec, "group_size"), "axis": field(qspec, "ch_axis")}
        if self._quark_base is None:
            return {}
        quant_min, quant_max = quark_qmin_qmax(self.dtype)
        return {"symmetric": field(qspec, "symmetric"), "scale_type": field(qspec, "scale_type"),
                "qscheme": field(qspec, "qscheme"),
                "zero_point_type": field(qspec, "zero_point_type"),
                "quant_min": quant_min, "quant_max": quant_max}

    def _setting_buffers(self) -> tuple[str, ...]:
        # Quark's eps buffer is a constructor setting: a reset keeps it
        return (*super()._setting_buffers(), *(("eps",) if "eps" in self._buffers else ()))

    def extra_repr(self) -> str:
        """Quark's: the range (uniform scaling), the dtype (placeholder); the block classes
        (none in Quark) keep quantscope's ``spec=...``."""
        if self._quark_base == "uniform":
            return f"min_val={self.min_val}, max_val={self.max_val}"
        return f"dtype={self.dtype}" if self._quark_base is None else super().extra_repr()

    #: its check_input (the batch's dims) runs once per shape in the cached CPU call too
    _step_overrides = ("check_input",)

    def check_input(self, x) -> bool:
        axis = getattr(self.spec.layout, "axis", None)  # (per tensor: none)
        if isinstance(x, torch.Tensor) and x.numel() and axis is not None \
                and not -x.dim() <= axis < x.dim():  # (an empty batch: passed over, as Quark's)
            raise AxisRangeError(f"{self.describe()}: ch_axis={axis} is out of range for a "
                                 f"tensor of shape {tuple(x.shape)} (Quark's class raises "
                                 f"IndexError)")
        return super().check_input(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        data = x
        if isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
            if x.dtype in self._quark_fails_on:
                raise UnsupportedInputError(f"{type(self).__name__}: Quark's class fails on "
                                            f"{x.dtype} input (NotImplementedError); pass "
                                            f"x.float()")
            data = x.to(quark_work_dtype(x.dtype))  # integer / bool data: exact to 2 ** 24
        out = super().forward(data)
        # Quark's: each batch's, once taken (a batch the checks refuse leaves the dtype)
        if self._keeps_input_dtype and x.dtype != self._input_dtype:
            self._input_dtype = x.dtype
        if data.dim() >= 2 and data.numel():  # Quark's count (MoE): rows with a non-zero
            object.__setattr__(self, "_quark_tokens",  # (no reset; skips nn.Module's checks)
                               self._quark_tokens + quark_token_count(data))
        return x if out is data else out

    def _apply(self, fn, recurse=True):
        """A floating-point module cast (``.half()``, ``.double()``, ``.to(dtype)``) converts
        Quark's min_val / max_val / eps buffers, so its scales come in that dtype (min-max
        classes: until the next batch, whose dtype the range takes); the native statistics
        keep their dtype (:meth:`Observer._apply`), the values read here follow Quark's."""
        super()._apply(fn, recurse)
        eps = self._buffers.get("eps")  # the uniform-scaling classes' (Quark's buffers)
        if eps is not None:  # each buffer cast from its own dtype (fn: torch's cast)
            self._buffers["eps"] = eps.to(fn(eps).dtype)
            ranges = fn(torch.empty((), dtype=self._input_dtype, device=eps.device)).dtype
            if ranges.is_floating_point:
                self._input_dtype = ranges
        return self

    @property
    def _scale_dtype(self) -> torch.dtype:
        return self.scale_torch_dtype or quark_work_dtype(self._input_dtype)

    @property
    def _range_dtype(self) -> torch.dtype:
        """The dtype Quark's formulas see the range in: float32 for integer input (bool kept:
        Quark's float scales take its abs, which fails)."""
        return self._input_dtype if self._input_dtype == torch.bool else quark_work_dtype(
            self._input_dtype)

    @property
    def _num_observed_tokens(self) -> int:
        return int(self._quark_tokens)  # Quark's rule (forward)

    def _quark_shape(self, t: torch.Tensor) -> torch.Tensor:
        """A per-unit (or qparam-shaped) tensor in Quark's shape: 0-dim per tensor, ``(C,)``
        per channel, ``(rows, groups)`` per group / block (after data: before it each caller
        gives Quark's own answer)."""
        if isinstance(self.spec.layout, Tensor) and t.numel() == 1:
            return t.reshape(())
        if isinstance(self.spec.layout, Tensor | Channel):
            return t.reshape(-1)
        return _quark_rows(t.reshape(self.spec.layout.qparam_shape(self.shape)), self.shape,
                           self.spec.layout.axis)

    def _quark_reshape(self) -> tuple[int, ...] | None:
        """:meth:`_quark_shape`'s shape where it is a reshape of the layout's qparams (no
        permute: per tensor, per channel, groups / blocks along the last axis), which the
        native qparams are then made in; None elsewhere."""
        layout, shape = self.spec.layout, self.shape
        if isinstance(layout, Tensor | Channel):
            units = layout.num_units(shape)
            return () if units == 1 and isinstance(layout, Tensor) else (units,)
        if layout.axis % len(shape) != len(shape) - 1:
            return None
        groups = layout.qparam_shape(shape)[-1]
        return layout.num_units(shape) // groups, groups

    def _calculate_qparams(self):
        shape = self._quark_reshape()
        lo, hi, qp = self.range_and_qparams(shape)  # (in Quark's shape, or the layout's)
        scale = qp.effective_scale if shape is not None else self._quark_shape(qp.effective_scale)
        if self.spec.scale.is_block:  # float32 (Quark's even_round): the class casts it
            return scale, torch.zeros_like(scale)
        if self.spec.is_float:  # Quark divides in scale_type's dtype
            scale = scale.to(self._scale_dtype)
            return scale, torch.zeros_like(scale)
        # Quark's range: the input's dtype (int: float32); symmetric read where that rounds it
        work = quark_work_dtype(self._input_dtype)
        if not self.spec.symmetric or torch.finfo(work).bits < 32:
            lo, hi = (_cast(self._quark_shape(t), work) for t in (lo, hi))
        # a signed format's symmetric zero point: the native's zeros, where in Quark's shape
        zero = qp.zero_point if shape is not None and self.spec.format.signed else None
        return self._quark_int_qparams(lo, hi, scale, work, zero)

    def calculate_qparams(self, min_val: torch.Tensor | None = None,
                          max_val: torch.Tensor | None = None):
        """Quark's ``calculate_qparams()``; with ``(min_val, max_val)`` it prices a given range."""
        if min_val is None and max_val is None:
            return self._calculate_qparams()
        if enum_name(self.dtype) in self._quark_int_priced:  # Quark's default, or its assert
            return self.calculate_int_quant_params(min_val, max_val)
        self._check_fp4_scale_format()
        for name, t in (("min_val", min_val), ("max_val", max_val)):  # (Quark's float path
            if isinstance(t, torch.Tensor) and t.is_floating_point() \
                    and not bool(torch.isfinite(t).all()):  # returns NaN / inf scales)
                raise ValueError(f"{type(self).__name__}.calculate_qparams: {name} holds NaN "
                                 f"or inf, of which no scale is finite")
        if self.spec.is_float:
            return self._calculate_float_qparams(min_val, max_val)
        return self.calculate_int_quant_params(min_val, max_val)

    def _calculate_float_qparams(self, min_val: torch.Tensor, max_val: torch.Tensor):
        # Quark's dispatch: fp4 by get_scale(scale_format), the other float dtypes by fp8's
        if torch.bool in (min_val.dtype, max_val.dtype):  # Quark's amax: abs of the range
            raise UnsupportedInputError(f"{type(self).__name__}: Quark's {enum_name(self.dtype)}"
                                        f" scales take abs() of a bool range, which torch "
                                        f"does not implement (NotImplementedError)")
        if enum_name(self.dtype) == "fp4":
            return self.calculate_fp4_quant_parameters(min_val, max_val)
        return self.calculate_fp8_quant_parameters(min_val, max_val)

    def _check_fp4_scale_format(self, dtype: str | None = None) -> None:
        """Quark's uniform classes price fp4 with ``get_scale(scale_format)``, which raises
        ValueError (before data too) when the qspec has none: so does this one (``dtype``:
        ``enum_name(self.dtype)`` where the caller has it)."""
        if (self._quark_base == "uniform" and (dtype or enum_name(self.dtype)) == "fp4"
                and self.scale_format is None):
            raise ValueError(f"{type(self).__name__}: dtype 'fp4' needs a scale_format (e8m0, "
                             f"e4m3, e5m3 or float32), got None: Quark's get_scale has no "
                             f"default for it")

    def calculate_int_quant_params(self, min_val: torch.Tensor, max_val: torch.Tensor):
        """Quark's integer ``(scale, zero_point)`` of a range (any shape; int32 zero points);
        a range never observed (``inf``, ``-inf`` or empty) gives Quark's ``([1.], [0])``
        (checked first, as Quark's), a float dtype :class:`UnsupportedElementError`."""
        if min_val.numel() == 0 or max_val.numel() == 0 or (
                (min_val.dim() == 0 or max_val.dim() == 0) and bool(min_val == float("inf"))
                and bool(max_val == float("-inf"))):
            return _quark_int_default()
        if self.spec.is_float:  # Quark asserts an integer quant_min / quant_max
            raise UnsupportedElementError(
                f"{type(self).__name__}: calculate_int_quant_params (where Quark's class prices "
                f"this dtype) needs an integer dtype, the qspec has {enum_name(self.dtype)!r}: "
                f"Quark's asserts an integer quant_min / quant_max (fp4 groups: "
                f"PerBlockMXObserver)")
        try:
            qp = qparams_from_range(min_val.float(), max_val.float(), self.spec)
        except ValueError as e:  # Quark asserts min <= max: its exception type too
            if bool((min_val > max_val).any()) and not bool(min_val.isnan().any()):
                raise InvertedRangeError(*e.args) from None
            raise
        return self._quark_int_qparams(min_val, max_val, qp.scale)

    def _quark_int_qparams(self, lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor,
                           work: torch.dtype | None = None, zero: torch.Tensor | None = None):
        """Quark's integer ``(scale, zero_point)`` of its range from the native float32 ``scale``
        (its shape), in the dtypes of Quark's ops: the range's (``work``), promoted by the clamp
        to eps; the zero point Quark's ``qmin - round(min(lo, 0) / scale)`` (the native rounds
        ``qmin - lo / scale`` whole: a code off where float32 rounds that sum, int16), or a
        symmetric one's zeros: ``zero`` (int32 zeros of ``scale``'s shape) where given."""
        work = work or quark_work_dtype(torch.result_type(lo, hi))
        width = quark_half_width(lo, hi, work, sym := self.spec.symmetric)
        if width is not None:  # the native formula over Quark's rounded range
            lo0 = -width if sym else torch.zeros_like(width)
            scale = qparams_from_range(lo0, width, self.spec, check_finite=False).scale
        eps = self._buffers.get("eps")  # (the block classes' eps is a float: float32)
        if work == torch.float64:
            scale = quark_float64_scale(lo, hi, self.spec, float(self.eps)).reshape(scale.shape)
        eps = torch.float32 if eps is None else eps.dtype
        # the range's dtype (torch's half division rounds the float32 quotient, as this cast)
        scale = _cast(_cast(scale, work), _quark_int_scale_dtype(work, scale.dim() == 0, eps))
        if sym:  # Quark's zeros (the native rule: uint8's mid code 128)
            zp = torch.zeros_like(scale, dtype=torch.int32) if zero is None else zero
        else:
            qmin, qmax = int(self.spec.qmin), int(self.spec.qmax)
            zp = (qmin - torch.round(lo.clamp(max=0) / scale).to(torch.int32)).clamp(qmin, qmax)
        return _cast(scale, self.scale_torch_dtype or scale.dtype), zp

    def _quark_before_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What Quark's uniform classes return before any data (their range is ``(inf,
        -inf)``), in its shapes: ``(1, 1)`` per group / block."""
        floats = self.spec.is_float and enum_name(self.dtype) not in self._quark_int_priced
        scale, zp = (self._calculate_float_qparams(self.min_val, self.max_val)
                     if floats else _quark_int_default())  # (fp6: Quark's integer default)
        grouped = isinstance(self.spec.layout, Group | Block)
        return (scale.reshape(1, 1), zp.reshape(1, 1)) if grouped else (scale, zp)

    def calculate_fp8_quant_parameters(self, min_val: torch.Tensor, max_val: torch.Tensor):
        """Quark's float ``(scale, zeros)``: ``amax / quant_max`` of the range (divided by
        ``quant_max_first_level`` too when it is set), zeros -> eps."""
        amax = amax_of_range(min_val.clamp(max=0), max_val.clamp(min=0))  # Quark's amax
        if isinstance(self.eps, torch.Tensor):  # Quark moves its eps buffer to the range
            self.eps = self.eps.to(min_val.dtype).to(min_val.device)
        eps = self.eps
        scale = quark_float_scale(amax, self.spec.format.qmax, "float32", eps=eps,
                                  first_level=self.quant_max_first_level,
                                  dtype=self.scale_torch_dtype)
        return scale.to(self.scale_torch_dtype), torch.zeros_like(scale)

    def calculate_fp4_quant_parameters(self, min_val: torch.Tensor, max_val: torch.Tensor):
        """Quark's: :meth:`get_scale` of the range's amax in ``scale_format`` (zeros -> eps),
        a zero left -> float32 eps; zeros as the zero point."""
        amax = amax_of_range(min_val.clamp(max=0), max_val.clamp(min=0))
        scale = self.get_scale(amax, self.eps, self.scale_format)
        zero_point = torch.zeros_like(scale)
        return scale.masked_fill(scale == 0.0, _F32_EPS).to(self.scale_torch_dtype), zero_point

    def get_scale(self, amax: torch.Tensor, eps, scale_format: str) -> torch.Tensor:
        """Quark's ``get_scale``: the scale of ``amax`` in ``scale_format`` (e8m0 by
        ``scale_calculation_mode``, float32, e4m3, e5m3) for this qspec's element format."""
        if scale_format == "e4m3" and amax.numel() and bool(amax.max() == 0):
            return self._nvfp4_zero_scale(amax)
        if scale_format != "e8m0":
            return quark_float_scale(amax, self.spec.format.qmax, scale_format, eps=eps,
                                     first_level=self.quant_max_first_level,
                                     dtype=self.scale_torch_dtype)
        mode = self.scale_calculation_mode or "even"
        if mode == "even":  # the native rule: Quark's even_round bit for bit on float elements
            return e8m0_scale(amax, self.spec.format, "even")
        return quark_e8m0_scale(amax, self.spec.format.emax, mode, eps=eps)

    def _nvfp4_zero_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The native NVFP4 scales of an all-zero tensor (global scale 1, block scales the
        smallest): Quark's two levels divide by its zero global amax (NaN scales)."""
        spec = QuantSpec(self.spec.format, Block(1, -1), scale="fp8_e4m3", eps=self.spec.eps)
        zeros = torch.zeros(amax.numel(), 1, device=amax.device)
        scale = qparams_from_range(zeros, zeros, spec).effective_scale  # in scale_type's
        return scale.reshape(amax.shape).to(self.scale_torch_dtype or scale.dtype)  # as on data

    def record_observed_tokens(self, batch_tensor: torch.Tensor) -> None:
        """Quark's FakeQuantize calls this; ``forward`` counts the tokens by Quark's rule."""

    def _stat(self, name: str, empty: float) -> torch.Tensor:
        """A statistic as Quark shows it: ``tensor(empty)`` before data / after a reset."""
        self._check_present(name)
        if not self.has_observed:
            return torch.tensor(empty, dtype=self._input_dtype)
        stat = self._quark_shape(getattr(self, name + "s")).to(self._input_dtype)
        return stat.reshape(-1) if self._flat_stats else stat

    def _delete(self, name: str) -> None:
        self._deleted.add(name)

    def _refuse_assignment(self, name: str) -> None:
        """Quark's statistics are buffers a caller may assign; ours are read from the
        native state (a known difference, docs/guide/pipelines.md)."""
        raise AttributeError(f"quark {type(self).__name__}: {name} cannot be assigned here "
                             f"(Quark's buffer can): its state comes from observing batches")

    @staticmethod
    def ends(getter: str, what: str) -> tuple[property, property]:
        """Quark's ``min_val`` / ``max_val`` (deletable, as Quark's attributes):
        ``self.<getter>(name, empty)``, ``tensor(+-inf)`` before data; ``what`` their doc."""
        def end(name: str, empty: float) -> property:
            return property(lambda self: getattr(self, getter)(name, empty),
                            lambda self, value: self._refuse_assignment(name),
                            lambda self: self._delete(name),
                            doc=f"{what}; ``tensor({empty})`` before.")
        return end("min_val", float("inf")), end("max_val", float("-inf"))

    def _check_present(self, name: str) -> None:
        """Quark's AttributeError for a statistic deleted with ``del`` (until a reset)."""
        if name in self._deleted:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _require(self, *names: str) -> None:
        """Quark raises RuntimeError when reset_state finds a statistic deleted."""
        missing = [n for n in names if n in self._deleted]
        if missing:
            raise RuntimeError(f"{type(self).__name__} has no attribute "
                               f"{' or '.join(repr(n) for n in missing)}.")

    def reset_state(self) -> None:
        self.reset_min_max_vals()

    def reset_min_max_vals(self) -> None:
        """Forget the statistics: ``min_val`` / ``max_val`` read ``inf`` / ``-inf`` again."""
        self.reset()
        self._deleted.clear()
        if self._keeps_input_dtype:  # Quark's reset puts float32 inf / -inf back
            self._input_dtype = torch.float32


class _DynamicOrStatic(QuarkObserver, StaticMinMaxObserver):
    """Running min / max, or the last call's with ``is_dynamic`` (Quark keeps both in one class)."""

    #: Quark's per-group observer overwrites on every call, dynamic or not
    always_memoryless = False
    _fp4_scale_formats = True

    @property
    def accumulates(self):
        return not (self.is_dynamic or self.always_memoryless)

    def _quark_state_key(self, shape: tuple[int, ...]):
        """What Quark's static state is shaped by for a tensor of ``shape``: a class that
        returns one starts over when it changes, as Quark's; None (the default): Quark keeps
        the state, and a changed unit count raises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._starts_over(x):
            tokens = self.observed_tokens.clone()  # Quark counts tokens apart from the state
            self.reset()
            self.observed_tokens.copy_(tokens)
        return super().forward(x)

    def _starts_over(self, x) -> bool:
        if not (self.accumulates and self.has_observed and isinstance(x, torch.Tensor)
                and x.numel() and x.shape != self.shape  # (one shape, one key: the usual call)
                and self._quark_state_key(self.shape) is not None):
            return False
        try:
            return self._quark_state_key(tuple(x.shape)) != self._quark_state_key(self.shape)
        except (ValueError, IndexError):  # forward says what is wrong with x
            return False

    def _calculate_qparams(self):
        dtype = enum_name(self.dtype)
        if dtype in self._quark_int_priced:  # Quark's default, or its assert
            return self.calculate_qparams(self.min_val, self.max_val)
        self._check_fp4_scale_format(dtype)
        if not self.has_observed:
            return self._quark_before_data()
        if self.spec.is_float:  # Quark's float rules (quant_max_first_level, eps fill)
            self.check_ready()  # NaN / inf raise here too, as on the native path
            scale, zp = self._calculate_float_qparams(
                self.min_vals.to(self._range_dtype), self.max_vals.to(self._range_dtype))
            return self._quark_shape(scale), self._quark_shape(zp)
        return super()._calculate_qparams()

    min_val, max_val = QuarkObserver.ends("_stat", "Running (or last) minimum / maximum")
