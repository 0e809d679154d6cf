"""Histogram estimators against their definitions, torch.ao, and a slow TensorRT loop."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import tensorrt_entropy_loop
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

import quantscope as qs
from quantscope.compat.torch_ao import HistogramObserver
from quantscope.estimators import (
    entropy_amax,
    entropy_divergences,
    histogram_error,
    histogram_mse_range,
    l2_range,
    mix_range,
    percentile_range,
)
from quantscope.qdq import fake_quantize_units
from quantscope.stats.histogram import Hist


# ------------------------------------------------------------------ torch.ao's L2 search
def _torch_hist(x, bins):
    o = TorchHistogramObserver(bins=bins)
    o(x)
    return o


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.sampled_from([20, 3000]),
       bins=st.sampled_from([64, 256, 2048]), outliers=st.booleans(), positive=st.booleans())
def test_l2_search_equals_torch_ao_on_the_same_histogram(seed, n, bins, outliers, positive):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if outliers:
        x[: max(1, n // 500)] *= 40
    if positive:
        x = x.abs()
    o = _torch_hist(x, bins)
    ref_lo, ref_hi = o._non_linear_param_search()
    h = Hist(o.histogram.round().long()[None], o.min_val.reshape(1), o.max_val.reshape(1))
    lo, hi = l2_range(h)
    assert torch.equal(lo, ref_lo.reshape(1)) and torch.equal(hi, ref_hi.reshape(1))


def test_l2_search_per_unit_equals_torch_ao_row_by_row():
    torch.manual_seed(0)
    rows = [torch.randn(2000) * s for s in (0.1, 1.0, 5.0)] + [torch.rand(300), torch.randn(7)]
    rows[1][:3] = 50.0
    obs = [_torch_hist(r, 256) for r in rows]
    h = Hist(torch.stack([o.histogram.round().long() for o in obs]),
             torch.stack([o.min_val for o in obs]), torch.stack([o.max_val for o in obs]))
    lo, hi = l2_range(h)
    for i, o in enumerate(obs):
        rlo, rhi = o._non_linear_param_search()
        assert torch.equal(lo[i], rlo) and torch.equal(hi[i], rhi)


def test_l2_kernel_walk_visits_the_same_ranges_as_the_vectorized_path():
    from quantscope.estimators import l2

    if l2._kernel() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(11)
    rows = [torch.randn(3000) * s for s in (0.1, 1.0, 5.0)] + [torch.rand(300), torch.randn(9)]
    rows[1][:3] = 50.0
    rows[2] = rows[2].abs()
    obs = [_torch_hist(r, 256) for r in rows]
    counts = torch.stack([o.histogram.round().long() for o in obs])
    start, end, valid = l2.l2_path(counts)
    walk = l2._Walk(l2._kernel(), counts)
    parts = [walk.chunk(k, torch.zeros(len(rows), dtype=torch.bool)) for k in (3, 50, 1000)]
    s, e, v = (torch.cat(t, 1) for t in zip(*parts))
    for u in range(len(rows)):
        n = int(valid[u].sum())
        assert n > 0 and int(v[u].sum()) == n
        assert torch.equal(s[u][v[u]], start[u, :n]) and torch.equal(e[u][v[u]], end[u, :n])
    h = Hist(counts, torch.stack([o.min_val for o in obs]), torch.stack([o.max_val for o in obs]))
    for a, b in zip(l2_range(h), l2_range(h, backend="torch")):
        assert torch.equal(a, b)


def test_l2_torch_path_takes_more_bins_than_quantile_steps_as_the_c_walk():
    """More bins than torch.ao's 1e5 quantile steps (the observers take up to 2 ** 31 - 1):
    the torch path (CUDA, or no C compiler) walked one step per bin, past its table of steps
    (an IndexError); torch's loop stops within the steps, and so does the path, as the C
    walk."""
    from quantscope.estimators import l2

    if l2._kernel() is None:
        pytest.skip("no C compiler")
    counts = torch.zeros(2, 100001, dtype=torch.long)  # the table: 100002 steps
    counts[:, 100:200] = 3
    counts[0, 50000] = 7
    counts[1, -1] = 1
    hist = Hist(counts, torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 3.0]))
    for a, b in zip(l2_range(hist, backend="kernel"), l2_range(hist, backend="torch")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bins", [64, 256, 2048])
def test_l2_kernel_terms_sum_to_l2_norms_bitwise(bins):
    from quantscope.estimators import l2

    lib = l2._kernel()
    if lib is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(bins)
    for _ in range(8):
        U, J = 2, 16
        counts = (torch.rand(U, bins, generator=g) ** 8 * 1000).round().long()
        mag = 10.0 ** torch.randint(-3, 4, (2, U), generator=g).float()
        h = Hist(counts, -torch.rand(U, generator=g) * mag[0], torch.rand(U, generator=g) * mag[1])
        s = torch.randint(0, bins // 2, (U, J), generator=g)
        e = s + torch.randint(0, bins // 2, (U, J), generator=g)
        cf = counts.float().contiguous()
        terms = torch.empty(U, J, bins)
        lib.qs_l2_terms(cf.data_ptr(), h.lo.data_ptr(), h.hi.data_ptr(), s.data_ptr(),
                        e.data_ptr(), terms.data_ptr(), U, J, bins, 256)
        assert torch.equal(terms.sum(-1).double(), l2.l2_norms(h, s, e, 256))


@pytest.mark.parametrize("kw", [{}, {"qscheme": torch.per_tensor_symmetric, "dtype": torch.qint8},
                                {"bins": 256}, {"reduce_range": True},
                                {"quant_min": 0, "quant_max": 15}])
def test_torch_ao_histogram_observer_same_qparams_when_the_range_does_not_grow(kw):
    torch.manual_seed(1)
    ref, ours = TorchHistogramObserver(**kw), HistogramObserver(**kw)
    x = torch.randn(32, 384)
    x[:, 7] *= 25
    for b in (x, x * 0.5, x.clamp(-2, 3), x[:3]):
        ref(b)
        ours(b)
    assert torch.equal(ref.histogram, ours.histogram)
    (rs, rz), (s, z) = ref.calculate_qparams(), ours.calculate_qparams()
    assert torch.equal(rs, s) and torch.equal(rz.long(), z.long())
    assert torch.equal(ref.min_val, ours.min_val) and torch.equal(ref.max_val, ours.max_val)


def test_torch_ao_histogram_observer_equals_torch_ao_when_the_range_grows():
    torch.manual_seed(2)  # torch.ao's approximate re-binning, reproduced (tests/test_ao_histogram)
    ours, ref = HistogramObserver(), TorchHistogramObserver()
    x = torch.randn(10000)
    for b in (x, x * 3):
        ours(b)
        ref(b)
    assert torch.equal(ours.histogram, ref.histogram)
    (s, z), (rs, rz) = ours.calculate_qparams(), ref.calculate_qparams()
    assert torch.equal(s, rs) and torch.equal(z.long(), rz.long())


# ------------------------------------------------------------------ entropy (TensorRT)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(140, 260), sparse=st.booleans(),
       stride=st.sampled_from([1, 3]), bits=st.sampled_from([6, 8]))
def test_kl_equals_a_direct_tensorrt_loop(seed, n, sparse, stride, bits):
    rng = np.random.default_rng(seed)
    hist = np.round(rng.exponential(1.0, n) * np.exp(-np.arange(n) / 40) * 1000)
    if sparse:
        hist[rng.random(n) < 0.3] = 0
    hist[-1] = max(hist[-1], 1)
    start = 1 << (bits - 1)
    ref_div, ref_i = tensorrt_entropy_loop(hist, bits, start, stride)
    div, _cand = entropy_divergences(torch.from_numpy(hist).long()[None], num_bits=bits,
                                    start_bin=start, stride=stride)
    div = div[0].numpy()
    assert np.array_equal(np.isinf(div), np.isinf(ref_div))
    fin = np.isfinite(ref_div)
    np.testing.assert_allclose(div[fin], ref_div[fin], rtol=1e-9, atol=1e-12)
    amax = entropy_amax(Hist(torch.from_numpy(hist).long()[None], torch.zeros(1),
                             torch.tensor([float(n)]), True),
                        num_bits=bits, start_bin=start, stride=stride)
    i = int(amax.round())  # width 1: amax = edges[i] = i
    # same pick, or a tie within rounding
    assert i == ref_i or abs(ref_div[(i - start) // stride] - ref_div.min()) < 1e-12


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(130, 300),
       kind=st.sampled_from(["flat", "steps", "periodic", "spike"]),
       stride=st.sampled_from([1, 2]), bits=st.sampled_from([6, 8]))
def test_kl_ties_pick_a_minimum_of_the_literal_loop(seed, n, kind, stride, bits):
    # flat and repeating histograms give many equal (or nearly equal) divergences
    rng = np.random.default_rng(seed)
    k = np.arange(n)
    hist = {"flat": np.full(n, 50.0), "steps": 10.0 * (1 + k // 37),
            "periodic": np.where(k % 4 == 0, 8.0, 0.0) + (k % 2),
            "spike": np.where(k < 64, 1000.0, 1.0)}[kind]
    hist = hist + (rng.random(n) < 0.02)  # a few perturbed bins
    hist[-1] = max(hist[-1], 1)
    start = 1 << (bits - 1)
    ref_div, ref_i = tensorrt_entropy_loop(hist, bits, start, stride)
    h = Hist(torch.from_numpy(hist).long()[None], torch.zeros(1), torch.tensor([float(n)]), True)
    for backend in (None, "torch"):
        div = entropy_divergences(h.counts, num_bits=bits, start_bin=start, stride=stride,
                                  backend=backend)[0][0].numpy()
        assert np.array_equal(np.isinf(div), np.isinf(ref_div))
        fin = np.isfinite(ref_div)
        np.testing.assert_allclose(div[fin], ref_div[fin], rtol=1e-9, atol=1e-12)
    i = int(entropy_amax(h, num_bits=bits, start_bin=start, stride=stride).round())
    best = ref_div.min()
    # the same bin, or a tie within rounding
    assert i == ref_i or abs(ref_div[(i - start) // stride] - best) <= 1e-12 * max(1, abs(best))


@pytest.mark.parametrize("hist,bits,start", [
    # one non-empty bin below i, the last: P and Q normalise to the same one-hot
    ([1, 0, 0, 0, 2, 2, 2, 1, 0, 1, 2, 0, 1, 0, 0, 0], 4, 1),
    # no outliers past bin 5 and every group flat (or a single bin): P = Q from i = 5 on
    ([0, 5, 5, 0, 5] + [0] * 15, 8, 2),
    ([3, 3, 0, 3, 3, 0, 0, 3] + [0] * 8, 3, 8)])
def test_kl_exact_zero_ties_pick_the_last_as_the_loop(hist, bits, start):
    # where P and Q are proportional TensorRT's loop gets KL = 0 exactly (p / q = 1) and the
    # last such threshold wins; the closed form must not let its rounding noise decide
    ref_div, ref_i = tensorrt_entropy_loop(np.array(hist, dtype=np.float64), bits, start, 1)
    assert (ref_div == 0).sum() > 1
    counts = torch.tensor([hist])
    for backend in (None, "torch"):
        div, cand = entropy_divergences(counts, num_bits=bits, start_bin=start, backend=backend)
        assert torch.equal(div[0] == 0, torch.from_numpy(ref_div == 0)), backend
        key = torch.where(torch.isfinite(div[0]), div[0], torch.tensor(float("inf"))).flip(0)
        assert int(cand[len(cand) - 1 - int(key.argmin())]) == ref_i, backend


@pytest.mark.parametrize("unsigned,bits", [(True, 8), (False, 8), (False, 4)])
def test_kl_kernel_equals_the_torch_form(unsigned, bits):
    torch.manual_seed(9)
    x = torch.randn(6, 20000) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [0.5], [2.0]])
    x[2, :5] = 80
    x[4] = x[4].round()  # sparse histogram
    o = qs.get_observer("entropy", qs.QuantSpec("int8", "channel:0"))
    o(x)
    counts = o.current_histogram().counts
    stop = torch.tensor([2048, 1500, 700, 2048, 300, 128])
    a, _ = entropy_divergences(counts, num_bits=bits, unsigned=unsigned, stop=stop)
    b, _ = entropy_divergences(counts, num_bits=bits, unsigned=unsigned, stop=stop,
                               backend="torch")
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.isinf(), b.isinf())
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-10, atol=1e-12)


def test_entropy_per_channel_equals_per_tensor_channel_by_channel():
    torch.manual_seed(3)
    x = torch.randn(4000, 6) * torch.tensor([0.1, 1, 3, 10, 0.5, 2])
    x[:5, 2] = 80
    spec_c = qs.QuantSpec("int8", "channel:1")
    per_c = qs.get_observer("entropy", spec_c)
    per_c(x)
    lo, hi = per_c.calculate_range()
    for c in range(6):
        o = qs.get_observer("entropy", qs.QuantSpec())
        o(x[:, c].contiguous())
        l1, h1 = o.calculate_range()
        assert torch.equal(l1[0], lo[c]) and torch.equal(h1[0], hi[c])


# ------------------------------------------------------------------ percentile
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), p=st.sampled_from([50.0, 99.0, 99.9, 99.99, 100.0]),
       conv=st.sampled_from(["lower", "center", "upper"]))
def test_percentile_conventions_match_their_definitions(seed, p, conv):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, (3, 64))
    counts[:, rng.integers(0, 64)] += 1
    lo = torch.tensor([-2.0, 0.0, 1.5])
    hi = torch.tensor([2.0, 8.0, 3.5])
    h = Hist(torch.from_numpy(counts), lo, hi, True)
    amax = percentile_range(h, p, symmetric=True, convention=conv)[1]
    w = (hi - lo) / 64
    for u in range(3):
        cdf = np.cumsum(counts[u]) / counts[u].sum()
        i = min(int(np.searchsorted(cdf, p / 100 - 1e-15)), 63)  # first bin with cdf >= p
        off = {"lower": 0.0, "center": 0.5, "upper": 1.0}[conv]
        assert float(amax[u]) == pytest.approx(float(lo[u] + (i + off) * w[u]), rel=1e-6)
        if conv == "lower":  # ModelOpt's / TensorRT's literal formula
            edges = np.linspace(float(lo[u]), float(hi[u]), 65)
            j = min(int(np.searchsorted(cdf, p / 100)), 64)
            if abs(cdf[j - 1] - p / 100) > 1e-12 if j else True:
                assert float(amax[u]) == pytest.approx(edges[j], rel=1e-5)


@pytest.mark.parametrize("p,total", [(99.9, 40000), (99.99, 10000), (99.0, 300), (75.0, 4)])
def test_percentile_reached_exactly_at_a_whole_count(p, total):
    # p percent of the total is a whole count k: the bin whose cumulative count reaches k
    # holds the percentile (p / 100 * total rounds past k for 99.9 %: 39960.00000000001)
    k = round(p * total / 100)
    counts = torch.zeros(1, 64, dtype=torch.long)
    counts[0, 10], counts[0, 40] = k, total - k  # cumulative k from bin 10 to bin 39
    h = Hist(counts, torch.zeros(1), torch.full((1,), 64.0), True)
    assert float(percentile_range(h, p, convention="lower")[1]) == 10.0
    _, hi = percentile_range(Hist(counts, torch.zeros(1), torch.full((1,), 64.0)),
                             2 * p - 100, symmetric=False, convention="lower")
    assert float(hi) == 10.0  # each tail at (100 + p') / 2 = p percent from its end


def test_asymmetric_percentile_clips_half_the_excluded_mass_on_each_side():
    counts = torch.zeros(1, 100, dtype=torch.long)
    counts[0, 0] = 1  # one low outlier
    counts[0, 10:90] = 100
    counts[0, 99] = 1  # one high outlier
    h = Hist(counts, torch.tensor([-50.0]), torch.tensor([50.0]))
    lo, hi = percentile_range(h, 99.9, symmetric=False, convention="lower")
    # 0.05 % of 8002 = 4 values per tail: both outliers are clipped, the bulk kept
    assert float(lo) == -40.0 + 1.0 and float(hi) == 39.0
    lo, hi = percentile_range(h, 100.0, symmetric=False, convention="upper")
    assert float(lo) == -50.0 and float(hi) == 50.0


# ------------------------------------------------------------------ histogram MSE and mix
def _direct_error(h, lo, hi, spec):
    c = h.centers()
    out = []
    for a, b in zip(lo.reshape(-1).tolist(), hi.reshape(-1).tolist()):
        qp = qs.qparams_from_range(torch.tensor([a]), torch.tensor([b]), spec)
        fq = fake_quantize_units(c, qp.scale[:, None], qp.zero_point[:, None].float(), spec)
        out.append(float(((fq - c).double() ** 2 * h.counts.double()).sum()))
    return out


@pytest.mark.parametrize("fmt,sym", [("int8", True), ("int8", False), ("fp8_e4m3", True),
                                     ("int4", True)])
def test_histogram_mse_picks_the_least_error_candidate(fmt, sym):
    torch.manual_seed(4)
    x = torch.randn(1, 20000) * 2 + (0 if sym else 1)
    x[0, :4] = 60
    spec = qs.QuantSpec(fmt, symmetric=sym)
    o = qs.get_observer("percentile", spec, bins=512)
    o(x)
    h = o.current_histogram()
    lo, hi = histogram_mse_range(h, spec, start_bin=128, stride=7, refine=None)
    hh = h if not sym else Hist(*qs.stats.histogram.fold_abs(h))
    j = torch.arange(128, 512, 7)
    amax = (j + 0.5) * h.width
    if sym:
        clo, chi = -amax, amax
    else:
        from quantscope.estimators.histogram_mse import occupied_range

        olo, ohi = occupied_range(h)
        clo, chi = torch.maximum(-amax, olo), torch.minimum(amax, ohi)
    errs = _direct_error(hh, clo, chi, spec)
    best = int(np.argmin(errs))  # first minimum, as ModelOpt / Quark
    assert float(hi) == pytest.approx(float(chi[best]), rel=1e-6)
    assert float(lo) == pytest.approx(float(clo[best]), rel=1e-6)
    got = histogram_error(hh, clo[None], chi[None], spec)[0]
    np.testing.assert_allclose(got.numpy(), errs, rtol=1e-9)
    if not sym:  # bounds: the data's own min / max instead of the occupied bins' edges
        dlo, dhi = x.amin(1), x.amax(1)
        lo, hi = histogram_mse_range(h, spec, start_bin=128, stride=7, refine=None,
                                     bounds=(dlo, dhi))
        clo, chi = torch.maximum(-amax, dlo), torch.minimum(amax, dhi)
        best = int(np.argmin(_direct_error(hh, clo, chi, spec)))
        assert (float(lo), float(hi)) == (float(clo[best]), float(chi[best]))


def test_histogram_scorer_points_past_the_buffer_budget_equal_the_torch_path():
    # U * B * points above ELEMENT_BUDGET: the kernel counts the occupied bins first and
    # sizes its buffers to them (below it, room for every bin and one call)
    from quantscope.estimators.scorer import ELEMENT_BUDGET, HistogramScorer

    g = torch.Generator().manual_seed(11)
    U, B, points = 300, 512, 2
    assert U * B * points > ELEMENT_BUDGET
    counts = torch.randint(0, 9, (U, B), generator=g) * (torch.rand(U, B, generator=g) < 0.3)
    lo = -torch.rand(U, generator=g) * 4
    h = Hist(counts, lo, lo + 8)
    spec = qs.QuantSpec("int8", "channel:0", symmetric=False)
    k, t = (HistogramScorer(h, spec, points=points, backend=b) for b in (None, "torch"))
    assert all(torch.equal(a, b) for a, b in zip(k._points(), t._points()))
    clo, chi = h.lo[:, None] * torch.rand(U, 3, generator=g), h.hi[:, None] * 0.9
    torch.testing.assert_close(k(clo, chi.expand(U, 3)), t(clo, chi.expand(U, 3)), rtol=1e-12,
                               atol=0)


@pytest.mark.parametrize("sym,bits,points,scale", [(False, 8, 1, "fp32"), (True, 8, 2, "fp32"),
                                                   (False, 4, 4, "fp32"), (False, 8, 2, "pow2")])
def test_histogram_error_kernel_equals_the_torch_path(sym, bits, points, scale):
    # fp32 scales: the kernel derives (scale, zero point) itself; pow2: torch hands them over
    torch.manual_seed(10)
    x = torch.randn(3, 30000) * torch.tensor([[1.0], [3.0], [0.2]]) + 0.3
    x[0, :3] = 50
    spec = qs.QuantSpec(f"int{bits}", "channel:0", symmetric=sym, scale=scale)
    o = qs.get_observer("percentile", spec, bins=512)
    o(x)
    h = o.current_histogram()
    f = torch.linspace(0.05, 1.0, 97)
    lo, hi = o.min_vals[:, None] * f, o.max_vals[:, None] * f.flip(0)
    a = histogram_error(h, lo, hi, spec, points=points)
    b = histogram_error(h, lo, hi, spec, points=points, backend="torch")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert torch.equal(a.argmin(1), b.argmin(1))
    # the kernel's prepared points and weights are the torch path's, bit for bit
    from quantscope.estimators.scorer import HistogramScorer

    k, t = (HistogramScorer(h, spec, points=points, backend=b) for b in (None, "torch"))
    assert all(torch.equal(a, b) for a, b in zip(k._points(), t._points()))
    # line_argmin: the kernel builds and prices only the candidates it visits, the torch
    # path builds the whole line (Line.ranges), scores all and picks by the same rule
    from quantscope.estimators.scorer import Line

    w = h.width
    lines = [(Line.move(lo[:, 40], hi[:, 60], w, side, radius, steps, bounds), mid, coarse,
              first)
             for side, radius, steps, mid, coarse, first in (
                 (0, 64, 1, 64, 8, False), (1, 8, 4, 32, 4, False), (1, 300, 1, 300, (24, 5, 1),
                                                                     True),
                 (0, 20, 2, 3, (16, 4), True), (0, 5, 1, 5, 1, False))
             for bounds in (None, (o.min_vals + 0.01, o.max_vals - 0.01))]
    lines += [(Line.centres(w, start, stride, n, bounds), 0, coarse, True)
              for start, stride, n, coarse in ((100, 1, 400, 16), (3, 7, 60, 5))
              for bounds in (None, (o.min_vals, o.max_vals))]
    for line, mid, coarse, first in lines:
        bk = k.line_argmin(line, mid, coarse, first=first)
        bt = t.line_argmin(line, mid, coarse, first=first, torch_only=True)
        assert torch.equal(bk.index, bt.index)
        assert torch.equal(bk.lo, bt.lo) and torch.equal(bk.hi, bt.hi)
        torch.testing.assert_close(bk.error, bt.error, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sym", [False, True])
def test_mix_keeps_the_least_error_candidate_per_unit(sym):
    torch.manual_seed(5)
    x = torch.randn(3, 30000) * torch.tensor([[1.0], [3.0], [0.2]])
    x[0, :3] = 50
    spec = qs.QuantSpec("int8", "channel:0", symmetric=sym)
    o = qs.get_observer("mix", spec, bins=512)
    o(x)
    h = o.current_histogram()
    lo, hi, choice = mix_range(h, spec, lo=o.min_vals, hi=o.max_vals, return_choice=True)
    cands = [percentile_range(h, p, symmetric=sym) for p in (99.9, 99.99, 99.999, 99.9999)]
    cands += [(o.min_vals, o.max_vals),
              histogram_mse_range(h, spec, bounds=(o.min_vals, o.max_vals))]
    from quantscope.estimators import entropy_range

    cands.append(entropy_range(h))
    from quantscope.estimators.l2 import l2_finalists, l2_polished_range

    fl, fh = l2_finalists(h, spec, 256, bounds=(o.min_vals, o.max_vals))
    cands += list(zip(fl.unbind(1), fh.unbind(1)))  # the l2 candidates: polish finalists
    clo = torch.stack([torch.maximum(c[0], o.min_vals) for c in cands], 1)
    chi = torch.stack([torch.minimum(c[1], o.max_vals) for c in cands], 1)
    err = histogram_error(h, clo, chi, spec, points=4)
    k = err.argmin(1)
    assert torch.equal(k.clamp(max=7), choice)  # index 7: "l2", whichever finalist
    assert torch.equal(hi, chi.gather(1, k[:, None])[:, 0])
    assert torch.equal(lo, clo.gather(1, k[:, None])[:, 0])
    # the histogram observer picks among the same finalists, so mix does no worse
    plo, phi = l2_polished_range(h, spec, 256, bounds=(o.min_vals, o.max_vals))
    assert bool((err.gather(1, k[:, None])[:, 0] <= histogram_error(
        h, plo[:, None], phi[:, None], spec, points=4)[:, 0]).all())


@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "histogram", "mix"])
def test_per_channel_equals_per_tensor_channel_by_channel(name):
    torch.manual_seed(6)
    x = torch.randn(5, 3000) * torch.tensor([[0.3], [1.0], [4.0], [0.01], [2.0]])
    x[2, :4] = -70
    for sym in (True, False):
        per_c = qs.get_observer(name, qs.QuantSpec("int8", "channel:0", symmetric=sym), bins=256)
        per_c(x)
        per_c(x[:, :1000] * 0.5)
        lo, hi = per_c.calculate_range()
        for c in range(5):
            o = qs.get_observer(name, qs.QuantSpec("int8", symmetric=sym), bins=256)
            o(x[c])
            o(x[c, :1000] * 0.5)
            l1, h1 = o.calculate_range()
            assert torch.equal(l1[0], lo[c]) and torch.equal(h1[0], hi[c]), (name, sym, c)


def test_averaging_constant_is_an_ema_of_per_batch_estimates():
    torch.manual_seed(7)
    batches = [torch.randn(4000) * s for s in (1.0, 2.0, 0.5)]
    ema = qs.get_observer("percentile", qs.QuantSpec(), averaging_constant=0.1)
    ref = None
    for b in batches:
        ema(b)
        one = qs.get_observer("percentile", qs.QuantSpec())
        one(b)
        r = one.calculate_range()[1]
        ref = r.clone() if ref is None else ref + 0.1 * (r - ref)
    assert torch.allclose(ema.calculate_range()[1], ref, rtol=1e-6)
    # update_interval: one estimate per two batches
    two = qs.get_observer("entropy", qs.QuantSpec(), averaging_constant=0.5, update_interval=2)
    for b in batches[:2]:
        two(b)
    one = qs.get_observer("entropy", qs.QuantSpec())
    for b in batches[:2]:
        one(b)
    assert torch.equal(two.calculate_range()[1], one.calculate_range()[1])
    # the batch count towards the next estimate survives save / load (and reset clears it)
    saved = qs.get_observer("entropy", qs.QuantSpec(), averaging_constant=0.5, update_interval=2)
    saved(batches[0])
    loaded = qs.get_observer("entropy", qs.QuantSpec(), averaging_constant=0.5, update_interval=2)
    loaded.load_state_dict(saved.state_dict())
    for b in batches[1:]:
        loaded(b)
    two(batches[2])
    assert torch.equal(loaded.calculate_range()[1], two.calculate_range()[1])
    saved.reset()
    for b in batches:
        saved(b)
    assert torch.equal(saved.calculate_range()[1], two.calculate_range()[1])


@pytest.mark.parametrize("name", ["percentile", "entropy"])
def test_reading_qparams_mid_interval_changes_nothing(name):
    """A read in mid-interval returns the EMA with the pending batches' estimate averaged in,
    and leaves the interval whole: every estimate is still that of update_interval batches."""
    g = torch.Generator().manual_seed(9)
    bs = [torch.randn(64, 64, generator=g) * s for s in (1.0, 4.0, 1.0, 4.0)]

    def fresh(batches):  # one accumulated estimate (no averaging) of these batches
        o = qs.get_observer(name, qs.QuantSpec())
        for b in batches:
            o(b)
        return torch.stack(o.calculate_range())

    c = 0.5
    r0, r1 = fresh(bs[:2]), fresh(bs[2:])
    want_mid = {0: fresh(bs[:1]), 1: r0, 2: r0.lerp(fresh(bs[2:3]), c), 3: r0.lerp(r1, c)}
    o = qs.get_observer(name, qs.QuantSpec(), averaging_constant=c, update_interval=2)
    for i, b in enumerate(bs):
        o(b)
        for _ in range(2):  # reading twice: the same value
            assert torch.allclose(torch.stack(o.calculate_range()), want_mid[i], rtol=1e-6), i
        o.calculate_qparams()
    assert int(o.pending) == 0
    assert torch.allclose(torch.stack(o.calculate_range()), r0.lerp(r1, c), rtol=1e-6)


def test_registry_names():
    names = qs.list_observers()
    for n in ("percentile", "histogram_mse", "entropy", "kl", "histogram", "mix"):
        assert n in names
    assert type(qs.get_observer("kl", qs.QuantSpec())).__name__ == "EntropyObserver"


def test_polish_never_raises_the_histogram_error_and_stays_in_bounds():
    from quantscope.estimators.l2 import l2_polished_range

    torch.manual_seed(8)
    x = torch.randn(4, 5000) * torch.tensor([[1.0], [0.1], [5.0], [2.0]]) + 0.5
    x[1, :3] = 9.0
    spec = qs.QuantSpec("uint8", "channel:0", symmetric=False)
    o = qs.get_observer("histogram", spec, bins=256, polish=0)
    o(x)
    h = o.current_histogram()
    lo, hi = l2_range(h)
    assert torch.equal(torch.stack(o.calculate_range()), torch.stack((lo, hi)).clamp(
        o.min_vals, o.max_vals))  # polish=0: torch.ao's search, clipped to the data
    b = (o.min_vals, o.max_vals)
    plo, phi = l2_polished_range(h, spec, 256, bounds=b)
    before = histogram_error(h, lo.clamp(min=b[0])[:, None], hi.clamp(max=b[1])[:, None], spec,
                             points=4)
    after = histogram_error(h, plo[:, None], phi[:, None], spec, points=4)
    assert bool((after <= before).all())
    assert bool((plo >= b[0]).all() and (phi <= b[1]).all())


@pytest.mark.parametrize("polish", [0, 256])
@pytest.mark.parametrize("k", [-60, -40, 44, 50])
def test_histogram_search_is_scale_free_where_torch_ao_norms_overflow(k, polish):
    # torch.ao's float32 error model cubes bin offsets: at |x| ~ 2 ** 44 they overflow to inf
    # (2 ** -40: underflow to 0), no norm rises and its walk clips the range to a bin or two
    # (uint8 at 2 ** 50: all positive values cut); the search on the histogram scaled by a
    # power of two is the same walk as at |x| ~ 1, so the scales scale by 2 ** k exactly
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(9))
    for spec in (qs.QuantSpec("uint8", symmetric=False, eps=1e-44),
                 qs.QuantSpec("int8", "channel:0", symmetric=False, eps=1e-44)):
        got, want = (qs.get_observer("histogram", spec, polish=polish) for _ in range(2))
        got(x * 2.0**k)
        want(x)
        g, w = got.calculate_qparams(), want.calculate_qparams()
        assert torch.equal(g.scale, w.scale * 2.0**k)
        assert torch.equal(g.zero_point, w.zero_point)


@pytest.mark.parametrize("end", [1e-39, 2.0**127])
def test_histogram_search_scaling_stays_finite_at_float32s_ends(end):
    # the power-of-two factors were float32 2 ** -e / 2 ** e: inf for subnormal ends (a NaN
    # range) and for ends at 2 ** 127 (an inf range); they stay normal, the range finite
    from quantscope.estimators.l2 import l2_polished_range

    counts = torch.randint(1, 50, (1, 128), generator=torch.Generator().manual_seed(0))
    h = Hist(counts, torch.tensor([-end]), torch.tensor([end]))
    for radius in (0, 256):
        lo, hi = l2_polished_range(h, qs.QuantSpec("int8"), 256, radius)
        assert bool(torch.isfinite(lo).all() and torch.isfinite(hi).all())
        assert h.lo.item() <= lo.item() < 0 < hi.item() <= h.hi.item()
