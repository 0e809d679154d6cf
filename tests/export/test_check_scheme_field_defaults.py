"""`quantscope check` compares fused shards' config groups by what vLLM's scheme choice reads,
an omitted field as compressed-tensors' default.

vLLM gives qkv_proj the first shard's (q_proj's) config group; a field that picks another scheme
or other weight tensors for q than k / v were written with is a scheme mismatch: the scale
dtype (MXFP8 or not), the group size (the scales' shape), the type, dynamic weights. vLLM
builds compressed-tensors' ``QuantizationArgs`` from config.json, so an omitted field is its
default (num_bits 8, type int, symmetric True, dynamic False) and leaving out a default is no
mismatch. A mutation round found no test failing where one of these fields was dropped from the
comparison or a default changed (test_check_scheme_fields_s42.py covers the others).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from quantscope.exporters.consistency import check

torch.set_num_threads(1)

ATTN = "model.layers.0.self_attn."
W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
      "dynamic": False, "actorder": None}
FP8G = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
        "group_size": 32, "dynamic": False}
MX8 = dict(FP8G, scale_dtype="torch.uint8")


def _drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def _checkpoint(folder, q, kv, inputs, fmt):
    """q_proj in a config group of its own, k / v in another."""
    folder.mkdir()
    groups = {"group_0": {"targets": [ATTN + "q_proj"], "weights": q, "input_activations": inputs},
              "group_1": {"targets": [ATTN + "k_proj", ATTN + "v_proj"], "weights": kv,
                          "input_activations": inputs}}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}}))
    tensors = {}
    for shard in ("q_proj", "k_proj", "v_proj"):
        tensors[f"{ATTN}{shard}.weight"] = torch.ones(8, 256, dtype=torch.int8)
        tensors[f"{ATTN}{shard}.weight_scale"] = torch.full((8, 1), 0.5)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


#: name -> (q's weights, k / v's weights, inputs, format, whether qkv_proj's shards differ)
CASES = {
    "scale_dtype: MXFP8 q, fp32-scale k / v": (MX8, FP8G, None, "float-quantized", True),
    "group_size": (dict(W4, group_size=64), W4, None, "pack-quantized", True),
    "type float": (dict(W8, type="float"), W8, A8, "float-quantized", True),
    "dynamic weights": (dict(W8, strategy="tensor", dynamic=True),
                        dict(W8, strategy="tensor"), A8, "int-quantized", True),
    "symmetric left to its default": (_drop(W8, "symmetric"), W8, A8, "int-quantized", False),
    "num_bits and type left to their defaults": (_drop(W8, "num_bits", "type"), W8, A8,
                                                 "int-quantized", False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_shards_differ_by_the_fields_vllm_reads(tmp_path, name):
    q, kv, inputs, fmt, differs = CASES[name]
    found = [p for p in check(_checkpoint(tmp_path / "ct", q, kv, inputs, fmt))
             if p["tensor"] == "scheme"]
    assert [p["group"] for p in found] == ([ATTN + "qkv_proj"] if differs else []), found
