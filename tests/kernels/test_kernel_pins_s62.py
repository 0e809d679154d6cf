"""Pins from the s62 mutation round of the kernel layer (src/quantscope/kernels/): each test
kills one mutant the existing tests let through, on a contract the kernels' helpers document
(checked against the docstring's rule, never against printed output)."""

import pytest
import torch

from quantscope import kernels


@pytest.mark.parametrize("shape", [(1, 5), (5, 1)])
def test_out_buffers_takes_only_a_flat_pair_not_other_shapes_of_n_values(shape):
    """``out_buffers(n, out_for)`` hands back "two ``[n]`` float32 tensors": a caller's
    contiguous ``[1, n]`` or ``[n, 1]`` pair holds ``n`` float32s too, but taken as it is the
    kernel's result would come back in the caller's shape (s62 mutant K9: ``flat_f32`` tested
    ``numel() == n`` instead of ``shape == (n,)``)."""
    theirs = torch.zeros(shape), torch.zeros(5)
    lo, hi = kernels.out_buffers(5, lambda n: theirs)
    assert lo is not theirs[0] and hi is not theirs[1]
    assert lo.shape == hi.shape == (5,)
    assert not kernels.flat_f32(5, theirs[0])


def test_threads_is_at_least_one_whatever_is_requested():
    """``threads(requested)`` is "at least 1": a request of 0 or below runs on one thread, the
    kernels' work splits never see 0 (s62 mutant K13: ``max(0, ...)`` passed 0 through)."""
    assert kernels.threads(0) == 1
    assert kernels.threads(-3) == 1
    assert kernels.threads(2) == 2
    assert kernels.threads() == max(1, torch.get_num_threads())
