/* plugin.c: api.openai — an OpenAI-compatible HTTP server over the engine's scheduler.
 *
 * init binds the listening socket (so that a taken port fails before the model is announced),
 * run turns the libuv loop until stop, and stop only sets a flag and wakes the loop: it is safe
 * from any thread and from a signal handler (uv_async_send is async-signal-safe). On stop the
 * server closes its listener and idle connections, answers every request in flight with 503 (an
 * error event and [DONE] on streams) after cancelling it, and returns from run once the scheduler
 * has finished all of them: nothing of the plugin's is left in the scheduler afterwards. The host
 * ignores SIGPIPE (tmx serve does), so that a client that hangs up costs only its connection.
 *
 * /health answers 200 whenever the server accepts connections: `tmx serve` loads the model
 * before it starts the plugin, so there is no loading state to report with 503. */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api.h"

static const struct tmx_option options[] = {
    {"host", TMX_OPT_STRING, "127.0.0.1", "address to listen on (IPv4 or IPv6)"},
    {"port", TMX_OPT_INT, "8010", "TCP port to listen on; 0: any free port (logged)"},
    {"api_key", TMX_OPT_STRING, "",
     "require \"Authorization: Bearer <key>\" everywhere but /health; \"\": no key"},
    {"max_body", TMX_OPT_INT, "16777216", "largest request body in bytes (413 beyond)"},
    {"timeout", TMX_OPT_INT, "30",
     "seconds a client may take to send a whole request, or stay idle between requests"},
    {"cors_origin", TMX_OPT_STRING, "",
     "Access-Control-Allow-Origin for browser clients, e.g. \"*\"; \"\": CORS off"},
    {0},
};

