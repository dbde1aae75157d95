/* comm-threads.c: the threads backend of tmx/comm.h, ranks that are threads of one process.
 *
 * Every call is an exchange: each rank copies its contribution into its own stage, all ranks
 * meet at a barrier, then each reads what it needs from the others' stages. Stages alternate
 * between two sets by the parity of the call: a rank may start call k + 1 (writing the other
 * set) while a slower one still reads call k's, but it cannot start call k + 2 before everyone
 * has reached the barrier of call k + 1, so one set is never written while it is read. Stages
 * only grow, so a steady stream of same-sized calls allocates nothing.
 *
 * All-reduce of m bytes: up to TMX_COMM_SMALL_BYTES every rank sums every stage in rank order
 * (one barrier); above it rank r sums slice r of every stage into its own stage, and after a
 * second barrier everyone copies the n summed slices (a reduce-scatter and an all-gather). The
 * additions are the same either way.
 *
 * The barrier spins for up to TMX_COMM_SPIN_US microseconds (default 20; 0 when the group has
 * more ranks than the process has CPUs, where a spinning rank only delays the ones it waits
 * for), then sleeps on a condition variable: the short waits of a decode step stay off the
 * scheduler, long ones leave the core to others. */
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm-impl.h"

enum { LINE = 64, MAX_RANKS = 1024, DEFAULT_SPIN_US = 20, MAX_SPIN_US = 1000000 };
enum { OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_BARRIER };
static const char *const op_name[] = {"allreduce", "allgather", "broadcast", "barrier"};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The last rank to arrive resets `arrived` and bumps `round`; the others wait for the bump. */
struct barrier {
    alignas(LINE) atomic_int arrived;
    alignas(LINE) atomic_uint round;
    atomic_int sleepers; /* ranks waiting on cv */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;
    uint64_t spin_ns;
};

static void barrier_wait(struct barrier *b) {
    unsigned r = atomic_load_explicit(&b->round, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        /* seq_cst store, then seq_cst load: either a sleeper's increment is seen here, or the
         * sleeper sees the new round before it waits. */
        atomic_store(&b->round, r + 1);
        if (atomic_load(&b->sleepers)) {
            pthread_mutex_lock(&b->mu);
            pthread_cond_broadcast(&b->cv);
            pthread_mutex_unlock(&b->mu);
        }
        return;
    }
    if (b->spin_ns) {
        const uint64_t t0 = now_ns();
        for (unsigned i = 1;; i++) {
            if (atomic_load_explicit(&b->round, memory_order_acquire) != r) return;
            cpu_relax();
            if (i % 32 == 0 && now_ns() - t0 > b->spin_ns) break;
        }
    }
    pthread_mutex_lock(&b->mu);
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->round) == r) pthread_cond_wait(&b->cv, &b->mu);
    atomic_fetch_sub(&b->sleepers, 1);
    pthread_mutex_unlock(&b->mu);
}

/* One rank's part of a call: written by that rank before the barrier, read by all after. */
struct stage {
    unsigned char *buf; /* [cap] its input, or (large all-reduce) its summed slice */
    size_t cap, bytes;
    int op, root, dtype;
    enum tmx_status st; /* TMX_ERR_NOMEM when buf could not grow to bytes */
};

struct slot {
    alignas(LINE) struct stage par[2]; /* by call parity */
};

struct tcomm {
    alignas(LINE) struct tmx_comm base;
    struct tmx_comm_group *g;
    unsigned calls;     /* collectives so far; its parity picks the stage set */
    const void **rows;  /* [n] this call's stages, for tmx_comm_sum */
};

struct tmx_comm_group {
    struct barrier bar;
    int n;
    struct slot *slot;  /* [n] */
    struct tcomm *comm; /* [n] */
};

/* Publishes this rank's part of call `op` (bytes copied from src unless src is NULL), waits for
 * every rank and checks that all made the same call; *parity gets the stage set to read. Every
 * rank sees the same stages, so every rank returns the same status. */
