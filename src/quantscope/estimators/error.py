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
with the torch path to 1e-12). The torch path stays the reference and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import torch

from .. import native
from ..formats import IntFormat
from ..qparams import qparams_from_range
from ..quantize import fake_quantize_units
from ..spec import QuantSpec
from ..stats.histogram import Hist

__all__ = ["ELEMENT_BUDGET", "HistogramScorer", "histogram_error"]

#: elements of one chunk of the ``[units, candidates, bins]`` work (bounded memory)
ELEMENT_BUDGET = 1 << 18

_SOURCE = native.THREADS_C + native.FAKE_QUANT_C + r"""
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

typedef struct {
    const float *x; const double *w; const float *s, *z; double *out;
    int64_t C, P, j0, j1; float lo, hi;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t k = j->j0; k < j->j1; ++k) {
        int64_t u = k / j->C;
        j->out[k] = score(j->x + u * j->P, j->w + u * j->P, j->P, j->s[k], j->z[k], j->lo, j->hi);
    }
    return NULL;
}

/* out[u, c] for points x [U, P] (float32), weights w [U, P] (float64), scale / zero point
   s, z [U, C] (float32); threads split the U * C scores. */
int64_t qs_hist_error(const float *x, const double *w, const float *s, const float *z,
                      double *out, int64_t U, int64_t C, int64_t P, double lo, double hi,
                      int64_t threads) {
    int64_t n = U * C;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > n) threads = n;
    if (threads < 1) threads = 1;
    job_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t)
        jobs[t] = (job_t){x, w, s, z, out, C, P, n * t / threads, n * (t + 1) / threads,
                          (float)lo, (float)hi};
    qs_run_jobs(run, jobs, sizeof jobs[0], (int)threads);
    return 0;
}

/* Coarse-to-fine argmin along candidate lines s, z [L, n] (line l of unit l / G): round 0
   scores every lv[0]-th candidate (mid among them), round r the candidates lv[r] apart
   within lv[r - 1] of the best so far. A candidate replaces the best only if strictly
   lower (ties: mid, then the first), or with `first` also if equal and earlier. */
typedef struct {
    const float *x; const double *w; const float *s, *z; int64_t *idx; double *err;
    const int64_t *lv; int64_t nlv, G, n, P, mid, first, l0, l1; float lo, hi;
} ljob_t;

static void *line_run(void *arg) {
    ljob_t *j = (ljob_t *)arg;
    const int64_t n = j->n, first = j->first;
    for (int64_t l = j->l0; l < j->l1; ++l) {
        const float *xs = j->x + (l / j->G) * j->P;
        const double *ws = j->w + (l / j->G) * j->P;
        const float *sl = j->s + l * n, *zl = j->z + l * n;
        int64_t best = j->mid;
        double eb = score(xs, ws, j->P, sl[best], zl[best], j->lo, j->hi);
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
                double e = score(xs, ws, j->P, sl[k], zl[k], j->lo, j->hi);
                if (e < eb || (first && e == eb && k < best)) { eb = e; best = k; }
            }
        }
        j->idx[l] = best;
        j->err[l] = eb;
    }
    return NULL;
}

int64_t qs_line_argmin(const float *x, const double *w, const float *s, const float *z,
                       int64_t *idx, double *err, int64_t L, int64_t G, int64_t n, int64_t P,
                       double lo, double hi, int64_t mid, const int64_t *lv, int64_t nlv,
                       int64_t first, int64_t threads) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > L) threads = L;
    if (threads < 1) threads = 1;
    ljob_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t)
        jobs[t] = (ljob_t){x, w, s, z, idx, err, lv, nlv, G, n, P, mid, first,
                           L * t / threads, L * (t + 1) / threads, (float)lo, (float)hi};
    qs_run_jobs(line_run, jobs, sizeof jobs[0], (int)threads);
    return 0;
}

/* The scorer's points: per unit its occupied bins first, then its empty ones, m bins in
   all; bin i's points c + off[t] w (c = lo + (i + 0.5) w, float32 as Hist.centers) with
   weight count / p. x, wt [U, m * p]. */
int64_t qs_points(const int64_t *counts, const float *lo, const float *w, const float *off,
                  float *x, double *wt, int64_t U, int64_t B, int64_t m, int64_t p) {
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
    return 0;
}
"""
_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double
_ARGTYPES = {"qs_points": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
             "qs_hist_error": [_P, _P, _P, _P, _P, _I, _I, _I, _D, _D, _I],
             "qs_line_argmin": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _D, _D, _I, _P, _I, _I,
                                _I]}

