"""Pins of `quantscope check`'s cross-checks (exporters/consistency.py) that no test held: which
fp8 weights share one weight scale (both float8 kinds, per-tensor only, by the config's strategy
where it tells and the scale's size where it cannot, a 0-d scale too), which config groups'
schemes differ (the group's own format), how NaN scales weigh in the shards' and the experts'
agreement, which experts' input scales are compared (one value each), the name of a fused layer
without a parent, and how `format_problems` prints values and the FlashInfer note. They came
from a mutation round (s68): each test fails on a small defect that the other tests let pass.
"""

import pytest
import torch
from test_check import ATTN, write
from test_check_experts_held import EXPERTS, _fp8_experts, _write

from quantscope.exporters.consistency import check, format_problems

torch.set_num_threads(1)

QKV = ("q_proj", "k_proj", "v_proj")
LAYER0 = ATTN.format(0, "")
TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
         "dynamic": True}


def _fp8(strategy):
    return {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
            "dynamic": False}


def _group(targets, strategy="tensor", **extra):
    return {"targets": targets, "weights": _fp8(strategy), "input_activations": TOKEN,
            **extra}


def _qkv(scales, dtype=torch.float8_e4m3fn, leaf="weight_scale", prefix=LAYER0):
    """fp8 q / k / v weights of 4 x 4, ``scales``: shard -> its ``leaf`` tensor."""
    t = {}
    for shard in QKV:
        t[f"{prefix}{shard}.weight"] = torch.zeros(4, 4).to(dtype)
        t[f"{prefix}{shard}.{leaf}"] = scales[shard]
    return t


def _shared(problems, leaf="weight_scale"):
    """The problems of shards whose shared ``leaf`` values differ."""
    return [p for p in problems if p.get("tensor") == leaf and p.get("values")
            and not p.get("non_finite")]


DIFFERENT = {"q_proj": torch.tensor([0.5]), "k_proj": torch.tensor([0.25]),
             "v_proj": torch.tensor([0.5])}


def test_e5m2_per_tensor_weight_scales_are_shared(tmp_path):
    """vLLM re-quantizes float8 per-tensor shards to one scale, e5m2 as e4m3."""
    d = write(tmp_path / "ct", _qkv(DIFFERENT, torch.float8_e5m2), fmt="float-quantized")
    assert [p["group"] for p in _shared(check(d))] == ["model.layers.0.self_attn.qkv_proj"]


def test_weight_scales_of_int8_beside_fp8_shards_are_not_compared(tmp_path):
    """A weight scale is shared only where every shard's weight is float8."""
    t = _qkv(DIFFERENT)
    t[ATTN.format(0, "q_proj.weight")] = torch.zeros(4, 4, dtype=torch.int8)
    assert _shared(check(write(tmp_path / "ct", t, fmt="float-quantized"))) == []


def test_weight_scales_of_per_tensor_beside_per_channel_shards_are_not_compared(tmp_path):
    """Where the config says, only all-per-tensor shards share their weight scale."""
    groups = {"group_0": _group([ATTN.format(0, "q_proj")], "tensor"),
              "group_1": _group(["Linear"], "channel")}
    t = _qkv(DIFFERENT)
    d = write(tmp_path / "ct", t, groups=groups, fmt="float-quantized")
    assert _shared(check(d)) == []


def test_a_shard_two_groups_select_is_judged_by_its_scale_size(tmp_path):
    """Two patterns of different strategies match q_proj: the config cannot tell its
    strategy, so the one-value scales tell, and the shards share them."""
    groups = {"group_0": _group(["re:.*q_proj$"], "tensor"),
              "group_1": _group(["re:.*self_attn.*"], "channel")}
    d = write(tmp_path / "ct", _qkv(DIFFERENT), groups=groups, fmt="float-quantized")
    assert [p["group"] for p in _shared(check(d))] == ["model.layers.0.self_attn.qkv_proj"]


def test_zero_dim_scales_are_one_value(tmp_path):
    """A 0-d scale holds one value: the shards share it."""
    scales = {"q_proj": torch.tensor(0.5), "k_proj": torch.tensor(0.25),
              "v_proj": torch.tensor(0.5)}
    d = write(tmp_path / "ct", _qkv(scales), fmt="float-quantized")
    (p,) = _shared(check(d))
    assert p["values"][ATTN.format(0, "k_proj")] == 0.25


