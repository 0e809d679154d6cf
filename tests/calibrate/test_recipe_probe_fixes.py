"""Recipe defects a probe of presets / recipes / options found: each is refused when the recipe
is built (or named when calibrate cannot match), with a ValueError naming the field."""

import copy
import re

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec, presets
from quantscope.calibration.recipe import Recipe, Role, Rule, preset, with_group_size


@pytest.mark.parametrize("spec", [QuantSpec("int8"), presets.INT8_PER_TOKEN, presets.MXFP4],
                         ids=["int8-tensor", "int8-token", "mxfp4"])
def test_local_needs_a_spec_with_a_global_scale(spec):
    # elsewhere the calibrated range goes unused ("local" would equal True), and per token it
    # slipped past the error for a static per-token activation spec
    with pytest.raises(ValueError, match="Role.dynamic: 'local'.*global scale"):
        Role(spec, "minmax", "local")
    assert Role(presets.NVFP4, "minmax", "local").dynamic == "local"


@pytest.mark.parametrize("build,where,pattern", [
    (lambda: Rule(("re:(q|k_proj",), weight=Role(QuantSpec("int8", "channel"))),
     "Rule.targets", "re:(q|k_proj"),
    (lambda: preset("w8a8", ignore=["re:*lm_head"]), "Recipe.ignore", "re:*lm_head"),
    (lambda: preset("w8a8", targets="re:[a"), "Rule.targets", "re:[a"),
])
def test_a_malformed_regex_is_refused_when_the_recipe_is_built(build, where, pattern):
    with pytest.raises(ValueError, match=rf"{where}: '{re.escape(pattern)}' is not a valid "
                                         r"regular expression") as e:
        build()
    assert "re.error" not in type(e.value).__module__


def test_a_regex_target_still_matches_from_the_start():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    assert sorted(preset("w8a8", targets="re:1").match(model)) == ["1"]
    assert sorted(preset("w8a8", ignore="re:0").match(model)) == ["1"]


def test_a_bare_linear_is_named_as_the_root_module():
    with pytest.raises(ValueError, match=r"only the model itself \(Linear\) matches targets "
                                         r"\['Linear'\], and the root module is never "
                                         r"quantized.*nn.Sequential\(model\)"):
        quantscope.calibrate(nn.Linear(16, 8), [torch.randn(4, 16)], "w8a8", progress=False)
    wrapped = quantscope.calibrate(nn.Sequential(nn.Linear(16, 8)), [torch.randn(4, 16)],
                                   "w8a8", progress=False)
    assert sorted(wrapped.states) == ["0"]


def test_an_ignored_model_keeps_the_no_match_message():
    # a layer matched the targets but was ignored: not the root's fault
    with pytest.raises(ValueError, match="no module matches targets"):
        preset("w8a8", targets="*", ignore="*").match(nn.Sequential(nn.Linear(4, 4)))


def test_nvfp4_options_its_input_observer_does_not_take_are_named_at_preset():
    with pytest.raises(ValueError, match="preset 'nvfp4': option 'averaging_constant' is not "
                                         "one the input observer 'static_minmax' takes"):
        preset("nvfp4", averaging_constant=0.1)
    # an option it takes still goes to it; named, the observer takes its own
    assert dict(preset("nvfp4", non_finite="ignore").rules[0].input.options) == {
        "non_finite": "ignore"}
    named = preset("nvfp4", "minmax", averaging_constant=0.1).rules[0].input
    assert (named.observer, dict(named.options)) == ("minmax", {"averaging_constant": 0.1})


def test_scheme_options_its_input_observer_does_not_take_are_named():
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    with pytest.raises(ValueError, match="scheme 'FP8': option 'averaging_constant' is not "
                                         "one the input observer 'static_minmax' takes"):
        scheme("FP8", averaging_constant=0.1)
    assert scheme("FP8", "minmax", averaging_constant=0.1).rules[0].input.observer == "minmax"


def test_a_bool_group_size_is_refused():
    with pytest.raises(ValueError, match="group size must be a positive integer, got True"):
        with_group_size(preset("w4a16"), True)
    assert with_group_size(preset("w4a16"), 64).rules[0].weight.spec.layout.size == 64


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.__setitem__("bits", 8),
     r"Recipe.rules\[0\].input.spec: unknown key 'bits'; the known keys are \['format'"),
    (lambda s: s.__setitem__("layout", "groop:8"), r"Recipe.rules\[0\].input.spec: .*groop"),
])
def test_a_spec_error_in_a_recipe_dict_is_located(edit, match):
    d = preset("w8a8").to_dict()
    edit(d["rules"][0]["input"]["spec"])
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict(d)


def test_a_spec_written_as_a_string_is_located():
    d = copy.deepcopy(preset("w8a8").to_dict())
    d["rules"][0]["input"]["spec"] = "int8"
    with pytest.raises(ValueError, match=r"Recipe.rules\[0\].input.spec must be a mapping "
                                         r"with keys \['format'.*got str 'int8'"):
        Recipe.from_dict(d)
    assert Recipe.from_dict(preset("w8a8").to_dict()) == preset("w8a8")
