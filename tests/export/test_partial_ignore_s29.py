"""An ignore list that splits a fused group (q_proj float, k_proj / v_proj quantized): vLLM
refuses such a checkpoint ("different quantization schemes for the shards of qkv_proj"), so
`check` reports the group."""

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import quantscope
from quantscope.calibration import preset
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems

ATTN = "model.layers.{}.self_attn.{}"
LAYERS = 2


def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]


def calibrate(model, name, ignore):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib = quantscope.calibrate(model, batches(), preset(name, ignore=ignore),
                                     progress=False)
    return calib, [w for w in caught if "fusion group" in str(w.message)]


def ignored(model, pattern):
    return [n for n, _ in model.named_modules() if re.match(pattern, n)]


@pytest.mark.parametrize("name", ["w8a8", "fp8", "nvfp4"])
def test_check_reports_a_split_fused_group(tmp_path, name):
    model = llama()
    calib, _ = calibrate(model, name, ["re:.*q_proj$", "lm_head"])
    calib.export(model, tmp_path / "e")
    problems = [p for p in check(tmp_path / "e") if p.get("float")]
    floats = ignored(model, r".*q_proj$")
    assert len(floats) == LAYERS
    assert [p["group"] for p in problems] == [ATTN.format(i, "qkv_proj") for i in range(LAYERS)]
    assert [p["float"] for p in problems] == [[f] for f in floats]
    assert [p["layers"] for p in problems] == [
        [ATTN.format(i, s) for s in ("q_proj", "k_proj", "v_proj")] for i in range(LAYERS)]
    text = format_problems(problems)
    assert f"{floats[0]} float" in text and "vLLM refuses" in text


@pytest.mark.parametrize("ignore", [["re:.*[qkv]_proj$", "lm_head"],  # every member: float
                                    ["lm_head"]])  # none
def test_whole_groups_are_not_reported_or_warned(tmp_path, ignore):
    model = llama()
    calib, warned = calibrate(model, "w8a8", ignore)
    assert warned == []
    calib.export(model, tmp_path / "e")
    assert check(tmp_path / "e") == []


def test_check_reads_float_shards_of_a_handmade_checkpoint(tmp_path):
    t = {}
    for s in ("q_proj", "k_proj", "v_proj"):
        layer = ATTN.format(0, s)
        if s == "v_proj":  # float: an ignored shard holds its weight only
            t[f"{layer}.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
        else:
            t[f"{layer}.weight"] = torch.zeros(8, 8).to(torch.float8_e4m3fn)
            t[f"{layer}.weight_scale"] = torch.tensor([0.5])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
        "quantization_config": {"quant_method": "compressed-tensors", "format":
                                "float-quantized", "config_groups": {}}}))
    save_file(t, str(tmp_path / "model.safetensors"))
    problems = check(tmp_path)
    assert [(p["group"], p["float"]) for p in problems] == [
        (ATTN.format(0, "qkv_proj"), [ATTN.format(0, "v_proj")])]
