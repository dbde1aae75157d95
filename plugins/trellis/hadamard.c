/* hadamard.c: blockwise Hadamard-128 rotations and sign vectors.
 *
 * H is the normalized Sylvester Hadamard of order 128: H[i][j] = (-1)^popcount(i & j) /
 * sqrt(128). It is symmetric and orthonormal, so it is its own inverse. Activations are rotated
 * in f32 and then quantized, so the rounding of every step is part of the format: butterfly
 * stages h = 1, 2, 4, ..., 64 in that order, each pair (a, b) -> (a + b, a - b), then one
 * multiply by f32(1/sqrt(128)). */
#include "impl.h"

void tmx_trellis_hadamard(float *x, int64_t n) {
    for (int64_t b = 0; b < n; b += TMX_TRELLIS_HADAMARD) {
        float *y = x + b; /* [128] */
        for (int h = 1; h < TMX_TRELLIS_HADAMARD; h <<= 1)
            for (int i = 0; i < TMX_TRELLIS_HADAMARD; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float p = y[j], q = y[j + h];
                    y[j] = p + q;
                    y[j + h] = p - q;
                }
        for (int i = 0; i < TMX_TRELLIS_HADAMARD; i++) y[i] *= TRELLIS_HADAMARD_NORM;
    }
}

void tmx_trellis_signs_apply(const uint8_t *bits, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (bits[i >> 3] >> (i & 7) & 1) x[i] = -x[i];
}

void tmx_trellis_signs_random(uint64_t seed, uint8_t *bits, int64_t n) {
    uint64_t s = seed, r = 0;
    for (int64_t i = 0; i < n / 8; i++) {
        if (i % 8 == 0) r = trellis_splitmix64(&s);
        bits[i] = (uint8_t)(r >> (8 * (i % 8)));
    }
}

void tmx_trellis_rotate(const uint8_t *signs, float *x, int64_t n) {
    tmx_trellis_signs_apply(signs, x, n);
    tmx_trellis_hadamard(x, n);
}

void tmx_trellis_unrotate(const uint8_t *signs, float *x, int64_t n) {
    tmx_trellis_hadamard(x, n);
    tmx_trellis_signs_apply(signs, x, n);
}
