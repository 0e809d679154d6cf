"""Pins from session 59's mutation round of the estimators: the torch tiles engine chooses
what the C kernel chooses under every patience rule (per unit, global, the extension, the
plateau of equal encoded scales); a histogram search whose candidates all fit the refine
budget scores every one (its result is the argmin); the pow2 and Horizon searches price
every candidate of theirs, by the one error formula; the refusals and limits of the
candidate grid."""

from __future__ import annotations

import pytest
import torch

from quantscope.estimators import (
    histogram_mse_range,
    linear_search,
    mse_search,
    pow2_search,
    range_error,
)
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


def _priced(units, lo, hi, spec, factors):
    """Each candidate range ``(lo * f, hi * f)``'s error by the one formula, ``range_error``."""
    return torch.stack([range_error(units, lo * f, hi * f, spec) for f in factors])


def test_pow2_search_tries_every_factor_of_its_span():
    # an outlier among small values: the best is the smallest factor, 1/4 (a mutant that
    # stopped at 1/2 chose a range twice as wide)
    units = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0)) * 0.1
    units[0, 0] = 4.0
    spec = QuantSpec("int4", "tensor", scale="pow2:round")
    lo, hi = units.amin(1), units.amax(1)
    factors = [4.0, 2.0, 1.0, 0.5, 0.25]
    errors = _priced(units, lo, hi, spec, factors)
    res = pow2_search(units, None, None, spec)
    best = int(errors[:, 0].argmin())  # the first strict minimum, as Quark's
    assert torch.equal(res.hi, hi * factors[best]) and best == len(factors) - 1


def test_horizons_linear_search_prices_its_last_factor_and_keeps_the_last_minimum():
    g = torch.Generator().manual_seed(0)
    units = (torch.rand(1, 100_000, generator=g) - 0.5) * 0.1
    units[0, 0] = 1.0  # the best range is the narrowest, 0.06 of the outlier
    spec = QuantSpec("int4", "tensor")
    amax = units.abs().amax(1)
    factors = [1 - 0.01 * i for i in range(95)]
    errors = _priced(units, -amax, amax, spec, factors)[:, 0]
    last_min = len(factors) - 1 - int(errors.flip(0).argmin())
    res = linear_search(units, None, None, spec)
    assert int(res.index) == last_min == 94
    assert torch.equal(res.hi, amax * factors[last_min])


def test_a_native_search_of_no_candidates_is_refused():
    # maxshrink * grid below 1: no shrink factor (a mutant returned min-max, error 3.4e38)
    with pytest.raises(ValueError, match="0 candidates"):
        mse_search(torch.randn(4, 64), None, None, QuantSpec("int8", "channel"),
                   maxshrink=0.005, grid=100)


def test_llm_compressors_search_without_steps_is_the_expanded_range():
    units = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    res = mse_search(units, None, None, QuantSpec("int8", "channel"), compat="llmcompressor",
                     maxshrink=0.0, expand=1.5)
    assert torch.equal(res.hi, units.amax(1) * 1.5) and torch.equal(res.lo, units.amin(1) * 1.5)
