"""Horizon's linear MSE search, Horizon's KL divergence and the mix's symmetric percentile
candidate against references written out here from the documented algorithms: every
candidate of ``linear_search`` quantized with plain torch under the power-of-two scale
(``docs/guide/observers.md``: ``2 ** round / floor / ceil(log2 s)``, round up iff the
mantissa >= sqrt 2) and priced in float64, Horizon's last minimum; Horizon's
``_compute_amax_entropy`` loop in numpy with ``_entropy_torch``'s ``sum p log(p / (q +
1e-10))``; the ``|x|`` percentiles of counts folded by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from quantscope.estimators import linear_search
from quantscope.estimators.entropy import horizon_entropy_amax
from quantscope.estimators.mix import MIX_PERCENTILES, mix_range
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist


# ------------------------------------------------------------------ linear_search (Horizon)
def pow2_scale(s: torch.Tensor, mode: str) -> torch.Tensor:
    """``2 ** round / floor / ceil(log2 s)`` of positive float32 ``s``, from its exponent."""
    m, e = torch.frexp(s)  # s = m * 2 ** e, m in [0.5, 1): mantissa 2m in [1, 2), exponent e - 1
    up = {"round": 2 * m >= math.sqrt(2), "floor": torch.zeros_like(s, dtype=torch.bool),
          "ceil": m > 0.5}[mode]
    return torch.ldexp(torch.ones_like(s), e - 1 + up.long())


def ref_linear_search(units, qmin, qmax, mode, factors):
    """Every candidate ``(-amax f, amax f)`` (float32 products) priced in float64 with its
    power-of-two scale; ``(index, hi, error, first)``: the last minimum (Horizon) and, to show
    the units tie, the first."""
    amax = units.abs().amax(1)
    c = torch.stack([amax * f for f in factors], 1)  # [U, F]
    s = pow2_scale(c / ((qmax - qmin) / 2), mode).double()[..., None]
    x = units.double()[:, None, :]
    err = ((torch.clamp(torch.round(x / s), qmin, qmax) * s - x) ** 2).sum(-1)
    tied = err == err.min(1, keepdim=True).values
    pos = torch.arange(len(factors))
    last = torch.where(tied, pos, -1).amax(1)
    first = torch.where(tied, pos, len(factors)).amin(1)
    return last, c.gather(1, last[:, None])[:, 0], err.min(1).values, first


@pytest.mark.parametrize("mode", ["round", "floor", "ceil"])
@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_linear_search_keeps_horizons_last_minimum_on_power_of_two_plateaus(mode, stride, fmt):
    # a power-of-two scale is flat over many factors: their errors tie exactly, and Horizon's
    # MSEObserver keeps the last (smallest) of them (M12: the first, a larger clip)
    g = torch.Generator().manual_seed(0)
    units = torch.randn(6, 256, generator=g)
    spec = QuantSpec(fmt, "channel", scale=f"pow2:{mode}")
    factors = [1 - 0.01 * i for i in range(0, 95, stride)]
    idx, hi, err, first = ref_linear_search(units, float(spec.qmin), float(spec.qmax), mode,
                                            factors)
    assert int((first < idx).sum()) >= 3  # units whose best is a plateau of several factors
    res = linear_search(units, None, None, spec, stride=stride)
    assert res.index.tolist() == idx.tolist()
    torch.testing.assert_close(res.hi, hi, rtol=0, atol=0)
    torch.testing.assert_close(res.lo, -hi, rtol=0, atol=0)
    torch.testing.assert_close(res.error.double(), err, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ Horizon's KL
def horizon_kl(bins: np.ndarray, i: int, nq: int, eps=(1e-10,)) -> list[float]:
    """``_entropy_torch(P, Q)`` of threshold ``i`` (``bins`` after ``h[0] = h[1]``): TensorRT's
    P and Q, then ``sum p log(p / (q + eps))`` of the normalised counts (Horizon: eps 1e-10,
    finite where P > 0 = Q), one value per ``eps``."""
    d = np.digitize(np.arange(i), np.linspace(0, i, nq + 1)) - 1
    d[bins[:i] == 0] = -1
    keep = d != -1
    g = np.where(keep, d, 0)
    dens = np.bincount(d[keep], weights=bins[:i][keep], minlength=nq)
    n = np.bincount(d[keep], minlength=nq)
    q = np.where(keep, dens[g] / np.maximum(n[g], 1), 0.0)
    p = bins[:i].copy()
    p[-1] += bins[i:].sum()
    p = p / p.sum() if p.sum() != 0 else p
    q = q / q.sum() if q.sum() != 0 else q
    m = p > 0
    return [float(np.sum(p[m] * np.log(p[m] / (q[m] + e)))) for e in eps]


def ref_horizon_amax(counts, *, nq=128, start=128, smooth=9, eps=(1e-10,)):
    """Horizon's ``_compute_amax_entropy`` per row (stride 1), in bins: every threshold up to
    the histogram's end, the full ``smooth``-wide window sums (``range(len(div) - smooth -
    1)``), the last minimum, ``amax = edges[j + start + smooth // 2]``; ``[len(eps), U]``, and
    how many thresholds have P > 0 = Q (a count beyond an empty last bin)."""
    out, gaps = [], 0
    for row in np.asarray(counts, dtype=np.float64):
        b = row.copy()
        b[0] = b[1]
        divs = np.array([horizon_kl(b, i, nq, eps) for i in range(start, len(b) + 1)]).T
        gaps += sum(1 for i in range(start, len(b) + 1) if b[i - 1] == 0 and b[i:].sum() > 0)
        amax = []
        for div in divs:
            sums = [sum(div[j:j + smooth]) for j in range(len(div) - smooth - 1)]
            best = min(sums)
            amax.append(max(k for k, v in enumerate(sums) if v == best))
        out.append([j + start + smooth // 2 for j in amax])
    return torch.tensor(out, dtype=torch.float32).T, gaps


def test_horizon_kl_prices_a_count_past_an_empty_bin_with_its_1e10_term():
    # heavy tails leave empty bins: a threshold on one holds the outliers in a bin Q leaves
    # empty, where Horizon's divergence is p log(p / 1e-10), finite, and in the 9-wide sums
    # it decides the choice (E13's 1e-12 adds p log 100 there and moves the amax)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 20_000, generator=g).abs() ** 2
    top = x.amax(1)
    counts = torch.stack([torch.histc(r, 512, 0, float(t)) for r, t in zip(x, top)]).long()
    (ref, other), gaps = ref_horizon_amax(counts[2:6], eps=(1e-10, 1e-12))
    assert gaps > 0
    assert bool((other != ref).any())  # the term matters on these histograms
    h = Hist(counts[2:6], torch.zeros(4), top[2:6], absolute=True)
    got = horizon_entropy_amax(h)
    torch.testing.assert_close(got, ref * top[2:6] / 512, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ mix: |x| percentiles
def ref_abs_percentile(counts, first, p, offset):
    """``|x|`` percentile of a signed histogram on the native grid (bin ``j`` is
    ``[(first + j) w, (first + j + 1) w)``), folded by hand: a negative bin ``k`` holds
    ``|x|`` in bin ``-1 - k``; the first folded bin whose cumulative count reaches ``p``
    percent (the decimal ``p``, exactly), in bin widths ``i + offset``."""
    out = []
    frac = Fraction(repr(p)) / 100
    for row in counts.tolist():
        folded = [0] * len(row)
        for j, n in enumerate(row):
            k = first + j
            folded[min(k if k >= 0 else -1 - k, len(row) - 1)] += n
        total, cum = sum(folded), 0
        for i, n in enumerate(folded):
            cum += n
            if cum >= frac * total:
                break
        out.append(i + offset)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("p", MIX_PERCENTILES)
@pytest.mark.parametrize(("convention", "offset"), [("center", 0.5), ("lower", 0.0),
                                                     ("upper", 1.0)])
def test_a_symmetric_mix_percentile_candidate_is_the_abs_percentile(p, convention, offset):
    # symmetric: the percentile of |x| (X4 passes the signed histogram, which the percentile
    # folds the same way: equivalent), clipped to the data's min / max
    g = torch.Generator().manual_seed(0)
    U, B = 3, 2048
    x = torch.randn(U, 100_000, generator=g) * torch.tensor([[1.0], [0.5], [2.0]])
    x[1] -= 0.7  # skewed: the negative tail is the longer
    counts = torch.stack([torch.histc(r, B, -5, 5) for r in x]).long()
    w = 10 / B
    h = Hist(counts, torch.full((U,), -5.0), torch.full((U,), 5.0))
    amax = (ref_abs_percentile(counts, -B // 2, p, offset) * w).float()
    nz = [torch.nonzero(r)[:, 0] for r in counts]
    lo_d = torch.tensor([-5 + float(n[0]) * w for n in nz], dtype=torch.float32)
    hi_d = torch.tensor([-5 + float(n[-1] + 1) * w for n in nz], dtype=torch.float32)
    lo, hi = mix_range(h, QuantSpec("int8", "tensor"), candidates=("percentile",),
                       percentiles=(p,), convention=convention)
    torch.testing.assert_close(hi, torch.minimum(amax, hi_d), rtol=1e-6, atol=0)
    torch.testing.assert_close(lo, torch.maximum(-amax, lo_d), rtol=1e-6, atol=0)
