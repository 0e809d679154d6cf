"""Recipes as plain data: the dicts :meth:`Recipe.to_dict
<quantscope.calibration.recipe.Recipe.to_dict>` writes and a ``--recipe-file`` holds (JSON or
YAML), read back key by key; a role's observer options, checked and made hashable; and the
module name patterns of ``targets`` / ``ignore``, checked when a recipe is built."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import MISSING, fields
from functools import cache

import numpy as np

from .._plainchecks import spelt_as_scheme

__all__ = ["FirstMatch", "built", "fields_from", "matches", "own_options", "patterns",
           "preset_key", "role_options", "unmatched"]


def fields_from(cls, d, where: str, **read) -> dict:
    """The keyword arguments of dataclass ``cls`` that the mapping ``d`` gives, each value
    passed through ``read[key](value, where.key)`` where given. The keys are ``cls``'s fields
    (those ``to_dict`` writes): an unknown one (a misspelling, which would otherwise be dropped
    and the recipe run as if it were absent) or a missing required one is a ValueError naming
    it and the known keys; a key left out takes the field's default."""
    known = [f.name for f in fields(cls)]
    if not isinstance(d, Mapping):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
            f"{where} must be a mapping with keys {known}, got {type(d).__name__} {d!r}")
    for k in d:
        if k not in known:
            raise ValueError(f"{where}: unknown key {k!r}; the known keys are {known}")
    for f in fields(cls):
        if f.name not in d and f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{where}: missing key {f.name!r}; the known keys are {known}")
    return {k: read[k](v, f"{where}.{k}") if k in read else v for k, v in d.items()}


def built(cls, kwargs: dict, where: str):
    """``cls(**kwargs)`` (the keys :func:`fields_from` read), its checks' ``ValueError`` /
    ``TypeError`` led by ``where``: a recipe file with several rules names the rule and role
    whose value is bad, as it names a bad key."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        kind = ValueError if isinstance(e, ValueError) else TypeError
        raise kind(f"{where}: {e}") from None


def role_options(options) -> tuple:
    """``Role.options`` as sorted ``(name, value)`` pairs: the observers are keyed by them,
    so the names must be keywords and the values hashable (lists, as JSON and YAML hold a
    tuple such as ``mix``'s ``percentiles``, become tuples). None: no options."""
    if options is None:
        return ()
    pairs = (options.items() if isinstance(options, Mapping)
             else options if isinstance(options, (tuple, list)) else None)
    if pairs is None or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError(f"Role.options must be a mapping of observer keyword names to values "
                         f"({{'averaging_constant': 0.1}}), got {options!r}")
    out = {}
    for name, value in pairs:
        if not isinstance(name, str):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
                f"Role.options: keyword names must be strings, got {name!r}")
        if name in out:  # as a keyword or a recipe file's key given twice: never the last kept
            raise ValueError(f"Role.options: {name!r} is given twice; give each option once")
        out[name] = value = _frozen(value)
        try:
            hash(value)
        except TypeError:
            raise ValueError(f"Role.options[{name!r}] must be hashable (observers are shared "
                             f"by their options), got {value!r}") from None
    return tuple(sorted(out.items()))


