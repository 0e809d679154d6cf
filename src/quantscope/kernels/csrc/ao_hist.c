/* Called from quantscope.stats.ao_histogram through quantscope.kernels; that module's doc says
   what it computes (torch.ao HistogramObserver's histogram) and tests compare it with its
   torch reference (torch.ao's own ops) bit for bit. qs_ao_histc64 is the int64 histc of the
   first-grid histograms (quantscope.stats.histogram.linear_counts' torch.histc). */
#include "qs_threads.h"
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LAG 8 /* blocks of 16 indices computed ahead of the one being counted */
/* The counting pass prefetches this far ahead as non-temporal (each line is read once,
   backwards, which the hardware's stream prefetch follows less readily); 0-3 % on the
   compat observer's eight 12.6 MB batches. The min / max pass reads forwards, where the
   hardware prefetch is better alone (the same hint there cost 20 %). */
#define PF_BYTES 4096

/* The bin math of ATen's histc kernel, in float32: trunc((x - lo) * B / (hi - lo)), the
   right edge in the last bin; values outside [lo, hi] (and NaN) go to the dump bin B. */
typedef struct {
    float lo, hi, bf, d;
    int32_t last, dump;
} grid_t;

/* a non-temporal prefetch of the line `off` bytes from p (past either end of x: a hint,
   never a fault; the address is integer arithmetic, not a pointer out of its array) */
static inline void prefetch(const float *p, intptr_t off) {
    const char *a = (const char *)((uintptr_t)p + (uintptr_t)off);
#if defined(__AVX2__)
    _mm_prefetch(a, _MM_HINT_NTA);
#else
    __builtin_prefetch(a, 0, 0);
#endif
}

/* the running min / max and NaN flag of a fused pass */
typedef struct {
#if defined(__AVX512F__)
    __m512 mn, mx;
    __mmask16 nan;
#elif defined(__AVX2__)
    __m256 mn, mx, nan;
#else
    float mn, mx;
    int nan;
#endif
} track_t;

static void track_init(track_t *t) {
#if defined(__AVX512F__)
    t->mn = _mm512_set1_ps(INFINITY); t->mx = _mm512_set1_ps(-INFINITY); t->nan = 0;
#elif defined(__AVX2__)
    t->mn = _mm256_set1_ps(INFINITY); t->mx = _mm256_set1_ps(-INFINITY);
    t->nan = _mm256_setzero_ps();
#else
    t->mn = INFINITY; t->mx = -INFINITY; t->nan = 0;
#endif
}

/* one vector (or value) into the running min / max (vminps / vmaxps: NaN tracked on the
   side; a tie of -0 and 0 may keep either, as torch.aminmax's vector loop) */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void track_v(track_t *t, __m512 v) {
    t->mn = _mm512_min_ps(v, t->mn);
    t->mx = _mm512_max_ps(v, t->mx);
    t->nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}
