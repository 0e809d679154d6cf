"""Probe s40: a saved calibration's ``info`` was checked only to be a dict. An edited entry
quantscope reads back (the report's tables, the command line's) loaded, then crashed
``report().print()`` naming neither the file nor the key."""

import shutil
import warnings

import pytest
import torch
from saved_edits import edit_saved
from torch import nn

from quantscope.calibration import calibrate, load

transformers = pytest.importorskip("transformers")

from tiny_models import mixtral


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Mixtral calibration (fusion groups, experts) with every other entry quantscope reads
    back set as its writers set it; and its folder."""
    model, data = mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(model, data, "w8a8", progress=False)
    calib.info.update(
        model="/models/x", task="causal-lm", eval_max_length=256,
        keep_float={"n": 1, "mode": "float", "tensors": ["model.layers.0.mlp.gate"]},
        missing=[{"layer": "a", "role": "input", "calls": 0, "fallback": "float layer"}],
        unreached=[{"name": "b.weight", "why": "a parameter outside any module"}],
        smooth={"alpha": 0.5, "smoothed": ["c"], "skipped": [], "why": {}, "scales": {}})
    path = tmp_path_factory.mktemp("info") / "calib"
    calib.save(str(path))
    return calib, path


def test_every_entry_as_written_loads_and_reports(saved):
    calib, path = saved
    assert calib.info["fusion_groups"] and calib.info["experts"]
    loaded = load(str(path))
    assert loaded.info == calib.info
    assert "Fusion groups" in loaded.report().to_markdown()


@pytest.mark.parametrize("key,value,where,what", [
    ("fusion_groups", 5, "info.fusion_groups", "expected a list, got int"),
    ("fusion_groups", [{"layers": "q", "weight": "shared", "input": "shared"}],
     "info.fusion_groups[0].layers", "expected a list, got str"),
    ("keep_float", [1], "info.keep_float", "expected an object, got list"),
    ("keep_float", {"n": True, "mode": "float", "tensors": []}, "info.keep_float.n",
     "expected int, got bool"),
    ("experts", [{"module": "x"}], "info.experts[0].expert", "missing"),
    ("missing", "x", "info.missing", "expected a list, got str"),
    ("unreached", [1], "info.unreached[0]", "expected an object, got int"),
    ("smooth", {"alpha": "half", "smoothed": [], "skipped": []}, "info.smooth.alpha",
     "expected int or float, got str"),
    ("model", 3, "info.model", "expected str, got int"),
    ("task", 3, "info.task", "expected str, got int"),
    ("eval_max_length", "256", "info.eval_max_length", "expected int, got str"),
    ("calibration_seconds", "1s", "info.calibration_seconds", "expected int or float, got str"),
    ("missing", [{"layer": "a", "role": "input", "calls": 0, "fallback": 1}],
     "info.missing[0].fallback", "expected str, got int"),
    ("smooth", {"alpha": 0.5, "smoothed": [], "skipped": 1}, "info.smooth.skipped",
     "expected a list, got int"),
])
def test_an_edited_entry_is_refused_naming_the_key(saved, tmp_path, key, value, where, what):
    _, path = saved
    folder = tmp_path / "edited"
    shutil.copytree(path, folder)
    edit_saved(folder, meta=lambda d: d["info"].__setitem__(key, value))
    with pytest.raises(ValueError) as e:
        load(str(folder))
    assert f"quantscope.json: {where}: {what}" in str(e.value) and str(e.value).startswith("load:")


def test_entries_of_the_callers_own_stay_free(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4))
    calib = calibrate(model, [torch.randn(2, 8)], "w8a8", progress=False)
    calib.info["mine"] = {"anything": [1, "x", None]}
    calib.save(str(tmp_path / "c"))
    assert load(str(tmp_path / "c")).info["mine"] == {"anything": [1, "x", None]}


def test_an_expert_named_by_its_key_loads(saved, tmp_path):
    _, path = saved
    folder = tmp_path / "edited"
    shutil.copytree(path, folder)
    entry = [{"module": "m", "expert": "expert_0", "tokens": 3, "rule": "own"}]  # a ModuleDict's
    edit_saved(folder, meta=lambda d: d["info"].__setitem__("experts", entry))
    assert load(str(folder)).info["experts"] == entry


@pytest.mark.parametrize("key,value,where", [("model", None, "info.model"),
                                             ("eval_max_length", None, "info.eval_max_length")])
def test_save_refuses_an_entry_load_would_refuse(tmp_path, key, value, where):
    # review s40: save wrote it, and load refused the folder it wrote
    calib = calibrate(nn.Sequential(nn.Linear(8, 4)), [torch.randn(2, 8)], "w8a8",
                      progress=False)
    calib.info[key] = value
    with pytest.raises(ValueError, match=rf"save: the calibration's {where}: expected"):
        calib.save(str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()
