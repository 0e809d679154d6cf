"""The in-place min-max kernels' output memory (review s49): one rule for the caller's
``out_for(U)`` tensors (taken where a kernel can write them, else new buffers) and for
their version counters, bumped only where the kernel wrote them. ``_padded_rows`` asked for
and bumped the caller's tensors even for a block its kernel refuses (longer than 2048), which
then wrote nothing: a tensor saved for backward would have raised "modified by an inplace
operation" though no value changed."""

from __future__ import annotations

import pytest
import torch

from quantscope import Block, kernels
from quantscope.stats import minmax_layouts
from quantscope.stats.minmax import _kernel

needs_kernel = pytest.mark.skipif(_kernel() is None, reason="no compiled kernel")


@needs_kernel
def test_a_block_the_padded_kernel_refuses_leaves_the_callers_tensors_alone():
    x = torch.randn(30, 4100)
    out = torch.zeros(60), torch.zeros(60)
    asked = []

    def out_for(n):
        asked.append(n)
        return out

    assert minmax_layouts.layout_minmax(x, Block(4096), out_for) is None  # units built
    assert [t._version for t in out] == [0, 0] and not asked
    assert not any(t.any() for t in out)


@needs_kernel
def test_a_block_it_takes_is_written_into_the_callers_tensors_and_bumped():
    x = torch.randn(40, 2050)  # (past KERNEL_MIN_NUMEL: the kernel reads it)
    out = torch.zeros(80), torch.zeros(80)
    lo, hi = minmax_layouts.layout_minmax(x, Block(2048), lambda n: out)
    assert lo is out[0] and hi is out[1] and [t._version for t in out] == [1, 1]
    units = Block(2048).to_units(x)
    torch.testing.assert_close(lo, torch.cat((units[::2].amin(1)[:, None],
                                              x[:, 2048:].amin(1)[:, None]), 1).view(-1))


@pytest.mark.parametrize("bad", [
    lambda n: (torch.zeros(n, dtype=torch.float64), torch.zeros(n)),
    lambda n: (torch.zeros(n + 1), torch.zeros(n)),
    lambda n: (torch.zeros(2 * n)[::2], torch.zeros(n)),
    lambda n: None,
], ids=["float64", "shape", "strided", "none"])
def test_out_buffers_takes_the_callers_tensors_only_where_a_kernel_can_write_them(bad):
    good = torch.zeros(5), torch.zeros(5)
    assert kernels.out_buffers(5, lambda n: good) is good
    fresh = kernels.out_buffers(5, bad)
    theirs = bad(5) or ()
    assert all(t.shape == (5,) and t.dtype == torch.float32 for t in fresh)
    assert not any(f is t for f in fresh for t in theirs)
    assert all(t.shape == (5,) for t in kernels.out_buffers(5))


@pytest.mark.parametrize("failed, result, bumped", [(0, True, True), (-1, False, False),
                                                    (-2, False, True)])
def test_wrote_bumps_the_versions_where_the_kernel_wrote(failed, result, bumped):
    out = torch.zeros(3), torch.zeros(3)
    assert (kernels.wrote(out, failed) is out) == result
    assert [t._version for t in out] == [int(bumped)] * 2
