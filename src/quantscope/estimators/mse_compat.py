"""llm-compressor's exact MSE search (``compat="llmcompressor"``) with the C kernel pricing.

The torch path (:mod:`.mse_tiles`) scores a candidate by torch's float32
``T = sum(|fake_quant(x) - x| ** norm)`` and applies llm-compressor's rules to those
values: per unit a running minimum (tie ``"first"``: ``<``, ``"last"``: ``<=``) from
``float32 max`` (the first candidate always wins), and the global patience (stop after
``patience`` candidates that improved no unit). This engine returns the same choices, bit
for bit, faster (int4 4096 x 4096 per channel, one thread: 0.26 s, the torch path 1.08 s,
llm-compressor 6.5 s; docs/benchmarks.md):

1. **Price.** The C kernel (``csrc/mse_pnorm.c``) computes ``K[c, u]``: the same float32
   ``d`` as torch, ``|d| ** norm`` by a polynomial approximation, summed in float64.
2. **Bound.** ``T`` lies in ``[L, H] = [K (1 - tol) - a, K (1 + tol) + a]``
   (:func:`tolerance`): torch's float32 sum of ``n`` positive terms, in whatever order
   its reduction adds them, is within ``gamma_(n-1) = (n-1) u / (1 - (n-1) u)``
   (``u = 2^-24``) of the exact sum of its terms; each term is within ``rho`` of
   ``|d| ** norm`` (relative, normal results: ``rho`` below is at least 4x the worst
   error of torch's float32 ``pow`` over every positive float32 input, scanned
   exhaustively; ``norm`` 2 and 3 are one and two roundings) or ``2^-140``
   (absolute, subnormal results); the kernel's terms are within ``kappa = 2^-18 (1 +
   norm)`` (tested) and its float64 sum within ``gamma64_n``. Composing the four bounds
   gives ``tol`` and ``a``.
3. **Decide.** A comparison whose intervals do not overlap is certain. Where they
   overlap (near ties), torch's exact ``T`` of the pairs involved is computed with the
   torch path's own ``_tile_error`` on gathered rows, and the decision is made on those.
   The global rule needs, per candidate, whether any unit improved: certain as soon as
   one unit improved for certain, or every unit for certain did not. Each unit's choice
   is then the first (``"last"``: last) minimum over the candidates before the stop,
   among those whose ``L`` is at most the lowest ``H``.

Exactness of the recomputed ``T``: elementwise ops round alike in any tile; a row's sum
is reduced by one thread in one order whatever the other rows (rows under 32768
elements: TensorIterator splits a multi-row reduction over rows, and reduces a single
row of fewer than its grain serially). ``pow`` is the exception: torch's vectorized
``pow`` (Sleef) and its scalar tail (``std::pow`` in double) round differently, so for
norms other than 1, 2, 3 the engine applies only where every element of the torch
path's tiles, and of its own, goes through the vector loop (rows a multiple of 64
elements, each thread's share of a tile a multiple of 64: :func:`_vector_only`).

The kernel has AVX-512, AVX2 + FMA and scalar branches (tests run all three); the scalar
one is slower than torch, so it runs only under ``backend="kernel"``. Where the engine does
not apply (other formats, devices, norms, sizes) or an error is not finite, the torch path
runs. ``SearchResult.error`` (torch's ``T`` of the chosen
candidates) is computed on first access.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import version_of
from ..formats import IntFormat
from . import mse_tiles

__all__ = ["RHO", "STATS", "applies", "engine", "price", "scanned", "search",
           "tolerance"]

#: per-term relative error allowed for torch's float32 ``|d| ** norm`` (normal results).
#: 2.4 and 1.5: exhaustive scans (bench/scan_torch_pow.py) of torch 2.13's pow over all
#: positive float32, CPU capabilities AVX512 and AVX2 alike, gave 2^-18.1 and 2^-24.0;
#: 2 and 3 are ``d * d`` and ``d * d * d`` (one and two roundings); 1 copies.
RHO = {1.0: 0.0, 1.5: 2.0 ** -16, 2.0: 2.0 ** -24, 2.4: 2.0 ** -16, 3.0: 2.0 ** -22}
#: norms whose torch pow is exact arithmetic, the same in its vector loop and scalar tail
_TILE_FREE = (1.0, 2.0, 3.0)
#: where the scans of the other norms ran: torch version prefix, CPU capabilities
_SCANNED = ("2.13.", ("AVX512", "AVX2"))
_ALPHA = 2.0 ** -140  # absolute error per term (subnormal results), either side
_GRAIN = 32768  # torch's parallel grain (at::internal::GRAIN_SIZE)
_SAFE = 2.0 ** 100  # larger (or non-finite) kernel errors: the torch path
_FLT_MAX = float(torch.finfo(torch.float32).max)
#: the last search's (candidate, unit) pairs and how many of them torch recomputed (the tests
#: read it to know the engine ran, not its torch fallback)
STATS = {"pairs": 0, "recomputed": 0, "units": 0, "units_recomputed": 0}


def tolerance(n: int, norm: float) -> tuple[float, float]:
    """``(tol, a)``: torch's float32 error of a unit of ``n`` elements lies within
    ``K (1 +- tol) +- a`` of the kernel's ``K`` (module doc, step 2)."""
    g32 = (n - 1) * 2.0 ** -24 / (1 - (n - 1) * 2.0 ** -24)
    g64 = n * 2.0 ** -53 / (1 - n * 2.0 ** -53)
    kappa = 2.0 ** -18 * (1 + norm)
    rel = (1 + g32) * (1 + RHO[float(norm)]) / ((1 - kappa) * (1 - g64)) - 1
    return rel * 1.001 + 2.0 ** -40, 4 * n * _ALPHA  # >= the lower side's, float64 slack


