"""The plots a person reads: coinciding clipping ranges stay visible. Pinned by mutation
(s61): the histogram check refuses what a hand-edited report damaged (bool counts, a
histogram that is no dict, by its key) but not what calibrate writes: a histogram with
empty bins (most of a 256-bin one) or one collapsed to a point (lo == hi) still draws."""

import pytest


def test_histogram_plot_keeps_coinciding_ranges_visible(tmp_path, monkeypatch):
    """Observers with the same clipping range share one legend entry ("mse = mix") with the
    range written out, instead of a line drawn invisibly under another."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from quantscope.calibration.results import plots

    def row(lo, hi, obs):
        return {"layer": "l", "role": "input", "clip_lo": lo, "clip_hi": hi, "dynamic": False,
                "requested": obs, "observer": obs, "sqnr_db": 20.0}
    runs = {f"w8a8/{o}": {"recipe": "w8a8", "observer": o, "layers": [row(lo, hi, o)]}
            for o, lo, hi in (("minmax", -4.0, 5.0), ("mse", -2.0, 3.0), ("mix", -2.0, 3.0))}
    report = {"runs": runs, "histograms": {"l/input": {"lo": -4.0, "hi": 5.0,
                                                       "counts": [1, 5, 9, 5, 1]}}}
    labels = []
    real = Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x, **kw: (
        labels.append(kw.get("label")), real(self, x, **kw))[1])
    plots.plot_histogram(report, "l", str(tmp_path / "h.png"))
    assert [x for x in labels if x] == ["minmax: [-4, 5]", "mse = mix: [-2, 3]"]
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_sqnr_plot_merges_coinciding_lines(tmp_path, monkeypatch):
    """Weights every observer calibrates alike are one line "minmax = mse", not two drawn
    on top of each other; the inputs, which differ, keep one line each."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from quantscope.calibration.results import plots

    def rows(w, i):
        return [{"layer": f"l{k}", "role": role, "sqnr_db": v}
                for k in range(3) for role, v in (("weight", w + k), ("input", i + k))]
    report = {"runs": {f"w8a8/{o}": {"recipe": "w8a8", "observer": o, "layers": rows(30, i)}
                       for o, i in (("minmax", 20.0), ("mse", 22.0))}}
    labels = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: (
        labels.append(kw.get("label")), real(self, *a, **kw))[1])
    plots.plot_sqnr(report, str(tmp_path / "s.png"))
    assert sorted(labels) == ["minmax", "minmax = mse", "mse"]
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_the_picked_layer_is_where_one_recipes_observers_differ_most():
    """Not where recipes differ (int8 against fp8: 15 dB on every layer, whatever the
    observer); the drawn recipe's observers decide, and nvfp4's calibrated ('local') inputs
    count as plot_histogram draws them."""
    from quantscope.calibration.results import plots

    sqnr = {("w8a8", "minmax"): {"a": 46.5, "b": 40.0}, ("w8a8", "mse"): {"a": 46.5, "b": 41.0},
            ("fp8", "minmax"): {"a": 31.0, "b": 30.0}, ("fp8", "mse"): {"a": 32.2, "b": 30.1},
            ("nvfp4", "minmax"): {"a": 20.0, "b": 20.0}, ("nvfp4", "mse"): {"a": 23.0, "b": 20.0}}

    def rows(values, dynamic):
        return [{"layer": k, "role": "input", "sqnr_db": v, "dynamic": dynamic}
                for k, v in values.items()]
    report = {"runs": {f"{r}/{o}": {"recipe": r, "observer": o,
                                    "layers": rows(v, "local" if r == "nvfp4" else False)}
                       for (r, o), v in sqnr.items()}}
    assert plots.pick_layer(report) == "b"  # w8a8's observers: 1 dB at b, 0 at a
    assert plots.pick_layer(report, recipe="w8a8") == "b"
    assert plots.pick_layer(report, recipe="fp8") == "a"
    assert plots.pick_layer(report, recipe="nvfp4") == "a"


def _input_row(layer, dynamic=False, sqnr=30.0) -> dict:
    """A report row of ``layer``'s input, clipped to [-1, 1] by min-max."""
    return {"layer": layer, "role": "input", "sqnr_db": sqnr, "dynamic": dynamic,
            "requested": "minmax", "observer": "minmax", "clip_lo": -1.0, "clip_hi": 1.0}


def _report(runs: dict, hist=("a", "b")) -> dict:
    """A compare report of ``{recipe: rows}``, one minmax run per recipe in that order, with
    input histograms of the layers ``hist``."""
    return {"runs": {f"{rec}/minmax": {"recipe": rec, "observer": "minmax", "layers": rows}
                     for rec, rows in runs.items()},
            "histograms": {f"{layer}/input": {"counts": [1, 4, 4, 1], "lo": -1.5, "hi": 1.5}
                           for layer in hist}}


def test_the_recipe_drawn_on_a_layer_is_the_first_with_a_static_range_of_that_layer():
    """r1 quantizes a's input statically and b's at run time, r2 both statically: b's
    histogram draws r2's range (r1 has none of b), a's the first recipe's."""
    from quantscope.calibration.results import plots

    report = _report({"r1": [_input_row("a"), _input_row("b", dynamic=True)],
                      "r2": [_input_row("a"), _input_row("b")]})
    assert plots.drawable_recipes(report) == ["r1", "r2"]
    assert plots.drawable_recipes(report, layer="a") == ["r1", "r2"]
    assert plots.drawable_recipes(report, layer="b") == ["r2"]
    assert plots.histogram_choice(report, layer="b") == ("b", "r2")
    assert plots.histogram_choice(report, layer="a") == ("a", "r1")


