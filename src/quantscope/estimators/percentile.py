"""Percentile ranges from a histogram, with the references' bin conventions.

The bin ``i`` that holds the percentile ``p`` is the first whose cumulative count reaches
``p`` percent of the total. ``p`` is read as the decimal it prints as (``repr``: the
shortest decimal of the float, what the user wrote), and its share of the total ``p / 100``
as the fraction ``num / den``; the test is ``count * den >= num * total`` in integers: the
least count that passes, ``ceil(num * total / den)``, is computed per unit in int64 without
overflow (for any total an int64 count holds, and ``den < 2 ** 31``: decimals of up to seven
places), so where ``p`` percent of the total is a whole count (99.9 % of 41000 is 40959) it
is reached at the bin that reaches that count. The float itself would miss it: ``99.9`` is
above the decimal 99.9, and ``99.9 * 41000`` rounds to ``4095900.0000000005``. A percent of
more places (each of a list on its own), percents given as tensors
(:func:`percentile_value`) and counts in a float dtype take the float test,
``100 * count >= p * total`` in float64. The value reported for it differs
between the references; ``convention`` selects it:

=================  ====================================  ==========================
convention         value                                 used by
=================  ====================================  ==========================
``"lower"``        left edge ``lo + i w``                Quark, ModelOpt / TensorRT
                                                         (``edges[searchsorted(cdf, p)]``)
``"center"``       bin centre ``lo + (i + 0.5) w``        Horizon (default)
``"upper"``        right edge ``lo + (i + 1) w``           (keeps at least ``p`` inside)
=================  ====================================  ==========================

The default is ``"center"``: with values spread evenly inside the bin it is the
unbiased estimate, at most half a bin from the true percentile.

Symmetric ranges take the percentile of ``|x|``; asymmetric ones clip both tails,
each at half of the excluded mass (``(100 - p) / 2`` percent per tail, as Quark's
asymmetric option intends).
"""

from __future__ import annotations

import functools
import numbers
from fractions import Fraction
from typing import NamedTuple

import torch

from .._checks import check_bool
from ..formats import tensor_arg
from ..stats.histogram import Hist, fold_abs

__all__ = ["CONVENTIONS", "check_convention", "check_percentile", "percentile_range",
           "percentile_value"]

CONVENTIONS = {"lower": 0.0, "center": 0.5, "upper": 1.0,
               "quark": 0.0, "modelopt": 0.0, "tensorrt": 0.0, "horizon": 0.5, "centre": 0.5}


