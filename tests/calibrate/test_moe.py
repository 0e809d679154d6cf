"""MoE experts: 3-D experts modules and ModuleList experts, every expert calibrated soundly."""

import math
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from quantscope import Channel, QuantSpec, fake_quantize, qparams_from_range
from quantscope.calibration import PRESETS, calibrate, preset
from quantscope.calibration.results.apply import qdq_tensor

transformers = pytest.importorskip("transformers")

from tiny_models import STARVED, mixtral, qwen2_moe, starve


def experts_of(model):
    return [(f"model.layers.{i}.mlp.experts", layer.mlp.experts)
            for i, layer in enumerate(model.model.layers)]


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, snap):
    sd = model.state_dict()
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in snap)


@pytest.fixture(scope="module")
def moe_model():
    return mixtral()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_expert_calibrated_and_applied(moe_model, preset):
    model, batches = moe_model
    snap = snapshot(model)
    calib = calibrate(model, batches, preset, progress=False)
    assert unchanged(model, snap)
    assert all("forward" not in ex.__dict__ and "0" not in ex._modules
               for _, ex in experts_of(model))
    rules = {}
    for e_row in calib.info["experts"]:
        rules[(e_row["module"], e_row["expert"])] = (e_row["tokens"], e_row["rule"])
    for name, ex in experts_of(model):
        n_exp = ex.gate_up_proj.shape[0]
        static = PRESETS[preset]("minmax").input
        if static is None or static.dynamic is True:  # nothing calibrated from tokens
            assert rules[(name, STARVED)] == (0, "no calibrated activation scale")
        else:
            assert rules[(name, STARVED)] == (0, "pooled (no tokens)")
        if static is not None:  # the forward ran: top-2 routing, 3 batches of 2 x 12
            assert sum(rules[(name, e)][0] for e in range(n_exp)) == 2 * 2 * 12 * 3
        for e in range(n_exp):
            for proj in ("gate_up_proj", "down_proj"):
                roles = calib.states[f"{name}.{e}.{proj}"]
                assert "weight" in roles
                for role, st in roles.items():
                    for t in (st.qparams.scale if st.qparams else None,
                              st.qparams.global_scale if st.qparams else None,
                              st.global_amax, st.lo, st.hi):
                        if t is not None:
                            assert torch.isfinite(t).all(), (name, e, proj, role)
                    if role == "input" and not st.dynamic is True:
                        assert st.qparams is not None or st.global_amax is not None
    # apply: each expert's weight slice is what its state says; undone exactly
    x = batches[0]
    with torch.inference_mode():
        base = model(x).logits
    with calib.apply(model):
        for name, ex in experts_of(model):
            for e in range(ex.gate_up_proj.shape[0]):
                for proj in ("gate_up_proj", "down_proj"):
                    st = calib.states[f"{name}.{e}.{proj}"]["weight"]
                    ref = qdq_tensor(snap[f"{name}.{proj}"][e], st)
                    assert torch.equal(getattr(ex, proj).detach()[e], ref)
        with torch.inference_mode():
            assert not torch.equal(model(x).logits, base)
    assert unchanged(model, snap)
    assert all("forward" not in ex.__dict__ and "0" not in ex._modules
               for _, ex in experts_of(model))
    with torch.inference_mode():
        assert torch.equal(model(x).logits, base)


def test_expert_inputs_quantized_as_their_qparams_say(moe_model):
    """Under apply, an expert's input is fake-quantized with its state's static scale (the
    one its experts module shares: test_moe_shared_inputs.py)."""
    model, batches = moe_model
    calib = calibrate(model, batches, "w8a8", progress=False)
    name, ex = experts_of(model)[0]
    seen = {}
    with calib.apply(model):
        child = ex._modules["1"].gate_up_proj
        h = child.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].clone()))
        h2 = child.register_forward_hook(lambda m, a, o: seen.setdefault("y", o.clone()))
        with torch.inference_mode():
            model(batches[0])
        h.remove()
        h2.remove()
        st = calib.states[f"{name}.1.gate_up_proj"]
        w = child.weight.detach()
        # a hook registered after apply's sees the input apply's hook quantized: it is on
        # the expert's int8 grid (its state's scale), and the output is that input times W^T
        x = seen["x"]
        scale = st["input"].qparams.scale
        assert torch.equal(fake_quantize(x, st["input"].qparams, st["input"].spec), x)
        codes = x / scale
        assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 128
        assert codes.abs().max() > 60  # the scale spans the data, not a far larger range
        torch.testing.assert_close(seen["y"], x @ w.T, rtol=1e-5, atol=1e-6)


