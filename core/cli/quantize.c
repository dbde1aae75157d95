/* quantize.c: `tmx quantize` — a BF16/F32 checkpoint and calibration text in, a build of a codec
 * out (tmx/quantize.h). On a terminal stderr shows a progress bar with an ETA; otherwise (logs,
 * CI) one line per stage and per layer. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "tmx/quantize.h"

static const char usage[] =
    "usage: tmx quantize --model IN_DIR --out OUT_DIR --codec NAME [--bits K] [options]\n\n"
    "Runs calibration text through the model, codes every MoE layer's routed experts with\n"
    "plugin codec.NAME (trellis-e4m3, trellis-fp4, or any codec with an encoder), stores the\n"
    "attention projections as MXFP8 and writes a build that tmx generate loads: model shards,\n"
    "the codec's files, hf_quant_config.json, quantize-report.json, trellismx-manifest.json.\n\n"
    "  -o, --out DIR          the build folder (created; must be empty)\n"
    "      --codec NAME       the codec plugin\n"
    "  -b, --bits K           bits per weight (default 3)\n"
    "      --calib FILE       UTF-8 calibration text (default: a built-in public-domain sample)\n"
    "      --tokens N         calibration tokens at most (default 8192)\n"
    "      --window W         tokens per calibration window, BOS included (default 512)\n"
    CLI_ENGINE_USAGE;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --- progress ------------------------------------------------------------------------------ */

struct bar {
    int tty;
    double t0;          /* start of the run */
    double t_encode;    /* first encode event; 0 before */
    double last_draw;
    double frac;        /* of the encoding done */
};

static void duration(double s, char *buf, size_t size) {
    const long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, size, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60) snprintf(buf, size, "%ldm%02lds", t / 60, t % 60);
    else snprintf(buf, size, "%lds", t);
}

/* One terminal line, redrawn in place: [=====>    ] 45.2%  label  ETA. */
static void draw(struct bar *b, double frac, const char *label, int eta) {
    enum { W = 30 };
    char bar[W + 1], left[32] = "";
    const int fill = (int)(frac * W);
    for (int i = 0; i < W; i++) bar[i] = i < fill ? '=' : i == fill ? '>' : ' ';
    bar[W] = '\0';
    const double spent = now() - b->t_encode;
    if (eta && frac > 0.0) duration(spent * (1.0 - frac) / frac, left, sizeof left);
    fprintf(stderr, "\r[%s] %5.1f%%  %s%s%s\033[K", bar, 100.0 * frac, label,
            left[0] ? "  ETA " : "", left);
    b->last_draw = now();
}

static void on_progress(void *arg, const struct tmx_quantize_progress *p) {
    struct bar *b = arg;
    char label[96];
    switch (p->stage) {
    case TMX_QUANTIZE_CALIBRATE:
        snprintf(label, sizeof label, "calibration: %lld/%lld tokens", (long long)p->done,
                 (long long)p->total);
        if (b->tty) draw(b, (double)p->done / (double)p->total, label, 0);
        else if (p->done == p->total) fprintf(stderr, "tmx quantize: %s\n", label);
        break;
    case TMX_QUANTIZE_ENCODE:
        if (b->t_encode == 0.0) b->t_encode = now();
        b->frac = (double)p->done / (double)p->total;
        snprintf(label, sizeof label, "layer %d (%d/%d)", p->layer, p->moe_index + 1, p->n_moe);
        if (b->tty && now() - b->last_draw > 0.2) draw(b, b->frac, label, 1);
        break;
    case TMX_QUANTIZE_LAYER_DONE:
        if (b->t_encode == 0.0) b->t_encode = now() - p->seconds;
        b->frac = (double)(p->moe_index + 1) / p->n_moe;
        if (b->tty) fputs("\r\033[K", stderr);
        fprintf(stderr, "tmx quantize: layer %d (%d/%d) in %.1f s, mean proxy error %.5f, %d "
                "expert%s coded from supplemental inputs\n", p->layer, p->moe_index + 1,
                p->n_moe, p->seconds, p->proxy_mean, p->n_supplemented,
                p->n_supplemented == 1 ? "" : "s");
        snprintf(label, sizeof label, "%d/%d layers", p->moe_index + 1, p->n_moe);
        if (b->tty && p->moe_index + 1 < p->n_moe) draw(b, b->frac, label, 1);
        break;
    case TMX_QUANTIZE_WRITE:
        if (b->tty) fputs("\r\033[K", stderr);
        fprintf(stderr, "tmx quantize: writing %s\n",
                b->frac > 0.0 ? "the build's files and manifest" : "the non-expert tensors");
        break;
    }
}

