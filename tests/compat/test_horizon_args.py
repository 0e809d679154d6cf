"""compat.horizon: every documented argument of every Horizon class, against the formula.

Horizon's plugin has no public test suite; REFERENCES.md has its rules: symmetric only,
``scale = amax / ((quant_max - quant_min) / 2)``, an EMA (c 0.01) of each batch's estimate,
percentile on each batch's ``|x|`` histogram (bin centre), MSE over ``amax * (1 - 0.01 i)``
(``i`` in ``range(0, 95, stride)``, the last least L2 error), KL every ``update_interval``
batches, Mix among percentiles 99.9 .. 99.9999, ``is_sync_quantize`` all-reducing each rank's
averaged min / max (MIN / MAX) when the qparams are read.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from ports import rank_results, spawn_ranks

from quantscope.compat import horizon as hz

MINMAX = [hz.MinMaxObserver, hz.MovingAverageMinMaxObserver,
          hz.MovingAveragePerChannelMinMaxObserver]
HIST = [hz.PercentileObserver, hz.MSEObserver, hz.KLObserver, hz.MixObserver]
ALL = MINMAX + HIST
PER_TENSOR_ONLY = [hz.PercentileObserver, hz.KLObserver, hz.MixObserver]  # Horizon asserts it
WITH_CH_AXIS = [c for c in ALL if c is not hz.MovingAverageMinMaxObserver
                and c not in PER_TENSOR_ONLY]


def batches(n=3, shape=(32, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * s + 0.3 * s for s in (1.0, 2.5, 0.7, 1.6)[:n]]


def per_tensor(cls, **kw):
    if cls is hz.MovingAveragePerChannelMinMaxObserver:
        return cls(ch_axis=-1, qscheme=torch.per_tensor_symmetric, **kw)
    return cls(**kw)


# ------------------------------------------------------------------- reference formulas
def percentile_amax(x, p=99.99, bins=2048):
    """Horizon: ``|x|`` histogram over [0, max |x|], centre of the first bin reaching p."""
    a = x.abs().double().flatten()
    amax = float(a.max())
    counts = torch.histc(a, bins, 0, amax)
    cdf = counts.cumsum(0) / counts.sum()
    i = int((cdf >= p / 100).nonzero()[0])
    return min((i + 0.5) * amax / bins, amax)


def mse_amax(x, stride=1, qmin=-128, qmax=127):
    """Horizon: candidates ``amax * (1 - 0.01 i)``, L2 error, the last minimum."""
    amax = x.abs().max().double()
    x = x.double()
    best = None
    for i in range(0, 95, stride):
        c = amax * (1 - 0.01 * i)
        s = c / ((qmax - qmin) / 2)
        err = ((torch.clamp(torch.round(x / s), qmin, qmax) * s - x) ** 2).sum()
        if best is None or err <= best[0]:
            best = (err, float(c))
    return best[1]


def ema(values, c):
    out = values[0]
    for v in values[1:]:
        out = out + c * (v - out)
    return out


def scale_of(obs):
    return obs.calculate_qparams()[0].double()


def close(a, b, rtol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64), rtol=rtol), (a, b)


def single_batch_amax(cls, x, **kw):
    """A class's own estimate of one batch (an EMA of one value is that value)."""
    o = per_tensor(cls, **kw)
    o(x)
    return float(scale_of(o)) * 127.5


# ---------------------------------------------------------------------- common arguments
@pytest.mark.parametrize("cls", MINMAX)
@pytest.mark.parametrize("c", [0.01, 0.3])
def test_averaging_constant_minmax(cls, c):
    xs = batches()
    o = per_tensor(cls, averaging_constant=c)
    for x in xs:
        o(x)
    lo = ema([float(x.min()) for x in xs], c)
    hi = ema([float(x.max()) for x in xs], c)
    close(scale_of(o), [max(-lo, hi) / 127.5])


@pytest.mark.parametrize("cls", HIST)
@pytest.mark.parametrize("c", [0.01, 0.5])
def test_averaging_constant_histograms(cls, c):
    xs = batches()
    o = cls(averaging_constant=c)
    for x in xs:
        o(x)
    if cls is hz.KLObserver:  # a threshold of |x|: its EMA
        close(scale_of(o), [ema([single_batch_amax(cls, x) for x in xs], c) / 127.5])
        return
    ends = [signed_ends(cls, x) for x in xs]  # the EMA of each signed end
    lo, hi = ema([e[0] for e in ends], c), ema([e[1] for e in ends], c)
    close(scale_of(o), [max(-lo, hi) / 127.5])


def signed_ends(cls, x):
    """Horizon's ends of one batch: its min / max clipped at the batch's clip ``c``
    (Percentile, Mix: ``max(min, -c)``, ``min(max, c)``) or scaled by MSE's factor."""
    lo, hi = float(x.min()), float(x.max())
    if cls is hz.MSEObserver:
        f = mse_amax(x) / float(x.abs().max())
        return lo * f, hi * f
    c = percentile_amax(x) if cls is hz.PercentileObserver else single_batch_amax(cls, x)
    return max(lo, -c), min(hi, c)


