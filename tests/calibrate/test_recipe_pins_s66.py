"""Pins of recipes (quantscope.calibration.recipe and recipe_dict) that a mutation round
(session 66) found unpinned: an empty observer name refused, options kept sorted, the checks
``Recipe`` makes of its rules and ``fusion``, which recipes need calibration data (a
``local`` role, a KV cache, no weight), the KV cache's role (its names in any case, the roles
vLLM cannot hold refused, a misspelt target still an error beside it, the ignore list and a
rule's roles of an attention kept), the no-match message naming the ignore list, w4a16-asym's
asymmetric weights, preset names and a Recipe given to ``preset``, the group-size and
role-observer edits' refusals, ``re:`` matched from the start, and ``unmatched``'s list."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch import nn

from quantscope import QuantSpec, presets
from quantscope.calibration.recipe import (
    KV_CACHE,
    Recipe,
    Role,
    Rule,
    preset,
    with_group_size,
    with_role_observer,
)
from quantscope.calibration.recipe_dict import built, matches, unmatched
from quantscope.layout import Channel, Tensor

INT8 = QuantSpec("int8", Tensor())
FP8_KV = Role(KV_CACHE["fp8"], "minmax")


def rule(targets="Linear", **roles):
    return Rule(targets, **(roles or {"weight": Role(presets.INT8_PER_CHANNEL)}))


# Role


def test_an_empty_observer_name_is_refused():
    with pytest.raises(ValueError, match="Role.observer must be an observer name, got ''"):
        Role(INT8, "")


def test_a_local_role_needs_data_and_round_trips_as_local():
    local = Role(presets.NVFP4, "minmax", "local")
    assert local.needs_data is True
    assert Role(INT8, "minmax", True).needs_data is False
    assert local.to_dict()["dynamic"] == "local"
    assert Role.from_dict(json.loads(json.dumps(local.to_dict()))) == local


def test_options_are_pairs_sorted_by_name_whatever_the_order_given():
    """Observers are keyed by the options: two orders of the same options are one role."""
    want = (("averaging_constant", 0.1), ("non_finite", "ignore"))
    for options in ({"non_finite": "ignore", "averaging_constant": 0.1},
                    [("non_finite", "ignore"), ("averaging_constant", 0.1)]):
        assert Role(INT8, options=options).options == want
    assert Role(INT8, options=dict(reversed(want))) == Role(INT8, options=dict(want))


def test_built_keeps_a_type_error_a_type_error_led_by_where():
    with pytest.raises(TypeError, match=r"^here: Role.spec must be a QuantSpec"):
        built(Role, {"spec": "int8"}, "here")


# Recipe


def test_rules_in_a_dict_must_be_a_list():
    with pytest.raises(ValueError, match="Recipe.rules must be a list of rules, got str"):
        Recipe.from_dict({"rules": "Linear"})


def test_a_mapping_of_rules_is_refused():
    with pytest.raises(TypeError, match="Recipe.rules must be a Rule or a list of Rules"):
        Recipe({"a": rule()})


def test_every_rule_must_be_a_rule():
    with pytest.raises(TypeError, match="Recipe.rules must hold Rule objects, got QuantSpec"):
        Recipe([INT8, rule()])


def test_a_recipe_needs_a_rule_or_a_kv_cache():
    with pytest.raises(ValueError, match="at least one rule or a kv_cache"):
        Recipe(())
    assert Recipe((), kv_cache="fp8").rules == ()


def test_fusion_must_be_a_bool():
    with pytest.raises(TypeError, match="Recipe.fusion must be True or False, got 1"):
        Recipe(rule(), fusion=1)


@pytest.mark.parametrize("name,needs", [
    ("w4a16", False), ("w8a8-dynamic", False), ("mxfp4", False), ("fp8-dynamic", False),
    ("w8a8", True), ("nvfp4", True), ("fp8-kv", True),
])
def test_needs_data_where_an_activation_or_the_kv_cache_is_calibrated(name, needs):
    assert preset(name).needs_data is needs


def test_a_kv_cache_only_recipe_needs_data():
    assert Recipe((), kv_cache="fp8").needs_data is True


def test_the_no_match_message_names_the_ignore_list():
    with pytest.raises(ValueError, match=r"no module matches targets \['Conv2d'\] "
                                         r"\(ignore \['lm_head'\]\)"):
        Recipe(rule("Conv2d"), ignore="lm_head").match(nn.Sequential(nn.Linear(4, 4)))


# the KV cache


def test_kv_cache_names_are_read_in_any_case_with_minmax():
    assert Recipe(rule(), kv_cache="FP8").kv_cache == FP8_KV
    assert FP8_KV.spec == QuantSpec("fp8_e4m3", Tensor())


@pytest.mark.parametrize("role,match", [
    (Role(QuantSpec("fp8_e4m3", Channel(0))), "static per-tensor scales"),
    (Role(KV_CACHE["fp8"], "auto"), "name an observer"),
    ("int8", "must be None, a Role or one of"),
])
def test_a_kv_cache_role_vllm_cannot_hold_is_refused(role, match):
    with pytest.raises(ValueError, match=match):
        Recipe(rule(), kv_cache=role)


class SelfAttention(nn.Module):
    """What the KV cache takes for a cached attention (transformers'): a ``k_proj`` /
    ``v_proj``, a config naming its attention function, a forward taking the cache."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation="sdpa")
        self.k_proj, self.v_proj, self.o_proj = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, past_key_values=None):
        return self.o_proj(x)


