/* Called from quantscope.estimators.mse_kernel through quantscope.kernels (integer formats, and
   float element formats: the _fp entry points); that module's doc says what it
   computes and tests compare it with its torch reference bit for bit. */
#include "qs_parallel.h"
#include "qs_fakequant.h"
#include <stdlib.h>

/* The error of one unit under (s, z): sum(d * d), each square exact in float64
   ((double)d * (double)d: a float32 d's 24 bits square into 48 of float64's 53, with no
   underflow), the sum in float64 (the torch path, mse_tiles._tile_error, computes it so;
   only the order of the float64 additions differs, so both pick the same candidates where
   a float32 sum would break near ties at random: issue 20 #11). Squares rounded to float32
   lose precision below |d| ~ 1e-19 and vanish below ~3e-23, where every candidate of a unit
   of tiny values then ties at 0. Deterministic: equal (s, z) give bitwise equal errors,
   which the reuse of a previous candidate's error relies on. */
/* The sum of squares every price shares (one summation order, so equal element errors give
   bitwise equal prices): VDQ(v) the SIMD element error of VW lanes, SDQ(x) the scalar one;
   ACC(d, o, A, B) adds the terms of the VW errors d of elements o .. o + VW to the float64
   accumulators A (low lanes) and B (high lanes), TERM(d, j) is element j's term.
   Weighted by w (imatrix importance, [U, E] float32: WSQ2, WSQ1) a term is
   (double)w * ((double)d * (double)d), the product rounded once in float64, so w = 1 gives
   the unweighted terms (SQ2, SQ1) bit for bit (estimators.weighted's arithmetic). sq32
   (the _F32 forms) rounds each square to float32 first, d * d as torch's d.square(): the
   arithmetic of the toolkits whose compat classes share these prices (Horizon's norm,
   llm-compressor's |d| ** 2). */
#ifdef VW
/* the squares of the VW errors d in float64, low lanes L and high lanes H: exact (SQ64) or
   each rounded to float32 (SQ32) */
#define SQ64(d, L, H)                                                                         \
    do { vd l_ = DLO(d), h_ = DHI(d); L = DMUL(l_, l_); H = DMUL(h_, h_); } while (0)
#define SQ32(d, L, H) do { vf f_ = VMUL(d, d); L = DLO(f_); H = DHI(f_); } while (0)
#define PLAIN2(SQ, d, o, A, B)                                                                \
    do { vd L_, H_; SQ(d, L_, H_); A = DADD(A, L_); B = DADD(B, H_); } while (0)
#define WEIGHTED2(SQ, d, o, A, B)                                                              \
    do {                                                                                      \
        vd L_, H_;                                                                            \
        vf w_ = VLOAD(w + (o));                                                               \
        SQ(d, L_, H_);                                                                        \
        A = DADD(A, DMUL(DLO(w_), L_));                                                       \
        B = DADD(B, DMUL(DHI(w_), H_));                                                       \
    } while (0)
#define SQ2(d, o, A, B) PLAIN2(SQ64, d, o, A, B)
#define SQ2_F32(d, o, A, B) PLAIN2(SQ32, d, o, A, B)
#define WSQ2(d, o, A, B) WEIGHTED2(SQ64, d, o, A, B)
#define WSQ2_F32(d, o, A, B) WEIGHTED2(SQ32, d, o, A, B)
#define SUM_SQUARES_SIMD(VDQ, ACC)                                                            \
    do {                                                                                      \
        vd a0 = DZERO(), a1 = DZERO(), a2 = DZERO(), a3 = DZERO();                            \
        for (; j + 2 * VW <= E; j += 2 * VW) {                                                \
            vf d0 = VDQ(VLOAD(x + j));                                                        \
            vf d1 = VDQ(VLOAD(x + j + VW));                                                   \
            ACC(d0, j, a0, a1);                                                               \
            ACC(d1, j + VW, a2, a3);                                                          \
        }                                                                                     \
        for (; j + VW <= E; j += VW) {                                                        \
            vf d = VDQ(VLOAD(x + j));                                                         \
            ACC(d, j, a0, a1);                                                                \
        }                                                                                     \
        acc = DSUM(DADD(DADD(a0, a1), DADD(a2, a3)));                                         \
    } while (0)
