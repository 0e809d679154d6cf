"""ModelOpt's histogram grid, a mixin of :class:`~quantscope.compat.modelopt.HistogramCalibrator`:
its edges, ``linspace(0, max |x|, num_bins + 1)`` of the first batch, grown as its ``arange``
of that width, its ``_calib_hist`` / ``_calib_bin_edges``, the amaxes read as its values
(an edge, or a bin centre ``(edges[i] + edges[i + 1]) / 2``, in its float32 bits), and the
methods' candidates on it (:meth:`ModelOptGrid._check_start_bin`).

A batch that grows a float32 grid is counted in Python floats (:func:`bins_for`, the last edge
from a float end: :meth:`ModelOptGrid._grow_to`), bitwise the tensor formulas ModelOpt uses, on
every device (off the CPU its max ``|x|`` is the one host read, as the bin count was; its
checks come before the counts grow there too, so a refused batch changes nothing), and the
first grid's edges are kept per (max ``|x|``, bins, default dtype): each grown batch had cost
~15 tensor ops and 4 host reads more (general path, 1K values, one thread: 325 -> 268 us a
growing call)."""

from __future__ import annotations

import math
import struct
import warnings

import torch

from .. import kernels
from ..observers.step_cache import CACHES

__all__ = ["ModelOptGrid"]


def _float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, as torch rounds; past its range: inf)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def bins_for(top: float, w: float) -> float:
    """ModelOpt's bin count ``ceil(top / w)`` of float32 ``top`` and width ``w`` as torch's
    float32 division and ceil give it (:meth:`ModelOptGrid._bins_needed`), in Python: the
    double quotient rounded to float32 is the float32 quotient (53 bits >= 2 * 24 + 2:
    rounding twice is rounding once); ``x / 0`` as torch's (inf, or NaN for 0 / 0)."""
    q = _float32(top / w) if w else math.inf if top > 0 else math.nan
    return math.ceil(q) if math.isfinite(q) else q


