"""Pins from session 67's mutation round of compat.modelopt (modelopt.py, modelopt_base.py,
modelopt_grid.py, modelopt_spec.py), each a behaviour no test of the main venv held (some held
only by peers-venv tests): the argument checks (a bool axis or percentile, ``num_bits`` in
``[2, 16]``); ``MaxCalibrator.collect`` refusing an empty or bool batch and taking uint8's 0; a
bool histogram batch binned as its 0 / 1 values; a grown grid's edges as ModelOpt's ``arange``
of its first ``linspace``'s width; a true 0 amax read without the subnormal warning, and +0 on
all-zero data; an unpickled amax shape with a 0-size axis refused; NaN / inf asserted against
at ``MaxCalibrator.collect``; a meta batch's one value per unit a 0-d amax; a ``spec`` keyword
refused."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_modelopt_s38 import _collected, _load

from quantscope.compat import UnsupportedInputError
from quantscope.compat.modelopt import (
    HistogramCalibrator,
    MaxCalibrator,
    ModelOptArgumentError,
    modelopt_spec,
)


@pytest.mark.parametrize("axis", [True, False, (0, True)])
def test_a_bool_axis_is_a_type_error(axis):
    with pytest.raises(TypeError, match="axis must be None, an int or a tuple of ints"):
        MaxCalibrator(axis=axis)


@pytest.mark.parametrize("num_bits", [2, 16])
def test_num_bits_takes_2_to_16(num_bits):
    assert modelopt_spec(num_bits).format.name == f"int{num_bits}_narrow"


@pytest.mark.parametrize("num_bits", [1, 17])
def test_num_bits_outside_2_to_16_is_a_value_error(num_bits):
    with pytest.raises(ValueError, match=r"\[2, 16\]"):
        modelopt_spec(num_bits)


def test_a_bool_percentile_is_a_type_error():
    c = HistogramCalibrator(num_bins=8)
    c.collect(torch.linspace(0, 1, 64))
    with pytest.raises(TypeError, match="percentile must be a number"):
        c.compute_amax("percentile", percentile=True)


def test_histogram_collect_bins_a_bool_batch_as_its_0_1_values():
    """ModelOpt's ``x.float()``: ``histc`` of 0 / 1 over ``[0, 1]`` (module doc: bool batches
    are taken as their float32 values)."""
    c = HistogramCalibrator(num_bins=8)
    c.collect(torch.tensor([True, False, True, True]))
    assert c._calib_hist.tolist() == [1, 0, 0, 0, 0, 0, 0, 3]
    assert torch.equal(c._calib_bin_edges, torch.linspace(0, 1, 9))


def test_a_grown_grid_steps_by_its_first_linspaces_edge_1_minus_edge_0():
    """ModelOpt's width is ``edges[1] - edges[0]`` of ``linspace(0, max |x|, bins + 1)``, its
    grown edges ``arange(0, max |x| + width, width)``; on a subnormal top of 2 bins that width
    differs from ``max |x| / bins`` in float32."""
    top = torch.tensor(2.5265411311776452e-42)
    c = HistogramCalibrator(num_bins=2)
    c.collect(torch.stack([top, top / 3]))
    first = torch.linspace(0, float(top), 3)
    w = first[1] - first[0]
    c.collect(top.reshape(1) * 7)
    assert torch.equal(c._calib_bin_edges, torch.arange(0, top * 7 + w, w))


def test_an_amax_of_edge_0_is_returned_without_the_subnormal_warning():
    """ModelOpt's percentile 50 of 99 zeros and a one is ``edges[0]``, 0: a true 0, not the
    subnormal grid's underflowed edge the warning names."""
    c = HistogramCalibrator(num_bins=8)
    c.collect(torch.cat([torch.zeros(99), torch.ones(1)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amax = c.compute_amax("percentile", percentile=50)
    assert amax.item() == 0 and not amax.signbit()


@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_max_collect_refuses_an_empty_batch_and_keeps_nothing(shape):
    c = MaxCalibrator()
    with pytest.raises(ValueError, match="no elements"):
        c.collect(torch.empty(shape))
    assert c.compute_amax() is None


def test_max_collect_takes_an_unsigned_integer_batch_holding_0():
    """Only a signed dtype's minimum has no ``|x|``; uint8's 0 is its own: the amax is the
    max, in the batch's dtype (ModelOpt's)."""
    c = MaxCalibrator()
    c.collect(torch.tensor([0, 5, 200], dtype=torch.uint8))
    amax = c.compute_amax()
    assert amax.dtype == torch.uint8 and amax.item() == 200


def test_max_collect_refuses_a_bool_batch_as_modelopts_abs():
    """ModelOpt's ``abs`` of a bool tensor is a ``NotImplementedError``; nothing is kept."""
    c = MaxCalibrator()
    with pytest.raises(UnsupportedInputError, match="bool"):
        c.collect(torch.tensor([True, False]))
    assert isinstance(UnsupportedInputError("x"), NotImplementedError)
    assert c.compute_amax() is None


@pytest.mark.parametrize("method", ["entropy", "mse", "percentile"])
def test_histogram_amax_of_all_zero_data_is_plus_0(method):
    """ModelOpt's max ``|x|`` is +0 (its edges run from +0); no -0 from the native grid."""
    c = HistogramCalibrator()
    c.collect(torch.zeros(10))
    amax = c.compute_amax(method)
    assert amax.item() == 0 and not amax.signbit()


def test_an_unpickled_amax_shape_with_a_0_size_axis_is_refused():
    """One value per unit, each axis's size positive: a state edited to 0 units and amax
    shape ``(0, 1)`` fits no batch (an empty one is refused at ``collect``)."""
    c = _collected(0, (3, 4))
    buffers = dict(c.__getstate__()["_buffers"])
    buffers.update(min_vals=buffers["min_vals"][:0], max_vals=buffers["max_vals"][:0])
    with pytest.raises(ValueError, match=r"MaxCalibrator.*_amax_shape"):
        _load(c, _buffers=buffers, _amax_shape=(0, 1))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_max_collect_asserts_against_inf_and_nan_and_keeps_nothing(bad):
    """ModelOpt's ``MaxCalibrator`` asserts "detected NaN or inf values" at ``collect``."""
    c = MaxCalibrator()
    with pytest.raises(ModelOptArgumentError, match="NaN or inf") as err:
        c.collect(torch.tensor([1.0, bad]))
    assert isinstance(err.value, AssertionError)
    assert c.compute_amax() is None


def test_a_meta_batch_of_one_value_per_unit_gives_a_0d_meta_amax():
    """``reduce_amax``'s squeeze: one kept value is 0-d, meta batches alike."""
    c = MaxCalibrator(axis=0)
    c.collect(torch.empty(1, 4, device="meta", dtype=torch.float16))
    amax = c.compute_amax()
    assert amax.is_meta and amax.shape == () and amax.dtype == torch.float16


def test_a_spec_keyword_is_refused_naming_modelopts_arguments():
    with pytest.raises(TypeError, match=r"ModelOpt's arguments \(num_bits, axis, unsigned\)"):
        MaxCalibrator(spec=modelopt_spec(8))
