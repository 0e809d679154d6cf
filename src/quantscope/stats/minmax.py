"""Per-unit min and max: the one pass over the data every observer makes."""

from __future__ import annotations

import torch

__all__ = ["unit_minmax"]


def unit_minmax(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of every row of ``units [U, E]`` as two ``[U]`` tensors (NaN propagates).

    One unit reduces over the whole tensor: torch's full reduction is much faster
    than a reduction along a dim of a ``[1, E]`` view.
    """
    if units.shape[0] == 1:
        lo, hi = torch.aminmax(units)
        return lo.reshape(1), hi.reshape(1)
    return torch.aminmax(units, dim=1)
