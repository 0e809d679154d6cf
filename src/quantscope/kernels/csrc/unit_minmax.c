/* Called from quantscope.stats.minmax through quantscope.kernels; that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. qs_nonzero_rows (at the
   end) is quantscope.compat.quark_scales' token count, held to Quark's expression. */
#include "qs_threads.h"
#include <stdint.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The input's element type (quantscope.stats.minmax passes the code). bf16 / fp16 are
   widened to float32 a piece at a time into a buffer that stays in L1, exactly (every bf16 /
   fp16 value is a float32), so a half tensor is read once from memory at half the bytes and
   never copied to float32 there. */
enum { QS_F32 = 0, QS_BF16 = 1, QS_F16 = 2 };

/* floats widened at a time (8 KiB on the stack) */
#define PIECE 2048

/* One fp16 as float32 (exact: subnormal halves become normal floats). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t w;
    float f;
    if (e == 0x1f) w = s | 0x7f800000u | (m << 13);         /* inf, NaN */
    else if (e) w = s | ((e + 112) << 23) | (m << 13);     /* normal: rebias 15 -> 127 */
    else {                                                  /* zero, subnormal: m * 2**-24 */
        f = (float)m * 0x1p-24f;
        memcpy(&w, &f, 4);
        w |= s;
    }
    memcpy(&f, &w, 4);
    return f;
}

/* n bf16 / fp16 at h as float32 into out. */
static void widen(const uint16_t *h, int dt, int64_t n, float *out) {
    int64_t i = 0;
#ifdef __AVX2__
    if (dt == QS_BF16)
        for (; i + 8 <= n; i += 8) {  /* bf16 is float32's upper half */
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#ifdef __F16C__
    else
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
#endif
    for (; i < n; ++i) {
        if (dt == QS_BF16) {
            const uint32_t w = (uint32_t)h[i] << 16;
            memcpy(out + i, &w, 4);
        } else {
            out[i] = f16_to_f32(h[i]);
        }
    }
}

/* The running ends of a share of rows: the smallest min and largest max, and whether some
   row held NaN (then both ends are NaN, as torch's amin / amax of the per-row results). */
typedef struct { float lo, hi; int nan; } ends_t;

static inline void ends_add(ends_t *e, float lo, float hi, int bad) {
    e->lo = lo < e->lo ? lo : e->lo;
    e->hi = hi > e->hi ? hi : e->hi;
    e->nan |= bad;
}

/* n values at r into the running lo / hi / NaN flag one at a time, in order: a tie keeps
   the earlier value (row()'s last elements; a padded block's real values, qs_padded_minmax). */
static inline void scan(const float *r, int64_t n, float *lo, float *hi, int *bad) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = r[j];
        *lo = v < *lo ? v : *lo;
        *hi = v > *hi ? v : *hi;
        *bad |= v != v;
    }
}

/* Min / max of one row of E float32 (NaN propagates: tracked in a separate mask, since the
   min / max instructions drop NaN); the share's ends take it in. */
static void row(const float *r, int64_t E, float *lo, float *hi, ends_t *e) {
    float lo_ = INFINITY, hi_ = -INFINITY;
    int bad = 0;
    int64_t j = 0;
#ifdef __AVX2__
    if (E >= 8) {
        __m256 l = _mm256_set1_ps(INFINITY), h = _mm256_set1_ps(-INFINITY);
        __m256 n = _mm256_setzero_ps();
        __m256 l2 = l, h2 = h, n2 = n;
        for (; j + 16 <= E; j += 16) {
            __m256 a = _mm256_loadu_ps(r + j), b = _mm256_loadu_ps(r + j + 8);
            l = _mm256_min_ps(l, a); h = _mm256_max_ps(h, a);
            l2 = _mm256_min_ps(l2, b); h2 = _mm256_max_ps(h2, b);
            n = _mm256_or_ps(n, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            n2 = _mm256_or_ps(n2, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
        }
        for (; j + 8 <= E; j += 8) {
            __m256 a = _mm256_loadu_ps(r + j);
            l = _mm256_min_ps(l, a); h = _mm256_max_ps(h, a);
            n = _mm256_or_ps(n, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
        l = _mm256_min_ps(l, l2); h = _mm256_max_ps(h, h2); n = _mm256_or_ps(n, n2);
        __m128 a = _mm_min_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1));
        a = _mm_min_ps(a, _mm_movehl_ps(a, a));
        a = _mm_min_ss(a, _mm_shuffle_ps(a, a, 1));
        __m128 b = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        b = _mm_max_ps(b, _mm_movehl_ps(b, b));
        b = _mm_max_ss(b, _mm_shuffle_ps(b, b, 1));
        lo_ = _mm_cvtss_f32(a);
        hi_ = _mm_cvtss_f32(b);
        bad = _mm256_movemask_ps(n) != 0;
    }
#endif
    scan(r + j, E - j, &lo_, &hi_, &bad);
    *lo = bad ? NAN : lo_;
    *hi = bad ? NAN : hi_;
    ends_add(e, lo_, hi_, bad);
}

#ifdef __AVX2__
/* The 4 horizontal reductions of v0..v3 as one 4-lane vector (lane i: vi); 128-bit halves
   at the last level (cross-lane permutes are slow on some cores). */
#define HREDUCE4(OP, OP4, v0, v1, v2, v3, out) do {                                     \
    __m256 a01 = OP(_mm256_unpacklo_ps(v0, v1), _mm256_unpackhi_ps(v0, v1));            \
    __m256 a23 = OP(_mm256_unpacklo_ps(v2, v3), _mm256_unpackhi_ps(v2, v3));            \
    __m256 b03 = OP(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xEE)); \
    out = OP4(_mm256_castps256_ps128(b03), _mm256_extractf128_ps(b03, 1));              \
} while (0)

/* One row of E (a multiple of 8) folded to a vector: its min in *l, max in *h; NaN only
   sets *any (min / max drop it; the caller does such rows again with row()). */
