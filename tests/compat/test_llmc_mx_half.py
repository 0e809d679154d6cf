"""compat.llmcompressor's MX (E8M0) block scales of blocks a float16 model holds no normal amax
of, as compressed-tensors 0.19 computes them (its power-of-two rounding keeps the dtype's
exponent bits; a zero scale becomes its uint8 eps, 1): they were float32's power of two, cast.
Pinned values (tests/integrations/test_llmc_plugin_s54.py compares them with
llm-compressor's own in the peers' venv)."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import llmcompressor as lc
from quantscope.formats import FP4_E2M1
from quantscope.scales import e8m0_scale

#: block maxima: zero, tiny, float16 subnormals either side of the carry (1.5 * 2**-15, up to
#: the smallest normal 2**-14), that normal, a normal one
AMAX = [0.0, 2e-7, 1e-5, 1.49 * 2.0 ** -15, 1.5 * 2.0 ** -15, 2.0 ** -14, 0.5]
#: log2 of the float16 scales: 0 (scale 1) below the carry, then the normal rule
WANT_FP16 = {4: [0, 0, 0, 0, -16, -16, -3], 8: [0, 0, 0, 0, -22, -22, -9]}
#: bfloat16 holds them all as normal numbers (zero: the smallest E8M0 scale, 2**-127)
WANT_BF16 = {4: [-127, -25, -19, -17, -17, -16, -3], 8: [-127, -31, -25, -23, -23, -22, -9]}


def _mx(bits: int) -> dict:
    return {"num_bits": bits, "type": "float", "symmetric": True, "strategy": "group",
            "group_size": 32, "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}


def _blocks(dtype) -> torch.Tensor:
    return (torch.linspace(-1, 1, 32) * torch.tensor(AMAX, dtype=torch.float64)[:, None]).to(
        dtype)


@pytest.mark.parametrize(("dtype", "want"), [(torch.float16, WANT_FP16),
                                             (torch.bfloat16, WANT_BF16)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "memoryless_mse"])
def test_mx_scales_of_half_blocks_are_compressed_tensors(name, bits, dtype, want):
    obs = lc.Observer.load_from_registry(name, base_name="weight", args=_mx(bits))
    obs(_blocks(dtype))
    scale = obs.get_qparams()["scale"]
    assert scale.dtype == dtype
    assert scale.reshape(-1).float().log2().tolist() == want[bits]


def test_mx_scale_in_dtype_keeps_normal_amaxes_and_never_gives_zero():
    from quantscope.compat.llmcompressor_parts import mx_scale_in_dtype

    amax = torch.tensor(AMAX)
    fp32 = e8m0_scale(amax, FP4_E2M1)
    half = mx_scale_in_dtype(fp32, -amax, amax, FP4_E2M1, torch.float16)
    assert half.float().log2().tolist() == WANT_FP16[4]
    for dtype in (torch.bfloat16, torch.float32):  # both hold 2**-127 .. : float32's scales
        assert torch.equal(mx_scale_in_dtype(fp32, -amax, amax, FP4_E2M1, dtype),
                           fp32.to(dtype))


@pytest.mark.parametrize(("dtype", "want"), [(torch.float16, WANT_FP16),
                                             (torch.bfloat16, WANT_BF16)])
@pytest.mark.parametrize("bits", [4, 8])
def test_imatrix_prices_mx_candidates_with_the_same_scales(bits, dtype, want):
    """imatrix_mse's search prices each candidate range of a half-precision MX weight with
    compressed-tensors' scale of it (``candidate_qparams``), the blocks below float16's
    smallest normal included: a plain cast of float32's power of two (2**-19 for an amax of
    1e-5) priced candidates with scales llm-compressor never gives."""
    from quantscope.compat.llmcompressor_imatrix import candidate_qparams
    from quantscope.compat.llmcompressor_spec import llmcompressor_spec

    amax = torch.tensor(AMAX, dtype=torch.float64).to(dtype)
    scale, zp = candidate_qparams(-amax, amax, llmcompressor_spec(_mx(bits), "weight"))
    assert scale.dtype == dtype and not zp.any()
    assert scale.float().log2().tolist() == want[bits]
