/* test_sampler.c: greedy, the filters, the draw's distribution, seeding, parameter checks, the
 * partial sort against a reference that sorts the whole vocabulary, and draws from a row's
 * first candidates (tmx_sampler_sample_top) against draws from the whole row. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tmx/sampler.h"

static struct tmx_sampler *make(float temperature, int top_k, float top_p, float min_p,
                                uint64_t seed, int n_vocab) {
    struct tmx_sampler_params p = {temperature, top_k, top_p, min_p, seed};
    struct tmx_sampler *s = NULL;
    assert_int_equal(tmx_sampler_new(&p, n_vocab, &s, NULL), TMX_OK);
    return s;
}

static void test_greedy_takes_the_first_maximum(void **state) {
    (void)state;
    const float logits[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f, -INFINITY};
    struct tmx_sampler *s = make(0.0f, 0, 1.0f, 0.0f, 1, 6);
    assert_int_equal(tmx_sampler_sample(s, logits), 1);
    /* NaN is never the largest, first or not; a row of NaN gives 0 */
    const float with_nan[6] = {NAN, -3.0f, NAN, -2.0f, -2.5f, NAN};
    const float all_nan[6] = {NAN, NAN, NAN, NAN, NAN, NAN};
    assert_int_equal(tmx_sampler_sample(s, with_nan), 3);
    assert_int_equal(tmx_sampler_sample(s, all_nan), 0);
    tmx_sampler_free(s);
}

/* top_k = 1, a tiny top_p and min_p = 1 each leave only the most likely token. */
static void test_filters_that_leave_one_token(void **state) {
    (void)state;
    const float logits[5] = {0.1f, 0.3f, 3.0f, 0.2f, 2.9f};
    struct tmx_sampler *s[3] = {make(1.0f, 1, 1.0f, 0.0f, 7, 5), make(1.0f, 0, 1e-6f, 0.0f, 7, 5),
                                make(1.0f, 0, 1.0f, 1.0f, 7, 5)};
    for (int i = 0; i < 3; i++) {
        for (int r = 0; r < 200; r++) assert_int_equal(tmx_sampler_sample(s[i], logits), 2);
        tmx_sampler_free(s[i]);
    }
}

/* Frequencies of 200k draws at temperature T follow softmax(logits / T) within 4 sigma. */
static void test_draws_follow_the_softmax(void **state) {
    (void)state;
    enum { N = 5, DRAWS = 200000 };
    const float logits[N] = {1.0f, 0.0f, -1.0f, 2.0f, 0.5f}, T = 0.8f;
    struct tmx_sampler *s = make(T, 0, 1.0f, 0.0f, 42, N);
    int count[N] = {0};
    for (int i = 0; i < DRAWS; i++) count[tmx_sampler_sample(s, logits)]++;
    double z = 0.0;
    for (int i = 0; i < N; i++) z += exp(logits[i] / T);
    for (int i = 0; i < N; i++) {
        const double p = exp(logits[i] / T) / z, sigma = sqrt(p * (1 - p) / DRAWS);
        assert_true(fabs((double)count[i] / DRAWS - p) < 4 * sigma);
    }
    tmx_sampler_free(s);
}

/* top_p = 0.7 over probabilities {0.5, 0.3, 0.2}: the nucleus is the first two tokens; min_p
 * 0.5 drops the third (0.2 < 0.5 * 0.5). Neither ever draws token 2. */
static void test_nucleus_and_min_p_cut_the_tail(void **state) {
    (void)state;
    const float logits[3] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    struct tmx_sampler *s[2] = {make(1.0f, 0, 0.7f, 0.0f, 3, 3), make(1.0f, 0, 1.0f, 0.5f, 3, 3)};
    for (int i = 0; i < 2; i++) {
        int seen[3] = {0};
        for (int r = 0; r < 5000; r++) seen[tmx_sampler_sample(s[i], logits)]++;
        assert_true(seen[0] > 0 && seen[1] > 0);
        assert_int_equal(seen[2], 0);
        tmx_sampler_free(s[i]);
    }
}

