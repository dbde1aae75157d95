/* test_eval.c: the statistics of tmx eval-kld (tmx/eval.h) against known values — Wilson
 * intervals from Newcombe (1998), the splitmix64 reference stream, normal quantiles, BCa
 * intervals from the Python mirror in tests/python/test_eval_kld.py, the bootstrap's large-
 * sample limit — and the row scoring and n-gram screen on cases worked by hand. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "tmx/eval.h"

#define Z95 1.959963984540054

/* Newcombe, "Two-sided confidence intervals for the single proportion", Statistics in Medicine
 * 17 (1998) 857-872, Table I, method 3 (score), to the 4 decimals printed there. */
static void test_wilson_matches_newcombe(void **state) {
    (void)state;
    static const struct { int64_t k, n; double lo, hi; } cases[] = {
        {81, 263, 0.2553, 0.3662}, {15, 148, 0.0624, 0.1605}, {0, 20, 0.0, 0.1611},
        {1, 29, 0.0061, 0.1718},   {29, 29, 0.8830, 1.0},     {0, 1, 0.0, 0.7935},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double lo, hi;
        tmx_eval_wilson(cases[i].k, cases[i].n, Z95, &lo, &hi);
        assert_true(fabs(lo - cases[i].lo) < 5e-5);
        assert_true(fabs(hi - cases[i].hi) < 5e-5);
    }
    double lo, hi;
    tmx_eval_wilson(0, 0, Z95, &lo, &hi);
    assert_true(lo == 0.0 && hi == 1.0);
}

static void test_normal_quantile(void **state) {
    (void)state;
    assert_true(fabs(tmx_eval_normal_quantile(0.975) - Z95) < 1e-13);
    assert_true(fabs(tmx_eval_normal_quantile(0.01) + 2.326347874040841) < 1e-13);
    assert_true(fabs(tmx_eval_normal_quantile(0.5)) < 1e-15);
    for (double p = 0.001; p < 1.0; p += 0.0737)
        assert_true(fabs(tmx_eval_normal_cdf(tmx_eval_normal_quantile(p)) - p) < 1e-14);
}

/* The reference outputs of splitmix64 seeded with 1234567 (Vigna's splitmix64.c; Java's
 * SplittableRandom gives the same). */
static void test_splitmix64_reference_stream(void **state) {
    (void)state;
    uint64_t s = 1234567;
    assert_true(tmx_eval_splitmix64(&s) == 6457827717110365317ull);
    assert_true(tmx_eval_splitmix64(&s) == 3203168211198807973ull);
    assert_true(tmx_eval_splitmix64(&s) == 9817491932198370423ull);
}

static struct tmx_eval_interval boot(const double *sum, const double *rows, int n, int B,
                                     uint64_t seed) {
    struct tmx_eval_interval ci;
    assert_int_equal(tmx_eval_bootstrap(sum, rows, n, B, seed, 0.95, &ci, NULL), TMX_OK);
    return ci;
}

/* bca() of tests/python/test_eval_kld.py on the same data prints these, to the last bit but
 * for summation order. */
static void test_bootstrap_known_values(void **state) {
    (void)state;
    const double sum[6] = {12.5, 30.1, 8.0, 20.2, 15.5, 4.9};
    const double rows[6] = {100, 100, 80, 120, 100, 50};
    const struct tmx_eval_interval a = boot(sum, rows, 6, 2000, 42);
    const struct tmx_eval_interval b = boot(sum, rows, 6, 2000, 43);
    assert_true(fabs(a.est - 0.16581818181818184) < 1e-15);
    assert_true(fabs(a.lo - 0.12452380952380952) < 1e-12);
    assert_true(fabs(a.hi - 0.25124999999999997) < 1e-12);
    assert_true(fabs(b.lo - 0.126) < 1e-12 && fabs(b.hi - 0.25134539025889435) < 1e-12);
    /* two windows, means 0.1 and 0.9: resamples take 0.1, 0.5 or 0.9 */
    const double s2[2] = {1.0, 9.0}, r2[2] = {10, 10};
    const struct tmx_eval_interval c = boot(s2, r2, 2, 5000, 7);
    assert_true(c.est == 0.5 && fabs(c.lo - 0.1) < 1e-15 && fabs(c.hi - 0.9) < 1e-15);
}

/* Same seed, same bits; one window or identical windows give a point. */
static void test_bootstrap_degenerate_and_repeatable(void **state) {
    (void)state;
    const double sum[6] = {12.5, 30.1, 8.0, 20.2, 15.5, 4.9};
    const double rows[6] = {100, 100, 80, 120, 100, 50};
    const struct tmx_eval_interval a = boot(sum, rows, 6, 500, 9), b = boot(sum, rows, 6, 500, 9);
    assert_memory_equal(&a, &b, sizeof a);
    const struct tmx_eval_interval one = boot(sum, rows, 1, 500, 9);
    assert_true(one.est == 0.125 && one.lo == 0.125 && one.hi == 0.125);
    const double zs[4] = {0}, zr[4] = {5, 5, 5, 5};
    const struct tmx_eval_interval zero = boot(zs, zr, 4, 500, 9);
    assert_true(zero.est == 0.0 && zero.lo == 0.0 && zero.hi == 0.0);
    struct tmx_eval_interval ci;
    char *err = NULL;
    assert_int_equal(tmx_eval_bootstrap(sum, rows, 0, 500, 9, 0.95, &ci, &err), TMX_ERR_INVALID);
    free(err);
}

