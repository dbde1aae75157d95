/* params.c: reading request bodies — JSON parsing, typed members, and the generation parameters
 * that /v1/chat/completions and /v1/completions share.
 *
 * Unknown members are ignored (clients send many); a known member of the wrong type or out of
 * range is a 400 naming it; null reads as absent. Defaults follow the OpenAI API (temperature 1,
 * top_p 1, n 1, max_tokens the context left after the prompt) where the model's
 * generation_config.json does not give its own (tmx_serve_i.defaults, as vLLM). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

#define MAX_N 128    /* choices per prompt */
#define MAX_BIAS 1024 /* logit_bias entries */

enum tmx_status api_failf(struct api_fail *f, int status, const char *param, const char *fmt,
                          ...) {
    f->status = status;
    snprintf(f->param, sizeof f->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->msg, sizeof f->msg, fmt, ap);
    va_end(ap);
    return status == 429 ? TMX_ERR_BUSY : status >= 500 ? TMX_ERR_NOMEM : TMX_ERR_INVALID;
}

static int one_of(char c, const char *set) { return c && strchr(set, c); }

/* The key whose value ends at body[end], for a number out of range: the number, then
 * back over `"key" :`. Empty when the number is not an object member's value. */
static void key_before(const char *body, size_t end, char *key, size_t size) {
    key[0] = 0;
    size_t i = end;
    while (i > 0 && one_of(body[i - 1], "0123456789+-.eE")) i--;
    while (i > 0 && one_of(body[i - 1], " \t\r\n")) i--;
    if (i == 0 || body[--i] != ':') return;
    while (i > 0 && one_of(body[i - 1], " \t\r\n")) i--;
    if (i < 2 || body[--i] != '"') return;
    size_t close = i;
    while (i > 0 && (body[i - 1] != '"' || (i > 1 && body[i - 2] == '\\'))) i--;
    if (i == 0) return;
    snprintf(key, size, "%.*s", (int)(close - i), body + i);
}

enum tmx_status body_parse(const char *body, size_t len, json_t **out, struct api_fail *f) {
    if (len == 0)
        return api_failf(f, 400, NULL, "the request body is empty: expected a JSON object");
    json_error_t e;
    json_t *j = json_loadb(body, len, 0, &e);
    if (!j && json_error_code(&e) == json_error_null_character)
        return api_failf(f, 400, NULL, "invalid JSON at line %d, column %d (byte %d): strings "
                         "may not hold the character U+0000", e.line, e.column, e.position);
    if (!j && json_error_code(&e) == json_error_numeric_overflow) {
        char key[128];
        key_before(body, e.position > 0 && (size_t)e.position <= len ? (size_t)e.position : 0,
                   key, sizeof key);
        return api_failf(f, 400, key[0] ? key : NULL, "%s%sthe number at line %d, column %d "
                         "(byte %d) is out of range (integers must fit in 64 bits, others in a "
                         "double)", key, key[0] ? ": " : "", e.line, e.column, e.position);
    }
    if (!j)
        return api_failf(f, 400, NULL, "invalid JSON at line %d, column %d (byte %d): %s", e.line,
                         e.column, e.position, e.text);
    if (!json_is_object(j)) {
        json_decref(j);
        return api_failf(f, 400, NULL, "the request body must be a JSON object");
    }
    *out = j;
    return TMX_OK;
}

