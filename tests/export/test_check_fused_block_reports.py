"""How `quantscope check` and the export's warning report fp8 blocks that straddle fused shards.

vLLM's fp8 block layer needs every shard of a fused layer but the last to hold whole blocks of
rows (``validate_fp8_block_shape`` raises at load). A fused layer only partly quantized (an
ignore list that holds one shard) is refused before that (vLLM gives the fused layer one
scheme): it is reported as split, not as blocks. The export warns once, naming the first such
fused layer and counting the others (docs/guide/deploy.md: "the first fused layer and how many
more"). A mutation round found no test failing where these rules were dropped.
"""

import json
import warnings

import torch
from safetensors.torch import save_file

from quantscope.exporters.consistency import check, warn_fused_problems

torch.set_num_threads(1)

TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
FP8_BLOCKS = {"type": "float", "num_bits": 8, "strategy": "block", "symmetric": True,
              "dynamic": False, "block_structure": [128, 128]}
ONE_GROUP = {"group_0": {"targets": ["Linear"], "weights": FP8_BLOCKS,
                         "input_activations": TOKEN}}


def _checkpoint(folder, rows, float_layers=()):
    """fp8 weights of 64 columns in blocks of 128 x 128; ``rows``: layer -> output rows;
    ``float_layers`` hold their weight alone (as an ignore list's)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": ONE_GROUP}}))
    tensors = {}
    for layer, n in rows.items():
        if layer in float_layers:
            tensors[f"{layer}.weight"] = torch.zeros(n, 64)
        else:
            tensors[f"{layer}.weight"] = torch.zeros(n, 64).to(torch.float8_e4m3fn)
            tensors[f"{layer}.weight_scale"] = torch.ones(-(-n // 128), 1)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _qkv(i, k_rows=64):
    """q / k / v of layer ``i``: k's 64 rows are no whole block of 128."""
    a = f"model.layers.{i}.self_attn."
    return {a + "q_proj": 128, a + "k_proj": k_rows, a + "v_proj": 64}


def _warned(folder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_fused_problems(folder)
    return [str(w.message) for w in caught]


def test_a_partly_quantized_fused_layer_is_reported_split_not_as_blocks(tmp_path):
    # q and k in blocks of 128 (q 64 rows), v float: the one problem is the split
    a = "model.layers.0.self_attn."
    rows = {a + "q_proj": 64, a + "k_proj": 64, a + "v_proj": 64}
    problems = check(_checkpoint(tmp_path / "ct", rows, float_layers=(a + "v_proj",)))
    assert [p.get("float") for p in problems] == [[a + "v_proj"]], problems
    assert not [p for p in problems if p.get("block_rows")]


def test_one_straddling_fused_layer_warns_without_a_count(tmp_path):
    warned = _warned(_checkpoint(tmp_path / "ct", _qkv(0)))
    assert len(warned) == 1, warned
    assert "model.layers.0.self_attn.k_proj has 64 output rows" in warned[0]
    assert "more fused layers" not in warned[0]


def test_two_straddling_fused_layers_warn_once_naming_the_first(tmp_path):
    warned = _warned(_checkpoint(tmp_path / "ct", {**_qkv(0), **_qkv(1)}))
    assert len(warned) == 1, warned
    assert "model.layers.0.self_attn.qkv_proj: fp8 weight blocks of 128 rows" in warned[0]
    assert "(and 1 more fused layers)" in warned[0]
    assert "model.layers.1." not in warned[0]
