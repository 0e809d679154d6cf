"""A role's observer options given as ``(name, value)`` pairs (the form ``Role`` documents
beside a mapping, and a recipe file's list of pairs) may name an option once: a name given
twice is refused, as a keyword given twice and a recipe file's key given twice are, where the
last was kept without a word (found by a mutation round, session 66)."""

import pytest

from quantscope import QuantSpec
from quantscope.calibration.recipe import Recipe, Role, preset
from quantscope.layout import Tensor


def test_an_option_named_twice_in_pairs_is_refused_not_the_last_kept():
    with pytest.raises(ValueError, match="averaging_constant"):
        Role(QuantSpec("int8", Tensor()),
             options=[("averaging_constant", 0.1), ("averaging_constant", 0.5)])


def test_a_recipe_files_option_pairs_naming_one_twice_are_refused():
    d = preset("w8a8").to_dict()
    d["rules"][0]["input"]["options"] = [["averaging_constant", 0.1],
                                         ["averaging_constant", 0.5]]
    with pytest.raises(ValueError, match=r"Recipe.rules\[0\].input: .*averaging_constant"):
        Recipe.from_dict(d)
