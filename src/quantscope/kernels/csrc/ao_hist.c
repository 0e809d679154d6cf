/* Called from quantscope.stats.ao_histogram through quantscope.kernels; that module's doc says
   what it computes (torch.ao HistogramObserver's histogram) and tests compare it with its
   torch reference (torch.ao's own ops) bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define COPIES 4 /* interleaved int32 copies of the bins: a run of values in one bin is not one
                    chain of dependent increments */
#define BUF 512  /* indices computed (vectorized) per block, then counted */

/* out[k] = base[k] + float(the COPIES counts of bin k summed). */
static void add_counts(const int32_t *cp, int64_t B, const float *base, float *out) {
    for (int64_t k = 0; k < B; ++k) {
        const int32_t *c = cp + k * COPIES;
        int32_t t = 0;
        for (int q = 0; q < COPIES; ++q) t += c[q];
        out[k] = base[k] + (float)t;
    }
}

/* out[k] = base[k] + float(count of x in bin k) for torch.histc(x, B, min=lo, max=hi):
   bin trunc((x - lo) * B / (hi - lo)) in float32 as ATen's histc kernel, the right edge in
   the last bin, values outside [lo, hi] (and NaN) not counted. out may be base. Returns 1
   (nothing written) where the caller must take torch's path: lo >= hi, an infinite width,
   or n >= 2**24 (torch's float32 counts saturate there). */
int64_t qs_ao_histc(const float *x, int64_t n, float lo, float hi, int64_t B,
                    const float *base, float *out) {
    const float d = hi - lo;
    if (!(lo < hi) || !isfinite(d) || n >= ((int64_t)1 << 24) || B < 1 || B > (1 << 24))
        return 1;
    int32_t *cp = (int32_t *)calloc((size_t)(B + 1) * COPIES, sizeof(int32_t));
    if (!cp) return 1;
    const float bf = (float)B;
    const int32_t last = (int32_t)B - 1, dump = (int32_t)B;
    int32_t buf[BUF];
    for (int64_t b = 0; b < n; b += BUF) {
        const int32_t m = (int32_t)(n - b < BUF ? n - b : BUF);
        const float *xb = x + b;
        for (int32_t j = 0; j < m; ++j) { /* int32 lanes: full-width vectors */
            const float v = xb[j];
            const float p = (v - lo) * bf / d; /* in [0, B] for v in [lo, hi] */
            int32_t k = (int32_t)p;
            k = k > last ? last : k;
            k = (v >= lo && v <= hi) ? k : dump;
            buf[j] = k * COPIES + (j & (COPIES - 1));
        }
        int32_t j = 0;
        for (; j + 4 <= m; j += 4) {
            cp[buf[j]]++; cp[buf[j + 1]]++; cp[buf[j + 2]]++; cp[buf[j + 3]]++;
        }
        for (; j < m; ++j) cp[buf[j]]++;
    }
    add_counts(cp, B, base, out);
    free(cp);
    return 0;
}

/* One read of x for a batch that may fall inside the current range [lo, hi]: its min / max
   (NaN when x holds one, as torch.aminmax) into mm[0], mm[1], and, when every value lies in
   [lo, hi], out = base + its histc on that range (as qs_ao_histc); returns 0 then. Returns
   1 when some value lies outside (or is NaN): mm is still written, out is meaningless.
   Returns 2 (nothing written) where qs_ao_histc would not apply. */
