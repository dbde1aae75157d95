/* bitstream.c: a tile's K-bit symbols and its 32-bit words.
 *
 * A tile is a ring of 256*K bits, MSB-first: bit b is bit 31 - b%32 of word b/32. Symbol t is
 * bits [t*K, t*K + K) read MSB-first. The state of position t is the 16 bits that end where
 * symbol t ends, so it holds symbol t in its low K bits and the symbols before it above them;
 * for the first positions the window wraps around to the end of the ring (tail-biting). */
#include "impl.h"

static unsigned bit_at(const uint32_t *words, int b) {
    return (words[b >> 5] >> (31 - (b & 31))) & 1u;
}

void tmx_trellis_pack(const uint8_t *syms, int K, uint32_t *words) {
    /* Symbols enter the accumulator from the right; each full 32 bits leave as one word. */
    uint64_t acc = 0;
    int n = 0, w = 0;
    for (int t = 0; t < TMX_TRELLIS_TILE; t++) {
        acc = acc << K | syms[t];
        n += K;
        if (n >= 32) {
            n -= 32;
            words[w++] = (uint32_t)(acc >> n);
        }
    }
}

void tmx_trellis_unpack(const uint32_t *words, int K, uint8_t *syms) {
    uint64_t acc = 0;
    int n = 0, w = 0;
    for (int t = 0; t < TMX_TRELLIS_TILE; t++) {
        if (n < K) {
            acc = acc << 32 | words[w++];
            n += 32;
        }
        n -= K;
        syms[t] = (uint8_t)((acc >> n) & ((1u << K) - 1));
    }
}

uint16_t tmx_trellis_state(const uint32_t *words, int K, int t) {
    const int ring = TMX_TRELLIS_TILE * K, end = (t + 1) * K;
    unsigned s = 0;
    for (int i = 16; i > 0; i--) s = s << 1 | bit_at(words, (end - i + ring) % ring);
    return (uint16_t)s;
}

void tmx_trellis_states(const uint32_t *words, int K, uint16_t *states) {
    uint8_t syms[TMX_TRELLIS_TILE];
    tmx_trellis_unpack(words, K, syms);
    /* The state before position 0 is the last position's: the ring closes on itself. */
    unsigned s = tmx_trellis_state(words, K, TMX_TRELLIS_TILE - 1);
    for (int t = 0; t < TMX_TRELLIS_TILE; t++) {
        s = (s << K | syms[t]) & 0xffffu;
        states[t] = (uint16_t)s;
    }
}
