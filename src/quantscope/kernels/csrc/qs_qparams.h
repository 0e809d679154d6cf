/* The integer branch of quantscope.qparams.qparams_from_range with fp32 scales, the same
   float32 steps in its order, so a kernel can price candidate ranges it generates itself
   (tests/kernels/test_native.py compares it with qparams_from_range bitwise). q holds
   quantscope.kernels.qparams_consts(spec). */
#ifndef QS_QPARAMS_H
#define QS_QPARAMS_H

#include <math.h>
#include <float.h>

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
