"""Pins from session 59's mutation round of the estimators: the torch tiles engine chooses
what the C kernel chooses under every patience rule (per unit, global, the extension, the
plateau of equal encoded scales); a histogram search whose candidates all fit the refine
budget scores every one (its result is the argmin)."""

from __future__ import annotations

import pytest
import torch

from quantscope.estimators import histogram_mse_range, mse_search
from quantscope.kernels import lib
from quantscope.layout import Block
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist

KERNEL = "mse_search"  # the C search (estimators/mse_kernel.py)


@pytest.mark.parametrize(("spec", "patience"), [
    (QuantSpec("int4", "channel"), 1), (QuantSpec("int4", "channel"), 2),
    (QuantSpec("int4", "channel"), 3), (QuantSpec("int4", "channel"), 5),
    (QuantSpec("int4", "channel", scale="pow2:round"), 2),
    (QuantSpec("fp4_e2m1", Block(32), scale="e8m0:floor"), 2)],
    ids=["p1", "p2", "p3", "p5", "pow2-plateau", "mx-plateau"])
def test_the_torch_engine_chooses_as_the_kernel_under_patience(spec, patience):
    if lib(KERNEL) is None:
        pytest.skip("no C kernel here")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        units = torch.distributions.StudentT(3.0).sample((512, 64))  # heavy tails: late minima
    torch_path = mse_search(units, None, None, spec, backend="torch", patience=patience)
    kernel = mse_search(units, None, None, spec, patience=patience)
    assert torch.equal(torch_path.hi, kernel.hi) and torch.equal(torch_path.lo, kernel.lo)
    assert torch.equal(torch_path.error, kernel.error)


def test_a_refine_budget_holding_every_candidate_gives_the_argmin():
    # 64 bins from start_bin 0 are 4 x refine=16 candidates: all scored, as refine=None
    spec = QuantSpec("int2", "tensor")
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        levels = torch.randint(0, 6, (64,), generator=g) * (torch.rand(64, generator=g) < 0.15)
        hist = Hist((10 ** levels.double()).long()[None], torch.zeros(1), torch.ones(1),
                    absolute=True)
        refined = histogram_mse_range(hist, spec, start_bin=0, refine=16)
        full = histogram_mse_range(hist, spec, start_bin=0, refine=None)
        assert all(torch.equal(a, b) for a, b in zip(refined, full)), seed
