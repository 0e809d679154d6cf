"""The in-place min / max paths of runs along an axis before the memory's last
(``stats.minmax_layouts.layout_minmax``: a transposed weight's groups and blocks) write into
the memory an observer reuses (``_minmax_out``), as ``unit_minmax`` does on the units path:
NVFP4 blocks of a 4096 x 4096 ``w.t()`` had faulted in 8 MB of fresh pages a call (twice the
contiguous weight's, where every allocation of a MiB or more is mmapped, as calibration sets
glibc), 1.5x the contiguous weight's step time."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import Block, Group, QuantSpec
from quantscope.observers import base
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


@pytest.mark.parametrize("layout", [Block(16), Group(64)], ids=str)
def test_layout_minmax_writes_into_out_where_it_fits(layout):
    w = torch.randn(512, 384)  # w.t(): runs along its memory's rows
    count = layout.num_units(w.t().shape)
    out, asked = (torch.empty(count), torch.empty(count)), []
    lo, hi = minmax_layouts.layout_minmax(w.t(), layout, lambda n: asked.append(n) or out)
    assert asked == [count]
    assert lo.data_ptr() == out[0].data_ptr() and hi.data_ptr() == out[1].data_ptr()
    units = layout.to_units(w.t())
    assert torch.equal(lo, units.amin(1)) and torch.equal(hi, units.amax(1))
    wrong = (torch.empty(count + 1), torch.empty(count + 1))  # not the units' count: new ones
    again = minmax_layouts.layout_minmax(w.t(), layout, lambda n: wrong)
    assert again[0].data_ptr() != wrong[0].data_ptr() and torch.equal(again[0], lo)


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
def test_an_observer_reuses_its_memory_on_a_transposed_weights_blocks(name, monkeypatch):
    """The memoryless state is written in place call after call; an accumulating observer's
    scratch takes the call's ranges. Either way the units path's state, bit for bit."""
    spec = QuantSpec("fp4_e2m1", Block(16))
    ws = [torch.randn(512, 384, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    real, found = minmax_layouts.layout_minmax, []

    def spy(x, layout, out_for=None):
        got = real(x, layout, out_for)
        found.append(got[0].data_ptr())
        return got
    monkeypatch.setattr(base, "layout_minmax", spy)
    got = quantscope.get_observer(name, spec)
    for w in ws:
        before = got.min_vals.data_ptr()  # (the state the call before left: alive while
        got(w.t())  # the call allocates, so a new tensor cannot take its address)
        mine = got.min_vals if name == "memoryless_minmax" else got._scratch[0]
        assert found[-1] == mine.data_ptr()
        if name == "memoryless_minmax" and w is not ws[0]:
            assert got.min_vals.data_ptr() == before
    monkeypatch.setattr(base, "layout_minmax", lambda *args: None)  # the units path
    want = quantscope.get_observer(name, spec)
    for w in ws:
        want(w.t())
    assert torch.equal(got.min_vals, want.min_vals) and torch.equal(got.max_vals, want.max_vals)
