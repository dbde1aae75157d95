/* serve.c: the scheduler — one thread that runs every request of `tmx serve` over one model.
 *
 * Requests wait in a bounded FIFO; up to max_running of them hold a sequence at a time. Each
 * step is one forward pass over a batch drawn from every running request: a decode token each
 * first, then prompt chunks, oldest request first, within the step's token budget (config
 * "batch"): continuous batching with chunked prefill that never stalls decoding. A waiting
 * request joins between steps when the paged KV cache has free blocks for its tokens and a
 * little decode room, beyond what the running requests still need for theirs; it first takes
 * whatever prefix of its prompt the cache already holds. A cancelled request leaves within one
 * step and gives its blocks back.
 *
 * When decoding runs out of blocks anyway, the newest running request is preempted (vLLM's
 * recompute preemption): its blocks go back (the full ones stay findable by hash) and it
 * returns to the head of the queue, to be admitted again, and recompute its tokens, only when
 * the cache has room for it. Running out is a delay, never a failure. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tmx/log.h"
#include "tmx/serve.h"
#include "tmx/template.h"
#include "tmx/tmx.h"

struct request {
    uint64_t id;
    struct tmx_request_params p; /* arrays point into `owned` */
    void *owned;
    tmx_token_cb cb;
    void *arg;
    struct tmx_seq *seq;       /* NULL while waiting, and once finished */
    struct tmx_sampler *sampler;
    int32_t *tokens;  /* [n_prompt + max_tokens]: prompt, then generated */
    int n_tokens;     /* prompt + generated so far */
    int n_fed;        /* tokens in the sequence's KV cache */
    int n_gen;
    int preempted;    /* blocks given back this step: reap returns it to the queue */
    int requeued;     /* was preempted once: its prompt is not counted again */
    enum tmx_finish end_as; /* under the lock: NONE, or how cancel / stop ended it */
    double t_submit, t_last;
    struct request *next;
};

/* A step's token for one row and what its event reports. */
struct row_pick {
    int32_t tok;
    float logprob;
    int n_top;
    int32_t top_ids[TMX_MAX_TOP_LOGPROBS];
    float top_lp[TMX_MAX_TOP_LOGPROBS];
};

struct tmx_serve {
    struct tmx_engine *e;
    struct tmx_model *m;
    int n_ctx, n_batch, max_running, max_waiting, vocab_size, n_vocab;
    int prefix_cache;                 /* look-ups are counted only where there is a cache */
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int stopping;                     /* under lock */
    struct request *wait_head, *wait_tail; /* under lock; ascending ids (arrival order) */
    int n_waiting;                    /* under lock */
    struct request **running;         /* [max_running] ascending ids; changed under the lock */
    int n_running;
    struct request **gone;            /* [max_running] scratch of reap */
    uint64_t next_id;                 /* under lock */
    struct tmx_serve_metrics metrics; /* under lock */
    float *logits;                    /* [max_running][vocab_size] of a step */
    int32_t *next;                    /* [max_running] of a greedy step: each row's argmax */
    float *temps;                     /* [max_running] of a top step: each row's temperature */
    float *top_x;                     /* [max_running][TMX_TOPK_MAX] its first candidates */
    int32_t *top_id;                  /* [max_running][TMX_TOPK_MAX] */
    double *top_stat;                 /* [max_running][3] */
    float *work;                      /* [draw threads][vocab_size] a draw's edited logits */
    int32_t *edit_starts;             /* [max_running + 1] of a step: each row's edits */
    struct tmx_logit_edit *edits;     /* [edit_cap] of a step */
    size_t edit_cap;
    struct tmx_seq **b_seq;           /* [max_running] the step's batch */
    const int32_t **b_tok;            /* [max_running] */
    int *b_n;                         /* [max_running] */
    struct request **b_req;           /* [max_running] */
    int *edit_at;                     /* [vocab_size] scratch of edits_of, kept zero */
    struct row_pick *picks;           /* [max_running] of a step: each row's token */
    int *drawn;                       /* [max_running] rows whose draw reads their whole row */
    struct tmx_step_threads *draws;   /* the threads the draws over whole rows run on */
    struct tmx_sampling_defaults defaults; /* what requests sample with unless they say */
    struct tmx_template *chat;        /* the model's chat template, or NULL */
    json_t *special;                  /* bos_token / eos_token strings for the template */
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void observe(uint64_t *buckets, double *sum, double v) {
    static const double bounds[TMX_SERVE_N_BUCKETS] = TMX_SERVE_LATENCY_BOUNDS;
    for (int i = 0; i < TMX_SERVE_N_BUCKETS; i++)
        if (v <= bounds[i]) buckets[i]++;
    *sum += v;
}

static void request_free(struct request *r) {
    if (!r) return;
    tmx_seq_free(r->seq);
    tmx_sampler_free(r->sampler);
    free(r->tokens);
    free(r->owned);
    free(r);
}

/* --- the sampling of one request ----------------------------------------------------------- */

/* log-softmax normalizer of the model's logits over the tokenizer's ids */
static double log_sum_exp(const float *x, int n) {
    float max = x[0];
    for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
    double s = 0.0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - max);
    return max + log(s);
}

/* Adds token id of log probability lp to o's list, o->n_top long so far and at most want
 * (<= TMX_MAX_TOP_LOGPROBS), which goes by lp descending, the lower id first among equal ones. */
static void top_add(struct row_pick *o, int want, int32_t id, float lp) {
    const int k = o->n_top;
    if (want == 0 || (k == want && (lp < o->top_lp[k - 1] ||
                                    (lp == o->top_lp[k - 1] && id > o->top_ids[k - 1]))))
        return;
    int j = k < want ? o->n_top++ : k - 1;
    for (; j > 0 && (o->top_lp[j - 1] < lp || (o->top_lp[j - 1] == lp && o->top_ids[j - 1] > id));
         j--) {
        o->top_ids[j] = o->top_ids[j - 1];
        o->top_lp[j] = o->top_lp[j - 1];
    }
    o->top_ids[j] = id;
    o->top_lp[j] = lp;
}

