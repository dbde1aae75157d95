/* pool.c: the CPU's thread pool (see pool.h).
 *
 * Jobs are numbered modulo 2^32. Job e's (fn, arg, n_items) sit in slots[e % 2], and one
 * atomic word `work` holds (e << 32) | the next item to claim. A thread claims an item with a
 * compare-and-swap on `work`, which fails once job e is over. So a worker that wakes late, or
 * was descheduled, can never run an item of a finished job, and the caller waits only for the
 * items (`done`), never for workers that did nothing: on a busy machine a sleeping worker costs
 * the job nothing. Slot e % 2 is rewritten only for job e + 2, which cannot start before `work`
 * has moved on to e + 1; a claim that succeeds for e therefore read e's own slot. Every shared
 * variable is a sequentially consistent atomic, which is what that argument relies on. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"

/* Polls of `work` before a worker sleeps, and of `done` before the caller does: tens of
 * microseconds either way (a spin poll is a load, a yield about 0.4 us on an idle core),
 * longer than the gap between two ops of a decode step. */
#define SPIN_POLLS 65536
#define YIELD_POLLS 256
#define ITEM_MASK 0xffffffffu

struct job_slot {
    _Atomic(tmx_pool_fn) fn;
    _Atomic(void *) arg;
    atomic_uint_fast64_t n_items;
};

struct worker {
    struct tmx_pool *pool;
    int thread;
};

struct tmx_pool {
    int n_threads;          /* workers + the caller */
    int n_workers;          /* started */
    enum tmx_pool_poll poll;
    pthread_t *tids;        /* [n_threads - 1] */
    struct worker *workers; /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* a job was posted, or the pool stops */
    pthread_cond_t finished; /* the last item of the job is done */

    struct job_slot slots[2];
    atomic_uint_fast64_t work; /* (job << 32) | next item */
    atomic_uint_fast64_t done; /* items of the current job finished */
    atomic_int stop;
};

/* Runs items of job e until all are claimed or the job is over. */
static void run_items(struct tmx_pool *p, uint64_t e, int thread) {
    const struct job_slot *s = &p->slots[e & 1];
    tmx_pool_fn fn = atomic_load(&s->fn);
    void *arg = atomic_load(&s->arg);
    uint64_t n = atomic_load(&s->n_items);
    uint64_t w = atomic_load(&p->work);
    while (w >> 32 == e && (w & ITEM_MASK) < n) {
        if (!atomic_compare_exchange_weak(&p->work, &w, w + 1)) continue;
        fn(arg, (int64_t)(w & ITEM_MASK), thread);
        if (atomic_fetch_add(&p->done, 1) + 1 == n) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->finished);
            pthread_mutex_unlock(&p->mu);
        }
        w = atomic_load(&p->work);
    }
}

static int job_posted(struct tmx_pool *p, uint64_t seen) {
    return atomic_load(&p->work) >> 32 != seen || atomic_load(&p->stop);
}

/* One poll's wait: nothing, or the core given away. */
static int polls(const struct tmx_pool *p) {
    return p->poll == TMX_POOL_YIELD ? YIELD_POLLS : SPIN_POLLS;
}

static void pause_poll(const struct tmx_pool *p) {
    if (p->poll == TMX_POOL_YIELD) sched_yield();
}

static void *worker_main(void *arg) {
    const struct worker *me = arg;
    struct tmx_pool *p = me->pool;
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0; i < polls(p) && !job_posted(p, seen); i++) pause_poll(p);
        if (!job_posted(p, seen)) {
            pthread_mutex_lock(&p->mu);
            while (!job_posted(p, seen)) pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = atomic_load(&p->work) >> 32;
        run_items(p, seen, me->thread);
    }
}

enum tmx_status tmx_pool_new(int n_threads, enum tmx_pool_poll poll, struct tmx_pool **out) {
    *out = NULL;
    struct tmx_pool *p = calloc(1, sizeof *p);
    if (!p) return TMX_ERR_NOMEM;
    p->n_threads = n_threads < 1 ? 1 : n_threads;
    p->poll = poll;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->finished, NULL);
    p->tids = calloc((size_t)p->n_threads, sizeof *p->tids);
    p->workers = calloc((size_t)p->n_threads, sizeof *p->workers);
    if (!p->tids || !p->workers) {
        tmx_pool_free(p);
        return TMX_ERR_NOMEM;
    }
    for (int i = 0; i < p->n_threads - 1; i++) {
        p->workers[i] = (struct worker){p, i + 1};
        if (pthread_create(&p->tids[i], NULL, worker_main, &p->workers[i]) != 0) {
            tmx_pool_free(p);
            return TMX_ERR_NOMEM;
        }
        p->n_workers++;
    }
    *out = p;
    return TMX_OK;
}

void tmx_pool_free(struct tmx_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->finished);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p->tids);
    free(p);
}

int tmx_pool_threads(const struct tmx_pool *p) { return p->n_threads; }

void tmx_pool_run(struct tmx_pool *p, int64_t n_items, tmx_pool_fn fn, void *arg) {
    if (n_items <= 0) return;
    if (p->n_workers == 0 || n_items == 1) {
        for (int64_t i = 0; i < n_items; i++) fn(arg, i, 0);
        return;
    }
    uint64_t e = ((atomic_load(&p->work) >> 32) + 1) & ITEM_MASK; /* wraps after 2^32 jobs */
    struct job_slot *s = &p->slots[e & 1];
    atomic_store(&s->fn, fn);
    atomic_store(&s->arg, arg);
    atomic_store(&s->n_items, (uint64_t)n_items);
    atomic_store(&p->done, 0);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->work, e << 32);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_items(p, e, 0);

    for (int i = 0; i < polls(p) && atomic_load(&p->done) < (uint64_t)n_items; i++) pause_poll(p);
    if (atomic_load(&p->done) < (uint64_t)n_items) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->done) < (uint64_t)n_items) pthread_cond_wait(&p->finished, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

static void threads_run(void *pool, int64_t n_items, tmx_threads_fn fn, void *arg) {
    tmx_pool_run(pool, n_items, fn, arg);
}

struct tmx_threads tmx_pool_as_threads(struct tmx_pool *p) {
    return (struct tmx_threads){p, p->n_threads, threads_run};
}
