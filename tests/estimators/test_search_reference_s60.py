"""Histogram MSE, the histogram scorer's sub-points, the shrink searches and the output
clip search against brute force written out here: every candidate quantized with plain
torch (the documented integer formula, ``docs/guide/observers.md``: the range widened to 0,
symmetric ``scale = amax / ((qmax - qmin) / 2)``, asymmetric ``(hi - lo) / (qmax - qmin)``
and a half-to-even zero point, the scale a float32) and priced in float64, then the
documented tie rule (ModelOpt / Quark's ``argmin``: the first minimum)."""

from __future__ import annotations

import pytest
import torch

from quantscope.estimators import (
    dense_search,
    histogram_error,
    histogram_mse_range,
    mse_search,
)
from quantscope.estimators.histogram_mse import occupied_range
from quantscope.estimators.scorer import HistogramScorer, Line
from quantscope.estimators.weighted import output_clip_range, output_error
from quantscope.presets import NVFP4
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist


# ------------------------------------------------------------------ plain-torch references
def qdq(x, lo, hi, spec):
    """Fake-quantize ``x`` (float64, ``[..., P]``) with the integer range ``(lo, hi)``
    (``[...]``), the scale a float32 as stored."""
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    lo = torch.clamp(torch.as_tensor(lo, dtype=torch.float64), max=0)[..., None]
    hi = torch.clamp(torch.as_tensor(hi, dtype=torch.float64), min=0)[..., None]
    if spec.symmetric:
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).float().double()
        zp = torch.zeros_like(scale)
    else:
        scale = ((hi - lo) / (qmax - qmin)).float().double()
        zp = torch.round(qmin - lo / scale).clamp(qmin, qmax)
    return (torch.clamp(torch.round(x / scale) + zp, qmin, qmax) - zp) * scale


def ref_hist_error(counts, lo_edge, width, lo, hi, spec, points=1):
    """``sum count * (q(x) - x) ** 2`` with each bin's count at ``points`` points evenly
    inside it (``(k + 0.5) / points`` of the bin), ``[U, C]`` for ranges ``[U, C]``."""
    U, B = counts.shape
    k = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    x = (lo_edge.double()[:, None, None] + (torch.arange(B, dtype=torch.float64)[None, :, None]
         + k) * width.double()[:, None, None]).reshape(U, 1, B * points)
    w = (counts.double()[..., None] / points).expand(U, B, points).reshape(U, 1, B * points)
    return ((qdq(x, lo, hi, spec) - x) ** 2 * w).sum(-1)


def ref_histogram_mse_hi(counts, width, spec, start_bin=128, stride=1, amax=None):
    """Brute-force symmetric histogram MSE on an ``|x|`` histogram at 0: every centre from
    ``min(start_bin, B - 1)`` (Quark's rule on a small histogram), clipped to max |x| (the
    occupied bins' end), the first minimum."""
    U, B = counts.shape
    start = min(start_bin, B - 1)
    j = torch.arange(start, B, stride, dtype=torch.float64)
    c = ((j + 0.5) * width).expand(U, -1)
    top = (counts > 0).double() * torch.arange(1, B + 1, dtype=torch.float64)
    amax = top.amax(1, keepdim=True) * width if amax is None else amax
    c = torch.minimum(c, amax)
    err = ref_hist_error(counts, torch.zeros(U), torch.full((U,), width), -c, c, spec)
    return c.gather(1, err.argmin(1, keepdim=True))[:, 0], err


def _sparse_hists(U, B, seed):
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 6, (U, B), generator=g) * (torch.rand(U, B, generator=g) < 0.2)
    counts = (10 ** levels.double()).long() * (levels > 0)
    counts[:, -1] += 1
    return counts


# ------------------------------------------------------------------ histogram MSE
@pytest.mark.parametrize("B", [16, 64, 100])
def test_a_histogram_shorter_than_start_bin_scores_its_last_centre(B):
    # Quark: start_bin past the histogram leaves one candidate, the last bin's centre,
    # clipped to max |x| (H2 raised)
    counts = _sparse_hists(2, B, 0)
    w = 1.0 / B
    h = Hist(counts, torch.zeros(2), torch.ones(2), absolute=True)
    spec = QuantSpec("int8", "tensor")
    ref, _ = ref_histogram_mse_hi(counts, w, spec)
    lo, hi = histogram_mse_range(h, spec)
    torch.testing.assert_close(hi, ref.float())
    torch.testing.assert_close(lo, -ref.float())


