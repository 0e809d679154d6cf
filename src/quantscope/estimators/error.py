"""Quantization error of candidate ranges on a histogram: the one scoring function that
``histogram_mse`` and ``mix`` share.

Every bin stands for its count of values at its centre, as ModelOpt and Quark
score: ``error = sum_i count_i * (fake_quant(c_i) - c_i) ** 2``. The scale of a
candidate comes from :func:`quantscope.qparams_from_range` (so scale encodings
and zero points are those that run).

For integer formats on CPU a small C kernel (:mod:`quantscope.native`) scores the
candidates: the same float32 operations per point as :func:`fake_quantize_units`
(divide, add the zero point, round half to even, clamp, subtract, multiply), so the
same quantized values; only the float64 sum runs in another order (tests compare it
with the torch path to 1e-12). With fp32 scales the kernel also derives each
candidate's scale and zero point itself (``native.QPARAMS_C``, bitwise
``qparams_from_range``), and a search along a :class:`Line` builds only the candidates
it visits: one C call per line instead of some thirty small torch ops. The torch path
stays the reference and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from typing import NamedTuple

import torch

from .. import native
from ..formats import IntFormat
from ..qparams import qparams_from_range
from ..quantize import fake_quantize_units
from ..spec import QuantSpec
from ..stats.histogram import Hist

__all__ = ["ELEMENT_BUDGET", "MOVE_HI", "MOVE_LO", "SYMMETRIC", "HistogramScorer", "Line",
           "LineBest", "histogram_error"]

#: elements of one chunk of the ``[units, candidates, bins]`` work (bounded memory)
ELEMENT_BUDGET = 1 << 18

_SOURCE = native.THREADS_C + native.FAKE_QUANT_C + native.QPARAMS_C + r"""
/* sum_p w[p] * d[p]^2 with d the fake-quant error of x[p] under (s, z) (native.FAKE_QUANT_C's
   float32 steps), each d widened to float64 */
static double score(const float *x, const double *w, int64_t P, float s, float z, float lo,
                    float hi) {
    int64_t p = 0;
    double acc = 0.0;
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(lo), vhi = VSET1(hi);
    vd a0 = DZERO(), a1 = DZERO();
    for (; p + VW <= P; p += VW) {
        vf d = dqv(VLOAD(x + p), vs, vz, vlo, vhi, 0);
        vd d0 = DLO(d), d1 = DHI(d);
        a0 = DADD(a0, DMUL(DMUL(d0, d0), DLOAD(w + p)));
        a1 = DADD(a1, DMUL(DMUL(d1, d1), DLOAD(w + p + VW / 2)));
    }
    acc = DSUM(DADD(a0, a1));
#endif
    for (; p < P; ++p) {
        double d = (double)dq1(x[p], s, z, lo, hi);
        acc += d * d * w[p];
    }
    return acc;
}

/* (s, z) of candidate k of unit u: given [U, C] (s != NULL), else from its range by
   qparams_from_range's steps (native.QPARAMS_C) */
static inline void qp_of(const float *s, const float *z, const double *q, int64_t i, float lo,
                         float hi, float *sk, float *zk) {
    if (s) { *sk = s[i]; *zk = z[i]; }
    else qs_qparams(lo, hi, q, sk, zk);
}

typedef struct {
    const float *x; const double *w; const float *lo, *hi, *s, *z; const double *q; double *out;
    int64_t C, P, j0, j1;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const float qmin = (float)j->q[0], qmax = (float)j->q[1];
    for (int64_t k = j->j0; k < j->j1; ++k) {
        int64_t u = k / j->C;
        float sk, zk;
        qp_of(j->s, j->z, j->q, k, j->lo[k], j->hi[k], &sk, &zk);
        j->out[k] = score(j->x + u * j->P, j->w + u * j->P, j->P, sk, zk, qmin, qmax);
    }
    return NULL;
}

/* out[u, c]: the error of range (lo, hi) [U, C] on points x [U, P] (float32) with weights
   w [U, P] (float64); (s, z) [U, C] given or NULL (from the ranges); q: qparams_consts.
   Threads split the U * C scores. */
