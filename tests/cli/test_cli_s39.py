"""Observer names and tokenizer-less folders the command line took and failed on only after
the model loaded (probe s39): a compat class's name in --observer, --observers or a recipe
file; a recipe file's ``Auto``; a dynamic role's unknown observer; a BERT folder without
tokenizer files, which transformers fills with an all-[UNK] tokenizer."""

import json

import pytest
import torch

from quantscope import cli

transformers = pytest.importorskip("transformers")

FAST = ["--calib-docs", "2", "--max-length", "16", "--eval-max-length", "16", "--device",
        "cpu", "--threads", "1", "--no-progress"]


@pytest.mark.parametrize("argv", [
    ["calibrate", "--observer", "torch.ao:MinMaxObserver"],
    ["calibrate", "--input-observer", "quark:PerTensorMinMaxObserver"],
    ["compare", "--observers", "minmax,llmcompressor:minmax", "--no-plots"],
])
def test_a_compat_observer_is_refused_before_the_model_loads(llama_dir, tmp_path, capsys,
                                                             argv):
    rc = cli.main([*argv, "--model", llama_dir, *FAST, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "is a compat class" in err and "loading" not in err, err


def _recipe_file(tmp_path, input_role) -> str:
    weight = {"spec": {"format": "int8", "layout": "channel:0"}, "observer": "minmax",
              "dynamic": False}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"name": "r", "rules": [
        {"targets": ["Linear"], "weight": weight, "input": input_role}]}))
    return str(path)


def _built(llama_dir, path):
    from quantscope.cli.checks import check_recipe_args
    from quantscope.cli.recipes import build_recipe
    from quantscope.demo import models

    args = cli.build_parser().parse_args(["calibrate", "--model", llama_dir,
                                          "--recipe-file", path])
    check_recipe_args(args)
    model, _ = models.load_model(llama_dir, "cpu")
    return build_recipe(args, model)


def test_a_recipe_files_observer_reads_as_the_registry_spells_it(llama_dir, tmp_path):
    role = {"spec": {"format": "int8", "layout": "tensor"}, "observer": "Auto",
            "dynamic": False}
    rec = _built(llama_dir, _recipe_file(tmp_path, role))
    assert {r.input.observer for r in rec.rules} == {"auto"}
    assert {r.weight.observer for r in rec.rules} == {"minmax"}


@pytest.mark.parametrize("observer,said", [("nosuchobs", "unknown observer"),
                                           ("torch.ao:MinMaxObserver", "is a compat class")])
def test_a_dynamic_roles_observer_is_checked_too(llama_dir, tmp_path, observer, said):
    from quantscope.cli.checks import UsageError

    role = {"spec": {"format": "int8", "layout": "token"}, "observer": observer,
            "dynamic": True}
    with pytest.raises(UsageError, match=said):
        _built(llama_dir, _recipe_file(tmp_path, role))


def test_a_bert_folder_without_tokenizer_files_is_refused(tmp_path):
    from quantscope.demo import models

    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="has no tokenizer files"):
        models.load_model(tmp_path / "m")


def _kv_recipe_file(tmp_path, kv_observer) -> str:
    weight = {"spec": {"format": "int8", "layout": "channel:0"}, "observer": "minmax",
              "dynamic": False}
    kv = {"spec": {"format": "fp8_e4m3", "layout": "tensor"}, "observer": kv_observer,
          "dynamic": False}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"name": "kv", "kv_cache": kv, "rules": [
        {"targets": ["Linear"], "weight": weight}]}))
    return str(path)


def test_a_recipe_files_kv_cache_observer_is_checked_and_canonical(llama_dir, tmp_path):
    from quantscope.cli.checks import UsageError

    assert _built(llama_dir, _kv_recipe_file(tmp_path, "MinMax")).kv_cache.observer == "minmax"
    with pytest.raises(UsageError, match="is a compat class"):
        _built(llama_dir, _kv_recipe_file(tmp_path, "torch.ao:MinMaxObserver"))


def test_a_dynamic_roles_options_are_checked(llama_dir, tmp_path):
    from quantscope.cli.checks import UsageError

    role = {"spec": {"format": "int8", "layout": "token"}, "observer": "memoryless_minmax",
            "dynamic": True, "options": {"no_such_option": 1}}
    with pytest.raises(UsageError, match="takes no option 'no_such_option'"):
        _built(llama_dir, _recipe_file(tmp_path, role))


@pytest.mark.parametrize("files,ok", [(["tokenizer.model.v3"], True), (["x.tiktoken"], True),
                                      ([], False)])
def test_what_counts_as_tokenizer_files(tmp_path, files, ok):
    from quantscope.demo import models

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer.json").mkdir()  # a folder of that name is no file
    for f in files:
        (folder / f).write_text("")
    try:  # past the check, transformers' own loading fails on these empty files
        models._tokenizer(folder, False)
        said = ""
    except Exception as e:  # noqa: BLE001
        said = str(e)
    assert ("has no tokenizer files" in said) is not ok, said
