"""The ranks' recipe comparison of ``calibrate`` (``check_same_options``), probe s60: a tensor
option (``imatrix_mse``'s importance) was compared by its repr, which rounds its values and
elides the middle of a large one, so ranks giving different importances each went on with
their own; and a rank giving ``options={}`` was said to lack the option another rank gave.
One spawn of 2 gloo processes, each case's outcome on both ranks."""

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
    }


def _scenarios(r, out):
    from quantscope.calibration.run.gather import check_same_options

    for name, recipe in _cases(r).items():
        out[name] = error_text(check_same_options, Options(), None, {"r": recipe})


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
