/* Called from quantscope.stats.hist_kernel through quantscope.kernels; that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. */
#include "qs_threads.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define E_MIN (-126)
#define E_MAX 126
#define MAG_BITS 22
#define COPIES 8
/* values binned into the int32 copies between two flushes: a copy never passes 2**31 */
#define BLOCK ((int64_t)1 << 30)
#if COPIES != 8
#error the vector loops multiply by COPIES with a shift of 3
#endif

/* pow2(): exactly 2**e as float32, from the bits */
static float pow2f(int64_t e) {
    union { int32_t i; float f; } u;
    u.i = (int32_t)((e + 127) << 23);
    return u.f;
}

/* _fits(): the aligned grid of width 2**e holds [lo, hi] in bins bins (float32, as torch) */
static int fits(float lo, float hi, int64_t e, int64_t bins) {
    float inv = pow2f(-e);
    float a = floorf(hi * inv), b = floorf(lo * inv);
    float d = a - b;
    d = d + 1.0f;
    return d <= (float)bins;
}

static int64_t clampe(int64_t e) { return e < E_MIN ? E_MIN : (e > E_MAX ? E_MAX : e); }

/* grid_exponent() for one finite unit */
static int64_t grid_exponent(float lo, float hi, int64_t bins) {
    double span = (double)hi - (double)lo;
    double g = ceil(log2(span / (double)(bins - 1)));
    if (g != g) g = 0.0;
    else if (g == INFINITY) g = E_MAX;
    else if (g == -INFINITY) g = E_MIN;
    g = g < E_MIN ? E_MIN : (g > E_MAX ? E_MAX : g);
    int64_t guess = (int64_t)g, e = E_MAX;
    for (int64_t d = 1; d >= -2; --d) {
        int64_t cand = clampe(guess + d);
        if (fits(lo, hi, cand, bins) && cand < e) e = cand;
    }
    float a = fabsf(lo), b = fabsf(hi);
    float amax = a < b ? b : a;
    int ex = 0;
    frexpf(amax, &ex);
    /* the magnitude floor only where there is a magnitude: frexpf(0) reads 0, not -inf */
    int64_t mag = amax > 0.0f ? (int64_t)ex - 1 - MAG_BITS : E_MIN;
    return clampe(e > mag ? e : mag);
}

/* update()'s range clamp and _regrid()'s grid for one unit: the new lo / hi / exp / first.
   1: a NaN / inf, or a state exponent outside the float32 range (the torch path decides). */
static int grid_unit(float blo, float bhi, int absolute, int64_t bins, float slo, float shi,
                     int64_t sexp, float *nlo, float *nhi, int64_t *nexp, int64_t *nfirst) {
    float l, h;
    if (absolute) {
        float a = fabsf(blo), b = fabsf(bhi);
        h = (a != a || b != b) ? NAN : (a < b ? b : a);
        l = 0.0f;
    } else {  /* clamp(max=0) / clamp(min=0): NaN and -0 kept, as torch */
        l = blo > 0.0f ? 0.0f : blo;
        h = bhi < 0.0f ? 0.0f : bhi;
    }
    if (l != l || h != h || slo != slo || shi != shi || sexp < E_MIN || sexp > E_MAX) return 1;
    float lj = l < slo ? l : slo, hj = shi < h ? h : shi;  /* torch.minimum / maximum */
    if (!isfinite(lj) || !isfinite(hj)) return 1;
    int64_t e = grid_exponent(lj, hj, bins);
    e = sexp > e ? sexp : e;
    *nlo = lj;
    *nhi = hj;
    *nexp = e;
    *nfirst = absolute ? 0 : (int64_t)floorf(lj * pow2f(-e));
    return 0;
}

/* rebin(): bin first + i at width 2**exp goes whole into floor((first + i) / 2**m) - nfirst
   (clamped), m = nexp - exp; adds into out. Unsigned adds wrap as torch's int64 do. */
static void rebin_add(const int64_t *c, int64_t n, int64_t first, int64_t exp, int64_t nexp,
                      int64_t nfirst, int64_t bins, int64_t *out) {
    int64_t m = nexp - exp;
    m = m < 0 ? 0 : (m > 62 ? 62 : m);
    for (int64_t i = 0; i < n; ++i) {
        if (!c[i]) continue;
        int64_t a = (int64_t)((uint64_t)first + (uint64_t)i);
        int64_t k = (int64_t)((uint64_t)(a >> m) - (uint64_t)nfirst);
        k = k < 0 ? 0 : (k > bins - 1 ? bins - 1 : k);
        out[k] += c[i];
    }
}

