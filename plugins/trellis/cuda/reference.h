/* reference.h: what the device's registers and activation rows must hold, computed on the
 * CPU from the reference decoder (plugins/trellis): the bench compares the GPU with it, and
 * test_trellis_cuda_cpu checks it against the spec's tile values. */
#ifndef TMX_TRELLIS_CUDA_REFERENCE_H
#define TMX_TRELLIS_CUDA_REFERENCE_H

#include <stdint.h>

#include "trellis.h"

/* out[256]: the operand bytes of a tile as the device's lanes hold them, byte 8l + j from
 * lane l (trellis order): the E4M3 code (law e4m3) or the E4M3 byte of the E2M1 code. */
void trellis_ref_operands(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                          uint8_t *out);
/* The E4M3 byte of an E2M1 nibble's value (docs/trellismx.md §1.2). */
uint8_t trellis_ref_e2m1_as_e4m3(uint8_t nibble);
/* out[n] <- in[n] in kappa order (trellis_cuda.h): in[16h + 2q + (i & 1) + 8(i >> 1)] goes to
 * out[16h + 4q + i], n % 16 == 0. */
void trellis_ref_kappa(const uint8_t *in, int64_t n, uint8_t *out);

#endif