static enum tmx_status exchange(struct tcomm *t, int op, const void *src, size_t bytes, int root,
                                int dtype, int *parity, char **err) {
    struct tmx_comm_group *g = t->g;
    int p = (int)(t->calls++ & 1u), r = t->base.rank;
    struct stage *s = &g->slot[r].par[p];
    s->op = op, s->bytes = bytes, s->root = root, s->dtype = dtype, s->st = TMX_OK;
    if (src && bytes) {
        if (s->cap < bytes) {
            size_t cap = (bytes + LINE - 1) / LINE * LINE;
            unsigned char *buf = aligned_alloc(LINE, cap);
            if (buf) {
                free(s->buf);
                s->buf = buf, s->cap = cap;
            } else {
                s->st = TMX_ERR_NOMEM;
            }
        }
        if (s->st == TMX_OK) memcpy(s->buf, src, bytes);
    }
    barrier_wait(&g->bar);
    *parity = p;
    for (int k = 0; k < g->n; k++) {
        const struct stage *o = &g->slot[k].par[p];
        if (o->st != TMX_OK)
            return tmx_err(err, o->st, "comm (threads): rank %d could not allocate %zu bytes", k,
                           o->bytes);
        if (o->op != op || o->bytes != bytes || o->root != root || o->dtype != dtype)
            return tmx_err(err, TMX_ERR_INVALID,
                           "comm (threads): rank %d called %s of %zu bytes (root %d, dtype %d) "
                           "while rank %d called %s of %zu bytes (root %d, dtype %d)",
                           r, op_name[op], bytes, root, dtype, k, op_name[o->op], o->bytes,
                           o->root, o->dtype);
    }
    return TMX_OK;
}

static enum tmx_status t_allreduce(tmx_comm_t *c, void *buf, size_t count, enum tmx_dtype dtype,
                                   char **err) {
    struct tcomm *t = (struct tcomm *)c;
    struct tmx_comm_group *g = t->g;
    int n = g->n, p;
    if (n == 1) return TMX_OK; /* one rank's sum is its input, BF16 included */
    size_t es = tmx_dtype_size(dtype), bytes = count * es;
    enum tmx_status st = exchange(t, OP_ALLREDUCE, buf, bytes, 0, (int)dtype, &p, err);
    if (st != TMX_OK || !count) return st;
    for (int k = 0; k < n; k++) t->rows[k] = g->slot[k].par[p].buf;
    if (bytes <= TMX_COMM_SMALL_BYTES) {
        tmx_comm_sum(buf, t->rows, n, 0, count, dtype);
        return TMX_OK;
    }
    size_t lo, len;
    tmx_comm_slice(count, n, c->rank, &lo, &len);
    tmx_comm_sum(g->slot[c->rank].par[p].buf + lo * es, t->rows, n, lo, len, dtype);
    barrier_wait(&g->bar);
    for (int k = 0; k < n; k++) {
        tmx_comm_slice(count, n, k, &lo, &len);
        memcpy((unsigned char *)buf + lo * es, (const unsigned char *)t->rows[k] + lo * es,
               len * es);
    }
    return TMX_OK;
}

static enum tmx_status t_allgather(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                   char **err) {
    struct tcomm *t = (struct tcomm *)c;
    int n = t->g->n, p;
    if (n == 1) {
        if (nbytes && recv != send) memmove(recv, send, nbytes);
        return TMX_OK;
    }
    enum tmx_status st = exchange(t, OP_ALLGATHER, send, nbytes, 0, 0, &p, err);
    if (st != TMX_OK || !nbytes) return st;
    for (int k = 0; k < n; k++)
        memcpy((unsigned char *)recv + (size_t)k * nbytes, t->g->slot[k].par[p].buf, nbytes);
    return TMX_OK;
}

