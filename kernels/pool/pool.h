/* pool.h: the CPU's thread pool, a parallel-for on pthreads, for the CPU kernel set
 * (kernels/cpu) and the codecs' host path (plugins/trellis). A static library each links.
 *
 * tmx_pool_run(pool, n, fn, arg) calls fn(arg, item, thread) once for every item < n (n <
 * 2^32), spread over the pool's workers and the calling thread, and returns when all calls are
 * done. Items are claimed in order from a shared counter, so which thread runs an item varies:
 * an item must write only its own outputs and compute them the same way wherever it runs.
 * `thread` (0 .. threads - 1, 0 is the caller) indexes per-thread scratch. Between jobs a
 * worker polls for the next one before it sleeps (a decode step issues many small jobs back to
 * back), then sleeps; a worker that is slow to wake simply takes no part in a job. One caller
 * at a time, and fn must not call the pool. */
#ifndef TMX_POOL_H
#define TMX_POOL_H

#include <stdint.h>

#include "tmx/kernels.h"
#include "tmx/status.h"

struct tmx_pool;

typedef void (*tmx_pool_fn)(void *arg, int64_t item, int thread);

/* How a thread polls between jobs. SPIN: on the core, the quickest to take the next job.
 * YIELD: giving the core away at each poll, for a pool whose threads may share the cores with
 * another pool (a codec's own, beside a kernel set that lends it none). */
enum tmx_pool_poll { TMX_POOL_SPIN, TMX_POOL_YIELD };

/* n_threads counts the caller: 1 makes a pool without workers that runs items inline. */
enum tmx_status tmx_pool_new(int n_threads, enum tmx_pool_poll poll, struct tmx_pool **out);
/* Stops and joins the workers. Safe with NULL. */
void tmx_pool_free(struct tmx_pool *pool);

int tmx_pool_threads(const struct tmx_pool *pool);

void tmx_pool_run(struct tmx_pool *pool, int64_t n_items, tmx_pool_fn fn, void *arg);

/* The pool as a struct tmx_threads (tmx/kernels.h), what a kernel set lends a codec and what a
 * codec runs its own work on: valid while the pool is. */
struct tmx_threads tmx_pool_as_threads(struct tmx_pool *pool);

#endif
