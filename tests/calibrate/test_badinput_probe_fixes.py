"""Calibration API argument checks a bad-input probe found missing: observer options no role of
a recipe takes (weight-only presets / schemes dropped them silently), a QuantSpec where a Rule
takes a Role, and save / apply / keep_float given the wrong kind of object (an AttributeError
from deep inside before)."""

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec, presets
from quantscope.calibration import apply, keep_float, save
from quantscope.calibration.recipe import KV_CACHE, Recipe, Role, Rule, preset


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


@pytest.mark.parametrize(("args", "options", "option", "observer"), [
    (("w4a16", "mse"), {"maxshrnk": 0.5}, "maxshrnk", "memoryless_mse"),  # typo of maxshrink
    (("w4a16",), {"group_size": 8}, "group_size", "memoryless_minmax"),  # not an option
    (("w4a16",), {"foo": 1}, "foo", "memoryless_minmax"),
    (("w4a16-asym",), {"averaging_constant": 0.1}, "averaging_constant", "memoryless_minmax"),
    (("w4a16", "percentile"), {"percentile": 99.9}, "percentile", "memoryless_minmax"),
    (("w8a8-dynamic",), {"foo": 1}, "foo", "memoryless_minmax"),  # its input is dynamic
])
def test_weight_only_preset_options_no_role_takes_raise(args, options, option, observer):
    with pytest.raises(ValueError, match=f"option '{option}' is not one any observer.*"
                                         f"weight observer '{observer}'"):
        preset(*args, **options)


def test_recipe_with_observer_refuses_an_option_no_role_takes():
    with pytest.raises(ValueError, match="recipe 'w4a16': option 'foo'"):
        preset("w4a16").with_observer("mse", foo=1)
    with pytest.raises(ValueError, match="option 'foo'"):
        preset(preset("w4a16"), "minmax", foo=1)


def test_options_some_role_takes_still_go_to_it():
    w = preset("w4a16", "mse", maxshrink=0.5, non_finite="ignore").rules[0].weight
    assert (w.observer, dict(w.options)) == ("memoryless_mse",
                                             {"maxshrink": 0.5, "non_finite": "ignore"})
    # w8a8: the weight takes maxshrink, only the input's moving average averaging_constant
    r = preset("w8a8", "mse", maxshrink=0.5, averaging_constant=0.1).rules[0]
    assert dict(r.weight.options) == {"maxshrink": 0.5}
    assert dict(r.input.options) == {"maxshrink": 0.5, "averaging_constant": 0.1}
    # auto hands every option on, as before
    assert dict(preset("w4a16", "auto", foo=1).rules[0].weight.options) == {"foo": 1}


def test_a_named_kv_cache_takes_the_options_a_weight_only_rule_does_not():
    r = preset("w4a16", kv_cache="fp8", averaging_constant=0.1)
    assert dict(r.rules[0].weight.options) == {}
    assert (r.kv_cache.observer, dict(r.kv_cache.options)) == ("minmax",
                                                               {"averaging_constant": 0.1})
    # a KV cache Role given whole takes none of them: the option would be dropped
    with pytest.raises(ValueError, match="option 'averaging_constant'"):
        preset("w4a16", kv_cache=Role(KV_CACHE["fp8"], "minmax"), averaging_constant=0.1)


def test_a_weight_only_preset_with_a_bad_option_no_longer_calibrates_with_defaults():
    m = _model()
    with pytest.raises(ValueError, match="maxshrnk"):
        quantscope.calibrate(m, [torch.randn(4, 16)], preset("w4a16", "mse", maxshrnk=0.5),
                             progress=False)


def test_weight_only_scheme_options_no_role_takes_raise():
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    with pytest.raises(ValueError, match="scheme 'W4A16': option 'foo' is not one any observer"
                                         ".*weight observer 'memoryless_minmax'"):
        scheme("W4A16", foo=1)
    with pytest.raises(ValueError, match="scheme 'W4A16': option 'maxshrnk'"):
        scheme("W4A16", "mse", maxshrnk=0.5)
    w = scheme("W4A16", "mse", maxshrink=0.5).rules[0].weight
    assert (w.observer, dict(w.options)) == ("memoryless_mse", {"maxshrink": 0.5})


@pytest.mark.parametrize("role", ["weight", "input", "output"])
@pytest.mark.parametrize("value", [QuantSpec("int8", "channel"), "int8", presets.INT8_PER_CHANNEL])
def test_a_rule_role_must_be_a_role(role, value):
    with pytest.raises(TypeError, match=rf"Rule\.{role} must be a Role \(Role\(spec, observer\)\)"):
        Rule(**{role: value})


def test_a_rule_of_roles_is_still_accepted():
    rule = Rule(weight=Role(presets.INT8_PER_CHANNEL), input=None)
    assert Recipe((rule,)).rules[0].weight.observer == "minmax"


@pytest.fixture(scope="module")
def calibrated():
    m = _model()
    batches = [torch.randn(4, 16) for _ in range(2)]
    return m, batches, quantscope.calibrate(m, batches, "w8a8", progress=False)


def test_save_names_a_model_given_for_the_calibration(calibrated, tmp_path):
    m, _, _ = calibrated
    with pytest.raises(TypeError, match="save: calibration must be a Calibration.*Sequential"):
        save(m, tmp_path / "s")
    with pytest.raises(TypeError, match="save: calibration must be a Calibration.*NoneType"):
        save(None, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_apply_names_a_missing_model_or_states(calibrated):
    m, _, cal = calibrated
    with pytest.raises(TypeError, match="apply: model must be a torch.nn.Module, got NoneType"):
        cal.apply(None)
    with pytest.raises(TypeError, match="apply: model must be a torch.nn.Module, got NoneType"):
        apply(None, cal.states)
    with pytest.raises(TypeError, match=r"apply: states must be a .*mapping.*got NoneType"):
        apply(m, None)
    with pytest.raises(TypeError, match=r"calibration\.apply\(model\).*got Calibration"):
        apply(m, cal)
    apply(m, cal.states).remove()  # the right arguments still apply


def test_keep_float_names_the_argument_of_the_wrong_kind(calibrated):
    m, batches, cal = calibrated
    sens = quantscope.sensitivity(m, batches, "w8a8")
    with pytest.raises(TypeError, match="keep_float: sens must be a Sensitivity, got NoneType"):
        keep_float(cal, None, 1)
    with pytest.raises(TypeError, match="keep_float: calibration must be a Calibration, got "
                                        "NoneType"):
        keep_float(None, sens, 1)
    with pytest.raises(TypeError, match="keep_float: sens must be a Sensitivity, got "
                                        "Calibration"):
        keep_float(sens=cal, calibration=cal, n=1)
    assert keep_float(cal, sens, 1).info["keep_float"]["n"] == 1


def test_one_tensor_as_batches_is_refused_as_one_dict_is():
    """Found by probing: calibrate(model, x) iterated x's rows, each run as a batch without
    its batch dimension (an unbatched forward), silently."""
    from quantscope.calibration import calibrate, sensitivity

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    for call in (lambda: calibrate(model, x, "w8a8", progress=False),
                 lambda: sensitivity(model, x)):
        with pytest.raises(TypeError, match=r"got one Tensor .*\[batch\] \(or list\(t\.unbind"):
            call()
    assert calibrate(model, [x], "w8a8", progress=False).states  # the list runs