#endif
#define SQ1(d, j) ((double)(d) * (double)(d))
#define SQ1_F32(d, j) ((double)((d) * (d)))
#define WSQ1(d, j) ((double)w[j] * SQ1(d, j))
#define WSQ1_F32(d, j) ((double)w[j] * SQ1_F32(d, j))
#define SUM_SQUARES_TAIL(SDQ, TERM)                                                           \
    for (; j < E; ++j) {                                                                      \
        float d = SDQ(x[j]);                                                                  \
        acc += TERM(d, j);                                                                    \
    }
/* The sum over x (and w: weighted, NULL: not; sq32: the float32 squares) with element
   errors VDQ / SDQ */
#ifdef VW
#define SUM_SIMD(VDQ)                                                                         \
    do {                                                                                      \
        if (w && sq32) SUM_SQUARES_SIMD(VDQ, WSQ2_F32);                                       \
        else if (w) SUM_SQUARES_SIMD(VDQ, WSQ2);                                              \
        else if (sq32) SUM_SQUARES_SIMD(VDQ, SQ2_F32);                                        \
        else SUM_SQUARES_SIMD(VDQ, SQ2);                                                      \
    } while (0)
#else
#define SUM_SIMD(VDQ) do { } while (0)
#endif
#define SUM_TAIL(SDQ)                                                                         \
    do {                                                                                      \
        if (w && sq32) { SUM_SQUARES_TAIL(SDQ, WSQ1_F32) }                                    \
        else if (w) { SUM_SQUARES_TAIL(SDQ, WSQ1) }                                           \
        else if (sq32) { SUM_SQUARES_TAIL(SDQ, SQ1_F32) }                                     \
        else { SUM_SQUARES_TAIL(SDQ, SQ1) }                                                   \
    } while (0)

static inline __attribute__((always_inline)) double price_(const float *x, const float *w,
                                                         int64_t E, float s, float z,
                                                         float qmin, float qmax, int zero,
                                                         int sq32) {
    int64_t j = 0;
    double acc = 0.0;
    (void)zero;  /* the SIMD branch's */
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(qmin), vhi = VSET1(qmax);
#define VDQ(v) dqv(v, vs, vz, vlo, vhi, zero)
    SUM_SIMD(VDQ);
#undef VDQ
#endif
#define SDQ(v) dq1(v, s, z, qmin, qmax)
    SUM_TAIL(SDQ);
#undef SDQ
    return acc;
}

/* price_ for a float element format (MX, NVFP4 blocks): fq1 / fqv, same sums */
static double price_fp(const float *x, const float *w, int64_t E, float s, qs_ffmt f,
                       int sq32) {
    int64_t j = 0;
    double acc = 0.0;
#ifdef VW
    QS_FQV_CONSTS(s, f);
#define VDQ(v) fqv(v, vs, mf, sh, top, bottom)
    SUM_SIMD(VDQ);
#undef VDQ
#endif
#define SDQ(v) fq1(v, s, f)
    SUM_TAIL(SDQ);
#undef SDQ
    return acc;
}

/* The element format of a search: integer codes in [qmin, qmax] with a zero point, or a
   float format (is_float: f; the zero point is 0); and how its prices square (sq32: each
   square rounded to float32, a compat class's toolkit arithmetic; 0: exact) */
typedef struct { float qmin, qmax; int is_float; qs_ffmt f; int sq32; } fmt_t;

static fmt_t int_fmt(double qmin, double qmax, int sq32) {
    fmt_t m = {(float)qmin, (float)qmax, 0, {0, 0, 0.0f}, sq32 != 0};
    return m;
}

static fmt_t float_fmt(double fmax, int64_t min_exp, int64_t mbits, int sq32) {
    fmt_t m = {(float)-fmax, (float)fmax, 1, qs_ffmt_of(min_exp, mbits, fmax), sq32 != 0};
    return m;
}

/* The error of one unit x (weights w, or NULL: unweighted) under (s, z) */
static double price1(const float *x, const float *w, int64_t E, float s, float z,
                     const fmt_t *m) {
    if (m->is_float) return price_fp(x, w, E, s, m->f, m->sq32);
    return z == 0.0f ? price_(x, w, E, s, z, m->qmin, m->qmax, 1, m->sq32)
                     : price_(x, w, E, s, z, m->qmin, m->qmax, 0, m->sq32);
}