static void test_same_seed_same_draws(void **state) {
    (void)state;
    float logits[64];
    for (int i = 0; i < 64; i++) logits[i] = sinf((float)i);
    struct tmx_sampler *a = make(1.0f, 0, 0.95f, 0.0f, 9, 64), *b = make(1.0f, 0, 0.95f, 0.0f, 9, 64),
                       *c = make(1.0f, 0, 0.95f, 0.0f, 10, 64);
    int differ = 0;
    for (int i = 0; i < 100; i++) {
        const int x = tmx_sampler_sample(a, logits);
        assert_int_equal(x, tmx_sampler_sample(b, logits));
        differ |= x != tmx_sampler_sample(c, logits);
    }
    assert_true(differ);
    tmx_sampler_free(a);
    tmx_sampler_free(b);
    tmx_sampler_free(c);
}

static void test_bad_parameters_are_named(void **state) {
    (void)state;
    const struct {
        struct tmx_sampler_params p;
        const char *name;
    } cases[] = {
        {{-0.5f, 0, 1.0f, 0.0f, 0}, "temperature"}, {{NAN, 0, 1.0f, 0.0f, 0}, "temperature"},
        {{1.0f, -1, 1.0f, 0.0f, 0}, "top_k"},       {{1.0f, 0, 0.0f, 0.0f, 0}, "top_p"},
        {{1.0f, 0, 1.5f, 0.0f, 0}, "top_p"},        {{1.0f, 0, 1.0f, -0.1f, 0}, "min_p"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tmx_sampler *s = NULL;
        char *err = NULL;
        assert_int_equal(tmx_sampler_new(&cases[i].p, 10, &s, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, cases[i].name));
        assert_null(s);
        free(err);
    }
}

/* --- the reference: the sampler as it was written first, sorting every candidate ----------- */

struct ref_cand {
    float logit;
    int32_t id;
};

static uint64_t ref_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t ref_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double ref_next_unit(uint64_t *s) { /* xoshiro256**, 53 bits */
    const uint64_t r = ref_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = ref_rotl(s[3], 45);
    return (double)(r >> 11) * 0x1.0p-53;
}

static int ref_cmp(const void *a, const void *b) {
    const struct ref_cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

static int32_t ref_sample(const struct tmx_sampler_params *p, uint64_t *rng,
                          struct ref_cand *cand, const float *logits, int n_vocab) {
    int n = 0;
    for (int i = 0; i < n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY)
            cand[n++] = (struct ref_cand){logits[i] / p->temperature, i};
    qsort(cand, (size_t)n, sizeof *cand, ref_cmp);
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;
    const int n_kept = n;
    const float max = cand[0].logit;
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)cand[i].logit - max);
    for (int i = 0; i < n; i++) cand[i].logit = (float)(exp((double)cand[i].logit - max) / sum);
    if (p->top_p < 1.0f) {
        double mass = 0.0;
        for (int i = 0; i < n; i++) {
            mass += cand[i].logit;
            if (mass >= p->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        const float floor = p->min_p * cand[0].logit;
        int keep = 1;
        while (keep < n && cand[keep].logit >= floor) keep++;
        n = keep;
    }
    double mass = 1.0; /* every candidate kept: 1 */
    if (n < n_kept) {
        mass = 0.0;
        for (int i = 0; i < n; i++) mass += cand[i].logit;
    }
    double r = ref_next_unit(rng) * mass;
    for (int i = 0; i < n; i++) {
        r -= cand[i].logit;
        if (r < 0.0) return cand[i].id;
    }
    return cand[n - 1].id;
}

/* Rows of logits the draws are checked on. */
enum shape { PEAKED, QUARTERS, SIGNED, TIED, FLAT, STRIDED };

/* logits[n] of a shape, from gen: a few that stand out, 17 distinct values (quarters), quarters
 * from -4 to 4 with every zero's sign drawn (-0 ties +0), all equal, all within 0.01, or within
 * 0.01 but 8 higher around every (n / 256)-th (where the sampler takes its sample for a
 * threshold, which then keeps too few: its fallback); -inf at 17 and NaN at 4000. */
static void fill_logits(float *logits, int n, enum shape shape, uint64_t *gen) {
    for (int i = 0; i < n; i++) {
        const double u = (double)(ref_splitmix64(gen) >> 11) * 0x1.0p-53;
        logits[i] = shape == PEAKED     ? (float)(24.0 * u * u * u * u)
                  : shape == QUARTERS ? roundf((float)(4.0 * u) * 4.0f) / 4.0f
                  : shape == SIGNED   ? roundf((float)(8.0 * u - 4.0) * 4.0f) / 4.0f
                  : shape == TIED     ? 1.5f
                                      : (float)(0.01 * u);
        if (shape == SIGNED && logits[i] == 0.0f && ref_splitmix64(gen) & 1) logits[i] = -0.0f;
    }
    for (int j = 0; shape == STRIDED && j < 256; j++)
        for (int i = (int)((int64_t)j * n / 256); i < (int)((int64_t)j * n / 256) + 4; i++)
            logits[i] += 8.0f;
    logits[17] = -INFINITY;
    logits[4000] = NAN;
}

/* The sampler sorts only the candidates its filters and draw reach: over vocabularies large
 * enough for its sampled pivots, logits with many ties (rounded to quarters, of both signs and
 * both zeros, or all equal), -inf and NaN, and every filter alone and together, it draws
 * exactly the reference's tokens from the same seeds. */
static void test_partial_sort_draws_what_a_full_sort_draws(void **state) {
    (void)state;
    enum { V = 6000, DRAWS = 12 };
    static const struct tmx_sampler_params settings[] = {
        {1.0f, 0, 1.0f, 0.0f, 1},   {0.7f, 0, 1.0f, 0.0f, 2},    {1.0f, 1, 1.0f, 0.0f, 3},
        {1.0f, 40, 1.0f, 0.0f, 4},  {1.3f, 300, 1.0f, 0.0f, 5},  {1.0f, 0, 0.9f, 0.0f, 6},
        {0.5f, 0, 0.5f, 0.0f, 7},   {2.0f, 0, 0.999f, 0.0f, 8},  {1.0f, 0, 1.0f, 0.05f, 9},
        {1.0f, 50, 0.9f, 0.1f, 10}, {3.0f, 0, 0.95f, 0.01f, 11}, {1.0f, 5000, 0.8f, 0.0f, 12},
    };
    float *logits = malloc(V * sizeof *logits);
    struct ref_cand *cand = malloc(V * sizeof *cand);
    assert_non_null(logits);
    assert_non_null(cand);
    uint64_t gen = 77;
    static const enum shape shapes[] = {PEAKED, QUARTERS, SIGNED, TIED, STRIDED};
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        fill_logits(logits, V, shapes[sh], &gen);
        for (size_t k = 0; k < sizeof settings / sizeof settings[0]; k++) {
            const struct tmx_sampler_params *p = &settings[k];
            struct tmx_sampler *s = make(p->temperature, p->top_k, p->top_p, p->min_p, p->seed, V);
            uint64_t seed = p->seed, rng[4];
            for (int i = 0; i < 4; i++) rng[i] = ref_splitmix64(&seed);
            for (int d = 0; d < DRAWS; d++)
                assert_int_equal(tmx_sampler_sample(s, logits), ref_sample(p, rng, cand, logits, V));
            tmx_sampler_free(s);
        }
    }
    free(logits);
    free(cand);
}

/* A row's first k candidates as kernels.cpu's topk gives them: sorted, the sum in id order. */
static void ref_top(const float *logits, int n_vocab, float temperature, int k,
                    struct ref_cand *cand, float *x, int32_t *id, struct tmx_sampler_top *t) {
    int n = 0;
    for (int i = 0; i < n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY)
            cand[n++] = (struct ref_cand){logits[i] / temperature, i};
    qsort(cand, (size_t)n, sizeof *cand, ref_cmp);
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY)
            sum += exp((double)(logits[i] / temperature) - cand[0].logit);
    for (int i = 0; i < k; i++) {
        x[i] = i < n ? logits[cand[i].id] : -INFINITY;
        id[i] = i < n ? cand[i].id : -1;
    }
    *t = (struct tmx_sampler_top){k, x, id, n ? sum : 0.0, n};
}

