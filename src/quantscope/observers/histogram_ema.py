"""The EMA mode of the histogram observers (``averaging_constant``: Horizon's).

Every ``update_interval`` batches the range of those batches is estimated on their
histogram, ``range = torch.lerp(range, estimate, c)`` (the first estimate initialises;
lerp, not the min-max average's ``range + c * (estimate - range)``, which rounds at ``c = 1``:
lerp gives the estimate exactly there), and the histogram starts anew. An interval's
estimate is its own: the estimators' bounds (the clip,
histogram MSE's and L2's scored range, mix's min / max candidate) are the interval's min /
max, ``window_lo`` / ``window_hi``, not the running ``min_vals`` / ``max_vals`` of all the
data (those stay, for the magnitude check and the sync), so ``c = 1`` gives the last
interval's estimate, as a fresh observer on it. A symmetric spec averages the estimates'
``max |x|`` (``(-amax, amax)``), whatever side of zero an interval's data lay on.

:class:`IntervalAverage` is a mixin of
:class:`~quantscope.observers.histogram.HistogramObserverBase`, which holds the histogram
the estimate (``_estimated``) and the clip (``_bounds``, from :meth:`~IntervalAverage._data_range`).
"""

from __future__ import annotations

import torch

from ..qparams import amax_of_range
from ..stats import histogram as H

__all__ = ["WINDOW", "IntervalAverage"]

#: the buffers of the interval's signed min / max (empty: none, or a state saved before they
#: were kept: the data's min / max stand in)
WINDOW = ("window_lo", "window_hi")


class IntervalAverage:
    """The EMA mode's state and steps (see the module doc)."""

    def _register_window(self) -> None:
        for name in WINDOW:
            self.register_buffer(name, torch.zeros(0, dtype=torch.float32))

    def _interval_batch(self, lo, hi) -> None:
        """After a batch in the EMA mode: its min / max join the interval's; the interval's
        last batch runs the estimate."""
        if self.window_lo.shape != lo.shape:  # the interval's first batch (no host sync)
            self._store(WINDOW, (lo.clone(), hi.clone()))  # (the buffers' objects kept)
        else:
            torch.minimum(self.window_lo, lo, out=self.window_lo)
            torch.maximum(self.window_hi, hi, out=self.window_hi)
        self.pending += 1
        self._pending += 1
        # after NaN / inf no estimate: calculate_qparams raises the error forward records
        if self._pending % self.update_interval == 0 and not bool(self.seen_non_finite):
            self._ema_step()

    def _data_range(self):
        """The signed min / max the estimate is bounded by: the interval's in the EMA mode
        (where known), else the data's."""
        if self.averaging_constant is not None and self.window_lo.numel():
            return self.window_lo, self.window_hi
        return self.min_vals, self.max_vals

    #: average the estimate's signed ends as they are (Horizon's compat classes); else a
    #: symmetric spec averages ``max |x|``: a positive interval's (0, 4) and a negative one's
    #: (-4, 0) are two ranges of amax 4, not (-2, 2)
    signed_ends = False

    def _averaged(self):
        """The EMA with the histogram's estimate averaged in, as new tensors (state unchanged)."""
        lo, hi = self._estimated()
        if self.spec.symmetric and not self.signed_ends:
            hi = amax_of_range(lo, hi)
            lo = -hi
        if self.ema_lo.shape != lo.shape:  # the first estimate initialises
            return lo.clone(), hi.clone()
        c = self.averaging_constant
        return self.ema_lo.lerp(lo, c), self.ema_hi.lerp(hi, c)

    def _ema_step(self):
        self._store(("ema_lo", "ema_hi"), self._averaged())
        self._set_state(H.empty_state(self.ema_lo.shape[0], self.bins, self.ema_lo.device))
        self.linear_grid.fill_(self.grid == "first")
        self._store(WINDOW, [self.ema_lo.new_zeros(0) for _ in WINDOW])
        self.pending.zero_()
        self._pending = 0

    def _state_record(self) -> dict:
        # the mode is part of what the state means (record.check refuses the other mode's)
        return {**super()._state_record(), "ema": self.averaging_constant is not None}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              *args, **kwargs):
        keys = [prefix + n for n in WINDOW]
        if not any(k in state_dict for k in keys):  # saved before the window was state:
            empty = self.window_lo.new_zeros(0)  # empty (the data's min / max stand in)
            state_dict = {**state_dict, **dict.fromkeys(keys, empty)}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      *args, **kwargs)
        pending = state_dict.get(prefix + "pending")
        if pending is not None and not pending.is_meta:
            self._pending = int(pending)