/* ---------------------------------------------------------------- binning loops */

/* One value's bin as _bin() computes it: floor(x * inv) (|.| if absolute) - ff, clamped to
   [0, W - 1] with NaN to 0; *miss set when the value was outside [0, W) or NaN. */
static inline int32_t bin1(float x, float inv, float ff, float wm1, int absolute, int *miss) {
    float v = x * inv;
    if (absolute) v = fabsf(v);
    v = floorf(v);
    v = v - ff;
    *miss |= !(v >= 0.0f && v <= wm1);
    v = v > 0.0f ? v : 0.0f;
    v = v < wm1 ? v : wm1;
    return (int32_t)v;
}

typedef struct {
    const float *x;
    int64_t n;            /* values */
    float inv, ff;        /* 2**-e and the float index of bin 0 */
    int32_t W;            /* bins */
    int absolute, track;  /* track: min / max / largest negative value and misses */
    int64_t *out;         /* int64 [W] the counts are added into */
    int32_t h0;           /* first of HOT bins counted in registers (AVX-512), or -1 */
    float lo, hi, neg;    /* outputs when tracking */
    int miss;
    int direct;           /* count straight into out, no copies (a short span: see DIRECT) */
} span_t;

#define HOT 16  /* bins counted in registers: 4 vectors of 16 lanes x 4 8-bit fields */

/* The start of the HOT adjacent bins of c [n] holding the most counts, shifted by offset into
   a span's bins [0, W); -1 unless they hold at least 60 % of all (then counting them in
   registers, bin_span's hot path, pays for compressing the other values out). */
static int32_t hot_start(const int64_t *c, int64_t n, int64_t offset, int32_t W) {
    int64_t total = 0, run = 0, best = -1, at = -1;
    for (int64_t i = 0; i < n; ++i) {
        total += c[i];
        run += c[i];
        if (i >= HOT) run -= c[i - HOT];
        if (i >= HOT - 1 && run > best) { best = run; at = i - (HOT - 1); }
    }
    if (at < 0 || total <= 0 || 5 * best < 3 * total) return -1;
    at += offset;
    return at < 0 || at + HOT > W ? -1 : (int32_t)at;
}

#define BUF 512  /* indices computed per block, then counted (see bin_span) */

#if defined(__AVX512F__)
/* the 8-bit fields of the 16 lanes of acc (bins 4a + f, field f of accumulator a) added
   into hot[HOT] */
static void hot_flush(const __m512i *acc, int64_t *hot) {
    uint32_t t[16];
    for (int a = 0; a < 4; ++a) {
        _mm512_storeu_si512((void *)t, acc[a]);
        for (int q = 0; q < 16; ++q)
            for (int f = 0; f < 4; ++f) hot[4 * a + f] += (int64_t)((t[q] >> (8 * f)) & 255);
    }
}
#endif

/* The fused pass counts a batch of fewer values than DIRECT x its window's bins straight into
   the window's int64 bins: the copies (COPIES x W int32 to zero, then flush) cost more than
   such a batch (2K values in a 3 x 2048-bin window: 192 KB for 8 KB of values). Measured:
   2.4-3x faster up to 2K values; at 1-2 W values direct is 1.3-2x faster on spread values
   and as fast on values crowded into a few bins, which from 2 W on the copies' register
   path counts up to 1.35x faster. */
#define DIRECT 2

/* Count the ns bin indices of buf into the int64 bins out */
static inline __attribute__((always_inline)) void count_direct(int64_t *out, const int32_t *buf,
                                                               int ns) {
    for (int j = 0; j < ns; ++j) out[buf[j]]++;
}

/* Count the ns copy indices of buf into cp (8 increments per step: independent stores) */
static inline __attribute__((always_inline)) void count_indices(int32_t *cp, const int32_t *buf,
                                                                int ns) {
    int j = 0;
    for (; j + 8 <= ns; j += 8) {
        cp[buf[j]]++; cp[buf[j + 1]]++; cp[buf[j + 2]]++; cp[buf[j + 3]]++;
        cp[buf[j + 4]]++; cp[buf[j + 5]]++; cp[buf[j + 6]]++; cp[buf[j + 7]]++;
    }
    for (; j < ns; ++j) cp[buf[j]]++;
}

