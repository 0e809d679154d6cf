"""Pins of the MSE-family, ``imatrix_mse``, ``observe_many`` and state-record behaviours that a
mutation round (s71) found unpinned: the moving-average MSE's documented constant (0.01) and
its ends returned in order, the NVFP4 expanded preset's reach down to 0.8x of the range,
``linear_mse``'s full 95-candidate grid by default, ``pow2_mse``'s ``span`` (0: the min-max
scale itself), the MSE observers' sync plan (the global amax averaged with the ranges), an
``importance`` of one row kept flat, a pair observed alone charged its forward's time, and
the record's reading (a record on meta, one without ``layout``, JSON that is no object, a
partial state told by the submodule's own keys, an old state whose buffers tell no EMA
mode). Each test fails on a small defect of its source that the earlier tests let through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_observer_parts_pins_s65 import _units_state

from quantscope import QuantSpec, comm, presets
from quantscope.estimators import linear_search, mse_search
from quantscope.layout import Channel
from quantscope.observers import get_observer, grouped, observe_many, record
from quantscope.qparams import qparams_from_range
from quantscope.stats.minmax import unit_minmax


def _weight():
    """Four rows of N(0, 1) with one outlier each: clipping pays off."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[:, 0] = torch.tensor([9.0, -8.0, 7.0, -10.0])
    return w


def _units(spec, w):
    u = spec.layout.to_units(w)
    return (u, *unit_minmax(u))


# ---- the MSE observers ------------------------------------------------------------------

def test_moving_average_mse_default_constant_is_0_01():
    """``mse`` is an EMA with ``averaging_constant`` 0.01 (the class doc, the module table):
    a second batch moves each end 1 % of the way to that batch's search."""
    spec = QuantSpec("int8", Channel(0))
    ema, one = get_observer("mse", spec), get_observer("memoryless_mse", spec)
    ends = []
    for x in (_weight(), _weight() * 4):
        ema(x)
        one(x)
        ends.append([t.clone() for t in one.calculate_range()])
    (lo0, hi0), (lo1, hi1) = ends
    assert torch.allclose(ema.min_vals, lo0 + 0.01 * (lo1 - lo0), rtol=1e-6, atol=0)
    assert torch.allclose(ema.max_vals, hi0 + 0.01 * (hi1 - hi0), rtol=1e-6, atol=0)


def test_moving_average_mse_range_is_in_order_when_its_ends_cross():
    """The EMA's rounding can cross two close ends: ``calculate_range`` gives each unit's
    smaller end as its min and the larger as its max, whatever the state holds."""
    spec = QuantSpec("int8", Channel(0), symmetric=False)
    src = get_observer("mse", spec)
    src(torch.tensor([[-1.0, 2.0], [-3.0, 1.0]]))
    state = src.state_dict()
    state["min_vals"], state["max_vals"] = state["max_vals"].clone(), state["min_vals"].clone()
    into = get_observer("mse", spec)
    into.load_state_dict(state)
    lo, hi = into.calculate_range()
    assert torch.equal(lo, torch.minimum(into.min_vals, into.max_vals))
    assert torch.equal(hi, torch.maximum(into.min_vals, into.max_vals))
    assert (lo < hi).all()


def test_nvfp4_expanded_mse_searches_down_to_0_8x_the_range():
    """The preset searches from 1.8x the range down to 0.8x: ``mse_search`` with expand 1.8,
    grid 200, patience 1000 and ``maxshrink = 1 - 0.8 / 1.8``; on outlier rows it clips
    below the min-max range."""
    spec = QuantSpec("int4", Channel(0))
    w = _weight()
    u, lo, hi = _units(spec, w)
    o = get_observer("nvfp4_expanded_mse", spec)
    o(w)
    want = mse_search(u, lo, hi, spec, maxshrink=1 - 0.8 / 1.8, grid=200, patience=1000,
                      expand=1.8)
    assert torch.equal(o.min_vals, want.lo) and torch.equal(o.max_vals, want.hi)
    assert float((o.min_vals / lo).min()) < 1.0


def test_linear_mse_searches_all_95_candidates_by_default():
    """``stride`` defaults to 1: every ``amax * (1 - 0.01 i)``, i < 95, is a candidate (the
    data here choose 0.99 in a row that a stride of 2 would leave at 1.0)."""
    spec = QuantSpec("int8", Channel(0))
    w = _weight()
    u, lo, hi = _units(spec, w)
    o = get_observer("linear_mse", spec)
    o(w)
    want = linear_search(u, lo, hi, spec, stride=1)
    assert torch.equal(o.max_vals, want.hi) and torch.equal(o.min_vals, want.lo)
    assert not torch.equal(want.hi, linear_search(u, lo, hi, spec, stride=2).hi)


