/* reference.c: the device layout, computed on the CPU from plugins/trellis (reference.h). */
#include "reference.h"

uint8_t trellis_ref_e2m1_as_e4m3(uint8_t nibble) {
    static const uint8_t mag[8] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C};
    return (uint8_t)((nibble & 0x8 ? 0x80 : 0x00) | mag[nibble & 7]);
}

void trellis_ref_operands(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                          uint8_t *out) {
    if (law->id == TMX_TRELLIS_LAW_E4M3) {
        tmx_trellis_decode_codes(law, words, K, out);
        return;
    }
    uint8_t nib[TMX_TRELLIS_TILE / 2];
    tmx_trellis_decode_codes(law, words, K, nib);
    for (int t = 0; t < TMX_TRELLIS_TILE; t++)
        out[t] = trellis_ref_e2m1_as_e4m3(nib[t / 2] >> (4 * (t & 1)) & 0xf);
}

void trellis_ref_kappa(const uint8_t *in, int64_t n, uint8_t *out) {
    for (int64_t b = 0; b < n; b += 16)
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 4; i++)
                out[b + 4 * q + i] = in[b + 2 * q + (i & 1) + 8 * (i >> 1)];
}
