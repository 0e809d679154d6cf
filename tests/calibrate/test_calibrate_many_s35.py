"""calibrate_many: each recipe's report of fusion groups is its own, and recipes that cannot
share one pass are refused before any batch is read (probe s35)."""

import warnings
from dataclasses import replace

import pytest
from tiny_models import llama

from quantscope import calibrate
from quantscope.calibration import Outliers, calibrate_many, preset
from quantscope.calibration.recipe import with_group_size


def _many(model, batches, recipes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate_many(model, batches, recipes, progress=False)


def test_each_recipes_fusion_groups_are_its_own():
    """A weight-only recipe beside one quantizing inputs said its group's input was "shared",
    and a recipe ignoring k_proj / up_proj listed them in its groups, as the pass found them."""
    model, batches = llama()
    w4 = with_group_size(preset("w4a16"), 32)
    narrow = replace(preset("nvfp4", ignore=["*.k_proj", "*.up_proj"]), name="narrow")
    many = _many(model, batches, [w4, preset("w8a8"), narrow, preset("nvfp4")])
    for recipe in (w4, narrow):
        alone = calibrate(model, batches, recipe, progress=False)
        assert many[recipe.name].info["fusion_groups"] == alone.info["fusion_groups"]
    assert {g["input"] for g in many["w4a16"].info["fusion_groups"]} == {"none"}
    assert [g["layers"] for g in many["narrow"].info["fusion_groups"]] == [
        [f"model.layers.{i}.self_attn.q_proj", f"model.layers.{i}.self_attn.v_proj"]
        for i in range(2)]


@pytest.mark.parametrize("options", [{"outliers": Outliers(smooth=0.5)}, {"sequential": True}])
def test_recipes_of_other_fusion_options_are_refused_before_a_batch_is_read(options):
    """The refusal came after SmoothQuant's pass (one batch read) or every sequential piece
    (all read): a generator of batches was spent on a call that could not run."""
    model, batches = llama()
    read = []

    def stream():
        for b in batches:
            read.append(b)
            yield b
    off = replace(preset("fp8"), fusion=False)
    with pytest.raises(ValueError, match="fusion options .* differ"):
        calibrate_many(model, stream(), [preset("w8a8"), off], progress=False, **options)
    assert read == []
