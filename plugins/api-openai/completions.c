/* completions.c: POST /v1/completions — the legacy text endpoint: prompts as text or token ids,
 * one or a batch of them, echo, and logprobs in the legacy shape (tokens, token_logprobs,
 * top_logprobs, text_offset).
 *
 * Text prompts get the model's bos token in front (add_special_tokens, as vLLM); token prompts are
 * taken as they are. echo with logprobs would need the prompt's logprobs, which the scheduler does
 * not compute, so that combination is refused; so is `suffix` (no fill-in-the-middle). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

#define MAX_PROMPTS 64

/* --- prompts ------------------------------------------------------------------------------- */

struct prompts {
    int32_t **ids; /* [n][len[i]] */
    int *len;
    char **text;   /* [n]: for echo */
    int n;
};

static void prompts_free(struct prompts *p) {
    for (int i = 0; i < p->n; i++) {
        free(p->ids[i]);
        if (p->text) free(p->text[i]);
    }
    free(p->ids);
    free(p->len);
    free(p->text);
}

static int is_id_list(const json_t *v) {
    if (!json_is_array(v) || json_array_size(v) == 0) return 0;
    size_t i;
    json_t *x;
    json_array_foreach(v, i, x) if (!json_is_integer(x)) return 0;
    return 1;
}

/* Prompt i from a string: [bos] + its tokens. */
static enum tmx_status prompt_from_text(struct api *a, const json_t *s, int add_bos,
                                        struct prompts *p, int i, struct api_fail *f) {
    const struct tmx_serve_i *si = a->si;
    int32_t *tok = NULL;
    size_t n = 0;
    char *err = NULL;
    if (si->tokenize(si->serve, json_string_value(s), json_string_length(s), 1, &tok, &n,
                     &err) != TMX_OK) {
        api_failf(f, 500, NULL, "tokenizer: %s", err ? err : "failed");
        if (err) si->release(err);
        return TMX_ERR_INVALID;
    }
    const int bos = add_bos && si->bos_id >= 0;
    p->ids[i] = malloc((n + (size_t)bos + 1) * sizeof *p->ids[i]);
    if (p->ids[i]) {
        if (bos) p->ids[i][0] = si->bos_id;
        memcpy(p->ids[i] + bos, tok, n * sizeof *tok);
    }
    si->release(tok);
    p->text[i] = strdup(json_string_value(s));
    if (!p->ids[i] || !p->text[i]) return api_failf(f, 500, NULL, "out of memory");
    p->len[i] = (int)n + bos;
    if (p->len[i] == 0) return api_failf(f, 400, "prompt", "prompt: empty");
    return TMX_OK;
}

/* Prompt i from token ids; its echo text is their bytes, repaired to UTF-8. */
static enum tmx_status prompt_from_ids(struct api *a, const json_t *v, struct prompts *p, int i,
                                       struct api_fail *f) {
    const size_t n = json_array_size(v);
    p->ids[i] = malloc(n * sizeof *p->ids[i]);
    if (!p->ids[i]) return api_failf(f, 500, NULL, "out of memory");
    struct buf text = {0};
    struct utf8_dec d = {0};
    for (size_t k = 0; k < n; k++) {
        const json_int_t id = json_integer_value(json_array_get(v, k));
        if (id < 0 || id >= a->si->n_vocab) {
            buf_free(&text);
            return api_failf(f, 400, "prompt", "prompt: token id %lld is out of range [0, %d)",
                             (long long)id, a->si->n_vocab);
        }
        p->ids[i][k] = (int32_t)id;
        size_t len = 0;
        const char *bytes = a->si->token_bytes(a->si->serve, (int32_t)id, &len);
        if (bytes) utf8_push(&d, bytes, len, &text);
    }
    utf8_flush(&d, &text);
    p->len[i] = (int)n;
    p->text[i] = text.oom ? NULL : strdup(text.p ? text.p : "");
    buf_free(&text);
    return p->text[i] ? TMX_OK : api_failf(f, 500, NULL, "out of memory");
}

/* prompt: a string, a list of token ids, or a list of either (a batch). */
static enum tmx_status read_prompts(struct api *a, const json_t *body, struct prompts *p,
                                    struct api_fail *f) {
    json_t *v = body_get(body, "prompt");
    if (!v) return api_failf(f, 400, "prompt", "prompt: required");
    json_t *asp = body_get(body, "add_special_tokens");
    if (asp && !json_is_boolean(asp))
        return api_failf(f, 400, "add_special_tokens", "add_special_tokens: expected a boolean");
    const int batch = json_is_array(v) && !is_id_list(v);
    const size_t n = batch ? json_array_size(v) : 1;
    if (!json_is_string(v) && !json_is_array(v))
        return api_failf(f, 400, "prompt", "prompt: expected a string, a list of token ids, or "
                         "a list of those");
    if (n == 0 || n > MAX_PROMPTS)
        return api_failf(f, 400, "prompt", "prompt: expected 1 to %d prompts, got %zu",
                         MAX_PROMPTS, n);
    p->ids = calloc(n, sizeof *p->ids);
    p->len = calloc(n, sizeof *p->len);
    p->text = calloc(n, sizeof *p->text);
    if (!p->ids || !p->len || !p->text) return api_failf(f, 500, NULL, "out of memory");
    p->n = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *one = batch ? json_array_get(v, i) : v;
        enum tmx_status st;
        if (json_is_string(one)) st = prompt_from_text(a, one, !asp || json_is_true(asp), p,
                                                       (int)i, f);
        else if (is_id_list(one)) st = prompt_from_ids(a, one, p, (int)i, f);
        else st = api_failf(f, 400, "prompt", "prompt[%zu]: expected a string or a non-empty "
                            "list of token ids", i);
        if (st != TMX_OK) return st;
    }
    return TMX_OK;
}