def decoder():
    return nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"self_attn": SelfAttention()}) for _ in range(2))})


def test_a_misspelt_target_is_an_error_with_a_kv_cache_too():
    """calibrating.md: a misspelt target never leaves a KV-cache-only calibration."""
    with pytest.raises(ValueError, match=r"no module matches targets \['down_prj'\]"):
        Recipe(rule("down_prj"), kv_cache="fp8").match(decoder())


def test_an_ignored_attention_gets_no_kv_roles():
    found = Recipe(rule("*.o_proj"), ignore=r"re:layers\.0\.self_attn$",
                   kv_cache="fp8").match(decoder())
    assert "layers.0.self_attn" not in found
    assert found["layers.1.self_attn"][1] == {"key": FP8_KV, "value": FP8_KV}


def test_kv_roles_join_the_roles_a_rule_gives_an_attention():
    out = Role(INT8)
    found = Recipe(Rule("SelfAttention", output=out), kv_cache="fp8").match(decoder())
    assert found["layers.0.self_attn"][1] == {"output": out, "key": FP8_KV, "value": FP8_KV}


# presets and edits


def test_w4a16_asym_weights_are_asymmetric():
    """The table of calibrating.md: int4 groups of 128, asymmetric (zero points)."""
    spec = preset("w4a16-asym").rules[0].weight.spec
    assert spec == presets.INT4_GROUP128_ASYM
    assert spec.symmetric is False


def test_preset_names_are_read_in_any_case_but_the_scheme_spelling():
    assert preset("Fp8-Dynamic") == preset("fp8-dynamic")
    with pytest.raises(ValueError, match="compressed-tensors' spelling of its scheme"):
        preset("W8A8")


def test_a_recipe_given_to_preset_takes_an_observer_with_options_only():
    r = preset("w8a8")
    assert preset(r, "mse", averaging_constant=0.1) == r.with_observer("mse",
                                                                       averaging_constant=0.1)
    with pytest.raises(ValueError, match="kv_cache= given with Recipe 'w8a8'"):
        preset(r, kv_cache="fp8")
    with pytest.raises(ValueError, match="options without observer= given with Recipe"):
        preset(r, averaging_constant=0.1)


@pytest.mark.parametrize("size", [0, -128])
def test_a_group_size_below_one_is_refused(size):
    with pytest.raises(ValueError, match="group size must be a positive integer"):
        with_group_size(preset("w4a16"), size)
    assert with_group_size(preset("w4a16"), 1).rules[0].weight.spec.layout.size == 1


def test_a_group_size_for_a_recipe_without_groups_is_refused():
    with pytest.raises(ValueError, match="recipe 'w8a8' has no grouped role"):
        with_group_size(preset("w8a8"), 64)


def test_with_role_observer_refuses_a_role_nothing_calibrates():
    with pytest.raises(ValueError, match="'w8a8-dynamic' has dynamic inputs, quantized at run"):
        with_role_observer(preset("w8a8-dynamic"), "input", "mse")
    with pytest.raises(ValueError, match="'w8a8' has no output role"):
        with_role_observer(preset("w8a8"), "output", "mse")


def test_with_role_observer_drops_the_old_options_and_keeps_run_time_roles():
    static, run_time = Role(INT8, "minmax", options={"averaging_constant": 0.1}), \
        Role(presets.INT8_PER_TOKEN, "memoryless_minmax", True)
    r = with_role_observer(Recipe([Rule("0", input=static), Rule("1", input=run_time)]),
                           "input", "mse")
    assert r.rules[0].input == Role(INT8, "mse")
    assert r.rules[1].input == run_time


# name patterns


def test_a_regex_matches_from_the_start_of_the_name():
    """re.match, as compressed-tensors: ``re:.*mlp.gate`` takes ``mlp.gate_proj``."""
    lin = nn.Linear(2, 2)
    assert matches("re:.*mlp.gate", "model.mlp.gate_proj", lin)
    assert not matches("re:gate", "mlp.gate_proj", lin)


def test_unmatched_names_each_pattern_once():
    named = [("0", nn.Linear(2, 2))]
    assert unmatched(["down_prj", "Linear", "down_prj", "re:1", "0"], named) == [
        "down_prj", "re:1"]
