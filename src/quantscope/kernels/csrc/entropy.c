/* Called from quantscope.estimators.entropy through quantscope.kernels; that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. */
#include "qs_threads.h"
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static double xlogx(double x) { return x > 0 ? x * log(x) : 0.0; }

/* first bin of group g of threshold i: ceil(g i / nq), nq = 2 ** sh (np.digitize's groups) */
static inline int64_t gstart(int64_t g, int64_t i, int64_t sh) {
    return (g * i + ((int64_t)1 << sh) - 1) >> sh;
}

typedef struct {
    const int64_t *h; const int64_t *stop; double *out; int64_t *pick;
    int64_t B, start, stride, C, nq, shift, czb, fallback, u0, u1, simd;
} job_t;

/* one unit's prefix sums (cs, nz, bl over b, the counts as float64; nzn, chg: see prefix)
   and, where the table is cheaper than direct terms, its group table F (else NULL) */
typedef struct {
    double *cs, *nz, *bl, *b, *F;
    int64_t *nzn, *chg;
    int64_t S, nq, sh, simd;
} unit_t;

/* G log(G / n) of the group of bins [a, e) (0 if empty): a table entry, or a direct term */
static inline double gterm(const unit_t *t, int64_t a, int64_t e) {
    double G = t->cs[e] - t->cs[a], n = t->nz[e] - t->nz[a];
    return G > 0 ? G * log(G / (n < 1 ? 1 : n)) : 0.0;
}

static inline double group(const unit_t *t, int64_t a, int64_t e) {
    return t->F ? t->F[a * t->S + (e - a)] : gterm(t, a, e);
}

/* the unit's prefix sums; returns one past its last non-empty bin (before h[0] = h[1]) */
static int64_t prefix(unit_t *t, const int64_t *h, int64_t B, int64_t czb) {
    double *cs = t->cs, *nz = t->nz, *bl = t->bl, *b = t->b;
    int64_t *chg = t->chg, *nzn = t->nzn, last = 0;
    cs[0] = nz[0] = bl[0] = 0.0;
    for (int64_t k = 0; k < B; ++k) {
        if (h[k] > 0) last = k + 1;
        b[k] = (double)h[k == 0 && czb && B > 1 ? 1 : k];
        cs[k + 1] = cs[k] + b[k];
        nz[k + 1] = nz[k] + (b[k] > 0);
        bl[k + 1] = bl[k] + xlogx(b[k]);
    }
    /* flat(a, e): the non-empty bins of [a, e) all hold one count (chg: prefix count of
       non-empty bins whose count differs from the previous non-empty bin's; nzn: the first
       non-empty bin at or after k) */
    chg[0] = 0;
    double prev = -1.0;
    for (int64_t k = 0; k < B; ++k) {
        int64_t d = 0;
        if (b[k] > 0) { d = prev >= 0 && b[k] != prev; prev = b[k]; }
        chg[k + 1] = chg[k] + d;
    }
    nzn[B] = B;
    for (int64_t k = B - 1; k >= 0; --k) nzn[k] = b[k] > 0 ? k : nzn[k + 1];
    return last;
}

/* The table F[a * S + z] of the groups [a, a + z), S = ceil(lim / nq) + 1: a group of z bins
   belongs to a threshold i with z <= ceil(i / nq), i < (z + 1) nq, and ends at or below it;
   the thresholds end at lim. table_size: its entries (logs); fill: makes them. */
static int64_t table_size(int64_t lim, int64_t nq) {
    int64_t n = 0;
    for (int64_t z = 0; z <= (lim + nq - 1) / nq; ++z) {
        int64_t amax = (z + 1) * nq < lim - z + 1 ? (z + 1) * nq : lim - z + 1;
        n += amax > 0 ? amax : 0;
    }
    return n;
}

static void fill(unit_t *t, int64_t lim) {
    for (int64_t z = 0; z < t->S; ++z) {
        int64_t amax = (z + 1) * t->nq < lim - z + 1 ? (z + 1) * t->nq : lim - z + 1;
        for (int64_t a = 0; a < amax; ++a) t->F[a * t->S + z] = gterm(t, a, a + z);
    }
}

/* sum over the nq groups of threshold i of G log(G / n), in one order whichever source the
   terms come from (table, gathered or read, or direct), so the two agree bit for bit: with
   simd, two 4-lane sums over groups g..g+3 and g+4..g+7, added lane-wise into c0..c3 */
