/* tmx/sampler.h: picking the next token from logits.
 *
 * Order as in llama.cpp / vLLM: temperature 0 is greedy (argmax, lowest id on ties, NaN never
 * the largest: what a greedy step picks on the device, tmx/model.h); otherwise
 * logits / temperature -> top-k -> softmax -> top-p (nucleus) -> min-p (relative to the most
 * likely token) -> draw with a seeded PRNG. The filters and the draw walk the candidates from
 * the most likely down, the lower id first among equal logits, and one draw takes one number
 * from the PRNG. Time per draw: O(n_vocab) plus sorting the candidates the walk reaches. The
 * sampler owns its scratch memory (16 bytes per vocabulary entry). */
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

struct tmx_sampler;

/* Rejects out-of-range parameters with a message naming the parameter. */
enum tmx_status tmx_sampler_new(const struct tmx_sampler_params *p, int n_vocab,
                                struct tmx_sampler **out, char **err);
void tmx_sampler_free(struct tmx_sampler *s);
/* logits[n_vocab] is not modified. */
int32_t tmx_sampler_sample(struct tmx_sampler *s, const float *logits);

#endif
