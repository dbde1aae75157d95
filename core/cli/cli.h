/* cli.h: what the tmx subcommands share: engine options and error reporting. */
#ifndef TMX_CLI_H
#define TMX_CLI_H

#include <getopt.h>
#include <stdio.h>

#include "tmx/tmx.h"

#define TMX_CLI_MAX_OVERRIDES 64

/* --model, --config, --set and --threads: parsed the same way by every subcommand that opens an
 * engine. */
struct cli_engine_opts {
    const char *model;
    const char *config;
    const char *overrides[TMX_CLI_MAX_OVERRIDES];
    int n_overrides;
    char threads_set[32];
};

#define CLI_ENGINE_LONGOPTS                                                                   \
    {"model", required_argument, 0, 'm'}, {"config", required_argument, 0, 'c'},              \
        {"set", required_argument, 0, 'S'}, {"threads", required_argument, 0, 't'}
#define CLI_ENGINE_SHORTOPTS "m:c:S:t:"
#define CLI_ENGINE_USAGE                                                                      \
    "  -m, --model DIR        model directory (config.json, *.safetensors, tokenizer.json)\n" \
    "  -c, --config FILE      tmx configuration file (JSON; see docs/config.md)\n"            \
    "      --set KEY=VALUE    override a configuration key, e.g. --set kernels.cpu.threads=2\n" \
    "  -t, --threads N        worker threads (same as --set threads=N)\n"

/* Handles one engine option; returns 1 if `c` was one, 0 if not, -1 on a bad value. */
int cli_engine_opt(struct cli_engine_opts *o, int c, const char *arg);
/* Opens the engine or prints the error; returns NULL on failure. */
struct tmx_engine *cli_engine_open(const struct cli_engine_opts *o, const char *cmd);
/* Prints "tmx <cmd>: <msg>" to stderr and frees msg. Returns 1 (the exit code). */
int cli_fail(const char *cmd, char *msg);

/* Option --name of `tmx cmd`: a whole base-10 integer in [lo, hi] (cli_parse_int) or a finite
 * number in [lo, hi] (cli_parse_real) into *out; otherwise prints one line naming the option
 * and returns -1. */
int cli_parse_int(const char *cmd, const char *name, const char *arg, long long lo, long long hi,
                  long long *out);
int cli_parse_real(const char *cmd, const char *name, const char *arg, double lo, double hi,
                   double *out);

/* --tp N, for the commands that run a model (tmx generate, tmx serve): same as --set tp=N.
 * cli_tp_opt writes the assignment into buf (which must outlive the options) and adds it. */
#define CLI_TP_OPT 0x7470 /* getopt value of --tp, outside the short options */
#define CLI_TP_LONGOPT {"tp", required_argument, 0, CLI_TP_OPT}
#define CLI_TP_USAGE                                                                          \
    "      --tp N             tensor-parallel ranks (same as --set tp=N; under mpirun: one\n"   \
    "                         per process; docs/tp.md)\n"

static inline int cli_tp_opt(struct cli_engine_opts *o, char *buf, size_t size,
                             const char *arg) {
    snprintf(buf, size, "tp=%s", arg);
    return cli_engine_opt(o, 'S', buf) < 0 ? -1 : 0;
}

/* Under mpirun, ranks 1..N-1 of a command: follow rank 0's steps until it is done, then free
 * the engine; returns the exit code. */
static inline int cli_follow(struct tmx_engine *e, const char *cmd) {
    char *err = NULL;
    const int rc = tmx_engine_follow(e, &err) == TMX_OK ? 0 : cli_fail(cmd, err);
    tmx_engine_free(e);
    return rc;
}

int cmd_bench(int argc, char **argv);
int cmd_conform(int argc, char **argv);
int cmd_eval_kld(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_pack(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_serve(int argc, char **argv);

#endif