@pytest.mark.parametrize("cls", WITH_CH_AXIS)
def test_ch_axis_is_per_channel_along_that_axis(cls):
    x = batches(1, (16, 6))[0] * torch.arange(1, 7)  # channels of different sizes
    o = cls(ch_axis=1, qscheme=torch.per_channel_symmetric)
    o(x)
    s = scale_of(o)
    want = [single_batch_amax(cls, x[:, j].contiguous()) / 127.5 for j in range(6)]
    assert s.shape == (6,)
    close(s, want)
    if cls is not hz.MovingAveragePerChannelMinMaxObserver:
        assert per_tensor(cls).spec.layout != o.spec.layout  # -1 (default): per tensor


@pytest.mark.parametrize("cls", MINMAX + [hz.PercentileObserver, hz.MSEObserver])
@pytest.mark.parametrize("dtype, qmin, qmax", [("qint16", -32768, 32767), ("qint4", -8, 7),
                                               (torch.qint8, -128, 127)])
def test_dtype_sets_the_code_range(cls, dtype, qmin, qmax):
    x = batches(1)[0]
    o = per_tensor(cls, dtype=dtype)
    o(x)
    if cls is hz.PercentileObserver:
        amax = percentile_amax(x)
    elif cls is hz.MSEObserver:
        amax = mse_amax(x, qmin=qmin, qmax=qmax)
    else:
        amax = float(x.abs().max())
    close(scale_of(o), [amax / ((qmax - qmin) / 2)])
    zp = o.calculate_qparams()[1]
    assert zp.dtype == torch.int64 and not zp.any() and (o.quant_min, o.quant_max) == (qmin,
                                                                                      qmax)


@pytest.mark.parametrize("cls", [hz.KLObserver, hz.MixObserver])
def test_dtype_of_kl_and_mix(cls):
    x = batches(1)[0]
    with pytest.raises(ValueError, match="dtype"):
        cls(dtype="qint32")
    o8, o4 = cls(), cls(dtype="qint4")
    o8(x)
    o4(x)
    assert (o4.quant_min, o4.quant_max) == (-8, 7)
    # the 4-bit estimate is priced for 15 levels: its scale is amax_4 / 7.5, not / 127.5
    assert float(scale_of(o4)) * 7.5 <= float(x.abs().max()) + 1e-6
    assert float(scale_of(o4)) > 5 * float(scale_of(o8))


@pytest.mark.parametrize("cls", MINMAX + [hz.PercentileObserver, hz.MSEObserver])
def test_quant_min_and_quant_max(cls):
    x = batches(1)[0]
    o = per_tensor(cls, quant_min=-63, quant_max=63)
    o(x)
    if cls is hz.PercentileObserver:
        amax = percentile_amax(x)
    elif cls is hz.MSEObserver:
        amax = mse_amax(x, qmin=-63, qmax=63)
    else:
        amax = float(x.abs().max())
    close(scale_of(o), [amax / 63])
    with pytest.raises(ValueError, match="quant_min"):
        per_tensor(cls, quant_min=-63)


@pytest.mark.parametrize("cls", ALL)
def test_qscheme_is_symmetric_only(cls):
    with pytest.raises(ValueError, match="symmetric"):
        cls(qscheme=torch.per_tensor_affine)
    with pytest.raises(ValueError, match="symmetric"):
        cls(qscheme=torch.per_channel_affine)


@pytest.mark.parametrize("cls", PER_TENSOR_ONLY)
def test_per_tensor_only_classes_refuse_per_channel(cls):
    with pytest.raises(ValueError, match="only per_tensor_symmetric") as err:
        cls(ch_axis=0, qscheme=torch.per_channel_symmetric)
    assert isinstance(err.value, AssertionError)  # Horizon's assert


HORIZON_ARGS = ["ch_axis", "dtype", "qscheme", "quant_min", "quant_max", "is_sync_quantize",
                "factory_kwargs"]


@pytest.mark.parametrize("cls", ALL)
def test_positional_order_is_horizons(cls):
    """Horizon's positional parameters, in its order: each class's own, then
    ``averaging_constant`` and the base's (MovingAverageMinMaxObserver has no ``ch_axis``)."""
    own = {hz.PercentileObserver: ["percentile", "bins"], hz.MSEObserver: ["stride"],
           hz.KLObserver: ["bins", "update_interval"]}.get(cls, [])
    base = [a for a in HORIZON_ARGS if cls is not hz.MovingAverageMinMaxObserver
            or a != "ch_axis"]
    params = inspect.signature(cls).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [*own, "averaging_constant", *base]


def test_mix_takes_horizons_arguments_by_position():
    o = hz.MixObserver(0.5, -1, "qint16")
    o(batches(1)[0])
    assert (o.averaging_constant, o.ch_axis, o.quant_max, o.bins) == (0.5, -1, 32767, 2048)


