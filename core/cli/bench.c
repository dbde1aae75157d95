/* bench.c: `tmx bench` — the engine's own throughput, without HTTP or clients: for each
 * batch size B, B sequences prefill prompts of P tokens together, then decode N tokens each in
 * steps of all B at once: greedy (the pick made where the logits are), or with --temperature
 * sampled as tmx serve samples (the set's first candidates where it has them, the whole row
 * read back when a draw needs more; the host's time drawing and reading rows back is given
 * apart). What a server can do at most with B requests running;
 * what its clients cost is not in it (tools/loadtest.py measures that). Under mpirun the
 * processes of ranks 1..N-1 only follow rank 0's steps. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

#define MAX_SIZES 16

static const char usage[] =
    "usage: tmx bench --model DIR [options]\n\n"
    "  -b, --batch LIST       batch sizes, comma-separated (default 1,8,32)\n"
    "  -p, --prompt N         prompt tokens a sequence (default 128)\n"
    "  -n, --n-predict N      tokens each sequence generates (default 128)\n"
    "      --temperature T    decode sampled at T (default 0: greedy); the prompts' last\n"
    "                         tokens still pick greedily\n"
    "      --top-p P          nucleus mass when sampled (default 1 = off)\n"
    "      --json FILE        also write the results as JSON\n" CLI_TP_USAGE CLI_ENGINE_USAGE
    "\nPrompts are random token ids, different in every sequence. Each batch size first runs\n"
    "untimed (its prompts and two decode steps: a CUDA set loads the kernels of each shape on\n"
    "first use and records a graph for the batch size).\n"
    "config key max_running is raised to the largest batch size unless --set gives it.\n";

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "1,8,32" -> sizes; 0 on success, naming the option on error. */
static int parse_sizes(const char *arg, int *sizes, int *n) {
    *n = 0;
    for (const char *p = arg; *p;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || (*end && *end != ',') || *n == MAX_SIZES) {
            fprintf(stderr, "tmx bench: --batch expects up to %d sizes in 1..4096 separated "
                    "by commas, got \"%s\"\n", MAX_SIZES, arg);
            return -1;
        }
        sizes[(*n)++] = (int)v;
        p = *end ? end + 1 : end;
    }
    return *n ? 0 : (fprintf(stderr, "tmx bench: --batch is empty\n"), -1);
}

struct result {
    int batch;
    double prefill_s, decode_s; /* wall time of the prefill steps and of the decode steps */
    int prefill_steps;
    int64_t read_back;          /* sampled decode: rows whose draw read the logits back */
    double draw_s, read_s;      /* sampled decode: host time in the draws and in those reads */
};

/* The sequences of one round and their step arguments. */
struct round {
    struct tmx_model *m;
    int b, n_vocab, n_batch;
    struct tmx_seq **seqs;     /* [b] */
    int32_t *prompts;          /* [b][p] */
    int32_t *next;             /* [b] each sequence's last pick */
    int32_t *picks;            /* [b] a step's picks */
    int *owner;                /* [b] the sequence a prefill row ends, or -1 */
    const int32_t **toks;      /* [b] step arguments */
    int *ns;                   /* [b] */
    struct tmx_seq **step_seq; /* [b] */
    /* sampled decoding (temperature > 0) */
    struct tmx_sampler **samplers; /* [b] */
    float *temps;                  /* [b] */
    float *top_x;                  /* [b][TMX_TOPK_MAX] a top step's candidates */
    int32_t *top_id;               /* [b][TMX_TOPK_MAX] */
    double *top_stat;              /* [b][3] */
    float *logits;                 /* [b][vocab_size] rows read back */
    int *drawn;                    /* [b] a step's rows drawn from whole */
    const struct tmx_threads *threads; /* the draws', as tmx serve's */
    int top;                       /* the step was a top step (tmx_model_can_top) */
    int64_t read_back;
    double draw_s, read_s;         /* time drawing (reads not in it) and reading rows back */
};

/* Token ids for sequence s of round `salt`: an LCG, so that no two sequences share a prefix
 * (the prefix cache would skip their prefill) and a run repeats. */
static void fill_prompt(int32_t *ids, int p, int s, int salt, int n_vocab) {
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(s + 1) + (uint64_t)salt;
    for (int i = 0; i < p; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((x >> 33) % (uint64_t)n_vocab);
    }
}