def test_a_recipe_whose_static_layers_have_no_histogram_is_not_drawn():
    """r1's one static input (x) has no histogram in the report: nothing of r1 to draw; the
    histogram is r2's, of its layer with one."""
    from quantscope.calibration.results import plots

    report = _report({"r1": [_input_row("x")], "r2": [_input_row("x"), _input_row("a")]},
                     hist=("a",))
    assert plots.drawable_recipes(report) == ["r2"]
    assert plots.pick_layer(report, recipe="r1") is None
    assert plots.histogram_choice(report) == ("a", "r2")


def test_recipes_come_in_the_reports_order():
    """The first recipe drawn is the report's first (the order compare ran them in), not the
    first by name."""
    from quantscope.calibration.results import plots

    report = _report({"zeta": [_input_row("a")], "alpha": [_input_row("a")]})
    assert plots.drawable_recipes(report) == ["zeta", "alpha"]
    assert plots.histogram_choice(report) == ("a", "zeta")


def test_static_rows_without_an_sqnr_leave_no_layer_to_pick_saying_so():
    """A static range to draw, but no SQNR to choose the layer by (every row's is None): the
    caller is asked to name the layer, not handed a None layer."""
    from quantscope.calibration.results import plots

    report = _report({"r1": [_input_row("a", sqnr=None)]}, hist=("a",))
    with pytest.raises(ValueError, match=r"^plot: no input SQNR of recipe 'r1' to choose the "
                                         r"layer by: name one$"):
        plots.histogram_choice(report)
    assert plots.histogram_choice(report, layer="a") == ("a", "r1")


@pytest.mark.parametrize(("hist", "said"), [
    ({"counts": [], "lo": 0.0, "hi": 1.0}, r"counts must be a non-empty list"),
    ({"counts": [1, -2], "lo": 0.0, "hi": 1.0}, r"counts must be a non-empty list"),
    ({"counts": [1, 2], "lo": 1.0, "hi": 0.0}, r"needs finite 'lo' <= 'hi'"),
    ({"counts": [1, 2], "lo": 0.0, "hi": float("inf")}, r"needs finite 'lo' <= 'hi'"),
    ({"counts": [1, 2]}, r"needs finite 'lo' <= 'hi'"),
    # bools are ints to isinstance, but True/False are no counts
    ({"counts": [True, False], "lo": 0.0, "hi": 1.0}, r"counts must be a non-empty list"),
    # no dict at all: the same ValueError by key, not an AttributeError from .get
    ([1, 2, 3], r"counts must be a non-empty list"),
])
def test_a_damaged_histogram_is_refused_naming_its_key(hist, said):
    """A report edited by hand whose histogram has no bins or no finite range: a ValueError
    naming ``histograms[key]`` (the CLI's usage error), not a ZeroDivisionError mid-draw."""
    from quantscope.calibration.results import plots

    report = _report({"r1": [_input_row("a")]}, hist=("a",))
    report["histograms"]["a/input"] = hist
    with pytest.raises(ValueError, match=r"^plot: histograms\['a/input'\].*" + said):
        plots.histogram_choice(report, layer="a")


def test_a_histogram_collapsed_to_one_point_draws(tmp_path):
    """lo == hi (every sampled value the same: a constant input) is a finite range, if an
    empty one: the histogram is drawn, its one bin of width 0 beside the clipping range."""
    pytest.importorskip("matplotlib")
    from quantscope.calibration.results import plots

    report = _report({"r1": [_input_row("a")]}, hist=("a",))
    report["histograms"]["a/input"] = {"counts": [7], "lo": 0.5, "hi": 0.5}
    assert plots.histogram_choice(report, layer="a") == ("a", "r1")
    path = tmp_path / "h.png"
    assert plots.plot_histogram(report, "a", str(path)) == str(path)
    assert path.stat().st_size > 1000


def test_a_calibrated_histogram_with_empty_bins_draws(tmp_path):
    """calibrate's own input histogram (256 bins over a small sample) has empty bins; a count
    of 0 is a count, so the report compare writes of it is drawn, not refused as damaged."""
    pytest.importorskip("matplotlib")
    import torch
    from torch import nn

    import quantscope
    from quantscope.calibration.results import plots

    torch.manual_seed(0)
    calib = quantscope.calibrate(nn.Sequential(nn.Linear(16, 8)), [torch.randn(64, 16)],
                                 "w8a8", progress=False)
    calib.label = "w8a8/minmax"
    run = calib.report({}).to_dict()  # as compare's _evaluate_all writes each run
    run["recipe"], run["observer"] = calib.label.split("/", 1)
    report = {"runs": {calib.label: run},
              "histograms": {f"{k[0]}/{k[1]}": v for k, v in calib.histograms.items()}}
    hist = report["histograms"]["0/input"]
    assert 0 in hist["counts"], "the case needs a histogram with an empty bin"
    assert plots.histogram_choice(report) == ("0", "w8a8")
    path = tmp_path / "h.png"
    assert plots.plot_histogram(report, "0", str(path)) == str(path)
    assert path.stat().st_size > 1000


def test_plot_histogram_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    """matplotlib missing: plot_histogram says which extra to install, as plot_sqnr does (it
    imported matplotlib before asking figure(), whose ImportError says so)."""
    import builtins

    from quantscope.calibration.results import plots

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    report = _report({"r1": [_input_row("a")]}, hist=("a",))
    with pytest.raises(ImportError, match=r"^plots need matplotlib: pip install "
                                          r"'quantscope\[plot\]'$"):
        plots.plot_histogram(report, "a", str(tmp_path / "h.png"))
    assert not list(tmp_path.iterdir())