json_t *body_get(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* A number member in [lo, hi]; left unchanged when absent. */
static enum tmx_status get_float(const json_t *obj, const char *key, double lo, double hi,
                                 float *out, struct api_fail *f) {
    json_t *v = body_get(obj, key);
    if (!v) return TMX_OK;
    if (!json_is_number(v))
        return api_failf(f, 400, key, "%s: expected a number, got %s", key, type_name(v));
    const double x = json_number_value(v);
    if (!(x >= lo && x <= hi))
        return api_failf(f, 400, key, "%s: must be in [%g, %g], got %g", key, lo, hi, x);
    *out = (float)x;
    return TMX_OK;
}

/* An integer member in [lo, hi] (a real with an integral value counts); unchanged when absent. */
static enum tmx_status get_int(const json_t *obj, const char *key, long long lo, long long hi,
                               long long *out, struct api_fail *f) {
    json_t *v = body_get(obj, key);
    if (!v) return TMX_OK;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e18) {
        x = (long long)json_real_value(v);
    } else {
        return api_failf(f, 400, key, "%s: expected an integer, got %s", key, type_name(v));
    }
    if (x < lo || x > hi)
        return api_failf(f, 400, key, "%s: must be in [%lld, %lld], got %lld", key, lo, hi, x);
    *out = x;
    return TMX_OK;
}

static enum tmx_status get_bool(const json_t *obj, const char *key, int *out,
                                struct api_fail *f) {
    json_t *v = body_get(obj, key);
    if (!v) return TMX_OK;
    if (!json_is_boolean(v))
        return api_failf(f, 400, key, "%s: expected a boolean, got %s", key, type_name(v));
    *out = json_is_true(v);
    return TMX_OK;
}

/* stop: a string or a list of strings; empty strings stop nothing and are dropped. */
static enum tmx_status get_stop(const json_t *body, struct gen_params *p, struct api_fail *f) {
    json_t *v = body_get(body, "stop");
    if (!v) return TMX_OK;
    const size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (!json_is_string(v) && !json_is_array(v))
        return api_failf(f, 400, "stop", "stop: expected a string or a list of strings, got %s",
                         type_name(v));
    if (n > STOPS_MAX)
        return api_failf(f, 400, "stop", "stop: at most %d strings, got %zu", STOPS_MAX, n);
    p->stop = calloc(n ? n : 1, sizeof *p->stop);
    if (!p->stop) return api_failf(f, 500, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_string(s))
            return api_failf(f, 400, "stop", "stop[%zu]: expected a string, got %s", i,
                             type_name(s));
        if (json_string_length(s) == 0) continue;
        if (!(p->stop[p->n_stop++] = strdup(json_string_value(s))))
            return api_failf(f, 500, NULL, "out of memory");
    }
    return TMX_OK;
}

/* stop_token_ids (a vLLM extension): ids that end a choice like an end-of-sequence token. */
static enum tmx_status get_stop_ids(const struct api *a, const json_t *body,
                                    struct gen_params *p, struct api_fail *f) {
    json_t *v = body_get(body, "stop_token_ids");
    if (!v) return TMX_OK;
    if (!json_is_array(v) || json_array_size(v) > MAX_BIAS)
        return api_failf(f, 400, "stop_token_ids", "stop_token_ids: expected a list of at most "
                         "%d token ids", MAX_BIAS);
    const size_t n = json_array_size(v);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return api_failf(f, 500, NULL, "out of memory");
    p->req.stop_ids = ids;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            json_integer_value(x) >= a->si->n_vocab)
            return api_failf(f, 400, "stop_token_ids", "stop_token_ids[%zu]: expected a token "
                             "id in [0, %d)", i, a->si->n_vocab);
        ids[i] = (int32_t)json_integer_value(x);
    }
    p->req.n_stop_ids = (int)n;
    return TMX_OK;
}

