/* Threads of every kernel: qs_run_jobs runs a function over an array of per-thread
   jobs on plain pthreads, joined before it returns (an OpenMP pool would keep spinning
   after the call and slow down torch's own thread pool). */
#ifndef QS_THREADS_H
#define QS_THREADS_H

#include <stddef.h>
#include <stdint.h>
#include <pthread.h>

#define QS_MAXT 64

/* fn on each of the `threads` jobs at `jobs` (`size` bytes apart): job 0 on the calling
   thread, the others on their own threads; a thread that cannot start has its job run
   here. Returns 1 if any fn returned non-NULL (the kernels' error signal), else 0. */
static int qs_run_jobs(void *(*fn)(void *), void *jobs, size_t size, int threads) {
    pthread_t tid[QS_MAXT];
    int started[QS_MAXT] = {0}, bad = 0;
    char *j = (char *)jobs;
    if (threads > QS_MAXT) threads = QS_MAXT;
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&tid[t], NULL, fn, j + t * size) == 0;
    bad |= fn(j) != NULL;
    for (int t = 1; t < threads; ++t) {
        void *r = NULL;
        if (started[t]) pthread_join(tid[t], &r);
        else r = fn(j + t * size);
        bad |= r != NULL;
    }
    return bad;
}

#endif /* QS_THREADS_H */
