"""Pins from a mutation round (s65) on the native histogram observers
(observers/histogram.py): the option checks at construction (``update_interval``,
``skip_zeros``, the MSE ``stride``, mix's ``start_bin``), the documented defaults (percentile
99.99 at the bin centre, the MSE search's, ``histogram``'s polish), the memory limit of
``units x bins`` int64 counts, the signed histogram of ``histogram`` under a symmetric spec,
the entropy observer's search with its own ``num_bits`` and TensorRT's unsigned mode, the
``bins`` in the repr and the first grid's move to the native grid (bin 0's count kept).
Expected values come from the docstrings and docs/guide/observers.md (the percentile's first
bin reaching p % of the total, TensorRT's KL for the given bits, torch.histc's first grid)."""

import math

import pytest
import torch
from test_entropy_spec_bits import _heavy

from quantscope import QuantSpec
from quantscope.estimators.entropy import entropy_amax
from quantscope.observers.histogram import (
    EntropyObserver,
    HistogramMSEObserver,
    L2HistogramObserver,
    MixObserver,
    PercentileObserver,
)


def _native_exponent(lo: float, hi: float, bins: int) -> int:
    """The smallest ``e`` whose aligned grid of width ``2 ** e`` holds ``[lo, hi]`` and zero in
    ``bins`` bins (values of ordinary magnitude: the float32 floor does not bind)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    return next(k for k in range(-126, 127)
                if math.floor(hi / 2.0**k) - math.floor(lo / 2.0**k) + 1 <= bins)


def test_update_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="update_interval"):
        PercentileObserver(averaging_constant=0.5, update_interval=0)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_skip_zeros_takes_only_a_bool(bad):
    # bool("no") is True: a string (or 0 / 1, None) would switch skipping silently
    with pytest.raises(ValueError, match="skip_zeros"):
        PercentileObserver(skip_zeros=bad)


def test_l2_histogram_bins_signed_values_for_a_symmetric_spec():
    """``histogram`` (torch.ao's search) always histograms the signed values."""
    o = L2HistogramObserver(QuantSpec("int8"), bins=64)
    x = torch.tensor([-4.0, -1.0, 0.5, 1.0])
    o(x)
    h = o.current_histogram()
    assert not h.absolute
    assert float(h.lo[0]) <= -4.0
    w = (h.hi - h.lo) / h.bins
    # -4.0 in the bin floor((-4 - lo) / w) of the signed grid
    assert int(h.counts[0, int((-4.0 - float(h.lo[0])) / float(w[0]))]) == 1


@pytest.mark.parametrize("units", [1, 3])
def test_memory_limit_counts_eight_bytes_a_bin_and_allows_the_limit_itself(units):
    """``units x bins`` int64 counts: up to ``max_hist_bytes`` taken, one byte less refused."""
    spec = QuantSpec("int8", "channel:0") if units > 1 else QuantSpec("int8")
    x = torch.randn(units, 40)
    o = PercentileObserver(spec, bins=32)
    o.max_hist_bytes = units * 32 * 8
    o(x)
    assert int(o.current_histogram().counts.sum()) == x.numel()
    o = PercentileObserver(spec, bins=32)
    o.max_hist_bytes = units * 32 * 8 - 1
    with pytest.raises(ValueError, match="max_hist_bytes"):
        o(x)


def test_percentile_defaults_to_99_99_at_the_bin_centre():
    """Default ``percentile=99.99``, ``convention="center"``: the first bin whose cumulative
    count reaches 99.99 % of the total, reported at ``(i + 0.5) w`` (symmetric: of |x|)."""
    x = torch.arange(1, 20001, dtype=torch.float32) / 1000.0  # 0.001 .. 20.0
    o = PercentileObserver(bins=256)
    o(x)
    h = o.current_histogram()
    cum = h.counts[0].cumsum(0)
    i = int(torch.nonzero(cum * 10000 >= 9999 * x.numel())[0])
    w = float(h.width[0])
    lo, hi = o.calculate_range()
    assert float(hi[0]) == pytest.approx(min((i + 0.5) * w, 20.0), rel=1e-6)
    assert float(lo[0]) == -float(hi[0])


@pytest.mark.parametrize("cls, want", [
    (HistogramMSEObserver, {"start_bin": 128, "stride": 1, "refine": 16}),
    (L2HistogramObserver, {"polish": 256}),
    (PercentileObserver, {"percentile": 99.99, "convention": "center", "bins": 2048}),
], ids=["mse", "histogram", "percentile"])
def test_documented_defaults(cls, want):
    o = cls(QuantSpec("int8"))
    assert {k: getattr(o, k) for k in want} == want


def test_repr_names_the_bins():
    assert "bins=64" in repr(PercentileObserver(bins=64))


@pytest.mark.parametrize("spec, kw, bits, unsigned", [
    (QuantSpec("int8"), {"num_bits": 4}, 4, False),  # num_bits given: the spec's not used
    (QuantSpec("uint8", symmetric=False), {}, 8, True),  # TensorRT's unsigned 2 ** 8 levels
], ids=["num_bits", "unsigned"])
def test_entropy_searches_with_its_bits_and_unsigned_mode(spec, kw, bits, unsigned):
    """The range is TensorRT's KL threshold for the observer's own ``num_bits`` / unsigned
    mode on its histogram (then clipped to the data), not the other mode's."""
    x = _heavy(2).abs()
    o = EntropyObserver(spec, **kw)
    o(x)
    h = o.current_histogram()
    want = entropy_amax(h, num_bits=bits, unsigned=unsigned)
    signed8 = entropy_amax(h, num_bits=8, unsigned=False)  # the int8 default's search
    assert float(want[0]) != float(signed8[0])  # the mode matters on this data
    _, hi = o.calculate_range()
    assert float(hi[0]) == min(float(want[0]), float(x.max()))


def test_mse_stride_below_one_is_refused():
    with pytest.raises(ValueError, match="stride"):
        HistogramMSEObserver(stride=0)


def test_mix_start_bin_below_zero_is_refused():
    # (without the entropy candidate, whose own check would refuse it too)
    with pytest.raises(ValueError, match="start_bin"):
        MixObserver(start_bin=-1, candidates=("minmax", "mse"))


def test_leaving_the_first_grid_moves_every_bin_bin_0_included():
    """``grid="first"``: the first batch leaving ``[0, max |x|]`` moves each torch.histc bin
    (bin 0 too) to the native bin of its centre, then bins the batch exactly."""
    bins = 16
    o = PercentileObserver(bins=bins, grid="first")  # symmetric: |x| from 0
    a = torch.tensor([0.03, -0.3, 0.6, 0.9, -1.0])  # bin 0 holds 0.03
    b = torch.tensor([3.0, -2.0])
    o(a)
    o(b)
    assert not bool(o.linear_grid)
    w = 2.0 ** _native_exponent(0.0, 3.0, bins)
    want = [0] * bins
    for i, n in enumerate(torch.histc(a.abs(), bins, 0.0, 1.0).long().tolist()):
        want[math.floor((i + 0.5) / bins / w)] += n  # the old bin's centre
    for v in b.abs().tolist():
        want[math.floor(v / w)] += 1
    h = o.current_histogram()
    assert (float(h.lo[0]), float(h.hi[0])) == (0.0, bins * w)
    assert h.counts[0].tolist() == want
