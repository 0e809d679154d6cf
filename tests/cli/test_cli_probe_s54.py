"""Probe s54 (the command line): a folder named like a demo model checked as the path it is,
a non-UTF-8 ``--out`` name printed, ``--kv-cache`` and a recipe file's option values checked
before any forward, pasteable "next:" commands, usage errors in one line, observer names in
any case, library warnings as ``warning:`` lines, no signed zero, no doubled command name."""

import io
import json
import os
import subprocess
import sys
import warnings

import pytest
from cli_helpers import run_cli

from quantscope import cli

transformers = pytest.importorskip("transformers")
from tiny_models import bert_folder, require_lee_corpus

FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BERT folder (an encoder: no KV cache), once per module."""
    require_lee_corpus()
    return str(bert_folder(tmp_path_factory.mktemp("tiny-bert")))


def _quantized_folder(path) -> None:
    """A folder that looks like a compressed-tensors export (what --model refuses early)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert",
        "quantization_config": {"quant_method": "compressed-tensors"}}))


def _fake_run(path) -> str:
    """A folder that passes for a calibrate run until its qparams load."""
    (path / "qparams").mkdir(parents=True)
    (path / "qparams" / "quantscope.json").write_text("{}")
    return str(path)


@pytest.mark.parametrize("name", ["minilm", "SmolLM2-135M"])
@pytest.mark.parametrize("command", ["calibrate", "compare", "evaluate", "export"])
def test_a_folder_named_like_a_demo_model_is_checked_as_the_path_it_is(
        tmp_path, monkeypatch, capsys, command, name):
    """F1: ``--model minilm`` loads ./minilm where it exists, so the early checks read it too
    (a quantized checkpoint refused before the load), and a warning says which model it is."""
    monkeypatch.chdir(tmp_path)
    _quantized_folder(tmp_path / name)
    run = _fake_run(tmp_path / "run")
    argv = {"calibrate": ["calibrate", "--out", "o"],
            "compare": ["compare", "--observers", "minmax", "--no-plots", "--out", "o"],
            "evaluate": ["evaluate", run], "export": ["export", run, "--out", "o"]}[command]
    rc, _, err = run_cli(capsys, *argv, "--model", name)
    assert rc == 2, err
    assert f"--model '{name}' is a quantized checkpoint" in err, err
    assert f"warning: --model {name}: the folder ./{name} here, not the demo model" in err, err
    assert "loading" not in err and not (tmp_path / "o").exists(), err


def test_a_demo_name_with_no_such_folder_names_the_demo(tmp_path, monkeypatch):
    from quantscope._plainchecks import demo_model_name
    from quantscope.cli.running import command_inputs
    from quantscope.demo import models

    monkeypatch.chdir(tmp_path)
    assert demo_model_name("MiniLM") == "minilm" and demo_model_name("./minilm") is None
    assert tuple(models.DEMO_MODELS) == ("minilm", "smollm2-135m")
    (tmp_path / "minilm").mkdir()
    assert demo_model_name("minilm") is None  # the folder here: what resolve_model_path loads

    class Args:
        model, calib_file, recipe_file = "minilm", None, None
    assert command_inputs(Args) == ["minilm"]  # so --out may never replace it


def _strict_stream():
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", newline="\n")


def test_a_run_under_a_non_utf8_out_name_prints_its_summary(bert_dir, tmp_path, monkeypatch):
    """F2: stdout strict, as Python makes it under a UTF-8 locale: the run saved under
    ``bad<0xff>name`` printed its summary as an encoding error, exit code 2. Its paths print
    as their bytes now, the "next:" commands as bash's $'...', and the streams are put back
    (stderr strict too, as a caller of main() may have it)."""
    out, err = _strict_stream(), _strict_stream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    run = os.path.join(str(tmp_path), os.fsdecode(b"bad\xffname"))
    rc = cli.main(["calibrate", "--model", bert_dir, *FAST, "--out", run])
    out.flush()
    err.flush()
    assert rc == 0, err.buffer.getvalue()
    assert out.errors == "strict" and err.errors == "strict"
    assert os.fsencode(f"saving {run}") in err.buffer.getvalue()
    printed = out.buffer.getvalue()
    assert os.fsencode(os.path.join(run, "report.md")) in printed, printed
    assert b"next: quantscope evaluate $'" in printed and b"bad\\xffname'" in printed, printed
    assert os.path.isfile(os.path.join(run, "report.json"))


@pytest.mark.parametrize("path, word", [
    ("runs/a b", "'runs/a b'"), (os.fsdecode(b"r/\xff'\\"), "$'r/\\xff\\x27\\x5c'"),
    ("-dash", "./-dash"), ("-a b", "'./-a b'"), ("--", "./--"), ("/abs/-x", "/abs/-x")])
def test_shell_word_names_the_path_when_pasted(path, word):
    """F5 too: shlex.quote leaves ``-dash`` bare, which the next command reads as an option."""
    from quantscope.cli.calibrate import shell_word

    assert shell_word(path) == word


