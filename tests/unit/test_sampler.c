/* test_sampler.c: greedy, the filters, the draw's distribution, seeding, parameter checks. */
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_takes_the_first_maximum),
        cmocka_unit_test(test_filters_that_leave_one_token),
        cmocka_unit_test(test_draws_follow_the_softmax),
        cmocka_unit_test(test_nucleus_and_min_p_cut_the_tail),
        cmocka_unit_test(test_same_seed_same_draws),
        cmocka_unit_test(test_bad_parameters_are_named),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
