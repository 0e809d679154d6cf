"""Entropy (KL) calibration against TensorRT's loop written out here (ModelOpt 0.47's
``_compute_amax_entropy``, step for step, in numpy float64), with the documented additions:
candidates trimmed at the last non-empty bin, an infinite divergence where no count lies
below the threshold, the ``smooth`` moving average (centred, ``width // 2`` either side,
inf if any divergence in the window is), the last minimum, and the fallback to the right
edge of the last non-empty bin where no divergence is finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantscope.estimators import entropy_amax
from quantscope.estimators.entropy import entropy_divergences, horizon_entropy_amax
from quantscope.estimators.mix import mix_range
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist


# ------------------------------------------------------------------ TensorRT's loop
def trt_kl(counts, i: int, nq: int) -> float:
    """KL(P || Q) of threshold bin ``i`` (``counts`` after ``h[0] = h[1]``), as the loop."""
    if i == 0:  # no bin below it: infinite (documented; the loop's p[-1] fails there)
        return math.inf
    bins = np.asarray(counts, dtype=np.float64)
    d = np.digitize(range(i), np.linspace(0, i, nq + 1)) - 1
    d[bins[:i] == 0] = -1
    dens = np.zeros(nq)
    for k, g in enumerate(d):
        if g != -1:
            dens[g] += bins[k]
    for g in set(d.tolist()) - {-1}:
        dens[g] /= int((d == g).sum())
    q = np.array([dens[g] if g != -1 else 0.0 for g in d])
    p = bins[:i].copy()
    p[-1] += bins[i:].sum()
    if p.sum() == 0 or bins[:i].sum() == 0:  # no count below i: infinite (documented)
        return math.inf
    p, q = p / p.sum(), q / q.sum()
    if ((p > 0) & (q == 0)).any():
        return math.inf
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / q[m])))


def ref_entropy_amax(counts, width, *, num_bits=8, unsigned=False, start_bin=128, smooth=1,
                     trim=True):
    """Per-unit amax by the documented algorithm (``counts`` of an ``|x|`` histogram at 0)."""
    nq = 1 << (num_bits - 1 + int(unsigned))
    out = []
    for row in np.asarray(counts, dtype=np.float64):
        b = row.copy()
        b[0] = b[1]
        nonempty = np.nonzero(row > 0)[0]
        stop = int(nonempty[-1]) + 1 if len(nonempty) else 0  # one past the last non-empty
        cand = list(range(start_bin, (min(stop, len(row)) if trim else len(row)) + 1))
        kl = [trt_kl(b, i, nq) for i in cand]
        if smooth > 1:
            h = smooth // 2
            kl = [math.inf if any(math.isinf(v) for v in kl[max(0, c - h):c + h + 1])
                  else float(np.mean(kl[max(0, c - h):c + h + 1])) for c in range(len(kl))]
        finite = [c for c, v in enumerate(kl) if math.isfinite(v)]
        if not finite:  # the right edge of the last non-empty bin
            out.append(stop * width)
            continue
        best = min(kl[c] for c in finite)
        out.append(cand[max(c for c in finite if kl[c] == best)] * width)
    return torch.tensor(out, dtype=torch.float32)


def _hist(counts, width=1.0):
    counts = torch.as_tensor(counts, dtype=torch.int64)
    U, B = counts.shape
    return Hist(counts, torch.zeros(U), torch.full((U,), B * width), absolute=True)


def _skewed(U=2, B=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(U, 20_000, generator=g).abs() ** 1.5
    top = float(x.max())
    return torch.stack([torch.histc(r, B, 0, top) for r in x]).long(), top / B


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(("num_bits", "unsigned"), [(4, True), (3, True), (4, False)])
def test_entropy_amax_is_trts_loop_with_its_unsigned_levels(num_bits, unsigned):
    # unsigned: 2 ** bits quantized bins over [0, amax] (E2 kept 2 ** (bits - 1))
    counts, w = _skewed()
    ref = ref_entropy_amax(counts, w, num_bits=num_bits, unsigned=unsigned, start_bin=32)
    got = entropy_amax(_hist(counts, w), num_bits=num_bits, unsigned=unsigned, start_bin=32)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    kl, cand = entropy_divergences(counts, num_bits=num_bits, unsigned=unsigned, start_bin=32)
    b = counts[0].double().numpy().copy()
    b[0] = b[1]
    ref_kl = torch.tensor([trt_kl(b, int(i), 1 << (num_bits - 1 + int(unsigned)))
                           for i in cand], dtype=torch.float64)
    torch.testing.assert_close(kl[0], ref_kl, rtol=1e-9, atol=1e-12)


def test_start_bin_equal_to_bins_is_the_one_threshold_at_the_end():
    # TensorRT's range(start_bin, bins + 1): start_bin == bins leaves one candidate, bins
    counts, w = _skewed(B=64)
    counts[:, -1] += 1  # the last bin occupied: trimming keeps the candidate
    kl, cand = entropy_divergences(counts, start_bin=64, num_bits=4)
    b = counts[0].double().numpy().copy()
    b[0] = b[1]
    assert cand.tolist() == [64]
    torch.testing.assert_close(kl[0], torch.tensor([trt_kl(b, 64, 8)], dtype=torch.float64))
    got = entropy_amax(_hist(counts, w), start_bin=64, num_bits=4)
    torch.testing.assert_close(got, ref_entropy_amax(counts, w, start_bin=64, num_bits=4))


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_start_bin_zero_scores_threshold_zero_infinite_on_every_path(backend, dtype):
    """Threshold 0 holds no count: infinite, on the kernel (int64 counts) and the torch form
    (float counts, a forced backend, off the CPU), which divided by the threshold (torch's
    ``ZeroDivisionError``); the other thresholds are the loop's."""
    c = [5, 3, 0, 1]
    kl, cand = entropy_divergences(torch.tensor([c], dtype=dtype), num_bits=2, start_bin=0,
                                   backend=backend)
    assert cand.tolist() == [0, 1, 2, 3, 4]
    assert torch.isinf(kl[0, 0])
    want = [trt_kl([c[1], *c[1:]], i, 2) for i in range(1, 4)]  # h[0] = h[1]
    assert kl[0, 1:4].tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)
    h = Hist(torch.tensor([c], dtype=dtype), torch.zeros(1), torch.tensor([4.0]), absolute=True)
    assert entropy_amax(h, num_bits=2, start_bin=0).tolist() == pytest.approx(
        ref_entropy_amax([c], 1.0, num_bits=2, start_bin=0).tolist())