/* The d of every element of one unit (tests compare it with torch bit for bit). */
int64_t qs_mse_dq(const float *x, int64_t E, double s_, double z_, double qmin_, double qmax_,
                  float *out) {
    float s = (float)s_, z = (float)z_, qmin = (float)qmin_, qmax = (float)qmax_;
    int zero = z == 0.0f;
    int64_t j = 0;
    (void)zero;  /* the SIMD branch's */
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(qmin), vhi = VSET1(qmax);
    for (; j + VW <= E; j += VW)
        VSTORE(out + j, zero ? dqv(VLOAD(x + j), vs, vz, vlo, vhi, 1)
                             : dqv(VLOAD(x + j), vs, vz, vlo, vhi, 0));
#endif
    for (; j < E; ++j) out[j] = dq1(x[j], s, z, qmin, qmax);
    return 0;
}

/* qs_mse_dq for a float format (fq1, fqv) */
int64_t qs_mse_dq_fp(const float *x, int64_t E, double s_, double fmax, int64_t min_exp,
                     int64_t mbits, float *out) {
    const float s = (float)s_;
    const qs_ffmt f = qs_ffmt_of(min_exp, mbits, fmax);
    int64_t j = 0;
#ifdef VW
    QS_FQV_CONSTS(s, f);
    for (; j + VW <= E; j += VW) VSTORE(out + j, fqv(VLOAD(x + j), vs, mf, sh, top, bottom));
#endif
    for (; j < E; ++j) out[j] = fq1(x[j], s, f);
    return 0;
}

/* ---- dense pricing: out[j, i] for candidates j < k of unit sub[i] (or i) */
typedef struct {
    const float *x, *w; int64_t E; const int64_t *sub; int64_t n;
    const float *sc; const int32_t *zp; int64_t k; fmt_t m; double *out;
} price_t;

static void price_unit(void *p, int64_t i, int tid) {
    price_t *c = (price_t *)p;
    int64_t u = c->sub ? c->sub[i] : i;
    const float *xu = c->x + u * c->E, *wu = c->w ? c->w + u * c->E : NULL;
    for (int64_t j = 0; j < c->k; ++j) {
        int64_t o = j * c->n + i;
        c->out[o] = price1(xu, wu, c->E, c->sc[o], (float)c->zp[o], &c->m);
    }
    (void)tid;
}

static int64_t mse_price(const float *x, const float *w, int64_t E, const int64_t *sub,
                         int64_t n, const float *sc, const int32_t *zp, int64_t k, fmt_t m,
                         double *out, int threads) {
    price_t c = {x, w, E, sub, n, sc, zp, k, m, out};
    parallel(price_unit, &c, n, threads, (double)n * k * E);
    return 0;
}

/* The unit errors: out[j, i] = price1 of candidate j on unit sub[i] (or i), each element's
   squared error weighted by w [U, E] (float32, the rows of x's units; NULL: unweighted, the
   same loop: SUM_SIMD / SUM_TAIL test w once per unit and candidate): sum (double)w *
   ((double)d * (double)d); sq32: each square rounded to float32 (fmt_t) */
int64_t qs_mse_price_w(const float *x, const float *w, int64_t E, const int64_t *sub, int64_t n,
                       const float *sc, const int32_t *zp, int64_t k, double qmin, double qmax,
                       double *out, int threads, int sq32) {
    return mse_price(x, w, E, sub, n, sc, zp, k, int_fmt(qmin, qmax, sq32), out, threads);
}

/* qs_mse_price_w for a float format: fmax, min_exp, mbits (the zero points are 0) */
int64_t qs_mse_price_fp_w(const float *x, const float *w, int64_t E, const int64_t *sub,
                          int64_t n, const float *sc, const int32_t *zp, int64_t k, double fmax,
                          int64_t min_exp, int64_t mbits, double *out, int threads,
                          int sq32) {
    return mse_price(x, w, E, sub, n, sc, zp, k, float_fmt(fmax, min_exp, mbits, sq32), out,
                     threads);
}

/* ---- one block of candidates through the selection rules (mse._State.step) */
typedef struct {
    const float *x; int64_t E; const int64_t *sub; int64_t n;
    const float *sc; const int32_t *zp; int64_t k, i0; fmt_t m;
    int64_t patience; int per_unit, tie_last;
    double *best, *perr; int64_t *idx, *stale; uint8_t *stopped; float *psc, *pzp;
    const float *isc; const int32_t *izp;  /* the incumbent [n]: starts the state, or NULL */
    double *err;      /* [k, n] priced before the walk, or NULL: priced during it */
    uint8_t *any;     /* [threads, k]: some unit improved at candidate j, or NULL */
    int64_t gstop;    /* candidates j >= gstop see the global rule stopped */
} step_t;

/* Error e replaces the running best: strictly lower, or <= with tie_last, but never a
   non-finite e (overflowed errors tie each other; <= would keep the last of them). */