/* Add the COPIES copies of each of the W bins of cp into out, and zero them */
static inline __attribute__((always_inline)) void flush_copies(int32_t *cp, int32_t W,
                                                               int64_t *out) {
    for (int32_t k = 0; k < W; ++k) {
        int32_t *c = cp + (int64_t)k * COPIES;
        int64_t t = 0;
        for (int q = 0; q < COPIES; ++q) { t += c[q]; c[q] = 0; }
        out[k] += t;
    }
}

#if defined(__AVX512F__)
/* Fold the 16 lanes of the tracked min / max / largest negative value into lo / hi / neg */
static inline __attribute__((always_inline)) void fold_ends(__m512 vlo, __m512 vhi, __m512 vneg,
                                                            float *lo, float *hi, float *neg) {
    float t[16];
    _mm512_storeu_ps(t, vlo);
    for (int q = 0; q < 16; ++q) *lo = t[q] < *lo ? t[q] : *lo;
    _mm512_storeu_ps(t, vhi);
    for (int q = 0; q < 16; ++q) *hi = t[q] > *hi ? t[q] : *hi;
    _mm512_storeu_ps(t, vneg);
    for (int q = 0; q < 16; ++q) *neg = t[q] > *neg ? t[q] : *neg;
}
#elif defined(__AVX2__)
/* Fold the 8 lanes of the tracked min / max / largest negative value into lo / hi / neg */
static inline __attribute__((always_inline)) void fold_ends(__m256 vlo, __m256 vhi, __m256 vneg,
                                                            float *lo, float *hi, float *neg) {
    float t[8];
    _mm256_storeu_ps(t, vlo);
    for (int q = 0; q < 8; ++q) *lo = t[q] < *lo ? t[q] : *lo;
    _mm256_storeu_ps(t, vhi);
    for (int q = 0; q < 8; ++q) *hi = t[q] > *hi ? t[q] : *hi;
    _mm256_storeu_ps(t, vneg);
    for (int q = 0; q < 8; ++q) *neg = t[q] > *neg ? t[q] : *neg;
}
#endif

/* Bins x[0, n) into out through COPIES interleaved int32 copies (cp[bin * COPIES + copy],
   zero on entry and on return; value j goes to copy j % COPIES, so a run of values in one
   bin is not one chain of dependent increments). Per block of BUF values, the indices are
   computed vectorized into a buffer first, then counted: counting straight from the vector
   register waits on each store-to-load of the index (measured 1.5-2x slower).
   Returns the values it binned: all, or (hot path) fewer when the hot bins turn out to hold
   under half of the values seen (after 16 blocks): the caller bins the rest without them. */
static inline __attribute__((always_inline)) int64_t
bin_span_(span_t *s, int32_t *cp, const int absolute, const int track, const int hot,
          const int direct) {
    const float *x = s->x;
    const int64_t n = s->n;
    const int32_t W = s->W;
    const float inv = s->inv, ff = s->ff, wm1 = (float)(W - 1);
    float lo = INFINITY, hi = -INFINITY, neg = -INFINITY;
    int miss = 0;
    int32_t buf[BUF + 16] __attribute__((aligned(64)));
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv), vff = _mm512_set1_ps(ff);
    const __m512 vzero = _mm512_setzero_ps(), vwm1 = _mm512_set1_ps(wm1);
    const __m512i vabs = _mm512_set1_epi32(0x7fffffff);
    const __m512i vW = _mm512_set1_epi32(W), vWm1 = _mm512_set1_epi32(W - 1);
    const __m512i lane = _mm512_and_si512(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(COPIES - 1));
    __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
    __m512 vneg = _mm512_set1_ps(-INFINITY);
    __mmask16 vout = 0;
    /* hot path: HOT bins [h0, h0 + HOT) counted in 8-bit fields: lane value 1 << 8 (d - 4a)
       added to accumulator a (0 when the shift is outside [0, 32): vpsllvd gives 0 for counts
       >= 32, negative ones included), so no masks; added out every 255 vectors. The other
       values' indices are compressed into buf. */
    const __m512i vh0 = _mm512_set1_epi32(hot ? s->h0 : 0), vhot = _mm512_set1_epi32(HOT);
    const __m512i one = _mm512_set1_epi32(1), v32 = _mm512_set1_epi32(32);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    int64_t hotc[HOT] = {0};
    int it = 0;
