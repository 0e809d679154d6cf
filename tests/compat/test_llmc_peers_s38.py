"""compat.llmcompressor against llm-compressor 0.14 where the s38 llmc2 probe found them
differ: MX (E8M0) weights under ``imatrix_mse`` (candidates priced with their E8M0 scales),
the MSE and imatrix searches on bfloat16 / float16 weights with MX scales or a float16
``scale_dtype`` on bfloat16 (each candidate priced in the dtype, its scale rounded through the
``scale_dtype``), symmetric scales of half statistics rounded to the dtype before the
``scale_dtype``, and an asymmetric ``scale_dtype`` wider than the statistics (theirs raises:
compared with their scales without it). Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer as TheirObserver

from quantscope.compat import llmcompressor as lc

MXFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
         "group_size": 32, "scale_dtype": torch.uint8}
FP16_SCALES = {
    "int4_asym_g16": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                      "group_size": 16},
    "int4_sym_g16": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                     "group_size": 16},
    "int8_sym_ch": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "int4_asym_ch": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"},
    "fp8_ch": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
}


def _observe(impl, name, fields, w, x):
    """``name``'s ranges and qparams of weight ``w`` (importance from ``x`` where attached)."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    obs = impl.load_from_registry(name, base_name="weight", args=QuantizationArgs(**fields))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs.attach(lin)
        with torch.no_grad():
            lin(x.to(w.dtype))
        obs.detach(lin)
        obs(lin.weight)
    return obs.min_vals, obs.max_vals, obs.get_qparams()


def _assert_theirs(name, fields, w, x):
    theirs, ours = (_observe(impl, name, fields, w, x) for impl in (TheirObserver, lc.Observer))
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    for key in ("scale", "zero_point"):
        assert torch.equal(theirs[2][key], ours[2][key]), key


def _data(seed, rows=16, cols=64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * scale, torch.randn(4, cols, generator=g)


@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
def test_mx_imatrix_prices_e8m0_scales(name):
    """Theirs drops ``scale_dtype`` to search only for ``tensor_group``: MX candidates are
    priced with their E8M0 scales (float32 ones chose other block scales)."""
    for seed in range(1, 4):
        _assert_theirs(name, MXFP4, *_data(seed))


@pytest.mark.parametrize("name", ["memoryless_mse", "nvfp4_expanded_mse", "imatrix_mse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mx_half_searches_price_in_the_dtype(name, dtype):
    for seed, scale in ((1, 750.0), (2, 1.0), (3, 0.01)):
        w, x = _data(seed, scale=scale)
        _assert_theirs(name, MXFP4, w.to(dtype), x)


@pytest.mark.parametrize("fields", list(FP16_SCALES.values()), ids=list(FP16_SCALES))
@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "imatrix_mse"])
def test_fp16_scale_dtype_on_bfloat16_searches(name, fields):
    for seed, scale in ((5, 1.0), (6, 100.0)):
        w, x = _data(seed, rows=8, scale=scale)
        _assert_theirs(name, {**fields, "scale_dtype": torch.float16}, w.bfloat16(), x)


@pytest.mark.parametrize("symmetric", [True, False])
def test_fp16_scale_dtype_of_bfloat16_statistics(symmetric):
    """Theirs: the scale in bfloat16, then float16, then bfloat16; float32 rounded to float16
    first rounded twice (about 1 in 15 symmetric scales differed)."""
    fields = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": "group",
              "group_size": 16, "scale_dtype": torch.float16}
    for seed in range(4):
        w, x = _data(seed, rows=64, scale=3.0)
        _assert_theirs("memoryless_minmax", fields, w.bfloat16(), x)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("sd, dtype", [(torch.float32, torch.bfloat16),
                                       (torch.float32, torch.float16),
                                       (torch.bfloat16, torch.float16)], ids=str)
def test_scale_dtype_wider_than_statistics_is_their_formula(sd, dtype, symmetric):
    """Their formula (which raises at its clamp here): their scale without ``scale_dtype``
    rounded through it, the zero point theirs."""
    fields = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
              "group_size": 16}
    w, x = _data(7, rows=8)
    theirs = _observe(TheirObserver, "memoryless_minmax", fields, w.to(dtype), x)[2]
    ours = _observe(lc.Observer, "memoryless_minmax", {**fields, "scale_dtype": sd},
                    w.to(dtype), x)[2]
    assert torch.equal(ours["scale"], theirs["scale"].to(sd).to(dtype))
    assert torch.equal(ours["zero_point"], theirs["zero_point"])


MXFP8 = {**MXFP4, "num_bits": 8}


def _observe_input(impl, name, fields, x):
    obs = impl.load_from_registry(name, base_name="input", args=QuantizationArgs(**fields))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs(x)
    return obs.min_vals, obs.max_vals


@pytest.mark.parametrize("fields", [MXFP4, MXFP8], ids=["mxfp4", "mxfp8"])
@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "nvfp4_expanded_mse"])
def test_mx_activation_searches_price_e8m0_scales(name, fields):
    """An activation's one range per unit spans many tokens' blocks: theirs prices its
    candidates with the E8M0 scale too (float32 ones chose other ranges, most seeds)."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 64, generator=g) * torch.rand(16, 1, generator=g) * 5
        for dtype in (torch.float32, torch.bfloat16):
            theirs, ours = (_observe_input(impl, name, fields, x.to(dtype))
                            for impl in (TheirObserver, lc.Observer))
            assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1]), seed
