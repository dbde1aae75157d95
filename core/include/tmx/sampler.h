/* tmx/sampler.h: picking the next token from logits.
 *
 * Order as in llama.cpp / vLLM: temperature 0 is greedy (argmax, lowest id on ties, NaN never
 * the largest: what a greedy step picks on the device, tmx/model.h); otherwise
 * logits / temperature -> top-k -> softmax -> top-p (nucleus) -> min-p (relative to the most
 * likely token) -> draw with a seeded PRNG. The filters and the draw walk the candidates from
 * the most likely down, the lower id first among equal logits, and one draw takes one number
 * from the PRNG, scaled by the kept probabilities' sum (1 when the filters keep every
 * candidate). Time per draw: O(n_vocab). The sampler owns its scratch memory (28 bytes per
 * vocabulary entry). */
#ifndef TMX_SAMPLER_H
#define TMX_SAMPLER_H

#include <stdint.h>

#include "tmx/status.h"

struct tmx_sampler_params {
    float temperature; /* 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off */
    float min_p;       /* 0: off */
    uint64_t seed;
};

/* What a request samples with when it does not say: OpenAI's defaults (temperature 1, top_p 1,
 * no top_k, min_p or repetition penalty, the context left for max_tokens), or those of a
 * model's generation_config.json (tmx_model_config.gen). */
struct tmx_sampling_defaults {
    float temperature, top_p, min_p, repetition_penalty;
    int top_k;
    int max_tokens; /* 0: the context left after the prompt */
    int from_file;  /* how many of them generation_config.json gave */
};
#define TMX_SAMPLING_DEFAULTS {1.0f, 1.0f, 0.0f, 1.0f, 0, 0, 0}

struct tmx_sampler;

/* Rejects out-of-range parameters with a message naming the parameter. */
enum tmx_status tmx_sampler_new(const struct tmx_sampler_params *p, int n_vocab,
                                struct tmx_sampler **out, char **err);
void tmx_sampler_free(struct tmx_sampler *s);
/* logits[n_vocab] is not modified. */
int32_t tmx_sampler_sample(struct tmx_sampler *s, const float *logits);

/* A row's first candidates where its logits are (a kernel set's topk, tmx/kernels.h, at the
 * sampler's temperature; temperature 0 reads only the first). */
struct tmx_sampler_top {
    int k;             /* candidates given */
    const float *x;    /* [k] their logits, in candidate order (by logit / temperature) */
    const int32_t *id; /* [k]; -1 past the row's last candidate */
    double sum;        /* over all the row's candidates: exp(y - y[0]), y = logit / temperature */
    int n;             /* the row's candidates */
};

/* The draw tmx_sampler_sample would make from the whole row, made from its first candidates
 * and its softmax denominator; the same token when `sum` is summed as tmx_sampler_sample sums
 * (in id order). Returns -1 when the draw needs more of the row: then call
 * tmx_sampler_sample_rest (or tmx_sampler_sample) with the row's logits next, which uses the
 * PRNG number this call took. */
int32_t tmx_sampler_sample_top(struct tmx_sampler *s, const struct tmx_sampler_top *t);

/* After tmx_sampler_sample_top(s, t) returned -1: the draw from t and logits[n_vocab], the row
 * t came from (not modified), with the number that call took. The draw tmx_sampler_sample
 * would make, when `sum` is summed as it sums, at a fraction of its cost on a long row: the
 * first candidates are not looked for again, the softmax takes t's sum, and only the
 * candidates the walk reaches get an exp. A t whose candidates or count are not the row's
 * gets tmx_sampler_sample's draw. */
int32_t tmx_sampler_sample_rest(struct tmx_sampler *s, const struct tmx_sampler_top *t,
                                const float *logits);

#endif
