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

import math

import numpy as np
import torch

__all__ = ["as_float32", "expansion_overflow", "true_div", "upload"]


#: float32's largest value, and the exponent of its subnormals' spacing (2 ** -149)
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY_STEP = -149


def as_float32(x: float) -> float:
    """The Python number ``x`` rounded to float32 (to nearest, ties to even), as torch rounds
    a scalar argument into a float32 kernel (0 below half the smallest subnormal, inf past
    the largest value). In Python's double arithmetic: the CPU's flush-to-zero mode
    (``torch.set_flush_denormal(True)``) does not make float32's subnormals 0 here."""
    try:
        x = float(x)
    except OverflowError:  # an int past double's range
        return math.inf if x > 0 else -math.inf
    if x == 0 or not math.isfinite(x):
        return x
    if abs(x) >= 2.0 ** 128:  # past float32's largest value and half its spacing there
        return math.copysign(math.inf, x)
    step = max(math.frexp(x)[1] - 24, _F32_TINY_STEP)  # float32's spacing at |x|
    y = math.copysign(math.ldexp(round(math.ldexp(x, -step)), step), x)  # ties to even
    return y if abs(y) <= _F32_MAX else math.copysign(math.inf, x)


def expansion_overflow(lo: torch.Tensor, hi: torch.Tensor, expand: float
                       ) -> tuple[float, str] | None:
    """``(the largest finite |end| of the ranges lo, hi, the dtype's name)`` where ``expand``
    takes an end past float32's max, or past the ranges' own dtype's where that is narrower
    (fp16 statistics are expanded in fp16); None where none is (an inf / NaN end is none:
    observed non-finite values have their own refusal). The product is taken in the
    ranges' own dtype and only then held to the limit, so the answer is monotone in
    ``expand``: a float64 end past float32's max that ``expand < 1`` brings back passes. One
    host read, only where ``expand != 1``."""
    if expand == 1.0 or lo.is_meta:  # meta: shapes only, nothing to read
        return None
    amax = torch.maximum(lo.abs(), hi.abs())
    own = amax.dtype if amax.is_floating_point() else torch.float32
    limit = own if torch.finfo(own).max < torch.finfo(torch.float32).max else torch.float32
    finite = amax.isfinite()
    if not bool((finite & ~(amax * expand).to(limit).isfinite()).any()):
        return None
    return amax[finite].max().item(), str(limit).removeprefix("torch.")


def true_div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded once (IEEE division) on CPU and CUDA alike."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def upload(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` (or the CPU tensor ``values``) on ``device``,
    copied without a stream synchronization."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device, dtype=dtype, non_blocking=True)
