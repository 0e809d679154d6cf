"""Mutation round s47 on ``smooth_ranges._reduce``: a mapping one rank ran on data that is
constant in every channel (range 0 throughout: lo == hi) is a mapping that ran, on every
rank, as one process given all the batches finds it; only the reduction's identities
(lo = +inf, hi = -inf: no rank ran it) mean "never ran". A test of ``b <= a`` instead of
``b < a`` dropped it on the ranks that had not run it, so the ranks smoothed differently.

One spawn of 2 gloo processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ports import rank_results, spawn_ranks

from quantscope.calibration.choice import smooth_ranges

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20


def _scenarios(r, out):
    maps = [SimpleNamespace(previous="const"), SimpleNamespace(previous="never")]
    lo, hi = {}, {}
    if r == 0:  # only rank 0 ran "const", on constant channels; no rank ran "never"
        lo["const"] = torch.full((4,), 1.5)
        hi["const"] = torch.full((4,), 1.5)
    smooth_ranges._reduce(maps, [4, 4], lo, hi, None, None, None)
    out["ranges"] = {k: (lo[k].tolist(), hi[k].tolist()) for k in sorted(lo)}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def test_constant_channels_on_one_rank_reach_every_rank(ranks):
    a, b = rank_results(ranks, "ranges")
    assert a == b == {"const": ([1.5] * 4, [1.5] * 4)}
