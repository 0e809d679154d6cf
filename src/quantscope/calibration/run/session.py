"""Calibration: observe a model's weights once and its activations over the batches.

:func:`calibrate` runs one recipe; :func:`calibrate_many` runs several in **one**
pass over the data: the observers of all recipes are attached together, and a
recipe that asks for the same (layer, role, spec, observer) as another shares
its observer. ``observer="auto"`` observes every candidate and keeps what
``Auto.metric`` says is best: by default (``"model"``) the whole configuration
whose model output is closest to the float model's (:mod:`.auto`); per layer, the
candidates with the least error in the layer's output (``"joint"``, ``"fisher"``,
``"output"``) or in the tensor itself (``"tensor"``).

Hooks are removed in a ``finally``; each module's train / eval mode is restored, and a
SmoothQuant that ran is undone if the call raises. Forwards run under ``inference_mode``
but SmoothQuant's range pass (``no_grad``) and ``Auto(metric="fisher")``'s (a backward).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable
from dataclasses import fields

import torch
from torch import nn

from ... import comm as qd
from ..._checks import outside_quantscope
from ..choice import auto as _auto
from ..choice import layer_choice
from ..choice import smooth as _smooth
from ..choice.candidates import has_auto, ignores_non_finite
from ..choice.sensitivity import Sensitivity, check_fallback, measure
from ..options import (
    AUTO_METRICS,
    Auto,
    MoE,
    Options,
    Outliers,
    Runtime,
    Sampling,
    as_sequential,
    from_keywords,
)
from ..recipe import AUTO, Recipe, preset
from ..results.apply import refuse_applied
from ..results.result import Calibration
from ..structure import kv_cache
from ..structure import moe as _moe
from ..structure.fingerprint import record_fingerprints
from ..structure.fusion import one_fusion
from ..structure.placement import check_placement, refuse_compiled
from . import imatrix_roles
from . import sequential as _sequential
from .batches import batch_count, length_checked
from .dist_pass import calibrate_distributed
from .exclusive import calibrating
from .finish import build_states
from .gather import check_same_options
from .module_roles import check_shapes
from .observe import (
    DEFAULT_SAMPLE_BUDGET_MB,
    candidates_for,
    fed,
    make_plan,
    observe_batches,
    observer_seconds,
    share_group_inputs,
    unique_slots,
)
from .outliers import around
from .tied_roles import check_groups, check_recipes, check_states
from .unused_options import warn_idle_rules, warn_unused_activation_options, warn_unused_moe

__all__ = ["AUTO_METRICS", "DEFAULT_SAMPLE_BUDGET_MB", "calibrate", "calibrate_many",
           "calibrate_with", "sensitivity"]


def _as_recipe(recipe, observer) -> Recipe:
    if isinstance(recipe, str):
        recipe = preset(recipe, observer)  # None: the preset's own (nvfp4 inputs differ)
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"calibrate: recipe must be a preset name or a Recipe, got "
                        f"{type(recipe).__name__}")
    elif observer is not None:
        recipe = recipe.with_observer(observer)
    return recipe


def calibrate_many(model: nn.Module, batches, recipes, *, sampling: Sampling | None = None,
                   auto: Auto | None = None, moe: MoE | None = None,
                   outliers: Outliers | None = None, sequential=None,
                   runtime: Runtime | None = None, progress: bool = True,
                   **keywords) -> dict[str, Calibration]:
    """Calibrate several recipes in one pass over ``batches``.

    Args:
        model: any ``nn.Module``.
        batches: an iterable of model inputs: a dict (``model(**b)``), a tuple / list
            (``model(*b)``) or a tensor (``model(b)``).
        recipes: ``{label: recipe}`` or a list of recipes (labelled by name); a recipe
            is a :class:`Recipe` or a preset name.
        sampling: the activation rows kept for ``auto`` and the report
            (:class:`~.options.Sampling`: ``tokens``, ``budget_mb``, ``seed``).
        auto: how ``observer="auto"`` chooses (:class:`~.options.Auto`: ``candidates``,
            ``metric``, ``loss``, ``score_tokens``).
        moe: mixture-of-experts models (:class:`~.options.MoE`: ``all_experts``, ``min_tokens``).
        outliers: SmoothQuant before, activations kept out of static quantization after
            (:class:`~.options.Outliers`: ``smooth``, ``keep_float``, ``fallback``).
        sequential: one block at a time, for models larger than memory
            (:class:`~.options.Sequential`; ``True``, ``"float"`` or ``"quantized"`` stand for
            ``Sequential(mode=...)``). Not with ``outliers``, ``distributed`` or
            ``time_groups``.
        runtime: data-parallel processes, roles that saw no tokens, timing groups
            (:class:`~.options.Runtime`: ``distributed``, ``group``, ``missing``,
            ``time_groups``).
        progress: show a progress bar over the batches.
        keywords: the flat keywords of before (``sample_tokens=``, ``auto_metric=``,
            ``smooth=`` ...): deprecated, each mapped to its object's field with one
            ``DeprecationWarning`` that names the new spelling
            (:func:`~.options.from_keywords`); ``progress`` and ``sequential=True`` are not.
    """
    opts = _options(sampling, auto, moe, outliers, sequential, runtime, progress, keywords)
    return calibrate_with(model, batches, recipes, opts)


def _options(sampling, auto, moe, outliers, sequential, runtime, progress, keywords) -> Options:
    """The entry points' arguments as one :class:`~.options.Options` (defaults where None;
    the deprecated flat keywords applied, warning at the entry point's caller)."""
    def given(value, default):  # `or` would take {} or 0 for "not given" and run defaults
        return default() if value is None else value

    opts = Options(given(sampling, Sampling), given(auto, Auto), given(moe, MoE),
                   given(outliers, Outliers), as_sequential(sequential),
                   given(runtime, Runtime), progress)
    return from_keywords(opts, keywords)


