/* chat.c: POST /v1/chat/completions — messages and tools checked and rendered through the model's
 * chat template, and the chat shapes of responses (message, delta, logprobs.content, tool_calls).
 *
 * Content may be a string or a list of parts; text parts are joined with "\n" into one string,
 * which every template understands. Media parts are refused (400 naming the part) until a media
 * plugin can turn them into embeddings. Tool calls are parsed out of the output when the model's
 * tokenizer shows a format this server reads (text.h); tool_choice "required" or a named function
 * would need constrained sampling and is refused rather than ignored. A harmony model's (gpt-oss)
 * output is read into content, reasoning and calls whether or not tools are given, and its
 * reasoning goes out as both `reasoning_content` and `reasoning`: clients read one or the other. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

static const char *const roles[] = {"system", "developer", "user", "assistant", "tool", NULL};

/* content as one string: a string as is, or its text parts joined with "\n". */
static enum tmx_status flatten_content(const json_t *content, int i, json_t **out,
                                       struct api_fail *f) {
    if (json_is_string(content)) {
        *out = json_incref((json_t *)content);
        return TMX_OK;
    }
    if (!json_is_array(content))
        return api_failf(f, 400, "messages", "messages[%d].content: expected a string or a list "
                         "of content parts", i);
    struct buf b = {0};
    size_t k;
    json_t *part;
    json_array_foreach(content, k, part) {
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type)) {
            buf_free(&b);
            return api_failf(f, 400, "messages", "messages[%d].content[%zu]: expected an object "
                             "with a string \"type\"", i, k);
        }
        const char *t = json_string_value(type);
        json_t *text = json_object_get(part, "text");
        if (strcmp(t, "text") != 0) {
            buf_free(&b);
            if (strcmp(t, "image_url") == 0 || strcmp(t, "input_audio") == 0 ||
                strcmp(t, "audio_url") == 0 || strcmp(t, "video_url") == 0 ||
                strcmp(t, "input_image") == 0 || strcmp(t, "file") == 0)
                return api_failf(f, 400, "messages", "messages[%d].content[%zu]: %s content is "
                                 "not supported (this server has no media plugin)", i, k, t);
            return api_failf(f, 400, "messages", "messages[%d].content[%zu]: unknown content "
                             "type \"%.40s\"", i, k, t);
        }
        if (!json_is_string(text)) {
            buf_free(&b);
            return api_failf(f, 400, "messages", "messages[%d].content[%zu].text: expected a "
                             "string", i, k);
        }
        if (k > 0) buf_adds(&b, "\n");
        buf_add(&b, json_string_value(text), json_string_length(text));
    }
    *out = b.oom ? NULL : json_stringn(b.p ? b.p : "", b.n);
    buf_free(&b);
    return *out ? TMX_OK : api_failf(f, 500, NULL, "out of memory");
}

/* An assistant message's tool_calls, with string arguments parsed into objects: the templates
 * of tool-calling models print them as JSON (`| tojson`), as OpenAI clients do not send them. */
static enum tmx_status normalize_tool_calls(json_t *calls, int i, struct api_fail *f) {
    if (!json_is_array(calls))
        return api_failf(f, 400, "messages", "messages[%d].tool_calls: expected a list", i);
    size_t k;
    json_t *call;
    json_array_foreach(calls, k, call) {
        json_t *fn = json_object_get(call, "function");
        if (!json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return api_failf(f, 400, "messages", "messages[%d].tool_calls[%zu]: expected "
                             "{\"function\": {\"name\", \"arguments\"}}", i, k);
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_string(args)) continue;
        json_t *parsed = json_loads(json_string_value(args), 0, NULL);
        if (json_is_object(parsed)) json_object_set(fn, "arguments", parsed);
        json_decref(parsed);
    }
    return TMX_OK;
}

/* A checked copy of message i, its content flattened to a string; an assistant's missing
 * content (a message of tool calls only) becomes "", which templates read without failing. */