/* Prefills every sequence with its p prompt tokens, in steps of at most n_batch tokens taken
 * sequence by sequence, as the server packs prompts; next[i] is each one's first pick. */
static enum tmx_status prefill(struct round *r, int p, int *steps, char **err) {
    int seq = 0, done = 0; /* the next prompt token to feed: seqs[seq], position done */
    *steps = 0;
    while (seq < r->b) {
        int nb = 0, budget = r->n_batch;
        for (; seq < r->b && budget > 0; nb++) {
            const int take = p - done < budget ? p - done : budget;
            enum tmx_status st = tmx_seq_reserve(r->seqs[seq], take, err);
            if (st != TMX_OK) return st;
            r->step_seq[nb] = r->seqs[seq];
            r->toks[nb] = r->prompts + (size_t)seq * p + done;
            r->ns[nb] = take;
            r->owner[nb] = done + take == p ? seq : -1;
            budget -= take;
            done += take;
            if (done == p) seq++, done = 0;
        }
        enum tmx_status st = tmx_model_step_greedy(r->m, r->step_seq, r->toks, r->ns, nb,
                                                   r->n_vocab, r->picks, err);
        if (st != TMX_OK) return st;
        for (int i = 0; i < nb; i++)
            if (r->owner[i] >= 0) r->next[r->owner[i]] = r->picks[i];
        ++*steps;
    }
    return TMX_OK;
}

/* Draw item of a step: row r->drawn[item] from its whole row (after a top step, finished from
 * its candidates' draw). */
static void draw_row(void *arg, int64_t item, int thread) {
    struct round *r = arg;
    (void)thread;
    const int i = r->drawn[item];
    const size_t V = (size_t)tmx_model_cfg(r->m)->vocab_size;
    if (!r->top) {
        r->picks[i] = tmx_sampler_sample(r->samplers[i], r->logits + i * V);
        return;
    }
    const size_t at = (size_t)i * TMX_TOPK_MAX;
    const double *stat = r->top_stat + 3 * (size_t)i;
    const struct tmx_sampler_top t = {TMX_TOPK_MAX, r->top_x + at, r->top_id + at, stat[0],
                                      (int)stat[1]};
    r->picks[i] = tmx_sampler_sample_rest(r->samplers[i], &t, r->logits + i * V);
}

/* One sampled decode step of all b sequences: a top step and each sequence's draw from its
 * candidates, the row read back for a draw that needs more (as tmx serve does), or where the
 * model takes no top steps a plain step; the draws from whole rows run on the draw threads, as
 * tmx serve's do. */
static enum tmx_status sample_step(struct round *r, char **err) {
    int n_drawn = 0;
    enum tmx_status st;
    double t0, read0 = r->read_s;
    r->top = tmx_model_can_top(r->m);
    if (!r->top) {
        st = tmx_model_step(r->m, r->step_seq, r->toks, r->ns, r->b, r->logits, err);
        t0 = now();
        for (int i = 0; i < r->b; i++) r->drawn[n_drawn++] = i;
    } else {
        st = tmx_model_step_top(r->m, r->step_seq, r->toks, r->ns, r->b, r->n_vocab, r->temps,
                                NULL, NULL, r->top_x, r->top_id, r->top_stat, err);
        t0 = now();
        for (int i = 0; st == TMX_OK && i < r->b; i++) {
            const size_t at = (size_t)i * TMX_TOPK_MAX;
            const double *stat = r->top_stat + 3 * (size_t)i;
            const struct tmx_sampler_top t = {TMX_TOPK_MAX, r->top_x + at, r->top_id + at,
                                              stat[0], (int)stat[1]};
            r->picks[i] = tmx_sampler_sample_top(r->samplers[i], &t);
            if (r->picks[i] >= 0) continue;
            r->read_back++;
            const double t1 = now();
            const size_t V = (size_t)tmx_model_cfg(r->m)->vocab_size;
            st = tmx_model_read_logits(r->m, i, r->logits + i * V, err);
            r->read_s += now() - t1;
            r->drawn[n_drawn++] = i;
        }
    }
    if (st == TMX_OK && n_drawn > 0) r->threads->run(r->threads->pool, n_drawn, draw_row, r);
    r->draw_s += now() - t0 - (r->read_s - read0);
    return st;
}