#elif defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv), vff = _mm256_set1_ps(ff);
    const __m256 vzero = _mm256_setzero_ps(), vwm1 = _mm256_set1_ps(wm1);
    const __m256 vabs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 vninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_and_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(COPIES - 1));
    __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY), vneg = vninf;
    __m256 vout = vzero;
#endif
    int64_t since = 0, cold = 0;  /* values counted since the last flush; not hot */
    int64_t b = 0;
    int stop = 0;
    for (; b < n && !stop; b += BUF) {
        const int m = n - b < BUF ? (int)(n - b) : BUF;
        const float *xb = x + b;
        int j = 0, ns = 0;  /* ns: indices in buf */
#if defined(__AVX512F__)
        for (; j + 16 <= m; j += 16) {
            __m512 x16 = _mm512_loadu_ps(xb + j);
            if (track) {
                vlo = _mm512_min_ps(vlo, x16);
                vhi = _mm512_max_ps(vhi, x16);
                if (!absolute)
                    vneg = _mm512_mask_max_ps(vneg, _mm512_cmp_ps_mask(x16, vzero, _CMP_LT_OQ),
                                              vneg, x16);
            }
            __m512 v = _mm512_mul_ps(x16, vinv);
            if (absolute) v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), vabs));
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            v = _mm512_sub_ps(v, vff);
            __m512i k;
            if (track) {  /* a miss discards the bins: the index need only stay in [0, W) */
                k = _mm512_cvttps_epi32(v);  /* NaN, beyond int32: 0x80000000 */
                vout |= _mm512_cmpge_epu32_mask(k, vW);  /* negative: as unsigned, >= W */
                k = _mm512_min_epu32(k, vWm1);
            } else {
                v = _mm512_max_ps(v, vzero);  /* NaN -> 0 (maxps returns the 2nd operand) */
                v = _mm512_min_ps(v, vwm1);
                k = _mm512_cvttps_epi32(v);
            }
            /* x COPIES, + the copy (direct: the bin) */
            __m512i kc = direct ? k : _mm512_add_epi32(_mm512_slli_epi32(k, 3), lane);
            if (hot) {
                __m512i d = _mm512_sub_epi32(k, vh0);
                __mmask16 in = _mm512_cmplt_epu32_mask(d, vhot);
                __m512i sh = _mm512_slli_epi32(d, 3);
                acc[0] = _mm512_add_epi32(acc[0], _mm512_sllv_epi32(one, sh));
                sh = _mm512_sub_epi32(sh, v32);
                acc[1] = _mm512_add_epi32(acc[1], _mm512_sllv_epi32(one, sh));
                sh = _mm512_sub_epi32(sh, v32);
                acc[2] = _mm512_add_epi32(acc[2], _mm512_sllv_epi32(one, sh));
                sh = _mm512_sub_epi32(sh, v32);
                acc[3] = _mm512_add_epi32(acc[3], _mm512_sllv_epi32(one, sh));
                __mmask16 rest = (__mmask16)~in;
                _mm512_storeu_si512((void *)(buf + ns), _mm512_maskz_compress_epi32(rest, kc));
                ns += __builtin_popcount((unsigned)rest);
                if (++it == 255) {
                    hot_flush(acc, hotc);
                    for (int a = 0; a < 4; ++a) acc[a] = _mm512_setzero_si512();
                    it = 0;
                }
            } else {
                _mm512_store_si512((void *)(buf + j), kc);
            }
        }
        if (!hot) ns = j;
#elif defined(__AVX2__)
        for (; j + 8 <= m; j += 8) {
            __m256 x8 = _mm256_loadu_ps(xb + j);
            if (track) {
                vlo = _mm256_min_ps(vlo, x8);
                vhi = _mm256_max_ps(vhi, x8);
                if (!absolute)
                    vneg = _mm256_max_ps(vneg, _mm256_blendv_ps(
                        vninf, x8, _mm256_cmp_ps(x8, vzero, _CMP_LT_OQ)));
            }
            __m256 v = _mm256_mul_ps(x8, vinv);
            if (absolute) v = _mm256_and_ps(v, vabs);
            v = _mm256_floor_ps(v);
            v = _mm256_sub_ps(v, vff);
            if (track)
                vout = _mm256_or_ps(vout, _mm256_or_ps(_mm256_cmp_ps(v, vzero, _CMP_NGE_UQ),
                                                       _mm256_cmp_ps(v, vwm1, _CMP_NLE_UQ)));
            v = _mm256_max_ps(v, vzero);
            v = _mm256_min_ps(v, vwm1);
            __m256i k = _mm256_cvttps_epi32(v);
            if (!direct) k = _mm256_add_epi32(_mm256_slli_epi32(k, 3), lane);
            _mm256_store_si256((__m256i *)(buf + j), k);
        }
        ns = j;
