/* sampler.c: greedy and temperature / top-k / top-p / min-p sampling with a seeded PRNG.
 *
 * The filters and the draw read the candidates in order of probability, but rarely more than
 * the first few hundred of them: instead of sorting the vocabulary, the sampler selects the
 * first ones and sorts only those (radix select and sort on one 64-bit number a candidate), and
 * more when a walk goes past them; an exp is taken for the softmax's sum and again for each
 * candidate a walk reaches. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/sampler.h"

struct tmx_sampler {
    struct tmx_sampler_params p;
    int n_vocab;
    uint64_t rng[4];   /* xoshiro256** state */
    double u;          /* a draw's number that tmx_sampler_sample_top took and left to
                          tmx_sampler_sample(_rest); < 0: none */
    uint64_t *cand;    /* [n_vocab] scratch: candidates (cand_make) */
    uint64_t *tmp;     /* [n_vocab] scratch: the radix sort's other buffer */
    float *prob;       /* [n_vocab] scratch: the probabilities of the first candidates */
    double *e;         /* [n_vocab] scratch: exp(logit - max) of a row's candidates, by id */
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
    if (s) {
        s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
        s->tmp = malloc((size_t)n_vocab * sizeof *s->tmp);
        s->prob = malloc((size_t)n_vocab * sizeof *s->prob);
        s->e = malloc((size_t)n_vocab * sizeof *s->e);
    }
    if (!s || !s->cand || !s->tmp || !s->prob || !s->e) {
        tmx_sampler_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    s->p = *p;
    s->n_vocab = n_vocab;
    uint64_t seed = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&seed);
    s->u = -1.0;
    *out = s;
    return TMX_OK;
}

void tmx_sampler_free(struct tmx_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->tmp);
    free(s->prob);
    free(s->e);
    free(s);
}

/* The lowest id of the largest logit, NaN never the largest (all NaN: 0), as the kernel sets'
 * argmax that greedy steps use (tmx/kernels.h). */
static int32_t argmax(const float *logits, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (!isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = i;
    return best < 0 ? 0 : best;
}

/* Candidate order: descending by logit, ascending id on ties. A candidate is one number whose
 * ascending order is that order: the logit's bits mapped so that larger floats give smaller
 * numbers (-0 as +0, equal as the order has them), then the id. The order is total, so every
 * way of sorting gives the same list and results are reproducible. */
static uint32_t flip(uint32_t u) { /* ascending floats -> descending keys, and back */
    return u ^ ~(uint32_t)((int32_t)u >> 31) >> 1; /* positive: all bits but the sign */
}

static uint64_t cand_make(float logit, int32_t id) {
    const float x = logit + 0.0f; /* -0 -> +0 */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint64_t)flip(u) << 32 | (uint32_t)id;
}

