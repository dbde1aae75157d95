/* pool.h: a small pthread pool with a parallel-for, for the CPU kernel set.
 *
 * cpu_pool_run(pool, n, fn, arg) calls fn(arg, i) once for every i < n (n < 2^32), spread over
 * the pool's threads and the calling thread, and returns when all calls are done. Tasks are
 * claimed in order from a shared counter, so which thread runs a task varies: a task must write
 * only its own outputs and compute them the same way wherever it runs. Workers spin briefly
 * between jobs (decode issues many small ops back to back), then sleep; a worker that is slow to
 * wake simply takes no part in a job. One caller at a time, and fn must not call the pool. */
#ifndef TMX_KERNELS_CPU_POOL_H
#define TMX_KERNELS_CPU_POOL_H

#include <stdint.h>

#include "tmx/status.h"

struct cpu_pool;

typedef void (*cpu_task_fn)(void *arg, int64_t task);

/* n_threads counts the caller: 1 makes a pool without workers that runs tasks inline. */
enum tmx_status cpu_pool_new(int n_threads, struct cpu_pool **out);
/* Stops and joins the workers. Safe with NULL. */
void cpu_pool_free(struct cpu_pool *pool);

int cpu_pool_threads(const struct cpu_pool *pool);

void cpu_pool_run(struct cpu_pool *pool, int64_t n_tasks, cpu_task_fn fn, void *arg);

#endif
