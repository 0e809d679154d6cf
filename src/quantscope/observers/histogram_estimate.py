"""The histogram observers' estimate step, and its first grids over subnormal-only data.

A ``grid="first"`` histogram (torch.ao's / Quark's / Horizon's / ModelOpt's binning: ``bins``
bins over the first batch's range) of data that is all subnormal has a float32 bin width
``(hi - lo) / bins`` rounded coarsely, or to 0: every edge and candidate then read ``lo``,
and the estimate was a silent 0. An observer whose estimate is a function of its histogram
(and of data-unit values it passes through :meth:`ScaledEstimate._estimate_units`: bounds,
a global amax) estimates such a histogram scaled by a power of two per unit
(:func:`~quantscope.stats.histogram.normal_width`), and scales the range back, rounded once:
the estimate of the data scaled into the normal range, scaled back. The power-of-two grid's
widths are normal (at least ``2 ** -126``): there nothing changes.
"""

from __future__ import annotations

import torch

from ..stats import histogram as H

__all__ = ["ScaledEstimate"]


class ScaledEstimate:
    """Mixin of :class:`~quantscope.observers.histogram.HistogramObserverBase`: its
    :meth:`_estimated` (``_estimate`` of the histogram, scaled where its first grid's width is
    not a normal float32 and the class ``scales_subnormal``)."""

    #: ``_estimate`` is the histogram's (and ``_estimate_units``') alone, equivariant under a
    #: power-of-two scale; False (the default): it reads other state (a toolkit's own grid
    #: or search, the running min / max), so it is handed the histogram as it is
    scales_subnormal = False
    _units_back: torch.Tensor | None = None  # the factors back while _estimate runs

    def _estimated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_estimate` of the current histogram, clipped (:meth:`_clip`). The view and
        the estimators are pure functions of the state, so they run under
        ``torch.inference_mode``: their ~20-200 small torch ops skip autograd's bookkeeping
        (5-7 % of a qparams call); the clip runs outside it and hands back ordinary tensors."""
        self._check_magnitude()
        with torch.inference_mode():
            hist, back = self.current_histogram(), None
            if self.scales_subnormal and self._linear:
                # a global scale's ratios hold only under one factor for all units
                hist, back = H.normal_width(hist, common=self.spec.scale.has_global_scale)
            self._units_back = back
            try:
                lo, hi = self._estimate(hist)
            finally:
                self._units_back = None
            if back is not None:
                lo, hi = H.scaled(lo, back), H.scaled(hi, back)
        return self._clip(lo, hi)

    def _estimate_units(self, *values) -> tuple:
        """``values`` (data units: the bounds, a global amax; None passes) in the units of the
        histogram ``_estimate`` was handed (scaled up with it, exactly)."""
        back = self._units_back
        if back is None:
            return values
        return tuple(None if v is None else H.scaled(v, 1 / back) for v in values)
