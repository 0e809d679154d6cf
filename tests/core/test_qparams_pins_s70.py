"""Pins from session 70's mutation round of quantscope.qparams: behaviour that a mutant broke
while every test covering the module passed. The torch branch (scale encodings with no C
kernel) widens a range to include zero at both ends; NVFP4 ranges with no units take the
global scale of amax 0 (1, per ``nvfp4_global_scale``); a ``shape`` of another count is refused
whatever the branch; off the CPU (meta here) a host ``global_amax`` is moved to the ranges'
device. Expected values come from the module's docstrings, not from a run."""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec, presets
from quantscope.qparams import qparams_from_range


@pytest.mark.parametrize("scale", ["bf16", "fp16", "pow2"])
@pytest.mark.parametrize(("lo", "hi", "widened"), [(1.0, 3.0, (0.0, 3.0)),
                                                   (-3.0, -1.0, (-3.0, 0.0))])
def test_torch_branch_widens_a_range_to_include_zero(scale, lo, hi, widened):
    """"The range is first widened to include zero": ``[lo, hi]`` on one side of zero gives
    the qparams of its widening, for encodings the C kernel leaves to the torch branch."""
    spec = QuantSpec("int8", symmetric=False, scale=scale)
    got = qparams_from_range(torch.tensor([lo]), torch.tensor([hi]), spec)
    want = qparams_from_range(torch.tensor([widened[0]]), torch.tensor([widened[1]]), spec)
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.zero_point, want.zero_point)


def test_nvfp4_with_no_units_takes_the_global_scale_of_amax_zero():
    """No units (the torch branch): the default global amax is 0, whose global scale is 1."""
    e = torch.empty(0)
    q = qparams_from_range(e, e, presets.NVFP4, check_finite=False)
    assert q.scale.shape == (0,) and q.zero_point.shape == (0,)
    assert q.global_scale.tolist() == [1.0]


@pytest.mark.parametrize("check_finite", [True, False])
def test_a_shape_of_another_count_is_refused(check_finite):
    """``shape`` is a reshape of the results: one with more values than the ranges raises
    (the C kernel must not make its results in it)."""
    with pytest.raises(RuntimeError, match="invalid for input of size 4"):
        qparams_from_range(torch.zeros(4), torch.ones(4), QuantSpec("int8"), shape=(8,),
                           check_finite=check_finite)


def test_meta_nvfp4_ranges_take_a_host_global_amax():
    """Off the CPU the global amax given on the host is moved to the ranges' device."""
    m = torch.zeros(4, device="meta")
    q = qparams_from_range(m - 1, m + 1, presets.NVFP4, global_amax=torch.tensor(2.0),
                           check_finite=False)
    assert q.scale.device.type == "meta" and q.scale.shape == (4,)
    assert q.global_scale.device.type == "meta" and q.global_scale.shape == (1,)
