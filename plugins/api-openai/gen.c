/* gen.c: jobs — the requests one HTTP request runs on the scheduler, and how their tokens become
 * text, stream chunks and the final response.
 *
 * Tokens arrive on the scheduler thread (gen_on_token), are queued under api.lock and handled
 * on the loop thread (gen_drain). Each choice turns token bytes into text through a UTF-8 repair,
 * so no chunk splits a character; searches its text for stop strings, cutting the text there and
 * cancelling the request; and, while streaming, holds back the tail that could still become a
 * stop string or a tool call. A chat output in harmony messages (gpt-oss) is read as it grows
 * into content, reasoning and calls instead (harmony.c). The job answers once every choice has
 * ended, and stays alive, detached from its connection, until the scheduler has sent the last
 * event of each request. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api.h"

struct event {
    struct choice *ch;
    int32_t token; /* -1: none */
    float logprob;
    int n_top;
    int32_t top_ids[TMX_MAX_TOP_LOGPROBS];
    float top_lps[TMX_MAX_TOP_LOGPROBS];
    enum tmx_finish finish;
    char *error; /* malloc'd, with TMX_FINISH_ERROR */
    struct event *next;
};

struct choice {
    struct job *job;
    int index, prompt;
    uint64_t id;          /* the scheduler's */
    int open;             /* submitted, last event not handled yet */
    int ended;            /* finish reason settled */
    int final_sent;       /* the stream has its finish chunk */
    const char *finish;
    int n_tokens;
    struct utf8_dec dec;
    struct buf text;      /* the output so far, valid UTF-8, cut at a stop string */
    struct stops_scan stop; /* where the text stands against the stop strings */
    size_t sent;          /* text[0..sent) is streamed */
    size_t tool_at;       /* where tool calls begin; SIZE_MAX: not (yet) */
    struct harmony hm;    /* job->harmony: the text read into content, reasoning and calls */
    size_t reasoning_sent; /* hm.reasoning[0..reasoning_sent) is streamed */
    struct lp_rec *lps;   /* [n_lps] */
    int n_lps, cap_lps, lps_sent;
    struct event last;    /* the final event's storage: it must never fail to allocate */
};

struct job {
    struct api *api;
    struct conn *conn;    /* NULL once answered or abandoned */
    const struct job_format *fmt;
    struct gen_params p;
    int32_t **prompts;    /* [n_prompts][n_prompt[i]] */
    int *n_prompt;
    int n_prompts;
    char **echo;          /* [n_prompts] or NULL */
    int tool_calls;       /* calls kept per choice; 0: the output is not parsed for them */
    int harmony;          /* the output is harmony messages, read through choice.hm */
    int skip_special;     /* special tokens add no text (kept where a parser reads them) */
    char id[48];
    long long created;
    struct choice *choices; /* [n_choices] */
    int n_choices, n_open, n_ended;
    int streaming;        /* the stream's head is out */
    int busy;             /* inside job code: freeing waits */
    struct stops stops;   /* p.stop's automata */
};

static void job_maybe_free(struct job *j);

struct api *job_api(const struct job *j) { return j->api; }

const char *job_echo(const struct job *j, int index) {
    return j->echo ? j->echo[index / j->p.n] : NULL;
}

int job_top_logprobs(const struct job *j) { return j->p.req.top_logprobs; }

/* --- token text ---------------------------------------------------------------------------- */

json_t *token_text_json(const struct api *a, int32_t id) {
    size_t len = 0;
    const char *bytes = a->si->token_bytes(a->si->serve, id, &len);
    struct utf8_dec d = {0};
    struct buf b = {0};
    utf8_push(&d, bytes ? bytes : "", bytes ? len : 0, &b);
    utf8_flush(&d, &b);
    json_t *s = json_stringn(b.p ? b.p : "", b.n);
    buf_free(&b);
    return s;
}

