"""Plots and printed tables leave the caller's state alone and show what they name."""

import io
import math

import pytest

SQNR_ROW = {"layer": "a", "role": "weight", "sqnr_db": 30.0, "dynamic": False}
HIST_REPORT = {
    "runs": {"w8a8/minmax": {"recipe": "w8a8", "observer": "minmax", "layers": [
        {"layer": "l", "role": "input", "clip_lo": -4.0, "clip_hi": 5.0, "dynamic": False,
         "requested": "minmax", "observer": "minmax", "sqnr_db": 20.0}]}},
    "histograms": {"l/input": {"lo": -4.0, "hi": 5.0, "counts": [1, 5, 9, 5, 1]}}}


def _draws(tmp_path):
    """Every function that draws, each writing to ``tmp_path / name``."""
    from quantscope.calibration.choice.sensitivity import Sensitivity, plot_fallback
    from quantscope.calibration.results import plots

    sens = Sensitivity([{"rank": 1, "layer": "a", "role": "input", "observer": "minmax",
                         "divergence": 0.1}], {"metric": "kl"})
    return [lambda name: plots.plot_histogram(HIST_REPORT, "l", str(tmp_path / name)),
            lambda name: plots.plot_sqnr({"runs": {"w/m": {"recipe": "w", "observer": "m",
                                                           "layers": [SQNR_ROW]}}},
                                         str(tmp_path / name)),
            lambda name: sens.plot(tmp_path / name),
            lambda name: plot_fallback([{"n": 0, "quality": 1.0, "float_macs_pct": 0.0}],
                                       tmp_path / name)]


def test_plots_keep_the_callers_backend_and_open_no_pyplot_figure(tmp_path):
    """A plot once switched the process to Agg (breaking a notebook's or a GUI's
    ``plt.show()``), and a refused write left its figure open in pyplot."""
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        for k, draw in enumerate(_draws(tmp_path)):
            draw(f"p{k}.png")
            with pytest.raises(ValueError):
                draw("")  # the folder itself: refused
            assert matplotlib.get_backend() == "svg"
            assert plt.get_fignums() == []
    finally:
        matplotlib.use(before)


@pytest.mark.parametrize("name, head", [("p.png", b"\x89PNG"), ("p.SVG", b"<?xml"),
                                        ("p.pdf", b"%PDF"), ("p", b"\x89PNG")])
def test_a_plot_is_written_in_the_format_its_extension_names(tmp_path, name, head):
    """PNG bytes were written under any name (``sens.pdf`` held a PNG)."""
    pytest.importorskip("matplotlib")
    for k, draw in enumerate(_draws(tmp_path)):
        (tmp_path / str(k)).mkdir()
        draw(f"{k}/{name}")
        assert (tmp_path / str(k) / name).read_bytes().startswith(head)


def test_an_unknown_extension_is_refused_and_nothing_written(tmp_path):
    pytest.importorskip("matplotlib")
    for draw in _draws(tmp_path):
        with pytest.raises(ValueError, match=r"p\.weird.*expected one of.*'png'"):
            draw("p.weird")
        assert list(tmp_path.iterdir()) == []


def test_sqnr_points_sit_at_their_layers_names(tmp_path, monkeypatch):
    """An observer without a row for a layer (``keep_float`` dropped it) shifted its later
    points left, under the other observers' labels: minmax's ``l1`` was drawn at ``l2``."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from quantscope.calibration.results import plots

    def rows(values):
        return [{"layer": name, "role": "input", "sqnr_db": v} for name, v in values]
    report = {"runs": {
        "w8a8/mse": {"recipe": "w8a8", "observer": "mse",
                     "layers": rows([("l0", 20.0), ("l2", 22.0)])},
        "w8a8/minmax": {"recipe": "w8a8", "observer": "minmax",
                        "layers": rows([("l0", 10.0), ("l1", 11.0), ("l2", 12.0)])},
        "w8a8/pct": {"recipe": "w8a8", "observer": "pct",
                     "layers": rows([("l1", 31.0), ("l3", 33.0)])}}}
    lines, ticks = {}, []
    plot, set_ticks = Axes.plot, Axes.set_xticklabels
    monkeypatch.setattr(Axes, "plot", lambda self, xs, ys, **kw: (
        lines.__setitem__(kw["label"], dict(zip(xs, ys))), plot(self, xs, ys, **kw))[1])
    monkeypatch.setattr(Axes, "set_xticklabels", lambda self, labels, **kw: (
        ticks.extend(labels), set_ticks(self, labels, **kw))[1])
    plots.plot_sqnr(report, str(tmp_path / "s.png"))
    assert ticks == ["l0", "l1", "l2", "l3"]
    drawn = {name: {ticks[x]: y for x, y in pts.items() if not math.isnan(y)}
             for name, pts in lines.items()}
    assert drawn == {"mse": {"l0": 20.0, "l2": 22.0},
                     "minmax": {"l0": 10.0, "l1": 11.0, "l2": 12.0},
                     "pct": {"l1": 31.0, "l3": 33.0}}


def test_printed_tables_show_names_as_given():
    """rich read ``[red]`` in a layer name as markup (``proj[red]`` printed as ``proj``)
    and ``[/]`` raised a MarkupError; a ``|`` in a name split a markdown row."""
    pytest.importorskip("rich")
    from quantscope.calibration.results.report import markdown_table, print_table

    out = io.StringIO()
    print_table(["layer", "sqnr_db"], [["blocks.proj[red]", 1.5], ["ffn[/]", 2.0]],
                "exp [bold]v2", file=out)
    text = out.getvalue()
    for name in ("blocks.proj[red]", "ffn[/]", "exp [bold]v2"):
        assert name in text
    table = markdown_table(["layer", "x"], [["a|b", 1.0]])
    assert table.splitlines()[2].count(" | ") == 1 and "a\\|b" in table
