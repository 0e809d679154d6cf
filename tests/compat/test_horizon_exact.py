"""compat.horizon against Horizon observer_v2's own formulas, written out here (the plugin is
not installable): KL's ``_compute_amax_entropy``, the signed ends Percentile / MSE / Mix
average, and the ``qscheme`` / ``ch_axis`` / ``bins`` assertions of its constructors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from peak_memory import extra_peak_mb

from quantscope.compat import horizon as hz


# ------------------------------------------------------------------ Horizon's formulas
def _entropy(pk, qk):  # _entropy_torch
    pk = pk / pk.sum() if pk.sum() != 0 else pk
    qk = (qk / qk.sum() if qk.sum() != 0 else qk) + 1e-10
    return torch.sum(-qk * torch.special.entr(pk / qk))


def kl_amax(hist, edges, nq=128, start=128):
    """_compute_amax_entropy, loop for loop (stride 1)."""
    bins = hist.clone()
    bins[0] = bins[1]
    bn = bins.numpy()
    div = []
    for i in range(start, len(bins) + 1):
        dens = np.zeros(nq)
        d = np.digitize(range(i), np.linspace(0, i, nq + 1)) - 1
        d[bn[:i] == 0] = -1
        for k, g in enumerate(d):
            if g != -1:
                dens[g] += bn[k]
        for key, val in Counter(d).items():
            if key != -1:
                dens[key] /= val
        q = np.array([dens[g] if g != -1 else 0.0 for g in d])
        p = bins[:i].clone()
        p[-1] += torch.sum(bins[i:])
        div.append(_entropy(p.double(), torch.from_numpy(q)))
    div = torch.as_tensor(div)
    sm = torch.as_tensor([torch.sum(div[j:j + 9]) for j in range(len(div) - 9 - 1)][::-1])
    return edges[len(sm) - 1 - torch.argmin(sm) + start + 4]


def kl_observer_amax(x, bins=512):
    a = x.detach().float().abs()
    return kl_amax(torch.histc(a, bins, 0.0, a.max()), torch.linspace(0, a.max(), bins + 1))


def percentile_ends(x, p=99.99, bins=2048):
    mn, mx = torch.aminmax(x)
    r = torch.max(-mn, mx)
    h = torch.histc(x.abs(), bins=bins, min=0.0, max=r)
    clip = (torch.searchsorted(torch.cumsum(h, 0), p / 100 * x.numel()) + 0.5) * (r / bins)
    return max(mn, -clip), min(mx, clip)


def mse_ends(x):
    mn, mx = torch.aminmax(x)
    errs = []
    for i in range(95):
        s = torch.max(-mn, mx) * (1 - 0.01 * i) / 127.5
        errs.append(torch.linalg.norm(torch.round(x / s).clamp(-128, 127) * s - x))
    last = 94 - int(torch.argmin(torch.stack(errs[::-1])))
    return mn * (1.0 - last * 0.01), mx * (1.0 - last * 0.01)


def ema_scale(ends, c):
    lo, hi = ends[0]
    for a, b in ends[1:]:
        lo, hi = lo + c * (a - lo), hi + c * (b - hi)
    return float(torch.max(-lo, hi) / 127.5)


def heavy(seed, shape=(64, 128)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x ** 3 if seed % 2 else x


# ------------------------------------------------------------------------------ KL
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bins", [256, 512])
def test_kl_observer_is_horizons_compute_amax_entropy(seed, bins):
    x = heavy(seed)
    o = hz.KLObserver(bins=bins)
    o(x)
    want = float(kl_observer_amax(x, bins)) / 127.5
    assert float(o.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)


def test_kl_search_temporaries_stay_small():
    # the search over every candidate held [c, bins] float64 temporaries of 4M elements each
    # (+235 MB at 2048 bins for a 16 KB histogram); chunks of 64K elements: ~15 MB with the
    # batch's histogram (the search runs at the end of each update interval: here the batch)
    o = hz.KLObserver(bins=2048)
    with extra_peak_mb() as extra:
        o(heavy(5))
        o.calculate_qparams()
    assert extra() < 64


def test_kl_ema_of_per_interval_thresholds():
    xs = [heavy(s) * (1 + s) for s in range(3)]
    o = hz.KLObserver(averaging_constant=0.5)
    for x in xs:
        o(x)
    amax = [kl_observer_amax(x) for x in xs]
    want = ema_scale([(-a, a) for a in amax], 0.5)
    assert float(o.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------- signed ends (EMA)
SKEWED = [torch.linspace(-10, 1, 1001), torch.linspace(-1, 10, 1001),
          torch.linspace(-3, 0.5, 777)]


@pytest.mark.parametrize("cls, ends", [(hz.PercentileObserver, percentile_ends),
                                       (hz.MSEObserver, mse_ends)])
def test_signed_ends_are_averaged(cls, ends):
    o = cls(averaging_constant=0.5)
    for b in SKEWED:
        o(b)
    want = ema_scale([ends(b) for b in SKEWED], 0.5)
    assert float(o.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)


def test_mix_signed_ends_are_averaged():
    ps = (99.9, 99.95, 99.99, 99.993, 99.995, 99.997, 99.999, 99.9995, 99.9999)

    def best(x):  # get_min_max_of_percentile_observer, then the least L2 error
        cands = [percentile_ends(x, p) for p in ps]
        err = [torch.linalg.norm(x - torch.round(x / s).clamp(-128, 127) * s)
               for s in (torch.max(-lo, hi) / 127.5 for lo, hi in cands)]
        return cands[int(np.argmin(err))]

    # batches where the histogram's error ranks the candidates as Horizon's exact L2 does
    # (on linspace(-10, 1) quantscope's histogram score picks another percentile)
    xs = SKEWED[1:] + [torch.linspace(-0.5, 4, 1001)]
    o = hz.MixObserver(averaging_constant=0.5)
    for b in xs:
        o(b)
    want = ema_scale([best(b) for b in xs], 0.5)
    assert float(o.calculate_qparams()[0]) == pytest.approx(want, rel=1e-5)


def interval_ends(ends, xs):
    """Per interval of two batches whose first holds the range (Horizon's interval histogram
    is then that of one batch holding both), the signed ends of the interval."""
    return [ends(torch.cat(xs[k:k + 2])) for k in range(0, len(xs), 2)]


# per interval a wide batch, then a narrow one inside its range
WIDE_FIRST = [x for w in (heavy(1), heavy(3) * 2) for x in (w, w.flip(0) * 0.25)]


@pytest.mark.parametrize("cls", [hz.PercentileObserver, hz.MixObserver])
def test_state_dict_round_trips_mid_interval(cls):
    """Saved after an interval's first batch, loaded into a new observer and continued: the
    interval's signed min / max (the window the ends are clipped to) comes back too."""
    def make():
        return cls(update_interval=2, averaging_constant=0.5)

    ref = make()
    for x in WIDE_FIRST:
        ref(x)
    for cut in (1, 3):  # mid-interval (the window holds the wide batch), in the second too
        a = make()
        for x in WIDE_FIRST[:cut]:
            a(x)
        b = make()
        b.load_state_dict(a.state_dict())
        for x in WIDE_FIRST[cut:]:
            b(x)
        assert torch.equal(b.calculate_qparams()[0], ref.calculate_qparams()[0]), cut
    if cls is hz.PercentileObserver:  # Horizon's formula
        want = ema_scale(interval_ends(percentile_ends, WIDE_FIRST), 0.5)
        assert float(ref.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)
    # reset forgets the window with the rest: the narrow batches alone, as a fresh observer's
    a, fresh = make(), make()
    a(WIDE_FIRST[0])
    a.reset()
    for o in (a, fresh):
        o(WIDE_FIRST[1])
        o(WIDE_FIRST[3])
    assert torch.equal(a.calculate_qparams()[0], fresh.calculate_qparams()[0])