json_t *token_bytes_json(const struct api *a, int32_t id) {
    size_t len = 0;
    const char *bytes = a->si->token_bytes(a->si->serve, id, &len);
    json_t *arr = json_array();
    for (size_t i = 0; bytes && i < len; i++)
        json_array_append_new(arr, json_integer((unsigned char)bytes[i]));
    return arr;
}

/* --- the scheduler side -------------------------------------------------------------------- */

void gen_on_token(void *arg, const struct tmx_token_event *ev) {
    struct choice *ch = arg;
    struct api *a = ch->job->api;
    struct event *e = ev->finish != TMX_FINISH_NONE ? &ch->last : malloc(sizeof *e);
    if (!e) return; /* out of memory: this token is lost, never the request's end */
    *e = (struct event){.ch = ch, .token = ev->token, .logprob = ev->logprob,
                        .finish = ev->finish};
    e->n_top = ev->n_top > 0 && ev->n_top <= TMX_MAX_TOP_LOGPROBS ? ev->n_top : 0;
    if (e->n_top) {
        memcpy(e->top_ids, ev->top_ids, (size_t)e->n_top * sizeof *e->top_ids);
        memcpy(e->top_lps, ev->top_logprobs, (size_t)e->n_top * sizeof *e->top_lps);
    }
    if (ev->finish == TMX_FINISH_ERROR && ev->error) e->error = strdup(ev->error);
    pthread_mutex_lock(&a->lock);
    if (a->ev_tail) a->ev_tail->next = e;
    else a->ev_head = e;
    a->ev_tail = e;
    pthread_mutex_unlock(&a->lock);
    uv_async_send(&a->wake);
}

/* --- choices ------------------------------------------------------------------------------- */

static void choice_end(struct choice *ch, const char *finish) {
    ch->ended = 1;
    ch->finish = finish;
    ch->job->n_ended++;
}

static void choice_take_token(struct job *j, struct choice *ch, const struct event *e) {
    ch->n_tokens++;
    if (j->p.logprobs) {
        if (ch->n_lps == ch->cap_lps) {
            const int cap = ch->cap_lps ? 2 * ch->cap_lps : 64;
            struct lp_rec *p = realloc(ch->lps, (size_t)cap * sizeof *p);
            if (p) ch->lps = p, ch->cap_lps = cap;
        }
        if (ch->n_lps < ch->cap_lps) {
            struct lp_rec *r = &ch->lps[ch->n_lps++];
            r->token = e->token;
            r->logprob = e->logprob;
            r->offset = ch->text.n;
            r->n_top = e->n_top;
            memcpy(r->top_ids, e->top_ids, sizeof r->top_ids);
            memcpy(r->top_lps, e->top_lps, sizeof r->top_lps);
        }
    }
    if (e->finish == TMX_FINISH_STOP) return; /* an end-of-sequence or stop token: no text */
    const struct tmx_serve_i *si = j->api->si;
    if (j->skip_special && si->token_special(si->serve, e->token)) return;
    size_t len = 0;
    const char *bytes = si->token_bytes(si->serve, e->token, &len);
    if (bytes) utf8_push(&ch->dec, bytes, len, &ch->text);
}

/* Looks for stop strings in what the last token added; a hit ends the choice there. */
static void choice_check_stop(struct job *j, struct choice *ch) {
    if (j->p.n_stop == 0 || ch->ended) return;
    const size_t at = stops_feed(&j->stops, &ch->stop, ch->text.p, ch->text.n);
    if (at == SIZE_MAX) return;
    ch->text.n = at;
    ch->text.p[at] = 0;
    choice_end(ch, "stop");
    if (ch->open) j->api->si->stop(j->api->si->serve, ch->id);
}

/* How much of the text a stream may send now: not a tail that may still turn into a stop
 * string, nor anything from the start of tool calls on. */