/* n decode steps of all b sequences, each feeding its last pick. */
static enum tmx_status decode(struct round *r, int n, char **err) {
    for (int i = 0; i < r->b; i++) {
        r->step_seq[i] = r->seqs[i];
        r->toks[i] = &r->next[i];
        r->ns[i] = 1;
    }
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < r->b; i++) {
            enum tmx_status st = tmx_seq_reserve(r->seqs[i], 1, err);
            if (st != TMX_OK) return st;
        }
        enum tmx_status st = r->samplers ? sample_step(r, err)
                             : tmx_model_step_greedy(r->m, r->step_seq, r->toks, r->ns, r->b,
                                                     r->n_vocab, r->picks, err);
        if (st != TMX_OK) return st;
        memcpy(r->next, r->picks, (size_t)r->b * sizeof *r->next);
    }
    return TMX_OK;
}

/* One batch size: an untimed round (the prompts, two steps), then the timed one. */
static enum tmx_status run_size(struct tmx_engine *e, int b, int p, int n,
                                const struct tmx_sampler_params *sp,
                                const struct tmx_threads *threads, struct result *out,
                                char **err) {
    struct round r = {.m = tmx_engine_model(e), .b = b, .n_vocab = tmx_engine_n_vocab(e),
                      .n_batch = (int)tmx_config_int(tmx_engine_config(e), "batch"),
                      .threads = threads};
    r.seqs = calloc((size_t)b, sizeof *r.seqs);
    r.prompts = malloc((size_t)b * (size_t)p * sizeof *r.prompts);
    r.next = malloc((size_t)b * sizeof *r.next);
    r.picks = malloc((size_t)b * sizeof *r.picks);
    r.owner = malloc((size_t)b * sizeof *r.owner);
    r.toks = malloc((size_t)b * sizeof *r.toks);
    r.ns = malloc((size_t)b * sizeof *r.ns);
    r.step_seq = malloc((size_t)b * sizeof *r.step_seq);
    enum tmx_status st = r.seqs && r.prompts && r.next && r.picks && r.owner && r.toks && r.ns &&
                                 r.step_seq
                             ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int i = 0; st == TMX_OK && i < b; i++)
        st = tmx_seq_new(r.m, tmx_engine_n_ctx(e), &r.seqs[i], err);
    if (st == TMX_OK && sp) {
        const size_t V = (size_t)tmx_model_cfg(r.m)->vocab_size;
        r.samplers = calloc((size_t)b, sizeof *r.samplers);
        r.temps = malloc((size_t)b * sizeof *r.temps);
        r.top_x = malloc((size_t)b * TMX_TOPK_MAX * sizeof *r.top_x);
        r.top_id = malloc((size_t)b * TMX_TOPK_MAX * sizeof *r.top_id);
        r.top_stat = malloc((size_t)b * 3 * sizeof *r.top_stat);
        r.logits = malloc((size_t)b * V * sizeof *r.logits);
        r.drawn = malloc((size_t)b * sizeof *r.drawn);
        if (!r.samplers || !r.temps || !r.top_x || !r.top_id || !r.top_stat || !r.logits ||
            !r.drawn)
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        for (int i = 0; st == TMX_OK && i < b; i++) {
            struct tmx_sampler_params one = *sp;
            one.seed = sp->seed + (uint64_t)i;
            r.temps[i] = sp->temperature;
            st = tmx_sampler_new(&one, r.n_vocab, &r.samplers[i], err);
        }
    }
    /* untimed, with the timed round's shapes: a GPU set loads the kernels a shape needs on
     * first use and records a graph for each batch size */
    int steps = 0;
    if (st == TMX_OK) {
        for (int i = 0; i < b; i++) fill_prompt(r.prompts + (size_t)i * p, p, i, 1, r.n_vocab);
        st = prefill(&r, p, &steps, err);
    }
    if (st == TMX_OK) st = decode(&r, 2, err);
    *out = (struct result){.batch = b};
    if (st == TMX_OK) {
        for (int i = 0; i < b; i++) {
            tmx_seq_reset(r.seqs[i]);
            fill_prompt(r.prompts + (size_t)i * p, p, i, 2, r.n_vocab);
        }
        const double t0 = now();
        st = prefill(&r, p, &out->prefill_steps, err);
        const double t1 = now();
        r.read_back = 0;
        r.draw_s = r.read_s = 0.0;
        if (st == TMX_OK) st = decode(&r, n, err);
        out->prefill_s = t1 - t0;
        out->decode_s = now() - t1;
        out->read_back = r.read_back;
        out->draw_s = r.draw_s;
        out->read_s = r.read_s;
    }
    for (int i = 0; r.seqs && i < b; i++) tmx_seq_free(r.seqs[i]);
    free(r.seqs), free(r.prompts), free(r.next), free(r.picks), free(r.owner), free(r.toks);
    free(r.ns), free(r.step_seq);
    for (int i = 0; r.samplers && i < b; i++) tmx_sampler_free(r.samplers[i]);
    free(r.samplers), free(r.temps), free(r.top_x), free(r.top_id), free(r.top_stat);
    free(r.logits), free(r.drawn);
    return st;
}

