"""Pins of survivors of a mutation round (s69) over the percentile, mix, histogram-MSE and
histogram-error estimators: a convention that is not a string, the conventions' reference
aliases, both tails of a percent past the exact test, a one-percent list's shape and the
defaults; mix's options, ends, clipping, global amax, start bin and MSE bounds; the MSE
range's refine search; ``histogram_error``'s own centres. Expected values come from the
module docs and docstrings (the bin rule, the conventions table, the refine procedure), not
from the code's output."""

import pytest
import torch

from quantscope import QuantSpec
from quantscope.estimators.error import histogram_error
from quantscope.estimators.histogram_mse import histogram_mse_range
from quantscope.estimators.mix import check_options, mix_range
from quantscope.estimators.percentile import (
    check_convention,
    percentile_range,
    percentile_value,
)
from quantscope.presets import NVFP4
from quantscope.stats.histogram import Hist


@pytest.mark.parametrize("convention", [["lower"], {"upper": 1}])
def test_check_convention_refuses_an_unhashable_convention_as_a_value_error(convention):
    """A list or dict (unhashable: a bare TypeError from ``in``) is a ValueError naming the
    choices, as any other bad convention."""
    with pytest.raises(ValueError, match="convention must be one of"):
        check_convention("who", convention)


@pytest.mark.parametrize("alias,same", [("quark", "lower"), ("modelopt", "lower"),
                                        ("tensorrt", "lower"), ("horizon", "center"),
                                        ("centre", "center")])
def test_reference_aliases_report_their_references_bin_value(alias, same):
    """The module's table: Quark, ModelOpt / TensorRT report the left edge, Horizon the
    centre. Half the total in bin 2 of [0, 8) (width 1): lower 2, centre 2.5."""
    counts = torch.tensor([[1, 1, 2, 4, 0, 0, 0, 0]])
    lo, w = torch.zeros(1), torch.ones(1)
    want = {"lower": 2.0, "center": 2.5}[same]
    assert percentile_value(counts, lo, w, 50.0, alias).item() == want


def test_both_tails_of_a_percent_past_the_exact_test_are_at_half_the_excluded_mass():
    """99.99999999 (eight places) leaves 1e-10 of the total out, 5e-11 per tail: each tail's
    float test is at (100 + p) / 2 percent, not at p. Total 1e11 with 8 counts in each end
    bin: a tail's share (all but 5) is reached past the end bin's neighbour, where a share
    of p (all but 10) would be reached already."""
    total = 10**11
    counts = torch.tensor([[8, total - 16, 8, 0]])
    h = Hist(counts, torch.zeros(1), torch.full((1,), 4.0))
    lo, hi = percentile_range(h, 99.99999999, symmetric=False, convention="lower")
    # the upper tail reaches total - 5 in bin 2 (left edge 2); the lower, on the reversed
    # counts from -4, in reversed bin 3: -(-4 + 3) = 1, bin 0's right edge
    assert (lo.item(), hi.item()) == (1.0, 2.0)


def test_a_symmetric_list_of_one_percent_gives_one_column():
    """A ``[K]`` list gives ``[U, K]``, also for K = 1 (only a bare float gives ``[U]``)."""
    counts = torch.tensor([[0, 1, 1, 2, 4, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 4]])
    h = Hist(counts, torch.zeros(2), torch.full((2,), 8.0), absolute=True)
    lo, hi = percentile_range(h, [50.0])
    assert lo.shape == hi.shape == (2, 1)
    flo, fhi = percentile_range(h, 50.0)
    assert torch.equal(lo[:, 0], flo) and torch.equal(hi[:, 0], fhi)


