"""``calibrate --recipe-file``: --ignore (and its default, the output head), --targets and
--observer adjust the file's recipe as docs/guide/command-line.md says, and the summary names
the observers the file's roles run."""

import json
from pathlib import Path

import pytest

from quantscope import cli

transformers = pytest.importorskip("transformers")
from tiny_models import require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "16", "--device", "cpu", "--threads", "1", "--no-progress"]
INT8_CHANNEL = {"spec": {"format": "int8", "layout": "channel:0"},
                "observer": "memoryless_minmax", "dynamic": False}
INT8_TENSOR = {"spec": {"format": "int8", "layout": "tensor"}, "observer": "minmax",
               "dynamic": False}
PLAIN = {"name": "mine", "rules": [{"targets": ["Linear"], "weight": INT8_CHANNEL,
                                    "input": INT8_TENSOR}]}
# attention weights only, then every other Linear with its input: the first rule wins
TWO_RULES = {"name": "two", "ignore": ["*.o_proj"], "rules": [
    {"targets": ["*.self_attn.*"], "weight": INT8_CHANNEL},
    {"targets": ["Linear"], "weight": INT8_CHANNEL, "input": INT8_TENSOR}]}


def _recipe_file(tmp_path, recipe) -> str:
    path = tmp_path / f"{recipe['name']}.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def _built(llama_dir, *argv):
    """The recipe ``calibrate ARGV`` builds, and what it quantizes: {layer: set of roles}."""
    from quantscope.cli.checks import check_recipe_args
    from quantscope.cli.recipes import build_recipe
    from quantscope.demo import models

    args = cli.build_parser().parse_args(["calibrate", "--model", llama_dir, *argv])
    check_recipe_args(args)
    model, _ = models.load_model(llama_dir, "cpu")
    rec = build_recipe(args, model)
    return rec, {n: set(roles) for n, (_, roles) in rec.match(model).items()}


def test_the_output_head_stays_float_unless_ignore_says_otherwise(llama_dir, tmp_path):
    f = _recipe_file(tmp_path, PLAIN)
    rec, layers = _built(llama_dir, "--recipe-file", f)
    assert "lm_head" not in layers and "lm_head" in "".join(rec.ignore)
    assert len(layers) == 14  # 7 Linear in each of the 2 decoder layers
    _, layers = _built(llama_dir, "--recipe-file", f, "--ignore")
    assert "lm_head" in layers


def test_ignore_joins_the_files_ignore_list(llama_dir, tmp_path):
    rec, layers = _built(llama_dir, "--recipe-file", _recipe_file(tmp_path, TWO_RULES),
                         "--ignore", "lm_head", "model.layers.0.mlp.down_proj")
    assert rec.ignore == ("*.o_proj", "lm_head", "model.layers.0.mlp.down_proj")
    assert not {"lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"
                } & set(layers)


def test_targets_narrow_each_rule_first_rule_winning(llama_dir, tmp_path):
    rec, layers = _built(llama_dir, "--recipe-file", _recipe_file(tmp_path, TWO_RULES),
                         "--targets", "model.layers.1.*")
    assert all(n.startswith("model.layers.1.") for n in layers) and len(layers) == 6
    assert layers["model.layers.1.self_attn.q_proj"] == {"weight"}  # rule 1: weights only
    assert layers["model.layers.1.mlp.up_proj"] == {"weight", "input"}
    assert "model.layers.1.self_attn.o_proj" not in layers  # the file's ignore still holds
    # the saved recipe names the modules it took
    assert rec.rules[0].targets == tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")


