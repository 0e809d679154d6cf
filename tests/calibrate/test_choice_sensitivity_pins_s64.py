"""Pins from the s64 mutation round over ``calibration/choice`` (``ranking``, ``sensitivity``,
``importance``, ``score_set``, ``references``): the ranking's JSON and bar chart, the unranked
tensors' warning, which activations ``keep_float`` counts and takes out (outputs, already
dynamic ones, fused units, their histograms), the fallback plot, the imatrix importance and
which weights ``imatrix_config`` leaves, the scoring pieces' cut and the output summaries.
Behaviour no earlier test held; expected values come from the docstrings, not the code."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration.choice.importance import InputImportance, imatrix_config
from quantscope.calibration.choice.references import summary
from quantscope.calibration.choice.score_set import (
    rows_of,
    score_plan,
    take_rows,
)
from quantscope.calibration.choice.sensitivity import (
    Sensitivity,
    keep_float,
    layer_sensitivity,
    plot_fallback,
)
from quantscope.calibration.recipe import Recipe, Role, Rule, preset
from quantscope.layout import Tensor


def _calibrate(model, batches, recipe="w8a8"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate(model, batches, recipe, progress=False)


def _mlp():
    """Two Linear layers calibrated w8a8: four static tensors, two of them inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    xs = [torch.randn(6, 16) for _ in range(2)]
    return model, xs, _calibrate(model, xs)


def _rows(*specs):
    return [{"rank": k, "layer": layer, "role": role, "observer": "minmax", "divergence": d}
            for k, (layer, role, d) in enumerate(specs, 1)]


# ------------------------------------------------------------------------------ ranking


def test_to_json_is_to_dict_with_indent_one(tmp_path):
    sens = Sensitivity(_rows(("a", "input", 0.5)), {"metric": "m", "forwards": 3})
    want = json.dumps({"info": {"metric": "m", "forwards": 3}, "rows": sens.rows}, indent=1)
    assert sens.to_json(tmp_path / "s.json") == want
    assert (tmp_path / "s.json").read_text() == want


def _plotted_axes(monkeypatch):
    """The Axes of the next figure :mod:`.results.plots` makes."""
    from quantscope.calibration.results import plots

    made = []
    real = plots.figure
    monkeypatch.setattr(plots, "figure", lambda **kw: made.append(real(**kw)) or made[-1])
    return lambda: made[-1].axes[0]


def test_sensitivity_plot_draws_the_top_rows_most_sensitive_at_the_top(tmp_path, monkeypatch):
    """``barh`` draws its first bar at the bottom: the rows reversed, so the most sensitive
    is the top bar; a divergence of 0 is drawn at 1e-12 on the log axis, not dropped."""
    pytest.importorskip("matplotlib")
    axes = _plotted_axes(monkeypatch)
    sens = Sensitivity(_rows(("a", "input", 0.5), ("b", "weight", 0.01), ("c", "input", 0.0)),
                       {"metric": "KL"})
    sens.plot(tmp_path / "s.png", top=3)
    ax = axes()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["c input", "b weight", "a input"]
    assert [p.get_width() for p in ax.patches] == [1e-12, 0.01, 0.5]
    assert ax.get_xscale() == "log" and "(KL)" in ax.get_xlabel()
    assert (tmp_path / "s.png").stat().st_size > 0


# ----------------------------------------------------------------- layer_sensitivity