#elif defined(__AVX2__)
static inline __attribute__((always_inline)) void track_v(track_t *t, __m256 v) {
    t->mn = _mm256_min_ps(v, t->mn);
    t->mx = _mm256_max_ps(v, t->mx);
    t->nan = _mm256_or_ps(t->nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
#else
static inline void track_v(track_t *t, float v) {
    t->mn = v < t->mn ? v : t->mn;
    t->mx = v > t->mx ? v : t->mx;
    t->nan |= v != v;
}
#endif

/* min / max of the tracked values (NaN when one was NaN, as torch.aminmax) into mm[2] */
static void track_done(const track_t *t, float *mm) {
    float mn = INFINITY, mx = -INFINITY;
    int nan;
#if defined(__AVX512F__)
    float a[16], b[16];
    _mm512_storeu_ps(a, t->mn); _mm512_storeu_ps(b, t->mx);
    for (int q = 0; q < 16; ++q) { mn = a[q] < mn ? a[q] : mn; mx = b[q] > mx ? b[q] : mx; }
    nan = t->nan != 0;
#elif defined(__AVX2__)
    float a[8], b[8];
    _mm256_storeu_ps(a, t->mn); _mm256_storeu_ps(b, t->mx);
    for (int q = 0; q < 8; ++q) { mn = a[q] < mn ? a[q] : mn; mx = b[q] > mx ? b[q] : mx; }
    nan = _mm256_movemask_ps(t->nan) != 0;
#else
    mn = t->mn; mx = t->mx; nan = t->nan;
#endif
    mm[0] = nan ? NAN : mn;
    mm[1] = nan ? NAN : mx;
}

/* the bins of x[0, 16) into r[16] (ab: of |x|, a constant of each caller); with tr, their
   min / max too (track_v) */
static inline __attribute__((always_inline)) void
index16(const float *x, const grid_t *g, int32_t *r, track_t *tr, int ab) {
#if defined(__AVX512F__)
    const __m512 raw = _mm512_loadu_ps(x), lo = _mm512_set1_ps(g->lo);
    const __m512 v = ab ? _mm512_abs_ps(raw) : raw;
    const __m512 p = _mm512_div_ps(_mm512_mul_ps(_mm512_sub_ps(v, lo), _mm512_set1_ps(g->bf)),
                                   _mm512_set1_ps(g->d));
    const __m512i k = _mm512_min_epi32(_mm512_cvttps_epi32(p), _mm512_set1_epi32(g->last));
    const __mmask16 in = _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ)
                         & _mm512_cmp_ps_mask(v, _mm512_set1_ps(g->hi), _CMP_LE_OQ);
    _mm512_store_si512((void *)r, _mm512_mask_mov_epi32(_mm512_set1_epi32(g->dump), in, k));
    if (tr) track_v(tr, v);
#elif defined(__AVX2__)
    const __m256 lo = _mm256_set1_ps(g->lo), hi = _mm256_set1_ps(g->hi);
    const __m256 bf = _mm256_set1_ps(g->bf), d = _mm256_set1_ps(g->d);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 16; h += 8) {
        const __m256 raw = _mm256_loadu_ps(x + h);
        const __m256 v = ab ? _mm256_andnot_ps(sign, raw) : raw;
        const __m256 p = _mm256_div_ps(_mm256_mul_ps(_mm256_sub_ps(v, lo), bf), d);
        const __m256i k = _mm256_min_epi32(_mm256_cvttps_epi32(p), _mm256_set1_epi32(g->last));
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ),
                                        _mm256_cmp_ps(v, hi, _CMP_LE_OQ));
        _mm256_store_si256((__m256i *)(r + h), _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(_mm256_set1_epi32(g->dump)), _mm256_castsi256_ps(k), in)));
        if (tr) track_v(tr, v);
    }
#else
    for (int q = 0; q < 16; ++q) {
        const float v = ab ? fabsf(x[q]) : x[q];
        if (v >= g->lo && v <= g->hi) {
            const int32_t k = (int32_t)((v - g->lo) * g->bf / g->d); /* in [0, B] */
            r[q] = k > g->last ? g->last : k;
        } else {
            r[q] = g->dump;
        }
        if (tr) track_v(tr, v);
    }
#endif
}

/* cp[bin]++ for each value of x[0, n) (cp: B + 1 int32, the last the dump), software
   pipelined: the indices of block j + LAG are computed (vector work) while those of block j
   are counted (one scalar increment each, the bound), so the two overlap; counting straight
   from a fresh store would wait on it. With tr, the min / max of x too. */
static inline __attribute__((always_inline)) void
count(const float *x, int64_t n, const grid_t *g, int32_t *cp, track_t *tr, int ab) {
    int32_t ring[LAG][16] __attribute__((aligned(64)));
    const int64_t blocks = n / 16;
    if (n > 16 * blocks) { /* the tail, padded with its first value (the same min / max) */
        const int64_t rem = n - 16 * blocks;
        float tail[16];
        int32_t r[16] __attribute__((aligned(64)));
        for (int64_t q = 0; q < 16; ++q) tail[q] = x[16 * blocks + (q < rem ? q : 0)];
        index16(tail, g, r, tr, ab);
        for (int64_t q = 0; q < rem; ++q) cp[r[q]]++;
    }
    /* last block first: a batch just read front to back (for its min / max) still has its
       end in cache and its start likeliest evicted; the counts do not depend on the order */
    for (int64_t i = 0; i < blocks; ++i) {
        int32_t *r = ring[i % LAG];
        if (i >= LAG)
            for (int q = 0; q < 16; ++q) cp[r[q]]++;
        prefetch(x + 16 * (blocks - 1 - i), -PF_BYTES);
        index16(x + 16 * (blocks - 1 - i), g, r, tr, ab);
    }
    for (int64_t t = blocks > LAG ? blocks - LAG : 0; t < blocks; ++t)
        for (int q = 0; q < 16; ++q) cp[ring[t % LAG][q]]++;
}

