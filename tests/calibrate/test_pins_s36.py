"""Pins found by mutation (s36): behaviours of the ignore list (KV-cache roles, unreached
weights, the command line's 'left in float' note) and of the SQNR plot's merged lines that no
test held."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from quantscope.calibration import Recipe, Role, Rule
from quantscope.spec import QuantSpec

RULE = Rule(("Linear",), weight=Role(QuantSpec("int8", "channel"), "minmax"))


# ---- Recipe.match: the KV cache's roles ----------------------------------------------------------

def test_kv_cache_roles_skip_an_ignored_attention_module():
    """An ignored attention module stays in float: no rule role and no KV-cache role either
    (quantizing its key / value cache would quantize a module the caller left out)."""
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.calibration import preset

    model, _ = llama()
    ignored, kept = "model.layers.0.self_attn", "model.layers.1.self_attn"
    found = preset("w8a8", kv_cache="fp8", ignore=[ignored]).match(model)
    roles = found.get(ignored, (None, {}))[1]
    assert "key" not in roles and "value" not in roles, sorted(roles)
    module, roles = found[kept]
    assert module is model.get_submodule(kept)
    assert {"key", "value"} <= set(roles)


# ---- moe.unreached -------------------------------------------------------------------------------

class _Stacked(nn.Module):
    """A module of quantscope's unknown kind holding a 3-D (stacked experts') parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))


def test_an_ignored_modules_3d_weight_is_not_reported_unreached():
    """The ignore list leaves a module in float on purpose: its 3-D weight is no weight the
    recipe would cover and quantscope cannot reach."""
    from quantscope.calibration.structure.moe import unreached

    model = nn.Sequential(nn.Linear(8, 8), _Stacked())
    assert [u["name"] for u in unreached(model, Recipe((RULE,)))] == ["1.w"]  # reported...
    assert unreached(model, Recipe((RULE,), ("1",))) == []  # ...unless ignored


# ---- cli float_note ------------------------------------------------------------------------------

def test_float_note_names_an_ignored_module_not_its_children():
    """``re:0.*`` matches the Sequential ``0`` and both its Linears: the note names the
    outermost module once ('0'), not '0, 0.0, 0.1'."""
    from quantscope.cli.recipes import float_note

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    assert float_note(Recipe((RULE,), ("re:0.*",)), model) == (
        "left in float: 0 (--ignore to change)")


def test_float_note_tells_a_sibling_from_a_child_by_the_dot():
    """'10' is no child of '1' (a child is '1.<name>'): both ignored siblings are named."""
    from quantscope.cli.recipes import float_note

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(11)])
    assert float_note(Recipe((RULE,), ("1", "10")), model) == (
        "left in float: 1, 10 (--ignore to change)")


# ---- plot_sqnr -----------------------------------------------------------------------------------

def test_sqnr_lines_with_a_nan_on_the_same_layer_still_merge(tmp_path, monkeypatch):
    """Two observers with the same SQNR on every layer, NaN on one (each NaN its own float
    object, as computed in memory: NaN != NaN and the tuples hold different objects) share
    one line labelled 'minmax = mse', as they do without the NaN."""
    pytest.importorskip("matplotlib")
    from quantscope.calibration.results import plots

    def rows(nan):
        return [{"layer": "l0", "role": "weight", "sqnr_db": 20.0},
                {"layer": "l1", "role": "weight", "sqnr_db": nan}]
    a, b = math.inf - math.inf, float("nan")
    assert a is not b and math.isnan(a) and math.isnan(b)
    report = {"runs": {"r/minmax": {"recipe": "r", "observer": "minmax", "layers": rows(a)},
                       "r/mse": {"recipe": "r", "observer": "mse", "layers": rows(b)}}}
    figs = []
    real = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, *a, **kw: (
        figs.append(fig), real(fig, *a, **kw))[1])
    plots.plot_sqnr(report, str(tmp_path / "s.png"))
    (fig,) = figs
    (ax,) = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["minmax = mse"]
    (line,) = ax.get_lines()
    assert line.get_ydata()[0] == 20.0 and math.isnan(line.get_ydata()[1])  # a gap at l1
