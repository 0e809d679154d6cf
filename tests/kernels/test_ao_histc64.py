"""csrc/ao_hist.c's ``qs_ao_histc64``: ``torch.histc`` of ``|x|`` (or ``x``) added into int64
counts, the first-grid histograms' count (observers/first_step.py: ModelOpt's
``HistogramCalibrator``), against :func:`quantscope.stats.histogram.linear_counts` (its torch
path: ``torch.histc``); the scalar and AVX2 builds: tests/kernels/test_ao_hist_branches.py."""

import pytest
import torch

from quantscope import kernels
from quantscope.stats.histogram import linear_counts

pytestmark = pytest.mark.skipif(kernels.lib("ao_hist") is None, reason="no compiled kernel")


@pytest.mark.parametrize("absolute", [1, 0])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_histc64_kernel_equals_linear_counts(absolute, threads):
    """qs_ao_histc64 adds torch.histc's counts (linear_counts) of |x| (or x) into int64
    counts, values outside [lo, hi] dropped; a batch split over threads gives the same."""
    lib = kernels.lib("ao_hist")
    g = torch.Generator().manual_seed(threads + 10 * absolute)
    for n in (1, 15, 16, 17, 1000, 2**19 + 3):
        x = torch.randn(n, generator=g) * 3
        x[::5] = -0.0
        B = int(torch.randint(1, 3000, (1,), generator=g))
        hi = float(x.abs().max()) * 0.9 if n > 1 else 1.0
        lo = 0.0 if absolute else -hi * 0.7
        u = x.abs() if absolute else x
        want = linear_counts(u[None], torch.tensor([lo]), torch.tensor([hi]), B)[0]
        counts = torch.full((B,), 7, dtype=torch.int64)
        assert lib.qs_ao_histc64(x.data_ptr(), n, lo, hi, B, counts.data_ptr(), absolute,
                                 threads) == 0
        assert torch.equal(counts - 7, want)
    counts = torch.zeros(4, dtype=torch.int64)  # an empty range: not taken, nothing written
    assert lib.qs_ao_histc64(x.data_ptr(), 4, 1.0, 1.0, 4, counts.data_ptr(), 1, 1) == 1
    assert not counts.any()


def test_histc64_drops_nan_inf_and_counts_past_float32():
    """NaN and values outside the range are not counted; a batch of more than 2 ** 24 values
    is counted exactly (int64: torch.histc's float32 counts stop there, linear_counts sums
    its chunks)."""
    lib = kernels.lib("ao_hist")
    x = torch.tensor([0.5, float("nan"), float("inf"), -float("inf"), 2.0, -0.5, 1.0])
    counts = torch.zeros(4, dtype=torch.int64)
    assert lib.qs_ao_histc64(x.data_ptr(), x.numel(), 0.0, 1.0, 4, counts.data_ptr(), 1, 1) == 0
    assert counts.tolist() == [0, 0, 2, 1]  # |x|: 0.5, 0.5, 1.0 (the right edge: last bin)
    n = (1 << 24) + 5
    x = torch.full((n,), 0.25)
    x[::3] = 0.75
    counts = torch.zeros(2, dtype=torch.int64)
    assert lib.qs_ao_histc64(x.data_ptr(), n, 0.0, 1.0, 2, counts.data_ptr(), 1, 2) == 0
    assert torch.equal(counts, linear_counts(x[None], torch.zeros(1), torch.ones(1), 2)[0])
    assert counts.tolist() == [n - (n + 2) // 3, (n + 2) // 3]
