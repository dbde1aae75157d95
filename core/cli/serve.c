/* serve.c: `tmx serve` — load the model, start the scheduler, and hand them to the API front end
 * (plugin api.<config "api">, api.openai by default) until SIGINT or SIGTERM. Under mpirun the
 * processes of ranks 1..N-1 only follow rank 0's steps until rank 0 stops. Without --model it
 * serves the default model, muse-mini's K3 build that tools/make_default_models.sh makes. */
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "tmx/log.h"
#include "tmx/serve.h"

/* The default model and the name it is served under. */
#define DEFAULT_MODEL_DIR "models/muse-mini-k3"
#define DEFAULT_MODEL_NAME "muse-mini-trellismx-k3"

static const char usage[] =
    "usage: tmx serve [--model DIR] [options]\n\n"
    "Serves the model over the API front end named by config key \"api\" (default: openai, an\n"
    "OpenAI-compatible HTTP server; its options are api.openai.host, .port, .api_key, ...).\n"
    "Without --model: the default model, " DEFAULT_MODEL_DIR " (made by\n"
    "tools/make_default_models.sh) in the working directory or the source tree tmx was built\n"
    "in, served as \"" DEFAULT_MODEL_NAME "\".\n\n"
    "      --host HOST        same as --set api.openai.host=HOST\n"
    "      --port PORT        same as --set api.openai.port=PORT\n"
    "      --served-model-name NAME\n"
    "                         the model's name in the API, as vLLM's flag (over config key\n"
    "                         model_name; default: the model folder's name)\n"
    CLI_TP_USAGE CLI_ENGINE_USAGE;

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

/* The default model's folder: in the working directory (the repository root, as README.md runs
 * it), else beside the build tree of this executable (<root>/<build>/bin/tmx). Writes it to
 * path; returns 0, or -1 with a message when neither exists. */
static int default_model(char *path, size_t size) {
    if (access(DEFAULT_MODEL_DIR "/config.json", R_OK) == 0) {
        snprintf(path, size, "%s", DEFAULT_MODEL_DIR);
        return 0;
    }
    char exe[PATH_MAX], probe[PATH_MAX + 64];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = NULL;
    if (n > 0) {
        exe[n] = '\0';
        for (int i = 0; i < 3 && (slash = strrchr(exe, '/')); i++) *slash = '\0';
    }
    /* exe: now the root the build folder is in */
    if (slash && (size_t)snprintf(path, size, "%s/" DEFAULT_MODEL_DIR, exe) < size &&
        (size_t)snprintf(probe, sizeof probe, "%s/config.json", path) < sizeof probe &&
        access(probe, R_OK) == 0)
        return 0;
    fprintf(stderr, "tmx serve: no --model given and the default model " DEFAULT_MODEL_DIR
            " is missing: make it with tools/make_default_models.sh, or pass --model DIR\n");
    return -1;
}

/* The front end's options alone, before the model loads (minutes, for a large one): a bad
 * port or address fails at once. */
static int check_api(const struct cli_engine_opts *eo) {
    struct tmx_config *cfg = NULL;
    struct tmx_plugins *ps = NULL;
    const struct tmx_plugin *p = NULL;
    char *err = NULL;
    enum tmx_status st = tmx_config_load(eo->config, &cfg, &err);
    for (int i = 0; st == TMX_OK && i < eo->n_overrides; i++)
        st = tmx_config_set(cfg, eo->overrides[i], &err);
    if (st == TMX_OK) st = tmx_plugins_new(cfg, &ps, &err);
    if (st == TMX_OK)
        st = tmx_plugins_load(ps, TMX_PLUGIN_API, tmx_config_str(cfg, "api"), &p, &err);
    const struct tmx_api_i *api = p ? p->ops : NULL;
    if (st == TMX_OK && TMX_OPS_HAS(api, check))
        st = api->check(tmx_host_get(), tmx_plugins_opts(ps, p), &err);
    tmx_plugins_free(ps);
    tmx_config_free(cfg);
    return st == TMX_OK ? 0 : cli_fail("serve", err);
}

int cmd_serve(int argc, char **argv) {
    static const struct option longopts[] = {{"host", required_argument, 0, 'H'},
                                              {"port", required_argument, 0, 'P'},
                                              {"served-model-name", required_argument, 0, 'N'},
                                              {"help", no_argument, 0, 'h'},
                                              CLI_TP_LONGOPT,
                                              CLI_ENGINE_LONGOPTS,
                                              {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    char host_set[300], port_set[64], tp_set[32], default_dir[PATH_MAX];
    const char *served_name = NULL;
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
        } else if (c == 'N') {
            served_name = optarg;
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
    if (!eo.model) {
        if (default_model(default_dir, sizeof default_dir) < 0) return 1;
        eo.model = default_dir;
    }
    /* Signals go to one thread; a client that hangs up must not kill the server. */
    struct stopper stop = {0};
    sigemptyset(&stop.signals);
    sigaddset(&stop.signals, SIGINT);
    sigaddset(&stop.signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop.signals, NULL);
    signal(SIGPIPE, SIG_IGN);

    if (check_api(&eo) != 0) return 1;
    struct tmx_engine *e = cli_engine_open(&eo, "serve");
    if (!e) return 1;
    if (tmx_engine_rank(e) != 0) return cli_follow(e, "serve"); /* signals stay blocked */
    const struct tmx_config *cfg = tmx_engine_config(e);
    struct tmx_serve *s = NULL;
    const struct tmx_plugin *p = NULL;
    char *err = NULL, name[256];
    void *ctx = NULL;
    /* --served-model-name, else config model_name, else the default model's name or the
     * folder's */
    const char *model_name = served_name ? served_name : tmx_config_str(cfg, "model_name");
    if (!*model_name && eo.model == default_dir) model_name = DEFAULT_MODEL_NAME;
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
