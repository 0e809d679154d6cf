"""Pins from session 59's mutation round of compat.modelopt (ModelOpt 0.47 where it takes
part): an axis named twice is one kept axis, re-set or not; the native qparams of an
``unsigned`` histogram are ModelOpt's ``amax / 255`` codes from 0; ``reset()`` forgets a
grown grid."""

from __future__ import annotations

import warnings

import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator


@pytest.mark.peers
def test_an_axis_named_twice_keeps_one_axis_as_modelopts():
    calib = pytest.importorskip("modelopt.torch.quantization.calib")
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    ours, theirs = MaxCalibrator(8, axis=(1, 1)), calib.MaxCalibrator(8, axis=(1, 1))
    ours.collect(x)
    theirs.collect(x)
    assert torch.equal(ours.compute_amax(), theirs.compute_amax())
    assert tuple(ours.qparams().scale.shape) == (1, 4, 1)
    ours._axis = theirs._axis = 1  # the same axis spelled once keeps the amax
    assert torch.equal(ours.compute_amax(), theirs.compute_amax())


def test_unsigned_histogram_qparams_are_amax_over_255_from_code_0():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))  # signed data
    c = HistogramCalibrator(num_bits=8, unsigned=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c(x)
    q = c.qparams()
    amax = c.compute_amax("entropy")
    assert torch.equal(q.scale.reshape(()), (amax / 255).to(q.scale.dtype))
    assert q.zero_point.flatten().tolist() == [0]


def test_reset_forgets_a_grown_grid():
    c, fresh = HistogramCalibrator(num_bins=8), HistogramCalibrator(num_bins=8)
    c.collect(torch.linspace(0, 1, 100))
    c.collect(torch.linspace(0, 3, 100))  # grows the grid to 3
    c.reset()
    for h in (c, fresh):
        h.collect(torch.linspace(0, 1, 100))
    assert torch.equal(c._calib_bin_edges, fresh._calib_bin_edges)
    assert torch.equal(c.compute_amax("percentile", percentile=100),
                       fresh.compute_amax("percentile", percentile=100))
