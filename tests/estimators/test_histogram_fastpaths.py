"""The short paths of the histogram estimators against the forms they replace.

Each fast path (the entropy kernel's trimmed table, skipped infinite candidates and in-place
pick; both percentile tails in one pass; the bin width computed once) must give the same
bits as the slower form it stands for.
"""

import numpy as np
import pytest
import torch
from oracles import tensorrt_entropy_loop

from quantscope import kernels
from quantscope.estimators import entropy
from quantscope.estimators.entropy import entropy_amax, entropy_divergences
from quantscope.estimators.percentile import percentile_range, percentile_value
from quantscope.stats import histogram as H
from quantscope.stats.histogram import Hist


def _signed_hist(seed, U=4, bins=256):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(U, 3000, generator=g) * torch.rand(U, 1, generator=g) * 5
    u[0, :4] *= 30  # a long, sparse tail
    u[1] += 2.0
    st = H.update(H.empty_state(U, bins), u, u.amin(1), u.amax(1))
    return H.view(st)


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and \
        torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


@pytest.mark.parametrize("bits,unsigned", [(8, False), (8, True), (4, False), (2, False)])
@pytest.mark.parametrize("trim", [True, False])
def test_entropy_amax_kernel_pick_is_the_last_argmin_of_its_divergences(bits, unsigned, trim):
    h = _signed_hist(1)
    h = Hist(h.counts.clone(), h.lo, h.hi)
    h.counts[3] = 0  # a unit without data: the fallback bin
    got = entropy_amax(h, num_bits=bits, unsigned=unsigned, start_bin=64, trim=trim)
    f = H.fold_abs(h)
    B = f.bins
    last = torch.tensor([int(r.nonzero().max()) + 1 if r.any() else 0 for r in f.counts])
    kl, cand = entropy_divergences(f.counts, num_bits=bits, unsigned=unsigned, start_bin=64,
                                   stop=last if trim else torch.full_like(last, B))
    key = torch.where(torch.isfinite(kl), kl, torch.full_like(kl, float("inf"))).flip(-1)
    i = torch.where(torch.isfinite(kl).any(-1), cand[cand.numel() - 1 - key.argmin(-1)], last)
    assert torch.equal(got, f.lo + i * f.width)
    assert torch.equal(got[3], torch.tensor(0.0))


@pytest.mark.parametrize("smooth", [1, 9])
@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("copy_zero_bin", [True, False])
def test_entropy_amax_kernel_equals_the_torch_path(monkeypatch, smooth, trim, copy_zero_bin):
    # the kernel takes the int64 counts (zero-bin copy, float64 cast, trim end and fallback
    # bin in its own pass); the torch path does each step with tensor ops
    h = _signed_hist(3)
    h = Hist(h.counts.clone(), h.lo, h.hi)
    h.counts[2] = 0  # no data: the fallback bin
    h.counts[1, h.counts[1].nonzero()[5:, 0]] = 0  # too few bins for a candidate: fallback
    kw = {"start_bin": 32, "smooth": smooth, "trim": trim, "copy_zero_bin": copy_zero_bin}
    got = entropy_amax(h, **kw)
    monkeypatch.setattr(entropy, "_kernel", lambda: None)
    assert torch.equal(got, entropy_amax(h, **kw))


