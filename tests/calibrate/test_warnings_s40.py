"""Probe s40: option warnings through every path, at the caller's line. ``MoE(...)`` set in
vain warned only in the plain pass (not with sequential, nor under Auto(metric='model'),
whose passes are inner calls); keep_float's and SmoothQuant's warnings named a line of
quantscope's, or torch's no_grad wrapper, instead of the caller's."""

import warnings

import pytest
import torch
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration import MoE, Outliers, Recipe, Role, Rule, calibrate, calibrate_many
from quantscope.calibration.recipe import preset

transformers = pytest.importorskip("transformers")

from tiny_models import llama

W4 = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int4", "group:32"), "memoryless_minmax")),),
            name="w4g32")


def _caught(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if not issubclass(w.category, DeprecationWarning)]


def _warns_here_once(text, call):
    """``call`` warns ``text`` once, at this file's line (the caller's)."""
    said = [w for w in _caught(call) if text in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in said]


@pytest.mark.parametrize("how", ["sequential", "auto"])
def test_moe_set_in_vain_warns_through_every_pass(how):
    model, data = llama()
    recipe, kw = (("w8a8", {"sequential": True}) if how == "sequential"
                  else (preset("w8a8", "auto"), {}))
    _warns_here_once("MoE(all_experts=True, min_tokens=128) changes nothing", lambda: calibrate(
        model, data, recipe, progress=False, moe=MoE(all_experts=True), **kw))


def test_keep_float_with_nothing_to_rank_warns_at_the_callers_line_naming_the_label():
    model, data = llama()
    caught = _caught(lambda: calibrate_many(model, data, {"w": W4, "x": "w8a8-dynamic"},
                                            progress=False, outliers=Outliers(keep_float=1)))
    said = [w for w in caught if "ranks only static inputs" in str(w.message)]
    assert {w.filename for w in said} == {__file__}
    assert sorted(str(w.message).split("calibration ")[1][:3] for w in said) == ["'w'", "'x'"]


def test_keep_floats_other_warnings_are_at_the_callers_line_too():
    torch.manual_seed(0)
    _warns_here_once("3 activations asked for, 1 kept float", lambda: calibrate(
        nn.Sequential(nn.Linear(8, 8)), [torch.randn(4, 8)], "w8a8", progress=False,
        outliers=Outliers(keep_float=3)))
    _warns_here_once("no tokens to quantize per token", lambda: calibrate(
        nn.Sequential(nn.Conv2d(3, 4, 3)), [torch.randn(2, 3, 8, 8)],
        preset("w8a8", targets=("Conv2d",)), progress=False,
        outliers=Outliers(keep_float=1, fallback="dynamic")))


def test_moe_where_the_recipe_ignores_every_expert_warns():
    from tiny_models import mixtral

    model, data = mixtral()
    caught = _caught(lambda: calibrate(model, data, preset("w8a8", ignore=["re:.*experts.*"]),
                                       progress=False, moe=MoE(all_experts=True)))
    assert any("changes nothing: the model has no mixture-of-experts" in str(w.message)
               for w in caught)


def test_smooth_with_no_pair_warns_at_the_callers_line():
    torch.manual_seed(0)
    _warns_here_once("no pair SmoothQuant smooths", lambda: calibrate(
        nn.Sequential(nn.Linear(8, 8)), [torch.randn(4, 8)], "w8a8", progress=False,
        outliers=Outliers(smooth=0.5)))


@pytest.mark.parametrize("name", ["W8A8", "FP8", "NVFP4"])
def test_a_schemes_spelling_is_no_presets(name):
    # probe s40: calibrate(model, batches, "W8A8") ran the static preset w8a8, where the
    # scheme of that spelling has dynamic per-token inputs
    with pytest.raises(ValueError, match=rf"recipe: '{name}' is compressed-tensors' spelling "
                                         rf"of its scheme \(scheme\('{name}'\)\); presets "
                                         rf"are lower case"):
        preset(name)
    assert preset(name.capitalize()).name == name.lower()  # another case reads as before
    assert preset("W8A8-DYNAMIC").name == "w8a8-dynamic"  # no scheme is spelt so
