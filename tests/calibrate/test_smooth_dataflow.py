"""SmoothQuant's data-flow check (calibration/choice/smooth.py, ``_Flow``): a mapping found by
name is kept only if its balanced Linears read exactly its ``previous`` module's output and
no other Linear does, so the smoothed model computes the same function."""

import pytest
import torch
from torch import nn

from quantscope import comm
from quantscope.calibration.choice import smooth as sm

_COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}


def _tiny(kind):
    """A random 2-layer decoder with norm weights away from 1 and one outlier channel in the
    embeddings (so a wrong smoothing shows in the logits)."""
    import transformers

    cls, cfg = {"cohere": (transformers.CohereForCausalLM, transformers.CohereConfig),
                "phi": (transformers.PhiForCausalLM, transformers.PhiConfig),
                "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config),
                "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[kind]
    torch.manual_seed(0)
    model = cls(cfg(**_COMMON)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(torch.rand_like(p) + 0.5)
        model.model.embed_tokens.weight[:, 3] *= 20
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(3, 100, (2, 12), generator=g) for _ in range(2)]


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(b).logits for b in batches])


# the norm each architecture routes elsewhere than its name says, and why (their modeling code):
# Cohere / Phi run attention and MLP in parallel on one input_layernorm output; OLMo2's
# post_attention_layernorm normalizes the attention output, the MLP reads the residual
@pytest.mark.parametrize("kind, norm, why", [
    ("cohere", "input_layernorm", "also feeds model.layers.{i}.mlp.gate_proj"),
    ("phi", "input_layernorm", "also feeds model.layers.{i}.mlp.fc1"),
    ("olmo2", "post_attention_layernorm", "mlp.gate_proj reads another tensor"),
])
def test_a_norm_that_feeds_other_layers_is_left_alone(kind, norm, why):
    model, batches = _tiny(kind)
    ref = _logits(model, batches)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if norm in n}
    info = sm.smooth(model, batches[:1], 0.5)
    torch.testing.assert_close(_logits(model, batches), ref, rtol=1e-5, atol=1e-6)
    names = [f"model.layers.{i}.{norm}" for i in range(2)]
    assert [n for n in info["skipped"] if n.endswith(norm)] == names
    for i, n in enumerate(names):
        assert why.format(i=i) in info["why"][n]
    assert not set(names) & set(info["smoothed"]) and not set(names) & set(info["scales"])
    assert all(torch.equal(model.get_parameter(n), v) for n, v in norms.items())


def test_the_gated_mlps_of_those_models_are_still_smoothed():
    for kind in ("cohere", "olmo2"):
        model, batches = _tiny(kind)
        info = sm.smooth(model, batches[:1], 0.5)
        assert info["smoothed"] == [f"model.layers.{i}.mlp.up_proj" for i in range(2)]


def test_llama_is_smoothed_whole():
    model, batches = _tiny("llama")
    ref = _logits(model, batches)
    info = sm.smooth(model, batches[:1], 0.5)
    assert info["skipped"] == [] and info["why"] == {}
    assert info["smoothed"] == [m.previous for m in sm.find_mappings(model)]
    assert len(info["smoothed"]) == 6
    torch.testing.assert_close(_logits(model, batches), ref, rtol=1e-5, atol=1e-6)


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x * self.weight


class _Block(nn.Module):
    """``input_layernorm`` into q / k / v; ``extra`` reads a copy of the norm's output
    (``copy``) or the block's input."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.input_layernorm = _Norm(8)
        self.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj"):
            setattr(self.self_attn, n, nn.Linear(8, 8))
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        h = self.input_layernorm(x)
        a = self.self_attn
        # q reads a copy of h: the same values, so still the mapping's input
        out = a.q_proj(h.clone()) + a.k_proj(h) + a.v_proj(h)
        return out + self.extra(h.clone() if self.copy else x)


@pytest.mark.parametrize("copy", [True, False])
def test_a_copy_of_the_output_counts_as_the_output(copy):
    torch.manual_seed(0)
    model = _Block(copy)
    x = [torch.randn(4, 8) * 5]
    with torch.no_grad():
        ref = model(x[0])
        info = sm.smooth(model, x, 0.5)
        got = model(x[0])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if copy:
        assert info["skipped"] == ["input_layernorm"]
        assert "also feeds extra" in info["why"]["input_layernorm"]
    else:
        assert info["smoothed"] == ["input_layernorm"] and info["skipped"] == []


def test_a_mapping_another_rank_rejects_is_skipped_on_every_rank(monkeypatch):
    """The verdicts ride the ranges' one collective (MIN): a rank whose flow fits follows one
    whose flow does not, so every rank smooths alike."""
    model, batches = _tiny("llama")
    n = len(sm.find_mappings(model))

    def other_rank_rejects_the_first(t, op, group):
        t[-n - 1] = 0.0  # the first mapping's flag (before the failure flag, last), as a
        # rank whose flow does not fit sends it

    monkeypatch.setattr(comm, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(comm, "group_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(comm, "all_reduce", other_rank_rejects_the_first)
    info = sm.smooth(model, batches[:1], 0.5, distributed=True)
    assert info["skipped"] == ["model.layers.0.input_layernorm"]
    assert "another rank" in info["why"]["model.layers.0.input_layernorm"]
    assert len(info["smoothed"]) == n - 1