#: below this many point evaluations torch's chunked path costs no more than a kernel call
KERNEL_MIN_WORK = 1 << 12


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
        self.kernel = kernel and _use_kernel(hist.counts, spec, KERNEL_MIN_WORK)
        counts = hist.counts
        nz = counts > 0
        width = hist.width
        if points > 1:  # sub-points at (i + (k + 0.5) / points) w
            off = _offsets(points, counts.device)
        if self.kernel and centers is None:  # the same points and weights, in one C call
            U, B = counts.shape
            m = int(nz.sum(1).max()) if counts.numel() else 0
            off = off if points > 1 else torch.zeros(1)
            x = torch.empty(U, m * points)
            w = torch.empty(U, m * points, dtype=torch.float64)
            cc, lo, wd = counts.contiguous(), hist.lo.float().contiguous(), width.contiguous()
            _kernel().qs_points(cc.data_ptr(), lo.data_ptr(), wd.data_ptr(), off.data_ptr(),
                                x.data_ptr(), w.data_ptr(), U, B, m, points)
            self.centers, self.counts = x[:, None, :], w[:, None, :]
            self._flat = (x, w)
            return
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
        spec, centers, counts = self.spec, self.centers, self.counts
        # candidate ranges come from finite histogram edges: no device read-back per chunk
        qp = qparams_from_range(lo, hi, spec, check_finite=False)
        scale = qp.effective_scale.float()
        zp = qp.zero_point.float()
        C = lo.shape[1]
        if kernel and self.kernel and U * C * centers.shape[-1] >= KERNEL_MIN_WORK:
            if self._flat is None:
                self._flat = (centers[:, 0].contiguous(), counts[:, 0].contiguous())
            x, w = self._flat
            s, z = scale.expand(U, C).contiguous(), zp.expand(U, C).contiguous()
            out = torch.empty(U, C, dtype=torch.float64)
            _kernel().qs_hist_error(x.data_ptr(), w.data_ptr(), s.data_ptr(), z.data_ptr(),
                                    out.data_ptr(), U, C, x.shape[1], float(spec.qmin),
                                    float(spec.qmax), torch.get_num_threads())
            return out
        return self._torch(scale, zp)

    def _torch(self, scale, zp):
        centers, counts, U = self.centers, self.counts, self.units
        C = scale.shape[1]
        step = max(1, ELEMENT_BUDGET // max(1, U * centers.shape[-1]))
        out = []
        for c in range(0, C, step):
            s, z = scale[:, c:c + step, None], zp[:, c:c + step, None]
            d = fake_quantize_units(centers, s, z, self.spec) - centers
            out.append((d.double().square_() * counts).sum(-1))
        return torch.cat(out, dim=1)

    def line_argmin(self, lo: torch.Tensor, hi: torch.Tensor, mid: int, coarse=1, *,
                    first: bool = False, kernel: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Best candidate along each line of ranges ``lo``, ``hi`` ``[U, G, n]``: ``(index
        [U, G], error [U, G])``. ``coarse``: the strides of the rounds, ``(k0, k1, ..., 1)``
        (an int ``k`` means ``(k, 1)``): every ``k0``-th candidate (``mid`` among them) is
        scored, then those ``k1`` apart within ``k0`` of the best so far, and so on. A
        candidate wins only if strictly lower (ties keep ``mid``, then the first), with
        ``first`` also if equal and earlier (ties: the first in the line, as ``argmin``).
        The kernel scores only the candidates it visits; the torch path scores all and
        picks by the same rule."""
        U, G, n = lo.shape
        lv = _levels(coarse)
        if U != self.units or hi.shape != lo.shape or not 0 <= mid < n:
            raise ValueError(f"line_argmin: lo, hi must be [{self.units}, lines, n] with "
                             f"0 <= mid < n, got {tuple(lo.shape)}, {tuple(hi.shape)}, "
                             f"mid={mid}")
        qp = qparams_from_range(lo.reshape(U, G * n), hi.reshape(U, G * n), self.spec,
                                check_finite=False)
        scale = qp.effective_scale.float().expand(U, G * n)
        zp = qp.zero_point.float().expand(U, G * n)
        visits = n // lv[0] + sum(2 * a // b for a, b in itertools.pairwise(lv))
        if kernel and self.kernel and U * G * visits * self.centers.shape[-1] >= KERNEL_MIN_WORK:
            if self._flat is None:
                self._flat = (self.centers[:, 0].contiguous(), self.counts[:, 0].contiguous())
            x, w = self._flat
            s, z = scale.contiguous(), zp.contiguous()
            idx = torch.empty(U, G, dtype=torch.long)
            err = torch.empty(U, G, dtype=torch.float64)
            lvt = torch.tensor(lv, dtype=torch.long)
            _kernel().qs_line_argmin(x.data_ptr(), w.data_ptr(), s.data_ptr(), z.data_ptr(),
                                     idx.data_ptr(), err.data_ptr(), U * G, G, n, x.shape[1],
                                     float(self.spec.qmin), float(self.spec.qmax), mid,
                                     lvt.data_ptr(), len(lv), int(first),
                                     torch.get_num_threads())
            return idx, err
        return _line_pick(self._torch(scale, zp).reshape(U, G, n), mid, lv, first)


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


@functools.lru_cache(maxsize=8)
def _offsets(points: int, device) -> torch.Tensor:
    """Offsets ``(k + 0.5) / points - 0.5`` of a bin's points, in bin widths (float32)."""
    return (torch.arange(points, device=device) + 0.5) / points - 0.5


def _use_kernel(t: torch.Tensor, spec: QuantSpec, work: int) -> bool:
    return (t.device.type == "cpu" and isinstance(spec.format, IntFormat)
            and work >= KERNEL_MIN_WORK and _kernel() is not None)
