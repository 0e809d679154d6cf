"""make test's tier and the extended one.

``make test`` (the loop before each commit, under 10 minutes on a 2-core machine) runs every
behaviour; ``make test-extended`` runs the cases marked ``extended``: more combinations of a
path ``make test`` already runs, more compiler targets, more spawned process groups, real
models end to end. CI (``.ci/run``) runs both.
"""

import itertools

import pytest
import torch

extended = pytest.mark.extended


def each_value(*axes, ids=None):
    """The product of ``axes`` as ``pytest.param`` s, the combinations beyond the few that
    show every value of every axis marked ``extended``: combination ``i`` of those takes
    each axis's value ``i`` (modulo its length), so ``make test`` runs as many as the
    longest axis has values, and ``make test-extended`` the rest of the product. A tuple
    value fills as many arguments as it holds, as a row of ``parametrize`` does. ``ids``
    names a value in the case's id (as ``parametrize``'s callable ``ids``; by default
    strings, numbers and dtypes name themselves and other values leave the id to pytest)."""
    covered = {tuple(i % len(axis) for axis in axes) for i in range(max(map(len, axes)))}
    params = []
    for index in itertools.product(*(range(len(axis)) for axis in axes)):
        values = [v for axis, i in zip(axes, index)
                  for v in (axis[i] if isinstance(axis[i], tuple) else (axis[i],))]
        names = [(ids or _name)(v) for v in values]
        params.append(pytest.param(*values, id=None if None in names else "-".join(names),
                                   marks=() if index in covered else (extended,)))
    return params


def _name(value) -> str | None:
    """A value's part of the case's id (``float16`` for ``torch.float16``); None where pytest
    should name the case itself."""
    if value is None or isinstance(value, (str, int, float)):
        return str(value)
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None
