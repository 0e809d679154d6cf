/* Called from quantscope.estimators.error through quantscope.kernels; that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. */
#include "qs_threads.h"
#include "qs_fakequant.h"
#include "qs_qparams.h"
/* The element format: integer codes in [qmin, qmax] (dq1), or a float format (fp: fq1 with
   f; its zero point is 0) */
typedef struct { float qmin, qmax; int fp; qs_ffmt f; } fmt_t;

/* q: qparams_consts (qmin, qmax first); fmt: NULL for an integer format, else a float
   format's {max, min_exp, mbits} */
static fmt_t fmt_of(const double *q, const double *fmt) {
    fmt_t m = {(float)q[0], (float)q[1], fmt != NULL, {0, 0, 0.0f}};
    if (fmt) m.f = qs_ffmt_of((int64_t)fmt[1], (int64_t)fmt[2], fmt[0]);
    return m;
}

/* sum_p w[p] * d[p]^2 with d[p] = DQ(x[p]) (VDQ: VW lanes), each d widened to float64 */
#ifdef VW
#define SUM_SIMD(VDQ)                                                                         \
    do {                                                                                      \
        vd a0 = DZERO(), a1 = DZERO();                                                        \
        for (; p + VW <= P; p += VW) {                                                        \
            vf d = VDQ(VLOAD(x + p));                                                         \
            vd d0 = DLO(d), d1 = DHI(d);                                                      \
            a0 = DADD(a0, DMUL(DMUL(d0, d0), DLOAD(w + p)));                                  \
            a1 = DADD(a1, DMUL(DMUL(d1, d1), DLOAD(w + p + VW / 2)));                         \
        }                                                                                     \
        acc = DSUM(DADD(a0, a1));                                                             \
    } while (0)
#endif
#define SUM_TAIL(DQ)                                                                          \
    for (; p < P; ++p) {                                                                      \
        double d = (double)DQ(x[p]);                                                          \
        acc += d * d * w[p];                                                                  \
    }

/* the sum under (s, z) of an integer format (qs_fakequant.h's float32 steps) */
static double score_int(const float *x, const double *w, int64_t P, float s, float z,
                        float lo, float hi) {
    int64_t p = 0;
    double acc = 0.0;
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(lo), vhi = VSET1(hi);
#define VDQ(v) dqv(v, vs, vz, vlo, vhi, 0)
    SUM_SIMD(VDQ);
#undef VDQ
#endif
#define SDQ(v) dq1(v, s, z, lo, hi)
    SUM_TAIL(SDQ)
#undef SDQ
    return acc;
}

/* the sum under scale s of a float format (FloatFormat.round's float32 steps: fq1, fqv) */
static double score_fp(const float *x, const double *w, int64_t P, float s, qs_ffmt f) {
    int64_t p = 0;
    double acc = 0.0;
#ifdef VW
    QS_FQV_CONSTS(s, f);
#define VDQ(v) fqv(v, vs, mf, sh, top, bottom)
    SUM_SIMD(VDQ);
#undef VDQ
#endif
#define SDQ(v) fq1(v, s, f)
    SUM_TAIL(SDQ)
#undef SDQ
    return acc;
}

static inline double score(const float *x, const double *w, int64_t P, float s, float z,
                           const fmt_t *m) {
    return m->fp ? score_fp(x, w, P, s, m->f) : score_int(x, w, P, s, z, m->qmin, m->qmax);
}

/* (s, z) of candidate k of unit u: given [U, C] (s != NULL), else from its range by
   qparams_from_range's steps (qs_qparams.h) */
static inline void qp_of(const float *s, const float *z, const double *q, int64_t i, float lo,
                         float hi, float *sk, float *zk) {
    if (s) { *sk = s[i]; *zk = z[i]; }
    else qs_qparams(lo, hi, q, sk, zk);
}

typedef struct {
    const float *x; const double *w; const float *lo, *hi, *s, *z; const double *q; double *out;
    int64_t C, P, j0, j1; fmt_t m;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t k = j->j0; k < j->j1; ++k) {
        int64_t u = k / j->C;
        float sk, zk;
        qp_of(j->s, j->z, j->q, k, j->lo[k], j->hi[k], &sk, &zk);
        j->out[k] = score(j->x + u * j->P, j->w + u * j->P, j->P, sk, zk, &j->m);
    }
    return NULL;
}

/* out[u, c]: the error of range (lo, hi) [U, C] on points x [U, P] (float32) with weights
   w [U, P] (float64); (s, z) [U, C] given or NULL (from the ranges); q: qparams_consts;
   fmt: NULL, or a float format (fmt_of: its scales are always given). Threads split the
   U * C scores. */
int64_t qs_hist_error(const float *x, const double *w, const float *lo, const float *hi,
                      const float *s, const float *z, const double *q, const double *fmt,
                      double *out, int64_t U, int64_t C, int64_t P, int64_t threads) {
    int64_t n = U * C;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > n) threads = n;
    if (threads < 1) threads = 1;
    job_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t)
        jobs[t] = (job_t){x, w, lo, hi, s, z, q, out, C, P, n * t / threads,
                          n * (t + 1) / threads, fmt_of(q, fmt)};
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
    const int64_t *lv; int64_t nlv, n, P, mid, first, u0, u1; fmt_t m;
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
    m->e = score(j->x + u * j->P, j->w + u * j->P, j->P, sk, zk, &j->m);
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
                       const float *z, const double *q, const double *fmt, int64_t *idx,
                       double *err, float *olo,
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
                           U * t / threads, U * (t + 1) / threads, fmt_of(q, fmt)};
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