static inline __attribute__((always_inline)) void fold(const float *r, const int64_t E,
                                                       __m256 *l, __m256 *h, __m256 *any) {
    __m256 a = _mm256_loadu_ps(r), lk = a, hk = a, n;
    int64_t j = 8;
    if (E >= 16) {  /* pairs: one unordered compare finds NaN in either */
        __m256 b = _mm256_loadu_ps(r + 8);
        lk = _mm256_min_ps(lk, b); hk = _mm256_max_ps(hk, b);
        n = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
        for (j = 16; j + 16 <= E; j += 16) {
            a = _mm256_loadu_ps(r + j); b = _mm256_loadu_ps(r + j + 8);
            lk = _mm256_min_ps(_mm256_min_ps(lk, a), b);
            hk = _mm256_max_ps(_mm256_max_ps(hk, a), b);
            n = _mm256_or_ps(n, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        }
    } else {
        n = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    }
    if (j < E) {
        a = _mm256_loadu_ps(r + j);
        lk = _mm256_min_ps(lk, a); hk = _mm256_max_ps(hk, a);
        n = _mm256_or_ps(n, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    *l = lk; *h = hk; *any = _mm256_or_ps(*any, n);
}

/* Short rows (E a multiple of 8, up to 64: MX / NVFP4 / BFP blocks, small groups), 4 rows
   at a time: each row folds to one vector, then the 4 reduce together by shuffles. NaN is
   one mask per 4 rows; the rare 4 rows that hold one are done again by row(). The share's
   ends are kept in vectors. Returns the first row not done. */
static inline __attribute__((always_inline)) int64_t
rows4(const float *x, const int64_t E, int64_t u, int64_t u1, float *lo, float *hi, ends_t *e) {
    __m128 el = _mm_set1_ps(INFINITY), eh = _mm_set1_ps(-INFINITY);
    for (; u + 4 <= u1; u += 4) {
        const float *r = x + u * E;
        __m256 l0, l1, l2, l3, h0, h1, h2, h3, any = _mm256_setzero_ps();
        fold(r, E, &l0, &h0, &any);
        fold(r + E, E, &l1, &h1, &any);
        fold(r + 2 * E, E, &l2, &h2, &any);
        fold(r + 3 * E, E, &l3, &h3, &any);
        __m128 L, H;
        HREDUCE4(_mm256_min_ps, _mm_min_ps, l0, l1, l2, l3, L);
        HREDUCE4(_mm256_max_ps, _mm_max_ps, h0, h1, h2, h3, H);
        if (__builtin_expect(_mm256_movemask_ps(any) != 0, 0)) {  /* rare: NaN here */
            for (int k = 0; k < 4; ++k) row(r + k * E, E, lo + u + k, hi + u + k, e);
            continue;
        }
        _mm_storeu_ps(lo + u, L);
        _mm_storeu_ps(hi + u, H);
        el = _mm_min_ps(el, L);
        eh = _mm_max_ps(eh, H);
    }
    float t[4], s[4];
    _mm_storeu_ps(t, el);
    _mm_storeu_ps(s, eh);
    for (int k = 0; k < 4; ++k) ends_add(e, t[k], s[k], 0);
    return u;
}
#endif

/* Min / max of the n rows of a contiguous [n, E] float32 matrix, NaN propagated, and the
   share's ends. */
static void rows(const float *x, int64_t E, int64_t n, float *lo, float *hi, ends_t *e) {
    int64_t u0 = 0;
#ifdef __AVX2__
    /* E as a constant where it is common: the folds unroll */
    if (E == 16) u0 = rows4(x, 16, 0, n, lo, hi, e);
    else if (E == 32) u0 = rows4(x, 32, 0, n, lo, hi, e);
    else if (E % 8 == 0 && E <= 64) u0 = rows4(x, E, 0, n, lo, hi, e);
#endif
    for (int64_t u = u0; u < n; ++u) row(x + u * E, E, lo + u, hi + u, e);  /* the rest */
}

/* rows() of an [n, E] matrix of any element type: bf16 / fp16 rows are widened a piece at
   a time (whole rows where they fit in one, else each row piece by piece). */
static void rows_of(const void *x, int dt, int64_t E, int64_t n_rows, float *lo, float *hi,
                    ends_t *e) {
    if (dt == QS_F32) {
        rows((const float *)x, E, n_rows, lo, hi, e);
        return;
    }
    const uint16_t *h = (const uint16_t *)x;
    float buf[PIECE] __attribute__((aligned(64)));  /* no 32-byte access splits a line */
    if (E <= PIECE) {
        const int64_t k = PIECE / E;
        for (int64_t u = 0; u < n_rows; u += k) {
            const int64_t n = n_rows - u < k ? n_rows - u : k;
            widen(h + u * E, dt, n * E, buf);
            rows(buf, E, n, lo + u, hi + u, e);
        }
        return;
    }
    for (int64_t u = 0; u < n_rows; ++u) {
        float l = INFINITY, g = -INFINITY, pl, ph;
        int bad = 0;
        for (int64_t j = 0; j < E; j += PIECE) {
            const int64_t n = E - j < PIECE ? E - j : PIECE;
            widen(h + u * E + j, dt, n, buf);
            row(buf, n, &pl, &ph, e);  /* NaN in both ends where the piece holds one */
            bad |= pl != pl;
            l = pl < l ? pl : l;
            g = ph > g ? ph : g;
        }
        lo[u] = bad ? NAN : l;
        hi[u] = bad ? NAN : g;
    }
}

/* The column kernel (qs_col_minmax): per-column min / max of [R, C] slabs, NaN propagated.
   Each slab's rows are cut into `shares` row shares (as that many threads once split them);
   the results of one share are its last tying value (+0.0 / -0.0) in the vector columns and
   its first in the scalar ones (the last C % 8), and the shares merge in order, the first
   winning a tie: the sign of a zero min / max depends on that cut and on nothing else (not
   on the threads that run it), as it always has. */

/* A slab's running per-column results: lo / hi / a NaN mask (non-zero: the column held
   one), those of the share being read where earlier shares' are in lo / hi (share_lo /
   share_hi), and where one thread does the whole slab, its final lo / hi (NaN where the
   mask is set) go straight to out_lo / out_hi, units step apart (NULL: the caller merges
   the threads'). */
typedef struct {
    float *lo, *hi; int32_t *nan; float *share_lo, *share_hi, *out_lo, *out_hi; int64_t step;
} acc_t;

/* The final lo / hi of columns [c0, c1) from the running ones. */
static void finish(acc_t a, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
        a.out_lo[c * a.step] = a.nan[c] ? NAN : a.lo[c];
        a.out_hi[c * a.step] = a.nan[c] ? NAN : a.hi[c];
    }
}

#if !(defined(__AVX2__) && defined(__F16C__))
/* Column min / max of rows [r0, r1) of a contiguous [R, C] float32 matrix into lo / hi / nan
   (length C, initialised by the caller), row after row. */
static void cols(const float *x, int64_t C, int64_t r0, int64_t r1, float *lo, float *hi,
                 int32_t *nan) {
    for (int64_t r = r0; r < r1; ++r) {
        const float *row = x + r * C;
        for (int64_t c = 0; c < C; ++c) {
            float v = row[c];
            lo[c] = v < lo[c] ? v : lo[c];
            hi[c] = v > hi[c] ? v : hi[c];
            nan[c] |= v != v;
        }
    }
}

/* Shares [k0, k1) of the slab at x into a (no AVX2: every column scalar, so a tie keeps
   the first value whatever the shares; bf16 / fp16 rows widened a piece at a time, whole
   rows where they fit in one, else each row piece by piece). */
static void slab(const void *x, int dt, int64_t R, int64_t C, int64_t S, int64_t k0,
                 int64_t k1, acc_t a) {
    const int64_t r0 = R * k0 / S, r1 = R * k1 / S;
    const uint16_t *h = (const uint16_t *)x;
    float buf[PIECE] __attribute__((aligned(64)));
    for (int64_t c = 0; c < C; ++c) { a.lo[c] = INFINITY; a.hi[c] = -INFINITY; a.nan[c] = 0; }
    if (dt == QS_F32) {
        cols((const float *)x, C, r0, r1, a.lo, a.hi, a.nan);
    } else if (C <= PIECE) {
        const int64_t k = PIECE / C;
        for (int64_t r = r0; r < r1; r += k) {
            const int64_t n = r1 - r < k ? r1 - r : k;
            widen(h + r * C, dt, n * C, buf);
            cols(buf, C, 0, n, a.lo, a.hi, a.nan);
        }
    } else {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = 0; c < C; c += PIECE) {
                const int64_t n = C - c < PIECE ? C - c : PIECE;
                widen(h + r * C + c, dt, n, buf);
                cols(buf, n, 0, 1, a.lo + c, a.hi + c, a.nan + c);
            }
    }
    if (a.out_lo) finish(a, 0, C);
}
#else
/* 8 elements of type dt at p as float32, exactly as widen() makes them. */
static inline __attribute__((always_inline)) __m256 load8(const char *p, const int dt) {
    if (dt == QS_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == QS_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* A slab is read a block of rows at a time, and each block strip after strip across all
   its columns: a strip's results stay in registers down the block's rows, and the running
   results are read and written once a block, not once a row (3C floats each time: beyond
   L1 from 2048 columns, where the per-row update took 2.8x the row kernel's time). */
enum {
    ROWS = 8,           /* rows a block holds: 8 streams, each read in order */
    SHORT = 256,        /* bytes of a row below which blocks take more rows ... */
    SHORT_BLOCK = 2048, /* ... up to this many bytes (at most 64 rows): fewer merges */
    PF_ROW = 4096,      /* bytes of a row up to which the next blocks are prefetched */
    PF_AHEAD = 2        /* that many blocks ahead */
};
/* A block's place: the first of its share (NEW), the last (END), in a share after the
   thread's first (LATER: the earlier shares' results are in lo / hi, this share's in
   share_lo / share_hi until its end), the slab's last (FINAL: its results are final). */
enum { NEW = 1, END = 2, LATER = 4, FINAL = 8 };

/* Columns [c, c + 8V) (V <= 4: 12 of the 16 vector registers hold their lo / hi / NaN) of
   n rows s bytes apart from p (their first element), reduced in registers, then folded
   into a's columns at c. In row order: min / max return their second operand on a tie. */
static inline __attribute__((always_inline)) void
strip(const char *p, const int dt, const int V, int64_t n, int64_t s, acc_t a, int64_t c,
      int how) {
    const int64_t z = dt == QS_F32 ? 32 : 16;  /* bytes of one vector's 8 elements */
    float *slo = how & LATER ? a.share_lo : a.lo, *shi = how & LATER ? a.share_hi : a.hi;
    __m256 l[4], h[4], m[4];
    for (int k = 0; k < V; ++k) {
        l[k] = _mm256_set1_ps(INFINITY); h[k] = _mm256_set1_ps(-INFINITY);
        m[k] = _mm256_setzero_ps();
    }
    for (; n >= 2; n -= 2, p += 2 * s)  /* pairs: one unordered compare finds NaN in either */
        for (int k = 0; k < V; ++k) {
            const __m256 u = load8(p + k * z, dt), v = load8(p + s + k * z, dt);
            l[k] = _mm256_min_ps(_mm256_min_ps(l[k], u), v);
            h[k] = _mm256_max_ps(_mm256_max_ps(h[k], u), v);
            m[k] = _mm256_or_ps(m[k], _mm256_cmp_ps(u, v, _CMP_UNORD_Q));
        }
    for (int k = 0; n && k < V; ++k) {
        const __m256 u = load8(p + k * z, dt);
        l[k] = _mm256_min_ps(l[k], u); h[k] = _mm256_max_ps(h[k], u);
        m[k] = _mm256_or_ps(m[k], _mm256_cmp_ps(u, u, _CMP_UNORD_Q));
    }
    for (int k = 0; k < V; ++k) {
        const int64_t j = c + 8 * k;
        if (!(how & NEW)) {  /* after the share's earlier rows: this block's win a tie */
            l[k] = _mm256_min_ps(_mm256_loadu_ps(slo + j), l[k]);
            h[k] = _mm256_max_ps(_mm256_loadu_ps(shi + j), h[k]);
        }
        if ((how & (END | LATER)) == (END | LATER)) {  /* after the earlier shares': theirs */
            l[k] = _mm256_min_ps(l[k], _mm256_loadu_ps(a.lo + j));
            h[k] = _mm256_max_ps(h[k], _mm256_loadu_ps(a.hi + j));
        }
        if ((how & (NEW | LATER)) != NEW)  /* the mask: NaN in any row of the thread's */
            m[k] = _mm256_or_ps(m[k], _mm256_loadu_ps((const float *)(a.nan + j)));
        if (how & FINAL && a.out_lo) {
            const __m256 q = _mm256_set1_ps(NAN);
            l[k] = _mm256_blendv_ps(l[k], q, m[k]);
            h[k] = _mm256_blendv_ps(h[k], q, m[k]);
            if (a.step == 1) {
                _mm256_storeu_ps(a.out_lo + j, l[k]);
                _mm256_storeu_ps(a.out_hi + j, h[k]);
                continue;
            }
            float tl[8], th[8];  /* units in another order: step apart */
            _mm256_storeu_ps(tl, l[k]);
            _mm256_storeu_ps(th, h[k]);
            for (int e = 0; e < 8; ++e) {
                a.out_lo[(j + e) * a.step] = tl[e];
                a.out_hi[(j + e) * a.step] = th[e];
            }
            continue;
        }
        _mm256_storeu_ps(how & END ? a.lo + j : slo + j, l[k]);
        _mm256_storeu_ps(how & END ? a.hi + j : shi + j, h[k]);
        _mm256_storeu_ps((float *)(a.nan + j), m[k]);
    }
}

/* One element of type dt as float32 (the columns past the last whole vector). */
static inline float elem(const char *p, int dt) {
    uint16_t b;
    float f;
    if (dt == QS_F32) {
        memcpy(&f, p, 4);
        return f;
    }
    memcpy(&b, p, 2);
    if (dt == QS_F16) return f16_to_f32(b);
    const uint32_t w = (uint32_t)b << 16;
    memcpy(&f, &w, 4);
    return f;
}

/* Columns [c0, C) (fewer than 8) of n rows from row p, one value at a time in row order: a
   tie keeps the first value, in a share and across them. */
static void tail(const char *p, int dt, int64_t C, int64_t c0, int64_t n, acc_t a, int how) {
    const int64_t z = dt == QS_F32 ? 4 : 2;
    for (int64_t c = c0; (how & (NEW | LATER)) == NEW && c < C; ++c) {
        a.lo[c] = INFINITY; a.hi[c] = -INFINITY; a.nan[c] = 0;
    }
    for (int64_t r = 0; r < n; ++r)
        for (int64_t c = c0; c < C; ++c) {
            const float v = elem(p + (r * C + c) * z, dt);
            a.lo[c] = v < a.lo[c] ? v : a.lo[c];
            a.hi[c] = v > a.hi[c] ? v : a.hi[c];
            a.nan[c] |= v != v;
        }
    if (how & FINAL && a.out_lo) finish(a, c0, C);
}

/* n rows of the slab from p (a block), strip after strip; pf: where a later block's bytes
   start, prefetched into L2 in order as this block's strips go (NULL: none). Short rows
   need it: there a block's strips hop between rows a few lines long, which the hardware
   prefetchers do not follow (1.4-2x the row kernel's time from memory without it). */
static inline __attribute__((always_inline)) void
block(const char *p, const int dt, int64_t C, const int64_t n, acc_t a, int how,
      const char *pf) {
    const int64_t z = dt == QS_F32 ? 4 : 2, C8 = C & ~(int64_t)7;
    int64_t c = 0;
    for (; c + 32 <= C8; c += 32) {  /* (the strip's share of the later block's bytes) */
        for (int64_t o = 0; pf && o < n * 32 * z; o += 64)
            _mm_prefetch(pf + c * z * n + o, _MM_HINT_T1);
        strip(p + c * z, dt, 4, n, C * z, a, c, how);
    }
    for (; c < C8; c += 8) {
        for (int64_t o = 0; pf && o < n * 8 * z; o += 64)
            _mm_prefetch(pf + c * z * n + o, _MM_HINT_T1);
        strip(p + c * z, dt, 1, n, C * z, a, c, how);
    }
    if (C8 < C) tail(p, dt, C, C8, n, a, how);
}

/* Shares [k0, k1) of the slab at x into a, a block at a time. */
static inline __attribute__((always_inline)) void
slab_dt(const char *x, const int dt, int64_t R, int64_t C, int64_t S, int64_t k0, int64_t k1,
        acc_t a) {
    const int64_t z = dt == QS_F32 ? 4 : 2, row = C * z, end = R * k1 / S;
    const int64_t rows = row >= SHORT ? ROWS : SHORT_BLOCK / row > 64 ? 64 : SHORT_BLOCK / row;
    const char *last = x + R * row;
    for (int64_t k = k0, later = 0; k < k1; ++k) {
        const int64_t r0 = R * k / S, r1 = R * (k + 1) / S;
        for (int64_t b = r0; b < r1; b += rows) {
            const int64_t n = r1 - b < rows ? r1 - b : rows;
            const int how = (b == r0 ? NEW : 0) | (b + n == r1 ? END : 0) | (later ? LATER : 0)
                            | (b + n == end ? FINAL : 0);
            const char *p = x + b * row, *q = p + PF_AHEAD * rows * row;
            q = row <= PF_ROW && q < last ? q : NULL;
            if (n == ROWS) block(p, dt, C, ROWS, a, how, q);  /* the rows unrolled */
            else block(p, dt, C, n, a, how, q);
        }
        later |= r1 > r0;  /* (an empty share holds no results) */
    }
}

/* Shares [k0, k1) of the slab at x into a (AVX2: strips of columns in registers, bf16 /
   fp16 widened there). */
static void slab(const void *x, int dt, int64_t R, int64_t C, int64_t S, int64_t k0,
                 int64_t k1, acc_t a) {
    if (dt == QS_F32) slab_dt((const char *)x, QS_F32, R, C, S, k0, k1, a);
    else if (dt == QS_BF16) slab_dt((const char *)x, QS_BF16, R, C, S, k0, k1, a);
    else slab_dt((const char *)x, QS_F16, R, C, S, k0, k1, a);
}
#endif

/* A thread's part: slabs [s0, s1) whole (into their units of lo / hi), or shares [k0, k1)
   of slab s0 alone (lo NULL: into its running results, which the caller merges). */
typedef struct {
    const char *x; int dt; int64_t R, C, S, s0, s1, k0, k1, group; float *lo, *hi; acc_t a;
} cjob_t;

/* Slabs whose results are put in unit order at a time: 16 floats (a cache line) of each
   column's units, where each slab's straight there (a float a line) took as long as a torch
   transpose of them all. */
#define BATCH 16

#ifdef __AVX2__
/* The 8 x 8 floats in r0..r7 (a row each) transposed in place (r0: their first column). */
#define TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7) do {                                    \
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);               \
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);               \
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);               \
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);               \
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);     \
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);     \
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);     \
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);     \
    r0 = _mm256_permute2f128_ps(s0, s4, 0x20); r1 = _mm256_permute2f128_ps(s1, s5, 0x20);  \
    r2 = _mm256_permute2f128_ps(s2, s6, 0x20); r3 = _mm256_permute2f128_ps(s3, s7, 0x20);  \
    r4 = _mm256_permute2f128_ps(s0, s4, 0x31); r5 = _mm256_permute2f128_ps(s1, s5, 0x31);  \
    r6 = _mm256_permute2f128_ps(s2, s6, 0x31); r7 = _mm256_permute2f128_ps(s3, s7, 0x31);  \
} while (0)

