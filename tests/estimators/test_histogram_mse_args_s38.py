"""histogram_mse_range's integer options (s38): numpy integers taken (ModelOpt's
``compute_amax("mse", start_bin=np.int64(3))`` was refused), bool and values under 1 refused
naming the option."""

import numpy as np
import pytest
import torch

import quantscope as qs
from quantscope.estimators.histogram_mse import histogram_mse_range


def _hist():
    o = qs.get_observer("percentile", qs.QuantSpec("int8"), bins=256)
    o(torch.randn(1, 4000, generator=torch.Generator().manual_seed(0)))
    return o.current_histogram()


def test_numpy_integers_are_integers():
    h, spec = _hist(), qs.QuantSpec("int8")
    want = histogram_mse_range(h, spec, start_bin=3, stride=2, refine=4)
    got = histogram_mse_range(h, spec, start_bin=np.int64(3), stride=np.int32(2),
                              refine=np.int64(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["stride", "refine"])
@pytest.mark.parametrize("value", [0, -1, True])
def test_an_option_under_1_or_a_bool_is_refused(name, value):
    with pytest.raises(ValueError, match=rf"histogram_mse: {name} must be an integer >= 1"):
        histogram_mse_range(_hist(), qs.QuantSpec("int8"), **{name: value})
