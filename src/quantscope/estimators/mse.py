"""Range choice by error search: the MSE grid searches, vectorized over units.

A search tries candidate ranges ``(lo * f_lo, hi * f_hi)`` for a list of
factors, scores each by the quantization error of the quantizer it defines, and
keeps the best per unit. Every candidate goes through
:func:`~quantscope.qparams.qparams_from_range` (the one place scales are
computed), so an encoded scale (E8M0, fp8 under NVFP4's global scale, power of
two, fp16) is scored as it will run, not as a float32 idealisation.

Work is tiled ``[candidates, units, elements]``: each tile is one batched tensor
expression, tiles are bounded by ``chunk_elems`` elements (peak extra memory a
few tiles, within 2x the input for large inputs), and the only Python loops run
over tiles and over the candidates of a chunk on ``[U]`` vectors, never over
units, groups or blocks.

For integer formats on CPU (squared error, not ``compat``) a C kernel
(:mod:`.mse_kernel`) does the pricing and the rules below unit by unit instead, summing
the exact fake-quant error in float64; only the candidates' qparams (from
``qparams_from_range``) are computed in torch. ``backend="torch"`` forces the tiles.

Selection rules (all evaluated on ``[U]`` vectors, candidate by candidate):

* ``per_unit_patience=True`` (native): a unit stops after ``patience``
  consecutive candidates that did not improve it; candidates whose encoded
  qparams equal the previous candidate's do not count (an E8M0 or fp8 scale is
  flat over many factors, and a plateau is not evidence the search is done).
* ``per_unit_patience=False`` (llm-compressor): the search stops after
  ``patience`` consecutive candidates that improved no unit at all.
* ``tie="first"`` keeps the earliest best (strict ``<``); ``"last"`` the latest (``<=``, Horizon).

Native searches start from the min-max range (``f = 1``) as the incumbent, so
their error never exceeds min-max's.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_int, check_number
from ..formats import IntFormat
from ..qparams import amax_of_range, qparams_from_range
from ..quantize import fake_quantize_units
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from . import mse_kernel

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "SearchResult",
    "dense_search",
    "linear_search",
    "mse_search",
    "pow2_search",
    "range_error",
    "shrink_factors",
]

#: elements of one [candidates, units, elements] tile: ~4 MB per temporary, cache-friendly
DEFAULT_CHUNK_ELEMS = 1 << 20
_MIN_CHUNK_ELEMS = 1 << 16
#: the kernel path's [candidates, units] qparams blocks: at most this many elements, below
#: torch's parallel grain (32768), so their torch ops run on one thread: with two, every op
#: waits at OpenMP's barrier for a descheduled worker on a loaded machine (measured: 10x
#: slower on the MiniLM weights at load 4). Chunks of at least this many units:
_KERNEL_BLOCK = 32767
_MIN_KERNEL_UNITS = 256
BACKENDS = (None, "torch", "kernel")


class SearchResult(tuple):
    """``(lo, hi)`` of the chosen ranges, with the search's by-products as attributes.

    ``error`` is each unit's error at its chosen range (the search's own measure);
    ``global_amax`` the NVFP4 global amax the ranges were chosen under (None
    otherwise); ``index`` the chosen candidate per unit.
    """

    def __new__(cls, lo, hi, error=None, global_amax=None, index=None):
        self = super().__new__(cls, (lo, hi))
        self.lo, self.hi, self.error, self.global_amax, self.index = (
            lo, hi, error, global_amax, index)
        return self


#: the most candidates one search tries (llm-compressor's grid has 20, the expanded NVFP4
#: grid 111): a bound so that a mistyped grid is an error rather than an hour-long search
MAX_CANDIDATES = 10_000
#: pow2_search's widest span: factors ``2 ** +-span`` stay far inside float32
MAX_SPAN = 32


def shrink_factors(maxshrink: float = 0.2, grid: float = 100, expand: float = 1.0) -> list[float]:
    """llm-compressor's candidates ``p = 1 - i / grid`` for ``i < int(maxshrink * grid)``.

    The range searched is ``(lo * expand) * p``; ``expand`` is applied to the base range.
    """
    grid = check_number("mse_search", "grid", grid, 0, lo_open=True)
    maxshrink = check_number("mse_search", "maxshrink", maxshrink, 0, 1, lo_open=True)
    check_number("mse_search", "expand", expand, 0, lo_open=True)
    steps = int(maxshrink * grid)
    if not 1 <= steps <= MAX_CANDIDATES:
        raise ValueError(f"mse_search: maxshrink * grid = {maxshrink * grid} gives {steps} "
                         f"candidates; need 1 to {MAX_CANDIDATES}")
    return [1 - i / grid for i in range(steps)]


# ----------------------------------------------------------------------------- error kernels
def _norm_sum(d: torch.Tensor, norm: float) -> torch.Tensor:
    """``sum(|d| ** norm)`` over the last dim (one pass, no temporary)."""
    return torch.linalg.vector_norm(d, ord=norm, dim=-1).pow_(norm)


def _tile_error(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec,
                norm: float, exact: bool) -> torch.Tensor:
    """Error of ``x [Ut, E]`` under ``scale``, ``zp`` ``[Cc, Ut]`` (effective scale): ``[Cc, Ut]``.

    ``exact``: llm-compressor's arithmetic, ``sum(|fake_quant(x) - x| ** norm)``.
    Otherwise, integer formats with ``norm=2`` compute the C kernel's error
    (:mod:`.mse_kernel`): float32 squares summed in float64, so that both paths choose the
    same candidates (a float32 sum breaks near ties differently: issue 20 #11); other norms
    use the rounding identity ``fake_quant(x) - x = (clamp(round(t)) - t) * scale`` with
    ``t = x / scale + zp``, which scores the same quantizer with fewer passes over the tile.
    """
    s3, z3 = scale.unsqueeze(-1), zp.unsqueeze(-1)
    if not exact and norm == 2 and isinstance(spec.format, IntFormat):
        d = fake_quantize_units(x, s3, z3, spec).sub_(x)
        return d.square_().sum(-1, dtype=torch.float64)
    if exact or not isinstance(spec.format, IntFormat):
        d = fake_quantize_units(x, s3, z3, spec).sub_(x)
        if exact:
            return d.abs_().pow_(norm).sum(-1)
        return _norm_sum(d, norm)
    t = x / s3
    if not (spec.symmetric and spec.format.signed):
        t.add_(z3)
    d = torch.round(t).clamp_(spec.qmin, spec.qmax).sub_(t)
    del t
    return _norm_sum(d, norm) * scale.abs().pow(norm)


def _errors(units, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems):
    """Errors ``[Cc, U]`` of candidate ranges ``lo_c, hi_c [Cc, U]``, tiled; also the qparams."""
    # candidates derive from the observer's checked min / max: no device read-back per chunk
    qp = qparams_from_range(lo_c, hi_c, spec, global_amax=global_amax, check_finite=False)
    scale = qp.effective_scale.expand_as(lo_c)
    zp = qp.zero_point.float()
    cc = lo_c.shape[0]
    n_units, n_elems = units.shape
    if n_elems <= chunk_elems:  # tiles of whole units: [candidates, units, E]
        cstep = max(1, min(cc, chunk_elems // n_elems))
        ustep = max(1, chunk_elems // (n_elems * cstep))
        if cstep >= cc and ustep >= n_units:
            err = _tile_error(units, scale, zp, spec, norm, exact)
        else:
            err = torch.cat([torch.cat([
                _tile_error(units[a:a + ustep], scale[c:c + cstep, a:a + ustep],
                            zp[c:c + cstep, a:a + ustep], spec, norm, exact)
                for a in range(0, n_units, ustep)], dim=1) for c in range(0, cc, cstep)])
    else:  # units larger than a tile (per-tensor): element slices, partial sums added
        err = scale.new_zeros(cc, n_units, dtype=torch.float64 if norm == 2 else scale.dtype)
        for u in range(n_units):
            for c in range(cc):
                for a in range(0, n_elems, chunk_elems):
                    err[c:c + 1, u:u + 1] += _tile_error(
                        units[u:u + 1, a:a + chunk_elems], scale[c:c + 1, u:u + 1],
                        zp[c:c + 1, u:u + 1], spec, norm, exact)
    return err, qp.scale.expand_as(lo_c), zp


# ----------------------------------------------------------------------------- the search
def _check(units, lo, hi, spec, norm):
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"mse_search: spec must be a QuantSpec, got {type(spec).__name__}")
    if not isinstance(units, torch.Tensor) or units.dim() != 2:
        raise ValueError(f"mse_search: units must be a 2-D [units, elements] tensor, got "
                         f"{getattr(units, 'shape', type(units).__name__)}")
    if not (isinstance(norm, (int, float)) and norm > 0):
        raise ValueError(f"mse_search: norm must be a positive number, got {norm!r}")
    units = units.float()
    if lo is None or hi is None:
        lo, hi = unit_minmax(units)
    lo = torch.as_tensor(lo, dtype=torch.float32, device=units.device).reshape(-1)
    hi = torch.as_tensor(hi, dtype=torch.float32, device=units.device).reshape(-1)
    if lo.numel() != units.shape[0] or hi.numel() != units.shape[0]:
        raise ValueError(f"mse_search: lo and hi need one value per unit ({units.shape[0]}), "
                         f"got {lo.numel()} and {hi.numel()}")
    return units, lo, hi


def _default_global_amax(lo, hi, spec, global_amax):
    if not spec.scale.has_global_scale:
        return None
    if global_amax is None:
        return amax_of_range(lo, hi).max().clamp(min=0).reshape(())
    return torch.as_tensor(global_amax, dtype=torch.float32, device=lo.device).reshape(())


class _State:
    """Per-unit search state; :meth:`step` applies one candidate to all units or a subset."""

    def __init__(self, best_lo, best_hi, best_err, prev):
        dev, n = best_lo.device, best_lo.shape[0]
        self.lo, self.hi, self.err = best_lo, best_hi, best_err
        self.idx = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.stale = torch.zeros(n, dtype=torch.int64, device=dev)
        self.stopped = torch.zeros(n, dtype=torch.bool, device=dev)  # the unit's own rule
        self.g_stale = torch.zeros((), dtype=torch.int64, device=dev)
        self.g_stopped = torch.zeros((), dtype=torch.bool, device=dev)  # the global rule
        self.prev = prev  # qparams of the previous candidate (plateau detection)

    def step(self, i, e, lo, hi, sc, zp, *, patience, per_unit, tie, use_global, sub=None):
        """Candidate ``i`` with errors ``e`` (of units ``sub``, all if None)."""
        def get(t):
            return t if sub is None else t[sub]

        def put(name, value):
            if sub is None:
                setattr(self, name, value)
            else:
                getattr(self, name)[sub] = value

        best_err, stale, stopped = get(self.err), get(self.stale), get(self.stopped)
        if patience is None:
            active = torch.ones_like(stopped)
        elif per_unit and use_global:  # a unit stops when it AND the global rule have stopped
            active = ~(stopped & self.g_stopped)
        elif per_unit:
            active = ~stopped
        else:
            active = ~self.g_stopped.expand_as(stopped)
        better = active & ((e <= best_err) if tie == "last" else (e < best_err))
        put("err", torch.where(better, e, best_err))
        put("idx", torch.where(better, i, get(self.idx)))
        put("lo", torch.where(better, lo, get(self.lo)))
        put("hi", torch.where(better, hi, get(self.hi)))
        if patience is None:
            return
        if per_unit:
            counts = active & ~better
            if self.prev is not None:  # a plateau of equal encoded qparams is not evidence
                p_sc, p_zp = get(self.prev[0]), get(self.prev[1])
                counts &= (sc != p_sc) | (zp != p_zp)
            stale = torch.where(better, 0, stale + counts.long())
            put("stale", stale)
            put("stopped", stopped | (stale >= patience))
            if self.prev is None:
                self.prev = (sc.clone(), zp.clone()) if sub is None else None
            elif sub is None:
                self.prev = (sc, zp)
            else:
                self.prev[0][sub], self.prev[1][sub] = sc, zp
        if use_global:
            self.g_stale = torch.where(better.any(), 0, self.g_stale + (~self.g_stopped).long())
            self.g_stopped |= self.g_stale >= patience

    def done(self, per_unit, use_global):
        if per_unit and use_global:
            return self.g_stopped & self.stopped.all()
        return self.stopped.all() if per_unit else self.g_stopped


def _search(units, lo, hi, spec, f_lo, f_hi, *, norm, patience, per_unit, tie, exact,
            incumbent, global_amax, chunk_elems, chunk_candidates, early_stop, extend=()):
    """Core: pick, per unit, the best of candidates ``(lo * f_lo[i], hi * f_hi[i])``.

    ``incumbent``: a ``(lo, hi)`` scored first as the best so far (index -1).
    ``extend``: further factors tried, after the grid, by the units still improving
    (per-unit patience only; on CPU only those units are computed).
    """
    dev = units.device
    n_units = units.shape[0]
    total = len(f_lo)
    f_lo = torch.tensor(f_lo, dtype=torch.float32, device=dev)
    f_hi = torch.tensor(f_hi, dtype=torch.float32, device=dev)
    if incumbent is not None:  # the min-max range: native searches never do worse than it
        best_lo, best_hi = incumbent[0].clone(), incumbent[1].clone()
        err, sc, zp = _errors(units, best_lo[None], best_hi[None], spec, norm, exact,
                              global_amax, chunk_elems)
        st = _State(best_lo, best_hi, err[0], (sc[0].clone(), zp[0].clone()))
    else:  # llm-compressor: the first candidate always wins
        st = _State(lo * f_lo[0], hi * f_hi[0],
                    torch.full((n_units,), torch.finfo(torch.float32).max, device=dev), None)
    # native per-unit patience never stops a unit before llm-compressor's global rule would
    use_global = patience is not None and (not per_unit or not exact)
    rule = {"patience": patience, "per_unit": per_unit, "tie": tie, "use_global": use_global}
    cc = chunk_candidates or max(1, min(total, 32 if total <= 32 else 16))
    for start in range(0, total, cc):
        fl, fh = f_lo[start:start + cc], f_hi[start:start + cc]
        lo_c, hi_c = lo[None] * fl[:, None], hi[None] * fh[:, None]
        err, sc, zp = _errors(units, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems)
        for j in range(lo_c.shape[0]):
            st.step(start + j, err[j], lo_c[j], hi_c[j], sc[j], zp[j], **rule)
        # one host sync per chunk, on CPU only
        if early_stop and patience is not None and start + cc < total and \
                bool(st.done(per_unit, use_global)):
            break
    if extend and per_unit and patience is not None:
        ext = torch.tensor(extend, dtype=torch.float32, device=dev)
        rule["use_global"] = False  # the global rule's grid has ended
        for start in range(0, len(extend), cc):
            sub = None
            if early_stop:
                keep = (~st.stopped).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                if keep.numel() * 2 <= n_units:  # gather only a minority (bounded copy)
                    sub = keep
            f = ext[start:start + cc, None]
            x, l0, h0 = (units, lo, hi) if sub is None else (units[sub], lo[sub], hi[sub])
            lo_c, hi_c = l0[None] * f, h0[None] * f
            err, sc, zp = _errors(x, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems)
            for j in range(lo_c.shape[0]):
                st.step(total + start + j, err[j], lo_c[j], hi_c[j], sc[j], zp[j], sub=sub,
                        **rule)
    return st.lo, st.hi, st.err.float(), st.idx  # float32, as the kernel's


def _search_kernel(units, lo, hi, spec, f_lo, f_hi, *, patience, per_unit, tie, incumbent,
                   global_amax, chunk_elems, early_stop, extend=(), **_):
    """:func:`_search` with the C kernel (:mod:`.mse_kernel`) pricing candidates and
    applying the same rules unit by unit (errors summed in float64).

    Candidates' qparams are computed in ``[candidates, units]`` blocks of at most
    ``_KERNEL_BLOCK`` (and ``chunk_elems``) elements: the whole grid at once for chunks
    of units, so each unit's data is read once for the grid and once for its extension.
    The global rule couples all units; over several chunks it is first assumed not to
    stop within the grid (the usual case with many units), and if it did, the search is
    redone knowing where.
    """
    def qparams(lo_c, hi_c):
        qp = qparams_from_range(lo_c, hi_c, spec, global_amax=global_amax, check_finite=False)
        return qp.effective_scale.expand_as(lo_c), qp.zero_point

    n_units = units.shape[0]
    st = mse_kernel.KernelState(units, spec)
    total = len(f_lo)
    ext = list(extend) if extend and per_unit and patience is not None else []
    first_is_incumbent = (incumbent[0] is lo and incumbent[1] is hi and f_lo[0] == 1.0
                          and f_hi[0] == 1.0)  # then lo * 1.0 is the incumbent's row
    f_lo = torch.tensor(list(f_lo) + ext, dtype=torch.float32)
    f_hi = torch.tensor(list(f_hi) + ext, dtype=torch.float32)
    use_global = patience is not None
    rule = {"patience": patience, "per_unit": per_unit, "tie": tie}
    budget = max(1, min(chunk_elems, _KERNEL_BLOCK))
    ub = min(n_units, max(_MIN_KERNEL_UNITS, budget // (total + 1)))  # units per chunk
    kb = min(total, max(1, budget // ub))  # candidates per block
    chunks = [(a, min(a + ub, n_units)) for a in range(0, n_units, ub)]
    speculate = use_global and (len(chunks) > 1 or kb < total)

    def run(gstop, flags):
        for a, b in chunks:
            rows = slice(a, b)
            l0, h0 = lo[a:b], hi[a:b]
            live = b - a
            for i0 in range(0, total, kb):
                i1 = min(i0 + kb, total)  # f_lo, f_hi go on with the extension
                lo_c, hi_c = l0[None] * f_lo[i0:i1, None], h0[None] * f_hi[i0:i1, None]
                init = 0
                if i0 == 0:  # the min-max incumbent rides in the first block's qparams
                    init = 2 if first_is_incumbent else 1
                    if init == 1:
                        lo_c = torch.cat((incumbent[0][a:b][None], lo_c))
                        hi_c = torch.cat((incumbent[1][a:b][None], hi_c))
                g = -1 if gstop is None else gstop - i0
                live = st.step(i0, *qparams(lo_c, hi_c), units=rows, init=init,
                               use_global=use_global, gstop=g,
                               any_out=None if flags is None else flags[i0:i1], **rule)
                if early_stop and gstop is not None and gstop <= i1 and live == 0:
                    break  # every unit stopped, and the global rule too
            start = 0
            while ext and start < len(ext):
                sub, l1, h1 = None, l0, h0
                if early_stop:  # only the units still searching: fewer qparams to compute
                    keep = (~st.stopped[a:b]).nonzero().squeeze(1)
                    if keep.numel() == 0:
                        break
                    if keep.numel() < b - a:
                        sub, l1, h1 = keep, l0[keep], h0[keep]
                k = max(1, budget // l1.shape[0])
                f = f_lo[total + start:total + start + k, None]
                lo_c, hi_c = l1[None] * f, h1[None] * f
                st.step(total + start, *qparams(lo_c, hi_c), units=rows, sub=sub,
                        use_global=False, **rule)  # the global rule's grid has ended
                start += k

    if speculate:
        flags = torch.zeros(total, dtype=torch.uint8)
        run(1 << 62, flags)  # assuming the global rule does not stop within the grid
        g = st.global_stop(flags, patience)
        if g < total:  # it did, before candidate g: again, knowing it
            run(g, None)
    else:
        run(None, None)
    idx = st.idx.clone()
    j, take = idx.clamp(min=0), idx >= 0  # the chosen candidates' ranges, built as before
    return (torch.where(take, lo * f_lo[j], incumbent[0]),
            torch.where(take, hi * f_hi[j], incumbent[1]), st.best.float(), idx)


def mse_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
               spec: QuantSpec, *, maxshrink: float = 0.2, grid: float = 100, norm: float = 2.0,
               patience: int | None = 5, expand: float = 1.0, per_unit_patience: bool = True,
               encoding_aware: bool = True, independent_ends: bool = False,
               ends_grid: int | None = None, global_amax: torch.Tensor | None = None,
               global_grid: int | None = None, factors: list[float] | None = None,
               tie: str = "first", compat: str | None = None,
               extend_to: float | None = 0.5, chunk_elems: int | None = None,
               chunk_candidates: int | None = None, early_stop: bool | None = None,
               backend: str | None = None) -> SearchResult:
    """Per-unit range minimizing ``sum(|fake_quant(x) - x| ** norm)`` over shrink candidates.

    Args:
        units: float ``[U, E]`` (a layout's units view); ``lo``, ``hi``: its per-unit
            min / max (None: computed).
        spec: the quantizer; candidates are scored as it runs.
        maxshrink, grid, expand: candidates ``(lo * expand) * p``, ``p = 1 - i / grid``,
            ``i < int(maxshrink * grid)`` (llm-compressor's grid); ``factors`` replaces it.
        norm: error exponent (2: MSE; llm-compressor's default is 2.4).
        patience: stop after this many non-improving candidates (None: try all).
        per_unit_patience: per-unit stopping (True) or llm-compressor's global rule.
        encoding_aware: score candidates with the spec's scale encoding (True) or with
            float32 scales (False: what llm-compressor does for NVFP4).
        independent_ends: asymmetric specs try every ``(f_lo, f_hi)`` pair of a small
            2-D grid (``ends_grid`` factors per end, default all of the 1-D grid).
        global_amax: NVFP4's whole-tensor amax (default: from ``lo``, ``hi``).
        global_grid: NVFP4: also try global amax ``* 2 ** (k / global_grid)`` for
            ``k < global_grid`` and keep the best total (default 4 native, 1 compat).
        tie: ``"first"`` or ``"last"`` best candidate.
        extend_to: with per-unit patience, units still improving at the end of the grid
            go on along it (``p = 1 - i / grid``) down to ``p = 1 - extend_to`` until they
            stop improving (None: the grid only). llm-compressor's 20-step grid ends at
            0.81x, short of the int4 optimum of Gaussian-like rows (about 0.75x).
        compat: ``"llmcompressor"``: their exact search (global patience, their error sum,
            no min-max incumbent, fp32 scales without the global scale for NVFP4).
        chunk_elems: elements per ``[candidates, units, elements]`` tile.
        early_stop: break once every unit stopped (default: on CPU; elsewhere the same
            answer is computed without a host sync).
        backend: None (default): the C kernel (:mod:`.mse_kernel`) where it applies
            (integer formats without a global scale, ``norm=2``, float32 CPU units, not
            ``compat``), else torch; ``"torch"`` forces the torch tiles; ``"kernel"``
            requires the kernel. The kernel scores ``sum((fake_quant(x) - x) ** 2)`` summed
            in float64; torch scores the same quantizer in float32 by a rounding identity.

    Returns:
        :class:`SearchResult` ``(lo, hi)`` with ``.error``, ``.global_amax``, ``.index``.
    """
    units, lo, hi = _check(units, lo, hi, spec, norm)
    if compat not in (None, "llmcompressor"):
        raise ValueError(f"mse_search: compat must be None or 'llmcompressor', got {compat!r}")
    if tie not in ("first", "last"):
        raise ValueError(f"mse_search: tie must be 'first' or 'last', got {tie!r}")
    if patience is not None and (not isinstance(patience, int) or patience < 1):
        raise ValueError(f"mse_search: patience must be a positive integer or None, "
                         f"got {patience!r}")
    if not (isinstance(expand, (int, float)) and expand >= 1.0):
        raise ValueError(f"mse_search: expand must be a number >= 1.0, got {expand!r}")
    if backend not in BACKENDS:
        raise ValueError(f"mse_search: backend must be one of {BACKENDS}, got {backend!r}")
    exact = compat == "llmcompressor"
    use_kernel = backend != "torch" and not exact and mse_kernel.usable(units, spec, norm)
    if backend == "kernel" and not use_kernel:
        raise ValueError("mse_search: backend='kernel' needs an integer format without a "
                         "global scale, norm=2, float32 CPU units, no compat, and a C compiler")
    if exact:
        per_unit_patience, encoding_aware, independent_ends = False, False, False
        extend_to = None
        if spec.scale.has_global_scale:  # they search NVFP4 without the fp8 rounding and global
            encoding_aware = False
    extend = []
    if factors is None:
        factors = shrink_factors(maxshrink, grid, expand)
        if extend_to is not None and per_unit_patience and patience is not None:
            if not (isinstance(extend_to, (int, float)) and 0 < extend_to < 1):
                raise ValueError(f"mse_search: extend_to must be in (0, 1) or None, "
                                 f"got {extend_to!r}")
            extend = [1 - i / grid for i in range(len(factors), int(extend_to * grid))]
    else:
        factors = [float(f) for f in factors]
        if not factors or min(factors) <= 0:
            raise ValueError(f"mse_search: factors must be positive numbers, got {factors!r}")
    if expand != 1.0:
        lo, hi = lo * expand, hi * expand  # llm-compressor's order: (lo * expand) * p
        base_lo, base_hi = lo / expand, hi / expand
    else:
        base_lo, base_hi = lo, hi
    search_spec = spec if encoding_aware else _blind(spec)
    if chunk_elems is None:
        chunk_elems = min(DEFAULT_CHUNK_ELEMS, max(units.numel() // 2, _MIN_CHUNK_ELEMS))
    if early_stop is None:
        early_stop = units.device.type == "cpu"
    if independent_ends and not spec.symmetric:
        ends = factors if ends_grid is None else factors[:: max(1, len(factors) // ends_grid)]
        f_lo = [a for a in ends for _ in ends]
        f_hi = [b for _ in ends for b in ends]
        patience_used = None  # a 2-D grid has no order to be patient along
        extend = []
    else:
        f_lo = f_hi = factors
        patience_used = patience
    ga0 = _default_global_amax(base_lo, base_hi, spec, global_amax)
    if spec.scale.has_global_scale and not encoding_aware:
        gas = [None]
    elif ga0 is not None:
        g = 4 if global_grid is None else int(global_grid)
        if g < 1:
            raise ValueError(f"mse_search: global_grid must be >= 1, got {global_grid!r}")
        gas = [ga0 * 2 ** (k / g) for k in range(g)]
    else:
        gas = [None]
    kw = {"norm": float(norm), "patience": patience_used, "per_unit": per_unit_patience, "tie": tie,
              "exact": exact, "chunk_elems": int(chunk_elems), "chunk_candidates": chunk_candidates,
              "early_stop": early_stop, "incumbent": None if exact else (base_lo, base_hi),
              "extend": extend}
    search = _search_kernel if use_kernel and not exact else _search
    results = [search(units, lo, hi, search_spec, f_lo, f_hi, global_amax=ga, **kw)
               for ga in gas]
    if len(results) == 1:
        blo, bhi, berr, bidx = results[0]
        ga = ga0 if gas[0] is None and not exact else gas[0]
        return SearchResult(blo, bhi, berr, ga, bidx)
    # pick the global scale with the lowest total error by indexing, not by a Python branch
    # on a tensor value (no device read-back); argmin keeps the first of equal totals
    k = torch.stack([r[2].sum() for r in results]).argmin().reshape(1)

    def pick(parts):
        return torch.stack(parts).index_select(0, k).squeeze(0)

    blo, bhi, berr, bidx = (pick(parts) for parts in zip(*results))
    ga = gas[0] if gas[0] is None else pick(
        [torch.as_tensor(g, dtype=torch.float32, device=units.device) for g in gas])
    if ga is None and not exact:
        ga = ga0  # a blind NVFP4 search still runs under the observed global amax
    return SearchResult(blo, bhi, berr, ga, bidx)


def _blind(spec: QuantSpec) -> QuantSpec:
    """The spec with float32 scales: what an encoding-blind search scores."""
    if spec.scale.kind == "fp32":
        return spec
    return spec.replace(scale="fp32")


# ----------------------------------------------------------------------------- the others
def range_error(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec,
                norm: float = 2, *, global_amax: torch.Tensor | None = None,
                chunk_elems: int | None = None) -> torch.Tensor:
    """Per-unit ``sum(|fake_quant(x) - x| ** norm)`` of the quantizer of ranges ``lo, hi``.

    The quantizer is exactly what ``qparams_from_range(lo, hi, spec, global_amax)``
    gives and ``fake_quantize_units`` runs (NVFP4: the global amax defaults to
    the largest of ``|lo|, |hi|``).
    """
    units, lo, hi = _check(units, lo, hi, spec, norm)
    if chunk_elems is None:
        chunk_elems = min(DEFAULT_CHUNK_ELEMS, max(units.numel() // 2, _MIN_CHUNK_ELEMS))
    qp = qparams_from_range(lo, hi, spec, global_amax=global_amax)
    scale = qp.effective_scale.expand_as(lo)[None]
    zp = qp.zero_point.float()[None]
    n_units, n_elems = units.shape
    err = lo.new_zeros(n_units)
    if n_elems <= chunk_elems:
        step = max(1, chunk_elems // n_elems)
        for a in range(0, n_units, step):
            x = units[a:a + step]
            d = fake_quantize_units(x, scale[0, a:a + step, None], zp[0, a:a + step, None],
                                    spec).sub_(x)
            err[a:a + step] = _norm_sum(d, float(norm))
    else:
        for a in range(0, n_elems, chunk_elems):
            x = units[:, a:a + chunk_elems]
            d = fake_quantize_units(x, scale[0, :, None], zp[0, :, None], spec).sub_(x)
            err += _norm_sum(d, float(norm))
    return err


def dense_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                 spec: QuantSpec, *, candidates: int = 1000, expand: float = 1.0,
                 min_factor: float = 0.0, norm: float = 2.0, global_amax: torch.Tensor | None = None,
                 chunk_elems: int | None = None) -> SearchResult:
    """The optimality reference: ``candidates`` factors evenly from ``expand`` down to
    ``min_factor`` (``expand * (1 - i / candidates)`` by default), no early stop.

    The best range per unit on a dense grid from ``expand`` times the min-max
    range down to nearly zero (the min-max range included), scored as the spec
    runs; benchmarks and tests report other searches' error relative to it.
    """
    if not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"dense_search: candidates must be a positive integer, got {candidates!r}")
    if not 0 <= min_factor < 1:
        raise ValueError(f"dense_search: min_factor must be in [0, 1), got {min_factor!r}")
    span = 1 - min_factor
    return mse_search(units, lo, hi, spec,
                      factors=[1 - span * i / candidates for i in range(candidates)],
                      expand=expand, norm=norm, patience=None, global_amax=global_amax,
                      global_grid=1, chunk_elems=chunk_elems)


def linear_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                  spec: QuantSpec, *, stride: int = 1, norm: float = 2.0,
                  chunk_elems: int | None = None) -> SearchResult:
    """Horizon's MSE search: ``amax * (1 - 0.01 i)`` for ``i`` in ``range(0, 95, stride)``.

    Symmetric ranges ``(-c, c)`` around zero, L2 error, the last minimum wins.
    """
    if not isinstance(stride, int) or not 1 <= stride <= 94:
        raise ValueError(f"linear_search: stride must be an integer in 1..94, got {stride!r}")
    units, lo, hi = _check(units, lo, hi, spec, norm)
    amax = amax_of_range(lo, hi).clamp(min=0)
    return mse_search(units, -amax, amax, spec, factors=[1 - 0.01 * i for i in range(0, 95, stride)],
                      norm=norm, patience=None, tie="last", global_grid=1,
                      chunk_elems=chunk_elems)


def pow2_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                spec: QuantSpec, *, span: int = 2, norm: float = 2.0,
                chunk_elems: int | None = None) -> SearchResult:
    """Quark's power-of-two min-MSE: the min-max scale's exponent ``pos - span .. pos + span``.

    Scaling the range by ``2 ** k`` moves a power-of-two scale by exactly ``k``
    binades, so the candidates are the factors ``4, 2, 1, 1/2, 1/4`` (span 2), the
    first minimum winning as in Quark (which tries the largest scale first).
    """
    check_int("pow2_search", "span", span, 0, MAX_SPAN)
    return mse_search(units, lo, hi, spec, factors=[math.ldexp(1.0, -k) for k in range(-span, span + 1)],
                      norm=norm, patience=None, global_grid=1, chunk_elems=chunk_elems)