def test_no_token_expert_gets_pooled_range(moe_model):
    model, batches = moe_model
    calib = calibrate(model, batches, "w8a8", progress=False, expert_min_tokens=1)
    name = experts_of(model)[0][0]
    seen = [calib.states[f"{name}.{e}.down_proj"]["input"] for e in range(3)]
    lo = torch.stack([s.lo for s in seen]).amin(0)
    hi = torch.stack([s.hi for s in seen]).amax(0)
    starved = calib.states[f"{name}.{STARVED}.down_proj"]["input"]
    ref = qparams_from_range(lo, hi, starved.spec)
    assert torch.equal(starved.qparams.scale.reshape(-1), ref.scale.reshape(-1))


def test_few_token_experts_shrunk_toward_pooled(moe_model):
    """Per-channel static inputs (per-tensor ones end as the module's one range, as vLLM
    serves them: test_moe_shared_inputs.py) keep each expert's shrunk range."""
    model, batches = moe_model
    base = preset("w8a8")
    rule = base.rules[0]
    recipe = replace(base, rules=(replace(rule, input=replace(
        rule.input, spec=QuantSpec("int8", Channel(-1)))),))
    own = calibrate(model, batches, recipe, progress=False, expert_min_tokens=1)
    big = 10_000
    shrunk = calibrate(model, batches, recipe, progress=False, expert_min_tokens=big)
    name = experts_of(model)[0][0]
    counts = {r["expert"]: r["tokens"] for r in shrunk.info["experts"] if r["module"] == name}
    states = [own.states[f"{name}.{e}.down_proj"]["input"] for e in range(3)]
    assert not torch.equal(states[0].hi, states[1].hi)  # the experts' own ranges
    phi = torch.stack([s.hi for s in states]).amax(0)
    for e in range(3):
        w = counts[e] / big
        s = shrunk.states[f"{name}.{e}.down_proj"]["input"]
        torch.testing.assert_close(s.hi, w * states[e].hi + (1 - w) * phi)
    rules = [r["rule"] for r in shrunk.info["experts"]]
    assert any(r.startswith("shrunk") for r in rules)
    md = shrunk.report().to_markdown()
    assert "MoE experts" in md and "pooled (no tokens)" in md


def test_all_experts_sees_every_token_and_keeps_outputs(moe_model):
    model, batches = moe_model
    blocks = [layer.mlp for layer in model.model.layers]
    floats = []
    with torch.inference_mode():
        for b in batches:
            outs = []
            hs = [blk.register_forward_hook(lambda m, a, o, outs=outs: outs.append(o.clone()))
                  for blk in blocks]
            model(b)
            for h in hs:
                h.remove()
            floats.append(outs)
    during = []

    def keep(m, a, o):
        during.append(o.clone())
    hs = [blk.register_forward_hook(keep) for blk in blocks]
    try:
        calib = calibrate(model, batches, "w8a8", progress=False, all_experts=True)
    finally:
        for h in hs:
            h.remove()
    # the detection forward (fusion groups) runs batch 0 once more, first
    during = during[len(blocks):]
    ref = [o for outs in floats for o in outs]
    assert len(during) == len(ref)
    for a, b in zip(during, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    tokens = 2 * 12 * 3
    assert all(r["tokens"] == tokens and r["rule"] == "all tokens (all_experts)"
               for r in calib.info["experts"])


class OldExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), \
            nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class OldMoe(nn.Module):
    """A pre-transformers-5 Mixtral block: a ModuleList of experts, routed by masks."""

    def __init__(self, d=64, h=128, n=4, k=2):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(OldExpert(d, h) for _ in range(n))
        self.k = k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        logits[:, STARVED] = -math.inf
        w, idx = torch.topk(torch.softmax(logits, -1), self.k, -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, expert(flat[tok]) * w[tok, pos, None])
        return out.reshape(x.shape)


