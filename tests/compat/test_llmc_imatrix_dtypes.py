"""imatrix_mse on bfloat16 / float16 / float64 weights against llm-compressor 0.14's: the
compat class and the registry's ``quantscope_imatrix_mse`` keep the weight's dtype in
``min_vals`` / ``max_vals`` and so in the scales, as llm-compressor's imatrix_mse (and
quantscope's MSE compat) do (docs/guide/pipelines.md: "same dtypes"). Values: float64 within
float32's rounding (quantscope searches in float32); half precision bit for bit (each
candidate priced in the dtype, as theirs, and the qparams of the range computed in it, the
asymmetric ones too). The MSE and min-max classes on half precision too, weights and
activations. Runs in the peers' venv."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiers import each_value

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
    # float64: float32's rounding; half: each candidate priced in the dtype, as theirs (FIELDS
    # are symmetric: the scales come from the range alone)
    return {"rtol": 1e-6} if dtype == torch.float64 else {"rtol": 0, "atol": 0}


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


#: the formats whose bfloat16 / float16 searches are llm-compressor's bit for bit
HALF_FIELDS = {
    "int4_ch_sym": {"num_bits": 4, "symmetric": True, "strategy": "channel"},
    "int4_ch_asym": {"num_bits": 4, "symmetric": False, "strategy": "channel"},
    "int8_ch_sym": {"num_bits": 8, "symmetric": True, "strategy": "channel"},
    "int4_g16_asym": {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 16},
    "int8_g16_sym": {"num_bits": 8, "symmetric": True, "strategy": "group", "group_size": 16},
    "fp8_ch": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
    "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
              "group_size": 16},
}


def _inputs(kind, g):
    """Calibration inputs of a kind of importance (None: no importance, the uniform search)."""
    return {"none": None,
            "rand": torch.randn(5, 64, generator=g) * torch.rand(64, generator=g) * 3,
            "some_zeros": torch.randn(7, 64, generator=g) * (torch.arange(64) % 3 != 0),
            "one_huge": torch.randn(4, 64, generator=g)
            * torch.where(torch.arange(64) == 5, 1e4, 1.0)}[kind]


def _half_case(name, fields, dtype, seed, kind):
    """(theirs, ours): each ``(min_vals, max_vals, qparams)`` for one weight."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(dtype)
    x = _inputs(kind, g)
    out = []
    for impl in (TheirObserver, lc.Observer):
        lin = torch.nn.Linear(64, 8, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obs = impl.load_from_registry(name, base_name="weight",
                                          args=QuantizationArgs(**fields))
            obs.attach(lin)
            if x is not None:
                with torch.no_grad():
                    lin(x.to(dtype))
            obs.detach(lin)
            obs(w)
        out.append((obs.min_vals, obs.max_vals, obs.get_qparams()))
    return out


def _assert_half_equal(theirs, ours, fields, dtype):
    """The searched ranges and the qparams, asymmetric ones too, bit for bit."""
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    for key, want in theirs[2].items():
        got = ours[2][key]
        assert (got is None) if want is None else torch.equal(got, want), key


@pytest.mark.parametrize(("dtype", "name", "layout", "kind"), each_value(
    [torch.bfloat16, torch.float16], ["imatrix_mse", "nvfp4_expanded_imatrix"], list(HALF_FIELDS),
    ["none", "rand", "some_zeros", "one_huge"]))
def test_half_imatrix_search_is_llmcompressors(dtype, name, layout, kind):
    """Each candidate priced as theirs, in the weight's dtype (compressed-tensors'
    ``calculate_qparams`` and ``fake_quantize``), the error summed in float32."""
    fields = HALF_FIELDS[layout]
    for seed in range(3):
        theirs, ours = _half_case(name, fields, dtype, seed, kind)
        _assert_half_equal(theirs, ours, fields, dtype)


@pytest.mark.parametrize(("dtype", "name", "layout"), each_value(
    [torch.bfloat16, torch.float16], ["memoryless_mse", "mse", "nvfp4_expanded_mse"],
    list(HALF_FIELDS)))
def test_half_mse_search_is_llmcompressors(dtype, name, layout):
    """memoryless_mse and its kin price in the dtype and sum the error in it, as theirs."""
    fields = HALF_FIELDS[layout]
    for seed in range(3):
        theirs, ours = _half_case(name, fields, dtype, seed, "none")
        _assert_half_equal(theirs, ours, fields, dtype)


#: asymmetric integer formats: compressed-tensors computes their scale ``(max - min) / range``
#: and zero point ``qmin - min / scale`` in the statistics' dtype, each operation rounded to it
ASYM_FIELDS = {
    "int4_g16": {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 16},
    "int8_ch": {"num_bits": 8, "symmetric": False, "strategy": "channel"},
    "int8_tensor": {"num_bits": 8, "symmetric": False, "strategy": "tensor"},
    "int4_tg16": {"num_bits": 4, "symmetric": False, "strategy": "tensor_group",
                  "group_size": 16},
}
WEIGHT_CLASSES = ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse",
                  "imatrix_mse"]


