"""torch.ao ``HistogramObserver``'s non-linear L2 parameter search, same result, vectorized.

torch.ao (``_non_linear_param_search``) walks quantile bounds ``alpha`` up and
``beta`` down by ``1e-5`` per iteration (up to 1e5 Python iterations); each one
finds the bins ``l``, ``r`` at the next quantiles, moves the side that trims more
bins (``l - start > end - r``; the end otherwise), and, when the bins changed,
prices the new range with an L2 model of the error (uniform density in each
bin, ``dst_nbins`` output bins); it stops at the first range whose error is
larger than the previous one.

The walk does not depend on the errors except for where it stops, so it is
computed without the loop:

* ``A(a)`` / ``B(b)``: the bins at the ``a``-th / ``b``-th quantile step (searchsorted
  of ``float32(alpha * total)`` in the float32 cumulative counts, as torch compares);
* the side chosen depends only on the two gains ``dA(a) = A(a+1) - A(a)`` and
  ``dB(b) = B(b) - B(b+1)`` -- a greedy merge of two sequences, which equals the
  ordinary merge of their prefix minima, i.e. positions from one ``searchsorted``;
* once the alpha gain is 0 the alpha side never moves again and the end walks
  down through every bin the beta quantiles reach (found per bin, by inverting the
  beta sequence); the two bounds meeting ("crossing") ends the walk in one step;
* the walk stops where ``alpha >= beta`` (the same float64 accumulations as torch).

The errors of all ranges on the path are then evaluated with torch's float32
operations, in the same order, chunk by chunk, and the first increase picks the
range. Per-tensor results equal torch.ao's bitwise (tested); every unit of a
per-channel histogram gets the same search.

On CPU a C kernel (:mod:`quantscope.kernels`) walks the bounds instead, torch's loop
step by step (the same float64 ``alpha`` / ``beta`` and float32 thresholds), with
two pointers that only move forward (``O(bins + steps)``, no search per step), and
hands over the visited ranges in growing chunks (8, 16, 32 ...) until the norms
(still :func:`l2_norms`, torch's float32 operations) rise: only the ranges before
the stop are walked and priced. :func:`l2_path` (the vectorized form) is the
reference it is tested against.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import kernels
from .._checks import check_int
from ..formats import IntFormat
from ..stats.histogram import Hist
from .histogram_mse import occupied_range
from .scorer import HistogramScorer, Line, tensor_amax

__all__ = ["default_dst_nbins", "l2_finalists", "l2_norms", "l2_path", "l2_polished_range",
           "l2_range"]

_STEP = 1e-5
_BUDGET = 1 << 19


def _kernel():
    return kernels.lib("l2_walk")


class _Walk:
    """The kernel's walk of every unit, resumed chunk by chunk; its state also keeps the
    stop rule's best range and norm."""

    def __init__(self, lib, counts: torch.Tensor):
        U, B = counts.shape
        hist = kernels.contiguous(counts)  # (the C reads it; no op when it is already)
        self.lib, self.U, self.B, self.counts = lib, U, B, hist
        self.total = hist.sum(1).double()  # torch: torch.sum(histogram).item()
        self.csum = torch.cumsum(hist, dim=1)
        self.fs = torch.empty(U, 3, dtype=torch.float64)
        self.st = torch.empty(U, 7, dtype=torch.long)
        lib.qs_l2_init(self.fs.data_ptr(), self.st.data_ptr(), U, B)

    def chunk(self, k: int, done: torch.Tensor):
        """The next ``k`` ranges of each unit not ``done``: ``(start, end, valid)`` ``[U, k]``."""
        self.st[:, 4] |= done.long()
        s, e, n = self.chunk_raw(k)
        return s, e, torch.arange(k)[None, :] < n[:, None]

    def chunk_raw(self, k: int):
        """``(start, end, count)``: ranges ``[U, k]``, the first ``count [U]`` of them valid."""
        s = torch.empty(self.U, k, dtype=torch.long)
        e = torch.empty(self.U, k, dtype=torch.long)
        n = torch.empty(self.U, dtype=torch.long)
        self.lib.qs_l2_walk(self.csum.data_ptr(), self.total.data_ptr(), self.fs.data_ptr(),
                            self.st.data_ptr(), s.data_ptr(), e.data_ptr(), n.data_ptr(),
                            self.U, self.B, k)
        return s, e, n


