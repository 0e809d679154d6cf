"""Mutation round s47 on the l2 polish's ``_stay_on_side``: data whose largest magnitude lies
between half a bin and a bin of the native grid (bins no narrower than 2 ** -126) are still
"within a bin of zero": the moving end must stay on its side there too. (The subnormal test
file's data, one seed at whole powers of two, do not reach that band.)"""

import pytest
import torch

import quantscope
from quantscope import QuantSpec, fake_quantize

SPEC = QuantSpec("int8", "channel:0", symmetric=False, eps=1e-45)


def _error(x, lo, hi) -> float:
    q = quantscope.qparams_from_range(lo, hi, SPEC)
    return float(((fake_quantize(x, q, SPEC).double() - x.double()) ** 2).sum())


@pytest.mark.parametrize("frac", [1.5, 1.75])
def test_polish_keeps_both_sides_within_a_bin_of_zero(frac):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    x = x * 2.0 ** -100 * (2.0 ** -28 * frac)  # max |x| ~ 1e-38: within a bin of zero
    obs = quantscope.get_observer("histogram", SPEC)
    obs(x)
    lo, hi = obs.calculate_range()
    assert bool((x.amin(1) < 0).all()) and bool((x.amax(1) > 0).all())
    assert bool((lo < 0).all()) and bool((hi > 0).all()), (lo, hi)
    assert _error(x, lo, hi) <= 8 * _error(x, x.amin(1), x.amax(1))
