"""The shapes of the ``info`` entries quantscope reads back from a saved calibration.

``info`` is a free dict, but some of its keys quantscope writes and later reads again: the
report's tables, the command line's ``evaluate`` / ``export`` and ``keep_float``. A folder
someone edited is checked here when it loads, so a wrong type is a ``ValueError`` naming the
key, not a crash in a report later (docs/SECURITY.md). Other keys are kept as they are.
"""

from __future__ import annotations

__all__ = ["info_problem"]

_NUMBER = (int, float)
_NAMES = [str]

#: key -> shape: a type (or tuple of types), ``[shape]`` a list of it, ``{field: shape}`` an
#: object with at least those fields
SHAPES = {
    "model": str,
    "task": str,
    "eval_max_length": int,
    "calibration_seconds": _NUMBER,
    "fusion_groups": [{"layers": _NAMES, "weight": str, "input": str}],
    "experts": [{"module": str, "expert": (int, str), "tokens": int, "rule": str}],
    "keep_float": {"n": int, "mode": str, "tensors": _NAMES},
    "missing": [{"layer": str, "role": str, "calls": int, "fallback": str}],
    "unreached": [{"name": str, "why": str}],
    "smooth": {"alpha": _NUMBER, "smoothed": _NAMES, "skipped": _NAMES},
}


def info_problem(info: dict) -> tuple[str, str] | None:
    """``(where, what)`` for the first entry of ``info`` not of its :data:`SHAPES` shape
    (``where`` as ``info.fusion_groups[0].layers``), or None."""
    for key, shape in SHAPES.items():
        if key in info:
            found = _problem(info[key], shape, f"info.{key}")
            if found is not None:
                return found
    return None


def _problem(value, shape, where: str) -> tuple[str, str] | None:
    if isinstance(shape, list):
        if not isinstance(value, list):
            return where, f"expected a list, got {type(value).__name__}"
        return next((p for i, v in enumerate(value)
                     if (p := _problem(v, shape[0], f"{where}[{i}]")) is not None), None)
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return where, f"expected an object, got {type(value).__name__}"
        for field, inner in shape.items():
            if field not in value:
                return f"{where}.{field}", "missing"
            found = _problem(value[field], inner, f"{where}.{field}")
            if found is not None:
                return found
        return None
    kinds = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, bool) or not isinstance(value, kinds):  # JSON's true is no count
        want = " or ".join(k.__name__ for k in kinds)
        return where, f"expected {want}, got {type(value).__name__}"
    return None
