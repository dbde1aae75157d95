/* act.c: the activation formats the expert matmuls multiply, and MXFP8 for other weights.
 *
 * Every scale that is not an E4M3 block scale is a power of two, chosen as the smallest that
 * fits the largest magnitude under the element format's maximum. Dividing by a power of two is
 * exact, so each element is one round-to-nearest-even of an exact value, and every
 * implementation produces the same bytes. The arithmetic below runs in double: each step is
 * exact or a single rounding of a value far from any E4M3/E2M1 tie (docs/trellismx.md says why),
 * so it equals rounding the exact quotient. */
#include <math.h>

#include "impl.h"
#include "tmx/tensor.h"

#define E4M3_MAX 448.0f
#define NVFP4_MAX 2688.0f /* 6 * 448: E2M1 max times E4M3 max */

int tmx_trellis_pow2_exp(float amax, float max) {
    if (amax == 0.0f) return 0;
    int ea, em;
    frexp(amax, &ea);
    frexp(max, &em);
    int e = ea - em - 1; /* max * 2^e < amax here; one or two steps up reach it */
    while ((double)amax > ldexp(max, e)) e++;
    return e < -127 ? -127 : e > 127 ? 127 : e;
}

static float absmax(const float *x, int64_t n) {
    float a = 0.0f;
    for (int64_t i = 0; i < n; i++) a = fmaxf(a, fabsf(x[i]));
    return a;
}

float tmx_trellis_act_e4m3(const float *x, int64_t n, uint8_t *q) {
    const int e = tmx_trellis_pow2_exp(absmax(x, n), E4M3_MAX);
    const double down = ldexp(1.0, -e); /* exact in double, and so is every product */
    for (int64_t i = 0; i < n; i++) q[i] = trellis_e4m3_rne(x[i] * down);
    return ldexpf(1.0f, e);
}

float tmx_trellis_act_nvfp4(const float *x, int64_t n, uint8_t *q, uint8_t *scales) {
    const int e = tmx_trellis_pow2_exp(absmax(x, n), NVFP4_MAX);
    for (int64_t b = 0; b < n / 16; b++) {
        const float *xb = x + 16 * b; /* [16] */
        uint8_t *qb = q + 8 * b;      /* [8] nibble pairs */
        const uint8_t s = trellis_e4m3_rne(ldexp(absmax(xb, 16), -e) / 6.0);
        const double d = ldexp(tmx_e4m3_to_f32(s), e); /* the block's step: exact */
        scales[b] = s;
        for (int i = 0; i < 16; i += 2) {
            const uint8_t lo = s ? trellis_e2m1_rne(xb[i] / d) : 0;
            const uint8_t hi = s ? trellis_e2m1_rne(xb[i + 1] / d) : 0;
            qb[i / 2] = (uint8_t)(lo | hi << 4);
        }
    }
    return ldexpf(1.0f, e);
}

void tmx_trellis_mxfp8_quantize(const float *x, int64_t n, uint8_t *q, uint8_t *scales) {
    for (int64_t b = 0; b < n / 32; b++) {
        const int e = tmx_trellis_pow2_exp(absmax(x + 32 * b, 32), E4M3_MAX);
        const double down = ldexp(1.0, -e); /* exact, as in tmx_trellis_act_e4m3 */
        scales[b] = (uint8_t)(e + 127);
        for (int i = 0; i < 32; i++) q[32 * b + i] = trellis_e4m3_rne(x[32 * b + i] * down);
    }
}
