/* generate.c: `tmx generate` — tokenize a prompt (as written, or as one chat turn through the
 * model's chat template), prefill it, then sample and print tokens as they come; the last line
 * reports tokens/s. Under mpirun the processes of ranks 1..N-1 only follow rank 0's steps and
 * print nothing. */
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tmx/fs.h"
#include "tmx/template.h"

static const char usage[] =
    "usage: tmx generate --model DIR (--prompt TEXT | --file FILE) [-n N] [options]\n\n"
    "  -p, --prompt TEXT      the text to continue (special tokens like <|start|> are parsed)\n"
    "  -f, --file FILE        the prompt is FILE's text, less one final newline\n"
    "                         (- = standard input)\n"
    "      --chat             the prompt is a user's message: rendered with the model's chat\n"
    "                         template, ready for the assistant's answer (no bos added)\n"
    "      --system TEXT      with --chat, a system message before it\n"
    "  -n, --n-predict N      tokens to generate (default 64); stops early at end of sequence\n"
    "      --temperature T    0 = greedy (default 0)\n"
    "      --top-k K          keep the K most likely tokens (default 0 = off)\n"
    "      --top-p P          nucleus sampling mass (default 1 = off)\n"
    "      --min-p P          drop tokens below P x the top probability (default 0 = off)\n"
    "      --seed S           sampling seed (default: config \"seed\"; -1 = from the clock)\n"
    "      --no-bos           do not prepend the model's bos_token_id\n" CLI_TP_USAGE
    CLI_ENGINE_USAGE;

static const char cmd[] = "generate";

enum { OPT_CHAT = 0x100, OPT_SYSTEM }; /* getopt values of long-only options */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The text a chat template makes of [system,] user, ready for the assistant's turn. */
static enum tmx_status chat_prompt(const struct tmx_engine *e, const char *system,
                                   const char *user, char **text, char **err) {
    struct tmx_template *t = NULL;
    json_t *ctx = NULL, *msgs = json_array();
    enum tmx_status st = tmx_chat_template_load(tmx_engine_model_dir(e), &t, &ctx, err);
    if (st == TMX_OK) {
        if (system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system",
                                                          "content", system));
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", user));
        if (!msgs || json_array_size(msgs) != 1u + !!system ||
            json_object_set(ctx, "messages", msgs) ||
            json_object_set_new(ctx, "add_generation_prompt", json_true()))
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    if (st == TMX_OK) st = tmx_template_render(t, ctx, NULL, text, NULL, err);
    json_decref(msgs);
    json_decref(ctx);
    tmx_template_free(t);
    return st;
}

/* Feeds `next` to seq and picks the token after it where the logits are when the model can:
 * the kernel set's argmax (greedy) or its first candidates for the sampler (topk; the row
 * read back when the draw needs more). Otherwise *pending is -1 and logits holds the row. */
static enum tmx_status decode(struct tmx_model *m, struct tmx_seq *seq, int32_t next,
                              struct tmx_sampler *sampler, float temperature, int n_vocab,
                              float *logits, int32_t *pending, char **err) {
    const int greedy = temperature == 0;
    *pending = -1;
    if (!greedy && !tmx_model_can_top(m)) return tmx_seq_forward(seq, &next, 1, logits, 0, err);
    enum tmx_status st = tmx_seq_reserve(seq, 1, err);
    const int one = 1;
    const int32_t *tokens = &next;
    if (st != TMX_OK) return st;
    if (greedy) return tmx_model_step_greedy(m, &seq, &tokens, &one, 1, n_vocab, pending, err);
    float xs[TMX_TOPK_MAX];
    int32_t ids[TMX_TOPK_MAX];
    double stats[3];
    st = tmx_model_step_top(m, &seq, &tokens, &one, 1, n_vocab, &temperature, NULL, NULL, xs,
                            ids, stats, err);
    if (st != TMX_OK) return st;
    const struct tmx_sampler_top t = {TMX_TOPK_MAX, xs, ids, stats[0], (int)stats[1]};
    if ((*pending = tmx_sampler_sample_top(sampler, &t)) >= 0) return TMX_OK;
    if ((st = tmx_model_read_logits(m, 0, logits, err)) == TMX_OK)
        *pending = tmx_sampler_sample_rest(sampler, &t, logits);
    return st;
}

