"""`quantscope compare` / `plot` plots as session 44's probe found them wanting: one plot that
cannot be drawn no longer takes the other with it, and says why."""

import json

import pytest

transformers = pytest.importorskip("transformers")
from cli_helpers import run_cli as _run
from tiny_models import require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "32", "--device", "cpu", "--threads", "1", "--no-progress"]


def test_keep_float_taking_the_plot_layer_out_still_draws_sqnr(llama_dir, tmp_path, capsys):
    """--plot-layer passes its check once the model loads; --keep-float chooses only after
    calibration (by each activation's effect on its layer's output), here every input, so the
    layer's histogram is gone from every configuration. The histogram is skipped with a
    warning naming keep_float; sqnr.png, which no layer decides, was lost with it."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    layer = "model.layers.0.mlp.down_proj"
    with pytest.warns(UserWarning, match="keep_float: 100 activations asked for"):
        rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                            "--observers", "minmax", "--keep-float", "100", "--plot-layer",
                            layer, "--out", str(out), *FAST)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["histograms"] == {}  # every input fell back: no histogram is left
    assert f"{layer} input" in report["runs"]["w8a8/minmax"]["info"]["keep_float"]["tensors"]
    assert (f"warning: no hist.png: plot: no input histogram for layer {layer!r} (keep_float "
            f"took it out of static quantization: w8a8/minmax)") in err, err
    assert (out / "sqnr.png").is_file() and not (out / "hist.png").exists()
    assert "and plots (sqnr.png)" in got, got
    assert "![SQNR per layer](sqnr.png)" in (out / "report.md").read_text()


def _axvline_labels(monkeypatch) -> list:
    """The legend labels of the clipping-range lines drawn from now on."""
    from matplotlib.axes import Axes

    labels, real = [], Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x, **kw: (
        labels.append(kw.get("label")), real(self, x, **kw))[1])
    return labels


def test_the_histogram_draws_the_first_recipe_with_static_inputs(llama_dir, tmp_path, capsys,
                                                                 monkeypatch):
    """W8A8 (compressed-tensors' scheme: dynamic inputs) listed first: compare drew its
    --plot-layer histogram titled W8A8 with no clipping range at all, drew none without
    --plot-layer (no warning), and `plot RUN` said the report had no static inputs with a
    histogram, though w8a8's are. The ranges drawn are w8a8's, each observer's row's."""
    pytest.importorskip("matplotlib")
    labels = _axvline_labels(monkeypatch)
    out, layer = tmp_path / "cmp", "model.layers.0.mlp.down_proj"
    rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "W8A8,w8a8",
                        "--observers", "minmax,mse", "--plot-layer", layer, "--out", str(out),
                        *FAST)
    assert rc == 0 and "warning" not in err, err
    report = json.loads((out / "report.json").read_text())
    ranges = {}
    for obs in ("minmax", "mse"):
        row = next(r for r in report["runs"][f"w8a8/{obs}"]["layers"]
                   if r["layer"] == layer and r["role"] == "input")
        assert row["dynamic"] is False
        ranges[obs] = f"[{row['clip_lo']:.4g}, {row['clip_hi']:.4g}]"
    drawn = sorted(x for x in labels if x)
    # observers with the same range share one entry ("minmax = mse: [..]")
    want = (sorted(f"{o}: {r}" for o, r in ranges.items()) if len(set(ranges.values())) > 1
            else [f"minmax = mse: {ranges['minmax']}"])
    assert drawn == want, (drawn, want)
    assert (out / "hist.png").is_file() and "and plots (hist.png, sqnr.png)" in got, got
    labels.clear()
    rc, got, err = _run(capsys, "plot", str(out), "--out", str(tmp_path / "p"))
    assert rc == 0, err
    assert "input, w8a8's clipping ranges) and" in got, got
    assert (tmp_path / "p" / "hist.png").is_file() and len([x for x in labels if x]) >= 1


def _report(recipe_rows: dict) -> dict:
    """A compare report with one minmax run per recipe, ``{recipe: dynamic}`` of input l."""
    runs = {f"{rec}/minmax": {"recipe": rec, "observer": "minmax", "layers": [] if dyn is None
                              else [{"layer": "l", "role": "input", "sqnr_db": 30.0,
                                     "dynamic": dyn, "requested": "minmax",
                                     "observer": "minmax", "clip_lo": -1.0, "clip_hi": 1.0}]}
            for rec, dyn in recipe_rows.items()}
    return {"runs": runs, "histograms": {"l/input": {"counts": [1, 4, 4, 1], "lo": -1.5,
                                                     "hi": 1.5}}}


def test_pick_layer_passes_over_a_weight_only_or_dynamic_first_recipe():
    from quantscope.calibration.results import plots

    assert plots.pick_layer(_report({"w4a16": None, "w8a8": False})) == "l"
    assert plots.pick_layer(_report({"W8A8": True, "w8a8": False})) == "l"
    assert plots.pick_layer(_report({"W8A8": True})) is None
    assert plots.pick_layer(_report({"W8A8": True, "w8a8": False}), recipe="W8A8") is None


NO_RANGE = "(weight-only, dynamic inputs or kept in float)"


@pytest.mark.parametrize("flags,said", [
    ([], ("none of the report's recipes (W8A8, w4a16) has a static input clipping range "
          f"of a layer with a histogram {NO_RANGE}")),
    (["--recipe", "W8A8", "--layer", "l"],
     (f"recipe 'W8A8' has no static input clipping range of layer 'l' {NO_RANGE}; "
      "recipes with one: w8a8"))])
def test_plot_refuses_a_histogram_with_no_range_saying_why(tmp_path, capsys, flags, said):
    """`plot --recipe W8A8 --layer l` drew l's histogram with no clipping range, without a
    word; with no recipe drawing one at all, the error now says why."""
    report = _report({"W8A8": True, "w4a16": None, "w8a8": False})
    if not flags:
        del report["runs"]["w8a8/minmax"]
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = tmp_path / "plots"
    rc, _, err = _run(capsys, "plot", str(tmp_path), *flags, "--out", str(out))
    assert rc == 2, err
    assert f"error: {said}" in err, err
    assert not out.exists()


def test_a_compare_of_weight_only_recipes_says_why_it_draws_no_histogram(llama_dir, tmp_path,
                                                                         capsys):
    out = tmp_path / "cmp"
    rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w4a16",
                        "--group-size", "32", "--observers", "minmax", "--out", str(out),
                        *FAST)
    assert rc == 0, err
    assert ("warning: no hist.png: plot: none of the report's recipes (w4a16) has a static "
            "input clipping range") in err, err
    assert not (out / "hist.png").exists() and "hist.png" not in got


@pytest.mark.parametrize("recipes", [["W8A8"], ["W8A8,w4a16", "--group-size", "32"]])
def test_a_plot_layer_no_recipe_quantizes_statically_is_refused_up_front(
        llama_dir, tmp_path, capsys, recipes):
    """Dynamic inputs (W8A8) have no clipping range, known from the recipe before any
    forward: the run went through and drew the layer's histogram with no range at all."""
    rc, _, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", *recipes,
                      "--observers", "minmax", "--plot-layer", "model.layers.0.mlp.down_proj",
                      "--out", str(tmp_path / "cmp"), *FAST)
    assert rc == 2, err
    assert ("error: --plot-layer 'model.layers.0.mlp.down_proj': none of --recipes quantizes "
            "an input statically") in err, err
    assert "evaluating float" not in err and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("flags, role", [([], "input"), (["--role", "output"], "output")])
def test_plot_role_chooses_the_histogram_drawn(tmp_path, capsys, monkeypatch, flags, role):
    """`plot --role output` draws the output activations' histogram (default: input); the
    role reached the layer check and the message, but hist.png was the input's (mutation s61)."""
    from quantscope.calibration.results import plots

    report = _report({"w8a8": False})
    (row,) = report["runs"]["w8a8/minmax"]["layers"]
    report["runs"]["w8a8/minmax"]["layers"].append({**row, "role": "output"})
    report["histograms"]["l/output"] = {"counts": [2, 1], "lo": -9.0, "hi": 9.0}
    (tmp_path / "report.json").write_text(json.dumps(report))
    drawn = []
    monkeypatch.setattr(plots, "plot_histogram", lambda report, layer, path, role, recipe,
                        **kw: drawn.append((layer, role, recipe)))
    monkeypatch.setattr(plots, "plot_sqnr", lambda *a, **kw: None)
    rc, out, err = _run(capsys, "plot", str(tmp_path), *flags, "--out", str(tmp_path / "p"))
    assert rc == 0, err
    assert drawn == [("l", role, "w8a8")] and f"(l {role}, w8a8's clipping ranges)" in out
