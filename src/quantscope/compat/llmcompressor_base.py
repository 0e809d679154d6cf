"""llm-compressor 0.14's ``Observer`` base class, with quantscope's formulas underneath.

The contract (see :mod:`quantscope.compat.llmcompressor`): statistics are plain attributes
named by ``_stats_attrs``, each update replaces them (a tensor read earlier keeps its
values), ``get_qparams()`` turns them into compressed-tensors' qparams and deletes them
(cooperatively in a fusion group), ``sync_activation_stats()`` all-reduces the
attributes of ``_act_sync_dict`` asynchronously.

Every collective call goes through this module's ``dist`` name, read when the call is
made, as llm-compressor's go through ``llmcompressor.observers.base.dist``: a test that
patches ``quantscope.compat.llmcompressor_base.dist`` sees them all (no other compat module
of llm-compressor's API binds a ``dist``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import distributed as dist

from .._checks import check_float32_range
from .._numerics import expansion_overflow
from ..formats import FP4_E2M1, FP8_E4M3
from ..layout import Channel
from ..qparams import amax_of_range, qparams_from_range
from ..scales import nvfp4_global_scale
from ..spec import QuantSpec
from ..stats.minmax import ema_
from . import UnsupportedInputError, enum_name, field
from .llmcompressor_parts import FusionHandler, flatten_for_calibration, mx_scale_in_dtype
from .llmcompressor_spec import (
    _ZERO_STAND_IN,
    default_strategy,
    llmcompressor_spec,
    scale_dtype,
    scales_times_global_scale,
    zp_dtype,
)

__all__ = ["HALF_SCALES", "Observer", "check_expanded_range",
           "check_finite_statistics", "fused_amax", "global_scale_of", "half_qparams", "lerp",
           "qparams_of_statistics", "round_to_scale_dtype", "statistics_dtype", "statistics_units"]

_NO_STATISTICS = "No statistics available. Call observer(value) first."
#: per class that registers (compressed-tensors keys its registry by the class ``register``
#: is called on): standardized name -> value, and name or alias -> standardized name
_REGISTRY: dict[type, dict[str, object]] = {}
_ALIASES: dict[type, dict[str, str]] = {}


def _lookup_name(name: str) -> str:
    """compressed-tensors' ``standardize_lookup_name``: "_" and " " as "-", lower case."""
    return name.replace("_", "-").replace(" ", "-").lower()


def _alias_names(alias) -> list[str]:
    """``alias`` (None, a name or several) as a list of standardized names."""
    if alias is None:
        return []
    return [_lookup_name(a) for a in ([alias] if isinstance(alias, str) else alias)]


def _check_subclass(parent: type, value) -> None:
    if not issubclass(value, parent):  # ValueError: compressed-tensors' type
        raise ValueError(  # noqa: TRY004
            f"class {value} is not a subclass of the class it is registered for: {parent}.")


def _register(parent: type, value, name: str | None, alias) -> None:
    """Add ``value`` under ``name`` (default its ``__name__``) and its aliases, checked as
    compressed-tensors checks them (same errors, same order) but all before any change: a
    refused registration leaves the registry as it was (theirs keeps the aliases it got to)."""
    name = _lookup_name(value.__name__ if name is None else name)
    aliases = _alias_names(alias)
    if name in aliases:
        raise KeyError(f"Attempting to register alias {name}, that is identical to the "
                       f"standardized name: {name}.")
    taken = dict(_ALIASES.get(parent, {}))
    for key in [*aliases, name]:  # the name is its own alias, so a taken name is refused
        if key in taken:
            raise KeyError(f"Attempting to register alias {key} as {name} however {key} "
                           f"has already been registered as {taken[key]}")
        taken[key] = name
    if parent.registry_requires_subclass:
        _check_subclass(parent, value)
    _ALIASES[parent] = taken
    _REGISTRY.setdefault(parent, {})[name] = value


