"""Command-line pins found by mutation (s66) of ``cli/calibrate.py``, ``cli/export.py`` and
``cli/options.py``: the documented defaults of the calibrating commands' options (and of
``evaluate`` / ``export``), the option types and choices argparse enforces (which flag, what
was expected), ``calibrate``'s summary lines and run folder, ``evaluate``'s overrides of what
the run recorded, and ``export``'s argument checks. Each test fails on a mutant of that round
that no earlier test killed."""

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from test_cli_pins_s61 import _args

from quantscope import cli
from quantscope.cli import names

transformers = pytest.importorskip("transformers")
from test_cli_probe_s54 import FAST
from tiny_models import bert_folder, require_lee_corpus


class Stop(Exception):
    """Raised by a stub once it has seen what it was called with."""


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny BERT calibrated once (w8a8, FAST) by main(): the model, the run and stdout."""
    require_lee_corpus()
    d = tmp_path_factory.mktemp("s66")
    model, run = str(bert_folder(d / "bert")), str(d / "run")
    with pytest.MonkeyPatch.context() as mp:
        out = io.StringIO()
        mp.setattr(sys, "stdout", out)
        assert cli.main(["calibrate", "--model", model, *FAST, "--out", run]) == 0
    return model, run, out.getvalue()


def test_calibrate_option_defaults_as_documented():
    """--help and command-line.md: --max-length 128, --eval-max-length 256, --batch-size 8,
    --sample-tokens 2048, --seed 0, --threads 0 (torch's choice), --keep-float 0, --fallback
    dynamic, --on-indivisible error, --device auto, the run in runs/calibrate."""
    a = _args("calibrate")
    assert (a.max_length, a.eval_max_length, a.batch_size, a.sample_tokens) == (128, 256, 8, 2048)
    assert (a.seed, a.threads, a.keep_float) == (0, 0, 0)
    assert (a.fallback, a.on_indivisible, a.device) == ("dynamic", "error", "auto")
    assert a.out == "runs/calibrate" and _args("compare").out == "runs/compare"
    assert a.no_progress is False and a.verbose is False
    assert a.sequential is None and a.smooth is None and a.sample_budget_mb is None


def test_targets_ignore_and_observers_defaults():
    """--targets not given is None (a recipe file keeps its own targets); --ignore defaults to
    the head and pooler; compare --observers to DEFAULT_OBSERVERS."""
    a = _args("calibrate")
    assert a.targets is None and list(a.ignore) == list(names.DEFAULT_IGNORE)
    assert _args("compare").observers == names.DEFAULT_OBSERVERS


def test_bare_list_flags_and_sequential():
    """--targets / --ignore with no pattern are empty lists (only --kv-cache's cache; nothing
    left float); a bare --sequential is 'float', the whole pass's qparams."""
    a = _args("calibrate", "--targets", "--ignore", "--sequential")
    assert a.targets == [] and a.ignore == [] and a.sequential == "float"
    assert _args("calibrate", "--sequential", "quantized").sequential == "quantized"


def test_fractional_option_values_parse():
    """--smooth ALPHA in [0, 1] and --sample-budget-mb MB are numbers with a fraction."""
    a = _args("calibrate", "--smooth", "0.85", "--sample-budget-mb", "0.5")
    assert a.smooth == 0.85 and a.sample_budget_mb == 0.5
    assert _args("compare", "--smooth", "0.5").smooth == 0.5


@pytest.mark.parametrize("argv, flag, expected", [
    (["--group-size", "32.5"], "--group-size", "invalid int value: '32.5'"),
    (["--kv-cache", "int3"], "--kv-cache", "invalid choice: 'int3'"),
    (["--task", "vision"], "--task", "invalid choice: 'vision'"),
    (["--threads", "x"], "--threads", "invalid int value: 'x'")])
def test_calibrate_refuses_a_bad_option_value_naming_the_flag(capsys, argv, flag, expected):
    """argparse's error: exit code 2, the flag named and what it expected."""
    rc, _, err = run_cli(capsys, "calibrate", *argv)
    assert rc == 2 and f"argument {flag}" in err and expected in err, err


def test_evaluate_and_export_defaults():
    """evaluate: --task and --eval-max-length default to the run's (None here); export:
    --format compressed-tensors, --external-data neither (None)."""
    e = _args("evaluate", "RUN")
    assert e.task is None and e.eval_max_length is None and e.threads == 0
    x = _args("export", "RUN", "--out", "DIR")
    assert x.format == "compressed-tensors" and x.external_data is None
    assert not x.overwrite and not x.allow_lossy and not x.allow_other_weights


def test_calibrate_summary_lines(calibrated):
    """The summary names the recipe and its observers, the cosine to float to 4 decimals (as
    report.json holds it), what stayed in float (the pooler), the calibration time to 1
    decimal, and the run's report.md; no per-layer table without --verbose."""
    _, run, out = calibrated
    report = json.loads(Path(run, "report.json").read_text())
    head = re.search(r"^quantscope calibrate: .*, w8a8, observer (\S+)$", out,
                     re.MULTILINE)
    assert head, out
    assert f"  cosine to float embeddings: {report['metrics']['cosine']:.4f}\n" in out, out
    left = r"^  left in float: .*pooler.* \(--ignore to change\)$"
    assert re.search(left, out, re.MULTILINE), out
    assert "intermediate.dense" not in out  # the per-layer table: --verbose only
    assert re.search(r"^  calibration \d+\.\d s, total \d+\.\d s$", out, re.MULTILINE), out
    assert f"  report: {os.path.join(run, 'report.md')}   next: quantscope evaluate " in out
    assert "lee_r_fp32" in report["metrics"] and "lee_r" in report["metrics"]
    # the saved label: recipe/observers, as the summary names them
    meta = json.loads(Path(run, "qparams", "quantscope.json").read_text())
    assert meta["label"] == f"w8a8/{head.group(1)}"


def test_calibrate_writes_report_md_and_replaces_its_own_run(calibrated, tmp_path, capsys):
    """The run folder holds qparams/, report.json and report.md; calibrating again into the
    same --out replaces quantscope's own run without a flag."""
    model, run, _ = calibrated
    assert {"qparams", "report.json", "report.md"} <= set(os.listdir(run))
    again = str(tmp_path / "again")
    for _ in range(2):
        rc, _, err = run_cli(capsys, "calibrate", "--model", model, *FAST, "--out", again)
        assert rc == 0, err
    assert Path(again, "report.md").read_text().startswith("# quantscope report: w8a8/")


def test_a_rank_other_than_0_calibrates_but_neither_evaluates_nor_writes(calibrated, tmp_path,
                                                                          capsys):
    """Under torchrun only rank 0 evaluates, writes and prints; the other ranks' phases are
    quiet (rank 1 of a one-process world here: calibrate runs, nothing else)."""
    from quantscope.cli.calibrate import cmd_calibrate

    model = calibrated[0]
    args = _args("calibrate", "--model", model, *FAST, "--out", str(tmp_path / "r1"))
    args.rank, args.world = 1, 1
    assert cmd_calibrate(args) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == "" and not (tmp_path / "r1").exists()


def _stub(monkeypatch, target, seen):
    def stub(*a, **k):
        seen.append((a, k))
        raise Stop
    monkeypatch.setattr(target, stub)


def test_evaluate_flags_override_what_the_run_recorded(calibrated, monkeypatch):
    """--eval-max-length N overrides the run's (recorded: 8), which applies when not given."""
    from quantscope.cli import calibrate

    _, run, _ = calibrated
    for flags, length in (([], 8), (["--eval-max-length", "16"], 16)):
        seen = []
        _stub(monkeypatch, "quantscope.cli.calibrate.Evaluator", seen)
        with pytest.raises(Stop):
            calibrate.cmd_evaluate(_args("evaluate", run, "--no-progress", *flags))
        assert seen[0][0][3] == length


def test_evaluate_task_flag_overrides_the_runs(calibrated, monkeypatch):
    """--task is the model's task over the one the run recorded (embedding here)."""
    from quantscope.cli import calibrate

    _, run, _ = calibrated
    for flags, task in (([], "embedding"), (["--task", "causal-lm"], "causal-lm")):
        seen = []
        _stub(monkeypatch, "quantscope.demo.models.load_model", seen)
        with pytest.raises(Stop):
            calibrate.cmd_evaluate(_args("evaluate", run, *flags))
        assert seen[0][1]["task"] == task


@pytest.mark.parametrize("flags, progress", [
    ([], True), (["--no-progress"], False), (["--json"], False)])
def test_evaluate_progress_bars_off_with_json(calibrated, monkeypatch, flags, progress):
    """--json prints one JSON line: no progress bars, as with --no-progress."""
    from quantscope.cli import calibrate

    seen = []
    _stub(monkeypatch, "quantscope.cli.calibrate.Evaluator", seen)
    with pytest.raises(Stop):
        calibrate.cmd_evaluate(_args("evaluate", calibrated[1], *flags))
    assert seen[0][0][4] is progress


def test_export_reads_the_format_in_any_case_and_says_what_it_wrote(calibrated, tmp_path,
                                                                    capsys):
    """--format is a name read in any case; the closing line names the folder written and
    the format as spelled in FORMATS. RUN may be the run's qparams/ itself."""
    run = calibrated[1]
    out = str(tmp_path / "ct")
    rc, printed, err = run_cli(capsys, "export", os.path.join(run, "qparams"), "--format",
                               "Compressed-Tensors", "--out", out)
    assert rc == 0, err
    assert printed.strip().splitlines()[-1] == (
        f"quantscope export: wrote {out} (compressed-tensors)")
    assert os.path.isfile(os.path.join(out, "config.json"))


@pytest.mark.parametrize("flag", ["--external-data", "--no-external-data"])
def test_external_data_flags_are_refused_outside_onnx_naming_the_flag(calibrated, tmp_path,
                                                                      capsys, flag):
    """Either spelling, which does nothing for compressed-tensors, is refused by name."""
    rc, _, err = run_cli(capsys, "export", calibrated[1], flag, "--out", str(tmp_path / "o"))
    assert rc == 2 and f"{flag} applies to --format onnx only, not compressed-tensors" in err
    assert not (tmp_path / "o").exists()


def test_export_run_refuses_external_data_outside_onnx(calibrated, tmp_path):
    """export_run(external_data=False) with compressed-tensors: a ValueError, not ignored."""
    from quantscope.cli.export import export_run

    with pytest.raises(ValueError, match="external_data applies to format='onnx' only"):
        export_run(calibrated[1], tmp_path / "o", external_data=False)


@pytest.mark.parametrize("target", ["model", "run", "other run"])
def test_export_out_refusals_name_the_flag(calibrated, tmp_path, capsys, target):
    """--out naming the model or the run (an input), or another calibrate run (another kind
    of output, even with --overwrite) is refused as '--out: ...', saying which, before
    anything loads."""
    model, run, _ = calibrated
    out = {"model": model, "run": run, "other run": str(tmp_path / "r2")}[target]
    if target == "other run":
        assert run_cli(capsys, "calibrate", "--model", model, *FAST, "--out", out)[0] == 0
    rc, _, err = run_cli(capsys, "export", run, "--model", model, "--out", out, "--overwrite")
    assert rc == 2 and "quantscope export: error: --out: output" in err, err
    because = "quantscope wrote, not" if target == "other run" else f"is the input {out!r}"
    assert because in err, err
    assert "exporting" not in err


def test_export_loads_the_model_for_the_recorded_task(calibrated, tmp_path, monkeypatch):
    """export_run loads the model as the run recorded its task (calibrate's --task)."""
    from quantscope.cli.export import export_run

    seen = []
    _stub(monkeypatch, "quantscope.demo.models.load_model", seen)
    with pytest.raises(Stop):
        export_run(calibrated[1], tmp_path / "o")
    assert seen[0][1] == {"task": "embedding"}


def test_check_refuses_a_folder_without_config_json(tmp_path, capsys):
    """check DIR: a folder that is not a model folder is a usage error naming it."""
    rc, _, err = run_cli(capsys, "check", str(tmp_path))
    assert rc == 2 and f"{str(tmp_path)!r} is not a model folder (no config.json)" in err, err


def test_evaluate_a_run_that_recorded_no_length_at_calibrates_default(calibrated, tmp_path,
                                                                      monkeypatch):
    """qparams saved without an eval_max_length (from Python) evaluate at calibrate's default
    --eval-max-length, 256 tokens (the tiny BERT holds 512 positions)."""
    import shutil

    from quantscope.cli import calibrate

    qdir = tmp_path / "qparams"
    shutil.copytree(os.path.join(calibrated[1], "qparams"), qdir)
    meta = json.loads((qdir / "quantscope.json").read_text())
    del meta["info"]["eval_max_length"]
    (qdir / "quantscope.json").write_text(json.dumps(meta))
    seen = []
    _stub(monkeypatch, "quantscope.cli.calibrate.Evaluator", seen)
    with pytest.raises(Stop):
        calibrate.cmd_evaluate(_args("evaluate", str(qdir), "--no-progress"))
    assert seen[0][0][3] == 256


def test_smooth_summary_line_names_alpha_as_given(llama_dir, tmp_path, capsys):
    """--smooth 0.85: the summary gives ALPHA as written (not rounded to 0.8 / 0.9) and adds
    '(N left as they were)' only where SmoothQuant skipped a module (none here)."""
    from quantscope.calibration import load

    run = str(tmp_path / "run")
    rc, out, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--recipe", "w8a8",
                           "--smooth", "0.85", "--out", run, *FAST)
    assert rc == 0, err
    smooth = load(Path(run, "qparams")).info["smooth"]
    assert smooth["alpha"] == 0.85 and not smooth["skipped"]
    n = len(smooth["smoothed"])
    line = f"  --smooth 0.85: {n} modules' outputs smoothed into the next layers' weights\n"
    assert line in out, out


