"""`quantscope check` compares fused shards' schemes by the fields vLLM's scheme choice reads.

vLLM gives a fused layer (qkv_proj, gate_up_proj) the config group of its first shard
(``_match_fused_layer``) and builds the scheme from ``_get_scheme_from_parts``
(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py), which reads
num_bits, type, symmetric, strategy, group_size, block_structure, dynamic, actorder and
scale_dtype of the weights and input activations, and the format -- never ``observer``,
``observer_kwargs`` or ``zp_dtype``. Groups that differ only there are one scheme: the other
shards load. vLLM builds compressed-tensors' ``QuantizationArgs`` from config.json, so an omitted
field is its default (num_bits 8, type int, symmetric True, dynamic False): leaving out a default
is no mismatch, while the scale dtype (MXFP8 or not), the group size (the scales' shape), the
type and dynamic weights are (a mutation round found no test pinning those).
"""

import json
import warnings
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import save_file

import quantscope
from quantscope.calibration import preset
from quantscope.cli import main
from quantscope.exporters.consistency import check

torch.set_num_threads(1)

ATTN = "model.layers.0.self_attn."
W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
      "observer": "minmax", "observer_kwargs": {}}
A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
      "observer": None}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
      "dynamic": False, "actorder": None}
FP8G = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
        "group_size": 32, "dynamic": False}
MX8 = dict(FP8G, scale_dtype="torch.uint8")


def _drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def _checkpoint(folder, q_weights, q_inputs=A8, kv_weights=W8, kv_inputs=A8,
                fmt="int-quantized"):
    """int8 q / k / v of one attention; q_proj in a config group of its own."""
    folder.mkdir()
    groups = {"group_0": {"targets": [ATTN + "q_proj"], "weights": q_weights,
                          "input_activations": q_inputs},
              "group_1": {"targets": [ATTN + "k_proj", ATTN + "v_proj"], "weights": kv_weights,
                          "input_activations": kv_inputs}}
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for shard in ("q_proj", "k_proj", "v_proj"):
        tensors[f"{ATTN}{shard}.weight"] = torch.ones(8, 256, dtype=torch.int8)
        tensors[f"{ATTN}{shard}.weight_scale"] = torch.full((8, 1), 0.5)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


#: q_proj's weights / input -> whether vLLM's qkv_proj gets another scheme than k's and v's
CASES = {
    "observer": (dict(W8, observer="mse"), A8, False),
    "observer_kwargs": (dict(W8, observer_kwargs={"maxshrink": 0.2}), A8, False),
    "zp_dtype": (dict(W8, zp_dtype="torch.int8"), A8, False),
    "input observer": (W8, dict(A8, observer="minmax"), False),
    "dynamic left to its default": ({k: v for k, v in W8.items() if k != "dynamic"}, A8, False),
    "num_bits": (dict(W8, num_bits=4), A8, True),
    "strategy": (dict(W8, strategy="tensor"), A8, True),
    "input symmetric": (W8, dict(A8, symmetric=False), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_compares_only_the_fields_vllm_reads(tmp_path, name):
    weights, inputs, differs = CASES[name]
    problems = check(_checkpoint(tmp_path / "ct", weights, inputs))
    assert [p["tensor"] for p in problems] == (["scheme"] if differs else []), problems
    if differs:
        assert problems[0]["schemes"] == {ATTN + "q_proj": "group_0",
                                          ATTN + "k_proj": "group_1",
                                          ATTN + "v_proj": "group_1"}


#: name -> (q's weights, k / v's weights, both inputs, format, whether qkv_proj's shards differ)
DEFAULT_CASES = {
    "scale_dtype: MXFP8 q, fp32-scale k / v": (MX8, FP8G, None, "float-quantized", True),
    "group_size": (dict(W4, group_size=64), W4, None, "pack-quantized", True),
    "type float": (dict(W8, type="float"), W8, A8, "float-quantized", True),
    "dynamic weights": (dict(W8, strategy="tensor", dynamic=True),
                        dict(W8, strategy="tensor"), A8, "int-quantized", True),
    "symmetric left to its default": (_drop(W8, "symmetric"), W8, A8, "int-quantized", False),
    "num_bits and type left to their defaults": (_drop(W8, "num_bits", "type"), W8, A8,
                                                 "int-quantized", False),
}


@pytest.mark.parametrize("name", sorted(DEFAULT_CASES))
def test_fused_shards_differ_by_the_fields_vllm_reads_defaults_included(tmp_path, name):
    q, kv, inputs, fmt, differs = DEFAULT_CASES[name]
    found = [p for p in check(_checkpoint(tmp_path / "ct", q, inputs, kv, inputs, fmt))
             if p["tensor"] == "scheme"]
    assert [p["group"] for p in found] == ([ATTN + "qkv_proj"] if differs else []), found


def test_export_of_groups_that_differ_in_the_observer_alone_checks_clean(tmp_path, capsys):
    # the probe's case: q_proj's weights calibrated with memoryless_mse, k / v with
    # memoryless_minmax, all else equal: two config groups, one scheme to vLLM
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]
    base = preset("w8a8-dynamic", "minmax", ignore=["lm_head"])
    q_rule = replace(base.rules[0], targets=("re:.*q_proj$",),
                     weight=replace(base.rules[0].weight, observer="memoryless_mse"))
    calib = quantscope.calibrate(model, batches, replace(base, rules=(q_rule, base.rules[0])),
                                 progress=False)
    out = str(tmp_path / "ct")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantscope.export(calib, model, out)
    with open(f"{out}/config.json") as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    assert sorted(g["weights"]["observer"] for g in groups.values()) == [
        "memoryless_minmax", "memoryless_mse"]
    assert check(out) == []
    assert main(["check", out]) == 0
    assert "agree" in capsys.readouterr().out


def test_a_target_two_groups_name_is_the_later_groups(tmp_path):
    """vLLM maps each target to one scheme, the last config group's that names it
    (``target_scheme_map[target] = ...``): k_proj named again by a later group of another
    scheme splits the fused qkv_proj, which vLLM refuses; ``check`` read the doubly named
    target as undecided and reported nothing."""
    folder = _checkpoint(tmp_path / "ct", W8)
    cfg = json.loads((folder / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_0"]["targets"] = [ATTN + s for s in ("q_proj", "k_proj", "v_proj")]
    groups["group_1"] = {"targets": [ATTN + "k_proj"], "weights": dict(W8, strategy="tensor"),
                         "input_activations": A8}
    (folder / "config.json").write_text(json.dumps(cfg))
    (problem,) = check(folder)
    assert problem["tensor"] == "scheme" and problem["schemes"] == {
        ATTN + "q_proj": "group_0", ATTN + "k_proj": "group_1", ATTN + "v_proj": "group_0"}
    groups["group_1"]["weights"] = W8  # the same scheme named twice: one scheme, no problem
    (folder / "config.json").write_text(json.dumps(cfg))
    assert check(folder) == []