/* Whether r's sampler reads nothing but its logits over the tokenizer's ids (no logit bias or
 * penalties): its steps edit no logits, and when greedy without logprobs can take their
 * argmax where the logits are. */
static int plain(const struct request *r) {
    const struct tmx_request_params *p = &r->p;
    return p->n_bias == 0 && p->presence_penalty == 0 && p->frequency_penalty == 0 &&
           p->repetition_penalty == 1;
}

/* The edits that r's logit bias and penalties make to its next logits need room for. */
static size_t edits_bound(const struct request *r) {
    return plain(r) ? 0 : (size_t)r->p.n_bias + (size_t)r->n_tokens;
}

/* r's edit of logit id, made (changing nothing) when r has none yet. */
static struct tmx_logit_edit *edit_of(int *at, struct tmx_logit_edit *e, int *n, int32_t id) {
    if (!at[id]) {
        e[*n] = (struct tmx_logit_edit){id, 0.0f, 0.0f, 1.0f};
        at[id] = ++*n;
    }
    return &e[at[id] - 1];
}

/* The edits of r's next logits into e (room for edits_bound), one an id below n_vocab (the
 * sampler reads no other): its logit bias (the biases of one id summed), the OpenAI penalties
 * over the tokens it generated (frequency x count + presence), the CTRL / HF repetition penalty
 * over every token it has seen, prompt included. Returns their number. */
static int edits_of(struct tmx_serve *s, const struct request *r, struct tmx_logit_edit *e) {
    const struct tmx_request_params *p = &r->p;
    int *at = s->edit_at, n = 0;
    for (int i = 0; i < p->n_bias; i++)
        edit_of(at, e, &n, p->bias_ids[i])->bias += p->bias_values[i];
    if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
        for (int i = p->n_prompt; i < r->n_tokens; i++) /* counted in penalty first */
            if (r->tokens[i] < s->n_vocab) edit_of(at, e, &n, r->tokens[i])->penalty += 1.0f;
        for (int i = 0; i < n; i++)
            if (e[i].penalty > 0)
                e[i].penalty = p->frequency_penalty * e[i].penalty + p->presence_penalty;
    }
    if (p->repetition_penalty != 1)
        for (int i = 0; i < r->n_tokens; i++)
            if (r->tokens[i] < s->n_vocab)
                edit_of(at, e, &n, r->tokens[i])->rep = p->repetition_penalty;
    for (int i = 0; i < n; i++) at[e[i].id] = 0;
    return n;
}

/* Room for n edits in s->edits; 0 when out of memory. */
static int edits_room(struct tmx_serve *s, size_t n) {
    if (n <= s->edit_cap) return 1;
    struct tmx_logit_edit *e = realloc(s->edits, n * sizeof *e);
    if (!e) return 0;
    s->edits = e;
    s->edit_cap = n;
    return 1;
}

/* Draws r's next token from its logits into o: with `edited` 0 its edits e[n_edits] (logit
 * bias and penalties) go on a copy in work[n_vocab] (edited 1: the logits carry them, from a top
 * step), then the request's sampler (top: the row's first candidates, when a top step's draw
 * needed the rest of it). Fills o's logprobs from the logits, which are unmodified when r asks
 * for them. Touches nothing but r's sampler, work and o: draws of other rows run beside it. */
static void pick(const struct tmx_serve *s, struct request *r, const float *logits, int edited,
                 const struct tmx_sampler_top *top, const struct tmx_logit_edit *e, int n_edits,
                 float *work, struct row_pick *o) {
    const struct tmx_request_params *p = &r->p;
    const int n = s->n_vocab;
    const float *x = logits;
    if (!edited && n_edits > 0) {
        memcpy(work, logits, (size_t)n * sizeof *work);
        for (int i = 0; i < n_edits; i++)
            work[e[i].id] = tmx_logit_edit_apply(&e[i], work[e[i].id]);
        x = work;
    }
    o->tok = top ? tmx_sampler_sample_rest(r->sampler, top, x) : tmx_sampler_sample(r->sampler, x);
    o->n_top = 0;
    if (p->top_logprobs >= 0) {
        const double lse = log_sum_exp(logits, n);
        for (int i = 0; i < n && p->top_logprobs > 0; i++)
            top_add(o, p->top_logprobs, i, (float)(logits[i] - lse));
        o->logprob = (float)(logits[o->tok] - lse);
    }
}

/* --- events -------------------------------------------------------------------------------- */

static void finish(struct tmx_serve *s, struct request *r, enum tmx_finish why, const char *error) {
    struct tmx_token_event ev = {.id = r->id, .token = -1, .finish = why, .error = error,
                                 .n_prompt = r->p.n_prompt, .n_generated = r->n_gen};
    r->cb(r->arg, &ev);
    pthread_mutex_lock(&s->lock);
    s->metrics.finished[why]++;
    pthread_mutex_unlock(&s->lock);
}

static int is_stop(const struct tmx_serve *s, const struct request *r, int32_t tok) {
    const struct tmx_model_config *c = tmx_model_cfg(s->m);
    for (int i = 0; !r->p.ignore_eos && i < c->n_eos; i++)
        if (tok == c->eos_token_ids[i]) return 1;
    for (int i = 0; i < r->p.n_stop_ids; i++)
        if (tok == r->p.stop_ids[i]) return 1;
    return 0;
}

/* Row j of a top step: its first candidates. */
static struct tmx_sampler_top top_row(const struct tmx_serve *s, int j) {
    const size_t at = (size_t)j * TMX_TOPK_MAX;
    const double *st = s->top_stat + 3 * (size_t)j;
    return (struct tmx_sampler_top){TMX_TOPK_MAX, s->top_x + at, s->top_id + at, st[0],
                                    (int)st[1]};
}

