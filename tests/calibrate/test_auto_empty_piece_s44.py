"""A scoring piece (or a sensitivity batch) with no real token: an attention mask all 0 (a
document of padding only). The KL over no position was 0 / 0, NaN, and ``auto`` raised that
the quantized model's output was not finite (it was): such a piece is left out of the score,
for every candidate alike. Errors name a scoring piece as one, with the batch it comes from."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tiny_models import Sqrt
from torch import nn

from quantscope.calibration import (
    Auto,
    Runtime,
    apply,
    calibrate,
    calibrate_many,
    preset,
    sensitivity,
)
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


def test_sequential_auto_leaves_a_piece_without_tokens_out_as_the_whole_model_does():
    """Block by block (sequential=True) the pieces are batch numbers and rows, their real
    tokens read from the user's batches, not the block's inputs (which hold no mask)."""
    model, batches = _llama()
    whole = calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                      progress=False)
    seq = calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                    progress=False, sequential=True)
    # 3 pieces (rows 0:1 and 1:4 of batch 0, batch 1), the first of no real token: 36 + 48
    # real tokens scored on the other two
    for info in (whole.info["auto"], seq.info["auto"]["blocks"]["model.layers.0"]):
        assert info["score_pieces"] == 2 and info["score_tokens"] == 84
        assert all(0 < v < math.inf for v in info["scores"].values())


@pytest.mark.parametrize("runtime", [Runtime(), Runtime(distributed=True)],
                         ids=["alone", "distributed-without-a-group"])
def test_auto_refuses_documents_with_no_real_token_at_all(runtime):
    """Runtime(distributed=True) outside a process group is one process: its scoring decides
    "no piece left" alone, as Runtime() does (not a ZeroDivisionError of a mean over none)."""
    model, batches = _llama()
    for b in batches:
        b["attention_mask"].zero_()
    with pytest.raises(ValueError, match=r"^auto: the documents compared hold no real token "
                                         r"\(batches of 0 rows, or every attention mask all 0\)"):
        calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                  progress=False, runtime=runtime)


def _embedding_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.ReLU(),
                         nn.Linear(32, 64)).eval()


@pytest.mark.parametrize("wrap", [lambda t: t, lambda t: {"input": t}], ids=["tensor", "dict"])
def test_a_batch_of_zero_rows_of_token_ids_holds_no_token(wrap):
    """Token ids of 0 rows hold no token, as a mask all 0 (they counted one, so the piece was
    scored and the output's summary of 0 rows raised a reshape error): left out of the score,
    and refused by name where every batch is one."""
    g = torch.Generator().manual_seed(1)
    ids, empty = torch.randint(0, 64, (4, 12), generator=g), torch.zeros(0, 12, dtype=int)
    auto = calibrate(_embedding_mlp(), [wrap(ids), wrap(empty)], "w8a8", observer="auto",
                     auto=Auto(candidates=NAMES), progress=False)
    assert auto.info["auto"]["score_tokens"] == 48
    alone = calibrate(_embedding_mlp(), [wrap(ids)], "w8a8", observer="auto",
                      auto=Auto(candidates=NAMES), progress=False)
    assert auto.info["auto"]["scores"] == alone.info["auto"]["scores"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # activation roles that saw no token fall back
        with pytest.raises(ValueError, match=r"^auto: the documents compared hold no real "
                                             r"token \(batches of 0 rows"):
            calibrate(_embedding_mlp(), [wrap(empty)], "w8a8", observer="auto",
                      auto=Auto(candidates=NAMES), progress=False)


def test_distributed_auto_outside_a_group_refuses_batches_all_left_out():
    """Every batch brings NaN under non_finite='ignore': Runtime(distributed=True) with no
    process group raises the one-process error, as Runtime() does."""
    x = torch.randn(4, 16)
    x[0, 0] = float("nan")
    for runtime in (Runtime(), Runtime(distributed=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the NaN batch left out
            with pytest.raises(ValueError, match=r"^auto: every scoring batch \(1\) brought "
                                                 r"NaN or inf values"):
                calibrate(_mlp(), [x], preset("w8a8", "auto", non_finite="ignore"),
                          auto=Auto(candidates=NAMES), progress=False, runtime=runtime)


def test_an_error_on_a_scoring_piece_names_the_piece_and_its_batch_rows():
    model, batches = _llama(empty_rows=())
    with pytest.raises(ValueError, match=r"^auto: loss returned nan on scoring piece 0 \(rows "
                                         r"0:1 of calibration batch 0, counting from 0\), "):
        calibrate(model, batches, "w8a8", progress=False, observer="auto",
                  auto=Auto(candidates=NAMES, loss=lambda out, ref, b: float("nan")))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8)).eval()


def test_an_error_after_a_nan_piece_was_left_out_names_its_own_piece():
    """Piece 0 (a NaN batch) left out under non_finite='ignore': the loss's NaN on batch 2
    names scoring piece 2, its own, not piece 1 (its place among the pieces kept)."""
    model = _mlp()
    batches = [torch.randn(8, 16) for _ in range(3)]
    batches[0][0, 0] = float("nan")

    def loss(out, ref, batch):  # NaN on batch 2 alone, whose outputs are finite
        return float("nan") if batch is batches[2] else float((out - ref).square().mean())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN batch left out
        with pytest.raises(ValueError, match=r"^auto: loss returned nan on scoring piece 2 "
                                             r"\(calibration batch 2, counting from 0\)"):
            calibrate(model, batches, preset("w8a8", "auto", non_finite="ignore"),
                      auto=Auto(candidates=NAMES, loss=loss), progress=False)


def test_a_nan_float_output_names_the_scoring_piece_and_its_batch():
    """A finite batch on which the float model's output is NaN: the piece is named as one,
    with its calibration batch (not as "batch 1" alone, which reads as a calibration batch)."""
    model = nn.Sequential(nn.Linear(16, 8), Sqrt()).eval()
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[0].bias.fill_(40.0)  # outputs 0.1 * sum(x) + 40: positive on ordinary batches
    torch.manual_seed(0)
    batches = [torch.randn(8, 16) for _ in range(3)]
    batches[1] = torch.full((8, 16), -50.0)  # its float output: sqrt(-40), NaN
    assert torch.isnan(model(batches[1])).all() and not torch.isnan(model(batches[0])).any()
    with pytest.raises(ValueError, match=r"^auto: scoring piece 1 \(calibration batch 1, "
                                         r"counting from 0\) brought NaN or inf values \(the "
                                         r"float model's output on it is not finite\)"):
        calibrate(model, batches, "w8a8", observer="auto", auto=Auto(candidates=NAMES),
                  progress=False)


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
