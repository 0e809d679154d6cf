/* tests/kernels/test_threads_claim.py: qs_run_jobs runs each job once, whoever claims it; a
   job's error reaches the caller; the caller returns after every job has finished. */
#include "qs_threads.h"
#include <stdio.h>
#include <unistd.h>
typedef struct { int runs, fail; long sum; } job_t;
static void *job(void *p) {
    job_t *j = (job_t *)p;
    j->runs++;  /* a second run of a job (or a race on it) shows here or under TSan */
    for (long i = 0; i < 2000; ++i) j->sum += i % 7;
    if (j->fail && j->runs == 1) usleep(50);  /* a slow job the caller must wait for */
    return j->fail ? p : NULL;
}
int main(void) {
    for (int r = 0; r < 1500; ++r) {
        const int threads = 1 + r % 9, failing = r % 5 == 0 ? r % threads : -1;
        job_t jobs[9] = {{0}};
        for (int t = 0; t < threads; ++t) jobs[t].fail = t == failing;
        const int bad = qs_run_jobs(job, jobs, sizeof jobs[0], threads);
        for (int t = 0; t < threads; ++t)
            if (jobs[t].runs != 1 || jobs[t].sum != 5995) {
                printf("job %d of %d: %d runs, sum %ld\n", t, threads, jobs[t].runs, jobs[t].sum);
                return 1;
            }
        if (bad != (failing >= 0)) { printf("error flag %d, failing job %d\n", bad, failing); return 1; }
    }
    printf("ok\n");
    return 0;
}
