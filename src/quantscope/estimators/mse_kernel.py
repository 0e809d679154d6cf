"""The MSE search's CPU kernel: candidate pricing and the per-unit selection rules in C.

For integer formats on CPU the torch search (:mod:`quantscope.estimators.mse`) spends
its time in per-tile op chains and in Python steps over ``[U]`` vectors. This kernel
does both in one call per block of candidates, with plain threads over units
(built by :mod:`quantscope.kernels`):

* **Pricing.** The error of a candidate ``(scale, zp)`` on a unit is
  ``sum(d ** 2)`` with ``d = fake_quantize_units(x) - x`` rounded exactly as
  :func:`~quantscope.quantize.fake_quantize_units` rounds it (``x / scale``,
  ``+ zp``, round half to even, clamp, ``(q - zp) * scale``, minus ``x``; built
  with ``-ffp-contract=off``). Each ``d`` is float32 as in torch; its square is
  exact in float64 and the sum is accumulated in float64, so the error is the
  float64 sum of torch's squared errors up to summation order (tests compare
  against a float64 torch reference at 1e-12). A candidate whose scale and zero
  point equal the previous one's (the min-max incumbent and ``p = 1``, plateaus
  of encoded scales) reuses its error, bit for bit.
* **Selection.** :func:`step` applies the rules of ``mse._State.step``
  (per-unit patience with plateaus not counted, llm-compressor's global
  patience, tie first / last) to a block of candidates, on a unit-by-unit walk:
  a unit that has stopped for good is not priced any more. The global rule
  needs every unit's error before it stops (all units are active until then): a
  block of all units is priced densely first; over several chunks of units the
  caller assumes it does not stop, gathers its flags, and redoes the search if it
  did. Tests run the torch ``_State`` on this kernel's prices and require the same
  choices bit for bit.

The scales and zero points of every candidate still come from
:func:`~quantscope.qparams.qparams_from_range`; the kernel only scores them.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..formats import IntFormat
from ..spec import QuantSpec

__all__ = ["KernelState", "available", "dq", "price", "usable"]


def _lib():
    return kernels.lib("mse_search")


def available() -> bool:
    """Whether the compiled kernel can be used (a C compiler was found and it built)."""
    return _lib() is not None


def usable(units: torch.Tensor, spec: QuantSpec, norm: float) -> bool:
    """Whether the kernel scores this search: integer formats without a global scale,
    squared error, float32 units on CPU, no autograd."""
    return (isinstance(spec.format, IntFormat) and not spec.scale.has_global_scale
            and float(norm) == 2.0 and units.device.type == "cpu"
            and units.dtype == torch.float32 and not units.requires_grad and available())


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _f32(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype == torch.float32 else t.float()
    return t if t.is_contiguous() else t.contiguous()


def _i32(t: torch.Tensor) -> torch.Tensor:
    """Zero points as int32 (qparams_from_range's dtype; integer-valued floats convert exactly)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


def price(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
          spec: QuantSpec, sub: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of every candidate ``(scale, zero_point) [k, n]`` on units ``sub``
    (all when None) of float32 ``units [U, E]``: float64 ``[k, n]``."""
    units = units.contiguous()
    n = units.shape[0] if sub is None else sub.numel()
    k = max(scale.shape[0], zero_point.shape[0])
    sc, zp = _f32(scale.expand(k, n)), _i32(zero_point.expand(k, n))
    sub = None if sub is None else sub.to(torch.int64).contiguous()
    out = torch.empty((k, n), dtype=torch.float64)
    _lib().qs_mse_price(units.data_ptr(), units.shape[1], None if sub is None else sub.data_ptr(),
                        n, sc.data_ptr(), zp.data_ptr(), k, float(spec.qmin), float(spec.qmax),
                        out.data_ptr(), _threads())
    return out


def dq(x: torch.Tensor, scale: float, zero_point: float, spec: QuantSpec) -> torch.Tensor:
    """``fake_quantize(x) - x`` of a 1-D float32 ``x`` as the kernel computes it (tests)."""
    x = _f32(x.reshape(-1))
    out = torch.empty_like(x)
    _lib().qs_mse_dq(x.data_ptr(), x.numel(), float(scale), float(zero_point), float(spec.qmin),
                     float(spec.qmax), out.data_ptr())
    return out


class KernelState:
    """The per-unit search state of ``mse._State``, in buffers the kernel updates in place.

    The first :meth:`step` of a unit (``init``) takes the incumbent as row 0 of its block:
    best so far (index -1) and previous qparams. The chosen range is not kept: it is the
    candidate ``idx`` (the caller rebuilds it from the factors, as it built the candidates).
    """

    def __init__(self, units: torch.Tensor, spec: QuantSpec):
        n = units.shape[0]
        self.units = units.contiguous()
        self.qmin, self.qmax = float(spec.qmin), float(spec.qmax)
        f64 = torch.empty((2, n), dtype=torch.float64)
        self.best, self.perr = f64[0], f64[1]  # error of the best, of the previous candidate
        self.idx = torch.empty(n, dtype=torch.int64)
        self.stale = torch.empty(n, dtype=torch.int64)
        self.stopped = torch.empty(n, dtype=torch.bool)
        self.psc, self.pzp = torch.empty((2, n)).unbind(0)  # the previous candidate's qparams
        self.g = torch.zeros(2, dtype=torch.int64)  # the global rule: stale count, stopped

    def step(self, i0, scale, zp, *, patience, per_unit, tie, use_global, units=None,
             sub=None, init=0, gstop=-1, any_out=None):
        """Candidates ``i0 ..`` (encoded qparams ``[rows, n]``) for units ``sub`` (all if
        None) of ``units`` (a ``slice`` of rows: the state's, offset; default all); returns
        how many of them are still searching.

        ``init`` (a unit's first step) 1: row 0 is the incumbent, 2: row 0 is the incumbent
        and also candidate ``i0``. The global rule: ``gstop=-1`` decides it here (the block
        is priced for every unit first); else candidates ``i0 + j``, ``j >= gstop`` see it
        stopped, and ``any_out`` (uint8 ``[k]``) gathers the flags it needs.
        """
        rows, n = scale.shape[0], (zp.shape[1] if zp.dim() == 2 else scale.shape[1])
        sc, z = _f32(scale.expand(rows, n)), _i32(zp.expand(rows, n))
        sub = None if sub is None else sub.to(torch.int64).contiguous()
        a = 0 if units is None else units.start
        x, E = self.units[a:], self.units.shape[1]

        def at(t):
            return t[a:].data_ptr()

        live = _lib().qs_mse_step(
            x.data_ptr(), E, None if sub is None else sub.data_ptr(), n, sc.data_ptr(),
            z.data_ptr(), rows - (init == 1), i0, int(init), self.qmin, self.qmax,
            0 if patience is None else int(patience), int(per_unit), int(use_global),
            int(tie == "last"), at(self.best), at(self.perr), at(self.idx), at(self.stale),
            at(self.stopped), at(self.psc), at(self.pzp), self.g.data_ptr(), int(gstop),
            None if any_out is None else any_out.data_ptr(), _threads())
        if live < 0:
            raise MemoryError("mse kernel: could not allocate the block's scratch")
        return live

    def global_stop(self, any_flags: torch.Tensor, patience: int) -> int:
        """The global rule over gathered flags: the first candidate that sees it stopped."""
        return _lib().qs_mse_gstop(any_flags.data_ptr(), any_flags.numel(), int(patience),
                                   self.g.data_ptr())