/* The 8 x 8 floats at t (rows C apart) transposed to out (rows step apart). */
static inline void transpose8(const float *t, int64_t C, float *out, int64_t step) {
    __m256 r[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(t + k * C);
    TRANSPOSE8(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + k * step, r[k]);
}
#endif

/* Rows [0, n) of t ([n, C]) as the columns of out: column c's n values at out + c * step. */
static void put_units(const float *t, int64_t n, int64_t C, float *out, int64_t step) {
    int64_t n8 = 0, C8 = 0;  /* (rows and columns in 8 x 8 blocks) */
#ifdef __AVX2__
    n8 = n & ~(int64_t)7;
    C8 = C & ~(int64_t)7;
    for (int64_t c = 0; c < C8; c += 8)
        for (int64_t b = 0; b < n8; b += 8) transpose8(t + b * C + c, C, out + c * step + b, step);
#endif
    for (int64_t c = 0; c < C; ++c)
        for (int64_t b = c < C8 ? n8 : 0; b < n; ++b)
            out[c * step + b] = t[b * C + c];
}

static void *crun(void *p) {
    cjob_t *j = (cjob_t *)p;
    const int64_t bytes = j->R * j->C * (j->dt == QS_F32 ? 4 : 2), C = j->C, g = j->group;
    /* group > 1: a batch's results into t ([2, BATCH, C]), then put in unit order */
    float *t = j->lo && g > 1 ? (float *)malloc(sizeof(float) * 2 * BATCH * C) : NULL;
    for (int64_t s = j->s0, e; s < j->s1; s = e) {
        const int64_t at = s / g * C * g + s % g;  /* slab s's unit of column 0 */
        e = s + 1;
        if (t) {  /* to the batch's end, within the group */
            e = s - s % BATCH + BATCH;
            e = e < j->s1 ? e : j->s1;
            e = e < (s / g + 1) * g ? e : (s / g + 1) * g;
        }
        for (int64_t i = s; i < e; ++i) {
            acc_t a = j->a;
            if (t) {
                a.out_lo = t + (i - s) * C;
                a.out_hi = t + (BATCH + i - s) * C;
            } else if (j->lo) {  /* (i == s: its units g apart, where g is 1 or t failed) */
                a.out_lo = j->lo + at;
                a.out_hi = j->hi + at;
                a.step = g;
            }
            slab(j->x + i * bytes, j->dt, j->R, C, j->S, j->k0, j->k1, a);
        }
        if (t) {
            put_units(t, e - s, C, j->lo + at, g);
            put_units(t + BATCH * C, e - s, C, j->hi + at, g);
        }
    }
    free(t);
    return NULL;
}

/* The threads' running results of one slab merged in order (the first wins a tie). */
static void merge(const cjob_t *jobs, int threads, int64_t C, float *lo, float *hi) {
    for (int64_t c = 0; c < C; ++c) {
        float l = INFINITY, h = -INFINITY;
        int bad = 0;
        for (int t = 0; t < threads; ++t) {
            const cjob_t *j = jobs + t;
            if (j->R * j->k0 / j->S == j->R * j->k1 / j->S) continue;  /* no rows: no results */
            float lt = j->a.lo[c], ht = j->a.hi[c];
            l = lt < l ? lt : l;
            h = ht > h ? ht : h;
            bad |= j->a.nan[c];
        }
        lo[c] = bad ? NAN : l;
        hi[c] = bad ? NAN : h;
    }
}

/* Per-column min / max of each of `runs` contiguous [R, C] slabs of element type dt into
   lo / hi in unit order: slab l * group + g's column c at (l * C + c) * group + g (group 1:
   [runs, C]; runs a multiple of group). Each slab's rows are cut into `shares` (see above).
   Threads take whole slabs where there are several, else shares of the one; work (threads x
   5C floats) is scratch from the caller. Returns 0, or -1 for sizes no caller passes
   (exported kernels return int64: kernels.SIGNATURES). */
int64_t qs_col_minmax(const void *x, int64_t runs, int64_t R, int64_t C, float *lo, float *hi,
                      float *work, int threads, int shares, int64_t group, int dt) {
    if (C < 1 || R < 1 || runs < 1 || group < 1 || runs % group) return -1;  /* (no caller's) */
    if (shares > QS_MAXT) shares = QS_MAXT;  /* as the threads that cut it were capped */
    if (shares < 1) shares = 1;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads > (runs > 1 ? runs : shares)) threads = (int)(runs > 1 ? runs : shares);
    if (threads < 1) threads = 1;
    cjob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t) {
        float *l = work + (int64_t)t * 5 * C;
        const acc_t a = {l, l + C, (int32_t *)(l + 2 * C), l + 3 * C, l + 4 * C, NULL, NULL, 1};
        if (runs > 1 || threads == 1)
            jobs[t] = (cjob_t){x, dt, R, C, shares, runs * t / threads, runs * (t + 1) / threads,
                               0, shares, group, lo, hi, a};
        else
            jobs[t] = (cjob_t){x, dt, R, C, shares, 0, 1, shares * t / threads,
                               shares * (t + 1) / threads, 1, NULL, NULL, a};
    }
    qs_run_jobs(crun, jobs, sizeof jobs[0], threads);
    if (runs == 1 && threads > 1) merge(jobs, threads, C, lo, hi);
    return 0;
}

