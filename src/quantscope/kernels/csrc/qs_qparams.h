/* The integer branch of quantscope.qparams.qparams_from_range with fp32 scales, the same
   float32 steps in its order, so a kernel can price candidate ranges it generates itself
   (tests/kernels/test_native.py compares it with qparams_from_range bitwise). q holds
   quantscope.kernels.qparams_consts(spec). */
#ifndef QS_QPARAMS_H
#define QS_QPARAMS_H

#include <math.h>
#include <float.h>

/* what the qparams kernels return of their ranges, as flags a pass ORs: 1 where an end is
   NaN or inf (nothing usable: the caller raises, or runs the torch branch), 2 where lo > hi
   (computed as the torch branch does, from the clamped ends; qparams_from_range's checked
   calls refuse it, so they need no pass of their own over the ranges) */
static inline int qs_range_flags(float lo, float hi) {
    return (!(fabsf(lo) < INFINITY) | !(fabsf(hi) < INFINITY)) | ((lo > hi) << 1);
}

/* a pass's OR of qs_range_flags as its return value: 1 (not finite) outranks 2 */
static inline int64_t qs_range_result(int flags) { return flags & 1 ? 1 : flags; }

/* q: qmin, qmax, min_scale, symmetric (0 / 1), the symmetric zero point */
static inline void qs_qparams(float lo, float hi, const double *q, float *s, float *z) {
    const float qmin = (float)q[0], qmax = (float)q[1];
    lo = 0.0f < lo ? 0.0f : lo;                      /* lo.clamp(max=0) */
    hi = hi < 0.0f ? 0.0f : hi;                      /* hi.clamp(min=0) */
    float scale;
    if (q[3] != 0.0) {
        float amax = -lo < hi ? hi : -lo;            /* torch.maximum(-lo, hi) */
        scale = amax / ((qmax - qmin) / 2.0f);
    } else {
        scale = (hi - lo) / (qmax - qmin);
        if (!isfinite(scale)) scale = hi / (qmax - qmin) - lo / (qmax - qmin);
    }
    if (scale < (float)q[2]) scale = (float)q[2];    /* clamp(min=min_scale) */
    if (scale < 0x1p-149f) scale = 0x1p-149f;        /* encode_scale fp32: subnormal min */
    if (scale > FLT_MAX) scale = FLT_MAX;
    *s = scale;
    if (q[3] != 0.0) { *z = (float)q[4]; return; }
    float t = nearbyintf(qmin - lo / scale);
    *z = t < qmin ? qmin : (t > qmax ? qmax : t);
}

#endif /* QS_QPARAMS_H */