def _lookup(parent: type, name: str):
    """The value registered to ``parent`` as ``name`` or an alias of it (standardized, as
    theirs)."""
    if ":" in name:  # theirs executes the file: a name read from a config would run code
        raise ValueError(f"registry name {name!r}: quantscope runs no file a registry name "
                         f"points to (compressed-tensors' 'file.py:value' form); import the "
                         f"module and register its value instead")
    name = _ALIASES.get(parent, {}).get(_lookup_name(name), _lookup_name(name))
    value = _REGISTRY.get(parent, {}).get(name)
    if value is None:
        raise KeyError(f"Unable to find {name} registered under type {parent}.\n"
                       f"Registered values for {parent}: {_names(parent)}\n"
                       f"Registered aliases for {parent}: {_aliases(parent)}")
    if parent.registry_requires_subclass:
        _check_subclass(parent, value)
    return value


def _names(parent: type) -> list[str]:
    return list(_REGISTRY.get(parent, {}))


def _aliases(parent: type) -> list[str]:
    return list(set(_ALIASES.get(parent, {})) - set(_names(parent)))


def _as_args(args):
    """A dict of ``QuantizationArgs`` fields as an object (the classes read attributes; no
    strategy: compressed-tensors' default)."""
    if isinstance(args, dict):
        args = SimpleNamespace(**{"strategy": None, "observer_kwargs": None, **args})
        args.strategy = args.strategy or default_strategy(getattr(args, "group_size", None))
    return args


def _internal_module() -> type:
    """compressed-tensors' ``InternalModule`` where it is installed, as llm-compressor's
    ``Observer`` subclasses it: its target matching (``match_named_modules``) skips an observer
    attached to a layer; ``nn.Module`` without it."""
    if importlib.util.find_spec("compressed_tensors") is None:
        return torch.nn.Module
    from compressed_tensors import InternalModule

    return InternalModule