static enum tmx_status normalize_message(const json_t *m, int i, json_t **out,
                                         struct api_fail *f) {
    if (!json_is_object(m))
        return api_failf(f, 400, "messages", "messages[%d]: expected an object", i);
    json_t *role = json_object_get(m, "role");
    int known = 0;
    for (int r = 0; json_is_string(role) && roles[r]; r++)
        known |= strcmp(json_string_value(role), roles[r]) == 0;
    if (!known)
        return api_failf(f, 400, "messages", "messages[%d].role: expected one of system, "
                         "developer, user, assistant, tool", i);
    const int assistant = strcmp(json_string_value(role), "assistant") == 0;
    json_t *content = body_get(m, "content");
    json_t *calls = body_get(m, "tool_calls");
    if (!content && !assistant)
        return api_failf(f, 400, "messages", "messages[%d].content: required", i);
    json_t *copy = json_deep_copy(m);
    json_t *flat = NULL;
    enum tmx_status st = copy ? TMX_OK : api_failf(f, 500, NULL, "out of memory");
    if (st == TMX_OK && content) st = flatten_content(content, i, &flat, f);
    else if (st == TMX_OK && !(flat = json_string("")))
        st = api_failf(f, 500, NULL, "out of memory");
    if (st == TMX_OK && flat) json_object_set_new(copy, "content", flat);
    if (st == TMX_OK && calls) st = normalize_tool_calls(json_object_get(copy, "tool_calls"), i, f);
    if (st != TMX_OK) {
        json_decref(copy);
        return st;
    }
    *out = copy;
    return TMX_OK;
}

/* tools and tool_choice: sets *tool_calls (0: none parsed) and whether tools go to the
 * template. */
static enum tmx_status check_tools(const struct api *a, const json_t *body, int *tool_calls,
                                   int *render, struct api_fail *f) {
    json_t *tools = body_get(body, "tools");
    json_t *choice = body_get(body, "tool_choice");
    *tool_calls = 0;
    *render = 0;
    if (tools && !json_is_array(tools))
        return api_failf(f, 400, "tools", "tools: expected a list");
    size_t k;
    json_t *t;
    json_array_foreach(tools, k, t) {
        json_t *fn = json_object_get(t, "function");
        if (!json_is_object(t) || !json_is_string(json_object_get(t, "type")) ||
            strcmp(json_string_value(json_object_get(t, "type")), "function") != 0 ||
            !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return api_failf(f, 400, "tools", "tools[%zu]: expected {\"type\": \"function\", "
                             "\"function\": {\"name\", ...}}", k);
    }
    const char *mode = json_is_string(choice) ? json_string_value(choice) : NULL;
    if (choice && (json_is_object(choice) || (mode && strcmp(mode, "required") == 0)))
        return api_failf(f, 400, "tool_choice", "tool_choice: %s is not supported by this server "
                         "(it needs constrained sampling); use \"auto\" or \"none\"",
                         mode ? "\"required\"" : "a named function");
    if (choice && (!mode || (strcmp(mode, "auto") != 0 && strcmp(mode, "none") != 0)))
        return api_failf(f, 400, "tool_choice", "tool_choice: expected \"none\", \"auto\", "
                         "\"required\" or a function");
    if (!tools || json_array_size(tools) == 0 || (mode && strcmp(mode, "none") == 0))
        return TMX_OK;
    if (a->tools == TOOL_FORMAT_NONE)
        return api_failf(f, 400, "tools", "tools are not supported for this model: its tokenizer "
                         "shows no tool-call format the server can parse (Hermes <tool_call>, "
                         "Llama 3 <|python_tag|> or harmony)");
    int parallel = 1;
    json_t *par = body_get(body, "parallel_tool_calls");
    if (par && !json_is_boolean(par))
        return api_failf(f, 400, "parallel_tool_calls", "parallel_tool_calls: expected a boolean");
    if (par) parallel = json_is_true(par);
    *tool_calls = parallel ? INT_MAX : 1;
    *render = 1;
    return TMX_OK;
}

/* The template's context: chat_template_kwargs, then messages, add_generation_prompt, tools. */
static enum tmx_status chat_context(const struct api *a, const json_t *body, json_t **out,
                                    int *tool_calls, struct api_fail *f) {
    json_t *msgs = body_get(body, "messages");
    if (!msgs) return api_failf(f, 400, "messages", "messages: required");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return api_failf(f, 400, "messages", "messages: expected a non-empty list");
    json_t *kwargs = body_get(body, "chat_template_kwargs");
    if (kwargs && !json_is_object(kwargs))
        return api_failf(f, 400, "chat_template_kwargs", "chat_template_kwargs: expected an "
                         "object");
    json_t *effort = body_get(body, "reasoning_effort");
    if (effort && !json_is_string(effort))
        return api_failf(f, 400, "reasoning_effort", "reasoning_effort: expected a string");
    json_t *agp = body_get(body, "add_generation_prompt");
    if (agp && !json_is_boolean(agp))
        return api_failf(f, 400, "add_generation_prompt", "add_generation_prompt: expected a "
                         "boolean");
    int render_tools;
    enum tmx_status st = check_tools(a, body, tool_calls, &render_tools, f);
    if (st != TMX_OK) return st;
    json_t *ctx = json_object(), *list = json_array();
    if (!ctx || !list) st = api_failf(f, 500, NULL, "out of memory");
    if (st == TMX_OK && kwargs) json_object_update(ctx, kwargs);
    for (size_t i = 0; st == TMX_OK && i < json_array_size(msgs); i++) {
        json_t *m = NULL;
        st = normalize_message(json_array_get(msgs, i), (int)i, &m, f);
        if (st == TMX_OK) json_array_append_new(list, m);
    }
    if (st != TMX_OK) {
        json_decref(ctx);
        json_decref(list);
        return st;
    }
    json_object_set_new(ctx, "messages", list);
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(!agp || json_is_true(agp)));
    if (render_tools) json_object_set(ctx, "tools", body_get(body, "tools"));
    if (effort) json_object_set(ctx, "reasoning_effort", effort);
    *out = ctx;
    return TMX_OK;
}

