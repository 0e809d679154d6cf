"""Pins found by mutation (s60) in the export / structure code: compressed-tensors' target
precedence when config groups overlap (exact name > ``re:`` > class name; a container a
target matches is never quantized), the reader's refusal of a zero point outside the
scheme's integers and of an expert whose gate and up are quantized differently, the fused
MoE slots of ``check`` (expert numbers of two digits, ``w1`` / ``w3`` in one ``w13`` slot,
nested names no slot), and the attention modules whose forward takes no cache (no KV
roles)."""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantscope import Channel, Group, QuantSpec, Tensor
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate
from quantscope.exporters import check
from quantscope.exporters.moe_slots import expert_index, expert_slot


def _batches(vocab=50, n=2):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (1, 8), generator=g)} for _ in range(n)]


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False)).eval()


def _bloom():
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        hidden_size=32, n_layer=1, n_head=4, vocab_size=50)).eval()


def _edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg["quantization_config"]


# ---- ct_match.precedence / winners: overlapping config groups ------------------------------------

def _ct_schemes(model, qconfig):
    """``{name: (num_bits, strategy)}`` of the weights compressed-tensors' own
    apply_quantization_config gives each module of a fresh ``model`` (the expectation)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    fresh = type(model)(model.config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(fresh, QuantizationConfig.model_validate(qconfig),
                                  show_progress=False)
    return {n: (m.quantization_scheme.weights.num_bits, m.quantization_scheme.weights.strategy)
            for n, m in fresh.named_modules()
            if getattr(m, "quantization_scheme", None) is not None
            and m.quantization_scheme.weights is not None}


_GROUP = {"int4 group:16 sym": (4, "group"), "int8 channel:0 sym": (8, "channel")}

# (model, the int4 group's layers as exported, config targets rewritten to overlap, a layer the
# int4 group must win): t3, a regex over a class name; t2, an exact name over a regex (names
# sort after "re:")
_OVERLAPS = {
    "regex_over_class": (_llama, ("*mlp*",),
                         {4: ["re:.*mlp.*"], 8: ["Linear"]}, "model.layers.0.mlp.down_proj"),
    "name_over_regex": (_bloom, ("transformer.h.0.mlp.dense_4h_to_h",),
                        {4: ["transformer.h.0.mlp.dense_4h_to_h"],
                         8: ["re:.*(dense|query_key_value).*"]},
                        "transformer.h.0.mlp.dense_4h_to_h"),
}


@pytest.mark.parametrize("case", sorted(_OVERLAPS))
def test_overlapping_groups_read_back_as_compressed_tensors_applies_them(tmp_path, case):
    """A folder whose config groups overlap (as llm-compressor writes them) is read back with
    each layer in the group compressed-tensors' apply_quantization_config gives it: the most
    specific target wins (exact name > ``re:`` > class name), and a container a target
    matches (the ``mlp`` a regex names) is no layer of any group."""
    make, low, targets, layer = _OVERLAPS[case]
    model = make()
    recipe = Recipe((Rule(low, weight=Role(QuantSpec("int4", Group(16)), "minmax")),
                     Rule(("Linear",), weight=Role(QuantSpec("int8", Channel(0)), "minmax"))),
                    ("lm_head",), "mix")
    out = tmp_path / "ct"
    calibrate(model, _batches(), recipe, progress=False).export(model, out)

    def overlap(qc):
        for grp in qc["config_groups"].values():
            grp["targets"] = targets[grp["weights"]["num_bits"]]
    qconfig = _edit_config(out, overlap)

    want = _ct_schemes(model, qconfig)
    assert want[layer] == (4, "group")  # the expectation itself: the specific target wins
    assert {n for n, (bits, _) in want.items() if bits == 8}  # both groups take layers
    back = Calibration.from_compressed_tensors(out)
    got = {n: _GROUP[str(roles["weight"].spec)] for n, roles in back.states.items()
           if "weight" in roles}
    assert got == want


def test_a_container_a_regex_matches_is_not_a_layer_of_its_group(tmp_path):
    """``re:.*mlp.*`` matches the ``mlp`` module as well as its Linears: compressed-tensors
    quantizes only the Linear / Embedding layers a target matches, so the reader gives the
    container no state (it holds no tensor of its own) and reads the Linears."""
    model = _llama()
    recipe = Recipe((Rule(("*mlp*",), weight=Role(QuantSpec("int4", Group(16)), "minmax")),),
                    ("lm_head",), "mlp")
    out = tmp_path / "ct"
    calibrate(model, _batches(), recipe, progress=False).export(model, out)
    qconfig = _edit_config(out, lambda qc: [g.update(targets=["re:.*mlp.*"])
                                            for g in qc["config_groups"].values()])
    want = _ct_schemes(model, qconfig)
    assert "model.layers.0.mlp" not in want
    back = Calibration.from_compressed_tensors(out)
    assert sorted(back.states) == sorted(want) == [
        f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]


# ---- read.py: a zero point outside its scheme's integers -----------------------------------------

def test_a_zero_point_outside_the_schemes_integers_is_refused(tmp_path):
    """An int4 asymmetric input's zero point edited to 100 (int8 holds it; int4's integers are
    [-8, 7]) is refused by name, never read back as a zero point no int4 code reaches."""
    model = _llama()
    recipe = Recipe((Rule(("Linear",),
                          weight=Role(QuantSpec("int8", Channel(0), symmetric=False), "minmax"),
                          input=Role(QuantSpec("int4", Tensor(), symmetric=False), "minmax")),),
                    ("lm_head",), "asym")
    out = tmp_path / "ct"
    calibrate(model, _batches(), recipe, progress=False).export(model, out)
    key = "model.layers.0.self_attn.q_proj.input_zero_point"
    (f,) = out.glob("*.safetensors")
    t = load_file(f)
    assert -8 <= int(t[key].min()) <= int(t[key].max()) <= 7  # as written
    t[key] = torch.full_like(t[key], 100)
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key} holds values that are no integers in "
                                         r"\[-8, 7\] \(int4 tensor asym\)"):
        Calibration.from_compressed_tensors(out)


# ---- experts.py: gate and up quantized differently -----------------------------------------------

def test_experts_gate_and_up_quantized_differently_are_refused(tmp_path):
    """A Mixtral checkpoint whose expert 1 has its w3 (up) in a 7-bit group while its w1 (gate)
    stays int8 (a valid int7 checkpoint): the model's 3-D experts fuse gate and up into one
    gate_up_proj of one spec, so the reader refuses it by name rather than read the int7 rows
    as int8."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, num_local_experts=2,
        num_experts_per_tok=2)).eval()
    out = tmp_path / "ct"
    calibrate(model, _batches(), "w8a8", progress=False).export(model, out)
    w3 = "model.layers.0.block_sparse_moe.experts.1.w3"

    def split(qc):
        (g0,) = qc["config_groups"].values()
        g7 = copy.deepcopy(g0)
        g7["weights"]["num_bits"] = 7
        g7["targets"] = [w3]
        qc["config_groups"]["group_int7"] = g7
        if w3 in g0["targets"]:
            g0["targets"].remove(w3)
    _edit_config(out, split)
    (f,) = out.glob("*.safetensors")
    t = load_file(f)
    t[f"{w3}.weight"] = t[f"{w3}.weight"].clamp(-64, 63)
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts model\.layers\.0\.mlp\.experts\.1: gate and "
                                         r"up weights are quantized differently"):
        Calibration.from_compressed_tensors(out)