/* one thread's share of x, counted into its own bins (and min / max when tracking) */
typedef struct {
    const float *x;
    int64_t n;
    const grid_t *g;
    int32_t *cp;
    track_t tr;
} job_t;

static void *count_plain(void *a) {
    job_t *j = (job_t *)a;
    count(j->x, j->n, j->g, j->cp, NULL, 0);
    return NULL;
}

static void *count_abs(void *a) { /* the bins of |x| */
    job_t *j = (job_t *)a;
    count(j->x, j->n, j->g, j->cp, NULL, 1);
    return NULL;
}

static void *count_track(void *a) {
    job_t *j = (job_t *)a;
    count(j->x, j->n, j->g, j->cp, &j->tr, 0);
    return NULL;
}

/* The threads a pass over x[0, n) runs on: at most `threads` (and QS_MAXT), 2**18 values a
   thread at least (~0.1 ms of counting: more than starting the thread), at least 1. Each
   share into jobs[t] (x, n, a fresh min / max track). */
static int64_t split(const float *x, int64_t n, int64_t threads, job_t *jobs) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > n >> 18) threads = n >> 18;
    if (threads < 1) threads = 1;
    for (int64_t t = 0; t < threads; ++t) {
        const int64_t a = n * t / threads, e = n * (t + 1) / threads;
        jobs[t].x = x + a;
        jobs[t].n = e - a;
        track_init(&jobs[t].tr);
    }
    return threads;
}

/* the min / max of all shares' tracks into mm[2] (NaN when one saw a NaN) */
static void tracks_done(const job_t *jobs, int64_t threads, float *mm) {
    track_done(&jobs[0].tr, mm);
    for (int64_t t = 1; t < threads; ++t) {
        float m[2];
        track_done(&jobs[t].tr, m);
        mm[0] = (m[0] != m[0] || m[0] < mm[0]) ? m[0] : mm[0]; /* NaN stays */
        mm[1] = (m[1] != m[1] || m[1] > mm[1]) ? m[1] : mm[1];
    }
}

/* out = base + the bins of x[0, n) (float32 adds of exact int32 counts: n < 2**24; out may
   be base), x split over up to `threads` threads (no more bins than values a thread), each
   with its own bins. With mm, the min / max of x into mm[2] (NaN when x holds one), and out
   is written only when every value lies in [g->lo, g->hi] (else returns 2: a fused pass
   that missed leaves the state as it was). Returns 1 (nothing written) when out of
   memory. */
static int count_all(const float *x, int64_t n, const grid_t *g, int64_t threads,
                     const float *base, float *out, float *mm) {
    const int64_t B = g->dump, W = B + 1;
    if (threads > n / W) threads = n / W;
    job_t jobs[QS_MAXT];
    threads = split(x, n, threads, jobs);
    int32_t *cp = (int32_t *)calloc((size_t)(threads * W), sizeof(int32_t));
    if (!cp) return 1;
    for (int64_t t = 0; t < threads; ++t) {
        jobs[t].g = g;
        jobs[t].cp = cp + t * W;
    }
    qs_run_jobs(mm ? count_track : count_plain, jobs, sizeof jobs[0], (int)threads);
    if (mm) {
        tracks_done(jobs, threads, mm);
        if (!(mm[0] >= g->lo && mm[1] <= g->hi)) { /* false for NaN */
            free(cp);
            return 2;
        }
    }
    for (int64_t k = 0; k < B; ++k) {
        int32_t c = 0;
        for (int64_t t = 0; t < threads; ++t) c += cp[t * W + k];
        out[k] = base[k] + (float)c;
    }
    free(cp);
    return 0;
}

