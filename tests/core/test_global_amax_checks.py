"""``check_ranges``' check of a ``global_amax`` (NVFP4's global scale comes from it): any
finite value >= 0, a Python number checked in float64.

An all-zero tensor's absolute maximum is 0, so a global amax of 0 is one (and passing it gives
the qparams of letting ``qparams_from_range`` compute it); a Python number is checked as the
float64 tensor of it (``is_amax``: the default float32 would overflow a large one to inf), so
1e39 passes as ``torch.tensor(1e39, dtype=torch.float64)`` does. A mutation round found no test
failing where 0 was refused or the number was checked in float32.
"""

import pytest
import torch

from quantscope import presets as P
from quantscope import qparams_from_range
from quantscope._checks import check_ranges

torch.set_num_threads(1)


def test_a_zero_global_amax_is_an_amax():
    lo = hi = torch.zeros(4)
    check_ranges("t", lo, hi, 0.0)
    check_ranges("t", lo, hi, torch.tensor(0.0))
    given = qparams_from_range(lo, hi, P.NVFP4, global_amax=0.0)
    computed = qparams_from_range(lo, hi, P.NVFP4)  # max(|lo|, |hi|) = 0
    assert torch.equal(given.scale, computed.scale)
    assert torch.equal(given.global_scale, computed.global_scale)
    with pytest.raises(ValueError, match="global_amax must be finite and >= 0"):
        check_ranges("t", lo, hi, -1e-30)


def test_a_number_global_amax_is_checked_as_its_float64_tensor():
    lo, hi = -torch.ones(4), torch.ones(4)
    check_ranges("t", lo, hi, 1e39)
    check_ranges("t", lo, hi, torch.tensor(1e39, dtype=torch.float64))
    a = qparams_from_range(lo, hi, P.NVFP4, global_amax=1e39)
    b = qparams_from_range(lo, hi, P.NVFP4, global_amax=torch.tensor(1e39, dtype=torch.float64))
    assert torch.equal(a.scale, b.scale) and torch.equal(a.global_scale, b.global_scale)
    with pytest.raises(ValueError, match="global_amax must be finite"):
        check_ranges("t", lo, hi, float("inf"))
