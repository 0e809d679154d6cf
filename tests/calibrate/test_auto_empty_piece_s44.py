"""A scoring piece (or a sensitivity batch) with no real token: an attention mask all 0 (a
document of padding only). The KL over no position was 0 / 0, NaN, and ``auto`` raised that
the quantized model's output was not finite (it was): such a piece is left out of the score,
for every candidate alike. Errors name a scoring piece as one, with the batch it comes from."""

from __future__ import annotations

import pytest
import torch

from quantscope.calibration import Auto, apply, calibrate, calibrate_many, preset, sensitivity
from quantscope.calibration.choice.score_set import score_pieces

NAMES = ["minmax", "mse"]


def _llama(empty_rows=(0,)):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (4, 12), generator=g),
                "attention_mask": torch.ones(4, 12, dtype=torch.long)} for _ in range(2)]
    for r in empty_rows:  # the first scoring piece is the first batch's row 0
        batches[0]["attention_mask"][r] = 0
    return model, batches


def _kl(model, batch, states) -> float:
    """KL(p_float || p_quant) of the next-token distributions, mean over the real positions,
    written out directly in float64."""
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch).logits.double(), -1)
        with apply(model, states):
            q = torch.log_softmax(model(**batch).logits.double(), -1)
    keep = batch["attention_mask"].bool()
    return float((ref.exp() * (ref - q)).sum(-1)[keep].mean())


def test_auto_leaves_a_piece_without_tokens_out_of_every_candidates_score():
    model, batches = _llama()
    pieces = score_pieces(batches, 1024)
    assert [int(p["attention_mask"].sum()) for p in pieces] == [0, 36, 48]
    auto = calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                     progress=False)
    info = auto.info["auto"]
    assert info["score_pieces"] == 2 and info["score_tokens"] == 84
    assert info["pieces_scored"]["minmax"] == 2
    singles = calibrate_many(model, batches, {n: preset("w8a8", n) for n in NAMES},
                             progress=False)
    for n in NAMES:
        k = info["pieces_scored"][n]
        direct = sum(_kl(model, p, singles[n].states) for p in pieces[1:1 + k]) / k
        assert info["scores"][n] == pytest.approx(direct, rel=1e-3, abs=1e-12)


def test_auto_refuses_documents_with_no_real_token_at_all():
    model, batches = _llama()
    for b in batches:
        b["attention_mask"].zero_()
    with pytest.raises(ValueError, match=r"^auto: the documents compared hold no real token "
                                         r"\(every attention mask is all 0\)"):
        calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                  progress=False)


def test_an_error_on_a_scoring_piece_names_the_piece_and_its_batch_rows():
    model, batches = _llama(empty_rows=())
    with pytest.raises(ValueError, match=r"^auto: loss returned nan on scoring piece 0 \(rows "
                                         r"0:1 of calibration batch 0, counting from 0\), "):
        calibrate(model, batches, "w8a8", progress=False, observer="auto",
                  auto=Auto(candidates=NAMES, loss=lambda out, ref, b: float("nan")))


def test_sensitivity_leaves_a_batch_without_tokens_out():
    model, batches = _llama(empty_rows=range(4))  # the first batch: padding only
    calib = calibrate(model, batches, "w8a8", progress=False)
    got = sensitivity(model, batches, calibration=calib)
    alone = sensitivity(model, batches[1:], calibration=calib)
    assert got.info["batches"] == 1
    assert [(r["layer"], r["role"]) for r in got.rows] == [
        (r["layer"], r["role"]) for r in alone.rows]
    for r, a in zip(got.rows, alone.rows):
        assert r["divergence"] == a["divergence"] > 0
        st = calib.states[r["layer"]][r["role"]]
        assert r["divergence"] == pytest.approx(
            _kl(model, batches[1], {r["layer"]: {r["role"]: st}}), rel=1e-3, abs=1e-12)
