"""Pins from a mutation round (s71) over ``quantscope.stats.minmax`` and
``stats.minmax_actorder``: argument checks of the ops that every existing test passed with
changed: ``minmax_update``'s ``kind`` must be an :data:`~quantscope.stats.minmax.UPDATES`
code (0 is none), and ``record_non_finite``'s ``seen`` must be one bool."""

from __future__ import annotations

import pytest
import torch

from quantscope.stats import minmax as MM


def test_minmax_update_refuses_a_kind_that_is_no_update_code():
    """``kind`` 0 is no :data:`UPDATES` code (they are 1, 2, 3): a ValueError, state kept."""
    lo, hi = torch.zeros(3), torch.ones(3)
    slo, shi = torch.full((3,), -1.0), torch.full((3,), 2.0)
    with pytest.raises(ValueError, match="kind"):
        MM.minmax_update(lo, hi, slo, shi, 0, 0.5)
    assert slo.tolist() == [-1.0] * 3 and shi.tolist() == [2.0] * 3


def test_record_non_finite_refuses_a_seen_of_several_bools():
    """``seen`` is one bool: a ``(2,)`` bool tensor is refused."""
    lo, hi = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="seen"):
        MM.record_non_finite(lo, hi, torch.zeros(2, dtype=torch.bool))