typedef struct {
    const void *x; int dt; int64_t E, u0, u1; float *lo, *hi; float ends[2];
    int mode; float c, omc; float *slo, *shi;
} job_t;

/* The state updates of the accumulating min-max observers, fused into the same pass, each
   rounded as the torch ops of quantscope.stats.minmax.update_state round (no contraction:
   built with -ffp-contract=off). 1: running min / max (NaN kept, as torch.minimum);
   2: s + c * (b - s) (torch.ao); 3: s * (1 - c) + b * c (llm-compressor's lerp). Over n
   units, one loop per mode: branch-free selects, so they vectorize. */
static void update(int mode, float *slo, float *shi, const float *lo,
                   const float *hi, int64_t n, float c, float omc) {
    if (mode == 1) {
        for (int64_t u = 0; u < n; ++u) {
            const float s = slo[u], b = lo[u], t = shi[u], g = hi[u];
            slo[u] = s != s ? s : b != b ? b : b < s ? b : s;
            shi[u] = t != t ? t : g != g ? g : g > t ? g : t;
        }
    } else if (mode == 2) {
        for (int64_t u = 0; u < n; ++u) {
            float d = lo[u] - slo[u], f = hi[u] - shi[u];
            d = d * c;
            f = f * c;
            slo[u] = slo[u] + d;
            shi[u] = shi[u] + f;
        }
    } else {
        for (int64_t u = 0; u < n; ++u) {
            float a = slo[u] * omc, t = lo[u] * c, k = shi[u] * omc, m = hi[u] * c;
            slo[u] = a + t;
            shi[u] = k + m;
        }
    }
}

