"""Quantization error of candidate ranges on a histogram, in one call.

Every bin stands for its count of values at its centre, as ModelOpt and Quark score:
``error = sum_i count_i * (fake_quant(c_i) - c_i) ** 2``, the scale of a candidate from
:func:`quantscope.qparams_from_range`. The scorer behind it (prepared once, C kernel,
line searches) is :mod:`quantscope.estimators.scorer`, whose names this module re-exports
for code that imported them from here.
"""

from __future__ import annotations

import torch

from ..spec import QuantSpec
from ..stats.histogram import Hist
from .scorer import (  # noqa: F401 -- re-exported
    ELEMENT_BUDGET,
    MOVE_HI,
    MOVE_LO,
    SYMMETRIC,
    HistogramScorer,
    Line,
    LineBest,
)

__all__ = ["histogram_error"]


def histogram_error(hist: Hist, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, *,
                    centers: torch.Tensor | None = None, points: int = 1,
                    backend: str | None = None, global_amax: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Squared error ``[U, C]`` of quantizing each unit's histogram with each candidate
    range ``(lo[u, c], hi[u, c])``, computed in chunks of candidates. ``centers [U, B]``
    overrides the bin centres (a reference's own float rounding of its edges). ``points > 1``
    spreads each bin's count evenly over that many points inside it (uniform density in
    the bin, as torch.ao's L2 model assumes) instead of its centre. ``backend``: see
    :data:`quantscope.kernels.BACKENDS` (``"torch"``: the reference the kernel is tested
    against). ``global_amax``: a global-scale spec's (NVFP4) tensor-wide ``max |x|``, which
    every candidate is scored under (required there)."""
    return HistogramScorer(hist, spec, centers=centers, points=points, backend=backend,
                           global_amax=global_amax)(lo, hi)