def calibrate_with(model: nn.Module, batches, recipes, opts: Options) -> dict[str, Calibration]:
    """:func:`calibrate_many` with its options as one :class:`~.options.Options` value."""
    with calibrating(model):
        return _calibrate_with(model, batches, recipes, opts, top=True)


def _calibrate_with(model, batches, recipes, opts: Options, top=False) -> dict[str, Calibration]:
    """:func:`calibrate_with` inside its guard: the sequential pieces and auto's end-to-end
    candidates calibrate through here, on the model (or a block of it) the call holds;
    ``top``: the user's own call (the options checked against its recipes)."""
    t0 = time.perf_counter()
    batches = [] if batches is None else batches
    across = opts.runtime.distributed and qd.is_distributed(opts.runtime.group)
    # distributed: a check failing on one rank (its recipe, its batches) raises on every rank
    # here, not with the others waiting in the planning's collectives
    with (qd.all_or_none("calibrate's checks", opts.runtime.group, same_type=True)
          if opts.runtime.distributed else contextlib.nullcontext()):
        recipes = _checked(model, recipes, opts, top)
        batches = length_checked(batches, lengths=top)  # (a piece's batches are numbers)
        scored = opts.auto.metric == "model" and any(map(has_auto, recipes.values()))
        if scored:
            # read twice, the scoring prefix only: calibrated on, then scored on
            head, batches = _held(model, batches, opts, across)
            if not head and not across:  # (across ranks: below, once every rank is here)
                raise _auto.no_batches_error()
        kv_cache.check_asked(model, recipes.values())
        check_shapes(model, recipes.values())  # before any forward (smooth, fisher, sequential)
        if top:  # once the checks pass; here, not in the pass: sequential pieces and auto's
            # candidates calibrate through inner calls
            warn_unused_moe(recipes, opts.moe, _moe.has_experts(model, recipes.values()))
    if top and opts.runtime.distributed:  # every rank here: its checks passed on all
        check_same_options(opts, opts.runtime.group, recipes)
        # one collective on every rank, whatever its recipes (a rank not scoring adds 1)
        given = qd.all_sum(len(head) if scored else 1, opts.runtime.group)
        if scored and not given:  # no batch on any rank: one process's error, before a pass
            raise _auto.no_batches_error()

    def run(batches):  # the calibration itself; keep_float's ranking follows it
        if opts.sequential is not None:
            # every piece calibrates with the other options (none of the outliers' ones)
            inner = opts.but(sequential=None, runtime__time_groups=None)

            def piece(m, b, r, progress=False, replayed=False):
                # the head runs on the blocks' replayed outputs, fed by batch order: auto's
                # whole-model metrics forward it again (all batches, row pieces) and would
                # read the wrong batch's; there it chooses by its layers' output error
                auto = (Auto(inner.auto.candidates, "output")  # (reads no score_tokens)
                        if replayed and inner.auto.metric == "model" else inner.auto)
                return _calibrate_with(m, b, r, inner.but(progress=progress, auto=auto))

            return _sequential.calibrate_sequential(
                piece, model, batches, recipes, progress=opts.progress,
                **opts.sequential.keywords())
        if opts.auto.metric == "model" and any(has_auto(r) for r in recipes.values()):
            return _end_to_end(model, batches, recipes, opts)
        fisher = None
        if opts.auto.metric == "fisher":  # its g^2 from the scoring prefix, before the pass
            head, batches = _held(model, batches, opts, across, fisher=True)
            fisher = _fisher_weights(model, head, recipes, opts.auto, opts.runtime)
        # MoE experts become Linear views for the whole calibration (moe.py); restored after
        with _moe.attach(model, opts.moe.all_experts, recipes=recipes.values()) as experts:
            experts.min_tokens = opts.moe.min_tokens
            if across:
                return calibrate_distributed(model, batches, recipes, opts, t0, experts,
                                             _conclude, fisher)
            return _calibrate_local(model, batches, recipes, opts, t0, experts, fisher)

    checked = (lambda b: check_states(model, run(b))) if top else run  # tied: one state
    return around(model, batches, checked, opts.outliers, opts.runtime)


