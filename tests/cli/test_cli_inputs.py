"""What the command line reads and names: --calib-file (UTF-8) and --recipe-file checked
before the model loads, scheme names in `compare --recipes`, observer flags that no role
takes, `compare --plot-layer` and `plot --recipe / --layer` checked before the work they
would waste, and the label naming the observers the recipe runs."""

import importlib.util
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
from cli_helpers import run_cli as _run
from tiny_models import require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


# ------------------------------------------------------------------ --calib-file, --recipe-file

def test_calib_file_is_read_as_utf8_text(llama_dir, tmp_path, capsys, monkeypatch):
    from quantscope.demo import models

    docs = ["Café naïve résumé in Zürich", "東京の天気は晴れです"]
    f = tmp_path / "calib.txt"
    f.write_text("\n".join(docs) + "\n", encoding="utf-8")
    fed = []

    def stop(tok, calib, *a, **k):  # what the tokenizer is given; then stop the run
        fed.extend(calib)
        raise RuntimeError("stop here")
    monkeypatch.setattr(models, "token_batches", stop)
    rc, _, err = _run(capsys, "calibrate", "--model", llama_dir, "--calib-file", str(f),
                      "--out", str(tmp_path / "run"), *FAST)
    assert rc == 2 and "stop here" in err, err
    assert fed == docs


def test_a_calib_file_that_is_not_utf8_stops_before_the_model_loads(llama_dir, tmp_path,
                                                                    capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café\nabc\n".encode("latin-1"))
    rc, _, err = _run(capsys, "calibrate", "--model", llama_dir, "--calib-file", str(f),
                      "--out", str(tmp_path / "run"), *FAST)
    assert rc == 2, err
    assert f"--calib-file: corpus file {str(f)!r} is not UTF-8 text: byte 0xe9 at offset 3" \
        in err, err
    assert "loading" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,flag", [("calibrate", "--calib-file"),
                                          ("calibrate", "--recipe-file"),
                                          ("compare", "--calib-file")])
@pytest.mark.parametrize("kind,said", [("folder", "is a folder"),
                                       ("device", "is not a regular file"),
                                       ("missing", "does not exist")])
def test_input_files_say_what_is_wrong_before_the_model_loads(llama_dir, tmp_path, capsys,
                                                              command, flag, kind, said):
    path = {"folder": str(tmp_path), "device": "/dev/null",
            "missing": str(tmp_path / "none.txt")}[kind]
    extra = ["--observers", "minmax", "--no-plots"] if command == "compare" else []
    rc, _, err = _run(capsys, command, "--model", llama_dir, flag, path, *extra,
                      "--out", str(tmp_path / "run"), *FAST)
    assert rc == 2 and f"error: {flag} {path!r} {said}" in err, err
    assert "loading" not in err, err


@pytest.mark.parametrize("flag,name,text", [
    ("--calib-file", "report.md", "the cat sat on the mat\na dog ran far away\n"),
    ("--recipe-file", "recipe.json",
     '{"rules": [{"targets": ["Linear"], "weight": {"spec": {"format": "int8"}}}]}')])
def test_an_out_holding_an_input_file_is_refused_before_the_model_loads(
        llama_dir, tmp_path, capsys, monkeypatch, flag, name, text):
    """--out may never replace what the command reads: an earlier run's folder holding the
    --calib-file or --recipe-file given is refused naming that input, before the model loads
    (mutation s61: without them the refusal came only at saving, after the calibration)."""
    from quantscope.demo import models
    from quantscope.exporters.atomic import atomic_dir

    run = tmp_path / "run"
    with atomic_dir(str(run), what="calibrate-run") as tmp:
        Path(tmp, name).write_text(text)

    def no_load(*a, **k):
        raise RuntimeError("the model was loaded")
    monkeypatch.setattr(models, "load_model", no_load)
    rc, _, err = _run(capsys, "calibrate", "--model", llama_dir, flag, str(run / name),
                      "--out", str(run), *FAST)
    assert rc == 2, err
    assert (f"error: --out: output {str(run)!r} contains the input {str(run / name)!r}: "
            f"writing it would replace it") in err, err
    assert "loading" not in err and (run / name).read_text() == text, err