/* r's next token from t, row j of a top step, into o, and its log probabilities as pick()
 * finds them in the whole row (the softmax at temperature 1 and the top_logprobs most likely,
 * the lower id first among equal ones), which lie among the candidates. o->tok is -1 when the
 * draw or the list needs more of the row (then pick() makes it, with the same random number). */
static void pick_top(const struct tmx_serve *s, struct request *r, const struct tmx_sampler_top *t,
                     int j, struct row_pick *o) {
    const float *x = t->x;
    const int32_t *id = t->id;
    const double *st = s->top_stat + 3 * (size_t)j;
    const int want = r->p.top_logprobs, known = t->n < TMX_TOPK_MAX ? t->n : TMX_TOPK_MAX;
    o->n_top = 0;
    /* want > known: pick() lists ids of -inf too */
    o->tok = want > known ? -1 : tmx_sampler_sample_top(r->sampler, t);
    if (o->tok < 0 || want < 0) return;
    const double lse = x[0] + log(st[2]);
    for (int i = 0; i < known; i++) {
        const float lp = (float)(x[i] - lse);
        if (id[i] == o->tok) o->logprob = lp;
        top_add(o, want, id[i], lp);
    }
}

/* Reports r's token o (with its log probabilities if r asked for them). Returns 1 when r is
 * finished. */
static int emit(struct tmx_serve *s, struct request *r, const struct row_pick *o) {
    struct tmx_token_event ev = {.id = r->id};
    const int32_t tok = o->tok;
    if (r->p.top_logprobs >= 0) {
        ev.logprob = o->logprob;
        ev.n_top = o->n_top;
        ev.top_ids = o->top_ids;
        ev.top_logprobs = o->top_lp;
    }
    r->tokens[r->n_tokens++] = tok;
    r->n_gen++;
    const double t = now();
    pthread_mutex_lock(&s->lock);
    s->metrics.generation_tokens++;
    if (r->n_gen == 1) observe(s->metrics.ttft_count, &s->metrics.ttft_sum, t - r->t_submit);
    else observe(s->metrics.itl_count, &s->metrics.itl_sum, t - r->t_last);
    pthread_mutex_unlock(&s->lock);
    r->t_last = t;
    ev.token = tok;
    ev.n_prompt = r->p.n_prompt;
    ev.n_generated = r->n_gen;
    if (is_stop(s, r, tok)) ev.finish = TMX_FINISH_STOP;
    else if (r->n_gen >= r->p.max_tokens) ev.finish = TMX_FINISH_LENGTH;
    r->cb(r->arg, &ev);
    if (ev.finish == TMX_FINISH_NONE) return 0;
    pthread_mutex_lock(&s->lock);
    s->metrics.finished[ev.finish]++;
    pthread_mutex_unlock(&s->lock);
    return 1;
}

/* --- the loop ------------------------------------------------------------------------------ */

static int div_up(int a, int b) { return (a + b - 1) / b; }

/* Full-attention blocks r still has to take to hold its first n positions (a request without
 * a sequence holds none). */
static int blocks_to_hold(const struct request *r, int n, int block_size) {
    const int held = r->seq ? div_up(tmx_seq_n_past(r->seq), block_size) : 0;
    const int want = div_up(n, block_size);
    return want > held ? want - held : 0;
}

/* Whether waiting request r, holding the cached prefix of its tokens, fits beside the running
 * requests: the full-attention pool's free blocks cover what each of them still needs for the
 * tokens it has, and the rest of r's tokens with up to a block of generation room. The
 * sliding-window pool is left out: a sequence holds no more of it than of the full pool, plus
 * a block, and a prompt chunk shrinks to what it has free. */
static int fits(struct tmx_serve *s, const struct request *r) {
    struct tmx_kv_usage u;
    tmx_model_kv_usage(s->m, &u);
    if (!u.full_total) return 1;
    int free_blocks = u.full_total - u.full_used;
    for (int i = 0; i < s->n_running; i++) {
        const struct request *q = s->running[i];
        if (q->seq) free_blocks -= blocks_to_hold(q, q->n_tokens, u.block_size);
    }
    const int to_go = r->p.max_tokens - r->n_gen;
    const int room = to_go < u.block_size ? to_go : u.block_size;
    return blocks_to_hold(r, r->n_tokens + room, u.block_size) <= free_blocks;
}

/* Moves waiting requests, in queue order, into the running set (kept in arrival order) while
 * it has a free slot and the KV cache room for the head, which first takes the cached prefix
 * of its tokens (with nothing running the head always fits: kv_tokens holds a context). The
 * prompt's prefix-cache look-up is counted when the request comes in, not when it comes back
 * after a preemption; it keeps its sampler then, so that its draws go on where they stopped.
 * A request that cannot start finishes with an error (reap collects it). Called with the lock
 * held, so that the head stays put while it is weighed; drops it to make the sampler. The
 * running set changes only under the lock (tmx_serve_cancel reads it). */
static void admit(struct tmx_serve *s) {
    while (s->wait_head && s->n_running < s->max_running) {
        struct request *r = s->wait_head;
        char *err = NULL;
        enum tmx_status st = tmx_seq_new(s->m, s->n_ctx, &r->seq, &err);
        if (st == TMX_OK) {
            r->n_fed = tmx_seq_prefix(r->seq, r->tokens, r->n_tokens);
            if (s->n_running > 0 && !fits(s, r)) {
                tmx_seq_free(r->seq); /* its blocks stay findable */
                r->seq = NULL;
                return;
            }
            if (!r->requeued && s->prefix_cache) {
                s->metrics.prefix_cache_queries += (uint64_t)r->n_tokens;
                s->metrics.prefix_cache_hits += (uint64_t)r->n_fed;
            }
        }
        s->wait_head = r->next;
        if (!s->wait_head) s->wait_tail = NULL;
        s->n_waiting--;
        int i = s->n_running++;
        for (; i > 0 && s->running[i - 1]->id > r->id; i--) s->running[i] = s->running[i - 1];
        s->running[i] = r;
        pthread_mutex_unlock(&s->lock);
        if (st == TMX_OK && !r->sampler)
            st = tmx_sampler_new(&r->p.sampling, s->n_vocab, &r->sampler, &err);
        if (st != TMX_OK) {
            tmx_seq_free(r->seq);
            r->seq = NULL;
            finish(s, r, TMX_FINISH_ERROR, err ? err : "out of memory");
        }
        free(err);
        pthread_mutex_lock(&s->lock);
    }
}

