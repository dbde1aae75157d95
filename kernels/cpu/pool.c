/* pool.c: the CPU kernel set's thread pool (see pool.h).
 *
 * Jobs are numbered modulo 2^32. Job e's (fn, arg, n_tasks) sit in slots[e % 2], and one
 * atomic word `work` holds (e << 32) | the next task to claim. A thread claims a task with a
 * compare-and-swap on `work`, which fails once job e is over. So a worker that wakes late, or
 * was descheduled, can never run a task of a finished job, and the caller waits only for the
 * tasks (`done`), never for workers that did nothing: on a busy machine a sleeping worker costs
 * the job nothing. Slot e % 2 is rewritten only for job e + 2, which cannot start before `work`
 * has moved on to e + 1; a claim that succeeds for e therefore read e's own slot. Every shared
 * variable is a sequentially consistent atomic, which is what that argument relies on. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"

/* Polls of `work` before a worker sleeps, and of `done` before the caller does: tens of
 * microseconds, longer than the gap between two ops of a decode step. */
#define SPIN_POLLS 65536
#define TASK_MASK 0xffffffffu

struct job_slot {
    _Atomic(cpu_task_fn) fn;
    _Atomic(void *) arg;
    atomic_uint_fast64_t n_tasks;
};

struct cpu_pool {
    int n_threads;      /* workers + the caller */
    int n_workers;      /* started */
    pthread_t *workers; /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* a job was posted, or the pool stops */
    pthread_cond_t finished; /* the last task of the job is done */

    struct job_slot slots[2];
    atomic_uint_fast64_t work; /* (job << 32) | next task */
    atomic_uint_fast64_t done; /* tasks of the current job finished */
    atomic_int stop;
};

/* Runs tasks of job e until all are claimed or the job is over. */
static void run_tasks(struct cpu_pool *p, uint64_t e) {
    const struct job_slot *s = &p->slots[e & 1];
    cpu_task_fn fn = atomic_load(&s->fn);
    void *arg = atomic_load(&s->arg);
    uint64_t n = atomic_load(&s->n_tasks);
    uint64_t w = atomic_load(&p->work);
    while (w >> 32 == e && (w & TASK_MASK) < n) {
        if (!atomic_compare_exchange_weak(&p->work, &w, w + 1)) continue;
        fn(arg, (int64_t)(w & TASK_MASK));
        if (atomic_fetch_add(&p->done, 1) + 1 == n) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->finished);
            pthread_mutex_unlock(&p->mu);
        }
        w = atomic_load(&p->work);
    }
}

static int job_posted(struct cpu_pool *p, uint64_t seen) {
    return atomic_load(&p->work) >> 32 != seen || atomic_load(&p->stop);
}

static void *worker_main(void *arg) {
    struct cpu_pool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0; i < SPIN_POLLS && !job_posted(p, seen); i++) {}
        if (!job_posted(p, seen)) {
            pthread_mutex_lock(&p->mu);
            while (!job_posted(p, seen)) pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = atomic_load(&p->work) >> 32;
        run_tasks(p, seen);
    }
}

enum tmx_status cpu_pool_new(int n_threads, struct cpu_pool **out) {
    *out = NULL;
    struct cpu_pool *p = calloc(1, sizeof *p);
    if (!p) return TMX_ERR_NOMEM;
    p->n_threads = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->finished, NULL);
    p->workers = calloc((size_t)p->n_threads, sizeof *p->workers);
    if (!p->workers) {
        cpu_pool_free(p);
        return TMX_ERR_NOMEM;
    }
    for (int i = 0; i < p->n_threads - 1; i++) {
        if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
            cpu_pool_free(p);
            return TMX_ERR_NOMEM;
        }
        p->n_workers++;
    }
    *out = p;
    return TMX_OK;
}

void cpu_pool_free(struct cpu_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->workers[i], NULL);
    pthread_cond_destroy(&p->finished);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

int cpu_pool_threads(const struct cpu_pool *p) { return p->n_threads; }

void cpu_pool_run(struct cpu_pool *p, int64_t n_tasks, cpu_task_fn fn, void *arg) {
    if (n_tasks <= 0) return;
    if (p->n_workers == 0 || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; i++) fn(arg, i);
        return;
    }
    uint64_t e = ((atomic_load(&p->work) >> 32) + 1) & TASK_MASK; /* wraps after 2^32 jobs */
    struct job_slot *s = &p->slots[e & 1];
    atomic_store(&s->fn, fn);
    atomic_store(&s->arg, arg);
    atomic_store(&s->n_tasks, (uint64_t)n_tasks);
    atomic_store(&p->done, 0);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->work, e << 32);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, e);

    for (int i = 0; i < SPIN_POLLS && atomic_load(&p->done) < (uint64_t)n_tasks; i++) {}
    if (atomic_load(&p->done) < (uint64_t)n_tasks) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->done) < (uint64_t)n_tasks) pthread_cond_wait(&p->finished, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
