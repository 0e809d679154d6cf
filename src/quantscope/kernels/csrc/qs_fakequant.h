/* The float32 steps of quantscope.qdq.fake_quantize_units,
   d = (clamp(nearbyint(x / s + z), qmin, qmax) - z) * s - x, scalar (dq1) and as one SIMD
   vector (dqv, VW lanes: AVX-512 or AVX2, with float64 helpers), written once here so the
   MSE search and the histogram error round alike (each tests itself against torch bitwise).
   The float element formats (fp4, fp6, fp8: MX and NVFP4 blocks) round as
   formats.FloatFormat.round does: fq1 / fqv, same layout. */
#ifndef QS_FAKEQUANT_H
#define QS_FAKEQUANT_H

#include <stdint.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* d = (clamp(nearbyint(x / s + z), qmin, qmax) - z) * s - x, each float32 op rounded as
   the torch ops of fake_quantize_units round it (no contraction: -ffp-contract=off).
   With z == 0 the two zero-point ops are skipped: they change nothing but the sign of a
   zero, which the square drops. */
static inline float dq1(float v, float s, float z, float qmin, float qmax) {
    float t = v / s;
    t = t + z;
    t = nearbyintf(t);
    t = t < qmin ? qmin : t;  /* NaN kept, as torch.clamp keeps it (0 / 0) */
    t = t > qmax ? qmax : t;
    float d = (t - z) * s;
    return d - v;
}

/* A float element format as FloatFormat.round sees it: the float32 exponent field of the
   smallest normal value ((min_exp + 127) << 23), mbits << 23, and the largest finite value. */
typedef struct { int32_t min_field, shift; float fmax; } qs_ffmt;

static inline qs_ffmt qs_ffmt_of(int64_t min_exp, int64_t mbits, double fmax) {
    qs_ffmt f = {(int32_t)((min_exp + 127) << 23), (int32_t)(mbits << 23), (float)fmax};
    return f;
}

/* d = round_f(v / s) * s - v with round_f FloatFormat.round: the step 2 ** (e - mbits) from
   the exponent field of t (at least min_exp's, at most the top binade's: inf's step is finite,
   so inf saturates at mbits 0 too), t / step rounded half to even, times the step, clamped to
   +-fmax (NaN kept: torch's clamp_). */
static inline float fq1(float v, float s, qs_ffmt f) {
    float t = v / s;
    union { float x; int32_t i; } u = {t};
    int32_t field = u.i & 0x7F800000;
    field = field < f.min_field ? f.min_field : (field > (254 << 23) ? (254 << 23) : field);
    union { int32_t i; float x; } st = {field - f.shift};
    float q = nearbyintf(t / st.x) * st.x;
    q = q < -f.fmax ? -f.fmax : (q > f.fmax ? f.fmax : q);
    return q * s - v;
}

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline __attribute__((always_inline)) vf dqv(vf v, vf s, vf z, vf lo, vf hi, int zero) {
    vf t = _mm512_div_ps(v, s);
    if (!zero) t = _mm512_add_ps(t, z);
    t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_min_ps(hi, _mm512_max_ps(lo, t));  /* NaN kept: the 2nd operand */
    if (!zero) t = _mm512_sub_ps(t, z);
    return _mm512_sub_ps(_mm512_mul_ps(t, s), v);
}
/* fq1 of VW lanes (min / max with the operands in the order that keeps a NaN, as clamp_).
   It multiplies by 1 / step where fq1 divides by the step: a power of two whose inverse,
   field 254 - e_step, is a normal float32 for a step up to 2 ** 126 (the field is capped at
   254 << 23, as in fq1: it changes the step only for an inf or NaN t, whose quotient stays
   inf or NaN), so both are exact and the bits equal. A step of 2 ** 127 (mbits 0: t in the
   top binade, inf or NaN, or min_exp 127) has a subnormal inverse, which that pattern makes
   0: those lanes divide by the step, on a branch that normal steps never take. */
