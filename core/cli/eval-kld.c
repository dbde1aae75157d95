/* eval-kld.c: `tmx eval-kld` — how far a model's next-token distributions are from its
 * teacher's (docs/fidelity.md, the seed 001 methodology).
 *
 * Each --text file is tokenized with the teacher's tokenizer and cut into windows of --window
 * tokens (BOS first when the model has one). Every window runs as a fresh sequence through both
 * engines, CHUNK rows at a time; every next-token row is scored in FP64 (tmx/eval.h). Windows
 * whose 13-grams overlap the calibration text by more than 5% leave the headline. Out:
 * a table on stdout and, with --out, summary.json and tokens.jsonl, renamed into place when
 * complete. `--paired A --paired B` runs no model: it reads two such outputs of the same rows
 * and bootstraps A - B and A / B. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "tmx/eval.h"
#include "tmx/fs.h"
#include "tmx/quantize.h"

#define MAX_TEXTS 64

static const char cmd[] = "eval-kld";
#define MAX_SETS 32
#define CHUNK 256         /* rows per forward call: bounds the logits buffers */
#define NGRAM 13          /* the overlap screen: 13-grams ... */
#define MAX_OVERLAP 0.05  /* ... shared with the calibration text, at most 5% */
#define N_BUCKETS 3
static const int bucket_start[N_BUCKETS + 1] = {0, 256, 1024, 1 << 30}; /* row positions */

static const char usage[] =
    "usage: tmx eval-kld --teacher DIR --model DIR --text FILE [--text FILE ...] [options]\n"
    "       tmx eval-kld --paired OUT_A --paired OUT_B [--out DIR] [--seed S] [--resamples N]\n\n"
    "KL(teacher || model) in nats over the full vocabulary, in FP64, at every next-token row of\n"
    "fixed windows, each run as a fresh sequence; top-1 agreement; window-block bootstrap (BCa)\n"
    "and Wilson 95% intervals; by position and by source (docs/fidelity.md).\n\n"
    "      --teacher DIR      the reference model (e.g. the BF16 checkpoint)\n"
    "      --text FILE        UTF-8 text; each file is one source (up to 64)\n"
    "  -w, --window N         tokens per window, BOS included (default 2048; at most the\n"
    "                         models' max_position_embeddings)\n"
    "      --max-windows N    windows per source at most, spread evenly over it (default: all)\n"
    "      --calib FILE|none  the calibration text for the overlap screen (default: the one\n"
    "                         --model's quantize-report.json names; none: no screen)\n"
    "  -o, --out DIR          write DIR/summary.json and DIR/tokens.jsonl (created; not in a\n"
    "                         model's folder)\n"
    "      --seed S           bootstrap seed (default 0)\n"
    "      --resamples N      bootstrap resamples (default 5000)\n"
    "      --model-set K=V    a configuration override for --model only, e.g.\n"
    "                         codec.trellis-e4m3.activations=f32 (weights only)\n"
    "      --teacher-set K=V  a configuration override for --teacher only\n"
    "      --paired OUT       (twice) compare two runs' --out folders on the same rows: their\n"
    "                         KLD, A - B and A / B with bootstrap intervals; with --out DIR,\n"
    "                         DIR/paired.json\n"
    CLI_ENGINE_USAGE "  (--config, --set and --threads apply to both engines)\n";

struct opts {
    struct cli_engine_opts eo; /* eo.model: the model; --set, --threads, --config: both */
    const char *teacher, *out, *calib;
    const char *paired[2]; /* --paired: the --out folders of two runs */
    int n_paired;
    const char *texts[MAX_TEXTS];
    int n_texts;
    const char *teacher_sets[MAX_SETS], *model_sets[MAX_SETS];
    int n_teacher_sets, n_model_sets;
    long long window, max_windows, resamples, seed;
};

/* Row sums of one window in one position bucket. */
struct acc {
    double kld, rows, agree, teacher_nll, model_nll;
};

struct window {
    int source;
    int64_t offset;           /* first text token in the source */
    double overlap;           /* of its 13-grams with the calibration text */
    int headline;
    struct acc b[N_BUCKETS];  /* by position bucket */
};

struct source {
    const char *path;
    int32_t *ids;
    size_t n_ids;
};

struct run {
    const struct opts *o;
    struct tmx_engine *teacher, *model;
    int window, bos, n_vocab;
    struct source src[MAX_TEXTS];
    struct window *win;
    int n_win;
    struct tmx_ngram_set *calib;  /* NULL: no screen */
    json_t *calib_info;           /* what the screen used, for the summary */
    FILE *tokens;                 /* tokens.jsonl's temporary file, or NULL */
    int wrote;                    /* --out holds this run's temporary files */
};

/* --- options ------------------------------------------------------------------------------- */

static int push(const char **list, int *n, int max, const char *name, const char *arg) {
    if (*n == max) {
        fprintf(stderr, "tmx eval-kld: at most %d --%s options\n", max, name);
        return -1;
    }
    list[(*n)++] = arg;
    return 0;
}