/* logit_bias: {"<token id>": bias in [-100, 100]}. */
static enum tmx_status get_bias(const struct api *a, const json_t *body, struct gen_params *p,
                                struct api_fail *f) {
    json_t *v = body_get(body, "logit_bias");
    if (!v) return TMX_OK;
    if (!json_is_object(v))
        return api_failf(f, 400, "logit_bias", "logit_bias: expected an object mapping token ids "
                         "to biases, got %s", type_name(v));
    const size_t n = json_object_size(v);
    if (n > MAX_BIAS)
        return api_failf(f, 400, "logit_bias", "logit_bias: at most %d entries", MAX_BIAS);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    float *vals = malloc((n ? n : 1) * sizeof *vals);
    p->req.bias_ids = ids;
    p->req.bias_values = vals;
    if (!ids || !vals) return api_failf(f, 500, NULL, "out of memory");
    const char *key;
    json_t *x;
    int i = 0;
    json_object_foreach(v, key, x) {
        char *end;
        const long id = strtol(key, &end, 10);
        if (!key[0] || *end || id < 0 || id >= a->si->n_vocab)
            return api_failf(f, 400, "logit_bias", "logit_bias: key \"%.40s\" is not a token id "
                             "in [0, %d)", key, a->si->n_vocab);
        if (!json_is_number(x) || !(fabs(json_number_value(x)) <= 100))
            return api_failf(f, 400, "logit_bias", "logit_bias[\"%s\"]: expected a number in "
                             "[-100, 100]", key);
        ids[i] = (int32_t)id;
        vals[i++] = (float)json_number_value(x);
    }
    p->req.n_bias = i;
    return TMX_OK;
}

/* response_format: plain text only; JSON modes need constrained sampling. */
static enum tmx_status check_response_format(const json_t *body, struct api_fail *f) {
    json_t *v = body_get(body, "response_format");
    if (!v) return TMX_OK;
    json_t *type = json_is_object(v) ? json_object_get(v, "type") : NULL;
    if (!json_is_string(type))
        return api_failf(f, 400, "response_format", "response_format: expected an object with a "
                         "string \"type\"");
    const char *t = json_string_value(type);
    if (strcmp(t, "text") == 0) return TMX_OK;
    if (strcmp(t, "json_object") == 0 || strcmp(t, "json_schema") == 0)
        return api_failf(f, 400, "response_format", "response_format: type \"%s\" is not "
                         "supported by this server (no constrained sampling yet)", t);
    return api_failf(f, 400, "response_format", "response_format: unknown type \"%.40s\"", t);
}

