"""`quantscope compare` / `plot` as a probe found them wanting: --keep-float's histograms
kept for the configurations that still quantize those inputs statically, the KV cache in the
table, and no claim of plots that were not drawn."""

import json

import pytest

transformers = pytest.importorskip("transformers")
from cli_helpers import run_cli as _run
from tiny_models import require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "32", "--device", "cpu", "--threads", "1", "--no-progress"]


def test_keep_float_keeps_the_histograms_other_recipes_plot(llama_dir, tmp_path, capsys):
    from quantscope.calibration.results import plots

    out = tmp_path / "cmp"
    rc, _, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8,fp8",
                      "--observers", "minmax,mse", "--keep-float", "2", "--out", str(out),
                      *FAST)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    kept = next(iter(report["runs"].values()))["info"]["keep_float"]["tensors"]
    assert kept  # the first configuration took some inputs out...
    drawable = set(plots.histogram_layers(report))
    for label, run in report["runs"].items():  # ...which the others may keep static
        static = {r["layer"] for r in run["layers"] if r["role"] == "input" and not r["dynamic"]}
        assert static <= drawable, (label, sorted(static - drawable))
    for recipe in ("w8a8", "fp8"):
        rc, got, err = _run(capsys, "plot", str(out), "--recipe", recipe, "--out",
                            str(tmp_path / f"plots-{recipe}"))
        assert rc == 0, err
        assert (tmp_path / f"plots-{recipe}" / "hist.png").is_file(), got


def test_a_kv_cache_only_compare_lists_the_cache_and_claims_no_plots(llama_dir, tmp_path,
                                                                     capsys):
    out = tmp_path / "cmp"
    # `--targets` with no pattern: no layer (a target matching nothing is an error)
    rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                        "--observers", "minmax", "--targets", "--kv-cache", "fp8",
                        "--out", str(out), *FAST)
    assert rc == 0, err
    assert "warning: no sqnr.png: plot: no run of the report has a layer row" in err, err
    assert "and plots" not in got and not (out / "sqnr.png").exists()
    assert "report.json" in got
    run = json.loads((out / "report.json").read_text())["runs"]["w8a8/minmax"]
    assert run["layers"] == [] and {r["role"] for r in run["kv_cache"]} == {"key", "value"}
    md = (out / "report.md").read_text()
    assert "| KV cache |" in md and "fp8_e4m3 tensor sym (4 tensors)" in md, md


def test_compare_with_plots_names_them(llama_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                        "--observers", "minmax", "--out", str(out), *FAST)
    assert rc == 0, err
    assert "and plots (hist.png, sqnr.png)" in got, got
    assert "KV cache" not in got  # no configuration quantizes it: no column


def test_compare_verbose_prints_each_configurations_layers(llama_dir, tmp_path, capsys):
    """--verbose (shared with calibrate: 'also print the per-layer table') printed nothing
    more in compare: each configuration's layer table comes before the comparison."""
    args = ["compare", "--model", llama_dir, "--recipes", "w8a8", "--observers",
            "minmax,mse", "--no-plots", *FAST]
    rc, plain, err = _run(capsys, *args, "--out", str(tmp_path / "a"))
    assert rc == 0, err
    rc, verbose, err = _run(capsys, *args, "--out", str(tmp_path / "b"), "--verbose")
    assert rc == 0, err
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    for label, run in report["runs"].items():
        assert f"{label}: layers" in verbose and f"{label}: layers" not in plain
        for row in run["layers"]:
            assert row["layer"] in verbose
    assert verbose.index("w8a8/mse: layers") < verbose.index("quantscope compare:")


@pytest.mark.parametrize("runs", [{"w8a8/minmax": None}, [1, 2]], ids=["null-run", "list"])
def test_plot_names_a_report_whose_runs_are_malformed(tmp_path, capsys, runs):
    # probe s58: a hand-edited report gave a bare AttributeError line
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps({"setup": {}, "runs": runs}))
    rc, _, err = _run(capsys, "plot", str(tmp_path / "r"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "'runs' must map each run's name to a mapping" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["--recipes", "--observers"])
def test_compare_names_the_flag_that_names_nothing(tmp_path, capsys, flag):
    args = {"--recipes": "w8a8", "--observers": "minmax", flag: ","}
    rc, _, err = _run(capsys, "compare", "--model", str(tmp_path), *[x for kv in args.items()
                                                                   for x in kv])
    assert rc == 2 and f"{flag} ',' names no {flag[2:-1]}" in err, err


def test_plot_says_why_a_report_path_is_not_read(tmp_path, capsys):
    import os

    rc, _, err = _run(capsys, "plot", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "missing.json: no such file" in err, err
    os.mkfifo(tmp_path / "report.json")  # exists, but no regular file (no blocking read)
    rc, _, err = _run(capsys, "plot", str(tmp_path / "report.json"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "report.json: not a regular file" in err, err