@pytest.mark.parametrize("name,text,said", [
    ("bad.json", '{"rules": [1, 2', "is not valid JSON: Expecting ',' delimiter"),
    ("bad.yaml", "rules: [\n", "parses as neither JSON nor plain YAML"),
    ("evil.yaml", "!!python/object/apply:os.system ['true']\n",
     "parses as neither JSON nor plain YAML: could not determine a constructor")])
def test_a_recipe_file_that_does_not_parse_stops_before_the_model_loads(
        llama_dir, tmp_path, capsys, name, text, said):
    f = tmp_path / name
    f.write_text(text)
    rc, _, err = _run(capsys, "calibrate", "--model", llama_dir, "--recipe-file", str(f),
                      "--out", str(tmp_path / "run"), *FAST)
    assert rc == 2 and f"error: --recipe-file {str(f)!r} {said}" in err, err
    assert "loading" not in err, err


# ------------------------------------------------------------------ compare --recipes

def test_recipe_names_resolve_by_their_exact_spelling_in_compare():
    from quantscope.cli.checks import UsageError, check_recipe_name

    assert check_recipe_name("W8A8") == "W8A8" and check_recipe_name("w8a8") == "w8a8"
    assert check_recipe_name("FP8") == "FP8" and check_recipe_name("fp8") == "fp8"
    # calibrate's flags say which registry: any case there, but the other one's exact
    # spelling (probe s40: --recipe W8A8 ran the static preset w8a8 without a word)
    assert check_recipe_name("w8A8", "scheme") == "W8A8"
    assert check_recipe_name("W8a8", "preset") == "w8a8"
    with pytest.raises(UsageError, match=r"--recipe 'W8A8' is a scheme's spelling \(give it "
                                         r"to --scheme\)"):
        check_recipe_name("W8A8", "preset")
    with pytest.raises(UsageError, match=r"--scheme 'w8a8' is a preset's spelling \(give it "
                                         r"to --recipe\)"):
        check_recipe_name("w8a8", "scheme")
    with pytest.raises(UsageError, match="unknown recipe or scheme 'W8a8'; did you mean"):
        check_recipe_name("W8a8")


def test_compare_runs_the_scheme_a_scheme_name_names(llama_dir, tmp_path, capsys):
    from quantscope.calibration.recipe import preset, scheme

    out = tmp_path / "cmp"
    rc, _, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "W8A8,w8a8",
                      "--observers", "minmax", "--no-plots", "--out", str(out), *FAST)
    assert rc == 0, err
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert set(runs) == {"W8A8/minmax", "w8a8/minmax"}
    for label, rec in (("W8A8/minmax", scheme("W8A8")), ("w8a8/minmax", preset("w8a8"))):
        dynamic = {r["dynamic"] for r in runs[label]["layers"] if r["role"] == "input"}
        assert dynamic == {rec.rules[0].input.dynamic}, label


@pytest.mark.parametrize("flag,names,twice", [("--recipes", "w8a8,w4a8,w8a8", "w8a8"),
                                              ("--observers", "minmax,mse,minmax", "minmax")])
def test_compare_names_given_twice_are_an_error(tmp_path, capsys, flag, names, twice):
    other = {"--recipes": ["--observers", "minmax"], "--observers": ["--recipes", "w8a8"]}
    rc, _, err = _run(capsys, "compare", flag, names, *other[flag],
                      "--out", str(tmp_path / "cmp"))
    assert rc == 2 and f"error: {flag} names {twice!r} more than once" in err, err


# ------------------------------------------------------------------ compare --plot-layer

def test_a_plot_layer_typo_stops_before_the_float_evaluation(llama_dir, tmp_path, capsys):
    rc, _, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                      "--observers", "minmax", "--plot-layer", "model.layers.0.mlp.dwon_proj",
                      "--out", str(tmp_path / "cmp"), *FAST)
    assert rc == 2, err
    assert "error: --plot-layer 'model.layers.0.mlp.dwon_proj'" in err, err
    assert "did you mean 'model.layers.0.mlp.down_proj'" in err, err
    assert "evaluating float" not in err and "calibrating" not in err, err
    assert not (tmp_path / "cmp").exists()