# ---- moe_slots.py: check()'s fused MoE slots -----------------------------------------------------

def _fp8_experts(folder, experts, n, projs, drop, model_type):
    """A hand-written FP8 experts checkpoint: ``n`` experts ``experts.<e>.<proj>``, each with
    a static input scale but the ``(e, proj)`` in ``drop`` (dynamic)."""
    t = {}
    for e in range(n):
        for p in projs:
            name = f"{experts}.{e}.{p}"
            t[f"{name}.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
            t[f"{name}.weight_scale"] = torch.tensor([0.5])
            if (e, p) not in drop:
                t[f"{name}.input_scale"] = torch.tensor([0.125])
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {}}}))
    save_file(t, str(folder / "model.safetensors"))
    return folder


QWEN = "model.layers.0.mlp.experts"
MIXTRAL = "model.layers.0.block_sparse_moe.experts"


def test_an_expert_numbered_past_nine_is_in_its_modules_slot(tmp_path):
    """12 experts, expert 11's down_proj dynamic: vLLM's fused MoE layer holds one down input
    scale for all 12, so check() flags the w2 slot, expert 11 among its layers."""
    assert expert_index("11") == 11 and expert_index("expert_10") == 10
    assert expert_slot(f"{QWEN}.11.down_proj") == (QWEN, "down_proj")
    d = _fp8_experts(tmp_path / "ct", QWEN, 12, ("gate_proj", "up_proj", "down_proj"),
                     {(11, "down_proj")}, "qwen3_moe")
    problems = check(d)
    assert [(p["group"], p["experts"], p["tensor"]) for p in problems] == [
        (QWEN, "down_proj", "input_scale")]
    assert sorted(problems[0]["layers"]) == sorted(f"{QWEN}.{e}.down_proj" for e in range(12))
    assert f"{QWEN}.11.down_proj" not in problems[0]["held_by"]


