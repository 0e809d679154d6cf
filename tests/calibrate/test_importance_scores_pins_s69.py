"""Pins from the s69 mutation round over ``calibration/choice`` (``importance``,
``output_sensitivity``, ``score_set``): how :class:`InputImportance` counts rows (1-D
inputs, float64 sums, only inside ``counting``, its hooks gone after ``means``), what
``imatrix_config`` keeps of its base and which rows ``imatrix_rows`` gives, the ranking's
metric name, counts, row numbers and refusals (no tensor of the roles asked, no
Calibration), which tied weights it lists, and how the scoring set counts tokens and cuts
its batches and pieces. Behaviour no earlier test held; expected values come from the docstrings, not the
code."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from test_choice_sensitivity_pins_s64 import _importance_and_base, _mlp
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope import comm as qd
from quantscope.calibration.choice.importance import (
    InputImportance,
    imatrix_config,
    imatrix_rows,
)
from quantscope.calibration.choice.output_sensitivity import convolutions, measure
from quantscope.calibration.choice.score_set import (
    piece_of,
    rows_of,
    score_batches,
    scoring_prefix,
    take_rows,
    tokens_of,
)
from quantscope.calibration.recipe import Recipe, Role, Rule, preset
from quantscope.calibration.results.report import tensor_stats
from quantscope.layout import Tile


def _ids(rows, cols, mask=None):
    batch = {"input_ids": torch.ones(rows, cols, dtype=torch.long)}
    return batch if mask is None else {**batch, "attention_mask": torch.tensor(mask)}


# ------------------------------------------------------------------------- importance


def _linear_importance():
    model = nn.Sequential(nn.Linear(2, 3)).eval()
    return model, InputImportance(model, ["0"])


def test_a_one_dimensional_input_is_one_row():
    model, imp = _linear_importance()
    with imp.counting(), torch.no_grad():
        model(torch.tensor([1.0, 2.0]))
        model(torch.tensor([[3.0, 0.0]]))
    torch.testing.assert_close(imp.means()["0"], torch.tensor([5.0, 2.0]))


def test_forwards_after_counting_are_not_counted():
    model, imp = _linear_importance()
    with imp.counting(), torch.no_grad():
        model(torch.tensor([[1.0, 1.0]]))
    with torch.no_grad():
        model(torch.tensor([[9.0, 9.0]]))
    torch.testing.assert_close(imp.means()["0"], torch.tensor([1.0, 1.0]))


def test_means_removes_the_hooks_and_is_float32():
    model, imp = _linear_importance()
    with imp.counting(), torch.no_grad():
        model(torch.tensor([[1.0, 2.0]]))
        means = imp.means()
        model(torch.tensor([[5.0, 5.0]]))
    assert not model[0]._forward_pre_hooks and means["0"].dtype == torch.float32
    torch.testing.assert_close(imp.means()["0"], torch.tensor([1.0, 4.0]))


class _Rows(nn.Module):
    """Linear-like (``in_features`` 2, weight ``[3, 2]``) but taking any input it can
    reshape to rows of 2: integer ids, or rows of 4."""

    in_features = 2

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 2))

    def forward(self, x):
        return x.float().reshape(-1, 2) @ self.weight.T


@pytest.mark.parametrize("x", [torch.ones(1, 2, dtype=torch.long), torch.ones(1, 4)],
                         ids=["integer", "wider"])
def test_an_integer_or_other_width_input_is_not_counted(x):
    model = nn.Sequential(_Rows())
    imp = InputImportance(model, ["0"])
    with imp.counting(), torch.no_grad():
        model(x)
    assert not imp.seen() and imp.means() == {}


def test_one_ranks_reduction_gives_back_its_own_means(monkeypatch):
    """``distributed``: the sums and row counts of every rank together; a group whose
    reduction adds nothing (one rank's data) gives the means alone would."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)).eval()
    imp = InputImportance(model, ["0", "1"])
    monkeypatch.setattr(qd, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(qd, "group_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(qd, "all_reduce", lambda t, op, group: None)
    with imp.counting(), torch.no_grad():
        model(torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 2.0]]))
    got = imp.means(distributed=True)
    torch.testing.assert_close(got["0"], torch.tensor([10 / 3, 8.0]))
    assert got["1"].shape == (3,)


