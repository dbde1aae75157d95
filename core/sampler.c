/* sampler.c: greedy and temperature / top-k / top-p / min-p sampling with a seeded PRNG.
 *
 * The filters and the draw read the candidates in order of probability, but rarely more than
 * the first few hundred of them: instead of sorting the vocabulary, the sampler selects the
 * first ones (quickselect) and sorts only those (a radix sort), and more when a walk goes past
 * them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/sampler.h"

struct cand {
    float logit;
    int32_t id;
};

struct tmx_sampler {
    struct tmx_sampler_params p;
    int n_vocab;
    uint64_t rng[4];   /* xoshiro256** state */
    double u;          /* a draw's number that tmx_sampler_sample_top took and left to
                          tmx_sampler_sample; < 0: none */
    struct cand *cand; /* [n_vocab] scratch */
    struct cand *tmp;  /* [n_vocab] scratch: the radix sort's other buffer */
    double *e;         /* [n_vocab] scratch: exp(logit - max) of the survivors, by token id */
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
        s->e = malloc((size_t)n_vocab * sizeof *s->e);
    }
    if (!s || !s->cand || !s->tmp || !s->e) {
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

/* Candidate order: descending by logit, ascending id on ties. The order is total, so every
 * way of sorting gives the same list and results are reproducible. */
static int before(const struct cand *x, const struct cand *y) {
    return x->logit > y->logit || (x->logit == y->logit && x->id < y->id);
}

/* The same order as one unsigned key, ascending: the logit's bits mapped so that larger
 * floats give smaller numbers (-0 as +0, equal as `before` has them), then the id. */
static uint64_t cand_key(struct cand c) {
    uint32_t u;
    memcpy(&u, &c.logit, sizeof u);
    if (u == 0x80000000u) u = 0;
    u = u & 0x80000000u ? u : ~u & 0x7fffffffu; /* ascending floats -> descending keys */
    return (uint64_t)u << 32 | (uint32_t)c.id;
}

/* Sorts c[0..n) in candidate order: a least-significant-digit radix sort on cand_key, a byte
 * a pass, skipping the bytes every key shares (an id's high bytes), through tmp[n]. */
static void sort_cands(struct cand *c, int n, struct cand *tmp) {
    uint32_t count[8][256] = {{0}};
    for (int i = 0; i < n; i++) {
        const uint64_t key = cand_key(c[i]);
        for (int d = 0; d < 8; d++) count[d][key >> 8 * d & 0xff]++;
    }
    struct cand *from = c, *to = tmp;
    for (int d = 0; d < 8; d++) {
        uint32_t *at = count[d], sum = 0;
        if (n == 0 || at[cand_key(c[0]) >> 8 * d & 0xff] == (uint32_t)n) continue;
        for (int b = 0; b < 256; b++) {
            const uint32_t m = at[b];
            at[b] = sum;
            sum += m;
        }
        for (int i = 0; i < n; i++) to[at[cand_key(from[i]) >> 8 * d & 0xff]++] = from[i];
        struct cand *t = from;
        from = to;
        to = t;
    }
    if (from != c) memcpy(c, from, (size_t)n * sizeof *c);
}

static void swap(struct cand *x, struct cand *y) {
    const struct cand t = *x;
    *x = *y;
    *y = t;
}

/* A pivot for selecting the first candidates of c[lo..hi) up to position k, moved to
 * c[hi - 1]. In a large range, SAMPLE candidates spread over it are moved to its front and
 * sorted, and the pivot is the sample's candidate at k's share of it plus two standard
 * deviations of that estimate, so that it most often falls a little after position k: one
 * partition then leaves little more than the k first. Otherwise the median of the first,
 * middle and last. */
enum { SAMPLE = 256 };

static void pivot_to_end(struct cand *c, int lo, int hi, int k, struct cand *tmp) {
    const int n = hi - lo;
    int at;
    if (n >= 16 * SAMPLE) {
        for (int j = 0; j < SAMPLE; j++) /* from c[lo + SAMPLE..hi), so none is moved twice */
            swap(&c[lo + j], &c[lo + SAMPLE + (int)((int64_t)j * (n - SAMPLE) / SAMPLE)]);
        sort_cands(c + lo, SAMPLE, tmp);
        const double f = (double)(k - lo) / n;
        const int want = (int)(f * SAMPLE + 2.0 * sqrt(SAMPLE * f * (1.0 - f)) + 1.0);
        at = lo + (want < SAMPLE - 1 ? want : SAMPLE - 1);
    } else {
        const int mid = lo + n / 2;
        if (before(&c[mid], &c[lo])) swap(&c[mid], &c[lo]);
        if (before(&c[hi - 1], &c[lo])) swap(&c[hi - 1], &c[lo]);
        if (before(&c[hi - 1], &c[mid])) swap(&c[hi - 1], &c[mid]);
        at = mid;
    }
    swap(&c[at], &c[hi - 1]);
}

/* Moves the k first candidates of c[0..n) (in candidate order) to c[0..k), unordered, for
 * 0 < k < n: quickselect. Partitions that keep coming out lopsided (an adversarial order) end
 * in a sort of what is left, so the worst case is O(n). */
static void select_first(struct cand *c, int n, int k, struct cand *tmp) {
    int lo = 0, hi = n, rounds = 64;
    while (lo < k && k < hi) { /* c[0..lo) are among the first k, c[hi..n) are not */
        if (rounds-- == 0) {
            sort_cands(c + lo, hi - lo, tmp);
            return;
        }
        pivot_to_end(c, lo, hi, k, tmp);
        const struct cand pivot = c[hi - 1];
        int store = lo;
        for (int i = lo; i < hi - 1; i++)
            if (before(&c[i], &pivot)) swap(&c[i], &c[store++]);
        swap(&c[store], &c[hi - 1]);
        if (store < k) lo = store + 1;
        else hi = store;
    }
}

/* The draw works on the candidates in order but mostly reads only the first few: cand[0..n)
 * is sorted lazily, in chunks that grow eightfold, each selected from the unsorted rest and
 * sorted alone. */
enum { FIRST_CHUNK = 256, GROWTH = 8 };

struct order {
    struct cand *cand;
    struct cand *tmp; /* scratch for sort_cands */
    const double *e; /* exp(logit - max) by token id */
    int n;        /* candidates */
    int n_known;  /* cand[0..n_known) are at hand: n, or the first ones of a kernel set's topk */
    int past;     /* a walk needed a candidate past them */
    int n_sorted; /* cand[0..n_sorted) are the first n_sorted, in order */
    int n_prob;   /* cand[0..n_prob) (sorted) hold probabilities instead of logits */
    float max;    /* the largest logit */
    double sum;   /* softmax denominator: the sum of e over the candidates */
};

static void sort_upto(struct order *o, int k) {
    if (k <= o->n_sorted) return;
    int want = o->n_sorted * GROWTH > FIRST_CHUNK ? o->n_sorted * GROWTH : FIRST_CHUNK;
    if (want < k) want = k;
    if (want > o->n) want = o->n;
    struct cand *rest = o->cand + o->n_sorted;
    const int m = want - o->n_sorted;
    if (want < o->n) select_first(rest, o->n - o->n_sorted, m, o->tmp);
    sort_cands(rest, m, o->tmp);
    o->n_sorted = want;
}

/* The probability of the i-th candidate in order (0 and o->past set past the known ones). */
static float prob(struct order *o, int i) {
    if (i >= o->n_known) {
        o->past = 1;
        return 0.0f;
    }
    sort_upto(o, i + 1);
    for (; o->n_prob <= i; o->n_prob++) {
        struct cand *c = &o->cand[o->n_prob];
        c->logit = (float)(o->e[c->id] / o->sum);
    }
    return o->cand[i].logit;
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
            return s->cand[i].id;
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
        if (r < 0.0) return s->cand[i].id;
    }
    if (o->past || n > o->n_known) { /* left to the whole row, with the same number */
        s->u = u;
        return -1;
    }
    return s->cand[n - 1].id; /* rounding left r >= 0 */
}