def test_defaults_are_99_99_percent_and_the_bin_centre():
    """``percentile_range`` defaults to 99.99 % and, as ``percentile_value``, to the centre
    convention (the module doc's default). 99.99 % of 10000 is 9999: reached in bin 1 of
    [0, 4) (99.9 % would be reached in bin 0), centre 1.5."""
    counts = torch.tensor([[9990, 9, 1, 0]])
    h = Hist(counts, torch.zeros(1), torch.full((1,), 4.0), absolute=True)
    lo, hi = percentile_range(h)
    assert (lo.item(), hi.item()) == (-1.5, 1.5)
    assert percentile_value(counts, torch.zeros(1), torch.ones(1), 99.99).item() == 1.5


def test_empty_percentiles_are_refused_only_when_percentile_is_the_only_candidate():
    """With another candidate left, no percentiles is a valid choice (nothing refused)."""
    with pytest.raises(ValueError, match="percentiles must not be empty"):
        check_options(candidates=("percentile",), percentiles=())
    assert check_options(candidates=["percentile", "minmax"], percentiles=[]) == (
        ("percentile", "minmax"), ())
    counts = torch.tensor([[0, 3, 5, 0, 1, 0, 0, 0]])
    h = Hist(counts, torch.zeros(1), torch.full((1,), 8.0), absolute=True)
    lo, hi, choice = mix_range(h, QuantSpec("int8"), candidates=("percentile", "minmax"),
                               percentiles=(), return_choice=True)
    # the one candidate left: min / max, the occupied bins' edges
    assert (lo.item(), hi.item(), choice.item()) == (1.0, 5.0, 0)


def _outlier_hist() -> Hist:
    """256 bins of |x| over [0, 256): dense in bins 0-39, one count in the last bin."""
    counts = torch.zeros(1, 256, dtype=torch.int64)
    counts[0, :40] = 100000
    counts[0, 255] = 1
    return Hist(counts, torch.zeros(1), torch.full((1,), 256.0), absolute=True)


def test_mix_scores_mse_candidates_from_bin_128_by_default():
    """``start_bin`` defaults to ModelOpt's 128: the MSE candidate is a bin centre from bin
    128 on, even where a clip nearer the dense bins (from bin 64) would err less."""
    h, spec = _outlier_hist(), QuantSpec("int8")
    _, hi = mix_range(h, spec, candidates=("mse",))
    assert hi.item() >= 128.5
    assert torch.equal(hi, mix_range(h, spec, candidates=("mse",), start_bin=128)[1])
    assert mix_range(h, spec, candidates=("mse",), start_bin=64)[1].item() < 128


@pytest.mark.parametrize("given, want", [({"lo": torch.tensor([2.0])}, (2.0, 5.0)),
                                         ({"hi": torch.tensor([4.0])}, (1.0, 4.0))])
def test_mix_keeps_a_given_end_and_takes_the_other_from_the_occupied_bins(given, want):
    """Each of ``lo`` / ``hi`` not given is the occupied bins' edge (min / max here: 1 and 5);
    a given one is kept (it was dropped when the other was missing)."""
    counts = torch.tensor([[0, 3, 5, 0, 1, 0, 0, 0]])
    h = Hist(counts, torch.zeros(1), torch.full((1,), 8.0), absolute=True)
    lo, hi = mix_range(h, QuantSpec("int8"), candidates=("minmax",), **given)
    assert (lo.item(), hi.item()) == want


def test_mix_clips_its_candidates_to_the_datas_min_and_max():
    """A candidate is the range that runs: clipped to the data's ``lo``, ``hi``. The 99.9 %
    percentile of |x| is bin 4's centre, (-4.5, 4.5), clipped to the data's [1.5, 4.25]."""
    counts = torch.tensor([[0, 3, 5, 0, 1, 0, 0, 0]])
    h = Hist(counts, torch.zeros(1), torch.full((1,), 8.0), absolute=True)
    lo, hi = mix_range(h, QuantSpec("int8"), lo=torch.tensor([1.5]), hi=torch.tensor([4.25]),
                       candidates=("percentile",), percentiles=(99.9,))
    assert (lo.item(), hi.item()) == (1.5, 4.25)


