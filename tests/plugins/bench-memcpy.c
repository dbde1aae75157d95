/* bench-memcpy.c: memcpy bandwidth, the smallest bench plugin.
 *
 * What it is: a bench plugin (kind "bench", ops table struct tmx_bench_i in tmx/plugin.h) with
 * one case per copy size. Each case doubles its iteration count until one timed batch lasts
 * min_time_ms, then writes one JSON object per line to out_fd:
 *     {"case": "memcpy-4KiB", "bytes": 4096, "iters": 65536, "ns_per_iter": 81.2,
 *      "gb_per_s": 50.4}
 * (gb_per_s counts the bytes copied, 1e9 per GB.) It is the baseline the kernel benches are
 * read against: no op moves data faster than memcpy on the same memory.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND bench NAME memcpy SOURCES bench-memcpy.c); by
 * hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -I core/include \
 *        -o libtmx-bench-memcpy.so tests/plugins/bench-memcpy.c
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir and add
 * "bench.memcpy" to the config's "load" list. Its option: min_time_ms (default 50), e.g.
 * TMX_BENCH_MEMCPY_MIN_TIME_MS=200.
 *
 * What it shows: a case table filtered by name, output as JSON lines on a file descriptor, and
 * keeping the compiler from deleting work whose result nobody reads. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tmx/plugin.h"

static const struct {
    const char *name;
    size_t bytes;
} memcpy_cases[] = {
    {"memcpy-4KiB", 4 << 10},   /* L1 */
    {"memcpy-256KiB", 256 << 10}, /* L2 */
    {"memcpy-16MiB", 16 << 20}, /* beyond most L3 slices: memory bandwidth */
};

struct memcpy_bench {
    const struct tmx_host *host;
    double min_ns;
};

static enum tmx_status memcpy_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                   void **ctx, char **err) {
    const int64_t ms = host->opt_int(opts, "min_time_ms");
    if (ms < 1) return host->err(err, TMX_ERR_INVALID, "bench memcpy: min_time_ms must be >= 1");
    struct memcpy_bench *b = calloc(1, sizeof *b);
    if (!b) return host->err(err, TMX_ERR_NOMEM, "bench memcpy: out of memory");
    b->host = host;
    b->min_ns = (double)ms * 1e6;
    *ctx = b;
    return TMX_OK;
}

static void memcpy_fini(void *ctx) { free(ctx); }

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static enum tmx_status memcpy_run(void *ctx, const char *filter, int out_fd, char **err) {
    const struct memcpy_bench *b = ctx;
    for (size_t c = 0; c < sizeof memcpy_cases / sizeof memcpy_cases[0]; c++) {
        if (filter && !strstr(memcpy_cases[c].name, filter)) continue;
        const size_t n = memcpy_cases[c].bytes;
        char *src = malloc(n), *dst = malloc(n);
        if (!src || !dst) {
            free(src);
            free(dst);
            return b->host->err(err, TMX_ERR_NOMEM, "bench memcpy: out of memory");
        }
        memset(src, 1, n);
        memcpy(dst, src, n); /* fault the pages in before timing */
        double ns = 0.0;
        long iters = 1;
        for (;; iters *= 2) {
            const double t0 = now_ns();
            for (long i = 0; i < iters; i++) {
                memcpy(dst, src, n);
                __asm__ volatile("" : : "r"(dst) : "memory"); /* dst counts as read */
            }
            ns = now_ns() - t0;
            if (ns >= b->min_ns) break;
        }
        free(src);
        free(dst);
        const double per = ns / (double)iters;
        if (dprintf(out_fd,
                    "{\"case\": \"%s\", \"bytes\": %zu, \"iters\": %ld, \"ns_per_iter\": %.1f, "
                    "\"gb_per_s\": %.2f}\n",
                    memcpy_cases[c].name, n, iters, per, (double)n / per) < 0)
            return b->host->err(err, TMX_ERR_IO, "bench memcpy: cannot write to fd %d", out_fd);
    }
    return TMX_OK;
}

static const struct tmx_option memcpy_opts[] = {
    {"min_time_ms", TMX_OPT_INT, "50", "shortest timed batch per case, in milliseconds"},
    {0},
};

static const struct tmx_bench_i memcpy_ops = {
    .struct_size = sizeof(struct tmx_bench_i),
    .init = memcpy_init,
    .fini = memcpy_fini,
    .run = memcpy_run,
};

static const struct tmx_plugin memcpy_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "memcpy",
    .kind = TMX_PLUGIN_BENCH,
    .version = "1.0.0",
    .opts = memcpy_opts,
    .ops = &memcpy_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &memcpy_plugin;
}
