"""Percentile ranges from a histogram, with the references' bin conventions.

The bin ``i`` that holds the percentile ``p`` is the first whose cumulative count reaches
``p`` percent of the total. ``p`` is read as the decimal it prints as (``repr``: the
shortest decimal of the float, what the user wrote), ``num / den``, and the test is
``count * (100 * den) >= num * total`` in integers: the least count that passes,
``ceil(num * total / (100 * den))``, is computed per unit in int64 without overflow (for
any total an int64 count holds, and ``100 * den < 2 ** 31``: decimals of up to seven
places), so where ``p`` percent of the total is a whole count (99.9 % of 41000 is 40959)
it is reached at the bin that reaches that count. The float itself would miss it: ``99.9``
is above the decimal 99.9, and ``99.9 * 41000`` rounds to ``4095900.0000000005``. For a
decimal of more places the test is the float one, ``100 * count >= p * total`` in float64,
as for percents given as tensors (:func:`percentile_value`). The value reported for it differs
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

import math
import numbers
from fractions import Fraction

import torch

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
        v = _values(counts, lo, width, pct.reshape(1, 1) if pct.dim() == 0 else pct, 1, off)
        return v[:, 0] if pct.dim() == 0 else v
    pct, den = _scaled([_decimal(percent)], [float(percent)], counts.device)
    return _values(counts, lo, width, pct, den, off)[:, 0]


def _decimal(p: float) -> Fraction:
    """The decimal ``p`` prints as (the shortest that reads back as ``p``), exactly."""
    return Fraction(repr(float(p)))


def _scaled(fracs: list[Fraction], floats: list[float], device) -> tuple[torch.Tensor, int]:
    """``(nums, den)``, ``nums`` a ``[1, K]`` tensor: int64 with ``nums[k] / den == fracs[k]``
    where ``100 * den < 2 ** 31`` (the exact test), else ``floats`` in float64 and ``den = 1``
    (the float test)."""
    den = math.lcm(*(f.denominator for f in fracs))
    if 100 * den >= 2**31:
        return torch.tensor([floats], dtype=torch.float64, device=device), 1
    nums = [f.numerator * (den // f.denominator) for f in fracs]
    return torch.tensor([nums], dtype=torch.int64, device=device), den


def _values(counts, lo, width, num, den, off):
    # [U, K] values of the bins reaching num / den percent of the total (the module doc);
    # num: int64 from _scaled (the exact test) or float64, [U, K] or [1, K] (the float test)
    cum = counts.cumsum(-1)
    if num.dtype == torch.int64:
        # the least count c with c D >= n total, D = 100 den: with total = q D + r it is
        # n q + ceil(n r / D), every product below 2 ** 62 (n <= D, r < D < 2 ** 31)
        cum, D = cum.long(), 100 * den
        q, r = cum[:, -1:].div(D, rounding_mode="floor"), cum[:, -1:].remainder(D)
        need = num * q + (num * r + (D - 1)).div(D, rounding_mode="floor")
    else:
        cum = cum.double()
        cum, need = cum * (100 * den), num * cum[:, -1:]
    i = torch.searchsorted(cum, need, right=False)
    i = i.clamp_(max=counts.shape[-1] - 1).float()
    return lo[:, None] + (i + off) * width[:, None]


def percentile_range(hist: Hist, percentile: float = 99.99, *, symmetric: bool = True,
                     convention: str = "center") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` at ``percentile`` (a float, or a ``[K]`` list: then ``[U, K]``)."""
    p = torch.as_tensor(percentile, dtype=torch.float64)
    ps = p.tolist()  # the fractions in Python floats: the same float64 steps, no tensor ops
    ps = [ps] if p.dim() == 0 else ps
    for v in ps:
        check_percentile("percentile", "percentile", v)
    off = _offset(convention)
    dev = hist.counts.device
    dec = [_decimal(v) for v in ps]  # the decimals the user wrote (module doc)
    if symmetric:
        h = fold_abs(hist)
        pct, den = _scaled(dec, ps, dev)
        amax = _values(h.counts, h.lo, h.width, pct, den, off)
        amax = amax[:, 0] if p.dim() == 0 else amax
        return -amax, amax
    # both tails in one pass, each at (100 + p) / 2 percent from its own end: the upper on the
    # counts, the lower on the reversed counts (from -hi, negated back)
    pct, den = _scaled([(100 + f) / 2 for f in dec], [(100 + v) / 2 for v in ps], dev)
    U, w = hist.counts.shape[0], hist.width
    v = _values(torch.cat([hist.counts, hist.counts.flip(-1)]), torch.cat([hist.lo, -hist.hi]),
                torch.cat([w, w]), pct, den, off)
    v = v[:, 0] if p.dim() == 0 else v
    return -v[U:], v[:U]