@functools.lru_cache(maxsize=1)
def _quantile_steps() -> tuple[torch.Tensor, torch.Tensor]:
    # alpha_k = alpha_{k-1} + 1e-5 and beta_k = beta_{k-1} - 1e-5 in float64, as torch's loop
    n = int(1 / _STEP) + 3
    a = np.full(n, _STEP)
    a[0] = 0.0
    b = np.full(n, -_STEP)
    b[0] = 1.0
    return torch.from_numpy(np.cumsum(a)), torch.from_numpy(np.cumsum(b))


def _thr(level: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``float32(level * total)``: torch compares a float32 cumsum with the float64 product."""
    return (level * total).float()


def _count_beta_ge(c: torch.Tensor, total: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """For float32 values ``c [U, N]``: how many quantile steps ``b`` have
    ``float32(beta_b * total) >= c`` (a prefix, since the thresholds decrease)."""
    K = beta.numel()
    approx = torch.searchsorted(-beta, -(c.double() / total[:, None]), right=True)
    base = (approx - 3).clamp(min=0)
    count = base.clone()
    for d in range(7):  # exact check of the few steps around the estimate
        k = base + d
        ok = k < K
        t = _thr(beta[k.clamp(max=K - 1)], total[:, None])
        count += (ok & (t >= c)).long()
    return count


def l2_path(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranges torch.ao's search visits: ``(start [U, J], end [U, J], valid [U, J])`` in
    visiting order (each a change of range that torch prices).

    torch's loop moves the range's ends by quantile steps ``alpha`` (start) and ``beta``
    (end) in two phases: both ends while the start still gains (phase 1), then the end alone
    (phase 2); each phase is computed for every step at once."""
    dev = counts.device
    alpha, beta = (t.to(dev) for t in _quantile_steps())
    hist = counts.float()
    total = hist.sum(1).double()  # torch: torch.sum(histogram).item()
    csum = torch.cumsum(hist, dim=1)
    A, Bv = _step_bins(csum, total, alpha, beta)
    start1, end1, valid1, ended, a_max, b_max = _both_ends(A, Bv, alpha, beta)
    start2, end2, valid2 = _end_alone(csum, total, A, Bv, alpha, beta, a_max, b_max, ended)
    start = torch.cat([start1, start2], 1)
    end = torch.cat([end1, end2], 1)
    valid = torch.cat([valid1, valid2], 1)
    # compact: visited ranges first, in order
    order = torch.argsort((~valid).long(), dim=1, stable=True)
    return start.gather(1, order), end.gather(1, order), valid.gather(1, order)


#: larger than any step index (a sort key that goes last)
_BIG = torch.iinfo(torch.int64).max // 4


def _step_bins(csum, total, alpha, beta):
    """``(A, B) [U, L]``: the bin the start reaches after ``k`` alpha steps and the end after
    ``k`` beta steps (step 0: the histogram's ends), for ``L = bins + 2`` steps but at most
    the table's (torch's loop stops within them: alpha meets beta)."""
    Bn = csum.shape[1]
    ks = torch.arange(min(Bn + 2, alpha.numel()), device=csum.device)
    A = torch.searchsorted(csum, _thr(alpha[ks][None, :], total[:, None]), right=False)
    Bv = torch.searchsorted(csum, _thr(beta[ks][None, :], total[:, None]), right=True) - 1
    A[:, 0] = 0
    Bv[:, 0] = Bn - 1
    return A, Bv


def _both_ends(A, Bv, alpha, beta):
    """Phase 1, while both ends still gain: the steps of either end merged in the order
    torch's loop takes them (it moves the end that gains more bins).
    ``(start, end, valid) [U, 2 (L - 1)]``, whether the walk ended in this phase ``[U]``,
    and the steps each end took in it ``[U]``."""
    U, L = A.shape
    dev = A.device
    dA = A[:, 1:] - A[:, :-1]  # [U, L - 1]
    dB = Bv[:, :-1] - Bv[:, 1:]
    ar = torch.arange(L - 1, device=dev)
    a_max = torch.where(dA == 0, ar, L).amin(1)  # first zero gain
    b_max = torch.where(dB == 0, ar, L).amin(1)
    in_a = ar[None, :] < a_max[:, None]
    in_b = ar[None, :] < b_max[:, None]
    xs = torch.where(in_a, torch.cummin(dA, 1).values, -1)  # keys of the alpha steps
    ys = torch.where(in_b, torch.cummin(dB, 1).values, -1)
    # merge (ties: beta first). alpha step a lands after every beta step with key >= its
    nb = torch.searchsorted(torch.where(in_b, -ys, _BIG), torch.where(in_a, -xs, _BIG),
                            right=True)
    nb = torch.minimum(nb, b_max[:, None])
    L1 = 2 * (L - 1)
    is_alpha = torch.zeros(U, L1 + 1, dtype=torch.long, device=dev)
    pos_a = torch.where(in_a, ar[None, :] + nb, L1)
    is_alpha.scatter_(1, pos_a, 1)
    is_alpha = is_alpha[:, :L1]
    k = torch.arange(L1, device=dev)
    n1 = (a_max + b_max)[:, None]
    a_bef = torch.cumsum(is_alpha, 1) - is_alpha
    b_bef = k[None, :] - a_bef
    a_bef = a_bef.clamp(max=L - 2)
    b_bef = b_bef.clamp(min=0, max=L - 2)
    s0 = A.gather(1, a_bef)
    e0 = Bv.gather(1, b_bef)
    l_un = A.gather(1, a_bef + 1)
    r_un = Bv.gather(1, b_bef + 1)
    in_phase = k[None, :] < n1
    runs = alpha[a_bef] < beta[b_bef]  # torch's `while alpha < beta`
    cross = (l_un > e0) | (r_un < s0)
    l_cl = torch.minimum(e0, l_un)
    r_cl = torch.maximum(s0, r_un)
    go_a = torch.where(cross, (l_cl - s0) > (e0 - r_cl), is_alpha.bool())
    start = torch.where(go_a, l_cl, s0)
    end = torch.where(go_a, e0, r_cl)
    # a step runs if every earlier step ran without crossing; it changes the range if it moves
    stop_ev = (in_phase & (~runs | cross)).long()
    stopped = torch.cumsum(stop_ev, 1) - stop_ev
    valid = in_phase & runs & (stopped == 0) & ((start != s0) | (end != e0))
    ended = stop_ev.bool().any(1)  # the walk ended inside phase 1
    return start, end, valid, ended, a_max, b_max


def _end_alone(csum, total, A, Bv, alpha, beta, a_max, b_max, ended):
    """Phase 2: alpha stuck at ``a_max``; the end walks down through the bins the beta steps
    reach. ``(start, end, valid) [U, bins]``, the end descending."""
    U, Bn = csum.shape
    L = A.shape[1]
    dev = csum.device
    s2 = A.gather(1, a_max.clamp(max=L - 1)[:, None])[:, 0]
    e2 = Bv.gather(1, b_max.clamp(max=L - 1)[:, None])[:, 0]
    b_end = (beta[None, :] > alpha[a_max.clamp(max=alpha.numel() - 1)][:, None]).sum(1)
    bins = torch.arange(Bn, device=dev)
    nxt = csum.gather(1, (bins + 1).clamp(max=Bn - 1)[None, :].expand(U, -1))
    first_b = _count_beta_ge(nxt, total, beta)  # first step with B(b) <= i
    first_b = torch.where(bins[None, :] + 1 < Bn, first_b, 0)
    prev = torch.cat([first_b[:, :1] * 0 + _BIG, first_b[:, :-1]], 1)  # first with B <= i-1
    reach = (first_b < prev) | (bins[None, :] == s2[:, None])
    reach &= (first_b <= b_end[:, None]) & (first_b > b_max[:, None])
    reach &= (bins[None, :] >= s2[:, None]) & (bins[None, :] < e2[:, None])
    reach &= ~ended[:, None]
    end = bins.flip(0)[None, :].expand(U, -1)  # descending
    return s2[:, None].expand(U, Bn), end, reach.flip(1)


def l2_norms(hist: Hist, start: torch.Tensor, end: torch.Tensor,
             dst_nbins: int = 256) -> torch.Tensor:
    """torch.ao's ``_compute_quantization_error(start, end)`` for ranges ``[U, J]``, with the
    same float32 operations in the same order (so the same values, bit for bit)."""
    _U, Bn = hist.counts.shape
    dev = hist.counts.device
    counts = hist.counts.float()
    bw64 = (hist.hi.double() - hist.lo.double()) / Bn  # (max.item() - min.item()) / bins
    dbw64 = bw64[:, None] * (end - start + 1).double() / dst_nbins
    bw = bw64.float()[:, None, None]
    dbw = dbw64.float()[..., None]
    half = (dbw64 / 2).float()[..., None]
    nhalf = (-dbw64 / 2).float()[..., None]
    src = torch.arange(Bn, device=dev)
    src_begin = (src[None, None, :] - start[..., None]).float() * bw
    src_end = src_begin + bw
    dob = torch.clamp(torch.div(src_begin, dbw, rounding_mode="floor"), 0, dst_nbins - 1)
    dob_c = (dob + 0.5) * dbw
    doe = torch.clamp(torch.div(src_end, dbw, rounding_mode="floor"), 0, dst_nbins - 1)
    density = (counts[:, None, :] / bw)

    def get_norm(db, de):
        return density * ((de * de * de - db * db * db) / 3)

    norm = torch.zeros_like(src_begin)
    norm += get_norm(src_begin - dob_c, torch.ones_like(src_begin) * half)
    norm += (doe - dob - 1) * get_norm(nhalf, half)
    doe_c = doe * dbw + half
    norm += get_norm(nhalf, src_end - doe_c)
    out = norm.sum(-1).double()
    return torch.where(dbw64 == 0, torch.zeros_like(out), out)


def l2_range(hist: Hist, dst_nbins: int = 256, *, backend: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(new_min, new_max)`` of torch.ao's non-linear search on ``hist`` (its
    ``min_val`` / ``max_val`` are ``hist.lo`` / ``hist.hi``); ``backend="torch"`` walks with
    :func:`l2_path` instead of the C walk (:data:`quantscope.kernels.BACKENDS`)."""
    check_dst_nbins("l2_range", dst_nbins)
    U, Bn = hist.counts.shape
    if Bn < 1:  # no range to walk (the walk's bin width divides by the bins)
        raise ValueError(f"l2_range: the histogram needs at least one bin, got counts of "
                         f"shape {tuple(hist.counts.shape)}")
    dev = hist.counts.device
    lib = kernels.choose(backend, "l2_walk", "l2_range", dev.type == "cpu" and U > 0,
                         (hist.counts, hist.lo, hist.hi))
    if lib is not None:
        return _l2_range_kernel(lib, hist, dst_nbins)
    start, end, valid = l2_path(hist.counts)
    J = int(valid.sum(1).max()) if valid.numel() else 0
    best_s = torch.zeros(U, dtype=torch.long, device=dev)
    best_e = torch.full((U,), Bn - 1, dtype=torch.long, device=dev)
    prev = torch.full((U,), float("inf"), dtype=torch.float64, device=dev)
    done = torch.zeros(U, dtype=torch.bool, device=dev)
    cap = max(1, _BUDGET // max(1, U * Bn))
    j0, step = 0, min(8, cap)
    while j0 < J:  # growing chunks of ranges (the walk usually stops early) until all stopped
        s, e, v = start[:, j0:j0 + step], end[:, j0:j0 + step], valid[:, j0:j0 + step]
        j0, step = j0 + step, min(2 * step, cap)
        norms = l2_norms(hist, s, e, dst_nbins)
        before = torch.cat([prev[:, None], norms[:, :-1]], 1)
        worse = (norms > before) & v
        # torch: accept while norm <= previous norm; the first increase stops the walk
        first_bad = torch.where(worse, torch.arange(s.shape[1], device=dev), s.shape[1]).amin(1)
        accept = v & (torch.arange(s.shape[1], device=dev)[None, :] < first_bad[:, None])
        accept &= ~done[:, None]
        last = torch.where(accept, torch.arange(s.shape[1], device=dev), -1).amax(1)
        got = last >= 0
        best_s = torch.where(got, s.gather(1, last.clamp(min=0)[:, None])[:, 0], best_s)
        best_e = torch.where(got, e.gather(1, last.clamp(min=0)[:, None])[:, 0], best_e)
        prev = torch.where(got, norms.gather(1, last.clamp(min=0)[:, None])[:, 0], prev)
        done |= (first_bad < s.shape[1]) | (~v).any(1)
        if bool(done.all()):
            break
    w = hist.width
    return hist.lo + w * best_s, hist.lo + w * (best_e + 1)


def _l2_range_kernel(lib, hist: Hist, dst_nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2_range` by the C walk, C per-bin terms (torch sums them, as torch.ao does)
    and the C stop rule, in chunks of 8, 16, 32 ... ranges."""
    U, Bn = hist.counts.shape
    walk = _Walk(lib, hist.counts)
    lo, hi = kernels.contiguous(hist.lo), kernels.contiguous(hist.hi)
    cap = max(1, _BUDGET // max(1, U * Bn))
    step = min(8, cap)
    while True:
        s, e, n = walk.chunk_raw(step)
        terms = kernels.buffer(U, step, Bn)
        lib.qs_l2_terms(walk.counts.data_ptr(), lo.data_ptr(), hi.data_ptr(), s.data_ptr(),
                        e.data_ptr(), terms.data_ptr(), U, step, Bn, dst_nbins)
        norms = terms.sum(-1).double()  # torch's float32 sum, as torch.ao's norm.sum()
        if lib.qs_l2_accept(norms.data_ptr(), s.data_ptr(), e.data_ptr(), n.data_ptr(),
                            walk.fs.data_ptr(), walk.st.data_ptr(), U, step):
            break
        step = min(2 * step, cap)
    new_lo, new_hi = kernels.buffer(2, U).unbind(0)
    lib.qs_l2_result(lo.data_ptr(), hi.data_ptr(), walk.st.data_ptr(), new_lo.data_ptr(),
                     new_hi.data_ptr(), U, Bn)
    return new_lo, new_hi


def check_dst_nbins(who: str, dst_nbins) -> int:
    """``dst_nbins`` (torch.ao's quantized bin count, ``2 ** bits`` of its dtype) as an int in
    ``[2, 2 ** 32]`` (int32's, the widest torch.ao observes)."""
    return check_int(who, "dst_nbins", dst_nbins, 2, 1 << 32)


def default_dst_nbins(spec) -> int:
    """torch.ao's ``dst_nbins`` for a spec: ``2 ** bits`` of an integer format, else 256."""
    fmt = spec.format
    return 2 ** fmt.bits if isinstance(fmt, IntFormat) else 256


def l2_polished_range(hist: Hist, spec, dst_nbins: int = 256, radius: int = 256, bounds=None,
                      global_amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ao's search (:func:`l2_range`), then a polish of both ends on the histogram's
    quantization error: the native ``histogram`` estimator.

    ``lo`` moves along a line of candidates (``hi`` fixed), then ``hi`` (the new ``lo``
    fixed): ``+-radius`` whole bins scored with 2 points per bin, coarse-to-fine (every
    16th bin, then the 15 either side of the best; one
    :meth:`~quantscope.estimators.scorer.HistogramScorer.line_argmin` call each). Then the
    search's own range and the two moves are scored with 4 points per bin and the least
    error wins (ties: the search's range), so the polish
    never has more histogram error than torch.ao's choice. ``global_amax``: a global-scale
    spec's tensor-wide ``max |x|`` the candidates are scored under (default: the data's,
    from ``bounds`` or the occupied bins).
    """
    if not radius:
        return _l2_range_normalized(hist, dst_nbins)
    global_amax = _global_amax(hist, spec, bounds, global_amax)
    clo, chi = l2_finalists(hist, spec, dst_nbins, radius, bounds, global_amax)
    four = HistogramScorer(hist, spec, points=4, global_amax=global_amax)
    k = four(clo, chi).argmin(1, keepdim=True)  # first minimum: the search's range on ties
    return clo.gather(1, k)[:, 0], chi.gather(1, k)[:, 0]


def l2_finalists(hist: Hist, spec, dst_nbins: int = 256, radius: int = 256, bounds=None,
                 global_amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranges ``(lo, hi)`` ``[U, 3]`` :func:`l2_polished_range` picks from: the search's
    (clipped to ``bounds``), then with ``lo`` moved, then with ``hi`` moved too."""
    global_amax = _global_amax(hist, spec, bounds, global_amax)
    lo, hi = _l2_range_normalized(hist, dst_nbins)
    if bounds is not None:
        lo, hi = torch.maximum(lo, bounds[0]), torch.minimum(hi, bounds[1])
    two = HistogramScorer(hist, spec, points=2, global_amax=global_amax)
    los, his = [lo], [hi]
    for side in (0, 1):
        lo, hi = _move_end(two, hist, lo, hi, side, radius, 1, 16, bounds)
        los.append(lo)
        his.append(hi)
    return torch.stack(los, 1), torch.stack(his, 1)


def _l2_range_normalized(hist: Hist, dst_nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`l2_range` on each unit's histogram scaled by a power of two to ``max(|lo|,
    |hi|)`` in ``[0.5, 1)``, the range scaled back: the same result bit for bit where torch.ao's
    float32 norms (cubes of bin offsets) stay normal, and the search also where they would
    overflow or underflow (``|x|`` past about ``4e13``, or small: torch.ao then clips the range
    to a bin or two, as its observer does)."""
    # both factors normal float32 (subnormal ends are scaled up exactly, only not to ~1)
    e = torch.frexp(torch.maximum(hist.lo.abs(), hist.hi.abs())).exponent.clamp(-126, 126)
    f, back = torch.ldexp(torch.ones_like(hist.lo), -e), torch.ldexp(torch.ones_like(hist.lo), e)
    step = None if hist.step is None else hist.step * f
    lo, hi = l2_range(Hist(hist.counts, hist.lo * f, hist.hi * f, hist.absolute, step),
                      dst_nbins)
    return lo * back, hi * back


def _global_amax(hist: Hist, spec, bounds, global_amax):
    """``global_amax``, else a global-scale spec's from the data: ``bounds``, else the
    histogram's occupied bins."""
    if global_amax is not None or not spec.scale.has_global_scale:
        return global_amax
    return tensor_amax(spec, *(occupied_range(hist) if bounds is None else bounds))


def _move_end(scorer, hist: Hist, lo, hi, side: int, radius: int, steps: int, coarse: int,
              bounds):
    """``(lo, hi)`` with the best ``lo`` (``side`` 0, ``hi`` fixed) or the best ``hi`` (``side``
    1) over ``+-radius`` bins in ``1 / steps`` bin steps, coarse-to-fine; the current range
    wins ties."""
    bounds = _stay_on_side(lo, hi, side, bounds, hist.width)
    line = Line.move(lo, hi, hist.width, side, radius, steps, bounds)
    best = scorer.line_argmin(line, radius * steps, coarse)
    return best.lo, best.hi


def _stay_on_side(lo, hi, side: int, bounds, width):
    """``bounds`` narrowed, where the data lie within a bin of zero, so that the moving end
    stays on its side of the fixed one. A line orders each candidate's ends: a ``lo`` moved
    past ``hi`` is the range ``[hi, lo']``; on such a grid (subnormal data, whose bins stop
    at ``2 ** E_MIN``) a bin step jumps over all the data, and ``lo`` moved past ``hi = 0``
    won, dropping every negative value. Elsewhere (the data span many bins) nothing changes."""
    if bounds is None:
        return None
    blo, bhi = bounds
    coarse = torch.maximum(blo.abs(), bhi.abs()) <= width
    if side == 0:
        return blo, torch.where(coarse, torch.minimum(bhi, hi), bhi)
    return torch.where(coarse, torch.maximum(blo, lo), blo), bhi