/* Float32 units per block of a share: their min / max are staged in L1 for lo / hi and the
   state update. Stored from the pass itself, among its reads, short rows' outputs cost more
   than the reads (NVFP4 blocks of 16 of a 4096 x 4096 float32 weight: the memoryless pass
   1.3-1.4x its reads with streaming stores, 1.6x plain; a state update in blocks of 4096
   units 1.7x; staged in blocks of 256: 1.0-1.1x). */
#define BLOCK_UNITS 256

/* Units per block: a multiple of rows4()'s quads and of rows_of()'s pieces of half rows, so
   that a share's units meet the same lanes block by block as in one call (bit for bit, the
   sign of a zero that ties included: the padded and act-order paths count on it). */
static int64_t block_units(int dt, int64_t E) {
    if (dt == QS_F32 || E > PIECE) return BLOCK_UNITS;
    const int64_t k = PIECE / E;
    return k < BLOCK_UNITS ? BLOCK_UNITS / k * k : k;
}

static void *run(void *p) {
    job_t *j = (job_t *)p;
    ends_t e = {INFINITY, -INFINITY, 0};
    /* (a block of half rows holds up to PIECE units) */
    float blo[PIECE] __attribute__((aligned(64))), bhi[PIECE] __attribute__((aligned(64)));
    const int64_t row_bytes = j->E * (j->dt == QS_F32 ? 4 : 2), step = block_units(j->dt, j->E);
    /* half rows: rows_of() reads them from its L1 widening buffer, whose pieces these
       blocks are (block_units); their lo / hi go straight out, unstaged */
    const int direct = j->lo && !j->mode && j->dt != QS_F32;
    for (int64_t b = j->u0; b < j->u1; b += step) {
        const int64_t n = j->u1 - b < step ? j->u1 - b : step;
        float *lo = direct ? j->lo + b : blo, *hi = direct ? j->hi + b : bhi;
        rows_of((const char *)j->x + b * row_bytes, j->dt, j->E, n, lo, hi, &e);
        if (j->mode) update(j->mode, j->slo + b, j->shi + b, lo, hi, n, j->c, j->omc);
        if (j->lo && !direct) {  /* NULL: a state update's, which no one reads */
            memcpy(j->lo + b, lo, (size_t)n * sizeof *lo);
            memcpy(j->hi + b, hi, (size_t)n * sizeof *hi);
        }
    }
    /* the smallest min and largest max of this share, NaN kept (the non-finite check) */
    j->ends[0] = e.nan ? NAN : e.lo;
    j->ends[1] = e.nan ? NAN : e.hi;
    return NULL;
}

/* One unit on several threads (a per-tensor range): each takes a contiguous share of its
   elements, and the shares' ends combine as the threads' ends of many units do (min / max
   are exact, so the unit's are the same values; NaN in any share makes both NaN). */
