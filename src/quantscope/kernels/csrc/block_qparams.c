/* Called from quantscope.qparams.qparams_from_range through quantscope.kernels: its MX (E8M0)
   and NVFP4 (fp8 e4m3 block scale) branches over many blocks in one pass each (MXFP4 of a
   4096 x 4096 weight has 524,288 blocks; the torch ops take a dozen passes over them). The
   same float32 steps as the torch branch (scales.e8m0_scale, formats.FloatFormat.round),
   bitwise (tests/kernels/test_block_qparams.py). */
#include <stdint.h>
#include <math.h>
#include "qs_qparams.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* max(-min(lo, 0), max(hi, 0)) as the torch branch: clamp, then torch.maximum */
static inline float block_amax(float lo, float hi) {
    lo = 0.0f < lo ? 0.0f : lo;
    hi = hi < 0.0f ? 0.0f : hi;
    return -lo < hi ? hi : -lo;
}

static int finite_ranges(const float *lo, const float *hi, int64_t n) {
    int flags = 0;
    for (int64_t i = 0; i < n; ++i)
        flags |= qs_range_flags(lo[i], hi[i]);
    return !(flags & 1);
}

static inline int32_t bits_of(float x) { union { float f; int32_t i; } u = {x}; return u.i; }
static inline float float_of(int32_t i) { union { int32_t i; float f; } u = {i}; return u.f; }

/* frexp of a non-negative finite x from its bits (subnormals scaled up by 2**24 first):
   x = m * 2**e, m in [0.5, 1), and (0, 0) for 0 as frexpf; inline, so the loops vectorize
   (libm's frexpf is a call) */
static inline int frexp_pos(float x, float *m) {
    const int sub = bits_of(x) < 0x00800000;
    const int32_t b = bits_of(sub ? x * 0x1p24f : x);
    *m = x == 0.0f ? 0.0f : float_of((b & 0x007FFFFF) | (126 << 23));
    return x == 0.0f ? 0 : ((b >> 23) & 255) - 126 - (sub ? 24 : 0);
}

/* exactly 2**k as float32 for k in [-149, 127] */
static inline float exp2i(int k) {
    return k >= -126 ? float_of((k + 127) << 23) : float_of(1 << (k + 149));
}

#if defined(__AVX2__)
/* block_amax of 8 ranges: min / max take their operands in the order that makes their
   compare the scalar one (vminps(a, b) is a < b ? a : b), so the bits are the same */
static inline __m256 block_amax8(__m256 l, __m256 h) {
    const __m256 z = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    return _mm256_max_ps(_mm256_max_ps(z, h), _mm256_xor_ps(_mm256_min_ps(z, l), sign));
}

/* all-ones lanes where |l| or |h| is not below inf (NaN or inf) */
static inline __m256 nonfinite8(__m256 l, __m256 h) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    return _mm256_or_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, l), inf, _CMP_NLT_UQ),
                        _mm256_cmp_ps(_mm256_andnot_ps(sign, h), inf, _CMP_NLT_UQ));
}

/* the vector loop's qs_range_flags: its two lane masks as the flags */
static inline int range_flags8(__m256 nonfinite, __m256 disordered) {
    return (_mm256_movemask_ps(nonfinite) != 0) | ((_mm256_movemask_ps(disordered) != 0) << 1);
}

/* frexp_pos of 8 lanes: the exponents, the mantissas in *m */
static inline __m256i frexp_pos8(__m256 x, __m256 *m) {
    const __m256i b0 = _mm256_castps_si256(x);
    const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), b0);
    const __m256i b = _mm256_castps_si256(_mm256_blendv_ps(
        x, _mm256_mul_ps(x, _mm256_set1_ps(0x1p24f)), _mm256_castsi256_ps(sub)));
    const __m256i zero = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
    *m = _mm256_castsi256_ps(_mm256_andnot_si256(zero, _mm256_or_si256(
        _mm256_and_si256(b, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(126 << 23))));
    __m256i e = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 23),
                                                  _mm256_set1_epi32(255)),
                                 _mm256_set1_epi32(126));
    e = _mm256_sub_epi32(e, _mm256_and_si256(sub, _mm256_set1_epi32(24)));
    return _mm256_andnot_si256(zero, e);
}

/* -1 where a == b (the scalar's 1, subtracted instead of added) */
static inline __m256i eq8(__m256 a, float b) {
    return _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_EQ_OQ));
}

/* exp2i of 8 lanes, k in [-127, 127] */
static inline __m256 exp2i8(__m256i k) {
    const __m256i normal = _mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(1),
                                          _mm256_add_epi32(k, _mm256_set1_epi32(149)));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(
        sub, normal, _mm256_cmpgt_epi32(k, _mm256_set1_epi32(-127))));
}

