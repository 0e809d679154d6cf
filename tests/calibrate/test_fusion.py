"""Fusion groups: q/k/v and gate/up found from the forward, sharing the scales a runtime fuses."""

from dataclasses import replace

import pytest
import torch

from quantscope import QuantSpec, fake_quantize, presets, qparams_from_range
from quantscope.calibration import Auto, Recipe, Role, Rule, calibrate, calibrate_many, preset
from quantscope.layout import Tensor
from quantscope.observers.registry import get_observer

transformers = pytest.importorskip("transformers")

import tiny_models

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FP8_TENSOR = Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "memoryless_minmax"),
                          input=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),), name="fp8t")


def llama(seed=0):
    model, batches = tiny_models.llama(seed)
    with torch.no_grad():  # members with clearly different ranges, so sharing shows
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.mlp.up_proj.weight.mul_(0.25)
    return model, batches


def groups(i):
    attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    return [[f"{attn}.{p}" for p in QKV], [f"{mlp}.{p}" for p in GATE_UP]]


def all_groups(model):
    return [g for i in range(len(model.model.layers)) for g in groups(i)]


@pytest.fixture(scope="module")
def tiny():
    return llama()


def test_groups_found_from_the_forward(tiny):
    model, batches = tiny
    calib = calibrate(model, batches, "w8a8", progress=False)
    found = [g["layers"] for g in calib.info["fusion_groups"]]
    assert found == all_groups(model)
    assert "Fusion groups" in calib.report().to_markdown()


@pytest.mark.parametrize("recipe", ["nvfp4", "w8a8", FP8_TENSOR], ids=str)
def test_groups_share_what_the_runtime_shares(tiny, recipe):
    model, batches = tiny
    calib = calibrate(model, batches, recipe, progress=False)
    for group in all_groups(model):
        w = [calib.states[m]["weight"].qparams for m in group]
        x = [calib.states[m]["input"] for m in group]
        if recipe == "nvfp4":
            assert all(torch.equal(q.global_scale, w[0].global_scale) for q in w)
            assert all(torch.equal(s.global_amax, x[0].global_amax) for s in x)
        else:
            assert all(torch.equal(s.qparams.scale, x[0].qparams.scale) for s in x)
        if recipe is FP8_TENSOR:  # per-tensor fp8 weights: vLLM re-quantizes to one scale
            assert all(torch.equal(q.scale, w[0].scale) for q in w)
            amax = max(float(model.get_submodule(m).weight.detach().abs().max()) for m in group)
            assert float(w[0].scale) == pytest.approx(amax / 448.0, rel=1e-6)
        if recipe == "w8a8":  # per-channel int8 weights: each member keeps its rows' scales
            for m, q in zip(group, w):
                wt = model.get_submodule(m).weight
                amax = wt.detach().abs().amax(1)
                ref = qparams_from_range(-amax, amax, presets.INT8_PER_CHANNEL).scale
                assert torch.allclose(q.scale.flatten(), ref.flatten(), rtol=1e-6)


def test_shared_input_is_observed_once(tiny):
    model, batches = tiny
    calib = calibrate(model, batches, "w8a8", progress=False)
    q = calib.states["model.layers.0.self_attn.q_proj"]["input"]
    # the minmax observer is a moving average: observing the shared input 3x would differ
    seen = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].clone()))
    with torch.inference_mode():
        for b in batches:
            model(b)
    h.remove()
    ref = get_observer("minmax", QuantSpec("int8", Tensor()))
    for x in seen:
        ref(x)
    assert torch.equal(q.qparams.scale, ref.calculate_qparams().scale)


@pytest.mark.parametrize("recipe", ["nvfp4", FP8_TENSOR, "w8a8"], ids=str)
def test_apply_equals_the_concatenated_reference(tiny, recipe):
    """apply()'s weights are the group's weights concatenated and quantized with one
    observer, as the runtime's fused tensor; outputs match that reference."""
    model, batches = tiny
    r = preset(recipe) if isinstance(recipe, str) else recipe
    calib = calibrate(model, batches, r, progress=False)
    rule = r.rules[0]
    floats = {n: p.detach().clone() for n, p in model.named_parameters()}
    refs = {}
    for group in all_groups(model):
        w = torch.cat([floats[f"{m}.weight"] for m in group])
        obs = get_observer(rule.weight.observer, rule.weight.spec)
        obs(w)
        q = fake_quantize(w, obs.calculate_qparams(), rule.weight.spec)
        for m, part in zip(group, q.split([floats[f"{m}.weight"].shape[0] for m in group])):
            refs[m] = part
    x = batches[0]
    with torch.inference_mode():
        base = model(x).logits
    with calib.apply(model):
        for m, ref in refs.items():
            torch.testing.assert_close(model.get_submodule(m).weight.detach(), ref,
                                       rtol=1e-6, atol=1e-7)
        # a fused Linear: one GEMM over the concatenated weights, with the shared input qdq
        attn = model.model.layers[0].self_attn
        hid = torch.randn(3, 64)
        ins = [attn.q_proj, attn.k_proj, attn.v_proj]
        fused = torch.nn.functional.linear(
            fake_quantize(hid, calib.states["model.layers.0.self_attn.q_proj"]["input"].qparams,
                          rule.input.spec)
            if rule.input.dynamic is False else hid,
            torch.cat([refs[f"model.layers.0.self_attn.{p}"] for p in QKV]))
        with torch.inference_mode():
            outs = torch.cat([mod(hid) for mod in ins], -1)
        if rule.input.dynamic is False:
            torch.testing.assert_close(outs, fused, rtol=1e-5, atol=1e-5)
        with torch.inference_mode():
            assert not torch.equal(model(x).logits, base)
    assert all(torch.equal(p, floats[n]) for n, p in model.named_parameters())


