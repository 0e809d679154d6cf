"""``stats.minmax.unit_minmax`` with a state update (an observer's step), on the C kernel's path
and on torch's: the same values, and the same version counters moved on the tensors written,
as in-place torch ops move them (a tensor autograd saved that the C wrote without a bump
would give wrong gradients silently, not "modified by an inplace operation"). With ``ends``
too, the kernel keeps no per-unit pair: ``(None, None)``. Pins mutant SM03 of mutation round
s55 (the caller's out pair written by the C pass but its version left as it was)."""

from __future__ import annotations

import pytest
import torch

from quantscope.stats import minmax as stats

needs_kernel = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def _state(units):
    return torch.full((units.shape[0],), float("inf")), torch.full((units.shape[0],),
                                                                   float("-inf"))


@pytest.mark.parametrize("path", [pytest.param("kernel", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_update_into_the_callers_pair_bumps_what_it_wrote(monkeypatch, path, dtype):
    if path == "torch":
        monkeypatch.setattr(stats, "_kernel", lambda: None)
    units = torch.randn(64, 128).to(dtype)
    slo, shi = _state(units)
    out = torch.empty(64), torch.empty(64)
    before = [t._version for t in (*out, slo, shi)]
    lo, hi = stats.unit_minmax(units, out, None, ("min", 0.0, slo, shi))
    assert lo is out[0] and hi is out[1]  # (scratch after an update: only the state counts)
    assert torch.equal(slo, units.amin(1).float()) and torch.equal(shi, units.amax(1).float())
    after = [t._version for t in (*out, slo, shi)]
    assert all(a > b for a, b in zip(after, before)), (before, after)


@needs_kernel
def test_a_fused_update_with_ends_keeps_no_per_unit_pair():
    units = torch.randn(64, 128)
    slo, shi = _state(units)
    ends = torch.empty(2)
    v = [t._version for t in (slo, shi, ends)]
    assert stats.unit_minmax(units, None, ends, ("min", 0.0, slo, shi)) == (None, None)
    assert torch.equal(slo, units.amin(1)) and torch.equal(shi, units.amax(1))
    assert ends.tolist() == [float(units.min()), float(units.max())]
    assert slo._version > v[0] and shi._version > v[1]


@pytest.mark.parametrize("path", [pytest.param("kernel", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("update", [False, True], ids=["ends", "ends+update"])
def test_the_callers_ends_are_bumped_as_written(monkeypatch, path, update):
    """``ends`` is the caller's tensor, written on either path: torch's copy_ bumped it, the
    kernel's pass did not (as the histogram kernel's does)."""
    if path == "torch":
        monkeypatch.setattr(stats, "_kernel", lambda: None)
    units = torch.randn(64, 128)
    ends = torch.empty(2)
    v = ends._version
    stats.unit_minmax(units, None, ends, ("min", 0.0, *_state(units)) if update else None)
    assert ends.tolist() == [float(units.min()), float(units.max())]
    assert ends._version > v
