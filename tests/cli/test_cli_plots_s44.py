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