/* the min / max of x[0, n) into tr (16 values at a time; the tail padded with its first) */
static void track_all(const float *x, int64_t n, track_t *tr) {
    const int64_t blocks = n / 16;
    for (int64_t i = 0; i < blocks; ++i) {
        const float *p = x + 16 * i;
#if defined(__AVX512F__)
        track_v(tr, _mm512_loadu_ps(p));
#elif defined(__AVX2__)
        track_v(tr, _mm256_loadu_ps(p));
        track_v(tr, _mm256_loadu_ps(p + 8));
#else
        for (int q = 0; q < 16; ++q) track_v(tr, p[q]);
#endif
    }
    if (n > 16 * blocks) {
        float tail[16];
        for (int64_t q = 0; q < 16; ++q) tail[q] = x[16 * blocks + (q < n - 16 * blocks ? q : 0)];
        track_all(tail, 16, tr);
    }
}

static void *minmax_job(void *a) {
    job_t *j = (job_t *)a;
    track_all(j->x, j->n, &j->tr);
    return NULL;
}

/* torch.aminmax(x) into mm[2] (NaN when x holds one), x[0, n) (n >= 1) split over up to
   `threads` threads */
int64_t qs_ao_minmax(const float *x, int64_t n, float *mm, int64_t threads) {
    job_t jobs[QS_MAXT];
    threads = split(x, n, threads, jobs);
    qs_run_jobs(minmax_job, jobs, sizeof jobs[0], (int)threads);
    tracks_done(jobs, threads, mm);
    return 0;
}

/* the grid of torch.histc(x, B, min=lo, max=hi); 0 where the caller must take torch's path:
   lo >= hi, an infinite width, a width whose (x - lo) * B can overflow to inf (torch counts
   such values in bin 0; the truncation here would give INT_MIN, an index out of bounds), or
   n >= 2**24 (torch's float32 counts saturate there). For x in [lo, hi], x - lo <= d and
   (x - lo) * B <= d * B in float32 (rounding is monotonic): a finite d * B rules overflow out,
   and the hot loop needs no clamp. */
static int grid_of(float lo, float hi, int64_t B, grid_t *g) { /* (grid() but for n) */
    const float d = hi - lo;
    if (!(lo < hi) || !isfinite(d) || B < 1 || B > (1 << 24) || !isfinite(d * (float)B))
        return 0;
    g->lo = lo; g->hi = hi; g->bf = (float)B; g->d = d;
    g->last = (int32_t)B - 1; g->dump = (int32_t)B;
    return 1;
}

static int grid(float lo, float hi, int64_t n, int64_t B, grid_t *g) {
    return n < ((int64_t)1 << 24) && grid_of(lo, hi, B, g);
}

/* out = base + torch.histc(x, B, min=lo, max=hi) (out may be base), on up to `threads`
   threads. Returns 1 (nothing written) where grid() does not apply. */
int64_t qs_ao_histc(const float *x, int64_t n, float lo, float hi, int64_t B,
                    const float *base, float *out, int64_t threads) {
    grid_t g;
    if (!grid(lo, hi, n, B, &g)) return 1;
    return count_all(x, n, &g, threads, base, out, NULL);
}

/* counts[k]++ (int64 [B], no dump bin) for each value of x[0, n) (ab: of |x|) in the bins of
   g, on this thread: count()'s cp[bin]++ straight into the caller's counts, a value outside
   [lo, hi] (bin B) skipped; the same software pipeline and order. */
static inline __attribute__((always_inline)) void
count64(const float *x, int64_t n, const grid_t *g, int64_t *c, int ab) {
    int32_t ring[LAG][16] __attribute__((aligned(64)));
    const int32_t B = g->dump;
    const int64_t blocks = n / 16;
    if (n > 16 * blocks) { /* the tail, padded with its first value (not counted) */
        const int64_t rem = n - 16 * blocks;
        float tail[16];
        int32_t r[16] __attribute__((aligned(64)));
        for (int64_t q = 0; q < 16; ++q) tail[q] = x[16 * blocks + (q < rem ? q : 0)];
        index16(tail, g, r, NULL, ab);
        for (int64_t q = 0; q < rem; ++q)
            if (r[q] < B) c[r[q]]++;
    }
    for (int64_t i = 0; i < blocks; ++i) { /* last block first, as count() */
        int32_t *r = ring[i % LAG];
        if (i >= LAG)
            for (int q = 0; q < 16; ++q)
                if (r[q] < B) c[r[q]]++;
        prefetch(x + 16 * (blocks - 1 - i), -PF_BYTES);
        index16(x + 16 * (blocks - 1 - i), g, r, NULL, ab);
    }
    for (int64_t t = blocks > LAG ? blocks - LAG : 0; t < blocks; ++t)
        for (int q = 0; q < 16; ++q)
            if (ring[t % LAG][q] < B) c[ring[t % LAG][q]]++;
}