static enum tmx_status t_broadcast(tmx_comm_t *c, void *buf, size_t nbytes, int root,
                                   char **err) {
    struct tcomm *t = (struct tcomm *)c;
    int p;
    if (t->g->n == 1) return TMX_OK;
    const int me = c->rank == root;
    enum tmx_status st = exchange(t, OP_BROADCAST, me ? buf : NULL, nbytes, root, 0, &p, err);
    if (st != TMX_OK || me || !nbytes) return st;
    memcpy(buf, t->g->slot[root].par[p].buf, nbytes);
    return TMX_OK;
}

static enum tmx_status t_barrier(tmx_comm_t *c, char **err) {
    struct tcomm *t = (struct tcomm *)c;
    int p;
    if (t->g->n == 1) return TMX_OK;
    return exchange(t, OP_BARRIER, NULL, 0, 0, 0, &p, err);
}

static const struct tmx_comm_ops threads_ops = {t_allreduce, t_allgather, t_broadcast, t_barrier,
                                                NULL};

enum tmx_status tmx_comm_group_new(int n, tmx_comm_group_t **out, char **err) {
    *out = NULL;
    if (n < 1 || n > MAX_RANKS)
        return tmx_err(err, TMX_ERR_INVALID, "comm group: %d ranks is not in 1..%d", n,
                       MAX_RANKS);
    cpu_set_t cpus;
    int spin_us = sched_getaffinity(0, sizeof cpus, &cpus) == 0 && n > CPU_COUNT(&cpus)
                      ? 0
                      : DEFAULT_SPIN_US;
    const char *env = getenv("TMX_COMM_SPIN_US");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end || v < 0 || v > MAX_SPIN_US)
            return tmx_err(err, TMX_ERR_INVALID,
                           "TMX_COMM_SPIN_US: '%s' is not a number of microseconds (0..%d)", env,
                           MAX_SPIN_US);
        spin_us = (int)v;
    }
    tmx_comm_group_t *g = aligned_alloc(LINE, sizeof *g);
    if (!g) return tmx_err(err, TMX_ERR_NOMEM, "comm group: out of memory");
    memset(g, 0, sizeof *g);
    g->n = n;
    g->bar.n = n, g->bar.spin_ns = (uint64_t)spin_us * 1000u;
    atomic_init(&g->bar.arrived, 0);
    atomic_init(&g->bar.round, 0u);
    atomic_init(&g->bar.sleepers, 0);
    pthread_mutex_init(&g->bar.mu, NULL);
    pthread_cond_init(&g->bar.cv, NULL);
    g->slot = aligned_alloc(LINE, (size_t)n * sizeof *g->slot);
    g->comm = aligned_alloc(LINE, (size_t)n * sizeof *g->comm);
    int ok = g->slot && g->comm;
    if (g->slot) memset(g->slot, 0, (size_t)n * sizeof *g->slot);
    if (g->comm) memset(g->comm, 0, (size_t)n * sizeof *g->comm);
    for (int r = 0; ok && r < n; r++) {
        struct tcomm *t = &g->comm[r];
        t->base = (struct tmx_comm){&threads_ops, TMX_COMM_THREADS, r, n, NULL};
        t->g = g;
        ok = (t->rows = malloc((size_t)n * sizeof *t->rows)) != NULL;
    }
    if (!ok) {
        tmx_comm_group_free(g);
        return tmx_err(err, TMX_ERR_NOMEM, "comm group: out of memory for %d ranks", n);
    }
    *out = g;
    return TMX_OK;
}

tmx_comm_t *tmx_comm_group_rank(tmx_comm_group_t *g, int rank) {
    if (!g || rank < 0 || rank >= g->n) return NULL;
    return &g->comm[rank].base;
}

void tmx_comm_group_free(tmx_comm_group_t *g) {
    if (!g) return;
    for (int r = 0; g->slot && r < g->n; r++)
        for (int p = 0; p < 2; p++) free(g->slot[r].par[p].buf);
    for (int r = 0; g->comm && r < g->n; r++) free(g->comm[r].rows);
    free(g->slot);
    free(g->comm);
    pthread_mutex_destroy(&g->bar.mu);
    pthread_cond_destroy(&g->bar.cv);
    free(g);
}
