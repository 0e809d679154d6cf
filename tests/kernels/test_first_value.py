"""kernels.first_value: a CPU tensor's first value read from its memory, or None where torch
must read it (the ModelOpt grid's and its cached step's one-value reads)."""

import pytest
import torch

from quantscope import kernels


@pytest.mark.parametrize("t, dtype, want", [
    (torch.tensor([2.5, 7.0]), torch.float32, 2.5),
    (torch.tensor([-3]), torch.int64, -3),
    (torch.tensor([True]), torch.bool, True),
    (torch.tensor([7.0, 2.5])[1:], torch.float32, 2.5),  # an offset view: its own first
])
def test_reads_the_first_value(t, dtype, want):
    assert kernels.first_value(t, dtype) == want


@pytest.mark.parametrize("t, dtype", [
    (torch.tensor([1.0]), torch.int64),  # another dtype
    (torch.tensor([1.0], dtype=torch.float64), torch.float32),
    (torch.empty(0), torch.float32),
    (torch.arange(6.0).reshape(2, 3).t(), torch.float32),  # not contiguous
    (torch.empty(1, device="meta"), torch.float32),
    (torch.tensor([1.0])._neg_view(), torch.float32),  # its memory holds -1
])
def test_none_where_torch_must_read_it(t, dtype):
    assert kernels.first_value(t, dtype) is None
