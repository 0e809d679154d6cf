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


def test_read_and_write_refuse_more_values_than_the_tensor_holds():
    """``read(t, count)`` / ``write(t, *values)`` go through ``t``'s memory: past its
    ``numel()`` they would read or write memory that is not ``t``'s (here its base's, so a
    mutant reads values of the base instead of raising), so they raise a ``ValueError``, or
    ``read`` returns None when not ``strict`` (s62 mutant K11: the length test dropped)."""
    base = torch.arange(4.0)
    t = base[:2]
    assert kernels.read(t, 2) == [0.0, 1.0]
    with pytest.raises(ValueError, match="at least 3 values"):
        kernels.read(t, 3)
    assert kernels.read(t, 3, strict=False) is None
    with pytest.raises(ValueError, match="at least 3 values"):
        kernels.write(t, 7.0, 8.0, 9.0)
    assert base.tolist() == [0.0, 1.0, 2.0, 3.0]  # nothing written, the base's memory included