/* --- responses ----------------------------------------------------------------------------- */

/* -inf (a token the model rules out) is no JSON number: written as -9999, as vLLM does */
static json_t *logprob_json(float lp) { return json_real(isfinite(lp) ? lp : -9999.0); }

static json_t *completion_logprobs(const struct job *j, const struct delta *d, size_t base) {
    const struct api *a = job_api(j);
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(),
           *offsets = json_array();
    for (int i = 0; i < d->n_lps; i++) {
        const struct lp_rec *r = &d->lps[i];
        json_array_append_new(tokens, token_text_json(a, r->token));
        json_array_append_new(lps, logprob_json(r->logprob));
        json_t *top = json_object();
        for (int k = 0; k < r->n_top; k++) {
            json_t *t = token_text_json(a, r->top_ids[k]);
            if (t) json_object_set_new(top, json_string_value(t), logprob_json(r->top_lps[k]));
            json_decref(t);
        }
        json_array_append_new(tops, top);
        json_array_append_new(offsets, json_integer((json_int_t)(base + r->offset)));
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", lps,
                     "top_logprobs", tops, "text_offset", offsets);
}

static json_t *completion_opening(const struct job *j, int index) {
    const char *echo = job_echo(j, index);
    if (!echo || !echo[0]) return NULL;
    return json_pack("{s:i,s:s,s:n,s:n}", "index", index, "text", echo, "logprobs",
                     "finish_reason");
}

static json_t *completion_choice(const struct job *j, int index, const struct delta *d,
                                 int whole) {
    const char *echo = whole ? job_echo(j, index) : NULL;
    const size_t base = job_echo(j, index) ? strlen(job_echo(j, index)) : 0;
    const int want_lp = job_top_logprobs(j) >= 0 && (whole || d->n_lps > 0);
    struct buf text = {0};
    if (echo) buf_adds(&text, echo);
    buf_add(&text, d->text ? d->text : "", d->n);
    json_t *c = json_pack("{s:i,s:s%,s:o,s:s?}", "index", index, "text", text.p ? text.p : "",
                          text.n, "logprobs",
                          want_lp ? completion_logprobs(j, d, base) : json_null(),
                          "finish_reason", d->finish);
    buf_free(&text);
    return c;
}

static const struct job_format completion_format = {
    .object = "text_completion",
    .chunk_object = "text_completion",
    .id_prefix = "cmpl-",
    .prompt_param = "prompt",
    .opening = completion_opening,
    .choice = completion_choice,
};

static enum tmx_status check_unsupported(const json_t *body, const struct gen_params *p,
                                         int *echo, struct api_fail *f) {
    json_t *e = body_get(body, "echo");
    if (e && !json_is_boolean(e)) return api_failf(f, 400, "echo", "echo: expected a boolean");
    *echo = json_is_true(e);
    if (*echo && p->logprobs)
        return api_failf(f, 400, "echo", "echo with logprobs is not supported (the server does "
                         "not compute prompt logprobs)");
    json_t *suffix = body_get(body, "suffix");
    if (suffix && (!json_is_string(suffix) || json_string_length(suffix) > 0))
        return api_failf(f, 400, "suffix", "suffix is not supported");
    json_t *best_of = body_get(body, "best_of");
    if (best_of && (!json_is_number(best_of) || json_number_value(best_of) != p->n))
        return api_failf(f, 400, "best_of", "best_of is not supported (it must equal n)");
    return TMX_OK;
}

void completions_handle(struct conn *c, const char *body, size_t len) {
    struct api *a = conn_api(c);
    struct api_fail f = {0};
    struct gen_params p = {0};
    struct prompts pr = {0};
    json_t *req = NULL;
    int echo = 0;
    enum tmx_status st = body_parse(body, len, &req, &f);
    if (st == TMX_OK) st = params_parse(a, req, ENDPOINT_COMPLETIONS, &p, &f);
    if (st == TMX_OK) st = check_unsupported(req, &p, &echo, &f);
    if (st == TMX_OK) st = read_prompts(a, req, &pr, &f);
    json_decref(req);
    if (st != TMX_OK) {
        prompts_free(&pr);
        params_free(&p);
        http_fail(c, &f);
        return;
    }
    if (!echo) {
        for (int i = 0; i < pr.n; i++) free(pr.text[i]);
        free(pr.text);
        pr.text = NULL;
    }
    struct job *j = job_new(c, &completion_format, &p, pr.ids, pr.len, pr.n, pr.text, 0);
    free(pr.len);
    if (!j) st = api_failf(&f, 500, NULL, "out of memory");
    else st = job_start(j, &f);
    if (st != TMX_OK) http_fail(c, &f);
}