def _held(model, batches, opts: Options, across: bool, fisher: bool = False):
    """``(the scoring prefix, every batch)`` (:func:`.score_set.scoring_prefix`): a stream
    keeps only the prefix while the pass reads the rest once. Listed as before where the
    batches are needed whole or by number: across ranks (each rank's share, ``comm.shard``,
    is a list only for a list, and the activation sample is spread over its length), in
    sequential mode (each block replays them all; a block's own pass gets batch numbers),
    and for ``fisher`` without a length (a generator: its per-layer choice reads the
    sample, spread over the batches' number)."""
    listed = (across or opts.sequential is not None
              or _sequential.batch_source(model) is not None
              or (fisher and batch_count(batches) is None))
    if listed:
        batches = list(batches)
    return _auto.scoring_prefix(batches, opts.auto.score_tokens)


def _end_to_end(model, batches, recipes, opts: Options) -> dict[str, Calibration]:
    """``Auto(metric="model")`` (:func:`.auto.calibrate_end_to_end`; the outliers' steps go
    around it: :func:`.outliers.around`); a time group with an auto recipe counts its scoring
    too."""
    out = _auto.calibrate_end_to_end(_calibrate_with, model, batches, recipes,
                                     opts.but(outliers=Outliers()))
    for name, labels in (opts.runtime.time_groups or {}).items():
        scored = [out[k].info["auto"]["score_seconds"] for k in labels if has_auto(recipes[k])]
        for k in labels if scored else ():
            seconds = out[k].info["group_seconds"]
            seconds[name] = round(seconds[name] + scored[0], 3)
    return out


