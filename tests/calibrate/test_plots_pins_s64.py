"""Pins from the s64 mutation round over ``calibration/results/plots.py``: the data each plot
draws (a histogram's bar centres and heights, the clipping-range lines and their legend, the
SQNR panels' order, lines and gaps), its labels and the file it writes; not pixels. Expected
values come from the module's docstrings (bins over ``[lo, hi]``, a gap where an SQNR is
missing, weights' panel before inputs')."""

from __future__ import annotations

import pytest

from quantscope.calibration.results import plots

pytest.importorskip("matplotlib")


def _axes(monkeypatch):
    """The Axes of the figures the plots make, in order."""
    made = []
    real = plots.figure
    monkeypatch.setattr(plots, "figure", lambda **kw: made.append(real(**kw)) or made[-1])
    return lambda: [ax for fig in made for ax in fig.axes]


def _row(layer, lo=-1.0, hi=1.0, obs="minmax", dynamic=False, sqnr=30.0, role="input"):
    return {"layer": layer, "role": role, "clip_lo": lo, "clip_hi": hi, "dynamic": dynamic,
            "requested": obs, "observer": obs, "sqnr_db": sqnr}


def _report(runs, hist=None):
    report = {"runs": {f"{rec}/{obs}": {"recipe": rec, "observer": obs, "layers": rows}
                       for (rec, obs), rows in runs.items()}}
    if hist is not None:
        report["histograms"] = hist
    return report


def test_histogram_bars_sit_at_their_bin_centres_empty_bins_at_zero(tmp_path, monkeypatch):
    """Four bins over [-2, 2]: centres -1.5 .. 1.5, width 1; a count of 0 draws no bar (0 on
    the log axis), a count below 1 is raised to 0.8 so that it shows."""
    axes = _axes(monkeypatch)
    hist = {"l/input": {"lo": -2.0, "hi": 2.0, "counts": [3, 0, 0.5, 7]}}
    plots.plot_histogram(_report({("w8a8", "minmax"): [_row("l")]}, hist), "l",
                         str(tmp_path / "h.png"))
    (ax,) = axes()
    bars = ax.patches
    assert [b.get_x() + b.get_width() / 2 for b in bars] == [-1.5, -0.5, 0.5, 1.5]
    assert [b.get_width() for b in bars] == [1.0] * 4
    assert [b.get_height() for b in bars] == [3, 0, 0.8, 7]
    assert ax.get_xlabel() == "value" and ax.get_ylabel() == "count (log)"


def test_histogram_title_shortens_a_bert_layer_name(tmp_path, monkeypatch):
    axes = _axes(monkeypatch)
    layer = "encoder.layer.3.attention.output.dense"
    hist = {f"{layer}/input": {"lo": -2.0, "hi": 2.0, "counts": [1, 2]}}
    plots.plot_histogram(_report({("w8a8", "minmax"): [_row(layer)]}, hist), layer,
                         str(tmp_path / "h.png"))
    (ax,) = axes()
    assert ax.get_title() == "w8a8 L3.attn.out input: clipping range per observer"


def test_sqnr_panels_come_weight_first_per_recipe_in_the_reports_order(tmp_path, monkeypatch):
    axes = _axes(monkeypatch)
    runs = {("b8", "minmax"): [_row("a"), _row("a", role="weight")],
            ("a4", "minmax"): [_row("a", role="weight"), _row("a")]}
    plots.plot_sqnr(_report(runs), str(tmp_path / "s.png"))
    assert [ax.get_title() for ax in axes()] == ["b8 weight", "b8 input", "a4 weight",
                                                 "a4 input"]
