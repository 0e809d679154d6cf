"""Mutation round s47 on ``stats.minmax.range_overflow`` and the observers'
``overflow_cause``: a range holding NaN (a state written into) is never called an overflow,
on a per-channel state where only some units hold NaN too; the causes named are the
observer's own (no compat ``expand`` blamed on a native search, every cause of a compat
moving average named)."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec


def _fed(name, spec, *batches, **kw):
    o = quantscope.get_observer(name, spec, **kw)
    for b in batches:
        o(b)
    return o


@pytest.mark.parametrize("where", ["all", "one"])
def test_a_state_holding_nan_is_no_overflow(where):
    # finite input, the flag clear; then NaN written into the state (one unit, or every one)
    # of an observer that keeps no average (an average's NaN: test_range_overflow_s48.py)
    o = _fed("static_minmax", QuantSpec("int8", "channel:0"), torch.randn(4, 16))
    with torch.no_grad():
        if where == "all":
            o.min_vals.fill_(float("nan"))
        else:
            o.min_vals[1] = float("nan")
            o.max_vals[2] = float("inf")  # one end past float32 too: NaN still decides
    assert not bool(o.seen_non_finite)
    with pytest.raises(ValueError) as e:
        o.calculate_qparams()
    assert "overflowed" not in str(e.value) and "not finite though" not in str(e.value)


def test_native_search_with_expand_does_not_blame_expand():
    # a native search never picks a candidate past float32: the moving average overflows
    o = _fed("mse", QuantSpec("int8"), torch.full((4, 8), -2.0e38), torch.full((4, 8), 2.0e38),
             expand=1.5)
    with pytest.raises(ValueError, match="moving average") as e:
        o.calculate_qparams()
    assert "expand" not in str(e.value)


@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
def test_compat_search_without_expand_does_not_blame_expand(name):
    """``overflow_cause`` names compat's ``expand`` only where it widens the search
    (``expand != 1``): llm-compressor's search from the observed range itself (the default)
    picks no candidate past it, so a compat moving average names its update alone and a
    memoryless one no cause of its own."""
    o = _fed(name, QuantSpec("int8"), torch.randn(4, 8), compat="llmcompressor")
    assert o.options["expand"] == 1
    assert "expand" not in o.overflow_cause


def test_compat_moving_average_with_expand_names_both_causes():
    w = torch.tensor([[3.0e38, -1.0, 2.0, 0.5] * 8])
    o = _fed("mse", QuantSpec("int8"), w, expand=1.5, compat="llmcompressor")
    with pytest.raises(ValueError) as e:
        o.calculate_qparams()
    msg = str(e.value)
    assert "expand=1.5 takes the observed range past" in msg and "moving average" in msg
