"""ModelOpt's calibrator arguments ``(num_bits, axis, unsigned)`` as a :class:`QuantSpec`:
the one translation :mod:`quantscope.compat.modelopt` builds its observers' specs by; what an
``axis`` keeps on data of some dims (:func:`_plan`), and the calibrators' other argument
checks."""

from __future__ import annotations

import numbers

from .._checks import check_int
from .._plainchecks import as_bool
from ..layout import Channel, Tensor
from ..spec import QuantSpec

__all__ = ["modelopt_spec"]


def _axes(axis) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"modelopt: axis must be None, an int or a tuple of ints (the "
                             f"axes kept), got {axis!r}")
    # an axis named twice is kept once, as ModelOpt's ((1, -1) on 2-D: _view knows the dims)
    return tuple(dict.fromkeys(int(a) for a in axes))


def _plan(axis, nd: int) -> tuple[tuple[int, ...], str]:
    """How :meth:`MaxCalibrator._view` lays out a tensor of ``nd`` dims for ``axis``: the axes
    kept (sorted, from 0: ``-1`` is ``nd - 1``) and the view: ``"tensor"`` (none kept),
    ``"row"`` / ``"column"`` (all kept, or none for torch's ``amax``: one unit on the spec's
    channel axis; the column for ``-1`` on 1-D), ``"as is"`` (one axis: the spec's
    ``Channel(axis)``), ``"flat"`` (several, moved to the front and flattened: ``Channel(0)``).
    Spellings of one plan view the data alike: ``_axis`` set from one to another keeps it."""
    axes = _axes(axis)
    for a in axes or ():
        if not -nd <= a < nd:
            raise ValueError(f"modelopt MaxCalibrator: axis {axis!r} is out of range for a "
                             f"tensor of {nd} dims")
    kept = tuple(sorted({a % nd for a in axes or ()}))
    if not kept:
        return kept, "tensor"
    if len(kept) == nd:
        return kept, "column" if axes == (-1,) else "row"
    return kept, "as is" if len(axes) == 1 else "flat"


def modelopt_flag(value) -> bool | None:
    """A ModelOpt flag as a bool: True / False (numpy's too) or 1 / 0; else None. ModelOpt
    reads any truthy value; a string or None would be read silently."""
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    return as_bool(value)


_FLOATS = {(4, 3): "fp8_e4m3", (5, 2): "fp8_e5m2", (2, 1): "fp4_e2m1"}  # ModelOpt's float bits


def modelopt_spec(num_bits=8, axis=None, unsigned=False) -> QuantSpec:
    """The :class:`QuantSpec` of ModelOpt calibrator arguments (the one translation):
    ``int{num_bits}_narrow`` symmetric (ModelOpt's ``amax / (2 ** (b - 1) - 1)``, codes +-127 for 8
    bits), ``uint{num_bits}`` from 0 (``unsigned``: True / False or 1 / 0), or the float format
    of ``(E, M)`` bits (fp8 e4m3 / e5m2, fp4 e2m1), per tensor, or
    per index of ``axis`` when it keeps one axis (several: ``Channel(0)`` of the kept axes
    flattened, :meth:`MaxCalibrator.collect`)."""
    flag = modelopt_flag(unsigned)
    if flag is None:
        raise TypeError(f"modelopt: unsigned must be True / False (or 1 / 0), got {unsigned!r}")
    unsigned = flag
    axes = _axes(axis)
    layout = Tensor() if not axes else Channel(axes[0] if len(axes) == 1 else 0)
    if isinstance(num_bits, (tuple, list)):  # (exponent, mantissa) bits: a float format
        if tuple(num_bits) not in _FLOATS:
            raise ValueError(f"modelopt: num_bits must be an integer in [2, 16] or one of "
                             f"{list(_FLOATS)} (exponent, mantissa bits), got {num_bits!r}")
        if unsigned:
            raise ValueError(f"modelopt: num_bits={num_bits!r} is a float format, which takes "
                             f"no unsigned=True (it is signed)")
        return QuantSpec(_FLOATS[tuple(num_bits)], layout)
    check_int("modelopt", "num_bits", num_bits, 2, 16)
    fmt = f"uint{num_bits}" if unsigned else f"int{num_bits}_narrow"  # amax / (2 ** (b-1) - 1)
    return QuantSpec(fmt, layout, symmetric=not unsigned)


def _check_percentile(who: str, value) -> float:
    """ModelOpt's range, ``0 <= percentile <= 100`` (its message says "range")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: percentile must be a number in range 0 <= percentile <= 100, "
                        f"got {type(value).__name__} {value!r}")
    if not 0 <= value <= 100:  # NaN too
        raise ValueError(f"{who}: invalid percentile {value!r}; percentile must be in range "
                         f"0 <= percentile <= 100")
    return float(value)


def _per_tensor(axis) -> None:
    if axis is not None:
        raise NotImplementedError("Calibrator histogram collection only supports per "
                                  f"tensor scaling (modelopt HistogramCalibrator: axis must "
                                  f"be None, got {axis!r})")