int32_t tmx_sampler_sample(struct tmx_sampler *s, const float *logits) {
    const struct tmx_sampler_params *p = &s->p;
    if (p->temperature == 0.0f) return argmax(logits, s->n_vocab);

    struct order o = {.cand = s->cand, .tmp = s->tmp, .e = s->e, .max = -INFINITY};
    for (int i = 0; i < s->n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY) {
            const float x = logits[i] / p->temperature;
            s->cand[o.n++] = (struct cand){x, i};
            o.max = x > o.max ? x : o.max;
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
        const int32_t id = s->cand[i].id;
        s->e[id] = exp((double)s->cand[i].logit - o.max);
        o.sum += s->e[id];
    }
    return walk(s, &o);
}

int32_t tmx_sampler_sample_top(struct tmx_sampler *s, const struct tmx_sampler_top *t) {
    const struct tmx_sampler_params *p = &s->p;
    if (p->temperature == 0.0f) return t->k > 0 && t->id[0] >= 0 ? t->id[0] : -1;
    if (t->n < 1 || t->k < 1) return -1; /* the whole row says what to do */
    const int known = t->k < t->n ? t->k : t->n;
    for (int i = 0; i < known; i++) s->cand[i] = (struct cand){t->x[i] / p->temperature, t->id[i]};
    struct order o = {.cand = s->cand, .tmp = s->tmp, .e = s->e, .n = t->n, .n_known = known,
                      .n_sorted = known, .max = s->cand[0].logit, .sum = t->sum};
    if (p->top_k > 0 && p->top_k < o.n) { /* as tmx_sampler_sample sums the survivors */
        if (p->top_k > known) return -1;
        o.n = o.n_known = o.n_sorted = p->top_k;
        o.sum = 0.0;
        for (int i = 0; i < o.n; i++) o.sum += exp((double)s->cand[i].logit - o.max);
    }
    for (int i = 0; i < o.n_known; i++)
        s->e[s->cand[i].id] = exp((double)s->cand[i].logit - o.max);
    return walk(s, &o);
}
