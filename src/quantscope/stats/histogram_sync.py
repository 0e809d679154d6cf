"""How a histogram state syncs across processes: :class:`HistogramSync`.

Beside :mod:`quantscope.stats.histogram` because it is that statistic's reduction rule:
histogram observers name it in :meth:`~quantscope.observers.Observer.sync_plan`.
"""

from __future__ import annotations

import torch

from ..comm import SUM, CustomSync
from .histogram import HistState, empty_state, rebin, union_grid

__all__ = ["HistogramSync"]


class HistogramSync(CustomSync):
    """Exact sync of a :mod:`quantscope.stats.histogram` state kept in five buffers.

    The ranks agree on the union range (``lo`` MIN, ``hi`` MAX) and the largest bin
    exponent in one MAX all-reduce; each rank then re-bins its counts exactly onto the
    grid :func:`~quantscope.stats.histogram.merge` would choose for the union (power-of-two
    bin merges), and the counts are summed. The result equals, bitwise, the histogram
    of one process that saw every batch.

    ``names``: the buffers holding ``HistState(counts, exp, first, lo, hi)``.
    """

    def __init__(self, counts="hist_counts", exp="hist_exp", first="hist_first",
                 lo="hist_lo", hi="hist_hi", absolute: bool = False):
        self.names = (counts, exp, first, lo, hi)
        self.absolute = bool(absolute)

    def _state(self, obs):
        return HistState(*(getattr(obs, n) for n in self.names))

    def _set(self, obs, state) -> None:
        for n, v in zip(self.names, state):
            setattr(obs, n, v)

    def empty(self, obs, shapes):
        """The five buffers as :func:`~.histogram.empty_state` of counts' ``[units, bins]``."""
        units, bins = shapes[self.names[0]]
        self._set(obs, empty_state(units, bins, device=getattr(obs, self.names[0]).device))

    def grid(self, obs):
        """``float64 [3 * units]``, ``[-lo, hi, exp]``: MAX gives the union range, top exponent."""
        return self.grid_many([(obs, self)])[0]

    def rebin(self, obs, grid):
        """Re-bin counts exactly onto the agreed grid, set all five buffers; ``{counts: SUM}``."""
        return self.rebin_many([(obs, self)], [grid])[0]

    def batch_key(self, obs):
        """Histograms with equal bin count, ``absolute``, device and dtype sync in one batch."""
        c = getattr(obs, self.names[0])
        return (HistogramSync, c.shape[1], self.absolute, c.device, c.dtype)

    @classmethod
    def grid_many(cls, pairs):
        # one [-lo, hi, exp] vector over the units of every histogram of the group
        sts = [it._state(obs) for obs, it in pairs]
        return [torch.cat([-torch.cat([st.lo for st in sts]).double(),
                           torch.cat([st.hi for st in sts]).double(),
                           torch.cat([st.exp for st in sts]).double()])]

    @classmethod
    def rebin_many(cls, pairs, grids):
        sts = [it._state(obs) for obs, it in pairs]
        units = [st.counts.shape[0] for st in sts]
        U, bins = sum(units), sts[0].counts.shape[1]
        g = grids[0].to(sts[0].counts.device)
        lo, hi = (-g[:U]).float(), g[U:2 * U].float()
        e, first = union_grid(lo, hi, g[2 * U:].long(), bins, pairs[0][1].absolute)
        old_e = torch.cat([st.exp for st in sts])
        old_first = torch.cat([st.first for st in sts])
        # only units whose grid moves are re-binned (none, once the ranks agree)
        moved = torch.nonzero((e != old_e) | (first != old_first)).reshape(-1)
        start = 0
        out = []
        for (obs, it), st, n in zip(pairs, sts, units):
            rows = moved[(moved >= start) & (moved < start + n)]
            counts = st.counts
            if rows.numel():
                local = rows - start
                counts = counts.clone()
                counts[local] = rebin(st.counts[local], old_e[rows], old_first[rows], e[rows],
                                      first[rows])
            sl = slice(start, start + n)
            it._set(obs, (counts, e[sl].clone(), first[sl].clone(), lo[sl].clone(),
                          hi[sl].clone()))
            out.append({it.names[0]: SUM})
            start += n
        return out

