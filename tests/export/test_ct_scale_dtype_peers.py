"""``_ct_scale_dtype`` (the dtype the compressed-tensors export gives the KV cache's
``k_scale`` / ``v_scale``) mirrors compressed-tensors' own rule for a scale's dtype, the one
its ``initialize_qparams`` gives a Linear's scales: pinned here to that function, for every
scheme we export and the model dtypes, so a change of their rule fails this test. Runs in
the peers' venv (compressed-tensors 0.19, ``make test``: PEER_TESTS) and in .venv (the
compressed-tensors the export runs with there)."""

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

from quantscope.exporters.compressed_tensors import _ct_scale_dtype

#: the weights of the schemes we export: int (channel, group), fp8, NVFP4, MXFP4
SCHEMES = ["W8A8", "W4A16", "W4A16_ASYM", "FP8", "NVFP4", "MXFP4"]
#: the float dtypes keep their own; a non-float one (an attention whose first parameter is
#: int8 or float8) gets compressed-tensors' float16, not another float
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
          torch.float8_e4m3fn]


def _theirs(scheme: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype compressed-tensors gives the scale of a [64, 128] tensor observed in
    ``dtype`` under ``scheme``'s weight arguments."""
    args = PRESET_SCHEMES[scheme]["weights"]
    module = nn.Linear(128, 64)
    initialize_qparams(module, "k", args, observed_shape=(64, 128), observed_dtype=dtype,
                       force_zero_point=False)
    return module.k_scale.dtype


def _check(scheme: str, dtype: torch.dtype) -> None:
    assert _ct_scale_dtype(dtype) == _theirs(scheme, dtype), (scheme, dtype)


@pytest.mark.peers
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_rule_is_the_peers_compressed_tensors(scheme, dtype):
    _check(scheme, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_rule_is_the_installed_compressed_tensors(scheme, dtype):
    _check(scheme, dtype)