def test_mix_scores_a_global_scale_spec_under_the_data_max_by_default():
    """NVFP4: without ``global_amax`` the candidates are scored under ``lo``, ``hi``'s
    tensor-wide ``max |x|`` (the docstring's default), here 6.5."""
    counts = torch.tensor([[0, 3, 5, 0, 1, 0, 0, 0], [2, 0, 0, 4, 0, 0, 1, 0]])
    h = Hist(counts, torch.zeros(2), torch.full((2,), 8.0), absolute=True)
    lo, hi = torch.tensor([-4.5, -6.5]), torch.tensor([4.5, 6.0])
    got = mix_range(h, NVFP4, lo=lo, hi=hi, candidates=("minmax", "percentile"))
    want = mix_range(h, NVFP4, lo=lo, hi=hi, candidates=("minmax", "percentile"),
                     global_amax=torch.tensor(6.5))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_mix_mse_candidate_is_searched_within_the_datas_range():
    """The MSE candidate is the histogram-MSE range under ``bounds=(lo, hi)``: candidates
    past ``hi`` score as ``hi`` (the range that runs), so with ``hi`` = 253 a clip inside it
    wins; searched without the bounds the best is past 253 and only then clipped to it."""
    counts = (torch.arange(256, 0, -1) ** 2)[None]
    h = Hist(counts, torch.zeros(1), torch.full((1,), 256.0), absolute=True)
    spec, lo, hi = QuantSpec("int8"), torch.zeros(1), torch.tensor([253.0])
    got = mix_range(h, spec, lo=lo, hi=hi, candidates=("mse",))[1]
    want = histogram_mse_range(h, spec, bounds=(lo, hi))[1]
    assert torch.equal(got, want) and want.item() < 253.0


def _coarse_then_fine(err: torch.Tensor, k: int) -> int:
    """The refine search on a row of candidate errors: every ``k``-th, then every one within
    ``k`` of the best of those; the first minimum in bin order each time."""
    n = err.numel()
    best = min(range(0, n, k), key=lambda j: (err[j].item(), j))
    near = range(max(0, best - k), min(n, best + k + 1))
    return min(near, key=lambda j: (err[j].item(), j))


@pytest.mark.parametrize("outliers", [1, 2])
def test_histogram_mse_refines_every_16th_candidate_by_default(outliers):
    """Default ``refine=16`` (the docstring's procedure, scored by ``histogram_error``):
    with one outlier it stops short of the full argmin (254.5), with two it differs from
    ``refine=8``'s pick."""
    counts = torch.zeros(1, 256, dtype=torch.int64)
    counts[0, :40], counts[0, 255] = 1000, outliers
    h = Hist(counts, torch.zeros(1), torch.full((1,), 256.0), absolute=True)
    spec = QuantSpec("int8")
    c = torch.arange(128, 256) + 0.5  # the centres from start_bin 128
    err = histogram_error(h, -c[None], c[None], spec)[0]
    lo, hi = histogram_mse_range(h, spec)
    assert (lo.item(), hi.item()) == (-c[_coarse_then_fine(err, 16)].item(),
                                      c[_coarse_then_fine(err, 16)].item())
    assert _coarse_then_fine(err, 16) != (int(err.argmin()) if outliers == 1
                                          else _coarse_then_fine(err, 8))


def test_histogram_error_scores_the_centres_given():
    """``centers`` replaces the bin centres: on int8's unit grid (the range +-127.5, scale
    255 / 255) integers quantize exactly, the bin centres k + 0.5 err by 0.25 each."""
    h = Hist(torch.ones(1, 4, dtype=torch.int64), torch.zeros(1), torch.full((1,), 4.0),
             absolute=True)
    lo, hi, spec = torch.full((1, 1), -127.5), torch.full((1, 1), 127.5), QuantSpec("int8")
    assert histogram_error(h, lo, hi, spec, centers=torch.arange(4.0)[None]).item() == 0.0
    assert histogram_error(h, lo, hi, spec).item() == 1.0