def test_horizons_kl_refuses_start_bin_zero_by_name():
    """Horizon's loop fails at threshold 0 (the last bin of none): a named refusal here, not
    torch's ``ZeroDivisionError``."""
    h = Hist(torch.ones(1, 300, dtype=torch.long), torch.zeros(1), torch.tensor([300.0]),
             absolute=True)
    with pytest.raises(ValueError, match=r"^horizon_entropy: start_bin=0 is a threshold of no "
                                         r"bin"):
        horizon_entropy_amax(h, start_bin=0)
    assert horizon_entropy_amax(h, start_bin=1).shape == (1,)


@pytest.mark.parametrize(("smooth", "trim", "count"), [(1, True, 1.0), (3, True, 1.0),
                                                      (1, False, 1000.0), (3, False, 1000.0)])
def test_proportional_thresholds_tie_at_zero_and_the_last_wins_in_float_counts(smooth, trim,
                                                                              count):
    # flat groups (equal counts) and no outliers: P == Q, KL 0 exactly in the loop, at many
    # thresholds; float counts run the torch form (E5 left its rounding noise there, which
    # picked among them; E9 took the first minimum)
    c = torch.zeros(3, 256, dtype=torch.float64)
    c[0, :150] = count
    c[1, :90] = count
    c[1, 90:150:7] = count
    c[2, :200] = count
    c[2, :200:3] = 2 * count
    ref = ref_entropy_amax(c.numpy(), 1.0, num_bits=4, start_bin=16, smooth=smooth, trim=trim)
    h = Hist(c, torch.zeros(3), torch.full((3,), 256.0), absolute=True)
    got = entropy_amax(h, num_bits=4, start_bin=16, smooth=smooth, trim=trim)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("smooth", [2, 3, 4, 5])
def test_smoothed_divergences_pick_as_the_loop_smoothed(smooth):
    counts, w = _skewed(B=160, seed=1)
    counts[:, 100:110] = 0  # empty bins: thresholds there are infinite (P > 0 = Q)
    ref = ref_entropy_amax(counts, w, num_bits=4, start_bin=32, smooth=smooth)
    got = entropy_amax(_hist(counts, w), num_bits=4, start_bin=32, smooth=smooth)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_an_infinite_divergence_makes_its_window_infinite():
    # a low divergence next to infinite ones must not win through the average (E7)
    c = torch.zeros(1, 96, dtype=torch.int64)
    c[0, :40] = torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(3))
    c[0, 40:60] = 0
    c[0, 60] = 1000
    c[0, 61:64] = 0
    c[0, 64:90] = 5
    for smooth in (3, 5):
        ref = ref_entropy_amax(c, 1.0, num_bits=3, start_bin=8, smooth=smooth)
        got = entropy_amax(_hist(c), num_bits=3, start_bin=8, smooth=smooth)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("smooth", [1, 3])
@pytest.mark.parametrize("last", [0, 10, 100])
def test_data_below_start_bin_fall_back_to_their_last_bins_right_edge(smooth, last):
    # documented: the right edge of the last non-empty bin (E8: the grid's end; E14: its left)
    c = torch.zeros(2, 256, dtype=torch.int64)
    c[0, last] = 5
    c[1, : last + 1] = 3
    got = entropy_amax(_hist(c, 1 / 256), smooth=smooth)
    torch.testing.assert_close(got, ref_entropy_amax(c, 1 / 256, smooth=smooth))
    torch.testing.assert_close(got, torch.full((2,), (last + 1) / 256))


@pytest.mark.parametrize("smooth", [1, 3])
def test_the_threshold_past_the_last_occupied_bin_is_a_candidate(smooth):
    # trimming ends the candidates one past the last non-empty bin, which is one of them
    counts, w = _skewed(B=160, seed=2)
    got = entropy_amax(_hist(counts, w), num_bits=4, start_bin=32, smooth=smooth)
    torch.testing.assert_close(got, ref_entropy_amax(counts, w, num_bits=4, start_bin=32,
                                                     smooth=smooth), rtol=1e-6, atol=0)


def test_mix_scores_the_entropy_candidate_of_the_specs_unsigned_kl():
    # uint4 asymmetric on non-negative data: the entropy observer's KL is unsigned (2 ** 4
    # quantized bins, X5 took 2 ** 3); the mix's entropy-only choice is its range clipped
    counts, w = _skewed(U=2, B=256, seed=4)
    counts[:, -1] += 1
    U, B = counts.shape
    h = Hist(counts, torch.zeros(U), torch.full((U,), B * w))
    spec = QuantSpec("uint4", "tensor", symmetric=False)
    lo, hi = mix_range(h, spec, candidates=("entropy",))
    ref = ref_entropy_amax(counts, w, num_bits=4, unsigned=True)
    torch.testing.assert_close(hi, torch.minimum(ref, torch.full((U,), B * w)), rtol=1e-6, atol=0)
    torch.testing.assert_close(lo, torch.zeros(U))  # clipped to the data's min (X1)