def _qparams(name, base_name, fields, values):
    """Each implementation's ``get_qparams()`` after observing ``values`` in turn."""
    out = []
    for impl in (TheirObserver, lc.Observer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obs = impl.load_from_registry(name, base_name=base_name,
                                          args=QuantizationArgs(**fields))
            for value in values:
                obs(value)
            out.append(obs.get_qparams())
    return out


def _assert_qparams_equal(theirs, ours):
    for key, want in theirs.items():
        got = ours[key]
        if want is None:
            assert got is None, key
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), (key, (got != want).sum().item())


@pytest.mark.parametrize("fields", list(ASYM_FIELDS.values()), ids=list(ASYM_FIELDS))
@pytest.mark.parametrize("name", WEIGHT_CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_asymmetric_weight_qparams_are_llmcompressors(dtype, name, fields):
    """The scale and zero point of an asymmetric range in the weight's dtype, bit for bit."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(32, 64, generator=g) * 0.05 + 0.01).to(dtype)
        _assert_qparams_equal(*_qparams(name, "weight", fields, [w]))


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("strategy,dynamic", [("token", True), ("tensor", False),
                                              ("tensor", True)])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_activation_qparams_are_llmcompressors(dtype, name, strategy, dynamic, symmetric):
    """Input observers over three batches (running statistics in the dtype), bit for bit."""
    fields = {"num_bits": 8, "symmetric": symmetric, "strategy": strategy, "dynamic": dynamic}
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(2, 8, 64, generator=g) * (0.3 * i + 0.3) + 0.2).to(dtype)
              for i in range(3)]
        _assert_qparams_equal(*_qparams(name, "input", fields, xs))


#: compressed-tensors' NVFP4 preset: fp8 block scales (``scale_dtype``) under the global scale
NVFP4_PRESET = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                "group_size": 16, "scale_dtype": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", WEIGHT_CLASSES + ["nvfp4_expanded_mse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_nvfp4_preset_qparams_are_llmcompressors(dtype, name):
    """Session 33: with the preset's fp8 ``scale_dtype`` the global scale was float32's
    ``2688 / amax`` (theirs: in the statistics' dtype, 13107.2 against 13120.0 on a bf16
    weight) and so were the block scales (theirs: the half amax / 6, times it): 19 of 512
    differed. Weights and three input batches, bit for bit."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(64, 128, generator=g) * 0.05 * (seed + 1)).to(dtype)
        _assert_qparams_equal(*_qparams(name, "weight", NVFP4_PRESET, [w]))
        if name in ("memoryless_minmax", "static_minmax", "minmax"):
            xs = [(torch.randn(2, 8, 64, generator=g) * (0.5 * i + 0.2)).to(dtype)
                  for i in range(3)]
            _assert_qparams_equal(*_qparams(name, "input", NVFP4_PRESET, xs))
