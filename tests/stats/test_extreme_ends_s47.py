"""``stats.minmax.extreme_ends``: the non-finite check's two values from the per-unit ``lo`` /
``hi`` of the paths that do not find them in their pass (``layout_minmax``: a transposed
weight, tiles, channels), read where they lie. A cat of both had been a copy of them, in fresh
memory: on NVFP4 blocks of a 4096 x 4096 ``w.t()`` (2 x 1M units) 3.7 ms of the observer's 12,
where the contiguous weight's whole step takes 6."""

from __future__ import annotations

import math

import pytest
import torch
from op_names import Copies

from quantscope.stats import minmax as stats


def want(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The smallest and the largest of ``lo`` and ``hi`` together (finite or inf)."""
    both = torch.cat((lo.reshape(-1), hi.reshape(-1))).double()
    return torch.stack((both.min(), both.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (3,), (1000,), (4, 250)])
def test_extreme_ends_reads_lo_and_hi_where_they_lie(dtype, shape):
    """Many units: no op makes a tensor of their count (one unit: a cat of its two values)."""
    g = torch.Generator().manual_seed(0)
    lo = torch.randn(shape, generator=g).to(dtype)  # each unit's ends in order, as callers'
    hi = lo + torch.rand(shape, generator=g).to(dtype)
    with Copies(lo) as copies:
        ends = stats.extreme_ends(lo, hi)
    assert copies.found == ([] if lo.numel() > 1 else ["aten.cat"])
    assert ends.shape == (2,) and ends.dtype == dtype
    assert torch.equal(ends.double(), want(lo, hi))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["lo", "hi"])
def test_extreme_ends_keeps_a_non_finite_value_of_either(bad, where):
    """NaN in ``lo`` or in ``hi`` makes both ends NaN; an inf (a ``lo`` of +inf too: a caller's
    ``lo > hi``) reaches the end it bounds."""
    lo, hi = -torch.rand(300) - 1, torch.rand(300) + 1
    (lo if where == "lo" else hi)[123] = bad
    ends = stats.extreme_ends(lo, hi)
    if math.isnan(bad):
        assert bool(ends.isnan().all())
    else:
        assert torch.equal(ends.double(), want(lo, hi))
    assert bool(stats.any_non_finite(ends))
