"""Pins of recipes (quantscope.calibration.recipe and recipe_dict) that a mutation round
(session 71) found unpinned: ``Role.to_dict`` writing options as a mapping, a tuple of rules
and a KV cache role's errors read from a dict, ``fuse=None`` as no groups, ``w4a8``'s
symmetric int4 weights, scheme names in any case and an empty scheme refused, an unknown role
name refused by ``with_role_observer``, and lists nested in a tuple option frozen."""

from __future__ import annotations

import pytest

from quantscope import QuantSpec, presets
from quantscope.calibration.recipe import (
    KV_CACHE,
    Recipe,
    Role,
    Rule,
    preset,
    with_role_observer,
)
from quantscope.layout import Tensor

INT8 = QuantSpec("int8", Tensor())


def test_role_to_dict_writes_the_options_as_a_mapping():
    role = Role(INT8, "minmax", options={"averaging_constant": 0.1})
    assert role.to_dict() == {"spec": INT8.to_dict(), "observer": "minmax", "dynamic": False,
                              "options": {"averaging_constant": 0.1}}


def test_a_dict_of_rules_as_a_tuple_is_read_as_a_list():
    rule = Rule("Linear", weight=Role(presets.INT8_PER_CHANNEL))
    assert Recipe.from_dict({"rules": (rule.to_dict(),)}).rules == (rule,)


def test_fuse_none_is_no_fusion_group():
    assert Recipe(Rule("Linear", weight=Role(INT8)), fuse=None).fuse == ()


def test_a_bad_kv_cache_role_in_a_dict_is_located():
    kv = {**Role(KV_CACHE["fp8"]).to_dict(), "observer": ""}
    with pytest.raises(ValueError, match=r"^Recipe\.kv_cache: Role\.observer must be"):
        Recipe.from_dict({"rules": [], "kv_cache": kv})


def test_w4a8_weights_are_symmetric_int4_groups_with_static_int8_inputs():
    """calibrating.md's table: int4 groups of 128 (no zero points), int8 per tensor static."""
    rule = preset("w4a8").rules[0]
    assert rule.weight.spec == presets.INT4_GROUP128
    assert rule.weight.spec.symmetric is True
    assert (rule.input.spec, rule.input.dynamic) == (INT8, False)


def test_with_role_observer_refuses_an_unknown_role_name():
    with pytest.raises(ValueError, match="role must be one of"):
        with_role_observer(preset("w8a8"), "key", "mse")


def test_lists_inside_a_tuple_option_are_frozen_to_tuples():
    """JSON gives lists back: nested ones must become tuples to stay hashable."""
    assert Role(INT8, options={"percentiles": (1, [2, 3])}).options == (
        ("percentiles", (1, (2, 3))),)


def test_scheme_names_are_read_in_any_case():
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    assert scheme("fp8_dynamic") == scheme("FP8_DYNAMIC")


def test_an_empty_scheme_is_an_unknown_one():
    """compressed-tensors' UNQUANTIZED holds no role: no recipe to build."""
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration.recipe import scheme

    with pytest.raises(ValueError, match="unknown scheme 'UNQUANTIZED'"):
        scheme("UNQUANTIZED")