static inline int beats(double e, double best, int tie_last) {
    return tie_last ? e <= best && e < INFINITY : e < best;
}

/* The state of a unit before any candidate: the incumbent (index -1) is the best so far
   and the previous qparams; nothing is stale. */
static void init_unit(step_t *c, int64_t i, int64_t u) {
    float z = (float)c->izp[i];
    double e = price1(c->x + u * c->E, NULL, c->E, c->isc[i], z, &c->m);
    c->best[u] = e; c->perr[u] = e; c->psc[u] = c->isc[i]; c->pzp[u] = z;
    c->idx[u] = -1; c->stale[u] = 0; c->stopped[u] = 0;
}

/* Pricing ahead of the global rule: every unit is active until it stops, so "some unit
   improved at j" is each unit's running best improving, whatever the per-unit rule says. */
static void dense_unit(void *p, int64_t i, int tid) {
    step_t *c = (step_t *)p;
    int64_t u = c->sub ? c->sub[i] : i;
    if (c->isc) init_unit(c, i, u);
    const float *xu = c->x + u * c->E;
    double lb = c->best[u], perr = c->perr[u];
    float psc = c->psc[u], pzp = c->pzp[u];
    uint8_t *any = c->any + (int64_t)tid * c->k;
    for (int64_t j = 0; j < c->k; ++j) {
        int64_t o = j * c->n + i;
        float s = c->sc[o], z = (float)c->zp[o];
        double e = (s == psc && z == pzp) ? perr : price1(xu, NULL, c->E, s, z, &c->m);
        c->err[o] = e;
        if (beats(e, lb, c->tie_last)) { lb = e; any[j] = 1; }
        psc = s; pzp = z; perr = e;
    }
}

/* One unit through the block, pricing as it goes (or reading err): a unit that stops for
   good is not priced further. With any: records which candidates improved it (before the
   global rule stops every unit is active, so these are the global rule's flags). */
static void walk_unit(void *p, int64_t i, int tid) {
    step_t *c = (step_t *)p;
    int64_t u = c->sub ? c->sub[i] : i;
    if (c->isc && !c->err) init_unit(c, i, u);
    const float *xu = c->x + u * c->E;
    double best = c->best[u], perr = c->perr[u];
    float psc = c->psc[u], pzp = c->pzp[u];
    int64_t stale = c->stale[u], idx = c->idx[u];
    int stopped = c->stopped[u];
    uint8_t *any = c->any && !c->err ? c->any + (int64_t)tid * c->k : NULL;
    for (int64_t j = 0; j < c->k; ++j) {
        int gs = j >= c->gstop;
        int active = c->patience <= 0 ? 1 : c->per_unit ? !(stopped && gs) : !gs;
        if (!active) break;  /* for good: both flags only ever turn on */
        int64_t o = j * c->n + i;
        float s = c->sc[o], z = (float)c->zp[o];
        int same = s == psc && z == pzp;
        double e = c->err ? c->err[o] : same ? perr
                 : price1(xu, NULL, c->E, s, z, &c->m);
        int better = beats(e, best, c->tie_last);
        if (better) { best = e; idx = c->i0 + j; if (any) any[j] = 1; }
        if (c->patience > 0 && c->per_unit) {
            if (better) stale = 0;
            else if (!same) stale += 1;  /* a plateau of equal qparams is not evidence */
            if (stale >= c->patience) stopped = 1;
        }
        psc = s; pzp = z; perr = e;
    }
    c->best[u] = best; c->perr[u] = perr; c->psc[u] = psc; c->pzp[u] = pzp;
    c->stale[u] = stale; c->idx[u] = idx; c->stopped[u] = (uint8_t)stopped;
    (void)tid;
}

/* The global rule over flags any[0 .. k) from counters g (stale, stopped): returns the
   first index that sees it stopped (k + 1: none). */
int64_t qs_mse_gstop(const uint8_t *any, int64_t k, int64_t patience, int64_t *g) {
    if (g[1]) return 0;
    for (int64_t j = 0; j < k; ++j) {
        g[0] = any[j] ? 0 : g[0] + 1;
        if (g[0] >= patience) { g[1] = 1; return j + 1; }
    }
    return k + 1;
}

