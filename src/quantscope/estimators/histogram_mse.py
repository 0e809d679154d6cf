"""Histogram MSE (ModelOpt / Quark): the clipping magnitude that minimises the squared
error of quantizing the bin centres, weighted by the counts.

Candidates are the bin centres of the ``|x|`` histogram from ``start_bin`` on, every
``stride``-th (ModelOpt: 128, 1; Quark: 2045, 1); the first minimum wins, as
``argmin`` does in both. By default the search is coarse-to-fine (``refine``). Symmetric specs score ``(-c, c)`` on ``|x|``; asymmetric ones
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


def histogram_mse_range(hist: Hist, spec: QuantSpec, *, start_bin: int = 128, stride: int = 1,
                        refine: int | None = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` minimising the histogram's quantization error.

    ``refine=k`` scores every ``k``-th candidate, then every candidate within ``k`` of the
    best (about ``n / k + 2 k`` instead of ``n`` candidates; the minimum of a smooth error
    curve is found exactly). ``refine=None`` scores every candidate, as ModelOpt / Quark.
    """
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"histogram_mse: stride must be a positive integer, got {stride!r}")
    if not isinstance(start_bin, int) or start_bin < 0:
        raise ValueError(f"histogram_mse: start_bin must be a non-negative integer, got "
                         f"{start_bin!r}")
    if refine is not None and (not isinstance(refine, int) or refine < 1):
        raise ValueError(f"histogram_mse: refine must be None or a positive integer, got "
                         f"{refine!r}")
    h = fold_abs(hist) if spec.symmetric else hist
    B = h.bins
    start = min(start_bin, B - 1)  # as Quark: at least one candidate on a small histogram
    j = torch.arange(start, B, stride, device=h.counts.device)
    U, n = h.counts.shape[0], j.numel()
    if refine is None or refine == 1 or n <= 4 * refine:
        pick = j.expand(U, n)
        return _best(h, hist.width, pick, spec)[:2]
    coarse = j[::refine].expand(U, -1)
    _, _, best = _best(h, hist.width, coarse, spec)
    pos = (best - start) // stride  # index of the coarse winner in j
    near = (pos[:, None] + torch.arange(-refine, refine + 1, device=j.device)).clamp(0, n - 1)
    return _best(h, hist.width, j[near], spec)[:2]


def _best(h: Hist, w: torch.Tensor, bins_idx: torch.Tensor, spec: QuantSpec):
    """Score clipping at the centres of bins ``bins_idx [U, C]``; the first minimum per unit."""
    amax = (bins_idx.float() + 0.5) * w[:, None]  # centres of the |x| grid
    if spec.symmetric:
        lo_c, hi_c = -amax, amax
    else:
        olo, ohi = occupied_range(h)
        lo_c = torch.maximum(-amax, olo[:, None])
        hi_c = torch.minimum(amax, ohi[:, None])
    err = histogram_error(h, lo_c, hi_c, spec)
    # first minimum in bin order (the refined window may repeat a bin at the clamped ends)
    key = torch.where(err == err.amin(-1, keepdim=True), bins_idx, torch.iinfo(torch.long).max)
    k = key.argmin(-1, keepdim=True)
    return lo_c.gather(1, k)[:, 0], hi_c.gather(1, k)[:, 0], bins_idx.gather(1, k)[:, 0]
