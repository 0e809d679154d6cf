"""Differential: our compressed-tensors export against the checkpoint llm-compressor writes
with the same scales.

llm-compressor's own path: its ``QuantizationModifier`` attaches the scheme (its preset, or
a config group for the static schemes it has no preset for), the module parameters are set
to quantscope's qparams, and its ``save_pretrained`` wrapper compresses and writes. Every
tensor of the two folders must be equal, name, dtype and bits, and the quantization configs
equal but for the observer names (ours record the observer that chose the range). Runs in
the peers' venv (``make test``: PEER_TESTS).
"""

import copy
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")

import tiny_models

import quantscope
from quantscope import QuantSpec, Tensor
from quantscope import presets as P
from quantscope.calibration import Recipe, Role, Rule, calibrate, preset
from quantscope.scales import nvfp4_global_scale

pytestmark = pytest.mark.peers
torch.set_num_threads(1)

_INT8_STATIC = {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor",
                          "symmetric": True, "dynamic": False}}}
_FP8_CHANNEL_STATIC = {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                          "symmetric": True, "dynamic": False}}}
_MX_EVEN = QuantSpec("fp4_e2m1", P.MXFP4.layout, scale="e8m0:even")


def _fp8_tensor():
    return Recipe((Rule(("Linear",), weight=Role(P.FP8_PER_TENSOR, "memoryless_minmax"),
                        input=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),), (), "fp8t")


def _mxfp4():
    return Recipe((Rule(("Linear",), weight=Role(P.MXFP4, "memoryless_minmax"),
                        input=Role(_MX_EVEN, "memoryless_minmax", True)),), (), "mxfp4")


#: our recipe -> llm-compressor's scheme (a preset name, or config groups)
CASES = {
    "w8a8": (lambda: preset("w8a8"), {"config_groups": _INT8_STATIC}),
    "w8a8-dynamic": (lambda: preset("w8a8-dynamic"), {"scheme": "W8A8"}),
    "w4a16": (lambda: preset("w4a16"), {"scheme": "W4A16"}),
    "w4a16-asym": (lambda: preset("w4a16-asym"), {"scheme": "W4A16_ASYM"}),
    "fp8-tensor": (_fp8_tensor, {"scheme": "FP8"}),
    "fp8-channel": (lambda: preset("fp8"), {"config_groups": _FP8_CHANNEL_STATIC}),
    "fp8-dynamic": (lambda: preset("fp8-dynamic"), {"scheme": "FP8_DYNAMIC"}),
    "nvfp4": (lambda: preset("nvfp4"), {"scheme": "NVFP4"}),
    "mxfp4": (_mxfp4, {"scheme": "MXFP4"}),
}


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=120,
                                  max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    batches = [{"input_ids": torch.randint(0, 120, (2, 12))} for _ in range(3)]
    return model, batches


