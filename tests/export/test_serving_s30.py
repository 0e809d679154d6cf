"""What vLLM serves of a compressed-tensors export: the export warns and `quantscope check`
reports a config group vLLM has no scheme for, and fused shards in config groups of different
schemes (vLLM gives the fused layer one scheme).

The expected verdicts come from vLLM's scheme choice
(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py,
``_get_scheme_from_parts``), not from quantscope's output."""

import json
import os
import warnings

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_models import mixtral, qwen2_moe

import quantscope
from quantscope import QuantSpec, Tensor, Tile, Token
from quantscope import presets as P
from quantscope.calibration import Recipe, Role, Rule, calibrate, preset
from quantscope.cli import main
from quantscope.exporters.consistency import check, format_problems
from quantscope.exporters.serving import vllm_moe_refusal, vllm_refusal

torch.set_num_threads(1)


def _args(type_, bits, strategy, dynamic=False, symmetric=True, **kw):
    return {"type": type_, "num_bits": bits, "strategy": strategy, "dynamic": dynamic,
            "symmetric": symmetric, **kw}


I8_CH, I8_T = _args("int", 8, "channel"), _args("int", 8, "tensor")
I8_TOK = _args("int", 8, "token", dynamic=True)
I4_G = _args("int", 4, "group", group_size=128)
F8_CH, F8_T = _args("float", 8, "channel"), _args("float", 8, "tensor")
F8_TOK = _args("float", 8, "token", dynamic=True)
F8_BLOCK = _args("float", 8, "block", block_structure=[128, 128])
NV = _args("float", 4, "tensor_group", group_size=16)
MX = _args("float", 4, "group", group_size=32)

#: (weights, input, format, vLLM's scheme or None where _get_scheme_from_parts raises)
VLLM = {
    "w8a8": (I8_CH, I8_T, "int-quantized", "W8A8Int8 (_is_static_tensor_w8a8)"),
    "w8a8-dynamic": (I8_CH, I8_TOK, "int-quantized", "W8A8Int8 (_is_dynamic_token_w8a8)"),
    "w4a16": (I4_G, None, "pack-quantized", "WNA16"),
    "w4a16-asym": (dict(I4_G, symmetric=False), None, "pack-quantized", "WNA16"),
    "int8 weight-only": (I8_CH, None, "pack-quantized", "WNA16"),
    "fp8": (F8_CH, F8_T, "float-quantized", "W8A8Fp8"),
    "fp8-dynamic": (F8_CH, F8_TOK, "float-quantized", "W8A8Fp8"),
    "fp8 block, dynamic input": (F8_BLOCK, F8_TOK, "float-quantized", "W8A8Fp8 block"),
    "nvfp4": (NV, dict(NV, dynamic="local"), "nvfp4-pack-quantized", "W4A4Fp4"),
    "mxfp4": (MX, dict(MX, dynamic=True), "mxfp4-pack-quantized", "MXFP4"),
    "w4a8, dynamic per-token input": (I4_G, I8_TOK, "int-quantized", "W4A8Int"),
    "w4a8, static per-tensor input": (I4_G, I8_T, "int-quantized", None),
    "fp8 block, static input": (F8_BLOCK, F8_T, "float-quantized", None),
    "int8 groups, static input": (_args("int", 8, "group", group_size=128), I8_T,
                                  "int-quantized", None),
    "int3 weight-only": (_args("int", 3, "channel"), None, "pack-quantized", None),
}


@pytest.mark.parametrize("name", sorted(VLLM))
def test_vllm_refusal_follows_vllms_scheme_choice(name):
    weights, inputs, fmt, scheme = VLLM[name]
    why = vllm_refusal(weights, inputs, fmt)
    assert (why is None) == (scheme is not None), (name, why)
    if scheme is None:
        assert why.startswith("vLLM serves ")


def test_refusals_name_what_vllm_needs():
    assert "dynamic per token" in vllm_refusal(I4_G, I8_T, "int-quantized")
    assert "w4a16" in vllm_refusal(I4_G, I8_T, "int-quantized")
    assert "dynamic" in vllm_refusal(F8_BLOCK, F8_T, "float-quantized")
    # vLLM's _is_wNa8o8_int: int weights with a static int8 input served with an int8 output
    assert vllm_refusal(I4_G, I8_T, "int-quantized", outputs=I8_T) is None


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=120,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [{"input_ids": torch.randint(0, 120, (2, 12))} for _ in range(2)]


def _recipe(weight, inp=None, name="custom"):
    return Recipe((Rule(("Linear",), weight=weight, input=inp),), ("lm_head",), name)


