"""histogram_error on a Hist with float64 ends (public API): the C kernel reads its ends and
bin widths as float32; the torch path (backend="torch", and every path without a C
compiler or under QUANTSCOPE_NO_KERNEL) built float64 centres, so the two disagreed
(~1.6e-5 relative): both now score float32 ends, the torch path the reference again."""

import pytest
import torch

from quantscope import kernels, presets
from quantscope.estimators.error import histogram_error
from quantscope.stats.histogram import Hist


def _case():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (3, 64), generator=g)
    lo, hi = -torch.rand(3, generator=g) - 1, torch.rand(3, generator=g) + 1
    cand = torch.linspace(0.5, 1.0, 5)
    return counts, lo, hi, (lo[:, None] * cand, hi[:, None] * cand, presets.INT8_PER_CHANNEL)


@pytest.mark.parametrize("points", [1, 4])
def test_the_torch_path_scores_float64_ends_as_their_float32_values(points):
    counts, lo, hi, args = _case()
    f32 = histogram_error(Hist(counts, lo, hi), *args, points=points, backend="torch")
    f64 = histogram_error(Hist(counts, lo.double(), hi.double()), *args, points=points,
                          backend="torch")
    assert torch.equal(f32, f64)


@pytest.mark.skipif(not kernels.available("hist_error"), reason="no C kernel")
def test_kernel_and_torch_agree_on_float64_ends():
    counts, lo, hi, args = _case()
    hist = Hist(counts, lo.double(), hi.double())
    ours = histogram_error(hist, *args, points=4, backend="kernel")
    ref = histogram_error(hist, *args, points=4, backend="torch")
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
