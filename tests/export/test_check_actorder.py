"""`quantscope check` compares fused shards' ``actorder`` as vLLM reads it: group or not.

vLLM's WNA16 schemes read ``actorder`` only as ``has_g_idx = actorder ==
ActivationOrdering.GROUP`` (CompressedTensorsWNA16 in
vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:
a ``weight_g_idx`` parameter, and Marlin's reordering, only then: vllm-project/vllm#6358;
recent vLLM, after the RFC vllm-project/vllm#48148, refuses group at config parsing).
``"weight"``, ``"static"`` and none change how GPTQ calibrated, not the checkpoint's tensors,
so q_proj in a group of ``actorder: "weight"`` and k / v in one of none are one scheme, and
load; check reported them as a scheme mismatch (probe s43). Group (``"dynamic"`` its alias,
``true`` older compressed-tensors' spelling) is another scheme: its shards hold a
``weight_g_idx``.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from quantscope.exporters.consistency import check
from quantscope.exporters.serving import scheme_args

torch.set_num_threads(1)

ATTN = "model.layers.0.self_attn."
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
      "dynamic": False}


def _checkpoint(folder, q_order, kv_order):
    """w4a16 q / k / v of one attention, q_proj in a config group of its own."""
    folder.mkdir()
    groups = {"group_0": {"targets": [ATTN + "q_proj"], "weights": dict(W4, actorder=q_order)},
              "group_1": {"targets": [ATTN + "k_proj", ATTN + "v_proj"],
                          "weights": dict(W4, actorder=kv_order)}}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": groups}}))
    tensors = {}
    for shard in ("q_proj", "k_proj", "v_proj"):
        tensors[f"{ATTN}{shard}.weight_packed"] = torch.zeros(8, 32, dtype=torch.int32)
        tensors[f"{ATTN}{shard}.weight_scale"] = torch.full((8, 2), 0.5)
        tensors[f"{ATTN}{shard}.weight_shape"] = torch.tensor([8, 256])
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("q_order, kv_order", [
    ("weight", None), ("static", "weight"), ("static", None), (None, "weight"),
])
def test_shards_that_differ_only_in_a_reordering_without_g_idx_are_one_scheme(
        tmp_path, q_order, kv_order):
    problems = check(_checkpoint(tmp_path / "ct", q_order, kv_order))
    assert [p for p in problems if p["tensor"] == "scheme"] == [], problems


@pytest.mark.parametrize("order", ["weight", "static"])
def test_compressed_tensors_parses_them_as_no_group_ordering(order):
    ct = pytest.importorskip("compressed_tensors.quantization")
    args = ct.QuantizationArgs(**dict(W4, actorder=order))
    assert args.actorder != ct.ActivationOrdering.GROUP  # vLLM's has_g_idx: False


def test_group_ordering_is_another_scheme():
    # the key check compares (recent compressed-tensors refuses these when it parses the
    # config, which check does where it is installed)
    none = scheme_args(dict(W4, actorder=None))
    for order in ("group", "GROUP", "dynamic", True):
        assert scheme_args(dict(W4, actorder=order))["actorder"] == "group"
        assert scheme_args(dict(W4, actorder=order)) != none
    for order in ("weight", "static", None, False):
        assert scheme_args(dict(W4, actorder=order)) == none
