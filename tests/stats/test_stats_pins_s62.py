"""Pins from a mutation round over quantscope.stats (s62): rules of the histogram layer that
every test passed with changed, each checked against its docstring on a few values.

``normal_width``'s ``common`` factor, ``check_state``'s bounds (the grid exponent's upper end,
the counts' total) and its reading of a unit that saw nothing next to one that did, the empty
state's identities, ``fold_abs``'s width, and the torch path's ``"ema_lerp"`` rounding.
"""

from __future__ import annotations

import pytest
import torch

from quantscope.stats import histogram as H
from quantscope.stats import minmax as MM

TINY = torch.finfo(torch.float32).tiny


def _subnormal_and_normal_hist() -> H.Hist:
    """Unit 0 spans ``[0, 4 * tiny]`` (width ``tiny / 2``: subnormal), unit 1 ``[0, 3]``."""
    lo, hi = torch.zeros(2), torch.tensor([4 * TINY, 3.0])
    return H.Hist(torch.ones(2, 8, dtype=torch.int64), lo, hi)


def test_normal_width_common_factor_scales_every_unit_by_the_largest_ones():
    """``common``: every unit takes the largest end's factor (a global scale's ratios kept),
    the unit whose width is normal too, not only the subnormal one: ``3 = 0.75 * 2 ** 2``."""
    _, back = H.normal_width(_subnormal_and_normal_hist(), common=True)
    assert back.dtype == torch.float64
    assert back.tolist() == [4.0, 4.0]


def test_normal_width_scales_only_the_subnormal_units_without_common():
    """Without ``common`` each subnormal-width unit is scaled to ``max |end|`` in ``[0.5, 1)``
    (``4 * tiny = 0.5 * 2 ** -123``) and a normal one keeps factor 1."""
    hist, back = H.normal_width(_subnormal_and_normal_hist())
    assert back.tolist() == [2.0 ** -123, 1.0]
    assert hist.hi.tolist() == [0.5, 3.0]


def test_check_state_refuses_a_grid_exponent_past_e_max():
    """Binning needs ``2 ** e`` and ``2 ** -e`` normal: exponents outside ``[E_MIN, E_MAX]``
    are refused (``E_MAX + 1`` makes ``pow2(-e)`` zero), ``E_MAX`` itself loads."""
    H.check_state("obs", {"hist_exp": torch.tensor([H.E_MIN, H.E_MAX])}, "", 8, 1)
    with pytest.raises(ValueError, match="grid exponents must lie"):
        H.check_state("obs", {"hist_exp": torch.tensor([H.E_MAX + 1])}, "", 8, 1)


def test_check_state_refuses_a_unit_total_of_2_pow_62():
    """A unit's counts must total under ``2 ** 62``: exactly ``2 ** 62`` is refused."""
    H.check_state("obs", {"hist_counts": torch.tensor([[2 ** 61, 2 ** 60]])}, "", 2, 1)
    with pytest.raises(ValueError, match="under 2\\*\\*62"):
        H.check_state("obs", {"hist_counts": torch.tensor([[2 ** 61, 2 ** 61]])}, "", 2, 1)


def test_check_state_reads_no_grid_start_for_a_unit_that_saw_nothing():
    """A unit that saw nothing (``hist_lo`` +inf, ``hist_first`` 0) beside a signed unit whose
    grid starts below zero is a state an observer writes: it loads. The first-bin rule holds
    for the units that saw data only (``grid_first`` of +inf is no bin index)."""
    seen = H.update(H.empty_state(1, 8), torch.tensor([[-3.0, 5.0]]),
                    torch.tensor([-3.0]), torch.tensor([5.0]))
    assert int(seen.first) == -2  # e = 1: bins of 2 from -4 hold [-3, 5]
    state = [torch.cat(pair) for pair in zip(seen, H.empty_state(1, 8))]
    sd = dict(zip(H.STATE_BUFFERS, state))
    H.check_state("obs", sd, "", 8, 1)
    sd["hist_first"] = torch.tensor([-1, 0])  # the seen unit's start moved: refused
    with pytest.raises(ValueError, match="native grid starts"):
        H.check_state("obs", sd, "", 8, 1)


def test_empty_state_ends_are_the_running_min_and_max_identities():
    """A state that saw nothing keeps ``lo = +inf``, ``hi = -inf``: the running min / max of
    no data, so that the first batch's ends, negative or positive, are the state's own."""
    st = H.empty_state(2, 8)
    assert st.lo.tolist() == [float("inf")] * 2 and st.hi.tolist() == [float("-inf")] * 2
    x = torch.tensor([-2.0, -5.0])  # a unit of negative data: its max is below zero
    assert torch.equal(torch.maximum(st.hi, x), x) and torch.equal(torch.minimum(st.lo, x), x)


def test_fold_abs_keeps_the_bin_width_and_b_bins_from_zero():
    """``fold_abs`` returns ``B`` bins from zero of the same width: ``hi = w * B``, and a
    value in bin ``-1 - k`` of the signed grid lands in bin ``k`` of ``|x|``."""
    st = H.update(H.empty_state(1, 8), torch.tensor([[-3.0, 5.0]]),
                  torch.tensor([-3.0]), torch.tensor([5.0]))
    folded = H.fold_abs(H.view(st))  # e = 1: width 2, signed bins from -4
    assert folded.absolute and folded.lo.tolist() == [0.0] and folded.hi.tolist() == [16.0]
    assert folded.width.tolist() == [2.0]
    assert folded.counts.tolist() == [[0, 1, 1, 0, 0, 0, 0, 0]]  # |-3| in [2, 4), 5 in [4, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ema_lerp_update_rounds_as_llm_compressor_on_the_torch_path(dtype):
    """``"ema_lerp"`` is ``s * (1 - c) + b * c`` (llm-compressor's), not torch.ao's
    ``s + c * (b - s)``: at these values the two round apart (``update_state`` on the CPU is
    the torch ops; the kernel fuses the same rounding into ``unit_minmax``'s pass)."""
    c = 0.3
    s = torch.tensor([-1.152360200881958, -0.2505785822868347, 0.8487103581428528], dtype=dtype)
    b = torch.tensor([1.0990885496139526, 0.16391335427761078, -0.8483231663703918], dtype=dtype)
    want = s * (1.0 - c) + b * c
    assert not torch.equal(want, s + c * (b - s))  # (the case the test is for)
    lo, hi = s.clone(), s.clone()
    MM.update_state("ema_lerp", c, lo, hi, b.clone(), b.clone())
    assert torch.equal(lo, want) and torch.equal(hi, want)