static enum tmx_finish end_as(struct tmx_serve *s, const struct request *r) {
    pthread_mutex_lock(&s->lock);
    const enum tmx_finish why = r->end_as;
    pthread_mutex_unlock(&s->lock);
    return why;
}

/* Gives r's blocks back now; reap returns it to the queue. */
static void preempt(struct tmx_serve *s, struct request *r) {
    tmx_seq_reset(r->seq);
    r->n_fed = 0;
    r->preempted = 1;
    pthread_mutex_lock(&s->lock);
    s->metrics.preemptions++;
    pthread_mutex_unlock(&s->lock);
}

/* The newest running request after running[i] that holds blocks and is not in the step's
 * batch, or -1. */
static int victim(const struct tmx_serve *s, int i, int n_batched) {
    for (int v = s->n_running - 1; v > i; v--) {
        const struct request *r = s->running[v];
        int batched = 0;
        for (int j = 0; j < n_batched; j++) batched |= s->b_req[j] == r;
        if (r->seq && tmx_seq_n_past(r->seq) > 0 && !batched) return v;
    }
    return -1;
}

/* Reserves positions for running[i]: n of them, or for a prompt chunk as many as the cache has
 * blocks for (halving n), and preempts newer requests outside the step's batch while not even
 * one fits. Returns the positions reserved; 0: none (the request waits for blocks). */
static int reserve(struct tmx_serve *s, int i, int n, int n_batched) {
    for (;;) {
        for (int m = n; m > 0; m /= 2)
            if (tmx_seq_reserve(s->running[i]->seq, m, NULL) == TMX_OK) return m;
        const int v = victim(s, i, n_batched);
        if (v < 0) return 0;
        preempt(s, s->running[v]);
    }
}

/* Adds n tokens of r at n_fed to the step's batch. */
static void batch_add(struct tmx_serve *s, int *nb, struct request *r, int n) {
    s->b_req[*nb] = r;
    s->b_seq[*nb] = r->seq;
    s->b_tok[*nb] = r->tokens + r->n_fed;
    s->b_n[*nb] = n;
    (*nb)++;
}

/* The draws over whole rows of a step: item i is row s->drawn[i]. */
struct draw_job {
    struct tmx_serve *s;
    int top; /* the step was a top step: the rows were read back, and carry their edits */
};

static void draw_row(void *arg, int64_t item, int thread) {
    const struct draw_job *d = arg;
    struct tmx_serve *s = d->s;
    const int j = s->drawn[item];
    struct request *r = s->b_req[j];
    const struct tmx_sampler_top t = d->top ? top_row(s, j) : (struct tmx_sampler_top){0};
    const int e0 = s->edit_starts[j];
    pick(s, r, s->logits + (size_t)j * s->vocab_size, d->top, d->top ? &t : NULL, s->edits + e0,
         s->edit_starts[j + 1] - e0, s->work + (size_t)thread * s->vocab_size, &s->picks[j]);
}

/* Ends r's run with an error (reap collects it). */
static void fail(struct tmx_serve *s, struct request *r, const char *msg) {
    finish(s, r, TMX_FINISH_ERROR, msg);
    tmx_seq_free(r->seq);
    r->seq = NULL;
}

/* One step: a decode token for every request past its prompt, then prompt chunks (a
 * recomputing request's tokens count as prompt) within the token budget, as one forward pass.
 * A request that is cancelled, finishes or fails loses its sequence (reap collects it). */
