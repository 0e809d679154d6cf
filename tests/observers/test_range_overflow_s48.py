"""A moving average that overflowed float32 stays named as the cause after later batches
(s48 docs probe): its next update makes NaN of the infinite average (``inf - inf``), and the
error had become the generic "lo and hi must be finite (got NaN or inf)", naming no observer
and blaming the input, which observers.md says it does not."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec

BIG = 2e38  # finite; an average of -BIG and +BIG batches overflows the update s + c (b - s)


@pytest.mark.parametrize("name", ["minmax", "mse"])
@pytest.mark.parametrize("numel", [4, 1 << 17], ids=["torch", "kernel"])
@pytest.mark.parametrize("later", [0, 1, 3])
def test_an_overflowed_average_is_named_after_later_batches(name, numel, later):
    o = quantscope.get_observer(name, QuantSpec("int8"))
    for v in [-BIG, BIG] + [1.0] * later:
        o(torch.full((numel,), v))
    assert not bool(o.seen_non_finite)
    with pytest.raises(ValueError, match=r"its moving average of finite ranges overflowed") \
            as e:
        o.calculate_qparams()
    assert o.describe() in str(e.value)
    assert ("inf - inf" in str(e.value)) == bool(later)
    assert bool(torch.isnan(o.min_vals).any()) == bool(later)  # the state it read
