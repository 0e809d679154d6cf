"""``qparams_from_range``'s check of the ranges off the C kernels (the CUDA path: one read of
the spans' min and max, the full checks only where that fails), case by case against what
the full checks say."""

import math

import pytest
import torch

from quantscope._checks import check_ranges


def _check_finite(lo, hi, global_amax, finite=True):
    check_ranges("qparams_from_range", lo, hi, global_amax, finite)


TINY = 1.401298464324817e-45  # float32's smallest subnormal
FINITE = "lo and hi must be finite"
ORDER = "lo must be <= hi"


@pytest.mark.parametrize("lo, hi, error", [
    ([-1.0, 0.0, 2.0], [1.0, 0.0, 3.0], None),
    ([0.0], [-0.0], None),  # +0 <= -0: a range (its span -0 is not negative)
    ([-0.0, 5.0], [0.0, 5.0], None),  # equal ends
    ([-3e38], [3e38], None),  # finite ends whose span overflows float32: still a range
    ([TINY], [2 * TINY], None),
    ([1.5e-38], [1.4e-38], ORDER),  # normal ends a subnormal apart (see the flushed case)
    ([2 * TINY], [TINY], ORDER),  # distinct ends a subnormal apart: never a rounded zero
    ([-1.0, 2.0], [1.0, 1.0], ORDER),
    ([math.nan, 0.0], [1.0, 1.0], FINITE),
    ([0.0], [math.nan], FINITE),
    ([-math.inf], [1.0], FINITE),
    ([0.0], [math.inf], FINITE),
    ([math.inf], [math.inf], FINITE),
    ([-math.inf], [math.inf], FINITE),
    ([2.0, math.nan], [1.0, 1.0], FINITE),  # the finite check first, as before
])
def test_range_checks(lo, hi, error):
    lo, hi = torch.tensor(lo), torch.tensor(hi)
    if error is None:
        _check_finite(lo, hi, None)
    else:
        with pytest.raises(ValueError, match=error):
            _check_finite(lo, hi, None)
    # the C kernels' path (finite known): only the order is checked
    if error == ORDER:
        with pytest.raises(ValueError, match=ORDER):
            _check_finite(lo, hi, None, finite=False)


def test_no_units_is_a_range():
    _check_finite(torch.zeros(0), torch.zeros(0), None)


def test_a_valid_range_takes_one_read_and_three_ops():
    """The common case: the spans' min and max read back once (on CUDA each op is a launch
    and each read a wait for the device), not the eight ops of the full checks."""
    from op_names import OpNames

    lo, hi = -torch.rand(64), torch.rand(64)
    with OpNames() as seen:
        _check_finite(lo, hi, None)
    # (tolist's read is no dispatched op on the CPU)
    assert seen.names == {"aten.sub", "aten.aminmax", "aten.stack"}, seen.calls


def test_ends_a_subnormal_apart_are_refused_where_denormals_flush():
    """With denormals flushed to zero, ``hi - lo`` of ``lo > hi`` a subnormal apart is
    ``-0.0``: the one read must send it to the full checks, not pass it."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        lo, hi = torch.tensor([1.5e-38]), torch.tensor([1.4e-38])
        assert float(hi - lo) == 0.0
        with pytest.raises(ValueError, match=ORDER):
            _check_finite(lo, hi, None)
    finally:
        torch.set_flush_denormal(False)
