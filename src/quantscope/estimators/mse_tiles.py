"""The MSE search's torch path: candidates priced in ``[candidates, units, elements]`` tiles.

Each tile is one batched tensor expression, tiles are bounded by ``chunk_elems``
elements (peak extra memory a few tiles, within 2x the input for large inputs), and the
only Python loops run over tiles and over the candidates of a chunk on ``[U]`` vectors,
never over units, groups or blocks. :class:`_State` holds the selection rules that
:mod:`.mse` describes; :mod:`.mse_kernel` applies the same rules in C.
"""

from __future__ import annotations

import math

import torch

from ..formats import IntFormat
from ..kernels.price_ops import price_sums
from ..kernels.select_ops import beats
from ..qdq import fake_quantize_units
from ..qparams import QParams, qparams_from_range
from ..spec import QuantSpec


def norm_sum(d: torch.Tensor, norm: float) -> torch.Tensor:
    """``sum(|d| ** norm)`` over the last dim (one pass, no temporary)."""
    return torch.linalg.vector_norm(d, ord=norm, dim=-1).pow_(norm)


def candidate_qparams(lo_c: torch.Tensor, hi_c: torch.Tensor, spec: QuantSpec,
                      global_amax, finite: bool = False) -> QParams:
    """The qparams of candidate ranges ``lo_c, hi_c``, with a NaN scale where the range is not
    finite (a factor > 1 of values near float32's max): every engine prices that NaN, and a
    non-finite error never replaces the best, so a native search never returns such a range
    (``qparams_from_range`` saturates its scale, and its finite error could win). The one
    place every engine (tiles, C kernel, ops, :mod:`.mse_compat`) takes a candidate's qparams
    from. (llm-compressor's own search prices such a range NaN too: its scale is inf.)

    ``finite``: the caller has shown every candidate finite (:func:`finite_candidates`), so
    the mask, five passes over the candidates, is skipped."""
    # candidates scale the observer's checked min / max: no device read-back per chunk
    qp = qparams_from_range(lo_c, hi_c, spec, global_amax=global_amax, check_finite=False)
    if finite:
        return qp
    past = torch.maximum(lo_c.abs(), hi_c.abs()) == math.inf
    return QParams(qp.scale.masked_fill(past, math.nan), qp.zero_point, qp.global_scale)


def finite_candidates(ends, factors) -> bool:
    """Whether every candidate ``end * factor`` (each of ``ends`` times each of ``factors``,
    in their dtypes) is finite, in one host read: ``|end| * |factor|`` is at most ``max|end|
    * max|factor|``, and rounding is monotone. For the CPU engines, which then price without
    :func:`candidate_qparams`' mask; a NaN end reads as not finite. A tensor given twice
    (the kernel search's incumbent, where it is the min / max itself) is read once."""
    kept = []
    for e in ends:
        if e.numel() and all(e is not k for k in kept):
            kept.append(e)
    if not kept:
        return True
    top = torch.stack([e.abs().amax() for e in kept]).amax()
    return bool(torch.isfinite(top * torch.stack([f.abs().amax() for f in factors]).amax()))


def _tile_error(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec,
                norm: float, exact: bool, float32_squares: bool = False) -> torch.Tensor:
    """Error of ``x [Ut, E]`` under ``scale``, ``zp`` ``[Cc, Ut]`` (effective scale): ``[Cc, Ut]``.

    ``exact``: llm-compressor's arithmetic, ``sum(|fake_quant(x) - x| ** norm)``.
    Otherwise, ``norm=2`` computes the C kernel's error (:mod:`.mse_kernel`; integer and
    float formats): the ops' prices (``kernels.price_ops.price_sums``: squares exact in
    float64, or rounded to float32 with ``float32_squares``, summed in float64), so that
    both paths choose the same candidates (a float32 sum breaks near ties differently: issue
    20 #11); other norms use the rounding identity ``fake_quant(x) - x = (clamp(round(t)) -
    t) * scale`` with ``t = x / scale + zp``, which scores the same quantizer with fewer
    passes over the tile.
    """
    s3, z3 = scale.unsqueeze(-1), zp.unsqueeze(-1)
    if not exact and norm == 2:
        d = fake_quantize_units(x, s3, z3, spec).sub_(x)
        return price_sums(d, float32_squares=float32_squares)
    if exact or not isinstance(spec.format, IntFormat):
        d = fake_quantize_units(x, s3, z3, spec).sub_(x)
        if exact:
            return d.abs_().pow_(norm).sum(-1)
        return norm_sum(d, norm)
    t = x / s3
    if not (spec.symmetric and spec.format.signed):
        t.add_(z3)
    d = torch.round(t).clamp_(spec.qmin, spec.qmax).sub_(t)
    del t
    return norm_sum(d, norm) * scale.abs().pow(norm)


def chunk_candidates_of(total: int, chunk_candidates: int | None) -> int:
    """Candidates priced per chunk of :func:`search` (then stepped through one by one)."""
    return chunk_candidates or max(1, min(total, 32 if total <= 32 else 16))