int64_t qs_hist_error(const float *x, const double *w, const float *lo, const float *hi,
                      const float *s, const float *z, const double *q, double *out, int64_t U,
                      int64_t C, int64_t P, int64_t threads) {
    int64_t n = U * C;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > n) threads = n;
    if (threads < 1) threads = 1;
    job_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t)
        jobs[t] = (job_t){x, w, lo, hi, s, z, q, out, C, P, n * t / threads,
                          n * (t + 1) / threads};
    qs_run_jobs(run, jobs, sizeof jobs[0], (int)threads);
    return 0;
}

/* Candidate k of unit u on a line (Line.ranges): t = ((float)(k mul + add) / div) w[u];
   kind 0 moves lo (lo0 + t, hi0), 1 moves hi (lo0, hi0 + t), 2 is (-t, t); then ordered
   (min, max) and clipped to [blo, bhi] (NULL: no bound). */
typedef struct {
    const float *lo0, *hi0, *w, *blo, *bhi;
    int64_t kind, mul, add, div;
} line_t;

static inline void line_range(const line_t *L, int64_t u, int64_t k, float *x, float *y) {
    float t = ((float)(k * L->mul + L->add) / (float)L->div) * L->w[u];
    float a, b;
    if (L->kind == 0) { a = L->lo0[u] + t; b = L->hi0[u]; }
    else if (L->kind == 1) { a = L->lo0[u]; b = L->hi0[u] + t; }
    else { a = -t; b = t; }
    float lo = a < b ? a : b, hi = a < b ? b : a;
    if (L->blo && lo < L->blo[u]) lo = L->blo[u];
    if (L->bhi && hi > L->bhi[u]) hi = L->bhi[u];
    *x = lo; *y = hi;
}

/* Coarse-to-fine argmin along each unit's line of n candidates: round 0 scores every
   lv[0]-th candidate (mid among them), round r the candidates lv[r] apart within
   lv[r - 1] of the best so far. A candidate replaces the best only if strictly lower
   (ties: mid, then the first), or with `first` also if equal and earlier. */
typedef struct {
    const float *x; const double *w; line_t line; const float *s, *z; const double *q;
    int64_t *idx; double *err; float *olo, *ohi;
    const int64_t *lv; int64_t nlv, n, P, mid, first, u0, u1;
} ljob_t;

/* the last priced (s, z) of a unit and its error: a candidate with the same qparams (the
   clipped ends of a line, plateaus of the scale) reuses it, as the score depends on
   nothing else */
typedef struct { float s, z; double e; } memo_t;

static inline double line_score(const ljob_t *j, int64_t u, int64_t k, memo_t *m) {
    float lo, hi, sk, zk;
    line_range(&j->line, u, k, &lo, &hi);
    qp_of(j->s, j->z, j->q, u * j->n + k, lo, hi, &sk, &zk);
    if (sk == m->s && zk == m->z) return m->e;
    m->s = sk;
    m->z = zk;
    m->e = score(j->x + u * j->P, j->w + u * j->P, j->P, sk, zk, (float)j->q[0],
                 (float)j->q[1]);
    return m->e;
}

static void *line_run(void *arg) {
    ljob_t *j = (ljob_t *)arg;
    const int64_t n = j->n, first = j->first;
    for (int64_t u = j->u0; u < j->u1; ++u) {
        memo_t m = {NAN, NAN, 0.0};  /* NaN equals nothing: the first candidate is priced */
        int64_t best = j->mid;
        double eb = line_score(j, u, best, &m);
        for (int64_t r = 0; r < j->nlv; ++r) {
            int64_t st = j->lv[r], c = best, a, b;
            if (r == 0) { a = j->mid % st; b = n - 1; }
            else {
                int64_t reach = (j->lv[r - 1] - 1) / st * st;
                a = c - reach; b = c + reach;
                while (a < 0) a += st;
                if (b > n - 1) b = n - 1;
            }
            for (int64_t k = a; k <= b; k += st) {
                if (k == c) continue;
                double e = line_score(j, u, k, &m);
                if (e < eb || (first && e == eb && k < best)) { eb = e; best = k; }
            }
        }
        j->idx[u] = best;
        j->err[u] = eb;
        line_range(&j->line, u, best, j->olo + u, j->ohi + u);
    }
    return NULL;
}