static void one_unit(const void *x, int64_t E, float *lo, float *hi, float *ends, int threads,
                     int mode, float c, float omc, float *slo, float *shi, int dt) {
    job_t jobs[QS_MAXT];
    float plo[QS_MAXT], phi[QS_MAXT], l1, h1;
    if (!lo) lo = &l1, hi = &h1;  /* a state update's: not kept */
    const int64_t size = dt == QS_F32 ? 4 : 2;
    for (int t = 0; t < threads; ++t) {
        const int64_t e0 = E * t / threads, e1 = E * (t + 1) / threads;
        jobs[t] = (job_t){(const char *)x + e0 * size, dt, e1 - e0, 0, 1, plo + t, phi + t,
                          {0, 0}, 0, 0.0f, 1.0f, NULL, NULL};
    }
    qs_run_jobs(run, jobs, sizeof jobs[0], threads);
    float l = plo[0], h = phi[0];
    int bad = 0;
    for (int t = 0; t < threads; ++t) {
        l = plo[t] < l ? plo[t] : l;
        h = phi[t] > h ? phi[t] : h;
        bad |= plo[t] != plo[t];  /* a share's row() made both of its ends NaN */
    }
    lo[0] = ends[0] = bad ? NAN : l;
    hi[0] = ends[1] = bad ? NAN : h;
    if (mode) {  /* the state update run() does, after the whole unit's min / max */
        update(mode, slo, shi, lo, hi, 1, c, omc);
    }
}

/* Per-unit min / max of [U, E] of element type dt into lo / hi (NULL with a state update:
   not kept), the ends of all units in ends[2], and the state update of mode (see update());
   returns 0, as qs_col_minmax. */
int64_t qs_unit_minmax(const void *x, int64_t U, int64_t E, float *lo, float *hi,
                       float *ends, int threads, int mode, double c, float *slo, float *shi,
                       int dt) {
    if (E < 1) return -1;  /* rows of no elements: no min / max (the caller refuses them) */
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1) threads = 1;
    if (U == 1 && threads > 1 && E >= threads) {
        one_unit(x, E, lo, hi, ends, threads, mode, (float)c, (float)(1.0 - c), slo, shi, dt);
        return 0;
    }
    job_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (job_t){x, dt, E, U * t / threads, U * (t + 1) / threads, lo, hi, {0, 0},
                          mode, (float)c, (float)(1.0 - c), slo, shi};
    qs_run_jobs(run, jobs, sizeof jobs[0], threads);
    float l = jobs[0].ends[0], h = jobs[0].ends[1];
    for (int t = 1; t < threads; ++t) {
        float a = jobs[t].ends[0], b = jobs[t].ends[1];
        l = (a < l || a != a) && l == l ? a : l;
        h = (b > h || b != b) && h == h ? b : h;
    }
    ends[0] = l;
    ends[1] = h;
    return 0;
}

/* ---- blocks with a zero-padded tail along the last axis, read in place ------------------ */

/* Rows of W elements of type dt at x cut into N = ceil(W / E) blocks of E, the last of each
   row holding W - (N - 1) E real values: the units of the zero-padded copy that
   quantscope.layout.Block.to_units makes (unit u = r N + k), read from x itself. */
typedef struct { const char *x; int dt; int64_t W, E, N; float *lo, *hi; } padded_t;

/* n units from row r's block k on, as the padded copy holds them, as float32 into buf (n E
   floats): each row's run of them from x (bf16 / fp16 widened), then its padding's zeros
   (+0.0, as the copy's). */
static void padded_units(const padded_t *p, int64_t r, int64_t k, int64_t n, float *buf) {
    const int64_t E = p->E, z = p->dt == QS_F32 ? 4 : 2;
    for (int64_t m; n; n -= m, ++r, k = 0, buf += m * E) {
        m = n < p->N - k ? n : p->N - k;
        const int64_t real = m * E < p->W - k * E ? m * E : p->W - k * E;
        const char *s = p->x + (r * p->W + k * E) * z;
        if (p->dt == QS_F32) memcpy(buf, s, (size_t)real * 4);
        else widen((const uint16_t *)s, p->dt, real, buf);
        memset(buf + real, 0, (size_t)(m * E - real) * 4);
    }
}

/* The padded units among the n at buf (padded_units()'s, from a row's block k; their
   results at lo / hi) take their real values' min / max by scan(): the copy's range once
   its zeros are taken out (stats.minmax_layouts.unpad_minmax_: torch's amin / amax, whose
   loop over a row of fewer than 32 values takes them in order, the first of a tie winning;
   the caller keeps to such tails). */
static void unpad(const padded_t *p, int64_t k, int64_t n, const float *buf, float *lo,
                  float *hi) {
    const int64_t real = p->W - (p->N - 1) * p->E;
    for (int64_t i = p->N - 1 - k; i < n; i += p->N) {
        float l = INFINITY, h = -INFINITY;
        int bad = 0;
        scan(buf + i * p->E, real, &l, &h, &bad);
        lo[i] = bad ? NAN : l;
        hi[i] = bad ? NAN : h;
    }
}

typedef struct { const padded_t *p; int64_t u0, u1; } pjob_t;

/* Units [u0, u1), a share of the copy's as qs_unit_minmax cuts it, as the row kernel reduces
   that share of the copy: float32 runs of whole quads of a row's full blocks (rows4()'s,
   counted from the share's start) where they lie; the rest (a quad that holds a padded
   block or crosses a row's end; bf16 / fp16 in rows_of()'s pieces) through buf as the copy
   holds it. The same lanes meet the same values: the copy's min / max bit for bit, NaN and
   the sign of a zero that ties included (which rows4() or row() takes a unit decides it).
   Unit u is row r's block k (no division per piece: they cost as much as a quad). */
static void *prun(void *q) {
    const pjob_t *j = (const pjob_t *)q;
    const padded_t *p = j->p;
    const int64_t E = p->E, N = p->N;
    const int64_t piece = p->dt == QS_F32 ? (PIECE / E < 4 ? PIECE / E : 4) : PIECE / E;
    float buf[PIECE] __attribute__((aligned(64)));
    ends_t e = {INFINITY, -INFINITY, 0};  /* (unused: the caller derives the ends) */
    int64_t r = j->u0 / N, k = j->u0 % N;
    for (int64_t u = j->u0, n; u < j->u1; u += n, k += n) {
        if (k >= N) {  /* (the last piece crossed a row's end) */
            r += k / N;
            k %= N;
        }
        const int64_t full = N - 1 - k < j->u1 - u ? N - 1 - k : j->u1 - u;
        n = p->dt == QS_F32 ? full / 4 * 4 : 0;
        if (n) {
            rows((const float *)p->x + r * p->W + k * E, E, n, p->lo + u, p->hi + u, &e);
            continue;
        }
        n = j->u1 - u < piece ? j->u1 - u : piece;
        padded_units(p, r, k, n, buf);
        rows(buf, E, n, p->lo + u, p->hi + u, &e);
        unpad(p, k, n, buf, p->lo + u, p->hi + u);
    }
    return NULL;
}

/* Per-unit min / max of the blocks of E along the rows of a contiguous [R, W] of type dt
   whose last block is zero-padded (W % E != 0; E <= PIECE), in the padded copy's unit
   order, on `threads` (the copy's count: its cut into shares decides which units rows4()
   takes): the row kernel's results on the copy bit for bit, a padded block's its real
   values' (unpad()). Returns 0, or -1 (bad sizes: the caller copies). */