/* draws draws of `top` from candidates t, finished from the rest of the row
 * (tmx_sampler_sample_rest) when it returns -1, each checked against `row` drawing from the
 * row; returns the number of fallbacks. */
static int draw_both(struct tmx_sampler *top, struct tmx_sampler *row,
                     const struct tmx_sampler_top *t, const float *logits, int draws) {
    int fallbacks = 0;
    for (int d = 0; d < draws; d++) {
        int32_t got = tmx_sampler_sample_top(top, t);
        if (got < 0) {
            fallbacks++;
            got = tmx_sampler_sample_rest(top, t, logits);
        }
        assert_int_equal(got, tmx_sampler_sample(row, logits));
    }
    return fallbacks;
}

/* Two samplers of one seed draw the same tokens when one draws from the first k candidates and
 * finishes from the rest of the row only when it returns -1; with k = 256 the fallback never
 * comes for top_k <= 256 or a tight nucleus, and does come for plain sampling of a flat row. */
static void test_top_candidates_draw_what_the_row_draws(void **state) {
    (void)state;
    enum { V = 6000, DRAWS = 40 };
    static const struct tmx_sampler_params settings[] = {
        {1.0f, 0, 1.0f, 0.0f, 1},  {0.7f, 0, 1.0f, 0.0f, 2},   {1.0f, 1, 1.0f, 0.0f, 3},
        {1.0f, 40, 1.0f, 0.0f, 4}, {1.3f, 300, 1.0f, 0.0f, 5}, {1.0f, 0, 0.9f, 0.0f, 6},
        {0.5f, 0, 0.5f, 0.0f, 7},  {1.0f, 0, 1.0f, 0.05f, 9},  {1.0f, 50, 0.9f, 0.1f, 10},
        {0.0f, 0, 1.0f, 0.0f, 11},
    };
    static const int ks[] = {1, 7, 256};
    float *logits = malloc(V * sizeof *logits), x[256];
    int32_t id[256];
    struct ref_cand *cand = malloc(V * sizeof *cand);
    assert_non_null(logits);
    assert_non_null(cand);
    uint64_t gen = 99;
    static const enum shape shapes[] = {PEAKED, QUARTERS, FLAT};
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        fill_logits(logits, V, shapes[sh], &gen);
        for (size_t c = 0; c < sizeof settings / sizeof settings[0]; c++)
            for (size_t kk = 0; kk < sizeof ks / sizeof ks[0]; kk++) {
                const struct tmx_sampler_params *p = &settings[c];
                struct tmx_sampler *row = make(p->temperature, p->top_k, p->top_p, p->min_p,
                                               p->seed, V),
                                   *top = make(p->temperature, p->top_k, p->top_p, p->min_p,
                                               p->seed, V);
                struct tmx_sampler_top t;
                ref_top(logits, V, p->temperature > 0 ? p->temperature : 1.0f, ks[kk], cand, x, id,
                        &t);
                const int fallbacks = draw_both(top, row, &t, logits, DRAWS);
                const int fits = p->temperature == 0 || (p->top_k > 0 && p->top_k <= 256) ||
                                 (shapes[sh] == PEAKED && p->top_p < 1.0f);
                if (ks[kk] == 256 && fits) assert_int_equal(fallbacks, 0);
                if (ks[kk] == 256 && shapes[sh] == FLAT && p->temperature > 0 && p->top_k == 0)
                    assert_true(fallbacks > DRAWS / 2);
                tmx_sampler_free(row);
                tmx_sampler_free(top);
            }
    }
    free(logits);
    free(cand);
}