static void step(struct tmx_serve *s) {
    int budget = s->n_batch, nb = 0, stalled = -1;
    for (int i = 0; i < s->n_running; i++) { /* ended: before anyone waits on its blocks */
        struct request *r = s->running[i];
        const enum tmx_finish why = r->seq ? end_as(s, r) : TMX_FINISH_NONE;
        if (why != TMX_FINISH_NONE) {
            finish(s, r, why, NULL);
            tmx_seq_free(r->seq);
            r->seq = NULL;
        }
    }
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < s->n_running; i++) {
            struct request *r = s->running[i];
            if (!r->seq || r->preempted) continue;
            const int left = r->n_tokens - r->n_fed;
            const int decoding = r->n_gen > 0 && left == 1;
            if (decoding != (pass == 0) || budget <= 0) continue;
            const int n = reserve(s, i, left < budget ? left : budget, nb);
            if (n == 0) {
                if (stalled < 0 || i < stalled) stalled = i;
                continue;
            }
            batch_add(s, &nb, r, n);
            budget -= n;
        }
    if (nb == 0) {
        /* The oldest request that found no room preempted every newer one first, and the
         * older ones hold nothing: it holds every block in use and still cannot grow. A cache
         * of at least one context never gets here; this keeps a misfit from spinning. */
        if (stalled >= 0)
            fail(s, s->running[stalled], "the request needs more KV cache than the server has "
                 "(config key kv_tokens)");
        return;
    }
    /* what the step hands back: each row's argmax when every request that gets a token is
     * plain greedy, its first candidates when every one is plain or (the set edits logits)
     * takes no log probabilities, else its logits */
    int greedy = 1, top = tmx_model_can_top(s->m);
    const int can_edit = tmx_model_can_edit(s->m);
    size_t bound = 0;
    for (int j = 0; j < nb; j++) {
        const struct request *r = s->b_req[j];
        const int emits = r->n_fed + s->b_n[j] >= r->n_tokens;
        const float t = r->p.sampling.temperature;
        greedy &= !emits || (plain(r) && t == 0 && r->p.top_logprobs < 0);
        top &= !emits || plain(r) || (can_edit && r->p.top_logprobs < 0);
        s->temps[j] = t > 0 ? t : 1.0f; /* greedy: the first candidate */
        bound += emits ? edits_bound(r) : 0;
    }
    top &= !greedy;
    if (!edits_room(s, bound)) {
        for (int j = 0; j < nb; j++) fail(s, s->b_req[j], "out of memory for logit edits");
        return;
    }
    int n_edits = 0; /* those of the rows that get a token */
    for (int j = 0; !greedy && j < nb; j++) {
        const struct request *r = s->b_req[j];
        s->edit_starts[j] = n_edits;
        if (r->n_fed + s->b_n[j] >= r->n_tokens && !plain(r))
            n_edits += edits_of(s, r, s->edits + n_edits);
    }
    s->edit_starts[nb] = n_edits;
    char *err = NULL;
    enum tmx_status st =
        greedy ? tmx_model_step_greedy(s->m, s->b_seq, s->b_tok, s->b_n, nb, s->n_vocab, s->next,
                                       &err)
        : top  ? tmx_model_step_top(s->m, s->b_seq, s->b_tok, s->b_n, nb, s->n_vocab, s->temps,
                                    n_edits ? s->edit_starts : NULL, s->edits, s->top_x,
                                    s->top_id, s->top_stat, &err)
               : tmx_model_step(s->m, s->b_seq, s->b_tok, s->b_n, nb, s->logits, &err);
    /* Each row that gets a token takes it from the step's argmax, from its candidates, or
     * from a draw over its whole row (read back after a top step). Those draws are
     * independent and the costliest part of a sampled step, so they run on the draw threads;
     * the tokens are reported after, in row order. */
    int n_drawn = 0;
    for (int j = 0; j < nb; j++) {
        struct request *r = s->b_req[j];
        struct row_pick *o = &s->picks[j];
        o->tok = -2; /* no token this step */
        if (st != TMX_OK) {
            fail(s, r, err ? err : "forward pass failed");
            continue;
        }
        r->n_fed += s->b_n[j];
        if (r->n_fed < r->n_tokens) continue; /* more prompt to go */
        if (greedy) {
            o->tok = s->next[j];
            continue;
        }
        if (top) {
            const struct tmx_sampler_top t = top_row(s, j);
            pick_top(s, r, &t, j, o);
            if (o->tok >= 0) continue;
            char *rerr = NULL; /* past the candidates: the row, with the same random number */
            if (tmx_model_read_logits(s->m, j, s->logits + (size_t)j * s->vocab_size, &rerr) !=
                TMX_OK) {
                o->tok = -2;
                fail(s, r, rerr);
                free(rerr);
                continue;
            }
        }
        s->drawn[n_drawn++] = j;
    }
    struct draw_job job = {s, top};
    const struct tmx_threads *th = tmx_step_threads_get(s->draws);
    if (n_drawn > 1) th->run(th->pool, n_drawn, draw_row, &job);
    else if (n_drawn == 1) draw_row(&job, 0, 0);
    for (int j = 0; j < nb; j++) {
        struct request *r = s->b_req[j];
        if (s->picks[j].tok >= 0 && emit(s, r, &s->picks[j])) {
            tmx_seq_free(r->seq); /* finished */
            r->seq = NULL;
        }
    }
    free(err);
}

/* The metrics' share of the KV cache in use, once a step's ended requests gave their blocks
 * back (also when the step ran nothing: its last request was cancelled or stopped). */
static void note_kv_usage(struct tmx_serve *s) {
    struct tmx_kv_usage u;
    tmx_model_kv_usage(s->m, &u);
    pthread_mutex_lock(&s->lock);
    s->metrics.kv_usage = u.full_total ? (double)u.full_used / u.full_total
                          : u.sliding_total ? (double)u.sliding_used / u.sliding_total : 0.0;
    pthread_mutex_unlock(&s->lock);
}

/* Puts preempted r back in the queue in arrival order, which is ahead of every request that
 * has not run yet; it drops its sequence (empty) and keeps its sampler. Lock held. */
static void requeue(struct tmx_serve *s, struct request *r) {
    tmx_seq_free(r->seq);
    r->seq = NULL;
    r->preempted = 0;
    r->requeued = 1;
    struct request **pp = &s->wait_head;
    while (*pp && (*pp)->id < r->id) pp = &(*pp)->next;
    r->next = *pp;
    *pp = r;
    if (!r->next) s->wait_tail = r;
    s->n_waiting++;
}

/* Drops finished and ended requests from the running set (those cancelled or stopped during
 * the step get their last event here) and returns preempted ones to the queue. */
static void reap(struct tmx_serve *s, struct request **gone) {
    int kept = 0, n_gone = 0;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->n_running; i++) {
        struct request *r = s->running[i];
        if (!r->seq || r->end_as != TMX_FINISH_NONE) gone[n_gone++] = r;
        else if (r->preempted) requeue(s, r);
        else s->running[kept++] = r;
    }
    s->n_running = kept;
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < n_gone; i++) {
        if (gone[i]->seq) finish(s, gone[i], gone[i]->end_as, NULL); /* out of running: set */
        request_free(gone[i]);
    }
}