int64_t qs_ao_fused(const float *x, int64_t n, float lo, float hi, int64_t B,
                    const float *base, float *out, float *mm) {
    const float d = hi - lo;
    if (!(lo < hi) || !isfinite(d) || n < 1 || n >= ((int64_t)1 << 24) || B < 1
        || B > (1 << 24))
        return 2;
    int32_t *cp = (int32_t *)calloc((size_t)(B + 1) * COPIES, sizeof(int32_t));
    if (!cp) return 2;
    const float bf = (float)B;
    const int32_t last = (int32_t)B - 1, dump = (int32_t)B;
    float mn = INFINITY, mx = -INFINITY;
    int32_t nan = 0;
#if defined(__AVX2__)
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
    __m256 vnan = _mm256_setzero_ps();
#endif
    int32_t buf[BUF];
    for (int64_t b = 0; b < n; b += BUF) {
        const int32_t m = (int32_t)(n - b < BUF ? n - b : BUF);
        const float *xb = x + b;
        int32_t j = 0;
#if defined(__AVX2__)
        /* vminps / vmaxps: NaN tracked on the side; a tie of -0 and 0 may keep either, as
           torch.aminmax's own vector loop */
        for (; j + 8 <= m; j += 8) {
            const __m256 v = _mm256_loadu_ps(xb + j);
            vmn = _mm256_min_ps(v, vmn);
            vmx = _mm256_max_ps(v, vmx);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
#endif
        for (; j < m; ++j) {
            const float v = xb[j];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            nan |= v != v;
        }
        for (j = 0; j < m; ++j) {
            const float v = xb[j];
            const float p = (v - lo) * bf / d;
            int32_t k = (int32_t)p;
            k = k > last ? last : k;
            k = (v >= lo && v <= hi) ? k : dump;
            buf[j] = k * COPIES + (j & (COPIES - 1));
        }
        for (j = 0; j < m; ++j) cp[buf[j]]++;
    }
#if defined(__AVX2__)
    float vmin[8], vmax[8];
    _mm256_storeu_ps(vmin, vmn);
    _mm256_storeu_ps(vmax, vmx);
    nan |= _mm256_movemask_ps(vnan) != 0;
    for (int q = 0; q < 8; ++q) {
        mn = vmin[q] < mn ? vmin[q] : mn;
        mx = vmax[q] > mx ? vmax[q] : mx;
    }
#endif
    mm[0] = nan ? NAN : mn;
    mm[1] = nan ? NAN : mx;
    const int inside = !nan && mn >= lo && mx <= hi;
    if (inside)
        add_counts(cp, B, base, out);
    free(cp);
    return !inside;
}

/* torch.ao's _upscale_histogram: each of the B bins split into `rate` pieces of weight
   hist[i] / rate at the mid points mids [B * rate], each piece added (in order, float32, as
   torch.bincount) into the bin of the new edges bounds [B + 1] that holds its mid point
   (torch.bucketize(right=True) - 1, clamped to [0, B - 1]); out [B] is overwritten. */
int64_t qs_ao_upscale(const float *hist, int64_t B, int64_t rate, const float *mids,
                      const float *bounds, float *out) {
    const float r = (float)rate;
    for (int64_t k = 0; k < B; ++k) out[k] = 0.0f;
    /* edges and mid points both rise (as linspace's do): any upper-bound search gives
       torch's answer, so one merge walk; else torch's own binary search, probe for probe */
    const int64_t n = B * rate;
    int rising = 1;
    for (int64_t k = 0; k < B; ++k) rising &= bounds[k] <= bounds[k + 1];
    for (int64_t i = 0; i + 1 < n; ++i) rising &= mids[i] <= mids[i + 1];
    int64_t walk = 0;
    float w = 0.0f;
    int64_t q = 0, src = 0; /* piece q of old bin src */
    for (int64_t i = 0; i < n; ++i) {
        const float v = mids[i];
        if (q == 0) w = hist[src++] / r; /* once per old bin */
        if (++q == rate) q = 0;
        int64_t a = 0;
        if (rising) { /* the count of edges <= v */
            while (walk < B + 1 && bounds[walk] <= v) ++walk;
            a = walk;
        } else {
            int64_t e = B + 1;
            while (a < e) {
                const int64_t mid = a + ((e - a) >> 1);
                if (!(bounds[mid] > v)) a = mid + 1;
                else e = mid;
            }
        }
        int64_t t = a - 1;
        t = t < 0 ? 0 : (t > B - 1 ? B - 1 : t);
        out[t] += w;
    }
    return 0;
}