static size_t choice_sendable(struct job *j, struct choice *ch) {
    size_t end = ch->text.n;
    if (!ch->ended) end -= stops_pending(&j->stops, &ch->stop);
    if (j->tool_calls) {
        size_t hold = 0;
        if (ch->tool_at == SIZE_MAX)
            ch->tool_at = tool_starts_at(j->api->tools, ch->text.p, ch->text.n, &hold);
        if (ch->tool_at != SIZE_MAX) end = end < ch->tool_at ? end : ch->tool_at;
        else if (!ch->ended && ch->text.n - hold < end) end = ch->text.n - hold;
    }
    return end;
}

/* An ended choice's content length and tool calls (new reference, or NULL). Calls that do not
 * parse stay in the content. */
static size_t choice_result(struct job *j, struct choice *ch, json_t **calls) {
    *calls = NULL;
    choice_sendable(j, ch); /* settles tool_at */
    if (ch->tool_at == SIZE_MAX) return ch->text.n;
    *calls = tool_calls_parse(j->api->tools, ch->text.p + ch->tool_at, ch->text.n - ch->tool_at);
    while (*calls && (int)json_array_size(*calls) > j->tool_calls)
        json_array_remove(*calls, json_array_size(*calls) - 1);
    return *calls ? ch->tool_at : ch->text.n;
}

/* Reads a harmony output as far as it is settled: not into a tail that may still turn into a
 * stop string, which would cut it. */
static void choice_read_harmony(struct job *j, struct choice *ch) {
    size_t n = ch->text.n;
    if (!ch->ended) n -= stops_pending(&j->stops, &ch->stop);
    harmony_read(&ch->hm, ch->text.p ? ch->text.p : "", n, ch->ended);
}

/* What a choice can say so far, or in all once it has ended. */
struct said {
    const char *content, *reasoning;
    size_t n_content, n_reasoning;
    size_t raw;    /* the output bytes behind it (logprobs go up to there) */
    json_t *calls; /* once ended: its tool calls (new reference), or NULL */
};

static struct said choice_said(struct job *j, struct choice *ch) {
    if (!j->harmony) {
        json_t *calls = NULL;
        const size_t end = ch->ended ? choice_result(j, ch, &calls) : choice_sendable(j, ch);
        return (struct said){.content = ch->text.p, .n_content = end, .raw = end, .calls = calls};
    }
    const struct harmony *h = &ch->hm;
    struct said s = {.content = h->content.p, .n_content = h->content.n,
                     .reasoning = h->reasoning.p, .n_reasoning = h->reasoning.n, .raw = h->pos};
    if (ch->ended && h->calls && json_array_size(h->calls) > 0) s.calls = json_incref(h->calls);
    return s;
}

/* The logprob records behind text[0..end) not yet sent. */
static int lps_upto(const struct choice *ch, size_t end) {
    int k = ch->lps_sent;
    while (k < ch->n_lps && ch->lps[k].offset < end) k++;
    return k;
}

/* --- responses ----------------------------------------------------------------------------- */

static void usage_counts(const struct job *j, int *prompt, int *completion) {
    *prompt = *completion = 0;
    for (int i = 0; i < j->n_prompts; i++) *prompt += j->n_prompt[i];
    for (int i = 0; i < j->n_choices; i++) *completion += j->choices[i].n_tokens;
}

static json_t *usage_json(const struct job *j) {
    int prompt, completion;
    usage_counts(j, &prompt, &completion);
    return json_pack("{s:i,s:i,s:i}", "prompt_tokens", prompt, "completion_tokens", completion,
                     "total_tokens", prompt + completion);
}

static json_t *response_json(const struct job *j, const char *object, json_t *choices) {
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", j->id, "object", object, "created",
                     j->created, "model", j->api->model, "choices", choices);
}

static void stream_choice_json(struct job *j, json_t *choice) {
    if (!j->conn) { /* the client went away during this event */
        json_decref(choice);
        return;
    }
    json_t *chunk = response_json(j, j->fmt->chunk_object, json_pack("[o]", choice));
    if (chunk && j->p.include_usage) json_object_set_new(chunk, "usage", json_null());
    sse_send(j->conn, chunk);
}

