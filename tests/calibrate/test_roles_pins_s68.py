"""Pins found by a mutation round (s68) on how a module takes a recipe's roles
(``run.module_roles``) and on the warnings for options and rules set in vain
(``run.unused_options``): a Conv1D's activation layouts taken untransposed, a grouped
ConvTranspose's per-channel activations taken, groups and blocks along a conv weight's kernel
refused, a Linear's input and output widths each checked on its own side, every recipe's
shapes checked past one that matches nothing, and a rule naming a container module said to
take none of its roles rather than to be misspelt. Each test fails on a mutant of the
source that the older tests let pass (the tied-roles checks had no such mutant)."""

from __future__ import annotations

import pytest
from test_run_parts_pins_s64 import _messages
from test_sequential_parts_pins_s64 import _role
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.run import unused_options
from quantscope.calibration.run.module_roles import (
    activation_width,
    check_role_shape,
    check_shapes,
)

_INT8 = QuantSpec("int8", "channel:0")


def _layout(text):
    return QuantSpec("int8", text).layout


@pytest.mark.parametrize("layout, dynamic", [("channel:-1", False), ("group:2", True)])
def test_a_conv1d_takes_its_activation_layouts_untransposed(layout, dynamic):
    """A transformers Conv1D holds its weight transposed (``[in, out]``), not its
    activations: an input or output role's layout is taken as given, along the last dim."""
    from transformers.pytorch_utils import Conv1D

    for role in ("input", "output"):
        got = check_role_shape("c", role, _role(layout, dynamic=dynamic), Conv1D(6, 4))
        assert got.spec.layout == _layout(layout)


def test_a_grouped_conv_transposes_per_channel_activations_are_taken_unchanged():
    """The groups refusal is the weight's ([in, out / groups, *k]); its activations
    ``[N, C, *spatial]`` keep their channel axis, the input's and the output's."""
    module = nn.ConvTranspose2d(4, 6, 3, groups=2)
    for role in ("input", "output"):
        got = check_role_shape("t", role, _role("channel:1", dynamic=True), module)
        assert got.spec.layout == _layout("channel:1")
    got = check_role_shape("t", "input", _role("channel:0", dynamic=True),
                           nn.ConvTranspose2d(4, 6, 3))
    assert got.spec.layout == _layout("channel:0")


@pytest.mark.parametrize("layout", ["group:3:2", "group:3:-1", "block:3:2", "block:3:-2"])
def test_groups_and_blocks_along_a_conv_weights_kernel_are_refused(layout):
    """A conv weight ``[out, in / groups, kh, kw]``: groups and blocks on axis 2 and up run
    along the kernel, refused naming the layer, its class and the kernel dims."""
    with pytest.raises(ValueError, match=r"layer 'c' \(Conv2d\) weight of shape \(4, 4, 3, 3\)"
                                         r".*along the kernel dims \(3, 3\)"):
        check_role_shape("c", "weight", _role(layout), nn.Conv2d(4, 4, 3))


def test_a_linears_widths_are_its_in_and_out_features():
    module = nn.Linear(4, 6)
    assert activation_width(module, "input") == 4 and activation_width(module, "output") == 6
    assert activation_width(nn.Conv2d(4, 6, 3), "input") is None


def test_a_group_that_divides_only_the_other_width_is_refused_naming_it():
    """A group size is checked against the role's own width: the input's in_features, the
    output's out_features."""
    module = nn.Linear(4, 6)
    check_role_shape("l", "input", _role("group:4", dynamic=True), module)
    with pytest.raises(ValueError, match=r"layer 'l' output of width 6 cannot take"):
        check_role_shape("l", "output", _role("group:4", dynamic=True), module)


def test_check_shapes_checks_a_recipe_after_one_that_matches_nothing():
    model = nn.Sequential(nn.Linear(4, 6))
    nothing = Recipe((Rule(("nope",), weight=Role(_INT8)),), name="n")
    bad = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", "group:5"))),), name="b")
    check_shapes(model, [nothing])
    with pytest.raises(ValueError, match=r"layer '0' weight of shape \(6, 4\)"):
        check_shapes(model, [nothing, bad])


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.block = nn.Sequential(nn.Linear(2, 2))


def test_a_rule_naming_a_container_is_said_roleless_not_misspelt():
    """A target naming a container module matches it (it is no misspelt name); the rule takes
    none of its roles, and the warning names the container."""
    rec = Recipe((Rule(("head",), weight=Role(_INT8)), Rule(("block",), weight=Role(_INT8))),
                 name="r")
    said = _messages(lambda: unused_options.warn_idle_rules(_Nested(), {"r": rec}))
    assert len(said) == 1
    assert "match no module" not in said[0]
    assert "rules[1]" in said[0] and "'block' (Sequential)" in said[0]