def test_the_sums_keep_small_squares_after_a_large_one():
    """Summed in float64: 64 forwards of 1^2 after one 1e4^2 are not rounded away."""
    model, imp = _linear_importance()
    with imp.counting(), torch.no_grad():
        model(torch.tensor([[1e4, 1e4]]))
        for _ in range(64):
            model(torch.ones(1, 2))
    want = torch.tensor((1e8 + 64) / 65, dtype=torch.float64).float()
    assert torch.equal(imp.means()["0"], want.expand(2))


def test_imatrix_config_keeps_the_label_and_writer_rank():
    model, base, imp = _importance_and_base(preset("w8a8", "mse"))
    base = replace(base, label="mine", writer_rank=3)
    got = imatrix_config(model, base, imp)
    assert (got.label, got.writer_rank, got.recipe) == ("mine", 3, base.recipe)


def test_a_conv1d_weight_in_tiles_is_left_as_it_was():
    """A layout the weighted search cannot take (a Conv1D's tiles) is left, not raised."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = nn.Sequential(conv1d(4, 8)).eval()
    tiles = Role(QuantSpec("int8", Tile(2, 2)), "minmax")
    base = quantscope.calibrate(model, [torch.randn(3, 8)], Recipe(Rule(("Conv1D",),
                                weight=tiles)), progress=False)
    assert imatrix_config(model, base, {"0": torch.ones(8)}) is None


def test_imatrix_rows_are_weight_rows_one_per_layer():
    """Rows made for the searched weights, base's for the others, no input rows."""
    model, base, imp = _importance_and_base(preset("w8a8", "mse"))
    config = imatrix_config(model, base, {"0": imp["0"]})
    rows = imatrix_rows(model, config, base)
    assert sorted((r["layer"], r["role"]) for r in rows) == [("0", "weight"), ("2", "weight")]
    base_row = next(r for r in base.stats if (r["layer"], r["role"]) == ("2", "weight"))
    assert next(r for r in rows if r["layer"] == "2") is base_row
    row = next(r for r in rows if r["layer"] == "0")
    own = tensor_stats(model[0].weight.detach(), config.states["0"]["weight"])
    assert row["observer"] == "imatrix" and row["sqnr_db"] == own["sqnr_db"]


# ---------------------------------------------------------------- output_sensitivity


def _measure(loss=None):
    model, xs, cal = _mlp()
    return measure(model, xs, cal, loss=loss)


def test_the_ranking_names_its_metric_and_counts_its_batches():
    sens = _measure()
    assert sens.info["metric"] == "1 - cosine" and sens.info["batches"] == 2
    assert _measure(loss=lambda o, r, b: (o - r).square().mean()).info["metric"] == "loss"


def test_every_convolution_is_named():
    mods = {"c1": nn.Conv1d(2, 2, 1), "c2": nn.Conv2d(2, 2, 1), "c3": nn.Conv3d(2, 2, 1),
            "fc": nn.Linear(2, 2), "gone": None}
    assert convolutions(mods) == ["c1", "c2", "c3"]


# ------------------------------------------------------------------------- score_set


@pytest.mark.parametrize("batch, tokens", [
    ({"position_ids": torch.zeros(1, 3, dtype=torch.long),
      "input_ids": torch.ones(2, 5, dtype=torch.long)}, 10),
    ((torch.ones(2, 3, dtype=torch.long),), 6),
    (torch.randn(2, 3, 4), 6),
    (torch.randn(4), 1),
    ({"flag": True}, 1),
    (_ids(2, 3, [[1, 1, 0], [1, 0, 0]]), 3),
])
def test_a_batchs_real_tokens(batch, tokens):
    assert tokens_of(batch) == tokens


