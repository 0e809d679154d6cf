"""imatrix_mse on bfloat16 / float16 / float64 weights against llm-compressor 0.14's: the
compat class and the registry's ``quantscope_imatrix_mse`` keep the weight's dtype in
``min_vals`` / ``max_vals`` and so in the scales, as llm-compressor's imatrix_mse (and
quantscope's MSE compat) do (docs/guide/pipelines.md: "same dtypes"). Values: float64 within
float32's rounding (quantscope searches in float32); half precision within a few units in
the last place, or the neighbouring candidate (their candidates are rounded to the dtype).
Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer as TheirObserver

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)
from quantscope.compat import llmcompressor as lc

DTYPES = [torch.bfloat16, torch.float16, torch.float64]
#: (our implementation, name): the compat class and the registry class
OURS = [(lc.Observer, "imatrix_mse"), (TheirObserver, "quantscope_imatrix_mse")]
FIELDS = [{"num_bits": 8, "strategy": "channel"},
          {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 16}]


def _observe(impl, name, fields, lin, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs = impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(**fields))
    obs.attach(lin)
    with torch.no_grad():
        lin(x)
    obs.detach(lin)
    obs(lin.weight.detach())
    stats = {"min_vals": obs.min_vals.clone(), "max_vals": obs.max_vals.clone()}
    return stats, obs.get_qparams()


def _tolerance(dtype):
    # float64: float32's rounding; half: their candidates p * range are rounded to the dtype
    # and priced in it, so a neighbouring candidate (1 / grid = 5% of the range) may win
    return {"rtol": 1e-6} if dtype == torch.float64 else {"rtol": 0.06}


@pytest.mark.parametrize("fields", FIELDS, ids=lambda f: f["strategy"])
@pytest.mark.parametrize("impl,name", OURS, ids=["compat", "registry"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_imatrix_keeps_the_weight_dtype_as_llmcompressor(dtype, impl, name, fields):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 24).to(dtype)
    x = (torch.randn(16, 64) * torch.linspace(0.1, 5, 64)).to(dtype)
    theirs = _observe(TheirObserver, "imatrix_mse", fields, lin, x)
    ours = _observe(impl, name, fields, lin, x)
    for part in (0, 1):
        for key, want in theirs[part].items():
            got = ours[part][key]
            if want is None:
                assert got is None, key
                continue
            assert got.dtype == want.dtype and got.shape == want.shape, key
            if key != "zero_point":  # zero points: compressed-tensors' zp_dtype
                assert want.dtype == dtype, key
                assert torch.allclose(got.double(), want.double(), **_tolerance(dtype)), key