@pytest.mark.parametrize(("B", "refine"), [(64, 16), (40, 10), (48, 16), (32, 8)])
def test_a_refine_budget_holding_every_candidate_is_the_brute_force_argmin(B, refine):
    # n <= 4 * refine candidates: all scored (H3: n == 4 * refine; H8: any n)
    spec = QuantSpec("int2", "tensor")
    w = 1.0 / B
    for seed in range(40):
        counts = _sparse_hists(4, B, seed)
        h = Hist(counts, torch.zeros(4), torch.ones(4), absolute=True)
        ref, _err = ref_histogram_mse_hi(counts, w, spec, start_bin=0)
        _lo, hi = histogram_mse_range(h, spec, start_bin=0, refine=refine)
        # the chosen candidate's error is the least (ties: the same error, the first range)
        torch.testing.assert_close(hi, ref.float(), msg=f"seed {seed}")


@pytest.mark.parametrize("scale", ["pow2:round", "pow2:floor", "pow2:ceil"])
def test_refine_on_power_of_two_plateaus_finds_the_first_tied_candidate(scale):
    # a power-of-two scale is flat over many clips (equal errors): refine=16's rounds keep
    # the earliest tied candidate, the argmin's (H5 kept the coarse round's, a later clip).
    # Every candidate priced by the one error formula, histogram_error; the first minimum.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 100_000, generator=g).abs()
    top = float(x.max())
    counts = torch.stack([torch.histc(r, 2048, 0, top) for r in x]).long()
    h = Hist(counts, torch.zeros(2), torch.full((2,), top), absolute=True)
    spec = QuantSpec("int8", "tensor", scale=scale)
    _lo_occ, hi_occ = occupied_range(h)
    j = torch.arange(128, 2048, dtype=torch.float32)
    c = torch.minimum((j + 0.5) * h.width[:, None].float(), hi_occ[:, None])
    err = histogram_error(h, -c, c, spec)
    ref = c.gather(1, err.argmin(1, keepdim=True))[:, 0]
    _lo, hi = histogram_mse_range(h, spec, refine=16)
    torch.testing.assert_close(hi, ref, rtol=0, atol=0)


def test_nvfp4_candidates_run_under_the_datas_max_not_the_grids_end():
    # default global amax: the occupied bins' max |x| (H7: the grid's end, 1.0)
    g = torch.Generator().manual_seed(0)
    U, B = 4, 256
    counts = torch.zeros(U, B, dtype=torch.int64)
    counts[:, :150] = torch.randint(1, 50, (U, 150), generator=g)
    h = Hist(counts, torch.zeros(U), torch.ones(U), absolute=True)
    w = 1.0 / B
    c = ((torch.arange(0, B, dtype=torch.float64) + 0.5) * w).clamp(max=150 * w).float()
    c = c.expand(U, -1).contiguous()
    ga = torch.tensor(150 * w)
    err = histogram_error(h, -c, c, NVFP4, global_amax=ga)
    ref = c.gather(1, err.argmin(1, keepdim=True))[:, 0]
    _lo, hi = histogram_mse_range(h, NVFP4, start_bin=0, refine=None)
    torch.testing.assert_close(hi, ref)


def test_the_occupied_range_starts_at_the_first_non_empty_bin_even_bin_0():
    counts = torch.zeros(3, 64, dtype=torch.int64)
    counts[0, [0, 5, 40]] = 3
    counts[1, [1, 63]] = 2
    counts[2, [0]] = 1
    h = Hist(counts, torch.tensor([-2.0, -1.0, 0.0]), torch.tensor([2.0, 1.0, 4.0]))
    w = (h.hi - h.lo) / 64
    nz = [torch.nonzero(r)[:, 0] for r in counts]
    first = torch.stack([n[0] for n in nz]).float()
    last = torch.stack([n[-1] for n in nz]).float()
    lo, hi = occupied_range(h)
    torch.testing.assert_close(lo, h.lo + first * w)
    torch.testing.assert_close(hi, h.lo + (last + 1) * w)