@pytest.mark.parametrize(("layers", "more"), [(5, " and 2 more. "), (4, None)])
def test_unranked_tensors_are_named_up_to_eight_and_the_rest_counted(layers, more):
    """Batches of 0 rows: no layer sees a row; the Linear layers' tensors (two each) are said,
    the first eight by name and the rest counted ("and 2 more"); exactly eight are all named,
    with no "more"."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))).eval()
    calib = _calibrate(model, [torch.randn(4, 8)])
    with pytest.warns(UserWarning, match=rf"{2 * layers} calibrated tensor\(s\) not ranked") \
            as said:
        layer_sensitivity(model, [torch.zeros(0, 8)], calib)
    msg = str(said[0].message)
    assert msg.count("' weight") + msg.count("' input") == 8
    assert (more in msg) if more else ("more" not in msg)


# ------------------------------------------------------------------------- keep_float


def test_already_dynamic_inputs_are_not_counted():
    """Those already quantized per token do not count towards ``n``: the next static one is
    taken."""
    calib = _mlp()[2]
    sens = Sensitivity(_rows(("0", "input", 1.0), ("2", "input", 0.5)))
    first = keep_float(calib, Sensitivity(_rows(("0", "input", 1.0))), 1, mode="dynamic")
    kept = keep_float(first, sens, 1)
    assert kept.info["keep_float"]["tensors"] == ["0 input", "2 input"]
    assert kept.states["2"]["input"].dynamic is True


def test_an_output_role_falls_back_too():
    calib = _mlp()[2]
    st = calib.states["0"]["input"]
    calib = replace(calib, states={**calib.states, "0": {**calib.states["0"], "output": st}})
    kept = keep_float(calib, Sensitivity(_rows(("0", "output", 1.0))), 1)
    assert kept.info["keep_float"]["tensors"] == ["0 output"]
    assert "output" not in kept.states["0"] and "input" in kept.states["0"]


def test_falling_back_drops_the_tensors_histograms_and_rows():
    calib = _mlp()[2]
    kept = keep_float(calib, Sensitivity(_rows(("2", "input", 1.0))), 1)
    assert ("2", "input") in calib.histograms and ("2", "input") not in kept.histograms
    assert set(kept.histograms) == set(calib.histograms) - {("2", "input")}
    assert {(r["layer"], r["role"]) for r in kept.stats} == (
        {(r["layer"], r["role"]) for r in calib.stats} - {("2", "input")})


def test_a_fusion_group_without_a_shared_input_is_not_one_unit():
    """Only a group whose ``input`` is ``"shared"`` falls back whole."""
    calib = _mlp()[2]
    groups = [{"layers": ["0", "2"], "input": "own"}]
    calib = replace(calib, info={**calib.info, "fusion_groups": groups})
    kept = keep_float(calib, Sensitivity(_rows(("0", "input", 1.0))), 1)
    assert kept.info["keep_float"]["tensors"] == ["0 input"]
    shared = replace(calib, info={**calib.info, "fusion_groups": [{**groups[0],
                                                                   "input": "shared"}]})
    kept = keep_float(shared, Sensitivity(_rows(("0", "input", 1.0))), 1)
    assert kept.info["keep_float"]["tensors"] == ["0 input", "2 input"]


def test_a_shared_units_dynamic_member_keeps_its_state():
    """A fused group's member already dynamic is no static activation: the fallback takes
    the static members out and leaves it as it was."""
    calib = _mlp()[2]
    sens = Sensitivity(_rows(("2", "input", 1.0)))
    dyn = keep_float(calib, sens, 1, mode="dynamic").states["2"]["input"]
    calib = replace(calib, states={**calib.states, "2": {**calib.states["2"], "input": dyn}},
                    info={**calib.info, "fusion_groups": [{"layers": ["0", "2"],
                                                           "input": "shared"}]})
    kept = keep_float(calib, Sensitivity(_rows(("0", "input", 1.0))), 1)
    assert kept.info["keep_float"]["tensors"] == ["0 input"]
    assert kept.states["2"]["input"] is dyn


# --------------------------------------------------------------------- fallback_curve


def test_plot_fallback_draws_quality_against_the_float_share(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    axes = _plotted_axes(monkeypatch)
    rows = [{"n": 0, "quality": 9.0, "float_macs_pct": 0.0, "tensors": []},
            {"n": 2, "quality": 7.5, "float_macs_pct": 12.5, "tensors": ["a input"]}]
    plot_fallback(rows, tmp_path / "p.png", quality_label="perplexity")
    ax = axes()
    x, y = ax.lines[0].get_data()
    assert list(x) == [0.0, 12.5] and list(y) == [9.0, 7.5]
    assert [t.get_text() for t in ax.texts] == ["N=0", "N=2"]
    assert ax.get_ylabel() == "perplexity" and (tmp_path / "p.png").stat().st_size > 0


# -------------------------------------------------------------------------- score_set


def _ids(rows, cols, mask=None):
    batch = {"input_ids": torch.ones(rows, cols, dtype=torch.long)}
    return batch if mask is None else {**batch, "attention_mask": torch.tensor(mask)}


def test_a_mask_that_is_not_2d_is_not_cut_by_rows():
    assert rows_of(_ids(2, 3, [[1, 1, 0], [1, 0, 0]])) == 2
    assert rows_of({"attention_mask": torch.ones(2, 3, 3)}) is None
    assert rows_of({"inputs_embeds": torch.randn(2, 3, 4)}) == 2


def test_take_rows_cuts_only_the_tensors_of_the_rows():
    batch = {"input_ids": torch.arange(12).reshape(4, 3), "scale": torch.arange(3)}
    got = take_rows(batch, 1, 3)
    assert got["input_ids"].tolist() == [[3, 4, 5], [6, 7, 8]] and got["scale"] is batch["scale"]


@pytest.mark.parametrize("rows, first, cut", [(2, 0.25, 1), (2, 0.75, 1), (6, 0.25, 2),
                                              (4, 0.9, 3)])
def test_score_plan_cuts_the_rounded_share_leaving_a_second_piece(rows, first, cut):
    plan = score_plan([_ids(rows, 2)], 10**6, first)
    assert plan == [(0, 0, cut), (0, cut, rows)]


def test_a_one_row_batch_is_one_piece():
    assert score_plan([_ids(1, 4), _ids(3, 4)], 10**6) == [(0, 0, 1), (1, 0, 3)]


# -------------------------------------------------------------- references / loss_checks


def test_one_logit_per_row_is_one_vector_compared_by_cosine():
    """A regression head's one logit: no KL; the batch's column is the vector."""
    kind, vec = summary({"logits": torch.tensor([[3.0], [4.0]])}, None)
    assert kind == "cos"
    torch.testing.assert_close(vec, torch.tensor([[0.6, 0.8]], dtype=torch.float64))


def test_an_all_padding_row_pools_to_zero_not_nan():
    hidden = torch.ones(2, 3, 4)
    _, vec = summary(type("O", (), {"last_hidden_state": hidden})(),
                     torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert torch.isfinite(vec).all() and vec[1].abs().sum() == 0


# ------------------------------------------------------------------------- importance


class _Custom(nn.Module):
    """A 2-D ``[out, in]`` weight but no ``in_features``: not Linear-like."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return x @ self.weight.T


