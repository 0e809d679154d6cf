"""What auto's scoring checks on a batch (choice/loss_checks.py) and how it names and keeps its
scoring pieces (choice/score_set.py): the loss a user's callable returns, which outputs count
as finite, which pieces hold a real token, and what the errors call each piece."""

from __future__ import annotations

import pytest
import torch

from quantscope.calibration.choice.loss_checks import finite, scalar
from quantscope.calibration.choice.score_set import piece_names, score_plan, with_tokens


@pytest.mark.parametrize("graph", [False, True], ids=["number", "graph"])
def test_a_bool_is_no_scalar_loss(graph):
    """``True`` is a ``numbers.Real`` to Python, but a loss returning a bool is a bug (a
    comparison returned): refused naming its type, as None or a vector is; a number or a
    one-element tensor is taken as its float."""
    with pytest.raises(TypeError, match=r"^auto: loss must return a finite scalar .*got bool$"):
        scalar("auto", "loss", True, graph=graph)
    assert scalar("auto", "loss", 2) == 2.0 and scalar("auto", "loss", torch.tensor([0.5])) == 0.5


def test_logits_may_hold_minus_inf_but_no_nan_or_plus_inf():
    """A banned token's logit is -inf (probability 0): a finite output to score; NaN and +inf
    are not. Without ``logits`` every infinity counts; integer tensors are not judged."""
    banned = torch.tensor([[0.5, -float("inf"), 1.0]])
    assert finite(banned, logits=True) is True
    assert finite({"logits": banned, "hidden": torch.zeros(2)}, logits=True) is True
    assert finite(banned) is False
    for bad in (float("nan"), float("inf")):
        assert finite(torch.tensor([0.0, bad]), logits=True) is False
    assert finite(torch.tensor([1, 2])) is True


def test_a_piece_with_one_real_token_is_kept():
    """Only pieces of no real token (a mask all 0) are left out: one real token is a position
    to compare the outputs on, as a feature batch's one row is."""
    ids = torch.zeros(2, 5, dtype=torch.long)
    one = torch.zeros_like(ids)
    one[1, 3] = 1
    batches = [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)},
               {"input_ids": ids, "attention_mask": one}, torch.randn(1, 8)]
    assert with_tokens(batches) == [1, 2] and with_tokens(batches[:1]) == []


def test_piece_names_name_the_piece_and_the_batch_it_comes_from():
    """The first dict batch is cut in two pieces (its first quarter of rows, at least one),
    each later batch is one more: piece k names its own number and the calibration batch (and
    rows) it was cut from, which differ from the second piece on."""
    ids = torch.ones(4, 6, dtype=torch.long)
    plan = score_plan([{"input_ids": ids}, {"input_ids": ids}, torch.randn(3, 8)], 10**6)
    assert plan == [(0, 0, 1), (0, 1, 4), (1, 0, 4), (2, 0, None)]
    assert piece_names(plan) == [
        "scoring piece 0 (rows 0:1 of calibration batch 0, counting from 0)",
        "scoring piece 1 (rows 1:4 of calibration batch 0, counting from 0)",
        "scoring piece 2 (rows 0:4 of calibration batch 1, counting from 0)",
        "scoring piece 3 (calibration batch 2, counting from 0)",
    ]
