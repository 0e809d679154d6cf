"""Pins found by a mutation round (s67) on ``run.batches``, called directly on tiny inputs:
``check_batches`` takes a sequence with ``[]`` only and hints ``unbind`` only for one tensor,
``length_checked`` checks a tuple's batches before any is read and returns the tuple itself,
``sized_like`` keeps a source's length of 0, and ``module_input`` reads the positional
argument before the keyword one."""

from __future__ import annotations

import pytest
import torch

from quantscope.calibration.run.batches import (
    check_batches,
    length_checked,
    module_input,
    sized_like,
)


class _Indexed:
    """A sequence with ``[]`` only (no ``__iter__``): iterable by the old protocol."""

    def __getitem__(self, i):
        if i >= 2:
            raise IndexError(i)
        return torch.ones(1, 2)


def test_check_batches_takes_a_sequence_with_getitem_only():
    check_batches(_Indexed())  # no raise
    with pytest.raises(TypeError, match="got object"):
        check_batches(object())


def test_check_batches_hints_unbind_only_for_one_tensor():
    with pytest.raises(TypeError) as one_dict:
        check_batches({"input_ids": torch.ones(1, 2)})
    assert "got one dict" in str(one_dict.value) and "unbind" not in str(one_dict.value)


def test_length_checked_checks_a_tuple_before_any_batch_is_read():
    ok, bad = torch.ones(2, 3), torch.zeros(2, 0)
    batches = (ok, ok)
    assert length_checked(batches) is batches
    with pytest.raises(ValueError, match="batch 1's"):
        length_checked((ok, bad))  # at once, not when iterated


def test_sized_like_keeps_a_length_of_zero():
    assert len(sized_like(iter(()), [])) == 0
    it = iter(())
    assert sized_like(it, (x for x in ())) is it  # a source without a length: as it is


def test_module_input_reads_the_positional_argument_before_the_keyword():
    a, b = torch.ones(1), torch.zeros(1)
    assert module_input((a,), {"x": b}, "x") is a
    assert module_input((), {"y": b}, "x") is None