enum tmx_status chat_prompt(struct api *a, const json_t *body, int32_t **ids, int *n_ids,
                            int *tool_calls, struct api_fail *f) {
    const struct tmx_serve_i *si = a->si;
    json_t *ctx = NULL;
    enum tmx_status st = chat_context(a, body, &ctx, tool_calls, f);
    if (st != TMX_OK) return st;
    char *text = NULL, *err = NULL;
    size_t len = 0;
    st = si->chat_render ? si->chat_render(si->serve, ctx, &text, &len, &err)
                         : TMX_ERR_NOT_FOUND;
    json_decref(ctx);
    if (st == TMX_ERR_NOT_FOUND)
        api_failf(f, 400, "messages", "this model has no chat template (tokenizer_config.json "
                  "chat_template or chat_template.jinja); use /v1/completions");
    else if (st != TMX_OK)
        api_failf(f, 400, "messages", "chat template: %s", err ? err : "rendering failed");
    if (err) si->release(err);
    if (st != TMX_OK) return st;
    int32_t *tok = NULL;
    size_t n = 0;
    st = si->tokenize(si->serve, text, len, 1, &tok, &n, &err);
    si->release(text);
    if (st != TMX_OK) {
        api_failf(f, 500, NULL, "tokenizer: %s", err ? err : "failed");
        if (err) si->release(err);
        return st;
    }
    *ids = malloc((n ? n : 1) * sizeof **ids);
    if (*ids) memcpy(*ids, tok, n * sizeof *tok);
    si->release(tok);
    if (!*ids) return api_failf(f, 500, NULL, "out of memory");
    if (n == 0) {
        free(*ids);
        *ids = NULL;
        return api_failf(f, 400, "messages", "messages: the rendered prompt is empty");
    }
    *n_ids = (int)n;
    return TMX_OK;
}

/* --- responses ----------------------------------------------------------------------------- */

static json_t *token_entry(const struct api *a, int32_t id, float logprob) {
    return json_pack("{s:o,s:f,s:o}", "token", token_text_json(a, id), "logprob",
                     isfinite(logprob) ? (double)logprob : -9999.0, "bytes",
                     token_bytes_json(a, id));
}

static json_t *chat_logprobs(const struct job *j, const struct delta *d) {
    const struct api *a = job_api(j);
    json_t *content = json_array();
    for (int i = 0; i < d->n_lps; i++) {
        const struct lp_rec *r = &d->lps[i];
        json_t *e = token_entry(a, r->token, r->logprob), *top = json_array();
        for (int k = 0; k < r->n_top; k++)
            json_array_append_new(top, token_entry(a, r->top_ids[k], r->top_lps[k]));
        json_object_set_new(e, "top_logprobs", top);
        json_array_append_new(content, e);
    }
    return json_pack("{s:o}", "content", content);
}

static json_t *tool_calls_json(const struct job *j, const json_t *calls, int streaming) {
    struct api *a = job_api(j);
    json_t *out = json_array();
    size_t k;
    json_t *call;
    json_array_foreach(calls, k, call) {
        char id[32];
        snprintf(id, sizeof id, "call_%016llx", (unsigned long long)api_random(a));
        json_t *c = json_pack("{s:s,s:s,s:{s:O,s:O}}", "id", id, "type", "function", "function",
                              "name", json_object_get(call, "name"), "arguments",
                              json_object_get(call, "arguments"));
        if (c && streaming) json_object_set_new(c, "index", json_integer((json_int_t)k));
        json_array_append_new(out, c);
    }
    return out;
}

