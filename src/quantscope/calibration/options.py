"""The options of a calibration, as a few typed objects.

:func:`~.session.calibrate` and :func:`~.session.calibrate_many` take, beside the model, the
batches and the recipe, one object per concern; each validates its fields when made (the
error names the field), and the session carries them as one :class:`Options` value::

    calibrate(model, batches, "w8a8", observer="auto",
              sampling=Sampling(tokens=4096, seed=1), auto=Auto(metric="joint"),
              outliers=Outliers(smooth=0.8, keep_float=4))
    calibrate(model, batches, "w4a16", sequential=Sequential(blocks="model.layers"))

(``Outliers`` needs the whole model's forward, so it does not combine with ``sequential``.)

A new capability adds a field to one of them. The keywords of the flat signature
(``sample_tokens=``, ``auto_metric=``, ``smooth=`` ...) still work through one path,
:func:`from_keywords`, which warns (``DeprecationWarning``) with the new spelling;
``progress=`` stays a plain keyword (a display choice, not an option of the result), and
``sequential=True`` / ``"float"`` / ``"quantized"`` stays shorthand for ``Sequential(mode=...)``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from .._checks import FrozenDict, as_int, as_number, is_finite, outside_quantscope
from .choice.candidates import check_candidates
from .choice.sensitivity import FALLBACK_MODES
from .choice.smooth import check as _check_alpha
from .role_observers import AUTO, folded
from .run.dist_pass import check_group
from .run.finish import MISSING_POLICIES
from .run.sequential import MODES
from .structure.moe import MIN_TOKENS

__all__ = ["AUTO_METRICS", "Auto", "MoE", "Options", "Outliers", "Runtime", "Sampling",
           "Sequential", "from_keywords"]

#: what ``auto`` can minimise (see :class:`Auto`); "model", "joint" and "fisher" live in
#: :mod:`.auto`
AUTO_METRICS = ("model", "joint", "fisher", "tensor", "output")
#: the metrics that call :attr:`Auto.loss`
LOSS_METRICS = ("model", "fisher")

#: the seeds ``torch.Generator.manual_seed`` takes (a negative one wraps to 2**64 + seed)
SEED_RANGE = (-0x8000_0000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF)


def _set(obj, name: str, value) -> None:
    """Stores a checked field's plain Python value (a frozen dataclass)."""
    object.__setattr__(obj, name, value)


def _positive_int(obj, name: str, shown: str | None = None) -> None:
    """Checks ``obj.name`` and stores it as a Python int; ``shown``: the field in messages."""
    value = getattr(obj, name)
    n = as_int(value)
    if n is None or n < 1:
        raise ValueError(f"calibrate: {type(obj).__name__}.{shown or name} must be a positive "
                         f"integer, got {value!r}")
    _set(obj, name, n)


def _bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):  # "no" or 0.5 would read as True
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
            f"calibrate: {owner}.{name} must be True or False, got {value!r}")


