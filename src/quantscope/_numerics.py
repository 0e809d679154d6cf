"""Arithmetic that rounds the same on every device, and values sent to a device without
waiting for it.

CUDA divides a tensor by a Python number (or a CPU scalar tensor) as ``t * (1 / c)``: two
roundings, so about 70 % of float32 quotients land one ulp away from the CPU's correctly
rounded ``t / c``, and qparams would depend on the device. A divisor that is a tensor on
``t``'s own device takes the division kernel on both.

A host-to-device copy with ``non_blocking=False`` (what ``torch.tensor(..., device=...)`` and
``.to(device)`` do) makes PyTorch synchronize the stream afterwards: the host waits for all
the GPU work queued before it, as a read would. From pageable memory a non-blocking copy is
staged before the call returns (the CUDA runtime's rule), so the source may go at once.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["as_float32", "true_div", "upload"]


def as_float32(x: float) -> float:
    """The Python number ``x`` rounded to float32, as torch rounds a scalar argument into a
    float32 kernel (0 below the smallest subnormal, inf past the largest value)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def true_div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded once (IEEE division) on CPU and CUDA alike."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def upload(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` (or the CPU tensor ``values``) on ``device``,
    copied without a stream synchronization."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device, dtype=dtype, non_blocking=True)