def test_an_asymmetric_search_clips_to_an_occupied_bin_0():
    # bin 0 occupied: the data's min is the grid's lo; asymmetric candidates (-c, c) are
    # clipped to it (H9 clipped to bin 1's edge, losing bin 0's values)
    counts = torch.tensor([[7, 3, 0, 2, 5, 0, 0, 1] * 32], dtype=torch.int64)
    h = Hist(counts, torch.tensor([-2.0]), torch.tensor([2.0]))
    spec = QuantSpec("uint8", "tensor", symmetric=False)
    lo, _hi = histogram_mse_range(h, spec, start_bin=0, refine=None)
    assert float(lo) == -2.0


# ------------------------------------------------------------------ the scorer
@pytest.mark.parametrize("points", [1, 2, 4])
def test_sub_points_sit_evenly_inside_their_bins(points):
    # (k + 0.5) / points of the bin (C6 shifted them by a quarter bin)
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 20, (2, 32), generator=g)
    h = Hist(counts, torch.tensor([-1.0, -3.0]), torch.tensor([1.5, 1.0]))
    spec = QuantSpec("int4", "tensor", symmetric=False)
    lo = torch.tensor([[-1.0, -0.7, -0.2], [-3.0, -2.0, -1.1]])
    hi = torch.tensor([[1.5, 1.1, 0.6], [1.0, 0.9, 0.3]])
    got = histogram_error(h, lo, hi, spec, points=points)
    ref = ref_hist_error(counts, h.lo, (h.hi - h.lo) / 32, lo, hi, spec, points=points)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("coarse", [(4, 4, 1), (2, 4), (1, 1), (0,), ()])
def test_coarse_strides_must_be_strictly_decreasing_positive(coarse):
    counts = torch.randint(1, 9, (1, 64), generator=torch.Generator().manual_seed(0))
    h = Hist(counts, torch.zeros(1), torch.ones(1), absolute=True)
    scorer = HistogramScorer(h, QuantSpec("int8", "tensor"))
    with pytest.raises(ValueError, match="coarse"):
        scorer.line_argmin(Line.centres(h.width, 0, 1, 64), 0, coarse)


# ------------------------------------------------------------------ shrink searches
def _unit_errors(units, spec, factors):
    """``[U, F]`` float64 errors of the candidates ``(lo * f, hi * f)`` (``lo``, ``hi``: each
    unit's min / max, float32 products as the search's), and the candidates' ``hi``."""
    x = units.double()[:, None, :]
    lo, hi = units.amin(1), units.amax(1)
    clo = torch.stack([lo * f for f in factors], 1)
    chi = torch.stack([hi * f for f in factors], 1)
    return ((qdq(x, clo, chi, spec) - x) ** 2).sum(-1), chi


def test_units_improving_past_the_grid_try_080_next():
    # int4 Gaussian rows improve down to ~0.75x: the extension goes on from 0.81 with 0.80
    # (M4 skipped it). A unit whose brute-force errors fall strictly down to 0.80 and rise
    # for the next five chooses exactly 0.80 under any patience.
    g = torch.Generator().manual_seed(0)
    units = torch.randn(1024, 128, generator=g)
    spec = QuantSpec("int4", "channel")
    factors = [1 - i / 100 for i in range(27)]
    err, cand = _unit_errors(units, spec, factors)
    d = err.diff(dim=1)
    clear = (d[:, :20] < -1e-6 * err[:, 1:21]).all(1) & (d[:, 20:26] > 1e-6 * err[:, 21:27]).all(1)
    assert int(clear.sum()) >= 3
    res = mse_search(units, None, None, spec)
    torch.testing.assert_close(res.hi[clear], cand[clear, 20], rtol=0, atol=0)