class ModelOptGrid:
    """Mixin (before :class:`~quantscope.compat.horizon.AppendingFirstGrid`): the first grid's
    edges, bin count and top as ModelOpt computes them."""

    _grown_top: torch.Tensor | None = None  # max |x| of the batch that last grew the grid
    _grown_edge: torch.Tensor | None = None  # the grown grid's last edge (_linear_top)
    #: Observer's uncopied caches and the kept first grid's edges (:meth:`_first_grid`)
    _uncopied = (*CACHES, "_grid_cache")

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
        # ModelOpt's arange runs on the batch's device, its linspace on the CPU (kept: a copy)
        return edges.clone() if self._grown_top is None else edges.to(self.hist_counts.device)

    def _first_grid(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """ModelOpt's ``linspace(0, max |x|, num_bins + 1)`` of the first batch (CPU, the
        default dtype: float32), its width ``edges[1] - edges[0]`` and that as a float, kept
        per (max ``|x|``, bins, dtype): a growing batch reads them (read only: copied where
        returned)."""
        hi = self._buffers["hist_hi"]
        top = kernels.first_value(hi) if hi.shape == (1,) else None
        key = (float(hi[0]) if top is None else top, self.bins, torch.get_default_dtype())
        kept = self.__dict__.get("_grid_cache")
        if kept is None or kept[0] != key:
            edges = torch.linspace(0, key[0], self.bins + 1)
            w = edges[1] - edges[0]
            kept = self.__dict__["_grid_cache"] = (key, edges, w, float(w))
        return kept[1:]

    def _modelopt_edges(self) -> torch.Tensor:
        """ModelOpt's edges of the first grid (CPU float32): ``linspace(0, max |x|, num_bins +
        1)`` of the first batch; grown, ``arange(0, top + w, w)`` to the growing batch's max
        ``|x|`` (one edge more than the bins where float32 rounds so). Read only (the
        first grid's are kept: :meth:`_first_grid`)."""
        edges, w, _ = self._first_grid()
        if self._grown_top is None:
            return edges
        return torch.arange(0, self._grown_top + w, w)

    def _bins_needed(self, hi) -> torch.Tensor:
        # ModelOpt's count: ceil(x_max / w) in float32, w = edges[1] - edges[0] of its
        # float32 linspace (not Horizon's float64 quotient, which can count a bin more)
        w = self._first_grid()[1].to(hi.device)
        return torch.ceil(hi.float() / w).max()  # (one CPU value: bins_for, in Python)

    def _linear_top(self):
        # histc's max on a grown grid: ModelOpt's last edge (float32 steps, not float64's),
        # kept when the grid grows (read 2-3 times a batch)
        hi = self._buffers["hist_hi"]
        if self._grown_top is None:
            return hi
        edge = kept = self._grown_edge
        if edge is None:
            edge = self._modelopt_edges()[-1:]
        if not (edge.is_cpu and hi.is_cpu) and edge.device != hi.device:  # Module.to moves
            edge = edge.to(hi.device)  # no plain attribute
        if edge is not kept:  # (a plain attribute: no nn.Module.__setattr__)
            self.__dict__["_grown_edge"] = edge
        return edge

    def _append_bins(self, hi) -> bool:
        # ModelOpt's edges run to this batch's max |x| (hi: per tensor, one value), grown by
        # _grow_to on every device: off the CPU its float is the one host read (the bin
        # count's before), and its checks come before the pad there too
        top = kernels.first_value(hi)
        grown = self._grow_to(float(hi.reshape(())) if top is None else top)
        if grown is None:  # a float64 default dtype's linspace: torch's ops
            grown = super()._append_bins(hi)
            if grown:  # (plain attributes: no nn.Module.__setattr__, every growing batch)
                self.__dict__.update(_grown_top=hi.reshape(()).float().cpu(), _grown_edge=None)
        return grown

    #: observers/first_step.py's cached step may call _grow_to with the float it has (a
    #: subclass overriding _append_bins is given the tensor)
    _append_bins.takes_float = "_grow_to"

    def _grow_to(self, top: float) -> bool | None:
        """:meth:`_append_bins` of a batch whose max ``|x|`` is the float32 ``top`` on a
        float32 first grid, in Python floats (:func:`bins_for`; the last edge ``arange(0, top +
        w, w)[-1]``, whose end ``top + w`` rounds to float32 as torch's sum does), the top and
        that edge kept at once, on the CPU whatever the device (``_calib_bin_edges`` is read
        there; :meth:`_linear_top` moves the edge once); None where it does not apply (the
        grid is not float32); False, nothing done, where the grid cannot hold it (a ``top`` of
        inf: ``forward``'s non-finite batch, recorded by the caller and refused by
        ``qparams()`` / ``compute_amax()``; a first grid of width 0, or past the bound:
        :meth:`_fits`, the caller's move to the native grid). The count, the end and the
        edges come first, in ModelOpt's order, for a finite ``top``: a bin count past
        float32's range (a first grid of a positive width far below the data) is ModelOpt's
        ``OverflowError`` of ``int(inf)``, then an end past it (data near its max) ModelOpt's
        ``RuntimeError`` of that ``arange``, each raised with nothing changed (ModelOpt's
        histogram stays as it was; the caller's state too: the cached step and ``_observe``
        grow the grid before they update the min / max)."""
        _, w, width = self._first_grid()  # (float32: the default dtype, as its key says)
        if w.dtype != torch.float32:
            return None
        if not math.isfinite(top):  # non-finite data, not data near float32's max
            return False
        end, need = _float32(top + width), bins_for(top, width)
        if width and math.isinf(need):  # ModelOpt's int(ceil(top / w)) first: int(inf)
            raise OverflowError(f"cannot convert float infinity to integer (modelopt "
                                f"{type(self).__name__}: ModelOpt's bin count ceil(max |x| / "
                                f"width) for max |x| {top:.6g}, width {width:.6g} is past "
                                f"float32's range; the batch is refused, nothing changed)")
        if not math.isfinite(end):
            raise RuntimeError(f"unsupported range: 0 -> inf (modelopt {type(self).__name__}: "
                               f"ModelOpt's edges arange(0, max |x| + width, width) for max "
                               f"|x| {top:.6g}, width {width:.6g} end past float32's range; "
                               f"the batch is refused, nothing changed)")
        if not self._fits(need, 1):
            return False
        edge = torch.arange(0, end, width)[-1:]  # (before the pad: an error changes nothing)
        self._pad_to(need, 1)
        self.__dict__.update(_grown_top=torch.full((), top, dtype=torch.float32),
                             _grown_edge=edge)
        return True

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
