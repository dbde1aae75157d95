/* api.h: the openai front end's shared declarations.
 *
 * One libuv loop runs everything of the plugin on the thread that called `run`: the listener,
 * connections (http.c), request handlers (chat.c, completions.c, info.c, metrics.c) and jobs
 * (gen.c). The scheduler calls back on its own thread; those callbacks only copy the event into
 * a mutex-guarded queue and wake the loop with uv_async_send (gen.c), so no uv handle and no job
 * is ever touched off the loop thread.
 *
 * Ownership: the api owns its connections (a list) and counts its jobs; a connection owns the
 * job answering its current request until the response ends or the client goes away, after which
 * the job lives on alone until the scheduler has sent the last event of each of its requests. */
#ifndef TMX_API_OPENAI_API_H
#define TMX_API_OPENAI_API_H

#include <http_parser.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <uv.h>

#include "text.h"
#include "tmx/plugin.h"

struct conn;
struct job;
struct choice;

struct api {
    const struct tmx_host *host;
    const struct tmx_serve_i *si;
    char *model;       /* the name /v1/models lists and responses echo */
    char *bind_host;   /* options (plugin.c) */
    int port;
    char *api_key;     /* "" : no authentication */
    char *cors_origin; /* "" : no CORS headers */
    size_t max_body;
    uint64_t timeout_ms;
    enum tool_format tools; /* how the model writes tool calls (from its tokenizer) */
    long long started;      /* Unix time of init: /v1/models "created" */

    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t wake;    /* scheduler events and stop requests */
    atomic_int stop_requested; /* set by `stop`, from any thread or a signal handler */
    int stopping;       /* the loop has begun shutting down */
    int listening;      /* the listener is open */

    pthread_mutex_t lock;
    struct event *ev_head, *ev_tail; /* under lock: scheduler events not yet handled */

    struct conn *conns; /* open connections */
    int n_jobs;         /* jobs alive, attached or not */
    uint64_t rng;       /* response ids and default seeds */
};

/* Called by http.c and gen.c when a connection or a job ends: during shutdown, the last one
 * lets `run` return (plugin.c). */
void api_check_done(struct api *a);
uint64_t api_random(struct api *a);

/* --- request failures ------------------------------------------------------------------------
 * The HTTP counterpart of `char **err`: request handling fills one of these, naming the
 * request parameter at fault, and the connection turns it into an OpenAI error body. */
struct api_fail {
    int status;     /* HTTP status */
    char param[64]; /* "" : no parameter */
    char msg[512];
};

/* Fills f and returns TMX_ERR_INVALID (TMX_ERR_BUSY for 429, TMX_ERR_UNSUPPORTED for a
 * parameter this server refuses), so that error paths read `return api_failf(f, ...);`. */
enum tmx_status api_failf(struct api_fail *f, int status, const char *param, const char *fmt,
                          ...) __attribute__((format(printf, 4, 5)));

/* --- http.c: connections ------------------------------------------------------------------ */

/* Whether host:port is an IPv4 or IPv6 address (into *addr). */
int http_addr(const char *host, int port, struct sockaddr_storage *addr);
enum tmx_status http_listen(struct api *a, char **err);
/* Stops accepting, closes idle connections and fails in-flight jobs with 503. */
void http_shutdown(struct api *a);

/* One complete response; the connection then reads its next request or closes. */
void http_respond(struct conn *c, int status, const char *content_type, const char *body,
                  size_t len);
void http_respond_json(struct conn *c, int status, json_t *body); /* steals body */
void http_fail(struct conn *c, const struct api_fail *f);
/* {"error": {"message", "type", "param", "code"}}: the body of an error response or event. */
json_t *http_error_json(int status, const char *param, const char *msg);
/* A chunked response: begin, any number of chunks, end (which completes it). */
void http_stream_begin(struct conn *c, const char *content_type);
void http_stream_send(struct conn *c, const char *p, size_t n);
void http_stream_end(struct conn *c);

/* sse.c: server-sent events over a chunked response, as `data: <json>` lines. */
void sse_begin(struct conn *c);
void sse_send(struct conn *c, json_t *event); /* steals event */
void sse_done(struct conn *c);                /* data: [DONE], and the response ends */

struct api *conn_api(const struct conn *c);
/* What follows a prefix route's path in the request's (still percent-encoded). */
const char *conn_path_rest(const struct conn *c, size_t *n);
/* The job answering c's request: the connection cancels it if the client goes away. */
void conn_set_job(struct conn *c, struct job *j);
/* Adds token counts to the request's log line. */
void conn_log_tokens(struct conn *c, int prompt, int completion);

/* --- handlers (the routes of http.c) ------------------------------------------------------- */

typedef void (*api_handler)(struct conn *c, const char *body, size_t len);
void chat_handle(struct conn *c, const char *body, size_t len);        /* chat.c */
void completions_handle(struct conn *c, const char *body, size_t len); /* completions.c */
void health_handle(struct conn *c, const char *body, size_t len);      /* info.c */
void models_handle(struct conn *c, const char *body, size_t len);
void model_handle(struct conn *c, const char *body, size_t len);       /* GET /v1/models/{id} */
void tokenize_handle(struct conn *c, const char *body, size_t len);
void detokenize_handle(struct conn *c, const char *body, size_t len);
void metrics_handle(struct conn *c, const char *body, size_t len);     /* metrics.c */