/* Hands the connection back: the response is about to end. */
static struct conn *job_release(struct job *j) {
    struct conn *c = j->conn;
    j->conn = NULL;
    conn_set_job(c, NULL);
    return c;
}

/* Streams what choice ch may send now, and its end once it has ended. */
static void stream_choice(struct job *j, struct choice *ch) {
    const struct said s = choice_said(j, ch);
    const int lp_end = lps_upto(ch, s.raw);
    if (s.n_content > ch->sent || s.n_reasoning > ch->reasoning_sent) {
        struct delta d = {.lps = ch->lps ? ch->lps + ch->lps_sent : NULL,
                          .n_lps = lp_end - ch->lps_sent};
        if (s.n_content > ch->sent) {
            d.text = s.content + ch->sent;
            d.n = s.n_content - ch->sent;
        }
        if (s.n_reasoning > ch->reasoning_sent) {
            d.reasoning = s.reasoning + ch->reasoning_sent;
            d.n_reasoning = s.n_reasoning - ch->reasoning_sent;
        }
        stream_choice_json(j, j->fmt->choice(j, ch->index, &d, 0));
        ch->sent = s.n_content;
        ch->reasoning_sent = s.n_reasoning;
        ch->lps_sent = lp_end;
    }
    if (ch->ended && !ch->final_sent && j->conn) {
        ch->final_sent = 1;
        if (s.calls) {
            const struct delta d = {.tool_calls = s.calls};
            stream_choice_json(j, j->fmt->choice(j, ch->index, &d, 0));
        }
        const struct delta d = {.finish = s.calls ? "tool_calls" : ch->finish};
        stream_choice_json(j, j->fmt->choice(j, ch->index, &d, 0));
    }
    json_decref(s.calls);
}

static void respond_whole(struct job *j) {
    json_t *choices = json_array();
    for (int i = 0; i < j->n_choices; i++) {
        struct choice *ch = &j->choices[i];
        const struct said s = choice_said(j, ch);
        const struct delta d = {.text = s.content ? s.content : "", .n = s.n_content,
                                .reasoning = s.reasoning, .n_reasoning = s.n_reasoning,
                                .lps = ch->lps, .n_lps = lps_upto(ch, s.raw),
                                .tool_calls = s.calls,
                                .finish = s.calls ? "tool_calls" : ch->finish};
        json_array_append_new(choices, j->fmt->choice(j, i, &d, 1));
        json_decref(s.calls);
    }
    json_t *body = response_json(j, j->fmt->object, choices);
    if (body) json_object_set_new(body, "usage", usage_json(j));
    struct conn *c = job_release(j);
    http_respond_json(c, 200, body);
}

/* After an event of choice ch: stream it, and answer once every choice has ended. */
static void job_progress(struct job *j, struct choice *ch) {
    if (!j->conn) return;
    if (j->p.stream) stream_choice(j, ch);
    if (!j->conn || j->n_ended < j->n_choices) return;
    int prompt, completion;
    usage_counts(j, &prompt, &completion);
    conn_log_tokens(j->conn, prompt, completion);
    if (!j->p.stream) {
        respond_whole(j);
        return;
    }
    if (j->p.include_usage) {
        json_t *u = response_json(j, j->fmt->chunk_object, json_array());
        if (u) json_object_set_new(u, "usage", usage_json(j));
        sse_send(j->conn, u);
    }
    if (j->conn) sse_done(job_release(j));
}

static void cancel_open(struct job *j) {
    for (int i = 0; i < j->n_choices; i++)
        if (j->choices[i].open) j->api->si->cancel(j->api->si->serve, j->choices[i].id);
}

