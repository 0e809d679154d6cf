"""The EMA mode (``averaging_constant``) estimates each interval on its own data: the bounds of
its estimate (the clip, the MSE / L2 scored range, mix's min / max) are the interval's min /
max, not those of every batch seen, so ``c = 1`` gives exactly a fresh observer's estimate on
the last interval."""

import pytest
import torch

from quantscope import QuantSpec
from quantscope.layout import Channel
from quantscope.observers import get_observer, list_observers, observer_class
from quantscope.observers.histogram import HistogramObserverBase


def _native():
    """The native histogram observers, one name per class (the first of its aliases)."""
    names = {}
    for n in sorted(list_observers()):
        if ":" not in n and issubclass(observer_class(n), HistogramObserverBase):
            names.setdefault(observer_class(n), n)
    return sorted(names.values())


NATIVE = _native()

SPECS = [QuantSpec("uint8", symmetric=False), QuantSpec("int8"),
         QuantSpec("int8", Channel(0), symmetric=False)]


def _intervals(seed):
    g = torch.Generator().manual_seed(seed)
    first = [torch.randn(4, 1024, generator=g) * 2 for _ in range(2)]  # two-sided, wide
    last = [-(torch.rand(4, 1024, generator=g) * 2 + 1) for _ in range(2)]  # in (-3, -1]
    return first, last


def test_every_native_histogram_observer_is_covered():
    assert {"entropy", "histogram", "histogram_mse", "mix", "percentile"} <= set(NATIVE)


@pytest.mark.parametrize("grid", ["pow2", "first"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", NATIVE)
def test_constant_one_gives_a_fresh_observer_on_the_last_interval(name, spec, grid):
    first, last = _intervals(1)
    o = get_observer(name, spec, averaging_constant=1.0, update_interval=2, grid=grid)
    fresh, every = get_observer(name, spec, grid=grid), get_observer(name, spec, grid=grid)
    for b in first + last:
        o(b)
        every(b)
    for b in last:
        fresh(b)
    got, want = o.calculate_qparams(), fresh.calculate_qparams()
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)
    if not spec.symmetric:  # (a symmetric one averages (-amax, amax): the next test)
        for got, want in zip(o.calculate_range(), fresh.calculate_range()):
            assert torch.equal(got, want)
    # the running min / max still cover every batch (the sync and the magnitude check)
    assert torch.equal(o.min_vals, every.min_vals) and torch.equal(o.max_vals, every.max_vals)


@pytest.mark.parametrize("name", NATIVE)
def test_a_mid_interval_read_bounds_by_the_pending_batches(name):
    spec = QuantSpec("uint8", symmetric=False)
    first, last = _intervals(2)
    o = get_observer(name, spec, averaging_constant=1.0, update_interval=2)
    fresh = get_observer(name, spec)
    o(first[0]), o(first[1]), o(last[0])  # one interval closed, one batch pending
    fresh(last[0])
    for got, want in zip(o.calculate_range(), fresh.calculate_range()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", NATIVE)
def test_the_window_survives_a_state_dict_round_trip_and_old_states_load(name):
    spec = QuantSpec("uint8", symmetric=False)
    first, last = _intervals(3)
    o = get_observer(name, spec, averaging_constant=0.5, update_interval=2)
    for b in (*first, last[0]):
        o(b)
    state = o.state_dict()
    assert state["window_hi"].numel() == 1
    back = get_observer(name, spec, averaging_constant=0.5, update_interval=2)
    back.load_state_dict(state)
    for got, want in zip(back.calculate_range(), o.calculate_range()):
        assert torch.equal(got, want)
    # a state saved before the window was kept: loads (strict), the data's min / max stand in
    old = {k: v for k, v in state.items() if not k.startswith("window_")}
    again = get_observer(name, spec, averaging_constant=0.5, update_interval=2)
    again.load_state_dict(old)
    assert again.window_lo.numel() == 0
    lo, hi = again.calculate_range()
    assert bool((lo <= hi).all())


@pytest.mark.parametrize("name", NATIVE)
def test_a_symmetric_spec_averages_max_abs_whatever_side_the_data_lay_on(name):
    """An interval of positive data, then one of negative data, each of amax ~4: the average
    of their (-amax, amax) ranges, not of their signed ends ((0, 4) and (-4, 0) gave
    (-2, 2): half the scale, found by probing)."""
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.rand(4096, generator=g) * 4, -torch.rand(4096, generator=g) * 4
    spec = QuantSpec("int8")
    o = get_observer(name, spec, averaging_constant=0.5)
    amax = []
    for b in (pos, neg):
        o(b)
        f = get_observer(name, spec)
        f(b)
        amax.append(f.calculate_range()[1].abs().maximum(f.calculate_range()[0].abs()))
    lo, hi = o.calculate_range()
    want = amax[0].lerp(amax[1], 0.5)
    assert torch.equal(hi, want) and torch.equal(lo, -want)