/* the exponent k of 8 blocks' E8M0 scales before the clamp, from safe = their amax (1 where
   it is 0), per mode as the scalar loop's K; fmax = mf * 2**ef (frexp) */
static inline __m256i e8m0_k8(int mode, __m256 safe, __m256 top, float mf, int ef, int em) {
    const __m256i one = _mm256_set1_epi32(1), vem = _mm256_set1_epi32(em);
    __m256 m;
    const __m256i e = frexp_pos8(safe, &m);
    if (mode == 0)
        return _mm256_sub_epi32(_mm256_sub_epi32(e, one), vem);
    if (mode == 1)
        return _mm256_sub_epi32(_mm256_add_epi32(e, eq8(m, 0.5f)), vem);
    if (mode == 2) {  /* e - 1 + (floor(m * top + 0.5) >= top) - em */
        const __m256 r = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(m, top),
                                                       _mm256_set1_ps(0.5f)));
        const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(r, top, _CMP_GE_OQ));
        return _mm256_sub_epi32(_mm256_sub_epi32(_mm256_sub_epi32(e, one), up), vem);
    }
    /* rceil: e - ef + (m > mf), 127 where safe is not below inf (the scalar loop's K) */
    const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(mf), _CMP_GT_OQ));
    const __m256 inf = _mm256_cmp_ps(safe, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ);
    return _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(ef)), gt),
                              _mm256_set1_epi32(127), _mm256_castps_si256(inf));
}
#endif

/* E8M0 scales 2**k of n blocks with ranges [lo, hi]; mode 0 floor, 1 ceil, 2 even (mbits
   fraction bits rounded half away), 3 rceil (ceil log2(amax / fmax), exactly: with amax =
   m * 2**e and fmax = mf * 2**ef, m / mf lies in (0.5, 2), so it is e - ef + (m > mf));
   emax the element format's. Returns 1 when a range holds NaN or inf (checked in the same
   pass: the scales are then written but meaningless) or the mode is unknown, else 2 when
   some lo > hi (qs_range_flags), else 0. The AVX2 loop is the scalar one lane for lane. */
int64_t qs_e8m0_qparams(const float *lo, const float *hi, int64_t n, int64_t mode,
                        int64_t emax, int64_t mbits, double fmax, float *scale) {
    if (mode < 0 || mode > 3) return 1;
    const float top = exp2i((int)mbits + 1);
    float mf;
    const int em = (int)emax, ef = frexp_pos((float)fmax, &mf);
    int flags = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f), vtop = _mm256_set1_ps(top);
    const __m256i kmin = _mm256_set1_epi32(-127), kmax = _mm256_set1_epi32(127);
    __m256 nonfinite = _mm256_setzero_ps(), disordered = nonfinite;
    for (; i + 8 <= n; i += 8) {
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
        nonfinite = _mm256_or_ps(nonfinite, nonfinite8(l, h));
        disordered = _mm256_or_ps(disordered, _mm256_cmp_ps(l, h, _CMP_GT_OQ));
        const __m256 amax = block_amax8(l, h);
        const __m256 none = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_LE_OQ);
        __m256i k = e8m0_k8((int)mode, _mm256_blendv_ps(amax, one, none), vtop, mf, ef, em);
        k = _mm256_blendv_epi8(k, kmin, _mm256_castps_si256(none));
        k = _mm256_min_epi32(_mm256_max_epi32(k, kmin), kmax);
        _mm256_storeu_ps(scale + i, exp2i8(k));
    }
    flags = range_flags8(nonfinite, disordered);
#endif
#define E8M0_LOOP(K)                                                          \
    for (; i < n; ++i) {                                                      \
        const float amax = block_amax(lo[i], hi[i]);                          \
        const float safe = amax <= 0.0f ? 1.0f : amax;                        \
        float m;                                                              \
        const int e = frexp_pos(safe, &m);                                    \
        (void)m;                                                              \
        (void)e;                                                              \
        int k = (K);                                                          \
        k = amax <= 0.0f ? -127 : k;                                          \
        k = k < -127 ? -127 : (k > 127 ? 127 : k);                            \
        scale[i] = exp2i(k);                                                  \
        flags |= qs_range_flags(lo[i], hi[i]);                               \
    }
    if (mode == 0) { E8M0_LOOP(e - 1 - em) }
    else if (mode == 1) { E8M0_LOOP((m == 0.5f ? e - 1 : e) - em) }
    else if (mode == 2) { E8M0_LOOP(e - 1 + (floorf(m * top + 0.5f) >= top) - em) }
    else { E8M0_LOOP(safe < INFINITY ? e - ef + (m > mf) : 127) }