def _checked(model, recipes, opts: Options, top=False) -> dict[str, Recipe]:
    """:func:`calibrate_many`'s ``{label: Recipe}``; raises naming the argument where the
    model, the recipes or the options together do not fit (each option object checked its
    own fields when made), before any hook is attached or batch run."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate: model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_compiled(model, "calibrate")  # its hooks would see no activation
    parallel = [n for n, m in model.named_modules() if isinstance(m, nn.DataParallel)]
    if parallel:  # the observers record the pass's own thread, not the replicas' threads
        raise ValueError(f"calibrate: {'the model' if not parallel[0] else repr(parallel[0])} "
                         f"is an nn.DataParallel, whose replicas run in threads the "
                         f"observers do not record; pass the module it wraps (.module)")
    seq = opts.sequential
    check_placement(model, "calibrate", calibrating=True, skeleton=seq is not None)
    refuse_applied(model, "calibrate")  # its observers would see the QDQ values
    recipes = one_fusion(_as_recipes(recipes, inner=not top))  # one set of groups for all
    if top:  # not a piece's or auto's inner pass (auto's candidates: no auto role)
        _check_auto(recipes, opts.auto)
        check_recipes(model, recipes, opts.auto)  # tied weights two roles would split
        warn_unused_activation_options(recipes, opts)
        warn_idle_rules(model, recipes)
    if seq is not None:
        if opts.outliers.keep_float:
            check_fallback(opts.outliers.keep_float, opts.outliers.fallback, True)
        _smooth.check(opts.outliers.smooth, True)
        if opts.runtime.distributed:
            raise ValueError("calibrate: sequential and distributed calibration do not combine")
        if opts.runtime.time_groups:
            raise ValueError("calibrate: Runtime.time_groups is not available with sequential")
        fisher = opts.auto.metric == "fisher"  # else a loss is "model"'s: needs the model output
        if (fisher or opts.auto.loss is not None) and any(map(has_auto, recipes.values())):
            what, fix = (("Auto(metric='fisher') weighs errors by the model loss's gradients",
                          "use metric 'joint' (the same error, unweighted)") if fisher else
                         ("Auto.loss is called with the model's output",
                          "drop loss= (each block is then scored by its output's 1 - cosine)"))
            raise ValueError(f"calibrate: {what}, which needs the whole model's forward; "
                             f"sequential calibration runs one block at a time: {fix} or "
                             f"calibrate the whole model")
        seq.check_here()
    for name, labels in (top and opts.runtime.time_groups or {}).items():  # inner: auto's labels
        if unknown := [label for label in labels if label not in recipes]:
            raise ValueError(f"calibrate: Runtime.time_groups[{name!r}] names {unknown[0]!r}, "
                             f"which is not a recipe label; the labels are {list(recipes)}")
    return recipes


def _check_auto(recipes, auto: Auto) -> None:
    """Where a recipe has ``observer="auto"``: every option of its auto roles is taken by one of
    its candidates (:func:`.auto.check_options`, for every metric). Where none has, ``auto``
    must be left at its defaults: a field set would change nothing, so say so rather than
    ignore it (a field at its default counts as not set, as in ``from_keywords``)."""
    autos = {label: r for label, r in recipes.items() if has_auto(r)}
    names = candidates_for("input", auto.candidates) if autos else ()
    for label, r in autos.items():
        _auto.check_options(r, label, names, per_layer=auto.metric != "model")
    changed = [f.name for f in fields(Auto) if getattr(auto, f.name) != f.default]
    if changed and not autos:
        name = changed[0]
        raise ValueError(f"calibrate: Auto.{name} is set ({name}={getattr(auto, name)!r}), "
                         f"but Auto says how observer='auto' chooses and no recipe here has an "
                         f"'auto' role; it would be ignored (drop auto=, or calibrate with "
                         f"observer='auto')")


def _as_recipes(recipes, inner=False) -> dict[str, Recipe]:
    """``{label: Recipe}`` of a recipe, a list of recipes (labelled by name) or a dict; preset
    names become their recipes. ``inner``: auto's or a piece's pass, which may take the
    ``(label, observer)`` labels auto gives its candidates (the user's call may not: one
    would replace a candidate, or be replaced)."""
    if isinstance(recipes, (str, Recipe)):
        recipes = [recipes]
    if not isinstance(recipes, Iterable):  # (a dict, a list, a tuple, a generator)
        raise TypeError(f"calibrate: recipes must be a preset name, a Recipe, a list of them "
                        f"or a dict {{label: recipe}}, got {type(recipes).__name__}")
    if not isinstance(recipes, dict):
        recipes = [_as_recipe(r, None) for r in recipes]
        names = [r.name for r in recipes]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:  # labelled by name, the later one would replace the earlier
            raise ValueError(f"calibrate: two recipes are named {twice!r}; give each its own "
                             f"name, or label them with a dict {{label: recipe}}")
        recipes = dict(zip(names, recipes))
    else:
        # a label is saved with the calibration, and load() reads back a str; auto labels
        # the candidates it expands a recipe into (label, observer), never returned
        bad = [k for k in recipes if not isinstance(k, str) and not (inner and isinstance(
            k, tuple) and len(k) == 2 and all(isinstance(x, str) for x in k))]
        if bad:
            raise TypeError(f"calibrate: a recipe label must be a str, got {bad[0]!r} "
                            f"({type(bad[0]).__name__}); label it {str(bad[0])!r}")
        recipes = {k: _as_recipe(r, None) for k, r in recipes.items()}
    if not recipes:
        raise ValueError("calibrate: no recipe given")
    return recipes


def _fisher_weights(model, batches, recipes, auto: Auto, runtime: Runtime):
    """:func:`~.layer_choice.fisher_weights` of the ``auto`` recipes' weights ("fisher")."""
    autos = [r for r in recipes.values() if has_auto(r)]
    layers = {layer for r in autos for layer, (_, rs) in r.match(model).items() if "weight" in rs}
    ignore = all(map(ignores_non_finite, autos))
    return layer_choice.fisher_weights(model, _auto.score_batches(batches, auto.score_tokens),
                                       sorted(layers), auto.loss, ignore, runtime.distributed,
                                       runtime.group)


