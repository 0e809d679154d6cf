"""Which of ``auto``'s candidate observers a recipe's roles cannot run, known before the pass.

A candidate observer may refuse a role's spec (``linear_mse`` searches symmetric ranges
only). The per-layer metrics drop it where it refuses (``observe._observer_failed``);
:func:`refused_by_model` lets ``Auto(metric="model")``, whose candidates are whole
configurations (:func:`as_candidate`), drop one that some role refuses, and
:func:`check_options` says when a candidate is refused by every ``auto`` role (it would
vanish without a word).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace

from ..._checks import outside_quantscope
from ...observers.registry import get_observer
from ..recipe import AUTO, Recipe, weight_observer
from ..role_observers import folded, observed

__all__ = ["as_candidate", "auto_keys", "check_candidates", "check_options", "expand", "has_auto",
           "ignores_non_finite", "reads_as_zero", "refusals", "refused_by_model"]


def check_candidates(names) -> None:
    """``Auto.candidates``: each a native observer of the registry, which auto makes for each
    role's spec (a compat class, ``"torch.ao:MinMaxObserver"``, takes no spec: it would be
    refused on every layer), or ``"auto"`` in any case (ignored); else a ``ValueError``
    naming it."""
    from ...observers.registry import list_observers, observer_class

    for name in names:
        try:
            observer_class(name)
            why = ("a compat class configured by its own arguments, which takes no spec"
                   if ":" in name else None)
        except ValueError:
            why = "unknown observer" if folded(name) != AUTO else None
        if why is not None:
            native = [n for n in list_observers() if ":" not in n]
            raise ValueError(f"calibrate: Auto.candidates names {name!r}: {why}; auto's "
                             f"candidates are native observers: {', '.join(native)}")


def refusals(pairs) -> dict[str, str]:
    """``{candidate: reason}`` of the candidates whose observer cannot be made for a role:
    ``pairs`` holds ``(candidate, observer key)`` (``observe.observer_key``: ``(name, spec,
    options)``, the observer the pass would make), each key tried once."""
    out, tried = {}, {}
    for cand, key in pairs:
        if cand in out:
            continue
        if key not in tried:
            name, spec, options = key
            try:
                get_observer(name, spec, **dict(options))
                tried[key] = None
            except (ValueError, TypeError) as e:
                tried[key] = f"observer {name!r} with {spec}: {e}"
        if tried[key] is not None:
            out[cand] = tried[key]
    return out


def _candidate_role(role, kind: str, name: str):
    """``role`` (of ``kind``) in candidate ``name``'s configuration: an ``auto`` role runs
    ``name`` (weights: its :func:`weight_observer`), with the options of its own ``name``
    takes; a role naming its observer (by hand, or the KV cache's: never ``auto``) keeps it."""
    return observed(role, kind, name, {}) if role is not None and role.observer == AUTO else role


def as_candidate(recipe: Recipe, name: str) -> Recipe:
    """``recipe`` as ``Auto(metric="model")``'s candidate ``name`` runs it: its ``auto`` roles
    running ``name`` (:func:`_candidate_role`), the others and the KV cache as they are (not
    :meth:`Recipe.with_observer`, which would replace the observers the user named)."""
    return replace(recipe, rules=tuple(
        replace(r, **{k: _candidate_role(v, k, name) for k, v in r.roles().items()})
        for r in recipe.rules))


def refused_by_model(model, recipe: Recipe, names) -> dict[str, str]:
    """``{candidate: reason}`` of ``names`` whose whole configuration (:func:`as_candidate`)
    some ``auto`` role of ``model`` refuses (the others run the same observer in every
    candidate), keyed as the pass's :func:`~.observe.make_plan` makes the observers."""
    from ..run.module_roles import check_role_shape
    from ..run.observe import observer_key

    matched = recipe.match(model)

    def pairs():
        for n in names:
            for layer, (module, roles) in matched.items():
                for role, cfg in roles.items():
                    if cfg.observer == AUTO and cfg.dynamic is not True:
                        cfg = check_role_shape(layer, role, _candidate_role(cfg, role, n),
                                               module)
                        yield n, observer_key(cfg.observer, cfg, module)
    return refusals(pairs())


def expand(model, recipes, autos, names):
    """The pass's recipes: the others as they are, each auto recipe once per candidate
    that its roles can run (:func:`refused_by_model`: one refused by a role is
    dropped, with a warning). Returns ``(recipes, {label: candidates kept}, {label:
    {candidate refused: why}})``; raises where a recipe keeps none."""
    expanded = {label: r for label, r in recipes.items() if label not in autos}
    kept, refused = {}, {}
    for label in autos:
        refused[label] = refused_by_model(model, recipes[label], names)
        kept[label] = [n for n in names if n not in refused[label]]
        if not kept[label]:
            raise ValueError(f"calibrate: recipe {label!r}: observer 'auto' has no candidate "
                             f"left: each of {names} is refused by some role: {refused[label]}")
        if refused[label]:
            warnings.warn(f"calibrate: recipe {label!r}: auto candidate(s) "
                          f"{sorted(refused[label])} cannot run on every role and take no part "
                          f"in the choice (metric 'model' scores whole configurations; "
                          f"calibration.info['auto']['refused'] says why)",
                          stacklevel=outside_quantscope())
        for n in kept[label]:  # (their options checked with the session's: check_options)
            expanded[(label, n)] = as_candidate(recipes[label], n)
    return expanded, kept, refused


def ignores_non_finite(recipe: Recipe) -> bool:
    """Whether a role of ``recipe`` reads NaN / inf as zero (``non_finite="ignore"``)."""
    return reads_as_zero(r for rule in recipe.rules for r in rule.roles().values())


def reads_as_zero(roles) -> bool:
    """Whether one of ``roles`` (:class:`~.recipe.Role`) reads NaN / inf as zero."""
    return any(dict(r.options).get("non_finite") == "ignore" for r in roles)


def check_options(recipe: Recipe, label, names, per_layer: bool) -> None:
    """Raise ``ValueError`` for an option of ``recipe``'s ``auto`` roles that none of
    ``auto``'s candidate observers ``names`` takes (a misspelt name would otherwise be dropped
    without a word); the roles naming their observer keep it, and their options, under every
    metric (:func:`as_candidate`, :func:`.observe.candidate_options`). Where ``per_layer``
    (not ``metric="model"``), warn once of a candidate every ``auto`` role refuses (it would
    vanish from every layer)."""
    runs = [(kind, r) for rule in recipe.rules for kind, r in rule.roles().items()
            if r.dynamic is not True and r.observer == AUTO]
    given = {k for _, r in runs for k, _ in r.options}
    # the rule a candidate's roles take their options by (as_candidate's)
    taken = {k for kind, r in runs for n in names
             for k, _ in _candidate_role(r, kind, n).options}
    if given - taken:
        raise ValueError(f"calibrate: recipe {label!r}: observer 'auto' option(s) "
                         f"{sorted(given - taken)} taken by none of its candidate observers "
                         f"{names} (nor their weight variants)")
    if per_layer and runs:  # metric "model" drops and records them itself
        _warn_refused_everywhere(label, names, runs)


def _warn_refused_everywhere(label, names, runs) -> None:
    from ..run.observe import observer_key

    every = None
    for kind, r in runs:
        mine = refusals((n, observer_key(weight_observer(n) if kind == "weight" else n, r))
                        for n in names)
        every = mine if every is None else {n: why for n, why in every.items() if n in mine}
    if every:
        warnings.warn(f"calibrate: recipe {label!r}: auto candidate(s) {sorted(every)} cannot "
                      f"run on any of its 'auto' roles and take no part in the choice "
                      f"({next(iter(every.values()))})", stacklevel=outside_quantscope())


def auto_keys(model, recipe: Recipe) -> set[tuple[str, str]]:
    """The ``(layer, role)`` of ``recipe``'s ``auto`` roles in ``model``, MoE experts held as
    3-D parameters by the per-expert names the pass gives them (their views attached
    meanwhile, as :mod:`.sensitivity` does)."""
    from ..structure import moe

    with (moe.attach(model, count=False) if moe.has_experts_3d(model)
          else contextlib.nullcontext()):
        return {(layer, role) for layer, (_, roles) in recipe.match(model).items()
                for role, r in roles.items() if r.observer == AUTO}


def has_auto(recipe: Recipe) -> bool:
    return any(role.observer == AUTO for rule in recipe.rules for role in rule.roles().values())
