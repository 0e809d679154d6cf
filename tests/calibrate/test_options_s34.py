"""Options probe s34: Auto(score_tokens=N) counted each dict batch without an attention_mask
as one token (N whole batches scored), and under sequential each block counted its batch
numbers as one token each; Auto(loss=...) with sequential reached the user's loss with a
decoder block's output tensor; MoE(min_tokens=...) moved the shared static expert input
range by an ulp (w * own + (1 - w) * pooled rounds where own == pooled)."""

import copy

import pytest
import torch
from tiny_models import llama

import quantscope
from quantscope.calibration import Auto, MoE
from quantscope.calibration.choice import auto as auto_mod
from quantscope.calibration.choice.auto import score_batches

transformers = pytest.importorskip("transformers")

ROWS, POSITIONS, VOCAB = 2, 16, 100  # each batch: 2 documents of 16 tokens, no padding
#: the first documents holding 40 tokens: batch 0 (32 tokens) and one row of batch 1 (16),
#: in 3 scoring pieces (batch 0 cut in two by rows, then batch 1's row)
ASKED, WANT_TOKENS, WANT_PIECES = 40, 32 + 16, 3


def _batches(mask: bool, n: int = 4):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (ROWS, POSITIONS), generator=g) for _ in range(n)]
    return [{"input_ids": i, **({"attention_mask": torch.ones_like(i)} if mask else {})}
            for i in ids]


@pytest.fixture
def scored(monkeypatch):
    """The rows each scoring piece compares, by the piece's float reference (every piece has
    its own): next-token positions for KL (a causal LM), documents for 1 - cosine (a
    block's mean-pooled outputs). The references are kept alive: their ids stay unique."""
    seen = {}
    real = auto_mod._divergence

    def counting(kind, q, ref):
        seen.setdefault(id(ref), (ref, kind, q.shape[0]))
        return real(kind, q, ref)

    monkeypatch.setattr(auto_mod, "_divergence", counting)
    return seen


def _tokens(seen) -> int:
    """Tokens the pieces compared: a KL row is a token, a cosine row a document."""
    return sum(n if kind == "kl" else n * POSITIONS for _, kind, n in seen.values())


def _auto(model, batches, **kw):
    return quantscope.calibrate(model, batches, "w8a8", observer="auto",
                                auto=Auto(candidates=("minmax", "mse"), score_tokens=ASKED),
                                progress=False, **kw)


@pytest.mark.parametrize("key", ["input_ids", "inputs_embeds"])
def test_score_batches_counts_a_dict_without_mask_by_its_tensor(key):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (ROWS, POSITIONS), generator=g)
    value = ids if key == "input_ids" else torch.randn(ROWS, POSITIONS, 8, generator=g)
    # ids: every entry a token; features [rows, positions, width]: every position a token
    out = score_batches([{key: value}] * 4, ASKED)
    assert [b[key].shape[0] for b in out] == [ROWS, 1]  # 32 tokens, then 1 row of 16


def test_score_tokens_on_dicts_without_mask_count_their_ids(scored):
    model = llama()[0]
    calib = _auto(copy.deepcopy(model), _batches(mask=False))
    assert _tokens(scored) == WANT_TOKENS
    assert len(scored) == WANT_PIECES
    assert calib.info["auto"]["score_tokens"] == WANT_TOKENS
    assert calib.info["auto"]["score_pieces"] == WANT_PIECES
    scored.clear()  # the same documents with a mask of ones: the same scoring
    masked = _auto(copy.deepcopy(model), _batches(mask=True))
    assert _tokens(scored) == WANT_TOKENS
    assert masked.info["auto"]["score_tokens"] == WANT_TOKENS


@pytest.mark.parametrize("mask", [True, False])
def test_sequential_scores_the_tokens_the_whole_model_run_scores(scored, mask):
    model = llama()[0]
    whole = _auto(copy.deepcopy(model), _batches(mask))
    whole_tokens = _tokens(scored)
    assert whole_tokens == WANT_TOKENS
    scored.clear()
    seq = _auto(copy.deepcopy(model), _batches(mask), sequential=True)
    blocks = seq.info["auto"]["blocks"]
    assert len(blocks) == 2
    for info in blocks.values():
        assert info["score_tokens"] == whole.info["auto"]["score_tokens"] == WANT_TOKENS
        assert info["score_pieces"] == whole.info["auto"]["score_pieces"] == WANT_PIECES
    # each block compared the same documents' outputs: 3 pieces of one row each
    assert len(scored) == 2 * WANT_PIECES
    assert _tokens(scored) == 2 * whole_tokens


def test_sequential_refuses_auto_loss_naming_both():
    calls = []

    def loss(out, ref, batch):
        calls.append(type(out).__name__)
        return float((out.logits - ref.logits).pow(2).mean())

    with pytest.raises(ValueError, match=r"Auto\.loss.*sequential.*drop loss="):
        quantscope.calibrate(llama()[0], _batches(mask=False), "w8a8", observer="auto",
                             auto=Auto(candidates=("minmax", "mse"), loss=loss),
                             sequential=True, progress=False)
    assert calls == []  # refused before any forward reached it
    # the whole model takes it, with the model's output
    quantscope.calibrate(llama()[0], _batches(mask=False, n=2), "w8a8", observer="auto",
                         auto=Auto(candidates=("minmax", "mse"), loss=loss), progress=False)
    assert calls and set(calls) == {"CausalLMOutputWithPast"}


def test_moe_min_tokens_keeps_the_widest_shared_expert_input_range():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg).eval()
    batches = _batches(mask=False)
    # every expert its own range (each saw a token), then every one shrunk toward the pooled
    own = quantscope.calibrate(copy.deepcopy(model), batches, "w8a8", moe=MoE(min_tokens=1),
                               progress=False)
    shrunk = quantscope.calibrate(copy.deepcopy(model), batches, "w8a8",
                                  moe=MoE(min_tokens=1000), progress=False)
    counts = [e["tokens"] for e in shrunk.info["experts"]]
    assert counts and 0 < min(counts) and max(counts) < 1000  # all shrunk, none unseen
    inputs = [layer for layer, roles in own.states.items()
              if ".experts." in layer and "input" in roles]
    assert inputs
    for layer in inputs:
        a, b = own.states[layer]["input"], shrunk.states[layer]["input"]
        # shared: the widest of the experts', which shrinking leaves as it is (own == pooled)
        assert torch.equal(a.hi, b.hi) and torch.equal(a.lo, b.lo), layer
        assert torch.equal(a.qparams.scale, b.qparams.scale), layer