@pytest.mark.parametrize("seed", range(6))
def test_entropy_kernel_trimmed_to_stop_equals_the_torch_form(seed):
    # the kernel tabulates groups only up to each unit's stop and skips infinite candidates
    g = torch.Generator().manual_seed(seed)
    U, B = 5, int(torch.randint(40, 400, (1,), generator=g))
    counts = torch.randint(0, 500, (U, B), generator=g) * (torch.rand(U, B, generator=g) < 0.6)
    stop = torch.randint(0, B + 3, (U,), generator=g)  # beyond B too
    for bits in (3, 6, 8, 9):
        start = int(torch.randint(1, B // 2, (1,), generator=g))
        for stride in (1, 3):
            pick = torch.empty(U, dtype=torch.int64)
            a, _ = entropy_divergences(counts, num_bits=bits, start_bin=start, stride=stride,
                                       stop=stop, pick=pick)
            b, _ = entropy_divergences(counts, num_bits=bits, start_bin=start, stride=stride,
                                       stop=stop, backend="torch")
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            assert torch.equal(a.isinf(), b.isinf())
            fin = torch.isfinite(b)
            torch.testing.assert_close(a[fin], b[fin], rtol=1e-10, atol=1e-12)
            key = torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf"))).flip(-1)
            want = start + stride * (a.shape[1] - 1 - key.argmin(-1))
            if not kernels.available("entropy"):  # the torch form picks nothing: -2
                assert (pick == -2).all()
                continue
            assert torch.equal(pick, torch.where(torch.isfinite(a).any(-1), want, -1))


@pytest.mark.parametrize("n,bits", [(40, 8), (100, 8), (60, 7)])
def test_entropy_threshold_at_the_last_bin_with_fewer_bins_than_groups(n, bits):
    # i = B < nq: an empty group starts at bin B (the kernel read past its table there once)
    rng = np.random.default_rng(n)
    hist = rng.integers(1, 50, n).astype(np.float64)
    ref, _ = tensorrt_entropy_loop(hist, bits, 8, 1)
    counts = torch.from_numpy(hist).long()[None].repeat(3, 1)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            div, _ = entropy_divergences(counts, num_bits=bits, start_bin=8)
        finally:
            torch.set_num_threads(1)
        for row in div:
            np.testing.assert_allclose(row.numpy(), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("p", [99.99, 50.0, 100.0, [99.9, 99.99, 50.0, 100.0]])
@pytest.mark.parametrize("convention", ["lower", "center", "upper"])
def test_percentile_both_tails_in_one_pass_equal_each_tail_alone(p, convention):
    h = _signed_hist(2)
    lo, hi = percentile_range(h, p, symmetric=False, convention=convention)
    U = h.counts.shape[0]
    f = (100 + torch.as_tensor(p, dtype=torch.float64)) / 2  # percent from each end
    f = f if f.dim() == 0 else f.expand(U, -1)
    w = (h.hi - h.lo) / h.bins
    assert torch.equal(hi, percentile_value(h.counts, h.lo, w, f, convention))
    assert torch.equal(lo, -percentile_value(h.counts.flip(-1), -h.hi, w, f, convention))
    a_lo, a_hi = percentile_range(h, p, symmetric=True, convention=convention)
    fa = H.fold_abs(h)
    fs = torch.as_tensor(p, dtype=torch.float64)
    amax = percentile_value(fa.counts, fa.lo, fa.width, fs if fs.dim() == 0 else
                            fs.expand(U, -1), convention)
    assert torch.equal(a_hi, amax) and torch.equal(a_lo, -amax)


def test_percentile_rejects_out_of_range_values():
    h = _signed_hist(3)
    for bad in (0.0, 101.0, float("nan"), [99.0, 0.0]):
        with pytest.raises(ValueError, match="percentile must be in"):
            percentile_range(h, bad)


def test_the_width_computed_once_is_the_width_formula():
    h = _signed_hist(4)
    assert h.step is not None and torch.equal(h.width, (h.hi - h.lo) / h.bins)
    bare = Hist(h.counts, h.lo, h.hi)
    assert bare.step is None and torch.equal(bare.width, h.width)
    # a reference grid (not a power of two wide): fold_abs keeps (hi - lo) / B of its result
    ref = Hist(h.counts, torch.full_like(h.lo, -3.3), torch.full_like(h.hi, 7.1))
    f = H.fold_abs(ref)
    assert torch.equal(f.width, (f.hi - f.lo) / f.bins)
    assert torch.equal(Hist(*f[:4]).width, f.width)