static double prefill_tok_s(const struct result *x, int p) { return x->batch * p / x->prefill_s; }

static double decode_tok_s(const struct result *x, int n) {
    return n ? x->batch * n / x->decode_s : 0.0;
}

static double per_step_ms(double s, int n) { return n ? 1e3 * s / n : 0.0; }

static int write_json(const char *path, const char *model, const char *kernels, int tp, int p,
                      int n, double temperature, double top_p, const struct result *res,
                      int n_res) {
    json_t *runs = json_array();
    for (int i = 0; i < n_res; i++) {
        const struct result *x = &res[i];
        json_array_append_new(runs, json_pack("{s:i, s:f, s:i, s:f, s:f, s:f, s:f, s:I, s:f, "
                                              "s:f}", "batch", x->batch, "prefill_s",
                                              x->prefill_s, "prefill_steps", x->prefill_steps,
                                              "prefill_tok_s", prefill_tok_s(x, p), "decode_s",
                                              x->decode_s, "decode_tok_s", decode_tok_s(x, n),
                                              "ms_per_step", per_step_ms(x->decode_s, n),
                                              "rows_read_back", (json_int_t)x->read_back,
                                              "draw_ms_per_step", per_step_ms(x->draw_s, n),
                                              "read_back_ms_per_step", per_step_ms(x->read_s, n)));
    }
    json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:f, s:o}", "model", model,
                            "kernels", kernels, "tp", tp, "prompt", p, "n_predict", n,
                            "temperature", temperature, "top_p", top_p,
                            "runs", runs);
    const int rc = doc && json_dump_file(doc, path, JSON_INDENT(1) | JSON_PRESERVE_ORDER) == 0;
    json_decref(doc);
    if (!rc) fprintf(stderr, "tmx bench: cannot write %s\n", path);
    return rc ? 0 : -1;
}