def test_targets_matching_none_of_the_files_modules_stop_early(llama_dir, tmp_path, capsys):
    rc = cli.main(["calibrate", "--model", llama_dir, "--recipe-file",
                   _recipe_file(tmp_path, PLAIN), "--targets", "Conv2d",
                   "--out", str(tmp_path / "run"), *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and "--targets Conv2d: no module that recipe 'mine'" in err, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists()


def test_observer_replaces_the_files_observers(llama_dir, tmp_path):
    f = _recipe_file(tmp_path, PLAIN)
    rec, _ = _built(llama_dir, "--recipe-file", f)
    assert (rec.rules[0].weight.observer, rec.rules[0].input.observer) == (
        "memoryless_minmax", "minmax")  # the file's, when --observer is not given
    rec, _ = _built(llama_dir, "--recipe-file", f, "--observer", "mse")
    assert (rec.rules[0].weight.observer, rec.rules[0].input.observer) == (
        "memoryless_mse", "mse")
    rec, _ = _built(llama_dir, "--recipe-file", f, "--observer", "mse", "--weight-observer",
                    "minmax")
    assert (rec.rules[0].weight.observer, rec.rules[0].input.observer) == ("minmax", "mse")


def test_calibrate_with_a_recipe_file_saves_and_says_what_ran(llama_dir, tmp_path, capsys):
    run = tmp_path / "run"
    rc = cli.main(["calibrate", "--model", llama_dir, "--recipe-file",
                   _recipe_file(tmp_path, PLAIN), "--ignore", "lm_head",
                   "model.layers.0.mlp.down_proj", "--targets", "model.layers.1.*",
                   "--observer", "mse", "--out", str(run), *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    meta = json.loads(Path(run, "qparams", "quantscope.json").read_text())
    layers = meta["layers"]
    assert layers and all(n.startswith("model.layers.1.") for n in layers)
    assert layers["model.layers.1.mlp.down_proj"]["input"]["observer"] == "mse"
    assert meta["recipe"]["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert "mine, observer memoryless_mse/mse" in out
    assert "left in float: model.layers.0.mlp.down_proj, lm_head" in out
    # without --observer the summary names the file's observers, not the flag's default
    rc = cli.main(["calibrate", "--model", llama_dir, "--recipe-file",
                   _recipe_file(tmp_path, PLAIN), "--out", str(run), *FAST])
    assert rc == 0 and "mine, observer memoryless_minmax/minmax" in capsys.readouterr().out


@pytest.mark.parametrize("argv, want", [
    (("--recipe", "nvfp4"), "static_minmax"),  # llm-compressor's NVFP4 inputs
    (("--recipe", "nvfp4", "--observer", "minmax"), "minmax"),
    (("--recipe", "w8a8"), "minmax"),
    (("--scheme", "FP8"), "static_minmax"),  # compressed-tensors' FP8 scheme names it
])
def test_without_observer_the_preset_or_scheme_chooses_the_input_observer(llama_dir, argv, want):
    """The command line gave every role minmax where no --observer was given, so its nvfp4 /
    FP8 inputs were a moving average where calibrate()'s are the scheme's running max."""
    rec, _ = _built(llama_dir, *argv)
    assert rec.rules[0].input.observer == want


@pytest.mark.parametrize(("recipe", "said"), [
    ({**PLAIN, "ignores": ["*.mlp.*"]}, r"unknown key 'ignores'"),
    ({**TWO_RULES, "rules": [TWO_RULES["rules"][0], {**TWO_RULES["rules"][1], "inputs": INT8_TENSOR}]},
     r"Recipe\.rules\[1\]: unknown key 'inputs'"),
])
def test_a_misspelt_key_in_a_recipe_file_is_refused_not_dropped(tmp_path, recipe, said):
    """A misspelt key was dropped: the file ran as if it were absent (no ignore list, no
    input role)."""
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import read_recipe_file

    with pytest.raises(UsageError, match=r"--recipe-file '.*': not a recipe \(ValueError: .*" + said):
        read_recipe_file(_recipe_file(tmp_path, recipe))


def test_a_recipe_file_may_leave_out_a_roles_observer_dynamic_and_options(tmp_path):
    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.cli.recipes import read_recipe_file
    from quantscope.spec import QuantSpec

    spec = {"format": "int8", "layout": "tensor"}
    got = read_recipe_file(_recipe_file(tmp_path, {"name": "short", "rules": [
        {"targets": ["Linear"], "input": {"spec": spec}}]}))
    assert got == Recipe(Rule(("Linear",), input=Role(QuantSpec.from_dict(spec))), name="short")



@pytest.mark.parametrize("spelt", ["auto", "Auto", "AUTO"])
def test_a_recipe_files_auto_role_is_read_not_built(tmp_path, spelt):
    """A role's ``observer: auto`` (in any case, docs/guide/command-line.md) reads as
    ``auto``: each of its candidates is built at calibration; checking it as one observer
    (built with its options for the spec, as the other names are) refused it as unknown."""
    from quantscope.cli.recipes import read_recipe_file

    spec = {"format": "int8", "layout": "tensor"}
    got = read_recipe_file(_recipe_file(tmp_path, {"name": "chooses", "rules": [
        {"targets": ["Linear"], "weight": {"spec": spec, "observer": spelt},
         "input": {"spec": spec, "observer": spelt}}]}))
    assert (got.rules[0].weight.observer, got.rules[0].input.observer) == ("auto", "auto")

_DUPLICATES = {
    "top.yaml": "name: mine\nignore: [lm_head]\nrules: []\nignore: []\n",
    "spec.yaml": ("name: mine\nrules:\n- targets: [Linear]\n  weight:\n    spec: {format: int4, "
                  "layout: 'group:32', format: int8}\n"),
    "top.json": '{"name": "mine", "ignore": ["lm_head"], "rules": [], "ignore": []}',
}


@pytest.mark.parametrize("name", sorted(_DUPLICATES))
def test_a_key_given_twice_is_refused_not_the_last_kept(tmp_path, name):
    """JSON and YAML parsers keep the last of a repeated key: an ignore list or a format the
    author wrote first was silently replaced."""
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / name
    path.write_text(_DUPLICATES[name])
    key = "format" if name.startswith("spec") else "ignore"
    with pytest.raises(UsageError, match=f"key '{key}' given twice"):
        read_recipe_file(str(path))


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """Nested aliases grow 10x a level: a 400-byte file took 24 s and 840 MB to expand."""
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import read_recipe_file

    levels = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]'] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\nname: mine\nrules: []\noptions: *a7\n")
    with pytest.raises(UsageError, match="aliases") as e:
        read_recipe_file(str(path))
    assert len(str(e.value)) < 400