#undef E8M0_LOOP
    return qs_range_result(flags);
}

/* The largest block amax of n ranges into *out (NVFP4's global amax by default). Returns 1
   when a range holds NaN or inf. */
int64_t qs_block_amax_max(const float *lo, const float *hi, int64_t n, float *out) {
    if (!finite_ranges(lo, hi, n)) return 1;
    float m = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__)
    /* finite values only, so vmaxps's NaN and signed-zero rules change nothing */
    const __m256 z = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    __m256 vm = z;
    for (; i + 8 <= n; i += 8) {
        const __m256 l = _mm256_min_ps(_mm256_loadu_ps(lo + i), z);
        const __m256 h = _mm256_max_ps(_mm256_loadu_ps(hi + i), z);
        vm = _mm256_max_ps(vm, _mm256_max_ps(_mm256_xor_ps(l, sign), h));
    }
    float t[8];
    _mm256_storeu_ps(t, vm);
    for (int j = 0; j < 8; ++j) m = t[j] > m ? t[j] : m;
#endif
    for (; i < n; ++i) {
        const float a = block_amax(lo[i], hi[i]);
        m = a > m ? a : m;
    }
    *out = m;
    return 0;
}

/* NVFP4 block scales: amax / fmax * gs rounded to fp8 e4m3 (nearest, ties to even,
   saturating at 448: FloatFormat.round with min_exp -6, 3 mantissa bits), non-positive
   ones replaced by min_scale. Returns 1 when a range holds NaN or inf (checked in the same
   pass: the scales are then written but meaningless), else 2 when some lo > hi
   (qs_range_flags), else 0. The AVX2 loop is the scalar one op for op (min / max / blend
   take their operands in the order that makes their compare the scalar one, NaN included),
   except that it multiplies by 1 / step where the scalar loop divides by the step: both are
   exact (powers of two, 2**-125 <= 1 / step <= 2**9, and the quotient is representable), so
   the bits are the same. */
int64_t qs_nvfp4_qparams(const float *lo, const float *hi, int64_t n, double fmax, double gs,
                         double min_scale, float *scale) {
    int flags = 0;
    const float fm = (float)fmax, g = (float)gs, ms = (float)min_scale;
    const int32_t min_field = (-6 + 127) << 23, shift = 3 << 23;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 z = _mm256_setzero_ps();
    const __m256 top = _mm256_set1_ps(448.0f), bottom = _mm256_set1_ps(-448.0f);
    const __m256 vfm = _mm256_set1_ps(fm), vg = _mm256_set1_ps(g), vms = _mm256_set1_ps(ms);
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000), vmin = _mm256_set1_epi32(min_field);
    const __m256i vshift = _mm256_set1_epi32(shift), inv = _mm256_set1_epi32(254 << 23);
    __m256 nonfinite = z, disordered = z;
    for (; i + 8 <= n; i += 8) {
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
        nonfinite = _mm256_or_ps(nonfinite, nonfinite8(l, h));
        disordered = _mm256_or_ps(disordered, _mm256_cmp_ps(l, h, _CMP_GT_OQ));
        const __m256 amax = block_amax8(l, h);
        const __m256 v = _mm256_mul_ps(_mm256_div_ps(amax, vfm), vg);
        const __m256i field = _mm256_max_epi32(
            _mm256_and_si256(_mm256_castps_si256(v), exp_mask), vmin);
        const __m256i step = _mm256_sub_epi32(field, vshift);
        const __m256 st = _mm256_castsi256_ps(step);
        const __m256 rst = _mm256_castsi256_ps(_mm256_sub_epi32(inv, step));  /* 1 / st */
        __m256 q = _mm256_round_ps(_mm256_mul_ps(v, rst),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_mul_ps(q, st);
        q = _mm256_min_ps(top, _mm256_max_ps(bottom, q));  /* the clamp, NaN kept */
        _mm256_storeu_ps(scale + i, _mm256_blendv_ps(vms, q, _mm256_cmp_ps(q, z, _CMP_GT_OQ)));
    }
    flags = range_flags8(nonfinite, disordered);
#endif
    for (; i < n; ++i) {
        const float v = block_amax(lo[i], hi[i]) / fm * g;
        int32_t field = bits_of(v) & 0x7F800000;
        field = field < min_field ? min_field : field;
        const float st = float_of(field - shift);   /* 2 ** (e - mbits) */
        float q = rintf(v / st) * st;                /* ties to even (the default mode) */
        q = q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q);
        scale[i] = q > 0.0f ? q : ms;
        flags |= qs_range_flags(lo[i], hi[i]);
    }
    return qs_range_result(flags);  /* 1: the scales written are to be ignored */
}
