"""Review s55 (the command line): a YAML number where a recipe file takes text is refused
naming the field and saying to quote it; the KV-cache refusal says what a preset's or a recipe
file's user can do; ``main`` returns the code of a SystemExit raised inside a command, and the
documented codes 1 (stdout's reader gone) and 130 (interrupted)."""

import os
import re
import sys

import pytest
from cli_helpers import run_cli

from quantscope import cli
from quantscope.cli.checks import UsageError
from quantscope.cli.recipes import read_recipe_file

_WEIGHT = "weight: {spec: {format: int8}}"
_RULES = f"rules:\n  - targets: [Linear]\n    {_WEIGHT}\n"
FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BERT folder (an encoder: no KV cache), once per module."""
    pytest.importorskip("transformers")
    from tiny_models import bert_folder, require_lee_corpus

    require_lee_corpus()
    return str(bert_folder(tmp_path_factory.mktemp("tiny-bert")))


@pytest.mark.parametrize("text, field, quoted", [
    (f"name: 2e5\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n", "name (line 1, column 7) is 2e5",
     'name: "2e5"'),
    (f"rules:\n  - targets: [1e3]\n    {_WEIGHT}\n",
     "rules[0].targets[0] (line 2, column 15) is 1e3", '"1e3"'),
    (f"ignore: [lm_head, 12]\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n",
     "ignore[1] (line 1, column 19) is 12", '"12"'),
    ("rules:\n  - targets: [Linear]\n    weight: {spec: {format: int8}, observer: 1e3}\n",
     "rules[0].weight.observer (line 3, column 46) is 1e3", 'observer: "1e3"'),
])
def test_a_yaml_number_where_a_recipe_takes_text_says_to_quote_it(tmp_path, text, field,
                                                                   quoted):
    # the exponent resolver (YAML 1.2's floats) read `name: 2e5` and `targets: [1e3]`, text to
    # YAML 1.1, as 200000.0 / 1000.0: refused as "must be a string", with no word of quoting
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        read_recipe_file(str(path))
    said = str(e.value)
    assert f"--recipe-file {str(path)!r}: {field}, which YAML reads as a number" in said, said
    assert said.endswith(f"the field takes text: quote it, {quoted}"), said
    # quoted, it is the text
    path.write_text(text.replace(": 2e5", ': "2e5"').replace("[1e3]", '["1e3"]')
                    .replace(", 12]", ', "12"]').replace("observer: 1e3", 'observer: "1e3"'))
    try:
        rec = read_recipe_file(str(path))
    except UsageError as err:  # an observer named 1e3 is unknown: said as such, not a number
        assert "1e3" in str(err) and "reads as a number" not in str(err)
    else:
        assert rec.name == "2e5" or "1e3" in rec.rules[0].targets or "12" in rec.ignore


@pytest.mark.parametrize("text, field", [
    (f"fuse: [[q_proj, 1e3]]\n{_RULES}",
     "fuse[0][1] (line 1, column 17)"),
    (f"split: [1e3]\n{_RULES}", "split[0] (line 1, column 9)"),
    (f"kv_cache: {{spec: {{format: fp8_e4m3}}, observer: 1e3}}\n{_RULES}",
     "kv_cache.observer (line 1, column 48)"),
    (f"{_RULES}    input: {{spec: {{format: 8}}}}\n",
     "rules[0].input.spec.format (line 4, column 28)"),
    (f"{_RULES}    output: {{spec: {{layout: 12}}}}\n",
     "rules[0].output.spec.layout (line 4, column 29)"),
])
def test_every_text_field_refuses_a_yaml_number(tmp_path, text, field):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        read_recipe_file(str(path))
    said = str(e.value)
    assert f": {field} is " in said and "which YAML reads as a number; the field takes text: " \
        "quote it" in said, said


@pytest.mark.parametrize("value", ["false", "no"])
def test_fuse_false_says_how_to_turn_fusion_off(tmp_path, value):
    # it loaded as no fusion group before (fusion still on); quoted, it is a group's name
    path = tmp_path / "r.yaml"
    path.write_text(f"fuse: {value}\n{_RULES}")
    with pytest.raises(UsageError, match=r"which YAML reads as a boolean; .*; to turn fusion "
                                         r"off, write fusion: false$"):
        read_recipe_file(str(path))


@pytest.mark.parametrize(("text", "field"), [
    ('rules:\n  - targets: ["re:(.|.)*z"]\n    weight: {spec: {format: int8}}\n',
     "rules[0].targets"),
    (f'ignore: ["re:(a+)+$"]\n{_RULES}', "ignore"),
    (f'split: ["re:(.|.)*z"]\n{_RULES}', "split"),
    (f'fuse: [[q_proj, "re:(a|a)*b"]]\n{_RULES}', "fuse[0]")])
def test_a_pattern_that_can_backtrack_for_hours_is_refused(tmp_path, text, field):
    # accepted: matching re:(.|.)*z took 10 s against a 26-character module name, doubling
    # with each more; a saved calibration and a checkpoint's config refuse it already
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=rf"^--recipe-file '.*': {re.escape(field)}: 're:"):
        read_recipe_file(str(path))
    path.write_text(f'ignore: ["re:.*lm_head", "re:.*self_attn.(q|k|v)_proj$"]\n{_RULES}')
    assert read_recipe_file(str(path)).ignore == ("re:.*lm_head", "re:.*self_attn.(q|k|v)_proj$")


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "---\n"])
def test_an_empty_recipe_file_is_not_a_recipe(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=r"not a recipe \(ValueError: Recipe must be a mapping"):
        read_recipe_file(str(path))


@pytest.mark.parametrize("value, kind", [("on", "a boolean"), ("false", "a boolean"),
                                         ("2024-05-01", "a date")])
def test_a_yaml_boolean_or_date_where_a_recipe_takes_text_says_to_quote_it(tmp_path, value,
                                                                          kind):
    # these got the number's old "must be a string, got datetime.date(...)", no line or quoting
    path = tmp_path / "r.yaml"
    path.write_text(f"name: {value}\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n")
    with pytest.raises(UsageError) as e:
        read_recipe_file(str(path))
    assert str(e.value) == (f"--recipe-file {str(path)!r}: name (line 1, column 7) is {value}, "
                            f"which YAML reads as {kind}; the field takes text: quote it, "
                            f'name: "{value}"')
    path.write_text(f'name: "{value}"\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n')
    assert read_recipe_file(str(path)).name == value


def test_numbers_where_a_recipe_takes_numbers_stay_numbers(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: w8\nrules:\n  - targets: [Linear]\n    weight: {spec: {format: int8, "
                    "eps: 1e-8}, observer: percentile, options: {percentile: 99}}\n")
    rec = read_recipe_file(str(path))
    assert rec.rules[0].weight.spec.eps == 1e-8
    assert dict(rec.rules[0].weight.options)["percentile"] == 99


def test_the_quote_advice_is_one_usage_line(bert_dir, tmp_path, capsys):
    capsys.readouterr()  # (writing the folder's shards printed a progress bar)
    path = tmp_path / "r.yaml"
    path.write_text(f"name: 2e5\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n")
    rc, out, err = run_cli(capsys, "calibrate", "--model", bert_dir, "--recipe-file", str(path),
                           "--out", str(tmp_path / "run"))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert 'quote it, name: "2e5"' in err, err


@pytest.mark.parametrize("argv, said", [
    (["calibrate", "--recipe", "fp8-kv"],
     "recipe 'fp8-kv' calibrates the KV cache, but the model has no attention module"),
    (["compare", "--recipes", "w8a8,fp8-kv", "--observers", "minmax", "--no-plots"],
     "recipe 'fp8-kv' calibrates the KV cache, but the model has no attention module"),
    (["calibrate", "--recipe-file", "KV"],
     "recipe 'custom' sets kv_cache, but the model has no attention module")])
def test_the_kv_cache_refusal_says_what_a_preset_or_file_user_can_do(bert_dir, tmp_path, capsys,
                                                                      argv, said):
    # it read "recipe 'fp8-kv' sets kv_cache, but: the model ..." and ended "take kv_cache out
    # of the recipe", which a preset's user cannot do
    kv = tmp_path / "kv.yaml"
    kv.write_text(f"kv_cache: fp8\nrules:\n  - targets: [Linear]\n    {_WEIGHT}\n")
    capsys.readouterr()
    argv = [str(kv) if a == "KV" else a for a in argv]
    rc, _, err = run_cli(capsys, *argv, "--model", bert_dir, *FAST, "--out", str(tmp_path / "r"))
    last = err.strip().splitlines()[-1]  # (after the model's loading lines)
    assert rc == 2 and said in last and "but:" not in last, err
    advice = "take kv_cache out of the file" if str(kv) in argv else (
        "keeps no KV cache: use the preset 'fp8' instead, the same without the KV cache")
    assert last.endswith(advice), err


def _command_raising(monkeypatch, error):
    def run(args):
        raise error
    monkeypatch.setitem(cli.COMMANDS, "formats", (cli.COMMANDS["formats"][0], run))


@pytest.mark.parametrize("error, code, said", [
    (SystemExit(3), 3, ""), (SystemExit(None), 0, ""), (SystemExit(0), 0, ""),
    (SystemExit("no such thing\nhere"), 2, "quantscope formats: error: no such thing here\n"),
    (BrokenPipeError(), 1, ""), (KeyboardInterrupt(), 130, "quantscope formats: interrupted\n")])
def test_main_returns_the_documented_codes_and_never_raises_systemexit(monkeypatch, capsys,
                                                                       error, code, said):
    # a SystemExit raised inside a command (a library's sys.exit) left main(), which the docs
    # say never raises it; 1 and 130 were not documented
    # (capsys's stdout has no file: the broken pipe's handler leaves it, as it raised before)
    _command_raising(monkeypatch, error)
    assert cli.main(["formats"]) == code
    assert capsys.readouterr().err == said


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files by /proc")
def test_a_broken_pipe_points_stdout_at_devnull_and_leaves_no_file_open(monkeypatch, tmp_path):
    # the devnull descriptor dup2 copied stayed open: one more per call of main()
    _command_raising(monkeypatch, BrokenPipeError())
    with open(tmp_path / "out", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        before = sorted(os.listdir("/proc/self/fd"))
        assert cli.main(["formats"]) == 1
        assert sorted(os.listdir("/proc/self/fd")) == before
        assert os.path.samestat(os.fstat(out.fileno()), os.stat(os.devnull))


@pytest.mark.parametrize("length, said", [(500, "x" * 500),
                                          (600, "x" * 500 + " ... (--debug shows all)")])
def test_a_long_error_message_is_cut_after_500_characters(monkeypatch, capsys, length, said):
    """The one error line holds at most 500 characters of the message, then says that
    --debug shows all (a long path, a long list of names would fill the terminal)."""
    _command_raising(monkeypatch, ValueError("x" * length))
    assert cli.main(["formats"]) == 2
    assert capsys.readouterr().err == f"quantscope formats: error: {said}\n"


def test_an_argparse_error_keeps_the_spaces_of_a_value(capsys):
    # the one-line rule collapsed every run of spaces, the user's value's too ('x y')
    rc, out, err = run_cli(capsys, "calibrate", "--threads", "x  y")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "argument --threads: invalid int value: 'x  y' (quantscope calibrate --help" in err
