/* Threads over units in dynamic chunks (units stop after different numbers of steps, rows
   cost alike): parallel(fn, ctx, n, threads, work) runs fn(ctx, i, tid) for i < n on
   qs_run_jobs threads. Shared by the MSE search kernels (mse_search.c, mse_pnorm.c). */
#ifndef QS_PARALLEL_H
#define QS_PARALLEL_H

#include "qs_threads.h"

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

#endif /* QS_PARALLEL_H */