static inline __attribute__((always_inline)) vf fqv(vf v, vf s, __m512i mf, __m512i sh,
                                                    vf top, vf bottom) {
    vf t = _mm512_div_ps(v, s);
    __m512i field = _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(0x7F800000));
    field = _mm512_max_epi32(field, mf);
    __m512i step = _mm512_sub_epi32(_mm512_min_epi32(field, _mm512_set1_epi32(254 << 23)), sh);
    vf st = _mm512_castsi512_ps(step);
    vf rst = _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(254 << 23), step));
    vf u = _mm512_mul_ps(t, rst);
    __mmask16 big = _mm512_cmpeq_epi32_mask(step, _mm512_set1_epi32(254 << 23));
    if (big) u = _mm512_mask_div_ps(u, big, t, st);
    vf q = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_mul_ps(q, st)));
    return _mm512_sub_ps(_mm512_mul_ps(q, s), v);
}
typedef __m512i vi;
#define VISET1 _mm512_set1_epi32
#define VSET1 _mm512_set1_ps
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
typedef __m512d vd;
#define DZERO _mm512_setzero_pd
#define DADD _mm512_add_pd
#define DMUL _mm512_mul_pd
#define DLOAD _mm512_loadu_pd
#define DLO(f) _mm512_cvtps_pd(_mm512_castps512_ps256(f))
#define DHI(f) _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1))
#define DSUM _mm512_reduce_add_pd
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vf;
static inline __attribute__((always_inline)) vf dqv(vf v, vf s, vf z, vf lo, vf hi, int zero) {
    vf t = _mm256_div_ps(v, s);
    if (!zero) t = _mm256_add_ps(t, z);
    t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm256_min_ps(hi, _mm256_max_ps(lo, t));  /* NaN kept: the 2nd operand */
    if (!zero) t = _mm256_sub_ps(t, z);
    return _mm256_sub_ps(_mm256_mul_ps(t, s), v);
}
/* as the AVX-512 fqv: the lanes with a step of 2 ** 127 divide, blended in */
static inline __attribute__((always_inline)) vf fqv(vf v, vf s, __m256i mf, __m256i sh,
                                                    vf top, vf bottom) {
    vf t = _mm256_div_ps(v, s);
    __m256i field = _mm256_and_si256(_mm256_castps_si256(t), _mm256_set1_epi32(0x7F800000));
    field = _mm256_max_epi32(field, mf);
    __m256i step = _mm256_sub_epi32(_mm256_min_epi32(field, _mm256_set1_epi32(254 << 23)), sh);
    vf st = _mm256_castsi256_ps(step);
    vf rst = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(254 << 23), step));
    vf u = _mm256_mul_ps(t, rst);
    __m256i big = _mm256_cmpeq_epi32(step, _mm256_set1_epi32(254 << 23));
    if (!_mm256_testz_si256(big, big))
        u = _mm256_blendv_ps(u, _mm256_div_ps(t, st), _mm256_castsi256_ps(big));
    vf q = _mm256_round_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(top, _mm256_max_ps(bottom, _mm256_mul_ps(q, st)));
    return _mm256_sub_ps(_mm256_mul_ps(q, s), v);
}
typedef __m256i vi;
#define VISET1 _mm256_set1_epi32
#define VSET1 _mm256_set1_ps
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
typedef __m256d vd;
#define DZERO _mm256_setzero_pd
#define DADD _mm256_add_pd
#define DMUL _mm256_mul_pd
#define DLOAD _mm256_loadu_pd
#define DLO(f) _mm256_cvtps_pd(_mm256_castps256_ps128(f))
#define DHI(f) _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))
static inline double DSUM(vd a) {
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
#endif

#ifdef VW
/* fqv's operands for scale s and float format f (a qs_ffmt), declared where a loop calls
   fqv(v, vs, mf, sh, top, bottom) */
#define QS_FQV_CONSTS(s, f)                                                                   \
    const vf vs = VSET1(s), top = VSET1((f).fmax), bottom = VSET1(-(f).fmax);                 \
    const vi mf = VISET1((f).min_field), sh = VISET1((f).shift)
#endif

#endif /* QS_FAKEQUANT_H */
