"""Which of ``auto``'s candidate observers a recipe's roles cannot run, known before the pass.

A candidate observer may refuse a role's spec (``linear_mse`` searches symmetric ranges
only). The per-layer metrics drop it where it refuses (``observe._observer_failed``);
:func:`refused_by_model` lets ``Auto(metric="model")``, whose candidates are whole
configurations, drop one that some role refuses, and :func:`check_options` says when a
candidate is refused by every ``auto`` role (it would vanish without a word).
"""

from __future__ import annotations

import warnings

from ..._checks import outside_quantscope
from ...observers.registry import get_observer
from ..recipe import AUTO, Recipe, weight_observer
from ..role_observers import observed

__all__ = ["check_candidates", "check_options", "expand", "has_auto", "ignores_non_finite",
           "reads_as_zero", "refusals", "refused_by_model"]


def check_candidates(names) -> None:
    """``Auto.candidates``: each a native observer of the registry, which auto makes for each
    role's spec (a compat class, ``"torch.ao:MinMaxObserver"``, takes no spec: it would be
    refused on every layer), or ``"auto"`` (ignored); else a ``ValueError`` naming it."""
    from ...observers.registry import list_observers, observer_class

    for name in names:
        try:
            observer_class(name)
            why = ("a compat class configured by its own arguments, which takes no spec"
                   if ":" in name else None)
        except ValueError:
            why = "unknown observer" if name != AUTO else None
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


def refused_by_model(model, recipe: Recipe, names) -> dict[str, str]:
    """``{candidate: reason}`` of ``names`` whose whole configuration
    (:meth:`Recipe.with_observer`) some role of ``model`` refuses, keyed as the pass's
    :func:`~.observe.make_plan` makes the observers."""
    from ..run.module_roles import check_role_shape
    from ..run.observe import observer_key

    def pairs():
        for n in names:
            for layer, (module, roles) in recipe.with_observer(n).match(model).items():
                for role, cfg in roles.items():
                    if cfg.dynamic is not True:
                        cfg = check_role_shape(layer, role, cfg, module)
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
            expanded[(label, n)] = recipes[label].with_observer(n)
    return expanded, kept, refused


def ignores_non_finite(recipe: Recipe) -> bool:
    """Whether a role of ``recipe`` reads NaN / inf as zero (``non_finite="ignore"``)."""
    return reads_as_zero(r for rule in recipe.rules for r in rule.roles().values())


def reads_as_zero(roles) -> bool:
    """Whether one of ``roles`` (:class:`~.recipe.Role`) reads NaN / inf as zero."""
    return any(dict(r.options).get("non_finite") == "ignore" for r in roles)


def check_options(recipe: Recipe, label, names, every_role: bool) -> None:
    """Raise ``ValueError`` for an option of ``recipe``'s roles that run ``auto``'s candidate
    observers ``names`` that none of them takes (a misspelt name would otherwise be dropped
    without a word): of every calibrated role (and the KV cache's) where ``every_role``
    (``metric="model"`` runs :meth:`Recipe.with_observer` of each candidate), else of its
    ``auto`` roles (the per-layer metrics: :func:`.observe.candidate_options`). There, warn
    once of a candidate every ``auto`` role refuses (it would vanish from every layer)."""
    runs = [(kind, r) for rule in recipe.rules for kind, r in rule.roles().items()
            if r.dynamic is not True and (every_role or r.observer == AUTO)]
    if every_role and recipe.kv_cache is not None:
        runs.append(("key", recipe.kv_cache))
    given = {k for _, r in runs for k, _ in r.options}
    # the rule Recipe.with_observer gives each candidate's roles their options by
    taken = {k for kind, r in runs for n in names for k, _ in observed(r, kind, n, {}).options}
    if given - taken:
        raise ValueError(f"calibrate: recipe {label!r}: observer 'auto' option(s) "
                         f"{sorted(given - taken)} taken by none of its candidate observers "
                         f"{names} (nor their weight variants)")
    if not every_role and runs:  # metric "model" drops and records them itself
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


def has_auto(recipe: Recipe) -> bool:
    return any(role.observer == AUTO for rule in recipe.rules for role in rule.roles().values())