uint64_t api_random(struct api *a) { /* splitmix64: ids and seeds, not secrets */
    uint64_t z = (a->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void api_check_done(struct api *a) {
    /* the wake handle is the last one keeping the loop alive: without it, run returns */
    if (a->stopping && !a->conns && a->n_jobs == 0) uv_unref((uv_handle_t *)&a->wake);
}

static void on_wake(uv_async_t *h) {
    struct api *a = h->data;
    gen_drain(a);
    if (atomic_load(&a->stop_requested) && !a->stopping) {
        a->stopping = 1;
        a->host->log(TMX_LOG_INFO, "api.openai: shutting down");
        http_shutdown(a);
        api_check_done(a);
    }
}

/* Which tool-call format the model writes, told by its tokenizer's special tokens. */
static enum tool_format tool_format_of(const struct tmx_serve_i *si) {
    if (si->find_token(si->serve, "<|channel|>") >= 0 &&
        si->find_token(si->serve, "<|message|>") >= 0)
        return TOOL_FORMAT_HARMONY;
    if (si->find_token(si->serve, "<tool_call>") >= 0 &&
        si->find_token(si->serve, "</tool_call>") >= 0)
        return TOOL_FORMAT_HERMES;
    if (si->find_token(si->serve, "<|python_tag|>") >= 0) return TOOL_FORMAT_LLAMA3;
    return TOOL_FORMAT_NONE;
}

static void close_handle(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

static void openai_fini(void *ctx) {
    struct api *a = ctx;
    if (!a) return;
    if (a->wake.data) { /* the loop exists */
        uv_walk(&a->loop, close_handle, NULL);
        uv_run(&a->loop, UV_RUN_DEFAULT);
        uv_loop_close(&a->loop);
        pthread_mutex_destroy(&a->lock);
    }
    free(a->model);
    free(a->bind_host);
    free(a->api_key);
    free(a->cors_origin);
    free(a);
}

static char *opt_strdup(const struct tmx_host *h, const struct tmx_opts *o, const char *name) {
    const char *v = h->opt_str(o, name);
    return strdup(v ? v : "");
}

/* The options that can be wrong without trying to listen: each one names itself. */
static enum tmx_status openai_check(const struct tmx_host *host, const struct tmx_opts *opts,
                                    char **err) {
    const char *bind_host = host->opt_str(opts, "host");
    const int64_t port = host->opt_int(opts, "port");
    struct sockaddr_storage addr;
    if (port < 0 || port > 65535)
        return host->err(err, TMX_ERR_INVALID, "%s: %lld is not a TCP port",
                         tmx_opt_where(host, opts, "port"), (long long)port);
    if (!http_addr(bind_host, (int)port, &addr))
        return host->err(err, TMX_ERR_INVALID, "%s: \"%.200s%s\" is not an IPv4 or IPv6 address",
                         tmx_opt_where(host, opts, "host"), bind_host,
                         strlen(bind_host) > 200 ? "..." : "");
    if (host->opt_int(opts, "max_body") < 1024)
        return host->err(err, TMX_ERR_INVALID, "%s: must be at least 1024 bytes",
                         tmx_opt_where(host, opts, "max_body"));
    if (host->opt_int(opts, "timeout") < 1)
        return host->err(err, TMX_ERR_INVALID, "%s: must be at least 1 second",
                         tmx_opt_where(host, opts, "timeout"));
    return TMX_OK;
}

static enum tmx_status openai_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                   const struct tmx_serve_i *serve, void **ctx, char **err) {
    *ctx = NULL;
    if (!serve || serve->struct_size < sizeof *serve)
        return host->err(err, TMX_ERR_ABI, "api.openai: the serving table is older than the "
                         "plugin (%u < %zu bytes)", serve ? serve->struct_size : 0, sizeof *serve);
    struct api *a = calloc(1, sizeof *a);
    if (!a) return host->err(err, TMX_ERR_NOMEM, "out of memory");
    a->host = host;
    a->si = serve;
    a->model = strdup(serve->model_name ? serve->model_name : "tmx"); /* core key model_name */
    a->bind_host = opt_strdup(host, opts, "host");
    a->api_key = opt_strdup(host, opts, "api_key");
    a->cors_origin = opt_strdup(host, opts, "cors_origin");
    const int64_t port = host->opt_int(opts, "port");
    const int64_t max_body = host->opt_int(opts, "max_body");
    const int64_t timeout = host->opt_int(opts, "timeout");
    a->port = (int)port;
    a->max_body = (size_t)max_body;
    a->timeout_ms = (uint64_t)timeout * 1000;
    a->tools = tool_format_of(serve);
    a->started = (long long)time(NULL);
    a->rng = uv_hrtime() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)a;
    atomic_init(&a->stop_requested, 0);
    enum tmx_status st = openai_check(host, opts, err);
    if (st == TMX_OK && (!a->model || !a->bind_host || !a->api_key || !a->cors_origin))
        st = host->err(err, TMX_ERR_NOMEM, "out of memory");
    else if (st == TMX_OK && uv_loop_init(&a->loop) != 0)
        st = host->err(err, TMX_ERR_NOMEM, "api.openai: cannot create the event loop");
    if (st == TMX_OK) {
        pthread_mutex_init(&a->lock, NULL);
        uv_async_init(&a->loop, &a->wake, on_wake);
        a->wake.data = a;
        st = http_listen(a, err);
    }
    if (st != TMX_OK) {
        openai_fini(a);
        return st;
    }
    *ctx = a;
    return TMX_OK;
}

static enum tmx_status openai_run(void *ctx, char **err) {
    struct api *a = ctx;
    if (a->stopping)
        return a->host->err(err, TMX_ERR_INVALID, "api.openai: run after the server stopped");
    const int v6 = strchr(a->bind_host, ':') != NULL;
    a->host->log(TMX_LOG_INFO, "api.openai: serving \"%s\" on http://%s%s%s:%d/v1", a->model,
                 v6 ? "[" : "", a->bind_host, v6 ? "]" : "", a->port);
    uv_run(&a->loop, UV_RUN_DEFAULT);
    return TMX_OK;
}

static void openai_stop(void *ctx) {
    struct api *a = ctx;
    if (!a) return;
    atomic_store(&a->stop_requested, 1);
    uv_async_send(&a->wake);
}

static const struct tmx_api_i openai_ops = {
    .struct_size = sizeof(struct tmx_api_i),
    .init = openai_init,
    .fini = openai_fini,
    .run = openai_run,
    .stop = openai_stop,
    .check = openai_check,
};

static const struct tmx_plugin openai_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "openai",
    .kind = TMX_PLUGIN_API,
    .version = "1.0.0",
    .opts = options,
    .ops = &openai_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &openai_plugin;
}
