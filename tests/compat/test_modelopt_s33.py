"""compat.modelopt, probe s33, against ModelOpt 0.47's own classes: an axis named twice,
batches of different dtypes (ModelOpt's ``torch.max`` promotes), empty batches refused at
``collect`` (the state as it was), fp8 input (ModelOpt's float32 upcast) and the histogram
grown by ModelOpt's float32 ``ceil(x_max / w)`` bins."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator

pytestmark = pytest.mark.peers
pytest.importorskip("modelopt")
mo = pytest.importorskip("modelopt.torch.quantization.calib")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _both(kw, batches):
    """ModelOpt's MaxCalibrator and ours, each given every batch."""
    ref, ours = mo.MaxCalibrator(**kw), MaxCalibrator(**kw)
    for x in batches:
        ref.collect(x)
        ours.collect(x)
    return ref, ours


def _same(a, b):
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (a, b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), (a, b)
    assert torch.equal(a, b), (a, b)


def _same_amaxs(ref, ours):
    assert len(ref.amaxs) == len(ours.amaxs)
    for a, b in zip(ref.amaxs, ours.amaxs):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (a, b)


# ------------------------------------------------------------------ 1. an axis named twice
@pytest.mark.parametrize(("shape", "axis"), [
    ((5, 4), (1, 1)), ((5, 4), (1, -1)), ((5, 4), (0, -2)), ((5, 4), (-1, -1, 1)),
    ((5, 5, 4), (1, 1)), ((3, 4, 5), (2, -1)), ((3, 4, 5), (0, 0, -1)),
    ((3, 4, 5), (-3, 1, 0)), ((4,), (0, -1)), ((4,), (-1, -1)), ((2, 3, 4, 5), (1, -3, 3)),
])
def test_axis_named_twice_is_modelopts(shape, axis):
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(shape, generator=g) * (k + 1) for k in range(3)]
    ref, ours = _both({"axis": axis, "track_amax": True}, batches)
    _same(ref.compute_amax(), ours.compute_amax())
    _same_amaxs(ref, ours)


def test_refused_batches_leave_the_state_as_modelopts():
    # each refusal (ModelOpt's: an empty batch, NaN, another amax shape) after a good batch:
    # the amax and the tracked amaxs stay those of the batches taken
    g = torch.Generator().manual_seed(4)
    ref, ours = _both({"axis": (1, -1), "track_amax": True}, [torch.randn(5, 4, generator=g)])
    for bad in (torch.empty(0, 4), torch.tensor([[1.0, float("nan")]] * 5),
                torch.randn(5, 3, generator=g)):
        with pytest.raises(Exception):  # noqa: B017 (ModelOpt's own kinds: checked below)
            ref.collect(bad)
        with pytest.raises((ValueError, RuntimeError)):
            ours.collect(bad)
        _same(ref.compute_amax(), ours.compute_amax())
        _same_amaxs(ref, ours)
    x = torch.randn(5, 4, generator=g) * 3
    ref.collect(x)
    ours.collect(x)
    _same(ref.compute_amax(), ours.compute_amax())
    _same_amaxs(ref, ours)


# ------------------------------------------------------------------ 2. batches' dtypes
@pytest.mark.parametrize("axis", [None, 0, (0, 1)])
@pytest.mark.parametrize(("values", "dtypes"), [
    ([[5.5, 1.0], [3, 1]], (torch.float32, torch.int64)),
    ([[1e6, 2.0], [3.0, 1.0]], (torch.float32, torch.float16)),
    ([[1.0001, 0.25], [0.5, 0.125]], (torch.float32, torch.bfloat16)),
    ([[3.0, 1.5], [3.099609375, 0.25]], (torch.bfloat16, torch.float16)),
    ([[2.0, 7.0], [1.0, 4.0]], (torch.float16, torch.int32)),
    ([[200, 3], [-7, 100]], (torch.uint8, torch.int8)),
    ([[3, 9], [0.75, 12.5]], (torch.int64, torch.float32)),
    ([[1.0, 0.5], [60000.0, 2.0], [0.25, 3.0]], (torch.float32, torch.float16, torch.float32)),
])
def test_mixed_dtypes_promote_as_modelopt(values, dtypes, axis):
    # ModelOpt's torch.max(amax, batch amax): the dtypes promoted, never the last one's
    batches = [torch.tensor(v).to(dt) for v, dt in zip(values, dtypes)]
    batches = [b.reshape(1, 2).expand(3, 2).contiguous() if axis is not None else b
               for b in batches]
    track = torch.bfloat16 not in dtypes  # numpy has no bf16: ModelOpt fails there
    ref, ours = _both({"axis": axis, "track_amax": track}, batches)
    _same(ref.compute_amax(), ours.compute_amax())
    if track:
        _same_amaxs(ref, ours)