def test_the_next_commands_run_as_pasted_with_an_out_that_starts_with_a_dash(
        bert_dir, tmp_path, monkeypatch, capsys):
    """F5: ``--out=-dash`` printed ``quantscope evaluate -dash``, which argparse refuses."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "calibrate", "--model", bert_dir, *FAST, "--out=-dash")
    assert rc == 0, err
    assert "next: quantscope evaluate ./-dash | quantscope export ./-dash --out DIR" in out, out
    rc, out, err = run_cli(capsys, "evaluate", "./-dash", "--eval-max-length", "8",
                           "--no-progress", "--threads", "1")
    assert rc == 0 and "quantscope evaluate: ./-dash/qparams" in out, err


@pytest.mark.parametrize("targets", [[], ["--targets"]], ids=["recipe", "kv-only"])
def test_kv_cache_on_an_encoder_is_refused_before_any_forward(bert_dir, tmp_path, capsys,
                                                               targets):
    """F3: an encoder has no cached attention: ``--kv-cache fp8`` was refused by calibrate,
    after the float evaluation; with ``--targets`` (the KV cache alone) early but as "no module
    matches targets []". Now once the model is loaded, naming --kv-cache and why."""
    rc, _, err = run_cli(capsys, "calibrate", "--model", bert_dir, *targets, "--kv-cache",
                         "fp8", *FAST, "--out", str(tmp_path / "run"))
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "error: --kv-cache fp8: the model has no attention module" in last, err
    assert "keeps no KV cache: leave out --kv-cache" in last, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists(), err


_PERCENTILE_TEXT = """rules:
  - targets: [Linear]
    weight:
      spec: {format: int8}
      observer: percentile
      options: {percentile: "99"}
"""


def test_a_recipe_file_option_value_is_checked_before_the_model_loads(bert_dir, tmp_path,
                                                                       capsys):
    """F4: option names were checked up front, their values only by calibrate, after the
    float evaluation: ``percentile: "99"`` (a string) is refused before the model loads."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_PERCENTILE_TEXT)
    rc, _, err = run_cli(capsys, "calibrate", "--model", bert_dir, "--recipe-file",
                         str(recipe), *FAST, "--out", str(tmp_path / "run"))
    assert rc == 2 and err.count("\n") == 1, err
    assert "rules[0].weight: observer 'percentile' with int8" in err, err
    assert "percentile must be a number in (0, 100], got str '99'" in err, err


@pytest.mark.parametrize("text, eps", [("1e-8", 1e-8), ("2E-7", 2e-7), ("+5e-6", 5e-6),
                                       ("1.0e5", 1e5), ("2e5", 2e5), ("1e3", 1e3), (".5e6", 5e5),
                                       ("1.0e-8", 1e-8)])
def test_a_yaml_exponent_float_reads_as_a_number(tmp_path, text, eps):
    """F4: YAML 1.1 (PyYAML) reads a hand-written ``eps: 1e-8`` as the string '1e-8', which
    the recipe refused with no hint; a recipe file reads it as YAML 1.2 and JSON do. Every
    case but ``1.0e-8`` (a float in YAML 1.1 too: a guard) was text to YAML 1.1: no dot, or
    no sign after the ``e`` (``1.0e5``)."""
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / "r.yaml"
    path.write_text("rules:\n  - targets: [Linear]\n    weight:\n"
                    f"      spec: {{format: int8, eps: {text}}}\n")
    assert read_recipe_file(str(path)).rules[0].weight.spec.eps == pytest.approx(eps)
    path.write_text(f"rules:\n  - targets: [Linear]\n    weight:\n      spec: "
                    f"{{format: int8, eps: '{text}'}}\n")  # quoted: text, as the user wrote
    with pytest.raises(Exception, match="QuantSpec.eps must be a positive number"):
        read_recipe_file(str(path))


@pytest.mark.parametrize("argv, said", [
    (["calibrate", "--calib-docs", "x"],
     ("quantscope calibrate: error: argument --calib-docs: invalid int value: 'x' "
      "(quantscope calibrate --help lists the options)")),
    (["export", "run"], "quantscope export: error: the following arguments are required: --out"),
    # a command's unknown option: its parser names it and its --help (quantscope --help,
    # which lists no command's options, was named: review s55)
    (["calibrate", "--bogus"], ("quantscope calibrate: error: unrecognized arguments: --bogus "
                                "(quantscope calibrate --help lists the options)")),
    (["--bogus"], "quantscope: error: unrecognized arguments: --bogus (quantscope --help")])
def test_an_argparse_error_is_one_line_on_stderr(capsys, argv, said):
    """F6: argparse printed its whole usage block (18 lines for calibrate) before the error."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(said) and err.rstrip().endswith("--help lists the options)"), err