int64_t qs_padded_minmax(const void *x, int64_t R, int64_t W, int64_t E, float *lo, float *hi,
                         int threads, int dt) {
    if (E < 1 || E > PIECE || R < 1 || W < 1 || W % E == 0) return -1;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1) threads = 1;
    const padded_t p = {(const char *)x, dt, W, E, (W + E - 1) / E, lo, hi};
    const int64_t U = R * p.N;
    pjob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (pjob_t){&p, U * t / threads, U * (t + 1) / threads};
    qs_run_jobs(prun, jobs, sizeof jobs[0], threads);
    return 0;
}

/* ---- activation-order groups, read in place (quantscope.stats.minmax_actorder) ---------- */

/* Group(E, g_idx) of an [R, C] matrix at x, strides rs / cs (elements): unit u = r * G + g
   (G = C / E) holds x[r, perm[g * E + k]], k < E, perm the stable argsort of g_idx. */
typedef struct {
    const char *x; int dt; int64_t R, C, rs, cs, E, G; const int64_t *perm; float *lo, *hi;
} agroups_t;

/* The units a permuted copy's row kernel reduces together, from its share's start: float32
   in runs of 4 (rows4's quads), bf16 / fp16 in rows_of()'s widening pieces of PIECE / E
   units, longer units one at a time. */
static int64_t chunk(int dt, int64_t E) {
    int64_t k = E <= PIECE ? PIECE / E : 1;
    if (dt == QS_F32 && E <= 64 && k >= 4) k -= k % 4;
    return k;
}

/* Units [u, u + n) in their permuted order into buf (the input's type): the rows a permuted
   copy would hold, gathered from their rows in cache. */
__attribute__((optimize("no-tree-vectorize"))) /* (a vector gather is the slower here) */
static void gather(const agroups_t *a, int64_t u, int64_t n, void *buf) {
    const int64_t E = a->E;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = (u + i) / a->G, *p = a->perm + (u + i) % a->G * E, cs = a->cs;
        if (a->dt == QS_F32) {
            const float *s = (const float *)a->x + r * a->rs;
            float *d = (float *)buf + i * E;
            if (cs == 1) for (int64_t k = 0; k < E; ++k) d[k] = s[p[k]];
            else for (int64_t k = 0; k < E; ++k) d[k] = s[p[k] * cs];
        } else {
            const uint16_t *s = (const uint16_t *)a->x + r * a->rs;
            uint16_t *d = (uint16_t *)buf + i * E;
            if (cs == 1) for (int64_t k = 0; k < E; ++k) d[k] = s[p[k]];
            else for (int64_t k = 0; k < E; ++k) d[k] = s[p[k] * cs];
        }
    }
}

/* Units [u0, u1) as the row kernel reduces a permuted copy's share that starts at u0, chunk
   by chunk (chunk()), each gathered into buf first (chunk() units of the input's type): the
   same lanes meet the same values, so its min / max bit for bit, NaN and the sign of a zero
   that ties included. */
static void exact(const agroups_t *a, int64_t u0, int64_t u1, void *buf) {
    const int64_t k = chunk(a->dt, a->E);
    ends_t e = {INFINITY, -INFINITY, 0};  /* (unused: forward derives the ends) */
    for (int64_t u = u0; u < u1; u += k) {
        const int64_t n = u1 - u < k ? u1 - u : k;
        gather(a, u, n, buf);
        rows_of(buf, a->dt, a->E, n, a->lo + u, a->hi + u, &e);
    }
}

static void *chunk_buffer(const agroups_t *a) {
    return malloc((size_t)(chunk(a->dt, a->E) * a->E * (a->dt == QS_F32 ? 4 : 2)));
}

typedef struct { const agroups_t *a; int64_t u0, u1; } ajob_t;

static void *arun(void *p) {  /* exact() of a share; non-NULL: no memory */
    ajob_t *j = (ajob_t *)p;
    void *buf = chunk_buffer(j->a);
    if (!buf) return p;
    exact(j->a, j->u0, j->u1, buf);
    free(buf);
    return NULL;
}

/* Units the fast pass left undone or unsure, again by exact(), each with its whole chunk
   of the share qs_unit_minmax would give it on `threads`: every unit of rows [rows, R), and
   any whose min or max is a zero (its sign depends on the order the values meet) or NaN
   (a block of rows that held one). Returns 0, or 1 without memory. */
static int redo(const agroups_t *a, int64_t rows, int threads) {
    const int64_t U = a->R * a->G, k = chunk(a->dt, a->E);
    void *buf = NULL;
    int t = 0;
    for (int64_t u = 0; u < U; ++u) {
        if (u < rows * a->G) {  /* (rows past them: nothing written yet) */
            const float l = a->lo[u], h = a->hi[u];
            if (l != 0 && h != 0 && l == l) continue;
        }
        if (!buf && !(buf = chunk_buffer(a))) return 1;
        while (U * (t + 1) / threads <= u) ++t;
        const int64_t s0 = U * t / threads, s1 = U * (t + 1) / threads;
        const int64_t c0 = s0 + (u - s0) / k * k, c1 = c0 + k < s1 ? c0 + k : s1;
        exact(a, c0, c1, buf);
        u = c1 - 1;
    }
    free(buf);
    return 0;
}

#if defined(__AVX2__) && defined(__F16C__)
/* The fast pass: 8 rows at a time, one vector lane a row, every column's 8 values folded
   into its group's running min / max (a column's group from a table), so each element is
   read once, in memory order; exact but for the sign of a zero min / max (the order differs
   from the row kernel's: redo() takes those units, and blocks that hold NaN, again). */
typedef struct { const agroups_t *a; const int32_t *grp; int64_t b0, b1; } vjob_t;

/* (load8(), elem() and TRANSPOSE8: the column kernel's, above) */

/* The running min / max of the group at L / H (8 lanes: the block's rows) take v in. */
static inline void fold8(float *L, float *H, __m256 v) {
    _mm256_storeu_ps(L, _mm256_min_ps(_mm256_loadu_ps(L), v));
    _mm256_storeu_ps(H, _mm256_max_ps(_mm256_loadu_ps(H), v));
}

/* One block of 8 rows at x (rs, cs: bytes) into L / H ([G][8]); returns whether it held
   NaN. Rows of contiguous columns: 8 x 8 tiles transposed; else (rs of one element) each
   column's 8 rows are one load. */