def test_w1_and_w3_share_the_w13_slot(tmp_path):
    """Mixtral's w1 (gate) and w3 (up) are both read into vLLM's one w13 slot: every w1
    holding a static input scale and no w3 is a split w13 slot."""
    assert expert_slot(f"{MIXTRAL}.0.w3") == expert_slot(f"{MIXTRAL}.0.w1") == (MIXTRAL, "w13")
    assert expert_slot(f"{MIXTRAL}.0.w2") == (MIXTRAL, "w2")
    d = _fp8_experts(tmp_path / "ct", MIXTRAL, 4, ("w1", "w2", "w3"),
                     {(e, "w3") for e in range(4)}, "mixtral")
    w13 = [p for p in check(d) if p.get("experts") == "w13"]
    assert [(p["group"], p["tensor"], p["held_by"]) for p in w13] == [
        (MIXTRAL, "input_scale", [f"{MIXTRAL}.{e}.w1" for e in range(4)])]
    assert sorted(w13[0]["layers"]) == sorted(f"{MIXTRAL}.{e}.{p}"
                                              for e in range(4) for p in ("w1", "w3"))


def test_an_experts_nested_layer_is_in_no_slot(tmp_path):
    """``experts.<e>.mlp.down_proj`` is no name vLLM's fused MoE loader stacks (its mapping
    takes ``experts.<e>.<proj>.``): no slot, so no experts problem, though expert 1 holds no
    input scale."""
    assert expert_slot(f"{QWEN}.1.mlp.down_proj") is None
    projs = tuple(f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    d = _fp8_experts(tmp_path / "ct", QWEN, 4, projs, {(1, "mlp.down_proj")}, "qwen3_moe")
    assert [p for p in check(d) if p.get("experts")] == []


# ---- kv_cache.py: attention whose forward takes no cache ----------------------------------------

def test_attention_whose_forward_takes_no_cache_has_no_kv_roles():
    """Mllama's vision attention (k_proj / v_proj, no is_causal attribute, a forward that
    takes no cache) is no cached attention module to compressed-tensors (it gives only
    attention whose forward takes the cache a KV scale), so it gets no KV roles; a Llama's
    self_attn (a forward taking ``cache``, transformers 5.24's name) does."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    from quantscope.calibration.structure.kv_cache import attention_modules

    torch.manual_seed(0)
    vision = transformers.MllamaVisionModel(transformers.MllamaVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
        attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64,
        intermediate_layers_indices=[0])).eval()
    attn = [n for n, m in vision.named_modules()
            if "attention" in type(m).__name__.lower() and hasattr(m, "k_proj")]
    assert attn == ["transformer.layers.0.self_attn", "global_transformer.layers.0.self_attn"]
    assert not any(is_cached_attention_module(m) for m in vision.modules())  # the expectation
    assert attention_modules(vision) == {}
    assert sorted(attention_modules(_llama())) == ["model.layers.0.self_attn"]
