"""vLLM's serving rules read a config group's args as compressed-tensors' ``QuantizationArgs``
holds them: an omitted field is its default.

vLLM builds ``QuantizationArgs`` of each group's ``weights`` / ``input_activations`` from
config.json (``_quantization_scheme_map_from_config``), so an omitted ``symmetric`` is True,
``dynamic`` False, ``num_bits`` 8, ``type`` int, and an omitted ``strategy`` is inferred from
``group_size`` (none: tensor; > 0: group; -1: channel). The rules read ``symmetric`` raw, so a
W8A8 group that left it out (or W4A16 experts, fp8 channel weights) was reported unservable,
by the export's warning and by `quantscope check` (probe s43). The reference here is
compressed-tensors itself: each group gets the verdict of the args it parses them into.
"""

import json
from enum import Enum

import pytest
import torch
from safetensors.torch import save_file

from quantscope.exporters.consistency import check
from quantscope.exporters.serving import (
    SCHEME_FIELDS,
    scheme_args,
    vllm_embedding_refusal,
    vllm_moe_refusal,
    vllm_refusal,
)

torch.set_num_threads(1)

W8 = {"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": False}
A8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
FP8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}

#: name -> (weights, input activations, format): fields left to compressed-tensors' defaults
CASES = {
    "w8a8 per channel / token": (W8, A8, "int-quantized"),
    "w8a8 static per tensor, strategy inferred": ({"num_bits": 8}, {"dynamic": False},
                                                  "int-quantized"),
    "w4a16 (group inferred from group_size)": ({"num_bits": 4, "group_size": 128}, None,
                                                "pack-quantized"),
    "w4a16 per channel (group_size -1)": ({"num_bits": 4, "group_size": -1}, None,
                                          "pack-quantized"),
    "w4a8 int": (W4, A8, "int-quantized"),
    "fp8 channel weights, dynamic token input": (FP8, FP8_TOKEN, "float-quantized"),
    "fp8 blocks": (dict(FP8, strategy="block", block_structure=[128, 128]), FP8_TOKEN,
                   "float-quantized"),
    "mxfp8": (dict(FP8, strategy="group", group_size=32, scale_dtype="torch.uint8"), None,
              "float-quantized"),
    "nvfp4": (NVFP4, dict(NVFP4, dynamic="local"), "nvfp4-pack-quantized"),
    "asymmetric int8 weights": (dict(W8, symmetric=False), A8, "int-quantized"),
}


def test_omitted_symmetric_is_symmetric():
    # what the probe saw: each of these is served, as with symmetric: true written out
    assert vllm_refusal(W8, A8, "int-quantized") is None
    assert vllm_refusal({"num_bits": 8}, {"dynamic": False}, "int-quantized") is None
    assert vllm_refusal(FP8, FP8_TOKEN, "float-quantized") is None
    assert vllm_moe_refusal(W4, None, "pack-quantized") is None
    assert vllm_moe_refusal(W8, A8, "int-quantized") is None
    assert vllm_refusal(dict(W8, symmetric=False), A8, "int-quantized") is not None


def _symmetric(args):
    return None if args is None else dict(args, symmetric=True)


FP8_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor"}
#: name -> (rule, weights, input activations, format, a part of its verdict), none of them
#: writing ``symmetric`` out
OMITTED = {
    "int4 group weights, a static per-tensor int8 input": (
        vllm_refusal, {"num_bits": 4, "group_size": 128}, {"num_bits": 8}, "int-quantized",
        "a static symmetric per-tensor int8 input"),
    "fp8 per-tensor experts, a dynamic per-token input": (
        vllm_moe_refusal, FP8_TENSOR, FP8_TOKEN, "float-quantized",
        "tensor weights only with a per-tensor input"),
    "a packed int4 group embedding": (
        vllm_embedding_refusal, {"num_bits": 4, "group_size": 128}, None, "pack-quantized",
        "only with its CompressedTensorsEmbeddingWNA16Int"),
    "fp8 blocks, a static per-tensor input": (
        vllm_refusal, dict(FP8, strategy="block", block_structure=[128, 128]), FP8_TENSOR,
        "float-quantized", "only with a dynamic input"),
}