def test_a_plot_layer_with_no_plots_is_refused(llama_dir, tmp_path, capsys):
    # --no-plots draws none, so the layer would be read by nothing (not even checked)
    rc, _, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                      "--observers", "minmax", "--plot-layer", "model.layers.0.mlp.dwon_proj",
                      "--no-plots", "--out", str(tmp_path / "cmp"), *FAST)
    assert rc == 2 and "error: --plot-layer chooses the layer" in err and "--no-plots" in err
    assert "evaluating float" not in err and not (tmp_path / "cmp").exists()


def test_a_failing_plot_never_loses_the_report(llama_dir, tmp_path, capsys, monkeypatch):
    from quantscope.calibration.results import plots

    def fail(*a, **k):
        raise RuntimeError("the plot failed")
    monkeypatch.setattr(plots, "plot_histogram", fail)
    out = tmp_path / "cmp"
    rc, got, err = _run(capsys, "compare", "--model", llama_dir, "--recipes", "w8a8",
                        "--observers", "minmax", "--plot-layer", "model.layers.0.mlp.down_proj",
                        "--out", str(out), *FAST)
    assert rc == 0 and "warning: no hist.png: the plot failed" in err, err
    if importlib.util.find_spec("matplotlib"):  # the other plot is drawn all the same
        assert (out / "sqnr.png").is_file() and "and plots (sqnr.png)" in got, got
    assert set(json.loads((out / "report.json").read_text())["runs"]) == {"w8a8/minmax"}
    assert "w8a8" in (out / "report.md").read_text()


# ------------------------------------------------------------------ observer flags, label

@pytest.mark.parametrize("recipe,why", [
    ("w4a16", "recipe 'w4a16' has no input role"),
    ("w8a8-dynamic", "recipe 'w8a8-dynamic' has dynamic inputs, quantized at run time")])
def test_an_input_observer_no_role_takes_is_an_error(llama_dir, tmp_path, capsys, recipe, why):
    rc, _, err = _run(capsys, "calibrate", "--model", llama_dir, "--recipe", recipe,
                      "--input-observer", "mse", "--out", str(tmp_path / "run"), *FAST)
    assert rc == 2 and f"error: --input-observer mse: {why}" in err, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists()


def test_with_role_observer_refuses_a_role_no_rule_calibrates():
    from quantscope.calibration.recipe import preset, with_role_observer

    with pytest.raises(ValueError, match="recipe 'w4a16' has no input role"):
        with_role_observer(preset("w4a16"), "input", "mse")
    with pytest.raises(ValueError, match="recipe 'w8a8-dynamic' has dynamic inputs"):
        with_role_observer(preset("w8a8-dynamic"), "input", "mse")
    rec = with_role_observer(preset("w8a8-dynamic"), "weight", "mse")
    assert rec.rules[0].weight.observer == "mse"


@pytest.mark.parametrize("flags", [["--recipe", "w4a16", "--observer", "mse", "--group-size",
                                    "32"],
                                   ["--recipe", "w8a8", "--weight-observer", "minmax",
                                    "--input-observer", "mse"]])
def test_the_label_names_the_observers_the_recipe_runs(llama_dir, tmp_path, capsys, flags):
    run = tmp_path / "run"
    rc, out, err = _run(capsys, "calibrate", "--model", llama_dir, *flags, "--out", str(run),
                        *FAST)
    assert rc == 0, err
    meta = json.loads((run / "qparams" / "quantscope.json").read_text())
    rule = meta["recipe"]["rules"][0]
    ran = "/".join(dict.fromkeys(rule[k]["observer"] for k in ("weight", "input")
                                 if rule[k] and rule[k]["dynamic"] is not True))
    assert meta["label"] == f"{flags[1]}/{ran}"
    assert f"{flags[1]}, observer {ran}" in out
    assert (run / "report.md").read_text().startswith(f"# quantscope report: {flags[1]}/{ran}")


# ------------------------------------------------------------------ plot --recipe, --layer

REPORT = {"runs": {"w8a8/minmax": {
    "recipe": "w8a8", "observer": "minmax",
    "layers": [{"layer": "l0", "role": "input", "sqnr_db": 30.0, "dynamic": False,
                "requested": "minmax", "observer": "minmax", "clip_lo": -1.0,
                "clip_hi": 1.0}]}},
    "histograms": {"l0/input": {"counts": [1, 4, 4, 1], "lo": -1.5, "hi": 1.5}}}


