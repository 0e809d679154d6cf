"""Pins from session 70's mutation round over ``auto``'s model-level scoring
(:mod:`quantscope.calibration.choice.auto`): the divergence never below 0 and the same however
the KL is chunked; what :class:`OutputDivergence` refuses (a loss that is not callable, an
infinite score, a non-finite output blamed on the model) and what ``drop_non_finite``
returns; that :func:`choose` never picks a dropped candidate; the configurations
:func:`choose_roles` skips; and no importance-weighted weight trial where the candidates offer
the weights one observer. Expected values come from the docstrings and the KL / cosine
definitions, not from the code's output."""

from __future__ import annotations

import pytest
import torch
from test_calibrate_pins_s63 import _config, _Table
from torch import nn

import quantscope
from quantscope.calibration import Auto
from quantscope.calibration.choice import auto
from quantscope.calibration.choice.auto import (
    OutputDivergence,
    Tally,
    _divergence,
    choose,
    choose_roles,
)


def _kl_by_hand(q, ref):
    """Mean over rows of KL(p_ref || p_q), written out in float64."""
    r, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(q.double(), -1)
    return float((r.exp() * (r - lq)).sum(-1).mean())


def test_cosine_divergence_of_a_row_with_itself_is_zero_not_below():
    """A unit row whose float64 self-product rounds above 1 still diverges 0 from itself."""
    u = nn.functional.normalize(torch.ones(1, 3, dtype=torch.float64), dim=-1)
    assert _divergence("cos", u, u) == 0.0


def test_kl_of_a_shifted_copy_is_not_below_zero():
    """Logits shifted by a constant give the same distribution: KL 0, each position's clamped
    at 0 where float64 rounding would leave it below."""
    ref = torch.tensor([[0.1, 0.2, 0.3]])
    d = _divergence("kl", ref + 0.25, ref)
    assert 0.0 <= d < 1e-12


@pytest.mark.parametrize("chunk", [1, 12])
def test_kl_is_the_same_however_many_logits_a_chunk_holds(monkeypatch, chunk):
    """KL_CHUNK bounds the logits taken at once, not the result: every row counts once,
    against its own reference row, also where a row alone holds more logits than a chunk."""
    monkeypatch.setattr(auto, "KL_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    ref, q = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    assert _divergence("kl", q, ref) == pytest.approx(_kl_by_hand(q, ref), rel=1e-12)


def _refs(*rows):
    """Float references as OutputDivergence keeps them for a tensor output (cosine)."""
    return [("cos", nn.functional.normalize(torch.tensor([r], dtype=torch.float64), dim=-1))
            for r in rows]


def test_output_divergence_refuses_a_loss_that_is_not_callable():
    with pytest.raises(TypeError, match="loss must be callable"):
        OutputDivergence(nn.Linear(2, 2), [torch.ones(1, 2)], loss=3.0)


def test_tally_after_dropping_counts_only_the_kept_batches_and_their_tokens():
    """Tally: given, real (holding a token), kept (finite) and the kept ones' real tokens;
    drop_non_finite returns how many it left out and the pieces left are the kept ones."""
    x = [torch.ones(2, 2), torch.ones(3, 2), torch.ones(4, 2)]
    bad = ("cos", torch.full((1, 2), float("nan"), dtype=torch.float64))
    refs = [bad, *_refs([1.0, 0.0], [0.0, 1.0])]
    div = OutputDivergence(nn.Linear(2, 2), x, references=refs)
    assert div.drop_non_finite() == 1
    assert div.pieces == 2
    assert div.tally() == Tally(given=3, real=3, kept=2, tokens=3 + 4)


def test_an_infinite_loss_value_is_refused_naming_the_loss():
    div = OutputDivergence(nn.Linear(2, 2), [torch.ones(1, 2)],
                           loss=lambda out, ref, batch: float("inf"))
    with pytest.raises(ValueError, match="loss returned inf on batch 0"):
        div.on(0)


class _Nan(nn.Module):
    def forward(self, x):
        return torch.full_like(x, float("nan"))


def test_a_non_finite_quantized_output_is_blamed_on_the_model_not_the_loss():
    """With a custom loss: NaN out of the quantized model (the float references finite) is
    said of the model's output, not blamed on the loss."""
    div = OutputDivergence(_Nan(), [torch.ones(1, 2)], references=[torch.ones(1, 2)],
                           loss=lambda out, ref, batch: float((out - ref).sum()))
    with pytest.raises(ValueError, match="quantized model's output is not finite"):
        div.on(0)


def test_choose_never_picks_a_dropped_candidate_and_bars_on_the_alive_only():
    """c, dropped after piece 0, is not chosen though its one-piece mean ends the lowest, and
    its stale mean sets no bar for those still scored: the best always stays."""
    div = _Table({"a": [1.0, 6.0], "c": [2.0, 0.0]})
    best, scores = choose(div, {"a": "a", "c": "c"}, "a")
    assert best == "a"
    assert scores == {"a": (3.5, 2), "c": (2.0, 1)}


def test_choose_roles_skips_a_configuration_over_other_layers_or_without_the_role():
    """A candidate is tried for a role only where it has that role and the same layers."""
    configs = {"minmax": _config("memoryless_minmax", "minmax"),
               "other": _config("memoryless_mse", "mse"),
               "noinput": _config("memoryless_minmax", "x")}
    configs["other"].states = {"l9": configs["other"].states["l0"]}
    configs["noinput"].states["l0"].pop("input")
    div = _Table({"unused": [1.0]})
    roles, tried = choose_roles(div, configs, "minmax", [1.0], alive=list(configs))
    assert roles == {"weight": "minmax", "input": "minmax"}
    assert div.calls == [] and tried == {}


def test_no_imatrix_weight_trial_where_the_candidates_give_the_weights_no_choice():
    """Percentile's weights are min-max's (role_observers.weight_observer): candidates minmax
    and percentile offer the weights one observer, so no importance-weighted weight search
    is tried (it is one more weight candidate only where the weights have a choice)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    batches = [torch.randn(4, 8) for _ in range(2)]
    calib = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                                 auto=Auto(candidates=["minmax", "percentile"]))
    assert not any(k.startswith("weight=") for k in calib.info["auto"]["role_scores"])
