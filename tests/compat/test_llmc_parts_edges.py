"""compat.llmcompressor_parts at its edges: the MX (E8M0) block scales in a model's dtype
(``mx_scale_in_dtype``) of no blocks at all, the qparams of an empty range (a zero-row weight's
statistics) that call it. Pins mutant LP06 of mutation round s55 (``amax.min()`` of no blocks
raises)."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat.llmcompressor_base import qparams_of_statistics
from quantscope.compat.llmcompressor_parts import mx_scale_in_dtype
from quantscope.formats import FP4_E2M1, FP8_E4M3


@pytest.mark.parametrize("fmt", [FP4_E2M1, FP8_E4M3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0)])
def test_mx_scale_in_dtype_of_no_blocks_is_an_empty_scale(fmt, dtype, shape):
    empty = torch.empty(shape)
    out = mx_scale_in_dtype(empty, empty, empty, fmt, dtype)
    assert out.dtype == dtype and out.shape == shape


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mx_qparams_of_empty_statistics_are_empty(bits, dtype):
    args = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": "group",
            "group_size": 32, "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
    empty = torch.empty(0, 2, dtype=dtype)
    scale, zero = qparams_of_statistics(empty, empty, args, "weight", None)
    assert scale.shape == zero.shape == (0, 2)
    assert scale.dtype == dtype and zero.dtype == torch.uint8