static double cross(const unit_t *t, int64_t i) {
    const int64_t nq = t->nq, sh = t->sh;
    double c[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t g = 0;
#ifdef __AVX2__
    if (t->simd && t->F) {  /* 8 groups at a time: int32 bounds, two 4-wide gathers */
        const __m256i step8 = _mm256_set1_epi32((int)(8 * i));
        const __m256i vi = _mm256_set1_epi32((int)i), va = _mm256_set1_epi32((int)(nq - 1));
        const __m256i vS = _mm256_set1_epi32((int)t->S);
        __m256i num = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vi);
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        for (; g + 8 <= nq; g += 8) {
            __m256i a = _mm256_srli_epi32(_mm256_add_epi32(num, va), (int)sh);
            __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(num, vi), va),
                                          (int)sh);
            __m256i k = _mm256_add_epi32(_mm256_mullo_epi32(a, vS), _mm256_sub_epi32(b, a));
            s0 = _mm256_add_pd(s0, _mm256_i32gather_pd(t->F, _mm256_castsi256_si128(k), 8));
            s1 = _mm256_add_pd(s1, _mm256_i32gather_pd(t->F, _mm256_extracti128_si256(k, 1), 8));
            num = _mm256_add_epi32(num, step8);
        }
        _mm256_storeu_pd(c, _mm256_add_pd(s0, s1));
    } else if (t->simd) {  /* the same sums, one lane at a time */
        double s0[4] = {0.0, 0.0, 0.0, 0.0}, s1[4] = {0.0, 0.0, 0.0, 0.0};
        for (; g + 8 <= nq; g += 8)
            for (int l = 0; l < 4; ++l) {
                s0[l] += gterm(t, gstart(g + l, i, sh), gstart(g + l + 1, i, sh));
                s1[l] += gterm(t, gstart(g + l + 4, i, sh), gstart(g + l + 5, i, sh));
            }
        for (int l = 0; l < 4; ++l) c[l] = s0[l] + s1[l];
    }
#endif
    /* four partial sums: the additions are independent (no latency chain) */
    for (; g + 4 <= nq; g += 4)
        for (int l = 0; l < 4; ++l)
            c[l] += group(t, gstart(g + l, i, sh), gstart(g + l + 1, i, sh));
    for (; g < nq; ++g) c[0] += group(t, gstart(g, i, sh), gstart(g + 1, i, sh));
    return (c[0] + c[1]) + (c[2] + c[3]);
}

/* KL of threshold i (the module doc's closed form) */
static double kl(const unit_t *t, int64_t i, double T, double logT) {
    const double *cs = t->cs, *nz = t->nz;
    const int64_t nq = t->nq, sh = t->sh;
    double ci = cs[i], si = T - ci, blast = t->b[i - 1];
    /* P > 0 where Q = 0 (the last bin empty, outliers beyond it), or nothing below
       i: infinite whatever the sums, so they are skipped (a third of the candidates
       on a long-tailed histogram) */
    if ((si > 0 && blast == 0) || !(ci > 0)) return INFINITY;
    double plogp = t->bl[i - 1] + xlogx(blast + si);
    double xc = cross(t, i);
    int64_t lastg = (nq * (i - 1)) / i;
    int64_t qa = gstart(lastg, i, sh), qz = gstart(lastg + 1, i, sh);
    double out_term = 0.0;
    if (si > 0) {
        double G = cs[qz] - cs[qa], n = nz[qz] - nz[qa];
        double q = G / (n < 1 ? 1 : n);
        out_term = si * log(q < 1e-300 ? 1e-300 : q);
    }
    /* P and Q proportional, so TensorRT's KL is 0 exactly (its p / q are 1) where the
       closed form leaves rounding noise of either sign: the one non-empty bin below i
       is the last, or no outliers and every group flat */
    if (nz[i] == 1 && blast > 0) return 0.0;
    if (si == 0) {
        int64_t g = 0;
        for (; g < nq; ++g) {
            int64_t a = gstart(g, i, sh), e = gstart(g + 1, i, sh);
            int64_t f = t->nzn[a];
            if (f < e && t->chg[e] != t->chg[f + 1]) break;
        }
        if (g == nq) return 0.0;
    }
    return (plogp - xc - out_term) / T - logT + log(ci);
}

