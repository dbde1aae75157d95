/* main.c: the tmx command line — one binary, one subcommand per job. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"bench", cmd_bench, "the engine's prefill and decode tokens/s at several batch sizes"},
    {"conform", cmd_conform, "check a kernel set against the conformance cases (tmx/conform.h)"},
    {"eval-kld", cmd_eval_kld, "KL divergence and top-1 agreement of a model against its teacher"},
    {"generate", cmd_generate, "continue a prompt and print the text and tokens/s"},
    {"inspect", cmd_inspect, "print a checkpoint's config, tensors and the plugins it needs"},
    {"pack", cmd_pack, "lay out a TrellisMX build per tensor-parallel rank, without re-encoding"},
    {"plan", cmd_plan, "will a model fit these GPUs: weights, runtime and KV cache per rank"},
    {"quantize", cmd_quantize, "code a BF16 checkpoint's routed experts with a codec (TrellisMX)"},
    {"serve", cmd_serve, "serve a model over an OpenAI-compatible HTTP API"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: tmx <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n`tmx <command> --help` describes a command's options.\n");
}

int cli_engine_opt(struct cli_engine_opts *o, int c, const char *arg) {
    switch (c) {
    case 'm': o->model = arg; return 1;
    case 'c': o->config = arg; return 1;
    case 't':
        snprintf(o->threads_set, sizeof o->threads_set, "threads=%s", arg);
        arg = o->threads_set;
        /* fall through */
    case 'S':
        if (o->n_overrides == TMX_CLI_MAX_OVERRIDES) {
            fprintf(stderr, "tmx: at most %d --set options\n", TMX_CLI_MAX_OVERRIDES);
            return -1;
        }
        o->overrides[o->n_overrides++] = arg;
        return 1;
    }
    return 0;
}

struct tmx_engine *cli_engine_open(const struct cli_engine_opts *o, const char *cmd) {
    if (!o->model) {
        fprintf(stderr, "tmx %s: --model DIR is required\n", cmd);
        return NULL;
    }
    struct tmx_engine *e = NULL;
    char *err = NULL;
    if (tmx_engine_open(o->model, o->config, o->n_overrides, o->overrides, &e, &err) != TMX_OK) {
        cli_fail(cmd, err);
        return NULL;
    }
    return e;
}

int cli_fail(const char *cmd, char *msg) {
    fprintf(stderr, "tmx %s: %s\n", cmd, msg ? msg : "out of memory");
    free(msg);
    return 1;
}

int cli_parse_int(const char *cmd, const char *name, const char *arg, long long lo, long long hi,
                  long long *out) {
    char *end;
    errno = 0;
    const long long v = strtoll(arg, &end, 10);
    if (end != arg && !*end && !errno && v >= lo && v <= hi) {
        *out = v;
        return 0;
    }
    if (hi == LLONG_MAX)
        fprintf(stderr, "tmx %s: --%s expects an integer >= %lld, got \"%s\"\n", cmd, name, lo,
                arg);
    else
        fprintf(stderr, "tmx %s: --%s expects an integer in [%lld, %lld], got \"%s\"\n", cmd,
                name, lo, hi, arg);
    return -1;
}

int cli_parse_real(const char *cmd, const char *name, const char *arg, double lo, double hi,
                   double *out) {
    char *end;
    const double v = strtod(arg, &end);
    if (end != arg && !*end && isfinite(v) && v >= lo && v <= hi) {
        *out = v;
        return 0;
    }
    fprintf(stderr, "tmx %s: --%s expects a number in [%g, %g], got \"%s\"\n", cmd, name, lo, hi,
            arg);
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("tmx %s (plugin ABI %d.%d)\n", TMX_VERSION, TMX_ABI_MAJOR, TMX_ABI_MINOR);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "tmx: unknown command \"%s\"\n", argv[1]);
    usage(stderr);
    return 2;
}
