"""Option fields that were taken in vain or failed naming no field (session 39's probe):
Runtime.missing and MoE.min_tokens where no role reads them, time_groups' labels, budgets
beyond float's range, numpy options saved; and calibrate_many's order under
Auto(metric='model'). (Runtime.group without distributed: test_options_probe_fixes.py.)"""

import warnings

import pytest
import torch
from torch import nn

from quantscope.calibration import (
    Auto,
    MoE,
    Runtime,
    Sampling,
    Sequential,
    calibrate,
    calibrate_many,
    preset,
)

torch.set_num_threads(1)


def _linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 16)).eval(), [torch.randn(4, 128) for _ in range(2)]


def _said(run):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in said if "changes nothing" in str(w.message)]


@pytest.mark.parametrize("missing", ["float", "error"])
def test_missing_on_a_weight_only_recipe_warns(missing):
    model, batches = _linear()
    ref = calibrate(model, batches, "w4a16", progress=False)
    got, said = _said(lambda: calibrate(model, batches, "w4a16", progress=False,
                                        runtime=Runtime(missing=missing)))
    assert got.quantizes_like(ref)  # it changes nothing: said so
    assert len(said) == 1 and f"Runtime(missing={missing!r})" in said[0], said


def test_missing_with_an_activation_role_is_quiet():
    model, batches = _linear()
    _, said = _said(lambda: calibrate(model, batches, "w8a8-dynamic", progress=False,
                                      runtime=Runtime(missing="float")))
    assert not said, said


def _mixtral():
    tm = pytest.importorskip("tiny_models")
    pytest.importorskip("transformers")
    return tm.mixtral()


@pytest.mark.parametrize("recipe", ["w8a8-dynamic", "w4a16"])
def test_min_tokens_without_a_static_activation_warns(recipe):
    model, batches = _mixtral()
    _, said = _said(lambda: calibrate(model, batches, recipe, progress=False,
                                      moe=MoE(min_tokens=3)))
    assert len(said) == 1 and "min_tokens" in said[0], said


def test_min_tokens_with_a_static_activation_is_quiet():
    model, batches = _mixtral()
    got, said = _said(lambda: calibrate(model, batches, "w8a8", progress=False,
                                        moe=MoE(min_tokens=10 ** 6)))
    assert not said, said
    assert got.info["expert_min_tokens"] == 10 ** 6


@pytest.mark.parametrize("groups", [{"g": [["w8a8"]]}, {7: ["w8a8"]}, {"g": [1]}])
def test_time_groups_names_and_labels_are_strings(groups):
    with pytest.raises(ValueError, match=r"Runtime\.time_groups must be a dict of str label"):
        Runtime(time_groups=groups)


@pytest.mark.parametrize("make", [lambda: Sampling(budget_mb=10 ** 400),
                                  lambda: Sequential(cache_budget_mb=10 ** 400)])
def test_budgets_beyond_float_are_refused_by_name(make):
    with pytest.raises(ValueError, match="budget_mb"):
        make()


def test_calibrate_many_keeps_the_callers_order_under_the_model_metric():
    tm = pytest.importorskip("tiny_models")
    pytest.importorskip("transformers")
    model, batches = tm.llama()
    recipes = {"a": preset("w8a8", "auto"), "m": preset("w8a8", "minmax")}
    out = calibrate_many(model, batches, recipes, progress=False,
                         auto=Auto(candidates=["minmax", "mse"], metric="model"))
    assert list(out) == ["a", "m"]


def test_numpy_role_options_save_and_load(tmp_path):
    # probe s39: np.int64 / np.float32 options calibrated, then save() failed in json.dump
    # ("int64 is not JSON serializable"), the work lost
    np = pytest.importorskip("numpy")
    from quantscope import presets
    from quantscope.calibration import Recipe, Role, Rule, load

    model, batches = _linear()
    for obs, options in (("histogram_mse", {"bins": np.int64(1024)}),
                         ("minmax", {"averaging_constant": np.float32(0.25)})):
        role = Role(presets.INT8_PER_TENSOR, obs, options=options)
        assert all(type(v) in (int, float) for _, v in role.options)
        recipe = Recipe((Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "minmax"),
                              input=role),))
        cal = calibrate(model, batches, recipe, progress=False)
        path = cal.save(tmp_path / obs)
        assert load(path).quantizes_like(cal)


# ---- pins of the mutation round (s39)
def test_sampling_budget_alone_on_a_weight_only_recipe_warns():
    model, batches = _linear()
    _, said = _said(lambda: calibrate(model, batches, "w4a16", progress=False,
                                      sampling=Sampling(budget_mb=5)))
    assert len(said) == 1 and "Sampling(" in said[0], said


def test_moe_options_on_a_model_without_moe_warn_once():
    model, batches = _linear()
    _, said = _said(lambda: calibrate(model, batches, "w4a16", progress=False,
                                      moe=MoE(min_tokens=3)))
    assert len(said) == 1 and "no mixture-of-experts layer" in said[0], said


def test_missing_with_an_output_role_only_is_quiet():
    from quantscope import presets
    from quantscope.calibration import Recipe, Role, Rule

    model, batches = _linear()
    recipe = Recipe((Rule(("Linear",), output=Role(presets.INT8_PER_TENSOR, "minmax")),))
    _, said = _said(lambda: calibrate(model, batches, recipe, progress=False,
                                      runtime=Runtime(missing="float")))
    assert not said, said


def test_missing_with_a_kv_cache_role_is_quiet():
    # (reviewer) the KV cache's key / value roles take the missing policy too
    tm = pytest.importorskip("tiny_models")
    pytest.importorskip("transformers")
    from quantscope.calibration.recipe import with_group_size

    model, batches = tm.llama()
    recipe = with_group_size(preset("w4a16", kv_cache="fp8"), 32)
    _, said = _said(lambda: calibrate(model, batches, recipe, progress=False,
                                      runtime=Runtime(missing="float")))
    assert not said, said
