"""NaN in a moving average's range with its non-finite flag clear has two causes its state
cannot tell apart: an average that overflowed to inf becomes NaN at the next batch's update
(inf - inf), or NaN was written into the state (a damaged checkpoint loaded). The error names
both and the observer (review s49: it blamed the overflow alone, for a loaded NaN too)."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec

WRITTEN = r"or NaN was written into its state \(load_state_dict"
OVERFLOW = r"its moving average of finite ranges overflowed float32"


def _loaded_with_nan(name):
    src = quantscope.get_observer(name, QuantSpec("int8", "channel:0"))
    src(torch.randn(4, 8))
    state = src.state_dict()
    state["min_vals"] = state["min_vals"].clone()
    state["min_vals"][1] = float("nan")  # a damaged checkpoint
    o = quantscope.get_observer(name, QuantSpec("int8", "channel:0"))
    o.load_state_dict(state)
    assert not bool(o.seen_non_finite)
    return o


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_a_loaded_nan_is_not_blamed_on_an_overflow_alone(name):
    o = _loaded_with_nan(name)
    with pytest.raises(ValueError, match=WRITTEN) as e:
        o.calculate_qparams()
    assert o.describe() in str(e.value)
    assert "holds NaN" in str(e.value) and "|x| near float32's max" not in str(e.value)
    assert "(inf - inf)" in str(e.value)  # the other cause, which it cannot rule out


def test_an_overflow_turned_nan_names_both_causes_and_an_infinite_one_only_the_overflow():
    o = quantscope.get_observer("minmax", QuantSpec("int8"))
    for v in (-2e38, 2e38):
        o(torch.full((4,), v))
    with pytest.raises(ValueError, match=OVERFLOW) as e:
        o.calculate_qparams()
    assert "written into" not in str(e.value)  # inf: the state was not NaN
    o(torch.ones(4))  # inf - inf
    with pytest.raises(ValueError, match=OVERFLOW + r".*inf - inf.*" + WRITTEN):
        o.calculate_qparams()


def test_the_same_state_in_a_static_observer_keeps_the_generic_error():
    o = _loaded_with_nan("static_minmax")
    with pytest.raises(ValueError, match="lo and hi must be finite"):
        o.calculate_qparams()