def test_importance_skips_a_module_without_in_features():
    model = nn.Sequential(_Custom(), nn.Linear(4, 2)).eval()
    imp = InputImportance(model, ["0", "1"])
    with imp.counting(), torch.no_grad():
        model(torch.ones(3, 6))
    means = imp.means()
    assert list(means) == ["1"] and means["1"].shape == (4,)


def test_importance_is_the_mean_square_per_row_and_names_only_layers_that_saw_rows():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)).eval()
    imp = InputImportance(model, ["0", "1"])
    with imp.counting(), torch.no_grad():
        model[0](torch.tensor([[1.0, 2.0], [3.0, 0.0]]))
        model[0](torch.tensor([[[1.0, 0.0]]]))
    assert imp.seen()
    means = imp.means()
    assert list(means) == ["0"]
    torch.testing.assert_close(means["0"], torch.tensor([11 / 3, 4 / 3]))


def _importance_and_base(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    xs = [torch.randn(6, 16) * 2]
    base = _calibrate(model, xs, recipe)
    imp = InputImportance(model, ["0", "2"])
    with imp.counting(), torch.no_grad():
        model(xs[0])
    return model, base, imp.means()


def test_imatrix_config_leaves_a_dynamic_weight():
    """A dynamic weight state (its scale taken at run time) is not searched."""
    model, base, imp = _importance_and_base(preset("w8a8", "mse"))
    assert imatrix_config(model, base, imp).states["0"]["weight"].observer == "imatrix"
    states = {k: {**v, "weight": replace(v["weight"], dynamic="local")}
              for k, v in base.states.items()}
    assert imatrix_config(model, replace(base, states=states), imp) is None


def test_imatrix_config_leaves_an_fp8_per_tensor_weight():
    """A float per-tensor weight scale is one a fused runtime layer shares: not searched
    layer by layer."""
    fp8 = Recipe((Rule(("Linear",), weight=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),))
    model, base, imp = _importance_and_base(fp8)
    assert imatrix_config(model, base, imp) is None