def test_modulelist_experts_count_the_tokens_routed_to_them():
    """A ModuleList expert's token count is the rows it was given (its calls would put
    every expert under expert_min_tokens, shrinking each range toward the pooled one), as
    the routing gives them: the gate's top-k replayed here."""
    torch.manual_seed(0)
    moe = OldMoe()
    model = nn.Sequential(moe).eval()
    batches = [torch.randn(2, 8, 64) for _ in range(3)]
    routed = [0] * len(moe.experts)
    with torch.no_grad():
        for x in batches:
            logits = moe.gate(x.reshape(-1, 64))
            logits[:, STARVED] = -math.inf
            idx = torch.topk(torch.softmax(logits, -1), moe.k, -1).indices
            for e in range(len(routed)):
                routed[e] += int((idx == e).sum())
    calib = calibrate(model, batches, "w8a8", progress=False, expert_min_tokens=4)
    got = {r["expert"]: (r["tokens"], r["rule"]) for r in calib.info["experts"]}
    assert [got[e][0] for e in range(len(routed))] == routed
    assert sum(routed) == 3 * 16 * moe.k and min(n for n in routed if n) >= 4
    assert {got[e][1] for e in got if routed[e]} == {"own"}
    # an expert given exactly min_tokens keeps its own range (shrunk only below it)
    fewest = min(n for n in routed if n)
    calib = calibrate(model, batches, "w8a8", progress=False, expert_min_tokens=fewest)
    got = {r["expert"]: r["rule"] for r in calib.info["experts"]}
    assert got[routed.index(fewest)] == "own", got


def test_modulelist_experts():
    torch.manual_seed(0)
    model = nn.Sequential(OldMoe()).eval()
    batches = [torch.randn(2, 8, 64) for _ in range(3)]
    calib = calibrate(model, batches, "nvfp4", progress=False)
    st = calib.states[f"0.experts.{STARVED}.w1"]["input"]
    assert torch.isfinite(st.global_amax).all()
    rules = {r["expert"]: r["rule"] for r in calib.info["experts"]}
    assert rules[STARVED] == "pooled (no tokens)"
    # w1 and w3 of an expert read one tensor: a fusion group with one global scale
    g1 = calib.states["0.experts.0.w1"]["weight"].qparams.global_scale
    g3 = calib.states["0.experts.0.w3"]["weight"].qparams.global_scale
    assert torch.equal(g1, g3)
    with pytest.raises(ValueError, match="all_experts"):
        calibrate(model, batches, "w8a8", progress=False, all_experts=True)


