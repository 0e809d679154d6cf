"""The ``--group-size`` sizes the indivisible-width error offers divide every grouped layer.

One group size applies to every grouped layer of the recipe, so a size that divides the
refused layer but not another grouped one would stop at that one next. Two layers 4800 and 48
wide (group 128 divides neither): of 16..256 only 16 divides both (32 / 64 / 96 / 192 divide
4800 alone). A mutation round found no test failing where sizes dividing any layer were offered.
"""

import pytest
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.cli.checks import UsageError
from quantscope.cli.recipes import _indivisible
from quantscope.layout import Group


def test_the_sizes_offered_divide_every_grouped_layer():
    g128 = Role(QuantSpec("int4", layout=Group(128)), "minmax")
    m = nn.Sequential()
    m.add_module("a", nn.Linear(4800, 8))
    m.add_module("b", nn.Linear(48, 8))
    want = [d for d in (16, 32, 64, 96, 128, 192, 256) if 4800 % d == 0 and 48 % d == 0]
    assert want == [16]
    with pytest.raises(UsageError) as e:
        _indivisible(Recipe((Rule(("a", "b"), weight=g128),)), m, "error")
    assert "(2 such layers); --group-size 16 would, or --on-indivisible" in str(e.value)
