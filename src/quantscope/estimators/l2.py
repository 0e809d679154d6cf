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

On CPU a C kernel (:mod:`quantscope.native`) walks the bounds instead, torch's loop
step by step (the same float64 ``alpha`` / ``beta`` and float32 thresholds), with
two pointers that only move forward (``O(bins + steps)``, no search per step), and
hands over the visited ranges in growing chunks (8, 16, 32 ...) until the norms
(still :func:`l2_norms`, torch's float32 operations) rise: only the ranges before
the stop are walked and priced. :func:`l2_path` (the vectorized form) is the
reference it is tested against.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from .. import native
from .._checks import check_int
from ..formats import IntFormat
from ..stats.histogram import Hist
from .error import HistogramScorer, Line

__all__ = ["default_dst_nbins", "l2_finalists", "l2_norms", "l2_path", "l2_polished_range",
           "l2_range"]

_STEP = 1e-5
_BUDGET = 1 << 19

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

/* torch.ao's bound walk, resumable. Per unit fs = (alpha, beta, best norm) and
   is = (start, end, la, rb, done, best start, best end); la: first bin with csum >= the
   alpha threshold, rb: last bin with csum <= the beta threshold (both only move one
   way). qs_l2_walk writes up to K changed ranges per unit to s, e [U, K] (the rest
   (0, B - 1)) and their count to n [U]; done when alpha >= beta. */
#define NS 7
int64_t qs_l2_init(double *fs, int64_t *is, int64_t U, int64_t B) {
    for (int64_t u = 0; u < U; ++u) {
        fs[3 * u] = 0.0; fs[3 * u + 1] = 1.0; fs[3 * u + 2] = INFINITY;
        int64_t *st = is + NS * u;
        st[0] = 0; st[1] = B - 1; st[2] = 0; st[3] = B - 1; st[4] = 0; st[5] = 0;
        st[6] = B - 1;
    }
    return 0;
}

int64_t qs_l2_walk(const float *csum, const double *total, double *fs, int64_t *is,
                   int64_t *s, int64_t *e, int64_t *n, int64_t U, int64_t B, int64_t K) {
    for (int64_t u = 0; u < U; ++u) {
        const float *cs = csum + u * B;
        double alpha = fs[3 * u], beta = fs[3 * u + 1], tot = total[u];
        int64_t *st = is + NS * u;
        int64_t start = st[0], end = st[1], la = st[2], rb = st[3], k = 0;
        while (!st[4] && k < K) {
            if (!(alpha < beta)) { st[4] = 1; break; }
            double na = alpha + 1e-5, nb = beta - 1e-5;
            float ta = (float)(na * tot), tb = (float)(nb * tot);
            while (la < B && cs[la] < ta) ++la;
            while (rb >= 0 && cs[rb] > tb) --rb;
            int64_t l = la < start ? start : la;
            if (l > end) l = end;
            int64_t r = rb > end ? end : rb;
            if (r < start) r = start;
            int64_t ns = start, ne = end;
            if (l - start > end - r) { ns = l; alpha = na; }
            else { ne = r; beta = nb; }
            if (ns == start && ne == end) continue;
            s[u * K + k] = ns; e[u * K + k] = ne; ++k;
            start = ns; end = ne;
        }
        n[u] = k;
        for (int64_t j = k; j < K; ++j) { s[u * K + j] = 0; e[u * K + j] = B - 1; }
        fs[3 * u] = alpha; fs[3 * u + 1] = beta;
        st[0] = start; st[1] = end; st[2] = la; st[3] = rb;
    }
    return 0;
}

/* new_min = lo + w * best start, new_max = lo + w * (best end + 1), w = (hi - lo) / B, in
   float32 as torch.ao (and Hist.width) compute them. */
int64_t qs_l2_result(const float *lo, const float *hi, const int64_t *is, float *out_lo,
                     float *out_hi, int64_t U, int64_t B) {
    for (int64_t u = 0; u < U; ++u) {
        float w = (hi[u] - lo[u]) / (float)B;
        out_lo[u] = lo[u] + w * (float)is[NS * u + 5];
        out_hi[u] = lo[u] + w * (float)(is[NS * u + 6] + 1);
    }
    return 0;
}

/* fmodf(a, b) for b > 0 (exact, as fmod always is): the remainder a - q b is exact in
   double while q b fits in 53 bits; libm's fmodf (slow) otherwise. */
static float fmod_pos(float a, float b) {
    double q = trunc((double)a / (double)b);
    if (!(fabs(q) < 268435456.0)) return fmodf(a, b);
    double r = (double)a - q * (double)b;
    if (a >= 0) { if (r < 0) r += b; else if (r >= b) r -= b; }
    else { if (r > 0) r -= b; else if (r <= -(double)b) r += b; }
    return (float)r;
}

/* c10::div_floor_floating (torch.div(..., rounding_mode="floor") on float32), b > 0: the
   floor of the exact quotient. When a / b rounds to a non-integer no integer lies
   between it and the exact quotient (round to nearest), so floorf gives the same; the
   fmod form runs only when a / b is an integer. */
static float div_floor(float a, float b) {
    float basic = a / b, f = floorf(basic);
    if (basic != f) return f;
    float mod = fmod_pos(a, b);
    float fl = (fabsf(basic) == INFINITY && fabsf(a) != INFINITY) ? a : a - mod;
    float div = fl / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1.0f;
    if (div == 0) return copysignf(0.0f, basic);
    float fd = floorf(div);
    if (div - fd > 0.5f) fd += 1.0f;
    return fd;
}

static float cube_diff(float db, float de) { return (de * de * de - db * db * db) / 3.0f; }

/* torch.ao's per-bin L2 terms of ranges (s, e) [U, J]: out [U, J, B], float32, the
   operations of l2_norms in its order (rows with a zero dst bin width are 0). The loops
   are written to vectorize: the quotients and their floors for all bins first (floorf of
   the rounded quotient is div_floor's result unless the quotient rounded to an integer;
   those few bins take div_floor), then the terms. */
int64_t qs_l2_terms(const float *counts, const float *lo, const float *hi, const int64_t *s,
                    const int64_t *e, float *out, int64_t U, int64_t J, int64_t B,
                    int64_t dst) {
    const float top = (float)(dst - 1);
    float *dens = malloc(sizeof(float) * 3 * (size_t)(B > 0 ? B : 1));
    if (!dens) return 1;
    float *restrict fb = dens + B, *restrict fe = fb + B;
    for (int64_t u = 0; u < U; ++u) {
        const double b64 = ((double)hi[u] - (double)lo[u]) / (double)B;  /* torch.ao's .item() */
        const float bw = (float)b64;
        for (int64_t i = 0; i < B; ++i) dens[i] = counts[u * B + i] / bw;
        for (int64_t j = 0; j < J; ++j) {
            float *restrict o = out + (u * J + j) * B;
            int64_t st = s[u * J + j];
            double d64 = b64 * (double)(e[u * J + j] - st + 1) / (double)dst;
            if (d64 == 0) { for (int64_t i = 0; i < B; ++i) o[i] = 0.0f; continue; }
            const float dbw = (float)d64, half = (float)(d64 / 2), nhalf = (float)(-d64 / 2);
            const float mid = cube_diff(nhalf, half);
            for (int64_t i = 0; i < B; ++i) {
                float sb = (float)(i - st) * bw, se = sb + bw;
                fb[i] = sb / dbw;
                fe[i] = se / dbw;
            }
            for (int64_t i = 0; i < B; ++i) {
                float qb = fb[i], qe = fe[i];
                fb[i] = floorf(qb);
                fe[i] = floorf(qe);
                o[i] = (float)((qb == fb[i]) | (qe == fe[i]));  /* integer quotient: below */
            }
            for (int64_t i = 0; i < B; ++i) {
                if (o[i] == 0.0f) continue;
                float sb = (float)(i - st) * bw, se = sb + bw;
                fb[i] = div_floor(sb, dbw);
                fe[i] = div_floor(se, dbw);
            }
            for (int64_t i = 0; i < B; ++i) {
                float density = dens[i];
                float sb = (float)(i - st) * bw, se = sb + bw;
                float dob = fb[i], doe = fe[i];
                dob = dob < 0 ? 0 : dob;  /* the sign of a zero changes no term */
                dob = dob > top ? top : dob;
                doe = doe < 0 ? 0 : doe;
                doe = doe > top ? top : doe;
                float n = 0.0f + density * cube_diff(sb - (dob + 0.5f) * dbw, half);
                n = n + ((doe - dob) - 1.0f) * (density * mid);
                n = n + density * cube_diff(nhalf, se - (doe * dbw + half));
                o[i] = density == 0 ? 0.0f : n;  /* 0 x finite: adds nothing */
            }
        }
    }
    free(dens);
    return 0;
}

/* torch.ao's stop rule on a chunk of priced ranges: accept while the norm does not rise;
   a unit is done at the first rise or when its walk ended (fewer than K ranges). Returns
   1 when every unit is done. */
int64_t qs_l2_accept(const double *norms, const int64_t *s, const int64_t *e,
                     const int64_t *n, double *fs, int64_t *is, int64_t U, int64_t K) {
    int64_t all = 1;
    for (int64_t u = 0; u < U; ++u) {
        int64_t *st = is + NS * u;
        if (!st[4] || n[u]) {
            for (int64_t k = 0; k < n[u]; ++k) {
                double v = norms[u * K + k];
                if (v > fs[3 * u + 2]) { st[4] = 1; break; }
                fs[3 * u + 2] = v; st[5] = s[u * K + k]; st[6] = e[u * K + k];
            }
            if (n[u] < K) st[4] = 1;
        }
        all &= st[4] != 0;
    }
    return all;
}
"""
_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = {"qs_l2_init": [_P, _P, _I, _I],
             "qs_l2_walk": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I],
             "qs_l2_result": [_P, _P, _P, _P, _P, _I, _I],
             "qs_l2_terms": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
             "qs_l2_accept": [_P, _P, _P, _P, _P, _P, _I, _I]}


def _kernel():
    return native.load("l2_walk", _SOURCE, _ARGTYPES)


class _Walk:
    """The kernel's walk of every unit, resumed chunk by chunk; its state also keeps the
    stop rule's best range and norm."""

    def __init__(self, lib, counts: torch.Tensor):
        U, B = counts.shape
        hist = counts.float()
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
    visiting order (each a change of range that torch prices)."""
    U, Bn = counts.shape
    dev = counts.device
    alpha, beta = (t.to(dev) for t in _quantile_steps())
    hist = counts.float()
    total = hist.sum(1).double()  # torch: torch.sum(histogram).item()
    csum = torch.cumsum(hist, dim=1)
    L = Bn + 2
    ks = torch.arange(L, device=dev)
    A = torch.searchsorted(csum, _thr(alpha[ks][None, :], total[:, None]), right=False)
    Bv = torch.searchsorted(csum, _thr(beta[ks][None, :], total[:, None]), right=True) - 1
    A[:, 0] = 0
    Bv[:, 0] = Bn - 1
    dA = A[:, 1:] - A[:, :-1]  # [U, L - 1]
    dB = Bv[:, :-1] - Bv[:, 1:]
    ar = torch.arange(L - 1, device=dev)
    a_max = torch.where(dA == 0, ar, L).amin(1)  # first zero gain
    b_max = torch.where(dB == 0, ar, L).amin(1)
    in_a = ar[None, :] < a_max[:, None]
    in_b = ar[None, :] < b_max[:, None]
    big = torch.iinfo(torch.int64).max // 4
    xs = torch.where(in_a, torch.cummin(dA, 1).values, -1)  # keys of the alpha steps
    ys = torch.where(in_b, torch.cummin(dB, 1).values, -1)
    # phase 1: merge (ties: beta first). alpha step a lands after every beta step with key >= its
    nb = torch.searchsorted(torch.where(in_b, -ys, big), torch.where(in_a, -xs, big), right=True)
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
    start1 = torch.where(go_a, l_cl, s0)
    end1 = torch.where(go_a, e0, r_cl)
    # a step runs if every earlier step ran without crossing; it changes the range if it moves
    stop_ev = (in_phase & (~runs | cross)).long()
    stopped = torch.cumsum(stop_ev, 1) - stop_ev
    valid1 = in_phase & runs & (stopped == 0) & ((start1 != s0) | (end1 != e0))
    ended = stop_ev.bool().any(1)  # the walk ended inside phase 1
    # phase 2: alpha stuck at a_max; the end walks down through the bins the beta steps reach
    s2 = A.gather(1, a_max.clamp(max=L - 1)[:, None])[:, 0]
    e2 = Bv.gather(1, b_max.clamp(max=L - 1)[:, None])[:, 0]
    b_end = (beta[None, :] > alpha[a_max.clamp(max=alpha.numel() - 1)][:, None]).sum(1)
    bins = torch.arange(Bn, device=dev)
    nxt = csum.gather(1, (bins + 1).clamp(max=Bn - 1)[None, :].expand(U, -1))
    first_b = _count_beta_ge(nxt, total, beta)  # first step with B(b) <= i
    first_b = torch.where(bins[None, :] + 1 < Bn, first_b, 0)
    prev = torch.cat([first_b[:, :1] * 0 + big, first_b[:, :-1]], 1)  # first step with B <= i-1
    reach = (first_b < prev) | (bins[None, :] == s2[:, None])
    reach &= (first_b <= b_end[:, None]) & (first_b > b_max[:, None])
    reach &= (bins[None, :] >= s2[:, None]) & (bins[None, :] < e2[:, None])
    reach &= ~ended[:, None]
    end2 = bins.flip(0)[None, :].expand(U, -1)  # descending
    valid2 = reach.flip(1)
    start2 = s2[:, None].expand(U, Bn)
    start = torch.cat([start1, start2], 1)
    end = torch.cat([end1, end2], 1)
    valid = torch.cat([valid1, valid2], 1)
    # compact: visited ranges first, in order
    order = torch.argsort((~valid).long(), dim=1, stable=True)
    return start.gather(1, order), end.gather(1, order), valid.gather(1, order)


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


def l2_range(hist: Hist, dst_nbins: int = 256, *, kernel: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(new_min, new_max)`` of torch.ao's non-linear search on ``hist`` (its
    ``min_val`` / ``max_val`` are ``hist.lo`` / ``hist.hi``); ``kernel=False`` walks with
    :func:`l2_path` (torch) instead of the C walk."""
    check_dst_nbins("l2_range", dst_nbins)
    U, Bn = hist.counts.shape
    dev = hist.counts.device
    lib = _kernel() if kernel and dev.type == "cpu" and U else None
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
    lo, hi = hist.lo.float().contiguous(), hist.hi.float().contiguous()
    cap = max(1, _BUDGET // max(1, U * Bn))
    step = min(8, cap)
    while True:
        s, e, n = walk.chunk_raw(step)
        terms = torch.empty(U, step, Bn)
        lib.qs_l2_terms(walk.counts.data_ptr(), lo.data_ptr(), hi.data_ptr(), s.data_ptr(),
                        e.data_ptr(), terms.data_ptr(), U, step, Bn, dst_nbins)
        norms = terms.sum(-1).double()  # torch's float32 sum, as torch.ao's norm.sum()
        if lib.qs_l2_accept(norms.data_ptr(), s.data_ptr(), e.data_ptr(), n.data_ptr(),
                            walk.fs.data_ptr(), walk.st.data_ptr(), U, step):
            break
        step = min(2 * step, cap)
    new_lo, new_hi = torch.empty(2, U).unbind(0)
    lib.qs_l2_result(lo.data_ptr(), hi.data_ptr(), walk.st.data_ptr(), new_lo.data_ptr(),
                     new_hi.data_ptr(), U, Bn)
    return new_lo, new_hi


def check_dst_nbins(who: str, dst_nbins) -> int:
    """``dst_nbins`` (torch.ao's quantized bin count) as an int in ``[2, 2 ** 16]``."""
    return check_int(who, "dst_nbins", dst_nbins, 2, 1 << 16)


def default_dst_nbins(spec) -> int:
    """torch.ao's ``dst_nbins`` for a spec: ``2 ** bits`` of an integer format, else 256."""
    fmt = spec.format
    return 2 ** fmt.bits if isinstance(fmt, IntFormat) else 256


def l2_polished_range(hist: Hist, spec, dst_nbins: int = 256, radius: int = 256, bounds=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ao's search (:func:`l2_range`), then a polish of both ends on the histogram's
    quantization error: the native ``histogram`` estimator.

    ``lo`` moves along a line of candidates (``hi`` fixed), then ``hi`` (the new ``lo``
    fixed): ``+-radius`` whole bins scored with 2 points per bin, coarse-to-fine (every
    16th bin, then the 15 either side of the best; one
    :meth:`~quantscope.estimators.error.HistogramScorer.line_argmin` call each). Then the
    search's own range and the two moves are scored with 4 points per bin and the least
    error wins (ties: the search's range), so the polish
    never has more histogram error than torch.ao's choice.
    """
    if not radius:
        return l2_range(hist, dst_nbins)
    clo, chi = l2_finalists(hist, spec, dst_nbins, radius, bounds)
    k = HistogramScorer(hist, spec, points=4)(clo, chi).argmin(1, keepdim=True)  # first minimum: the search's range on ties
    return clo.gather(1, k)[:, 0], chi.gather(1, k)[:, 0]


def l2_finalists(hist: Hist, spec, dst_nbins: int = 256, radius: int = 256, bounds=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranges ``(lo, hi)`` ``[U, 3]`` :func:`l2_polished_range` picks from: the search's
    (clipped to ``bounds``), then with ``lo`` moved, then with ``hi`` moved too."""
    lo, hi = l2_range(hist, dst_nbins)
    if bounds is not None:
        lo, hi = torch.maximum(lo, bounds[0]), torch.minimum(hi, bounds[1])
    two = HistogramScorer(hist, spec, points=2)
    los, his = [lo], [hi]
    for side in (0, 1):
        lo, hi = _move_end(two, hist, lo, hi, side, radius, 1, 16, bounds)
        los.append(lo)
        his.append(hi)
    return torch.stack(los, 1), torch.stack(his, 1)


def _move_end(scorer, hist: Hist, lo, hi, side: int, radius: int, steps: int, coarse: int,
              bounds):
    """``(lo, hi)`` with the best ``lo`` (``side`` 0, ``hi`` fixed) or the best ``hi`` (``side``
    1) over ``+-radius`` bins in ``1 / steps`` bin steps, coarse-to-fine; the current range
    wins ties."""
    line = Line.move(lo, hi, hist.width, side, radius, steps, bounds)
    best = scorer.line_argmin(line, radius * steps, coarse)
    return best.lo, best.hi
