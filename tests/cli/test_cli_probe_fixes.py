"""Command-line defects a probe found: the --group-size hint, a recipe file's observers
checked before the model loads, main() returning argparse's exit codes, one-line errors that
name the file (config.json, report.json) or the cause (no tokenizer, an image model), a
recipe's name type-checked, and the printed next commands shell-quoted."""

import json
import re
import shlex
import shutil

import pytest

from quantscope.calibration.recipe import Recipe, preset

transformers = pytest.importorskip("transformers")
from cli_helpers import run_cli
from tiny_models import require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "16", "--device", "cpu", "--threads", "1", "--no-progress"]


def _recipe_file(tmp_path, change) -> str:
    d = preset("w8a8").to_dict()
    change(d)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_group_size_hint_names_only_sizes_dividing_every_layer(llama_dir, tmp_path, capsys):
    # the tiny Llama's layers are 64 wide, its down_proj 96: 64 divides the first, not both
    rc, _, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--recipe", "w4a16",
                         "--group-size", "48", *FAST, "--out", str(tmp_path / "o"))
    assert rc == 2
    assert "--group-size 16 / 32 would, or --on-indivisible float" in err


@pytest.mark.parametrize("change, said", [
    (lambda d: d["rules"][0]["weight"].update(observer="msee"),
     (r"unknown observer \(--recipe-file '.*r\.json', rules\[0\]\.weight\) 'msee'; did you "
      r"mean 'mse' or 'pow2_mse'\?")),
    (lambda d: d["rules"][0]["input"].update(options={"averaging_constnt": 0.1}),
     r"rules\[0\]\.input: observer 'minmax' takes no option 'averaging_constnt'"),
    (lambda d: d.update(name=7), r"Recipe\.name must be a string, got 7")])
def test_a_recipe_file_is_checked_before_the_model_loads(llama_dir, tmp_path, capsys,
                                                          change, said):
    path = _recipe_file(tmp_path, change)
    rc, _, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--recipe-file", path,
                         *FAST, "--out", str(tmp_path / "o"))
    assert rc == 2
    assert "loading" not in err  # refused before the model loads
    assert err.count("\n") == 1
    assert re.search(said, err), err


def test_a_recipe_file_with_known_observers_and_options_passes(tmp_path):
    from quantscope.cli.recipes import read_recipe_file

    path = _recipe_file(tmp_path, lambda d: (
        d["rules"][0]["input"].update(observer="MSE", options={"averaging_constant": 0.1})))
    # read as the registry spells it (any case accepted): "Auto" must become auto (s39)
    assert read_recipe_file(path).rules[0].input.observer == "mse"


def test_recipe_name_must_be_a_string():
    with pytest.raises(TypeError, match="Recipe.name must be a string"):
        Recipe(preset("w8a8").rules, name=None)


@pytest.mark.parametrize("argv, code, said", [
    (["calibrate", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["evaluate"], 2, "the following arguments are required: RUN"),
    (["calibrate", "--help"], 0, "usage: quantscope calibrate")])
def test_main_returns_argparse_exit_codes(capsys, argv, code, said):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == code
    assert said in out + err


def _vit_folder(path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    transformers.ViTModel(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=32, patch_size=16)).save_pretrained(path)


def _bad_config(folder, llama_dir):
    (folder / "config.json").write_text("{oops")
    return f"--model '{folder}': {folder}/config.json is not valid JSON (Expecting"


def _no_tokenizer(folder, llama_dir):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{llama_dir}/{f}", folder)
    return f"model '{folder}' has no tokenizer files (expected one of tokenizer.json"


def _vit(folder, llama_dir):  # an image model as saved: no tokenizer
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    transformers.ViTModel(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=32, patch_size=16)).save_pretrained(folder)
    return "(ViTModel) is a model of pixel_values; the command line calibrates causal LMs"


@pytest.mark.parametrize("make", [_bad_config, _no_tokenizer, _vit])
def test_model_folder_errors_name_the_file_or_the_cause(llama_dir, tmp_path, capsys, make):
    folder = tmp_path / "model"
    folder.mkdir()
    said = make(folder, llama_dir)
    rc, _, err = run_cli(capsys, "calibrate", "--model", str(folder), *FAST,
                         "--out", str(tmp_path / "o"))
    assert rc == 2
    assert said in err, err


@pytest.mark.parametrize("text, said", [("{bad", "/report.json is not valid JSON ("),
                                        ('{"runs": {}}', "the report has no runs")])
def test_plot_errors_name_the_report(tmp_path, capsys, text, said):
    (tmp_path / "report.json").write_text(text)
    rc, _, err = run_cli(capsys, "plot", str(tmp_path))
    assert rc == 2
    assert said in err, err


def test_next_commands_are_shell_quoted(llama_dir, tmp_path, capsys):
    out = str(tmp_path / "my run")
    rc, stdout, _ = run_cli(capsys, "calibrate", "--model", llama_dir, *FAST, "--out", out)
    assert rc == 0
    assert f"next: quantscope evaluate {shlex.quote(out)} | quantscope export " \
           f"{shlex.quote(out)} --out DIR" in stdout
