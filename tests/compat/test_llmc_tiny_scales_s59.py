"""compressed-tensors replaces only a zero scale by eps: the compat searches price candidate
scales below float32's eps as they are, as llm-compressor 0.14's do (s58 did so for the int
and fp8 MSE searches; s59's probe found NVFP4's and the imatrix searches still floored them,
choosing other ranges of weights below ~1e-5)."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs

from quiet_logs import quiet

from quantscope.compat.llmcompressor import Observer as Ours

NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16}


def _assert_same(theirs: dict, ours: dict) -> None:
    assert theirs.keys() == ours.keys()
    for key, value in theirs.items():
        assert value is None and ours[key] is None or torch.equal(value, ours[key]), key


@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "nvfp4_expanded_mse"])
def test_nvfp4_searches_keep_tiny_block_scales(name):
    # block amaxes below 6 * 2**-23: 32 of 32 block scales and the global scale differed
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 1e-7
    got = []
    with quiet():
        for cls in (Theirs, Ours):
            obs = cls.load_from_registry(name, base_name="weight", args=QuantizationArgs(**NVFP4))
            obs(w)
            got.append(obs.get_qparams())
    _assert_same(*got)


@pytest.mark.parametrize(("name", "args", "magnitude"), [
    ("imatrix_mse", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                     "group_size": 32}, 1e-7),
    ("imatrix_mse", {"num_bits": 8, "type": "float", "symmetric": True,
                     "strategy": "channel"}, 3e-6),
    ("imatrix_mse", {"num_bits": 8, "type": "int", "symmetric": False,
                     "strategy": "channel"}, 2e-7),
    ("imatrix_mse", NVFP4, 1e-7),
    ("nvfp4_expanded_imatrix", {"num_bits": 8, "type": "int", "symmetric": True,
                                "strategy": "channel"}, 3e-6),
], ids=["int4-group", "fp8-channel", "int8-asym", "nvfp4", "expanded-int8"])
def test_imatrix_searches_keep_tiny_scales(name, args, magnitude):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 64, generator=g) * magnitude, torch.randn(8, 64, generator=g)
    got = []
    with quiet():
        for cls in (Theirs, Ours):
            lin = torch.nn.Linear(64, 16, bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            obs = cls.load_from_registry(name, base_name="weight",
                                         args=QuantizationArgs(**args))
            obs.attach(lin)
            lin(x)
            obs(lin.weight)
            obs.detach(lin)
            got.append(obs.get_qparams())
    _assert_same(*got)


@pytest.mark.parametrize("fields", [{"num_bits": 8, "type": "int", "symmetric": True,
                                     "group_size": -1},
                                    {"num_bits": 4, "type": "int", "symmetric": True}])
def test_dict_args_without_a_strategy_take_compressed_tensors_default(fields):
    # probe s59: a dict's group_size=-1 was per tensor, compressed-tensors' per channel
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    got = []
    with quiet():
        for cls, args in ((Theirs, QuantizationArgs(**fields)), (Ours, dict(fields))):
            obs = cls.load_from_registry("memoryless_minmax", base_name="weight", args=args)
            obs(w)
            got.append(obs.get_qparams())
    _assert_same(*got)


@pytest.mark.parametrize("scale_dtype", [None, torch.float8_e4m3fn])
def test_a_float16_nvfp4_global_scale_past_float16_falls_back_to_one_as_theirs(scale_dtype):
    # amax below 2688 / 65504: their float16 global scale overflows and falls back to 1
    # (a mutant that dropped the fallback, inf scales, left every other test passing)
    w = (torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 1e-3).half()
    args = QuantizationArgs(**NVFP4, **({} if scale_dtype is None else
                                        {"scale_dtype": scale_dtype}))
    got = []
    with quiet():
        for cls in (Theirs, Ours):
            obs = cls.load_from_registry("memoryless_minmax", base_name="weight", args=args)
            obs(w)
            got.append(obs.get_qparams())
    _assert_same(*got)
    assert got[1]["global_scale"].tolist() == [1.0]
