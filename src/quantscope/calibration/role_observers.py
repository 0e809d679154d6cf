"""Which observer, with which options, a recipe's role runs when a recipe is built from one
observer name (:meth:`~quantscope.calibration.recipe.Recipe.with_observer`, the presets and
schemes): weights take the name's memoryless variant, and each role keeps the options of its
own the new observer takes; run-time roles, and the KV cache under ``auto``, keep their
observer and take those of the options it takes."""

from __future__ import annotations

import inspect
from dataclasses import replace

from .structure.kv_cache import ROLES as KV_ROLES

__all__ = ["AUTO", "check_taken", "ct_observer", "folded", "observed", "unknown_options",
           "weight_observer"]

AUTO = "auto"


def folded(observer):
    """``observer`` in one spelling: ``auto`` in any case :data:`AUTO`, a registry name (read
    in any case) as registered, so that the names compared downstream (``== AUTO``,
    ``"imatrix_mse"``, one observer per name) are the same for ``"MSE"`` and ``"mse"``."""
    if not isinstance(observer, str):
        return observer  # refused where it is read
    if observer.lower() == AUTO:
        return AUTO
    from ..observers.registry import registered_name

    return registered_name(observer)


def weight_observer(name: str) -> str:
    """The observer a weight role runs when a recipe is built from observer ``name``.

    Weights are observed once: a name with a memoryless variant uses it (``minmax`` ->
    ``memoryless_minmax``, ``mse`` -> ``memoryless_mse``). Histogram observers
    (percentile, entropy, mix, ...) are activation calibrators -- TensorRT and Horizon
    pair them with max calibration of weights -- so their weights use
    ``memoryless_minmax``, with the options it shares with ``name`` (``non_finite``: see
    :func:`_accepted`). ``auto`` stays ``auto``. A :class:`Role` written by hand runs
    the observer it names.
    """
    from ..observers.registry import observer_class

    if name == AUTO:
        return name
    cls = observer_class(name)  # torch.ao's compat classes are torch.ao's: no such flags
    if getattr(cls, "memoryless", False):
        return name
    try:
        observer_class(f"memoryless_{name}")
        return f"memoryless_{name}"
    except ValueError:
        pass
    if getattr(cls, "family", None) == "histogram":
        return "memoryless_minmax"
    return name


def _keywords(name: str) -> dict[str, type]:
    """The keyword-only arguments (the options) of observer ``name``'s class, each with the
    most basic class that declares it (a subclass may declare it again, passing it on)."""
    from ..observers.registry import observer_class

    return {p.name: c for c in observer_class(name).__mro__ if "__init__" in c.__dict__
            for p in inspect.signature(c.__init__).parameters.values()
            if p.kind == p.KEYWORD_ONLY}


def _accepted(name: str, observer: str, options: dict) -> dict:
    """Of the ``options`` given for ``observer``, those ``name`` takes: it, or its memoryless
    variant, takes its own (an MSE search's ``maxshrink``, not a moving average's
    ``averaging_constant``); another standing in for it (a histogram observer's weights:
    ``memoryless_minmax``) those the two declare in one class (``non_finite``), not a name
    each declares with a meaning of its own."""
    mine = _keywords(name)
    if name not in (observer, f"memoryless_{observer}"):
        theirs = _keywords(observer)
        mine = {k: c for k, c in mine.items() if theirs.get(k) is c}
    return {k: v for k, v in options.items() if k in mine}


def unknown_options(observer: str, options: dict) -> list[str]:
    """The names in ``options`` that ``observer``'s class takes no keyword-only argument of,
    sorted."""
    return sorted(set(options) - set(_accepted(observer, observer, options)))


def _kept(kind: str, observer: str, options: dict) -> tuple[str, dict]:
    """The observer a role of ``kind`` runs for ``observer`` (weights: its
    :func:`weight_observer`) and the ``options`` it keeps."""
    name = weight_observer(observer) if kind == "weight" else observer
    return name, (options if name == observer else _accepted(name, observer, options))


