"""Pins from a mutation round (s71) on the histogram observers (observers/histogram.py,
histogram_ema.py, histogram_estimate.py): behaviour the rest of the suite left free: the
``MIN_BINS`` and grid-name checks, float32 units under ``sync_every_step``, the first grid's
top bin moved into a full native grid's last bin, a step-synced EMA interval kept through
``sync_plan``, ``reset`` restarting the interval, ``histogram``'s default ``dst_nbins``, the
EMA mode refused across modes before any estimate, and ordinary tensors from
``calculate_range``. Expected values come from the module docs and docstrings, never from a
printed result."""

import math

import pytest
import torch

from quantscope import QuantSpec
from quantscope.observers.histogram import L2HistogramObserver, PercentileObserver

ASYM = QuantSpec("uint8", symmetric=False)


def test_bins_below_min_bins_are_refused_and_min_bins_is_taken():
    """``MIN_BINS`` (16) is the fewest ``bins`` a native histogram observer takes."""
    assert PercentileObserver.MIN_BINS == 16
    assert PercentileObserver(bins=16).bins == 16
    with pytest.raises(ValueError, match="bins"):
        PercentileObserver(bins=15)


def test_a_grid_other_than_pow2_or_first_is_refused():
    with pytest.raises(ValueError, match="grid must be 'pow2' or 'first'"):
        PercentileObserver(grid="linear")


def test_step_synced_observers_take_float32_units():
    """The native grid's ops read bf16 / fp16 units as they are, but a step exchange gathers
    float32 units: ``sync_every_step`` turns ``units_in_input_dtype`` off."""
    o = PercentileObserver()
    assert o.units_in_input_dtype
    o.sync_every_step = True
    assert not o.units_in_input_dtype


def test_leaving_a_full_native_grid_moves_the_top_bin_into_the_last_bin():
    """Leaving the first grid, each torch.histc bin goes to the native bin holding its centre:
    the first grid's top bin too, where that is the native grid's last bin (grid ``[-1, 15)``,
    width 1, exactly 16 bins for ``[-0.5, 14.9]`` and zero)."""
    bins = 16
    o = PercentileObserver(ASYM, bins=bins, grid="first")
    x = torch.linspace(0.1, 14.9, 1000)[None]
    o(x)
    o(torch.tensor([[-0.5]]))  # below the first grid: leaves it
    assert not bool(o.linear_grid)
    first = -1  # floor(-0.5 / 1)
    w0 = (14.9 - 0.1) / bins
    want = [0] * bins
    want[math.floor(-0.5) - first] += 1
    for i, n in enumerate(torch.histc(x, bins, float(x.min()), float(x.max())).long().tolist()):
        want[math.floor(0.1 + (i + 0.5) * w0) - first] += n
    h = o.current_histogram()
    assert (float(h.lo[0]), float(h.hi[0])) == (-1.0, 15.0)
    assert h.counts[0].tolist() == want


def test_sync_plan_keeps_a_step_synced_interval_going():
    """Before a sync, a rank's batches since the last estimate join its average, except
    where ranks are step-synced (they agree already): their interval goes on, its batch and
    histogram kept, no estimate averaged in."""
    o = PercentileObserver(ASYM, bins=64, averaging_constant=0.5, update_interval=2)
    x = torch.linspace(-1.0, 3.0, 100)[None]
    o(x)
    o.sync_every_step = True
    o.sync_plan()
    assert (o._pending, int(o.pending), o.ema_lo.numel()) == (1, 1, 0)
    assert int(o.hist_counts.sum()) == x.numel()


def test_reset_starts_the_ema_interval_anew():
    """After ``reset`` the EMA mode's interval restarts: one batch of an interval of two is
    pending, not the interval's close (no estimate averaged in yet)."""
    o = PercentileObserver(ASYM, bins=64, averaging_constant=0.5, update_interval=2)
    x = torch.linspace(-1.0, 3.0, 100)[None]
    o(x)
    o.reset()
    o(x)
    assert (o._pending, int(o.pending), o.ema_lo.numel()) == (1, 1, 0)
    assert int(o.hist_counts.sum()) == x.numel()


def test_l2_histogram_default_dst_nbins_is_two_to_the_integer_bits():
    """torch.ao's ``dst_nbins`` for the spec: ``2 ** bits`` of an integer format (int4: 16)."""
    assert L2HistogramObserver(QuantSpec("int4")).dst_nbins == 16


@pytest.mark.parametrize("saved, loaded", [(0.5, None), (None, 0.5)], ids=["ema", "accumulating"])
def test_a_state_of_the_other_mode_is_refused_before_any_estimate(saved, loaded):
    """The EMA mode is part of what a histogram state means (its record's ``ema`` entry): a
    state of the other mode is refused, also before an interval closed (its buffers alone
    cannot tell the modes apart there)."""
    o = PercentileObserver(ASYM, bins=64, averaging_constant=saved, update_interval=2)
    o(torch.linspace(-1.0, 3.0, 100)[None])
    other = PercentileObserver(ASYM, bins=64, averaging_constant=loaded, update_interval=2)
    with pytest.raises(ValueError, match="EMA mode"):
        other.load_state_dict(o.state_dict())


def test_calculate_range_hands_back_ordinary_tensors():
    """The estimate runs under ``torch.inference_mode``, the clip outside it: the range is
    ordinary tensors (an inference tensor refuses in-place updates outside that mode)."""
    o = PercentileObserver(ASYM, bins=64)
    o(torch.linspace(-1.0, 3.0, 100)[None])
    lo, hi = o.calculate_range()
    assert not lo.is_inference() and not hi.is_inference()
    lo.add_(0.0)
