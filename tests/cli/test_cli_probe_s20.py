"""Probe s20: ``--out`` holding another kind of quantscope output is refused before the model
loads (not at saving, after calibration), naming ``--out``; ``--group-size`` on a recipe
without groups (NVFP4's blocks) names the flag and the layouts the recipe has instead."""

import json
import os

import pytest
from cli_helpers import run_cli

from quantscope.exporters.atomic import atomic_dir


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from tiny_models import bert_folder

    return str(bert_folder(tmp_path_factory.mktemp("bert-s20")))


def _output(path, kind: str, name: str, data: dict) -> str:
    """A folder as quantscope writes an output of ``kind`` (its marker records the kind)."""
    with atomic_dir(path, what=kind) as tmp, open(os.path.join(tmp, name), "w") as f:
        json.dump(data, f)
    return str(path)


SMALL = ["--calib-docs", "2", "--max-length", "16", "--eval-max-length", "16",
         "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("kind,name,data,said", [
    ("compressed-tensors", "config.json", {"quantscope": {}}, "a compressed-tensors export"),
    ("compare-run", "report.json", {"runs": {}, "setup": {}}, "a `quantscope compare` run")])
def test_calibrate_refuses_another_kind_of_out_before_loading(tiny_bert, tmp_path, capsys,
                                                              kind, name, data, said):
    out = _output(tmp_path / "out", kind, name, data)
    rc, _, err = run_cli(capsys, "calibrate", "--model", tiny_bert, *SMALL, "--out", out)
    assert rc == 2, err
    assert "error: --out: " in err and said in err and "calibrate` run" in err, err
    assert "loading" not in err and "calibrating" not in err, err
    assert os.path.isfile(os.path.join(out, name))  # left as it was


def test_compare_refuses_a_calibrate_run_as_out_before_loading(tiny_bert, tmp_path, capsys):
    out = _output(tmp_path / "run", "calibrate-run", "report.json", {})
    rc, _, err = run_cli(capsys, "compare", "--model", tiny_bert, *SMALL, "--recipes", "w8a8",
                         "--observers", "minmax", "--no-plots", "--out", out)
    assert rc == 2 and "error: --out: " in err and "calibrate` run" in err, err
    assert "loading" not in err, err


@pytest.mark.parametrize("recipe,said", [
    (("--scheme", "NVFP4"), "weight block:16, input block:16); blocks are not groups"),
    (("--recipe", "w8a8"), "(weight channel:0, input tensor); --group-size sets")])
def test_group_size_on_a_recipe_without_groups_names_the_flag(tiny_bert, tmp_path, capsys,
                                                              recipe, said):
    rc, _, err = run_cli(capsys, "calibrate", "--model", tiny_bert, *SMALL, *recipe,
                         "--group-size", "16", "--out", str(tmp_path / "run"))
    assert rc == 2, err
    assert "error: --group-size 16: recipe " in err and "has no grouped weights" in err, err
    assert said in err, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists(), err
