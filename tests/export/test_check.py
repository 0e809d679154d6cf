"""`quantscope check`: fused shards of a compressed-tensors checkpoint must agree on scales."""

import json

import pytest
import torch
from safetensors.torch import save_file

from quantscope.cli import main
from quantscope.exporters import check

ATTN = "model.layers.{}.self_attn.{}"
MLP = "model.layers.{}.mlp.{}"


def write(folder, tensors, method="compressed-tensors", groups=None,
          fmt="nvfp4-pack-quantized"):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama",
           "quantization_config": {"quant_method": method, "format": fmt,
                                   "config_groups": groups or {}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def nvfp4_checkpoint(layers=2):
    t = {}
    for i in range(layers):
        for name in [ATTN.format(i, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                    [MLP.format(i, p) for p in ("gate_proj", "up_proj", "down_proj")]:
            t[f"{name}.weight_packed"] = torch.zeros(8, 4, dtype=torch.uint8)
            t[f"{name}.weight_scale"] = torch.ones(8, 1).to(torch.float8_e4m3fn)
            # one value per fused layer; o_proj / down_proj stand alone and may differ
            t[f"{name}.weight_global_scale"] = torch.tensor([100.0 + i + ("o_proj" in name)])
            t[f"{name}.input_global_scale"] = torch.tensor([7.0 + i + ("down" in name)])
    return t


def test_consistent_checkpoint_passes(tmp_path, capsys):
    d = write(tmp_path / "ok", nvfp4_checkpoint())
    assert check(d) == []
    assert main(["check", str(d)]) == 0
    assert "agree" in capsys.readouterr().out


def test_edited_global_scales_are_flagged(tmp_path, capsys):
    t = nvfp4_checkpoint()
    t[ATTN.format(1, "k_proj") + ".weight_global_scale"] = torch.tensor([123.5])
    t[MLP.format(0, "up_proj") + ".input_global_scale"] = torch.tensor([9.25])
    d = write(tmp_path / "bad", t)
    problems = check(d)
    assert {(p["group"], p["tensor"]) for p in problems} == {
        ("model.layers.1.self_attn.qkv_proj", "weight_global_scale"),
        ("model.layers.0.mlp.gate_up_proj", "input_global_scale")}
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn.k_proj=123.5" in out
    assert "model.layers.1.self_attn.q_proj=101" in out
    assert "model.layers.0.mlp.up_proj=9.25" in out


@pytest.mark.parametrize("attention", ["encoder_attn", "cross_attn", "cross_attention"])
def test_cross_attention_fuses_keys_and_values_only(tmp_path, attention):
    # Whisper / BART (encoder_attn), T5Gemma (cross_attn), SeamlessM4T (cross_attention):
    # the decoder's queries read the decoder's states, its keys and values the encoder's
    # output (calibrate fuses only those; vLLM keeps q_proj apart beside kv_proj): check
    # called quantscope's own export inconsistent
    cross = f"model.decoder.layers.0.{attention}.{{}}"
    t = {}
    for shard, scale in (("q_proj", 3.0), ("k_proj", 5.0), ("v_proj", 5.0)):
        t[cross.format(shard) + ".weight"] = torch.zeros(8, 8, dtype=torch.int8)
        t[cross.format(shard) + ".weight_scale"] = torch.ones(8, 1)
        t[cross.format(shard) + ".input_scale"] = torch.tensor([scale])
    assert check(write(tmp_path / "ok", t, fmt="int-quantized")) == []
    t[cross.format("v_proj") + ".input_scale"] = torch.tensor([6.0])
    problems = check(write(tmp_path / "bad", t, fmt="int-quantized"))
    assert [(p["group"], p["tensor"]) for p in problems] == [
        (f"model.decoder.layers.0.{attention}.kv_proj", "input_scale")]
    assert problems[0]["layers"] == [cross.format("k_proj"), cross.format("v_proj")]  # vLLM's


def test_shards_of_different_schemes_are_flagged(tmp_path, capsys):
    # found by probing: keep_float made up_proj's input dynamic (no input scale) and kept
    # gate_proj's static; the check compared only values both held and said they agree
    t = nvfp4_checkpoint(1)
    del t[MLP.format(0, "up_proj") + ".input_global_scale"]
    d = write(tmp_path / "mixed", t)
    problems = check(d)
    assert [(p["group"], p["tensor"], p["held_by"]) for p in problems] == [
        ("model.layers.0.mlp.gate_up_proj", "input_global_scale", [MLP.format(0, "gate_proj")])]
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert "held by model.layers.0.mlp.gate_proj but not by model.layers.0.mlp.up_proj" in out


def test_fp8_weight_scales_shared_int8_widened(tmp_path):
    t = {}
    for p, s in (("q_proj", 0.5), ("k_proj", 0.25), ("v_proj", 0.5)):
        t[f"{ATTN.format(0, p)}.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
        t[f"{ATTN.format(0, p)}.weight_scale"] = torch.tensor([s])
        t[f"{ATTN.format(0, p)}.input_scale"] = torch.tensor([0.1])
    for p, s in (("gate_proj", 0.5), ("up_proj", 0.25)):  # int8: vLLM widens per channel
        t[f"{MLP.format(0, p)}.weight"] = torch.zeros(4, 4, dtype=torch.int8)
        t[f"{MLP.format(0, p)}.weight_scale"] = torch.tensor([s])
    problems = check(write(tmp_path / "fp8", t))
    assert [(p["group"], p["tensor"]) for p in problems] == [
        ("model.layers.0.self_attn.qkv_proj", "weight_scale")]
    assert problems[0]["values"][ATTN.format(0, "k_proj")] == 0.25


def _fp8_group(targets, strategy):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {"targets": targets, "weights": weights, "format": "float-quantized"}


_BLOCK = {"group_0": _fp8_group(["Linear"], "block")}
_TENSOR = {"group_0": _fp8_group(["Linear"], "tensor")}
# compressed-tensors' precedence: a name pattern's group over a class name's
_BLOCK_BY_NAME = {"group_0": _fp8_group(["Linear"], "tensor"),
                  "group_1": _fp8_group([r"re:.*self_attn\.[qkv]_proj$"], "block")}


@pytest.mark.parametrize("groups, flagged", [(_BLOCK, False), (_TENSOR, True),
                                             (_BLOCK_BY_NAME, False)])
def test_fp8_weight_scales_are_shared_only_for_per_tensor_weights(tmp_path, groups, flagged):
    # found by probing: llm-compressor's FP8_BLOCK of a 128-wide model has one 128 x 128
    # block per q/k/v shard, its [1, 1] block scale was taken for a per-tensor scale and
    # `check` exited 1; vLLM re-quantizes shards to one scale only for strategy TENSOR
    t = {}
    for p, s in (("q_proj", 0.5), ("k_proj", 0.25), ("v_proj", 0.5)):
        t[f"{ATTN.format(0, p)}.weight"] = torch.zeros(128, 128).to(torch.float8_e4m3fn)
        t[f"{ATTN.format(0, p)}.weight_scale"] = torch.tensor([[s]])
    problems = check(write(tmp_path / "fp8", t, groups=groups, fmt="float-quantized"))
    assert [(p["group"], p["tensor"]) for p in problems] == (
        [("model.layers.0.self_attn.qkv_proj", "weight_scale")] if flagged else [])


def test_moe_and_mla_shards(tmp_path):
    t = {}
    for e, (a, b) in enumerate(((2.0, 2.0), (3.0, 4.0))):
        t[f"model.layers.0.block_sparse_moe.experts.{e}.w1.input_global_scale"] = torch.tensor([a])
        t[f"model.layers.0.block_sparse_moe.experts.{e}.w3.input_global_scale"] = torch.tensor([b])
    t["model.layers.0.self_attn.q_a_proj.input_scale"] = torch.tensor([1.0])
    t["model.layers.0.self_attn.kv_a_proj_with_mqa.input_scale"] = torch.tensor([2.0])
    t["model.layers.1.self_attn.q_proj.input_scale"] = torch.tensor([float("nan")])
    problems = check(write(tmp_path / "moe", t))
    groups = {p.get("group") for p in problems}
    assert "model.layers.0.block_sparse_moe.experts.1.w13" in groups
    assert "model.layers.0.block_sparse_moe.experts.0.w13" not in groups
    assert "model.layers.0.self_attn.fused_qkv_a_proj" in groups
    assert any(p.get("non_finite") and "layers.1.self_attn.q_proj" in p["tensor"]
               for p in problems)


def test_bad_input(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        check(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        check(tmp_path / "empty")
    d = write(tmp_path / "gptq", nvfp4_checkpoint(1), method="gptq")
    with pytest.raises(ValueError, match="compressed-tensors"):
        check(d)
    assert main(["check", str(d)]) == 2  # an error, not a disagreement (exit 1)
    assert "compressed-tensors" in capsys.readouterr().err