@pytest.mark.parametrize("name", sorted(OMITTED))
def test_an_omitted_symmetric_gets_the_verdict_of_symmetric_true(name):
    # each verdict (a refusal, or its message) is the one of the same args written out
    rule, weights, inputs, fmt, part = OMITTED[name]
    why = rule(weights, inputs, fmt)
    assert why == rule(_symmetric(weights), _symmetric(inputs), fmt)
    assert part in why, why


def test_group_size_zero_infers_no_strategy_and_is_not_served():
    # compressed-tensors refuses it ("Use group_size > 0 for strategy='group'")
    assert scheme_args({"num_bits": 4, "group_size": 0})["strategy"] is None
    assert vllm_refusal({"num_bits": 4, "group_size": 0}, None, "pack-quantized") is not None


def test_check_of_a_w8a8_group_that_leaves_symmetric_out(tmp_path):
    folder = tmp_path / "ct"
    folder.mkdir()
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": W8, "input_activations": A8}}}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "quantization_config": qc}))
    save_file({"model.layers.0.mlp.down_proj.weight": torch.ones(8, 4, dtype=torch.int8),
               "model.layers.0.mlp.down_proj.weight_scale": torch.full((8, 1), 0.5)},
              str(folder / "model.safetensors"))
    assert check(folder) == []


def _fp8_qkv(folder, weights):
    """fp8 q / k / v of one attention in one group, one row of 64 columns each, whose scales
    ([1, 1]) differ: 0.5, 1.5, 2.5."""
    folder.mkdir()
    groups = {"group_0": {"targets": ["Linear"], "weights": weights,
                          "input_activations": FP8_TOKEN}}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": groups}}))
    attn = "model.layers.0.self_attn."
    tensors = {}
    for i, shard in enumerate(("q_proj", "k_proj", "v_proj")):
        tensors[f"{attn}{shard}.weight"] = torch.zeros(1, 64).to(torch.float8_e4m3fn)
        tensors[f"{attn}{shard}.weight_scale"] = torch.full((1, 1), 0.5 + i)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_check_of_fp8_channel_weights_whose_strategy_group_size_infers(tmp_path):
    # vLLM keeps each fused shard's channel scales (one per row): nothing to report, as with
    # strategy: channel written out; per-tensor shards' scales differing are reported
    inferred = {"num_bits": 8, "type": "float", "group_size": -1}
    assert check(_fp8_qkv(tmp_path / "inferred", inferred)) == []
    assert check(_fp8_qkv(tmp_path / "written", dict(inferred, strategy="channel"))) == []
    found = check(_fp8_qkv(tmp_path / "tensor", FP8_TENSOR))
    assert [p["tensor"] for p in found] == ["weight_scale"]


def _parsed(args):
    """``args`` as compressed-tensors parses them, every field written out."""
    from compressed_tensors.quantization import QuantizationArgs

    if args is None:
        return None
    q = QuantizationArgs(**args)
    out = {}
    for field in SCHEME_FIELDS:
        value = getattr(q, field)
        if isinstance(value, Enum):
            value = value.value
        elif isinstance(value, torch.dtype):
            value = str(value)
        if value is not None:
            out[field] = value
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_verdicts_are_those_of_the_args_compressed_tensors_parses(name):
    pytest.importorskip("compressed_tensors")
    weights, inputs, fmt = CASES[name]
    w, a = _parsed(weights), _parsed(inputs)
    assert scheme_args(weights) == scheme_args(w)
    assert scheme_args(inputs) == scheme_args(a)
    assert vllm_refusal(weights, inputs, fmt) == vllm_refusal(w, a, fmt)
    assert vllm_moe_refusal(weights, inputs, fmt) == vllm_moe_refusal(w, a, fmt)