def test_auto_picks_one_observer_per_group(tiny):
    model, batches = tiny
    calib = calibrate(model, batches, "nvfp4", observer="auto", progress=False)
    for group in all_groups(model):
        for role in ("weight", "input"):
            chosen = {calib.states[m][role].observer for m in group}
            assert len(chosen) == 1, (group, role, chosen)
        gs = {float(calib.states[m]["weight"].qparams.global_scale) for m in group}
        assert len(gs) == 1


def test_recipe_splits_and_adds_groups(tiny):
    model, batches = tiny
    r = replace(preset("nvfp4"), split=("*.v_proj",),
                fuse=(("*.o_proj", "*.down_proj"),))
    calib = calibrate(model, batches, r, progress=False)
    found = [tuple(g["layers"]) for g in calib.info["fusion_groups"]]
    assert ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj") in found
    assert not any("v_proj" in m for g in found for m in g)
    # o_proj and down_proj are in different parents: no group from that pattern
    assert not any("o_proj" in m for g in found for m in g)
    # static_minmax: a running min / max, so the merge of two inputs is their max
    r2 = replace(preset("nvfp4", "static_minmax"),
                 fuse=(("*.self_attn.o_proj", "*.self_attn.q_proj"),))
    calib2 = calibrate(model, batches, r2, progress=False)
    found2 = [tuple(g["layers"]) for g in calib2.info["fusion_groups"]]
    grp = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj")
    assert tuple(sorted(grp)) in [tuple(sorted(g)) for g in found2]
    # o_proj and q_proj read different tensors: their shared input state is the merge
    q = calib2.states[grp[0]]["input"].global_amax
    o = calib2.states[grp[1]]["input"].global_amax
    assert torch.equal(q, o)
    single = calibrate(model, batches, replace(r2, fusion=False), progress=False)
    amax = max(float(single.states[m]["input"].global_amax) for m in grp)
    assert float(q) == pytest.approx(amax, rel=1e-6)
    assert "fusion_groups" not in single.info
    assert Recipe.from_dict(r.to_dict()) == r


def test_fusion_off_keeps_per_layer_scales(tiny):
    model, batches = tiny
    calib = calibrate(model, batches, replace(preset("nvfp4"), fusion=False), progress=False)
    g = groups(0)[0]
    gs = {float(calib.states[m]["weight"].qparams.global_scale) for m in g}
    assert len(gs) > 1  # k_proj was scaled by 3: per layer, the scales differ


def test_recipes_must_agree_on_fusion(tiny):
    model, batches = tiny
    with pytest.raises(ValueError, match="fusion options"):
        calibrate_many(model, batches, {"a": preset("w8a8"),
                                        "b": replace(preset("w8a8"), fusion=False)},
                       progress=False)


def test_export_writes_shared_scales(tiny, tmp_path):
    pytest.importorskip("quantscope.exporters.compressed_tensors")
    from quantscope.exporters import check, export

    model, batches = tiny
    for recipe in ("nvfp4", FP8_TENSOR, "w8a8"):
        calib = calibrate(model, batches, recipe, progress=False)
        out = export(calib, model, tmp_path / str(getattr(recipe, "name", recipe)),
                     format="compressed-tensors")
        assert check(out) == []
    # per-layer scales (fusion off): k_proj's own global scale, flagged by the check
    calib = calibrate(model, batches, replace(preset("nvfp4"), fusion=False), progress=False)
    out = export(calib, model, tmp_path / "per-layer", format="compressed-tensors")
    assert any(p["tensor"] == "weight_global_scale" and "qkv_proj" in p["group"]
               for p in check(out))