int64_t qs_line_search(const float *x, const double *w, const float *lo0, const float *hi0,
                       const float *wd, const float *blo, const float *bhi, const float *s,
                       const float *z, const double *q, int64_t *idx, double *err, float *olo,
                       float *ohi, int64_t U, int64_t P, int64_t kind, int64_t n, int64_t mul,
                       int64_t add, int64_t div, int64_t mid, const int64_t *lv, int64_t nlv,
                       int64_t first, int64_t threads) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > U) threads = U;
    if (threads < 1) threads = 1;
    line_t line = {lo0, hi0, wd, blo, bhi, kind, mul, add, div};
    ljob_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t)
        jobs[t] = (ljob_t){x, w, line, s, z, q, idx, err, olo, ohi, lv, nlv, n, P, mid, first,
                           U * t / threads, U * (t + 1) / threads};
    qs_run_jobs(line_run, jobs, sizeof jobs[0], (int)threads);
    return 0;
}

/* The scorer's points: per unit its occupied bins first, then its empty ones, m bins in
   all, m the most occupied bins of a unit (returned; x NULL: only that); bin i's points
   c + off[t] w (c = lo + (i + 0.5) w, float32 as Hist.centers) with weight count / p.
   x, wt [U, m * p] (room for at least that). */
int64_t qs_points(const int64_t *counts, const float *lo, const float *w, const float *off,
                  float *x, double *wt, int64_t U, int64_t B, int64_t p) {
    int64_t m = 0;
    for (int64_t u = 0; u < U; ++u) {
        int64_t k = 0;
        for (int64_t i = 0; i < B; ++i) k += counts[u * B + i] > 0;
        if (k > m) m = k;
    }
    if (!x) return m;
    for (int64_t u = 0; u < U; ++u) {
        const int64_t *cu = counts + u * B;
        float *xu = x + u * m * p;
        double *wu = wt + u * m * p;
        int64_t k = 0;
        for (int pass = 0; pass < 2 && k < m; ++pass)
            for (int64_t i = 0; i < B && k < m; ++i) {
                if ((cu[i] > 0) != (pass == 0)) continue;
                float c = lo[u] + ((float)i + 0.5f) * w[u];
                for (int64_t t = 0; t < p; ++t) {
                    xu[k * p + t] = p > 1 ? c + off[t] * w[u] : c;
                    wu[k * p + t] = (double)cu[i] / (double)p;
                }
                ++k;
            }
    }
    return m;
}
"""
_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double
_ARGTYPES = {"qs_points": [_P] * 6 + [_I] * 3,
             "qs_hist_error": [_P] * 8 + [_I] * 4,
             "qs_line_search": [_P] * 14 + [_I] * 8 + [_P] + [_I] * 3}

def _kernel():
    return native.load("hist_error", _SOURCE, _ARGTYPES)


def kernel_available() -> bool:
    """Whether the compiled scoring kernel is in use."""
    return _kernel() is not None


def histogram_error(hist: Hist, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, *,
                    centers: torch.Tensor | None = None, points: int = 1,
                    kernel: bool = True) -> torch.Tensor:
    """Squared error ``[U, C]`` of quantizing each unit's histogram with each candidate
    range ``(lo[u, c], hi[u, c])``, computed in chunks of candidates. ``centers [U, B]``
    overrides the bin centres (a reference's own float rounding of its edges). ``points > 1``
    spreads each bin's count evenly over that many points inside it (uniform density in
    the bin, as torch.ao's L2 model assumes) instead of its centre. ``kernel=False`` forces
    the torch path (the reference the kernel is tested against)."""
    return HistogramScorer(hist, spec, centers=centers, points=points, kernel=kernel)(
        lo, hi, kernel=kernel)


class HistogramScorer:
    """:func:`histogram_error` of one histogram for many candidate sets: the occupied bins'
    points and weights are prepared once (searches score several rounds of candidates)."""

    def __init__(self, hist: Hist, spec: QuantSpec, *, centers: torch.Tensor | None = None,
                 points: int = 1, kernel: bool = True):
        self.spec, self.units = spec, hist.counts.shape[0]
        self.kernel = kernel and _use_kernel(hist.counts, spec)
        self._derive, self._q = _kernel_consts(spec)
        counts = hist.counts
        width = hist.width
        off = _offsets(points, counts.device)  # sub-points at (i + (k + 0.5) / points) w
        if self.kernel and centers is None:  # the same points and weights, in one C call
            U, B = counts.shape
            cc, lo, wd = counts.contiguous(), hist.lo.float().contiguous(), width.contiguous()
            args = cc.data_ptr(), lo.data_ptr(), wd.data_ptr(), off.data_ptr()
            # room for every bin when that is small, else a first call counts the occupied
            n = B if U * B * points <= ELEMENT_BUDGET else \
                _kernel().qs_points(*args, None, None, U, B, points)
            x = torch.empty(U * n * points)
            w = torch.empty(U * n * points, dtype=torch.float64)
            m = _kernel().qs_points(*args, x.data_ptr(), w.data_ptr(), U, B, points)
            self._flat = (x[:U * m * points].view(U, m * points),
                          w[:U * m * points].view(U, m * points))
            self.centers = self.counts = None  # [U, 1, P] views when the torch path asks
            return
        nz = counts > 0
        centers = hist.centers() if centers is None else centers.float()
        if counts.shape[0] == 1:  # one unit: index the occupied bins directly
            keep = nz[0].nonzero()[:, 0]
            if keep.numel() < counts.shape[1]:
                centers, counts = centers[:, keep], counts[:, keep]
        else:
            m = int(nz.sum(1).max()) if counts.numel() else 0
            if m < counts.shape[1]:  # score only occupied bins (empty ones add nothing): [U, m]
                keep = torch.sort((~nz).to(torch.int8), dim=1, stable=True).indices[:, :m]
                centers, counts = centers.gather(1, keep), counts.gather(1, keep)
        centers = centers[:, None, :]  # [U, 1, B]
        counts = counts.double()[:, None, :]
        if points > 1:
            centers = (centers[..., None] + off * width[:, None, None, None]).flatten(-2)
            counts = (counts[..., None] / points).expand(*counts.shape, points).flatten(-2)
        self.centers, self.counts = centers, counts  # [U, 1, P]
        self._flat = None

    def __call__(self, lo: torch.Tensor, hi: torch.Tensor, *, kernel: bool = True
                 ) -> torch.Tensor:
        """Errors ``[U, C]`` of the candidate ranges ``lo``, ``hi`` ``[U, C]``."""
        U = self.units
        if lo.dim() != 2 or lo.shape != hi.shape or lo.shape[0] != U:
            raise ValueError(f"histogram_error: lo and hi must be [units, candidates] with "
                             f"{U} units, got {tuple(lo.shape)} and {tuple(hi.shape)}")
        C = lo.shape[1]
        if kernel and self.kernel:
            x, w = self._points()
            lo, hi = lo.float().contiguous(), hi.float().contiguous()
            s, z = self._qparams(lo, hi)
            out = torch.empty(U, C, dtype=torch.float64)
            _kernel().qs_hist_error(x.data_ptr(), w.data_ptr(), lo.data_ptr(), hi.data_ptr(),
                                    _ptr(s), _ptr(z), self._q.data_ptr(), out.data_ptr(), U, C,
                                    x.shape[1], torch.get_num_threads())
            return out
        return self._torch(*self._qparams(lo, hi, torch_only=True))

    def _points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The points and weights ``[U, P]`` (contiguous), as the kernel takes them."""
        if self._flat is None:
            self._flat = (self.centers[:, 0].contiguous(), self.counts[:, 0].contiguous())
        return self._flat

    def _qparams(self, lo, hi, torch_only: bool = False):
        """``(scale, zero point)`` float32 ``[U, C]`` of the ranges; ``(None, None)`` where the
        kernel derives them itself (native.QPARAMS_C)."""
        if self._derive and not torch_only:
            return None, None
        qp = qparams_from_range(lo, hi, self.spec, check_finite=False)
        U, C = lo.shape
        return (qp.effective_scale.float().expand(U, C).contiguous(),
                qp.zero_point.float().expand(U, C).contiguous())

    def _torch(self, scale, zp):
        if self.centers is None:
            self.centers, self.counts = (t[:, None, :] for t in self._flat)
        centers, counts, U = self.centers, self.counts, self.units
        C = scale.shape[1]
        step = max(1, ELEMENT_BUDGET // max(1, U * centers.shape[-1]))
        out = []
        for c in range(0, C, step):
            s, z = scale[:, c:c + step, None], zp[:, c:c + step, None]
            d = fake_quantize_units(centers, s, z, self.spec) - centers
            out.append((d.double().square_() * counts).sum(-1))
        return torch.cat(out, dim=1)

    def line_argmin(self, line: Line, mid: int, coarse=1, *, first: bool = False,
                    kernel: bool = True) -> LineBest:
        """Best candidate along each unit's ``line``: a :class:`LineBest` (``[U]`` each).
        ``coarse``: the strides of the rounds, ``(k0, k1, ..., 1)`` (an int ``k`` means
        ``(k, 1)``): every ``k0``-th candidate (``mid`` among them) is scored, then those
        ``k1`` apart within ``k0`` of the best so far, and so on. A candidate wins only if
        strictly lower (ties keep ``mid``, then the first), with ``first`` also if equal and
        earlier (ties: the first in the line, as ``argmin``). The kernel generates and
        prices only the candidates it visits; the torch path builds the whole line
        (:meth:`Line.ranges`), scores all and picks by the same rule."""
        U, n = self.units, line.n
        lv = _levels(coarse)
        per_unit = (line.lo, line.hi, line.width, *(line.bounds or (None, None)))
        if any(t is not None and t.shape != (U,) for t in per_unit) or not 0 <= mid < n:
            raise ValueError(f"line_argmin: the line's ends, width and bounds must be [{U}] "
                             f"(one per unit) and 0 <= mid < {n}, got shapes "
                             f"{[None if t is None else tuple(t.shape) for t in per_unit]} "
                             f"and mid={mid}")
        if kernel and self.kernel:
            x, w = self._points()
            f = [None if t is None else t.float().contiguous() for t in per_unit]
            s = z = None
            if not self._derive:  # scale encodings the kernel does not derive
                s, z = self._qparams(*line.ranges(), torch_only=True)
            idx = torch.empty(U, dtype=torch.long)
            err = torch.empty(U, dtype=torch.float64)
            blo, bhi = torch.empty(2, U).unbind(0)
            lvt = _as_tensor(lv)
            _kernel().qs_line_search(x.data_ptr(), w.data_ptr(), *map(_ptr, f), _ptr(s),
                                     _ptr(z), self._q.data_ptr(), idx.data_ptr(), err.data_ptr(),
                                     blo.data_ptr(), bhi.data_ptr(), U, x.shape[1], line.kind,
                                     n, line.mul, line.add, line.div, mid, lvt.data_ptr(),
                                     len(lv), int(first), torch.get_num_threads())
            return LineBest(blo, bhi, idx, err)
        clo, chi = line.ranges()
        idx, err = _line_pick(self._torch(*self._qparams(clo, chi, torch_only=True)), mid, lv,
                              first)
        return LineBest(clo.gather(1, idx[:, None])[:, 0], chi.gather(1, idx[:, None])[:, 0],
                        idx, err)


class LineBest(NamedTuple):
    """:meth:`HistogramScorer.line_argmin`'s choice per unit: its range, index and error."""

    lo: torch.Tensor
    hi: torch.Tensor
    index: torch.Tensor
    error: torch.Tensor


class Line(NamedTuple):
    """``n`` candidate ranges per unit, one line of a search, built alike by :meth:`ranges`
    (torch, the reference) and by the kernel (which builds only those it visits): with
    ``t_k = float32(k * mul + add) / div * width`` (float32), candidate ``k`` is
    ``(lo + t_k, hi)`` (``kind`` :data:`MOVE_LO`), ``(lo, hi + t_k)`` (:data:`MOVE_HI`) or
    ``(-t_k, t_k)`` (:data:`SYMMETRIC`), ordered, then clipped to ``bounds = (lo_min,
    hi_max)``."""

    kind: int
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    width: torch.Tensor
    n: int
    mul: int
    add: int
    div: int
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def move(cls, lo, hi, width, side: int, radius: int, steps: int, bounds=None) -> Line:
        """``lo`` (``side`` 0, ``hi`` fixed) or ``hi`` (``side`` 1) moved by ``d`` bin widths,
        ``d`` from ``-radius`` to ``radius`` in ``1 / steps`` (``mid = radius * steps`` is no
        move)."""
        return cls(side, lo, hi, width, 2 * radius * steps + 1, 1, -radius * steps, steps,
                   bounds)

    @classmethod
    def centres(cls, width, start: int, stride: int, n: int, bounds=None) -> Line:
        """``(-c, c)`` for the bin centres ``c = (j + 0.5) width``, ``j = start + k stride``
        (ModelOpt's and Quark's candidates; ``(2 j + 1) / 2`` is ``j + 0.5`` exactly)."""
        return cls(SYMMETRIC, None, None, width, n, 2 * stride, 2 * start + 1, 2, bounds)

    def ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every candidate, ``(lo, hi)`` ``[U, n]``."""
        k = torch.arange(self.n, device=self.width.device)
        t = (k * self.mul + self.add).float() / self.div * self.width[:, None]
        if self.kind == MOVE_LO:
            a, b = self.lo[:, None] + t, self.hi[:, None].expand_as(t)
        elif self.kind == MOVE_HI:
            a, b = self.lo[:, None].expand_as(t), self.hi[:, None] + t
        else:
            a, b = -t, t
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        if self.bounds is not None:
            lo = torch.maximum(lo, self.bounds[0][:, None])
            hi = torch.minimum(hi, self.bounds[1][:, None])
        return lo, hi


#: :class:`Line` kinds
MOVE_LO, MOVE_HI, SYMMETRIC = 0, 1, 2


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _levels(coarse) -> tuple[int, ...]:
    if isinstance(coarse, int):
        coarse = (coarse, 1) if coarse > 1 else (1,)
    lv = tuple(coarse)
    if (not lv or any(not isinstance(k, int) or k < 1 for k in lv)
            or any(a <= b for a, b in itertools.pairwise(lv))):
        raise ValueError(f"line_argmin: coarse must be a positive int or decreasing positive "
                         f"ints, got {coarse!r}")
    return lv


def _line_pick(err: torch.Tensor, mid: int, levels, first: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`HistogramScorer.line_argmin`'s rule on the errors of every candidate
    ``[U, G, n]``."""
    n = err.shape[-1]
    ar = torch.arange(n, device=err.device)

    def pick(mask, cur):
        e_cur = err.gather(-1, cur[..., None])[..., 0]
        cand = torch.where(mask, err, torch.full_like(err, float("inf")))
        k = cand.argmin(-1)  # first minimum
        v = cand.gather(-1, k[..., None])[..., 0]
        better = (v < e_cur) | ((v == e_cur) & (k < cur)) if first else v < e_cur
        return torch.where(better, k, cur)

    cur = torch.full(err.shape[:-1], mid, dtype=torch.long, device=err.device)
    cur = pick(((ar - mid) % levels[0] == 0).expand_as(err), cur)
    for prev, st in itertools.pairwise(levels):
        d = ar - cur[..., None]
        cur = pick((d % st == 0) & (d.abs() < prev), cur)
    return cur, err.gather(-1, cur[..., None])[..., 0]


@functools.lru_cache(maxsize=32)
def _as_tensor(levels: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _kernel_consts(spec: QuantSpec) -> tuple[bool, torch.Tensor]:
    """Whether the kernel derives ``spec``'s scales itself, and its constants (float64):
    :func:`native.qparams_consts`, else just ``qmin, qmax``."""
    consts = native.qparams_consts(spec)
    return consts is not None, torch.tensor(consts or [float(spec.qmin), float(spec.qmax)],
                                            dtype=torch.float64)


@functools.lru_cache(maxsize=8)
def _offsets(points: int, device) -> torch.Tensor:
    """Offsets ``(k + 0.5) / points - 0.5`` of a bin's points, in bin widths (float32)."""
    return (torch.arange(points, device=device) + 0.5) / points - 0.5


def _use_kernel(t: torch.Tensor, spec: QuantSpec) -> bool:
    return (t.device.type == "cpu" and isinstance(spec.format, IntFormat)
            and _kernel() is not None)