/* Point t->F at a table for thresholds up to stop where making it (table_size logs) costs
   less than the direct terms (nq logs per candidate): with few groups per threshold (low
   bits) or many bins per group the table is mostly never read. *F, *cap: the thread's
   buffer, grown to the largest table used. Returns 1 when out of memory. */
static int choose_table(unit_t *t, const job_t *j, int64_t stop, double **F, size_t *cap) {
    const int64_t lim = stop < j->B ? stop : j->B;
    int64_t ncand = stop < j->start ? 0 : (stop - j->start) / j->stride + 1;
    if (ncand > j->C) ncand = j->C;
    t->F = NULL;
    t->S = (lim + j->nq - 1) / j->nq + 1;
    if (table_size(lim, j->nq) >= ncand * j->nq) return 0;
    size_t need = (size_t)(lim + 1) * (size_t)t->S;  /* an empty group may start at bin lim */
    if (need > *cap) {
        double *p = realloc(*F, sizeof(double) * need);
        if (!p) return 1;
        *F = p;
        *cap = need;
    }
    t->F = *F;
    fill(t, lim);
    return 0;
}

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t B = j->B, C = j->C;
    double *cs = malloc(sizeof(double) * 4 * (size_t)(B + 1)), *F = NULL;
    int64_t *nzn = malloc(sizeof(int64_t) * 2 * (size_t)(B + 1));
    size_t cap = 0;
    if (!cs || !nzn) { free(cs); free(nzn); return (void *)1; }
#ifdef __AVX2__
    const int64_t simd = j->simd;
#else
    const int64_t simd = 0;  /* the scalar order: the table path has no gather here */
#endif
    unit_t t = {cs, cs + B + 1, cs + 2 * (B + 1), cs + 3 * (B + 1), NULL, nzn, nzn + B + 1,
                0, j->nq, j->shift, simd};
    for (int64_t u = j->u0; u < j->u1; ++u) {
        double *out = j->out + u * C;
        const int64_t last = prefix(&t, j->h + u * B, B, j->czb);
        const int64_t stop = j->stop ? j->stop[u] : last;
        const double T = t.cs[B], logT = log(T);
        if (choose_table(&t, j, stop, &F, &cap)) { free(cs); free(nzn); free(F); return (void *)1; }
        for (int64_t c = 0; c < C; ++c) {
            int64_t i = j->start + c * j->stride;
            out[c] = i > stop ? NAN : kl(&t, i, T, logT);
        }
        if (j->pick) {  /* the last minimum of the finite divergences */
            int64_t best = -1;
            double bv = INFINITY;
            for (int64_t c = 0; c < C; ++c)
                if (isfinite(out[c]) && out[c] <= bv) { bv = out[c]; best = c; }
            j->pick[u] = best >= 0 ? j->start + best * j->stride : (j->fallback ? last : -1);
        }
    }
    free(cs);
    free(nzn);
    free(F);
    return NULL;
}

/* KL of candidates i = start + c * stride (c < C) of |x| histograms h [U, B] (int64 counts;
   czb: TensorRT's h[0] = h[1] first); NaN past stop[u] (stop NULL: past the unit's last
   non-empty bin). nq a power of two (2 ** shift). With pick (else NULL): each unit's last
   argmin bin; where no divergence is finite, -1, or with fallback one past the unit's last
   non-empty bin. */
int64_t qs_entropy(const int64_t *h, const int64_t *stop, double *out, int64_t *pick, int64_t U,
                   int64_t B, int64_t start, int64_t stride, int64_t C, int64_t shift,
                   int64_t czb, int64_t fallback, int64_t threads) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > U) threads = U;
    if (threads < 1) threads = 1;
    job_t jobs[QS_MAXT];
    for (int64_t t = 0; t < threads; ++t) {
        int64_t nq = (int64_t)1 << shift, S = (B + nq - 1) / nq + 1;
        /* int32 lanes hold g * i + nq and the table index (a unit's table is at most
           (B + 1) x S); the direct terms keep the gathers' summation order under the
           same condition */
        int64_t simd = nq * (B + 2) < ((int64_t)1 << 31) && (B + 1) * S < ((int64_t)1 << 31);
        jobs[t] = (job_t){h, stop, out, pick, B, start, stride, C, nq, shift, czb, fallback,
                          U * t / threads, U * (t + 1) / threads, simd};
    }
    return qs_run_jobs(run, jobs, sizeof jobs[0], (int)threads);
}
