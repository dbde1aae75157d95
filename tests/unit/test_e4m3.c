/* test_e4m3.c: tmx_f32_to_e4m3 (tmx/tensor.h) against a reference that searches the 126 finite
 * magnitudes for the nearest one. Every code round-trips; values halfway between two codes go to
 * the even code; values above 448 saturate; a sweep over the floats up to 500 agrees with the
 * reference everywhere. The codes' values themselves are checked against the OCP formula. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "tmx/tensor.h"

/* OCP FP8 E4M3 magnitude of code c (0 .. 0x7e): bias 7, subnormals m/8 * 2^-6. */
static double ocp_value(int c) {
    int e = c >> 3, m = c & 7;
    return e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
}

/* The code nearest to f: the largest magnitude not above |f| or the next one, whichever is
 * closer, the even code on a tie; 448 and above saturate. Keeps the sign, so -0 is 0x80.
 * values[c] = ocp_value(c), increasing. */
static uint8_t reference(const double *values, float f) {
    uint8_t sign = signbit(f) ? 0x80 : 0;
    double a = fabs((double)f);
    if (a >= 448) return sign | 0x7e;
    int lo = 0, hi = 0x7e; /* values[lo] <= a < values[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (values[mid] <= a)
            lo = mid;
        else
            hi = mid;
    }
    double below = a - values[lo], above = values[hi] - a;
    if (below < above || (below == above && lo % 2 == 0)) return sign | (uint8_t)lo;
    return sign | (uint8_t)hi;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_decode_matches_ocp(void **state) {
    (void)state;
    for (int c = 0; c < 0x7f; c++) {
        assert_true(tmx_e4m3_to_f32((uint8_t)c) == ocp_value(c));
        assert_true(tmx_e4m3_to_f32((uint8_t)(c | 0x80)) == -ocp_value(c));
    }
    assert_true(isnan(tmx_e4m3_to_f32(0x7f)));
    assert_true(isnan(tmx_e4m3_to_f32(0xff)));
}

static void test_round_trip(void **state) {
    (void)state;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue; /* NaN */
        uint8_t got = tmx_f32_to_e4m3(tmx_e4m3_to_f32((uint8_t)c));
        if (got != c) fail_msg("code 0x%02x (%g) comes back as 0x%02x", c,
                               (double)tmx_e4m3_to_f32((uint8_t)c), got);
    }
}

/* Halfway between codes c and c + 1 is the even one of the two; one float either side of the
 * midpoint is the nearer code. The midpoints and their neighbours are exact floats. */
static void test_ties_to_even(void **state) {
    (void)state;
    for (int c = 0; c < 0x7e; c++)
        for (int neg = 0; neg < 2; neg++) {
            float s = neg ? -1.0f : 1.0f, mid = s * (float)((ocp_value(c) + ocp_value(c + 1)) / 2);
            uint8_t sign = neg ? 0x80 : 0, even = (uint8_t)(c % 2 == 0 ? c : c + 1);
            uint8_t low = tmx_f32_to_e4m3(nextafterf(mid, 0));
            uint8_t high = tmx_f32_to_e4m3(nextafterf(mid, s * INFINITY));
            if (tmx_f32_to_e4m3(mid) != (sign | even))
                fail_msg("%g: 0x%02x, want 0x%02x", (double)mid, tmx_f32_to_e4m3(mid),
                         sign | even);
            if (low != (sign | c) || high != (sign | (c + 1)))
                fail_msg("around %g: 0x%02x and 0x%02x, want 0x%02x and 0x%02x", (double)mid, low,
                         high, sign | c, sign | (c + 1));
        }
}

static void test_saturation_and_nan(void **state) {
    (void)state;
    const float big[] = {448.0f, 448.5f, 463.99f, 464.0f, 465.0f, 480.0f, 1e6f, 3.4e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(tmx_f32_to_e4m3(big[i]), 0x7e);
        assert_int_equal(tmx_f32_to_e4m3(-big[i]), 0xfe);
    }
    assert_int_equal(tmx_f32_to_e4m3(NAN) & 0x7f, 0x7f);
    assert_int_equal(tmx_f32_to_e4m3(0.0f), 0x00);
    assert_int_equal(tmx_f32_to_e4m3(-0.0f), 0x80);
    assert_int_equal(tmx_f32_to_e4m3(ldexpf(1, -11)), 0x00); /* a quarter of the least code */
    assert_int_equal(tmx_f32_to_e4m3(ldexpf(1, -10)), 0x00); /* half of it: tie to even 0 */
    assert_int_equal(tmx_f32_to_e4m3(ldexpf(3, -10)), 0x02); /* 1.5 codes: tie to even 2 */
}

/* Every 251st float from 0 to 500 (about 4.5 million) and every 7th between 2^-10 and 2^-5,
 * where E4M3 is subnormal (below 2^-6) and rounds in the other branch, both signs. */
static void test_sweep(void **state) {
    (void)state;
    double values[0x7f];
    for (int c = 0; c < 0x7f; c++) values[c] = ocp_value(c);
    /* 500, 2^-10 and 2^-5 */
    const uint32_t top = 0x43fa0000u, dense0 = 0x3a800000u, dense1 = 0x3d000000u;
    for (uint32_t u = 0; u <= top; u += u >= dense0 && u < dense1 ? 7 : 251) {
        float f = from_bits(u);
        for (int neg = 0; neg < 2; neg++, f = -f)
            if (tmx_f32_to_e4m3(f) != reference(values, f))
                fail_msg("%a: 0x%02x, want 0x%02x", (double)f, tmx_f32_to_e4m3(f),
                         reference(values, f));
    }
}

/* tmx_mxfp8_to_bf16 on every code under every UE8M0 scale (row r: scale r) gives the rounded
 * ldexpf of the code's value, as it was first written: subnormal results and 2^128 included. */
static void test_mxfp8_to_bf16(void **state) {
    (void)state;
    enum { M = 256, K = 256 };
    static uint8_t data[M * K + M * K / 32];
    static uint16_t out[M * K];
    for (int r = 0; r < M; r++) {
        for (int c = 0; c < K; c++) data[r * K + c] = (uint8_t)c;
        for (int b = 0; b < K / 32; b++) data[M * K + r * K / 32 + b] = (uint8_t)r;
    }
    const struct tmx_tensor mx = {TMX_DTYPE_MXFP8, 2, {M, K}, data};
    tmx_mxfp8_to_bf16(&mx, out);
    for (int r = 0; r < M; r++)
        for (int c = 0; c < K; c++) {
            uint16_t want = tmx_f32_to_bf16(ldexpf(tmx_e4m3_to_f32((uint8_t)c), r - 127));
            if (out[r * K + c] != want)
                fail_msg("code 0x%02x, scale %d: 0x%04x, want 0x%04x", c, r, out[r * K + c], want);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_matches_ocp),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_ties_to_even),
        cmocka_unit_test(test_saturation_and_nan),
        cmocka_unit_test(test_sweep),
        cmocka_unit_test(test_mxfp8_to_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