def test_quantscope_with_no_command_prints_its_help_on_stderr(capsys):
    """F6: the help went to stdout with exit code 2 (an error's code, an answer's stream)."""
    rc, out, err = run_cli(capsys)
    assert rc == 2 and out == "" and err.startswith("usage: quantscope"), (out, err)
    assert "calibrate" in err and "examples:" in err


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys):
    """F6: ``--debug`` raised the error out of main (exit code 1 on the command line)."""
    rc, _, err = run_cli(capsys, "--debug", "calibrate", "--observer", "minmx")
    assert rc == 2 and err.startswith("Traceback"), err
    assert err.strip().splitlines()[-1].startswith(
        "quantscope calibrate: error: unknown observer (--observer) 'minmx'"), err


def test_the_command_line_exits_2_under_debug(tmp_path):
    import quantscope

    src = os.path.dirname(os.path.dirname(quantscope.__file__))  # this checkout's
    r = subprocess.run([sys.executable, "-m", "quantscope", "--debug", "calibrate",
                        "--observer", "minmx"], capture_output=True, text=True, check=False,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": src})
    assert r.returncode == 2 and "Traceback" in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [
    ["calibrate", "--observer", "MSE"], ["calibrate", "--weight-observer", "Percentile"],
    ["calibrate", "--input-observer", "MinMax"],
    ["compare", "--observers", "MinMax,MSE,Auto", "--no-plots"]])
def test_observer_names_are_read_in_any_case(tmp_path, capsys, argv):
    """F7: ``--recipe`` and ``--scheme`` (and a recipe file's observers) read any case,
    ``--observer`` / ``--observers`` did not. The names pass: the next check is --model's."""
    rc, _, err = run_cli(capsys, *argv, "--model", str(tmp_path / "none"), "--out",
                         str(tmp_path / "run"))
    assert rc == 2 and "error: --model" in err and "does not exist" in err, err


def test_observer_names_in_another_case_are_one_name_and_suggested(capsys):
    rc, _, err = run_cli(capsys, "compare", "--observers", "mse,MSE")
    assert rc == 2 and "--observers names 'mse' more than once" in err, err
    rc, _, err = run_cli(capsys, "calibrate", "--observer", "MINMX")
    assert rc == 2 and "did you mean 'minmax'" in err, err
    rc, _, err = run_cli(capsys, "compare", "--recipes", "W8a8")  # exact spelling: both
    assert rc == 2 and "did you mean 'w8a8' or 'W8A8'" in err, err


def test_library_warnings_are_warning_lines(bert_dir, tmp_path, capsys, monkeypatch):
    """F8: a library warning reached the user as ``<frozen runpy>:88: UserWarning: ...``.
    Shown here as Python shows one outside a recorder (pytest records them): formatted by
    ``warnings.formatwarning``, onto stderr."""
    before = warnings.formatwarning
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno,
                        file=None, line=None: sys.stderr.write(warnings.formatwarning(
                            message, category, filename, lineno, line)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc, _, err = run_cli(capsys, "calibrate", "--model", bert_dir, *FAST, "--keep-float",
                             "1000", "--out", str(tmp_path / "run"))
    assert rc == 0, err
    assert "\nwarning: keep_float: 1000 activations asked for" in err, err
    assert "UserWarning" not in err, err
    assert warnings.formatwarning is before  # the caller's, back


def test_a_change_that_rounds_to_zero_has_no_sign():
    """F9: the first documented command printed ``(-0.0000)``; a perplexity ``+0.0 %``."""
    from quantscope.cli.running import metric_line

    assert metric_line("lee_r", 0.65641, 0.65639).endswith("(0.0000)")
    assert metric_line("lee_r", 0.6564, 0.6601).endswith("(+0.0037)")
    assert metric_line("perplexity", 49565.96, 49569.14).endswith("(+3.18, 0.0 %)")
    assert metric_line("perplexity", 40.0, 39.0).endswith("(-1.00, -2.5 %)")
    headers, rows = cli.compare_rows({
        "fp32": {"lee_r": 0.65641, "cosine": 1.0},
        "runs": {"w8a8/minmax": {"recipe": "w8a8", "observer": "minmax", "summary": {},
                                 "metrics": {"lee_r": 0.65639, "cosine": 0.99}}}})
    assert rows[1][headers.index("r - fp32")] == "0.0000"


@pytest.mark.parametrize("argv, said", [
    (["evaluate", "nope"], "quantscope evaluate: error: 'nope' is not a folder"),
    (["export", "nope", "--out", "x"], "quantscope export: error: 'nope' is not a folder"),
    (["plot", "nope"], "quantscope plot: error: 'nope' is not a compare run"),
    (["check", "nope"], "quantscope check: error: 'nope' is not a model folder")])
def test_an_error_line_names_its_command_once(tmp_path, monkeypatch, capsys, argv, said):
    """F9: ``quantscope evaluate: error: evaluate: 'nope' is not a folder``."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.startswith(said), err