static void *loop(void *arg) {
    struct tmx_serve *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        admit(s);
        if (s->stopping) break;
        if (s->n_running == 0) {
            pthread_cond_wait(&s->wake, &s->lock);
            continue;
        }
        pthread_mutex_unlock(&s->lock);
        step(s);
        reap(s, s->gone);
        note_kv_usage(s);
        pthread_mutex_lock(&s->lock);
    }
    /* shutting down: everything still here is aborted */
    struct request *w = s->wait_head;
    s->wait_head = s->wait_tail = NULL;
    s->n_waiting = 0;
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < s->n_running; i++) {
        if (s->running[i]->seq) finish(s, s->running[i], TMX_FINISH_ABORT, NULL);
        request_free(s->running[i]);
    }
    s->n_running = 0;
    while (w) {
        struct request *next = w->next;
        finish(s, w, TMX_FINISH_ABORT, NULL);
        request_free(w);
        w = next;
    }
    return NULL;
}

/* One warm-up prompt: n tokens in a fresh sequence, a greedy step; then, with `decode`, one
 * decode step of each kind the scheduler makes (greedy, top where it takes top steps, logits).
 * Returns the decode steps made in *steps. */
static enum tmx_status warm_prompt(struct tmx_serve *s, int n, int decode, int *steps,
                                   char **err) {
    int32_t *tokens = malloc((size_t)n * sizeof *tokens), next = 0;
    if (!tokens) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) tokens[i] = i % s->n_vocab;
    struct tmx_seq *q = NULL;
    enum tmx_status st = tmx_seq_new(s->m, s->n_ctx, &q, err);
    if (st == TMX_OK) st = tmx_seq_reserve(q, n + 3, err);
    const int32_t *tok = tokens;
    int len = n;
    const float temp = 1.0f;
    if (st == TMX_OK) st = tmx_model_step_greedy(s->m, &q, &tok, &len, 1, s->n_vocab, &next, err);
    tok = &next;
    len = 1;
    for (int kind = 0; decode && st == TMX_OK && kind < 3; kind++) { /* greedy, top, logits */
        if (kind == 1 && !tmx_model_can_top(s->m)) continue;
        st = kind == 0 ? tmx_model_step_greedy(s->m, &q, &tok, &len, 1, s->n_vocab, &next, err)
           : kind == 1 ? tmx_model_step_top(s->m, &q, &tok, &len, 1, s->n_vocab, &temp, NULL,
                                            NULL, s->top_x, s->top_id, s->top_stat, err)
                       : tmx_model_step(s->m, &q, &tok, &len, 1, s->logits, err);
        *steps += st == TMX_OK;
    }
    tmx_seq_free(q);
    free(tokens);
    return st;
}

/* What the first requests would run, run before any arrives, so that they do not pay for first
 * calls and first touches: a prompt of a whole step's tokens (config key batch, at most the
 * context less 3; its buffers' pages are touched the first time a step is that wide), then one
 * decode step of each kind the scheduler makes (on CUDA the first launches load the modules,
 * cuBLASLt makes its first calls and the decode graphs of one sequence are recorded). On a
 * device, prompts of every power of two below it down to 16 too: cuBLASLt's kernels are loaded
 * when first used, and the CUDA set takes for a width the algorithm of the power of two at or
 * above it (option lt_buckets; a first prompt of a width no earlier call had paid 8-25 ms:
 * docs/perf/h200.md). The sequences are freed after; their prompts' blocks stay in the prefix
 * cache as any request's do. */
static enum tmx_status warm_up(struct tmx_serve *s, char **err) {
    const int n = s->n_batch < s->n_ctx - 3 ? s->n_batch : s->n_ctx - 3;
    if (n < 1) return TMX_OK; /* a context too short to bother */
    const double t0 = now();
    int below = 16; /* the largest power of two under n, where the device's prompts start */
    while (below <= (n - 1) / 2) below *= 2;
    const int powers = tmx_model_on_device(s->m) && below < n;
    int steps = 0;
    enum tmx_status st = warm_prompt(s, n, 1, &steps, err);
    for (int w = below; st == TMX_OK && powers && w >= 16; w /= 2)
        st = warm_prompt(s, w, 0, &steps, err);
    if (st == TMX_OK)
        tmx_log(TMX_LOG_INFO, "warm-up: a %d-token prompt%s and %d decode steps in %.1f ms", n,
                powers ? " (and prompts of every power of two below it, down to 16)" : "", steps,
                1e3 * (now() - t0));
    return st;
}

/* --- the public side ----------------------------------------------------------------------- */