@pytest.mark.parametrize("cls", ALL)
def test_factory_kwargs_device(cls):
    o = cls(factory_kwargs={"device": "meta"})
    assert {b.device.type for b in o.buffers()} == {"meta"}
    o = cls(factory_kwargs={"device": "cpu"})
    assert {b.device.type for b in o.buffers()} == {"cpu"}


# --------------------------------------------------------------- per-class arguments
@pytest.mark.parametrize("p", [90.0, 99.0, 99.99])
@pytest.mark.parametrize("bins", [16, 300, 2048])
def test_percentile_percentile_and_bins(p, bins):
    x = batches(1)[0]
    o = hz.PercentileObserver(percentile=p, bins=bins)
    o(x)
    close(scale_of(o), [percentile_amax(x, p, bins) / 127.5])


@pytest.mark.parametrize("stride", [1, 3, 7, 50])
def test_mse_stride(stride):
    x = batches(1)[0]
    x[0, 0] = 40.0  # an outlier: the best candidate lies well inside
    o = hz.MSEObserver(stride=stride)
    o(x)
    close(scale_of(o), [mse_amax(x, stride) / 127.5])


def test_kl_bins_sets_the_histogram():
    x = batches(1)[0]
    for bins in (256, 512, 1024):
        o = hz.KLObserver(bins=bins, update_interval=2)
        o(x)  # no estimate yet: the histogram holds the batch
        assert o.hist_counts.shape == (1, bins) and int(o.hist_counts.sum()) == x.numel()
    with pytest.raises(ValueError, match="start_bin"):
        hz.KLObserver(bins=64)(x)  # KL starts at bin 128: fewer bins leave no candidate


def test_kl_update_interval_estimates_on_the_merged_histogram():
    """Each interval's first batch holds its range: Horizon's interval histogram ([0, max
    |x|] of its first batch) is then that of one batch holding both."""
    xs = batches(4)
    xs[1], xs[3] = xs[0].flip(0) * 0.6, xs[2].flip(1) * 0.8
    o = hz.KLObserver(update_interval=2, averaging_constant=1.0)
    one = []
    for k in (0, 2):
        ref = hz.KLObserver(update_interval=1)
        ref(torch.cat([xs[k], xs[k + 1]]))  # one batch holding both: the same histogram
        one.append(float(scale_of(ref)))
        o(xs[k])
        o(xs[k + 1])
        close(scale_of(o), [one[-1]], rtol=1e-6)
    assert one[0] != one[1]


@pytest.mark.parametrize("bins", [256, 2048])
def test_mix_bins_and_percentile_candidates(bins):
    x = batches(1)[0]
    o = hz.MixObserver(bins=bins)
    o(x)
    amax = float(scale_of(o)) * 127.5
    cands = [percentile_amax(x, p, bins) for p in (99.9, 99.99, 99.999, 99.9999)]
    assert min(abs(amax - c) / c for c in cands) < 1e-5, (amax, cands)


# ------------------------------------------------------- is_sync_quantize (two processes)
SYNCED = [hz.MinMaxObserver, hz.MovingAveragePerChannelMinMaxObserver, hz.PercentileObserver,
          hz.MSEObserver, hz.KLObserver, hz.MixObserver]


def _rank_batch(step, rank):
    # the ranks lean to opposite sides, swapping every step: the order of EMA and MIN / MAX
    # matters
    return batches(1, seed=10 * step + rank)[0] * (1 if (step + rank) % 2 else -1)


def _sync_scenarios(rank, out):
    for cls in SYNCED:
        o = cls(is_sync_quantize=True, averaging_constant=0.3)
        for step in range(3):
            o(_rank_batch(step, rank))
        out[cls.__name__] = o.calculate_qparams()[0]


@pytest.mark.dist
@pytest.mark.extended  # spawns its own process group
def test_is_sync_quantize_reduces_each_ranks_averaged_ends_at_read():
    got = spawn_ranks(_sync_scenarios, 2, 30)
    for cls in SYNCED:
        # Horizon: each rank's own EMA (here: one process per rank, unsynced), then MIN / MAX
        ends = []
        for r in range(2):
            alone = cls(averaging_constant=0.3)
            for step in range(3):
                alone(_rank_batch(step, r))
            ends.append(alone.calculate_range())
        lo = torch.minimum(ends[0][0], ends[1][0])
        hi = torch.maximum(ends[0][1], ends[1][1])
        want = torch.maximum(-lo, hi) / 127.5
        for scale in rank_results(got, cls.__name__):
            close(scale, want)
        # an EMA of each step's merged ends (a sync before every update) differs
        step_synced = cls(averaging_constant=0.3)
        for step in range(3):
            step_synced(torch.cat([_rank_batch(step, r) for r in range(2)], dim=1))
        assert not torch.allclose(step_synced.calculate_qparams()[0], want, rtol=1e-4)
