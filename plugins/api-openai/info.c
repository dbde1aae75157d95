/* info.c: the small endpoints — GET /health, GET /v1/models and /v1/models/{id}, POST /tokenize,
 * POST /detokenize (the last two as vLLM has them). */
#include <stdlib.h>
#include <string.h>

#include "api.h"

void health_handle(struct conn *c, const char *body, size_t len) {
    (void)body, (void)len;
    http_respond_json(c, 200, json_pack("{s:s}", "status", "ok"));
}

static json_t *model_json(const struct api *a) {
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", a->model, "object", "model", "created",
                     (json_int_t)a->started, "owned_by", "tmx", "root", a->model,
                     "max_model_len", a->si->max_model_len);
}

void models_handle(struct conn *c, const char *body, size_t len) {
    (void)body, (void)len;
    http_respond_json(c, 200, json_pack("{s:s,s:[o]}", "object", "list", "data",
                                        model_json(conn_api(c))));
}

static int hex_digit(char ch) {
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
         : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
}

void model_handle(struct conn *c, const char *body, size_t len) {
    (void)body, (void)len;
    const struct api *a = conn_api(c);
    size_t n;
    const char *p = conn_path_rest(c, &n);
    struct buf id = {0}; /* p percent-decoded: names may hold '/' (org/model) */
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        int hi, lo;
        if (ch == '%' && i + 2 < n && (hi = hex_digit(p[i + 1])) >= 0 &&
            (lo = hex_digit(p[i + 2])) >= 0) {
            ch = (char)(hi << 4 | lo);
            i += 2;
        }
        buf_add(&id, &ch, 1);
    }
    struct api_fail f = {0};
    if (id.oom) {
        api_failf(&f, 500, NULL, "out of memory");
        http_fail(c, &f);
    } else if (id.n == strlen(a->model) && memcmp(id.p, a->model, id.n) == 0) {
        http_respond_json(c, 200, model_json(a));
    } else {
        api_failf(&f, 404, "model", "The model `%.200s` does not exist", id.p);
        http_fail(c, &f);
    }
    buf_free(&id);
}

/* {"prompt": text, "add_special_tokens"?}: [bos] + the text's tokens. */
static enum tmx_status tokenize_text(struct api *a, const json_t *req, int32_t **ids, int *n,
                                     struct api_fail *f) {
    const struct tmx_serve_i *si = a->si;
    json_t *prompt = body_get(req, "prompt");
    json_t *asp = body_get(req, "add_special_tokens");
    if (!json_is_string(prompt))
        return api_failf(f, 400, "prompt", "prompt: expected a string (or send \"messages\")");
    if (asp && !json_is_boolean(asp))
        return api_failf(f, 400, "add_special_tokens", "add_special_tokens: expected a boolean");
    int32_t *tok = NULL;
    size_t nt = 0;
    char *err = NULL;
    enum tmx_status st = si->tokenize(si->serve, json_string_value(prompt),
                                      json_string_length(prompt), 1, &tok, &nt, &err);
    if (st != TMX_OK) {
        api_failf(f, 500, NULL, "tokenizer: %s", err ? err : "failed");
        if (err) si->release(err);
        return st;
    }
    const int bos = (!asp || json_is_true(asp)) && si->bos_id >= 0;
    *ids = malloc((nt + 1) * sizeof **ids);
    if (*ids) {
        if (bos) (*ids)[0] = si->bos_id;
        memcpy(*ids + bos, tok, nt * sizeof *tok);
        *n = (int)nt + bos;
    }
    si->release(tok);
    return *ids ? TMX_OK : api_failf(f, 500, NULL, "out of memory");
}

/* {"prompt"} or a chat request's {"messages", ...} -> {"tokens", "count", "max_model_len"}. */
void tokenize_handle(struct conn *c, const char *body, size_t len) {
    struct api *a = conn_api(c);
    struct api_fail f = {0};
    json_t *req = NULL;
    int32_t *ids = NULL;
    int n = 0, tool_calls;
    enum tmx_status st = body_parse(body, len, &req, &f);
    if (st == TMX_OK)
        st = body_get(req, "messages") ? chat_prompt(a, req, &ids, &n, &tool_calls, &f)
                                       : tokenize_text(a, req, &ids, &n, &f);
    json_decref(req);
    if (st != TMX_OK) {
        free(ids);
        http_fail(c, &f);
        return;
    }
    json_t *arr = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    http_respond_json(c, 200, json_pack("{s:o,s:i,s:i}", "tokens", arr, "count", n,
                                        "max_model_len", a->si->max_model_len));
}

/* {"tokens": [ids]} -> {"prompt": text}; bytes that are no valid UTF-8 become U+FFFD. */
void detokenize_handle(struct conn *c, const char *body, size_t len) {
    struct api *a = conn_api(c);
    struct api_fail f = {0};
    json_t *req = NULL;
    enum tmx_status st = body_parse(body, len, &req, &f);
    json_t *tokens = st == TMX_OK ? body_get(req, "tokens") : NULL;
    if (st == TMX_OK && !json_is_array(tokens))
        st = api_failf(&f, 400, "tokens", "tokens: expected a list of token ids");
    struct buf text = {0};
    struct utf8_dec d = {0};
    size_t i;
    json_t *x;
    json_array_foreach(st == TMX_OK ? tokens : NULL, i, x) {
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            json_integer_value(x) >= a->si->n_vocab) {
            st = api_failf(&f, 400, "tokens", "tokens[%zu]: expected a token id in [0, %d)", i,
                           a->si->n_vocab);
            break;
        }
        size_t n = 0;
        const char *bytes = a->si->token_bytes(a->si->serve, (int32_t)json_integer_value(x), &n);
        if (bytes) utf8_push(&d, bytes, n, &text);
    }
    utf8_flush(&d, &text);
    json_decref(req);
    if (st == TMX_OK && text.oom) st = api_failf(&f, 500, NULL, "out of memory");
    if (st != TMX_OK) http_fail(c, &f);
    else http_respond_json(c, 200, json_pack("{s:s%}", "prompt", text.p ? text.p : "", text.n));
    buf_free(&text);
}