static json_t *chat_opening(const struct job *j, int index) {
    (void)j;
    return json_pack("{s:i,s:{s:s,s:s},s:n,s:n}", "index", index, "delta", "role", "assistant",
                     "content", "", "logprobs", "finish_reason");
}

static json_t *chat_choice(const struct job *j, int index, const struct delta *d, int whole) {
    const int want_lp = job_top_logprobs(j) >= 0 && (whole || d->n_lps > 0);
    json_t *lp = want_lp ? chat_logprobs(j, d) : json_null();
    json_t *body = json_object();
    if (whole) json_object_set_new(body, "role", json_string("assistant"));
    /* a message with tool calls and no text has content null; a delta has only what changed */
    if (d->n || (whole && !d->tool_calls))
        json_object_set_new(body, "content", json_stringn(d->text ? d->text : "", d->n));
    else if (whole)
        json_object_set_new(body, "content", json_null());
    if (d->n_reasoning) {
        json_object_set_new(body, "reasoning_content", json_stringn(d->reasoning, d->n_reasoning));
        json_object_set_new(body, "reasoning", json_stringn(d->reasoning, d->n_reasoning));
    }
    if (d->tool_calls)
        json_object_set_new(body, "tool_calls", tool_calls_json(j, d->tool_calls, !whole));
    return json_pack("{s:i,s:o,s:o,s:s?}", "index", index, whole ? "message" : "delta", body,
                     "logprobs", lp, "finish_reason", d->finish);
}

static const struct job_format chat_format = {
    .object = "chat.completion",
    .chunk_object = "chat.completion.chunk",
    .id_prefix = "chatcmpl-",
    .prompt_param = "messages",
    .channels = 1,
    .opening = chat_opening,
    .choice = chat_choice,
};

/* Harmony ends a turn with <|return|> and a tool call with <|call|>, but gpt-oss's config.json
 * names only <|return|> as its end of sequence (generation_config.json, which the core does not
 * read, names both): without this a model would run on past its call. */
static enum tmx_status add_harmony_stops(const struct api *a, struct gen_params *p,
                                         struct api_fail *f) {
    static const char *const ends[] = {"<|return|>", "<|call|>"};
    const int n = p->req.n_stop_ids;
    int32_t *ids = realloc((void *)p->req.stop_ids, (size_t)(n + 2) * sizeof *ids);
    if (!ids) return api_failf(f, 500, NULL, "out of memory");
    p->req.stop_ids = ids;
    for (int i = 0; i < 2; i++) {
        const int32_t id = a->si->find_token(a->si->serve, ends[i]);
        if (id >= 0) ids[p->req.n_stop_ids++] = id;
    }
    return TMX_OK;
}

void chat_handle(struct conn *c, const char *body, size_t len) {
    struct api *a = conn_api(c);
    struct api_fail f = {0};
    struct gen_params p = {0};
    json_t *req = NULL;
    int32_t *ids = NULL;
    int n_ids = 0, tool_calls = 0;
    enum tmx_status st = body_parse(body, len, &req, &f);
    if (st == TMX_OK) st = params_parse(a, req, ENDPOINT_CHAT, &p, &f);
    if (st == TMX_OK && a->tools == TOOL_FORMAT_HARMONY) st = add_harmony_stops(a, &p, &f);
    if (st == TMX_OK) st = chat_prompt(a, req, &ids, &n_ids, &tool_calls, &f);
    json_decref(req);
    int32_t **prompts = st == TMX_OK ? malloc(sizeof *prompts) : NULL;
    if (st == TMX_OK && !prompts) st = api_failf(&f, 500, NULL, "out of memory");
    if (st != TMX_OK) {
        free(ids);
        params_free(&p);
        http_fail(c, &f);
        return;
    }
    prompts[0] = ids;
    struct job *j = job_new(c, &chat_format, &p, prompts, &n_ids, 1, NULL, tool_calls);
    if (!j) st = api_failf(&f, 500, NULL, "out of memory");
    else st = job_start(j, &f);
    if (st != TMX_OK) http_fail(c, &f);
}
