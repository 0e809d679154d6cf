"""The MSE search family: the range that minimizes the quantization error of what was seen.

Each call searches candidate ranges on the observed tensor
(:func:`~quantscope.estimators.mse.mse_search`); memoryless observers keep the
last answer, moving-average ones an EMA of the chosen ranges.

==========================  ======================================================
name                        search
==========================  ======================================================
``memoryless_mse``          llm-compressor's grid (maxshrink 0.2, grid 100,
``mse`` (EMA, c = 0.01)     patience 5), native rules by default: norm 2, per-unit
                            patience, encoding-aware, min-max as the incumbent
``nvfp4_expanded_mse``      the same from 1.8x the range (grid 200, patience 1000)
``linear_mse`` (EMA)        Horizon: ``amax * (1 - 0.01 i)``, i in range(0, 95,
                            stride), L2, last minimum
``pow2_mse``                Quark: the min-max scale's exponent -2 .. +2
==========================  ======================================================

``compat="llmcompressor"`` gives llm-compressor's exact search instead: norm
2.4, global patience, their error sum, no min-max incumbent, NVFP4 searched with
unrounded float32 scales and the global scale taken from the chosen ranges, and
their ``lerp`` for the moving average.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .._checks import check_int
from ..comm import AVG
from ..estimators.mse import MAX_SPAN, linear_search, mse_search, pow2_search
from ..stats.minmax import ema_, ordered
from .base import Observer
from .overflow import EMA_OVERFLOW
from .registry import register

__all__ = [
    "COMPAT_MODES",
    "LinearMSEObserver",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "Pow2MSEObserver",
]

COMPAT_MODES = (None, "llmcompressor")
_VALIDATED: set = set()  # configurations whose search ran once in a constructor


@register("memoryless_mse")
class MemorylessMSEObserver(Observer):
    """The MSE-optimal range of the last tensor observed (llm-compressor's ``memoryless_mse``).

    Args:
        spec: the quantizer the range is searched for.
        maxshrink, grid, patience, expand: the candidate grid (see
            :func:`~quantscope.estimators.mse.mse_search`).
        norm: error exponent; default 2 (2.4 with ``compat="llmcompressor"``).
        per_unit_patience, encoding_aware: native rules (default on; in compat mode
            llm-compressor's: global patience, NVFP4 priced with float32 scales).
        independent_ends: asymmetric specs search both ends on a 2-D grid.
        global_grid: NVFP4 global-scale candidates (default 4; 1 = the observed amax only).
        compat: None or ``"llmcompressor"`` (their exact search).
        chunk_elems: tile size of the search (memory bound).
    """

    family = "mse"
    memoryless = True

    accumulates = False
    #: the ``compat`` used when none is given (compat classes set "llmcompressor")
    compat_default: str | None = None
    #: defaults of the search grid (presets override them)
    defaults: ClassVar[dict] = {"maxshrink": 0.2, "grid": 100, "patience": 5, "expand": 1.0}

    def __init__(self, spec=None, *, maxshrink: float | None = None, grid: float | None = None,
                 norm: float | None = None, patience: int | None | str = "default",
                 expand: float | None = None, per_unit_patience: bool | None = None,
                 encoding_aware: bool | None = None, independent_ends: bool = False,
                 global_grid: int | None = None, compat: str | None | bool = False,
                 chunk_elems: int | None = None, **kwargs):
        super().__init__(spec, **kwargs)
        if compat is False:
            compat = self.compat_default
        if compat not in COMPAT_MODES:
            raise ValueError(f"{type(self).__name__}: compat must be one of {COMPAT_MODES}, "
                             f"got {compat!r}")
        exact = compat is not None
        d = self.defaults
        self.compat = compat
        self.options = {
            "maxshrink": d["maxshrink"] if maxshrink is None else maxshrink,
            "grid": d["grid"] if grid is None else grid,
            "patience": d["patience"] if patience == "default" else patience,
            "expand": d["expand"] if expand is None else expand,
            "norm": (2.4 if exact else 2.0) if norm is None else norm,
            "per_unit_patience": not exact if per_unit_patience is None else per_unit_patience,
            "encoding_aware": not exact if encoding_aware is None else encoding_aware,
            "independent_ends": independent_ends, "global_grid": global_grid, "compat": compat,
            "chunk_elems": chunk_elems}
        # validate now, on a one-element tensor, rather than at the first forward; once per
        # configuration (observers are made per layer, and a search costs ~0.1 ms)
        # by repr: stride=True equals 1 (and hashes alike), so it would skip the check
        key = (type(self), repr(self.spec), repr(sorted(self.options.items())),
               repr(getattr(self, "stride", None)), repr(getattr(self, "span", None)))
        if key not in _VALIDATED:
            self._search(torch.zeros(1, 1), torch.zeros(1), torch.zeros(1))
            if len(_VALIDATED) < 4096:
                _VALIDATED.add(key)
        self.register_buffer("min_vals", torch.zeros(0, dtype=torch.float32))
        self.register_buffer("max_vals", torch.zeros(0, dtype=torch.float32))
        self.register_buffer("global_amax_val", torch.zeros(0, dtype=torch.float32))

    _one_value_buffers = ("global_amax_val",)

    def _sized_buffers(self):
        return ("min_vals", "max_vals", "global_amax_val")

    def sync_plan(self):
        return {"min_vals": AVG, "max_vals": AVG, "global_amax_val": AVG}

    def _search(self, units, lo, hi):
        return mse_search(units, lo, hi, self.spec, **self.options)

    def _observe(self, units, lo, hi):
        res = self._search(units, lo, hi)
        ga = None if res.global_amax is None else res.global_amax.reshape(1)
        self._store_range(res.lo, res.hi, ga)

    def _store_range(self, lo, hi, ga):
        # Observer._store: in place once a batch has sized them (torch.export keeps only that)
        names, values = ("min_vals", "max_vals"), (lo, hi)
        if ga is not None:
            names, values = names + ("global_amax_val",), values + (ga,)
        self._store(names, values)

    def calculate_range(self):
        return self.min_vals, self.max_vals

    def global_amax(self):
        # the amax the ranges were searched under; compat mode derives it from the ranges
        return self.global_amax_val[0] if self.global_amax_val.numel() else None

    @property
    def overflow_cause(self) -> str:
        """What takes the range past float32 from finite input: compat's ``expand`` (native
        searches never choose such a candidate), and for the moving average its update."""
        causes = [EMA_OVERFLOW] if not self.memoryless else []
        if self.compat and self.options["expand"] != 1:
            causes.insert(0, f"expand={self.options['expand']} takes the observed range past "
                             f"float32's max (llm-compressor's search then returns NaN scales)")
        return "; or ".join(causes) or "its search overflowed float32"

    def extra_repr(self):
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        return f"{super().extra_repr()}, {opts}"


@register("mse", "moving_average_mse")
class MovingAverageMSEObserver(MemorylessMSEObserver):
    """EMA of the MSE-optimal ranges (llm-compressor's ``mse``; ``averaging_constant`` 0.01).

    The first call initialises; NVFP4's global amax is averaged the same way.
    """

    memoryless = False

    accumulates = True

    def __init__(self, spec=None, *, averaging_constant: float = 0.01, **kwargs):
        super().__init__(spec, **kwargs)
        self.averaging_constant = self._averaging_constant(averaging_constant)

    def _store_range(self, lo, hi, ga):
        if self.min_vals.shape != lo.shape:  # first call (shape, not value: no host sync)
            super()._store_range(lo.clone(), hi.clone(), None if ga is None else ga.clone())
            return
        self._ema_(self.min_vals, lo)
        self._ema_(self.max_vals, hi)
        if ga is not None and self.global_amax_val.shape == ga.shape:
            self._ema_(self.global_amax_val, ga)

    def calculate_range(self):
        return ordered(self.min_vals, self.max_vals)  # (the EMA's rounding can cross them)

    def _ema_(self, state: torch.Tensor, batch: torch.Tensor) -> None:
        # llm-compressor's lerp in compat mode, else the min-max family's rounding (torch.ao's)
        kind = "ema_lerp" if self.compat == "llmcompressor" else "ema"
        ema_(kind, self.averaging_constant, state, batch.clone())

    def extra_repr(self):
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant}"


@register("nvfp4_expanded_mse", "fouroversix")
class NVFP4ExpandedMSEObserver(MemorylessMSEObserver):
    """llm-compressor's NVFP4 preset: search from 1.8x the range down to 0.8x (111 candidates)."""

    defaults: ClassVar[dict] = {"maxshrink": 1 - 0.8 / 1.8, "grid": 200, "patience": 1000,
                                "expand": 1.8}


@register("linear_mse", "horizon_mse")
class LinearMSEObserver(MovingAverageMSEObserver):
    """Horizon's MSE observer: a linear search ``amax * (1 - 0.01 i)``, then an EMA.

    ``stride`` thins the 95 candidates; the error is L2 and the last minimum wins.
    Symmetric specs only (Horizon is symmetric): an asymmetric spec is a ``ValueError``.
    """

    #: the search's squares rounded to float32 (Horizon's arithmetic: its compat class); the
    #: native search squares exactly in float64 (``mse_search``'s ``float32_squares``)
    float32_squares: ClassVar[bool] = False
    #: an asymmetric spec is refused (integrations check it to name what their user wrote)
    symmetric_only: ClassVar[bool] = True

    def __init__(self, spec=None, *, stride: int = 1, averaging_constant: float = 0.01,
                 chunk_elems: int | None = None, **kwargs):
        self.stride = stride
        super().__init__(spec, averaging_constant=averaging_constant, chunk_elems=chunk_elems,
                         **kwargs)
        if self.symmetric_only and not self.spec.symmetric:  # (-amax, amax) wastes half the grid
            raise ValueError(f"{type(self).__name__}: searches symmetric ranges only, got the "
                             f"asymmetric spec {self.spec}; use memoryless_mse / mse for it")

    def _search(self, units, lo, hi):
        return linear_search(units, lo, hi, self.spec, stride=self.stride,
                             chunk_elems=self.options["chunk_elems"],
                             float32_squares=self.float32_squares)

    def extra_repr(self):
        return (f"spec={self.spec}, stride={self.stride}, "
                f"averaging_constant={self.averaging_constant}")


@register("pow2_mse")
class Pow2MSEObserver(MemorylessMSEObserver):
    """Quark's power-of-two min-MSE: the min-max scale's exponent shifted by -span .. +span.

    Meant for power-of-two scales (``scale="pow2:round"``), where the five
    candidates are exactly five consecutive exponents.
    """

    def __init__(self, spec=None, *, span: int = 2, chunk_elems: int | None = None, **kwargs):
        self.span = check_int(type(self).__name__, "span", span, 0, MAX_SPAN)
        super().__init__(spec, chunk_elems=chunk_elems, **kwargs)

    def _search(self, units, lo, hi):
        return pow2_search(units, lo, hi, self.spec, span=self.span,
                           chunk_elems=self.options["chunk_elems"])

    def extra_repr(self):
        return f"spec={self.spec}, span={self.span}"