enum tmx_status params_parse(struct api *a, const json_t *body, enum endpoint ep,
                             struct gen_params *p, struct api_fail *f) {
    const struct tmx_sampling_defaults *d = a->si->defaults;
    *p = (struct gen_params){
        .req = {.sampling = {.temperature = d->temperature, .top_k = d->top_k, .top_p = d->top_p,
                             .min_p = d->min_p},
                .repetition_penalty = d->repetition_penalty, .top_logprobs = -1},
        .n = 1,
        .max_tokens_param = "max_tokens",
        .skip_special = 1,
    };
    json_t *model = body_get(body, "model");
    if (model && !json_is_string(model))
        return api_failf(f, 400, "model", "model: expected a string, got %s", type_name(model));
    long long n = 1, top_k = d->top_k, max_tokens = 0, seed = 0, top_lp = -1, lp_int = -1;
    struct tmx_sampler_params *s = &p->req.sampling;
    enum tmx_status st;
    if ((st = get_float(body, "temperature", 0, 100, &s->temperature, f)) ||
        (st = get_float(body, "top_p", 0, 1, &s->top_p, f)) ||
        (st = get_int(body, "top_k", -1, 1 << 30, &top_k, f)) ||
        (st = get_float(body, "min_p", 0, 1, &s->min_p, f)) ||
        (st = get_float(body, "presence_penalty", -2, 2, &p->req.presence_penalty, f)) ||
        (st = get_float(body, "frequency_penalty", -2, 2, &p->req.frequency_penalty, f)) ||
        (st = get_float(body, "repetition_penalty", 1e-3, 100, &p->req.repetition_penalty, f)) ||
        (st = get_int(body, "n", 1, MAX_N, &n, f)) ||
        (st = get_int(body, "max_tokens", 1, 1 << 30, &max_tokens, f)) ||
        (st = get_int(body, "seed", INT64_MIN, INT64_MAX, &seed, f)) ||
        (st = get_bool(body, "stream", &p->stream, f)) ||
        (st = get_bool(body, "ignore_eos", &p->req.ignore_eos, f)) ||
        (st = get_bool(body, "skip_special_tokens", &p->skip_special, f)) ||
        (st = get_stop(body, p, f)) || (st = get_stop_ids(a, body, p, f)) ||
        (st = get_bias(a, body, p, f)) || (st = check_response_format(body, f)))
        return st;
    if (s->top_p == 0)
        return api_failf(f, 400, "top_p", "top_p: must be in (0, 1], got 0");
    if (ep == ENDPOINT_CHAT) {
        if (body_get(body, "max_completion_tokens")) p->max_tokens_param = "max_completion_tokens";
        if ((st = get_int(body, "max_completion_tokens", 1, 1 << 30, &max_tokens, f)) ||
            (st = get_bool(body, "logprobs", &p->logprobs, f)) ||
            (st = get_int(body, "top_logprobs", 0, TMX_MAX_TOP_LOGPROBS, &top_lp, f)))
            return st;
        if (top_lp >= 0 && !p->logprobs)
            return api_failf(f, 400, "top_logprobs", "top_logprobs: requires \"logprobs\": true");
        if (p->logprobs) p->req.top_logprobs = top_lp >= 0 ? (int)top_lp : 0;
    } else {
        if ((st = get_int(body, "logprobs", 0, TMX_MAX_TOP_LOGPROBS, &lp_int, f))) return st;
        p->logprobs = lp_int >= 0;
        p->req.top_logprobs = (int)lp_int;
    }
    json_t *so = body_get(body, "stream_options");
    if (so && !json_is_object(so))
        return api_failf(f, 400, "stream_options", "stream_options: expected an object, got %s",
                         type_name(so));
    if (so && !p->stream)
        return api_failf(f, 400, "stream_options", "stream_options: only allowed when \"stream\" "
                         "is true");
    if (so && (st = get_bool(so, "include_usage", &p->include_usage, f))) {
        snprintf(f->param, sizeof f->param, "stream_options.include_usage");
        return st;
    }
    p->n = (int)n;
    p->max_tokens = (int)max_tokens;
    p->seeded = body_get(body, "seed") != NULL;
    s->seed = (uint64_t)seed;
    s->top_k = top_k < 0 ? 0 : (int)top_k;
    return TMX_OK;
}

void params_free(struct gen_params *p) {
    for (int i = 0; i < p->n_stop; i++) free(p->stop[i]);
    free(p->stop);
    free((void *)p->req.stop_ids);
    free((void *)p->req.bias_ids);
    free((void *)p->req.bias_values);
    *p = (struct gen_params){0};
}

enum tmx_status params_fit(const struct api *a, const struct gen_params *p, int n_prompt,
                           const char *what, int index, int *max_tokens, struct api_fail *f) {
    const int ctx = a->si->max_model_len;
    char name[64]; /* "prompt", or "prompt[3]" of a batch */
    if (index < 0) snprintf(name, sizeof name, "%s", what);
    else snprintf(name, sizeof name, "%s[%d]", what, index);
    if (n_prompt >= ctx)
        return api_failf(f, 400, what, "This model's maximum context length is %d tokens. "
                         "However, your %s resulted in %d tokens, which leaves no room to "
                         "generate.", ctx, name, n_prompt);
    if (p->max_tokens > ctx - n_prompt)
        return api_failf(f, 400, p->max_tokens_param, "This model's maximum context length is %d "
                         "tokens. However, you requested %d tokens (%d in the %s, %d in the "
                         "completion). Please reduce the length of the %s or completion.", ctx,
                         n_prompt + p->max_tokens, n_prompt, name, p->max_tokens, what);
    const int left = ctx - n_prompt, d = a->si->defaults->max_tokens; /* d: the model's cap */
    *max_tokens = p->max_tokens ? p->max_tokens : d && d < left ? d : left;
    return TMX_OK;
}