class Observer(_internal_module()):
    """llm-compressor 0.14's observer base: ``(base_name, args, **observer_kwargs)``.

    Subclasses implement :meth:`update_statistics_from_observed` on the
    ``(observations, *qparam_shape, elements)`` view; keyword options are read from
    ``args.observer_kwargs`` (the call's ``observer_kwargs`` are merged into it, as there).
    """

    #: statistic attribute -> reduce op of ``sync_activation_stats``
    _act_sync_dict: ClassVar[dict] = {}
    #: the attributes that make up the statistics
    _stats_attrs: ClassVar[list[str]] = ["min_vals", "max_vals"]

    def __init__(self, base_name: str, args, **observer_kwargs):
        super().__init__()
        self.base_name = base_name
        self.args = _as_args(args)
        self.args.observer_kwargs = dict(self.args.observer_kwargs or {})
        self.args.observer_kwargs.update(observer_kwargs)
        self.fusion_handler = FusionHandler(self)

    # ------------------------------------------------------------------ registry
    #: True: only subclasses of the registering class may be registered and loaded
    registry_requires_subclass: ClassVar[bool] = False

    @classmethod
    def register(cls, name: str | None = None, alias: list[str] | str | None = None):
        """Class decorator: register a class (or factory) to ``cls`` as ``name`` (default its
        ``__name__``) and ``alias`` (names standardized; a taken one raises ``KeyError``)."""
        def add(value):
            cls.register_value(value, name=name, alias=alias)
            return value
        return add

    @classmethod
    def register_value(cls, value, name: str | None, alias: list[str] | str | None = None):
        """Register ``value`` to ``cls`` as ``name`` (None: its ``__name__``) and ``alias``."""
        _register(cls, value, name, alias)

    @classmethod
    def get_value_from_registry(cls, name: str):
        """The value registered to ``cls`` as ``name`` or an alias (``KeyError`` if none); a
        ``"file.py:value"`` name, which compressed-tensors executes, is a ``ValueError``."""
        return _lookup(cls, name)

    @classmethod
    def load_from_registry(cls, name: str, **kwargs) -> Observer:
        """The observer registered as ``name``, constructed with ``kwargs``."""
        return cls.get_value_from_registry(name)(**kwargs)

    @classmethod
    def registered_names(cls) -> list[str]:
        """The names registered to ``cls``, in registration order."""
        return _names(cls)

    @classmethod
    def registered_aliases(cls) -> list[str]:
        """The aliases registered to ``cls`` (names excluded)."""
        return _aliases(cls)

    # ---------------------------------------------------------------- statistics
    @property
    def has_statistics(self) -> bool:
        return all(hasattr(self, name) for name in self._stats_attrs)

    @property
    def is_weight_obs(self) -> bool:
        return self.base_name == "weight"

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        """Update the statistics from ``(observations, *qparam_shape, elements)``."""
        raise NotImplementedError()

    def get_statistics(self) -> dict[str, torch.Tensor]:
        assert self.has_statistics, _NO_STATISTICS
        return {name: getattr(self, name) for name in self._stats_attrs}

    def delete_statistics(self, check_fused: bool = True) -> None:
        """Delete the statistics (in a fusion group, once every member has asked)."""
        if check_fused:
            self.fusion_handler.maybe_delete_statistics()
            return
        for name in self._stats_attrs:
            if hasattr(self, name):
                delattr(self, name)

    def attach(self, module: torch.nn.Module) -> None:
        """Called when attached to ``module`` (importance observers install hooks)."""

    def detach(self, module: torch.nn.Module) -> None:
        """Called before removal from ``module``."""

    # ------------------------------------------------------------------- qparams
    def get_global_scale(self) -> torch.Tensor | None:
        """NVFP4's global scale over the fusion group (None unless ``tensor_group``)."""
        if enum_name(field(self.args, "strategy")) != "tensor_group":
            return None
        return self._fused_global_scale(self.fusion_handler.get_fused_statistics())

    def _fused_global_scale(self, statistics: list[dict]) -> torch.Tensor:
        """The global scale of a fusion group's statistics, computed as theirs in the
        statistics' (promoted) dtype: the ranges', not imatrix's float32 / int64 sums."""
        dtype = functools.reduce(torch.promote_types, [
            s[name].dtype for s in statistics for name in ("min_vals", "max_vals")])
        return global_scale_of(fused_amax(statistics), dtype)

    @torch.no_grad()
    def get_qparams(self) -> dict:
        """``{"scale", "zero_point", "global_scale"}`` from the statistics, which it deletes."""
        assert self.has_statistics, _NO_STATISTICS
        # activations here, not in forward: no host read while the model runs (NaN / inf
        # stay in the statistics)
        check_finite_statistics(self, self.min_vals, self.max_vals)
        self._check_float32_range(self.min_vals, self.max_vals)
        amax = global_scale = None
        if enum_name(field(self.args, "strategy")) == "tensor_group":
            statistics = self.fusion_handler.get_fused_statistics()
            amax, global_scale = fused_amax(statistics), self._fused_global_scale(statistics)
        scale, zero = qparams_of_statistics(self.min_vals, self.max_vals, self.args,
                                            self.base_name, amax)
        self.delete_statistics()
        return {"scale": scale, "zero_point": zero, "global_scale": global_scale}

    @torch.no_grad()
    def forward(self, observed: torch.Tensor) -> Observer:
        """Update the statistics from ``observed`` (a weight once); returns the observer."""
        if observed.numel() == 0 or (self.is_weight_obs and self.has_statistics):
            return self
        self._check_float32_range(observed)
        self.update_statistics_from_observed(
            flatten_for_calibration(observed, self.base_name, self.args))
        # a weight, once: refused here, not at get_qparams (which refuses them all the same
        # in a traced forward: torch.compile / torch.export take no host read)
        if self.is_weight_obs and not torch.compiler.is_compiling():
            try:  # NaN / inf reach every class's statistics (each starts from the units'
                # min / max): two small reads, where isfinite over the whole weight took 10x
                # llm-compressor's whole call
                check_finite_statistics(self, self.min_vals, self.max_vals)
            except ValueError:
                del self.min_vals, self.max_vals  # the update's: none, as before the call
                raise
        self.fusion_handler.get_fused_statistics()
        return self

    def _check_float32_range(self, *values: torch.Tensor) -> None:
        check_float32_range(_who(self), *values)

    def sync_activation_stats(self) -> list:
        """All-reduce the ``_act_sync_dict`` statistics across ranks; the async handles."""
        handles = []  # `dist` looked up at call time: patching this module's dist reaches it
        for name, op in self._act_sync_dict.items():
            value = getattr(self, name, None)
            if value is not None:
                value = value if value.dim() else value.reshape(1)
                handles.append(dist.all_reduce(value, op=op, async_op=True))
        return handles