@pytest.mark.parametrize("flag,value,said", [
    ("--recipe", "W8A8", "--recipe 'W8A8': no run of the report has it; did you mean 'w8a8'"),
    ("--layer", "l1", "--layer 'l1': the report has no input histogram of it")])
def test_plot_checks_recipe_and_layer_before_writing(tmp_path, capsys, flag, value, said):
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    out = tmp_path / "plots"
    rc, _, err = _run(capsys, "plot", str(tmp_path), flag, value, "--out", str(out))
    assert rc == 2 and f"error: {said}" in err, err
    assert not out.exists()


def test_plot_histogram_refuses_a_recipe_no_run_has(tmp_path):
    pytest.importorskip("matplotlib")
    from quantscope.calibration.results import plots

    with pytest.raises(ValueError, match="no run of recipe 'w8a9'"):
        plots.plot_histogram(REPORT, "l0", str(tmp_path / "h.png"), recipe="w8a9")
    assert Path(plots.plot_histogram(REPORT, "l0", str(tmp_path / "h.png"),
                                     recipe="w8a8")).is_file()


PNG = b"\x89PNG\r\n\x1a\n"  # the PNG signature


def test_plot_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path, capsys):
    # found by probing: savefig(path) followed RUN/hist.png -> a user's file and wrote a PNG
    # over it; the plot now replaces the link, the file it pointed at is left as it was
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps(REPORT))
    victim = tmp_path / "notes.txt"
    victim.write_text("precious user data\n")
    (run / "hist.png").symlink_to(victim)
    (run / "sqnr.png").symlink_to(victim)
    # not plots quantscope wrote there (no .quantscope-output lists them): refused as they are
    rc, _, err = _run(capsys, "plot", str(run))
    assert rc == 2 and "--overwrite" in err, err
    assert (run / "hist.png").is_symlink() and victim.read_text() == "precious user data\n"
    rc, _, err = _run(capsys, "plot", str(run), "--overwrite")
    assert rc == 0, err
    assert victim.read_text() == "precious user data\n"
    for name in ("hist.png", "sqnr.png"):
        assert not (run / name).is_symlink() and (run / name).read_bytes()[:8] == PNG


def test_plot_functions_replace_a_symlink_for_library_callers(tmp_path):
    pytest.importorskip("matplotlib")
    from quantscope.calibration.results import plots

    victim = tmp_path / "notes.txt"
    victim.write_text("keep")
    (tmp_path / "s.png").symlink_to(victim)
    assert plots.plot_sqnr(REPORT, str(tmp_path / "s.png")) == str(tmp_path / "s.png")
    assert victim.read_text() == "keep" and not (tmp_path / "s.png").is_symlink()
    read = tmp_path / "read.png"  # (a .txt is refused by its extension first)
    read.write_text("keep")
    with pytest.raises(ValueError, match="is the input"):
        plots.plot_sqnr(REPORT, str(read), inputs=[str(read)])
    assert read.read_text() == "keep"


def test_plot_refuses_to_write_over_its_own_input(tmp_path, capsys):
    # found by probing: `plot run2/sqnr.png` (the report under that name) drew sqnr.png over
    # the report it read, since --out defaults to the report's folder
    pytest.importorskip("matplotlib")
    report = tmp_path / "sqnr.png"
    report.write_text(json.dumps(REPORT))
    rc, _, err = _run(capsys, "plot", str(report))
    assert rc == 2, err
    assert (f"error: --out (default: the report's folder): output '{report}' is the input "
            f"'{report}'") in err, err
    assert json.loads(report.read_text()) == REPORT
    assert not (tmp_path / "hist.png").exists()  # both checked before either is drawn


def test_plot_writes_both_pngs_into_a_new_out_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    out = tmp_path / "a" / "plots"
    rc, stdout, err = _run(capsys, "plot", str(tmp_path), "--out", str(out))
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["hist.png", "sqnr.png"]  # no temporaries
    assert all((out / n).read_bytes()[:8] == PNG for n in ("hist.png", "sqnr.png"))
    assert f"wrote {out}/hist.png (l0 input, w8a8's clipping ranges)" in stdout


# ------------------------------------------------------------------ relative input paths

