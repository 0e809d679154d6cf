"""tests/tiers.py: make test runs every value of every axis, make test-extended the rest."""

import itertools

import pytest
import torch
from tiers import each_value


def _split(params):
    fast = [p.values for p in params if not p.marks]
    extended = [p.values for p in params if p.marks]
    assert all(m.name == "extended" for p in params for m in p.marks)
    return fast, extended


@pytest.mark.parametrize("sizes", [(1,), (3,), (2, 2), (5, 4, 2), (2, 6), (3, 1, 4)])
def test_every_value_runs_in_make_test_and_the_product_in_both(sizes):
    axes = [[f"a{n}v{i}" for i in range(size)] for n, size in enumerate(sizes)]
    fast, extended = _split(each_value(*axes))
    assert sorted(fast + extended) == sorted(itertools.product(*axes))  # each case once
    assert len(fast) == max(sizes)
    for n, axis in enumerate(axes):
        assert {values[n] for values in fast} == set(axis)


def test_a_tuple_value_fills_several_arguments_and_ids_name_the_values():
    params = each_value([None, 4], [("int8", "even"), ("int8_narrow", "floor")])
    assert [p.values for p in params][:2] == [(None, "int8", "even"), (None, "int8_narrow",
                                                                     "floor")]
    assert [p.id for p in params] == ["None-int8-even", "None-int8_narrow-floor",
                                      "4-int8-even", "4-int8_narrow-floor"]
    assert each_value([torch.bfloat16], [1.5])[0].id == "bfloat16-1.5"
    assert each_value([object()])[0].id is None  # pytest's own id for a value not plain