def _frozen(value):
    """``value`` with its lists as tuples, nested ones too (``to_dict`` -> JSON -> ``from_dict``
    gives back the tuple it wrote), and numpy scalars as Python numbers (JSON, which saving a
    calibration writes, takes no ``np.int64``)."""
    if isinstance(value, list) or type(value) is tuple:
        return tuple(_frozen(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


def own_options(where: str, role: str, observer: str, options: dict) -> None:
    """Raise ``ValueError`` for an option of ``options`` (given with no observer named) that
    ``observer``, the one a preset or scheme runs on its ``role`` then, does not take: it would
    otherwise fail at calibration (weights are not checked: their memoryless variant keeps the
    options it takes, as a named observer's do)."""
    from .role_observers import unknown_options

    extra = unknown_options(observer, options)
    if extra:
        raise ValueError(f"{where}: option {extra[0]!r} is not one the {role} observer "
                         f"{observer!r} takes ({observer} runs there when no observer is "
                         f"given); name the observer it is for (observer='minmax', ...)")


# unbounded: a bounded one (as re's own, 512) thrashes once recipes hold more patterns, each
# then compiled again for every module; the patterns are the recipes' own, bounded
@cache
def _regex(expr: str) -> re.Pattern:
    return re.compile(expr)  # once per pattern: matched against every module name


def patterns(owner: str, value) -> tuple[str, ...]:
    """``value`` as a tuple of module name patterns: a string is one pattern, None none; a
    mapping, or a ``re:`` pattern that does not compile, is a ValueError naming ``owner``."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        if isinstance(value, Mapping):  # its keys would be read as the patterns, silently
            raise TypeError
        value = tuple(value)
    except TypeError:
        raise ValueError(f"{owner} must be a pattern string or a list of them, got "
                         f"{value!r}") from None
    for p in value:
        if not isinstance(p, str):
            hint = f" (write the class by name: {p.__name__!r})" if isinstance(p, type) else ""
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
                f"{owner} must hold strings: a module class name, a glob on the module's "
                f"name or 're:' and a regular expression; got {p!r}{hint}")
        if p.startswith("re:"):
            try:
                _regex(p[3:])
            except re.error as e:
                raise ValueError(f"{owner}: {p!r} is not a valid regular expression "
                                 f"({e})") from None
    return value


def matches(pattern: str, name: str, module) -> bool:
    """Whether ``pattern`` (of :func:`patterns`) takes the module ``module`` named ``name``."""
    if pattern.startswith("re:"):
        return _regex(pattern[3:]).match(name) is not None  # from the start, as compressed-tensors
    if any(pattern in (c.__name__, f"{c.__module__}.{c.__qualname__}")  # a subclass too,
           for c in type(module).__mro__):  # as compressed-tensors matches (FalconLinear)
        return True
    return fnmatch.fnmatchcase(name, pattern)


_WILD = frozenset("*?[")  # fnmatch's wildcards: a pattern without them matches itself only


class FirstMatch:
    """``next((i for i, ps in enumerate(lists) if any(matches(p, name, module) for p in ps)),
    None)``, the index of the first pattern list that takes a module, in time independent of
    how many plain patterns the lists hold (a mixed-precision recipe names every layer: a
    scan per module is quadratic in layers). A plain pattern (no ``re:``, no glob character)
    takes a module only by being its name (a glob without wildcards) or a class's name, so
    it is looked up; only the lists holding a ``re:`` or glob pattern are tested, in order,
    by :func:`matches` itself."""

    def __init__(self, lists):
        self._lists = [tuple(ps) for ps in lists]
        self._plain = {}  # pattern -> the first list holding it
        self._other = []  # the lists holding a re: or glob pattern, in order
        for i, ps in enumerate(self._lists):
            for p in ps:
                if p.startswith("re:") or not _WILD.isdisjoint(p):
                    if not self._other or self._other[-1] != i:
                        self._other.append(i)
                else:
                    self._plain.setdefault(p, i)

    def __call__(self, name: str, module) -> int | None:
        keys = _keys(name, module)
        hit = min((self._plain[k] for k in keys if k in self._plain), default=None)
        for i in self._other:
            if hit is not None and i >= hit:
                break
            if any(matches(p, name, module) for p in self._lists[i]):
                return i
        return hit


def _keys(name: str, module) -> list[str]:
    """The strings a plain pattern takes the module by: its name, its classes' names."""
    return [name, *(k for c in type(module).__mro__  # the keys matches() compares whole
                    for k in (c.__name__, f"{c.__module__}.{c.__qualname__}"))]


def unmatched(patterns, named) -> list[str]:
    """The ones of ``patterns`` that take none of the ``(name, module)`` pairs ``named``
    (plain ones looked up, as :class:`FirstMatch` does)."""
    named = list(named)
    keys = {k for n, m in named for k in _keys(n, m)}
    return [p for p in dict.fromkeys(patterns)
            if (p not in keys if not p.startswith("re:") and _WILD.isdisjoint(p)
                else not any(matches(p, n, m) for n, m in named))]


def preset_key(name, presets) -> str:
    """``name`` as the key of ``presets`` (lower case; any case is read), else ``ValueError``:
    an unknown name, or a compressed-tensors scheme's spelling of a preset's
    (:func:`~quantscope._plainchecks.spelt_as_scheme`)."""
    key = str(name).lower()
    if key not in presets:
        raise ValueError(f"recipe: unknown preset {name!r}; expected one of {sorted(presets)}")
    if spelt_as_scheme(str(name), presets):
        raise ValueError(f"recipe: {name!r} is compressed-tensors' spelling of its scheme "
                         f"(scheme({name!r})); presets are lower case: {key!r} (the two may "
                         f"differ: w8a8's inputs are static, W8A8's dynamic per token)")
    return key
