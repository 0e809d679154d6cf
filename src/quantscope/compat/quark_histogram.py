"""AMD Quark's histogram observers (re-exported by :mod:`quantscope.compat.quark`).

Quark's recorder, percentile and histogram-MSE observers over the native histogram
observers, with Quark's ``(qspec, device=None)`` signature and qparams (the torch.ao-backed
"Pro": :mod:`.quark_pro`).
As Quark's: a constant batch's top bin edge is nudged (``x_min == x_max``), the estimate is
priced unclipped, and ``min_val`` / ``max_val`` hold the range the last qparams priced
(``inf`` / ``-inf`` before; never set on ``PerTensorHistogramObserverPro``)."""

from __future__ import annotations

import torch

from ..layout import Tensor
from ..observers.histogram import HistogramObserverBase
from ..observers.registry import register
from . import enum_name, field
from .quark_base import _F32_EPS, QuarkObserver
from .quark_mse import FP8_DTYPES, best_candidate
from .quark_scales import _WIDE, _quark_edges, _QuarkGrid, _refuse_overflow

__all__ = ["PerTensorHistogramObserver", "PerTensorMSEObserver", "PerTensorPercentileObserver"]


def __getattr__(name: str):
    # Pro lived here until 2026-12-06: its old import path, and pickles made then, still load
    if name == "PerTensorHistogramObserverPro":
        from .quark_pro import PerTensorHistogramObserverPro
        return PerTensorHistogramObserverPro
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the dtypes Quark's MSE search prices (its integer and fp8 fake-quantizers)
_MSE_DTYPES = {"int4", "uint4", "int8", "uint8", *FP8_DTYPES}


