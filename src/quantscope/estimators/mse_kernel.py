"""The MSE search's CPU kernel: candidate pricing and the per-unit selection rules in C.

For integer formats on CPU the torch search (:mod:`quantscope.estimators.mse`) spends
its time in per-tile op chains and in Python steps over ``[U]`` vectors. This kernel
does both in one call per block of candidates, with plain threads over units
(built by :mod:`quantscope.native`):

* **Pricing.** The error of a candidate ``(scale, zp)`` on a unit is
  ``sum(d ** 2)`` with ``d = fake_quantize_units(x) - x`` rounded exactly as
  :func:`~quantscope.quantize.fake_quantize_units` rounds it (``x / scale``,
  ``+ zp``, round half to even, clamp, ``(q - zp) * scale``, minus ``x``; built
  with ``-ffp-contract=off``). Each ``d`` is float32 as in torch; its square is
  exact in float64 and the sum is accumulated in float64, so the error is the
  float64 sum of torch's squared errors up to summation order (tests compare
  against a float64 torch reference at 1e-12). A candidate whose scale and zero
  point equal the previous one's (the min-max incumbent and ``p = 1``, plateaus
  of encoded scales) reuses its error, bit for bit.
* **Selection.** :func:`step` applies the rules of ``mse._State.step``
  (per-unit patience with plateaus not counted, llm-compressor's global
  patience, tie first / last) to a block of candidates, on a unit-by-unit walk:
  a unit that has stopped for good is not priced any more. The global rule
  needs every unit's error before it stops (all units are active until then): a
  block of all units is priced densely first; over several chunks of units the
  caller assumes it does not stop, gathers its flags, and redoes the search if it
  did. Tests run the torch ``_State`` on this kernel's prices and require the same
  choices bit for bit.

The scales and zero points of every candidate still come from
:func:`~quantscope.qparams.qparams_from_range`; the kernel only scores them.
"""

from __future__ import annotations

import ctypes

import torch

from .. import native
from ..formats import IntFormat
from ..spec import QuantSpec

__all__ = ["KernelState", "available", "dq", "price", "usable"]

