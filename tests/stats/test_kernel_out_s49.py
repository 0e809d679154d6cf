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


@pytest.mark.parametrize("make", [
    lambda n: (torch.zeros(n, dtype=torch.float64), torch.zeros(n)),
    lambda n: (torch.zeros(n + 1), torch.zeros(n)),
    lambda n: (torch.zeros(2 * n)[::2], torch.zeros(n)),
    lambda n: (torch.zeros(n), torch.zeros(2 * n)[::2]),
    lambda n: None,
], ids=["float64", "shape", "strided", "strided second", "none"])
def test_out_buffers_takes_the_callers_tensors_only_where_a_kernel_can_write_them(make):
    """The caller's pair is taken where a kernel can write it as ``n`` contiguous float32s,
    else two new buffers: checked by identity against the very tensors the caller gave (s50's
    K09: a second call of the factory made new tensors, so a strided pair taken passed)."""
    good = torch.zeros(5), torch.zeros(5)
    assert kernels.out_buffers(5, lambda n: good) is good
    theirs = make(5)
    fresh = kernels.out_buffers(5, lambda n: theirs)
    assert all(t.shape == (5,) and t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu
               for t in fresh)
    assert not any(f is t for f in fresh for t in theirs or ())
    assert all(t.shape == (5,) for t in kernels.out_buffers(5))


@needs_kernel
def test_a_strided_pair_from_the_caller_is_not_written_as_contiguous_memory():
    """A kernel writes its out pair as ``n`` contiguous float32s: a strided ``[n]`` view taken
    as it is would get the values in the wrong places and its storage's gaps overwritten."""
    x = torch.randn(40, 2050)
    storage = torch.zeros(160)
    lo, hi = minmax_layouts.layout_minmax(x, Block(2048), lambda n: (storage[::2], storage[1::2]))
    want = minmax_layouts.layout_minmax(x, Block(2048))
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])
    assert not storage.any()  # the caller's memory is not written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_out_buffers_refuses_a_callers_cuda_pair():
    """The kernels write host memory: a CUDA pair (an observer's state on the GPU) is never
    handed to them, however contiguous (s50's K08, not reachable without a device)."""
    theirs = torch.zeros(5, device="cuda"), torch.zeros(5, device="cuda")
    fresh = kernels.out_buffers(5, lambda n: theirs)
    assert all(t.is_cpu and t.shape == (5,) and t.dtype == torch.float32 for t in fresh)
    assert not any(f is t for f in fresh for t in theirs)


@pytest.mark.parametrize("failed, result, bumped", [(0, True, True), (-1, False, False),
                                                    (-2, False, True)])
def test_wrote_bumps_the_versions_where_the_kernel_wrote(failed, result, bumped):
    out = torch.zeros(3), torch.zeros(3)
    assert (kernels.wrote(out, failed) is out) == result
    assert [t._version for t in out] == [int(bumped)] * 2