void job_fail(struct job *j, int status, const char *msg) {
    if (!j->conn) return;
    j->busy++;
    struct conn *c = job_release(j);
    cancel_open(j);
    if (j->streaming) {
        sse_send(c, http_error_json(status, NULL, msg));
        sse_done(c);
    } else {
        http_respond_json(c, status, http_error_json(status, NULL, msg));
    }
    j->busy--;
    job_maybe_free(j);
}

void job_detach(struct job *j) {
    j->conn = NULL;
    cancel_open(j);
    job_maybe_free(j);
}

static void choice_event(struct choice *ch, struct event *e) {
    struct job *j = ch->job;
    j->busy++;
    if (e->token >= 0 && !ch->ended) choice_take_token(j, ch, e);
    if (e->finish != TMX_FINISH_NONE) {
        ch->open = 0;
        j->n_open--;
        if (!ch->ended) utf8_flush(&ch->dec, &ch->text);
    }
    choice_check_stop(j, ch);
    if (!ch->ended && e->finish == TMX_FINISH_STOP) choice_end(ch, "stop");
    else if (!ch->ended && e->finish == TMX_FINISH_LENGTH) choice_end(ch, "length");
    if (j->harmony) choice_read_harmony(j, ch);
    if (ch->text.oom || ch->hm.oom) {
        job_fail(j, 500, "out of memory");
    } else if (!ch->ended && e->finish == TMX_FINISH_ERROR) {
        j->api->host->log(TMX_LOG_ERROR, "api.openai: %s: %s", j->id,
                          e->error ? e->error : "the engine failed");
        job_fail(j, 500, e->error ? e->error : "the engine failed");
    } else if (!ch->ended && e->finish == TMX_FINISH_ABORT) {
        job_fail(j, 503, "the request was cancelled: the server is shutting down");
    } else {
        job_progress(j, ch);
    }
    free(e->error);
    e->error = NULL;
    j->busy--;
    job_maybe_free(j);
}

void gen_drain(struct api *a) {
    pthread_mutex_lock(&a->lock);
    struct event *e = a->ev_head;
    a->ev_head = a->ev_tail = NULL;
    pthread_mutex_unlock(&a->lock);
    while (e) {
        struct event *next = e->next;
        const int last = e == &e->ch->last; /* lives in the choice, which the job may free */
        choice_event(e->ch, e);
        if (!last) free(e);
        e = next;
    }
}

/* --- lifetime ------------------------------------------------------------------------------ */

static void job_free(struct job *j) {
    for (int i = 0; i < j->n_prompts; i++) {
        free(j->prompts[i]);
        if (j->echo) free(j->echo[i]);
    }
    for (int i = 0; j->choices && i < j->n_choices; i++) {
        buf_free(&j->choices[i].text);
        harmony_fini(&j->choices[i].hm);
        free(j->choices[i].lps);
    }
    free(j->choices);
    free(j->prompts);
    free(j->n_prompt);
    free(j->echo);
    stops_free(&j->stops);
    params_free(&j->p);
    free(j);
}

static void job_maybe_free(struct job *j) {
    if (j->conn || j->n_open > 0 || j->busy > 0) return;
    struct api *a = j->api;
    job_free(j);
    a->n_jobs--;
    api_check_done(a);
}