def _one_of(owner: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"calibrate: {owner}.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class Sampling:
    """The activation rows kept per layer for ``auto`` and the report (SQNR, clipping);
    other qparams do not depend on them.

    Attributes:
        tokens: rows kept per sampled tensor, at most (was ``sample_tokens=``).
        budget_mb: the memory of all those rows together (every layer and role, counted
            at 4 bytes a value: a float64 model keeps half the rows, bf16 the same rows);
            when ``tokens`` rows each would not fit, every sampled tensor keeps the same
            smaller number of rows (at least one; a width known only at the first batch:
            its part of the bytes). None: 64 MB (was ``sample_budget_mb=``).
        seed: seeds the choice of sampled rows.
    """

    tokens: int = 2048
    budget_mb: float | None = None
    seed: int = 0

    def __post_init__(self):
        _positive_int(self, "tokens")
        b = self.budget_mb
        if b is not None:
            mb = as_number(b)
            if mb is None or not is_finite(mb) or mb <= 0:
                raise ValueError(f"calibrate: Sampling.budget_mb (sample_budget_mb) must be a "
                                 f"positive number of MB, got {b!r}")
            _set(self, "budget_mb", mb)
        seed = as_int(self.seed)
        if seed is None:
            raise TypeError(f"calibrate: Sampling.seed must be an integer, got {self.seed!r}")
        low, high = SEED_RANGE
        if not low <= seed <= high:  # else the pass would fail naming no field
            raise ValueError(f"calibrate: Sampling.seed must be in [{low}, {high}] (what "
                             f"torch.manual_seed takes), got {self.seed!r}")
        _set(self, "seed", seed)


@dataclass(frozen=True)
class Auto:
    """How ``observer="auto"`` chooses.

    Attributes:
        candidates: the observers it chooses from, named in any case (one named twice runs
            once; None: those of :data:`~.recipe.DEFAULT_CANDIDATES` that are registered;
            ``"auto"`` is ignored).
        metric: what it minimises: ``"model"`` (default) the divergence of the model's output
            from the float model's on ``score_tokens`` calibration tokens, among whole
            configurations (:mod:`.auto`); per layer, ``"joint"`` the layer's output error
            with weight and input chosen together, ``"fisher"`` that error weighted by the
            loss's ``g^2`` per output feature, ``"tensor"`` the quantized tensor's own squared
            error, ``"output"`` the error one role's quantization causes in ``x W^T``
            (was ``auto_metric=``).
        loss: for ``"model"``, ``callable(output, reference_output, batch) -> float``
            replacing the default divergence; for ``"fisher"``,
            ``callable(output, batch) -> scalar tensor`` (default: the model's own loss);
            the other metrics call none, so refuse one.
        score_tokens: calibration tokens the ``"model"`` and ``"fisher"`` metrics run on;
            the other metrics read none, so refuse one set.
    """

    candidates: tuple[str, ...] | None = None
    metric: str = "model"
    loss: Callable | None = None
    score_tokens: int = 1024

    def __post_init__(self):
        c = self.candidates
        if c is not None:  # a tuple first: checking a generator would consume it
            names = tuple(c) if not isinstance(c, str) and hasattr(c, "__iter__") else None
            if names is None or not all(isinstance(n, str) for n in names):
                raise ValueError(f"calibrate: Auto.candidates must be a list of observer "
                                 f"names, got {c!r}")
            if not set(map(folded, names)) - {AUTO}:  # else it fails once calibration starts
                but = " but for 'auto' itself, which is ignored" if names else ""
                raise ValueError(f"calibrate: Auto.candidates is empty{but}; give at least one "
                                 f"observer name, or None for the default candidates")
            check_candidates(names)  # a name auto cannot run: refused now, not dropped later
            _set(self, "candidates", names)
        _one_of("Auto", "metric (auto_metric)", self.metric, AUTO_METRICS)
        if self.loss is not None and not callable(self.loss):
            raise ValueError(f"calibrate: Auto.loss must be callable, got {self.loss!r}")
        if self.loss is not None and self.metric not in LOSS_METRICS:  # never called there
            raise ValueError(f"calibrate: Auto.loss is used only by metric "
                             f"{' or '.join(map(repr, LOSS_METRICS))}; metric={self.metric!r} "
                             f"would ignore it (drop loss=, or choose one of those metrics)")
        _positive_int(self, "score_tokens")
        # the default counts as not set (as in from_keywords): a CLI run passes it always
        if self.score_tokens != Auto.score_tokens and self.metric not in LOSS_METRICS:
            raise ValueError(f"calibrate: Auto.score_tokens ({self.score_tokens}) is read only "
                             f"by metric {' or '.join(map(repr, LOSS_METRICS))}; "
                             f"metric={self.metric!r} would ignore it (drop score_tokens=, or "
                             f"choose one of those metrics)")


@dataclass(frozen=True)
class MoE:
    """Mixture-of-experts models (:mod:`.moe`).

    Attributes:
        all_experts: every expert observes every token, while the block's output stays the
            routed one; default: each expert its routed tokens.
        min_tokens: in routed mode, an expert that saw fewer tokens has its activation
            ranges shrunk toward its layer's pooled range (was ``expert_min_tokens=``); with
            ``all_experts`` refused (every expert sees every token).
    """

    all_experts: bool = False
    min_tokens: int = MIN_TOKENS

    def __post_init__(self):
        _bool("MoE", "all_experts", self.all_experts)
        _positive_int(self, "min_tokens", "min_tokens (expert_min_tokens)")
        if self.all_experts and self.min_tokens != MIN_TOKENS:  # routed mode only: never read
            raise ValueError(f"calibrate: MoE.min_tokens ({self.min_tokens}) shrinks the ranges "
                             f"of experts few tokens were routed to; with all_experts=True "
                             f"every expert sees every token, so it would be ignored (drop "
                             f"min_tokens=, or all_experts=True)")


@dataclass(frozen=True)
class Outliers:
    """What is done about activations that quantize badly.

    Attributes:
        smooth: SmoothQuant's alpha (llm-compressor's ``smoothing_strength``, 0.5-0.8 is
            usual): before calibrating, each decoder layer's activation outliers move into
            the next weights (:mod:`.smooth`; one more forward, on the first batch).
            **Changes the model's parameters in place**. None: no smoothing.
        keep_float: this many activations, those whose quantization moves their own layer's
            output most (one more forward on the first batch), stay out of static
            quantization; ``calibration.info["keep_float"]`` lists them. "The first batch"
            is the first holding a value (one of 0 rows passes every module through); across
            ranks both read that of the lowest rank that holds one (:mod:`.run.outliers`).
        fallback: what those get: ``"dynamic"`` per-token qparams at run time in the same
            format, or ``"float"``.
    """

    smooth: float | None = None
    keep_float: int = 0
    fallback: str = "dynamic"

    def __post_init__(self):
        try:
            _set(self, "smooth", _check_alpha(self.smooth))
        except ValueError as e:  # named as the other fields are
            raise ValueError(f"calibrate: Outliers.{e}") from None
        k = as_int(self.keep_float)
        if k is None or k < 0:
            raise ValueError(f"calibrate: Outliers.keep_float must be a non-negative integer, "
                             f"got {self.keep_float!r}")
        _set(self, "keep_float", k)
        _one_of("Outliers", "fallback", self.fallback, FALLBACK_MODES)
        if self.fallback != "dynamic" and not k:  # nothing falls back: say so, not ignore it
            raise ValueError(f"calibrate: Outliers.fallback ({self.fallback!r}) is what the "
                             f"keep_float activations get; keep_float=0 keeps none, so it would "
                             f"be ignored (give keep_float=, or drop fallback=)")


@dataclass(frozen=True)
class Sequential:
    """One block at a time, for models larger than memory (:mod:`.sequential`).

    Attributes:
        mode: ``"float"`` (each block calibrated on the float model's activations) or
            ``"quantized"`` (on the previous blocks' quantized outputs; one recipe).
        checkpoint: a safetensors file or folder the blocks' weights load from (a model
            built on the meta device, :func:`~.checkpoint.empty_model`).
        blocks: the ``nn.ModuleList`` of blocks, by name (None: found).
        cache_budget_mb: the memory the blocks' cached activations may take before they
            spill to disk (None: the default of :mod:`.sequential`).
        cache_dir: the existing folder they spill to (None: the system's temporary folder).
        device: where the weights loaded from ``checkpoint`` go, so where the blocks run (a
            torch device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; None: the CPU, where
            safetensors reads them); the batches must be there too. Needs ``checkpoint``:
            weights already loaded stay where they are. Checked against the devices this
            torch sees when calibration starts (:meth:`check_here`).
    """

    mode: str = "float"
    checkpoint: Any = None
    blocks: str | None = None
    cache_budget_mb: float | None = None
    cache_dir: Any = None
    device: Any = None

    def __post_init__(self):
        _one_of("Sequential", "mode", self.mode, MODES)
        b = self.cache_budget_mb
        if b is not None:  # inf / NaN have no byte count
            mb = as_number(b)
            if mb is None or not is_finite(mb) or mb < 0:
                raise ValueError(f"calibrate: Sequential.cache_budget_mb must be a finite "
                                 f"number of MB >= 0, got {b!r}")
            _set(self, "cache_budget_mb", mb)
        for name in ("checkpoint", "cache_dir"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ValueError(f"calibrate: Sequential.{name} must be a path (str or "
                                 f"os.PathLike) or None, got {type(v).__name__} {v!r}")
        if self.blocks is not None and not isinstance(self.blocks, str):
            raise ValueError(f"calibrate: Sequential.blocks must be the name of the blocks' "
                             f"nn.ModuleList (a str) or None, got {self.blocks!r}")
        if self.device is not None:
            object.__setattr__(self, "device", _device(self.device))
            if self.checkpoint is None:  # it would move nothing: say so rather than ignore it
                raise ValueError(f"calibrate: Sequential.device ({self.device}) is where the "
                                 f"weights loaded from checkpoint go; give checkpoint= too, or "
                                 f"move the model to {self.device} before calibrating")

    def check_here(self) -> None:
        """Raises unless this machine has :attr:`cache_dir` and this torch can use
        :attr:`device` (at the start of a calibration, not when made: the options may be
        written on another machine)."""
        if self.cache_dir is not None and not os.path.isdir(self.cache_dir):
            raise ValueError(f"calibrate: Sequential.cache_dir {os.fspath(self.cache_dir)!r} "
                             f"is not an existing folder (the cached activations spill there)")
        if self.device is not None:
            check_device(self.device, "calibrate: Sequential.device")

    def keywords(self) -> dict:
        """:func:`~.sequential.calibrate_sequential`'s keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Runtime:
    """Where and how the pass runs.

    Attributes:
        distributed: inside a ``torch.distributed`` process group (e.g. under ``torchrun``),
            calibrate data-parallel: each rank takes every ``world``-th batch and a share of
            the weights, every rank returns the same result. A no-op in a single process.
        group: the process group (None: the default group).
        missing: an activation role that saw no tokens (and is not an MoE expert's):
            ``"skip"`` leaves that role unquantized, ``"float"`` the whole layer, ``"error"``
            raises; a fallback is listed in ``calibration.info["missing"]`` and warned about.
        time_groups: ``{name: [labels]}``: also time each group of recipes as one, in each
            member's ``info["group_seconds"][name]`` (``auto`` times its candidates so);
            kept read-only (a hashable mapping, each group a tuple).
    """

    distributed: bool = False
    group: Any = None
    missing: str = "skip"
    time_groups: dict | None = None

    def __post_init__(self):
        _bool("Runtime", "distributed", self.distributed)
        check_group(self.group, self.distributed)
        _one_of("Runtime", "missing", self.missing, MISSING_POLICIES)
        if self.time_groups is not None:  # read-only and hashable: the frozen dataclass hashes it
            _set(self, "time_groups", _time_groups(self.time_groups))


def _time_groups(groups) -> FrozenDict:
    # str names (info["group_seconds"] is saved as JSON) of lists of str labels, read twice
    # (a string would be its letters)
    if not (isinstance(groups, Mapping) and all(
            isinstance(name, str) and isinstance(labels, (list, tuple, set, frozenset))
            and all(isinstance(label, str) for label in labels)
            for name, labels in groups.items())):
        raise ValueError(f"calibrate: Runtime.time_groups must be a dict of str label lists "
                         f"({{'name': ['label', ...]}}), got {groups!r}")
    return FrozenDict((k, tuple(v)) for k, v in groups.items())


_KINDS = {"sampling": Sampling, "auto": Auto, "moe": MoE, "outliers": Outliers,
          "sequential": Sequential, "runtime": Runtime}


@dataclass(frozen=True)
class Options:
    """All of a calibration's options, the one value the session passes on."""

    sampling: Sampling = field(default_factory=Sampling)
    auto: Auto = field(default_factory=Auto)
    moe: MoE = field(default_factory=MoE)
    outliers: Outliers = field(default_factory=Outliers)
    sequential: Sequential | None = None
    runtime: Runtime = field(default_factory=Runtime)
    progress: bool = True

    def __post_init__(self):
        for name, kind in _KINDS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name == "sequential" and value is None):
                raise TypeError(f"calibrate: {name} must be {kind.__name__}(...), got "
                                f"{type(value).__name__}")
        _bool("Options", "progress", self.progress)

    def but(self, **changes) -> Options:
        """A copy with fields of the objects changed: ``but(sampling__seed=1, progress=False)``.
        ``sequential__...`` needs a :class:`Sequential` (here or in ``changes``): None is off,
        and changing a field does not turn it on."""
        top = {k: v for k, v in changes.items() if "__" not in k}
        nested = {}
        for key, value in changes.items():
            if "__" in key:
                kind, name = _path(key)
                nested.setdefault(kind, {})[name] = value
        for kind, values in nested.items():  # together: fields checked against each other
            owner = top.get(kind, getattr(self, kind))
            if owner is None:
                raise ValueError(f"Options.but: {kind}__{next(iter(values))}: {kind} is None "
                                 f"(off); pass {kind}={_KINDS[kind].__name__}(...) instead")
            top[kind] = replace(owner, **values)
        return replace(self, **top)


def _path(key: str) -> tuple[str, str]:
    """``"object__field"`` of :meth:`Options.but` as (object, field); anything else is a
    ``TypeError`` naming it, as an unknown keyword would be."""
    kind, _, name = key.partition("__")
    if kind not in _KINDS:
        raise TypeError(f"Options.but: {key!r} is not object__field (one level, objects: "
                        f"{', '.join(_KINDS)})")
    names = [f.name for f in fields(_KINDS[kind])]
    if name not in names:
        raise TypeError(f"Options.but: {key!r}: {_KINDS[kind].__name__} has no field "
                        f"{name!r} (fields: {', '.join(names)})")
    return kind, name


#: the flat keywords of before, each the field it became: (object, field)
KEYWORDS = {
    "sample_tokens": ("sampling", "tokens"), "sample_budget_mb": ("sampling", "budget_mb"),
    "seed": ("sampling", "seed"),
    "candidates": ("auto", "candidates"), "auto_metric": ("auto", "metric"),
    "loss": ("auto", "loss"), "score_tokens": ("auto", "score_tokens"),
    "all_experts": ("moe", "all_experts"), "expert_min_tokens": ("moe", "min_tokens"),
    "smooth": ("outliers", "smooth"), "keep_float": ("outliers", "keep_float"),
    "fallback": ("outliers", "fallback"),
    "checkpoint": ("sequential", "checkpoint"), "blocks": ("sequential", "blocks"),
    "cache_budget_mb": ("sequential", "cache_budget_mb"),
    "cache_dir": ("sequential", "cache_dir"), "device": ("sequential", "device"),
    "distributed": ("runtime", "distributed"), "group": ("runtime", "group"),
    "missing": ("runtime", "missing"), "time_groups": ("runtime", "time_groups"),
}


def _device(value) -> torch.device:
    """``Sequential.device`` as a ``torch.device`` (whether this torch has it: later)."""
    if isinstance(value, torch.device):
        return value
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError) as e:
        reason = str(e).splitlines()[0]
        raise ValueError(f"calibrate: Sequential.device must be a torch device such as 'cpu', "
                         f"'cuda' or 'cuda:1', got {value!r} ({reason})") from None


def check_device(device: torch.device, who: str) -> None:
    """Raises a ValueError that starts with ``who`` unless this torch sees ``device`` (its
    type, and its index among that type's devices); the command line's ``--device`` too."""
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
    count = (backend.device_count() if backend is not None
             and getattr(backend, "is_available", lambda: False)() else 0)
    if not count:
        cuda = device.type == "cuda" and torch.version.cuda is None
        raise ValueError(f"{who} {device}: this torch sees no {device.type} device (torch "
                         f"{torch.__version__}{', built without CUDA' if cuda else ''}); cpu "
                         f"runs here")
    if device.index is not None and device.index >= count:
        raise ValueError(f"{who} {device}: this machine has {count} {device.type} "
                         f"device{'s' if count > 1 else ''} ({device.type}:0 to "
                         f"{device.type}:{count - 1})")


def as_sequential(value) -> Sequential | None:
    """The ``sequential=`` argument: a :class:`Sequential`, ``True`` / ``"float"`` /
    ``"quantized"`` (its mode), or ``None`` / ``False`` (off)."""
    if value is None or value is False:
        return None
    if isinstance(value, Sequential):
        return value
    if value is True:
        return Sequential()
    if isinstance(value, str) and value in MODES:
        return Sequential(mode=value)
    raise ValueError(f"calibrate: sequential must be True or one of {MODES} or a Sequential, "
                     f"got {value!r}")


def from_keywords(options: Options, keywords: dict) -> Options:
    """``options`` with the flat keywords of before applied (one ``DeprecationWarning``
    naming the new spelling of each); an unknown keyword is a ``TypeError``, one that sets a
    field its object sets too a ``ValueError``."""
    if not keywords:
        return options
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"calibrate: unexpected keyword argument {unknown[0]!r} (options: "
                        f"{', '.join(_KINDS)}, progress)")
    if options.sequential is None and any(KEYWORDS[k][0] == "sequential" for k in keywords):
        raise TypeError("calibrate: checkpoint, blocks, cache_budget_mb, cache_dir and device "
                        "are options of sequential calibration; pass sequential=True")
    _check_not_set_twice(options, keywords)
    spelled = [f"{k}= -> {_KINDS[KEYWORDS[k][0]].__name__}({KEYWORDS[k][1]}=...)"
               for k in keywords]
    warnings.warn(f"calibrate: keyword options are deprecated, pass the option objects of "
                  f"quantscope.calibration.options: {'; '.join(spelled)}", DeprecationWarning,
                  stacklevel=outside_quantscope())
    return options.but(**{f"{KEYWORDS[k][0]}__{KEYWORDS[k][1]}": v for k, v in keywords.items()})


def _check_not_set_twice(options: Options, keywords: dict) -> None:
    """Raises if a flat keyword sets a field its option object already sets, rather than let
    one silently win. A field at its default counts as not set: the entry points fill in
    default objects, so an object's default field cannot be told from one not given."""
    for key, given in keywords.items():
        kind, name = KEYWORDS[key]
        default = next(f.default for f in fields(_KINDS[kind]) if f.name == name)
        value = getattr(getattr(options, kind), name)
        if value is not default and value != default:
            raise ValueError(f"calibrate: {key}={given!r} and {kind}={_KINDS[kind].__name__}"
                             f"({name}={value!r}) both set {kind}.{name}; pass it once (the "
                             f"keyword is deprecated)")
