"""Pins of survivors of a mutation round (s70) over ``quantscope.estimators.l2``: the torch
path's walk (``l2_path``) on histograms where float32 thresholds tie the cumulative counts
exactly, where the float32 cumulative sum passes the float64 total, where the end walks alone
over fractional quantile steps, and on one-bin and sparse histograms; each is checked against
the C walk (torch.ao's loop step by step) or torch.ao's search itself. And, from a clean
one-mutant-at-a-time rerun of the round: ``polish`` 0 is torch.ao's search alone, the
power-of-two normalisation of the search scales by the larger of ``|lo|`` and ``|hi|`` and
scales an explicit bin step with the ends, a global-scale spec's default global amax comes
from the occupied bins or ``bounds``, and the moving end stays on its side of the fixed one
where the data lie within a bin of zero."""

import warnings

import pytest
import torch
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

from quantscope import QuantSpec, presets
from quantscope.estimators import l2
from quantscope.estimators.histogram_mse import occupied_range
from quantscope.estimators.l2 import l2_finalists, l2_polished_range, l2_range
from quantscope.estimators.scorer import tensor_amax
from quantscope.stats.histogram import Hist


def _long(values):
    return torch.tensor(values, dtype=torch.long)


def _tail_steps(total):
    # a spike in bin 2, then one-count bins and a 4 before the last: the end walks alone
    return _long([0, 0, total - 62] + [1] * 57 + [4, 1])


