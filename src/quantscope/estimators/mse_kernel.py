"""The MSE search's CPU kernel: candidate pricing and the per-unit selection rules in C.

For integer and float element formats on CPU the torch search
(:mod:`quantscope.estimators.mse`) spends its time in per-tile op chains and in Python
steps over ``[U]`` vectors. This kernel does both in one call per block of candidates,
with plain threads over units (built by :mod:`quantscope.kernels`):

* **Pricing.** The error of a candidate ``(scale, zp)`` on a unit is
  ``sum(d ** 2)`` with ``d = fake_quantize_units(x) - x`` rounded exactly as
  :func:`~quantscope.qdq.fake_quantize_units` rounds it (``x / scale``,
  ``+ zp``, round half to even, clamp, ``(q - zp) * scale``, minus ``x``; built
  with ``-ffp-contract=off``). Each ``d`` is float32 as in torch; its square is
  taken in float64, where it is exact, and the sum is accumulated in float64, so the error
  is the float64 sum of the exact squared errors up to summation order (tests compare
  against a float64 torch reference at 1e-12). ``float32_squares`` rounds each square to
  float32 first (``d * d`` as torch's ``d.square()``: a compat class's toolkit
  arithmetic). Float element formats (fp4 / fp6 / fp8: MX and NVFP4 blocks, whose scale,
  NVFP4's global scale folded in, comes from the same ``qparams_from_range``) round as
  :meth:`~quantscope.formats.FloatFormat.round` does: the step ``2 ** (e - mbits)`` from
  ``x / scale``'s exponent field, half to even, saturating (the ``_fp`` entry points). A
  candidate whose scale and zero
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
from ..formats import FloatFormat, IntFormat
from ..spec import QuantSpec
from .mse_tiles import candidate_qparams, finite_candidates

__all__ = ["KernelState", "dq", "price", "search", "usable"]

#: the [candidates, units] qparams blocks: at most this many elements, below torch's
#: parallel grain (32768), so their torch ops run on one thread: with two, every op waits
#: at OpenMP's barrier for a descheduled worker on a loaded machine (measured: 10x slower
#: on the MiniLM weights at load 4). Chunks of at least this many units:
_KERNEL_BLOCK = 32767
#: with torch on one thread there is no barrier to wait at: larger blocks, fewer Python steps
#: (the NVFP4 expanded search prices 112 candidates of 262,144 blocks of a 1024 x 4096 weight)
_KERNEL_BLOCK_ONE_THREAD = 1 << 18
_MIN_KERNEL_UNITS = 256


def _lib():
    return kernels.lib("mse_search")


def usable(units: torch.Tensor, spec: QuantSpec, norm: float) -> bool:
    """Whether the kernel scores this search: integer formats without a global scale or
    float element formats (NVFP4's global scale included), squared error, float32 units on
    CPU, no autograd (and the kernel built)."""
    fmt = spec.format
    return ((isinstance(fmt, IntFormat) and not spec.scale.has_global_scale
             or isinstance(fmt, FloatFormat))
            and float(norm) == 2.0 and units.device.type == "cpu"
            and units.dtype == torch.float32 and not units.requires_grad
            and kernels.real(units) and kernels.available("mse_search"))


def price(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
          spec: QuantSpec, sub: torch.Tensor | None = None, *,
          float32_squares: bool = False) -> torch.Tensor:
    """Squared error of every candidate ``(scale, zero_point) [k, n]`` on units ``sub``
    (all when None) of float32 ``units [U, E]``: float64 ``[k, n]``."""
    units = units.contiguous()
    n = units.shape[0] if sub is None else sub.numel()
    k = max(scale.shape[0], zero_point.shape[0])
    # zero points as int32: qparams_from_range's dtype (integer-valued floats convert exactly)
    sc = kernels.contiguous(scale.expand(k, n))
    zp = kernels.contiguous(zero_point.expand(k, n), torch.int32)
    sub = None if sub is None else sub.to(torch.int64).contiguous()
    out = torch.empty((k, n), dtype=torch.float64)
    # the weighted entry points with no weights (NULL): the unweighted sums
    args = (units.data_ptr(), None, units.shape[1], None if sub is None else sub.data_ptr(), n,
            sc.data_ptr(), zp.data_ptr(), k)
    if spec.is_float:
        fmt = spec.format
        _lib().qs_mse_price_fp_w(*args, fmt.max, fmt.min_exp, fmt.mbits, out.data_ptr(),
                                 kernels.threads(), int(float32_squares))
    else:
        _lib().qs_mse_price_w(*args, float(spec.qmin), float(spec.qmax), out.data_ptr(),
                              kernels.threads(), int(float32_squares))
    return out


def dq(x: torch.Tensor, scale: float, zero_point: float, spec: QuantSpec) -> torch.Tensor:
    """``fake_quantize(x) - x`` of a 1-D float32 ``x`` as the kernel computes it (tests)."""
    x = kernels.contiguous(x.reshape(-1))
    out = torch.empty_like(x)
    if spec.is_float:
        fmt = spec.format
        _lib().qs_mse_dq_fp(x.data_ptr(), x.numel(), float(scale), fmt.max, fmt.min_exp,
                            fmt.mbits, out.data_ptr())
    else:
        _lib().qs_mse_dq(x.data_ptr(), x.numel(), float(scale), float(zero_point),
                         float(spec.qmin), float(spec.qmax), out.data_ptr())
    return out


class KernelState:
    """The per-unit search state of ``mse._State``, in buffers the kernel updates in place.

    The first :meth:`step` of a unit (``init``) takes the incumbent as row 0 of its block:
    best so far (index -1) and previous qparams. The chosen range is not kept: it is the
    candidate ``idx`` (the caller rebuilds it from the factors, as it built the candidates).
    """

    def __init__(self, units: torch.Tensor, spec: QuantSpec, float32_squares: bool = False):
        n = units.shape[0]
        self.sq32 = int(float32_squares)  # the prices' squares rounded to float32 (module doc)
        self.units = units.contiguous()
        self.qmin, self.qmax = float(spec.qmin), float(spec.qmax)
        # a float element format: the _fp entry point, with its min_exp and mbits
        self.float_fmt = (spec.format.min_exp, spec.format.mbits) if spec.is_float else None
        f64 = torch.empty((2, n), dtype=torch.float64)
        self.best, self.perr = f64[0], f64[1]  # error of the best, of the previous candidate
        self.idx = torch.empty(n, dtype=torch.int64)
        self.stale = torch.empty(n, dtype=torch.int64)
        self.stopped = torch.empty(n, dtype=torch.bool)
        self.psc, self.pzp = kernels.buffer(2, n).unbind(0)  # the previous candidate's qparams
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
        sc = kernels.contiguous(scale.expand(rows, n))
        z = kernels.contiguous(zp.expand(rows, n), torch.int32)
        sub = None if sub is None else sub.to(torch.int64).contiguous()
        a = 0 if units is None else units.start
        x, E = self.units[a:], self.units.shape[1]

        def at(t):
            return t[a:].data_ptr()

        fn, extra = _lib().qs_mse_step, ()
        if self.float_fmt is not None:
            fn, extra = _lib().qs_mse_step_fp, self.float_fmt
        live = fn(
            x.data_ptr(), E, None if sub is None else sub.data_ptr(), n, sc.data_ptr(),
            z.data_ptr(), rows - (init == 1), i0, int(init), self.qmin, self.qmax,
            0 if patience is None else int(patience), int(per_unit), int(use_global),
            int(tie == "last"), at(self.best), at(self.perr), at(self.idx), at(self.stale),
            at(self.stopped), at(self.psc), at(self.pzp), self.g.data_ptr(), int(gstop),
            None if any_out is None else any_out.data_ptr(), kernels.threads(), *extra,
            self.sq32)
        if live < 0:
            raise MemoryError("mse kernel: could not allocate the block's scratch")
        return live

    def global_stop(self, any_flags: torch.Tensor, patience: int) -> int:
        """The global rule over gathered flags: the first candidate that sees it stopped."""
        return _lib().qs_mse_gstop(any_flags.data_ptr(), any_flags.numel(), int(patience),
                                   self.g.data_ptr())


class _Search:
    """One search (the torch path's ``mse_tiles.search``) with the kernel pricing candidates
    and applying the rules unit by unit (errors summed in float64).

    Candidates' qparams are computed in ``[candidates, units]`` blocks of at most
    ``_KERNEL_BLOCK`` (and ``chunk_elems``) elements: the whole grid at once for chunks
    of units, so each unit's data is read once for the grid and once for its extension.
    The global rule couples all units; over several chunks it is first assumed not to
    stop within the grid (the usual case with many units), and if it did, the search is
    redone knowing where.
    """

    def __init__(self, units, lo, hi, spec, f_lo, f_hi, *, patience, per_unit, tie, incumbent,
                 global_amax, chunk_elems, early_stop, extend=(), float32_squares=False, **_):
        self.lo, self.hi, self.spec, self.incumbent = lo, hi, spec, incumbent
        self.global_amax, self.early_stop = global_amax, early_stop
        self.state = KernelState(units, spec, float32_squares)
        self.total = len(f_lo)
        self.ext = list(extend) if extend and per_unit and patience is not None else []
        self.first_is_incumbent = (incumbent[0] is lo and incumbent[1] is hi and f_lo[0] == 1.0
                                   and f_hi[0] == 1.0)  # then lo * 1.0 is the incumbent's row
        self.f_lo = torch.tensor(list(f_lo) + self.ext, dtype=torch.float32)
        self.f_hi = torch.tensor(list(f_hi) + self.ext, dtype=torch.float32)
        # the kernel runs on the CPU, where one read of the ends spares every block's mask
        self.finite = finite_candidates((lo, hi, *incumbent), (self.f_lo, self.f_hi))
        self.use_global = patience is not None
        self.rule = {"patience": patience, "per_unit": per_unit, "tie": tie}
        n_units = units.shape[0]
        block = _KERNEL_BLOCK if torch.get_num_threads() > 1 else _KERNEL_BLOCK_ONE_THREAD
        self.budget = max(1, min(chunk_elems, block))
        ub = min(n_units, max(_MIN_KERNEL_UNITS, self.budget // (self.total + 1)))
        self.kb = min(self.total, max(1, self.budget // ub))  # candidates per block
        self.chunks = [(a, min(a + ub, n_units)) for a in range(0, n_units, ub)]

    def _qparams(self, lo_c, hi_c):
        qp = candidate_qparams(lo_c, hi_c, self.spec, self.global_amax, self.finite)
        return qp.effective_scale.expand_as(lo_c), qp.zero_point

    def _grid(self, a, b, gstop, flags):
        """The grid for units ``a:b``; ``gstop``, ``flags``: as in :meth:`KernelState.step`."""
        l0, h0 = self.lo[a:b], self.hi[a:b]
        for i0 in range(0, self.total, self.kb):
            i1 = min(i0 + self.kb, self.total)  # f_lo, f_hi go on with the extension
            lo_c, hi_c = l0[None] * self.f_lo[i0:i1, None], h0[None] * self.f_hi[i0:i1, None]
            init = 0
            if i0 == 0:  # the min-max incumbent rides in the first block's qparams
                init = 2 if self.first_is_incumbent else 1
                if init == 1:
                    lo_c = torch.cat((self.incumbent[0][a:b][None], lo_c))
                    hi_c = torch.cat((self.incumbent[1][a:b][None], hi_c))
            g = -1 if gstop is None else gstop - i0
            live = self.state.step(i0, *self._qparams(lo_c, hi_c), units=slice(a, b),
                                   init=init, use_global=self.use_global, gstop=g,
                                   any_out=None if flags is None else flags[i0:i1], **self.rule)
            if self.early_stop and gstop is not None and gstop <= i1 and live == 0:
                break  # every unit stopped, and the global rule too

    def _extension(self, a, b):
        """Units ``a:b`` still improving go on along the extension's factors."""
        start = 0
        l0, h0 = self.lo[a:b], self.hi[a:b]
        while start < len(self.ext):
            sub, l1, h1 = None, l0, h0
            if self.early_stop:  # only the units still searching: fewer qparams to compute
                keep = (~self.state.stopped[a:b]).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                if keep.numel() < b - a:
                    sub, l1, h1 = keep, l0[keep], h0[keep]
            k = max(1, self.budget // l1.shape[0])
            f = self.f_lo[self.total + start:self.total + start + k, None]
            self.state.step(self.total + start, *self._qparams(l1[None] * f, h1[None] * f),
                            units=slice(a, b), sub=sub, use_global=False,
                            **self.rule)  # the global rule's grid has ended
            start += k

    def _pass(self, gstop, flags):
        for a, b in self.chunks:
            self._grid(a, b, gstop, flags)
            self._extension(a, b)

    def run(self):
        """``(lo, hi, error, index)`` per unit, as ``mse_tiles.search`` returns them."""
        if self.use_global and (len(self.chunks) > 1 or self.kb < self.total):
            flags = torch.zeros(self.total, dtype=torch.uint8)
            self._pass(1 << 62, flags)  # assuming the global rule does not stop within the grid
            g = self.state.global_stop(flags, self.rule["patience"])
            if g < self.total:  # it did, before candidate g: again, knowing it
                self._pass(g, None)
        else:
            self._pass(None, None)
        idx = self.state.idx.clone()
        j, take = idx.clamp(min=0), idx >= 0  # the chosen candidates' ranges, built as before
        return (torch.where(take, self.lo * self.f_lo[j], self.incumbent[0]),
                torch.where(take, self.hi * self.f_hi[j], self.incumbent[1]),
                self.state.best, idx)


def search(units, lo, hi, spec, f_lo, f_hi, **kw):
    """``mse_tiles.search`` (same arguments, same choices) through the kernel."""
    return _Search(units, lo, hi, spec, f_lo, f_hi, **kw).run()
