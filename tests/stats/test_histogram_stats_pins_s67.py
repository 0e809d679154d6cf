"""Pins from a mutation round over the histogram statistics (s67: ``stats.histogram``,
``stats.hist_kernel``, ``stats.histogram_sync``): each test fails on a small defect that every
existing test let through, its expected values from the docstrings or from torch.histc (the
reference the emulation claims to equal): the estimator view's ``absolute`` flag, the bin of a
position that overflows float32, ``normal_width`` / ``scaled`` on their edge cases, the kernels'
refusals (no bins, a float64 end) and their bf16 pieces' grids, and ``check_state``'s sign rule.
"""

from __future__ import annotations

import pytest
import torch

from quantscope.stats import hist_kernel as HK
from quantscope.stats import histogram as H

needs_kernel = pytest.mark.skipif(HK._kernel() is None, reason="no compiled kernel")


def _state_of_minus_3_and_5(absolute: bool) -> H.HistState:
    """One unit that saw ``[-3, 5]``, on an 8-bin grid (e = 1: width 2)."""
    x = torch.tensor([[-3.0, 5.0]])
    return H.update(H.empty_state(1, 8), x, x.amin(1), x.amax(1), absolute)


def test_view_of_an_abs_state_says_it_counts_abs_x():
    """``view(state, absolute=True)`` is a histogram of ``|x|`` (``Hist.absolute``), which
    ``fold_abs`` then returns as it is; the default view is a signed one."""
    st = _state_of_minus_3_and_5(True)
    hist = H.view(st, absolute=True)
    assert hist.absolute is True and H.fold_abs(hist) is hist
    assert H.view(st).absolute is False


def test_binned_counts_puts_an_overflowing_position_in_bin_0_as_histc():
    """A value whose ``(x - lo) * bins`` overflows float32 has position +inf: torch.histc
    counts it in bin 0 (the docstring's rule), never in the last bin."""
    x = torch.tensor([[8e37, 1e38, 3e38]])  # 8e37 -> bin 1; 1e38, 3e38 overflow: bin 0
    got = H.binned_counts(x, torch.tensor([0.0]), torch.tensor([3e38]), 4)
    want = torch.histc(x[0], 4, 0.0, 3e38).long()
    assert want.tolist() == [2, 1, 0, 0]
    assert torch.equal(got[0], want)


def test_normal_width_leaves_a_one_value_range_alone():
    """Only a subnormal-width grid over a range (``hi > lo``) is scaled: a unit of one value
    (``lo == hi``, no width at all) beside a normal unit gives ``(hist, None)``."""
    hist = H.Hist(torch.ones(2, 4, dtype=torch.int64), torch.tensor([5.0, 0.0]),
                  torch.tensor([5.0, 3.0]))
    out, back = H.normal_width(hist)
    assert back is None and out is hist


def test_normal_width_keeps_the_abs_flag():
    """A scaled ``|x|`` histogram is still one of ``|x|``: only its ends change."""
    hist = H.Hist(torch.ones(1, 8, dtype=torch.int64), torch.zeros(1),
                  torch.tensor([4 * torch.finfo(torch.float32).tiny]), absolute=True)
    out, back = H.normal_width(hist)
    assert back.tolist() == [2.0 ** -123]  # 4 * tiny = 0.5 * 2 ** -123
    assert out.absolute is True and out.hi.tolist() == [0.5]


def test_scaled_takes_the_first_factor_for_a_0d_value():
    """A 0-d value (a tensor-wide amax) is scaled by the first factor, rounded once."""
    factor = torch.tensor([2.0, 4.0], dtype=torch.float64)
    out = H.scaled(torch.tensor(3.0), factor)
    assert out.dtype == torch.float32 and out.dim() == 0 and float(out) == 6.0
    assert H.scaled(torch.tensor([3.0, 3.0]), factor).tolist() == [6.0, 12.0]


@needs_kernel
def test_kernels_take_no_histogram_of_zero_bins():
    """``B = 0`` is no grid for the C kernels (their last bin, -1, would be written):
    ``bin_values`` says False and ``regrid`` None, nothing done, the torch path decides."""
    counts = torch.zeros(1, 0, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    assert HK.bin_values(counts, torch.ones(1, 3), zero, zero.clone(), False) is False
    assert HK.regrid(H.empty_state(1, 0), torch.tensor([-1.0]), torch.tensor([1.0]),
                     False) is None


@needs_kernel
def test_kernels_read_no_state_whose_hi_is_not_float32():
    """``state_ok`` wants float32 ``lo`` and ``hi``: a float64 ``hi`` (whose bytes the C would
    read as float32) is refused, and ``regrid`` leaves it to the torch path."""
    st = H.empty_state(1, 8)
    assert HK.state_ok(st, 1, 8)
    odd = st._replace(hi=st.hi.double())
    assert not HK.state_ok(odd, 1, 8)
    assert HK.regrid(odd, torch.tensor([-1.0]), torch.tensor([1.0]), False) is None


@needs_kernel
def test_bin_values_of_half_pieces_reads_each_rows_own_grid():
    """bf16 units binned a piece of rows at a time: each row on its own grid (``exp``,
    ``first``), every value in bin ``floor(x * 2 ** -exp) - first`` of its row."""
    E = HK.HALF_PIECE // 2  # two rows a piece: the third row is the second piece's first
    x = torch.randn(3, E, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = x * torch.tensor([[1.0], [1.0], [64.0]], dtype=torch.bfloat16)
    lo, hi = x.float().amin(1), x.float().amax(1)
    st = H._update_grid(H.empty_state(3, 64), lo, hi, False)
    assert st.exp[2] != st.exp[0]  # (the case: the rows' grids differ)
    idx = torch.floor(x.double() * 2.0 ** -st.exp.double()[:, None]).long() - st.first[:, None]
    want = torch.zeros_like(st.counts).scatter_add_(1, idx, torch.ones_like(idx))
    got = st.counts.clone()
    assert HK.bin_values(got, x, st.exp, st.first, False)
    assert torch.equal(got, want)


def test_check_state_refuses_a_negative_count():
    """Counts must be ``>= 0``: a bin of -1 is refused, a bin of 0 loads."""
    H.check_state("obs", {"hist_counts": torch.tensor([[0, 3]])}, "", 2, 1)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        H.check_state("obs", {"hist_counts": torch.tensor([[-1, 3]])}, "", 2, 1)
