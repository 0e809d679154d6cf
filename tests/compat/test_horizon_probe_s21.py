"""compat.horizon, probe s21: KL's first grid appends bins of its width when a later batch of
the interval passes its top (not the approximate re-bin onto the power-of-two grid), and
Horizon keywords that ``**kwargs`` repeated (``ch_axis``, ``spec``) are clear errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from quantscope.compat import horizon as hz
from quantscope.estimators.entropy import horizon_entropy_amax
from quantscope.stats.histogram import Hist


def randn(n, seed, shape=(32, 64)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def amax_of(counts, top):
    return horizon_entropy_amax(Hist(counts[None], torch.zeros(1), torch.tensor([top]), True))


def appended_at_end(xs, bins=512):
    """The probe's reference: every batch's ``|x|`` histc on the final appended grid."""
    w = xs[0].abs().max().item() / bins
    nb = max(bins, math.ceil(max(x.abs().max().item() for x in xs) / w))
    counts = sum(torch.histc(x.abs(), nb, 0, nb * w).long() for x in xs)
    return counts, amax_of(counts, nb * w)


def appended_in_turn(xs, bins=512):
    """Appending as it goes: each batch on the grid of its time (zero bins appended first)."""
    w = xs[0].abs().max().item() / bins
    counts = torch.zeros(bins, dtype=torch.int64)
    for x in xs:
        nb = max(len(counts), math.ceil(x.abs().max().item() / w))
        counts = torch.cat([counts, counts.new_zeros(nb - len(counts))])
        counts += torch.histc(x.abs(), nb, 0, nb * w).long()
    return counts, len(counts) * w


def test_kl_interval_appends_bins_probe_case():
    """The probe's seed: the re-bin gave max |x| (4.1203, +10.9 %); now the appended grid's."""
    xs = randn(10, seed=6)
    o = hz.KLObserver(update_interval=10)
    for x in xs:
        o(x)
    _, want = appended_at_end(xs)
    assert torch.equal(o.ema_hi, want)
    assert o.ema_hi < max(x.abs().max() for x in xs)  # clipped, not max |x|


@pytest.mark.parametrize("seed", range(4))
def test_kl_interval_counts_equal_appended_reference(seed):
    """Seed 0's first max sits on the end reference's bin edge 512 w (its float32 top
    decides the bin): appending keeps it where the first histc put it."""
    xs = randn(10, seed)
    o = hz.KLObserver(update_interval=10)
    for x in xs[:9]:
        o(x)
    counts, _ = appended_in_turn(xs[:9])
    assert o._linear and torch.equal(o.current_histogram().counts[0], counts)
    o(xs[9])
    want = amax_of(*appended_in_turn(xs))
    assert torch.equal(o.ema_hi, torch.minimum(want, max(x.abs().max() for x in xs)))


@pytest.mark.parametrize("limit", [("GROW_LIMIT", 2), ("max_hist_bytes", 8 * 600)])
def test_kl_growth_past_the_bound_falls_back_to_the_rebin(limit):
    xs = randn(3, seed=1)
    top = xs[0].abs().max()
    xs[1][0, 0] = top * 1.9  # 973 bins: inside GROW_LIMIT 2, past 600 bins of max_hist_bytes
    o = hz.KLObserver(update_interval=4)
    setattr(o, *limit)
    o(xs[0])
    o(xs[1])
    grows = limit[0] == "GROW_LIMIT"
    assert o._linear == grows
    assert o.hist_counts.shape == (1, math.ceil(1.9 * 512) if grows else 512)
    xs[2][0, 0] = top * 2.5  # past 2 x bins: the re-bin (once; then the native grid)
    o(xs[2])
    assert not o._linear and o.hist_counts.shape == (1, 512)
    amax = o.calculate_range()[1]  # the unfinished interval's estimate
    assert torch.isfinite(amax).all() and 0 < amax <= top * 2.5


@pytest.mark.parametrize("case", ["modelopt_collect", "modelopt_forward", "GROW_LIMIT",
                                  "max_hist_bytes"])
def test_a_first_grid_grows_to_its_bound_inclusive(case):
    """The growth bound is inclusive ("at most ``GROW_LIMIT x bins``", and
    ``max_hist_bytes``: AppendingFirstGrid._fits): a batch needing exactly that many bins
    appends them (the exact first grid kept), one bin more moves to the native grid (pins
    G01: ``<`` for ``<=``, a whole bin width of batches moved approximately)."""
    from quantscope.compat.modelopt import HistogramCalibrator

    def make():
        if case.startswith("modelopt"):
            return HistogramCalibrator(num_bins=16)
        o = hz.KLObserver(update_interval=4)
        if case == "max_hist_bytes":
            o.max_hist_bytes = 8 * 600
        return o

    first, (at, past), bins = [[1.0, -0.5, 0.25]], (16.0, 16.0 + 1 / 512), 512  # w = 1 / 512
    if case.startswith("modelopt"):  # 16 bins of 1/16: 64 x 16 = 1024 bins reach 64.0
        (at, past), bins = (64.0, 64.0625), 16
    elif case == "max_hist_bytes":  # width 1: 600 int64 bins of 4800 bytes reach 600.0
        first, (at, past) = [[512.0, 1.0]], (600.0, 601.0)
    for top, grows in ((at, True), (past, False)):
        o = make()
        step = o.collect if case == "modelopt_collect" else o
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the move to the native grid is said)
            step(torch.tensor(first))
            step(torch.tensor([[top, 3.0, -2.0]]))
        assert o._linear == grows, top
        limit = 600 if case == "max_hist_bytes" else o.GROW_LIMIT * bins
        assert o.hist_counts.shape[-1] == (limit if grows else bins), top


def test_kl_far_batch_falls_back_finite_within_data():
    xs = randn(2, seed=2)
    xs[1][3, 4] = xs[0].abs().max() * 17  # 8704 bins > 16 x 512
    o = hz.KLObserver(update_interval=3)
    for x in xs:
        o(x)
    assert not o._linear and o.hist_counts.shape == (1, 512)
    lo, hi = o.calculate_range()
    scale, zp = o.calculate_qparams()
    assert torch.isfinite(scale).all() and zp.item() == 0
    assert 0 < hi.item() <= xs[1].abs().max().item() and lo.item() == -hi.item()


def test_kl_state_dict_round_trip_in_a_grown_interval():
    xs = randn(6, seed=6)
    a = hz.KLObserver(update_interval=6)
    for x in xs[:4]:
        a(x)
    assert a.hist_counts.shape[1] > 512  # grown (seed 6: the 5th batch grows it further)
    b = hz.KLObserver(update_interval=6)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.current_histogram().counts, a.current_histogram().counts)
    assert torch.equal(b.current_histogram().hi, a.current_histogram().hi)
    for x in xs[4:]:
        a(x)
        b(x)
    assert torch.equal(a.ema_hi, b.ema_hi)
    want = amax_of(*appended_in_turn(xs))
    assert torch.equal(a.ema_hi, torch.minimum(want, max(x.abs().max() for x in xs)))


def test_kl_state_of_other_bins_is_refused():
    """A first grid of 1024 bins that never grew is no grown grid of 512: refused, not read
    with a top of twice its own."""
    xs = randn(2, seed=0)
    a = hz.KLObserver(bins=1024, update_interval=5)
    for x in xs:
        a(x * 0.5 if x is xs[1] else x)
    b = hz.KLObserver(update_interval=5)
    with pytest.raises(ValueError, match="1024 bins into one of bins=512"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="9000 bins"):  # past 16 x 512
        b.load_state_dict({**a.state_dict(), "hist_counts": torch.zeros(1, 9000).long()})


def test_kl_interval_reset_goes_back_to_bins():
    xs = randn(4, seed=6)
    o = hz.KLObserver(update_interval=2)
    o(xs[0])
    xs[1][0, 0] = xs[0].abs().max() * 1.5
    o(xs[1])  # the interval's last batch: grown, then estimated and reset
    assert o.hist_counts.shape == (1, 512) and o._linear
    o(xs[2])
    assert o.hist_counts.shape == (1, 512)
    assert torch.equal(o.hist_hi, xs[2].abs().max()[None])  # the new interval's first grid
    o.reset()
    assert o.hist_counts.numel() == 0


# ------------------------------------------------------------ repeated keywords
def test_moving_average_minmax_takes_a_negative_ch_axis():
    x = randn(1, seed=3)[0]
    a, b = hz.MovingAverageMinMaxObserver(ch_axis=-1), hz.MovingAverageMinMaxObserver()
    a(x)
    b(x)
    assert torch.equal(a.calculate_qparams()[0], b.calculate_qparams()[0])
    assert a.ch_axis == -1 and a.calculate_qparams()[0].shape == (1,)


@pytest.mark.parametrize("ch_axis", [0, 1])
def test_moving_average_minmax_refuses_a_channel_axis(ch_axis):
    with pytest.raises(hz.HorizonArgumentError, match="ch_axis") as err:
        hz.MovingAverageMinMaxObserver(ch_axis=ch_axis)
    assert "MovingAveragePerChannelMinMaxObserver" in str(err.value)
    assert isinstance(err.value, AssertionError)


@pytest.mark.parametrize("cls", [hz.MinMaxObserver, hz.MovingAverageMinMaxObserver,
                                 hz.MovingAveragePerChannelMinMaxObserver, hz.KLObserver,
                                 hz.PercentileObserver, hz.MixObserver, hz.MSEObserver])
def test_spec_keyword_is_a_clear_error(cls):
    with pytest.raises(TypeError, match="not a quantscope spec"):
        cls(spec=None)
