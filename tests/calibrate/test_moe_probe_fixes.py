"""MoE probe fixes: experts modules quantscope cannot route, post-expert norms, ModuleList
experts skipped by the fusion detection, the all_experts message."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantscope.calibration import MoE, calibrate, preset
from quantscope.calibration.structure import moe

transformers = pytest.importorskip("transformers")


def llama4():
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
        num_local_experts=4, num_experts_per_tok=1, moe_layers=[0], no_rope_layers=[1],
        attention_chunk_size=16)
    return transformers.Llama4ForCausalLM(cfg).eval(), [torch.randint(0, 100, (1, 8))]


def test_llama4_experts_left_to_their_forward_and_named_unreached():
    """Llama4's text experts (3-D, forward(hidden_states) only) are not routed experts:
    calibrate leaves them to their own forward and names their weights, with a warning."""
    model, batches = llama4()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib = calibrate(model, batches, "w8a8", progress=False)
    name = "model.layers.0.feed_forward.experts"
    assert {u["name"] for u in calib.info["unreached"]} == {f"{name}.gate_up_proj",
                                                            f"{name}.down_proj"}
    assert any("cannot reach" in str(w.message) for w in caught)
    assert not any(".experts." in k for k in calib.states)
    ignored = calibrate(model, batches, preset("w8a8", ignore=["*experts*"]), progress=False)
    assert "unreached" not in ignored.info and ignored.states


def test_attach_skips_experts_no_recipe_quantizes():
    """``recipes``: an experts module every recipe ignores keeps its own forward."""
    from tiny_models import mixtral

    model, _ = mixtral()
    with moe.attach(model, recipes=[preset("w8a8", ignore=["re:.*layers\\.0\\.mlp\\.experts.*"])
                                    ]) as ex:
        assert not any(k.startswith("model.layers.0.") for k in ex.layers)
        assert any(k.startswith("model.layers.1.mlp.experts.0.") for k in ex.layers)
        assert "forward" not in model.model.layers[0].mlp.experts.__dict__


def muse_spark():
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextModel

    torch.manual_seed(0)
    cfg = MuseSparkTextConfig(vocab_size=100, hidden_size=64, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16)
    for k, v in {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_hidden_size": 64,
                 "moe_intermediate_size": 64}.items():
        setattr(cfg, k, v)
    model = MuseSparkTextModel(cfg).eval()
    (ex,) = [m for m in model.modules() if getattr(m, "has_post_expert_norm", False)]
    with torch.no_grad():  # a norm that changes the output
        for p in ex.post_expert_norm.parameters():
            p.fill_(3.0)
    return model, torch.randint(0, 100, (1, 8))


@pytest.mark.parametrize("all_experts", [False, True])
def test_routed_forward_applies_post_expert_norm(all_experts):
    pytest.importorskip("transformers.models.muse_spark")
    model, x = muse_spark()
    with torch.no_grad():
        ref = model(x).last_hidden_state
        with moe.attach(model, all_experts=all_experts):
            got = model(x).last_hidden_state
    # all_experts multiplies every token by every expert: other matrix shapes than the routed
    # forward's, summed in another order on some CPUs (AVX2); a missing norm is order 1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class _Expert(nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.w1 = nn.Linear(d, i, bias=False)
        self.w3 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ListMoe(nn.Module):
    """Routes as remote-code MoE blocks do (an expert given no token is not called); a batch
    whose first value is over 100 routes nothing to expert 3."""

    def __init__(self, d=64, i=64, n=4):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([_Expert(d, i) for _ in range(n)])

    def forward(self, x):
        logits = self.gate(x)
        if x[0, 0] > 100:
            logits = logits.clone()
            logits[:, 3] = -1e9
        w, idx = logits.softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            tok, pos = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, ex(x[tok]) * w[tok, pos, None])
        return out


def test_modulelist_expert_skipped_by_detection_still_fused():
    """Expert 3 gets no token in the first batch (the fusion detection's), tokens later: its
    w1 / w3 still share one NVFP4 weight global scale, as vLLM's w13 keeps one."""
    torch.manual_seed(0)
    model = nn.Sequential(_ListMoe()).eval()
    first = torch.randn(16, 64)
    first[0, 0] = 1000.0
    calib = calibrate(model, [first] + [torch.randn(16, 64) for _ in range(3)], "nvfp4",
                      progress=False)
    groups = [tuple(g["layers"]) for g in calib.info["fusion_groups"]]
    assert ("0.experts.3.w1", "0.experts.3.w3") in groups
    for e in range(4):
        g1, g3 = (calib.states[f"0.experts.{e}.{k}"]["weight"].qparams.global_scale
                  for k in ("w1", "w3"))
        assert torch.equal(g1, g3), e


def test_all_experts_message_names_the_option_object():
    model = nn.Sequential(_ListMoe()).eval()
    with pytest.raises(ValueError, match=r"moe=MoE\(all_experts=True\)"):
        calibrate(model, [torch.randn(16, 64)], "w8a8", progress=False,
                  moe=MoE(all_experts=True))
