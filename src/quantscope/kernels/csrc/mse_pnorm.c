/* Called from quantscope.estimators.mse_compat through quantscope.kernels; that module's doc
   says what it computes, how close it is to torch's float32 error, and how the search uses
   that bound to reproduce torch's choices bit for bit.

   qs_pnorm_price: E[c, u] = sum_j |d_j| ** p over the elements of unit u under candidate c,
   d = fake_quant(x) - x exactly as torch rounds it (qs_fakequant.h), |d| ** p by the
   approximation below (relative error under 2^-18 (1 + p), tested), summed in float64.

   |a| ** p, a = m 2^e with m in [0.75, 1.5): 2^(p e + p log2 m). p = ph + pl with ph of 12
   significant bits, so ph e (|e| <= 150) is exact in float32 and splits exactly into an
   integer n and a fraction f; r = f + pl e + p log2 m (|r| < 2 + p) carries float32
   rounding errors of ~1e-7 absolute; 2^r = 2^k P(r - k), k = round(r); the result is
   P 2^(n + k), scaled exactly (rounded only when it falls below float32's normal range:
   an absolute error of at most 2^-149, as torch's own float32 result has). 0, inf and NaN
   give a * a (0, inf, NaN). */
#include "qs_parallel.h"
#include "qs_fakequant.h"

typedef struct { float p, ph, pl; } pw_t;

static pw_t pw_make(double p) {
    int e;
    double m = frexp(p, &e);
    double ph = ldexp(nearbyint(ldexp(m, 12)), e - 12);
    pw_t w = {(float)p, (float)ph, (float)(p - ph)};
    return w;
}

/* log2(1 + x) / x on x in [-0.25, 0.5] (Chebyshev fit; log2 within 1.8e-7 absolute) */
#define L0 1.4426952600479126f
#define L1 -0.7213506698608398f
#define L2 0.4808475077152252f
#define L3 -0.3603352904319763f
#define L4 0.29007357358932495f
#define L5 -0.2506521940231323f
#define L6 0.20412734150886536f
#define L7 -0.09616397321224213f
/* 2^r on r in [-0.5, 0.5] (Chebyshev fit; within 2.6e-7 relative) */
#define X0 1.0000001192092896f
#define X1 0.6931471824645996f
#define X2 0.2402210682630539f
#define X3 0.05550327152013779f
#define X4 0.009676037356257439f
#define X5 0.0013400432653725147f
/* both polynomials in Horner form, and the range reduction below, written once for the
   scalar and the vector loops: each defines PV (a constant of its type), FMA (a * b + c:
   fused in the vector loops, two roundings in the scalar one), ADD, SUB, MUL and RND (round
   to nearest even) */
#define LOG2_Q(x) FMA(FMA(FMA(FMA(FMA(FMA(FMA(PV(L7), x, PV(L6)), x, PV(L5)), x, PV(L4)), \
                                  x, PV(L3)), x, PV(L2)), x, PV(L1)), x, PV(L0))
#define EXP2_P(t) FMA(FMA(FMA(FMA(FMA(PV(X5), t, PV(X4)), t, PV(X3)), t, PV(X2)), t, PV(X1)), \
                      t, PV(X0))
/* m 2^e -> |a| ** p = P 2^nk (the header's steps): declares P and nk, of type T */
#define POW_REDUCE(T, m, e, w, P, nk)                                                    \
    const T x_ = SUB(m, PV(1.0f)), l_ = MUL(LOG2_Q(x_), x_);                              \
    const T hp_ = MUL(PV((w)->ph), e), n_ = RND(hp_), f_ = SUB(hp_, n_);                 \
    const T r_ = ADD(f_, FMA(PV((w)->pl), e, MUL(PV((w)->p), l_))), k_ = RND(r_);        \
    const T P = EXP2_P(SUB(r_, k_)), nk = ADD(n_, k_)

#define PV(c) (c)
#define FMA(a, b, c) ((a) * (b) + (c))
#define ADD(a, b) ((a) + (b))
#define SUB(a, b) ((a) - (b))
#define MUL(a, b) ((a) * (b))
#define RND nearbyintf
static float pow1(float a, const pw_t *w) {
    if (!(a > 0.0f) || a == INFINITY) return a * a;
    int ie = ilogbf(a);
    float m = scalbnf(a, -ie), e = (float)ie;
    if (m >= 1.5f) { m *= 0.5f; e += 1.0f; }
    POW_REDUCE(float, m, e, w, P, nk);
    return scalbnf(P, (int)nk);
}
#undef PV
#undef FMA
#undef ADD
#undef SUB
#undef MUL
#undef RND

