"""Pins of the observer base (``quantscope.observers.base``) from a mutation round (s71).

Each test pins one behaviour of :class:`~quantscope.observers.Observer` that no earlier test
held (each kills a mutant that survived the observer tests): NaN that a step exchange brings
is recorded, ``check_ready(warn=False)`` stays quiet, ``observe_minmax`` checks ``hi`` and the
unit count as ``forward`` does, loads keep the observer's dtypes and read no meta counters,
reset drops the sync mark, the state record names the act order, and the earlier private
names still work.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import quantscope
from quantscope import Channel, Group, QuantSpec
from quantscope.observers import Observer, base, record


def test_a_nan_in_the_exchanged_step_range_is_recorded(monkeypatch):
    """``sync_every_step``: NaN that another rank brought into the step's range (the lo / hi
    step_sync returns) is recorded, though this rank's own values were finite."""
    def step_sync(obs, units, lo, hi, group):
        return units, lo + float("nan"), hi

    monkeypatch.setattr(base, "step_sync", step_sync)
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs.sync_every_step = True
    obs(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        obs.calculate_qparams()


def test_an_empty_step_records_nan_another_rank_brought(monkeypatch):
    """step_empty: the step's range comes from the other ranks; NaN in it is recorded."""
    def step_sync(obs, units, lo, hi, group):
        return torch.ones(1, 2), torch.tensor([float("nan")]), torch.tensor([1.0])

    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs.sync_every_step = True
    obs(torch.ones(1, 2))  # (this rank's own step: finite)
    monkeypatch.setattr(base, "step_sync", step_sync)
    obs.step_empty()
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        obs.calculate_qparams()


def test_check_ready_without_warn_does_not_warn_of_ignored_values():
    obs = quantscope.get_observer("static_minmax", QuantSpec(), non_finite="ignore")
    obs(torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        obs.check_ready(warn=False)
    with pytest.warns(UserWarning, match="ignored 2 NaN / inf values"):
        obs.check_ready()


def _observed(name="static_minmax", spec=None):
    obs = quantscope.get_observer(name, QuantSpec() if spec is None else spec)
    obs(torch.tensor([[-1.0, 3.0], [0.5, 2.0]]))
    return obs


def test_a_reset_drops_the_sync_mark_of_a_loaded_state():
    """A state loaded with a sync mark saves it; after reset it is a fresh one: no mark."""
    state = _observed().state_dict()
    state[record.RECORD] = record.encode({"layout": "tensor", "synced": [2, 0]})
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs.load_state_dict(state)
    assert record.decode(obs.get_extra_state(), "") == {"layout": "tensor", "synced": [2, 0]}
    obs.reset()
    assert record.decode(obs.get_extra_state(), "") == {"layout": "tensor"}


def test_a_load_keeps_the_observers_float32_state():
    """A saved float64 range loads into the observer's float32 buffers (as torch's copy)."""
    state = {k: v.double() if v.is_floating_point() else v
             for k, v in _observed().state_dict().items()}
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs.load_state_dict(state)
    assert obs.min_vals.dtype == obs.max_vals.dtype == torch.float32
    assert obs.min_vals.tolist() == [-1.0] and obs.max_vals.tolist() == [3.0]


def test_a_state_saved_without_its_record_loads_under_strict():
    state = _observed().state_dict()
    del state[record.RECORD]
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    result = obs.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert obs.shape == (2, 2) and obs.max_vals.tolist() == [3.0]


@pytest.mark.parametrize("old, new", [("_who", "describe"), ("_step_empty", "step_empty"),
                                      ("_set_shape", "set_shape")])
def test_the_earlier_private_names_are_the_methods(old, new):
    assert getattr(Observer, old) is getattr(Observer, new)


def test_a_step_synced_observer_does_not_take_minmax():
    """observe_minmax cannot stand for forward where forward exchanges the step's range."""
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    assert obs.takes_minmax
    obs.sync_every_step = True
    assert not obs.takes_minmax
    with pytest.raises(TypeError, match="no sync_every_step"):
        obs.observe_minmax(torch.ones(1, 2), torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("which", ["dtype", "length"])
def test_observe_minmax_checks_hi_as_lo(which):
    x = torch.randn(4, 8)
    lo, hi = x.aminmax(dim=1)
    hi = hi.double() if which == "dtype" else hi[:3]
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8", Channel(0)))
    with pytest.raises(ValueError, match="lo and hi must be float32 of the 4 units"):
        obs.observe_minmax(x, lo, hi)
    assert not obs.has_observed


def test_observe_minmax_keeps_the_unit_count_of_an_accumulating_observer():
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8", Channel(0)))
    obs(torch.randn(4, 8))
    y = torch.randn(5, 8)
    with pytest.raises(ValueError, match="unit count must not change"):
        obs.observe_minmax(y, *y.aminmax(dim=1))


def test_a_required_averaging_constant_refuses_none():
    with pytest.raises(ValueError, match=r"averaging_constant must be .* got None"):
        quantscope.get_observer("minmax", QuantSpec(), averaging_constant=None)


def test_a_meta_state_loads_without_reading_its_counters():
    """A state on the meta device loads (its counters are not read); the shape stays unset."""
    obs = quantscope.get_observer("static_minmax", QuantSpec()).to("meta")
    obs(torch.empty(2, 4, device="meta"))
    fresh = quantscope.get_observer("static_minmax", QuantSpec()).to("meta")
    fresh.load_state_dict(obs.state_dict())
    assert fresh.min_vals.is_meta and fresh.shape is None


def test_the_state_record_names_the_act_order():
    spec = QuantSpec("int4", Group(2, g_idx=torch.tensor([1, 0, 1, 0])))
    assert spec.layout.order is not None
    obs = quantscope.get_observer("static_minmax", spec)
    assert record.decode(obs.get_extra_state(), "")["order"] == spec.layout.order


def test_a_cast_to_another_device_moves_the_state_in_its_dtypes():
    obs = _observed().to("meta", torch.float16)
    assert obs.min_vals.is_meta and obs.min_vals.dtype == torch.float32
    assert obs.observed_tokens.is_meta and obs.observed_tokens.dtype == torch.int64


def test_store_writes_each_value_though_one_is_its_buffer_already():
    obs = _observed()
    hi = torch.tensor([7.0])
    obs._store(("min_vals", "max_vals"), (obs.min_vals, hi))
    assert obs.min_vals.tolist() == [-1.0] and obs.max_vals.tolist() == [7.0]


def test_qparams_of_a_meta_state_name_the_meta_device():
    obs = quantscope.get_observer("static_minmax", QuantSpec()).to("meta")
    obs(torch.empty(2, 4, device="meta"))
    with pytest.raises(ValueError, match="on the meta device, which holds no statistics"):
        obs.calculate_qparams()
