/* impl.h: what the files of tmx-trellis share and keep to themselves. */
#ifndef TMX_TRELLIS_IMPL_H
#define TMX_TRELLIS_IMPL_H

#include "trellis.h"

/* tmx_err() without libtmx: *err (if err is non-NULL) gets a malloc'd message; returns st. */
enum tmx_status trellis_err(char **err, enum tmx_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* E4M3 byte / E2M1 nibble of round-to-nearest-even(x), as tmx_trellis_e4m3_round() and
 * tmx_trellis_e2m1_round() define them, for a double: quotients are rounded once, not twice. */
uint8_t trellis_e4m3_rne(double x);
uint8_t trellis_e2m1_rne(double x);

#define TRELLIS_HADAMARD_NORM 0x1.6a09e6p-4f /* f32(1/sqrt(128)) */

/* splitmix64: the generator behind random sign vectors and the Gaussian benchmark data. */
static inline uint64_t trellis_splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#endif