int cmd_generate(int argc, char **argv) {
    static const struct option longopts[] = {
        {"prompt", required_argument, 0, 'p'}, {"n-predict", required_argument, 0, 'n'},
        {"temperature", required_argument, 0, 'T'}, {"top-k", required_argument, 0, 'K'},
        {"top-p", required_argument, 0, 'P'}, {"min-p", required_argument, 0, 'M'},
        {"seed", required_argument, 0, 's'}, {"no-bos", no_argument, 0, 'B'},
        {"file", required_argument, 0, 'f'}, {"chat", no_argument, 0, OPT_CHAT},
        {"system", required_argument, 0, OPT_SYSTEM},
        {"help", no_argument, 0, 'h'}, CLI_TP_LONGOPT, CLI_ENGINE_LONGOPTS, {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    char tp_set[32];
    const char *prompt = NULL, *file = NULL, *system = NULL;
    double temperature = 0, top_p = 1, min_p = 0;
    long long n_predict = 64, top_k = 0, seed = -2; /* seed -2: the config's */
    int bos = 1, chat = 0, c, r;
    while ((c = getopt_long(argc, argv, "p:f:n:h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        switch (c) {
        case 'p': prompt = optarg; break;
        case 'f': file = optarg; break;
        case OPT_CHAT: chat = 1; break;
        case OPT_SYSTEM: system = optarg; break;
        case 'n': r = cli_parse_int(cmd, "n-predict", optarg, 0, INT_MAX, &n_predict); break;
        case 'T': r = cli_parse_real(cmd, "temperature", optarg, 0, 100, &temperature); break;
        case 'K': r = cli_parse_int(cmd, "top-k", optarg, 0, INT_MAX, &top_k); break;
        case 'P': r = cli_parse_real(cmd, "top-p", optarg, 1e-6, 1, &top_p); break;
        case 'M': r = cli_parse_real(cmd, "min-p", optarg, 0, 1, &min_p); break;
        case 's': r = cli_parse_int(cmd, "seed", optarg, -1, LLONG_MAX, &seed); break;
        case 'B': bos = 0; break;
        case CLI_TP_OPT: r = cli_tp_opt(&eo, tp_set, sizeof tp_set, optarg); break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
        if (r < 0) return 2;
    }
    const char *bad = optind < argc            ? "unexpected argument"
                      : !prompt == !file         ? "give one of --prompt TEXT and --file FILE"
                      : system && !chat          ? "--system needs --chat"
                      : chat && !bos             ? "--no-bos does not go with --chat (the "
                                                   "template writes the bos token)"
                                                 : NULL;
    if (bad) {
        fprintf(stderr, "tmx generate: %s\n%s", bad, usage);
        return 2;
    }
    char *err = NULL, *text = NULL; /* --file's, read before the model loads */
    size_t text_len = 0;
    enum tmx_status st = file ? tmx_file_read(file, &text, &text_len, &err) : TMX_OK;
    if (st == TMX_OK && text && strlen(text) != text_len)
        st = tmx_err(&err, TMX_ERR_INVALID, "%s: holds a NUL byte: the prompt must be text", file);
    if (st != TMX_OK) {
        free(text);
        return cli_fail("generate", err);
    }
    if (text_len && text[text_len - 1] == '\n') text[--text_len] = 0; /* as llama.cpp's -f */
    struct tmx_engine *e = cli_engine_open(&eo, "generate");
    if (!e) {
        free(text);
        return 1;
    }
    if (tmx_engine_rank(e) != 0) {
        free(text);
        return cli_follow(e, "generate");
    }

    const struct tmx_tokenizer *tok = tmx_engine_tokenizer(e);
    const struct tmx_model_config *mc = tmx_model_cfg(tmx_engine_model(e));
    const int n_vocab = tmx_engine_n_vocab(e);
    if (seed == -2) seed = tmx_config_int(tmx_engine_config(e), "seed");
    if (seed < 0) seed = (long long)time(NULL);
    struct tmx_sampler_params sp = {(float)temperature, (int)top_k, (float)top_p, (float)min_p,
                                    (uint64_t)seed};
    struct tmx_sampler *sampler = NULL;
    struct tmx_seq *seq = NULL;
    int32_t *ids = NULL, *prompt_ids = NULL;
    size_t n_ids = 0;
    float *logits = NULL;
    size_t piece_cap = 64; /* grown to fit each token printed: a token's bytes may be any length */
    char *piece = NULL;
    char *chat_text = NULL;
    int rc = 1;

    st = tmx_sampler_new(&sp, n_vocab, &sampler, &err);
    if (st == TMX_OK && chat) st = chat_prompt(e, system, file ? text : prompt, &chat_text, &err);
    const char *in = chat ? chat_text : file ? text : prompt;
    if (st == TMX_OK) st = tmx_tokenizer_encode(tok, in, strlen(in), 1, &prompt_ids, &n_ids, &err);
    if (st == TMX_OK) { /* [bos] + prompt; a chat template writes its own */
        const int with_bos = bos && !chat && mc->bos_token_id >= 0;
        ids = malloc((n_ids + 1) * sizeof *ids);
        logits = malloc((size_t)mc->vocab_size * sizeof *logits);
        piece = malloc(piece_cap);
        if (!ids || !logits || !piece) st = tmx_err(&err, TMX_ERR_NOMEM, "out of memory");
        else {
            if (with_bos) ids[0] = mc->bos_token_id;
            memcpy(ids + with_bos, prompt_ids, n_ids * sizeof *ids);
            n_ids += (size_t)with_bos;
        }
    }
    if (st == TMX_OK && n_ids == 0)
        st = tmx_err(&err, TMX_ERR_INVALID, "the prompt is empty and %s",
                     chat ? "the chat template wrote nothing" : "the model has no bos_token_id");
    const int n_ctx = tmx_engine_n_ctx(e);
    if (st == TMX_OK && n_ids + (size_t)n_predict > (size_t)n_ctx)
        st = tmx_err(&err, TMX_ERR_INVALID,
                     "prompt (%zu tokens) + --n-predict (%d) exceed the context of %d tokens "
                     "(config key \"context\")", n_ids, (int)n_predict, n_ctx);
    if (st == TMX_OK)
        st = tmx_seq_new(tmx_engine_model(e), n_ctx, &seq, &err);

    /* prefill */
    const double t0 = now();
    if (st == TMX_OK) st = tmx_seq_forward(seq, ids, (int)n_ids, logits, 0, &err);
    const double t1 = now();

    /* decode */
    int n_gen = 0;
    struct tmx_detok detok = {0};
    int32_t pending = -1; /* the step's pick where the logits are, or -1: sample from logits */
    while (st == TMX_OK && n_gen < (int)n_predict) {
        const int32_t next = pending >= 0 ? pending : tmx_sampler_sample(sampler, logits);
        n_gen++;
        int eos = 0;
        for (int i = 0; i < mc->n_eos; i++) eos |= next == mc->eos_token_ids[i];
        if (eos) break;
        size_t len;
        if (tmx_tokenizer_token_bytes(tok, next, &len)) {
            if (3 * len + 12 > piece_cap) { /* tmx_detok_push's room for the token */
                char *p = realloc(piece, 3 * len + 12);
                if (!p) {
                    st = tmx_err(&err, TMX_ERR_NOMEM, "out of memory");
                    break;
                }
                piece = p;
                piece_cap = 3 * len + 12;
            }
            int w = tmx_detok_push(tok, &detok, next, piece, piece_cap);
            if (w > 0) fwrite(piece, 1, (size_t)w, stdout);
            fflush(stdout);
        }
        if (n_gen < (int)n_predict)
            st = decode(tmx_engine_model(e), seq, next, sampler, sp.temperature, n_vocab, logits,
                        &pending, &err);
    }
    const double t2 = now();
    int w = piece ? tmx_detok_flush(&detok, piece, piece_cap) : 0;
    if (w > 0) fwrite(piece, 1, (size_t)w, stdout);
    if (st == TMX_OK) {
        /* n_gen tokens came from n_gen - 1 decode steps plus the prefill's logits */
        printf("\n%d tokens, %.2f tokens/s (prompt: %zu tokens, %.2f tokens/s)\n", n_gen,
               n_gen > 1 ? (n_gen - 1) / (t2 - t1) : 0.0, n_ids, (double)n_ids / (t1 - t0));
        rc = 0;
    } else {
        fputc('\n', stdout);
        cli_fail("generate", err);
    }
    tmx_seq_free(seq);
    tmx_sampler_free(sampler);
    free(prompt_ids);
    free(text);
    free(chat_text);
    free(ids);
    free(logits);
    free(piece);
    tmx_engine_free(e);
    return rc;
}