_SOURCE = native.THREADS_C + native.FAKE_QUANT_C + r"""
#include <stdlib.h>

/* The error of one unit under (s, z): squares d * d in float32, summed in float32 over
   four vectors (32 or 64 elements), those partial sums in float64. About float32
   precision per term (the torch path's float32 norm is coarser), float64 across
   blocks, so long units lose nothing to accumulation. Deterministic: equal (s, z) give
   bitwise equal errors, which the reuse of a previous candidate's error relies on. */
static inline __attribute__((always_inline)) double price_(const float *x, int64_t E, float s,
                                                         float z, float qmin, float qmax,
                                                         int zero) {
    int64_t j = 0;
    double acc = 0.0;
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(qmin), vhi = VSET1(qmax);
    vd a0 = DZERO(), a1 = DZERO();
    for (; j + 4 * VW <= E; j += 4 * VW) {
        vf d0 = dqv(VLOAD(x + j), vs, vz, vlo, vhi, zero);
        vf d1 = dqv(VLOAD(x + j + VW), vs, vz, vlo, vhi, zero);
        vf d2 = dqv(VLOAD(x + j + 2 * VW), vs, vz, vlo, vhi, zero);
        vf d3 = dqv(VLOAD(x + j + 3 * VW), vs, vz, vlo, vhi, zero);
        vf f = VADD(VADD(VMUL(d0, d0), VMUL(d1, d1)), VADD(VMUL(d2, d2), VMUL(d3, d3)));
        a0 = DADD(a0, DLO(f));
        a1 = DADD(a1, DHI(f));
    }
    for (; j + VW <= E; j += VW) {
        vf d = dqv(VLOAD(x + j), vs, vz, vlo, vhi, zero);
        vf f = VMUL(d, d);
        a0 = DADD(a0, DLO(f));
        a1 = DADD(a1, DHI(f));
    }
    acc = DSUM(DADD(a0, a1));
#endif
    for (; j < E; ++j) {
        float d = dq1(x[j], s, z, qmin, qmax);
        acc += (double)(d * d);
    }
    return acc;
}

static double price1(const float *x, int64_t E, float s, float z, float qmin, float qmax) {
    return z == 0.0f ? price_(x, E, s, z, qmin, qmax, 1) : price_(x, E, s, z, qmin, qmax, 0);
}

/* The d of every element of one unit (tests compare it with torch bit for bit). */
int64_t qs_mse_dq(const float *x, int64_t E, double s_, double z_, double qmin_, double qmax_,
                  float *out) {
    float s = (float)s_, z = (float)z_, qmin = (float)qmin_, qmax = (float)qmax_;
    int zero = z == 0.0f;
    int64_t j = 0;
#ifdef VW
    const vf vs = VSET1(s), vz = VSET1(z), vlo = VSET1(qmin), vhi = VSET1(qmax);
    for (; j + VW <= E; j += VW)
        VSTORE(out + j, zero ? dqv(VLOAD(x + j), vs, vz, vlo, vhi, 1)
                             : dqv(VLOAD(x + j), vs, vz, vlo, vhi, 0));
#endif
    for (; j < E; ++j) out[j] = dq1(x[j], s, z, qmin, qmax);
    return 0;
}

/* ---- threads over units, dynamic chunks (units stop after different numbers of steps) */
typedef void (*unit_fn)(void *ctx, int64_t i, int tid);
typedef struct { unit_fn fn; void *ctx; int64_t n, chunk; int64_t *next; int tid; } worker_t;

static void *work(void *p) {
    worker_t *w = (worker_t *)p;
    for (;;) {
        int64_t a = __atomic_fetch_add(w->next, w->chunk, __ATOMIC_RELAXED);
        if (a >= w->n) break;
        int64_t b = a + w->chunk < w->n ? a + w->chunk : w->n;
        for (int64_t i = a; i < b; ++i) w->fn(w->ctx, i, w->tid);
    }
    return NULL;
}

/* fn over units 0 .. n in dynamic chunks, on qs_run_jobs threads. */
static void parallel(unit_fn fn, void *ctx, int64_t n, int threads, double work_elems) {
    /* a thread per ~16M element-ops (~2 ms): a worker preempted while it holds units (a
       shared machine, torch's OpenMP workers still spinning) stalls the join for a time
       slice, which shorter calls cannot amortize */
    int64_t most = (int64_t)(work_elems / (1 << 24)) + 1;
    if (threads > most) threads = (int)most;
    if (threads > n) threads = (int)n;
    if (threads > QS_MAXT) threads = QS_MAXT;
    if (threads < 1) threads = 1;
    int64_t next = 0, chunk = n / (threads * 16);
    if (chunk < 1) chunk = 1;
    worker_t w[QS_MAXT];
    for (int t = 0; t < threads; ++t)
        w[t] = (worker_t){fn, ctx, n, chunk, &next, t};
    qs_run_jobs(work, w, sizeof w[0], threads);  /* the workers share `next`: a job run late
                                                    finds its chunks taken */
}

/* ---- dense pricing: out[j, i] for candidates j < k of unit sub[i] (or i) */
typedef struct {
    const float *x; int64_t E; const int64_t *sub; int64_t n;
    const float *sc; const int32_t *zp; int64_t k; float qmin, qmax; double *out;
} price_t;

static void price_unit(void *p, int64_t i, int tid) {
    price_t *c = (price_t *)p;
    const float *xu = c->x + (c->sub ? c->sub[i] : i) * c->E;
    for (int64_t j = 0; j < c->k; ++j) {
        int64_t o = j * c->n + i;
        c->out[o] = price1(xu, c->E, c->sc[o], (float)c->zp[o], c->qmin, c->qmax);
    }
    (void)tid;
}

int64_t qs_mse_price(const float *x, int64_t E, const int64_t *sub, int64_t n,
                     const float *sc, const int32_t *zp, int64_t k, double qmin, double qmax,
                     double *out, int threads) {
    price_t c = {x, E, sub, n, sc, zp, k, (float)qmin, (float)qmax, out};
    parallel(price_unit, &c, n, threads, (double)n * k * E);
    return 0;
}

/* ---- one block of candidates through the selection rules (mse._State.step) */
typedef struct {
    const float *x; int64_t E; const int64_t *sub; int64_t n;
    const float *sc; const int32_t *zp; int64_t k, i0; float qmin, qmax;
    int64_t patience; int per_unit, tie_last;
    double *best, *perr; int64_t *idx, *stale; uint8_t *stopped; float *psc, *pzp;
    const float *isc; const int32_t *izp;  /* the incumbent [n]: starts the state, or NULL */
    double *err;      /* [k, n] priced before the walk, or NULL: priced during it */
    uint8_t *any;     /* [threads, k]: some unit improved at candidate j, or NULL */
    int64_t gstop;    /* candidates j >= gstop see the global rule stopped */
} step_t;

/* The state of a unit before any candidate: the incumbent (index -1) is the best so far
   and the previous qparams; nothing is stale. */
static void init_unit(step_t *c, int64_t i, int64_t u) {
    float z = (float)c->izp[i];
    double e = price1(c->x + u * c->E, c->E, c->isc[i], z, c->qmin, c->qmax);
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
        double e = (s == psc && z == pzp) ? perr : price1(xu, c->E, s, z, c->qmin, c->qmax);
        c->err[o] = e;
        if (c->tie_last ? e <= lb : e < lb) { lb = e; any[j] = 1; }
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
                 : price1(xu, c->E, s, z, c->qmin, c->qmax);
        int better = c->tie_last ? e <= best : e < best;
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
int64_t qs_mse_step(const float *x, int64_t E, const int64_t *sub, int64_t n,
                    const float *sc, const int32_t *zp, int64_t k, int64_t i0, int init,
                    double qmin, double qmax, int64_t patience, int per_unit, int use_global,
                    int tie_last, double *best, double *perr, int64_t *idx, int64_t *stale,
                    uint8_t *stopped, float *psc, float *pzp, int64_t *g, int64_t gstop,
                    uint8_t *any_out, int threads) {
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    int64_t r = init == 1 ? n : 0;  /* the candidates' first row */
    step_t c = {x, E, sub, n, sc + r, zp + r, k, i0, (float)qmin, (float)qmax,
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
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = {
    "qs_mse_dq": [_P, _I, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                  _P],
    "qs_mse_price": [_P, _I, _P, _I, _P, _P, _I, ctypes.c_double, ctypes.c_double, _P,
                     ctypes.c_int],
    "qs_mse_step": [_P, _I, _P, _I, _P, _P, _I, _I, ctypes.c_int, ctypes.c_double,
                    ctypes.c_double, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _P, _P,
                    _P, _P, _P, _P, _P, _I, _P, ctypes.c_int],
    "qs_mse_gstop": [_P, _I, _I, _P],
}


def _lib():
    return native.load("mse_search", _SOURCE, _ARGTYPES)


def available() -> bool:
    """Whether the compiled kernel can be used (a C compiler was found and it built)."""
    return _lib() is not None


def usable(units: torch.Tensor, spec: QuantSpec, norm: float) -> bool:
    """Whether the kernel scores this search: integer formats without a global scale,
    squared error, float32 units on CPU, no autograd."""
    return (isinstance(spec.format, IntFormat) and not spec.scale.has_global_scale
            and float(norm) == 2.0 and units.device.type == "cpu"
            and units.dtype == torch.float32 and not units.requires_grad and available())


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _f32(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype == torch.float32 else t.float()
    return t if t.is_contiguous() else t.contiguous()


def _i32(t: torch.Tensor) -> torch.Tensor:
    """Zero points as int32 (qparams_from_range's dtype; integer-valued floats convert exactly)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


def price(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
          spec: QuantSpec, sub: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of every candidate ``(scale, zero_point) [k, n]`` on units ``sub``
    (all when None) of float32 ``units [U, E]``: float64 ``[k, n]``."""
    units = units.contiguous()
    n = units.shape[0] if sub is None else sub.numel()
    k = max(scale.shape[0], zero_point.shape[0])
    sc, zp = _f32(scale.expand(k, n)), _i32(zero_point.expand(k, n))
    sub = None if sub is None else sub.to(torch.int64).contiguous()
    out = torch.empty((k, n), dtype=torch.float64)
    _lib().qs_mse_price(units.data_ptr(), units.shape[1], None if sub is None else sub.data_ptr(),
                        n, sc.data_ptr(), zp.data_ptr(), k, float(spec.qmin), float(spec.qmax),
                        out.data_ptr(), _threads())
    return out


def dq(x: torch.Tensor, scale: float, zero_point: float, spec: QuantSpec) -> torch.Tensor:
    """``fake_quantize(x) - x`` of a 1-D float32 ``x`` as the kernel computes it (tests)."""
    x = _f32(x.reshape(-1))
    out = torch.empty_like(x)
    _lib().qs_mse_dq(x.data_ptr(), x.numel(), float(scale), float(zero_point), float(spec.qmin),
                     float(spec.qmax), out.data_ptr())
    return out


class KernelState:
    """The per-unit search state of ``mse._State``, in buffers the kernel updates in place.

    The first :meth:`step` of a unit (``init``) takes the incumbent as row 0 of its block:
    best so far (index -1) and previous qparams. The chosen range is not kept: it is the
    candidate ``idx`` (the caller rebuilds it from the factors, as it built the candidates).
    """

    def __init__(self, units: torch.Tensor, spec: QuantSpec):
        n = units.shape[0]
        self.units = units.contiguous()
        self.qmin, self.qmax = float(spec.qmin), float(spec.qmax)
        f64 = torch.empty((2, n), dtype=torch.float64)
        self.best, self.perr = f64[0], f64[1]  # error of the best, of the previous candidate
        self.idx = torch.empty(n, dtype=torch.int64)
        self.stale = torch.empty(n, dtype=torch.int64)
        self.stopped = torch.empty(n, dtype=torch.bool)
        self.psc, self.pzp = torch.empty((2, n)).unbind(0)  # the previous candidate's qparams
        self.g = torch.zeros(2, dtype=torch.int64)  # the global rule: stale count, stopped

    def step(self, i0, scale, zp, *, patience, per_unit, tie, use_global, units=None,
             sub=None, init=0, gstop=-1, any_out=None):
        """Candidates ``i0 ..`` (encoded qparams ``[rows, n]``) for units ``sub`` (all if
        None) of ``units`` (a ``slice`` of rows: the state's, offset; default all); returns
        how many of them are still searching.

        ``init`` (a unit's first step) 1: row 0 is the incumbent, 2: row 0 is the incumbent
        and also candidate ``i0``. The global rule: ``gstop=-1`` decides it here (the block
        is priced for every unit first); else candidates ``i0 + j``, ``j >= gstop`` see it
        stopped, and ``any_out`` (uint8 ``[k]``) gathers the flags it needs.
        """
        rows, n = scale.shape[0], (zp.shape[1] if zp.dim() == 2 else scale.shape[1])
        sc, z = _f32(scale.expand(rows, n)), _i32(zp.expand(rows, n))
        sub = None if sub is None else sub.to(torch.int64).contiguous()
        a = 0 if units is None else units.start
        x, E = self.units[a:], self.units.shape[1]

        def at(t):
            return t[a:].data_ptr()

        live = _lib().qs_mse_step(
            x.data_ptr(), E, None if sub is None else sub.data_ptr(), n, sc.data_ptr(),
            z.data_ptr(), rows - (init == 1), i0, int(init), self.qmin, self.qmax,
            0 if patience is None else int(patience), int(per_unit), int(use_global),
            int(tie == "last"), at(self.best), at(self.perr), at(self.idx), at(self.stale),
            at(self.stopped), at(self.psc), at(self.pzp), self.g.data_ptr(), int(gstop),
            None if any_out is None else any_out.data_ptr(), _threads())
        if live < 0:
            raise MemoryError("mse kernel: could not allocate the block's scratch")
        return live

    def global_stop(self, any_flags: torch.Tensor, patience: int) -> int:
        """The global rule over gathered flags: the first candidate that sees it stopped."""
        return _lib().qs_mse_gstop(any_flags.data_ptr(), any_flags.numel(), int(patience),
                                   self.g.data_ptr())