def _who(observer) -> str:
    return f"llmcompressor observer {type(observer).__name__} ({observer.base_name!r})"


def check_finite_statistics(observer, *values: torch.Tensor) -> None:
    """Refuse non-finite statistics (NaN / inf in an observed value reach them and stay) when
    qparams are made of them, naming ``observer``, as quantscope's native observers refuse
    them (llm-compressor's turn them into NaN / inf scales silently). One host read of the
    per-qparam values."""
    if any(not v.is_meta and not bool(torch.isfinite(v).all()) for v in values):
        raise ValueError(f"{_who(observer)}: observed NaN or inf values; fix the input "
                         f"(llm-compressor's own observers give NaN / inf qparams from them)")


def check_expanded_range(observer, lo: torch.Tensor, hi: torch.Tensor, expand: float) -> None:
    """Refuse finite ranges that a search's ``expand`` takes past float32 (llm-compressor's
    then returns NaN scales, silently), naming ``observer``."""
    past = expansion_overflow(lo, hi, expand)
    if past is not None:
        raise ValueError(
            f"{_who(observer)}: expand={expand} takes the observed range past {past[1]}'s max "
            f"(max |x| = {past[0]:.3g}); llm-compressor returns NaN scales")


def statistics_dtype(observed: torch.Tensor) -> torch.dtype:
    """The dtype of llm-compressor's ``min_vals`` / ``max_vals`` for ``observed``: its own,
    float32 for integer (and bool) data (compressed-tensors then computes the scales in it);
    complex data, whose cast to float would drop the imaginary part, an
    :class:`~quantscope.compat.UnsupportedInputError` (llm-compressor's min / max of it raise)."""
    if observed.is_complex():
        raise UnsupportedInputError(f"llm-compressor observer: expected a real tensor (floating "
                                    f"point, integer or bool), got {observed.dtype}")
    return observed.dtype if observed.is_floating_point() else torch.float32