def test_promoted_dtype_restarts_after_reset():
    ref, ours = _both({}, [torch.tensor([1e6]), torch.tensor([3.0], dtype=torch.float16)])
    _same(ref.compute_amax(), ours.compute_amax())
    for c in (ref, ours):
        c.reset()
        c.collect(torch.tensor([3.0], dtype=torch.float16))
    _same(ref.compute_amax(), ours.compute_amax())


# ------------------------------------------------------------------ 3. empty batches
@pytest.mark.parametrize(("shape", "axis"), [
    ((0,), None), ((3, 0), 0), ((0, 4), 1), ((0, 4), (0, 1)), ((2, 0, 3), (0, 2)),
    ((0,), 0), ((0, 4), None),
])
@pytest.mark.parametrize("after_data", [False, True])
def test_empty_batch_refused_at_collect(shape, axis, after_data):
    good = [torch.arange(1.0, 1.0 + torch.Size(s).numel()).reshape(s)
            for s in [tuple(n or 2 for n in shape)]] if after_data else []
    ref, ours = _both({"axis": axis, "track_amax": True}, good)
    with pytest.raises(Exception):  # noqa: B017 (torch's RuntimeError / IndexError there)
        ref.collect(torch.empty(shape))
    with pytest.raises(ValueError, match="no elements"):
        ours.collect(torch.empty(shape))
    a, b = ref.compute_amax(), ours.compute_amax()
    if after_data:
        _same(a, b)
    else:
        assert a is None and b is None
    _same_amaxs(ref, ours)


def test_empty_batch_modelopt_keeps_refused():
    # a documented difference: ModelOpt's amax of a (0, 4) batch kept per row is empty
    ref = mo.MaxCalibrator(axis=0)
    ref.collect(torch.empty(0, 4))
    assert ref.compute_amax().numel() == 0
    with pytest.raises(ValueError, match=r"collect\(x\).*no elements"):
        MaxCalibrator(axis=0).collect(torch.empty(0, 4))


# ------------------------------------------------------------------ 4. fp8 input
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)])
def test_fp8_input_is_modelopts_float32(dtype, axis):
    x = torch.tensor([[1.0, -3.5, 0.25], [2.0, 448.0, -96.0]]).to(dtype)
    y = torch.tensor([[0.5, 12.0, -1.0], [-320.0, 3.0, 0.0]]).to(dtype)
    ref, ours = _both({"axis": axis, "track_amax": True}, [x, y])
    _same(ref.compute_amax(), ours.compute_amax())
    assert ours.compute_amax().dtype == torch.float32
    _same_amaxs(ref, ours)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_then_half_promotes_as_modelopt(dtype):
    x = torch.tensor([1.0, -3.5, 448.0]).to(dtype)
    ref, ours = _both({}, [x, torch.tensor([500.0, 1.0], dtype=torch.float16)])
    _same(ref.compute_amax(), ours.compute_amax())
    assert float(ours.compute_amax()) == 500.0


# ------------------------------------------------------------------ 5. grown histogram
def _hist_both(bins, batches):
    ref, ours = mo.HistogramCalibrator(num_bins=bins), HistogramCalibrator(num_bins=bins)
    for x in batches:
        ref.collect(x)
        ours.collect(x)
    _same(ref._calib_hist, ours._calib_hist)
    _same(ref._calib_bin_edges, ours._calib_bin_edges)
    return ref, ours


