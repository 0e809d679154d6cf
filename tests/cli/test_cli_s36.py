"""Command-line checks found by probing (session 36).

D1. A bad --model or --out fails before torch is imported (the seed check, which imports
    it, ran first; and the output-path guard's own imports pulled torch in).
D2. ``compare --sequential quantized`` with several configurations is refused up front,
    naming the flags (it was refused after the float model was evaluated).
D3. A misspelt target with a KV cache is "no module matches", not a KV-cache-only run;
    the command line's KV-cache-only recipe is `--targets` with no pattern.
D4. ``plot --out DIR`` replaces only the plots quantscope wrote into its output folder;
    a file of yours there needs --overwrite.
D5. A --targets / --ignore regex that does not compile names the flag before the model loads.
And: a refused output no longer offers --overwrite where --overwrite would be refused too.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli

from quantscope import cli


def _fake_model(tmp_path):
    """A folder that passes --model's checks (config.json) but holds no model: loading it
    would fail, so an error naming a flag was raised before the model loaded."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return str(model)


# ---------------------------------------------------------------- D1
def test_model_and_out_are_checked_before_torch_is_imported(tmp_path):
    cwd = str(tmp_path)
    cases = [
        (["calibrate", "--model", "nonexist"], "--model 'nonexist' does not exist"),
        (["compare", "--model", "nonexist"], "--model 'nonexist' does not exist"),
        (["calibrate", "--out", cwd], "is the current working folder"),
        (["compare", "--out", cwd], "is the current working folder"),
    ]
    code = ("import os, sys; from quantscope import cli\n"
            f"os.chdir({cwd!r})\n"
            f"for argv in {[a for a, _ in cases]!r}:\n"
            "    assert cli.main(argv) == 2, argv\n"
            "    assert 'torch' not in sys.modules, ('torch imported', argv)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == len(cases), err
    for line, (_, said) in zip(err, cases):
        assert said in line, line


def test_the_output_guard_imports_no_torch():
    code = ("import sys; import quantscope.exporters.atomic, quantscope.exporters; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- D2
def test_compare_sequential_quantized_takes_one_configuration_up_front(tmp_path, capsys):
    model = _fake_model(tmp_path)
    rc, _, err = run_cli(capsys, "compare", "--model", model, "--recipes", "w8a8",
                         "--observers", "minmax,mse", "--sequential", "quantized",
                         "--out", str(tmp_path / "out"))
    assert rc == 2, err
    assert "--sequential quantized" in err and "--recipes" in err and "--observers" in err
    assert "2 configurations" in err and "loading" not in err, err
    # one configuration, or --sequential float with several, pass the checks
    from quantscope.cli.compare import _check_compare_args

    for argv in (["--observers", "minmax", "--sequential", "quantized"],
                 ["--observers", "minmax,mse", "--sequential"]):
        args = cli.build_parser().parse_args(["compare", "--model", model, "--recipes", "w8a8",
                                              *argv, "--out", str(tmp_path / "out")])
        assert _check_compare_args(args)[0] == ["w8a8"]


# ---------------------------------------------------------------- D3
def test_a_misspelt_target_with_a_kv_cache_matches_nothing():
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.calibration import Recipe, preset

    model, _ = llama()
    with pytest.raises(ValueError, match=r"no module matches targets \['Lineer'\]"):
        preset("w8a8", targets=["Lineer"], kv_cache="fp8").match(model)
    # rules that take modules keep the KV cache's roles beside theirs
    got = preset("w8a8", kv_cache="fp8").match(model)
    attention = {f"model.layers.{i}.self_attn" for i in range(2)}
    assert attention <= set(got) and all(set(got[n][1]) == {"key", "value"} for n in attention)
    assert "model.layers.0.self_attn.q_proj" in got
    # a KV-cache-only recipe has no rules: the attention modules alone
    assert set(Recipe((), kv_cache="fp8").match(model)) == attention


def test_cli_targets_typo_with_kv_cache_is_an_error(llama_dir, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--targets", "Lineer",
                         "--kv-cache", "fp8", "--calib-docs", "2", "--max-length", "8",
                         "--no-progress", "--threads", "1", "--out", str(tmp_path / "run"))
    assert rc == 2, err
    assert "no module matches targets ['Lineer']" in err, err
    assert not (tmp_path / "run").exists()


def test_targets_with_no_pattern_is_the_kv_cache_alone(tmp_path, capsys):
    """The command line's KV-cache-only recipe, now that a target matching nothing is an
    error: `--targets` with no pattern (and --kv-cache, else it is said before loading)."""
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.cli.recipes import build_recipe

    rc, _, err = run_cli(capsys, "calibrate", "--model", _fake_model(tmp_path), "--targets",
                         "--out", str(tmp_path / "out"))
    assert rc == 2 and "--targets with no pattern quantizes no layer: add --kv-cache" in err
    model, _ = llama()
    for argv in (["--targets", "--kv-cache", "fp8"], ["--kv-cache", "fp8", "--targets"]):
        args = cli.build_parser().parse_args(["calibrate", *argv])
        args.recipe = "w8a8"
        rec = build_recipe(args, model)
        assert rec.rules == () and rec.kv_cache is not None
        assert set(rec.match(model)) == {f"model.layers.{i}.self_attn" for i in range(2)}


@pytest.mark.parametrize(("flags", "observer"), [((), "minmax"), (("--observer", "mse"), "mse")])
def test_a_kv_cache_only_run_is_labelled_by_its_kv_observer(flags, observer):
    """The summary, report and saved label name the KV cache's observer, not 'none (all
    dynamic)', and the float note says no layer was quantized."""
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.cli.recipes import build_recipe, float_note, observer_label

    model, _ = llama()
    args = cli.build_parser().parse_args(["calibrate", "--targets", "--kv-cache", "fp8", *flags])
    args.recipe = "w8a8"
    rec = build_recipe(args, model)
    assert observer_label(rec) == f"{observer} (KV cache only)"
    assert float_note(rec, model).startswith("left in float: every layer")


# ---------------------------------------------------------------- D4
def _compare_run(tmp_path):
    """A compare run folder as quantscope writes it (its marker lists hist.png, sqnr.png)."""
    from quantscope.exporters.atomic import atomic_dir

    def row(obs, lo, hi):
        return {"layer": "l", "role": "input", "clip_lo": lo, "clip_hi": hi, "dynamic": False,
                "requested": obs, "observer": obs, "sqnr_db": 20.0}
    report = {"setup": {}, "histograms": {"l/input": {"lo": -4.0, "hi": 5.0,
                                                       "counts": [1, 5, 9, 5, 1]}},
              "runs": {f"w8a8/{o}": {"recipe": "w8a8", "observer": o,
                                     "layers": [row(o, lo, hi)]}
                       for o, lo, hi in (("minmax", -4.0, 5.0), ("mse", -2.0, 3.0))}}
    run = tmp_path / "run"
    with atomic_dir(run, what="compare-run") as tmp:
        with open(f"{tmp}/report.json", "w") as f:
            json.dump(report, f)
        for name in ("hist.png", "sqnr.png"):
            with open(f"{tmp}/{name}", "w") as f:
                f.write("an earlier plot")
    return run


def test_plot_replaces_its_own_plots_but_not_a_users_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _compare_run(tmp_path)
    # into the run folder (the default --out): its own plots, replaced without a flag
    rc, _, err = run_cli(capsys, "plot", str(run))
    assert rc == 0, err
    assert (run / "hist.png").read_bytes()[:4] == b"\x89PNG"
    # a folder of yours: your hist.png is refused, and neither plot is written
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "hist.png").write_text("my own figure")
    rc, _, err = run_cli(capsys, "plot", str(run), "--out", str(mine))
    assert rc == 2
    assert "--out: output" in err and "hist.png" in err and "--overwrite" in err, err
    assert "is not one quantscope wrote" in err, err
    assert (mine / "hist.png").read_text() == "my own figure"
    assert not (mine / "sqnr.png").exists()
    # --overwrite says to replace it
    rc, _, err = run_cli(capsys, "plot", str(run), "--out", str(mine), "--overwrite")
    assert rc == 0, err
    assert (mine / "hist.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_help_says_what_out_replaces():
    helps = cli.build_parser()._subparsers._group_actions[0].choices["plot"].format_help()
    assert "--overwrite" in helps and "quantscope wrote" in helps


def test_the_python_plots_still_replace_any_file(tmp_path):
    """plot_histogram(report, layer, path) writes path as open(path, "w") would (documented
    in SECURITY.md): only the command line asks before replacing a file it did not write."""
    pytest.importorskip("matplotlib")
    from quantscope.calibration.results import plots

    report = json.loads((_compare_run(tmp_path) / "report.json").read_text())
    path = tmp_path / "h.png"
    path.write_text("mine")
    plots.plot_histogram(report, "l", str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- D5
@pytest.mark.parametrize("flag", ["--targets", "--ignore"])
@pytest.mark.parametrize("command", ["calibrate", "compare"])
def test_a_bad_regex_names_its_flag_before_the_model_loads(tmp_path, capsys, flag, command):
    rc, _, err = run_cli(capsys, command, "--model", _fake_model(tmp_path), flag, "re:[",
                         "--out", str(tmp_path / "out"))
    assert rc == 2, err
    assert f"error: {flag}: 're:[' is not a valid regular expression" in err, err
    assert "Rule.targets" not in err and "Recipe.ignore" not in err and "loading" not in err


# ---------------------------------------------------------------- --overwrite hint
def test_a_refused_output_offers_overwrite_only_where_it_would_replace(tmp_path, capsys):
    from quantscope.exporters.atomic import atomic_dir, check_writable_target

    run = tmp_path / "run" / "qparams"
    run.mkdir(parents=True)
    (run / "quantscope.json").write_text("{}")  # a run as far as the checks before loading go
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--out", str(user))
    assert rc == 2
    assert "is not a folder quantscope wrote" in err and "--overwrite" not in err, err
    # an earlier export of quantscope's: --overwrite would replace it, so it is offered
    ours = tmp_path / "ours"
    with atomic_dir(ours, what="compressed-tensors") as tmp:
        (Path(tmp) / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"pass overwrite=True \(--overwrite\)"):
        check_writable_target(ours, what="compressed-tensors")
    check_writable_target(ours, overwrite=True, what="compressed-tensors")