static float cand_logit(uint64_t c) {
    const uint32_t u = flip((uint32_t)(c >> 32));
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static int32_t cand_id(uint64_t c) { return (int32_t)(uint32_t)c; }

/* Sorts c[0..n) in candidate order: a least-significant-digit radix sort, a byte a pass,
 * skipping the bytes every candidate shares (an id's high bytes), through tmp[n]. */
static void sort_cands(uint64_t *c, int n, uint64_t *tmp) {
    uint32_t count[8][256] = {{0}};
    for (int i = 0; i < n; i++)
        for (int d = 0; d < 8; d++) count[d][c[i] >> 8 * d & 0xff]++;
    uint64_t *from = c, *to = tmp;
    for (int d = 0; d < 8; d++) {
        uint32_t *at = count[d], sum = 0;
        if (n == 0 || at[c[0] >> 8 * d & 0xff] == (uint32_t)n) continue;
        for (int b = 0; b < 256; b++) {
            const uint32_t m = at[b];
            at[b] = sum;
            sum += m;
        }
        for (int i = 0; i < n; i++) to[at[from[i] >> 8 * d & 0xff]++] = from[i];
        uint64_t *t = from;
        from = to;
        to = t;
    }
    if (from != c) memcpy(c, from, (size_t)n * sizeof *c);
}

/* Moves the `moved` candidates of c[lo..hi) whose byte at `shift` is below `below` to its
 * front (a Lomuto partition). When they are few the branch on the byte is all but always
 * right; otherwise which way a candidate goes is as good as random, and every candidate is
 * swapped, with no branch. */
static void partition(uint64_t *c, int lo, int hi, int shift, uint64_t below, int moved) {
    int front = lo; /* c[lo..front) are below, c[front..i) are not */
    if (moved < (hi - lo) / 16) {
        for (int i = lo; front < lo + moved; i++)
            if ((c[i] >> shift & 0xff) < below) {
                const uint64_t x = c[i];
                c[i] = c[front];
                c[front++] = x;
            }
        return;
    }
    for (int i = lo; i < hi; i++) {
        const uint64_t x = c[i];
        c[i] = c[front];
        c[front] = x;
        front += (x >> shift & 0xff) < below;
    }
}

/* Moves the k first candidates of c[0..n) (in candidate order) to c[0..k), unordered, for
 * 0 < k < n: a radix select from the most significant byte. Each round counts one byte over
 * the candidates not yet placed (in four tables: most share their first bytes, and one
 * table's increments would wait on each other) and finds the byte value that holds the k-th.
 * Those with a smaller byte are among the first k, those with a larger one are not: the ones
 * with a byte at most that value go to the front, and the smaller ones to the front of those.
 * Candidates are distinct (they hold their id), so at most 8 rounds, each O(n). */
static void radix_select(uint64_t *c, int n, int k) {
    int lo = 0, hi = n; /* c[0..lo) are among the first k, c[hi..n) are not */
    for (int shift = 56; shift >= 0 && lo < k && k < hi; shift -= 8) {
        uint32_t count[256] = {0}, part[3][256] = {{0}}; /* four counts: runs of one byte */
        int i = lo;
        for (; i + 4 <= hi; i += 4) {
            count[c[i] >> shift & 0xff]++;
            part[0][c[i + 1] >> shift & 0xff]++;
            part[1][c[i + 2] >> shift & 0xff]++;
            part[2][c[i + 3] >> shift & 0xff]++;
        }
        for (; i < hi; i++) count[c[i] >> shift & 0xff]++;
        for (int d = 0; d < 256; d++) count[d] += part[0][d] + part[1][d] + part[2][d];
        uint64_t b = 0;
        int below = lo;
        while (below + (int)count[b] < k) below += (int)count[b++];
        if ((int)count[b] == hi - lo) continue;
        const int front = below + (int)count[b];
        partition(c, lo, hi, shift, b + 1, front - lo);
        partition(c, lo, front, shift, b, below - lo);
        lo = below;
        hi = front;
    }
}

/* select_first's sample: in a range of at least 16 times as many candidates, when k is a
 * small share of it, a threshold from SAMPLE candidates spread over it (the one at k's share
 * plus two standard deviations of that estimate, so that it most often falls a little after
 * the k-th) lets one pass, which rarely moves a candidate, keep little more than the first k
 * for the radix select. */
enum { SAMPLE = 256 };

/* Moves the k first candidates of c[0..n) (in candidate order) to c[0..k), unordered, for
 * 0 < k < n, using tmp[SAMPLE]. */
static void select_first(uint64_t *c, int n, int k, uint64_t *tmp) {
    const double f = (double)k / n;
    const int want = (int)(f * SAMPLE + 2.0 * sqrt(SAMPLE * f * (1.0 - f)) + 1.0);
    if (n >= 16 * SAMPLE && want < SAMPLE / 4) {
        for (int j = 0; j < SAMPLE; j++) tmp[j] = c[(int64_t)j * n / SAMPLE];
        sort_cands(tmp, SAMPLE, tmp + SAMPLE);
        const uint64_t last = tmp[want];
        int front = 0;
        for (int i = 0; i < n; i++)
            if (c[i] <= last) {
                const uint64_t x = c[i];
                c[i] = c[front];
                c[front++] = x;
            }
        if (front >= k) { /* else the estimate fell short: all of c */
            if (front > k) radix_select(c, front, k);
            return;
        }
    }
    radix_select(c, n, k);
}

/* The draw works on the candidates in order but mostly reads only the first few: cand[0..n)
 * is sorted lazily, in chunks that grow eightfold, each selected from the unsorted rest and
 * sorted alone. */
enum { FIRST_CHUNK = 256, GROWTH = 8 };

struct order {
    uint64_t *cand;
    uint64_t *tmp; /* scratch for sort_cands */
    float *prob;   /* prob[i]: the probability of cand[i], for i < n_prob */
    const double *e; /* exp(logit - max) by id, computed for the sum (NULL: not kept) */
    int n;        /* candidates */
    int n_known;  /* cand[0..n_known) are at hand: n, or the first ones of a kernel set's topk */
    int past;     /* a walk needed a candidate past them */
    int n_sorted; /* cand[0..n_sorted) are the first n_sorted, in order */
    int n_prob;   /* prob[0..n_prob) are known (cand[0..n_prob) sorted) */
    float max;    /* the largest logit */
    double sum;   /* softmax denominator: the sum of exp(logit - max) over the candidates */
};

static void sort_upto(struct order *o, int k) {
    if (k <= o->n_sorted) return;
    int want = o->n_sorted * GROWTH > FIRST_CHUNK ? o->n_sorted * GROWTH : FIRST_CHUNK;
    if (want < k) want = k;
    if (want > o->n) want = o->n;
    uint64_t *rest = o->cand + o->n_sorted;
    const int m = want - o->n_sorted;
    if (want < o->n) select_first(rest, o->n - o->n_sorted, m, o->tmp);
    sort_cands(rest, m, o->tmp);
    o->n_sorted = want;
}

/* The probability of the i-th candidate in order (0 and o->past set past the known ones);
 * without o->e its exp is taken when a walk first reaches it. */
static float prob(struct order *o, int i) {
    if (i >= o->n_known) {
        o->past = 1;
        return 0.0f;
    }
    sort_upto(o, i + 1);
    for (; o->n_prob <= i; o->n_prob++) {
        const uint64_t c = o->cand[o->n_prob];
        const double e = o->e ? o->e[cand_id(c)] : exp((double)cand_logit(c) - o->max);
        o->prob[o->n_prob] = (float)(e / o->sum);
    }
    return o->prob[i];
}

/* The draw when the nucleus reaches past the known candidates (top_p alone). Its mass M is not
 * known, but lies in [top_p, top_p + q) for q the last known probability: the candidates come
 * in order, so the one that completes the nucleus is no likelier. The draw's target u M then
 * lies in [u top_p, u (top_p + q)); when that interval falls inside one known candidate's share
 * of the walk, with a margin for the whole row's rounding, that candidate is what the whole row
 * draws with this number. Otherwise -1, the number kept for tmx_sampler_sample. The interval
 * is u q wide, so a draw past the candidates' mass, or one whose interval straddles two shares
 * (likelier the flatter the candidates are), still needs the row. */
static int32_t draw_past_nucleus(struct tmx_sampler *s, struct order *o) {
    const double margin = 1e-12; /* far above a walk's rounding: 256 sums of 2^-53 */
    const double u = s->u >= 0.0 ? s->u : next_unit(s->rng);
    const double top_p = s->p.top_p, q = prob(o, o->n_known - 1);
    const double lo = u * top_p - margin, hi = u * (top_p + q) + margin;
    double cum = 0.0;
    for (int i = 0; i < o->n_known; i++) {
        const double before = cum;
        cum += prob(o, i);
        if (hi < cum) {
            if (before > lo) break;
            s->u = -1.0;
            return cand_id(s->cand[i]);
        }
    }
    s->u = u;
    return -1;
}

/* The filters and the draw over o's candidates, whose softmax denominator o->sum is. Returns
 * the pick, or -1 when a walk needs candidates past the known ones (the draw's number then
 * stays in s->u for tmx_sampler_sample). */
static int32_t walk(struct tmx_sampler *s, struct order *o) {
    const struct tmx_sampler_params *p = &s->p;
    int n = o->n;
    if (p->top_p < 1.0f) { /* the smallest prefix whose mass reaches top_p */
        double mass = 0.0;
        for (int i = 0; i < n; i++) {
            mass += prob(o, i);
            if (o->past) return p->min_p > 0.0f ? -1 : draw_past_nucleus(s, o);
            if (mass >= p->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        const float floor = p->min_p * prob(o, 0);
        int keep = 1;
        while (keep < n && prob(o, keep) >= floor) keep++;
        if (o->past) return -1;
        n = keep;
    }

    /* the kept mass: 1 when the filters kept every candidate (the probabilities' sum, but for
     * rounding), else the kept probabilities summed in order, which the filters computed */
    double mass = 1.0;
    if (n < o->n) {
        mass = 0.0;
        for (int i = 0; i < n; i++) mass += prob(o, i);
    }
    const double u = s->u >= 0.0 ? s->u : next_unit(s->rng);
    s->u = -1.0;
    double r = u * mass;
    for (int i = 0; i < n; i++) {
        r -= prob(o, i);
        if (o->past) break;
        if (r < 0.0) return cand_id(s->cand[i]);
    }
    if (o->past || n > o->n_known) { /* left to the whole row, with the same number */
        s->u = u;
        return -1;
    }
    return cand_id(s->cand[n - 1]); /* rounding left r >= 0 */
}

int32_t tmx_sampler_sample(struct tmx_sampler *s, const float *logits) {
    const struct tmx_sampler_params *p = &s->p;
    if (p->temperature == 0.0f) return argmax(logits, s->n_vocab);

    struct order o = {.cand = s->cand, .tmp = s->tmp, .prob = s->prob, .e = s->e,
                      .max = -INFINITY};
    /* every logit a candidate, in a loop without branches, unless some are NaN or -inf */
    int skip = 0;
    for (int i = 0; i < s->n_vocab; i++) {
        const float x = logits[i] / p->temperature;
        s->cand[i] = cand_make(x, i);
        o.max = x > o.max ? x : o.max;
        skip |= !(logits[i] > -INFINITY);
    }
    o.n = s->n_vocab;
    if (skip) {
        o.n = 0;
        o.max = -INFINITY;
        for (int i = 0; i < s->n_vocab; i++)
            if (!isnan(logits[i]) && logits[i] != -INFINITY) {
                const float x = logits[i] / p->temperature;
                s->cand[o.n++] = cand_make(x, i);
                o.max = x > o.max ? x : o.max;
            }
    }
    if (o.n == 0) return argmax(logits, s->n_vocab);
    if (p->top_k > 0 && p->top_k < o.n) { /* the survivors, all sorted */
        select_first(s->cand, o.n, p->top_k, s->tmp);
        o.n = p->top_k;
        sort_upto(&o, o.n);
    }
    o.n_known = o.n;

    /* softmax over the survivors: summed in order when top_k sorted them, else as they lie */
    for (int i = 0; i < o.n; i++) {
        const int32_t id = cand_id(s->cand[i]);
        s->e[id] = exp((double)cand_logit(s->cand[i]) - o.max);
        o.sum += s->e[id];
    }
    return walk(s, &o);
}

int32_t tmx_sampler_sample_top(struct tmx_sampler *s, const struct tmx_sampler_top *t) {
    const struct tmx_sampler_params *p = &s->p;
    if (p->temperature == 0.0f) return t->k > 0 && t->id[0] >= 0 ? t->id[0] : -1;
    if (t->n < 1 || t->k < 1) return -1; /* the whole row says what to do */
    const int known = t->k < t->n ? t->k : t->n;
    for (int i = 0; i < known; i++) s->cand[i] = cand_make(t->x[i] / p->temperature, t->id[i]);
    struct order o = {.cand = s->cand, .tmp = s->tmp, .prob = s->prob, .n = t->n,
                      .n_known = known, .n_sorted = known, .max = cand_logit(s->cand[0]),
                      .sum = t->sum};
    if (p->top_k > 0 && p->top_k < o.n) { /* as tmx_sampler_sample sums the survivors */
        if (p->top_k > known) return -1;
        o.n = o.n_known = o.n_sorted = p->top_k;
        o.sum = 0.0;
        for (int i = 0; i < o.n; i++) o.sum += exp((double)cand_logit(s->cand[i]) - o.max);
    }
    return walk(s, &o);
}

int32_t tmx_sampler_sample_rest(struct tmx_sampler *s, const struct tmx_sampler_top *t,
                                const float *logits) {
    const struct tmx_sampler_params *p = &s->p;
    const int known = t->k < t->n ? t->k : t->n;
    if (p->temperature == 0.0f || known < 1 || (p->top_k > 0 && p->top_k < t->n))
        return tmx_sampler_sample(s, logits); /* where tmx_sampler_sample_top wants the row */
    for (int i = 0; i < known; i++) {
        if (t->id[i] < 0 || t->id[i] >= s->n_vocab || !(logits[t->id[i]] == t->x[i]))
            return tmx_sampler_sample(s, logits); /* t is not this row's */
        s->cand[i] = cand_make(t->x[i] / p->temperature, t->id[i]);
    }
    const uint64_t last = s->cand[known - 1];
    int n = known;
    for (int i = 0; i < s->n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY) {
            const uint64_t c = cand_make(logits[i] / p->temperature, i);
            if (c > last && n++ < s->n_vocab) s->cand[n - 1] = c;
        }
    if (n != t->n) return tmx_sampler_sample(s, logits); /* nor is it */
    struct order o = {.cand = s->cand, .tmp = s->tmp, .prob = s->prob, .n = n, .n_known = n,
                      .n_sorted = known, .max = cand_logit(s->cand[0]), .sum = t->sum};
    return walk(s, &o);
}