def test_keep_float_summary_line_counts_activations_and_layers(llama_dir, tmp_path, capsys):
    """--keep-float N: N activations; the layers' inputs are counted apart only where a fused
    group's shared input took more layers than N (fused groups fall back whole)."""
    from quantscope.calibration import load

    run = str(tmp_path / "run")
    rc, out, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--recipe", "w8a8",
                           "--keep-float", "1", "--out", run, *FAST)
    assert rc == 0, err
    kept = load(Path(run, "qparams")).info["keep_float"]
    n, tensors = kept["n"], kept["tensors"]
    assert n == 1 and kept["mode"] == "dynamic"
    layers = f"({len(tensors)} layers' inputs, fused groups whole; " if len(tensors) > n else "("
    line = (f"  --keep-float: 1 activations dynamic instead of static {layers}first: "
            f"{tensors[0]}; all in qparams/quantscope.json)\n")
    assert line in out, out


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_a_run_that_is_a_file_is_refused_as_not_a_folder(tmp_path, capsys, command):
    """RUN must be a folder: a file there is named as such, not read as a run."""
    f = tmp_path / "run.json"
    f.write_text("{}")
    argv = [command, str(f)] + (["--out", str(tmp_path / "o")] if command == "export" else [])
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f"quantscope {command}: error: {str(f)!r} is not a folder" in err, err


def test_export_run_passes_allow_lossy_and_the_model_path_on(calibrated, tmp_path,
                                                             monkeypatch):
    """export_run hands the compressed-tensors exporter allow_lossy as given and the model
    folder the run recorded (model_path: its config and tokenizer files)."""
    from quantscope.cli.export import export_run

    seen = []
    _stub(monkeypatch, "quantscope.exporters.export", seen)
    with pytest.raises(Stop):
        export_run(calibrated[1], tmp_path / "o", allow_lossy=True)
    options = seen[0][1]
    assert options["allow_lossy"] is True and options["format"] == "compressed-tensors"
    assert os.path.samefile(options["model_path"], calibrated[0])
