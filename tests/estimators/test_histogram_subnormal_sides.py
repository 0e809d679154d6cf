"""Histogram observers on data scaled down into float32's subnormals by an exact power of two:
no side of the range is dropped, and the error stays near min-max's.

Below about ``2 ** -115`` the native grid's bins stop shrinking (``2 ** E_MIN``): the data
then lie within a bin of zero. The L2 observer's polish moved ``lo`` past ``hi = 0`` there
(a line orders each candidate's ends) and returned ``[0, max]``: every negative value
quantized to 0. (At 2 ** -146 and below the data are a few steps of 2 ** -149, the
smallest scale, and the ranges collapse: not covered here.)
"""

import pytest
import torch

import quantscope
from quantscope import QuantSpec, fake_quantize

_SPECS = {"tensor": QuantSpec("int8", symmetric=False, eps=1e-45),
          "channel": QuantSpec("int8", "channel:0", symmetric=False, eps=1e-45)}
_NAMES = ("histogram", "percentile", "histogram_mse", "entropy", "mix")


def _data(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g)
    # 2 ** k in two exact steps (2 ** -149 is past a float32 literal's one multiply)
    return x * 2.0 ** -100 * 2.0 ** (k + 100)


def _error(x, lo, hi, spec) -> float:
    q = quantscope.qparams_from_range(lo, hi, spec)
    return float(((fake_quantize(x, q, spec).double() - x.double()) ** 2).sum())


@pytest.mark.parametrize("k", [-110, -116, -120, -126, -127, -130, -135, -140])
@pytest.mark.parametrize("gran", sorted(_SPECS))
@pytest.mark.parametrize("name", _NAMES)
def test_subnormal_range_keeps_both_sides(name, gran, k):
    spec, x = _SPECS[gran], _data(k)
    if gran == "tensor":
        x = x[:1]
    obs = quantscope.get_observer(name, spec)
    obs(x)
    lo, hi = obs.calculate_range()
    dmin, dmax = x.amin(1), x.amax(1)
    assert bool((dmin < 0).all()) and bool((dmax > 0).all())  # the data has both signs
    # the range holds some of each side: the data's negative values do not all read 0
    assert bool((lo < 0).all()) and bool((hi > 0).all()), (lo, hi, dmin, dmax)
    # and the error is that of a sensible range: within 8x min-max's (the old [0, max]
    # range was some 10 ** 4 times worse; the grid's bins of 2 ** -126 cost the rest)
    assert _error(x, lo, hi, spec) <= 8 * _error(x, dmin, dmax, spec)