def test_tokens_per_row():
    assert tokens_of(_ids(2, 3, [[1, 1, 0], [1, 0, 0]]), per_row=True) == [2, 1]
    assert tokens_of(_ids(3, 4), per_row=True) == [4, 4, 4]


def test_rows_of_a_one_dimensional_id_batch_is_none():
    assert rows_of({"input_ids": torch.ones(5, dtype=torch.long)}) is None
    assert rows_of({"position_ids": torch.zeros(1, 3, dtype=torch.long),
                    "input_ids": torch.ones(2, 5, dtype=torch.long)}) == 2


def test_take_rows_keeps_a_zero_dim_tensor():
    batch = {"input_ids": torch.ones(4, 3, dtype=torch.long), "t": torch.tensor(2.0)}
    assert take_rows(batch, 0, 2)["t"] is batch["t"]


@pytest.mark.parametrize("tokens, rows", [(4, 2), (5, 3), (1, 1)])
def test_score_batches_cuts_to_the_rows_needed(tokens, rows):
    (got,) = score_batches([_ids(4, 2)], tokens)
    assert rows_of(got) == rows


def test_score_batches_stops_once_the_tokens_are_reached():
    assert len(score_batches([_ids(1, 2), _ids(1, 2), _ids(1, 2)], 2)) == 1
    assert len(score_batches([_ids(1, 2), _ids(1, 2), _ids(1, 2)], 3)) == 2


def test_a_list_is_its_own_scoring_prefix_and_stream():
    batches = [_ids(1, 2), _ids(1, 2)]
    prefix, stream = scoring_prefix(batches, 2)
    assert prefix is batches and stream is batches


def test_the_second_piece_is_the_rest_of_the_rows():
    batch = {"input_ids": torch.arange(8).reshape(4, 2)}
    assert piece_of(batch, 1, 4)["input_ids"].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert piece_of(batch, 0, 4) is batch


def test_the_ranks_count_from_one():
    sens = measure(*_mlp())
    assert [r["rank"] for r in sens.rows] == list(range(1, len(sens.rows) + 1))


def test_a_calibration_of_no_tensor_of_the_roles_is_refused():
    with pytest.raises(ValueError, match=r"quantizes no tensor of roles \('output',\)"):
        measure(*_mlp(), roles=("output",))


def test_what_is_no_calibration_is_a_type_error():
    model, xs, _ = _mlp()
    with pytest.raises(TypeError, match="calibration must be a Calibration, got str"):
        measure(model, xs, "w8a8")


def _tied_pair(recipe):
    """Two Linear layers holding one weight, calibrated by ``recipe``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    model[2].weight = model[0].weight
    xs = [torch.randn(3, 4) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, xs, quantscope.calibrate(model, xs, recipe, progress=False)


def test_a_ranking_of_inputs_lists_no_tied_weight():
    model, xs, cal = _tied_pair("w8a8")
    assert measure(model, xs, cal).info["tied"] == [["0", "2"]]
    assert measure(model, xs, cal, roles=("input",)).info["tied"] == []


def test_a_holder_with_no_weight_state_is_left_out_of_the_tied():
    w8a8 = preset("w8a8").rules[0]
    recipe = Recipe((Rule(("2",), input=w8a8.input),
                     Rule(("0",), weight=w8a8.weight, input=w8a8.input)))
    model, xs, cal = _tied_pair(recipe)
    assert set(cal.states["2"]) == {"input"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # apply() names the uncovered holder
        sens = measure(model, xs, cal)
    assert sens.info["tied"] == []
    assert {(r["layer"], r["role"]) for r in sens.rows} == {
        ("0", "weight"), ("0", "input"), ("2", "input")}