/* --- the command --------------------------------------------------------------------------- */

/* The whole file, NUL-terminated; NULL (errno set) on failure. */
static char *read_text(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0;
    *len = 0;
    for (;;) {
        if (*len + 65536 + 1 > cap) {
            char *p = realloc(buf, cap = 2 * cap + 65536 + 1);
            if (!p) break;
            buf = p;
        }
        const size_t n = fread(buf + *len, 1, cap - *len - 1, f);
        *len += n;
        if (n == 0) break;
    }
    const int bad = ferror(f) || !buf;
    fclose(f);
    if (bad) {
        free(buf);
        return NULL;
    }
    buf[*len] = '\0';
    return buf;
}

int cmd_quantize(int argc, char **argv) {
    static const struct option longopts[] = {
        {"out", required_argument, 0, 'o'},    {"codec", required_argument, 0, 'C'},
        {"bits", required_argument, 0, 'b'},   {"calib", required_argument, 0, 'L'},
        {"tokens", required_argument, 0, 'N'}, {"window", required_argument, 0, 'W'},
        {"help", no_argument, 0, 'h'},         CLI_ENGINE_LONGOPTS,
        {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    const char *out = NULL, *codec = NULL, *calib = NULL;
    long long bits = 3, tokens = 0, window = 0;
    int c, r;
    while ((c = getopt_long(argc, argv, "o:b:h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        switch (c) {
        case 'o': out = optarg; break;
        case 'C': codec = optarg; break;
        case 'L': calib = optarg; break;
        case 'b': r = cli_parse_int("quantize", "bits", optarg, 1, INT_MAX, &bits); break;
        case 'N': r = cli_parse_int("quantize", "tokens", optarg, 2, LLONG_MAX, &tokens); break;
        case 'W': r = cli_parse_int("quantize", "window", optarg, 2, INT_MAX, &window); break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
        if (r < 0) return 2;
    }
    if (!eo.model || !out || !codec || optind < argc) {
        fprintf(stderr, "tmx quantize: %s\n%s", optind < argc ? "unexpected argument"
                : "--model, --out and --codec are required", usage);
        return 2;
    }
    size_t calib_len = 0;
    char *text = NULL;
    if (calib && !(text = read_text(calib, &calib_len))) {
        fprintf(stderr, "tmx quantize: %s: %s\n", calib, strerror(errno ? errno : ENOMEM));
        return 1;
    }
    struct bar bar = {.tty = isatty(STDERR_FILENO), .t0 = now()};
    const struct tmx_quantize_params p = {
        .model_dir = eo.model, .out_dir = out, .codec = codec, .bits = (int)bits,
        .calib_text = text, .calib_len = calib_len, .calib_name = calib,
        .max_tokens = tokens, .window = (int)window, .config_path = eo.config,
        .n_overrides = eo.n_overrides, .overrides = eo.overrides, .progress = on_progress,
        .progress_arg = &bar};
    char *err = NULL;
    const enum tmx_status st = tmx_quantize(&p, &err);
    free(text);
    if (bar.tty) fputs("\r\033[K", stderr);
    if (st != TMX_OK) return cli_fail("quantize", err);
    char took[32];
    duration(now() - bar.t0, took, sizeof took);
    printf("%s: %s build at %lld bits in %s (report: %s/quantize-report.json)\n", out, codec,
           bits, took, out);
    return 0;
}
