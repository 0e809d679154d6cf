"""Pins of survivors of a mutation round (s68) over quantscope.compat.horizon: behaviour its
module doc, docstrings and docs/guide/pipelines.md state that no test held: both of
``quant_min`` / ``quant_max`` or neither, ``ch_axis=None`` as per tensor, the ``ch_axis`` error
naming the sign the ``qscheme`` wants, ``is_sync_quantize``'s all-reduce (MIN of the min, MAX of
the max, in place, before the scale, only when asked for), NaN / inf as quantscope's clear error
rather than a NaN range or the no-data default, ``reset_min_max_vals`` and a Horizon state
loading as a new observer's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_horizon_s32 import horizon_scale, horizon_state

from quantscope.compat import horizon as hz
from quantscope.layout import Tensor

NAN = float("nan")


def test_quant_max_alone_is_refused():
    """Both of ``quant_min`` / ``quant_max`` or neither: ``quant_max`` alone is named too."""
    with pytest.raises(ValueError, match="give both quant_min and quant_max, got None and 63"):
        hz.MinMaxObserver(quant_max=63)
    with pytest.raises(ValueError, match="give both quant_min and quant_max"):
        hz.horizon_spec(quant_max=63)


def test_ch_axis_none_is_per_tensor():
    """``ch_axis=None`` reads as -1 (per tensor), the default ``per_tensor_symmetric`` pair."""
    o = hz.MinMaxObserver(ch_axis=None, averaging_constant=1.0)
    assert o.spec.layout == Tensor()
    o(torch.tensor([[-3.0, 1.0], [2.0, 0.5]]))
    assert torch.equal(o.calculate_qparams()[0], torch.tensor([3.0 / 127.5]))


def test_ch_axis_error_names_the_sign_the_qscheme_wants():
    with pytest.raises(hz.HorizonArgumentError, match="ch_axis should be negative with "
                                                      "qscheme=torch.per_tensor_symmetric"):
        hz.MinMaxObserver(ch_axis=0)
    with pytest.raises(hz.HorizonArgumentError, match="ch_axis should be non-negative with "
                                                      "qscheme=torch.per_channel_symmetric"):
        hz.MovingAveragePerChannelMinMaxObserver(ch_axis=-1)


class _Reduce:
    """``all_reduce`` stand-in: records ``(op, group)`` and writes the other rank's ends in
    place (the merged ends a real MIN / MAX would leave)."""

    def __init__(self, lo, hi):
        self.calls, self.other = [], {dist.ReduceOp.MIN: lo, dist.ReduceOp.MAX: hi}

    def __call__(self, tensor, op, group):
        self.calls.append((op, group))
        other = self.other.get(op)
        if other is None:
            raise AssertionError(f"reduced with {op}")
        tensor.copy_(torch.minimum(tensor, other) if op == dist.ReduceOp.MIN
                     else torch.maximum(tensor, other))


@pytest.mark.parametrize("sync", [True, False])
def test_is_sync_quantize_all_reduces_the_ends_in_place_before_the_scale(monkeypatch, sync):
    """Inside a process group, ``calculate_qparams`` all-reduces the averaged min with MIN and
    max with MAX over ``sync_group``, in place, and scales the merged ends; without
    ``is_sync_quantize`` it joins no collective and scales its own."""
    reduce = _Reduce(torch.tensor([-5.1]), torch.tensor([0.5]))
    monkeypatch.setattr(hz, "is_distributed", lambda group: True)
    monkeypatch.setattr(hz, "all_reduce", reduce)
    o = hz.MinMaxObserver(is_sync_quantize=sync)
    o(torch.tensor([-1.0, 2.0]))
    scale, zp = o.calculate_qparams()
    if not sync:
        assert reduce.calls == [] and torch.equal(scale, torch.tensor([2.0 / 127.5]))
        return
    assert reduce.calls == [(dist.ReduceOp.MIN, o.sync_group), (dist.ReduceOp.MAX,
                                                                o.sync_group)]
    assert torch.equal(o.min_val, torch.tensor([-5.1])) and torch.equal(o.max_val,
                                                                         torch.tensor([2.0]))
    assert torch.equal(scale, horizon_scale(torch.tensor([-5.1]), torch.tensor([2.0])))
    assert zp.tolist() == [0]


def test_is_sync_quantize_without_ends_joins_no_all_reduce(monkeypatch):
    """Before any ends (no data) the read returns the default with a warning and, as
    Horizon's, takes no part in the all-reduce."""
    reduce = _Reduce(torch.tensor([-1.0]), torch.tensor([1.0]))
    monkeypatch.setattr(hz, "is_distributed", lambda group: True)
    monkeypatch.setattr(hz, "all_reduce", reduce)
    with pytest.warns(UserWarning, match="default scale 1.0"):
        scale, _ = hz.MinMaxObserver(is_sync_quantize=True).calculate_qparams()
    assert scale.tolist() == [1.0] and reduce.calls == []