enum tmx_status tmx_serve_new(struct tmx_engine *e, struct tmx_serve **out, char **err) {
    const struct tmx_config *cfg = tmx_engine_config(e);
    struct tmx_serve *s = calloc(1, sizeof *s);
    if (!s) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    s->e = e;
    s->m = tmx_engine_model(e);
    s->n_ctx = tmx_engine_n_ctx(e);
    struct tmx_kv_options kv; /* a step as the KV cache takes it: batch and max_running capped */
    tmx_model_kv_options(s->m, &kv);
    s->n_batch = kv.n_batch;
    s->max_running = kv.max_seqs;
    s->prefix_cache = kv.prefix_cache;
    s->max_waiting = (int)tmx_config_int(cfg, "max_waiting");
    s->vocab_size = tmx_model_cfg(s->m)->vocab_size;
    s->n_vocab = tmx_engine_n_vocab(e);
    s->next_id = 1;
    s->defaults = (struct tmx_sampling_defaults)TMX_SAMPLING_DEFAULTS;
    const struct tmx_sampling_defaults *gen = &tmx_model_cfg(s->m)->gen;
    if (gen->from_file && tmx_config_bool(cfg, "generation_config")) {
        s->defaults = *gen;
        tmx_log(TMX_LOG_INFO, "sampling defaults from generation_config.json (requests that set "
                "them override; config key generation_config=false drops them): temperature %g, "
                "top_p %g, top_k %d, min_p %g, repetition_penalty %g, max_tokens %d%s",
                (double)gen->temperature, (double)gen->top_p, gen->top_k, (double)gen->min_p,
                (double)gen->repetition_penalty, gen->max_tokens,
                gen->max_tokens ? "" : " (the context left)");
    }
    s->running = calloc((size_t)s->max_running, sizeof *s->running);
    s->gone = calloc((size_t)s->max_running, sizeof *s->gone);
    const size_t R = (size_t)s->max_running;
    s->logits = malloc(R * (size_t)s->vocab_size * sizeof *s->logits);
    s->next = malloc(R * sizeof *s->next);
    s->temps = malloc(R * sizeof *s->temps);
    s->top_x = malloc(R * TMX_TOPK_MAX * sizeof *s->top_x);
    s->top_id = malloc(R * TMX_TOPK_MAX * sizeof *s->top_id);
    s->top_stat = malloc(R * 3 * sizeof *s->top_stat);
    enum tmx_status st = tmx_step_threads_new(s->m, (int)tmx_config_int(cfg, "threads"),
                                              &s->draws, err);
    if (st != TMX_OK) {
        tmx_serve_free(s);
        return st;
    }
    const size_t n_threads = (size_t)tmx_step_threads_get(s->draws)->n_threads;
    s->work = malloc(n_threads * s->vocab_size * sizeof *s->work);
    s->picks = malloc(R * sizeof *s->picks);
    s->drawn = malloc(R * sizeof *s->drawn);
    s->edit_starts = malloc((R + 1) * sizeof *s->edit_starts);
    s->edit_at = calloc((size_t)s->vocab_size, sizeof *s->edit_at);
    s->b_seq = malloc(R * sizeof *s->b_seq);
    s->b_tok = malloc(R * sizeof *s->b_tok);
    s->b_n = malloc(R * sizeof *s->b_n);
    s->b_req = malloc(R * sizeof *s->b_req);
    if (!s->running || !s->gone || !s->logits || !s->next || !s->temps || !s->top_x ||
        !s->top_id || !s->top_stat || !s->work || !s->picks || !s->drawn || !s->edit_starts ||
        !s->edit_at || !s->b_seq || !s->b_tok || !s->b_n || !s->b_req) {
        tmx_serve_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    char *terr = NULL; /* no template is fine: chat requests get a clear 400 */
    st = tmx_chat_template_load(tmx_engine_model_dir(e), &s->chat, &s->special,
                                                &terr);
    if (st != TMX_OK && st != TMX_ERR_NOT_FOUND) {
        tmx_serve_free(s);
        return tmx_err(err, st, "%s", terr ? terr : "out of memory");
    }
    free(terr);
    if (tmx_config_bool(cfg, "warmup") && (st = warm_up(s, err)) != TMX_OK) {
        tmx_serve_free(s);
        return st;
    }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    if (pthread_create(&s->thread, NULL, loop, s) != 0) {
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->wake);
        s->thread = 0;
        tmx_serve_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "cannot start the scheduler thread");
    }
    *out = s;
    return TMX_OK;
}

void tmx_serve_free(struct tmx_serve *s) {
    if (!s) return;
    if (s->thread) {
        pthread_mutex_lock(&s->lock);
        s->stopping = 1;
        pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->lock);
        pthread_join(s->thread, NULL);
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->wake);
    }
    tmx_template_free(s->chat);
    json_decref(s->special);
    free(s->running);
    free(s->gone);
    free(s->logits);
    free(s->next);
    free(s->temps);
    free(s->top_x);
    free(s->top_id);
    free(s->top_stat);
    free(s->work);
    free(s->picks);
    free(s->drawn);
    tmx_step_threads_free(s->draws);
    free(s->edit_starts);
    free(s->edits);
    free(s->edit_at);
    free(s->b_seq);
    free(s->b_tok);
    free(s->b_n);
    free(s->b_req);
    free(s);
}

/* Copies the params' arrays into one allocation the request owns; checks every field. */
static enum tmx_status copy_params(const struct tmx_serve *s, const struct tmx_request_params *p,
                                   struct request *r, char **err) {
    if (p->n_prompt < 1 || !p->prompt)
        return tmx_err(err, TMX_ERR_INVALID, "prompt: at least one token is required");
    if (p->n_prompt >= s->n_ctx)
        return tmx_err(err, TMX_ERR_INVALID,
                       "prompt: %d tokens leave no room to generate in the context of %d",
                       p->n_prompt, s->n_ctx);
    if (p->max_tokens < 1)
        return tmx_err(err, TMX_ERR_INVALID, "max_tokens: must be at least 1 (got %d)",
                       p->max_tokens);
    if (p->top_logprobs < -1 || p->top_logprobs > TMX_MAX_TOP_LOGPROBS)
        return tmx_err(err, TMX_ERR_INVALID, "top_logprobs: must be 0..%d",
                       TMX_MAX_TOP_LOGPROBS);
    if (!(p->repetition_penalty > 0) || !isfinite(p->presence_penalty) ||
        !isfinite(p->frequency_penalty))
        return tmx_err(err, TMX_ERR_INVALID, "%s: must be finite%s",
                       !(p->repetition_penalty > 0) ? "repetition_penalty" : "penalties",
                       !(p->repetition_penalty > 0) ? " and > 0" : "");
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= s->n_vocab)
            return tmx_err(err, TMX_ERR_INVALID, "prompt: token id %d is out of range [0, %d)",
                           p->prompt[i], s->n_vocab);
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= s->n_vocab || !isfinite(p->bias_values[i]))
            return tmx_err(err, TMX_ERR_INVALID, "logit_bias: token %d is out of range or its "
                           "bias is not finite", p->bias_ids[i]);
    r->p = *p;
    r->p.max_tokens = p->max_tokens < s->n_ctx - p->n_prompt ? p->max_tokens
                                                               : s->n_ctx - p->n_prompt;
    const size_t nb = (size_t)p->n_bias, ns = (size_t)p->n_stop_ids;
    char *m = malloc(nb * (sizeof(int32_t) + sizeof(float)) + ns * sizeof(int32_t) + 1);
    r->tokens = malloc(((size_t)p->n_prompt + (size_t)r->p.max_tokens) * sizeof(int32_t));
    if (!m || !r->tokens) {
        free(m);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    r->owned = m;
    r->p.bias_ids = memcpy(m, p->bias_ids ? (const void *)p->bias_ids : "", nb * 4);
    r->p.bias_values = memcpy(m + nb * 4, p->bias_values ? (const void *)p->bias_values : "", nb * 4);
    r->p.stop_ids = memcpy(m + nb * 8, p->stop_ids ? (const void *)p->stop_ids : "", ns * 4);
    r->p.prompt = memcpy(r->tokens, p->prompt, (size_t)p->n_prompt * sizeof(int32_t));
    r->n_tokens = p->n_prompt;
    return TMX_OK;
}

