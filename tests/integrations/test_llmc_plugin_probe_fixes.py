"""Probe fixes of the llm-compressor plugin (``observer: quantscope_<name>``): bfloat16 MXFP4
scales as searched, one NVFP4 global scale for a fusion group mixing quantscope's and
llm-compressor's observers, and ``expand`` of the wrong type named. Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import generate_gparam
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.observers import Observer
from llmcompressor.observers.fusion import FusionHandler
from test_integrations_llmcompressor import _llama, _loader, _tokenizer

import quantscope
import quantscope.integrations.llmcompressor as qsl
from quantscope.compat.llmcompressor import llmcompressor_spec

torch.set_num_threads(1)

MXFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
         "group_size": 32, "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16, "scale_dtype": torch.float8_e4m3fn, "zp_dtype": torch.float8_e4m3fn}


def _observer(name, args):
    return Observer.load_from_registry(name, base_name="weight", args=args.model_copy())


@pytest.mark.parametrize("name", ["mse", "memoryless_mse"])
def test_mxfp4_bfloat16_scales_are_the_searched_ones(name):
    # a searched range of 1.7475 handed over in bfloat16 read 1.75, past compressed-tensors'
    # power-of-two rounding boundary: 2 of these 256 block scales were twice the searched
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 2).bfloat16()
    args = QuantizationArgs(**MXFP4)
    obs = _observer("quantscope_" + name, args)
    obs(w)
    got = obs.get_qparams()["scale"]
    native = quantscope.get_observer(name, llmcompressor_spec(args, "weight"))
    native(w)
    want = native.qparams().scale.float().reshape(got.shape)
    assert torch.equal(got.float(), want)
    # the scale keeps llm-compressor's own dtype (its GPTQ rounds in it)
    own = _observer("memoryless_minmax", args)
    own(w)
    assert got.dtype == own.get_qparams()["scale"].dtype == torch.bfloat16


def test_mxfp4_bfloat16_imatrix_fallback_scales_are_the_searched_ones():
    # quantscope_imatrix_mse without importance runs memoryless_mse's search: the same
    # hand-over (2 of 256 block scales doubled on this grid before)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 2).bfloat16()
    args = QuantizationArgs(**MXFP4, observer_kwargs={"grid": 100, "maxshrink": 0.2})
    obs = _observer("quantscope_imatrix_mse", args)
    with pytest.warns(UserWarning, match="Falling back to uniform MSE"):
        obs(w)
    got = obs.get_qparams()["scale"]
    options = {k: v for k, v in obs._uniform_options.items() if v is not None}
    native = quantscope.get_observer("memoryless_mse", qsl.units_spec(args, "weight"), **options)
    native(w.reshape(-1, 32))
    assert torch.equal(got.float(), native.qparams().scale.float().reshape(got.shape))
    assert got.dtype == torch.bfloat16


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_fusion_group_shares_one_global_scale(seed):
    # q by quantscope_mse (its searched global amax), k / v by llm-compressor's own observer:
    # each computed the group's global scale by its own rule (183.7 / 218.5 / 218.5)
    g = torch.Generator().manual_seed(seed)
    mods = [torch.nn.Linear(64, 32, bias=False) for _ in range(3)]
    for i, m in enumerate(mods):
        m.weight.data = torch.randn(32, 64, generator=g) * (3.0 if i == 0 else 1.0)
    args = QuantizationArgs(**NVFP4)
    obs = [_observer(n, args) for n in ("quantscope_mse", "memoryless_minmax",
                                       "memoryless_minmax")]
    FusionHandler.fuse(zip(obs, mods))
    obs[0](mods[0].weight)
    amax = obs[0].quantscope.global_amax().reshape(())
    scales = [o.get_qparams()["global_scale"] for o in obs]
    assert all(torch.equal(s, scales[0]) for s in scales)
    k_v = max(m.weight.abs().max() for m in mods[1:])
    top = torch.maximum(amax, k_v).reshape(1)  # llm-compressor's rule over the group
    assert torch.equal(scales[0], generate_gparam(-top, top))


def test_mixed_fusion_group_oneshot(tmp_path):
    model = _llama(tmp_path).from_pretrained(tmp_path)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(3.0)  # q holds the largest
    recipe = QuantizationModifier(config_groups={
        "q": QuantizationScheme(targets=["re:.*q_proj$"],
                                weights=QuantizationArgs(**NVFP4, observer="quantscope_mse")),
        "kv": QuantizationScheme(targets=["re:.*(k|v)_proj$"],
                                 weights=QuantizationArgs(**NVFP4, observer="memoryless_minmax"))},
        ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, dataset=_loader(), processor=_tokenizer())
    attn = model.model.layers[0].self_attn
    scales = [getattr(attn, p).weight_global_scale for p in ("q_proj", "k_proj", "v_proj")]
    assert all(torch.equal(s, scales[0]) for s in scales), scales


@pytest.mark.parametrize("expand", ["1.5", float("nan"), True])
def test_expand_of_the_wrong_type_is_named(expand):
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel",
                            observer_kwargs={"expand": expand})
    with pytest.raises(ValueError, match=r"quantscope_mse for weights \{.*\} with observer_kwargs "
                                         r"\{'expand': .*\}: llm-compressor's MSE search: "
                                         r"expand must be a finite number in \[1\.0, inf\)"):
        _observer("quantscope_mse", args)


@pytest.mark.parametrize("name", ["quantscope_static_minmax", "quantscope_histogram",
                                  "quantscope_mse", "quantscope_imatrix_mse"])
def test_a_complex_tensor_is_refused_not_read_as_its_real_part(name):
    # probe s32: the cast to float32 dropped the imaginary part and a scale came back
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    x = torch.complex(torch.randn(4, 16), 10 * torch.randn(4, 16))
    with pytest.raises(TypeError, match="expected a real tensor .* got torch.complex64"):
        Observer.load_from_registry(name, base_name="input", args=args.model_copy())(x)


def test_the_compat_mse_refuses_a_complex_tensor_as_llm_compressors():
    # it searched the real part; llm-compressor's min / max of complex data raise
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    x = torch.complex(torch.randn(4, 16), torch.randn(4, 16))
    for make in (lambda: Observer.load_from_registry("memoryless_mse", base_name="input",
                                                     args=args.model_copy()),
                 lambda: quantscope.compat.llmcompressor.MemorylessMSEObserver(
                     base_name="input", args=args.model_copy())):
        with pytest.raises(NotImplementedError):
            make()(x)


_SEQUENCES = {
    "fp32->bf16": (torch.float32, torch.bfloat16), "bf16->fp32": (torch.bfloat16, torch.float32),
    "fp16->bf16": (torch.float16, torch.bfloat16), "int->fp16": (torch.int64, torch.float16)}


@pytest.mark.parametrize("sequence", list(_SEQUENCES))
@pytest.mark.parametrize("args", [
    {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"},
    {"num_bits": 8, "type": "float", "strategy": "tensor"},
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
     "dynamic": "local"}], ids=["int8-asym", "fp8", "nvfp4"])
def test_static_minmax_of_batches_in_mixed_dtypes_is_theirs(args, sequence):
    # probe s40: the plugin kept the last batch's dtype, where theirs promotes the running
    # range (torch.min / max): a float32 batch then a bfloat16 one gave bfloat16 scales
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 4, 32, generator=g) * 3 if dt.is_floating_point
               else torch.randint(-9, 9, (2, 4, 32), generator=g) for dt in _SEQUENCES[sequence]]
    batches = [b.to(dt) for b, dt in zip(batches, _SEQUENCES[sequence])]
    got = {}
    for name in ("static_minmax", "quantscope_static_minmax"):
        obs = Observer.load_from_registry(name, base_name="input", args=QuantizationArgs(**args))
        for b in batches:
            obs(b)
        got[name] = obs.get_qparams()
    theirs, ours = got["static_minmax"], got["quantscope_static_minmax"]
    _same_qparams(theirs, ours)


@pytest.mark.parametrize("sequence", ["fp32->bf16", "bf16->fp32"])
def test_memoryless_minmax_keeps_the_last_batchs_dtype(sequence):
    # a memoryless range is the last batch's alone: its dtype too, as theirs
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, 32, generator=g) * 3).to(dt) for dt in _SEQUENCES[sequence]]
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    got = {}
    for name in ("memoryless_minmax", "quantscope_memoryless_minmax"):
        obs = Observer.load_from_registry(name, base_name="input", args=args)
        for b in batches:
            obs(b)
        got[name] = obs.get_qparams()
    _same_qparams(got["memoryless_minmax"], got["quantscope_memoryless_minmax"])


def _same_qparams(theirs, ours):
    for key in ("scale", "zero_point", "global_scale"):
        if theirs[key] is None:
            assert ours[key] is None
        else:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key])