#endif
        for (; j < m; ++j) {
            float xv = xb[j];
            if (track) {
                lo = xv < lo ? xv : lo;
                hi = xv > hi ? xv : hi;
                if (!absolute && xv < 0.0f && xv > neg) neg = xv;
            }
            int32_t k = bin1(xv, inv, ff, wm1, absolute, &miss);
            buf[ns++] = direct ? k : k * COPIES + (j & (COPIES - 1));
        }
        if (direct) {
            count_direct(s->out, buf, ns);
            continue;
        }
        count_indices(cp, buf, ns);
        since += m;
        if (hot) {
            cold += ns;
            stop = b >= 16 * BUF && 2 * cold > b + m;
        }
        if (since >= BLOCK || b + m >= n || stop) {
            flush_copies(cp, W, s->out);
            since = 0;
        }
    }
#if defined(__AVX512F__)
    if (hot) {
        hot_flush(acc, hotc);
        for (int q = 0; q < HOT; ++q) s->out[s->h0 + q] += hotc[q];
    }
#endif
    if (track) {
#if defined(__AVX512F__)
        fold_ends(vlo, vhi, vneg, &lo, &hi, &neg);
        miss |= vout != 0;
#elif defined(__AVX2__)
        fold_ends(vlo, vhi, vneg, &lo, &hi, &neg);
        miss |= _mm256_movemask_ps(vout) != 0;
#endif
    }
    s->lo = lo; s->hi = hi; s->neg = neg; s->miss = miss;
    return b < n ? b : n;
}

/* bin_span_ compiled for each (absolute, track, hot): no flag tests in the loop */
static void bin_span(span_t *s, int32_t *cp) {
#if defined(__AVX512F__)
    if (s->h0 >= 0 && s->h0 + HOT <= s->W) {
        int64_t done;
        if (s->absolute)
            done = s->track ? bin_span_(s, cp, 1, 1, 1, 0) : bin_span_(s, cp, 1, 0, 1, 0);
        else
            done = s->track ? bin_span_(s, cp, 0, 1, 1, 0) : bin_span_(s, cp, 0, 0, 1, 0);
        if (done < s->n) {  /* the hot bins were a poor guess: the rest without them */
            span_t r = *s;
            r.x += done;
            r.n -= done;
            r.h0 = -1;
            bin_span(&r, cp);
            s->lo = r.lo < s->lo ? r.lo : s->lo;
            s->hi = r.hi > s->hi ? r.hi : s->hi;
            s->neg = r.neg > s->neg ? r.neg : s->neg;
            s->miss |= r.miss;
        }
        return;
    }
#endif
    if (s->direct) {  /* (only the fused pass's short spans: tracked) */
        if (s->absolute) bin_span_(s, cp, 1, 1, 0, 1); else bin_span_(s, cp, 0, 1, 0, 1);
    } else if (s->absolute) {
        if (s->track) bin_span_(s, cp, 1, 1, 0, 0); else bin_span_(s, cp, 1, 0, 0, 0);
    } else {
        if (s->track) bin_span_(s, cp, 0, 1, 0, 0); else bin_span_(s, cp, 0, 0, 0, 0);
    }
}

/* Bins directly into int64 counts (short units: no copies to zero and flush). */
static void bin_direct(const float *x, int64_t n, float inv, float ff, int32_t W, int absolute,
                       int64_t *out) {
    const float wm1 = (float)(W - 1);
    int miss = 0;
    for (int64_t i = 0; i < n; ++i) out[bin1(x[i], inv, ff, wm1, absolute, &miss)]++;
}

typedef struct { span_t s; int32_t *cp; int ok; } sjob_t;

static void *srun(void *p) {
    sjob_t *j = (sjob_t *)p;
    int32_t *cp = j->cp;
    if (!cp && !j->s.direct) cp = (int32_t *)calloc((size_t)COPIES * j->s.W, sizeof(int32_t));
    if (!cp && !j->s.direct) { j->ok = 0; return NULL; }
    bin_span(&j->s, cp);
    if (!j->cp) free(cp);
    j->ok = 1;
    return NULL;
}

