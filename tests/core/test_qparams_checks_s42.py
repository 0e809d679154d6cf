"""``qparams_from_range``'s check of the ranges off the C kernels (the CUDA path: one read of
the spans' min and max, the full checks only where that fails), case by case against what
the full checks say."""

import math

import pytest
import torch

from quantscope import QuantSpec, presets, qparams, qparams_from_range
from quantscope._checks import check_ranges
from quantscope.layout import Channel


def _check_finite(lo, hi, global_amax):
    check_ranges("qparams_from_range", lo, hi, global_amax)


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
    if error is not None:  # the C kernels refuse it themselves (then nothing checks after)
        for spec in KERNEL_SPECS:
            with pytest.raises(ValueError, match=error):
                qparams_from_range(lo, hi, spec)


#: one spec per C qparams entry point: the integer branch, E8M0 (MX) and NVFP4's fp8 scales
KERNEL_SPECS = [QuantSpec("int8", Channel(0)), presets.MXFP4, presets.NVFP4]


@pytest.mark.parametrize("spec, global_amax", [
    (KERNEL_SPECS[0], None), (KERNEL_SPECS[1], None),
    (KERNEL_SPECS[2], None),  # its global amax first (qs_block_amax_max)
    (KERNEL_SPECS[2], 1.5),  # given: the scales' own pass refuses it
], ids=["int", "e8m0", "nvfp4", "nvfp4-global"])
@pytest.mark.parametrize("at", [0, 7, 8, 15, 18])  # AVX2 lanes of both blocks, the tail
@pytest.mark.parametrize("bad, error", [((2.0, 1.0), ORDER), ((math.nan, 1.0), FINITE),
                                        ((0.0, math.inf), FINITE)], ids=["order", "nan", "inf"])
def test_the_c_kernels_refuse_each_unit_the_checks_refuse(spec, global_amax, at, bad, error):
    """qparams_from_range checks nothing after a C kernel that computed: the kernel itself
    refuses a unit out of order or not finite, wherever it lies in its vector loop."""
    lo, hi = -torch.rand(19) - 0.5, torch.rand(19) + 0.5
    lo[at], hi[at] = bad
    ga = None if global_amax is None else torch.tensor(global_amax)
    with pytest.raises(ValueError, match=error):
        qparams_from_range(lo, hi, spec, global_amax=ga)


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


def _torch_branch(monkeypatch, fn):
    """``fn()`` with no C kernel (qparams_from_range's torch branch)."""
    from quantscope import kernels

    with monkeypatch.context() as m:
        m.setattr(kernels, "lib", lambda *a, **k: None)
        return fn()


def _spied(monkeypatch):
    """Records check_ranges' read of the ranges and the torch branches' calls."""
    from quantscope import _checks, qparams

    seen = []
    for owner, name in ((_checks, "_spans_ok"), (qparams, "_scale_qparams"),
                        (qparams, "_block_qparams")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _n=name, _f=real, **k: seen.append(_n)
                            or _f(*a, **k))
    return seen


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=["int", "e8m0", "nvfp4"])
def test_a_checked_kernel_call_reads_nothing_after_the_kernel(spec, monkeypatch):
    """The performance contract of the C kernels' own range test ("after the C kernels, which
    test NaN / inf and lo > hi in their pass", qparams.py): a checked call over ordered
    ranges, some with lo == hi (an all-zero channel or block: in order), in both AVX2 blocks
    and the tail, runs no check_ranges read and no torch branch after the kernel; an
    unchecked call of KERNEL_MIN_UNITS units or more with reversed units takes the kernel's
    values (the torch branch's, bitwise). Pins C02 (lo >= hi flagged), C07 (the integer
    kernel returning 1 for a reversed unit), C08 / C09 (the AVX2 compare's operands swapped)
    and P08 (check_ranges reading the ranges after a kernel that took them)."""
    seen = _spied(monkeypatch)
    lo, hi = -torch.rand(19) - 0.5, torch.rand(19) + 0.5
    for at, v in ((3, 0.0), (9, -0.25), (17, 0.25)):  # a lane of each AVX2 block, the tail
        lo[at] = hi[at] = v
    qp = qparams_from_range(lo, hi, spec)
    assert seen == []
    assert torch.equal(qp.scale, _torch_branch(monkeypatch, lambda: qparams_from_range(
        lo, hi, spec)).scale)
    del seen[:]  # (the torch branch's own calls)
    n = qparams.KERNEL_MIN_UNITS + 3
    lo, hi = -torch.rand(n) - 0.5, torch.rand(n) + 0.5
    (lo[2], hi[2]), (lo[n - 1], hi[n - 1]) = (1.0, 0.5), (0.75, -0.25)  # a lane, the tail
    qp = qparams_from_range(lo, hi, spec, check_finite=False)
    assert seen == []
    want = _torch_branch(monkeypatch, lambda: qparams_from_range(lo, hi, spec,
                                                                 check_finite=False))
    assert torch.equal(qp.scale, want.scale) and torch.equal(qp.zero_point, want.zero_point)


@pytest.mark.parametrize("spec", KERNEL_SPECS[1:], ids=["e8m0", "nvfp4"])
@pytest.mark.parametrize("bad", [(math.nan, 1.0), (-math.inf, 1.0)], ids=["nan", "inf"])
def test_an_unchecked_call_with_a_bad_unit_and_a_reversed_one_is_the_torch_branch(
        spec, bad, monkeypatch):
    """A block kernel's pass over a NaN / inf unit and a reversed one reports the non-finite
    unit (qs_range_result: "1 (not finite) outranks 2"), whose scales it wrote "but
    meaningless": an unchecked call (check_finite=False: forward, run-time quantization)
    of KERNEL_MIN_UNITS units or more then runs the torch branch, NaN and all (pins C04: 2
    outranking 1, MXFP4's NaN unit then given a scale of 5e30)."""
    n = qparams.KERNEL_MIN_UNITS + 3
    for at in (9, n - 1):  # the bad unit in a vector lane, in the tail
        lo, hi = -torch.rand(n) - 0.5, torch.rand(n) + 0.5
        lo[5], hi[5] = 1.0, 0.5
        lo[at], hi[at] = bad
        got = qparams_from_range(lo, hi, spec, check_finite=False)
        want = _torch_branch(monkeypatch, lambda: qparams_from_range(lo, hi, spec,  # noqa: B023
                                                                     check_finite=False))
        assert torch.equal(got.scale.nan_to_num(-1.0), want.scale.nan_to_num(-1.0)), at
        assert (got.global_scale is None) == (want.global_scale is None)
        if want.global_scale is not None:
            assert torch.equal(got.global_scale.nan_to_num(-1.0),
                               want.global_scale.nan_to_num(-1.0))
