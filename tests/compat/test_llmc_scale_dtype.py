"""compat.llmcompressor against llm-compressor 0.14 / compressed-tensors 0.19 where a
``scale_dtype`` or half-precision statistics are involved: ``tensor_group`` scales rounded to
a float16 / bfloat16 ``scale_dtype`` (not fp8), the MSE and imatrix searches without
``tensor_group``'s ``scale_dtype``, and zero points from the scale in the statistics' dtype.
Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer as TheirObserver

from quantscope.compat import llmcompressor as lc

HALF_SCALES = [torch.float16, torch.bfloat16]
TENSOR_GROUP = [
    {"num_bits": 4, "type": "float", "symmetric": True},
    {"num_bits": 8, "type": "int", "symmetric": False},
    {"num_bits": 4, "type": "int", "symmetric": True},
]


def _ids(f: dict) -> str:
    return f"{f['type']}{f['num_bits']}-{'sym' if f['symmetric'] else 'asym'}"


def _weight(seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 32, generator=g) * scale).to(dtype)


def _observers(name: str, fields: dict) -> list:
    """llm-compressor's and quantscope's observer ``name`` for a weight."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [impl.load_from_registry(name, base_name="weight",
                                        args=QuantizationArgs(**fields))
                for impl in (TheirObserver, lc.Observer)]


def _observed(name: str, fields: dict, w: torch.Tensor, observers=None):
    """(statistics, qparams) of llm-compressor's and quantscope's observer ``name`` on ``w``."""
    out = []
    for obs in observers or _observers(name, fields):
        obs(w)
        stats = {"min_vals": obs.min_vals.clone(), "max_vals": obs.max_vals.clone()}
        out.append((stats, obs.get_qparams()))
    return out


def _assert_same(theirs, ours):
    for key in theirs[0]:
        assert torch.equal(ours[0][key], theirs[0][key]), key
    for key in ("scale", "zero_point", "global_scale"):
        a, b = theirs[1][key], ours[1][key]
        if a is None:
            assert b is None, key
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, key
        assert torch.equal(a.float(), b.float()), (key, a, b)


# ------------------------------------------------------- tensor_group with a half scale_dtype
@pytest.mark.parametrize("sd", HALF_SCALES + [torch.float32], ids=str)
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("fields", TENSOR_GROUP, ids=_ids)
def test_tensor_group_scales_round_to_scale_dtype_as_llmcompressor(fields, name, sd):
    # compressed-tensors rounds float32 scales times the global scale to scale_dtype (fp4
    # elements included): no fp8 e4m3 block scales unless scale_dtype is float8_e4m3fn
    for seed in range(6):
        w = _weight(seed, scale=[1.0, 0.01, 300.0][seed % 3])
        fields_ = {**fields, "strategy": "tensor_group", "group_size": 8, "scale_dtype": sd}
        theirs, ours = _observed(name, fields_, w)
        _assert_same(theirs, ours)


def test_nvfp4_fp16_scale_dtype_is_scale_times_global_scale_in_fp16():
    # the formula: fp16(global_scale * amax / 6) per block of 4, global 448 * 6 / amax
    w = _weight(0)[:2, :8]
    (_, theirs), (_, ours) = _observed("memoryless_minmax", {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
        "group_size": 4, "scale_dtype": torch.float16}, w)
    amax = w.reshape(-1, 4).abs().amax(-1)
    gs = 448.0 * 6.0 / w.abs().max()
    expect = (gs * (amax / 6.0)).to(torch.float16).float()
    assert torch.equal(ours["scale"].flatten(), expect)
    assert torch.equal(ours["scale"], theirs["scale"])


# ------------------------------------------------- searches drop tensor_group's scale_dtype
@pytest.mark.parametrize("sd", HALF_SCALES, ids=str)
@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "nvfp4_expanded_mse"])
@pytest.mark.parametrize("fields", TENSOR_GROUP, ids=_ids)
def test_tensor_group_search_ignores_scale_dtype_as_llmcompressor(fields, name, sd):
    # llm-compressor's _grid_search_mse searches tensor_group with float32 candidate scales
    # (scale_dtype dropped), then rounds the chosen qparams' scales to it
    for seed in range(8):
        fields_ = {**fields, "strategy": "tensor_group", "group_size": 4, "scale_dtype": sd}
        if name == "nvfp4_expanded_mse":
            fields_["observer_kwargs"] = {"grid": 50}
        theirs, ours = _observed(name, fields_, _weight(seed))
        _assert_same(theirs, ours)


@pytest.mark.parametrize("sd", HALF_SCALES, ids=str)
@pytest.mark.parametrize("fields", TENSOR_GROUP, ids=_ids)
def test_tensor_group_imatrix_search_ignores_scale_dtype_as_llmcompressor(fields, sd):
    for seed in range(8):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(32, 16)
        fields_ = {**fields, "strategy": "tensor_group", "group_size": 8, "scale_dtype": sd}
        observers = _observers("imatrix_mse", fields_)
        for obs in observers:
            obs.attach(lin)
        lin(torch.randn(4, 6, 32) * torch.linspace(0.1, 5, 32))
        (st, qt), (so, qo) = _observed("imatrix_mse", fields_, lin.weight.detach(), observers)
        for key in st:  # the weighted sums: float32 order (as test_llmcompressor_peers)
            assert torch.allclose(so[key], st[key], rtol=1e-6), (seed, key)
        assert torch.allclose(qo["scale"], qt["scale"], rtol=1e-3), seed


# ------------------------------------------------ zero points of half-precision statistics
def _asym(bits: int) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
            "group_size": 8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_half_asymmetric_qparams_are_theirs(dtype, bits):
    # compressed-tensors rounds max - min to the statistics' dtype before it divides, and
    # takes the zero point from that scale in the dtype: quantscope's are those, bit for bit
    # (they were computed in float32 and rounded once: zero points two codes apart)
    for seed in range(12):
        w = _weight(seed, dtype, scale=[1e-3, 1.0, 100.0][seed % 3])
        theirs, ours = _observed("memoryless_minmax", _asym(bits), w)
        _assert_same(theirs, ours)


@pytest.mark.parametrize("sd", [None, torch.float16], ids=str)
def test_float32_asymmetric_qparams_stay_bitwise(sd):
    # float32 statistics: the zero point from the float32 scale, before scale_dtype rounding
    for seed in range(6):
        fields = {**_asym(8), "scale_dtype": sd}
        theirs, ours = _observed("memoryless_minmax", fields, _weight(seed, scale=1e-3))
        _assert_same(theirs, ours)
