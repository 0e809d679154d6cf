"""Percentile ranges from a histogram, with the references' bin conventions.

The bin ``i`` that holds the percentile ``p`` is the first whose cumulative count reaches
``p`` percent of the total, compared as ``100 * count >= p * total`` in float64 on int64
counts: exact, so where ``p`` percent of the total is a whole count (99.9 % of 40000 is
39960) it is reached at the bin that reaches that count (``p / 100 * total`` would round
past it: ``99.9 / 100`` is above 0.999 in float64). The value reported for it differs
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

import numbers

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
    ``percent`` percent of the total. ``percent`` is a float or a ``[U, K]`` tensor (then
    ``[U, K]``)."""
    off = _offset(convention)
    pct = torch.as_tensor(percent, dtype=torch.float64, device=counts.device)
    squeeze = pct.dim() == 0
    v = _values(counts, lo, width, pct.reshape(1, 1) if squeeze else pct, off)
    return v[:, 0] if squeeze else v


def _values(counts, lo, width, pct, off):
    # [U, K] values of the bins reaching ``pct`` percent ([U, K] or [1, K], float64) of the
    # total: 100 * count >= pct * total (the module doc says why not count >= pct / 100 * total)
    cum = counts.cumsum(-1).double()
    i = torch.searchsorted(cum * 100, pct * cum[:, -1:], right=False)
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
    if symmetric:
        h = fold_abs(hist)
        pct = torch.tensor([ps], dtype=torch.float64, device=dev)
        amax = _values(h.counts, h.lo, h.width, pct, off)
        amax = amax[:, 0] if p.dim() == 0 else amax
        return -amax, amax
    # both tails in one pass, each at (100 + p) / 2 percent from its own end: the upper on the
    # counts, the lower on the reversed counts (from -hi, negated back)
    pct = torch.tensor([[(100 + v) / 2 for v in ps]], dtype=torch.float64, device=dev)
    U, w = hist.counts.shape[0], hist.width
    v = _values(torch.cat([hist.counts, hist.counts.flip(-1)]), torch.cat([hist.lo, -hist.hi]),
                torch.cat([w, w]), pct, off)
    v = v[:, 0] if p.dim() == 0 else v
    return -v[U:], v[:U]