def _calibrate_local(model, batches, recipes, opts: Options, t0, experts, fisher):
    """``calibrate_many`` in one process: weights observed once, activations over the
    batches (skipped where no recipe needs them)."""
    sampling = opts.sampling
    slots, plans = make_plan(model, recipes, opts.auto.candidates)
    batches, groups = share_group_inputs(model, batches, recipes, slots)
    check_groups(plans, groups, slots)  # before the pass
    experts.reset_counts()
    needs_data = any(map(fed, slots.values()))
    importance = imatrix_roles.gather(model, slots)  # imatrix_mse weights: their inputs' x^2
    try:
        n = (observe_batches(model, batches, slots, sampling.tokens, opts.progress,
                             sampling.seed, sampling.budget_mb, forward=importance is not None)
             if needs_data or importance is not None else 0)
    finally:
        if importance is not None:
            importance.remove()
    imatrix_roles.observe_waiting(slots, importance and importance.means())
    return _conclude(slots, plans, recipes, n, needs_data, t0, opts, groups=groups,
                     experts=experts, model=model, fisher=fisher)


def _conclude(slots, plans, recipes, n, needs_data, t0, opts: Options, processes=1,
              groups=(), experts=None, model=None, fisher=None):
    if needs_data and n == 0 and any(r.needs_data for r in recipes.values()):
        raise ValueError("calibrate: batches is empty: the recipe quantizes activations "
                         "statically, which needs at least one calibration batch")
    with torch.no_grad():
        results, hists = build_states(slots, plans, recipes, opts.auto.metric, groups, experts,
                                      opts.runtime.missing, fisher, n)
        if model is not None:  # what apply() and the exports compare the model's weights with
            record_fingerprints(model, [states for states, *_ in results.values()])
    seconds = time.perf_counter() - t0
    # each recipe: the pass's shared time (forwards, planning, report) plus its own observers'
    common = seconds - sum(t for s in unique_slots(slots.values()) for t in s.seconds.values())
    group_seconds = {label: {} for label in recipes}
    for name, labels in _time_groups(recipes, opts.runtime.time_groups).items():
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
                          stacklevel=outside_quantscope())
        if shared:
            info["fusion_groups"] = shared
        if per_expert:
            info["experts"] = per_expert
            info["expert_min_tokens"] = experts.min_tokens
        missed = _moe.unreached(model, recipe) if model is not None else []
        if missed:
            info["unreached"] = missed
            warnings.warn(f"calibrate: recipe {recipe.name!r} targets weights quantscope cannot "
                          f"reach; left in float: {[u['name'] for u in missed]}",
                          stacklevel=outside_quantscope())
        flat = imatrix_roles.unweighted(slots, plans[label])
        if flat:
            info["imatrix_unweighted"] = flat
            warnings.warn(f"calibrate: {len(flat)} imatrix_mse weights searched unweighted, "
                          f"without input importance: {[f['layer'] for f in flat]} "
                          f"({flat[0]['layer']!r}: {flat[0]['reason']}; all in "
                          f"calibration.info['imatrix_unweighted'])",
                          stacklevel=outside_quantscope())
        if processes > 1:
            info["processes"] = processes
        out[label] = Calibration(recipe, states, label, rows, hists, info, writer_rank=(
            qd.main_global_rank(opts.runtime.group) if opts.runtime.distributed else None))
    return out


