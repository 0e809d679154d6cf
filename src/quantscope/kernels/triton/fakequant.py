"""Fake-quantization of integer formats on a ``[units, elements]`` view (Triton).

``out = (clamp(rint(x / s + z), qmin, qmax) - z) * s`` per unit, in float32 whatever the
input dtype, each step rounded as the torch ops of ``qdq.fake_quantize_units`` round
it: IEEE division (``div_rn``), half-to-even ``rint``, no FMA (see the package doc). The
clamp propagates NaN as ``torch.clamp`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH, cdiv, fake_quant, next_power_of_2, widen

__all__ = ["fake_quant_int"]


@triton.jit
def _fake_quant_kernel(x_ptr, s_ptr, z_ptr, out_ptr, U, E, stride_u, stride_e, qmin, qmax,
                       BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    # one grid axis (CUDA's first takes 2**31 - 1 programs, the others 65535: a per-tensor
    # unit of 2**26 elements has more element blocks than that)
    col_blocks = tl.cdiv(E, BLOCK_E)
    rows = (tl.program_id(0) // col_blocks) * BLOCK_U + tl.arange(0, BLOCK_U)
    cols = (tl.program_id(0) % col_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = (rows[:, None] < U) & (cols[None, :] < E)
    r64, c64 = rows[:, None].to(tl.int64), cols[None, :].to(tl.int64)
    x = widen(tl.load(x_ptr + r64 * stride_u + c64 * stride_e, mask=mask, other=0.0))
    s = tl.load(s_ptr + rows, mask=rows < U, other=1.0)[:, None]
    z = tl.load(z_ptr + rows, mask=rows < U, other=0.0)[:, None]
    tl.store(out_ptr + r64 * E + c64, fake_quant(x, s, z, qmin, qmax, ZERO_SIGN=True),
             mask=mask)


def fake_quant_int(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                   qmin: float, qmax: float, *, block_u: int | None = None,
                   block_e: int | None = None) -> torch.Tensor:
    """Float32 ``[U, E]`` fake-quantized ``units [U, E]`` (any strides, bf16 / fp16 / fp32)
    with float32 ``scale`` and ``zero_point`` of ``U`` contiguous values each."""
    U, E = units.shape
    out = torch.empty((U, E), dtype=torch.float32, device=units.device)
    be = block_e or min(next_power_of_2(max(E, 1)), 1024)
    bu = block_u or max(1, min(next_power_of_2(max(U, 1)), 4096 // be))
    grid = (cdiv(U, bu) * cdiv(E, be),)
    if U and E:
        _fake_quant_kernel[grid](units, scale, zero_point, out, U, E, units.stride(0),
                                 units.stride(1), float(qmin), float(qmax),
                                 BLOCK_U=bu, BLOCK_E=be, **LAUNCH)
    return out