def test_pow2_mse_span_0_keeps_the_min_max_scale():
    """``span`` 0 is allowed: the exponents -0 .. +0 are the min-max scale's alone."""
    spec = QuantSpec("int8", Channel(0), scale="pow2:round")
    w = _weight()
    _, lo, hi = _units(spec, w)
    o = get_observer("pow2_mse", spec, span=0)
    o(w)
    want = qparams_from_range(lo, hi, spec).scale
    assert torch.equal(o.calculate_qparams().scale.flatten(), want.flatten())


def test_mse_observers_sync_every_sized_buffer_as_the_ranks_mean():
    """Across ranks an MSE observer's state is the mean of the ranks' (docs/guide/
    distributed.md), NVFP4's global amax with its ranges: every sized buffer is in the plan."""
    for name in ("memoryless_mse", "mse", "nvfp4_expanded_mse", "pow2_mse"):
        o = get_observer(name, presets.NVFP4 if "nvfp4" in name else QuantSpec("int8"))
        want = dict.fromkeys(("min_vals", "max_vals", "global_amax_val"), comm.AVG)
        assert o.sync_plan() == want, name


# ---- imatrix_mse ------------------------------------------------------------------------

def test_imatrix_importance_of_one_row_is_kept_flat():
    """``importance`` is one value per input channel, kept as ``[in]`` however it is shaped
    (``[1, in]``): the state holds a 1-D tensor and the range is the 1-D one's."""
    spec, w = QuantSpec("int4", Channel(0)), _weight()
    imp = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.1
    row = get_observer("imatrix_mse", spec, importance=imp.reshape(1, 64))
    flat = get_observer("imatrix_mse", spec, importance=imp)
    assert row.state_dict()["importance"].shape == (64,)
    row(w)
    flat(w)
    assert torch.equal(row.min_vals, flat.min_vals) and torch.equal(row.max_vals, flat.max_vals)


# ---- observe_many -----------------------------------------------------------------------

def test_a_pair_observed_alone_is_charged_its_forward(monkeypatch):
    """``observe_many`` returns the seconds spent on each pair: a CPU pair (observed alone,
    through its forward) is charged its forward's time (a clock that moves only there)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(grouped, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    o = get_observer("memoryless_minmax")
    o.register_forward_pre_hook(lambda *_: setattr(clock, "now", clock.now + 5.0))
    assert observe_many([(o, torch.ones(2, 3))]) == [5.0]
    assert o.has_observed


# ---- the state record -------------------------------------------------------------------

def test_a_record_on_meta_is_no_record():
    """A record on the meta device (a state made there) holds no bytes to read: no record,
    loaded as a state saved before the record, not a failed read."""
    assert record.decode(torch.empty(23, dtype=torch.uint8, device="meta"), "Obs") is None


def test_a_record_without_a_layout_entry_is_a_record():
    """A subclass's record may hold only its own entries: no ``layout`` is no damage."""
    assert record.decode(record.encode({"ema": True}), "Obs") == {"ema": True}


@pytest.mark.parametrize("text", ["[1, 2]", '"tensor"', "7", "null"])
def test_json_that_is_no_object_is_no_record(text):
    """Valid JSON other than an object is the record's ``ValueError``, not a bare error."""
    state = torch.tensor(list(text.encode()), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^Obs: the state's _extra_state is no record$"):
        record.decode(state, "Obs")


def test_partial_looks_for_the_submodules_own_keys():
    """A partial state is told by the prefixed keys: a root-level key of the same name does
    not stand in for the submodule's missing one."""
    state = _units_state([4, 8], min_vals=torch.zeros(4))
    state = {**{f"a.{k}": v for k, v in state.items()}, "max_vals": torch.zeros(4)}
    err = record.partial(state, "a.", ("min_vals", "max_vals"), "Obs")
    assert err is not None and "lacks a.max_vals" in err and err.startswith("Obs at 'a'")


def test_an_old_state_whose_buffers_tell_no_mode_loads_in_either():
    """A state saved before the record's ``ema`` entry is told its EMA mode by its buffers
    only where they tell it: an observed state without ``ema_lo`` / ``pending`` (nor a
    record) is refused in neither mode; with an empty ``ema_lo`` (saved by an observer that
    has the buffer and averaged nothing) it was accumulating, refused in the EMA mode."""
    state = _units_state([4, 8])
    for ema in (False, True):
        assert record.check(state, "", {"layout": "tensor", "ema": ema}, "Obs") is None
    told = {**state, "ema_lo": torch.zeros(0)}
    with pytest.raises(ValueError, match=r"histogram state accumulating"):
        record.check(told, "", {"layout": "tensor", "ema": True}, "Obs")