/* A nucleus that reaches past the candidates: 256 logits of about 4 hold ~71% of the mass and
 * 5,744 of about 0 the rest, top_p 0.95 (at two temperatures, several seeds), so every draw
 * needed the row before. A draw that lands inside the candidates whatever the nucleus's exact
 * mass takes them, the others read the row (about half here: with candidates this flat the
 * draw's interval often straddles two of them); every draw is the row's. */
static void test_nucleus_past_the_candidates(void **state) {
    (void)state;
    enum { V = 6000, K = 256, DRAWS = 200 };
    float *logits = malloc(V * sizeof *logits), x[K];
    int32_t id[K];
    struct ref_cand *cand = malloc(V * sizeof *cand);
    assert_non_null(logits);
    assert_non_null(cand);
    uint64_t gen = 7;
    for (int i = 0; i < V; i++)
        logits[i] = (i % 23 == 0 && i < 23 * K ? 4.0f : 0.0f) +
                    (float)(0.01 * (double)(ref_splitmix64(&gen) >> 11) * 0x1.0p-53);
    static const float temps[] = {1.0f, 0.9f};
    for (int ti = 0; ti < 2; ti++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            struct tmx_sampler *row = make(temps[ti], 0, 0.95f, 0.0f, seed, V),
                               *top = make(temps[ti], 0, 0.95f, 0.0f, seed, V);
            struct tmx_sampler_top t;
            ref_top(logits, V, temps[ti], K, cand, x, id, &t);
            const int fallbacks = draw_both(top, row, &t, logits, DRAWS);
            if (fallbacks < DRAWS / 10 || fallbacks > 3 * DRAWS / 4)
                fail_msg("temperature %g, seed %d: %d of %d draws read the row", temps[ti],
                         (int)seed, fallbacks, DRAWS);
            tmx_sampler_free(row);
            tmx_sampler_free(top);
        }
    free(logits);
    free(cand);
}

