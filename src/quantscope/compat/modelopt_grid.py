"""ModelOpt's histogram grid, a mixin of :class:`~quantscope.compat.modelopt.HistogramCalibrator`:
its edges, ``linspace(0, max |x|, num_bins + 1)`` of the first batch, grown as its ``arange``
of that width, its ``_calib_hist`` / ``_calib_bin_edges``, the amaxes read as its values
(an edge, or a bin centre ``(edges[i] + edges[i + 1]) / 2``, in its float32 bits), and the
methods' candidates on it (:meth:`ModelOptGrid._check_start_bin`)."""

from __future__ import annotations

import warnings

import torch

__all__ = ["ModelOptGrid"]


class ModelOptGrid:
    """Mixin (before :class:`~quantscope.compat.horizon.AppendingFirstGrid`): the first grid's
    edges, bin count and top as ModelOpt computes them."""

    _grown_top: torch.Tensor | None = None  # max |x| of the batch that last grew the grid
    _grown_edge: torch.Tensor | None = None  # the grown grid's last edge (_linear_top)

    @property
    def _calib_hist(self) -> torch.Tensor | None:
        """ModelOpt's attribute: the counts as float32 ``[bins]`` (grown ones too), read
        only; None before data."""
        if not self.has_observed:
            return None
        return self.current_histogram().counts[0].float()

    @property
    def _calib_bin_edges(self) -> torch.Tensor | None:
        """ModelOpt's attribute: its edges (:meth:`_modelopt_edges`; on the CPU until grown,
        as ModelOpt's), read only; None before data."""
        if not self.has_observed:
            return None
        if not self._linear:  # moved to the native grid (quantscope.compat.modelopt's doc)
            return self.current_histogram().edges()[0]
        edges = self._modelopt_edges()
        # ModelOpt's arange runs on the batch's device, its linspace on the CPU
        return edges if self._grown_top is None else edges.to(self.hist_counts.device)

    def _first_edges(self) -> torch.Tensor:
        # ModelOpt's linspace(0, max |x|, num_bins + 1) of the first batch (CPU float32)
        return torch.linspace(0, float(self.hist_hi[0]), self.bins + 1)

    def _modelopt_edges(self) -> torch.Tensor:
        """ModelOpt's edges of the first grid (CPU float32): ``linspace(0, max |x|, num_bins +
        1)`` of the first batch; grown, ``arange(0, top + w, w)`` to the growing batch's max
        ``|x|`` (one edge more than the bins where float32 rounds so)."""
        edges = self._first_edges()
        if self._grown_top is None:
            return edges
        w = edges[1] - edges[0]
        return torch.arange(0, self._grown_top + w, w)

    def _bins_needed(self, hi) -> torch.Tensor:
        # ModelOpt's count: ceil(x_max / w) in float32, w = edges[1] - edges[0] of its
        # float32 linspace (not Horizon's float64 quotient, which can count a bin more)
        edges = self._first_edges()
        w = (edges[1] - edges[0]).to(hi.device)
        return torch.ceil(hi.float() / w).max()

    def _linear_top(self):
        # histc's max on a grown grid: ModelOpt's last edge (float32 steps, not float64's),
        # kept when the grid grows (read 2-3 times a batch)
        if self._grown_top is None:
            return self.hist_hi
        if self._grown_edge is None:
            self._grown_edge = self._modelopt_edges()[-1:]
        if self._grown_edge.device != self.hist_hi.device:  # Module.to moves no plain attribute
            self._grown_edge = self._grown_edge.to(self.hist_hi.device)
        return self._grown_edge

    def _append_bins(self, hi) -> bool:
        grown = super()._append_bins(hi)
        if grown:  # ModelOpt's edges run to this batch's max |x| (hi: per tensor)
            self._grown_top = hi.reshape(()).float().cpu()
            self._grown_edge = None
        return grown

    def _modelopt_value(self, amax: torch.Tensor, hist, centre: bool) -> torch.Tensor:
        """``amax``, an edge ``lo + i * width`` of the grid (or a centre ``lo + (i + 0.5) *
        width``), as ModelOpt returns it: its own ``_calib_bin_edges[i]`` (linspace's, or
        arange's float32 steps on a grown grid, which differ from ``lo + i * width`` in the
        last bit), or its float32 centre ``(edges[i] + edges[i + 1]) / 2``."""
        if not self._linear:
            return amax
        edges = self._modelopt_edges().to(amax.device)
        i = ((amax.double() - hist.lo.double()) / hist.width.double() - 0.5 * centre).round()
        i = i.long().clamp(0, edges.numel() - 1 - centre)
        value = ((edges[i] + edges[i + 1]) / 2 if centre else edges[i]).reshape(amax.shape)
        if bool(((value == 0) & (amax > 0)).any()):  # ModelOpt's value, said
            warnings.warn(f"modelopt {type(self).__name__}: compute_amax: ModelOpt's edges "
                          f"(linspace(0, {float(edges[-1]):.4g}, {edges.numel()})) read 0 at "
                          f"bin {int(i.reshape(-1)[0])}: its step underflows float32 on "
                          f"subnormal-only data; returning its amax, 0", stacklevel=4)
        return value

    def _check_start_bin(self, method, start_bin, bins, call, fix) -> None:
        """ModelOpt's ``argmin`` of no candidate fails (numpy's ``ValueError``): entropy's
        thresholds are ``range(start_bin, bins + 1)``, mse's centres ``range(start_bin,
        bins)``; said here naming the call, ``start_bin`` and ``num_bins``."""
        if start_bin > (bins if method == "entropy" else bins - 1):
            grown = f", grown to {bins}" if bins != self.bins else ""
            raise ValueError(f"{self.describe()}: {call}: start_bin={start_bin} leaves no "
                             f"{method} candidate in a histogram of {bins} bins (num_bins="
                             f"{self.bins}{grown}); {fix}")

    def reset(self) -> None:
        super().reset()
        self._grown_top = self._grown_edge = None
