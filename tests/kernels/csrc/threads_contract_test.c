/* tests/kernels/test_threads_claim.py: what qs_run_jobs promises beyond threads_claim_test.c,
   one build per flag:
   -DSPURIOUS: pthread_cond_wait may return without a signal (POSIX allows it); the caller still
               returns only after every job has finished (it waits in a loop, not once).
   -DFAILING_CREATE: every pthread_create fails (EAGAIN); the caller runs every job itself.
   -DCONCURRENT: threads = 2 starts a second thread: job 0 waits (1 s at most) until another
               thread runs job 1 beside it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <unistd.h>
#ifdef SPURIOUS
static int spurious_wait(pthread_cond_t *c, pthread_mutex_t *m) {
    static __thread unsigned s = 1;
    s = s * 1103515245u + 12345u;
    if ((s >> 16) & 1) {  /* a wake-up with no signal */
        pthread_mutex_unlock(m);
        sched_yield();
        pthread_mutex_lock(m);
        return 0;
    }
    return pthread_cond_wait(c, m);
}
#define pthread_cond_wait spurious_wait
#endif
#ifdef FAILING_CREATE
static int failing_create(pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *p) {
    (void)t; (void)a; (void)f; (void)p;
    return 11; /* EAGAIN: no thread starts */
}
#define pthread_create failing_create
#endif
#include "qs_threads.h"
#undef pthread_cond_wait
#undef pthread_create

typedef struct { int runs, slow, other_ran; long sum; } job_t;
#ifdef CONCURRENT
static int second_ran;  /* job 1 ran (on the second thread) */
#endif
static void *job(void *p) {
    job_t *j = (job_t *)p;
    j->runs++;
#ifdef CONCURRENT
    if (j->slow) {  /* job 0: wait for job 1 to run on another thread */
        for (int i = 0; i < 1000 && !__atomic_load_n(&second_ran, __ATOMIC_ACQUIRE); ++i)
            usleep(1000);
        j->other_ran = __atomic_load_n(&second_ran, __ATOMIC_ACQUIRE);
    } else {
        __atomic_store_n(&second_ran, 1, __ATOMIC_RELEASE);
    }
#else
    if (j->slow) usleep(200);
#endif
    for (long i = 0; i < 2000; ++i) j->sum += i % 7;
    return NULL;
}
int main(void) {
#ifdef CONCURRENT
    for (int r = 0; r < 20; ++r) {
        job_t jobs[2] = {{0}};
        jobs[0].slow = 1;
        __atomic_store_n(&second_ran, 0, __ATOMIC_RELEASE);
        qs_run_jobs(job, jobs, sizeof jobs[0], 2);
        if (!jobs[0].other_ran) {
            printf("round %d: job 1 never ran beside job 0 (no second thread)\n", r);
            return 1;
        }
    }
#else
    for (int r = 0; r < 300; ++r) {
        const int threads = 2 + r % 7;
        job_t jobs[8] = {{0}};
        jobs[threads - 1].slow = 1;
        qs_run_jobs(job, jobs, sizeof jobs[0], threads);
        for (int t = 0; t < threads; ++t)  /* read right after the call: every job done */
            if (jobs[t].runs != 1 || jobs[t].sum != 5995) {
                printf("round %d: job %d of %d: %d runs, sum %ld at return\n", r, t, threads,
                       jobs[t].runs, jobs[t].sum);
                return 1;
            }
    }
#endif
    printf("ok\n");
    return 0;
}
