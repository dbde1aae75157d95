/* laws.c: E4M3 and E2M1 rounding, and the two decode laws (state -> operand code).
 *
 * Both laws start from sigma(state), the byte sum of state * 0x83DCD12D, and round the same
 * unit-RMS fp16 value v(sigma) (EXL3's mul1 codebook): law e4m3 to an E4M3 byte, law e2m1
 * v / alpha to an E2M1 nibble. Only 1021 sigmas exist, so a law is a table, built here once. */
#include <math.h>
#include <string.h>

#include "impl.h"
#include "tmx/tensor.h"

#define E4M3_MAX_CODE 0x7e /* 448 */
#define E2M1_MAX_CODE 0x7  /* 6 */

/* Magnitude code of round-to-nearest-even(a) in a minifloat with `man` mantissa bits and
 * smallest normal exponent `emin`, saturating at code `max`; a >= 0 and not NaN. */
static unsigned minifloat_rne(double a, int man, int emin, unsigned max) {
    if (a == 0.0) return 0;
    if (isinf(a)) return max;
    int e;
    frexp(a, &e);
    e = e - 1 < emin ? emin : e - 1; /* a's exponent; subnormals take the smallest normal's */
    const double q = ldexp(a, man - e); /* a in steps of 2^(e - man): exact */
    double r = floor(q);
    if (q - r > 0.5 || (q - r == 0.5 && fmod(r, 2.0) == 1.0)) r += 1.0;
    /* Codes are (exponent field << man) + mantissa, subnormals included, so a mantissa that
     * rounds up to 2^(man+1) carries into the next exponent by itself. */
    const unsigned code = ((unsigned)(e - emin) << man) + (unsigned)r;
    return code > max ? max : code;
}

uint8_t trellis_e4m3_rne(double x) {
    if (isnan(x)) return 0x7f;
    const unsigned mag = minifloat_rne(fabs(x), 3, -6, E4M3_MAX_CODE);
    return (uint8_t)((signbit(x) ? 0x80u : 0u) | mag);
}

uint8_t trellis_e2m1_rne(double x) {
    if (isnan(x)) return E2M1_MAX_CODE;
    const unsigned mag = minifloat_rne(fabs(x), 1, 0, E2M1_MAX_CODE);
    return (uint8_t)((signbit(x) ? 0x8u : 0u) | mag);
}

float tmx_trellis_v(int sigma) {
    /* (1024 + sigma) * 1774/2^18 - 1329/2^7, exact as an integer over 2^18, rounded once to
     * fp16 (11 significant bits; |v| stays inside fp16's normal range). */
    const double exact = (double)(1774 * sigma - 905216) / 262144.0;
    int e;
    frexp(exact, &e);
    const double q = ldexp(exact, 11 - e);
    double r = floor(q);
    if (q - r > 0.5 || (q - r == 0.5 && fmod(r, 2.0) != 0.0)) r += 1.0;
    return (float)ldexp(r, e - 11);
}

uint8_t tmx_trellis_e4m3_round(float x) { return trellis_e4m3_rne(x); }
uint8_t tmx_trellis_e2m1_round(float x) { return trellis_e2m1_rne(x); }

float tmx_trellis_e2m1_to_f32(uint8_t nibble) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (nibble & 0x8u) ? -mag[nibble & 7u] : mag[nibble & 7u];
}

static const char *const law_names[] = {"e4m3", "e2m1"};

const char *tmx_trellis_law_name(enum tmx_trellis_law_id id) {
    return (unsigned)id < 2 ? law_names[id] : "?";
}

int tmx_trellis_law_from_name(const char *name) {
    for (int i = 0; i < 2; i++)
        if (strcmp(name, law_names[i]) == 0) return i;
    return -1;
}

enum tmx_status tmx_trellis_law_init(struct tmx_trellis_law *law, enum tmx_trellis_law_id id,
                                     float alpha, char **err) {
    if (id != TMX_TRELLIS_LAW_E4M3 && id != TMX_TRELLIS_LAW_E2M1)
        return trellis_err(err, TMX_ERR_INVALID, "trellis: unknown decode law %d", (int)id);
    if (id == TMX_TRELLIS_LAW_E2M1 && !(alpha > 0.0f && isfinite(alpha)))
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis law e2m1: alpha %g is not a positive finite number",
                           (double)alpha);
    law->id = id;
    law->alpha = id == TMX_TRELLIS_LAW_E2M1 ? alpha : 1.0f;
    for (int s = 0; s < TMX_TRELLIS_SIGMAS; s++) {
        const float v = tmx_trellis_v(s);
        if (id == TMX_TRELLIS_LAW_E4M3) {
            law->code[s] = trellis_e4m3_rne(v);
            law->value[s] = tmx_e4m3_to_f32(law->code[s]);
        } else {
            /* The double quotient is within 2^-53 of v/alpha, while a quotient that is not a
             * tie lies at least 2^-27 (relative) from every E2M1 tie (v has 11 significant
             * bits, alpha 24): rounding it equals rounding v/alpha. */
            law->code[s] = trellis_e2m1_rne((double)v / (double)law->alpha);
            law->value[s] = tmx_trellis_e2m1_to_f32(law->code[s]);
        }
    }
    return TMX_OK;
}

void tmx_trellis_decode_codes(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                              uint8_t *out) {
    uint16_t states[TMX_TRELLIS_TILE];
    tmx_trellis_states(words, K, states);
    if (law->id == TMX_TRELLIS_LAW_E4M3) {
        for (int t = 0; t < TMX_TRELLIS_TILE; t++) out[t] = law->code[tmx_trellis_sigma(states[t])];
        return;
    }
    for (int t = 0; t < TMX_TRELLIS_TILE; t += 2)
        out[t / 2] = (uint8_t)(law->code[tmx_trellis_sigma(states[t])] |
                               law->code[tmx_trellis_sigma(states[t + 1])] << 4);
}

void tmx_trellis_decode_values(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                               float *out) {
    uint16_t states[TMX_TRELLIS_TILE];
    tmx_trellis_states(words, K, states);
    for (int t = 0; t < TMX_TRELLIS_TILE; t++)
        out[tmx_trellis_pos(t)] = law->value[tmx_trellis_sigma(states[t])];
}
