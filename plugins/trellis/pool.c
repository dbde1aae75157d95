/* pool.c: a parallel-for on pthreads. Workers sleep on a condition variable between jobs; a
 * job bumps a generation number, the workers and the caller claim items from an atomic
 * counter, and the caller waits until every worker has left the job (so that fn and arg may
 * be gone when trellis_pool_run returns). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"

struct worker {
    struct trellis_pool *pool;
    int thread;
};

struct trellis_pool {
    int n_threads;
    pthread_t *tids;         /* [n_threads - 1] */
    struct worker *workers;  /* [n_threads - 1] */
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    uint64_t generation;     /* jobs started; under lock */
    int busy;                /* workers still inside the current job; under lock */
    int stop;                /* under lock */
    trellis_item_fn fn;
    void *arg;
    int64_t n_items;
    atomic_int_fast64_t next; /* the next unclaimed item */
};

static void drain(struct trellis_pool *p, int thread) {
    for (int64_t i; (i = atomic_fetch_add(&p->next, 1)) < p->n_items;) p->fn(p->arg, i, thread);
}

static void *worker_main(void *arg) {
    const struct worker *w = arg;
    struct trellis_pool *p = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->lock);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->lock);
        drain(p, w->thread);
        pthread_mutex_lock(&p->lock);
        if (--p->busy == 0) pthread_cond_signal(&p->idle);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

enum tmx_status trellis_pool_new(int n_threads, struct trellis_pool **out) {
    struct trellis_pool *p = calloc(1, sizeof *p);
    if (!p) return TMX_ERR_NOMEM;
    p->n_threads = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->idle, NULL);
    const int n = p->n_threads - 1;
    p->tids = calloc((size_t)n + 1, sizeof *p->tids);
    p->workers = calloc((size_t)n + 1, sizeof *p->workers);
    if (!p->tids || !p->workers) {
        p->n_threads = 1; /* nothing started: free only releases memory */
        trellis_pool_free(p);
        return TMX_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) {
        p->workers[i] = (struct worker){p, i + 1};
        if (pthread_create(&p->tids[i], NULL, worker_main, &p->workers[i]) != 0) {
            p->n_threads = i + 1; /* join the workers that did start */
            trellis_pool_free(p);
            return TMX_ERR_NOMEM;
        }
    }
    *out = p;
    return TMX_OK;
}

void trellis_pool_free(struct trellis_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->idle);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p->workers);
    free(p->tids);
    free(p);
}

int trellis_pool_threads(const struct trellis_pool *p) { return p->n_threads; }

void trellis_pool_run(struct trellis_pool *p, int64_t n_items, trellis_item_fn fn, void *arg) {
    if (p->n_threads == 1 || n_items < 2) {
        for (int64_t i = 0; i < n_items; i++) fn(arg, i, 0);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->arg = arg;
    p->n_items = n_items;
    atomic_store(&p->next, 0);
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    drain(p, 0);
    pthread_mutex_lock(&p->lock);
    while (p->busy > 0) pthread_cond_wait(&p->idle, &p->lock);
    pthread_mutex_unlock(&p->lock);
}
