"""Percentile ranges from a histogram, with the references' bin conventions.

The bin ``i`` that holds the percentile is the first whose cumulative count reaches
``p * total`` (compared exactly, in float64 on int64 counts). The value reported
for it differs between the references; ``convention`` selects it:

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

import torch

from ..stats.histogram import Hist, fold_abs

__all__ = ["CONVENTIONS", "percentile_range", "percentile_value"]

CONVENTIONS = {"lower": 0.0, "center": 0.5, "upper": 1.0,
               "quark": 0.0, "modelopt": 0.0, "tensorrt": 0.0, "horizon": 0.5, "centre": 0.5}


def _offset(convention: str) -> float:
    try:
        return CONVENTIONS[convention]
    except KeyError:
        raise ValueError(f"percentile: convention must be one of {sorted(CONVENTIONS)}, "
                         f"got {convention!r}") from None


def percentile_value(counts: torch.Tensor, lo: torch.Tensor, width: torch.Tensor,
                     fraction, convention: str = "center") -> torch.Tensor:
    """Per unit, the value (by ``convention``) of the first bin whose cumulative count reaches
    ``fraction`` of the total. ``fraction`` is a float or a ``[U, K]`` tensor (then ``[U, K]``)."""
    off = _offset(convention)
    cum = counts.cumsum(-1).double()
    total = cum[:, -1:]
    frac = torch.as_tensor(fraction, dtype=torch.float64, device=counts.device)
    squeeze = frac.dim() == 0
    frac = frac.reshape(1, 1) if squeeze else frac
    target = frac * total  # [U, K]
    i = torch.searchsorted(cum.contiguous(), target.contiguous(), right=False)
    i = i.clamp_(max=counts.shape[-1] - 1).float()
    v = lo[:, None] + (i + off) * width[:, None]
    return v[:, 0] if squeeze else v


def percentile_range(hist: Hist, percentile: float = 99.99, *, symmetric: bool = True,
                     convention: str = "center") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` at ``percentile`` (a float, or a ``[K]`` list: then ``[U, K]``)."""
    p = torch.as_tensor(percentile, dtype=torch.float64)
    if not bool(((p > 0) & (p <= 100)).all()):
        raise ValueError(f"percentile: percentile must be in (0, 100], got {percentile!r}")
    U = hist.counts.shape[0]
    frac = (p / 100).to(hist.counts.device)
    if symmetric:
        h = fold_abs(hist)
        f = frac if frac.dim() == 0 else frac.expand(U, -1)
        amax = percentile_value(h.counts, h.lo, h.width, f, convention)
        return -amax, amax
    one = 1 - (1 - frac) / 2
    f = one if one.dim() == 0 else one.expand(U, -1)
    w = hist.width
    hi = percentile_value(hist.counts, hist.lo, w, f, convention)
    lo = -percentile_value(hist.counts.flip(-1), -hist.hi, w, f, convention)
    return lo, hi
