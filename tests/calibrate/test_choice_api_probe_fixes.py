"""Probe fixes of the choice API: ``Outliers(keep_float=)`` warns where nothing it ranks is
static (it kept none silently); a second ``keep_float`` adds to the first in ``info`` and the
report; a non-str ``calibrate_many`` label is refused up front (``load`` refused the folder
``save`` wrote); a SmoothQuant calibration refuses an unsmoothed model (it ran the smoothed
qparams on the float weights silently); ``layer_sensitivity`` / ``fallback_curve`` name the
missing module of a foreign calibration; ``keep_float`` takes numpy integers."""

import copy
import dataclasses
import itertools
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Outliers, calibrate_many
from quantscope.calibration.choice.sensitivity import fallback_curve, layer_sensitivity
from quantscope.calibration.choice.smooth import reapply
from quantscope.calibration.recipe import Recipe, Rule, preset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiny_models

KW = {"progress": False}


def _mlp(*widths):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    body = [m for lin in layers for m in (lin, nn.ReLU())][:-1]
    return nn.Sequential(*body).eval(), [torch.randn(4, widths[0]) for _ in range(2)]


def test_outliers_keep_float_warns_when_only_outputs_are_static():
    model, batches = _mlp(16, 32, 16)
    base = preset("w8a8").rules[0]
    recipe = Recipe((Rule(("Linear",), weight=base.weight, output=base.input),), name="w8o8")
    with pytest.warns(UserWarning, match=r"Outliers\(keep_float=2\) ranks only static inputs"):
        c = quantscope.calibrate(model, batches, recipe, outliers=Outliers(keep_float=2), **KW)
    assert c.info["keep_float"]["n"] == 0


def test_second_keep_float_adds_to_the_first():
    model, batches = _mlp(8, 8, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = quantscope.calibrate(model, batches, "w8a8",
                                 outliers=Outliers(keep_float=1, fallback="float"), **KW)
        sens = quantscope.sensitivity(model, batches[:1], calibration=c, roles=("input",))
    first = c.info["keep_float"]["tensors"]
    k = quantscope.keep_float(c, sens, 1)
    out = [f"{layer} input" for layer in ("0", "2", "4") if "input" not in k.states.get(layer, {})]
    assert len(first) == 1 and len(out) == 2
    assert k.info["keep_float"]["n"] == 2 and sorted(k.info["keep_float"]["tensors"]) == out
    md = k.report().to_markdown()
    assert all(t in md[md.index("## Fallback"):] for t in out)
    with pytest.raises(ValueError, match="earlier fallback runs 'float'"):
        quantscope.keep_float(c, sens, 1, mode="dynamic")


def test_second_keep_float_takes_the_first_ones_mode():
    # probe s58: Outliers' default fallback is "dynamic" and keep_float's was "float", so a
    # second one without mode= was refused; the earlier fallback's mode is the default now
    model, batches = _mlp(8, 8, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = quantscope.calibrate(model, batches, "w8a8", outliers=Outliers(keep_float=1), **KW)
        sens = quantscope.sensitivity(model, batches[:1], calibration=c, roles=("input",))
    assert c.info["keep_float"]["mode"] == "dynamic"
    k = quantscope.keep_float(c, sens, 1)
    assert k.info["keep_float"]["mode"] == "dynamic" and k.info["keep_float"]["n"] == 2
    dynamic = [layer for layer, roles in k.states.items()
               if "input" in roles and roles["input"].dynamic]
    assert len(dynamic) == 2
    plain = quantscope.calibrate(model, batches, "w8a8", **KW)
    assert quantscope.keep_float(plain, sens, 1).info["keep_float"]["mode"] == "float"
    # s58 re-review: fallback_curve's own mode default was still "float"
    from quantscope.calibration import fallback_curve

    rows = fallback_curve(model, c, sens, lambda m: 1.0, ns=(0, 1))
    assert [r["n"] for r in rows] == [0, 1]


@pytest.mark.parametrize("label", [8, None])
def test_calibrate_many_refuses_a_non_str_label(label):
    model, batches = _mlp(8, 8)
    with pytest.raises(TypeError, match=f"label must be a str, got {label!r}"):
        calibrate_many(model, batches, {label: "w8a8"}, **KW)


def test_save_refuses_a_label_load_would_refuse(tmp_path):
    model, batches = _mlp(8, 8)
    # (a user's call refuses a tuple label now: auto's inner passes label candidates so)
    c = dataclasses.replace(calibrate_many(model, batches, {"w8a8": "w8a8"}, **KW)["w8a8"],
                            label=("w8a8", "minmax"))
    with pytest.raises(TypeError, match="label must be a str"):
        c.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_smoothed_calibration_refuses_an_unsmoothed_model(tmp_path):
    model, batches = tiny_models.llama(seed=1)
    fresh = copy.deepcopy(model)
    c = quantscope.calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.8), **KW)
    c.save(tmp_path / "sm")
    loaded = quantscope.calibrate.load(tmp_path / "sm")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"is not smoothed .*smooth\.reapply\(model, calib"):
        loaded.apply(fresh)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    reapply(fresh, loaded)
    with torch.no_grad():
        with c.apply(model):
            y = model(batches[0]).logits
        with loaded.apply(fresh):  # the smoothed copy: accepted, the saved QDQ model
            torch.testing.assert_close(fresh(batches[0]).logits, y)


def test_layer_sensitivity_and_fallback_curve_name_a_foreign_module():
    a, xs = _mlp(8, 8, 8)
    b = nn.Sequential(nn.Linear(8, 8)).eval()
    c = quantscope.calibrate(a, xs, "w8a8", **KW)
    s = quantscope.sensitivity(a, xs, calibration=c)
    with pytest.raises(ValueError, match=r"layer_sensitivity: the model has no module '2'"):
        layer_sensitivity(b, xs, c)
    with pytest.raises(ValueError, match=r"fallback_curve: the model has no module '2'"):
        fallback_curve(b, c, s, lambda m: 0.0, ns=(0,))


def test_keep_float_takes_numpy_integers():
    model, xs = _mlp(8, 8, 8)
    c = quantscope.calibrate(model, xs, "w8a8", **KW)
    s = quantscope.sensitivity(model, xs, calibration=c)
    k = quantscope.keep_float(c, s, np.int64(1))
    assert k.info["keep_float"]["n"] == 1 and isinstance(k.info["keep_float"]["n"], int)
    rows = fallback_curve(model, c, s, lambda m: 0.0, ns=np.arange(2))
    assert [len(r["tensors"]) for r in rows] == [0, 1]
    with pytest.raises(ValueError, match="non-negative integer"):
        quantscope.keep_float(c, s, True)