/* tmx_sampler_sample_rest given candidates that are not the row's first (another row's, or the
 * row's without its first) draws from the row alone, as tmx_sampler_sample does, and never
 * writes past its scratch. */
static void test_rest_of_another_row(void **state) {
    (void)state;
    enum { V = 6000, K = 256, DRAWS = 20 };
    float *logits = malloc(V * sizeof *logits), *other = malloc(V * sizeof *other), x[K];
    int32_t id[K];
    struct ref_cand *cand = malloc(V * sizeof *cand);
    assert_non_null(logits);
    assert_non_null(other);
    assert_non_null(cand);
    uint64_t gen = 5;
    fill_logits(logits, V, FLAT, &gen);
    fill_logits(other, V, PEAKED, &gen);
    for (int c = 0; c < 2; c++) {
        struct tmx_sampler_top t;
        ref_top(c ? logits : other, V, 1.0f, K, cand, x, id, &t);
        if (c) t = (struct tmx_sampler_top){K - 1, x + 1, id + 1, t.sum, t.n};
        struct tmx_sampler *rest = make(1.0f, 0, 1.0f, 0.0f, 3, V),
                           *row = make(1.0f, 0, 1.0f, 0.0f, 3, V);
        for (int d = 0; d < DRAWS; d++)
            assert_int_equal(tmx_sampler_sample_rest(rest, &t, logits),
                             tmx_sampler_sample(row, logits));
        tmx_sampler_free(rest);
        tmx_sampler_free(row);
    }
    free(logits);
    free(other);
    free(cand);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_takes_the_first_maximum),
        cmocka_unit_test(test_filters_that_leave_one_token),
        cmocka_unit_test(test_draws_follow_the_softmax),
        cmocka_unit_test(test_nucleus_and_min_p_cut_the_tail),
        cmocka_unit_test(test_same_seed_same_draws),
        cmocka_unit_test(test_bad_parameters_are_named),
        cmocka_unit_test(test_partial_sort_draws_what_a_full_sort_draws),
        cmocka_unit_test(test_top_candidates_draw_what_the_row_draws),
        cmocka_unit_test(test_nucleus_past_the_candidates),
        cmocka_unit_test(test_rest_of_another_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