/* 400 windows of equal size with normal means: the BCa interval is close to est +- 1.96 SE,
 * SE the standard error of the mean of the window means. */
static void test_bootstrap_large_sample_limit(void **state) {
    (void)state;
    enum { N = 400 };
    double sum[N], rows[N], mean = 0, var = 0;
    uint64_t s = 99;
    for (int i = 0; i < N; i++) { /* Box-Muller */
        const double u1 = ((tmx_eval_splitmix64(&s) >> 11) + 1.0) * 0x1.0p-53;
        const double u2 = (tmx_eval_splitmix64(&s) >> 11) * 0x1.0p-53;
        rows[i] = 100;
        sum[i] = 100 * (1.0 + 0.2 * sqrt(-2 * log(u1)) * cos(2 * M_PI * u2));
        mean += sum[i] / 100 / N;
    }
    for (int i = 0; i < N; i++) var += pow(sum[i] / 100 - mean, 2) / (N - 1);
    const double se = sqrt(var / N);
    const struct tmx_eval_interval ci = boot(sum, rows, N, 5000, 1);
    assert_true(fabs(ci.est - mean) < 1e-12);
    assert_true(fabs((ci.est - ci.lo) / (Z95 * se) - 1) < 0.08);
    assert_true(fabs((ci.hi - ci.est) / (Z95 * se) - 1) < 0.08);
}

/* KL of two distributions worked by hand; equal logits give exactly 0; ties go to the lower
 * id; log-probabilities of the target. */
static void test_score_row(void **state) {
    (void)state;
    const float t[3] = {logf(0.5f), logf(0.25f), logf(0.25f)};
    const float m[3] = {logf(0.25f), logf(0.5f), logf(0.25f)};
    struct tmx_eval_row r;
    tmx_eval_score_row(t, m, 3, 1, &r);
    /* 0.5 ln 2 + 0.25 ln(1/2) + 0 = 0.25 ln 2 (float logits: to ~1e-7) */
    assert_true(fabs(r.kld - 0.25 * log(2.0)) < 1e-7);
    assert_int_equal(r.teacher_top1, 0);
    assert_int_equal(r.model_top1, 1);
    assert_true(fabs(r.teacher_logp - log(0.25)) < 1e-7 && fabs(r.model_logp - log(0.5)) < 1e-7);
    const float x[4] = {3.0f, -1.0f, 3.0f, 1e-3f};
    tmx_eval_score_row(x, x, 4, 0, &r);
    assert_true(r.kld == 0.0);
    assert_int_equal(r.teacher_top1, 0);
    /* a shift of every logit changes nothing */
    const float y[4] = {103.0f, 99.0f, 103.0f, 100.001f};
    tmx_eval_score_row(x, y, 4, 0, &r);
    assert_true(fabs(r.kld) < 1e-9);
}

static void test_ngram_overlap(void **state) {
    (void)state;
    int32_t calib[40], text[20];
    for (int i = 0; i < 40; i++) calib[i] = i;
    struct tmx_ngram_set *s = NULL;
    assert_int_equal(tmx_ngram_set_new(calib, 40, 13, &s, NULL), TMX_OK);
    for (int i = 0; i < 20; i++) text[i] = 30 + i; /* 8 13-grams, all reaching past 39 */
    assert_true(tmx_ngram_set_overlap(s, text, 20) == 0.0);
    for (int i = 0; i < 20; i++) text[i] = 20 + i; /* every 13-gram is in calib */
    assert_true(tmx_ngram_set_overlap(s, text, 20) == 1.0);
    text[19] = 1000; /* the last 13-gram (start 7) is broken: 7 of 8 remain */
    assert_true(tmx_ngram_set_overlap(s, text, 20) == 7.0 / 8.0);
    assert_true(tmx_ngram_set_overlap(s, text, 12) == 0.0); /* shorter than one 13-gram */
    tmx_ngram_set_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wilson_matches_newcombe),
        cmocka_unit_test(test_normal_quantile),
        cmocka_unit_test(test_splitmix64_reference_stream),
        cmocka_unit_test(test_bootstrap_known_values),
        cmocka_unit_test(test_bootstrap_degenerate_and_repeatable),
        cmocka_unit_test(test_bootstrap_large_sample_limit),
        cmocka_unit_test(test_score_row),
        cmocka_unit_test(test_ngram_overlap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
