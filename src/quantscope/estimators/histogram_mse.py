"""Histogram MSE (ModelOpt / Quark): the clipping magnitude that minimises the squared
error of quantizing the bin centres, weighted by the counts.

Candidates are the bin centres of the ``|x|`` histogram from ``start_bin`` on, every
``stride``-th (ModelOpt: 128, 1; Quark: 2045, 1); the first minimum wins, as
``argmin`` does in both. Symmetric specs score ``(-c, c)`` on ``|x|``; asymmetric ones
clip the signed histogram at ``(-c, c)`` intersected with its occupied bins. The
error is :func:`~quantscope.estimators.error.histogram_error`, for integer and float
formats alike.
"""

from __future__ import annotations

import torch

from ..spec import QuantSpec
from ..stats.histogram import Hist, fold_abs
from .error import histogram_error

__all__ = ["histogram_mse_range", "occupied_range"]


def occupied_range(hist: Hist) -> tuple[torch.Tensor, torch.Tensor]:
    """Left edge of the first and right edge of the last non-empty bin, per unit."""
    nz = hist.counts > 0
    B = hist.bins
    ar = torch.arange(B, device=nz.device)
    first = torch.where(nz, ar, B).amin(-1).clamp(max=B - 1)
    last = torch.where(nz, ar, -1).amax(-1).clamp(min=0)
    w = hist.width
    return hist.lo + first * w, hist.lo + (last + 1) * w


def histogram_mse_range(hist: Hist, spec: QuantSpec, *, start_bin: int = 128,
                        stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` minimising the histogram's quantization error."""
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"histogram_mse: stride must be a positive integer, got {stride!r}")
    if not isinstance(start_bin, int) or start_bin < 0:
        raise ValueError(f"histogram_mse: start_bin must be a non-negative integer, got "
                         f"{start_bin!r}")
    h = fold_abs(hist) if spec.symmetric else hist
    B = h.bins
    start = min(start_bin, B - 1)  # as Quark: at least one candidate on a small histogram
    j = torch.arange(start, B, stride, device=h.counts.device, dtype=torch.float32)
    w = hist.width  # folding keeps the width
    amax = (j + 0.5) * w[:, None]  # [U, C] centres of the |x| grid
    if spec.symmetric:
        lo_c, hi_c = -amax, amax
    else:
        olo, ohi = occupied_range(h)
        lo_c = torch.maximum(-amax, olo[:, None])
        hi_c = torch.minimum(amax, ohi[:, None])
    err = histogram_error(h, lo_c, hi_c, spec)
    best = err.argmin(-1, keepdim=True)
    return lo_c.gather(1, best)[:, 0], hi_c.gather(1, best)[:, 0]
