"""Fusion groups are what vLLM fuses, and the report says what a group shares."""

import pytest
import torch
import transformers
from tiny_models import llama

from quantscope import calibrate
from quantscope.calibration import Recipe, Role, Rule
from quantscope.calibration.recipe import scheme


def test_mla_without_a_query_lora_keeps_q_proj_apart():
    """DeepSeek-V2-Lite (``q_lora_rank=None``): ``q_proj`` and ``kv_a_proj_with_mqa`` read
    the hidden state, but vLLM runs them apart (``fused_qkv_a_proj`` exists only with a query
    LoRA); grouped, ``kv_a_proj_with_mqa``'s fp8 per-tensor scale was widened to q_proj's."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
        vocab_size=100)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    calib = calibrate(model, [torch.randint(0, 100, (2, 12))], scheme("FP8", ignore=("lm_head",)),
                      progress=False)
    found = [g["layers"] for g in calib.info["fusion_groups"]]
    assert ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"] in found
    assert not any("model.layers.0.self_attn.q_proj" in g for g in found)
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "kv_a_proj_with_mqa"):
        scale = calib.states[f"model.layers.0.self_attn.{name}"]["weight"].qparams.scale
        own = getattr(attn, name).weight.abs().max() / 448
        assert torch.equal(scale.reshape(()), own)


def _input_scales(calib, layer=0):
    return [calib.states[f"model.layers.{layer}.self_attn.{p}_proj"]["input"].qparams.scale
            for p in "qkv"]


def _qkv_entry(calib):
    return next(g for g in calib.info["fusion_groups"] if g["layers"][0].endswith("q_proj"))


def test_a_group_whose_input_roles_differ_is_not_reported_shared():
    """k_proj's input under another observer keeps a scale of its own; the report said the
    group's input was "shared"."""
    model, batches = llama()
    fp8 = scheme("FP8", ignore=("lm_head",)).rules[0]
    calib = calibrate(model, batches, Recipe((fp8,), ("lm_head",), "fp8"), progress=False)
    assert _qkv_entry(calib)["input"] == "shared"
    q, k, v = _input_scales(calib)
    assert torch.equal(q, k) and torch.equal(q, v)

    k_own = Rule(("re:.*k_proj$",), weight=fp8.weight, input=Role(fp8.input.spec, "minmax"))
    calib = calibrate(model, batches, Recipe((k_own, fp8), ("lm_head",), "mixed"),
                      progress=False)
    assert _qkv_entry(calib)["input"] == "per layer (the members' input roles differ)"
    q, k, v = _input_scales(calib)
    assert torch.equal(q, v) and not torch.equal(q, k)


class _TwoTables(torch.nn.Module):
    """Two embeddings looking up the same ids (Gemma-3n's embed_tokens and
    embed_tokens_per_layer), then a Linear."""

    def __init__(self, kind):
        super().__init__()
        self.a, self.b = kind(64, 32), kind(64, 32)
        self.head = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.b.weight.mul_(10)

    def forward(self, ids):
        return self.head(self.a(ids) + self.b(ids))


@pytest.mark.parametrize("kind", [torch.nn.Embedding, torch.nn.EmbeddingBag],
                         ids=["Embedding", "EmbeddingBag"])
def test_embeddings_reading_the_same_ids_keep_their_own_scales(kind):
    # probe s40: two tables looking up one ids tensor were grouped as one GEMM's shards, and
    # the smaller one took the larger one's fp8 per-tensor scale (8.6x too coarse)
    from quantscope import QuantSpec
    from quantscope.layout import Tensor

    torch.manual_seed(0)
    model = _TwoTables(kind)
    fp8 = Role(QuantSpec("fp8_e4m3", Tensor()), "memoryless_minmax")
    calib = calibrate(model, [torch.randint(0, 64, (2, 5))],
                      Recipe((Rule((kind.__name__,), weight=fp8),)), progress=False)
    assert calib.info.get("fusion_groups", []) == []
    for name in "ab":
        scale = calib.states[name]["weight"].qparams.scale
        assert torch.equal(scale.reshape(()), getattr(model, name).weight.abs().max() / 448)


@pytest.mark.parametrize(("fmt", "shared"), [("int8", False), ("fp8_e4m3", True)])
def test_a_per_tensor_weight_scale_is_shared_by_a_fused_group_for_float_formats_only(fmt,
                                                                                     shared):
    """vLLM's FP8 path re-quantizes a fused q / k / v to the shards' largest per-tensor scale,
    so quantscope gives them that one; its INT8 path widens a per-tensor scale to per-channel,
    so each int8 weight keeps the scale of its own range (max |w| / 127.5)."""
    from dataclasses import replace

    from quantscope import QuantSpec, Tensor
    from quantscope.calibration import preset

    model, batches = llama()
    base = preset("w8a8")
    rule = base.rules[0]
    recipe = replace(base, rules=(replace(rule, weight=replace(rule.weight, spec=QuantSpec(
        fmt, Tensor()))),))
    calib = calibrate(model, batches, recipe, progress=False)
    attn = "model.layers.0.self_attn."
    names = [attn + p for p in ("q_proj", "k_proj", "v_proj")]
    scales = [calib.states[n]["weight"].qparams.scale.reshape(()) for n in names]
    amax = [model.get_submodule(n).weight.detach().abs().amax() for n in names]
    if shared:
        assert all(torch.equal(s, scales[0]) for s in scales)
        assert torch.equal(scales[0], max(amax) / 448)  # the largest range's, e4m3's max 448
    else:
        assert len({float(a) for a in amax}) == 3  # three ranges, three scales
        for s, a in zip(scales, amax, strict=True):
            assert torch.equal(s, a / 127.5), (s, a / 127.5)