def tile_steps(cc: int, n_elems: int, chunk_elems: int) -> tuple[int, int]:
    """``(candidates, units)`` per ``[candidates, units, elements]`` tile of a chunk of
    ``cc`` candidates, units of ``n_elems <= chunk_elems`` elements."""
    cstep = max(1, min(cc, chunk_elems // n_elems))
    return cstep, max(1, chunk_elems // (n_elems * cstep))


def tile_numels(n_units: int, n_elems: int, total: int, chunk_elems: int,
                chunk_candidates: int | None) -> set[int]:
    """The element counts of the tiles :func:`search` prices ``total`` candidates in
    (units of ``n_elems <= chunk_elems``; no incumbent): what :mod:`.mse_compat` needs to
    know of torch's loops."""
    cc = chunk_candidates_of(total, chunk_candidates)
    sizes = set()
    for start in range(0, total, cc):
        ccur = min(cc, total - start)
        cstep, ustep = tile_steps(ccur, n_elems, chunk_elems)
        for c in {cstep, ccur % cstep} - {0}:
            for u in {min(ustep, n_units), n_units % ustep} - {0}:
                sizes.add(c * u * n_elems)
    return sizes


def _errors(units, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems,
            sq32=False):
    """Errors ``[Cc, U]`` of candidate ranges ``lo_c, hi_c [Cc, U]``, tiled; also the qparams
    (``sq32``: :func:`_tile_error`'s ``float32_squares``)."""
    qp = candidate_qparams(lo_c, hi_c, spec, global_amax)
    scale = qp.effective_scale.expand_as(lo_c)
    zp = qp.zero_point.float()
    cc = lo_c.shape[0]
    n_units, n_elems = units.shape
    if n_elems <= chunk_elems:  # tiles of whole units: [candidates, units, E]
        cstep, ustep = tile_steps(cc, n_elems, chunk_elems)
        if cstep >= cc and ustep >= n_units:
            err = _tile_error(units, scale, zp, spec, norm, exact, sq32)
        else:
            err = torch.cat([torch.cat([
                _tile_error(units[a:a + ustep], scale[c:c + cstep, a:a + ustep],
                            zp[c:c + cstep, a:a + ustep], spec, norm, exact, sq32)
                for a in range(0, n_units, ustep)], dim=1) for c in range(0, cc, cstep)])
    else:  # units larger than a tile (per-tensor): element slices, partial sums added
        err = scale.new_zeros(cc, n_units, dtype=torch.float64 if norm == 2 else scale.dtype)
        for u in range(n_units):
            for c in range(cc):
                for a in range(0, n_elems, chunk_elems):
                    err[c:c + 1, u:u + 1] += _tile_error(
                        units[u:u + 1, a:a + chunk_elems], scale[c:c + 1, u:u + 1],
                        zp[c:c + 1, u:u + 1], spec, norm, exact, sq32)
    return err, qp.scale.expand_as(lo_c), zp


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
        better = active & beats(e, best_err, tie == "last")
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


def search(units, lo, hi, spec, f_lo, f_hi, *, norm, patience, per_unit, tie, exact,
           incumbent, global_amax, chunk_elems, chunk_candidates, early_stop, extend=(),
           float32_squares=False):
    """Core: pick, per unit, the best of candidates ``(lo * f_lo[i], hi * f_hi[i])``.

    ``incumbent``: a ``(lo, hi)`` scored first as the best so far (index -1).
    ``extend``: further factors tried, after the grid, by the units still improving
    (per-unit patience only; on CPU only those units are computed).
    ``float32_squares``: :func:`_tile_error`'s (a compat class's toolkit arithmetic).
    """
    sq32 = float32_squares
    dev = units.device
    n_units = units.shape[0]
    total = len(f_lo)
    f_lo = torch.tensor(f_lo, dtype=torch.float32, device=dev)
    f_hi = torch.tensor(f_hi, dtype=torch.float32, device=dev)
    if incumbent is not None:  # the min-max range: native searches never do worse than it
        best_lo, best_hi = incumbent[0].clone(), incumbent[1].clone()
        err, sc, zp = _errors(units, best_lo[None], best_hi[None], spec, norm, exact,
                              global_amax, chunk_elems, sq32)
        st = _State(best_lo, best_hi, err[0], (sc[0].clone(), zp[0].clone()))
    else:  # llm-compressor: the first candidate always wins
        st = _State(lo * f_lo[0], hi * f_hi[0],
                    torch.full((n_units,), torch.finfo(torch.float32).max, dtype=torch.float32,
                               device=dev), None)
    # native per-unit patience never stops a unit before llm-compressor's global rule would
    use_global = patience is not None and (not per_unit or not exact)
    rule = {"patience": patience, "per_unit": per_unit, "tie": tie, "use_global": use_global}
    cc = chunk_candidates_of(total, chunk_candidates)
    for start in range(0, total, cc):
        fl, fh = f_lo[start:start + cc], f_hi[start:start + cc]
        lo_c, hi_c = lo[None] * fl[:, None], hi[None] * fh[:, None]
        err, sc, zp = _errors(units, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems,
                              sq32)
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
            err, sc, zp = _errors(x, lo_c, hi_c, spec, norm, exact, global_amax, chunk_elems,
                                  sq32)
            for j in range(lo_c.shape[0]):
                st.step(total + start + j, err[j], lo_c[j], hi_c[j], sc[j], zp[j], sub=sub,
                        **rule)
    return st.lo, st.hi, st.err, st.idx  # float64 where priced so, as the kernel's