/* counts [B] (int64) += torch.histc(ab ? |x| : x, B, min=lo, max=hi) of x[0, n) (n < 2**31:
   no float32 count to saturate, so any batch), the first grid of quantscope's histogram
   observers (stats/histogram.py's linear_counts, whose torch.histc of |x| it equals); on one
   thread straight into counts, on several (2**18 values each at least, no more than the
   bins' values a thread) each into its own int32 bins, then summed. Returns 1 (nothing
   written) where the grid does not apply (see grid()) or out of memory. */
int64_t qs_ao_histc64(const float *x, int64_t n, float lo, float hi, int64_t B, int64_t *counts,
                      int64_t ab, int64_t threads) {
    grid_t g;
    if (n < 0 || n >= ((int64_t)1 << 31) || !grid_of(lo, hi, B, &g)) return 1;
    const int64_t W = B + 1;
    if (threads > n / W) threads = n / W;
    job_t jobs[QS_MAXT];
    threads = split(x, n, threads, jobs);
    if (threads == 1) {
        if (ab) count64(x, n, &g, counts, 1);
        else count64(x, n, &g, counts, 0);
        return 0;
    }
    int32_t *cp = (int32_t *)calloc((size_t)(threads * W), sizeof(int32_t));
    if (!cp) return 1;
    for (int64_t t = 0; t < threads; ++t) {
        jobs[t].g = &g;
        jobs[t].cp = cp + t * W;
    }
    qs_run_jobs(ab ? count_abs : count_plain, jobs, sizeof jobs[0], (int)threads);
    for (int64_t k = 0; k < B; ++k) {
        int64_t c = 0;
        for (int64_t t = 0; t < threads; ++t) c += cp[t * W + k];
        counts[k] += c;
    }
    free(cp);
    return 0;
}

/* One read of x for a batch that may fall inside the current range [lo, hi]: its min / max
   (NaN when x holds one, as torch.aminmax) into mm[0], mm[1], and, when every value lies in
   [lo, hi], out = base + its histc on that range (as qs_ao_histc; out may be base); returns
   0 then. Returns 1 when some value lies outside (or is NaN): mm is written, out is not.
   Returns 2 (nothing written) where qs_ao_histc would not apply or out of memory. */
int64_t qs_ao_fused(const float *x, int64_t n, float lo, float hi, int64_t B,
                    const float *base, float *out, float *mm, int64_t threads) {
    grid_t g;
    if (n < 1 || !grid(lo, hi, n, B, &g)) return 2;
    const int r = count_all(x, n, &g, threads, base, out, mm);
    return r == 1 ? 2 : r == 2;
}

/* The first piece p in [a, n) whose mid point lin[p] + half is >= e (n if none; the mid
   points rise from a on): from the guess g, galloping out from it and then bisecting, so a
   good guess costs two probes and a bad one a logarithm. */
static int64_t first_at_least(const float *lin, float half, int64_t a, int64_t n, float e,
                              double g) {
    int64_t b = n; /* the answer lies in [a, b] */
    int64_t p = !(g > (double)a) ? a : (g >= (double)b ? b : (int64_t)ceil(g));
    int64_t step = 1;
    if (p < b && lin[p] + half < e) { /* above p: gallop up */
        a = p + 1;
        while (a < b) {
            const int64_t q = a + step - 1 < b - 1 ? a + step - 1 : b - 1;
            if (lin[q] + half < e) { a = q + 1; step *= 2; }
            else { b = q; break; }
        }
    } else { /* at p or below: gallop down */
        b = p;
        while (a < b) {
            const int64_t q = b - step > a ? b - step : a;
            if (lin[q] + half >= e) { b = q; step *= 2; }
            else { a = q + 1; break; }
        }
    }
    while (a < b) {
        const int64_t m = a + ((b - a) >> 1);
        if (lin[m] + half < e) a = m + 1;
        else b = m;
    }
    return a;
}