class DenseMoe(OldMoe):
    """A soft MoE: every expert (and the router) reads the same tensor."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w = torch.softmax(self.gate(flat), -1)
        out = sum(expert(flat) * w[:, e, None] for e, expert in enumerate(self.experts))
        return out.reshape(x.shape)


def nvfp4_global_scale(*weights):
    """The NVFP4 weight global scale of a min-max observer: 448 * 6 / absmax."""
    return 448 * 6 / torch.cat([w.detach().float() for w in weights]).abs().amax()


def test_experts_reading_one_tensor_fuse_only_their_own_w1_w3():
    torch.manual_seed(0)
    model = nn.Sequential(DenseMoe()).eval()
    calib = calibrate(model, [torch.randn(2, 8, 64)], "nvfp4", progress=False)
    groups = [tuple(g["layers"]) for g in calib.info["fusion_groups"]]
    assert groups == [(f"0.experts.{e}.w1", f"0.experts.{e}.w3") for e in range(4)]
    for e, ex in enumerate(model[0].experts):
        own = nvfp4_global_scale(ex.w1.weight, ex.w3.weight)
        for proj in ("w1", "w3"):
            gs = calib.states[f"0.experts.{e}.{proj}"]["weight"].qparams.global_scale
            torch.testing.assert_close(gs.float().reshape(()), own)


@pytest.mark.parametrize("make", [mixtral, qwen2_moe])
def test_all_experts_keeps_each_experts_own_scales(make):
    """all_experts=True feeds every expert (and a shared expert) one tensor: still no fusion
    group joins two experts or an expert and another layer; each expert's weight global
    scale is its own, as in routed mode."""
    model, batches = make()
    calibs = {ae: calibrate(model, batches, "nvfp4", progress=False, all_experts=ae)
              for ae in (False, True)}
    for calib in calibs.values():
        groups = [set(g["layers"]) for g in calib.info["fusion_groups"]]
        assert not any(".experts." in m for g in groups for m in g), groups
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "shared_expert"):  # its gate / up still one group
                pair = {f"model.layers.{i}.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj")}
                assert any(pair <= g for g in groups), groups
    for name, ex in experts_of(model):
        for e in range(ex.gate_up_proj.shape[0]):
            own = nvfp4_global_scale(ex.gate_up_proj[e])
            for calib in calibs.values():
                gs = calib.states[f"{name}.{e}.gate_up_proj"]["weight"].qparams.global_scale
                torch.testing.assert_close(gs.float().reshape(()), own)


def test_unreachable_weights_are_named():
    class Stacked(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 16, 16))
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(torch.einsum("bi,eoi->bo", x, self.w))

    model = nn.Sequential(Stacked()).eval()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        calib = calibrate(model, [torch.randn(4, 16)], "w8a8", progress=False)
    assert any("0.w" in str(w.message) for w in got)
    assert [u["name"] for u in calib.info["unreached"]] == ["0.w"]
    assert "0.w" in calib.report().to_markdown()


def test_qwen2_moe_with_shared_expert():
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    starve(model.model.layers[0].mlp.gate)
    batches = [torch.randint(0, 100, (2, 10)) for _ in range(2)]
    calib = calibrate(model, batches, "nvfp4", progress=False)
    for e in range(4):
        st = calib.states[f"model.layers.0.mlp.experts.{e}.gate_up_proj"]
        assert torch.isfinite(st["weight"].qparams.global_scale).all()
        assert torch.isfinite(st["input"].global_amax).all()


def test_conv3d_is_not_unreached():
    model = nn.Sequential(nn.Conv3d(2, 2, 3), nn.Flatten(), nn.LazyLinear(4))
    model(torch.randn(1, 2, 4, 4, 4))
    calib = calibrate(model, [torch.randn(1, 2, 4, 4, 4)], "w8a8", progress=False)
    assert "unreached" not in calib.info


def test_a_stack_of_one_is_not_unreached_experts():
    """ViT's cls_token (1, 1, H) and position embeddings (1, N, H) are 3-D parameters of a
    module quantscope does not run, but no stack of experts (several along dim 0): they were
    warned about as weights a Linear recipe targets."""
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(x + self.cls_token[0, 0])

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        calib = calibrate(nn.Sequential(Embed()).eval(), [torch.randn(4, 16)], "w8a8",
                          progress=False)
    assert not any("cannot reach" in str(w.message) for w in got)
    assert "unreached" not in calib.info


def test_save_load_apply_experts(moe_model, tmp_path):
    from quantscope.calibration import load

    model, batches = moe_model
    calib = calibrate(model, batches, "nvfp4", progress=False)
    calib.save(tmp_path / "q")
    x = batches[0]
    with calib.apply(model), torch.inference_mode():
        a = model(x).logits
    with load(tmp_path / "q").apply(model), torch.inference_mode():
        b = model(x).logits
    assert torch.equal(a, b)