def _nonzero_ends(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Each row's min / max over its non-zero values (Quark's ``x[x != 0]``); 0 / 0 for a
    row of zeros (Quark's ``safe_min`` / ``safe_max``)."""
    nonzero = units.ne(0)
    inf = torch.tensor(float("inf"), dtype=units.dtype, device=units.device)
    some = nonzero.any(1)
    nz_lo = torch.where(nonzero, units, inf).amin(1).where(some, 0).to(lo.dtype)
    nz_hi = torch.where(nonzero, units, -inf).amax(1).where(some, 0).to(hi.dtype)
    return nz_lo, nz_hi


def _quark_float(t: torch.Tensor) -> torch.Tensor:
    """Quark's searches compute in their arguments' dtype: float32 for integer counts."""
    return t if t.is_floating_point() else t.float()


def _quark_zero(like: torch.Tensor) -> torch.Tensor:
    """Quark's lower end of a range from 0: ``torch.tensor(0)`` (int64) on ``like``'s device."""
    return torch.tensor(0, device=like.device)


class _QuarkHistogram(QuarkObserver):
    """Quark's histogram family: ``(qspec, device=None)``, 2048 bins, the first batch binned
    as Quark bins it (``|x|`` from 0 when symmetric, else ``[min, max]``); batches inside
    that range add on the same grid. Once a batch leaves that range Quark appends bins of the
    first width and bins every batch over all of them: quantscope then keeps Quark's grid
    (``_grids``, one :class:`_QuarkGrid` per row) beside its own, so the searches price
    Quark's counts and candidates exactly (Quark's grid grows without bound, as Quark's)."""

    _num_bins = 2048
    _skip_zeros = False
    _keeps_input_dtype = False  # Quark bins x.float(): float32 edges, unless a module cast
    _fp4_scale_formats = True  # Quark prices an fp4 estimate with get_scale(scale_format)

    def __init__(self, qspec, device: torch.device | None = None, **native):
        native.setdefault("grid", "first")
        native.setdefault("bins", self._num_bins)
        native.setdefault("skip_zeros", self._skip_zeros)
        symmetric = field(qspec, "symmetric")
        if symmetric is not None and not symmetric:  # Quark bins [min, max] (fp8 too)
            self.absolute = False
        super().__init__(qspec, device, **native)
        if not isinstance(self.spec.layout, Tensor):  # else a reshape error at qparams time
            raise ValueError(  # noqa: TRY004 (a value of qspec's qscheme, not a type)
                f"{type(self).__name__}: Quark's histogram observers are per tensor (its config "
                f"refuses them per channel / group), got qscheme {field(qspec, 'qscheme')!r}")
        self._priced: tuple[torch.Tensor, torch.Tensor] | None = None
        self._grids: list[_QuarkGrid] | None = None  # Quark's grid once a batch widened
        self._counts_dtype = torch.float32  # Quark's calib_hist: a batch's, or a later cast's
        self._empty_only = False  # only empty batches so far (Quark's grid of zeros)

    def forward(self, x):
        if isinstance(x, torch.Tensor) and not x.numel() and not self.has_observed:
            self._empty_only = True  # (the native observer passes an empty batch over)
        return super().forward(x)

    def _observe(self, units, lo, hi):
        self._refuse_overflow()  # (before any change) Quark's histc fails on a cast's inf
        if self.skip_zeros:  # Quark drops the zeros before it takes the batch's min / max
            lo, hi = _nonzero_ends(units, lo, hi)
        if self.min_vals.shape[0] != units.shape[0]:  # the first batch: new float32 edges
            self._input_dtype = torch.float32
        self._counts_dtype = torch.float32  # Quark's histc of x.float() (plus the old counts)
        super()._observe(units, lo, hi)
        if self._linear:  # still (or again, after an EMA step) the first grid
            self._grids = None
        elif self._grids is not None:  # None: native from the start (grid="pow2")
            x_min, x_max = self._quark_ends(lo, hi)
            rows = units.float().abs() if self._absolute else units.float()
            widened = [grid.grow(row[row != 0] if self.skip_zeros else row, a, b)
                       for grid, row, a, b in zip(self._grids, rows, x_min.tolist(),
                                                  x_max.tolist(), strict=True)]
            if any(widened):  # Quark's arange: float32 edges again
                self._input_dtype = torch.float32

    def _refuse_overflow(self) -> None:  # Quark's counts and edges in a cast's dtype
        if self.has_observed and {self._input_dtype, self._counts_dtype} - _WIDE:
            _refuse_overflow(self, sum(self._quark_rows(self.current_histogram()), ()))

    def _apply(self, fn, recurse=True):
        # Quark's cast converts its bin edges and counts only once a batch made them: the
        # first batch bins in new float32 ones (the eps buffer keeps the cast's dtype)
        super()._apply(fn, recurse)
        if not (self.has_observed or self._empty_only):  # (Quark's grid of zeros: cast too)
            self._input_dtype = torch.float32
        else:
            counts = fn(torch.empty((), dtype=self._counts_dtype)).dtype
            self._counts_dtype = counts if counts.is_floating_point else self._counts_dtype
        return self

    def _leave_linear(self, lo, hi):
        # Quark's grid so far, the first batch's: _observe grows it by this batch
        hist = self.current_histogram()
        self._grids = [_QuarkGrid(c.float(), e, self.bins)
                       for c, e in zip(hist.counts, _quark_edges(hist), strict=True)]
        self._input_dtype = torch.float32  # the batch widens Quark's grid: float32 edges
        super()._leave_linear(lo, hi)

    def _quark_rows(self, hist) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Quark's ``(calib_hist, calib_bin_edges)``: all rows ``[U, B]`` / ``[U, B + 1]`` on
        the first grid, one pair ``[1, B']`` / ``[1, B' + 1]`` per row once widened; float32,
        or the dtype of a module cast since the batch that made them (Quark's search runs in
        it; Quark's counts turn float32 again with each batch, its edges with a widening one)."""
        counts, edges = self._counts_dtype, self._input_dtype
        if self._grids is None:
            return [(hist.counts.to(counts), _quark_edges(hist).to(edges))]
        device = hist.lo.device  # the module may have moved since (a Python list)
        return [(g.counts.to(device, counts)[None], g.edges.to(device, edges)[None])
                for g in self._grids]

    def _estimate(self, hist):
        self._refuse_overflow()
        ends = [self._search(c, e) for c, e in self._quark_rows(hist)]
        return torch.cat([lo for lo, _ in ends]), torch.cat([hi for _, hi in ends])

    def _search(self, counts: torch.Tensor, edges: torch.Tensor):
        raise NotImplementedError

    def _calculate_qparams(self):
        if not self.has_observed:
            self._check_fp4_scale_format()  # Quark's get_scale raises before data too
            return self._empty_grid_qparams() if self._empty_only else \
                super()._calculate_qparams()
        # Quark's order: the estimate (MSE's search refuses its dtypes), then its pricing,
        # which refuses fp4 without scale_format and the dtypes of its integer formula
        qparams = super()._calculate_qparams()
        if enum_name(self.dtype) in self._quark_int_priced:
            self.calculate_int_quant_params(*self._priced)  # raises, as Quark's assert
        self._check_fp4_scale_format()
        if self.spec.is_float:  # Quark's float rules on the range it priced (as min-max's)
            return self._calculate_float_qparams(*self._priced)
        return qparams

    def _empty_grid_qparams(self):
        """Quark's qparams after empty batches alone: it bins one as a batch of zeros (the
        nudged grid ``[0, bins * eps]``) that adds no count, then searches and prices that
        grid. (A batch with data after it widens Quark's grid from there in steps of its
        width, millions of bins; the native grid here starts at the data.)"""
        zero = torch.zeros(1, device=self.observed_tokens.device)
        lo, hi = self._quark_ends(zero, zero)
        edges = torch.linspace(float(lo), float(hi), self.bins + 1, device=zero.device)
        counts = torch.zeros(1, self.bins, dtype=self._counts_dtype, device=zero.device)
        found = self._search(counts, edges[None].to(self._input_dtype))  # (a module cast's)
        self._priced = self._quark_range(*found)
        return self.calculate_qparams(*self._priced)

    def _observe_linear(self, units, lo, hi, *rest):
        if self.skip_zeros and not bool(self.hist_counts.any()) and bool(units.ne(0).any()):
            # only skipped zeros so far (Quark's grid [0, bins * eps]): the first batch with
            # data starts the grid, where Quark's grows that one in steps of its width (or
            # fails, asymmetric)
            self.hist_lo.fill_(float("inf"))
        return super()._observe_linear(units, lo, self._quark_hi(lo, hi), *rest)

    def _quark_hi(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Quark's top of a batch's bins in float32, so linspace's edges stay strictly
        increasing (:meth:`_quark_ends`)."""
        return self._quark_ends(lo, hi)[1].float()

    def _quark_ends(self, lo: torch.Tensor, hi: torch.Tensor):
        """Quark's ``x_min`` / ``x_max`` of a batch (float64, as its Python floats): ``|x|``
        from 0 when symmetric; for constant input (``x_min == x_max``: ``lo == hi``, or all
        zeros when symmetric) the top is ``x_min + max(|x_min|, 1) * bins * eps``."""
        x_min = torch.zeros_like(lo) if self._absolute else lo
        x_max = torch.maximum(lo.abs(), hi.abs()) if self._absolute else hi
        span = x_min.double().abs().clamp(min=1.0) * self.bins * _F32_EPS
        span = span.clamp(min=torch.finfo(torch.float32).tiny)
        return x_min.double(), torch.where(x_min == x_max, x_min.double() + span, x_max.double())

    def _clip(self, lo, hi):
        # Quark prices its estimate as it is: not clipped to the data (a constant batch's
        # nudged top bin centre lies above it), and stores it in min_val / max_val
        self._priced = self._quark_range(lo, hi)
        return lo.clone(), hi.clone()

    def _quark_range(self, lo: torch.Tensor, hi: torch.Tensor):
        """Quark's ``min_val`` / ``max_val`` of an estimate ``[1]``: 0-dim, in its bin edges'
        dtype (float32, or a module cast's)."""
        return (lo.reshape(()).to(self._input_dtype, copy=True),
                hi.reshape(()).to(self._input_dtype, copy=True))

    min_val, max_val = QuarkObserver.ends("_priced_end",
                                          "The range the last qparams priced (Quark's)")

    def _priced_end(self, name: str, empty: float) -> torch.Tensor:
        self._check_present(name)
        if self._priced is None:
            return torch.tensor(empty)
        return self._priced[name == "max_val"]

    def reset(self) -> None:
        super().reset()
        self._priced = None
        self._grids = None
        self._empty_only = False

    def _calib(self, which: int) -> torch.Tensor:
        if not self.has_observed:
            return torch.tensor([])
        rows = [pair[which] for pair in self._quark_rows(self.current_histogram())]
        if len({r.shape[-1] for r in rows}) > 1:
            raise ValueError(f"{self.describe()}: a widening batch gave the rows Quark's grids "
                             f"of different lengths; calib_hist / calib_bin_edges need one")
        t = torch.cat(rows)
        return t[0] if t.shape[0] == 1 else t

    @property
    def calib_hist(self) -> torch.Tensor:
        """Counts as Quark holds them (float32, or a module cast's dtype since the last batch;
        ``[bins]`` per tensor, ``[units, bins]`` else; more bins once a batch widened the range,
        as Quark's). On the first grid they are the exact counts, where Quark's float32 sums
        round once a bin passes ``2 ** 24``."""
        return self._calib(0)

    @property
    def calib_bin_edges(self) -> torch.Tensor:
        """Quark's edges: the first batch's linspace, then its appended bins."""
        return self._calib(1)


@register("quark:PerTensorHistogramObserver")
class PerTensorHistogramObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's histogram recorder. Quark's own never sets a range (scale 1); here the range is
    the data's min / max, so the class is usable on its own (before data: Quark's answer)."""

    def _estimate(self, hist):
        return self.min_vals, self.max_vals

    def _calculate_qparams(self):
        if not self.has_observed:
            self._check_fp4_scale_format()
            return self._quark_before_data()
        return super()._calculate_qparams()


@register("quark:PerTensorPercentileObserver")
class PerTensorPercentileObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's percentile observer: 4200 bins, zeros skipped, p = 99.99999999, left bin edge."""

    _num_bins = 4200
    _skip_zeros = True

    def __init__(self, qspec, device: torch.device | None = None, **native):
        self.percentile = 99.99999999
        super().__init__(qspec, device, **native)

    def _search(self, counts, edges):
        return self.get_min_max_by_percentile(counts, edges, self.percentile)

    def _calculate_qparams(self):
        scale, zp = super()._calculate_qparams()
        if self.has_observed and self._zero_mass():  # Quark's range: float32 zeros(1)
            if not self.spec.is_float:  # (priced in float32 whatever a module cast made)
                scale, zp = self.calculate_int_quant_params(*self._priced)
            return scale.reshape(1), zp.reshape(1)
        return scale, zp

    def _zero_mass(self) -> bool:
        return not self.has_observed or int(self.current_histogram().counts.sum()) <= 0

    def _quark_range(self, lo, hi):
        if self._zero_mass():  # Quark returns zeros(1) before its branches
            return torch.zeros(1, device=hi.device), torch.zeros(1, device=hi.device)
        lo, hi = super()._quark_range(lo, hi)
        return (_quark_zero(hi) if self._absolute else lo), hi

    def get_min_max_by_percentile(self, histogram: torch.Tensor, bin_edges: torch.Tensor,
                                  percentile: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's function, vectorized over rows (``[B]`` / ``[B + 1]`` or ``[U, B]`` /
        ``[U, B + 1]``). As in Quark: the asymmetric branch takes the max from the low tail
        (``cdf >= (100 - p) / 200``) and the min from the first bin."""
        if percentile < 0 or percentile > 100:
            raise ValueError("Percentile value must be between 0 and 100.")
        one = histogram.dim() == 1
        h = _quark_float(histogram).reshape(-1, histogram.shape[-1])
        edges = _quark_float(bin_edges).reshape(-1, bin_edges.shape[-1])
        total = h.sum(-1, keepdim=True)
        cdf = torch.cumsum(h / total, dim=-1)
        B = h.shape[-1]
        ar = torch.arange(B, device=h.device)

        def first(mask, default):
            return torch.where(mask, ar, B).amin(-1).where(mask.any(-1), default)

        if not self._absolute:  # Quark's symmetric=False branch (fp8 too: its [min, max] bins)
            side = (100.0 - percentile) / 200.0
            # Quark compares with Python floats: rounded to the cdf's dtype
            up = first(cdf >= torch.tensor(side, dtype=cdf.dtype), B - 1)
            low = first(cdf <= torch.tensor(1 - side, dtype=cdf.dtype), 0)
            mx, mn = edges.gather(1, up[:, None])[:, 0], edges.gather(1, low[:, None])[:, 0]
        else:
            target = torch.minimum(torch.tensor(percentile / 100.0, dtype=torch.float64),
                                   cdf[:, -1].double()).to(cdf.dtype)
            up = first(cdf >= target[:, None], B - 1)
            mx = edges.gather(1, up[:, None])[:, 0]
            mn = torch.zeros_like(mx)
        empty = total[:, 0] <= 0  # Quark: zero-mass histogram -> (0, 0)
        mn, mx = mn.masked_fill(empty, 0), mx.masked_fill(empty, 0)
        return (mn[0], mx[0]) if one else (mn, mx)


@register("quark:PerTensorMSEObserver")
class PerTensorMSEObserver(_QuarkHistogram, HistogramObserverBase):
    """Quark's histogram MSE: candidates ``(0, centre_i)`` for ``i >= start_bin`` (2045)."""

    def _search(self, counts, edges):
        return self.get_min_max_by_mse(counts, edges)

    def _quark_range(self, lo, hi):
        hi = super()._quark_range(lo, hi)[1]
        return _quark_zero(hi), hi

    def get_min_max_by_mse(self, calib_hist: torch.Tensor, calib_bin_edges: torch.Tensor,
                           stride: int = 1, start_bin: int = 2045
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's function (``[B]`` / ``[B + 1]``, or row by row ``[U, B]`` / ``[U, B + 1]``):
        the first centre with the least float32 ``mean((q(centres) - centres) ** 2 *
        counts)``; returns ``(0, amax)``. Quark's dtypes only: int4, uint4, int8, uint8,
        fp8_e4m3, fp8_e5m2 (others: ValueError, as Quark's)."""
        if enum_name(self.dtype) not in _MSE_DTYPES:
            raise ValueError(f"{type(self).__name__}: Quark's MSE search prices dtypes "
                             f"{sorted(_MSE_DTYPES)}, got {enum_name(self.dtype)!r}: use "
                             f"PerTensorPercentileObserver or PerTensorMinMaxObserver")
        if calib_bin_edges.shape[-1] < 2:
            raise ValueError(f"calib_bin_edges must have at least 2 elements, got "
                             f"{calib_bin_edges.shape[-1]}")
        if calib_hist.shape[-1] != calib_bin_edges.shape[-1] - 1:  # Quark: a size mismatch
            raise ValueError(
                f"{self.describe()}: Quark's grid has {calib_hist.shape[-1]} bins and "
                f"{calib_bin_edges.shape[-1]} edges (a widening batch's arange gave an edge more "
                f"or less than its bin count); Quark's MSE search fails here too")
        one = calib_hist.dim() == 1
        counts = _quark_float(calib_hist).reshape(-1, calib_hist.shape[-1])
        edges = _quark_float(calib_bin_edges).reshape(-1, calib_bin_edges.shape[-1])
        best = torch.stack([self._mse_row(c, e, stride, start_bin)
                            for c, e in zip(counts, edges, strict=True)])
        self._refuse_negative(best)  # fp8: Quark's scale of (0, best < 0) is 0
        mn = torch.zeros_like(best)
        return (mn[0], best[0]) if one else (mn, best)

    def _mse_row(self, counts: torch.Tensor, edges: torch.Tensor, stride: int,
                 start_bin: int) -> torch.Tensor:
        """One row's best centre, priced as Quark's loop prices it (one candidate at a time,
        its fake-quantizer and float32 ``mean`` over all bins: empty ones too, they place the
        others in the sum's order), here in chunks of candidates (:mod:`.quark_mse`). Many
        candidates tie within float32's rounding (the clipped negative bins of an asymmetric
        grid weigh the same in all), so an exact error picks another centre than Quark's
        rounded one."""
        centers = (edges[1:] + edges[:-1]) / 2
        _refuse_overflow(self, [centers])  # float16 edges past 32752: Quark's scale is inf
        amax = centers[min(start_bin, max(0, centers.numel() - 1))::stride]
        if not self.spec.is_float:  # Quark's int pricing asserts 0 <= centre
            self._refuse_negative(amax)
        # Quark's loop's answer bit for bit, the candidates priced in chunks
        return best_candidate(self, centers, counts, amax)

    def _refuse_negative(self, amax: torch.Tensor) -> None:
        if bool((amax < 0).any()):
            raise ValueError(
                f"{self.describe()}: with symmetric=False Quark's MSE search prices ranges "
                f"(0, centre) of the bins of [min, max] from its start_bin on, and a centre "
                f"is negative ({amax.min().item():.6g}): the data is (nearly) all negative, "
                f"or its grid grew wider than start_bin bins below zero; use a symmetric "
                f"qspec or PerTensorMinMaxObserver")

    def int_fake_tensor_quant(self, X: torch.Tensor, min_value: torch.Tensor,
                              max_value: torch.Tensor) -> torch.Tensor:
        """Quark's: ``X`` fake-quantized with the integer qparams of ``[min_value, max_value]``."""
        scale, zero_point = self.calculate_int_quant_params(min_value, max_value)
        return torch.fake_quantize_per_tensor_affine(
            X, scale.to(torch.float), zero_point.to(torch.int), self.quant_min, self.quant_max)

    def scaling_fp8(self, X: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Quark's: ``X`` scaled to ``amax``, clamped to the fp8 range, cast through fp8."""
        fp8 = FP8_DTYPES.get(enum_name(self.dtype))
        if fp8 is None:
            raise ValueError(f"Invalid dtype {self.dtype}. Supported fp8 formats: fp8_e4m3, "
                             f"fp8_e5m2.")
        scale = amax / self.quant_max
        clamped = torch.clamp(X / scale, min=self.quant_min, max=self.quant_max)
        return clamped.to(fp8).to(X.dtype) * scale
