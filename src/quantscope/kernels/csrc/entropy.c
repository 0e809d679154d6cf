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

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t B = j->B, C = j->C, nq = j->nq, S = (B + nq - 1) / nq + 1;
    /* F has B + 1 rows: an empty group may start at bin B (i = B < nq) */
    double *cs = malloc(sizeof(double) * (size_t)(4 + S) * (B + 1));
    int64_t *nzn = malloc(sizeof(int64_t) * 2 * (size_t)(B + 1));
    if (!cs || !nzn) { free(cs); free(nzn); return (void *)1; }
    double *nz = cs + B + 1, *bl = nz + B + 1, *b = bl + B + 1, *F = b + B + 1;
    int64_t *chg = nzn + B + 1;
    for (int64_t u = j->u0; u < j->u1; ++u) {
        const int64_t *h = j->h + u * B;
        double *out = j->out + u * C;
        int64_t last = 0;  /* one past the last non-empty bin (before h[0] = h[1]) */
        cs[0] = nz[0] = bl[0] = 0.0;
        for (int64_t k = 0; k < B; ++k) {
            if (h[k] > 0) last = k + 1;
            b[k] = (double)h[k == 0 && j->czb && B > 1 ? 1 : k];
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
        const int64_t stop = j->stop ? j->stop[u] : last;
        const double T = cs[B], logT = log(T);
        /* F[a * S + z]: G log(G / n) of the group of bins [a, a + z) (0 if empty). A group
           of z bins belongs to a threshold i with z <= ceil(i / nq), i < (z + 1) nq, and ends
           at or below it; the thresholds end at lim: only those entries are read and made. */
        const int64_t lim = stop < B ? stop : B;
        for (int64_t z = 0; z < S && z <= (lim + nq - 1) / nq; ++z) {
            int64_t amax = (z + 1) * nq < lim - z + 1 ? (z + 1) * nq : lim - z + 1;
            for (int64_t a = 0; a < amax; ++a) {
                int64_t e = a + z;
                double G = cs[e] - cs[a], n = nz[e] - nz[a];
                F[a * S + z] = G > 0 ? G * log(G / (n < 1 ? 1 : n)) : 0.0;
            }
        }
        for (int64_t c = 0; c < C; ++c) {
            int64_t i = j->start + c * j->stride;
            if (i > stop) { out[c] = NAN; continue; }
            double ci = cs[i], si = T - ci, blast = b[i - 1];
            /* P > 0 where Q = 0 (the last bin empty, outliers beyond it), or nothing below
               i: infinite whatever the sums, so they are skipped (a third of the candidates
               on a long-tailed histogram) */
            if ((si > 0 && blast == 0) || !(ci > 0)) { out[c] = INFINITY; continue; }
            double plogp = bl[i - 1] + xlogx(blast + si);
            /* four partial sums: the additions are independent (no latency chain) */
            double c0 = 0.0, c1 = 0.0, c2 = 0.0, c3 = 0.0;
            const int64_t add = nq - 1, sh = j->shift;
            int64_t g = 0;
            (void)add;  /* the SIMD branch's */
#ifdef __AVX2__
            if (j->simd) {  /* 8 groups at a time: int32 bounds, two 4-wide gathers */
                const __m256i step8 = _mm256_set1_epi32((int)(8 * i));
                const __m256i vi = _mm256_set1_epi32((int)i), va = _mm256_set1_epi32((int)add);
                const __m256i vS = _mm256_set1_epi32((int)S);
                __m256i num = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vi);
                __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
                for (; g + 8 <= nq; g += 8) {
                    __m256i a = _mm256_srli_epi32(_mm256_add_epi32(num, va), (int)sh);
                    __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(num, vi), va),
                                                  (int)sh);
                    __m256i k = _mm256_add_epi32(_mm256_mullo_epi32(a, vS), _mm256_sub_epi32(b, a));
                    s0 = _mm256_add_pd(s0, _mm256_i32gather_pd(F, _mm256_castsi256_si128(k), 8));
                    s1 = _mm256_add_pd(s1, _mm256_i32gather_pd(F, _mm256_extracti128_si256(k, 1), 8));
                    num = _mm256_add_epi32(num, step8);
                }
                double t[4];
                _mm256_storeu_pd(t, _mm256_add_pd(s0, s1));
                c0 = t[0]; c1 = t[1]; c2 = t[2]; c3 = t[3];
            }
#endif
            for (; g + 4 <= nq; g += 4) {
                int64_t a0 = gstart(g, i, sh), a1 = gstart(g + 1, i, sh);
                int64_t a2 = gstart(g + 2, i, sh), a3 = gstart(g + 3, i, sh);
                int64_t a4 = gstart(g + 4, i, sh);
                c0 += F[a0 * S + (a1 - a0)];
                c1 += F[a1 * S + (a2 - a1)];
                c2 += F[a2 * S + (a3 - a2)];
                c3 += F[a3 * S + (a4 - a3)];
            }
            for (; g < nq; ++g) {
                int64_t a0 = gstart(g, i, sh), a1 = gstart(g + 1, i, sh);
                c0 += F[a0 * S + (a1 - a0)];
            }
            double cross = (c0 + c1) + (c2 + c3);
            int64_t lastg = (nq * (i - 1)) / i;
            int64_t qa = gstart(lastg, i, sh), qz = gstart(lastg + 1, i, sh);
            double out_term = 0.0;
            if (si > 0) {
                double G = cs[qz] - cs[qa], n = nz[qz] - nz[qa];
                double q = G / (n < 1 ? 1 : n);
                out_term = si * log(q < 1e-300 ? 1e-300 : q);
            }
            out[c] = (plogp - cross - out_term) / T - logT + log(ci);
            /* P and Q proportional, so TensorRT's KL is 0 exactly (its p / q are 1) where the
               closed form leaves rounding noise of either sign: the one non-empty bin below i
               is the last, or no outliers and every group flat */
            if (nz[i] == 1 && blast > 0) out[c] = 0.0;
            else if (si == 0) {
                int64_t g2 = 0;
                for (; g2 < nq; ++g2) {
                    int64_t a = gstart(g2, i, sh), e = gstart(g2 + 1, i, sh);
                    int64_t f = nzn[a];
                    if (f < e && chg[e] != chg[f + 1]) break;
                }
                if (g2 == nq) out[c] = 0.0;
            }
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
        /* int32 lanes hold g * i + nq and the table index */
        int64_t simd = nq * (B + 2) < ((int64_t)1 << 31) && (B + 1) * S < ((int64_t)1 << 31);
        jobs[t] = (job_t){h, stop, out, pick, B, start, stride, C, nq, shift, czb, fallback,
                          U * t / threads, U * (t + 1) / threads, simd};
    }
    return qs_run_jobs(run, jobs, sizeof jobs[0], (int)threads);
}
