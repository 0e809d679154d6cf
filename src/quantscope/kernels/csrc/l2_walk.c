/* Called from quantscope.estimators.l2 through quantscope.kernels; that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

/* torch.ao's bound walk, resumable. Per unit fs = (alpha, beta, best norm) and
   is = (start, end, la, rb, done, best start, best end); la: first bin with csum >= the
   alpha threshold, rb: last bin with csum <= the beta threshold (both only move one
   way). qs_l2_walk writes up to K changed ranges per unit to s, e [U, K] (the rest
   (0, B - 1)) and their count to n [U]; done when alpha >= beta. */
#define NS 7
int64_t qs_l2_init(double *fs, int64_t *is, int64_t U, int64_t B) {
    for (int64_t u = 0; u < U; ++u) {
        fs[3 * u] = 0.0; fs[3 * u + 1] = 1.0; fs[3 * u + 2] = INFINITY;
        int64_t *st = is + NS * u;
        st[0] = 0; st[1] = B - 1; st[2] = 0; st[3] = B - 1; st[4] = 0; st[5] = 0;
        st[6] = B - 1;
    }
    return 0;
}

int64_t qs_l2_walk(const float *csum, const double *total, double *fs, int64_t *is,
                   int64_t *s, int64_t *e, int64_t *n, int64_t U, int64_t B, int64_t K) {
    for (int64_t u = 0; u < U; ++u) {
        const float *cs = csum + u * B;
        double alpha = fs[3 * u], beta = fs[3 * u + 1], tot = total[u];
        int64_t *st = is + NS * u;
        int64_t start = st[0], end = st[1], la = st[2], rb = st[3], k = 0;
        while (!st[4] && k < K) {
            if (!(alpha < beta)) { st[4] = 1; break; }
            double na = alpha + 1e-5, nb = beta - 1e-5;
            float ta = (float)(na * tot), tb = (float)(nb * tot);
            while (la < B && cs[la] < ta) ++la;
            while (rb >= 0 && cs[rb] > tb) --rb;
            int64_t l = la < start ? start : la;
            if (l > end) l = end;
            int64_t r = rb > end ? end : rb;
            if (r < start) r = start;
            int64_t ns = start, ne = end;
            if (l - start > end - r) { ns = l; alpha = na; }
            else { ne = r; beta = nb; }
            if (ns == start && ne == end) continue;
            s[u * K + k] = ns; e[u * K + k] = ne; ++k;
            start = ns; end = ne;
        }
        n[u] = k;
        for (int64_t j = k; j < K; ++j) { s[u * K + j] = 0; e[u * K + j] = B - 1; }
        fs[3 * u] = alpha; fs[3 * u + 1] = beta;
        st[0] = start; st[1] = end; st[2] = la; st[3] = rb;
    }
    return 0;
}

/* new_min = lo + w * best start, new_max = lo + w * (best end + 1), w = (hi - lo) / B, in
   float32 as torch.ao (and Hist.width) compute them. */
int64_t qs_l2_result(const float *lo, const float *hi, const int64_t *is, float *out_lo,
                     float *out_hi, int64_t U, int64_t B) {
    for (int64_t u = 0; u < U; ++u) {
        float w = (hi[u] - lo[u]) / (float)B;
        out_lo[u] = lo[u] + w * (float)is[NS * u + 5];
        out_hi[u] = lo[u] + w * (float)(is[NS * u + 6] + 1);
    }
    return 0;
}

/* fmodf(a, b) for b > 0 (exact, as fmod always is): the remainder a - q b is exact in
   double while q b fits in 53 bits; libm's fmodf (slow) otherwise. */
static float fmod_pos(float a, float b) {
    double q = trunc((double)a / (double)b);
    if (!(fabs(q) < 268435456.0)) return fmodf(a, b);
    double r = (double)a - q * (double)b;
    if (a >= 0) { if (r < 0) r += b; else if (r >= b) r -= b; }
    else { if (r > 0) r -= b; else if (r <= -(double)b) r += b; }
    return (float)r;
}

/* c10::div_floor_floating (torch.div(..., rounding_mode="floor") on float32), b > 0: the
   floor of the exact quotient. When a / b rounds to a non-integer no integer lies
   between it and the exact quotient (round to nearest), so floorf gives the same; the
   fmod form runs only when a / b is an integer. */