#: counts of one unit: float32 thresholds ``float32(alpha * total)`` that equal cumulative
#: counts (total 1e5: whole numbers; 1.5e5: every other step), a float32 cumsum that rounds
#: past the float64 total (2 ** 24 + 5s), a single bin, a sparse histogram
CASES = {
    "ties_both_ends": lambda: _long([1] * 30 + [2498] * 20 + [2499] * 20 + [1] * 30),
    "ties_end_alone": lambda: _tail_steps(150000).flip(0),
    "fractional_end_alone": lambda: _tail_steps(150000),
    "mass_at_both_ends": lambda: _long([99999] + [0] * 48 + [1]),
    "cumsum_past_total": lambda: _long([5] * 63 + [1 << 24]),
    "one_bin": lambda: _long([5]),
    "sparse": lambda: _long([0, 3, 0, 0, 4, 0, 0, 0]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_l2_path_visits_the_ranges_of_torch_aos_loop(case):
    """``l2_path`` (the torch backend's vectorized walk) visits the same ranges, in the same
    order, as the C walk that steps torch.ao's loop one quantile step at a time."""
    lib = l2._kernel()
    if lib is None:
        pytest.skip("no C compiler")
    counts = CASES[case]()[None]
    start, end, valid = l2.l2_path(counts)
    s, e, v = l2._Walk(lib, counts).chunk(1 << 17, torch.zeros(1, dtype=torch.bool))
    n = int(valid.sum())
    assert int(v.sum()) == n and bool(valid[0, :n].all())
    assert torch.equal(start[0, :n], s[0][v[0]]) and torch.equal(end[0, :n], e[0][v[0]])


def _torch_ao_search(counts, lo, hi):
    ref = TorchHistogramObserver(bins=counts.numel())
    ref.min_val.fill_(lo)
    ref.max_val.fill_(hi)
    ref.histogram.copy_(counts.float())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref._non_linear_param_search()


@pytest.mark.parametrize("case", ["cumsum_past_total", "one_bin", "ties_both_ends"])
def test_l2_torch_backend_range_is_torch_aos(case):
    """``l2_range(backend="torch")`` returns torch.ao's ``_non_linear_param_search`` range bit
    for bit (one bin: no range changes, so torch.ao keeps the histogram's ends)."""
    counts = CASES[case]()
    want = _torch_ao_search(counts, -1.0, 1.0)
    hist = Hist(counts[None], torch.tensor([-1.0]), torch.tensor([1.0]))
    got = l2_range(hist, backend="torch")
    assert torch.equal(got[0], want[0].reshape(1)) and torch.equal(got[1], want[1].reshape(1))


def test_l2_c_walk_chunk_gives_no_range_of_a_done_unit():
    """``_Walk.chunk(k, done)`` walks only the units not ``done``: a done unit's ranges are
    all invalid while the other unit's walk goes on."""
    lib = l2._kernel()
    if lib is None:
        pytest.skip("no C compiler")
    counts = torch.stack([CASES["ties_both_ends"](), CASES["ties_both_ends"]()])
    _s, _e, v = l2._Walk(lib, counts).chunk(8, torch.tensor([True, False]))
    assert not bool(v[0].any()) and bool(v[1].all())


def test_l2_range_takes_dst_nbins_from_2_to_2_to_the_32():
    """``dst_nbins`` is torch.ao's quantized bin count, an int in ``[2, 2 ** 32]`` (int32's
    ``2 ** 32`` included, one bin refused)."""
    h = Hist(CASES["sparse"]()[None], torch.tensor([-1.0]), torch.tensor([1.0]))
    lo, hi = l2_range(h, 2 ** 32)
    assert -1.0 <= float(lo) < float(hi) <= 1.0
    with pytest.raises(ValueError, match="dst_nbins"):
        l2_range(h, 1)


@pytest.mark.parametrize("fmt, want", [("int4", 16), ("uint8", 256), ("int16", 2 ** 16)])
def test_default_dst_nbins_is_two_to_the_integer_bits_else_256(fmt, want):
    assert l2.default_dst_nbins(QuantSpec(fmt)) == want


def _gauss_hist(bins=128):
    x = torch.randn(4000, generator=torch.Generator().manual_seed(3))
    x[:3] = torch.tensor([9.0, -7.5, 11.0])
    lo, hi = float(x.min()), float(x.max())
    counts = torch.histc(x, bins, lo, hi).long()
    return Hist(counts[None], torch.tensor([lo]), torch.tensor([hi]))


def test_l2_finalists_move_lo_first_then_hi():
    """``l2_finalists``: the search's range, then ``lo`` moved (``hi`` fixed), then ``hi``
    moved too (the new ``lo`` fixed)."""
    fl, fh = l2.l2_finalists(_gauss_hist(), QuantSpec("uint4", symmetric=False))
    assert torch.equal(fh[:, 1], fh[:, 0]) and torch.equal(fl[:, 2], fl[:, 1])
    assert not torch.equal(fl[:, 1], fl[:, 0]) and not torch.equal(fh[:, 2], fh[:, 1])


SPEC = QuantSpec("int8")
SPARSE = CASES["sparse"]()


def _hist(counts, lo, hi, step=None):
    t = torch.tensor
    return Hist(counts[None], t([lo]), t([hi]), False, None if step is None else t([step]))


def test_polish_0_is_torch_aos_search_not_clipped_to_bounds():
    """``radius=0``: no polish, the range is :func:`l2_range`'s, even where it passes
    ``bounds`` (the finalists' clipping is part of the polish)."""
    hist = _hist(SPARSE, -1.0, 1.0)
    want = l2_range(hist)
    bounds = (torch.tensor([-0.6]), torch.tensor([0.2]))
    got = l2_polished_range(hist, SPEC, radius=0, bounds=bounds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_search_is_normalised_by_the_larger_end():
    """The search runs on the histogram scaled by a power of two to ``max(|lo|, |hi|)`` in
    ``[0.5, 1)``: ends ``(-2 ** 100, 0)`` search as ``(-0.5, 0)``, scaled back by 2 ** 101."""
    counts = SPARSE
    got = l2_polished_range(_hist(counts, -2.0 ** 100, 0.0), SPEC, radius=0)
    lo, hi = l2_range(_hist(counts, -0.5, 0.0))
    assert torch.equal(got[0], lo * 2.0 ** 101) and torch.equal(got[1], hi * 2.0 ** 101)


def test_normalised_search_scales_an_explicit_bin_step(monkeypatch):
    """``Hist.step`` is the bin width ``(hi - lo) / B``: given explicitly, the normalised search
    (torch path: the step places the range's ends) gives the same range as without it."""
    monkeypatch.setattr(l2.kernels, "choose", lambda *a, **k: None)  # the torch path
    counts = SPARSE
    want = l2_polished_range(_hist(counts, -4.0, 4.0), SPEC, radius=0)
    got = l2_polished_range(_hist(counts, -4.0, 4.0, step=1.0), SPEC, radius=0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bounded", [False, True])
def test_global_amax_defaults_to_the_occupied_bins_or_bounds(bounded):
    """A global-scale spec's finalists are scored under the data's ``max |x|``: from
    ``bounds`` when given, else from the occupied bins (not the histogram's empty ends)."""
    counts = torch.zeros(64, dtype=torch.long)
    counts[24:40] = torch.arange(1, 17) * 7 % 23 + 1
    hist = _hist(counts, -8.0, 8.0)
    bounds = (torch.tensor([-1.9]), torch.tensor([1.8])) if bounded else None
    amax = tensor_amax(presets.NVFP4, *(bounds if bounded else occupied_range(hist)))
    got = l2_finalists(hist, presets.NVFP4, 16, 8, bounds)
    want = l2_finalists(hist, presets.NVFP4, 16, 8, bounds, amax)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("width", [1.0, 4.0])
def test_moving_end_stays_on_its_side_within_a_bin_of_zero(side, width):
    """Where ``max |bounds|`` is at most one bin (exactly one included), the bound on the
    moving end's far side becomes the fixed end: ``lo`` moves below ``hi``, ``hi`` above
    ``lo``."""
    lo, hi = torch.tensor([-0.25]), torch.tensor([0.5])
    blo, bhi = torch.tensor([-1.0]), torch.tensor([0.75])
    got = l2._stay_on_side(lo, hi, side, (blo, bhi), torch.tensor([width]))
    want = (blo, hi) if side == 0 else (lo, bhi)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
