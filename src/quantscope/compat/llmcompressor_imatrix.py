"""llm-compressor 0.14's ``imatrix_mse``: importance collected by a hook, a weighted MSE search.

:class:`IMatrixMixin` is the importance half of the contract, shared by
:class:`quantscope.compat.llmcompressor.IMatrixMSEObserver` and the registry class
``quantscope_imatrix_mse`` (:mod:`quantscope.integrations.llmcompressor`): ``attach(module)``
installs a forward-pre hook that sums ``x^2`` per input channel into ``_imatrix_sum`` /
``_imatrix_count`` (on the observer, float32, the module's device), ``detach`` removes it,
and before a search the importance ``sum / count`` is validated as llm-compressor validates
it (weights only, not ``tensor``, present, finite, non-negative, not all zero, one value per
input column): a failed check raises under ``strict`` and otherwise falls back to the
uniform search with a warning. Options and their checks are llm-compressor's (maxshrink
0.95, patience 5, grid 20, norm 3.0, expand 1.0), in the forms it takes (a float patience:
5.0, as a YAML recipe gives it); an ``expand`` that is not a finite positive number (theirs
takes it and returns meaningless ranges) is refused when the observer is made, as are
``norm=True`` and a non-finite ``norm``.

:func:`imatrix_search` is the search: candidates ``p * expand * [min, max]`` for
``p = 1 - i / grid``, ``i = 0 .. max(1, int(maxshrink * grid))``, scored by
``sum(importance * |fake_quant(x) - x| ** norm)`` per unit with the ``scale_dtype``'s scales
(MX's E8M0 too; ``tensor_group``: fp32, the global scale cancels), llm-compressor's global
patience: quantscope's
:func:`~quantscope.estimators.weighted.weighted_search` with its ``expand`` and ``patience``.
The range comes back in the observed dtype (float32 for integer data), as llm-compressor's
and the MSE compat's do, so the scales keep the weight's dtype. On bfloat16 / float16
weights (:func:`prices_in_dtype`) each candidate is priced as llm-compressor prices it,
:func:`half_search`: compressed-tensors' ``calculate_qparams`` and ``fake_quantize`` run in
the weight's dtype (each operation rounded to it), so the ranges are theirs bit for bit
(pricing the dtype's qparams in float32 chose other ranges in 157 of 576 cases, up to 0.75
relative, 120 of them with more error under the bfloat16 fake-quant that runs), a
``scale_dtype`` other than the weight's dtype and MX's E8M0 scales included
(:func:`candidate_qparams`: the scale in the dtype, rounded through the ``scale_dtype``).
One known difference: where the factors reach ``p = 0`` (``maxshrink=1``, or a grid below
1), llm-compressor may choose the range (0, 0), whose qparams it makes with its scale
dtype's eps, and these classes do not (see :func:`imatrix_search`).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import ClassVar

import torch

from ..estimators.mse import compat_patience
from ..estimators.weighted import select_candidates, weighted_search
from ..layout import Channel
from ..qdq import quantize_units
from ..qparams import amax_of_range
from ..scales import e8m0_scale
from ..stats.minmax import unit_minmax
from . import enum_name, field
from .llmcompressor_base import (
    HALF_SCALES,
    check_expanded_range,
    check_finite_statistics,
    half_qparams,
    round_to_scale_dtype,
    statistics_dtype,
    statistics_units,
)
from .llmcompressor_parts import flatten_for_calibration, mx_scale_in_dtype
from .llmcompressor_spec import search_spec, tiny_scales_kept, unit_search_spec

__all__ = ["IMatrixMixin", "candidate_qparams", "half_fake_quantize", "half_qparams",
           "half_search", "imatrix_search", "prices_in_dtype"]

_DEFAULTS = {"maxshrink": 0.95, "patience": 5, "grid": 20, "norm": 3.0, "strict": False,
             "expand": 1.0}


class IMatrixMixin:
    """Importance collection and validation (put it before the observer base class)."""

    _stats_attrs: ClassVar[list[str]] = ["min_vals", "max_vals", "_imatrix_sum", "_imatrix_count"]
    #: appended to "no importance data available" (what the caller can do about it)
    _no_data_hint: ClassVar[str] = ""

    def _init_imatrix(self, kwargs: dict, defaults: dict | None = None) -> None:
        opts = {**_DEFAULTS, **(defaults or {})}
        for name, default in opts.items():
            setattr(self, name, kwargs.get(name, default))
        self._imatrix_sum: torch.Tensor | None = None
        self._imatrix_count = torch.tensor(0, dtype=torch.int64)
        self._imatrix_hook = None
        if self.grid <= 0:
            raise ValueError(f"grid must be > 0, got {self.grid}")
        if self.patience < 0:
            raise ValueError(f"patience must be >= 0, got {self.patience}")
        if not 0 <= self.maxshrink <= 1:
            raise ValueError(f"maxshrink must be in [0, 1], got {self.maxshrink}")
        _check_positive("norm", self.norm)
        _check_positive("expand", self.expand)  # theirs takes <= 0: ranges of nothing
        #: the search's patience: theirs stops when ``patience > 0 and no_improve >=
        #: patience``, any number (5.0 from a recipe), as the compat MSE's reads it
        self._search_patience = compat_patience(float(self.patience)) \
            if self.patience > 0 else None

    def _hooks_disabled(self) -> bool:
        """Whether llm-compressor's pipeline has paused hooks (``HooksMixin.disable_hooks``)
        and not kept this one; read only where llm-compressor is already imported (this
        module does not import it)."""
        hooks = sys.modules.get("llmcompressor.modifiers.utils.hooks")
        mixin = getattr(hooks, "HooksMixin", None)
        return bool(getattr(mixin, "_HOOKS_DISABLED", False)) and \
            self._imatrix_hook not in getattr(mixin, "_HOOKS_KEEP_ENABLED", ())

    def attach(self, module: torch.nn.Module) -> None:
        """Collect ``sum x^2`` per input channel of ``module`` (a layer with ``in_features``)."""
        self.detach(module)
        if not hasattr(module, "in_features"):
            return
        param = next(module.parameters(), None)
        device = None if param is None else param.device
        self._imatrix_sum = torch.zeros(module.in_features, dtype=torch.float32, device=device)
        self._imatrix_count = torch.tensor(0, dtype=torch.int64, device=device)
        self._imatrix_hook = module.register_forward_pre_hook(self._collect)

    def detach(self, module: torch.nn.Module) -> None:
        if self._imatrix_hook is not None:
            self._imatrix_hook.remove()
            self._imatrix_hook = None

    def _collect(self, module, args) -> None:
        if self._hooks_disabled():
            return
        x = args[0] if isinstance(args, tuple) else args
        x = x[0] if isinstance(x, tuple) else x
        if not isinstance(x, torch.Tensor):
            return
        x = x.detach().float()
        self._imatrix_sum = self._imatrix_sum.to(x.device)
        self._imatrix_count = self._imatrix_count.to(x.device)
        self._imatrix_sum.add_(x.pow(2).sum(dim=tuple(range(x.dim() - 1))))
        self._imatrix_count += math.prod(x.shape[:-1])

    def _refuse(self, message: str, error=ValueError) -> None:
        if self.strict:
            raise error(f"imatrix_mse: {message}")
        warnings.warn(f"imatrix_mse: {message}. Falling back to uniform MSE.", stacklevel=3)

    def _importance(self, observed: torch.Tensor) -> torch.Tensor | None:
        """The validated importance, ``observed``'s shape (normalized to mean 1), or None."""
        strategy = enum_name(field(self.args, "strategy"))
        if self.base_name != "weight":
            return self._refuse("only supported for weight observers", NotImplementedError)
        if strategy == "tensor":
            return self._refuse("TENSOR strategy not supported", NotImplementedError)
        if self._imatrix_sum is None or int(self._imatrix_count) == 0:
            return self._refuse(f"no importance data available{self._no_data_hint}")
        imp = self._imatrix_sum / self._imatrix_count.float()
        for bad, what in ((~torch.isfinite(imp), "contains non-finite values"),
                          (imp < 0, "contains negative values")):
            if bool(bad.any()):
                return self._refuse(what)
        if bool((imp == 0).all()):
            return self._refuse("all zeros")
        if strategy == "channel":
            expected = observed.shape[-1]
        elif strategy in ("group", "tensor_group"):
            expected = observed.shape[2] * observed.shape[3]
        else:
            return self._refuse(f"unsupported strategy {strategy}", NotImplementedError)
        if imp.numel() != expected:
            return self._refuse(f"size mismatch: expected {expected}, got {imp.numel()}")
        imp = imp.to(device=observed.device, dtype=torch.float32)
        imp = imp / (imp.mean() + torch.finfo(torch.float32).tiny)
        return flatten_for_calibration(imp.expand(observed.shape[1], -1), "weight", self.args)

    def imatrix_range(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The searched ``(min_vals, max_vals)`` of ``(observations, *qparam_shape, elements)``:
        importance-weighted, or :meth:`uniform_range` where the importance is refused."""
        # a NaN / inf weight is refused before its importance is judged (whose fallback
        # warns, or raises when strict): one read, small beside the search
        check_finite_statistics(self, *torch.aminmax(observed))
        importance = self._importance(observed)
        if importance is None:
            return self.uniform_range(observed)
        return self._search(observed, importance)

    def uniform_range(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fallback without importance: llm-compressor's, the same search unweighted
        (the registry class overrides it with quantscope's ``memoryless_mse``)."""
        return self._search(observed, None)

    def _search(self, observed, importance):
        check_expanded_range(self, *torch.aminmax(observed), self.expand)  # one read, not two
        spec = search_spec(self.args, self.base_name)  # tensor_group's scale_dtype dropped
        strategy = enum_name(field(self.args, "strategy"))
        in_dtype = prices_in_dtype(spec, observed.dtype, strategy)
        # tensor_group: theirs prices float32 scales (the global scale cancels). Others keep
        # their scale encoding, MX's E8M0 block scales too (theirs prices with its scale_dtype)
        spec = tiny_scales_kept(spec.replace(layout=Channel(0), scale="fp32")
                                if strategy == "tensor_group" else unit_search_spec(spec))
        return imatrix_search(observed, importance, spec,
                              maxshrink=self.maxshrink, patience=self._search_patience,
                              grid=self.grid, norm=self.norm, expand=self.expand,
                              in_dtype=in_dtype)


def _check_positive(name: str, value) -> None:
    """llm-compressor's check of ``norm`` (a finite positive number), with its message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value}")


def imatrix_search(observed: torch.Tensor, importance: torch.Tensor | None, spec, *,
                   maxshrink: float, patience: int | None, grid: float, norm: float,
                   expand: float = 1.0, in_dtype: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor 0.14's importance-weighted grid search (see the module docstring), run
    by :func:`~quantscope.estimators.weighted.weighted_search`: its incumbent is their first
    candidate (``p = 1``, the range times ``expand``), the factors their others.
    ``in_dtype``: price as llm-compressor does on the observed bfloat16 / float16 data
    (:func:`half_search`; :func:`prices_in_dtype` says where)."""
    units, shape = statistics_units(observed)
    weights = None if importance is None else \
        importance.movedim(0, -2).reshape(units.shape).float()
    # a grid below 1 gives factors p < 0, a range (p * min, p * max) that their qparams
    # clamp to (0, 0). Known difference: that p = 0 candidate (maxshrink 1, or a grid below
    # 1) is priced here with a float32-eps scale (asymmetric in half: a NaN zero point, never
    # chosen), where llm-compressor prices it with its scale dtype's eps and a zero point of
    # 0, a quantizer that can win on small weights (a probe: 14 of 1,500 random cases)
    factors = [max(0.0, 1 - i / grid) for i in range(1, max(1, int(maxshrink * grid)) + 1)]
    if in_dtype:
        lo, hi = half_search(units, weights, spec, factors, norm=norm, expand=expand,
                             patience=patience, dtype_sums=False)
        return lo.reshape(shape), hi.reshape(shape)
    lo, hi = weighted_search(units.float(), weights, spec, factors=factors, norm=norm,
                             expand=expand, patience=patience, float32_sums=True)
    dtype = statistics_dtype(observed)
    return lo.reshape(shape).to(dtype), hi.reshape(shape).to(dtype)


def prices_in_dtype(spec, dtype: torch.dtype, strategy: str | None) -> bool:
    """Whether llm-compressor prices a search's candidates on ``dtype`` data as
    :func:`half_search` does: bfloat16 / float16 data and scales it encodes as theirs
    (:func:`candidate_qparams`: none, a float ``scale_dtype``, MX's E8M0; ``tensor_group``
    drops its own to search)."""
    return dtype in HALF_SCALES and (strategy == "tensor_group"
                                     or spec.scale.kind in ("fp32", "fp16", "bf16", "e8m0"))


#: the float ``scale_dtype`` of a half-precision scale encoding
_HALF_DTYPES = {kind: dtype for dtype, kind in HALF_SCALES.items()}


def candidate_qparams(lo: torch.Tensor, hi: torch.Tensor, spec
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``calculate_qparams`` of a bfloat16 / float16 candidate range with
    the ``scale_dtype`` ``spec.scale`` encodes, as their searches price it: the scale in the
    dtype (:func:`half_qparams`; MX: the E8M0 scale of the dtype's amax), then rounded through
    the ``scale_dtype`` and back to the dtype (:func:`round_to_scale_dtype`), the zero point
    from the scale before that rounding, a zero scale the ``scale_dtype``'s eps (E8M0's uint8:
    1), else the dtype's."""
    dtype = lo.dtype
    if spec.scale.kind == "e8m0":  # their generate_mx_scales; the exponent read in the dtype
        scale = e8m0_scale(amax_of_range(lo, hi).float(), spec.format, spec.scale.mode)
        scale = mx_scale_in_dtype(scale, lo, hi, spec.format, dtype)
        zp, eps = torch.zeros_like(scale), 1.0
    else:
        scale, zp = half_qparams(lo, hi, spec, eps=False)
        eps = torch.finfo(dtype).eps
        if (sd := _HALF_DTYPES.get(spec.scale.kind)) is not None:
            scale, eps = round_to_scale_dtype(scale, sd).to(dtype), torch.finfo(sd).eps
    return torch.where(scale == 0, torch.tensor(eps, dtype=dtype), scale), zp


def half_fake_quantize(units: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec
                       ) -> torch.Tensor:
    """compressed-tensors' ``fake_quantize`` in the units' dtype: ``x / scale + zp`` and
    ``(q - zp) * scale`` each rounded to it; the codes by quantscope's rounding (half to
    even, clamped: theirs for integers, fp8 and fp4 alike), exact in the dtype."""
    t = units / scale
    if not spec.is_float:
        t = t + zp
    one = torch.ones((), device=units.device)
    q = quantize_units(t.float(), one, torch.zeros_like(one), spec).to(units.dtype)
    return (q - zp) * scale


def half_search(units: torch.Tensor, weights: torch.Tensor | None, spec, factors, *,
                norm: float, expand: float, patience: int | None, dtype_sums: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's search on bfloat16 / float16 ``units [U, E]`` as it runs it: the
    range ``amin * expand``, ``amax * expand`` and each candidate ``p * range`` rounded to the
    dtype, priced by :func:`candidate_qparams` and :func:`half_fake_quantize`; the error
    ``sum w * |fq - x| ** norm`` in float32 (imatrix), or, ``dtype_sums``, unweighted in the
    dtype (memoryless_mse's: ``(fq - x).abs().pow(norm).sum()``). The incumbent is ``p = 1``,
    ``factors`` the other ``p``; :func:`select_candidates`' rules. Returns the chosen
    ``(lo, hi)`` ``[U]`` in the dtype."""
    units_f = units.float()
    lo0, hi0 = (t.to(units.dtype) * expand for t in unit_minmax(units_f))  # min, max: exact
    cands = [(lo0, hi0), *((lo0 * p, hi0 * p) for p in factors)]

    def errors():
        for lo, hi in cands:
            scale, zp = candidate_qparams(lo.reshape(-1, 1), hi.reshape(-1, 1), spec)
            fq = half_fake_quantize(units, scale, zp, spec)
            if dtype_sums:  # exact in float32: the dtype's comparisons kept
                yield (fq - units).abs().pow(norm).sum(1).float()[None]
                continue
            d = fq.float().sub_(units_f).abs_().pow_(norm)
            yield (d if weights is None else d.mul_(weights)).sum(1)[None]
    # select_candidates returns ``lo0 * factor``: with ones and the indices, the index
    ones = torch.ones(lo0.shape, device=units.device)
    best = select_candidates(errors(), ones, ones, list(range(len(cands))), patience)[0].long()
    lo, hi = (torch.stack([c[i] for c in cands]) for i in (0, 1))
    return lo.gather(0, best[None])[0], hi.gather(0, best[None])[0]