struct job *job_new(struct conn *c, const struct job_format *fmt, struct gen_params *p,
                    int32_t **prompts, const int *n_prompt, int n_prompts, char **echo,
                    int tool_calls) {
    struct api *a = conn_api(c);
    struct job *j = calloc(1, sizeof *j);
    const int n_choices = n_prompts * p->n;
    if (j) {
        j->choices = calloc((size_t)n_choices, sizeof *j->choices);
        j->n_prompt = malloc((size_t)n_prompts * sizeof *j->n_prompt);
    }
    struct stops stops;
    const int stops_ok = stops_init(&stops, p->stop, p->n_stop); /* p->stop moves to j->p */
    if (!j || !j->choices || !j->n_prompt || !stops_ok) {
        if (j) free(j->choices), free(j->n_prompt), free(j);
        stops_free(&stops);
        for (int i = 0; i < n_prompts; i++) {
            free(prompts[i]);
            if (echo) free(echo[i]);
        }
        free(prompts);
        free(echo);
        params_free(p);
        return NULL;
    }
    j->api = a;
    j->conn = c;
    j->fmt = fmt;
    j->p = *p;
    *p = (struct gen_params){0};
    j->stops = stops;
    j->prompts = prompts;
    memcpy(j->n_prompt, n_prompt, (size_t)n_prompts * sizeof *n_prompt);
    j->n_prompts = n_prompts;
    j->echo = echo;
    j->tool_calls = tool_calls;
    j->harmony = fmt->channels && a->tools == TOOL_FORMAT_HARMONY;
    j->skip_special = j->p.skip_special && !j->harmony && !tool_calls;
    j->n_choices = n_choices;
    j->created = (long long)time(NULL);
    snprintf(j->id, sizeof j->id, "%s%016llx%08llx", fmt->id_prefix,
             (unsigned long long)api_random(a), (unsigned long long)(api_random(a) >> 32));
    for (int i = 0; i < n_choices; i++) {
        j->choices[i] = (struct choice){.job = j, .index = i, .prompt = i / j->p.n,
                                        .tool_at = SIZE_MAX};
        harmony_init(&j->choices[i].hm, tool_calls);
    }
    a->n_jobs++;
    return j;
}

enum tmx_status job_start(struct job *j, struct api_fail *f) {
    const struct tmx_serve_i *si = j->api->si;
    enum tmx_status st = TMX_OK;
    if (j->n_choices > si->max_requests && j->p.n > 1)
        st = api_failf(f, 400, "n", "n: %d prompts x n = %d choices, more than the %d requests "
                       "this server holds at once (config keys max_running + max_waiting)",
                       j->n_prompts, j->n_choices, si->max_requests);
    else if (j->n_choices > si->max_requests)
        st = api_failf(f, 400, j->fmt->prompt_param, "%s: %d prompts, more than the %d requests "
                       "this server holds at once (config keys max_running + max_waiting)",
                       j->fmt->prompt_param, j->n_prompts, si->max_requests);
    j->busy++;
    for (int i = 0; i < j->n_choices && st == TMX_OK; i++) {
        struct choice *ch = &j->choices[i];
        struct tmx_request_params rp = j->p.req;
        rp.prompt = j->prompts[ch->prompt];
        rp.n_prompt = j->n_prompt[ch->prompt];
        st = params_fit(j->api, &j->p, rp.n_prompt, j->fmt->prompt_param,
                        j->n_prompts > 1 ? ch->prompt : -1, &rp.max_tokens, f);
        if (st != TMX_OK) break;
        rp.sampling.seed = j->p.seeded ? j->p.req.sampling.seed + (uint64_t)(i % j->p.n)
                                       : api_random(j->api);
        char *err = NULL;
        st = si->submit(si->serve, &rp, gen_on_token, ch, &ch->id, &err);
        if (st == TMX_OK) {
            ch->open = 1;
            j->n_open++;
        } else {
            api_failf(f, st == TMX_ERR_BUSY ? 429 : st == TMX_ERR_INVALID ? 400 : 500, NULL,
                      "%s", err ? err : "the scheduler refused the request");
            if (err) si->release(err);
        }
    }
    if (st != TMX_OK) {
        j->conn = NULL;
        cancel_open(j);
        j->busy--;
        job_maybe_free(j);
        return st;
    }
    conn_set_job(j->conn, j);
    if (j->p.stream) {
        j->streaming = 1;
        sse_begin(j->conn);
        for (int i = 0; i < j->n_choices && j->conn; i++) {
            json_t *open = j->fmt->opening(j, i);
            if (open) stream_choice_json(j, open);
        }
    }
    j->busy--;
    job_maybe_free(j);
    return TMX_OK;
}