/* Returns 0 to go on, or the exit code. */
static int parse_opts(int argc, char **argv, struct opts *o) {
    static const struct option longopts[] = {
        {"teacher", required_argument, 0, 'T'},    {"text", required_argument, 0, 'x'},
        {"window", required_argument, 0, 'w'},     {"max-windows", required_argument, 0, 'N'},
        {"calib", required_argument, 0, 'L'},      {"out", required_argument, 0, 'o'},
        {"seed", required_argument, 0, 'r'},       {"resamples", required_argument, 0, 'B'},
        {"model-set", required_argument, 0, 'M'},  {"teacher-set", required_argument, 0, 'E'},
        {"paired", required_argument, 0, 'p'},     {"help", no_argument, 0, 'h'},
        CLI_ENGINE_LONGOPTS,
        {0, 0, 0, 0}};
    int c, r;
    while ((c = getopt_long(argc, argv, "w:o:h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&o->eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        switch (c) {
        case 'T': o->teacher = optarg; break;
        case 'x': r = push(o->texts, &o->n_texts, MAX_TEXTS, "text", optarg); break;
        case 'w': r = cli_parse_int(cmd, "window", optarg, 2, INT_MAX, &o->window); break;
        case 'N': r = cli_parse_int(cmd, "max-windows", optarg, 1, LLONG_MAX, &o->max_windows);
            break;
        case 'L': o->calib = optarg; break;
        case 'o': o->out = optarg; break;
        case 'r': r = cli_parse_int(cmd, "seed", optarg, 0, LLONG_MAX, &o->seed); break;
        case 'B': r = cli_parse_int(cmd, "resamples", optarg, 1, INT_MAX, &o->resamples); break;
        case 'M': r = push(o->model_sets, &o->n_model_sets, MAX_SETS, "model-set", optarg); break;
        case 'p': r = push(o->paired, &o->n_paired, 2, "paired", optarg); break;
        case 'E':
            r = push(o->teacher_sets, &o->n_teacher_sets, MAX_SETS, "teacher-set", optarg);
            break;
        case 'h': fputs(usage, stdout); return -1;
        default: fputs(usage, stderr); return 2;
        }
        if (r < 0) return 2;
    }
    if (o->n_paired) {
        const char *bad = o->n_paired != 2 ? "takes two run folders (--paired A --paired B)"
                        : o->teacher || o->eo.model || o->n_texts
                            ? "compares two runs' outputs: no --teacher, --model or --text"
                        : optind < argc ? "takes no other argument" : NULL;
        if (bad) fprintf(stderr, "tmx eval-kld: --paired %s\n", bad);
        return bad ? 2 : 0;
    }
    const char *missing = !o->teacher ? "--teacher DIR" : !o->eo.model ? "--model DIR"
                        : !o->n_texts ? "--text FILE" : NULL;
    if (missing || optind < argc) {
        fprintf(stderr, "tmx eval-kld: %s%s\n", missing ? missing : "unexpected argument ",
                missing ? " is required" : argv[optind]);
        return 2;
    }
    return 0;
}

/* --- inputs -------------------------------------------------------------------------------- */

/* A whole file, its errors prefixed with the option that named it. */
static enum tmx_status read_file(const char *what, const char *path, char **out, size_t *len,
                                 char **err) {
    char *msg = NULL;
    enum tmx_status st = tmx_file_read(path, out, len, &msg);
    if (st != TMX_OK) tmx_err(err, st, "%s %s", what, msg ? msg : "out of memory");
    free(msg);
    return st;
}

static enum tmx_status tokenize(const struct run *R, const char *text, size_t len,
                                int32_t **ids, size_t *n, char **err) {
    return tmx_tokenizer_encode(tmx_engine_tokenizer(R->teacher), text, len, 0, ids, n, err);
}

/* The models' shared context: --window capped by both max_position_embeddings. */
static enum tmx_status plan_window(const struct opts *o, int *window, char **err) {
    struct tmx_model_config t, m;
    char *msg = NULL;
    const int bad_teacher = tmx_model_config_load(o->teacher, &t, &msg) != TMX_OK;
    if (bad_teacher || tmx_model_config_load(o->eo.model, &m, &msg) != TMX_OK) {
        const enum tmx_status st = tmx_err(err, TMX_ERR_INVALID, "%s %s: %s",
                                           bad_teacher ? "--teacher" : "--model",
                                           bad_teacher ? o->teacher : o->eo.model,
                                           msg ? msg : "out of memory");
        free(msg);
        return st;
    }
    long long w = o->window ? o->window : 2048;
    if (w > t.max_position_embeddings) w = t.max_position_embeddings;
    if (w > m.max_position_embeddings) w = m.max_position_embeddings;
    if (w < 2)
        return tmx_err(err, TMX_ERR_INVALID, "--window: the models hold %lld positions, "
                       "fewer than 2", w);
    *window = (int)w;
    return TMX_OK;
}

/* One engine with: a context of one window, one sequence, no prefix reuse, then --set and
 * --threads, then the engine's own overrides. */
static enum tmx_status open_engine(const struct run *R, const char *flag, const char *dir,
                                   const char *const *sets, int n_sets, struct tmx_engine **e,
                                   char **err) {
    const struct cli_engine_opts *eo = &R->o->eo;
    char context[32];
    snprintf(context, sizeof context, "context=%d", R->window);
    const char *ov[3 + TMX_CLI_MAX_OVERRIDES + MAX_SETS] = {context, "max_running=1",
                                                            "prefix_cache=false"};
    int n = 3;
    for (int i = 0; i < eo->n_overrides; i++) ov[n++] = eo->overrides[i];
    for (int i = 0; i < n_sets; i++) ov[n++] = sets[i];
    char *msg = NULL;
    if (tmx_engine_open(dir, eo->config, n, ov, e, &msg) != TMX_OK) {
        const enum tmx_status st = tmx_err(err, TMX_ERR_INVALID, "%s %s: %s", flag, dir,
                                           msg ? msg : "out of memory");
        free(msg);
        return st;
    }
    if (tmx_engine_n_ctx(*e) < R->window)
        return tmx_err(err, TMX_ERR_INVALID, "%s %s: context %d is shorter than the window of "
                       "%d tokens", flag, dir, tmx_engine_n_ctx(*e), R->window);
    return TMX_OK;
}

/* The model must read the same ids as the teacher: the tokens of a prefix of the first text
 * (the first half of them: the prefix's cut may change the last ones). */
static enum tmx_status check_tokenizer(const struct run *R, const char *text, size_t len,
                                       const int32_t *ids, size_t n, char **err) {
    int32_t *mids = NULL;
    size_t nm = 0;
    enum tmx_status st = tmx_tokenizer_encode(tmx_engine_tokenizer(R->model), text,
                                              len < 4096 ? len : 4096, 0, &mids, &nm, err);
    if (st == TMX_OK && memcmp(mids, ids, (nm / 2 < n ? nm / 2 : n) * sizeof *ids) != 0)
        st = tmx_err(err, TMX_ERR_INVALID, "--model and --teacher tokenize %s differently",
                     R->src[0].path);
    free(mids);
    return st;
}

static enum tmx_status load_sources(struct run *R, char **err) {
    for (int i = 0; i < R->o->n_texts; i++) {
        struct source *s = &R->src[i];
        char *text = NULL;
        size_t len = 0;
        s->path = R->o->texts[i];
        enum tmx_status st = read_file("--text", s->path, &text, &len, err);
        if (st == TMX_OK) st = tokenize(R, text, len, &s->ids, &s->n_ids, err);
        if (st == TMX_OK && i == 0) st = check_tokenizer(R, text, len, s->ids, s->n_ids, err);
        free(text);
        if (st != TMX_OK) return st;
        if (s->n_ids < (size_t)(R->window - R->bos))
            return tmx_err(err, TMX_ERR_INVALID, "--text %s: %zu tokens, fewer than one window "
                           "of %d", s->path, s->n_ids, R->window - R->bos);
    }
    return TMX_OK;
}

/* Every source's whole windows, or --max-windows of them spread evenly. */
static enum tmx_status plan_windows(struct run *R, char **err) {
    const int64_t per = R->window - R->bos;
    int64_t total = 0;
    for (int i = 0; i < R->o->n_texts; i++) {
        const int64_t avail = (int64_t)R->src[i].n_ids / per;
        total += R->o->max_windows && avail > R->o->max_windows ? R->o->max_windows : avail;
    }
    R->win = calloc((size_t)total, sizeof *R->win);
    if (!R->win) return tmx_err(err, TMX_ERR_NOMEM, "out of memory for %lld windows",
                                (long long)total);
    for (int i = 0; i < R->o->n_texts; i++) {
        const int64_t avail = (int64_t)R->src[i].n_ids / per;
        const int64_t k = R->o->max_windows && avail > R->o->max_windows ? R->o->max_windows
                                                                         : avail;
        for (int64_t j = 0; j < k; j++) {
            struct window *w = &R->win[R->n_win++];
            w->source = i;
            w->offset = j * avail / k * per;
            w->headline = 1;
        }
    }
    return TMX_OK;
}

/* --- the calibration screen ---------------------------------------------------------------- */

/* The text of --calib, or of the calibration quantize-report.json names: "built-in" (tmx's
 * own) or a file. The build used the first `used` tokens of it (0: all). */
static enum tmx_status calib_text(struct run *R, char **text, size_t *len, int64_t *used,
                                  char **err) {
    *used = 0;
    if (R->o->calib) {
        R->calib_info = json_pack("{s:s}", "source", R->o->calib);
        return read_file("--calib", R->o->calib, text, len, err);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/quantize-report.json", R->o->eo.model);
    json_t *rep = json_load_file(path, 0, NULL), *cal = json_object_get(rep, "calibration");
    const char *src = json_string_value(json_object_get(cal, "source"));
    if (!src) { /* no build of tmx quantize: nothing to screen against */
        json_decref(rep);
        return TMX_OK;
    }
    const int64_t tokens = json_integer_value(json_object_get(cal, "tokens"));
    *used = tokens - R->bos * json_integer_value(json_object_get(cal, "windows"));
    R->calib_info = json_pack("{s:s, s:s}", "source", src, "named_by", path);
    enum tmx_status st = TMX_OK;
    if (strcmp(src, "built-in") == 0) {
        *len = strlen(tmx_quantize_builtin_calib);
        if (!(*text = strdup(tmx_quantize_builtin_calib)))
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    } else if (read_file("calibration file", src, text, len, err) != TMX_OK) {
        free(*err);
        *err = NULL;
        st = tmx_err(err, TMX_ERR_INVALID, "%s names calibration file %s, which cannot be "
                     "read: pass --calib FILE (or --calib none)", path, src);
    }
    json_decref(rep);
    return st;
}

static enum tmx_status load_calib(struct run *R, char **err) {
    if (R->o->calib && strcmp(R->o->calib, "none") == 0) return TMX_OK;
    char *text = NULL;
    size_t len = 0, n = 0;
    int64_t used = 0;
    int32_t *ids = NULL;
    enum tmx_status st = calib_text(R, &text, &len, &used, err);
    if (st != TMX_OK || !text) return st;
    st = tokenize(R, text, len, &ids, &n, err);
    if (st == TMX_OK && used > 0 && (size_t)used < n) n = (size_t)used;
    if (st == TMX_OK) st = tmx_ngram_set_new(ids, n, NGRAM, &R->calib, err);
    if (st == TMX_OK) json_object_set_new(R->calib_info, "tokens", json_integer((json_int_t)n));
    free(ids);
    free(text);
    return st;
}

/* --- scoring ------------------------------------------------------------------------------- */

static int bucket_of(int row) {
    int b = 0;
    while (row >= bucket_start[b + 1]) b++;
    return b;
}

static void write_token(FILE *f, int win, int row, int32_t input, int32_t target,
                        const struct tmx_eval_row *r) {
    fprintf(f, "{\"window\":%d,\"row\":%d,\"input\":%d,\"target\":%d,\"kld\":%.17g,"
            "\"teacher_top1\":%d,\"model_top1\":%d,\"teacher_logp\":%.17g,\"model_logp\":%.17g}\n",
            win, row, input, target, r->kld, r->teacher_top1, r->model_top1, r->teacher_logp,
            r->model_logp);
}

/* Forwards ids[c..c+n) into both sequences and scores the rows that have a next token. */
static enum tmx_status score_chunk(struct run *R, struct tmx_seq *ts, struct tmx_seq *ms,
                                   const int32_t *ids, int c, int n, float *tl, float *ml,
                                   struct window *w, char **err) {
    enum tmx_status st = tmx_seq_forward(ts, ids + c, n, tl, 1, err);
    if (st == TMX_OK) st = tmx_seq_forward(ms, ids + c, n, ml, 1, err);
    const int tv = tmx_model_cfg(tmx_engine_model(R->teacher))->vocab_size;
    const int mv = tmx_model_cfg(tmx_engine_model(R->model))->vocab_size;
    for (int i = 0; st == TMX_OK && i < n && c + i + 1 < R->window; i++) {
        const int row = c + i;
        struct tmx_eval_row r;
        tmx_eval_score_row(tl + (size_t)i * tv, ml + (size_t)i * mv, R->n_vocab, ids[row + 1],
                           &r);
        struct acc *a = &w->b[bucket_of(row)];
        a->kld += r.kld;
        a->rows += 1;
        a->agree += r.teacher_top1 == r.model_top1;
        a->teacher_nll -= r.teacher_logp;
        a->model_nll -= r.model_logp;
        if (R->tokens) write_token(R->tokens, (int)(w - R->win), row, ids[row], ids[row + 1], &r);
    }
    return st;
}

/* One window: [BOS] + its text tokens, a fresh sequence in each engine, CHUNK rows a step. */
static enum tmx_status score_window(struct run *R, struct window *w, int32_t *ids, float *tl,
                                    float *ml, char **err) {
    const struct source *s = &R->src[w->source];
    const int per = R->window - R->bos;
    if (R->bos) ids[0] = tmx_model_cfg(tmx_engine_model(R->teacher))->bos_token_id;
    memcpy(ids + R->bos, s->ids + w->offset, (size_t)per * sizeof *ids);
    if (R->calib) w->overlap = tmx_ngram_set_overlap(R->calib, ids + R->bos, (size_t)per);
    w->headline = w->overlap <= MAX_OVERLAP;
    struct tmx_seq *ts = NULL, *ms = NULL;
    enum tmx_status st = tmx_seq_new(tmx_engine_model(R->teacher), R->window, &ts, err);
    if (st == TMX_OK) st = tmx_seq_new(tmx_engine_model(R->model), R->window, &ms, err);
    for (int c = 0; st == TMX_OK && c < R->window; c += CHUNK) {
        const int n = R->window - c < CHUNK ? R->window - c : CHUNK;
        st = score_chunk(R, ts, ms, ids, c, n, tl, ml, w, err);
    }
    tmx_seq_free(ts);
    tmx_seq_free(ms);
    return st;
}

static enum tmx_status score_all(struct run *R, char **err) {
    const size_t tv = (size_t)tmx_model_cfg(tmx_engine_model(R->teacher))->vocab_size;
    const size_t mv = (size_t)tmx_model_cfg(tmx_engine_model(R->model))->vocab_size;
    int32_t *ids = malloc((size_t)R->window * sizeof *ids);   /* [window] */
    float *tl = malloc(CHUNK * tv * sizeof *tl);              /* [CHUNK][teacher vocab_size] */
    float *ml = malloc(CHUNK * mv * sizeof *ml);              /* [CHUNK][model vocab_size] */
    enum tmx_status st = ids && tl && ml ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int i = 0; st == TMX_OK && i < R->n_win; i++) {
        struct window *w = &R->win[i];
        st = score_window(R, w, ids, tl, ml, err);
        double kld = 0, rows = 0;
        for (int b = 0; b < N_BUCKETS; b++) kld += w->b[b].kld, rows += w->b[b].rows;
        if (st == TMX_OK)
            fprintf(stderr, "tmx eval-kld: window %d/%d (%s @ token %lld): KLD %.6f%s\n", i + 1,
                    R->n_win, R->src[w->source].path, (long long)w->offset, kld / rows,
                    w->headline ? "" : " (calibration overlap: left out)");
    }
    free(ids);
    free(tl);
    free(ml);
    return st;
}

/* --- statistics ---------------------------------------------------------------------------- */

/* Which windows and buckets a group takes: headline -1 any, 0 left out, 1 headline; source -1
 * any; bucket -1 all. */
struct group {
    int headline, source, bucket;
};

static json_t *interval_json(const struct tmx_eval_interval *ci) {
    return json_pack("{s:f, s:f, s:f}", "mean", ci->est, "lo", ci->lo, "hi", ci->hi);
}

static struct acc window_acc(const struct window *w, int bucket) {
    struct acc a = {0};
    for (int b = 0; b < N_BUCKETS; b++) {
        if (bucket >= 0 && b != bucket) continue;
        a.kld += w->b[b].kld;
        a.rows += w->b[b].rows;
        a.agree += w->b[b].agree;
        a.teacher_nll += w->b[b].teacher_nll;
        a.model_nll += w->b[b].model_nll;
    }
    return a;
}

/* {windows, rows, kld {mean, lo, hi}, top1 {agree, rate, lo, hi}, nll {teacher {mean, lo, hi},
 * model {mean, lo, hi}}}: each mean with its window-block bootstrap interval. */
static enum tmx_status group_stats(const struct run *R, struct group g, json_t **out,
                                   char **err) {
    const size_t n_win = (size_t)R->n_win + 1;
    double *sum = malloc(3 * n_win * sizeof *sum); /* [3][n_win]: KL, teacher NLL, model NLL */
    double *rows = malloc(n_win * sizeof *rows);   /* [n_win] */
    if (!sum || !rows) {
        free(sum);
        free(rows);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    struct acc t = {0};
    int n = 0;
    for (int i = 0; i < R->n_win; i++) {
        const struct window *w = &R->win[i];
        if ((g.headline >= 0 && w->headline != g.headline) ||
            (g.source >= 0 && w->source != g.source))
            continue;
        const struct acc a = window_acc(w, g.bucket);
        if (a.rows == 0) continue;
        sum[n] = a.kld;
        sum[n_win + (size_t)n] = a.teacher_nll;
        sum[2 * n_win + (size_t)n] = a.model_nll;
        rows[n++] = a.rows;
        t.kld += a.kld, t.rows += a.rows, t.agree += a.agree;
        t.teacher_nll += a.teacher_nll, t.model_nll += a.model_nll;
    }
    struct tmx_eval_interval ci[3] = {{0}};
    enum tmx_status st = TMX_OK;
    *out = json_pack("{s:i, s:I}", "windows", n, "rows", (json_int_t)t.rows);
    for (int k = 0; n > 0 && st == TMX_OK && k < 3; k++)
        st = tmx_eval_bootstrap(sum + (size_t)k * n_win, rows, n, (int)R->o->resamples,
                                (uint64_t)R->o->seed, 0.95, &ci[k], err);
    if (n > 0 && st == TMX_OK) {
        double lo, hi;
        tmx_eval_wilson((int64_t)t.agree, (int64_t)t.rows, 1.959963984540054, &lo, &hi);
        json_object_set_new(*out, "kld", interval_json(&ci[0]));
        json_object_set_new(*out, "top1", json_pack("{s:I, s:f, s:f, s:f}", "agree",
                                                    (json_int_t)t.agree, "rate",
                                                    t.agree / t.rows, "lo", lo, "hi", hi));
        json_object_set_new(*out, "nll", json_pack("{s:o, s:o}", "teacher", interval_json(&ci[1]),
                                                   "model", interval_json(&ci[2])));
    }
    free(sum);
    free(rows);
    return st;
}

/* --- output -------------------------------------------------------------------------------- */

static json_t *strings(const char *const *a, int n) {
    json_t *arr = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(arr, json_string(a[i]));
    return arr;
}

static json_t *windows_json(const struct run *R) {
    json_t *arr = json_array();
    for (int i = 0; i < R->n_win; i++) {
        const struct window *w = &R->win[i];
        const struct acc a = window_acc(w, -1);
        json_array_append_new(arr, json_pack("{s:i, s:i, s:I, s:I, s:f, s:b, s:f, s:f}",
                                             "index", i, "source", w->source, "offset",
                                             (json_int_t)w->offset, "rows", (json_int_t)a.rows,
                                             "overlap", w->overlap, "headline", w->headline,
                                             "kld", a.kld / a.rows, "top1", a.agree / a.rows));
    }
    return arr;
}

/* Adds key: group_stats(g) to obj (or appends it to an array with extra members). */
static enum tmx_status add_group(const struct run *R, json_t *obj, const char *key,
                                 struct group g, json_t *extra, char **err) {
    json_t *s = NULL;
    enum tmx_status st = group_stats(R, g, &s, err);
    if (st == TMX_OK && extra) json_object_update(s, extra);
    json_decref(extra);
    if (st == TMX_OK) {
        if (json_is_array(obj)) json_array_append_new(obj, s);
        else json_object_set_new(obj, key, s);
    } else json_decref(s);
    return st;
}

static enum tmx_status summary(const struct run *R, json_t **out, char **err) {
    const struct opts *o = R->o;
    json_t *srcs = json_array(), *pos = json_array(), *by_src = json_array();
    for (int i = 0; i < o->n_texts; i++)
        json_array_append_new(srcs, json_pack("{s:s, s:I}", "file", R->src[i].path, "tokens",
                                              (json_int_t)R->src[i].n_ids));
    json_t *s = json_pack(
        "{s:s, s:{s:s, s:o}, s:{s:s, s:o}, s:o, s:i, s:b, s:i, s:I, s:i, s:i, s:o, s:o}",
        "tool", "tmx eval-kld " TMX_VERSION, "teacher", "dir", o->teacher, "overrides",
        strings(o->teacher_sets, o->n_teacher_sets), "model", "dir", o->eo.model, "overrides",
        strings(o->model_sets, o->n_model_sets), "overrides_both",
        strings(o->eo.overrides, o->eo.n_overrides), "window", R->window, "bos", R->bos,
        "n_vocab", R->n_vocab, "seed", (json_int_t)o->seed, "resamples", (int)o->resamples,
        "level_percent", 95, "sources", srcs, "calibration",
        R->calib_info ? json_pack("{s:O, s:i, s:f}", "text", R->calib_info, "ngram", NGRAM,
                                  "max_overlap", MAX_OVERLAP) : json_null());
    enum tmx_status st = add_group(R, s, "headline", (struct group){1, -1, -1}, NULL, err);
    if (st == TMX_OK) st = add_group(R, s, "left_out", (struct group){0, -1, -1}, NULL, err);
    if (st == TMX_OK) st = add_group(R, s, "all", (struct group){-1, -1, -1}, NULL, err);
    for (int b = 0; st == TMX_OK && b < N_BUCKETS && bucket_start[b] < R->window - 1; b++) {
        const int end = bucket_start[b + 1] < R->window - 1 ? bucket_start[b + 1] : R->window - 1;
        st = add_group(R, pos, NULL, (struct group){1, -1, b},
                       json_pack("{s:[i, i]}", "positions", bucket_start[b], end), err);
    }
    for (int i = 0; st == TMX_OK && i < o->n_texts; i++)
        st = add_group(R, by_src, NULL, (struct group){1, i, -1},
                       json_pack("{s:s}", "source", R->src[i].path), err);
    json_object_set_new(s, "by_position", pos);
    json_object_set_new(s, "by_source", by_src);
    json_object_set_new(s, "windows", windows_json(R));
    if (st == TMX_OK) *out = s;
    else json_decref(s);
    return st;
}

static void print_row(const char *label, json_t *g) {
    json_t *k = json_object_get(g, "kld"), *t = json_object_get(g, "top1");
    printf("%-28s %7lld %9lld", label, (long long)json_integer_value(json_object_get(g, "windows")),
           (long long)json_integer_value(json_object_get(g, "rows")));
    if (k)
        printf("  %.6f [%.6f, %.6f]  %6.2f%% [%.2f, %.2f]",
               json_real_value(json_object_get(k, "mean")),
               json_real_value(json_object_get(k, "lo")), json_real_value(json_object_get(k, "hi")),
               100 * json_real_value(json_object_get(t, "rate")),
               100 * json_real_value(json_object_get(t, "lo")),
               100 * json_real_value(json_object_get(t, "hi")));
    putchar('\n');
}

/* The summary's rows by position bucket and by source, each printed by `row`; source names cut
 * to `width` characters. */
static void print_groups(json_t *s, void (*row)(const char *label, json_t *g), int width) {
    char label[64];
    size_t i;
    json_t *g;
    json_array_foreach(json_object_get(s, "by_position"), i, g) {
        json_t *p = json_object_get(g, "positions");
        snprintf(label, sizeof label, "  positions %lld-%lld",
                 (long long)json_integer_value(json_array_get(p, 0)),
                 (long long)json_integer_value(json_array_get(p, 1)));
        row(label, g);
    }
    json_array_foreach(json_object_get(s, "by_source"), i, g) {
        const char *path = json_string_value(json_object_get(g, "source"));
        const char *base = path ? strrchr(path, '/') : NULL;
        snprintf(label, sizeof label, "  %.*s", width, base ? base + 1 : path ? path : "?");
        row(label, g);
    }
}

static void print_table(json_t *s) {
    printf("%-28s %7s %9s  %-32s %s\n", "", "windows", "rows", "KLD (nats) [95% BCa]",
           "top-1 [95% Wilson]");
    print_row("headline", json_object_get(s, "headline"));
    print_row("left out (calib overlap)", json_object_get(s, "left_out"));
    print_row("all windows", json_object_get(s, "all"));
    print_groups(s, print_row, 26);
}

/* --- paired: two runs on the same rows ---------------------------------------------------- */

/* Row sums of one window in one position bucket, for run A ([0]) and run B ([1]). */
struct pair_acc {
    double kld[2], agree[2], rows;
};

struct pair_window {
    int source;
    int headline; /* in the headline of both runs */
    int64_t rows; /* as the summaries say: tokens.jsonl must hold as many */
    struct pair_acc b[N_BUCKETS];
};

struct pairing {
    const struct opts *o;
    json_t *sum[2];           /* the runs' summary.json */
    struct pair_window *win;  /* [n_win] */
    int n_win;
};

static enum tmx_status load_run_summary(const char *dir, json_t **out, char **err) {
    char path[4096];
    json_error_t je;
    snprintf(path, sizeof path, "%s/summary.json", dir);
    if (!(*out = json_load_file(path, 0, &je)))
        return tmx_err(err, TMX_ERR_INVALID, "--paired %s: %s", dir, je.text);
    if (!json_is_array(json_object_get(*out, "windows")) ||
        !json_is_array(json_object_get(*out, "sources")))
        return tmx_err(err, TMX_ERR_INVALID, "--paired %s: no \"windows\" or \"sources\": not "
                       "a summary of tmx eval-kld", path);
    return TMX_OK;
}

/* The windows of both summaries: the same source, offset and rows, one by one. */
static enum tmx_status pair_windows(struct pairing *P, char **err) {
    json_t *wa = json_object_get(P->sum[0], "windows"), *wb = json_object_get(P->sum[1], "windows");
    const long long window[2] = {json_integer_value(json_object_get(P->sum[0], "window")),
                                 json_integer_value(json_object_get(P->sum[1], "window"))};
    if (json_array_size(wa) != json_array_size(wb) || window[0] != window[1] ||
        !json_array_size(wa))
        return tmx_err(err, TMX_ERR_INVALID, "--paired %s: %zu windows of %lld tokens, %s: %zu "
                       "of %lld: not the same windows", P->o->paired[0], json_array_size(wa),
                       window[0], P->o->paired[1], json_array_size(wb), window[1]);
    P->n_win = (int)json_array_size(wa);
    if (!(P->win = calloc((size_t)P->n_win, sizeof *P->win)))
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int i = 0; i < P->n_win; i++) {
        json_t *a = json_array_get(wa, (size_t)i), *b = json_array_get(wb, (size_t)i);
        static const char *const same[] = {"source", "offset", "rows"};
        for (int k = 0; k < 3; k++)
            if (json_integer_value(json_object_get(a, same[k])) !=
                json_integer_value(json_object_get(b, same[k])))
                return tmx_err(err, TMX_ERR_INVALID, "--paired: window %d has another %s in %s "
                               "than in %s", i, same[k], P->o->paired[1], P->o->paired[0]);
        P->win[i].source = (int)json_integer_value(json_object_get(a, "source"));
        P->win[i].rows = json_integer_value(json_object_get(a, "rows"));
        P->win[i].headline = json_is_true(json_object_get(a, "headline")) &&
                             json_is_true(json_object_get(b, "headline"));
    }
    return TMX_OK;
}

/* One record of tokens.jsonl: window, row, input, target, kld, teacher_top1, model_top1. */
static int parse_record(const char *line, long long v[6], double *kld) {
    json_t *j = json_loads(line, 0, NULL);
    static const char *const keys[6] = {"window", "row", "input", "target", "teacher_top1",
                                        "model_top1"};
    int ok = json_is_object(j) && json_is_number(json_object_get(j, "kld"));
    for (int k = 0; ok && k < 6; k++) {
        ok = json_is_integer(json_object_get(j, keys[k]));
        v[k] = json_integer_value(json_object_get(j, keys[k]));
    }
    if (ok) *kld = json_number_value(json_object_get(j, "kld"));
    json_decref(j);
    return ok;
}

/* Reads both tokens.jsonl in step: every row must have the same window, position, input and
 * target in both (the runs saw the same text). */
static enum tmx_status pair_rows(struct pairing *P, char **err) {
    FILE *f[2] = {NULL, NULL};
    char *line[2] = {NULL, NULL}, path[2][4096];
    size_t cap[2] = {0, 0};
    enum tmx_status st = TMX_OK;
    for (int k = 0; k < 2 && st == TMX_OK; k++) {
        snprintf(path[k], sizeof path[k], "%s/tokens.jsonl", P->o->paired[k]);
        if (!(f[k] = fopen(path[k], "r")))
            st = tmx_err(err, TMX_ERR_IO, "--paired %s: %s", path[k], strerror(errno));
    }
    for (long long n = 1; st == TMX_OK; n++) {
        const ssize_t got[2] = {getline(&line[0], &cap[0], f[0]),
                                getline(&line[1], &cap[1], f[1])};
        if (got[0] < 0 && got[1] < 0) break;
        long long v[2][6];
        double kld[2];
        for (int k = 0; k < 2 && st == TMX_OK; k++)
            if (got[k] < 0 || !parse_record(line[k], v[k], &kld[k]))
                st = tmx_err(err, TMX_ERR_INVALID, "--paired %s: line %lld: %s", path[k], n,
                             got[k] < 0 ? "missing (the other run has more rows)"
                                        : "not a record of tmx eval-kld");
        if (st != TMX_OK) break;
        if (memcmp(v[0], v[1], 4 * sizeof v[0][0]) != 0 || v[0][0] < 0 || v[0][0] >= P->n_win ||
            v[0][1] < 0) {
            st = tmx_err(err, TMX_ERR_INVALID, "--paired %s: line %lld: another row than in %s "
                         "(window, position or tokens differ)", path[1], n, path[0]);
            break;
        }
        struct pair_acc *a = &P->win[v[0][0]].b[bucket_of((int)v[0][1])];
        for (int k = 0; k < 2; k++) {
            a->kld[k] += kld[k];
            a->agree[k] += v[k][4] == v[k][5];
        }
        a->rows += 1;
    }
    for (int k = 0; k < 2; k++) {
        if (f[k]) fclose(f[k]);
        free(line[k]);
    }
    for (int i = 0; st == TMX_OK && i < P->n_win; i++) {
        double rows = 0;
        for (int b = 0; b < N_BUCKETS; b++) rows += P->win[i].b[b].rows;
        if (rows != (double)P->win[i].rows)
            st = tmx_err(err, TMX_ERR_INVALID, "--paired %s: window %d has %.0f rows, its "
                         "summary.json %lld", path[0], i, rows, (long long)P->win[i].rows);
    }
    return st;
}

/* {windows, rows, a {kld, top1}, b {kld, top1}, difference {mean, lo, hi}, ratio {mean, lo,
 * hi} or null} over the headline windows of `source` (-1: all) in `bucket` (-1: all). The
 * difference A - B is a row-weighted mean of per-window sums; the ratio A / B is one too,
 * with B's KL sums as the weights (null when a window's is 0: B is the teacher). */
static enum tmx_status pair_group(const struct pairing *P, int source, int bucket, json_t **out,
                                  char **err) {
    double *v = malloc(4 * (size_t)P->n_win * sizeof *v); /* [4][n_win]: A-B, rows, A, B */
    if (!v) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    double *diff = v, *rows = v + P->n_win, *ka = v + 2 * P->n_win, *kb = v + 3 * P->n_win;
    struct pair_acc t;
    memset(&t, 0, sizeof t);
    int n = 0, ratio = 1;
    for (int i = 0; i < P->n_win; i++) {
        const struct pair_window *w = &P->win[i];
        if (!w->headline || (source >= 0 && w->source != source)) continue;
        struct pair_acc a;
        memset(&a, 0, sizeof a);
        for (int b = 0; b < N_BUCKETS; b++) {
            if (bucket >= 0 && b != bucket) continue;
            for (int k = 0; k < 2; k++) a.kld[k] += w->b[b].kld[k], a.agree[k] += w->b[b].agree[k];
            a.rows += w->b[b].rows;
        }
        if (a.rows == 0) continue;
        diff[n] = a.kld[0] - a.kld[1];
        rows[n] = a.rows;
        ka[n] = a.kld[0];
        kb[n] = a.kld[1];
        ratio &= a.kld[1] > 0;
        n++;
        for (int k = 0; k < 2; k++) t.kld[k] += a.kld[k], t.agree[k] += a.agree[k];
        t.rows += a.rows;
    }
    *out = json_pack("{s:i, s:I}", "windows", n, "rows", (json_int_t)t.rows);
    enum tmx_status st = TMX_OK;
    struct tmx_eval_interval d, r;
    const int B = (int)P->o->resamples;
    const uint64_t seed = (uint64_t)P->o->seed;
    if (n > 0) st = tmx_eval_bootstrap(diff, rows, n, B, seed, 0.95, &d, err);
    if (n > 0 && st == TMX_OK && ratio) st = tmx_eval_bootstrap(ka, kb, n, B, seed, 0.95, &r, err);
    if (n > 0 && st == TMX_OK) {
        static const char *const side[2] = {"a", "b"};
        for (int k = 0; k < 2; k++)
            json_object_set_new(*out, side[k], json_pack("{s:f, s:f}", "kld", t.kld[k] / t.rows,
                                                         "top1", t.agree[k] / t.rows));
        json_object_set_new(*out, "difference", interval_json(&d));
        json_object_set_new(*out, "ratio", ratio ? interval_json(&r) : json_null());
    }
    free(v);
    return st;
}

static void print_pair_row(const char *label, json_t *g) {
    json_t *d = json_object_get(g, "difference"), *r = json_object_get(g, "ratio");
    printf("%-24s %7lld %9lld", label, (long long)json_integer_value(json_object_get(g, "windows")),
           (long long)json_integer_value(json_object_get(g, "rows")));
    if (d) {
        printf("  %.6f  %.6f  %+.6f [%+.6f, %+.6f]",
               json_real_value(json_object_get(json_object_get(g, "a"), "kld")),
               json_real_value(json_object_get(json_object_get(g, "b"), "kld")),
               json_real_value(json_object_get(d, "mean")), json_real_value(json_object_get(d, "lo")),
               json_real_value(json_object_get(d, "hi")));
        if (json_is_object(r))
            printf("  %.3f [%.3f, %.3f]", json_real_value(json_object_get(r, "mean")),
                   json_real_value(json_object_get(r, "lo")),
                   json_real_value(json_object_get(r, "hi")));
    }
    putchar('\n');
}

static enum tmx_status pair_summary(const struct pairing *P, json_t **out, char **err) {
    json_t *s = json_pack("{s:s, s:s, s:s, s:O, s:O, s:I, s:i, s:i}", "tool",
                          "tmx eval-kld --paired " TMX_VERSION, "a", P->o->paired[0], "b",
                          P->o->paired[1], "a_model", json_object_get(P->sum[0], "model"),
                          "b_model", json_object_get(P->sum[1], "model"), "seed",
                          (json_int_t)P->o->seed, "resamples", (int)P->o->resamples,
                          "level_percent", 95);
    json_t *pos = json_array(), *by_src = json_array(), *g = NULL;
    enum tmx_status st = pair_group(P, -1, -1, &g, err);
    json_object_set_new(s, "headline", g);
    json_object_set_new(s, "by_position", pos);
    json_object_set_new(s, "by_source", by_src);
    const int window = (int)json_integer_value(json_object_get(P->sum[0], "window"));
    for (int b = 0; st == TMX_OK && b < N_BUCKETS && bucket_start[b] < window - 1; b++) {
        st = pair_group(P, -1, b, &g, err);
        const int end = bucket_start[b + 1] < window - 1 ? bucket_start[b + 1] : window - 1;
        json_object_set_new(g, "positions", json_pack("[i, i]", bucket_start[b], end));
        json_array_append_new(pos, g);
    }
    json_t *srcs = json_object_get(P->sum[0], "sources");
    for (size_t i = 0; st == TMX_OK && i < json_array_size(srcs); i++) {
        st = pair_group(P, (int)i, -1, &g, err);
        json_object_set_new(g, "source", json_incref(json_object_get(json_array_get(srcs, i),
                                                                     "file")));
        json_array_append_new(by_src, g);
    }
    if (st == TMX_OK) *out = s;
    else json_decref(s);
    return st;
}

static void print_pair_table(json_t *s) {
    printf("A: %s\nB: %s\n%-24s %7s %9s  %-8s  %-8s  %-35s %s\n",
           json_string_value(json_object_get(s, "a")), json_string_value(json_object_get(s, "b")),
           "", "windows", "rows", "KLD A", "KLD B", "A - B (nats) [95% BCa]", "A / B [95% BCa]");
    print_pair_row("headline (both)", json_object_get(s, "headline"));
    print_groups(s, print_pair_row, 22);
}

/* tmx eval-kld --paired A --paired B: returns the exit code. */
static int cmd_paired(const struct opts *o) {
    struct pairing P = {.o = o};
    json_t *s = NULL;
    char *err = NULL, path[4096];
    enum tmx_status st = load_run_summary(o->paired[0], &P.sum[0], &err);
    if (st == TMX_OK) st = load_run_summary(o->paired[1], &P.sum[1], &err);
    if (st == TMX_OK) st = pair_windows(&P, &err);
    if (st == TMX_OK) st = pair_rows(&P, &err);
    if (st == TMX_OK) st = pair_summary(&P, &s, &err);
    if (st == TMX_OK && o->out) { /* through a temporary file, as the runs' outputs */
        char tmp[4200];
        snprintf(path, sizeof path, "%s/paired.json", o->out);
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        if (mkdir(o->out, 0777) != 0 && errno != EEXIST)
            st = tmx_err(&err, TMX_ERR_IO, "--out %s: %s", o->out, strerror(errno));
        else if (json_dump_file(s, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0 ||
                 rename(tmp, path) != 0)
            st = tmx_err(&err, TMX_ERR_IO, "--out %s: cannot write", path);
        if (st != TMX_OK) unlink(tmp);
    }
    if (st == TMX_OK) print_pair_table(s);
    json_decref(s);
    json_decref(P.sum[0]);
    json_decref(P.sum[1]);
    free(P.win);
    return st == TMX_OK ? 0 : cli_fail(cmd, err);
}

/* --- the command --------------------------------------------------------------------------- */

/* What --out DIR receives, each written as NAME.tmp and renamed into place when the run is
 * complete, summary.json last: an interrupted run leaves the earlier run's files whole. */
static const char *const out_names[2] = {"tokens.jsonl", "summary.json"};

static void out_path(char *buf, size_t size, const char *dir, const char *name, int tmp) {
    snprintf(buf, size, "%s/%s%s", dir, name, tmp ? ".tmp" : "");
}

/* --out may be neither model's folder nor lie inside one, and none of the names it writes may
 * be an input's (paths resolved). */
static enum tmx_status check_out(const struct opts *o, char **err) {
    const char *const flag[2] = {"--teacher", "--model"}, *const dir[2] = {o->teacher,
                                                                           o->eo.model};
    for (int i = 0; i < 2; i++) {
        const int in = tmx_path_within(o->out, dir[i]);
        if (in < 0) return tmx_err(err, TMX_ERR_IO, "--out %s: %s", o->out, strerror(errno));
        if (in)
            return tmx_err(err, TMX_ERR_INVALID, "--out %s: is the %s folder %s or lies "
                           "inside it; write the results elsewhere", o->out, flag[i], dir[i]);
    }
    const int calib = o->calib && strcmp(o->calib, "none") != 0;
    enum tmx_status st = TMX_OK;
    char path[4096];
    for (int i = 0; st == TMX_OK && i < o->n_texts + calib; i++) {
        const char *input = i < o->n_texts ? o->texts[i] : o->calib;
        const char *what = i < o->n_texts ? "--text" : "--calib";
        char *real = tmx_path_resolve(input), *out;
        if (!real) st = tmx_err(err, TMX_ERR_IO, "%s %s: %s", what, input, strerror(errno));
        for (int k = 0; st == TMX_OK && k < 4; k++) {
            out_path(path, sizeof path, o->out, out_names[k / 2], k % 2);
            if (!(out = tmx_path_resolve(path)))
                st = tmx_err(err, TMX_ERR_IO, "--out %s: %s", path, strerror(errno));
            else if (strcmp(out, real) == 0)
                st = tmx_err(err, TMX_ERR_INVALID, "--out %s: writing %s would replace %s %s",
                             o->out, path, what, input);
            free(out);
        }
        free(real);
    }
    return st;
}

static enum tmx_status open_out(struct run *R, char **err) {
    const char *dir = R->o->out;
    if (!dir) return TMX_OK;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return tmx_err(err, TMX_ERR_IO, "--out %s: %s", dir, strerror(errno));
    char path[4096];
    out_path(path, sizeof path, dir, out_names[0], 1);
    if (!(R->tokens = fopen(path, "w")))
        return tmx_err(err, TMX_ERR_IO, "--out %s: %s", path, strerror(errno));
    R->wrote = 1;
    return TMX_OK;
}

static enum tmx_status run(struct run *R, json_t **sum, char **err) {
    enum tmx_status st = R->o->out ? check_out(R->o, err) : TMX_OK;
    if (st == TMX_OK) st = plan_window(R->o, &R->window, err);
    if (st == TMX_OK) st = open_engine(R, "--teacher", R->o->teacher, R->o->teacher_sets,
                                       R->o->n_teacher_sets, &R->teacher, err);
    if (st == TMX_OK) st = open_engine(R, "--model", R->o->eo.model, R->o->model_sets,
                                       R->o->n_model_sets, &R->model, err);
    if (st != TMX_OK) return st;
    R->bos = tmx_model_cfg(tmx_engine_model(R->teacher))->bos_token_id >= 0;
    R->n_vocab = tmx_engine_n_vocab(R->teacher);
    if (tmx_engine_n_vocab(R->model) != R->n_vocab)
        return tmx_err(err, TMX_ERR_INVALID, "--model has %d token ids, --teacher %d: they must "
                       "share a tokenizer", tmx_engine_n_vocab(R->model), R->n_vocab);
    st = load_sources(R, err);
    if (st == TMX_OK) st = load_calib(R, err);
    if (st == TMX_OK) st = plan_windows(R, err);
    if (st == TMX_OK) st = open_out(R, err);
    if (st == TMX_OK) st = score_all(R, err);
    if (R->tokens && fclose(R->tokens) != 0 && st == TMX_OK)
        st = tmx_err(err, TMX_ERR_IO, "--out %s/tokens.jsonl: cannot write", R->o->out);
    R->tokens = NULL;
    if (st == TMX_OK) st = summary(R, sum, err);
    return st;
}

/* summary.json's temporary file, then both files into place. */
static enum tmx_status write_summary(const char *dir, json_t *s, char **err) {
    char tmp[4096], path[4096];
    out_path(tmp, sizeof tmp, dir, out_names[1], 1);
    if (json_dump_file(s, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0)
        return tmx_err(err, TMX_ERR_IO, "--out %s: cannot write", tmp);
    for (int i = 0; i < 2; i++) {
        out_path(tmp, sizeof tmp, dir, out_names[i], 1);
        out_path(path, sizeof path, dir, out_names[i], 0);
        if (rename(tmp, path) != 0)
            return tmx_err(err, TMX_ERR_IO, "--out %s: %s", path, strerror(errno));
    }
    return TMX_OK;
}

int cmd_eval_kld(int argc, char **argv) {
    struct opts o = {.window = 0, .resamples = 5000};
    const int r = parse_opts(argc, argv, &o);
    if (r) return r < 0 ? 0 : r;
    if (o.n_paired) return cmd_paired(&o);
    struct run R = {.o = &o};
    json_t *sum = NULL;
    char *err = NULL;
    enum tmx_status st = run(&R, &sum, &err);
    if (st == TMX_OK && o.out) st = write_summary(o.out, sum, &err);
    for (int i = 0; st != TMX_OK && R.wrote && i < 2; i++) {
        char tmp[4096];
        out_path(tmp, sizeof tmp, o.out, out_names[i], 1);
        unlink(tmp);
    }
    if (st == TMX_OK) print_table(sum);
    json_decref(sum);
    json_decref(R.calib_info);
    tmx_ngram_set_free(R.calib);
    for (int i = 0; i < o.n_texts; i++) free(R.src[i].ids);
    free(R.win);
    tmx_engine_free(R.model);
    tmx_engine_free(R.teacher);
    return st == TMX_OK ? 0 : cli_fail(cmd, err);
}