def statistics_units(observed: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(observations, *qparam_shape, elements)`` as ``[qparams, observations * elements]``,
    and the qparam shape."""
    shape = tuple(observed.shape[1:-1])
    return observed.movedim(0, -2).reshape(math.prod(shape), -1), shape


def lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``start * (1 - weight) + end * weight`` in new tensors (integer data in float32), each
    product rounded in its operand's dtype before the sum promotes them, as llm-compressor's
    (a bfloat16 state met by a float32 batch)."""
    start, end = (t if t.is_floating_point() else t.float() for t in (start, end))
    if start.dtype != end.dtype:
        start, end = start * (1.0 - weight), end * weight
        return start.to(torch.promote_types(start.dtype, end.dtype)).add_(end)
    state = start.clone()
    ema_("ema_lerp", weight, state, end.clone())
    return state


#: the scale encodings of the half-precision statistics dtypes
HALF_SCALES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def global_scale_of(amax: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam(-amax, amax)``: fp8 max times fp4 max over amax,
    float32; for a bfloat16 / float16 ``dtype`` theirs runs that expression in the dtype (a
    Python number over a tensor: the amax's reciprocal, then the product, each rounded to
    it; 1 where that is not finite, their fallback)."""
    if dtype not in HALF_SCALES:
        return nvfp4_global_scale(amax.reshape(1), FP4_E2M1)
    half = amax.reshape(1).to(dtype)
    gs = ((FP8_E4M3.max * FP4_E2M1.max) / half).float()
    return torch.where(torch.isfinite(gs) & (half > 0), gs, torch.ones_like(gs))


def fused_amax(statistics: list[dict]) -> torch.Tensor:
    """The largest ``|min|`` / ``max`` over a fusion group's statistics (NVFP4's global amax)."""
    return torch.stack([amax_of_range(s["min_vals"].min().float(), s["max_vals"].max().float())
                        for s in statistics]).max()


def _ct_eps(args, dtype: torch.dtype) -> float:
    """compressed-tensors' ``_get_dtype_eps`` of ``scale_dtype`` (else the scales' dtype)."""
    dtype = scale_dtype(args) or dtype
    if dtype == torch.float8_e4m3fn:
        return 0.125
    return torch.finfo(dtype).eps if dtype.is_floating_point else 1.0


def _ct_spec(args, base_name: str, times_global: bool) -> QuantSpec:
    """The spec whose float32 scales compressed-tensors computes before it rounds them to a
    float ``scale_dtype`` (NVFP4's fp8 and MX's E8M0 block scales are encoded in the spec)."""
    spec = llmcompressor_spec(args, base_name)
    if times_global:  # float32 scales, then times the global scale
        spec = spec.replace(layout=Channel(0), scale="fp32")
    if spec.scale.is_block:  # their own eps: never 0
        return spec
    return spec.replace(scale="fp32", eps=_ZERO_STAND_IN)


def half_qparams(lo: torch.Tensor, hi: torch.Tensor, spec, *, eps: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``calculate_qparams`` (no ``scale_dtype``, no global scale) on a
    bfloat16 / float16 range, each operation rounded to its dtype as theirs: ``(scale,
    zero_point)``, both in the dtype (the zero point a whole number of codes). ``eps``: a
    zero scale becomes the dtype's eps, theirs without a ``scale_dtype``; else it stays 0
    (the zero point then ``qmax``, or NaN where ``lo`` is 0)."""
    dtype = lo.dtype
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    span = torch.tensor(spec.qmax - spec.qmin, dtype=dtype)  # their bit_range.to(dtype)
    if spec.symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / (span / 2)
        zp = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / span
        zp = (spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax).round()
    if not eps:
        return scale, zp
    return torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale), zp


def round_to_scale_dtype(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' ``round_to_quantized_type_dtype`` of float ``scale`` to a float
    ``scale_dtype``: clamped to ``dtype``'s finite range (the bounds converted to the scale's
    dtype, as theirs), then cast to ``dtype``. Where ``dtype``'s range is wider than the
    scale's (a float32 ``scale_dtype`` on bfloat16 / float16 scales, bfloat16 on float16)
    their bounds do not fit the scale's dtype and theirs raises; that clamp changes no value
    there, so it is skipped: the cast alone, as the symmetric scales' float32 path gives."""
    info = torch.finfo(dtype)
    if info.max <= torch.finfo(scale.dtype).max:
        scale = scale.clamp(info.min, info.max)
    return scale.to(dtype)