static int block8(const agroups_t *a, const int32_t *grp, const char *x, int64_t rs,
                  int64_t cs, float *L, float *H) {
    const int dt = a->dt;
    __m256 any = _mm256_setzero_ps();
    int64_t c = 0;
    if (a->cs == 1) {
        for (; c + 8 <= a->C; c += 8) {
            const char *p = x + c * cs;
            __m256 v0 = load8(p, dt), v1 = load8(p + rs, dt), v2 = load8(p + 2 * rs, dt);
            __m256 v3 = load8(p + 3 * rs, dt), v4 = load8(p + 4 * rs, dt);
            __m256 v5 = load8(p + 5 * rs, dt), v6 = load8(p + 6 * rs, dt);
            __m256 v7 = load8(p + 7 * rs, dt);
            /* (an unordered compare of two finds NaN in either) */
            const __m256 n01 = _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q);
            const __m256 n23 = _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q);
            const __m256 n45 = _mm256_cmp_ps(v4, v5, _CMP_UNORD_Q);
            const __m256 n67 = _mm256_cmp_ps(v6, v7, _CMP_UNORD_Q);
            any = _mm256_or_ps(any, _mm256_or_ps(_mm256_or_ps(n01, n23), _mm256_or_ps(n45, n67)));
            TRANSPOSE8(v0, v1, v2, v3, v4, v5, v6, v7);
            const int32_t *g = grp + c;
            fold8(L + g[0] * 8, H + g[0] * 8, v0); fold8(L + g[1] * 8, H + g[1] * 8, v1);
            fold8(L + g[2] * 8, H + g[2] * 8, v2); fold8(L + g[3] * 8, H + g[3] * 8, v3);
            fold8(L + g[4] * 8, H + g[4] * 8, v4); fold8(L + g[5] * 8, H + g[5] * 8, v5);
            fold8(L + g[6] * 8, H + g[6] * 8, v6); fold8(L + g[7] * 8, H + g[7] * 8, v7);
        }
        int nan = 0;
        for (; c < a->C; ++c)  /* the last columns, each row's value alone */
            for (int i = 0; i < 8; ++i) {
                const float v = elem(x + c * cs + i * rs, dt);
                float *l = L + grp[c] * 8 + i, *h = H + grp[c] * 8 + i;
                *l = v < *l ? v : *l;
                *h = v > *h ? v : *h;
                nan |= v != v;
            }
        return nan || _mm256_movemask_ps(any);
    }
    for (; c < a->C; ++c) {
        const __m256 v = load8(x + c * cs, dt);
        any = _mm256_or_ps(any, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        fold8(L + grp[c] * 8, H + grp[c] * 8, v);
    }
    return _mm256_movemask_ps(any);
}

static void *vrun(void *p) {  /* blocks [b0, b1) of 8 rows; non-NULL: no memory */
    vjob_t *j = (vjob_t *)p;
    const agroups_t *a = j->a;
    const int64_t G = a->G, size = a->dt == QS_F32 ? 4 : 2;
    float *L = malloc((size_t)G * 16 * sizeof(float)), *H = L + G * 8;
    if (!L) return p;
    for (int64_t b = j->b0; b < j->b1; ++b) {
        for (int64_t i = 0; i < G * 8; ++i) { L[i] = INFINITY; H[i] = -INFINITY; }
        const int bad = block8(a, j->grp, a->x + b * 8 * a->rs * size, a->rs * size,
                               a->cs * size, L, H);
        float *lo = a->lo + b * 8 * G, *hi = a->hi + b * 8 * G;
        for (int64_t g = 0; g < G; ++g)
            for (int i = 0; i < 8; ++i) {  /* NaN: redo() finds the block's true values */
                lo[i * G + g] = bad ? NAN : L[g * 8 + i];
                hi[i * G + g] = bad ? NAN : H[g * 8 + i];
            }
    }
    free(L);
    return NULL;
}

/* The fast pass over the whole blocks of 8 rows, on up to `threads`; returns the rows it
   did (0: none, it does not apply, or no memory). */
static int64_t fast_pass(const agroups_t *a, int threads) {
    const int64_t blocks = a->R / 8;
    if (!blocks || (a->cs != 1 && a->rs != 1)) return 0;
    int32_t *grp = malloc((size_t)a->C * sizeof(int32_t));
    if (!grp) return 0;
    for (int64_t k = 0; k < a->C; ++k) grp[a->perm[k]] = (int32_t)(k / a->E);
    if (threads > blocks) threads = (int)blocks;
    vjob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (vjob_t){a, grp, blocks * t / threads, blocks * (t + 1) / threads};
    const int bad = qs_run_jobs(vrun, jobs, sizeof jobs[0], threads);
    free(grp);
    return bad ? 0 : blocks * 8;
}
#else
static int64_t fast_pass(const agroups_t *a, int threads) { (void)a; (void)threads; return 0; }
#endif

/* Per-unit min / max of Group(E, g_idx) over [R, C] of element type dt (see agroups_t),
   bit for bit the row kernel's on the permuted copy, on `threads` (the copy's count,
   whose split into shares decides how its units are grouped). Returns 0, or -1 (bad
   sizes), -2 (no memory: the caller copies instead). */
int64_t qs_actorder_minmax(const void *x, int64_t R, int64_t C, int64_t rs, int64_t cs,
                           const int64_t *perm, int64_t E, float *lo, float *hi, int threads,
                           int dt) {
    if (E < 1 || C % E || R < 0) return -1;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1) threads = 1;
    const agroups_t a = {(const char *)x, dt, R, C, rs, cs, E, C / E, perm, lo, hi};
    const int64_t rows = fast_pass(&a, threads);
    if (rows)
        return redo(&a, rows, threads) ? -2 : 0;
    const int64_t U = R * (C / E);
    ajob_t jobs[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (ajob_t){&a, U * t / threads, U * (t + 1) / threads};
    return qs_run_jobs(arun, jobs, sizeof jobs[0], threads) ? -2 : 0;
}

/* ---- the rows holding a value other than zero (Quark's token count) ------------------- */

/* float64 elements: qs_nonzero_rows only (the min / max kernels read float32, bf16, fp16) */
#define QS_F64 3

/* values read at a time: a vector compare each, up to the first piece holding a value != 0 */
#define QS_PIECE 64

/* Whether one of the n values at x + at (element type dt) compares != 0. */
static int piece_holds(const void *x, int dt, int64_t at, int64_t n) {
    int any = 0;
    if (dt == QS_F64) {
        const double *p = (const double *)x + at;
        for (int64_t i = 0; i < n; ++i) any |= p[i] != 0.0;
    } else if (dt == QS_F32) {
        const float *p = (const float *)x + at;
        for (int64_t i = 0; i < n; ++i) any |= p[i] != 0.0f;
    } else if (dt == QS_F16) {  /* an fp16 other than +-0 widens to a normal float, inf, NaN */
        const uint16_t *h = (const uint16_t *)x + at;
        for (int64_t i = 0; i < n; ++i) any |= (h[i] & 0x7fff) != 0;
    } else {  /* bf16: float32's upper half, compared as float32 */
        const uint16_t *h = (const uint16_t *)x + at;
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t w = (uint32_t)h[i] << 16;
            float f;
            memcpy(&f, &w, 4);
            any |= f != 0.0f;
        }
    }
    return any;
}

static int row_holds(const void *x, int dt, int64_t at, int64_t n) {
    for (int64_t i = 0; i < n; i += QS_PIECE)
        if (piece_holds(x, dt, at + i, n - i < QS_PIECE ? n - i : QS_PIECE)) return 1;
    return 0;
}

/* How many of the `rows` rows of `cols` values at x (element type dt, or QS_F64) hold a value
   that compares != 0: NaN does, +-0.0 does not, a subnormal float32 / bf16 / float64 as the
   calling thread's denormal mode reads it (torch's compare too). Quark's token count
   ((x != 0).any(-1).sum()); a row is read up to its first such value. -1: bad sizes. */
int64_t qs_nonzero_rows(const void *x, int64_t rows, int64_t cols, int dt) {
    if (rows < 0 || cols < 1 || dt < QS_F32 || dt > QS_F64) return -1;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; ++r)
        n += row_holds(x, dt, r * cols, cols);
    return n;
}