def test_state_saved_without_the_window_still_loads():
    """A state saved before the window was state (no window keys) loads strictly; at an
    interval's end the window is empty anyway, so the result is the uninterrupted one."""
    a = hz.PercentileObserver(update_interval=2, averaging_constant=0.5)
    for x in WIDE_FIRST[:2]:
        a(x)
    sd = {k: v for k, v in a.state_dict().items() if not k.startswith("window_")}
    b = hz.PercentileObserver(update_interval=2, averaging_constant=0.5)
    b.load_state_dict(sd)
    for x in WIDE_FIRST[2:]:
        b(x)
    want = ema_scale(interval_ends(percentile_ends, WIDE_FIRST), 0.5)
    assert float(b.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("cls, ends", [(hz.PercentileObserver, percentile_ends),
                                       (hz.KLObserver, None)])
def test_reading_qparams_mid_interval_changes_nothing(cls, ends):
    """A read after an interval's first batch neither commits it nor starts a new one: the
    later result is the EMA of whole intervals."""
    o = cls(update_interval=2, averaging_constant=0.5)
    for i, x in enumerate(WIDE_FIRST):
        o(x)
        if i % 2 == 0:
            o.calculate_qparams()
    if ends is None:
        amax = [kl_observer_amax(torch.cat(WIDE_FIRST[k:k + 2])) for k in (0, 2)]
        want = ema_scale([(-a, a) for a in amax], 0.5)
    else:
        want = ema_scale(interval_ends(ends, WIDE_FIRST), 0.5)
    assert float(o.calculate_qparams()[0]) == pytest.approx(want, rel=1e-6)


# ------------------------------------------------------------------------ assertions
@pytest.mark.parametrize("make", [
    lambda: hz.MinMaxObserver(qscheme=torch.per_channel_symmetric),
    lambda: hz.MinMaxObserver(ch_axis=0),
    lambda: hz.MovingAveragePerChannelMinMaxObserver(ch_axis=-1),
    lambda: hz.horizon_spec(ch_axis=1),
])
def test_qscheme_and_ch_axis_must_agree(make):
    with pytest.raises(ValueError, match="ch_axis should be") as err:
        make()
    assert isinstance(err.value, AssertionError)


def test_qscheme_decides_granularity():
    o = hz.MinMaxObserver(ch_axis=1, qscheme=torch.per_channel_symmetric)
    o(torch.randn(4, 8))
    assert o.calculate_qparams()[0].shape == (8,)


def test_kl_bins_below_256_is_refused():
    with pytest.raises(ValueError, match="bins must be an integer >= 256") as err:
        hz.KLObserver(bins=200)
    assert isinstance(err.value, AssertionError)
    hz.KLObserver(bins=256)


def test_kl_start_bin_zero_is_refused_when_made():
    """Horizon's loop fails at threshold 0 (the last bin of none): refused when the observer is
    made, not at its first estimate."""
    with pytest.raises(ValueError, match=r"start_bin must be >= 1 \(threshold 0 holds no "
                                         r"bin\), got 0") as err:
        hz.KLObserver(start_bin=0)
    assert isinstance(err.value, AssertionError)
    assert hz.KLObserver(start_bin=1).start_bin == 1


@pytest.mark.parametrize("shape", ["flat-part", "flat-all", "ramp"])
def test_kl_search_on_tied_and_edge_histograms_is_horizons(shape):
    # s59's mutants: the windows' count and the last minimum among ties (a flat histogram's
    # divergences tie at 0; one over every bin has its best threshold in the last window)
    from quantscope.estimators.entropy import horizon_entropy_amax
    from quantscope.stats.histogram import Hist

    bins = 512
    counts = {"flat-part": torch.cat([torch.full((300,), 4), torch.zeros(212)]),
              "flat-all": torch.full((bins,), 4),
              "ramp": torch.arange(bins, 0, -1)}[shape].long()
    got = horizon_entropy_amax(Hist(counts[None], torch.zeros(1), torch.ones(1),
                                    absolute=True))
    want = kl_amax(counts.double(), torch.linspace(0, 1, bins + 1))
    assert float(got) == pytest.approx(float(want), rel=1e-6), (float(got), float(want))
