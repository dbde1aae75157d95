/* serve.c: `tmx serve` — load the model, start the scheduler, and hand them to the API front end
 * (plugin api.<config "api">, api.openai by default) until SIGINT or SIGTERM. Under mpirun the
 * processes of ranks 1..N-1 only follow rank 0's steps until rank 0 stops. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tmx/log.h"
#include "tmx/serve.h"

static const char usage[] =
    "usage: tmx serve --model DIR [options]\n\n"
    "Serves the model over the API front end named by config key \"api\" (default: openai, an\n"
    "OpenAI-compatible HTTP server; its options are api.openai.host, .port, .api_key, ...).\n\n"
    "      --host HOST        same as --set api.openai.host=HOST\n"
    "      --port PORT        same as --set api.openai.port=PORT\n" CLI_TP_USAGE CLI_ENGINE_USAGE;

struct stopper {
    sigset_t signals;
    const struct tmx_api_i *api;
    void *ctx;
};

/* Waits for SIGINT/SIGTERM (blocked in every other thread) and stops the front end. */
static void *wait_signal(void *arg) {
    struct stopper *st = arg;
    int sig;
    if (sigwait(&st->signals, &sig) == 0) {
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL); /* finish stopping once begun */
        tmx_log(TMX_LOG_INFO, "%s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
        st->api->stop(st->ctx);
    }
    return NULL;
}

int cmd_serve(int argc, char **argv) {
    static const struct option longopts[] = {{"host", required_argument, 0, 'H'},
                                              {"port", required_argument, 0, 'P'},
                                              {"help", no_argument, 0, 'h'},
                                              CLI_TP_LONGOPT,
                                              CLI_ENGINE_LONGOPTS,
                                              {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    char host_set[300], port_set[64], tp_set[32];
    int c, r;
    while ((c = getopt_long(argc, argv, "h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        if (c == 'H' || c == 'P') {
            char *buf = c == 'H' ? host_set : port_set;
            snprintf(buf, c == 'H' ? sizeof host_set : sizeof port_set, "api.openai.%s=%s",
                     c == 'H' ? "host" : "port", optarg);
            if (cli_engine_opt(&eo, 'S', buf) < 0) return 2;
        } else if (c == CLI_TP_OPT) {
            if (cli_tp_opt(&eo, tp_set, sizeof tp_set, optarg) < 0) return 2;
        } else if (c == 'h') {
            fputs(usage, stdout);
            return 0;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tmx serve: unexpected argument \"%s\"\n%s", argv[optind], usage);
        return 2;
    }
    /* Signals go to one thread; a client that hangs up must not kill the server. */
    struct stopper stop = {0};
    sigemptyset(&stop.signals);
    sigaddset(&stop.signals, SIGINT);
    sigaddset(&stop.signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop.signals, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct tmx_engine *e = cli_engine_open(&eo, "serve");
    if (!e) return 1;
    if (tmx_engine_rank(e) != 0) return cli_follow(e, "serve"); /* signals stay blocked */
    const struct tmx_config *cfg = tmx_engine_config(e);
    struct tmx_serve *s = NULL;
    const struct tmx_plugin *p = NULL;
    char *err = NULL, name[256];
    void *ctx = NULL;
    const char *model_name = tmx_config_str(cfg, "model_name");
    if (!*model_name) { /* the model folder's name */
        const char *dir = tmx_engine_model_dir(e);
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        const char *base = dir + len;
        while (base > dir && base[-1] != '/') base--;
        snprintf(name, sizeof name, "%.*s", (int)(dir + len - base), base);
        model_name = name;
    }
    enum tmx_status st = tmx_serve_new(e, &s, &err);
    if (st == TMX_OK)
        st = tmx_plugins_load(tmx_engine_plugins_mut(e), TMX_PLUGIN_API,
                              tmx_config_str(cfg, "api"), &p, &err);
    struct tmx_serve_i table;
    if (st == TMX_OK) {
        tmx_serve_table(s, model_name, &table);
        stop.api = p->ops;
        st = stop.api->init(tmx_host_get(), tmx_plugins_opts(tmx_engine_plugins(e), p), &table,
                            &ctx, &err);
    }
    pthread_t waiter;
    int have_waiter = 0;
    if (st == TMX_OK) {
        stop.ctx = ctx;
        have_waiter = pthread_create(&waiter, NULL, wait_signal, &stop) == 0;
        tmx_log(TMX_LOG_INFO, "serving %s with api.%s", model_name, p->name);
        st = stop.api->run(ctx, &err);
    }
    if (have_waiter) { /* sigwait is a cancellation point: the thread ends without stopping */
        pthread_cancel(waiter);
        pthread_join(waiter, NULL);
    }
    if (stop.api) stop.api->fini(ctx);
    tmx_serve_free(s);
    tmx_engine_free(e);
    return st == TMX_OK ? 0 : cli_fail("serve", err);
}
