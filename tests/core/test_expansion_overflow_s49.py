"""``_numerics.expansion_overflow`` on float64 ranges past float32's max (review s49): it cast
them to float32 before applying ``expand``, so a range ``expand = 1`` let through was refused
by ``expand = 0.5``, which can only shrink it, and the refusal blamed ``expand``. The
expanded amax is now taken in the ranges' own dtype and then held to float32's max: the
answer is monotone in ``expand``."""

from __future__ import annotations

import pytest
import torch

from quantscope._numerics import expansion_overflow

F32_MAX = torch.finfo(torch.float32).max


def _past(amax: float, expand: float, dtype=torch.float64) -> bool:
    lo, hi = torch.tensor([-amax, 1.0], dtype=dtype), torch.tensor([amax, 2.0], dtype=dtype)
    return expansion_overflow(lo, hi, expand) is not None


@pytest.mark.parametrize("amax, expand, past", [
    (5e38, 0.5, False), (5e38, 0.6, False), (5e38, 0.7, True), (5e38, 1.5, True),
    (3e38, 1.1, False), (3e38, 1.2, True), (3e38, 0.5, False),
])
def test_a_float64_range_is_expanded_before_it_is_held_to_float32(amax, expand, past):
    assert _past(amax, expand) == past


def test_the_answer_is_monotone_in_expand():
    """(``expand = 1`` is never refused: it takes nothing past a limit; a float64 end already
    past float32's max is left to the callers' other checks there.)"""
    expands = [e for e in torch.linspace(0.1, 3.0, 59).tolist() if e != 1.0]
    for amax in (1e38, 2e38, F32_MAX, 4e38, 5e38, 1e39):
        answers = [_past(amax, e) for e in expands]
        assert answers == sorted(answers), amax  # False ... False True ... True


def test_narrower_and_float32_statistics_as_before():
    assert expansion_overflow(torch.tensor([-5e38], dtype=torch.float64),
                              torch.tensor([5e38], dtype=torch.float64), 1.5) == (5e38, "float32")
    assert _past(3e38, 1.2, torch.float32) and not _past(3e38, 1.1, torch.float32)
    assert _past(40000.0, 2.0, torch.float16) and not _past(30000.0, 2.0, torch.float16)
    assert expansion_overflow(torch.tensor([-40000.0], dtype=torch.float16),
                              torch.tensor([1.0], dtype=torch.float16), 2.0) == (40000.0,
                                                                                "float16")


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_an_infinite_or_nan_end_is_left_to_its_own_refusal(bad, dtype):
    """A range holding inf / NaN (observed non-finite values, which their own check names)
    is no ``expand`` overflow: None where the finite ends fit, and the largest *finite* end
    where one overflows (s50's mutants X03 / X05: an inf end reported as an expand overflow
    "(max |x| = 2)", and inf given as the largest end)."""
    lo = torch.tensor([-bad, -1.0, 0.5], dtype=dtype)
    hi = torch.tensor([1.0, 2.0, bad], dtype=dtype)
    assert expansion_overflow(lo, hi, 1.5) is None
    lo[1], hi[1] = -3e38, 3e38
    assert expansion_overflow(lo, hi, 1.5) == (pytest.approx(3e38, rel=1e-6), "float32")