/* chat.c: a chat request's messages (and tools) rendered by the model's template and tokenized;
 * /tokenize uses it too. *ids is malloc'd; *tool_calls as job_new takes it. */
enum tmx_status chat_prompt(struct api *a, const json_t *body, int32_t **ids, int *n_ids,
                            int *tool_calls, struct api_fail *f);

/* --- params.c: request bodies and sampling parameters -------------------------------------- */

/* The body as a JSON object; a parse error names the line, column and byte. */
enum tmx_status body_parse(const char *body, size_t len, json_t **out, struct api_fail *f);
/* A member, with JSON null read as absent (clients send null to mean "default"). */
json_t *body_get(const json_t *obj, const char *key);

/* The generation parameters both endpoints share. Arrays are owned (params_free). */
struct gen_params {
    struct tmx_request_params req; /* sampling, penalties, logit_bias, stop ids, top_logprobs;
                                      prompt and max_tokens are filled per choice */
    int max_tokens;   /* 0: the context left after the prompt */
    const char *max_tokens_param; /* the member that gave it: errors name what the client sent */
    int n;            /* choices per prompt */
    int seeded;       /* `seed` was given: the i-th choice of every prompt samples with seed + i */
    int skip_special; /* special tokens' text is left out of the output (the default) */
    int stream, include_usage;
    int logprobs;     /* token logprobs requested */
    char **stop;      /* [n_stop] stop strings */
    int n_stop;
};

enum endpoint { ENDPOINT_CHAT, ENDPOINT_COMPLETIONS };

enum tmx_status params_parse(struct api *a, const json_t *body, enum endpoint ep,
                             struct gen_params *p, struct api_fail *f);
void params_free(struct gen_params *p);
/* Checks prompt `index` of a batch (-1: the only one) against the context and settles
 * max_tokens; `what` names the prompt parameter ("messages" or "prompt") in the error. */
enum tmx_status params_fit(const struct api *a, const struct gen_params *p, int n_prompt,
                           const char *what, int index, int *max_tokens, struct api_fail *f);

/* --- gen.c: jobs --------------------------------------------------------------------------- */

/* The logprobs of one generated token. */
struct lp_rec {
    int32_t token;
    float logprob;
    size_t offset; /* bytes of output text before this token */
    int n_top;
    int32_t top_ids[TMX_MAX_TOP_LOGPROBS];
    float top_lps[TMX_MAX_TOP_LOGPROBS];
};

/* What a choice says in one stream chunk, or in the whole response. */
struct delta {
    const char *text; /* new content, valid UTF-8 */
    size_t n;
    const char *reasoning; /* new reasoning (harmony's analysis channel), valid UTF-8 */
    size_t n_reasoning;
    const struct lp_rec *lps; /* [n_lps] logprobs of the tokens behind it */
    int n_lps;
    const json_t *tool_calls; /* array of {"name", "arguments"}, or NULL */
    const char *finish;       /* finish_reason, or NULL while more follows */
};

/* How one endpoint shapes its responses (chat.c, completions.c). */
struct job_format {
    const char *object;       /* "chat.completion", "text_completion" */
    const char *chunk_object; /* what stream chunks say they are */
    const char *id_prefix;    /* "chatcmpl-", "cmpl-" */
    const char *prompt_param; /* what a too-long prompt error names: "messages", "prompt" */
    int channels;             /* harmony output is read into content, reasoning and calls (chat);
                                 0: returned as written (completions) */
    /* The choice object of a stream's first chunk for choice `index`; NULL: none. */
    json_t *(*opening)(const struct job *j, int index);
    /* A choice object: of one stream chunk, or (whole) of the complete response. */
    json_t *(*choice)(const struct job *j, int index, const struct delta *d, int whole);
};

/* A job generates n_prompts x n choices for c's request; choice index = prompt * n + i. The job
 * takes the prompts' token arrays and p (both freed with the job, or at once when job_new fails).
 * echo (may be NULL: no echo) holds each prompt's text, also taken. tool_calls: how many tool
 * calls a choice keeps (0: the output is not parsed for them). */
struct job *job_new(struct conn *c, const struct job_format *fmt, struct gen_params *p,
                    int32_t **prompts, const int *n_prompt, int n_prompts, char **echo,
                    int tool_calls);
/* Submits every choice and starts the response. On failure the job is gone and f says why. */
enum tmx_status job_start(struct job *j, struct api_fail *f);
/* The connection is going away: cancel whatever still runs; the job frees itself once the
 * scheduler has finished its requests. */
void job_detach(struct job *j);
/* Fails a job that is still answering with `status` (503 at shutdown). */
void job_fail(struct job *j, int status, const char *msg);

struct api *job_api(const struct job *j);
const char *job_echo(const struct job *j, int index); /* NULL: no echo */
int job_top_logprobs(const struct job *j);            /* -1: no logprobs */

/* Token text for logprobs: valid UTF-8 (broken bytes become U+FFFD), and the raw bytes. */
json_t *token_text_json(const struct api *a, int32_t id);
json_t *token_bytes_json(const struct api *a, int32_t id);

/* The scheduler's token callback (any thread) and the loop side that handles the events. */
void gen_on_token(void *arg, const struct tmx_token_event *ev);
void gen_drain(struct api *a);

#endif