enum tmx_status tmx_serve_submit(struct tmx_serve *s, const struct tmx_request_params *p,
                                 tmx_token_cb cb, void *arg, uint64_t *id, char **err) {
    struct request *r = calloc(1, sizeof *r);
    if (!r) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    enum tmx_status st = copy_params(s, p, r, err);
    if (st != TMX_OK) {
        request_free(r);
        return st;
    }
    r->cb = cb;
    r->arg = arg;
    r->t_submit = r->t_last = now();
    pthread_mutex_lock(&s->lock);
    if (s->n_waiting + s->n_running >= s->max_waiting + s->max_running) {
        pthread_mutex_unlock(&s->lock);
        request_free(r);
        return tmx_err(err, TMX_ERR_BUSY, "the server is busy: %d requests wait (config key "
                       "max_waiting); retry later", s->max_waiting);
    }
    r->id = *id = s->next_id++;
    if (s->wait_tail) s->wait_tail->next = r;
    else s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
    s->metrics.prompt_tokens += (uint64_t)p->n_prompt;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
    return TMX_OK;
}

/* Ends request id with `why` (ABORT or STOP), as tmx_serve_cancel says. */
static void end_request(struct tmx_serve *s, uint64_t id, enum tmx_finish why) {
    pthread_mutex_lock(&s->lock);
    /* a waiting request leaves the queue at once; a running one at the next step */
    for (struct request **pp = &s->wait_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        struct request *r = *pp;
        if (r->id != id) continue;
        *pp = r->next;
        if (s->wait_tail == r) s->wait_tail = prev;
        s->n_waiting--;
        pthread_mutex_unlock(&s->lock);
        finish(s, r, why, NULL);
        request_free(r);
        return;
    }
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id && s->running[i]->end_as == TMX_FINISH_NONE)
            s->running[i]->end_as = why;
    pthread_mutex_unlock(&s->lock);
}

void tmx_serve_cancel(struct tmx_serve *s, uint64_t id) { end_request(s, id, TMX_FINISH_ABORT); }

void tmx_serve_stop(struct tmx_serve *s, uint64_t id) { end_request(s, id, TMX_FINISH_STOP); }

void tmx_serve_metrics(struct tmx_serve *s, struct tmx_serve_metrics *m) {
    pthread_mutex_lock(&s->lock);
    *m = s->metrics;
    m->running = s->n_running;
    m->waiting = s->n_waiting;
    pthread_mutex_unlock(&s->lock);
}

/* --- the table api plugins get ------------------------------------------------------------- */

static enum tmx_status api_tokenize(struct tmx_serve *s, const char *text, size_t len,
                                    int parse_special, int32_t **ids, size_t *n_ids, char **err) {
    return tmx_tokenizer_encode(tmx_engine_tokenizer(s->e), text, len, parse_special, ids, n_ids,
                                err);
}

static const char *api_token_bytes(struct tmx_serve *s, int32_t id, size_t *len) {
    return id < s->n_vocab ? tmx_tokenizer_token_bytes(tmx_engine_tokenizer(s->e), id, len) : NULL;
}

static int api_token_special(struct tmx_serve *s, int32_t id) {
    return tmx_tokenizer_is_special(tmx_engine_tokenizer(s->e), id);
}

static int32_t api_find_token(struct tmx_serve *s, const char *text) {
    return tmx_tokenizer_find(tmx_engine_tokenizer(s->e), text);
}

static enum tmx_status api_chat_render(struct tmx_serve *s, const json_t *context, char **text,
                                       size_t *len, char **err) {
    if (!s->chat)
        return tmx_err(err, TMX_ERR_NOT_FOUND, "the model in %s has no chat template "
                       "(chat_template.jinja or tokenizer_config.json \"chat_template\")",
                       tmx_engine_model_dir(s->e));
    json_t *ctx = json_deep_copy(context);
    if (!ctx) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    const char *key;
    json_t *v;
    json_object_foreach(s->special, key, v) if (!json_object_get(ctx, key))
        json_object_set(ctx, key, v);
    enum tmx_status st = tmx_template_render(s->chat, ctx, NULL, text, len, err);
    json_decref(ctx);
    return st;
}

void tmx_serve_table(struct tmx_serve *s, const char *model_name, struct tmx_serve_i *out) {
    const struct tmx_model_config *c = tmx_model_cfg(s->m);
    *out = (struct tmx_serve_i){
        .struct_size = sizeof *out, .serve = s, .model_name = model_name,
        .max_model_len = s->n_ctx, .n_vocab = s->n_vocab, .eos_ids = c->eos_token_ids,
        .n_eos = c->n_eos, .bos_id = c->bos_token_id, .submit = tmx_serve_submit,
        .cancel = tmx_serve_cancel, .metrics = tmx_serve_metrics, .tokenize = api_tokenize,
        .token_bytes = api_token_bytes, .find_token = api_find_token,
        .chat_render = api_chat_render, .release = free,
        .max_requests = s->max_running + s->max_waiting, .token_special = api_token_special,
        .stop = tmx_serve_stop, .defaults = &s->defaults};
}
