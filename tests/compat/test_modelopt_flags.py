"""ModelOpt's flags ``unsigned`` and ``HistogramCalibrator(torch_hist=...)``: ModelOpt reads
any truthy value; the compat classes take True / False, numpy's bools and 1 / 0 as those bools
(a string or None would be read silently), and refuse ``torch_hist`` False (ModelOpt's numpy
path, not supported) naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator


@pytest.mark.parametrize("value", [1, np.True_])
def test_torch_hist_1_or_numpy_true_bins_as_true(value):
    x = torch.tensor([0.5, -1.5, 3.0, 0.25])
    got, want = HistogramCalibrator(num_bins=8, torch_hist=value), HistogramCalibrator(num_bins=8)
    got.collect(x)
    want.collect(x)
    assert torch.equal(got._calib_hist, want._calib_hist)
    assert torch.equal(got._calib_bin_edges, want._calib_bin_edges)


@pytest.mark.parametrize("value", [False, 0, np.False_, 2, None, "yes", 1.0])
def test_torch_hist_other_than_true_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"torch_hist=True or 1 .*got torch_hist="):
        HistogramCalibrator(torch_hist=value)


@pytest.mark.parametrize(("value", "unsigned"), [(np.True_, True), (np.False_, False),
                                                 (1, True), (0, False)])
def test_unsigned_takes_numpy_bools_and_1_0_as_bools(value, unsigned):
    calib = MaxCalibrator(num_bits=8, unsigned=value)
    assert calib._unsigned is unsigned
    assert calib.spec == MaxCalibrator(num_bits=8, unsigned=unsigned).spec


@pytest.mark.parametrize("value", [2, None, "yes", 1.0])
def test_unsigned_other_values_are_refused_naming_it(value):
    with pytest.raises(TypeError, match="unsigned must be True / False"):
        MaxCalibrator(unsigned=value)