/* One span split over threads; each its own copies and int64 bins, summed into s->out; the
   trackers combined. 0: out of memory. */
static int bin_split(span_t *s, int threads) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1 || s->n < ((int64_t)1 << 16)) threads = 1;
    int64_t *work = NULL;
    if (threads > 1) {
        work = (int64_t *)calloc((size_t)(threads - 1) * s->W, sizeof(int64_t));
        if (!work) threads = 1;
    }
    sjob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t) {
        int64_t a = s->n * t / threads, b = s->n * (t + 1) / threads;
        jobs[t].s = *s;
        jobs[t].s.x = s->x + a;
        jobs[t].s.n = b - a;
        jobs[t].s.out = t == 0 ? s->out : work + (int64_t)(t - 1) * s->W;
        jobs[t].cp = NULL;
        jobs[t].ok = 0;
    }
    qs_run_jobs(srun, jobs, sizeof jobs[0], threads);
    int ok = jobs[0].ok;
    for (int t = 1; t < threads; ++t) ok &= jobs[t].ok;
    span_t *r = &jobs[0].s;
    for (int t = 1; t < threads; ++t) {
        span_t *o = &jobs[t].s;
        for (int32_t k = 0; k < s->W; ++k) s->out[k] += o->out[k];
        r->lo = o->lo < r->lo ? o->lo : r->lo;
        r->hi = o->hi > r->hi ? o->hi : r->hi;
        r->neg = o->neg > r->neg ? o->neg : r->neg;
        r->miss |= o->miss;
    }
    s->lo = r->lo; s->hi = r->hi; s->neg = r->neg; s->miss = r->miss;
    free(work);
    return ok;
}

/* hot_start() for counts that are still empty (a first batch): from the bins of 4 runs of
   1024 values spread over x (a guess: it only picks the fast path). */
static int32_t sample_hot(const float *x, int64_t n, float inv, float ff, int32_t W,
                          int absolute) {
    if (n < 16 * 1024) return -1;
    int64_t *c = (int64_t *)calloc((size_t)W, sizeof(int64_t));
    if (!c) return -1;
    const float wm1 = (float)(W - 1);
    int miss = 0;
    for (int r = 0; r < 4; ++r) {
        const float *xr = x + (n - 1024) * r / 3;
        for (int i = 0; i < 1024; ++i) c[bin1(xr[i], inv, ff, wm1, absolute, &miss)]++;
    }
    int32_t h0 = hot_start(c, W, 0, W);
    free(c);
    return h0;
}

static int64_t total(const int64_t *c, int64_t n) {
    int64_t t = 0;
    for (int64_t i = 0; i < n; ++i) t += c[i];
    return t;
}

/* ---------------------------------------------------------------- add_values */

typedef struct {
    const float *x; int64_t E, u0, u1, B; const int64_t *exp, *first; int64_t *counts;
    int absolute, ok;
} ujob_t;

static void *urun(void *p) {
    ujob_t *j = (ujob_t *)p;
    int copies = j->E >= 4 * j->B;
    int32_t *cp = copies ? (int32_t *)calloc((size_t)COPIES * j->B, sizeof(int32_t)) : NULL;
    if (copies && !cp) { j->ok = 0; return NULL; }
    for (int64_t u = j->u0; u < j->u1; ++u) {
        float inv = pow2f(-j->exp[u]), ff = (float)j->first[u];
        const float *x = j->x + u * j->E;
        int64_t *out = j->counts + u * j->B;
        if (copies) {
            int32_t W = (int32_t)j->B;
            span_t s = {x, j->E, inv, ff, W, j->absolute, 0, out,
                        total(out, W) ? hot_start(out, W, 0, W)
                                      : sample_hot(x, j->E, inv, ff, W, j->absolute), 0, 0, 0, 0, 0};
            bin_span(&s, cp);
        } else {
            bin_direct(x, j->E, inv, ff, (int32_t)j->B, j->absolute, out);
        }
    }
    free(cp);
    j->ok = 1;
    return NULL;
}

/* add_values(): counts [U, B] += the bins of x [U, E] on the grids (exp, first). Units over
   threads; one unit: its values over threads. 0: out of memory. */
