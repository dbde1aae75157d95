/* sampler.c: greedy and temperature / top-k / top-p / min-p sampling with a seeded PRNG. */
#include <math.h>
#include <stdlib.h>

#include "tmx/sampler.h"

struct cand {
    float logit;
    int32_t id;
};

struct tmx_sampler {
    struct tmx_sampler_params p;
    int n_vocab;
    uint64_t rng[4];   /* xoshiro256** state */
    struct cand *cand; /* [n_vocab] scratch */
};

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t next_u64(uint64_t *s) {
    const uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Uniform in [0, 1) with 53 random bits. */
static double next_unit(uint64_t *s) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

enum tmx_status tmx_sampler_new(const struct tmx_sampler_params *p, int n_vocab,
                                struct tmx_sampler **out, char **err) {
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return tmx_err(err, TMX_ERR_INVALID, "temperature must be >= 0 (got %g)", p->temperature);
    if (p->top_k < 0) return tmx_err(err, TMX_ERR_INVALID, "top_k must be >= 0 (got %d)", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return tmx_err(err, TMX_ERR_INVALID, "top_p must be in (0, 1] (got %g)", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return tmx_err(err, TMX_ERR_INVALID, "min_p must be in [0, 1] (got %g)", p->min_p);
    if (n_vocab < 1) return tmx_err(err, TMX_ERR_INVALID, "sampler: empty vocabulary");
    struct tmx_sampler *s = calloc(1, sizeof *s);
    if (s) s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    if (!s || !s->cand) {
        tmx_sampler_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    s->p = *p;
    s->n_vocab = n_vocab;
    uint64_t seed = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&seed);
    *out = s;
    return TMX_OK;
}

void tmx_sampler_free(struct tmx_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s);
}

static int32_t argmax(const float *logits, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* Descending by logit, ascending id on ties: the order is total, so results are reproducible. */
static int cand_cmp(const void *a, const void *b) {
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t tmx_sampler_sample(struct tmx_sampler *s, const float *logits) {
    const struct tmx_sampler_params *p = &s->p;
    if (p->temperature == 0.0f) return argmax(logits, s->n_vocab);

    int n = 0;
    for (int i = 0; i < s->n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY)
            s->cand[n++] = (struct cand){logits[i] / p->temperature, i};
    if (n == 0) return argmax(logits, s->n_vocab);
    qsort(s->cand, (size_t)n, sizeof *s->cand, cand_cmp);
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;

    /* softmax over the survivors; cand[].logit becomes the probability */
    const float max = s->cand[0].logit;
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)s->cand[i].logit - max);
    for (int i = 0; i < n; i++) s->cand[i].logit = (float)(exp((double)s->cand[i].logit - max) / sum);

    if (p->top_p < 1.0f) { /* the smallest prefix whose mass reaches top_p */
        double mass = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            mass += s->cand[i].logit;
            if (mass >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        const float floor = p->min_p * s->cand[0].logit;
        int keep = 1;
        while (keep < n && s->cand[keep].logit >= floor) keep++;
        n = keep;
    }

    double mass = 0.0;
    for (int i = 0; i < n; i++) mass += s->cand[i].logit;
    double r = next_unit(s->rng) * mass;
    for (int i = 0; i < n; i++) {
        r -= s->cand[i].logit;
        if (r < 0.0) return s->cand[i].id;
    }
    return s->cand[n - 1].id;
}