def check_percentile(who: str, name: str, value) -> float:
    """``value`` as a float in ``(0, 100]``: ``TypeError`` naming ``name`` for a bool or a
    non-number (``"99"``, ``True``: ``<`` would fail bare, or take True as 1), else
    ``ValueError`` out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number in (0, 100], got "
                        f"{type(value).__name__} {value!r}")
    if not 0 < value <= 100:  # NaN too
        raise ValueError(f"{who}: {name} must be in (0, 100], got {value!r}")
    return float(value)


def check_convention(who: str, convention) -> str:
    """``convention`` if it is one of :data:`CONVENTIONS`, else ``ValueError`` naming it."""
    if not isinstance(convention, str) or convention not in CONVENTIONS:
        raise ValueError(f"{who}: convention must be one of {sorted(CONVENTIONS)}, "
                         f"got {convention!r}")
    return convention


def _offset(convention: str) -> float:
    return CONVENTIONS[check_convention("percentile", convention)]


def percentile_value(counts: torch.Tensor, lo: torch.Tensor, width: torch.Tensor,
                     percent, convention: str = "center") -> torch.Tensor:
    """Per unit, the value (by ``convention``) of the first bin whose cumulative count reaches
    ``percent`` percent of the total. ``percent`` is a float (read as its decimal: see the
    module doc) or a ``[U, K]`` tensor (then ``[U, K]``; compared as its float64 values)."""
    off = _offset(convention)
    if isinstance(percent, torch.Tensor):
        pct = percent.to(dtype=torch.float64, device=counts.device)
        if not bool(((pct > 0) & (pct <= 100)).all()):  # NaN too: else the first / last bin
            raise ValueError(f"percentile_value: percent must be in (0, 100], got {percent}")
        v = _values(counts, lo, width, _Percents(pct.reshape(1, 1) if pct.dim() == 0 else pct),
                    off)
        return v[:, 0] if pct.dim() == 0 else v
    percent = check_percentile("percentile_value", "percent", percent)
    pct = _percents([_decimal(percent)], [percent], counts.device)
    return _values(counts, lo, width, pct, off)[:, 0]


def _decimal(p: float) -> Fraction:
    """The decimal ``p`` prints as (the shortest that reads back as ``p``), exactly."""
    return Fraction(repr(float(p)))


class _Percents(NamedTuple):
    """``[1, K]`` percents (``[U, K]`` for tensors given): ``floats`` (float64) for the float
    test; where exact, ``num / den`` their fraction of the total (int64, ``den < 2 ** 31``)."""

    floats: torch.Tensor
    num: torch.Tensor | None = None
    den: torch.Tensor | None = None
    exact: torch.Tensor | None = None  # [1, K] bool
    some_exact: bool = False
    all_exact: bool = False


def _percents(decimals: list[Fraction], floats: list[float], device) -> _Percents:
    """Each percent's exact test where its fraction of the total ``p / 100`` has a
    denominator below ``2 ** 31`` (every decimal of up to seven places), else its float test."""
    fracs = [d / 100 for d in decimals]
    exact = [f.denominator < 2**31 for f in fracs]
    nums = [f.numerator if e else 0 for f, e in zip(fracs, exact, strict=True)]
    dens = [f.denominator if e else 1 for f, e in zip(fracs, exact, strict=True)]
    row = functools.partial(torch.tensor, device=device)
    return _Percents(row([floats], dtype=torch.float64), row([nums], dtype=torch.int64),
                     row([dens], dtype=torch.int64), row([exact], dtype=torch.bool),
                     any(exact), all(exact))


def _values(counts, lo, width, pct: _Percents, off):
    # [U, K] values of the bins reaching each percent of the total (the module doc); counts
    # in a float dtype (not the int64 of a Hist) take the float test throughout
    cum = counts.cumsum(-1)
    exact = pct.some_exact and not counts.is_floating_point()
    i = None
    if not (exact and pct.all_exact):  # the float test: 100 count >= p total
        f = cum.double()
        i = torch.searchsorted(f * 100, pct.floats * f[:, -1:], right=False)
    if exact:
        # the least count c with c den >= num total: with total = q den + r it is
        # num q + ceil(num r / den), every product below 2 ** 62 (num <= den < 2 ** 31)
        total = cum[:, -1:]
        q, r = total.div(pct.den, rounding_mode="floor"), total.remainder(pct.den)
        need = pct.num * q + (pct.num * r + (pct.den - 1)).div(pct.den, rounding_mode="floor")
        reach = torch.searchsorted(cum, need, right=False)
        i = reach if i is None else torch.where(pct.exact, reach, i)
    i = i.clamp_(max=counts.shape[-1] - 1).float()
    return lo[:, None] + (i + off) * width[:, None]


def percentile_range(hist: Hist, percentile: float = 99.99, *, symmetric: bool = True,
                     convention: str = "center") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` at ``percentile`` (a float, or a ``[K]`` list: then ``[U, K]``)."""
    p = tensor_arg("percentile", "percentile", percentile,  # as_tensor fails bare on "99"
                   "a number in (0, 100] or a list of them", dtype=torch.float64)
    ps = p.tolist()  # the fractions in Python floats: the same float64 steps, no tensor ops
    ps = [ps] if p.dim() == 0 else ps
    for v in ps:
        check_percentile("percentile", "percentile", v)
    off = _offset(convention)
    dev = hist.counts.device
    dec = [_decimal(v) for v in ps]  # the decimals the user wrote (module doc)
    if check_bool("percentile", "symmetric", symmetric):  # "no" would be symmetric
        h = fold_abs(hist)
        amax = _values(h.counts, h.lo, h.width, _percents(dec, ps, dev), off)
        amax = amax[:, 0] if p.dim() == 0 else amax
        return -amax, amax
    # both tails in one pass, each at (100 + p) / 2 percent from its own end: the upper on the
    # counts, the lower on the reversed counts (from -hi, negated back)
    pct = _percents([(100 + f) / 2 for f in dec], [(100 + v) / 2 for v in ps], dev)
    U, w = hist.counts.shape[0], hist.width
    v = _values(torch.cat([hist.counts, hist.counts.flip(-1)]), torch.cat([hist.lo, -hist.hi]),
                torch.cat([w, w]), pct, off)
    v = v[:, 0] if p.dim() == 0 else v
    return -v[U:], v[:U]
