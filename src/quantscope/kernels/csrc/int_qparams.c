/* Called from quantscope.qparams.qparams_from_range through quantscope.kernels: its integer
   branch with fp32 scales over many units in one pass (group-128 min-max of a 4096 x 4096
   weight has 131,072 units; the torch ops take ten passes over them). Bitwise the torch
   branch (qs_qparams.h, tests/kernels/test_native.py). */
#include <stdint.h>
#include <math.h>
#include "qs_qparams.h"

/* scale / zero point of the n ranges [lo[i], hi[i]] (q: qs_qparams' constants). Returns 1
   when a range holds NaN or inf (nothing written: the caller raises, or runs the torch
   branch), else 2 when some lo > hi (qs_range_flags), else 0. */
int64_t qs_int_qparams(const float *lo, const float *hi, int64_t n, const double *q,
                       float *scale, int32_t *zp) {
    int flags = 0;
    for (int64_t i = 0; i < n; ++i)  /* its own pass: vectorized, read from cache after */
        flags |= qs_range_flags(lo[i], hi[i]);
    if (flags & 1) return 1;
    for (int64_t i = 0; i < n; ++i) {
        float s, z;
        qs_qparams(lo[i], hi[i], q, &s, &z);
        scale[i] = s;
        zp[i] = (int32_t)z;
    }
    return flags;
}
