"""The entropy kernel's two sources of a group's ``G log(G / n)``: a table per unit, where
making it costs fewer logs than the candidates read (many groups per threshold, few bins per
group), or each candidate's ``nq`` terms computed directly (int2 / int4 at 2048 bins, or tens
of thousands of bins at int8), which keeps memory O(bins) per thread. Both paths give the
torch form's and the literal loop's values, and the same bits for the same threshold.
"""

import numpy as np
import pytest
import torch
from oracles import tensorrt_entropy_loop
from peak_memory import extra_peak_mb

from quantscope import kernels
from quantscope.estimators.entropy import entropy_divergences

pytestmark = pytest.mark.skipif(not kernels.available("entropy"), reason="no C kernel")


def _takes_table(bins, bits, stop, start=128):
    """The kernel's rule (stride 1): the table's entries fewer than candidates x nq."""
    nq = 1 << (bits - 1)
    lim = min(stop, bins)
    entries = sum(max(0, min((z + 1) * nq, lim - z + 1)) for z in range(-(-lim // nq) + 1))
    return entries < max(0, min(stop, bins) - start + 1) * nq


def _counts(U, bins, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(U, 50000, generator=g).abs() * (torch.rand(U, 1, generator=g) + 0.5)
    counts = torch.stack([torch.histc(r, bins, 0, float(x.max())) for r in x]).long()
    counts[0, bins // 3:: 7] = 0  # sparse: empty last bins with outliers beyond (infinite)
    return counts


def _close(a, b):
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.isinf(), b.isinf())
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bits,bins,table", [(2, 2048, False), (4, 2048, False),
                                             (8, 2048, True), (8, 256, True), (4, 256, False),
                                             (6, 4096, False), (8, 40000, False)])
def test_kernel_equals_the_torch_form_on_either_path(bits, bins, table):
    assert _takes_table(bins, bits, bins) == table  # the case takes the path it names
    counts = _counts(3, bins)
    a, _ = entropy_divergences(counts, num_bits=bits, backend="kernel")
    b, _ = entropy_divergences(counts, num_bits=bits, backend="torch")
    _close(a, b)


@pytest.mark.parametrize("bits,bins", [(2, 300), (4, 300), (8, 300)])
def test_kernel_equals_the_literal_loop_on_either_path(bits, bins):
    hist = _counts(1, bins, seed=bits)[0]
    ref, _ = tensorrt_entropy_loop(hist.numpy().astype(np.float64), bits, 128, 1)
    div, _ = entropy_divergences(hist[None], num_bits=bits, start_bin=128, backend="kernel")
    div = div[0].numpy()
    assert np.array_equal(np.isinf(div), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(div[fin], ref[fin], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_paths_agree_bit_for_bit_on_a_shared_threshold(threads):
    # one histogram, trimmed at 600 (the table) and not (direct terms): a threshold's
    # divergence does not depend on the trim, so its bits must not either; units of both
    # kinds (and none, stop below start_bin) in one call share a thread's buffers
    bins, bits = 4096, 6
    assert not _takes_table(bins, bits, bins) and _takes_table(bins, bits, 600)
    row = _counts(1, bins, seed=5)[0]
    counts = row.repeat(4, 1)
    stop = torch.tensor([bins, 600, 0, 600])
    torch.set_num_threads(threads)
    try:
        pick = torch.empty(4, dtype=torch.int64)
        a, _ = entropy_divergences(counts, num_bits=bits, stop=stop, backend="kernel", pick=pick)
    finally:
        torch.set_num_threads(1)
    upto = 600 - 128 + 1
    assert torch.equal(a[0, :upto].view(torch.int64), a[1, :upto].view(torch.int64))
    assert torch.equal(a[1].view(torch.int64), a[3].view(torch.int64))
    assert torch.isnan(a[2]).all()
    _close(a, entropy_divergences(counts, num_bits=bits, stop=stop, backend="torch")[0])
    key = torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf"))).flip(-1)
    want = 128 + (a.shape[1] - 1 - key.argmin(-1))
    assert torch.equal(pick, torch.where(torch.isfinite(a).any(-1), want, -1))


@pytest.mark.parametrize("bits,bins", [(4, 16384), (8, 32768)])
def test_direct_terms_keep_memory_linear_in_bins(bits, bins):
    # the table held ~bins^2 / nq float64 (int4, 16384 bins: ~140 MB; int8, 32768: ~65 MB)
    counts = _counts(1, bins)
    assert not _takes_table(bins, bits, bins)
    entropy_divergences(counts[:, :256], num_bits=bits, backend="kernel")  # built and loaded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with extra_peak_mb() as extra:
            entropy_divergences(counts, num_bits=bits, backend="kernel")
    finally:
        torch.set_num_threads(threads)
    assert extra() < 16  # MB: a few [bins] arrays and the [C] output
