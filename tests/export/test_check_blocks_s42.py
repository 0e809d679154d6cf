"""fp8 weight blocks that straddle the shards of a fused layer: vLLM refuses them at load.

vLLM builds ``qkv_proj`` / ``gate_up_proj`` as one merged layer with the first shard's scheme;
CompressedTensorsW8A8Fp8.create_weights calls ``validate_fp8_block_shape``
(vllm/model_executor/layers/quantization/utils/fp8_utils.py), which at tensor parallelism 1
checks ``output_partition_sizes[:-1]`` -- every shard but the last -- for multiples of
``block_n = block_structure[0]`` and raises "Weight output_partition_size = 64 is not divisible
by weight quantization block_n = 128". The expected verdicts below apply that rule by hand.
"""

import json
import warnings

import pytest
import torch
import transformers
from safetensors.torch import save_file

import quantscope
from quantscope.calibration import recipe as R
from quantscope.cli import main
from quantscope.exporters.consistency import check, format_problems

torch.set_num_threads(1)

ATTN, MLP = "model.layers.0.self_attn.", "model.layers.0.mlp."


def _fp8(strategy="block", block=(128, 128)):
    args = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
            "dynamic": False}
    return dict(args, block_structure=list(block)) if strategy == "block" else args


_TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
          "dynamic": True}


def _checkpoint(folder, rows, groups):
    """fp8 weights of 64 columns, ``rows``: shard -> output rows (a full path each)."""
    folder.mkdir()
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": groups}}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for layer, n in rows.items():
        tensors[f"{layer}.weight"] = torch.zeros(n, 64).to(torch.float8_e4m3fn)
        tensors[f"{layer}.weight_scale"] = torch.ones(-(-n // 64), 1)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _one_group(weights):
    return {"group_0": {"targets": ["Linear"], "weights": weights,
                        "input_activations": _TOKEN}}


QKV = {ATTN + "q_proj": 128, ATTN + "k_proj": 64, ATTN + "v_proj": 64}
#: name -> (shard rows, config groups, {fused layer: {shard: rows}} vLLM refuses)
CASES = {
    "k_proj of 64 rows, blocks of 128": (QKV, _one_group(_fp8()),
                                         {ATTN + "qkv_proj": {ATTN + "k_proj": 64}}),
    "gate_proj of 192 rows": ({MLP + "gate_proj": 192, MLP + "up_proj": 256},
                              _one_group(_fp8()),
                              {MLP + "gate_up_proj": {MLP + "gate_proj": 192}}),
    "only the last shard partial": ({ATTN + "q_proj": 128, ATTN + "k_proj": 128,
                                     ATTN + "v_proj": 64}, _one_group(_fp8()), {}),
    "blocks of 64 rows": (QKV, _one_group(_fp8(block=(64, 128))), {}),
    "per-channel weights": (QKV, _one_group(_fp8("channel")), {}),
    # compressed-tensors reads a strategy case-insensitively
    "an upper-case BLOCK strategy": (QKV, _one_group(dict(_fp8(), strategy="BLOCK")),
                                     {ATTN + "qkv_proj": {ATTN + "k_proj": 64}}),
    # vLLM takes the first shard's group: q_proj's blocks of 64 rows hold k's 64 whole
    "the first shard's block decides": (QKV, {
        "group_0": {"targets": [ATTN + "q_proj"], "weights": _fp8(block=(64, 128)),
                    "input_activations": _TOKEN},
        "group_1": {"targets": ["Linear"], "weights": _fp8(), "input_activations": _TOKEN}},
        {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_applies_validate_fp8_block_shape_to_fused_shards(tmp_path, name):
    rows, groups, refused = CASES[name]
    problems = [p for p in check(_checkpoint(tmp_path / "ct", rows, groups))
                if p.get("block_rows")]
    assert {p["group"]: p["rows"] for p in problems} == refused
    for p in problems:
        line = format_problems([p])
        assert f"blocks of {p['block_rows']} rows" in line and "validate_fp8_block_shape" in line
        assert all(f"{layer} has {n}" in line for layer, n in p["rows"].items())


def test_fp8_block_export_warns_and_check_reports_straddling_shards(tmp_path, capsys):
    # the probe's model: 4 heads of 64, one kv head -> k_proj, v_proj of 64 rows each
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1,
                                   vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]
    calib = quantscope.calibrate(model, batches, R.scheme("FP8_BLOCK", ignore=["lm_head"]),
                                 progress=False)
    out = str(tmp_path / "ct")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.export(calib, model, out)
    warned = [str(w.message) for w in caught if "validate_fp8_block_shape" in str(w.message)]
    assert len(warned) == 1, [str(w.message) for w in caught]
    assert ATTN + "qkv_proj" in warned[0] and ATTN + "k_proj has 64" in warned[0]
    assert "blocks of 128 rows" in warned[0] and "(and 1 more fused layers)" in warned[0]
    problems = check(out)
    assert [(p["group"], p["rows"]) for p in problems] == [
        (f"model.layers.{i}.self_attn.qkv_proj", {f"model.layers.{i}.self_attn.k_proj": 64})
        for i in range(2)]
    assert main(["check", out]) == 1
    assert "k_proj has 64 output rows" in capsys.readouterr().out
