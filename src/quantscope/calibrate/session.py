"""Calibration: observe a model's weights once and its activations over the batches.

:func:`calibrate` runs one recipe; :func:`calibrate_many` runs several in **one**
pass over the data: the observers of all recipes are attached together, and a
recipe that asks for the same (layer, role, spec, observer) as another shares
its observer. ``observer="auto"`` observes every candidate and keeps what
``auto_metric`` says is best: by default (``"model"``) the whole configuration
whose model output is closest to the float model's (:mod:`.auto`); per layer, the
candidates with the least error in the layer's output (``"joint"``, ``"fisher"``,
``"output"``) or in the tensor itself (``"tensor"``).

Hooks are removed in a ``finally``, whatever happens; the model's train / eval
mode is restored; forwards run under ``torch.inference_mode``.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings

import torch
from torch import nn

from .. import comm as qd
from ..observers.sync import sync_observers
from . import auto as _auto
from . import gather, kv_cache, layer_choice, moe
from . import sequential as _sequential
from . import smooth as _smooth
from .finish import MISSING_POLICIES, build_states
from .observe import (
    DEFAULT_SAMPLE_BUDGET_MB,
    check_shapes,
    make_plan,
    observe_batches,
    observer_seconds,
    sample_budget,
    share_group_inputs,
    unique_slots,
)
from .recipe import AUTO, Recipe, preset
from .result import Calibration
from .samples import RowSample
from .sensitivity import check_fallback, fall_back

__all__ = ["AUTO_METRICS", "DEFAULT_SAMPLE_BUDGET_MB", "calibrate", "calibrate_many"]

#: what ``auto`` can minimise (see :func:`calibrate_many`); "model", "joint" and "fisher"
#: live in :mod:`.auto`
AUTO_METRICS = ("model", "joint", "fisher", "tensor", "output")


def _as_recipe(recipe, observer) -> Recipe:
    if isinstance(recipe, str):
        recipe = preset(recipe, observer or "minmax")
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"calibrate: recipe must be a preset name or a Recipe, got "
                        f"{type(recipe).__name__}")
    elif observer is not None:
        recipe = recipe.with_observer(observer)
    return recipe


def _check_kv_cache(model, recipes) -> None:
    """A recipe that asks for the KV cache on a model without attention modules is an error
    (one piece of a sequential calibration may have none; the whole model must)."""
    asked = [r.name for r in recipes.values() if r.kv_cache is not None]
    if asked and not kv_cache.attention_modules(model):
        raise ValueError(f"calibrate: recipe {asked[0]!r} sets kv_cache but the model has no "
                         f"attention module with k_proj / v_proj (transformers')")


def calibrate_many(model: nn.Module, batches, recipes, *, candidates=None,
                   sample_tokens: int = 2048, sample_budget_mb: float | None = None,
                   progress: bool = True,
                   seed: int = 0, distributed: bool = False, group=None,
                   auto_metric: str = "model", loss=None, score_tokens: int = 1024,
                   all_experts: bool = False, expert_min_tokens: int = moe.MIN_TOKENS,
                   missing: str = "skip", sequential=False, keep_float: int = 0,
                   fallback: str = "dynamic", smooth: float | None = None,
                   time_groups: dict | None = None,
                   **sequential_options) -> dict[str, Calibration]:
    """Calibrate several recipes in one pass over ``batches``.

    Args:
        model: any ``nn.Module``.
        batches: an iterable of model inputs: a dict (``model(**b)``), a tuple / list
            (``model(*b)``) or a tensor (``model(b)``).
        recipes: ``{label: recipe}`` or a list of recipes (labelled by name); a recipe
            is a :class:`Recipe` or a preset name.
        candidates: the observers ``auto`` chooses from (default: those of
            :data:`~quantscope.calibrate.recipe.DEFAULT_CANDIDATES` that are registered).
        sample_tokens: activation rows kept per layer for ``auto`` and the report, at most.
        sample_budget_mb: the memory of all those rows together (float32, every layer and
            role); when ``sample_tokens`` rows each would not fit, every sampled tensor keeps
            the same smaller number of rows (at least one). Default
            :data:`DEFAULT_SAMPLE_BUDGET_MB` (64 MB). Only ``auto`` and the report's
            activation rows (SQNR, clipping) use the sample; other qparams do not depend on it.
        progress: show a tqdm progress bar over the batches.
        seed: seeds the choice of sampled rows.
        auto_metric: what ``auto`` minimises: ``"model"`` (default) the divergence of the
            model's output from the float model's on the first calibration batches
            (``score_tokens`` tokens), choosing among whole configurations: each candidate
            observer and the ``"joint"`` choice (:mod:`.auto`); per layer, ``"joint"`` the
            layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` with weight and input
            chosen together, ``"fisher"`` that error weighted by the loss's ``g^2`` per
            output feature, ``"tensor"`` the squared error of the quantized tensor itself
            (the report's SQNR), or ``"output"`` the error one role's quantization causes in
            ``x W^T``. See the README for the measurements behind the default.
        loss: for ``"model"``, ``callable(output, reference_output, batch) -> float``
            replacing the default divergence (KL of next-token distributions for causal LMs,
            ``1 - cosine`` of mean-pooled outputs otherwise); for ``"fisher"``,
            ``callable(output, batch) -> scalar tensor`` (default: the model's own loss).
        score_tokens: calibration tokens the ``"model"`` and ``"fisher"`` metrics run on.
        distributed: inside a ``torch.distributed`` process group (e.g. under ``torchrun``),
            calibrate data-parallel: each rank takes every ``world``-th batch and a share of
            the weights, statistics are synced before qparams, every rank returns the same
            result (write files from rank 0 only). A no-op in a single process.
        group: the process group (default: the default group).
        all_experts: MoE experts (see :mod:`~quantscope.calibrate.moe`) each observe every
            token, while the block's output stays the routed one; default: the routed tokens.
        expert_min_tokens: in routed mode, an expert that saw fewer tokens has its activation
            ranges shrunk toward its layer's pooled range (none: the pooled range).
        missing: an activation role that saw no tokens (a layer never called, or called
            only with 0 rows) and is not an MoE expert's: ``"skip"`` (default) leaves that
            role unquantized, the layer keeps its weight quantization (a weight-only
            scheme); ``"float"`` leaves the whole layer in float; ``"error"`` raises. Either
            fallback is listed in ``calibration.info["missing"]`` and warned about.
        sequential: ``True`` / ``"float"`` or ``"quantized"``: one block at a time
            (:mod:`.sequential`, for models larger than memory); ``sequential_options``
            (``checkpoint``, ``blocks``, ``cache_budget_mb``, ``cache_dir``, ``device``) go
            to :func:`.sequential.calibrate_sequential`.
        keep_float: this many activations stay out of static quantization: those whose
            quantization moves their own layer's output most
            (:func:`~.sensitivity.layer_sensitivity` on the first batch, one more forward;
            then :func:`~.sensitivity.keep_float`). ``fallback="dynamic"`` (default) quantizes
            them per token at run time in the same format, ``"float"`` leaves them in float.
            ``calibration.info["keep_float"]`` lists them. Not with ``sequential``.
        smooth: SmoothQuant's alpha (llm-compressor's ``smoothing_strength``, 0.5-0.8 is
            usual): before calibrating, each decoder layer's activation outliers are moved
            into the next weights (:mod:`.smooth`), with channel ranges from the first batch
            (one more forward). **Changes the model's parameters in place**; calibrate, apply
            and export that model. ``calibration.info["smooth"]`` says what was smoothed,
            ``calibration.smoothing`` holds the scales.
            Not with ``sequential``.
        time_groups: ``{name: [labels]}``: also time each group of recipes as one (the
            pass's shared time plus every observer the group uses, each once), in each
            member's ``info["group_seconds"][name]``. ``auto`` times its candidates so. Not
            with ``sequential``.
    """
    recipes = _checked(model, recipes, sample_tokens, sample_budget_mb, auto_metric, missing,
                       expert_min_tokens)
    check_fallback(keep_float, fallback, bool(sequential or sequential_options))
    _smooth.check(smooth, bool(sequential or sequential_options))
    t0 = time.perf_counter()
    if batches is None:
        batches = []
    _check_kv_cache(model, recipes)
    check_shapes(model, recipes.values())  # before any forward (smooth, fisher, sequential)

    def run(batches):  # the calibration itself; keep_float's ranking follows it
        if sequential or sequential_options:
            return _sequential.calibrate_sequential(
                calibrate_many, model, batches, recipes, mode=sequential, progress=progress,
                candidates=candidates, sample_tokens=sample_tokens,
                sample_budget_mb=sample_budget_mb, seed=seed, distributed=distributed,
                group=group, auto_metric=auto_metric, loss=loss, score_tokens=score_tokens,
                all_experts=all_experts, expert_min_tokens=expert_min_tokens, missing=missing,
                **sequential_options)
        if auto_metric == "model" and any(_auto._has_auto(r) for r in recipes.values()):
            return _auto.calibrate_end_to_end(
                calibrate_many, model, batches, recipes, candidates=candidates,
                score_tokens=score_tokens, loss=loss, sample_tokens=sample_tokens,
                progress=progress, seed=seed, distributed=distributed, group=group,
                all_experts=all_experts, expert_min_tokens=expert_min_tokens, missing=missing,
                sample_budget_mb=sample_budget_mb)
        fisher = None
        if auto_metric == "fisher":
            batches = list(batches)
            fisher = _fisher_weights(model, batches, recipes, score_tokens, loss)
        # MoE experts become Linear views for the whole calibration (moe.py); restored after
        with moe.attach(model, bool(all_experts)) as experts:
            experts.min_tokens = expert_min_tokens
            if distributed and qd.is_distributed(group):
                return _calibrate_distributed(model, batches, recipes, candidates, sample_tokens,
                                              progress, seed, group, t0, auto_metric, experts,
                                              missing, sample_budget_mb, time_groups)
            return _calibrate_local(model, batches, recipes, candidates, sample_tokens, progress,
                                    seed, t0, auto_metric, experts, missing, sample_budget_mb,
                                    fisher, time_groups)

    return _around(model, batches, run, smooth, keep_float, fallback, distributed, group)


def _around(model, batches, run, smooth, keep_float, fallback, distributed, group):
    """``run(batches)``, the calibration itself, with what goes around it: SmoothQuant
    before (ranges from the first batch), the float fallback after (ranked on it)."""
    smoothed = None
    if smooth is not None:
        first, batches = _peek(batches)
        smoothed = _smooth.smooth(model, [] if first is None else [first], smooth,
                                  distributed=distributed, group=group)
    if not keep_float:
        out = run(batches)
    else:
        first, batches = _peek(batches)
        out = {k: fall_back(model, first, c, keep_float, fallback)
               for k, c in run(batches).items()}
    if smoothed is not None:
        scales = smoothed.pop("scales")
        for c in out.values():
            c.smoothing, c.info["smooth"] = dict(scales), dict(smoothed)
    return out


def _checked(model, recipes, sample_tokens, sample_budget_mb, auto_metric, missing,
             expert_min_tokens) -> dict[str, Recipe]:
    """:func:`calibrate_many`'s ``{label: Recipe}``; raises naming the argument unless each
    is of its kind and in range (before any hook is attached or batch run)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(sample_tokens, int) or sample_tokens < 1:
        raise ValueError(f"calibrate: sample_tokens must be a positive integer, got "
                         f"{sample_tokens!r}")
    if sample_budget_mb is not None and not (
            isinstance(sample_budget_mb, (int, float)) and not isinstance(sample_budget_mb, bool)
            and math.isfinite(sample_budget_mb) and sample_budget_mb > 0):
        raise ValueError(f"calibrate: sample_budget_mb must be a positive number of MB, got "
                         f"{sample_budget_mb!r}")
    recipes = _as_recipes(recipes)
    if auto_metric not in AUTO_METRICS:
        raise ValueError(f"calibrate: auto_metric must be one of {AUTO_METRICS}, got "
                         f"{auto_metric!r}")
    if missing not in MISSING_POLICIES:
        raise ValueError(f"calibrate: missing must be one of {MISSING_POLICIES}, got "
                         f"{missing!r}")
    if not isinstance(expert_min_tokens, int) or expert_min_tokens < 1:
        raise ValueError(f"calibrate: expert_min_tokens must be a positive integer, got "
                         f"{expert_min_tokens!r}")
    return recipes


def _peek(batches):
    """``(first batch, batches)`` with nothing consumed: a list stays a list; an iterator
    goes on from its first batch."""
    if isinstance(batches, (list, tuple)):
        return (batches[0] if batches else None), batches
    it = iter(batches)
    first = next(it, None)
    return first, ([] if first is None else itertools.chain([first], it))


def _as_recipes(recipes) -> dict[str, Recipe]:
    """``{label: Recipe}`` of a recipe, a list of recipes (labelled by name) or a dict; preset
    names become their recipes."""
    if isinstance(recipes, (str, Recipe)):
        recipes = [recipes]
    if not isinstance(recipes, dict):
        recipes = [_as_recipe(r, None) for r in recipes]
        recipes = {r.name: r for r in recipes}
    else:
        recipes = {k: _as_recipe(r, None) for k, r in recipes.items()}
    if not recipes:
        raise ValueError("calibrate: no recipe given")
    return recipes


def _fisher_weights(model, batches, recipes, score_tokens, loss):
    """The loss's ``g^2`` per output feature of every weight an ``auto`` recipe quantizes
    (``auto_metric="fisher"``), from backward passes over the first ``score_tokens`` tokens."""
    layers = {layer for r in recipes.values() if _auto._has_auto(r)
              for layer, (_, roles) in r.match(model).items() if "weight" in roles}
    return layer_choice.fisher_weights(model, _auto.score_batches(batches, score_tokens),
                                       sorted(layers), loss)


def _calibrate_local(model, batches, recipes, candidates, sample_tokens, progress, seed, t0,
                     auto_metric, experts, missing, sample_budget_mb, fisher, time_groups=None):
    """``calibrate_many`` in one process: weights observed once, activations over the
    batches (skipped where no recipe needs them)."""
    slots, plans = make_plan(model, recipes, candidates)
    batches, groups = share_group_inputs(model, batches, recipes, slots)
    experts.reset_counts()
    needs_data = any(s.role != "weight" and (s.observers or s.needs_sample)
                     for s in slots.values())
    n = (observe_batches(model, batches, slots, sample_tokens, progress, seed, sample_budget_mb)
         if needs_data else 0)
    return _conclude(slots, plans, recipes, n, needs_data, t0, auto_metric=auto_metric,
                     groups=groups, experts=experts, model=model, missing=missing,
                     fisher=fisher, time_groups=time_groups)


def _conclude(slots, plans, recipes, n, needs_data, t0, processes=1, auto_metric="tensor",
              groups=(), experts=None, model=None, missing="skip", fisher=None,
              time_groups=None):
    if needs_data and n == 0 and any(r.needs_data for r in recipes.values()):
        raise ValueError("calibrate: batches is empty: the recipe quantizes activations "
                         "statically, which needs at least one calibration batch")
    with torch.no_grad():
        results, hists = build_states(slots, plans, recipes, auto_metric, groups, experts, missing,
                                 fisher)
    seconds = time.perf_counter() - t0
    # each recipe: the pass's shared time (forwards, planning, report) plus its own observers'
    common = seconds - sum(t for s in unique_slots(slots.values()) for t in s.seconds.values())
    group_seconds = {label: {} for label in recipes}
    for name, labels in (time_groups or {}).items():
        s = round(common + observer_seconds(slots, *(plans[k] for k in labels)), 3)
        for label in labels:
            group_seconds[label][name] = s
    out = {}
    for label, recipe in recipes.items():
        states, rows, shared, per_expert, absent = results[label]
        own = observer_seconds(slots, plans[label])
        info = {"batches": n, "calibration_seconds": round(common + own, 3)}
        if group_seconds[label]:
            info["group_seconds"] = group_seconds[label]
        if absent:
            info["missing"] = absent
            warnings.warn(f"calibrate: {len(absent)} activation roles saw no tokens and fall "
                          f"back ({absent[0]['layer']!r} {absent[0]['role']}: "
                          f"{absent[0]['fallback']}; all in calibration.info['missing'])",
                          stacklevel=3)
        if shared:
            info["fusion_groups"] = shared
        if per_expert:
            info["experts"] = per_expert
            info["expert_min_tokens"] = experts.min_tokens
        missed = moe.unreached(model, recipe) if model is not None else []
        if missed:
            info["unreached"] = missed
            warnings.warn(f"calibrate: recipe {recipe.name!r} targets weights quantscope cannot "
                          f"reach; left in float: {[u['name'] for u in missed]}", stacklevel=3)
        if processes > 1:
            info["processes"] = processes
        out[label] = Calibration(recipe, states, label, rows, hists, info)
    return out


def _calibrate_distributed(model, batches, recipes, candidates, sample_tokens, progress, seed,
                           group, t0, auto_metric="tensor", experts=None, missing="skip",
                           sample_budget_mb=None, time_groups=None):
    """``calibrate_many`` across the ranks of ``group``, every rank returning the same result.

    Batches are sharded round-robin; each weight is observed by one rank (balanced by
    size) and its state shared; after the local forwards, the activation observers are
    synced (exact for min / max and histograms, AVG for moving averages: see
    :mod:`quantscope.distributed`). With ``auto`` the sampled rows are gathered so every
    rank decides on the same data; otherwise the report rows (activation SQNR, clipping)
    come from rank 0's own sample and are empty on the other ranks. Local steps run under
    :func:`~quantscope.distributed.all_or_none`: an error on one rank raises on all.
    """
    world = qd.world_size(group)
    quantized = {layer for r in recipes.values()
                 for layer, (_, roles) in r.match(model).items() if "weight" in roles}
    owners = gather.weight_owners(model, quantized, group)
    me = qd.rank(group)
    with qd.all_or_none("planning", group):
        slots, plans = make_plan(model, recipes, candidates, owns=lambda l: owners.get(l, me) == me)
        batches, groups = share_group_inputs(model, batches, recipes, slots)
    experts.reset_counts()
    failed = gather.gather_failures({k: s.failed for k, s in slots.items() if s.role == "weight"},
                                group)
    for k, f in failed.items():  # a candidate that failed on its owner is dropped everywhere
        slots[k].failed.update(f)
        for key in f:
            slots[k].observers.pop(key, None)
    sync_observers([o for s in slots.values() if s.role == "weight"
                       for o in s.observers.values()], group)
    needs_data = any(s.role != "weight" and (s.observers or s.needs_sample)
                     for s in slots.values())
    # 'auto' decides on the sampled rows, so every rank needs the same sample: gather it;
    # otherwise the sample only feeds the report, which rank 0 makes from its own rows
    auto = any(cfg.observer == AUTO for p in plans.values() for cfg, _ in p.values())
    n = 0
    if needs_data:
        with qd.all_or_none("calibration", group):
            n = observe_batches(model, qd.shard(batches, group), slots,
                     -(-sample_tokens // world) if auto else sample_tokens,
                     progress and qd.is_main(group), seed + me,
                     sample_budget(sample_budget_mb) / world if auto else sample_budget_mb,
                     batch_index=lambda i: i * world + me)  # qd.shard's round robin
        n = qd.all_sum(n, group)
        acts = {k: s for k, s in slots.items() if s.role != "weight"}
        sync_observers([o for s in unique_slots(acts.values()) for o in s.observers.values()],
                          group)
        if auto:
            local = {k: [] if s.sample is None or not s.sample.count else [s.sample.rows()]
                     for k, s in acts.items()}
            merged = gather.gather_samples(local, sample_tokens, group)
            for k, rows in merged.items():
                acts[k].sample = RowSample.holding(rows[0]) if rows else None
        elif not qd.is_main(group):  # no report rows here: the qparams are all that matter
            for s in acts.values():
                s.sample = None
    for counts in experts.counts.values():  # every rank reports the global counts
        counts[:] = [qd.all_sum(c, group) for c in counts]
    return _conclude(slots, plans, recipes, n, needs_data, t0, world, auto_metric, groups,
                     experts, model, missing, time_groups=time_groups)


def calibrate(model: nn.Module, batches, recipe="w8a8", *, observer: str | None = None,
              **kwargs) -> Calibration:
    """Calibrate ``model`` on ``batches`` with ``recipe``; returns a :class:`Calibration`.

    ``recipe`` is a preset name (``w8a8``, ``w8a8-dynamic``, ``w4a16``, ``w4a8``,
    ``fp8``, ``mxfp4``, ``nvfp4``) or a :class:`Recipe`; ``observer`` (a registry
    name or ``"auto"``) replaces the recipe's observers. Other keywords as
    :func:`calibrate_many`. Apply the result with ``calibration.apply(model)``.
    """
    r = _as_recipe(recipe, observer)
    return calibrate_many(model, batches, {r.name: r}, **kwargs)[r.name]