def test_a_group_format_is_part_of_the_scheme(tmp_path):
    """Shards of groups alike but for their own ``format`` are in different schemes."""
    groups = {"group_0": _group([ATTN.format(0, "q_proj")], format="float-quantized"),
              "group_1": _group(["Linear"], format="naive-quantized")}
    scales = {s: torch.tensor([0.5]) for s in QKV}
    problems = check(write(tmp_path / "ct", _qkv(scales), groups=groups,
                           fmt="float-quantized"))
    assert [p["schemes"] for p in problems if p.get("schemes")] == [
        {ATTN.format(0, "q_proj"): "group_0", ATTN.format(0, "k_proj"): "group_1",
         ATTN.format(0, "v_proj"): "group_1"}]


def test_a_shard_no_group_selects_gives_no_scheme_problem(tmp_path):
    """Where the config cannot tell a shard's scheme, the scheme check stays quiet."""
    groups = {"group_0": _group(["re:.*q_proj$"], "tensor"),
              "group_1": _group(["re:.*k_proj$"], "channel")}
    scales = {s: torch.tensor([0.5]) for s in QKV}
    problems = check(write(tmp_path / "ct", _qkv(scales), groups=groups,
                           fmt="float-quantized"))
    assert [p for p in problems if p.get("schemes")] == []


def test_nan_shards_alone_do_not_differ(tmp_path):
    """All shards' scales NaN: each is reported not finite, none as a disagreement."""
    scales = {s: torch.tensor([float("nan")]) for s in QKV}
    problems = check(write(tmp_path / "ct", _qkv(scales, leaf="input_scale"),
                           fmt="float-quantized"))
    assert _shared(problems, "input_scale") == []
    assert len([p for p in problems if p.get("non_finite")]) == 3


def test_a_nan_shard_beside_finite_ones_differs(tmp_path):
    scales = {"q_proj": torch.tensor([float("nan")]), "k_proj": torch.tensor([0.5]),
              "v_proj": torch.tensor([0.5])}
    problems = check(write(tmp_path / "ct", _qkv(scales, leaf="input_scale"),
                           fmt="float-quantized"))
    assert [p["group"] for p in _shared(problems, "input_scale")] == [
        "model.layers.0.self_attn.qkv_proj"]


def test_a_nan_expert_input_scale_is_not_a_disagreement(tmp_path):
    """The experts' agreement is judged on their finite input scales."""
    t = _fp8_experts()
    t[f"{EXPERTS}.1.down_proj.input_scale"] = torch.tensor([float("nan")])
    problems = check(_write(tmp_path / "ct", t))
    assert [p for p in problems if p.get("experts")] == []
    assert [p for p in problems if p.get("non_finite")]


def test_experts_input_scales_of_several_values_are_not_compared(tmp_path):
    """Only one-value input scales are the one the fused MoE layer holds."""
    t = _fp8_experts()
    for e in range(4):
        t[f"{EXPERTS}.{e}.down_proj.input_scale"] = torch.tensor([0.25 + e, 1.0])
    assert [p for p in check(_write(tmp_path / "ct", t)) if p.get("experts")] == []


def test_a_fused_layer_without_a_parent_is_named_by_itself(tmp_path):
    d = write(tmp_path / "ct", _qkv(DIFFERENT, prefix=""), fmt="float-quantized")
    assert [p["group"] for p in _shared(check(d))] == ["qkv_proj"]


def test_printed_values_name_the_float32_scale_exactly(tmp_path):
    """float32 needs 9 significant digits: the printed value reads back as the scale."""
    scales = {"q_proj": torch.tensor([0.5]), "k_proj": torch.tensor([1.2345678]),
              "v_proj": torch.tensor([0.5])}
    d = write(tmp_path / "ct", _qkv(scales, leaf="input_scale"), fmt="float-quantized")
    line = format_problems(_shared(check(d), "input_scale"))
    k = line.split(ATTN.format(0, "k_proj") + "=")[1].split(",")[0]
    assert torch.tensor([float(k)]).item() == torch.tensor([1.2345678]).item()


@pytest.mark.parametrize("leaf, note", [("input_global_scale", True), ("input_scale", False)])
def test_the_flashinfer_note_names_global_scales_only(tmp_path, leaf, note):
    """vLLM's FlashInfer NVFP4 MoE holds one input_global_scale; FP8's input_scale is not it."""
    t = _fp8_experts(leaf=leaf)
    t[f"{EXPERTS}.2.down_proj.{leaf}"] = torch.tensor([0.5])
    text = format_problems([p for p in check(_write(tmp_path / "ct", t)) if p.get("experts")])
    assert "differs across the experts' down_proj inputs" in text
    assert ("FlashInfer NVFP4 MoE" in text) is note


def test_a_checkpoint_of_no_tensor_is_refused(tmp_path):
    """An empty safetensors file is no checkpoint to call consistent."""
    with pytest.raises(ValueError, match="hold no tensor"):
        check(write(tmp_path / "ct", {}, fmt="float-quantized"))
