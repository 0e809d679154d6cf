"""Quantization error of candidate ranges on a histogram: the one scoring function that
``histogram_mse`` and ``mix`` share.

Every bin stands for its count of values at its centre, as ModelOpt and Quark
score: ``error = sum_i count_i * (fake_quant(c_i) - c_i) ** 2``. The scale of a
candidate comes from :func:`quantscope.qparams_from_range` (so scale encodings
and zero points are those that run).
"""

from __future__ import annotations

import torch

from ..qparams import qparams_from_range
from ..quantize import fake_quantize_units
from ..spec import QuantSpec
from ..stats.histogram import Hist

__all__ = ["ELEMENT_BUDGET", "histogram_error"]

#: elements of one chunk of the ``[units, candidates, bins]`` work (bounded memory)
ELEMENT_BUDGET = 1 << 18


def histogram_error(hist: Hist, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, *,
                    centers: torch.Tensor | None = None, points: int = 1) -> torch.Tensor:
    """Squared error ``[U, C]`` of quantizing each unit's histogram with each candidate
    range ``(lo[u, c], hi[u, c])``, computed in chunks of candidates. ``centers [U, B]``
    overrides the bin centres (a reference's own float rounding of its edges). ``points > 1``
    spreads each bin's count evenly over that many points inside it (uniform density in
    the bin, as torch.ao's L2 model assumes) instead of its centre."""
    if lo.dim() != 2 or lo.shape != hi.shape or lo.shape[0] != hist.counts.shape[0]:
        raise ValueError(f"histogram_error: lo and hi must be [units, candidates] with "
                         f"{hist.counts.shape[0]} units, got {tuple(lo.shape)} and "
                         f"{tuple(hi.shape)}")
    # candidate ranges come from finite histogram edges: no device read-back per chunk
    qp = qparams_from_range(lo, hi, spec, check_finite=False)
    scale = qp.effective_scale.float()
    zp = qp.zero_point.float()
    centers = hist.centers() if centers is None else centers.float()
    counts = hist.counts
    nz = counts > 0
    m = int(nz.sum(1).max()) if counts.numel() else 0
    if m < counts.shape[1]:  # score only occupied bins (empty ones add nothing): [U, m]
        keep = torch.sort((~nz).to(torch.int8), dim=1, stable=True).indices[:, :m]
        centers, counts = centers.gather(1, keep), counts.gather(1, keep)
    width = hist.width
    centers = centers[:, None, :]  # [U, 1, B]
    counts = counts.double()[:, None, :]
    if points > 1:  # sub-points at (i + (k + 0.5) / points) w
        off = (torch.arange(points, device=centers.device) + 0.5) / points - 0.5
        centers = (centers[..., None] + off * width[:, None, None, None]).flatten(-2)
        counts = (counts[..., None] / points).expand(*counts.shape, points).flatten(-2)
    U, C = lo.shape
    step = max(1, ELEMENT_BUDGET // max(1, U * centers.shape[-1]))
    out = []
    for c in range(0, C, step):
        s, z = scale[:, c:c + step, None], zp[:, c:c + step, None]
        d = fake_quantize_units(centers, s, z, spec) - centers
        out.append((d.double().square_() * counts).sum(-1))
    return torch.cat(out, dim=1)