static float div_floor(float a, float b) {
    float basic = a / b, f = floorf(basic);
    if (basic != f) return f;
    float mod = fmod_pos(a, b);
    float fl = (fabsf(basic) == INFINITY && fabsf(a) != INFINITY) ? a : a - mod;
    float div = fl / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1.0f;
    if (div == 0) return copysignf(0.0f, basic);
    float fd = floorf(div);
    if (div - fd > 0.5f) fd += 1.0f;
    return fd;
}

static float cube_diff(float db, float de) { return (de * de * de - db * db * db) / 3.0f; }

/* torch.ao's per-bin L2 terms of ranges (s, e) [U, J]: out [U, J, B], float32, the
   operations of l2_norms in its order (rows with a zero dst bin width are 0). The loops
   are written to vectorize: the quotients and their floors for all bins first (floorf of
   the rounded quotient is div_floor's result unless the quotient rounded to an integer;
   those few bins take div_floor), then the terms. */
int64_t qs_l2_terms(const float *counts, const float *lo, const float *hi, const int64_t *s,
                    const int64_t *e, float *out, int64_t U, int64_t J, int64_t B,
                    int64_t dst) {
    const float top = (float)(dst - 1);
    float *dens = malloc(sizeof(float) * 3 * (size_t)(B > 0 ? B : 1));
    if (!dens) return 1;
    float *restrict fb = dens + B, *restrict fe = fb + B;
    for (int64_t u = 0; u < U; ++u) {
        const double b64 = ((double)hi[u] - (double)lo[u]) / (double)B;  /* torch.ao's .item() */
        const float bw = (float)b64;
        for (int64_t i = 0; i < B; ++i) dens[i] = counts[u * B + i] / bw;
        for (int64_t j = 0; j < J; ++j) {
            float *restrict o = out + (u * J + j) * B;
            int64_t st = s[u * J + j];
            double d64 = b64 * (double)(e[u * J + j] - st + 1) / (double)dst;
            if (d64 == 0) { for (int64_t i = 0; i < B; ++i) o[i] = 0.0f; continue; }
            const float dbw = (float)d64, half = (float)(d64 / 2), nhalf = (float)(-d64 / 2);
            const float mid = cube_diff(nhalf, half);
            for (int64_t i = 0; i < B; ++i) {
                float sb = (float)(i - st) * bw, se = sb + bw;
                fb[i] = sb / dbw;
                fe[i] = se / dbw;
            }
            for (int64_t i = 0; i < B; ++i) {
                float qb = fb[i], qe = fe[i];
                fb[i] = floorf(qb);
                fe[i] = floorf(qe);
                o[i] = (float)((qb == fb[i]) | (qe == fe[i]));  /* integer quotient: below */
            }
            for (int64_t i = 0; i < B; ++i) {
                if (o[i] == 0.0f) continue;
                float sb = (float)(i - st) * bw, se = sb + bw;
                fb[i] = div_floor(sb, dbw);
                fe[i] = div_floor(se, dbw);
            }
            for (int64_t i = 0; i < B; ++i) {
                float density = dens[i];
                float sb = (float)(i - st) * bw, se = sb + bw;
                float dob = fb[i], doe = fe[i];
                dob = dob < 0 ? 0 : dob;  /* the sign of a zero changes no term */
                dob = dob > top ? top : dob;
                doe = doe < 0 ? 0 : doe;
                doe = doe > top ? top : doe;
                float n = 0.0f + density * cube_diff(sb - (dob + 0.5f) * dbw, half);
                n = n + ((doe - dob) - 1.0f) * (density * mid);
                n = n + density * cube_diff(nhalf, se - (doe * dbw + half));
                o[i] = density == 0 ? 0.0f : n;  /* 0 x finite: adds nothing */
            }
        }
    }
    free(dens);
    return 0;
}

/* torch.ao's stop rule on a chunk of priced ranges: accept while the norm does not rise;
   a unit is done at the first rise or when its walk ended (fewer than K ranges). Returns
   1 when every unit is done. */
int64_t qs_l2_accept(const double *norms, const int64_t *s, const int64_t *e,
                     const int64_t *n, double *fs, int64_t *is, int64_t U, int64_t K) {
    int64_t all = 1;
    for (int64_t u = 0; u < U; ++u) {
        int64_t *st = is + NS * u;
        if (!st[4] || n[u]) {
            for (int64_t k = 0; k < n[u]; ++k) {
                double v = norms[u * K + k];
                if (v > fs[3 * u + 2]) { st[4] = 1; break; }
                fs[3 * u + 2] = v; st[5] = s[u * K + k]; st[6] = e[u * K + k];
            }
            if (n[u] < K) st[4] = 1;
        }
        all &= st[4] != 0;
    }
    return all;
}