#if defined(__AVX512F__)
#define PV _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define MUL _mm512_mul_ps
#define RND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __attribute__((always_inline)) __m512 powv(__m512 a, const pw_t *w) {
    const __m512 one = PV(1.0f);
    __mmask16 ok = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ)
                 & _mm512_cmp_ps_mask(a, PV(INFINITY), _CMP_LT_OQ);
    __m512 e = _mm512_getexp_ps(a);
    __m512 m = _mm512_getmant_ps(a, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
    e = _mm512_mask_add_ps(e, _mm512_cmp_ps_mask(m, one, _CMP_LT_OQ), e, one);
    POW_REDUCE(__m512, m, e, w, P, nk);
    return _mm512_mask_blend_ps(ok, _mm512_mul_ps(a, a), _mm512_scalef_ps(P, nk));
}

/* sum |d| ** p of one unit under (s, z); the tail through masked loads (zeros add 0) */
static inline __attribute__((always_inline)) double pprice_(const float *x, int64_t E, float s,
                                                          float z, float qmin, float qmax,
                                                          const pw_t *w, int zero) {
    const __m512 vs = PV(s), vz = PV(z), vlo = PV(qmin), vhi = PV(qmax);
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    __m512d a2 = _mm512_setzero_pd(), a3 = _mm512_setzero_pd();
    int64_t j = 0;
    for (; j + 32 <= E; j += 32) {
        __m512 t0 = powv(_mm512_abs_ps(dqv(VLOAD(x + j), vs, vz, vlo, vhi, zero)), w);
        __m512 t1 = powv(_mm512_abs_ps(dqv(VLOAD(x + j + 16), vs, vz, vlo, vhi, zero)), w);
        a0 = _mm512_add_pd(a0, DLO(t0)); a1 = _mm512_add_pd(a1, DHI(t0));
        a2 = _mm512_add_pd(a2, DLO(t1)); a3 = _mm512_add_pd(a3, DHI(t1));
    }
    for (; j < E; j += 16) {
        __mmask16 mk = E - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (E - j)) - 1u);
        __m512 d = dqv(_mm512_maskz_loadu_ps(mk, x + j), vs, vz, vlo, vhi, zero);
        __m512 t = _mm512_maskz_mov_ps(mk, powv(_mm512_abs_ps(d), w));
        a0 = _mm512_add_pd(a0, DLO(t)); a1 = _mm512_add_pd(a1, DHI(t));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}

static double pprice(const float *x, int64_t E, float s, float z, float qmin, float qmax,
                     const pw_t *w) {
    return z == 0.0f ? pprice_(x, E, s, z, qmin, qmax, w, 1)
                     : pprice_(x, E, s, z, qmin, qmax, w, 0);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define PV _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define MUL _mm256_mul_ps
#define RND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define IV _mm256_set1_epi32
/* |a| ** p of 8 lanes (a >= 0) as float64 (lanes 0-3, 4-7): no getexp / scalef here, so
   the exponent comes from the bits (subnormals scaled by 2^24 first) and the result is
   P 2^(n + k) built in float64 (exact; no float32 rounding). 0 gives 0; inf and NaN give
   NaN (the caller's torch fallback). */
static inline __attribute__((always_inline)) void powv(__m256 a, const pw_t *w, __m256d *r0,
                                                     __m256d *r1) {
    const __m256 one = PV(1.0f);
    __m256 sub = _mm256_cmp_ps(a, PV(0x1p-126f), _CMP_LT_OQ);
    __m256i bits = _mm256_castps_si256(_mm256_blendv_ps(a, _mm256_mul_ps(a, PV(0x1p24f)), sub));
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), IV(127)));
    e = _mm256_sub_ps(e, _mm256_and_ps(sub, PV(24.0f)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, IV(0x7FFFFF)),
                                                   IV(0x3F800000)));
    __m256 big = _mm256_cmp_ps(m, PV(1.5f), _CMP_GE_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, PV(0.5f)), big);
    e = _mm256_add_ps(e, _mm256_and_ps(big, one));
    POW_REDUCE(__m256, m, e, w, P0, nk);
    __m256 P = _mm256_and_ps(P0, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ)); /* 0 -> 0 */
    P = _mm256_add_ps(P, _mm256_sub_ps(a, a));  /* inf, NaN -> NaN */
    __m256i j = _mm256_add_epi32(_mm256_cvtps_epi32(nk), IV(1023));
    __m256d s0 = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(j)), 52));
    __m256d s1 = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(j, 1)), 52));
    *r0 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(P)), s0);
    *r1 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(P, 1)), s1);
}