def test_all_nan_histogram_batch_is_the_clear_error_not_the_no_data_default():
    """A batch of NaN only leaves a histogram class no averaged ends: the qparams read is
    quantscope's NaN / inf error, not Horizon's no-data default ``(1.0, 0)``."""
    o = hz.PercentileObserver()
    o(torch.tensor([NAN, NAN, NAN]))
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        o.calculate_qparams()


def test_calculate_range_after_nan_is_the_clear_error():
    """``calculate_range`` of averaged ends that saw NaN raises quantscope's error, not a NaN
    range."""
    o = hz.MinMaxObserver()
    o(torch.tensor([NAN, 1.0]))
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        o.calculate_range()


def test_reset_min_max_vals_forgets_the_data():
    """torch.ao's / Horizon's ``reset_min_max_vals``: empty ends, then the next batch's own."""
    o = hz.MinMaxObserver()
    o(torch.tensor([-4.0, 3.0]))
    o.reset_min_max_vals()
    assert o.min_val.numel() == 0 and o.max_val.numel() == 0
    o(torch.tensor([-1.0, 0.5]))
    assert torch.equal(o.min_val, torch.tensor([-1.0]))
    assert torch.equal(o.max_val, torch.tensor([0.5]))


@pytest.mark.parametrize("cls", [hz.MinMaxObserver, hz.PercentileObserver])
def test_a_horizon_state_loads_as_a_new_observers(cls):
    """A Horizon state is a new observer's state with its ends: loaded into an observer that
    has seen data, nothing of that data stays (empty ends: no data at all)."""
    o = cls(averaging_constant=0.5)
    o(torch.tensor([-4.0, 3.0, 1.0]))
    o.load_state_dict(horizon_state([], []))
    assert not o.has_observed and o.min_val.numel() == 0
    with pytest.warns(UserWarning, match="default scale 1.0"):
        assert o.calculate_qparams()[0].tolist() == [1.0]


@pytest.mark.parametrize("cls", [hz.MovingAverageMinMaxObserver,
                                 hz.MovingAveragePerChannelMinMaxObserver])
def test_moving_average_classes_average_with_horizons_default_constant(cls):
    """Horizon's (torch.ao's) moving-average observers: ``averaging_constant=0.01`` by
    default, the first batch's ends, then ``v + 0.01 * (new - v)``."""
    o = cls()
    o(torch.tensor([[-1.0, 2.0]]))
    o(torch.tensor([[-3.0, 4.0]]))
    lo, hi = -1.0 + 0.01 * -2.0, 2.0 + 0.01 * 2.0
    assert float(o.min_val.amin()) == pytest.approx(lo, rel=1e-6)
    assert float(o.max_val.amax()) == pytest.approx(hi, rel=1e-6)


def test_per_channel_moving_average_defaults_to_channel_axis_0():
    """``MovingAveragePerChannelMinMaxObserver``'s ``ch_axis`` is 0 by default: one scale per
    row."""
    o = hz.MovingAveragePerChannelMinMaxObserver()
    assert o.ch_axis == 0
    o(torch.tensor([[-1.0, 0.5, 0.25], [0.5, 2.0, -0.25]]))
    assert torch.equal(o.calculate_qparams()[0], torch.tensor([1.0, 2.0]) / 127.5)


@pytest.mark.parametrize("bins", [512.0, "512"])
def test_kl_bins_must_be_an_integer(bins):
    """Horizon's ``bins >= 256``, and an integer: a float or string count is named."""
    with pytest.raises(hz.HorizonArgumentError, match="bins must be an integer >= 256"):
        hz.KLObserver(bins=bins)
