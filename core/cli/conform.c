/* conform.c: `tmx conform` — runs the conformance cases of tmx/conform.h on one kernel set and
 * prints a line per case; the exit status is 0 only when every case passes. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tmx/conform.h"
#include "tmx/loader.h"

static const char usage[] =
    "usage: tmx conform [options]\n\n"
    "Checks a kernel set against the float64 references of every conformance case (or those\n"
    "whose name contains --filter): one line per case with its normalized max error, the op's\n"
    "tolerance and PASS or FAIL. Exits 1 if any case fails.\n\n"
    "  -k, --kernels NAME     kernel set (default: the config's \"kernels\")\n"
    "  -f, --filter STR       only cases whose name contains STR, e.g. \"matmul/\"\n"
    "  -j, --json FILE        also write the results as JSON\n"
    "  -r, --repeat N         after the check, run each case N more times and report the mean\n"
    "                         wall time of one run (queued N times, one sync)\n"
    "  -c, --config FILE      tmx configuration file (JSON; see docs/config.md)\n"
    "      --set KEY=VALUE    override a configuration key, e.g. --set kernels.cpu.threads=2\n"
    "  -t, --threads N        worker threads (same as --set threads=N)\n";

struct conform_opts {
    const char *kernels, *filter, *json;
    long repeat;
    struct cli_engine_opts eng; /* only --config, --set and --threads */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Mean seconds of one run over `repeat` runs of a case already checked; < 0 when the set
 * reports a failure at the sync. */
static double time_case(const struct tmx_kernels *k, struct tmx_conform_case *c, long repeat) {
    double t0 = now_s();
    for (long i = 0; i < repeat; i++) tmx_conform_case_run(c);
    if (k->ops->sync(k->ctx) != TMX_OK) return -1;
    return (now_s() - t0) / (double)repeat;
}

/* Runs case i; fills *res and *seconds (0 without --repeat). */
static enum tmx_status run_case(const struct tmx_kernels *k, size_t i, long repeat,
                                struct tmx_conform_result *res, double *seconds, char **err) {
    struct tmx_conform_case *c;
    enum tmx_status st = tmx_conform_case_new(i, k->ops, k->ctx, &c, err);
    if (st != TMX_OK) return st;
    tmx_conform_case_run(c);
    st = tmx_conform_case_check(c, res, err);
    *seconds = st == TMX_OK && repeat > 0 && res->status == TMX_OK ? time_case(k, c, repeat) : 0;
    tmx_conform_case_free(c);
    return st;
}

static json_t *case_json(size_t i, const struct tmx_conform_result *r, double seconds) {
    json_t *o = json_pack("{s:s, s:s, s:o, s:f, s:b, s:s}", "name", r->name, "op",
                          tmx_conform_op(i), "err", isfinite(r->err) ? json_real(r->err) : json_null(),
                          "tol", r->tol, "pass", r->pass, "status", tmx_status_str(r->status));
    if (o && seconds > 0) json_object_set_new(o, "us", json_real(seconds * 1e6));
    return o;
}

static int parse_args(int argc, char **argv, struct conform_opts *o) {
    static const struct option longopts[] = {
        {"kernels", required_argument, 0, 'k'}, {"filter", required_argument, 0, 'f'},
        {"json", required_argument, 0, 'j'},    {"repeat", required_argument, 0, 'r'},
        {"config", required_argument, 0, 'c'},  {"set", required_argument, 0, 'S'},
        {"threads", required_argument, 0, 't'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "k:f:j:r:c:t:h", longopts, NULL)) != -1) {
        long long repeat;
        switch (c) {
        case 'k': o->kernels = optarg; break;
        case 'f': o->filter = optarg; break;
        case 'j': o->json = optarg; break;
        case 'r':
            if (cli_parse_int("conform", "repeat", optarg, 0, 1000000, &repeat) < 0) return 2;
            o->repeat = repeat;
            break;
        case 'h': fputs(usage, stdout); return 0;
        default:
            if (cli_engine_opt(&o->eng, c, optarg) == 1) break;
            fputs(usage, stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tmx conform: unexpected argument \"%s\"\n%s", argv[optind], usage);
        return 2;
    }
    return -1;
}

static enum tmx_status open_kernels(const struct conform_opts *o, struct tmx_config **cfg,
                                    struct tmx_plugins **ps, struct tmx_kernels *k, char **err) {
    enum tmx_status st = tmx_config_load(o->eng.config, cfg, err);
    for (int i = 0; st == TMX_OK && i < o->eng.n_overrides; i++)
        st = tmx_config_set(*cfg, o->eng.overrides[i], err);
    if (st == TMX_OK) st = tmx_plugins_new(*cfg, ps, err);
    if (st == TMX_OK) st = tmx_kernels_open(*ps, o->kernels, k, err);
    return st;
}

int cmd_conform(int argc, char **argv) {
    struct conform_opts o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;

    struct tmx_config *cfg = NULL;
    struct tmx_plugins *ps = NULL;
    struct tmx_kernels k = {0};
    char *err = NULL;
    json_t *cases = json_array();
    int n_run = 0, n_failed = 0;
    enum tmx_status st = cases ? open_kernels(&o, &cfg, &ps, &k, &err) : TMX_ERR_NOMEM;
    const char *name = st == TMX_OK ? k.plugin->name : "";
    for (size_t i = 0; st == TMX_OK && i < tmx_conform_count(); i++) {
        if (o.filter && !strstr(tmx_conform_name(i), o.filter)) continue;
        struct tmx_conform_result r;
        double seconds = 0;
        if ((st = run_case(&k, i, o.repeat, &r, &seconds, &err)) != TMX_OK) break;
        n_run++;
        n_failed += !r.pass;
        printf("%-52s err %9.3e  tol %7.1e  %s", r.name, r.err, r.tol, r.pass ? "PASS" : "FAIL");
        if (r.status != TMX_OK) printf(" (%s)", tmx_status_str(r.status));
        if (seconds > 0) printf("  %10.2f us", seconds * 1e6);
        putchar('\n');
        fflush(stdout);
        json_array_append_new(cases, case_json(i, &r, seconds));
    }
    if (st == TMX_OK && n_run == 0)
        st = tmx_err(&err, TMX_ERR_NOT_FOUND, "no case matches \"%s\"", o.filter ? o.filter : "");
    if (st == TMX_OK) {
        printf("kernels.%s: %d of %d cases pass\n", name, n_run - n_failed, n_run);
        json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:O}", "kernels", name, "version",
                                k.plugin->version, "cases_run", n_run, "failed", n_failed,
                                "cases", cases);
        if (o.json && (!doc || json_dump_file(doc, o.json, JSON_INDENT(1)) != 0))
            st = tmx_err(&err, TMX_ERR_IO, "cannot write %s", o.json);
        json_decref(doc);
    }
    json_decref(cases);
    tmx_kernels_close(&k);
    tmx_plugins_free(ps);
    tmx_config_free(cfg);
    if (st != TMX_OK) return cli_fail("conform", err);
    return n_failed ? 1 : 0;
}
