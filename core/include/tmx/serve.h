/* tmx/serve.h: the engine's serving side — a scheduler thread that runs many requests over one
 * model, and the interface API front ends (plugins of kind api) drive it through.
 *
 * Requests carry token ids: front ends render chat templates and tokenize (the tokenizer is
 * read-only and thread-safe). Each request reports every generated token through its callback,
 * called on the scheduler thread; the callback must not block (post the event to your own loop,
 * e.g. with uv_async_send). The last event of a request has finish != TMX_FINISH_NONE; after it
 * the callback is never called again for that request.
 *
 * Ownership: tmx_serve borrows the engine (which must outlive it). Arrays in a request's params
 * are copied by submit; event arrays are valid only during the callback. */
#ifndef TMX_SERVE_H
#define TMX_SERVE_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/sampler.h"
#include "tmx/status.h"

struct tmx_engine;
struct tmx_serve;

enum tmx_finish {
    TMX_FINISH_NONE = 0, /* more tokens follow */
    TMX_FINISH_LENGTH,   /* max_tokens reached, or the context is full */
    TMX_FINISH_STOP,     /* an end-of-sequence or stop token was generated (it is reported),
                            or tmx_serve_stop ended it (no token) */
    TMX_FINISH_ABORT,    /* cancelled */
    TMX_FINISH_ERROR,    /* the engine failed; `error` says why */
};

#define TMX_MAX_TOP_LOGPROBS 20

struct tmx_request_params {
    const int32_t *prompt; /* [n_prompt] token ids, n_prompt >= 1 */
    int n_prompt;
    int max_tokens;        /* >= 1; capped by the context left */
    struct tmx_sampler_params sampling;
    float presence_penalty, frequency_penalty; /* OpenAI semantics, on generated tokens */
    float repetition_penalty;                  /* 1: off; CTRL-style on prompt + generated */
    const int32_t *bias_ids;                   /* logit_bias: [n_bias] ids and values */
    const float *bias_values;
    int n_bias;
    const int32_t *stop_ids;                   /* extra token ids that finish with STOP */
    int n_stop_ids;
    int ignore_eos;                            /* do not stop at the model's eos ids */
    int top_logprobs;                          /* -1: no logprobs; 0..TMX_MAX_TOP_LOGPROBS */
};

struct tmx_token_event {
    uint64_t id;          /* the request */
    int32_t token;        /* -1 on an event that carries no token (abort, error, length) */
    float logprob;        /* of `token` under the model (before penalties); with top_logprobs >= 0 */
    int n_top;
    const int32_t *top_ids;     /* [n_top], most likely first */
    const float *top_logprobs;  /* [n_top] */
    enum tmx_finish finish;
    const char *error;    /* with TMX_FINISH_ERROR */
    int n_prompt, n_generated;
};

typedef void (*tmx_token_cb)(void *arg, const struct tmx_token_event *ev);

/* Counters and gauges for /metrics (a snapshot). Histograms count events at or below each
 * bound of TMX_SERVE_LATENCY_BOUNDS (seconds), the last bucket being +Inf. */
#define TMX_SERVE_N_BUCKETS 12
#define TMX_SERVE_LATENCY_BOUNDS \
    {0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 1e300}
struct tmx_serve_metrics {
    int running, waiting;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t finished[5];                  /* by enum tmx_finish */
    uint64_t ttft_count[TMX_SERVE_N_BUCKETS], itl_count[TMX_SERVE_N_BUCKETS];
    double ttft_sum, itl_sum;
    double kv_usage;                       /* 0..1 */
    /* prompt tokens looked up in the prefix cache and found there, once per request (when it
     * is first admitted; not again when it comes back after a preemption) */
    uint64_t prefix_cache_queries, prefix_cache_hits;
    uint64_t preemptions;                  /* requests sent back to the queue to recompute
                                              (KV cache full) */
};

/* Starts the scheduler thread. Config keys: max_running (sequences decoded together),
 * max_waiting (queue bound), context, batch. */
enum tmx_status tmx_serve_new(struct tmx_engine *e, struct tmx_serve **out, char **err);
/* Finishes every request with ABORT, stops the thread, frees. */
void tmx_serve_free(struct tmx_serve *s);

/* Queues a request; TMX_ERR_BUSY when the queue is full (HTTP 429), TMX_ERR_INVALID for bad
 * params (message names the parameter). On success *id identifies it. */
enum tmx_status tmx_serve_submit(struct tmx_serve *s, const struct tmx_request_params *p,
                                 tmx_token_cb cb, void *arg, uint64_t *id, char **err);
/* Aborts a request (queued or running) within one step; its last event is ABORT. A queued
 * request's ABORT event is delivered at once, on the caller's thread. Unknown or finished ids
 * are ignored. */
void tmx_serve_cancel(struct tmx_serve *s, uint64_t id);
/* As cancel, for a request the front end ends because its text reached a stop string: its last
 * event, without a token, and the metrics say STOP. */
void tmx_serve_stop(struct tmx_serve *s, uint64_t id);
void tmx_serve_metrics(struct tmx_serve *s, struct tmx_serve_metrics *m);

/* --- what an api plugin gets ----------------------------------------------------------------
 * Plugins link nothing of the core, so the serving functions reach a front end as this table
 * (passed to tmx_api_i.init). Strings and arrays the table returns through out-parameters are
 * malloc'd by libtmx and released with `release`. */
typedef struct json_t json_t;

struct tmx_serve_i {
    uint32_t struct_size;
    struct tmx_serve *serve;
    const char *model_name;  /* what /v1/models lists and responses echo */
    int max_model_len;       /* context of one sequence */
    int n_vocab;             /* token ids are 0..n_vocab-1 */
    const int32_t *eos_ids;  /* [n_eos] */
    int n_eos;
    int32_t bos_id;          /* -1: none */
    enum tmx_status (*submit)(struct tmx_serve *s, const struct tmx_request_params *p,
                              tmx_token_cb cb, void *arg, uint64_t *id, char **err);
    void (*cancel)(struct tmx_serve *s, uint64_t id);
    void (*metrics)(struct tmx_serve *s, struct tmx_serve_metrics *m);
    enum tmx_status (*tokenize)(struct tmx_serve *s, const char *text, size_t len,
                                int parse_special, int32_t **ids, size_t *n_ids, char **err);
    const char *(*token_bytes)(struct tmx_serve *s, int32_t id, size_t *len);
    int32_t (*find_token)(struct tmx_serve *s, const char *text);
    /* Renders the model's chat template with `context` (messages, tools,
     * add_generation_prompt, ... ; bos_token/eos_token are added when absent).
     * TMX_ERR_NOT_FOUND: the model has no chat template. */
    enum tmx_status (*chat_render)(struct tmx_serve *s, const json_t *context, char **text,
                                   size_t *len, char **err);
    void (*release)(void *p);
    /* ABI 2.8 */
    int max_requests; /* requests running and waiting at most (config keys max_running +
                         max_waiting): one HTTP request of more choices can never be taken */
    int (*token_special)(struct tmx_serve *s, int32_t id); /* a special token's text is left
                                                              out by default */
    void (*stop)(struct tmx_serve *s, uint64_t id); /* tmx_serve_stop */
    const struct tmx_sampling_defaults *defaults; /* what a request that does not set them
                                                     samples with (config generation_config) */
};

/* Fills the table for s; model_name must outlive it. */
void tmx_serve_table(struct tmx_serve *s, const char *model_name, struct tmx_serve_i *out);

#endif