def _width(bins, first_max):  # ModelOpt's w: edges[1] - edges[0] of its float32 linspace
    edges = torch.linspace(0, first_max, bins + 1)
    return edges[1] - edges[0]


@pytest.mark.parametrize(("bins", "first", "second"), [
    (16, 0.7, 3.5), (16, 0.7, 7.0), (19, 1.5, 6.0), (10, 3.0, 9.0), (8, 0.3, 1.2),
])
def test_growth_to_a_multiple_of_the_width_is_modelopts(bins, first, second):
    # the probe's batches (few values, tidy maxima): the float64 quotient counted a bin more
    batches = [torch.tensor([first, first / 3, 0.1]), torch.tensor([second, 0.2, 0.5, 1.0])]
    ref, ours = _hist_both(bins, batches)
    for p in (30.0, 60.0, 90.0):
        _same(ref.compute_amax("percentile", percentile=p),
              ours.compute_amax("percentile", percentile=p))


@pytest.mark.parametrize("bins", [16, 19, 64])
@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("nudge", [-1, 0, 1])
def test_growth_at_whole_widths_is_modelopts(bins, k, nudge):
    # batches that fill the bins, a later max at k * bins widths (and one float32 step off):
    # the counts, edges, entropy and percentile amaxes are ModelOpt's
    first = 0.7
    top = (_width(bins, first) * k * bins).float()
    if nudge:
        top = torch.nextafter(top, torch.tensor(float(nudge) * 1e9))
    batches = [torch.linspace(0, first, 301), torch.cat([torch.linspace(0, float(top), 997),
                                                        top.reshape(1)]),
               torch.linspace(0, first * 2, 113)]
    ref, ours = _hist_both(bins, batches)
    start = bins // 2
    _same(ref.compute_amax("entropy", start_bin=start), ours.compute_amax("entropy",
                                                                          start_bin=start))
    hist = ref._calib_hist.int().numpy()
    cdf = np.cumsum(hist / hist.sum())
    for p in (50.0, 90.0, 99.0):
        i = int(np.searchsorted(cdf, p / 100))
        if i and abs(cdf[i - 1] - p / 100) < 1e-12:  # ModelOpt's rounding decides (doc)
            continue
        _same(ref.compute_amax("percentile", percentile=p),
              ours.compute_amax("percentile", percentile=p))


@pytest.mark.parametrize(("bins", "first"), [(10, 1.5), (10, 3.0)])
def test_growth_that_keeps_the_bin_count_is_modelopts(bins, first):
    # a max one float32 step past the top: ModelOpt's ceil(x_max / w) is still `bins`, its
    # last edge moves (arange's), and a later batch bins over that edge
    m = torch.tensor(first)
    past = torch.nextafter(m, torch.tensor(9.0))
    ref, ours = _hist_both(bins, [torch.stack([m, m / 3]), torch.stack([past, m / 2]),
                                  torch.linspace(0, first, 37)])
    assert ref._calib_hist.numel() == bins  # the case this test is for
    _same(ref.compute_amax("percentile", percentile=50.0),
          ours.compute_amax("percentile", percentile=50.0))


def test_horizon_growth_stays_float64():
    # Horizon's KL histogram keeps its own count, ceil(x_max / w) in float64 with w = top /
    # bins, where ModelOpt's float32 quotient (w its linspace step) counts a bin less
    from quantscope.compat.horizon import KLObserver

    bins, first = 256, torch.tensor(0.7)
    top = (_width(bins, float(first)) * 259).float()
    want64 = int(torch.ceil(top.double() / (first.double() / bins)))
    assert want64 == 1 + int(torch.ceil(top / _width(bins, float(first))))  # they differ
    obs = KLObserver(bins=bins, update_interval=3)  # the interval holds both batches
    obs(torch.stack([first, torch.tensor(0.1)]))
    obs(torch.stack([top, torch.tensor(0.2)]))
    assert obs.hist_counts.shape[-1] == want64