def _local_qparams(min_vals: torch.Tensor, max_vals: torch.Tensor, spec: QuantSpec,
                   global_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat scales (before a global scale, zeros kept) and zero points, as
    compressed-tensors computes them: asymmetric ones of bfloat16 / float16 statistics by
    :func:`half_qparams`, in the dtype (theirs rounds ``max - min`` to it before dividing:
    float32 then cast gave other scales and zero points), the others by quantscope's float32
    formulas (a symmetric scale cast to the dtype is theirs: one correctly rounded quotient)."""
    if min_vals.dtype in HALF_SCALES and not spec.symmetric and not spec.scale.is_block:
        return half_qparams(min_vals.reshape(-1), max_vals.reshape(-1), spec, eps=False)
    lo, hi = min_vals.float().reshape(-1), max_vals.float().reshape(-1)
    qp = qparams_from_range(lo, hi, spec, global_amax=global_amax,
                            check_finite=not lo.is_meta)  # (meta: shapes, as theirs)
    return qp.scale, qp.zero_point


def qparams_of_statistics(min_vals: torch.Tensor, max_vals: torch.Tensor, args, base_name: str,
                          global_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``calculate_qparams`` of per-qparam ranges, by quantscope's formulas:
    the scale in the statistics' float dtype (float32 for integer statistics; for
    ``tensor_group``, that dtype promoted with float32: compressed-tensors multiplies by its
    float32 global scale, which also broadcasts the scale, not the zero point, to ``[1]``),
    the zero point (from the scale in the statistics' dtype, as theirs) in the args'
    ``zp_dtype``; a ``tensor_group`` scale of integers, or whose ``scale_dtype`` is not
    float8_e4m3fn, is the float32 scale times the global scale, as compressed-tensors
    computes it. A float ``scale_dtype`` rounds the scale as
    theirs (to 0 below its range); a scale that is 0 becomes their eps of ``scale_dtype`` or
    the scale's dtype, and its zero point their ``qmin - lo / 0`` cast to an integer: 0
    where ``lo`` is 0 (NaN), else ``qmax``."""
    # (NVFP4's spec computes the block scales of float32 ranges as theirs; of half ones,
    # theirs is the half-precision amax / 6 times the global scale, as below)
    times_global = scales_times_global_scale(args) or (
        global_amax is not None and min_vals.dtype in HALF_SCALES)
    spec = _ct_spec(args, base_name, times_global)
    shape = tuple(min_vals.shape)
    if global_amax is not None:
        dtype = torch.promote_types(min_vals.dtype, torch.float32)
    else:
        dtype = statistics_dtype(min_vals)
    local, zero = _local_qparams(min_vals, max_vals, spec, None if times_global else global_amax)
    # theirs: the scale in the half-precision statistics' dtype, then (times the float32
    # global and) rounded to a scale_dtype: a float32 scale rounded to the scale_dtype alone
    # rounds twice differently (fp16 on bfloat16: 675 of 10240 symmetric scales)
    half = local.to(min_vals.dtype) if min_vals.dtype in HALF_SCALES else local
    scale = half.float() * global_scale_of(global_amax, min_vals.dtype) if times_global \
        else half
    if (sd := scale_dtype(args)) is not None and sd.is_floating_point:
        scale = round_to_scale_dtype(scale, sd)
    zero_scale = (local <= _ZERO_STAND_IN).reshape(shape)
    scale = scale.reshape(shape).to(dtype)
    if spec.scale.kind == "e8m0":  # theirs below the dtype's normal amaxes (float16: 1, not 0)
        scale = mx_scale_in_dtype(scale, min_vals, max_vals, spec.format, dtype)
    if global_amax is not None:  # their product with the [1] global scale
        scale = scale.reshape(torch.broadcast_shapes(shape, (1,)))
    zero_scale = zero_scale | (scale == 0)  # 0 also where a dtype rounds a scale to it
    scale = torch.where(zero_scale, torch.tensor(_ct_eps(args, dtype), dtype=dtype), scale)
    zero = zero.reshape(shape)
    if not spec.symmetric:
        at_zero = torch.where(min_vals >= 0, 0, int(spec.qmax))
        zero = torch.where(zero_scale.reshape(shape), at_zero, zero)
    zero = zero.to(zp_dtype(args, spec))
    if scale.ndim == 0:
        scale, zero = scale.reshape(1), zero.reshape(1)
    return scale, zero