static inline __m256i tail_mask(int64_t left) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), lane);
}

static inline __attribute__((always_inline)) double pprice_(const float *x, int64_t E, float s,
                                                          float z, float qmin, float qmax,
                                                          const pw_t *w, int zero) {
    const __m256 vs = PV(s), vz = PV(z), vlo = PV(qmin), vhi = PV(qmax), sign = PV(-0.0f);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), t0, t1;
    for (int64_t j = 0; j < E; j += 8) {
        __m256 v = j + 8 <= E ? VLOAD(x + j) : _mm256_maskload_ps(x + j, tail_mask(E - j));
        powv(_mm256_andnot_ps(sign, dqv(v, vs, vz, vlo, vhi, zero)), w, &t0, &t1);
        a0 = _mm256_add_pd(a0, t0); a1 = _mm256_add_pd(a1, t1);
    }
    return DSUM(_mm256_add_pd(a0, a1));
}

static double pprice(const float *x, int64_t E, float s, float z, float qmin, float qmax,
                     const pw_t *w) {
    return z == 0.0f ? pprice_(x, E, s, z, qmin, qmax, w, 1)
                     : pprice_(x, E, s, z, qmin, qmax, w, 0);
}
#else
static double pprice(const float *x, int64_t E, float s, float z, float qmin, float qmax,
                     const pw_t *w) {
    double acc = 0.0;
    for (int64_t j = 0; j < E; ++j) acc += (double)pow1(fabsf(dq1(x[j], s, z, qmin, qmax)), w);
    return acc;
}
#endif

/* The SIMD lanes of this build's loop: 16 (AVX-512), 8 (AVX2 + FMA), 0 (the scalar loop,
   ~10x slower than torch's path: the caller keeps torch unless the kernel is asked for). */
int64_t qs_pnorm_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 0;
#endif
}

/* |a| ** p of every element by the kernel's approximation (tests): vector (when built with
   AVX-512, the tail masked) or scalar (the other builds' code) */
int64_t qs_pnorm_pow(const float *x, int64_t n, double p, int scalar, float *out) {
    pw_t w = pw_make(p);
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; !scalar && j < n; j += 16) {
        __mmask16 mk = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, x + j));
        _mm512_mask_storeu_ps(out + j, mk, powv(v, &w));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; !scalar && j < n; j += 8) {
        __m256i mk = tail_mask(n - j);
        __m256d r0, r1;
        powv(_mm256_andnot_ps(PV(-0.0f), _mm256_maskload_ps(x + j, mk)), &w, &r0, &r1);
        __m256 v = _mm256_set_m128(_mm256_cvtpd_ps(r1), _mm256_cvtpd_ps(r0));
        _mm256_maskstore_ps(out + j, mk, v);
    }
#endif
    (void)scalar;
    for (; j < n; ++j) out[j] = pow1(fabsf(x[j]), &w);
    return 0;
}

typedef struct {
    const float *x; int64_t E; const float *sc; const int32_t *zp; int64_t k, n;
    float qmin, qmax; pw_t w; double *out;
} pp_t;

static void pprice_unit(void *p, int64_t i, int tid) {
    pp_t *c = (pp_t *)p;
    const float *xu = c->x + i * c->E;
    for (int64_t j = 0; j < c->k; ++j) {
        int64_t o = j * c->n + i;
        c->out[o] = pprice(xu, c->E, c->sc[o], (float)c->zp[o], c->qmin, c->qmax, &c->w);
    }
    (void)tid;
}

/* out[j, i] (float64 [k, n]) = sum |d| ** p of unit i (rows of x [n, E]) under candidate j
   (sc, zp [k, n]), threads over units. */
int64_t qs_pnorm_price(const float *x, int64_t E, int64_t n, const float *sc,
                       const int32_t *zp, int64_t k, double qmin, double qmax, double p,
                       double *out, int threads) {
    pp_t c = {x, E, sc, zp, k, n, (float)qmin, (float)qmax, pw_make(p), out};
    parallel(pprice_unit, &c, n, threads, 4.0 * (double)n * k * E);
    return 0;
}