def _keeps_own(kind: str, role, observer: str) -> bool:
    """Whether ``role`` (of ``kind``) keeps its own observer when a recipe is built from
    ``observer``, taking those of the options that observer takes: a run-time role
    (``dynamic=True``: nothing is calibrated, its observer computes the qparams of each
    forward) and, under ``auto``, a KV cache role (auto chooses no KV scales: a named observer,
    min-max for ``kv_cache="fp8"``, which ``auto``'s candidates each run too)."""
    return role.dynamic is True or (kind in KV_ROLES and observer == AUTO)


def _ran(kind: str, role, observer: str, options: dict) -> tuple[str, str, dict]:
    """``(kind, name, kept)``: what :func:`observed` makes of ``role`` (of ``kind``) under
    ``observer``, the observer it runs and the ``options`` it keeps; a run-time role's kind
    says so."""
    if _keeps_own(kind, role, observer):
        label = f"run-time {kind}" if role.dynamic is True else kind
        return label, role.observer, _accepted(role.observer, role.observer, options)
    return (kind, *_kept(kind, observer, options))


def observed(role, kind: str, observer: str, options: dict):
    """``role`` (of ``kind``: weight, input ...) running ``observer`` (weights: its
    :func:`weight_observer`) with ``options`` and those of its own it takes; a run-time role
    (``dynamic=True``: nothing observed) keeps its run-time observer, with those of
    ``options`` it takes (``non_finite``: its sample and its run-time ranges read NaN / inf
    as zero, as the calibrated roles do), and so does a KV cache role under ``auto``
    (:func:`_keeps_own`); None as it is."""
    if role is None:
        return role
    _, name, kept = _ran(kind, role, observer, options)
    if _keeps_own(kind, role, observer):
        return replace(role, options={**dict(role.options), **kept}) if kept else role
    own = dict(role.options) if name == AUTO else _accepted(name, name, dict(role.options))
    return replace(role, observer=name, options={**own, **kept})


def _taken(name: str, kept: dict) -> dict:
    """Of the options a role running ``name`` keeps, those its observer takes: all for auto
    (its candidates take them, checked at calibration) and a toolkit's class (its own
    keywords, as the CLI's recipe-file check leaves them)."""
    return kept if name == AUTO or ":" in name else _accepted(name, name, kept)


def check_taken(where: str, runs, options: dict) -> None:
    """Raise ``ValueError`` for an option of ``options`` that no role takes, calibrated or
    run-time, or that a role keeps but its observer does not take: ``runs`` holds the
    ``(kind, role, observer)`` :func:`observed` gets for each. A weight's memoryless variant
    and a run-time role keep only those they take, the other roles all: a typo would otherwise
    be dropped silently, or fail only at calibration (the observer's ``__init__``)."""
    ran = [_ran(kind, role, observer, options) for kind, role, observer in runs]
    taken = {k for _, name, kept in ran for k in _taken(name, kept)}
    extra = sorted(set(options) - taken)
    if extra:
        names = sorted({f"{kind} observer {name!r}" for kind, name, _ in ran})
        held = any(extra[0] in kept for *_, kept in ran)
        raise ValueError(f"{where}: option {extra[0]!r} is not one any observer of the recipe "
                         f"takes ({', '.join(names) or 'none is calibrated'}); "
                         f"{'calibrate would fail on it' if held else 'it would be dropped'}")
    for kind, name, kept in ran:  # another role takes it, this one would fail on it
        bad = sorted(set(kept) - set(_taken(name, kept)))
        if bad:
            raise ValueError(f"{where}: option {bad[0]!r} is not one the {kind} observer "
                             f"{name!r} takes; calibrate would fail on it")


def ct_observer(key: str, role: str, name: str | None) -> str:
    """quantscope's observer for the one compressed-tensors names (``minmax`` where it names
    none: llm-compressor's default); a ValueError where quantscope registers no such name."""
    from ..observers.registry import observer_class

    if name is None:
        return "minmax"
    try:
        observer_class(name)
    except ValueError:
        raise ValueError(f"scheme {key!r}: its {role} observer {name!r} is not one quantscope "
                         f"registers; pass observer= to choose one") from None
    return name