def test_the_2d_ends_grid_spreads_over_the_whole_grid():
    # ends_grid=5 of the 20-factor grid: factors 1.00, 0.96, 0.92, 0.88, 0.84 per end (M5:
    # the first five, 1.00 .. 0.96); brute force over those pairs, first minimum
    g = torch.Generator().manual_seed(0)
    units = torch.randn(6, 256, generator=g)
    spec = QuantSpec("int4", "channel", symmetric=False)
    lo, hi = units.amin(1), units.amax(1)
    ends = [1 - i / 100 for i in range(0, 20, 4)]
    pairs = [(a, b) for a in ends for b in ends]
    x = units.double()[:, None, :]
    clo = torch.stack([lo * a for a, _ in pairs], 1)
    chi = torch.stack([hi * b for _, b in pairs], 1)
    err = ((qdq(x, clo, chi, spec) - x) ** 2).sum(-1)
    res = mse_search(units, None, None, spec, independent_ends=True, ends_grid=5,
                     patience=None)
    got_lo = (res.lo[:, None] == clo) & (res.hi[:, None] == chi)
    assert got_lo.any(1).all()  # every choice is one of the spread pairs
    best = err.min(1).values
    chosen = torch.where(got_lo, err, torch.inf).min(1).values
    torch.testing.assert_close(chosen, best, rtol=1e-9, atol=0)


def test_dense_search_counts_min_max_as_candidate_0():
    # factors expand * (1 - i / candidates), i from 0: index i is factor 1 - i / candidates
    g = torch.Generator().manual_seed(0)
    units = torch.randn(8, 64, generator=g)
    spec = QuantSpec("int4", "channel")
    res = dense_search(units, None, None, spec, candidates=100)
    factors = [1 - i / 100 for i in range(100)]
    err, cand = _unit_errors(units, spec, factors)
    moved = res.index >= 0  # index -1: the min-max incumbent (no candidate strictly better)
    assert int(moved.sum()) >= 4
    i = res.index[moved, None]
    assert torch.equal(res.hi[moved], cand[moved].gather(1, i)[:, 0])
    torch.testing.assert_close(err[moved].gather(1, i)[:, 0], err[moved].min(1).values,
                               rtol=1e-9, atol=0)


def test_a_search_of_no_candidates_is_refused():
    units = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"maxshrink \* grid = 0.5 gives 0 candidates"):
        mse_search(units, None, None, QuantSpec("int8", "channel"), maxshrink=0.005, grid=100)


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_lo_hi_of_the_wrong_length_are_refused(n, backend):
    units = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"one value per unit \(4\), got {n} and {n}"):
        mse_search(units, -torch.ones(n), torch.ones(n), QuantSpec("int8", "channel"),
                   backend=backend)


def test_an_encoding_blind_nvfp4_search_reports_the_global_amax_it_ran_under():
    # encoding_aware=False scores float32 scales but its ranges run under the default
    # global amax, max |x| (M15 reported None)
    units = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    res = mse_search(units, None, None, NVFP4, encoding_aware=False)
    assert res.global_amax is not None
    torch.testing.assert_close(torch.as_tensor(res.global_amax).reshape(()),
                               units.abs().max())


# ------------------------------------------------------------------ output clip search
def _ref_output_error(x, w, lo, hi, spec):
    s = (torch.maximum(-torch.clamp(lo, max=0), torch.clamp(hi, min=0)) / 127.5).float()
    q = torch.clamp(torch.round(x / s), spec.qmin, spec.qmax) * s
    return float(((q @ w.T - x @ w.T).square()).double().sum())


def test_output_error_is_the_float64_sum_and_the_first_best_wins():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4096, 64, generator=g), torch.randn(32, 64, generator=g)
    spec = QuantSpec("int8", "tensor")
    a = (torch.tensor([-3.0]), torch.tensor([3.0]))
    b = (torch.tensor([-1.5]), torch.tensor([1.5]))
    ref = [_ref_output_error(x, w, lo, hi, spec) for lo, hi in (a, b, a)]
    assert ref[0] < ref[1]  # a (no clipping of Gaussian inputs) is the best, at 0 and 2
    assert output_error(x, w, spec, *a) == ref[0]  # W11: a float32 sum
    i, lo, hi, errs = output_clip_range(x, w, spec, [a, b, a])
    assert list(errs) == ref
    assert i == 0  # the first of the tied best (W10: the last)
    assert (lo, hi) == a