/* torch.ao's _upscale_histogram: each of the B bins split into `rate` pieces of weight
   hist[i] / rate at the mid points lin[i] + bin / 2 (lin [B * rate + 1]: torch.linspace(olo,
   ohi, B * rate + 1); bin = (ohi - olo) / (B * rate), float32 as torch computes it), each
   piece added (in order, float32, as torch.bincount) into the bin of the new edges
   bounds [B + 1] that holds its mid point (torch.bucketize(right=True) - 1, clamped to
   [0, B - 1]); out [B] is overwritten. */
int64_t qs_ao_upscale(const float *hist, int64_t B, int64_t rate, const float *lin, float olo,
                      float ohi, const float *bounds, float *out) {
    const float r = (float)rate, half = 0.5f * ((ohi - olo) / (float)(B * rate));
    const int64_t n = B * rate;
    int falls = 0;
    for (int64_t k = 0; k < B; ++k) falls |= !(bounds[k] <= bounds[k + 1]);
    for (int64_t i = 0; i + 1 < n; ++i) falls |= !(lin[i] <= lin[i + 1]); /* then mids too */
    int64_t *start = falls ? NULL : (int64_t *)malloc((size_t)(B + 1) * sizeof(int64_t));
    if (start) {
        /* edges and mid points both rise (as linspace's do), so new bin j takes the run of
           pieces [start[j], start[j + 1]): start[j] the first piece whose mid point reaches
           edge j (bucketize counts edge j from there on), start[0] = 0 and start[B] = n for
           the clamped ends. Each run is summed in a register: the same float32 adds, in
           the same order, as out[j] += w piece by piece. The guess is where a linspace
           puts the edge; first_at_least makes it exact. */
        const double per = (double)n / ((double)ohi - (double)olo); /* pieces per unit */
        start[0] = 0;
        start[B] = n;
        for (int64_t j = 1; j < B; ++j)
            start[j] = first_at_least(lin, half, start[j - 1], n, bounds[j],
                                      ((double)bounds[j] - (double)olo) * per - 0.5);
        int64_t src = 0, q = 0; /* the piece being added is src * rate + q */
        float w = B ? hist[0] / r : 0.0f;
        for (int64_t j = 0; j < B; ++j) {
            float acc = 0.0f;
            for (int64_t c = start[j + 1] - start[j]; c > 0; --c) {
                acc += w;
                if (++q == rate) {
                    q = 0;
                    w = ++src < B ? hist[src] / r : 0.0f;
                }
            }
            out[j] = acc;
        }
        free(start);
        return 0;
    }
    for (int64_t k = 0; k < B; ++k) out[k] = 0.0f;
    float w = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        if (i % rate == 0) w = hist[i / rate] / r; /* once per old bin */
        const float v = lin[i] + half;
        int64_t a = 0, e = B + 1; /* torch.bucketize(right=True): the count of edges <= v */
        while (a < e) {
            const int64_t mid = a + ((e - a) >> 1);
            if (!(bounds[mid] > v)) a = mid + 1;
            else e = mid;
        }
        int64_t t = a - 1;
        t = t < 0 ? 0 : (t > B - 1 ? B - 1 : t);
        out[t] += w;
    }
    return 0;
}

/* torch.ao's update for a batch that widens the range [olo, ohi] to [lo, hi], in one call:
   out [B] = the old bins moved as qs_ao_upscale moves them + torch.histc(x, B, min=lo,
   max=hi) (as qs_ao_histc), on up to `threads` threads; out may be hist (the state updated
   in place, as torch.ao's copy_). Returns 1 (nothing written) where qs_ao_histc would not
   apply or out of memory. */
int64_t qs_ao_widen(const float *hist, int64_t B, int64_t rate, const float *lin, float olo,
                    float ohi, const float *bounds, const float *x, int64_t n, float lo,
                    float hi, float *out, int64_t threads) {
    grid_t g;
    if (!grid(lo, hi, n, B, &g)) return 1;
    float *moved = (float *)malloc((size_t)B * sizeof(float));
    if (!moved) return 1;
    qs_ao_upscale(hist, B, rate, lin, olo, ohi, bounds, moved);
    const int r = count_all(x, n, &g, threads, moved, out, NULL);
    free(moved);
    return r;
}