def _time_groups(recipes, groups) -> dict:
    """``Runtime.time_groups`` over this pass's labels: in auto's pass, a recipe expanded into
    its candidates (``(label, observer)``) stands for them all, also a group of their own
    keyed ``(AUTO, label)`` (no user's group name: that recipe's time)."""
    tuples = [k for k in recipes if isinstance(k, tuple)]
    expanded = {k[0]: [t for t in tuples if t[0] == k[0]] for k in tuples}
    out = {(AUTO, label): members for label, members in expanded.items()}
    for name, labels in (groups or {}).items():
        out[name] = [k for label in labels for k in expanded.get(label, [label])]
    return out


def calibrate(model: nn.Module, batches, recipe="w8a8", *, observer: str | None = None,
              sampling: Sampling | None = None, auto: Auto | None = None, moe: MoE | None = None,
              outliers: Outliers | None = None, sequential=None, runtime: Runtime | None = None,
              progress: bool = True, **keywords) -> Calibration:
    """Calibrate ``model`` on ``batches`` with ``recipe``; returns a :class:`Calibration`.

    ``recipe`` is a preset name (``w8a8``, ``w4a16``, ``nvfp4``, ...: every name of
    :data:`~quantscope.calibration.recipe.PRESETS`) or a :class:`Recipe`; ``observer`` (a registry
    name or ``"auto"``) replaces the recipe's observers. The options (``sampling=``,
    ``auto=``, ``moe=``, ``outliers=``, ``sequential=``, ``runtime=``: the objects of
    :mod:`.options`) and ``progress`` as :func:`calibrate_many`, whose deprecated flat
    keywords work here too. Apply the result with ``calibration.apply(model)``.
    """
    r = _as_recipe(recipe, observer)
    opts = _options(sampling, auto, moe, outliers, sequential, runtime, progress, keywords)
    return calibrate_with(model, batches, {r.name: r}, opts)[r.name]


def sensitivity(model: nn.Module, batches, recipe="w8a8", *, calibration: Calibration | None
                = None, calib_batches=None, observer: str | None = None, loss=None,
                roles=("weight", "input"), progress: bool = False) -> Sensitivity:
    """Per layer and role, how much the model's output moves when only that tensor is
    quantized, on held-out ``batches``.

    Args:
        model: the float model.
        batches: held-out batches (dicts, tuples or tensors as :func:`calibrate` takes).
        recipe: the recipe whose tensors are measured (ignored if ``calibration`` given).
        calibration: a :class:`Calibration` to measure (default: ``recipe`` calibrated with
            ``observer`` on ``calib_batches``, which are refused with it: unused).
        observer: as :func:`calibrate`'s: None keeps a :class:`Recipe`'s observers (min-max
            for a preset name).
        calib_batches: calibration batches (default: ``batches``).
        loss: ``callable(output, reference_output, batch) -> float`` replacing the default
            divergence.
        roles: which roles to measure.
    """
    unused = [k for k, v in (("observer=", observer), ("calib_batches=", calib_batches))
              if v is not None]
    if calibration is not None and unused:  # how to calibrate: nothing is calibrated here
        raise ValueError(f"sensitivity: calibration= is measured as given, so "
                         f"{' and '.join(unused)} (how `recipe` is calibrated without it) "
                         f"would be ignored; give one or the other")
    batches = length_checked(batches, who="sensitivity")
    check_placement(model, "sensitivity")  # the model's first: a TypeError where it is no module
    refuse_compiled(model, "sensitivity")
    refuse_applied(model, "sensitivity")
    batches = list(batches)  # a generator: read by the calibration, then by the measure
    if not batches:
        raise ValueError("sensitivity: batches is empty: the divergence is measured on "
                         "held-out batches, at least one")
    if calibration is None:
        calibration = calibrate(model, batches if calib_batches is None else calib_batches,
                                recipe, observer=observer, progress=progress)
    return measure(model, batches, calibration, loss, roles, progress)
