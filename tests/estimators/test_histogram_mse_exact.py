"""histogram_mse against a brute-force reference: every candidate bin centre, clipped to the
data's max |x| (the range that runs), priced by sum(count * (q(c) - c) ** 2)."""

import numpy as np
import pytest
import torch

import quantscope as qs
from quantscope.estimators.histogram_mse import histogram_mse_range
from quantscope.qdq import fake_quantize_units
from quantscope.stats.histogram import Hist, fold_abs


def _price(h, a, spec):
    """sum(count * (q(c) - c) ** 2) of the clip (-a, a) on the |x| histogram ``h``."""
    c = h.centers()
    qp = qs.qparams_from_range(torch.tensor([-a]), torch.tensor([a]), spec)
    fq = fake_quantize_units(c, qp.scale[:, None], qp.zero_point[:, None].float(), spec)
    return float(((fq - c).double() ** 2 * h.counts.double()).sum())


def _brute_force(h, amax, spec, start_bin=128):
    """The first least-error clip among the bin centres from start_bin, each at most amax."""
    j = torch.arange(min(start_bin, h.bins - 1), h.bins)
    cands = torch.minimum((j + 0.5) * h.width, torch.tensor(amax)).tolist()
    errs = [_price(h, a, spec) for a in cands]
    best = int(np.argmin(errs))  # first minimum, as ModelOpt / Quark
    return cands[best], errs[best]


def _levels(seed):
    """Data on six levels in (0, 1) plus a 1.0: a sparse |x| histogram."""
    g = torch.Generator().manual_seed(seed)
    lv = torch.rand(6, generator=g)
    n = torch.randint(1, 5000, (6,), generator=g)
    return torch.cat([torch.full((int(k),), float(v)) for v, k in zip(lv, n)] + [torch.ones(1)])


def _sparse():
    """|x| on six bins of 512 over [0, 1] (the last: 323); among all centres from 128 the
    least error lies past the data (the unclipped brute force below)."""
    counts = torch.zeros(1, 512, dtype=torch.long)
    for b, c in {47: 500, 117: 9000, 192: 40, 195: 3000, 251: 700, 323: 5000}.items():
        counts[0, b] = c
    return Hist(counts, torch.zeros(1), torch.ones(1), absolute=True)


@pytest.mark.parametrize("refine", [None, 16])
def test_symmetric_candidates_stop_at_the_bounds(refine):
    h, spec = _sparse(), qs.QuantSpec("int8")
    assert _brute_force(h, 1.0, spec)[0] > 324 / 512  # unclipped: a clip past the data wins
    amax = torch.tensor([323.5 / 512])  # the data's max |x|: the last bin's centre
    lo, hi = histogram_mse_range(h, spec, refine=refine, bounds=(-amax, amax))
    want, err = _brute_force(h, float(amax), spec)
    assert (float(lo), float(hi)) == pytest.approx((-want, want), rel=1e-6)
    assert _price(h, float(hi), spec) == pytest.approx(err, rel=1e-9)
    # no bounds: the occupied bins' upper edge, 324 w
    lo, hi = histogram_mse_range(h, spec, refine=refine)
    assert float(hi) == pytest.approx(_brute_force(h, 324 / 512, spec)[0], rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_observer_scores_the_range_it_returns(seed):
    # the power-of-two grid runs up to twice max |x|: a clip past it was scored, then clipped
    # to max |x| by the observer, a range never scored (1.7x-10x the least error)
    x = _levels(seed)
    spec = qs.QuantSpec("int8")
    for refine in (16, None):
        obs = qs.get_observer("histogram_mse", spec, refine=refine)
        obs(x)
        with torch.inference_mode():
            lo, hi = obs._estimate(obs.current_histogram())
        assert float(hi) <= float(x.abs().max()) and float(lo) == -float(hi)
        assert torch.equal(obs.calculate_range()[1], hi)
    h = fold_abs(obs.current_histogram())  # refine=None: the brute force's choice
    assert float(hi) == pytest.approx(_brute_force(h, float(x.abs().max()), spec)[0], rel=1e-6)


@pytest.mark.parametrize("sym", [True, False])
def test_refine_none_is_the_argmin_with_bounds(sym):
    torch.manual_seed(3)
    x = torch.randn(1, 20000) * 0.3
    x[0, 0] = 1.0
    spec = qs.QuantSpec("int8", symmetric=sym)
    obs = qs.get_observer("histogram_mse", spec, refine=None)
    obs(x)
    lo, hi = histogram_mse_range(obs.current_histogram(), spec, refine=None,
                                 bounds=(obs.min_vals, obs.max_vals))
    if sym:  # symmetric bounds: +-max |x|
        want, _ = _brute_force(fold_abs(obs.current_histogram()), float(x.abs().max()), spec)
        assert (float(lo), float(hi)) == pytest.approx((-want, want), rel=1e-6)
    else:  # asymmetric: inside the data's min / max
        assert float(hi) <= float(x.max()) and float(lo) >= float(x.min())


def test_observer_checks_refine():
    with pytest.raises(ValueError, match="refine must be an integer >= 1"):
        qs.get_observer("histogram_mse", qs.QuantSpec(), refine=0)


def test_refine_kernel_and_torch_paths_agree_with_symmetric_bounds():
    # the C line search and the torch path clip symmetric candidates alike
    from quantscope.estimators.scorer import HistogramScorer, Line

    x = _levels(4)[None]
    spec = qs.QuantSpec("int8")
    obs = qs.get_observer("histogram_mse", spec)
    obs(x)
    h = fold_abs(obs.current_histogram())
    amax = x.abs().amax(1)
    line = Line.centres(h.width, 128, 1, h.bins - 128, (-amax, amax))
    sc = HistogramScorer(h, spec)
    for coarse in (1, 16):
        bk = sc.line_argmin(line, 0, coarse, first=True)
        bt = sc.line_argmin(line, 0, coarse, first=True, torch_only=True)
        assert torch.equal(bk.lo, bt.lo) and torch.equal(bk.hi, bt.hi)