int64_t qs_hist_bin(const float *x, int64_t U, int64_t E, int64_t B, int64_t *counts,
                    const int64_t *exp, const int64_t *first, int absolute, int threads) {
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1) threads = 1;
    if (U == 1) {
        float inv = pow2f(-exp[0]), ff = (float)first[0];
        int32_t W = (int32_t)B;
        span_t s = {x, E, inv, ff, W, absolute, 0, counts,
                    total(counts, B) ? hot_start(counts, B, 0, W)
                                     : sample_hot(x, E, inv, ff, W, absolute), 0, 0, 0, 0, 0};
        return bin_split(&s, threads);
    }
    if (threads > U) threads = (int)U;
    ujob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (ujob_t){x, E, U * t / threads, U * (t + 1) / threads, B, exp, first, counts,
                           absolute, 0};
    qs_run_jobs(urun, jobs, sizeof jobs[0], threads);
    int ok = jobs[0].ok;
    for (int t = 1; t < threads; ++t) ok &= jobs[t].ok;
    return ok;
}

/* ---------------------------------------------------------------- regrid */

/* Each unit's counts moved onto its new grid, into ncounts (which may be counts itself: in
   place, through row, a scratch of B counts). A unit whose grid stays (the same exp and
   first: rebin is the identity) is copied, or left as it is in place, so a batch inside the
   grid costs O(U), not O(U * B); only the units whose grid changes are re-binned. */
static void move_rows(int64_t U, int64_t B, const int64_t *counts, const int64_t *exp,
                      const int64_t *first, const int64_t *nexp, const int64_t *nfirst,
                      int64_t *ncounts, int64_t *row) {
    size_t bytes = (size_t)B * sizeof(int64_t);
    for (int64_t u = 0; u < U; ++u) {
        const int64_t *c = counts + u * B;
        int64_t *out = ncounts + u * B;
        if (nexp[u] == exp[u] && nfirst[u] == first[u]) {
            if (out != c) memcpy(out, c, bytes);
            continue;
        }
        if (out == c) c = (const int64_t *)memcpy(row, c, bytes);
        memset(out, 0, bytes);
        rebin_add(c, B, first[u], exp[u], nexp[u], nfirst[u], B, out);
    }
}

/* update()'s grid change for every unit: lo / hi the batch's per-unit min / max; the state
   (counts, exp, first, slo, shi) read, the new one written to the n* arrays: the state's own
   (in place), or others (ncounts: any contents on entry). 1 (nothing written): some unit
   needs the torch path (NaN / inf), or no memory. The new grid goes to scratch first: in
   place, the state stays whole until every unit has one. */
int64_t qs_hist_regrid(int64_t U, int64_t B, int absolute, const float *lo, const float *hi,
                       const int64_t *counts, const int64_t *exp, const int64_t *first,
                       const float *slo, const float *shi, int64_t *ncounts, int64_t *nexp,
                       int64_t *nfirst, float *nlo, float *nhi) {
    int64_t *ge = (int64_t *)malloc((size_t)(2 * U + B) * sizeof(int64_t));  /* exp, first, row */
    float *gl = (float *)malloc((size_t)(2 * U) * sizeof(float));          /* lo, hi */
    int bad = !ge || !gl;
    for (int64_t u = 0; u < U && !bad; ++u)
        bad = grid_unit(lo[u], hi[u], absolute, B, slo[u], shi[u], exp[u], gl + u, gl + U + u,
                        ge + u, ge + U + u);
    if (!bad) {
        move_rows(U, B, counts, exp, first, ge, ge + U, ncounts, ge + 2 * U);
        memcpy(nexp, ge, (size_t)U * sizeof(int64_t));
        memcpy(nfirst, ge + U, (size_t)U * sizeof(int64_t));
        memcpy(nlo, gl, (size_t)U * sizeof(float));
        memcpy(nhi, gl + U, (size_t)U * sizeof(float));
    }
    free(ge);
    free(gl);
    return bad;
}

/* ---------------------------------------------------------------- fused, one unit */

/* The update of a one-unit histogram in one read of x [n] (see the module doc): writes
   lo / hi / ends (min, max) and the new state (ncounts zero on entry) and returns 0; or
   returns 1 (a miss: nothing written) when the caller must take the unfused path.
   The window: the state's exponent, absolute bins [first - B, first + 2B) ([0, 2B) for |x|);
   an empty state (a first batch): the exponent of a sample's range (the batch's can only be
   larger: grid_exponent is monotone), bins [-4B, 4B) ([0, 4B)), so values up to about four
   times the sample's largest fit. */
