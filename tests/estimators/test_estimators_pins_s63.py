"""Pins of survivors of a mutation round over ``quantscope.estimators`` (s63): behaviour the
estimator tests did not hold, each checked against its definition (torch.ao, the docs)."""

import warnings

import torch
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

from quantscope import QuantSpec
from quantscope.estimators import mix_range, percentile_range
from quantscope.estimators.l2 import l2_norms, l2_range
from quantscope.estimators.mse import mse_search, range_error
from quantscope.estimators.scorer import HistogramScorer
from quantscope.stats.histogram import Hist


def test_l2_norms_of_a_zero_width_histogram_are_zero_as_torch_aos():
    """torch.ao's ``_compute_quantization_error`` returns 0.0 when the destination bin width
    is 0 (``min_val == max_val``); ``l2_norms`` copies it (no 0 / 0 NaN from the floor
    division by a zero width)."""
    bins = 8
    ref = TorchHistogramObserver(bins=bins)
    ref.min_val.fill_(1.5)
    ref.max_val.fill_(1.5)
    ref.histogram.copy_(torch.arange(1.0, bins + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = [ref._compute_quantization_error(s, e) for s, e in ((0, bins - 1), (2, 5))]
    assert want == [0.0, 0.0]
    hist = Hist(torch.arange(1, bins + 1)[None], torch.tensor([1.5]), torch.tensor([1.5]))
    got = l2_norms(hist, torch.tensor([[0, 2]]), torch.tensor([[bins - 1, 5]]))
    assert torch.equal(got, torch.zeros(1, 2, dtype=got.dtype))


def test_l2_torch_path_walks_torch_aos_1e5_quantile_steps_on_a_large_total():
    """torch.ao's search moves its quantile bounds by 1e-5 of the total per step; with ~1e6
    counts one step spans many one-count tail bins, so a coarser step visits other ranges
    and stops elsewhere. The torch path (``backend="torch"``) must give torch.ao's range
    bit for bit here too, not only on the small totals where any fine step agrees."""
    bins = 256
    counts = torch.full((bins,), 3.0)
    g = torch.Generator().manual_seed(2)
    counts[bins // 2 - 12:bins // 2 + 12] = (50000 * (1 + torch.rand(24, generator=g))).round()
    ref = TorchHistogramObserver(bins=bins)
    ref.min_val.fill_(-2.0)
    ref.max_val.fill_(1.5)
    ref.histogram.copy_(counts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref._non_linear_param_search()
    hist = Hist(counts.long()[None], torch.tensor([-2.0]), torch.tensor([1.5]))
    lo, hi = l2_range(hist, backend="torch")
    assert torch.equal(lo, want[0].reshape(1)) and torch.equal(hi, want[1].reshape(1))


def test_mix_asymmetric_percentile_candidate_clips_both_tails_of_the_signed_histogram():
    """mix folds the histogram to ``|x|`` for its entropy candidate, but an asymmetric spec's
    percentile candidate is the signed one (``percentile_range(symmetric=False)``: each tail
    at half the excluded mass). One low outlier below a dense [2, 3] block: that candidate
    clips it, which the folded ``(-3, 3)`` range (clipped to the data: min-max) and the
    entropy range do not, and it has the least error, so mix returns it."""
    bins = 1100
    counts = torch.zeros(1, bins, dtype=torch.long)
    counts[0, 0] = 1  # the outlier, at 1.9
    counts[0, 100:] = 50  # [2.0, 3.0]
    hist = Hist(counts, torch.tensor([1.9]), torch.tensor([3.0]))
    spec = QuantSpec("uint8", "tensor", symmetric=False)
    plo, phi = percentile_range(hist, 99.9, symmetric=False)
    assert float(plo) > 1.95 and float(phi) > 2.99  # the outlier's tail clipped, not the top
    scorer = HistogramScorer(hist, spec, points=4)
    err = scorer(torch.stack([plo, hist.lo], 1), torch.stack([phi, hist.hi], 1))
    assert float(err[0, 0]) < float(err[0, 1])  # clipping the outlier beats min-max
    lo, hi = mix_range(hist, spec, candidates=("percentile", "entropy"), percentiles=(99.9,))
    assert torch.equal(lo, plo) and torch.equal(hi, phi)


def test_global_patience_stopping_before_the_last_candidate_stops_it_in_the_kernel_too():
    """llm-compressor's global rule (``per_unit_patience=False``): after ``patience``
    candidates that improve no unit the search stops. Factors 1.5 and 1.4 improve no unit,
    so with patience 2 the last candidate (0.9, which alone would improve unit 0) is never
    tried and every unit keeps min-max (index -1). The C engine, run in blocks of
    candidates (small ``chunk_elems``), redoes its pass when the rule stops before the end,
    also when it stops right before the last candidate."""
    g = torch.Generator().manual_seed(0)
    units = torch.randn(3, 64, generator=g)
    spec = QuantSpec("int4", "channel")
    alone = mse_search(units, None, None, spec, factors=[0.9], patience=None, backend="torch")
    assert alone.index.tolist()[0] == 0  # 0.9 would win unit 0 had it been tried
    for backend in ("torch", "kernel"):
        res = mse_search(units, None, None, spec, factors=[1.5, 1.4, 0.9], patience=2,
                         per_unit_patience=False, chunk_elems=8, backend=backend)
        assert res.index.tolist() == [-1, -1, -1], backend


def test_torch_tiles_price_every_element_of_units_longer_than_a_tile():
    """``SearchResult.error`` is each unit's error at its chosen range. Where a unit is longer
    than ``chunk_elems`` the torch tiles price it in element slices and add the partial sums:
    every element counts, so the error equals ``range_error`` of the chosen range."""
    g = torch.Generator().manual_seed(1)
    units = torch.randn(1, 1000, generator=g)
    spec = QuantSpec("int4", "channel")
    res = mse_search(units, None, None, spec, chunk_elems=64, backend="torch")
    want = range_error(units, res.lo, res.hi, spec)
    assert torch.allclose(res.error.double(), want.double(), rtol=1e-5, atol=0)


def test_a_unit_still_improving_goes_on_to_p_above_one_minus_extend_to():
    """Past llm-compressor's 20-step grid, a unit still improving goes on along ``p = 1 - i /
    100`` while ``p > 1 - extend_to`` (the docstring's bound): 0.51 at the defaults, not
    0.50. One outlier over a narrow body: the error keeps falling below half the range, so
    the search ends at the bound (0.50 would price lower still)."""
    g = torch.Generator().manual_seed(0)
    units = torch.empty(1, 20001).uniform_(-0.45, 0.45, generator=g)
    units[0, 0] = 1.0
    spec = QuantSpec("int4", "channel")
    res = mse_search(units, None, None, spec)
    assert res.index.tolist() == [49]
    assert res.hi.tolist() == [torch.tensor(0.51).item()]
    half = mse_search(units, None, None, spec, factors=[0.5], patience=None)
    assert half.index.tolist() == [0] and float(half.error) < float(res.error)
