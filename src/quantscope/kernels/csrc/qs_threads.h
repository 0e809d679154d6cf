/* Threads of every kernel: qs_run_jobs runs a function over an array of jobs on plain
   pthreads (an OpenMP pool of our own would keep spinning after the call and slow down
   torch's).

   The jobs are claimed, not assigned: the caller and the threads it starts each take the
   next unclaimed job until none is left, and the caller then waits only for jobs another
   thread has taken. A thread that has not started yet holds nothing up: torch's OpenMP
   workers spin for milliseconds after each parallel op (a forward's), and on a busy machine
   a new thread may wait a time slice for a core; with fixed jobs the caller waited for it,
   now it runs that job itself. Which thread runs a job never changes a result: each job
   writes its own outputs. A late thread touches only the heap block the call shares with
   it (the last holder frees it), never the caller's jobs. */
#ifndef QS_THREADS_H
#define QS_THREADS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>

#define QS_MAXT 64

typedef struct {
    void *(*fn)(void *);
    char *jobs;
    size_t size;
    int count;          /* jobs */
    int claimed, bad;   /* jobs taken; whether any fn returned non-NULL (atomic) */
    int done, holders;  /* jobs finished (under mu); holders of this block (atomic) */
    pthread_mutex_t mu;
    pthread_cond_t all_done;
} qs_team_t;

static void qs_team_release(qs_team_t *t) {
    if (__atomic_sub_fetch(&t->holders, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_cond_destroy(&t->all_done);
        pthread_mutex_destroy(&t->mu);
        free(t);
    }
}

/* takes and runs jobs until none is left unclaimed */
static void qs_team_work(qs_team_t *t) {
    for (;;) {
        const int j = __atomic_fetch_add(&t->claimed, 1, __ATOMIC_RELAXED);
        if (j >= t->count) return;
        if (t->fn(t->jobs + (size_t)j * t->size) != NULL)
            __atomic_store_n(&t->bad, 1, __ATOMIC_RELAXED);
        pthread_mutex_lock(&t->mu); /* publishes the job's writes to the caller */
        if (++t->done == t->count) pthread_cond_signal(&t->all_done);
        pthread_mutex_unlock(&t->mu);
    }
}

static void *qs_team_thread(void *p) {
    qs_team_work((qs_team_t *)p);
    qs_team_release((qs_team_t *)p);
    return NULL;
}

/* fn on each of the `threads` jobs at `jobs` (`size` bytes apart), on the calling thread
   and up to threads - 1 more; jobs run here when a thread cannot start (or no memory).
   Returns 1 if any fn returned non-NULL (the kernels' error signal), else 0. */
static int qs_run_jobs(void *(*fn)(void *), void *jobs, size_t size, int threads) {
    char *j = (char *)jobs;
    if (threads > QS_MAXT) threads = QS_MAXT;
    qs_team_t *t = threads > 1 ? (qs_team_t *)malloc(sizeof *t) : NULL;
    if (!t) {
        int bad = 0;
        for (int k = 0; k < (threads > 1 ? threads : 1); ++k)
            bad |= fn(j + (size_t)k * size) != NULL;
        return bad;
    }
    *t = (qs_team_t){.fn = fn, .jobs = j, .size = size, .count = threads, .holders = 1};
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->all_done, NULL);
    pthread_attr_t attr;
    const int detach = pthread_attr_init(&attr) == 0;
    if (detach) pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int k = 1; k < threads && detach; ++k) {
        pthread_t tid;
        __atomic_add_fetch(&t->holders, 1, __ATOMIC_RELAXED);
        if (pthread_create(&tid, &attr, qs_team_thread, t) != 0) {
            __atomic_sub_fetch(&t->holders, 1, __ATOMIC_RELAXED);
            break; /* the jobs left run here */
        }
    }
    if (detach) pthread_attr_destroy(&attr);
    qs_team_work(t);
    pthread_mutex_lock(&t->mu);
    while (t->done < t->count) pthread_cond_wait(&t->all_done, &t->mu);
    pthread_mutex_unlock(&t->mu);
    const int bad = __atomic_load_n(&t->bad, __ATOMIC_RELAXED);
    qs_team_release(t);
    return bad;
}

#endif /* QS_THREADS_H */