def _llm_compressor_checkpoint(model, calibration, scheme_kw, path):
    """llm-compressor attaches its scheme, takes our qparams, and saves as it saves."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.transformers.compression.compressed_tensors_utils import (
        modify_save_pretrained,
    )

    model = copy.deepcopy(model)
    QuantizationModifier(targets=["Linear"], **scheme_kw).initialize_quantization(model)
    with torch.no_grad():
        for layer, roles in calibration.states.items():
            module = model.get_submodule(layer)
            for role, st in roles.items():
                values = {}
                if st.dynamic == "local":
                    values["global_scale"] = nvfp4_global_scale(st.global_amax, st.spec.format)
                elif st.qparams is not None:
                    values = {"scale": st.qparams.scale, "zero_point": st.qparams.zero_point,
                              "global_scale": st.qparams.global_scale}
                for name, v in values.items():
                    base = {"key": "k", "value": "v"}.get(role, role)  # k_scale, v_scale
                    p = getattr(module, f"{base}_{name}", None)
                    if v is not None and p is not None:
                        p.data = v.reshape(p.shape).to(p.dtype)
    modify_save_pretrained(model)
    model.save_pretrained(path)
    return path


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _groups(path):
    qc = _config(path)["quantization_config"]
    groups = qc["config_groups"]
    for g in groups.values():
        for role in ("weights", "input_activations", "output_activations"):
            if g.get(role):
                g[role].pop("observer", None)
    return qc["format"], qc["quantization_status"], groups, qc["ignore"]


@pytest.mark.parametrize("name", list(CASES))
def test_export_equals_what_llm_compressor_writes(bert, tmp_path, name):
    model, batches = bert
    make, scheme_kw = CASES[name]
    cal = calibrate(model, batches, make(), progress=False)
    ours = quantscope.export(cal, model, tmp_path / "ours")
    theirs = _llm_compressor_checkpoint(model, cal, scheme_kw, str(tmp_path / "theirs"))
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]), k
    assert _groups(ours) == _groups(theirs)


@pytest.mark.parametrize("name", ["w8a8", "w4a16-asym"])
def test_llm_compressor_transformers_loads_our_export(bert, tmp_path, name):
    """The peers' transformers (5.17, compressed-tensors 0.19) runs our export as the QDQ
    model, to the bit; asymmetric int4 too (.venv's transformers 5.24 with
    compressed-tensors 0.20 builds the packed zero point unpacked and refuses it)."""
    model, batches = bert
    cal = calibrate(model, batches, CASES[name][0](), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ours")
    with torch.inference_mode():
        with cal.apply(model):
            ref = model(**batches[0]).last_hidden_state
        got = transformers.AutoModel.from_pretrained(out).eval()(**batches[0]).last_hidden_state
    assert torch.equal(got, ref)


_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
       "symmetric": True}


@pytest.fixture(scope="module")
def llama():
    return tiny_models.llama()


def test_kv_cache_export_equals_llm_compressor_and_loads_quantized(llama, tmp_path):
    """The KV cache: the same k_scale / v_scale tensors and kv_cache_scheme as llm-compressor
    writes; and the peers' transformers (5.17 with compressed-tensors 0.19, which still hooks
    cached attention) runs our export with its KV cache quantized, equal to apply()."""
    model, batches = llama
    cal = calibrate(model, batches, preset("fp8-kv", ignore="lm_head"), progress=False)
    ours = quantscope.export(cal, model, tmp_path / "ours")
    theirs = _llm_compressor_checkpoint(
        model, cal, {"config_groups": _FP8_CHANNEL_STATIC, "ignore": ["lm_head"],
                     "kv_cache_scheme": _KV}, str(tmp_path / "theirs"))
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b) and "model.layers.1.self_attn.v_scale" in a
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]), k
    kv = [_config(p)["quantization_config"]["kv_cache_scheme"] for p in (ours, theirs)]
    for scheme in kv:
        scheme.pop("observer")
    assert kv[0] == {k: v for k, v in kv[1].items() if k in kv[0]}
    x = batches[0]
    with torch.inference_mode():
        got = transformers.AutoModelForCausalLM.from_pretrained(ours).eval()(x).logits
        with cal.apply(model):
            ref = model(x).logits
    assert torch.equal(got, ref)


def test_bf16_kv_cache_scales_load_as_written(llama, tmp_path):
    """The peers' transformers (5.17, compressed-tensors 0.19) loads a bf16 model's k_scale /
    v_scale into bf16 parameters (``initialize_attn_qparams``): the float32 values bf16 cannot
    hold, which the export wrote without a word (found by probing), ran rounded. Now they are
    refused, or under allow_lossy written rounded to bf16: what loads is what was written."""
    model = copy.deepcopy(llama[0]).to(torch.bfloat16)
    cal = calibrate(model, llama[1], Recipe((), kv_cache="fp8"), progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    stored = _tensors(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    for layer, roles in cal.states.items():
        for role, key in (("key", "k_scale"), ("value", "v_scale")):
            got = getattr(loaded.get_submodule(layer), key).detach().reshape(1)
            assert got.dtype == torch.bfloat16, (layer, key)
            assert torch.equal(got.float(), stored[f"{layer}.{key}"].float()), (layer, key)
            want = roles[role].qparams.scale.reshape(1).to(torch.bfloat16)
            assert torch.equal(stored[f"{layer}.{key}"], want), (layer, key)
    assert any("_scale not exact in torch.bfloat16" in str(w.message) for w in caught)
