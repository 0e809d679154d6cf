"""Pins of survivors of a mutation round (s63) over quantscope.compat's ModelOpt and Horizon
classes: behaviour the docs (quantscope.compat.modelopt's and .horizon's module docs,
REFERENCES.md) and ModelOpt 0.47's formulas promise, which no test held."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope.compat import horizon as hz
from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator


def test_max_unsigned_qparams_run_from_zero_with_modelopts_unsigned_step():
    """``unsigned=True`` is ``uint{num_bits}`` from 0 (modelopt_spec): ModelOpt's unsigned
    step is ``amax / (2 ** b - 1)`` with no offset, so the zero point is 0, not a symmetric
    uint8's midpoint 128 (and the step not ``2 * amax / 255``)."""
    cal = MaxCalibrator(unsigned=True)
    cal.collect(torch.tensor([0.5, 2.0, 1.0]))
    qp = cal.qparams()
    torch.testing.assert_close(qp.scale, torch.tensor([2.0 / 255]))
    assert qp.zero_point.tolist() == [0]


def test_max_axis_named_twice_is_that_axis_and_keeps_the_state():
    """An axis named twice (``(1, 1)``) is kept once (module doc): setting ``_axis`` from ``1``
    to ``(1, 1)`` is the same axis, so the amax collected stays (as ModelOpt keeps it)."""
    cal = MaxCalibrator(axis=1)
    cal.collect(torch.tensor([[1.0, -4.0, 2.0], [-3.0, 0.5, 1.0]]))
    cal._axis = (1, 1)
    assert torch.equal(cal.compute_amax(), torch.tensor([[3.0, 4.0, 2.0]]))


def test_max_reset_forgets_the_batches_dtype():
    """``reset()`` starts from no data: a float16 batch after it has ModelOpt's float16 amax
    (its ``_calib_amax`` is None again), not one promoted with the float32 batch before."""
    cal = MaxCalibrator()
    cal.collect(torch.tensor([1.0, -2.0]))
    cal.reset()
    cal.collect(torch.tensor([3.0, -0.5], dtype=torch.float16))
    amax = cal.compute_amax()
    assert amax.dtype == torch.float16 and float(amax) == 3.0


def test_max_float_num_bits_scale_by_their_formats_largest_value():
    """``num_bits=(4, 3)`` is fp8 e4m3 and ``(5, 2)`` fp8 e5m2 (ModelOpt's (E, M) bits): the
    scale is ``amax`` over the format's largest finite value, 448 and 57344."""
    for bits, top in (((4, 3), 448.0), ((5, 2), 57344.0)):
        cal = MaxCalibrator(num_bits=bits)
        cal.collect(torch.tensor([0.5, -448.0, 1.0]))
        torch.testing.assert_close(cal.qparams().scale, torch.tensor([448.0 / top]))


def test_histogram_entropy_starts_at_modelopts_bin_128():
    """ModelOpt's entropy starts at bin 128 (compute_amax's default ``start_bin``, and
    ``qparams()``' entropy): a 127-bin histogram has no candidate for either (a ValueError),
    a 128-bin one has its one, the full range."""
    x = torch.linspace(-1.0, 1.0, 301)
    small = HistogramCalibrator(num_bins=127)
    small.collect(x)
    with pytest.raises(ValueError, match="start_bin=128"):
        small.compute_amax("entropy")
    with pytest.raises(ValueError, match="start_bin=128"):
        small.qparams()
    fits = HistogramCalibrator(num_bins=128)
    fits.collect(x)
    assert float(fits.compute_amax("entropy")) == 1.0


def test_histogram_batch_past_the_top_within_modelopts_count_appends_no_bin():
    """ModelOpt grows to ``ceil(max |x| / w)`` bins (float32, ``w = edges[1] - edges[0]`` of
    its linspace): a batch just past the first top whose count is still ``num_bins`` (``w``
    rounded up) appends none (``MIN_APPEND = 0``); its top moves on to the batch's."""
    top = 0.9471435546875  # linspace(0, top, 11)'s step rounds up: 10 * w > top
    past = float(torch.tensor(top).nextafter(torch.tensor(2.0)))
    edges = torch.linspace(0, top, 11)
    assert int(torch.ceil(torch.tensor(past) / (edges[1] - edges[0]))) == 10  # the case
    cal = HistogramCalibrator(num_bins=10)
    cal.collect(torch.tensor([top]))
    cal.collect(torch.tensor([past]))
    assert cal._calib_hist.tolist() == [0.0] * 9 + [2.0]


def test_histogram_reset_forgets_the_grown_grid():
    """``reset()`` starts from no data: the next first batch's edges are ModelOpt's
    ``linspace(0, max |x|, num_bins + 1)`` again, not the grid the batches before grew to."""
    cal = HistogramCalibrator(num_bins=16)
    cal.collect(torch.tensor([1.0]))
    cal.collect(torch.tensor([3.0]))  # grows the grid
    cal.reset()
    cal.collect(torch.tensor([0.5, -2.0]))
    assert torch.equal(cal._calib_bin_edges, torch.linspace(0, 2.0, 17))
    assert cal._calib_hist.numel() == 16


def test_horizon_minmax_averages_with_its_default_constant():
    """Horizon's MinMaxObserver is an EMA with ``c = 0.01`` by default: the first batch's
    ends, then ``v + 0.01 * (new - v)``."""
    obs = hz.MinMaxObserver()
    obs(torch.tensor([-1.0, 2.0]))
    obs(torch.tensor([-3.0, 4.0]))
    torch.testing.assert_close(obs.min_val, torch.tensor([-1.0 + 0.01 * -2.0]))
    torch.testing.assert_close(obs.max_val, torch.tensor([2.0 + 0.01 * 2.0]))


def test_horizon_mse_strided_candidate_scales_the_ends_by_its_own_factor():
    """MSE with ``stride > 1`` prices ``amax * (1 - 0.01 * i)``, i in ``range(0, 95,
    stride)``, and scales the signed ends by the factor of the candidate it chose (the
    module doc's known difference from Horizon's default path). The reference: Horizon's
    symmetric step ``amax f / ((quant_max - quant_min) / 2)``, the L2 error, the last
    minimum."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    obs = hz.MSEObserver(stride=5, dtype="qint4")
    obs(x)
    amax = x.abs().max()
    errors = []
    for i in range(0, 95, 5):
        step = amax * (1 - 0.01 * i) / 7.5
        error = torch.linalg.norm((x / step).round().clamp(-8, 7) * step - x)
        errors.append((float(error), -i))
    best = 1 - 0.01 * -min(errors)[1]
    assert best < 0.9  # the case: a strided candidate past the first
    torch.testing.assert_close(obs.min_val, (x.min() * best).reshape(1))
    torch.testing.assert_close(obs.max_val, (x.max() * best).reshape(1))


def test_max_tracked_amaxs_keep_each_batchs_dtype():
    """``track_amax=True`` keeps each batch's amax as ModelOpt's numpy array in the batch's
    dtype (float16 and float64 as they are; only bf16, which numpy lacks, as float32)."""
    cal = MaxCalibrator(track_amax=True)
    cal.collect(torch.tensor([1.0, -2.0], dtype=torch.float16))
    cal.collect(torch.tensor([1.0, -3.0], dtype=torch.float64))
    assert [a.dtype for a in cal.amaxs] == [np.float16, np.float64]
    assert [float(a) for a in cal.amaxs] == [2.0, 3.0]