def _vector_only(numel: int) -> bool:
    """Whether torch's elementwise loop over a contiguous ``numel`` (a multiple of 64)
    sends every element through its vector body: each thread's share (at::parallel_for:
    ``ceil(numel / t)``, ``t = min(threads, ceil(numel / grain))``) a multiple of 64."""
    if numel < _GRAIN or kernels.threads() == 1:
        return True
    t = min(kernels.threads(), -(-numel // _GRAIN))
    return -(-numel // t) % 64 == 0


def scanned() -> bool:
    """Whether the bounds of the norms whose torch ``pow`` is not exact arithmetic (``RHO``
    past ``_TILE_FREE``) were measured on this torch and CPU (``_SCANNED``)."""
    return (torch.__version__.startswith(_SCANNED[0])
            and torch.backends.cpu.get_cpu_capability() in _SCANNED[1])


def applies(units, spec, norm, total, chunk_elems, chunk_candidates) -> bool:
    """Whether this engine reproduces the torch path here (module doc)."""
    if not (isinstance(spec.format, IntFormat) and spec.scale.kind == "fp32"
            and units.device.type == "cpu" and units.dtype == torch.float32
            and not units.requires_grad and float(norm) in RHO and kernels.real(units)):
        return False
    n_units, n_elems = units.shape
    if n_units == 0 or not 0 < n_elems < _GRAIN or n_elems > chunk_elems:
        return False
    if float(norm) in _TILE_FREE:
        return True
    if not scanned():
        return False  # RHO is a measured bound: only where it was measured
    return n_elems % 64 == 0 and all(map(_vector_only, mse_tiles.tile_numels(
        n_units, n_elems, total, chunk_elems, chunk_candidates)))


def engine(units, spec, kw, total, backend):
    """:func:`search` where it applies under ``backend`` (else None: the torch path)."""
    ok = applies(units, spec, kw["norm"], total, kw["chunk_elems"], kw["chunk_candidates"])
    lib = kernels.choose(backend, "mse_pnorm", "mse_search", ok)
    if lib is None or (backend is None and lib.qs_pnorm_lanes() == 0):
        return None  # a build without SIMD is slower than torch: only when asked for
    return search


def price(units, scale, zp, spec, norm) -> torch.Tensor:
    """The kernel's ``K [C, U]`` (float64) of candidates ``scale, zp [C, U]`` on float32
    ``units [U, E]``."""
    c, n = scale.shape
    units, sc, zi = units.contiguous(), scale.contiguous(), zp.to(torch.int32).contiguous()
    out = torch.empty((c, n), dtype=torch.float64)
    kernels.lib("mse_pnorm").qs_pnorm_price(
        units.data_ptr(), units.shape[1], n, sc.data_ptr(), zi.data_ptr(), c,
        float(spec.qmin), float(spec.qmax), float(norm), out.data_ptr(), kernels.threads())
    return out


class _Bounds:
    """``T``'s interval ``[L, H]`` per ``(candidate, unit)``, narrowed to ``T`` where it
    was computed in torch."""

    def __init__(self, units, scale, zp, spec, norm, chunk_elems):
        self.units, self.scale, self.zp, self.spec, self.norm = units, scale, zp, spec, norm
        k = price(units, scale, zp, spec, norm)
        self.ok = bool(torch.isfinite(k).all()) and float(k.max()) < _SAFE
        tol, a = tolerance(units.shape[1], norm)
        self.lo = (k * (1 - tol) - a).clamp_(min=0)
        self.hi = k.mul_(1 + tol).add_(a)
        self.known = torch.zeros(k.shape, dtype=torch.bool)
        self.rows = max(1, chunk_elems // units.shape[1])  # rows per torch tile
        while self.rows > 1 and norm not in _TILE_FREE and \
                not _vector_only(self.rows * units.shape[1]):
            self.rows -= 1

    def exact(self, cs, us):
        """torch's float32 ``T`` of pairs ``(cs[i], us[i])``, as the torch path computes it:
        its ``_tile_error`` on tiles of gathered rows (at most ``chunk_elems`` elements,
        and for norms 1.5 / 2.4 each thread's share of a tile through the vector loop)."""
        out = torch.empty(cs.numel(), dtype=torch.float32)
        for a in range(0, cs.numel(), self.rows):
            c, u = cs[a:a + self.rows], us[a:a + self.rows]
            out[a:a + self.rows] = mse_tiles._tile_error(
                self.units[u], self.scale[c, u][None], self.zp[c, u][None], self.spec,
                self.norm, True)[0]
        return out

    def refine(self, mask):
        """Narrow the pairs of ``mask [C, U]`` (not yet known) to torch's ``T``."""
        cs, us = (mask & ~self.known).nonzero(as_tuple=True)
        if cs.numel():
            t = self.exact(cs, us).double()
            self.lo[cs, us], self.hi[cs, us] = t, t
            self.known[cs, us] = True

    def better(self, tie):
        """``(yes, no, floor)`` ``[C, U]``: candidate ``c`` improves unit ``u``'s running
        minimum for certain / for certain not; ``floor``: the lowest ``H`` before ``c``."""
        top = torch.full_like(self.lo[:1], _FLT_MAX)  # the search's initial best
        floor_lo = torch.cat((top, self.lo.cummin(0).values[:-1]))
        floor_hi = torch.cat((top, self.hi.cummin(0).values[:-1]))
        if tie == "last":
            return self.hi <= floor_lo, self.lo > floor_hi, floor_hi
        return self.hi < floor_lo, self.lo >= floor_hi, floor_hi


def _stop(b, tie, patience, total):
    """The global rule's stop: candidates ``>= G`` see it stopped (``G = total``: never).
    A candidate that might or might not improve some unit (and improves none for certain)
    is settled by torch's ``T`` of those units' candidates up to it that could be their
    running minimum; that makes each of their comparisons at it certain."""
    if patience is None:
        return total
    c, stale = 0, 0
    yes, no, floor = b.better(tie)
    some, none = yes.any(1).tolist(), no.all(1).tolist()
    while c < total:
        if some[c]:
            stale = 0
        elif none[c]:
            stale += 1
            if stale >= patience:
                return c + 1
        else:  # settle it: then each unit's comparison at c is certain
            unsure = ~(yes[c] | no[c])
            near = (b.lo[:c] <= floor[c]) & unsure
            rest = torch.zeros_like(b.lo[c + 1:], dtype=torch.bool)
            b.refine(torch.cat((near, unsure[None], rest)))
            yes, no, floor = b.better(tie)
            some, none = yes.any(1).tolist(), no.all(1).tolist()
            if not (some[c] or none[c]):  # cannot happen (module doc): never loop on it
                raise RuntimeError("mse_compat: recomputed pairs left a candidate unsettled")
            continue
        c += 1
    return total


def _winners(b, tie, stop):
    """Each unit's first (``"last"``: last) minimum over candidates ``< stop``: among those
    whose ``L`` is at most the lowest ``H`` (the others are above the minimum for
    certain), from torch's ``T`` where there are several."""
    lo, hi = b.lo[:stop], b.hi[:stop]
    near = lo <= hi.min(0).values
    many = near.sum(0) > 1
    if bool(many.any()):
        pad = torch.zeros_like(b.lo[stop:], dtype=torch.bool)
        b.refine(torch.cat((near & many, pad)))
        lo = b.lo[:stop]
    v = torch.where(near, lo, torch.inf)
    if tie == "last":
        return stop - 1 - v.flip(0).argmin(0)
    return v.argmin(0)


def search(units, lo, hi, spec, f_lo, f_hi, *, norm, patience, per_unit, tie, exact,
           incumbent, global_amax, chunk_elems, chunk_candidates, early_stop, extend=(), **_):
    """:func:`mse_tiles.search` for the compat search (``exact``, global patience, no
    incumbent), priced by the kernel; the torch path itself where a kernel error is not
    finite. Returns ``(lo, hi, error, index)``; ``error`` a callable (lazy). Its terms are
    torch's float32 ``|d| ** norm`` (``exact``): the other engines' ``float32_squares`` is
    no option here (``**_``)."""
    assert exact and incumbent is None and not per_unit and not extend and global_amax is None
    total, factors = len(f_lo), (f_lo, f_hi)
    f_lo = torch.tensor(f_lo, dtype=torch.float32)
    f_hi = torch.tensor(f_hi, dtype=torch.float32)
    lo_c, hi_c = lo[None] * f_lo[:, None], hi[None] * f_hi[:, None]
    qp = mse_tiles.candidate_qparams(lo_c, hi_c, spec, None)
    b = _Bounds(units.contiguous(), qp.effective_scale.expand_as(lo_c),
                qp.zero_point.float().expand_as(lo_c), spec, norm, chunk_elems)
    if not b.ok:
        return mse_tiles.search(
            units, lo, hi, spec, *factors, norm=norm, patience=patience,
            per_unit=per_unit, tie=tie, exact=exact, incumbent=incumbent,
            global_amax=global_amax, chunk_elems=chunk_elems,
            chunk_candidates=chunk_candidates, early_stop=early_stop)
    idx = _winners(b, tie, _stop(b, tie, patience, total))
    STATS.update(pairs=b.known.numel(), recomputed=int(b.known.sum()), units=units.shape[0],
                 units_recomputed=int(b.known.any(0).sum()))
    # an inference tensor (torch.inference_mode) keeps no version counter: no guard there
    version = version_of(units)

    def error():  # torch's T of the chosen candidates, on first access (one torch pass)
        if version is not None and units._version != version:
            raise RuntimeError("mse_search: the units changed in place since the search; "
                               "its error (computed on first access) is gone")
        return b.exact(idx, torch.arange(units.shape[0]))

    return lo * f_lo[idx], hi * f_hi[idx], error, idx
