"""quantscope's observers in llm-compressor's pipelines: ``observer: quantscope_<name>``.

Importing this module registers every native quantscope observer (``histogram``, ``mse``,
``percentile``, ``entropy``, ``mix``, ``static_minmax`` ...; see
:func:`quantscope.list_observers`) in llm-compressor's ``Observer`` registry under
``quantscope_<name>``, so a recipe or ``QuantizationArgs(observer=...)`` can name it::

    import quantscope.integrations.llmcompressor  # noqa: F401  (registers on import)
    # FP8: static per-tensor fp8 inputs (W8A8's int8 inputs are dynamic: no input observer)
    QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"],
                         input_observer="quantscope_histogram", weight_observer="quantscope_mse")

How it fits llm-compressor's observer contract (llm-compressor 0.14):

* llm-compressor flattens the observed value to ``(observations, *qparam_shape, elements)``
  for the strategy (``flatten_for_calibration``: tensor, channel, group, tensor_group, block,
  token, attn_head). The plugin hands quantscope that view as ``[units, elements]`` (one unit
  per scale), so the units are exactly llm-compressor's in every strategy; the quantscope
  spec (format, symmetry, scale encoding) comes from
  :func:`quantscope.compat.llmcompressor.llmcompressor_spec`, the one translation.
* The statistic is quantscope's (histograms, running min / max, searches ...); its range
  is what the plugin reports as llm-compressor's ``min_vals`` / ``max_vals``, computed once
  when llm-compressor asks for qparams (not after every batch). llm-compressor then computes
  scale, zero point and the NVFP4 global scale (shared across fused q/k/v and gate/up
  weights) with compressed-tensors' ``calculate_qparams``, whose formula is bitwise
  quantscope's (tests/core/test_peers_core.py), so the checkpoint holds quantscope's qparams
  and llm-compressor's fusion and offloading keep working.
* NVFP4 (``tensor_group``): the global scale is llm-compressor's rule over the fusion group
  (the largest amax of the fused observers), where each quantscope observer contributes the
  amax its ranges were chosen under (for the MSE search the global amax it searched, which
  may exceed the tensor's absmax: candidates are scored with the e4m3 block scales that run
  under it, docs/guide/observers.md), reported to llm-compressor's own observers in the group
  too, so a mixed group shares one global scale; min-max ranges give llm-compressor's own.
* MX (E8M0) ranges are handed over in float32, not the observed dtype (:func:`range_dtype`);
  the scale comes back in the observed dtype by compressed-tensors' rule there
  (:func:`~quantscope.compat.llmcompressor_parts.mx_scale_in_dtype`): on float16, a block
  below its smallest normal amax (2**-14) gets scale 1 (below 1.5 * 2**-15) or fp4's 2**-16 /
  fp8's 2**-22, as llm-compressor's own observers give, never 0. One difference: a float16
  block amax from 57344 up, whose power of two compressed-tensors rounds to float16's inf
  (an inf scale), keeps the float32 one (2**14 for fp4); bfloat16 / float32 ones from
  1.75 * 2**127 get their inf, as theirs (the compat classes keep a finite one).
* On the meta device (``model_free_ptq``'s memory estimate) ``get_qparams`` returns meta
  qparams of llm-compressor's shapes and dtypes, as its own observers do; nothing is read.
  Real data after it starts afresh (a meta state holds no values), as theirs do once read.
* Group activation order (``actorder``) is GPTQ's: columns are observed unpermuted, as theirs.
* ``observer_kwargs`` are the quantscope observer's keyword options (``bins``,
  ``percentile``, ``averaging_constant`` ...; ``non_finite: ignore`` skips NaN / inf, which
  are refused otherwise). Errors name the registry name, the recipe's fields and the
  ``observer_kwargs``, then the observer's own message (a bad value as an unknown key).
* DDP: ``sync_activation_stats`` reduces the state through :mod:`quantscope.distributed`
  (histograms merge exactly, min / max by MIN / MAX); weights are not synced (every rank
  holds the same weights, and llm-compressor observes each weight on one rank).
* Activations with a block scale (NVFP4 ``tensor_group`` inputs, ``dynamic: local``) are
  observed per column block across all tokens, as llm-compressor does; only their global
  scale is used, so quantscope searches their range with fp32 block scales.

The classes follow llm-compressor 0.14's ``Observer`` contract as its own observer tests
exercise it: integer tensors are observed (as float32); ``min_vals`` / ``max_vals`` may be
assigned (then they are what ``get_qparams`` and ``sync_activation_stats`` use, reduced by
the observer's ``sync_plan``, docs/guide/pipelines.md) and a read is not changed later; MSE
observers keep ``triton_error_buffer`` and refuse ``expand < 1`` with llm-compressor's
message. ``quantscope_imatrix_mse`` is :class:`QuantscopeIMatrixObserver`: llm-compressor's
``imatrix_mse`` contract (``attach`` hook, options, checks, ``strict``) with quantscope's
search code (:mod:`quantscope.compat.llmcompressor_imatrix`); where it falls back to
"uniform MSE" (no valid importance, not ``strict``) it runs ``quantscope_memoryless_mse``'s
search over its own grid (:meth:`QuantscopeIMatrixObserver.uniform_range`), or, for a grid
that search does not run, llm-compressor's own unweighted one. A NaN / inf weight raises
"observed NaN or inf values" as the other ``quantscope_*`` observers do. In a weight-only
recipe pass ``requires_calibration_data=True`` to ``QuantizationModifier``: llm-compressor
turns calibration on by itself only for its own imatrix observer names.

Registration is explicit (import this module before ``oneshot``): llm-compressor has no
plugin entry point. To have it in every process of an environment, add a ``.pth`` file
holding the line ``import quantscope.integrations.llmcompressor`` to site-packages.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch
from torch import distributed as dist

try:
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import generate_gparam, should_generate_mx_scales
    from compressed_tensors.registry.registry import standardize_lookup_name
    from llmcompressor.observers import Observer
    from llmcompressor.observers.helpers import flatten_for_calibration
except ModuleNotFoundError as e:  # the same error, saying what to install
    raise ModuleNotFoundError(
        f"quantscope.integrations.llmcompressor registers quantscope's observers in "
        f"llm-compressor and needs it (with its compressed-tensors): pip install llmcompressor "
        f"({e})", name=e.name) from None

from .._checks import check_number
from ..compat.llmcompressor_base import (
    check_finite_statistics,
    statistics_dtype,
    statistics_units,
)
from ..compat.llmcompressor_imatrix import IMatrixMixin
from ..compat.llmcompressor_parts import mx_scale_in_dtype
from ..compat.llmcompressor_spec import llmcompressor_spec
from ..layout import Block, Channel
from ..observers.registry import list_observers, observer_class
from ..qparams import amax_of_range

__all__ = ["PREFIX", "QuantscopeIMatrixObserver", "QuantscopeObserver", "observer_names",
           "recipe_args", "register_all", "units_spec"]

PREFIX = "quantscope_"
#: native names not offered: the placeholder observes nothing (fp16 / bf16 pass-through)
_SKIP = ("placeholder",)


class QuantscopeObserver(Observer):
    """An llm-compressor ``Observer`` whose statistic and range are a quantscope observer's.

    Subclasses set :attr:`quantscope_name`; :func:`register_all` makes one per native name.
    """

    #: the quantscope registry name of the observer this class runs
    quantscope_name: str = ""

    def __init__(self, base_name: str, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        cls = observer_class(self.quantscope_name)
        try:  # a scheme, an unknown key, a bad value: in the recipe's words, then the observer's
            spec = units_spec(self.args, base_name)
            if getattr(cls, "symmetric_only", False) and not spec.symmetric:
                raise ValueError(f"it searches symmetric ranges only, these are asymmetric: use "
                                 f"{PREFIX}memoryless_mse or {PREFIX}mse for them")
            kwargs = self._take_llmcompressor_options(dict(self.args.observer_kwargs))
            self._make = functools.partial(cls, spec, **kwargs)  # (again: see below)
            object.__setattr__(self, "quantscope", self._make())  # no submodule: no state
        except (TypeError, ValueError) as err:
            given = self.args.observer_kwargs
            raise (TypeError if isinstance(err, TypeError) else ValueError)(
                f"observer {PREFIX}{self.quantscope_name} for {recipe_args(self.args, base_name)}"
                f"{f' with observer_kwargs {given}' if given else ''}: {err}") from err
        self._qparam_shape: tuple[int, ...] | None = None
        self._merged = torch.float32  # the batches' dtypes merged (as theirs promote them)
        self._range: tuple[torch.Tensor, torch.Tensor] | None = None
        #: statistics assigned by the caller (llm-compressor assigns min_vals / max_vals)
        self._assigned: dict[str, torch.Tensor] = {}

    def _take_llmcompressor_options(self, kwargs: dict) -> dict:
        """Keep llm-compressor's own MSE options as its observers do (``triton_error_buffer``,
        its CUDA search's patience, is an attribute; ``expand < 1`` is refused with its
        message) and return the keywords for the quantscope observer."""
        if observer_class(self.quantscope_name).family != "mse":
            return kwargs
        fp4 = self.args.type == "float" and self.args.num_bits == 4
        self.triton_error_buffer = kwargs.pop("triton_error_buffer", 1.00 if fp4 else 0.30)
        expand = kwargs.get("expand", 1.0)
        number = isinstance(expand, (int, float)) and not isinstance(expand, bool)
        if number and expand < 1.0:
            raise ValueError(f"expand value must be at least 1.0, got {expand}")
        # a YAML string or NaN: name the option, not a failed comparison (__init__: the rest)
        self.expand = check_number("llm-compressor's MSE search", "expand", expand, 1.0)
        return kwargs

    # ----------------------------------------------------------------- observing
    @torch.no_grad()
    def forward(self, observed: torch.Tensor) -> QuantscopeObserver:
        # llm-compressor's forward, except that it reads the fused statistics (which would
        # run quantscope's range search after every batch) only for fused weights, whose
        # siblings it observes there
        if observed.numel() == 0 or (self.is_weight_obs and self.has_statistics):
            return self
        self.update_statistics_from_observed(
            flatten_for_calibration(observed, self.base_name, self.args))
        if self.fusion_handler.is_fused:
            self.fusion_handler.get_fused_statistics()
        return self

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        """Feed ``(observations, *qparam_shape, elements)`` to quantscope as
        ``[units, elements]``."""
        shape = tuple(observed.shape[1:-1])
        units = observed.movedim(0, -2).reshape(math.prod(shape), -1)
        if self.quantscope.seen_non_finite.device != units.device:
            # llm-compressor's observers keep no state before data: theirs goes where the
            # data is (a module placed after its observer was made, model_free_ptq's meta
            # pass), so ours follows; a meta state, holding no values, is made anew there
            object.__setattr__(self, "quantscope", (
                self._make() if self._on_meta else self.quantscope).to(units.device))
        merged = observed.dtype
        if not self.quantscope.memoryless and self.quantscope.has_observed:
            # a running range merges every batch's: its dtype theirs promoted (their torch.min
            # / max and moving averages promote; an integer batch's int64 gives way to floats)
            merged = torch.promote_types(self._merged, merged)
        # integer data (llm-compressor observes it) is calibrated on its float32 values
        self.quantscope(units.to(statistics_dtype(observed)))
        self._qparam_shape, self._merged, self._range = shape, merged, None
        self._assigned = {}

    # ------------------------------------------------------------- statistics
    @property
    def _dtype(self) -> torch.dtype:
        """The statistics' dtype: the batches' merged one, float32 for integer data
        (:func:`statistics_dtype`'s rule)."""
        return self._merged if self._merged.is_floating_point else torch.float32

    @property
    def has_statistics(self) -> bool:
        return self.quantscope.has_observed or all(
            name in self._assigned for name in ("min_vals", "max_vals"))

    # min_vals / max_vals: quantscope's range, or what the caller assigned (llm-compressor
    # assigns them); each read after an update is a new tensor, never written in place
    @property
    def min_vals(self) -> torch.Tensor:
        if "min_vals" in self._assigned:
            return self._assigned["min_vals"]
        return self._current_range()[0]

    @min_vals.setter
    def min_vals(self, value: torch.Tensor) -> None:
        self._assigned["min_vals"] = value

    @min_vals.deleter
    def min_vals(self) -> None:
        self.delete_statistics(check_fused=False)

    @property
    def max_vals(self) -> torch.Tensor:
        if "max_vals" in self._assigned:
            return self._assigned["max_vals"]
        return self._current_range()[1]

    @max_vals.setter
    def max_vals(self, value: torch.Tensor) -> None:
        self._assigned["max_vals"] = value

    @max_vals.deleter
    def max_vals(self) -> None:
        self.delete_statistics(check_fused=False)

    def _current_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        # quantscope's range, shaped and typed as llm-compressor's min_vals (see range_dtype)
        if self._range is None:
            dtype = range_dtype(self.args, self._dtype)
            if self._on_meta:
                # model_free_ptq's memory estimate runs on the meta device: meta ranges of
                # the right shape and dtype, as llm-compressor's own (no values to read)
                self._range = (torch.empty(self._qparam_shape, dtype=dtype, device="meta"),
                               torch.empty(self._qparam_shape, dtype=dtype, device="meta"))
                return self._range
            self._check_ready()
            lo, hi = self.quantscope.calculate_range()
            # copies: the quantscope observer updates its buffers in place
            self._range = (lo.reshape(self._qparam_shape).to(dtype, copy=True),
                           hi.reshape(self._qparam_shape).to(dtype, copy=True))
        return self._range

    def _check_ready(self) -> None:
        """The quantscope observer's check, its NaN / inf refusal in the recipe's words."""
        try:
            self.quantscope.check_ready()
        except ValueError:
            if not bool(self.quantscope.seen_non_finite):  # (an error path: one host read)
                raise
            raise ValueError(
                f"observer {PREFIX}{self.quantscope_name} for "
                f"{recipe_args(self.args, self.base_name)}: observed NaN or inf values; fix "
                f"the input, or skip them with observer_kwargs: {{non_finite: ignore}} in the "
                f"recipe") from None

    @property
    def _on_meta(self) -> bool:
        """Whether the state observed the meta device (it follows the data's device)."""
        return self.quantscope.seen_non_finite.is_meta

    @torch.no_grad()
    def get_qparams(self) -> dict:
        mx = should_generate_mx_scales(self.args) and self.has_statistics
        if mx:  # (read before Observer.get_qparams deletes the statistics)
            lo, hi = self.min_vals, self.max_vals
        qparams = Observer.get_qparams(self)
        if mx:
            # the MX range went in float32 (range_dtype); the scale, a power of two, is kept
            # in the observed dtype as llm-compressor's own (its GPTQ rounds in that dtype),
            # with its rule for blocks that dtype holds no normal amax of (a plain cast
            # flushed float16's to 0: NaN in the quantized model)
            fmt = llmcompressor_spec(self.args, self.base_name).format
            qparams["scale"] = mx_scale_in_dtype(qparams["scale"], lo, hi, fmt, self._dtype)
        return qparams

    def get_statistics(self) -> dict[str, torch.Tensor]:
        stats = super().get_statistics()
        amax = None if self._on_meta else self.quantscope.global_amax()
        if amax is not None:  # the amax the ranges were searched under (NVFP4 MSE)
            # in the observed dtype, as llm-compressor's statistics, where it holds it: a
            # searched amax past float16's 65504 read inf there, a global scale of 0 (the
            # checkpoint dequantized to NaN; found by probing), so float32 then (one that
            # rounds down to 65504 stays float16, a hair low)
            amax, half = amax.reshape(()).float(), amax.reshape(()).to(self._dtype)
            _report_global_amax(stats, half if bool(torch.isfinite(half)) else amax)
        return stats

    def get_global_scale(self) -> torch.Tensor | None:
        """NVFP4's global scale from the largest amax in the fusion group (llm-compressor's
        rule), taking each quantscope observer's own global amax where it has one."""
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        amaxes = []
        for stats in self.fusion_handler.get_fused_statistics():
            if "global_amax" in stats:
                amaxes.append(stats["global_amax"].reshape(()))
            else:
                amaxes.append(amax_of_range(stats["min_vals"].min(), stats["max_vals"].max()))
        amax = torch.stack(amaxes).max().reshape(1)
        return generate_gparam(-amax, amax)

    def delete_statistics(self, check_fused: bool = True) -> None:
        if check_fused:
            self.fusion_handler.maybe_delete_statistics()
        else:
            self.quantscope.reset()
            self._range, self._assigned = None, {}

    def sync_activation_stats(self) -> list:
        """Reduce the state across DDP ranks through :mod:`quantscope.distributed` (exact for
        histograms and running min / max); synchronous, so no pending handles are returned."""
        if self._assigned:  # the caller's statistics: llm-compressor's async all-reduce
            self._act_sync_dict = _reduce_ops(self.quantscope.sync_plan())
            return super().sync_activation_stats()
        if not self.is_weight_obs:
            self.quantscope.sync()
            self._range = None
        return []

    def extra_repr(self) -> str:
        return f"base_name={self.base_name!r}, quantscope={self.quantscope_name!r}"


def range_dtype(args, observed: torch.dtype) -> torch.dtype:
    """The dtype the range is handed to llm-compressor in: the observed one, as its own
    observers keep min / max (compressed-tensors then computes the scales in it, as
    quantscope's spec does), except for MX scales: compressed-tensors rounds the range to a
    power of two by its mantissa (up from 1.75), and a searched range (a shrunk absmax, not
    a data value) rounded to bfloat16 can cross that boundary (1.7475 read 1.75: twice the
    scale searched); in float32 it rounds as the search priced it."""
    return torch.float32 if should_generate_mx_scales(args) else observed


#: the recipe field (QuantizationScheme's) of each observed base name; the kv cache's own
_RECIPE_FIELDS = {"weight": "weights", "input": "input_activations",
                  "output": "output_activations"}


def recipe_args(args, base_name: str) -> str:
    """``args`` as a recipe writes them, for messages: ``weights {num_bits: 4, type: int,
    symmetric: false, strategy: group, group_size: 32}`` (a kv cache / attention base name
    as itself)."""
    fields = {"num_bits": args.num_bits, "type": getattr(args.type, "value", args.type),
              "symmetric": str(args.symmetric).lower(),
              "strategy": getattr(args.strategy, "value", args.strategy)}
    for name in ("group_size", "block_structure"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    text = ", ".join(f"{k}: {v}" for k, v in fields.items())
    return f"{_RECIPE_FIELDS.get(base_name, base_name)} {{{text}}}"


def _report_global_amax(stats: dict, amax: torch.Tensor) -> None:
    """Add the global amax the ranges were searched under to ``stats``. They feed only the
    fusion group's NVFP4 global scale (``FusionHandler.get_fused_statistics``), and
    llm-compressor's own observers there take the largest ``-min_vals`` / ``max_vals``: they
    are reported as ``-amax`` / ``amax``, so those siblings share the global scale too."""
    stats["global_amax"] = amax
    stats["min_vals"], stats["max_vals"] = -amax, amax


def units_spec(args, base_name: str):
    """The quantscope spec of llm-compressor's ``[units, elements]`` view (one unit per
    qparam): a block scale (NVFP4 / MX) needs the Block layout, whose size is the weight's
    fixed group size; activations' rows hold every token, so there the range is searched
    with fp32 scales (see the module doc)."""
    spec = llmcompressor_spec(args, base_name)
    if spec.scale.is_block and base_name == "weight":
        return spec.replace(layout=Block(spec.layout.size))
    return spec.replace(layout=Channel(0), scale="fp32" if spec.scale.is_block else spec.scale)


def _reduce_ops(plan) -> dict:
    """quantscope's reduction of min_vals / max_vals (``plan``: a ``sync_plan()``, a dict or
    the histograms' list of ``(buffer, Op)`` pairs and custom syncs) as torch.distributed ops."""
    ops = dict(plan) if isinstance(plan, dict) else dict(p for p in plan if isinstance(p, tuple))
    return {name: getattr(dist.ReduceOp, ops[name].name) for name in ("min_vals", "max_vals")
            if name in ops and hasattr(dist.ReduceOp, ops[name].name)}


class QuantscopeIMatrixObserver(IMatrixMixin, Observer):
    """``quantscope_imatrix_mse``: llm-compressor 0.14's ``imatrix_mse`` contract with
    quantscope's search. ``attach(module)`` (llm-compressor calls it) collects ``E[x^2]`` per
    input channel on the observer; options, checks and ``strict`` are llm-compressor's
    (:mod:`quantscope.compat.llmcompressor_imatrix`); the qparams are compressed-tensors'."""

    _act_sync_dict: ClassVar[dict] = {"_imatrix_sum": dist.ReduceOp.SUM,
                                      "_imatrix_count": dist.ReduceOp.SUM}
    quantscope_name = "imatrix_mse"
    # llm-compressor turns calibration on for a weight-only recipe by a fixed list of its own
    # observer names (QuantizationMixin._set_requires_calibration_data), which no attribute
    # or registry entry extends: say how to turn it on
    _no_data_hint: ClassVar[str] = (
        " (no forward pass reached the layer while the observer was attached; llm-compressor "
        "runs calibration for a weight-only recipe by itself only for its own imatrix_mse / "
        "nvfp4_expanded_imatrix names: pass requires_calibration_data=True to "
        "QuantizationModifier, and a dataset to oneshot)")

    def __init__(self, base_name: str, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_imatrix(self.args.observer_kwargs)
        #: the NVFP4 global amax the uniform fallback's ranges were searched under
        self._global_amax: torch.Tensor | None = None
        self._dtype = torch.float32  # the observed dtype (statistics_dtype)
        #: memoryless_mse's options for the fallback; None where it refuses this grid
        self._uniform_options = self._memoryless_options()

    def _memoryless_options(self) -> dict | None:
        """``quantscope_memoryless_mse``'s options of this observer's grid (its patience as
        the search reads it), checked now: None for a grid llm-compressor takes and
        memoryless_mse refuses (``maxshrink * grid < 1``, ``expand < 1``, over its 10,000
        candidates), which :meth:`uniform_range` then searches as llm-compressor does."""
        options = {"maxshrink": self.maxshrink, "grid": self.grid, "expand": self.expand,
                   "patience": self._search_patience,
                   "norm": self.args.observer_kwargs.get("norm")}
        try:  # memoryless_mse checks its options when made (a search of one element)
            observer_class("memoryless_mse")(units_spec(self.args, self.base_name), **options)
        except ValueError:
            return None
        return options

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        self._global_amax, self._dtype = None, statistics_dtype(observed)
        lo, hi = self.imatrix_range(observed)
        check_finite_statistics(self, lo, hi)  # the other quantscope_* observers refuse too
        self.min_vals, self.max_vals = lo, hi

    def uniform_range(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Without valid importance, ``quantscope_memoryless_mse``'s search (quantscope's
        native rules) over this observer's grid: its ``maxshrink``, ``grid``, ``patience``
        (0: all candidates) and ``expand``; the ``norm`` given in ``observer_kwargs``, else
        memoryless_mse's (2: llm-compressor's 3.0 is the default of its weighted score). A
        grid memoryless_mse refuses (see :meth:`_memoryless_options`): llm-compressor's own
        unweighted search, as the compat ``imatrix_mse`` falls back."""
        if self._uniform_options is None:
            return super().uniform_range(observed)
        units, shape = statistics_units(observed)
        dtype = statistics_dtype(observed)
        uniform = observer_class("memoryless_mse")(
            units_spec(self.args, self.base_name), **self._uniform_options).to(units.device)
        uniform(units.to(dtype))
        lo, hi = uniform.calculate_range()
        self._global_amax = uniform.global_amax()
        dtype = range_dtype(self.args, dtype)
        return lo.reshape(shape).to(dtype), hi.reshape(shape).to(dtype)

    def get_statistics(self) -> dict[str, torch.Tensor]:
        stats = super().get_statistics()
        if self._global_amax is not None:  # the fallback's, as quantscope_memoryless_mse's
            _report_global_amax(stats, self._global_amax.reshape(()))
        return stats

    get_global_scale = QuantscopeObserver.get_global_scale
    get_qparams, extra_repr = QuantscopeObserver.get_qparams, QuantscopeObserver.extra_repr

    def delete_statistics(self, check_fused: bool = True) -> None:
        super().delete_statistics(check_fused)
        if not check_fused:
            self._global_amax = None


def observer_names() -> list[str]:
    """The names this module registers (``quantscope_histogram`` ...)."""
    return [PREFIX + n for n in list_observers() if ":" not in n and n not in _SKIP]


def register_all() -> None:
    """Register one :class:`QuantscopeObserver` subclass per native name (idempotent)."""
    known = set(Observer.registered_names())
    for name in observer_names():
        if standardize_lookup_name(name) in known:  # (this module imported anew: pickled by
            cls = Observer.get_value_from_registry(name)  # the name the first one gave it)
            globals()[cls.__name__] = cls
            continue
        native = name[len(PREFIX):]
        base = QuantscopeIMatrixObserver if native == "imatrix_mse" else QuantscopeObserver
        cls = type(f"Quantscope_{native}_Observer", (base,),
                   {"quantscope_name": native, "__module__": __name__,
                    "__doc__": f"quantscope's {native!r} observer as an llm-compressor Observer."})
        globals()[cls.__name__] = Observer.register(name)(cls)  # (pickled by that name)


register_all()