int64_t qs_hist_fused(const float *x, int64_t n, int64_t B, int absolute,
                      const int64_t *counts, const int64_t *exp, const int64_t *first,
                      const float *slo, const float *shi, int64_t *ncounts, int64_t *nexp,
                      int64_t *nfirst, float *nlo, float *nhi, float *lo, float *hi,
                      float *ends, int threads) {
    int64_t e = exp[0], wb, W;
    int32_t h0 = -1;
    if (n < 1 || e < E_MIN || e > E_MAX) return 1;
    if (slo[0] <= shi[0]) {
        /* a first bin past the float32-exact window (a grid recorded from an infinite
           value): a miss, before first[0] - B could overflow */
        if (first[0] < -((int64_t)1 << 24) || first[0] > ((int64_t)1 << 24)) return 1;
        wb = absolute ? 0 : first[0] - B;
        W = absolute ? 2 * B : 3 * B;
        if (wb < -((int64_t)1 << 24) || wb + W > ((int64_t)1 << 24)) return 1;  /* f32 exact */
        h0 = n < DIRECT * W ? -1 : hot_start(counts, B, first[0] - wb, (int32_t)W);
    } else {  /* empty */
        if (n < 16 * 1024 || slo[0] != slo[0] || shi[0] != shi[0]) return 1;
        float l = INFINITY, h = -INFINITY, ul, uh;
        int64_t uf;
        for (int r = 0; r < 4; ++r) {
            const float *xr = x + (n - 1024) * r / 3;
            for (int i = 0; i < 1024; ++i) {
                float v = xr[i];
                if (v != v) return 1;
                l = v < l ? v : l;
                h = v > h ? v : h;
            }
        }
        if (grid_unit(l, h, absolute, B, slo[0], shi[0], e, &ul, &uh, &e, &uf)) return 1;
        wb = absolute ? 0 : -4 * B;
        W = absolute ? 4 * B : 8 * B;
        if (4 * B > ((int64_t)1 << 24)) return 1;
        if (n >= DIRECT * W) {  /* the hot bins, from the sample's */
            int64_t *c = (int64_t *)calloc((size_t)W, sizeof(int64_t));
            if (!c) return 1;
            const float inv = pow2f(-e), wm1 = (float)(W - 1);
            int miss = 0;
            for (int r = 0; r < 4; ++r) {
                const float *xr = x + (n - 1024) * r / 3;
                for (int i = 0; i < 1024; ++i)
                    c[bin1(xr[i], inv, (float)wb, wm1, absolute, &miss)]++;
            }
            h0 = hot_start(c, W, 0, (int32_t)W);
            free(c);
        }
    }
    int64_t *win = (int64_t *)calloc((size_t)W, sizeof(int64_t));
    if (!win) return 1;
    span_t s = {x, n, pow2f(-e), (float)wb, (int32_t)W, absolute, 1, win, h0, 0, 0, 0, 0,
                n < DIRECT * W};
    float glo, ghi;
    int64_t ge, gf;
    int ok = bin_split(&s, threads) && !s.miss
             && !grid_unit(s.lo, s.hi, absolute, B, slo[0], shi[0], exp[0], &glo, &ghi, &ge, &gf)
             && ge >= e
             /* a negative value that is -0 at the new exponent: the torch path bins it at 0 */
             && (absolute || !(s.neg < 0.0f && s.neg * pow2f(-ge) == 0.0f));
    if (ok) {
        /* the window's bins that can hold counts: those of lo .. hi (of |x|: 0 .. max |x|;
           binning is monotonic, and no value missed) */
        int m = 0;
        const float wm1 = (float)(W - 1);
        int64_t k0 = absolute ? 0 : bin1(s.lo, s.inv, s.ff, wm1, 0, &m);
        int64_t k1 = bin1(absolute ? fmaxf(fabsf(s.lo), fabsf(s.hi)) : s.hi, s.inv, s.ff, wm1,
                          absolute, &m);
        rebin_add(counts, B, first[0], exp[0], ge, gf, B, ncounts);
        rebin_add(win + k0, k1 - k0 + 1, wb + k0, e, ge, gf, B, ncounts);
        *nexp = ge; *nfirst = gf; *nlo = glo; *nhi = ghi;
        lo[0] = s.lo; hi[0] = s.hi; ends[0] = s.lo; ends[1] = s.hi;
    }
    free(win);
    return !ok;
}