int cmd_bench(int argc, char **argv) {
    static const struct option longopts[] = {
        {"batch", required_argument, 0, 'b'}, {"prompt", required_argument, 0, 'p'},
        {"n-predict", required_argument, 0, 'n'}, {"json", required_argument, 0, 'J'},
        {"temperature", required_argument, 0, 'T'}, {"top-p", required_argument, 0, 'P'},
        {"help", no_argument, 0, 'h'}, CLI_TP_LONGOPT, CLI_ENGINE_LONGOPTS, {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    char tp_set[32], running_set[48];
    int sizes[MAX_SIZES] = {1, 8, 32}, n_sizes = 3, c, r = 0;
    long long prompt = 128, n_predict = 128;
    const char *json = NULL;
    double temperature = 0, top_p = 1;
    while ((c = getopt_long(argc, argv, "b:p:n:h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        switch (c) {
        case 'b': r = parse_sizes(optarg, sizes, &n_sizes); break;
        case 'p': r = cli_parse_int("bench", "prompt", optarg, 1, 1 << 20, &prompt); break;
        case 'n': r = cli_parse_int("bench", "n-predict", optarg, 0, 1 << 20, &n_predict); break;
        case 'J': json = optarg; break;
        case 'T': r = cli_parse_real("bench", "temperature", optarg, 0, 100, &temperature); break;
        case 'P': r = cli_parse_real("bench", "top-p", optarg, 1e-6, 1, &top_p); break;
        case CLI_TP_OPT: r = cli_tp_opt(&eo, tp_set, sizeof tp_set, optarg); break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
        if (r < 0) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tmx bench: unexpected argument \"%s\"\n%s", argv[optind], usage);
        return 2;
    }
    const int p = (int)prompt, n = (int)n_predict;
    /* Room for the largest batch: max_running first, so that a --set of it still wins. */
    int most = 0;
    for (int i = 0; i < n_sizes; i++) most = sizes[i] > most ? sizes[i] : most;
    snprintf(running_set, sizeof running_set, "max_running=%d", most);
    if (eo.n_overrides == TMX_CLI_MAX_OVERRIDES) {
        fprintf(stderr, "tmx bench: at most %d --set options\n", TMX_CLI_MAX_OVERRIDES - 1);
        return 2;
    }
    memmove(eo.overrides + 1, eo.overrides, (size_t)eo.n_overrides * sizeof *eo.overrides);
    eo.overrides[0] = running_set;
    eo.n_overrides++;

    struct tmx_engine *e = cli_engine_open(&eo, "bench");
    if (!e) return 1;
    if (tmx_engine_rank(e) != 0) return cli_follow(e, "bench");
    const int n_ctx = tmx_engine_n_ctx(e);
    if (p + n + 3 > n_ctx) {
        fprintf(stderr, "tmx bench: --prompt (%d) + --n-predict (%d) exceed the context of %d "
                "tokens (config key \"context\")\n", p, n, n_ctx);
        tmx_engine_free(e);
        return 2;
    }
    const struct tmx_config *cfg = tmx_engine_config(e);
    struct tmx_kv_options kv; /* max_running as the KV cache caps it: by batch, by context */
    tmx_model_kv_options(tmx_engine_model(e), &kv);
    if (most > kv.max_seqs) {
        fprintf(stderr, "tmx bench: --batch %d is above the %d sequences a step takes (config "
                "keys max_running = %lld, batch = %lld, context = %d)\n", most, kv.max_seqs,
                (long long)tmx_config_int(cfg, "max_running"),
                (long long)tmx_config_int(cfg, "batch"), n_ctx);
        tmx_engine_free(e);
        return 2;
    }
    const char *kernels = tmx_config_str(cfg, "kernels");
    const struct tmx_sampler_params sp = {(float)temperature, 0, (float)top_p, 0, 1};
    printf("tmx bench: %s, kernels %s, tp %d, %d prompt tokens and %d generated a sequence, ",
           tmx_engine_model_dir(e), kernels, tmx_engine_tp(e), p, n);
    if (temperature > 0) printf("sampled at %g, top-p %g\n\n", temperature, top_p);
    else printf("greedy\n\n");
    printf("| batch | prefill tok/s | prefill steps | decode tok/s | ms / decode step | rows read "
           "back | ms / step drawing | ms / step reading rows |\n"
           "|---|---|---|---|---|---|---|---|\n");
    struct result res[MAX_SIZES];
    char *err = NULL;
    int rc = 0, done = 0;
    struct tmx_step_threads *draws = NULL;
    if (tmx_step_threads_new(tmx_engine_model(e), (int)tmx_config_int(cfg, "threads"), &draws,
                             &err) != TMX_OK) {
        cli_fail("bench", err);
        tmx_engine_free(e);
        return 1;
    }
    for (; done < n_sizes; done++) {
        if (run_size(e, sizes[done], p, n, temperature > 0 ? &sp : NULL,
                     tmx_step_threads_get(draws), &res[done], &err) != TMX_OK) {
            fprintf(stderr, "tmx bench: batch %d: %s\n", sizes[done], err ? err : "out of memory");
            free(err);
            rc = 1;
            break;
        }
        const struct result *x = &res[done];
        printf("| %d | %.1f | %d | %.1f | %.3f | %lld | %.3f | %.3f |\n", x->batch,
               prefill_tok_s(x, p), x->prefill_steps, decode_tok_s(x, n),
               per_step_ms(x->decode_s, n), (long long)x->read_back, per_step_ms(x->draw_s, n),
               per_step_ms(x->read_s, n));
        fflush(stdout);
    }
    if (json && done &&
        write_json(json, tmx_engine_model_dir(e), kernels, tmx_engine_tp(e), p, n, temperature,
                   top_p, res, done))
        rc = 1;
    tmx_step_threads_free(draws);
    tmx_engine_free(e);
    return rc;
}