/* Candidates i0 .. i0 + k - 1 (rows of sc, zp [rows, n]) for units sub (all when NULL).
   init 1: row 0 is the incumbent, which starts the state, and the candidates are rows
   1 .. k; init 2: row 0 is both the incumbent and the first candidate.
   The global rule (use_global), counters g (stale, stopped): gstop < 0: this call decides
   it, pricing the block for every unit first; else candidates j >= gstop of the block see
   it stopped (the caller decided; a large gstop: not yet, and any_out [k] receives the
   flags the rule needs, OR-ed in). Returns how many of the n units are still searching
   after the block (-1: no memory). */
static int64_t mse_step(const float *x, int64_t E, const int64_t *sub, int64_t n,
                        const float *sc, const int32_t *zp, int64_t k, int64_t i0, int init,
                        fmt_t m, int64_t patience, int per_unit, int use_global,
                        int tie_last, double *best, double *perr, int64_t *idx, int64_t *stale,
                        uint8_t *stopped, float *psc, float *pzp, int64_t *g, int64_t gstop,
                        uint8_t *any_out, int threads) {
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    int64_t r = init == 1 ? n : 0;  /* the candidates' first row */
    step_t c = {x, E, sub, n, sc + r, zp + r, k, i0, m,
                patience, per_unit, tie_last, best, perr, idx, stale, stopped, psc, pzp,
                init ? sc : NULL, init ? zp : NULL, NULL, NULL, 0};
    double cost = (double)n * (k + (init == 1)) * E;
    int decide = use_global && patience > 0 && gstop < 0 && !g[1];
    c.gstop = !use_global ? 0 : gstop >= 0 ? gstop : g[1] ? 0 : k + 1;
    if (decide || any_out) {
        c.any = (uint8_t *)calloc((size_t)(threads * k + 1), 1);
        if (!c.any) return -1;
    }
    if (decide) {
        c.err = (double *)malloc(sizeof(double) * (size_t)(n * k + 1));
        if (!c.err) { free(c.any); return -1; }
        parallel(dense_unit, &c, n, threads, cost);
        for (int64_t j = 1; j < threads; ++j)
            for (int64_t q = 0; q < k; ++q) c.any[q] |= c.any[j * k + q];
        c.gstop = qs_mse_gstop(c.any, k, patience, g);
        cost = (double)n * k;  /* the walk reads prices */
    }
    parallel(walk_unit, &c, n, threads, cost);
    if (any_out && !decide)
        for (int64_t j = 0; j < threads; ++j)
            for (int64_t q = 0; q < k; ++q) any_out[q] |= c.any[j * k + q];
    free(c.err);
    free(c.any);
    if (patience <= 0) return n;
    if (!per_unit) return g[1] ? 0 : n;
    int gs = use_global ? (int)g[1] : 1;
    int64_t live = 0;
    for (int64_t i = 0; i < n; ++i) live += !(stopped[sub ? sub[i] : i] && gs);
    return live;
}

int64_t qs_mse_step(const float *x, int64_t E, const int64_t *sub, int64_t n,
                    const float *sc, const int32_t *zp, int64_t k, int64_t i0, int init,
                    double qmin, double qmax, int64_t patience, int per_unit, int use_global,
                    int tie_last, double *best, double *perr, int64_t *idx, int64_t *stale,
                    uint8_t *stopped, float *psc, float *pzp, int64_t *g, int64_t gstop,
                    uint8_t *any_out, int threads, int sq32) {
    return mse_step(x, E, sub, n, sc, zp, k, i0, init, int_fmt(qmin, qmax, sq32), patience,
                    per_unit, use_global, tie_last, best, perr, idx, stale, stopped, psc, pzp,
                    g, gstop, any_out, threads);
}

/* qs_mse_step for a float element format (MX, NVFP4 blocks): qmin, qmax are -fmax, fmax,
   then min_exp, mbits (FloatFormat's); the same rules, the prices from fq1 / fqv */
int64_t qs_mse_step_fp(const float *x, int64_t E, const int64_t *sub, int64_t n,
                       const float *sc, const int32_t *zp, int64_t k, int64_t i0, int init,
                       double qmin, double qmax, int64_t patience, int per_unit, int use_global,
                       int tie_last, double *best, double *perr, int64_t *idx, int64_t *stale,
                       uint8_t *stopped, float *psc, float *pzp, int64_t *g, int64_t gstop,
                       uint8_t *any_out, int threads, int64_t min_exp, int64_t mbits,
                       int sq32) {
    (void)qmin;
    return mse_step(x, E, sub, n, sc, zp, k, i0, init, float_fmt(qmax, min_exp, mbits, sq32),
                    patience, per_unit, use_global, tie_last, best, perr, idx, stale, stopped,
                    psc, pzp, g, gstop, any_out, threads);
}
