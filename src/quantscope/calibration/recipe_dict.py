"""Recipes as plain data: the dicts :meth:`Recipe.to_dict
<quantscope.calibration.recipe.Recipe.to_dict>` writes and a ``--recipe-file`` holds (JSON or
YAML), read back key by key, and a role's observer options, checked and made hashable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields

__all__ = ["fields_from", "role_options"]


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
    options = {name: _frozen(value) for name, value in pairs}
    for name, value in options.items():
        if not isinstance(name, str):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError naming the field)
                f"Role.options: keyword names must be strings, got {name!r}")
        try:
            hash(value)
        except TypeError:
            raise ValueError(f"Role.options[{name!r}] must be hashable (observers are shared "
                             f"by their options), got {value!r}") from None
    return tuple(sorted(options.items()))


def _frozen(value):
    """``value`` with its lists as tuples, nested ones too (``to_dict`` -> JSON -> ``from_dict``
    gives back the tuple it wrote)."""
    if isinstance(value, list) or type(value) is tuple:
        return tuple(_frozen(v) for v in value)
    return value
