"""The ranks' recipe comparison of ``calibrate`` (``check_same_options``), probe s60: a tensor
option (``imatrix_mse``'s importance) was compared by its repr, which rounds its values and
elides the middle of a large one, so ranks giving different importances each went on with
their own; and a rank giving ``options={}`` was said to lack the option another rank gave.
Pinned by mutation (s61): tensors of one fingerprint but different shapes (all zeros) differ,
and so do the same recipes given in another order (the order is the one the ranks exchange
in). One spawn of 2 gloo processes, each case's outcome on both ranks."""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule
from quantscope.calibration.options import Options
from quantscope.layout import Channel

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
END = ("; every rank of a distributed calibration must give the same options (they decide "
       "its exchanges and its result)")


def _imatrix(importance, percentile=None) -> Recipe:
    rules = [Rule(("Linear",), weight=Role(QuantSpec("int4", Channel(0)), "imatrix_mse",
                                           options={"importance": importance}))]
    if percentile is not None:
        rules.append(Rule(("Conv2d",), input=Role(QuantSpec(), "percentile",
                                                  options={"percentile": percentile})))
    return Recipe(rules, name="r")


def _percentile(options) -> Recipe:
    return Recipe([Rule(("Linear",), input=Role(QuantSpec(), "percentile", options=options))],
                  name="r")


def _cases(r: int) -> dict:
    small = torch.full((8,), 1.5)
    large = torch.ones(2048)
    if r:
        small[3] = 1.50001  # both print 1.5000
        large[1000:1010] = 1e4  # in the middle a repr elides
    return {
        "small": _imatrix(small),
        "large": _imatrix(large),
        "same_tensor": _imatrix(torch.arange(4.0), 99.0),
        "tensor_then_percentile": _imatrix(torch.arange(4.0), 99.0 if r == 0 else 99.9),
        "extra_rule": _imatrix(torch.arange(4.0), None if r == 0 else 99.0),
        "none_on_one": _percentile({"percentile": 99.0} if r == 0 else
                                   {"percentile": 99.0, "averaging_constant": None}),
        "empty_against_one": _percentile({} if r == 0 else {"percentile": 99.0}),
        # all zeros: one fingerprint whatever the length, so only the shape tells them apart
        "zeros_by_length": _imatrix(torch.zeros(4 if r == 0 else 8)),
    }


def _in_order(r: int) -> dict:
    """Two recipes by label, in the opposite order on rank 1."""
    recipes = [("a", _percentile({"percentile": 99.0})), ("b", _imatrix(torch.arange(4.0)))]
    return dict(recipes if r == 0 else recipes[::-1])


def _scenarios(r, out):
    from quantscope.calibration.run.gather import check_same_options

    for name, recipe in _cases(r).items():
        out[name] = error_text(check_same_options, Options(), None, {"r": recipe})
    out["reordered"] = error_text(check_same_options, Options(), None, _in_order(r))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _said(ranks, name) -> str:
    got = rank_results(ranks, name)
    assert got[0] == got[1], got
    assert got[0] is not None, f"{name}: the ranks' different recipes passed"
    return got[0]


@pytest.mark.parametrize("name", ["small", "large"])
def test_a_tensor_option_is_compared_by_its_values_not_its_repr(ranks, name):
    from quantscope.calibration.run.gather import _canonical

    said = _said(ranks, name)
    fps = [_canonical(dict(_cases(r)[name].rules[0].weight.options)["importance"])[2]
           for r in (0, 1)]
    n = 8 if name == "small" else 2048
    assert said == (f"ValueError: calibrate: the ranks give different options: recipe 'r': "
                    f"rules[0].weight.options.importance is a tensor [{n}] of fingerprint "
                    f"{fps[0]} on rank 0, a tensor [{n}] of fingerprint {fps[1]} on rank 1"
                    + END), said


def test_equal_tensor_options_pass(ranks):
    assert rank_results(ranks, "same_tensor") == [None, None]


@pytest.mark.parametrize(("name", "field", "values"), [
    ("tensor_then_percentile", "rules[1].input.options.percentile", ("99.0", "99.9")),
    ("extra_rule", "rules[1].targets", ("absent", "['Conv2d']")),
    ("none_on_one", "rules[0].input.options.averaging_constant", ("absent", "None")),
    ("empty_against_one", "rules[0].input.options.percentile", ("absent", "99.0")),
])
def test_the_first_field_that_differs_is_named_with_each_ranks_value(ranks, name, field,
                                                                    values):
    assert _said(ranks, name) == (f"ValueError: calibrate: the ranks give different options: "
                                  f"recipe 'r': {field} is {values[0]} on rank 0, {values[1]} "
                                  f"on rank 1" + END)


def test_zero_tensors_of_one_fingerprint_but_other_shapes_differ(ranks):
    """zeros(4) and zeros(8) hash alike; the shape is part of what is compared (an importance
    of another length is another option), and both are named."""
    from quantscope.calibration.run.gather import _canonical

    ts = [dict(_cases(r)["zeros_by_length"].rules[0].weight.options)["importance"]
          for r in (0, 1)]
    fps = [_canonical(t)[2] for t in ts]
    assert fps[0] == fps[1]  # the premise: the fingerprint alone cannot tell them apart
    assert _said(ranks, "zeros_by_length") == (
        f"ValueError: calibrate: the ranks give different options: recipe 'r': "
        f"rules[0].weight.options.importance is a tensor {list(ts[0].shape)} of fingerprint "
        f"{fps[0]} on rank 0, a tensor {list(ts[1].shape)} of fingerprint {fps[1]} on rank 1"
        + END)


def test_the_same_recipes_in_another_order_differ(ranks):
    """The ranks exchange per recipe in the order given: one rank's first recipe against
    another's second would pair unrelated exchanges, so the order is compared too."""
    orders = [tuple(_in_order(r)) for r in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]  # the premise
    assert _said(ranks, "reordered") == (
        f"ValueError: calibrate: the ranks give different options: the recipe (by label) is "
        f"{orders[0]} on rank 0, {orders[1]} on rank 1" + END)
