/* api-null.c: a front end that serves nothing, the skeleton of every api plugin.
 *
 * What it is: an api plugin (kind "api", ops table struct tmx_api_i in tmx/plugin.h). `run`
 * blocks the calling thread until another thread calls `stop`, which is the whole lifecycle
 * contract of a front end; a real one (an HTTP server) would serve requests inside `run` and
 * make `stop` wake its event loop. A `stop` that comes before `run` is kept, so `run` then
 * returns at once: a shutdown can never be lost to a race.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND api NAME null SOURCES api-null.c
 * LIBS Threads::Threads); by hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -pthread -I core/include \
 *        -o libtmx-api-null.so tests/plugins/api-null.c
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir and add
 * "api.null" to the config's "load" list.
 *
 * What it shows: blocking in run and waking from stop with a mutex and a condition variable,
 * and a fini that is safe after a failed init (ctx NULL). */
#include <pthread.h>
#include <stdlib.h>

#include "tmx/plugin.h"

struct null_api {
    const struct tmx_host *host;
    pthread_mutex_t lock;
    pthread_cond_t stopped_cv;
    int stopped; /* under lock */
};

static enum tmx_status null_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                 const struct tmx_serve_i *serve, void **ctx, char **err) {
    (void)opts, (void)serve;
    struct null_api *a = calloc(1, sizeof *a);
    if (!a) return host->err(err, TMX_ERR_NOMEM, "api null: out of memory");
    a->host = host;
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->stopped_cv, NULL);
    *ctx = a;
    return TMX_OK;
}

static void null_fini(void *ctx) {
    struct null_api *a = ctx;
    if (!a) return;
    pthread_cond_destroy(&a->stopped_cv);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

static enum tmx_status null_run(void *ctx, char **err) {
    (void)err;
    struct null_api *a = ctx;
    a->host->log(TMX_LOG_INFO, "api null: serving nothing until stopped");
    pthread_mutex_lock(&a->lock);
    while (!a->stopped) pthread_cond_wait(&a->stopped_cv, &a->lock);
    pthread_mutex_unlock(&a->lock);
    return TMX_OK;
}

static void null_stop(void *ctx) {
    struct null_api *a = ctx;
    pthread_mutex_lock(&a->lock);
    a->stopped = 1;
    pthread_cond_broadcast(&a->stopped_cv);
    pthread_mutex_unlock(&a->lock);
}

static const struct tmx_api_i null_ops = {
    .struct_size = sizeof(struct tmx_api_i),
    .init = null_init,
    .fini = null_fini,
    .run = null_run,
    .stop = null_stop,
};

static const struct tmx_plugin null_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "null",
    .kind = TMX_PLUGIN_API,
    .version = "1.0.0",
    .ops = &null_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &null_plugin;
}