def test_auto_output_metric_picks_one_input_observer_per_group(tiny):
    """auto_metric="output" weighs each member's own weights: the group's input observer is
    the one with the least total error over the members, the same for all."""
    model, batches = llama(1)
    attn = model.model.layers[0].self_attn
    seen = []
    h = attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax((0, 1))))
    with torch.inference_mode():
        model(batches[0])
    h.remove()
    c = int(torch.stack(seen).amax(0).argmax())  # the input channel with the largest values
    with torch.no_grad():  # an outlier channel c; q ignores it (clipping it is free), k reads
        model.model.layers[0].input_layernorm.weight[c] = 30.0  # only it (clipping costs all)
        attn.q_proj.weight[:, c] = 0
        keep = attn.k_proj.weight[:, c].clone() * 50
        attn.k_proj.weight.zero_()
        attn.k_proj.weight[:, c] = keep
    calib = calibrate(model, batches, "w8a8", observer="auto", auto_metric="output",
                      progress=False)
    for group in all_groups(model):
        states = [calib.states[m]["input"] for m in group]
        assert len({s.observer for s in states}) == 1
        assert all(torch.equal(s.qparams.scale, states[0].qparams.scale) for s in states)


def test_deepseek_mla_group_found_without_names():
    """q_a_proj and kv_a_proj_with_mqa read the hidden state with q_b_proj run in between:
    found all the same (and the 3-D experts of the block are calibrated too)."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_attention_heads=4, num_key_value_heads=4, n_group=1, topk_group=1,
        num_hidden_layers=1, vocab_size=100)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    calib = calibrate(model, [torch.randint(0, 100, (2, 8))], "nvfp4", progress=False)
    found = [g["layers"] for g in calib.info["fusion_groups"]]
    mla = ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert mla in found
    assert ["model.layers.0.mlp.shared_experts.gate_proj",
            "model.layers.0.mlp.shared_experts.up_proj"] in found
    gs = {float(calib.states[m]["weight"].qparams.global_scale) for m in mla}
    assert len(gs) == 1
    assert sum(r["tokens"] for r in calib.info["experts"]) == 2 * 8 * 2


def test_a_group_stays_within_one_parent_module():
    """T5's cross-attention k / v of every decoder block read the same tensor (the
    encoder's output); the runtime fuses each block's own pair, so a group never spans
    two blocks (it did: one NVFP4 global scale for four layers of two blocks)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "decoder_input_ids": ids}
    cal = calibrate(model, [batch], preset("nvfp4", ignore=("lm_head",)), progress=False)
    cross = [g for g in cal.info["fusion_groups"] if "EncDecAttention.k" in g["layers"][0]]
    assert [g["layers"] for g in cross] == [
        [f"decoder.block.{i}.layer.1.EncDecAttention.{p}" for p in "kv"] for i in range(2)]
    for i in range(2):  # each pair's global scale: its own pair's amax (NVFP4: 448 * 6 / amax)
        attn = model.decoder.block[i].layer[1].EncDecAttention
        amax = torch.cat([attn.k.weight, attn.v.weight]).abs().max()
        gs = cal.states[f"decoder.block.{i}.layer.1.EncDecAttention.k"]["weight"].qparams
        assert torch.equal(gs.global_scale, (448 * 6 / amax.float()).reshape(1))


def test_a_class_target_covers_its_subclasses():
    """compressed-tensors matches a class target against the module's class hierarchy:
    "Linear" covers Falcon's FalconLinear (an nn.Linear subclass). Only the class name was
    compared: Falcon's blocks stayed float while the exported config said "Linear"."""
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(MyLinear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert set(preset("w8a8").match(model)) == {"0", "2"}
    assert set(preset("w8a8", targets="MyLinear").match(model)) == {"0"}


class _Pair(torch.nn.Module):
    """Two Linears reading one input: a fusion group (found from the forward)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4, bias=False)
        self.b = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("candidates", [("minmax", "mse"), ("mse", "minmax")])
def test_a_groups_joined_weights_keep_the_first_listed_candidate_on_a_tie(candidates):
    """A group sharing one per-tensor fp8 weight scale gets it from the candidate of least
    error on the joined weights, the first listed where errors tie (a later one must do
    strictly better): weights reaching 448 and holding values e4m3 represents are exact
    under min-max's scale 1 and under the MSE search's (which tries that range too)."""
    model = torch.nn.Sequential(_Pair())
    with torch.no_grad():
        model[0].a.weight.copy_(torch.tensor([1.0, 2, 4, 8, 16, -1, -2, 0.5]).repeat(4, 1))
        model[0].b.weight.copy_(torch.tensor([448.0, -448, 3, -6, 12, 0.25, 0, 1]).repeat(4, 1))
    recipe = Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "auto")),))
    calib = calibrate(model, [torch.randn(4, 8)], recipe, progress=False,
                      auto=Auto(metric="tensor", candidates=candidates))
    assert [g["layers"] for g in calib.info["fusion_groups"]] == [["0.a", "0.b"]]
    for name, layer in (("0.a", model[0].a), ("0.b", model[0].b)):
        state = calib.states[name]["weight"]
        assert float(state.qparams.scale) == 1.0  # 448 / 448: no error
        assert torch.equal(fake_quantize(layer.weight, state.qparams, state.spec), layer.weight)
        assert state.observer == f"memoryless_{candidates[0]}"
