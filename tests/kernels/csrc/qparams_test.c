/* Test-only wrapper of qs_qparams.h over arrays (tests/kernels/test_native.py compares it with
   quantscope.qparams_from_range bit for bit). */
#include <stdint.h>
#include "qs_qparams.h"

int64_t qs_qparams_all(const float *lo, const float *hi, const double *q, float *s, float *z,
                       int64_t n) {
    for (int64_t i = 0; i < n; ++i) qs_qparams(lo[i], hi[i], q, s + i, z + i);
    return 0;
}
