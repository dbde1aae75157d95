/* pool.h: the codec plugins' worker threads, a parallel-for over work items.
 *
 * trellis_pool_run(pool, n, fn, arg) calls fn(arg, item, thread) once for every item < n, on
 * the pool's workers and the calling thread, and returns when every call has returned. Items
 * are claimed in order from a shared counter, so which thread runs an item varies from run to
 * run: an item writes only its own outputs and computes them the same way on any thread.
 * `thread` (0 .. threads - 1, 0 is the caller) indexes per-thread scratch. One caller at a
 * time; fn must not call the pool. */
#ifndef TMX_TRELLIS_POOL_H
#define TMX_TRELLIS_POOL_H

#include <stdint.h>

#include "tmx/status.h"

struct trellis_pool;

typedef void (*trellis_item_fn)(void *arg, int64_t item, int thread);

/* n_threads counts the caller; 1 starts no workers. */
enum tmx_status trellis_pool_new(int n_threads, struct trellis_pool **out);
/* Stops and joins the workers; safe with NULL. */
void trellis_pool_free(struct trellis_pool *pool);

int trellis_pool_threads(const struct trellis_pool *pool);

void trellis_pool_run(struct trellis_pool *pool, int64_t n_items, trellis_item_fn fn, void *arg);

#endif
