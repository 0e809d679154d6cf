"""A histogram unit that saw nothing on any rank comes out of :class:`HistogramSync` as
:func:`~quantscope.stats.histogram.empty_state`'s (``E_MIN``, ``first`` 0), as ``merge`` of two
empty states does. It used to come out at exponent -2 with ``first`` the int64 of
``floor(inf)``; the exponent then held the next batch on bins of ``2 ** -2`` at least.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantscope.stats import histogram as H
from quantscope.stats.histogram_sync import HistogramSync


def _synced_empty(units, bins, absolute):
    """Two ranks whose histograms saw nothing, synced (grid MAX, then the re-bin)."""
    it = HistogramSync(absolute=absolute)
    held = [SimpleNamespace(**dict(zip(H.STATE_BUFFERS, H.empty_state(units, bins))))
            for _ in range(2)]
    union = torch.maximum(*(it.grid(h) for h in held))
    for h in held:
        it.rebin(h, union.clone())
    return H.HistState(*(getattr(held[0], n) for n in H.STATE_BUFFERS))


@pytest.mark.parametrize("absolute", [False, True])
def test_sync_of_units_that_saw_nothing_anywhere_is_the_empty_state(absolute):
    """One process that saw nothing holds ``empty_state``; ``merge`` of two empty states is
    one: so is the sync (its doc: the grid ``merge`` would choose, bitwise one process's)."""
    got = _synced_empty(2, 8, absolute)
    want = H.merge(H.empty_state(2, 8), H.empty_state(2, 8), absolute)
    assert want.exp.tolist() == [H.E_MIN] * 2 and want.first.tolist() == [0, 0]
    for name, a, b in zip(H.STATE_BUFFERS, got, want):
        assert torch.equal(a, b), name


def test_data_after_a_sync_of_empty_units_is_binned_as_by_one_process():
    """The next batch after that sync is binned as one process that saw only it bins it."""
    x = torch.tensor([[0.001, 0.002, 0.003, -0.001]])
    got = H.update(_synced_empty(1, 64, False), x, x.amin(1), x.amax(1))
    want = H.update(H.empty_state(1, 64), x, x.amin(1), x.amax(1))
    assert int(want.exp) == -13
    assert torch.equal(got.exp, want.exp) and torch.equal(got.counts, want.counts)