_FP8_TOKEN = QuantSpec("fp8_e4m3", Token())
# blocks of 64 rows: the tiny Llama's k_proj has 64, and vLLM's fused qkv_proj needs whole
# blocks of rows in every shard but the last (validate_fp8_block_shape; test_check_blocks_s42)
_FP8_TILE = QuantSpec("fp8_e4m3", Tile(64, 128))
#: recipe -> (recipe, whether vLLM serves its export: the rules above)
RECIPES = {
    **{name: (lambda n=name: preset(n, ignore=("lm_head",)), True) for name in
       ("w8a8", "w8a8-dynamic", "w4a16", "w4a16-asym", "fp8", "fp8-dynamic", "nvfp4",
        "mxfp4", "fp8-kv")},
    "w4a8": (lambda: preset("w4a8", ignore=("lm_head",)), False),
    "int8 weight-only": (lambda: _recipe(Role(P.INT8_PER_CHANNEL, "minmax")), True),
    "fp8 block, dynamic input": (lambda: _recipe(
        Role(_FP8_TILE, "minmax"), Role(_FP8_TOKEN, "memoryless_minmax", True)), True),
    "fp8 block, static input": (lambda: _recipe(
        Role(_FP8_TILE, "minmax"), Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")), False),
}


def _export(llama, recipe, path):
    model, batches = llama
    calib = calibrate(model, batches, recipe, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.export(calib, model, path, allow_lossy=True)  # (mxfp4's floor rule)
    return [str(w.message) for w in caught if "vLLM" in str(w.message)]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_export_warns_and_check_reports_only_what_vllm_cannot_serve(llama, tmp_path, name):
    make, served = RECIPES[name]
    out = str(tmp_path / "out")
    warned = _export(llama, make(), out)
    with open(os.path.join(out, "config.json")) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    assert len(groups) == 1  # one scheme for every Linear
    problems = check(out)
    if served:
        assert warned == [] and problems == []
        return
    assert len(warned) == 1
    assert "config group 'group_0' (1 target, first 'Linear')" in warned[0]
    assert "transformers and compressed-tensors load it" in warned[0]
    assert [(p["group"], p["tensor"], p["layers"]) for p in problems] == [
        ("group_0", "config", ["Linear"])]
    assert problems[0]["vllm"] in warned[0]
    assert "dynamic" in problems[0]["vllm"]


def test_check_flags_fused_shards_in_config_groups_of_different_schemes(llama, tmp_path,
                                                                       capsys):
    # q/v int4 g128, k int8 per channel: vLLM's qkv_proj takes q_proj's scheme
    # (_match_fused_layer) and k_proj's 8-bit weight does not load into it
    recipe = Recipe((Rule(("*.k_proj",), weight=Role(P.INT8_PER_CHANNEL, "minmax")),
                     Rule(("Linear",), weight=Role(P.INT4_GROUP128, "minmax"))),
                    ("lm_head",), "mixed-k")
    out = str(tmp_path / "out")
    assert _export(llama, recipe, out) == []  # each group alone is served (WNA16)
    attn = "model.layers.0.self_attn."
    problems = check(out)
    assert [(p["group"], p["tensor"]) for p in problems] == [(attn + "qkv_proj", "scheme")]
    schemes = problems[0]["schemes"]
    assert list(schemes) == [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    assert schemes[attn + "q_proj"] == schemes[attn + "v_proj"] != schemes[attn + "k_proj"]
    assert "different schemes" in format_problems(problems)
    assert main(["check", out]) == 1
    assert "qkv_proj" in capsys.readouterr().out


def _checkpoint(folder, groups, fmt="int-quantized"):
    """int8 q/k/v of one attention (no quantscope export), with ``groups``."""
    folder.mkdir()
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for shard in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{shard}"
        tensors[f"{name}.weight"] = torch.ones(8, 4, dtype=torch.int8)
        tensors[f"{name}.weight_scale"] = torch.full((8, 1), 0.5)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("k_target", ["model.layers.0.self_attn.k_proj", "re:.*k_proj$"])
def test_check_resolves_a_shard_by_name_or_pattern_before_class(tmp_path, k_target):
    tensor_args = dict(I8_CH, strategy="tensor")
    mixed = {"group_0": {"targets": ["Linear"], "weights": I8_CH, "input_activations": I8_T},
             "group_1": {"targets": [k_target], "weights": tensor_args,
                         "input_activations": I8_T}}
    problems = check(_checkpoint(tmp_path / "mixed", mixed))
    assert [(p["tensor"], p["schemes"]) for p in problems] == [("scheme", {
        "model.layers.0.self_attn.q_proj": "group_0",
        "model.layers.0.self_attn.k_proj": "group_1",
        "model.layers.0.self_attn.v_proj": "group_0"})]
    # two config groups of the same args are one scheme to vLLM
    same = {"group_0": dict(mixed["group_0"]), "group_1": dict(mixed["group_0"],
                                                               targets=[k_target])}
    assert check(_checkpoint(tmp_path / "same", same)) == []


# vLLM's fused MoE layer: CompressedTensorsMoEMethod.get_moe_method (compressed_tensors_moe.py)
# and the __init__ checks of the MoE method it reaches. (weights, input, format, the method or
# None where vLLM raises / asserts)
NV_IN = dict(NV, dynamic="local")
VLLM_MOE = {
    "w8a8-dynamic": (I8_CH, I8_TOK, "int-quantized", "W8A8Int8MoE"),
    "w8a8 (static input)": (I8_CH, I8_T, "int-quantized", None),  # Unsupported FusedMoe
    "int8 tensor weights, dynamic input": (I8_T, I8_TOK, "int-quantized", None),  # per_channel
    "fp8 tensor / tensor": (F8_T, F8_T, "float-quantized", "W8A8Fp8MoE per_tensor"),
    "fp8-dynamic": (F8_CH, F8_TOK, "float-quantized", "W8A8Fp8MoE per_channel"),
    "fp8 block, dynamic input": (F8_BLOCK, F8_TOK, "float-quantized", "W8A8Fp8MoE block"),
    "fp8 (channel, static tensor input)": (F8_CH, F8_T, "float-quantized", None),  # == BLOCK
    "fp8 tensor weights, token input": (F8_T, F8_TOK, "float-quantized", None),
    "w4a16": (I4_G, None, "pack-quantized", "WNA16 Marlin MoE"),
    "int4 channel weight-only": (_args("int", 4, "channel"), None, "pack-quantized",
                                 "WNA16 Marlin MoE"),
    "int8 weight-only": (I8_CH, None, "pack-quantized", "WNA16 Marlin MoE"),
    "w4a16, int-quantized format": (I4_G, None, "int-quantized", None),
    "int3 weight-only": (_args("int", 3, "channel"), None, "pack-quantized", None),
    "nvfp4": (NV, NV_IN, "nvfp4-pack-quantized", "W4A4Nvfp4MoE"),
    "nvfp4a16": (NV, None, "nvfp4-pack-quantized", "W4A4Nvfp4MoE use_a16"),
    "nvfp4 weights, fp8 input": (NV, F8_TOK, "nvfp4-pack-quantized", None),
    "mxfp4": (MX, dict(MX, dynamic=True), "mxfp4-pack-quantized", "W4A4Mxfp4MoE"),
}


@pytest.mark.parametrize("name", sorted(VLLM_MOE))
def test_vllm_moe_refusal_follows_vllms_fused_moe_method_choice(name):
    weights, inputs, fmt, method = VLLM_MOE[name]
    why = vllm_moe_refusal(weights, inputs, fmt)
    assert (why is None) == (method is not None), (name, why)
    assert vllm_moe_refusal(None, None, fmt) is None  # ignored experts: unquantized


def _moe_export(make, preset_name, path):
    model, batches = make()
    calib = calibrate(model, batches, preset_name, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.export(calib, model, path)
    return [str(w.message) for w in caught if "vLLM" in str(w.message)]


#: (tiny model, preset) -> what vLLM refuses of its export: "experts" (the fused MoE method),
#: "gate" (a quantized shared_expert_gate)
MOE_EXPORTS = {
    ("mixtral", "w8a8"): {"experts"},
    ("mixtral", "fp8"): {"experts"},
    ("qwen2_moe", "fp8"): {"experts", "gate"},
    ("qwen2_moe", "fp8-dynamic"): {"gate"},
    ("mixtral", "w8a8-dynamic"): set(),
    ("mixtral", "fp8-dynamic"): set(),
    ("mixtral", "nvfp4"): set(),
    ("mixtral", "w4a16"): set(),  # group 128: the tiny Mixtral's widths are 128
}


@pytest.mark.parametrize("model_name, preset_name", sorted(MOE_EXPORTS))
def test_export_warns_and_check_reports_what_vllms_moe_refuses(tmp_path, capsys, model_name,
                                                               preset_name):
    expected = MOE_EXPORTS[model_name, preset_name]
    out = str(tmp_path / "out")
    warned = _moe_export({"mixtral": mixtral, "qwen2_moe": qwen2_moe}[model_name], preset_name, out)
    problems = check(out)
    assert len(warned) == len(problems) == len(expected), (warned, problems)
    assert [(p["group"], p["tensor"], p["layers"]) for p in problems] == [
        ("group_0", "config", ["Linear"])] * len(expected)
    for why, warning in zip((p["vllm"] for p in problems), warned):
        assert why in warning and "config group 'group_0'" in warning
    text = format_problems(problems)
    if "experts" in expected:
        assert "MoE" in text and ".experts.0." in text and "dynamic" in text
    if "gate" in expected:
        assert "'model.layers.0.mlp.shared_expert_gate' and 1 more" in text
        assert "ignore=('re:.*shared_expert_gate$',)" in text
    assert main(["check", out]) == (1 if expected else 0)
    capsys.readouterr()


def test_shared_expert_gate_in_ignore_is_served(tmp_path):
    model, batches = qwen2_moe()
    calib = calibrate(model, batches, preset("fp8-dynamic", ignore=(
        "lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$")), progress=False)
    out = str(tmp_path / "out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.export(calib, model, out)
    assert [str(w.message) for w in caught if "vLLM" in str(w.message)] == []
    assert check(out) == []
