"""compat.llmcompressor against llm-compressor 0.14 where a read-only probe found it differ:
tensor_group scales of fp8 / integer elements under an fp8 ``scale_dtype``, integer
``scale_dtype`` outside MX, the MSE options llm-compressor accepts, imatrix grids below 1,
bfloat16 tensor_group scales, a moving average whose dtype changes, and ``expand`` past
float32. Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer as TheirObserver

from quantscope.compat import llmcompressor as lc
from quantscope.compat import llmcompressor_legacy as legacy


def _weight(seed: int, rows: int = 8, cols: int = 64, scale: float = 0.05) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale


def _pair(name: str, fields: dict, base_name: str = "weight") -> list:
    """llm-compressor's and quantscope's observer ``name``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [impl.load_from_registry(name, base_name=base_name,
                                        args=QuantizationArgs(**fields))
                for impl in (TheirObserver, lc.Observer)]


def _assert_same_qparams(observers, *values):
    qps = []
    for obs in observers:
        for v in values:
            obs(v)
        qps.append(obs.get_qparams())
    theirs, ours = qps
    for key in ("scale", "zero_point", "global_scale"):
        a, b = theirs[key], ours[key]
        assert (a is None) == (b is None), key
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.float(), b.float()), (key, a.flatten()[:4], b.flatten()[:4])


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("elements", [{"num_bits": 8, "type": "float"},
                                      {"num_bits": 4, "type": "int"},
                                      {"num_bits": 8, "type": "int"}], ids=str)
def test_tensor_group_with_fp8_scale_dtype_as_llmcompressor(elements, name):
    # fp8 elements: theirs is amax / 448 times the fp4-based global scale, rounded to fp8
    # (quantscope's block scales assumed a global scale of 448 * 448 / amax: ~75x off);
    # integer elements were refused ("fp8 scales need strategy tensor_group")
    fields = {**elements, "symmetric": True, "strategy": "tensor_group", "group_size": 16,
              "scale_dtype": torch.float8_e4m3fn}
    for seed in range(4):
        _assert_same_qparams(_pair(name, fields), _weight(seed))


@pytest.mark.parametrize("fields", [
    {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
    {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16},
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
], ids=lambda f: f"{f['type']}{f['num_bits']}-{f['strategy']}")
def test_an_integer_scale_dtype_outside_mx_is_refused_naming_it(fields):
    # compressed-tensors rounds such scales to integers; quantscope dropped the scale_dtype
    # (or read uint8 on tensor_group as NVFP4's fp8 scales) and answered other scales
    fields = {**fields, "symmetric": True, "scale_dtype": torch.uint8}
    theirs, ours = _pair("memoryless_minmax", fields)
    theirs(_weight(0, scale=3.0))
    assert theirs.get_qparams()["scale"] is not None  # theirs accepts it
    ours(_weight(0, scale=3.0))
    with pytest.raises(ValueError, match=r"scale_dtype torch\.uint8 \(integer scales\)"):
        ours.get_qparams()


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float64], ids=str)
def test_a_float_scale_dtype_without_an_encoding_is_refused_naming_it(dtype):
    # it gave float32 scales silently where theirs rounds them to the dtype
    fields = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
              "scale_dtype": dtype}
    ours = _pair("memoryless_minmax", fields)[1]
    with pytest.raises(ValueError, match=rf"scale_dtype {dtype} has no quantscope scale"):
        ours(_weight(0))
        ours.get_qparams()


MSE_OPTIONS = [{"patience": 0}, {"patience": 5.0}, {"patience": 2.5}, {"maxshrink": 0.0},
               {"grid": 0.5}, {"grid": 5e3, "patience": 3}]


def test_a_grid_past_the_candidate_bound_is_refused_naming_it():
    # theirs takes it (its search stops by patience); ours prices every candidate first and
    # settles near ties quadratically: a clear error, as the native searches give
    fields = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel",
              "observer_kwargs": {"grid": 1e5, "patience": 3}}
    ours = _pair("memoryless_mse", fields)[1]
    with pytest.raises(ValueError, match=r"gives 20000 candidates; need 0 to 10000"):
        ours(_weight(0))


@pytest.mark.parametrize("kw", MSE_OPTIONS, ids=str)
@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "nvfp4_expanded_mse"])
def test_mse_options_llmcompressor_accepts(name, kw):
    # they were refused at the first observed tensor; theirs: patience counts from 1 (0 and
    # 2.5 act as 1 and 3), no steps (maxshrink 0, maxshrink * grid < 1) keep min-max
    fp4 = name == "nvfp4_expanded_mse"
    fields = {"num_bits": 4, "type": "float" if fp4 else "int", "symmetric": True,
              "strategy": "tensor_group" if fp4 else "channel", "observer_kwargs": kw}
    if fp4:
        fields["group_size"] = 16
    for seed in range(3):
        _assert_same_qparams(_pair(name, fields), _weight(seed, rows=16))


@pytest.mark.parametrize("kw", MSE_OPTIONS, ids=str)
def test_legacy_mse_accepts_the_same_options(kw):
    fields = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel",
              "observer_kwargs": kw}
    w = _weight(1, rows=16)
    theirs = _pair("memoryless_mse", fields)[0]
    theirs(w)
    ours = legacy.Observer.load_from_registry("memoryless_mse", base_name="weight",
                                              args=QuantizationArgs(**fields))
    assert torch.equal(ours(w)[0], theirs.get_qparams()["scale"])


@pytest.mark.parametrize("grid", [0.5, 0.2])
def test_imatrix_grid_below_one_keeps_the_full_range(grid):
    # theirs also prices p = 1 - 1 / grid < 0 (a zero range) and keeps p = 1; quantscope
    # raised on the negative factor
    fields = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel",
              "observer_kwargs": {"grid": grid}}
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8)
    observers = _pair("imatrix_mse", fields)
    for obs in observers:
        obs.attach(lin)
    lin(torch.randn(4, 32))
    _assert_same_qparams(observers, lin.weight.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_half_int_tensor_group_symmetric_scales_are_equal(bits, dtype):
    # theirs: amax / qmax rounded to the dtype, times the global scale computed in the dtype
    fields = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "tensor_group",
              "group_size": 16}
    for seed in range(4):
        w = (_weight(seed) * (1 if dtype == torch.bfloat16 else 40)).to(dtype)
        _assert_same_qparams(_pair("memoryless_minmax", fields), w)


def test_moving_average_across_dtypes_is_bitwise():
    # theirs rounds start * (1 - c) in the state's bfloat16 before adding the float32 batch
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(1, 5, 8, generator=g), torch.randn(1, 7, 8, generator=g) * 3
    fields = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor",
              "observer_kwargs": {"averaging_constant": 0.3}}
    for a, b in ((first.bfloat16(), second), (first, second.bfloat16())):
        theirs, ours = _pair("minmax", fields, "input")
        for obs in (theirs, ours):
            obs(a)
            obs(b)
        assert ours.min_vals.dtype == theirs.min_vals.dtype
        assert torch.equal(ours.min_vals, theirs.min_vals)
        assert torch.equal(ours.max_vals, theirs.max_vals)


@pytest.mark.parametrize("name", ["nvfp4_expanded_mse", "nvfp4_expanded_imatrix"])
def test_expand_past_float32_names_the_observer(name):
    fields = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
              "group_size": 4}
    ours = _pair(name, fields)[1]
    lin = torch.nn.Linear(16, 1)
    ours.attach(lin)
    lin(torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"NVFP4Expanded\w+Observer \('weight'\): expand=1\.8"):
        ours(torch.tensor([[-3e38, 3e38, 1.0, 0.0] * 4]))