def test_a_run_records_absolute_inputs_so_export_elsewhere_uses_the_same_model(
        llama_dir, tmp_path, capsys, monkeypatch):
    # found by probing: a run calibrated with `--model llama` recorded "llama"; `export` of
    # that run from another folder holding another "llama" wrote those weights silently
    import shutil

    from safetensors.torch import load_file, save_file

    from quantscope.calibration import load

    a, b = tmp_path / "A", tmp_path / "B"
    shutil.copytree(llama_dir, a / "llama")
    shutil.copytree(llama_dir, b / "llama")
    (f,) = (b / "llama").glob("*.safetensors")
    save_file({k: v * 1.5 for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    (a / "docs.txt").write_text("one calibration line\nanother calibration line\n")
    monkeypatch.chdir(a)
    rc, _, err = _run(capsys, "calibrate", "--model", "llama", "--calib-file", "docs.txt",
                      "--recipe", "w8a8", "--out", "runs/r", *FAST)
    assert rc == 0, err
    info = load(a / "runs" / "r" / "qparams").info
    assert info["model"] == str((a / "llama").resolve())
    assert info["calib_file"] == str((a / "docs.txt").resolve())
    monkeypatch.chdir(b)  # another working folder, with another model of the same name
    rc, _, err = _run(capsys, "export", "../A/runs/r", "--out", str(tmp_path / "exported"))
    assert rc == 0, err
    key = "model.embed_tokens.weight"  # float: copied from the model the export loaded
    (src,) = (a / "llama").glob("*.safetensors")
    assert load_file(tmp_path / "exported" / "model.safetensors")[key].equal(
        load_file(src)[key])


def test_export_format_takes_any_case_and_an_existing_file_is_said_to_exist(tmp_path, capsys):
    # found by probing: `--format ONNX` was an unknown format while other names take any
    # case, and an existing 0-byte --out file "exists and is not empty"
    run = tmp_path / "run" / "qparams"
    run.mkdir(parents=True)
    (run / "quantscope.json").write_text("{}")  # a run as far as the checks before loading go
    out = tmp_path / "model.onnx"
    out.write_bytes(b"")
    rc, _, err = _run(capsys, "export", str(tmp_path / "run"), "--format", "ONNX",
                      "--out", str(out))
    assert rc == 2
    assert f"--out: output {str(out)!r} exists and is not an ONNX file quantscope" in err, err
    assert "--overwrite" not in err, err  # it would be refused: not offered
    rc, _, err = _run(capsys, "export", str(tmp_path / "run"), "--format", "onnxx",
                      "--out", str(out))
    assert rc == 2 and "unknown format 'onnxx'" in err and "'onnx'" in err, err


@pytest.mark.parametrize("n,expect", [(3, [0, 3, 6]), (6, [0, 1, 3, 5, 6, 8]),
                                      (10, list(range(10))), (12, list(range(10)))])
def test_calib_docs_are_taken_evenly_from_the_whole_text(n, expect):
    from quantscope.cli.running import spread

    # floor(i * 10 / n): --calib-docs 6 of 10 reaches the last documents (it took the first 6)
    assert spread(list(range(10)), n) == expect


@pytest.mark.parametrize("args,said", [
    (["compare", "--recipes", "w8a8", "--observers", "minmax", "--auto-metric", "tensor"],
     "--auto-metric / --score-tokens say how the 'auto' observer chooses: add auto"),
    (["compare", "--recipes", "w8a8", "--observers", "minmax", "--score-tokens", "64"],
     "--auto-metric / --score-tokens say how the 'auto' observer chooses: add auto"),
    (["compare", "--recipes", "w8a8", "--observers", "auto", "--auto-metric", "tensor",
      "--score-tokens", "64"],
     "--score-tokens is read only by --auto-metric model or fisher; --auto-metric tensor"),
    (["calibrate", "--recipe", "w8a8", "--fallback", "float"],
     "--fallback float says what --keep-float's activations become: give --keep-float N")])
def test_flags_that_would_do_nothing_are_refused_before_the_model_loads(tmp_path, capsys,
                                                                        args, said):
    """calibrate refuses the option objects they build (Auto without an auto role, Outliers'
    fallback without keep_float): said here first, naming the flag, with no model loaded."""
    rc, _, err = _run(capsys, *args, "--model", str(tmp_path / "absent"), "--out",
                      str(tmp_path / "out"))
    assert rc == 2 and f"error: {said}" in err, err
