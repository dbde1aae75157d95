/* tiles.c: decoding tiles to operands and multiplying them with activations, the hot loop of
 * the codec plugins' CPU path.
 *
 * A tile is decoded in trellis order, eight positions (one mma lane l, §2) at a time: its
 * eight states lie in one 16 + 7K bit window of the ring, which a 64-bit shift register holds,
 * so eight shifts give the eight states. sigma is a multiply and a byte sum, and the law's
 * value table (1021 floats, in L1) gives the code values. Lane l's values sit at rows n0 and
 * n0 + 8 (n0 = l/4) and columns c, c+1, c+8, c+9 (c = 2(l%4)): multiplied by the block scales
 * of those rows (exact in f32) they are operands, and one 8-wide FMA with the activations laid
 * out in the same order (trellis_operands_lay) adds them into the partial sums of rows n0 and
 * n0 + 8. The operand values are the E4M3/E2M1 codes' exact values: multiplying them is
 * multiplying the codes.
 *
 * Vectors are GNU C vector extensions; with AVX2 the table lookup is a gather and the byte sum
 * two multiply-adds. */
#include <string.h>

#include "codec_impl.h"
#include "tmx/tensor.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));

static inline f32x8 v8_load(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8_store(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

/* The sum of the four bytes of each element. */
static inline u32x8 byte_sum(u32x8 x) {
#ifdef __AVX2__
    __m256i v;
    memcpy(&v, &x, sizeof v);
    v = _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
    memcpy(&x, &v, sizeof x);
    return x;
#else
    const u32x8 pairs = (x & 0x00ff00ffu) + (x >> 8 & 0x00ff00ffu);
    return (pairs & 0xffffu) + (pairs >> 16);
#endif
}

static inline f32x8 lookup(const float *table, u32x8 idx) {
#ifdef __AVX2__
    __m256i i;
    memcpy(&i, &idx, sizeof i);
    const __m256 r = _mm256_i32gather_ps(table, i, 4);
    f32x8 v;
    memcpy(&v, &r, sizeof v);
    return v;
#else
    return (f32x8){table[idx[0]], table[idx[1]], table[idx[2]], table[idx[3]],
                   table[idx[4]], table[idx[5]], table[idx[6]], table[idx[7]]};
#endif
}

/* The value of each legal block scale, 0x00..0x7E (E4M3: m 2^-9 below 0x08, else
 * (8 + m) 2^(e - 10)); 0x7F is never met. */
#define SCALE(c) \
    ((c) < 8 ? (float)(c) / 512.0f : (float)(8 + ((c) & 7)) * (float)(1 << ((c) >> 3)) / 1024.0f)
#define SCALES8(c) SCALE(c), SCALE(c + 1), SCALE(c + 2), SCALE(c + 3), SCALE(c + 4), \
                   SCALE(c + 5), SCALE(c + 6), SCALE(c + 7)
static const float scale_value[128] = {
    SCALES8(0),  SCALES8(8),  SCALES8(16), SCALES8(24), SCALES8(32),  SCALES8(40),
    SCALES8(48), SCALES8(56), SCALES8(64), SCALES8(72), SCALES8(80),  SCALES8(88),
    SCALES8(96), SCALES8(104), SCALES8(112), SCALES8(120)};

/* Block scales of one tile: rows[8], lane quad n0 gets B of rows n0 (elements 0..3) and n0 + 8
 * (elements 4..7). A tile's 16 columns lie in one block (block >= 16). */
static void tile_scales(const struct tmx_trellis_matrix *m, int64_t tr, int64_t tc,
                        f32x8 rows[8]) {
    const int64_t per_row = m->cols / m->block;
    const uint8_t *s = m->scales + 16 * tr * per_row + 16 * tc / m->block; /* [16] rows apart */
    for (int n0 = 0; n0 < 8; n0++) {
        const float a = scale_value[s[n0 * per_row] & 0x7f];
        const float b = scale_value[s[(n0 + 8) * per_row] & 0x7f];
        rows[n0] = (f32x8){a, a, a, a, b, b, b, b};
    }
}

/* out[256] <- the scaled code values of the tile with words w[8K], in trellis order. Inlined
 * once per K (decode), so that every lane's word index and shifts are constants. */
static inline __attribute__((always_inline)) void decode_k(const float *value,
                                                           const uint32_t *w, const int K,
                                                           const f32x8 scales[8], float *out) {
    const int nw = tmx_trellis_words(K);
    /* The ring with one word before it and two after, so that every window is three
     * consecutive words: ring bit b is bit b + 32 of ext. */
    uint32_t ext[8 * TMX_TRELLIS_K_MAX + 3];
    ext[0] = w[nw - 1];
    memcpy(ext + 1, w, (size_t)nw * sizeof *w);
    ext[nw + 1] = w[0];
    ext[nw + 2] = w[1];
    /* State j of a lane ends K(j + 1) bits into its window: even j in one shift, odd j in
     * the other, so that the two interleave into elements 0..7 in order. */
    const u64x4 even = {48, 48 - 2 * K, 48 - 4 * K, 48 - 6 * K};
    const u64x4 odd = {48 - K, 48 - 3 * K, 48 - 5 * K, 48 - 7 * K};
    for (int l = 0; l < 32; l++) {
        const int b = 8 * l * K + K - 16 + 32; /* first bit of state 0's window, in ext */
        const int i = b >> 5, off = b & 31;
        const uint64_t hi = (uint64_t)ext[i] << 32 | ext[i + 1];
        const uint64_t win = hi << off | ((uint64_t)ext[i + 2] << off) >> 32;
        const u64x4 wv = {win, win, win, win};
        const u32x8 states = (u32x8)((wv >> even & 0xffff) | (wv >> odd & 0xffff) << 32);
        const f32x8 v = lookup(value, byte_sum(states * TMX_TRELLIS_MUL));
        v8_store(out + 8 * l, v * scales[l >> 2]);
    }
}

/* decode_k for law e4m3-pair (docs/trellismx.md §14): the states of a lane's odd positions
 * (the odd shifts above) each give two codes, Q[s * M_i >> 22]: one multiply of the states,
 * doubled, by (M_0, M_1, M_0, ...), a shift and a gather of the values of Q (4 KB) give the
 * lane's eight values, without the 128 KB pair table. */
static inline __attribute__((always_inline)) void decode_pair_k(const float *q_value,
                                                                const uint32_t *w, const int K,
                                                                const f32x8 scales[8],
                                                                float *out) {
    const int nw = tmx_trellis_words(K);
    uint32_t ext[8 * TMX_TRELLIS_PAIR_K_MAX + 3]; /* as in decode_k */
    ext[0] = w[nw - 1];
    memcpy(ext + 1, w, (size_t)nw * sizeof *w);
    ext[nw + 1] = w[0];
    ext[nw + 2] = w[1];
    const u64x4 odd = {48 - K, 48 - 3 * K, 48 - 5 * K, 48 - 7 * K};
    const u32x8 mul = {TMX_TRELLIS_PAIR_M0, TMX_TRELLIS_PAIR_M1, TMX_TRELLIS_PAIR_M0,
                       TMX_TRELLIS_PAIR_M1, TMX_TRELLIS_PAIR_M0, TMX_TRELLIS_PAIR_M1,
                       TMX_TRELLIS_PAIR_M0, TMX_TRELLIS_PAIR_M1};
    for (int l = 0; l < 32; l++) {
        const int b = 8 * l * K + K - 16 + 32;
        const int i = b >> 5, off = b & 31;
        const uint64_t hi = (uint64_t)ext[i] << 32 | ext[i + 1];
        const uint64_t win = hi << off | ((uint64_t)ext[i + 2] << off) >> 32;
        const u64x4 wv = {win, win, win, win};
        const u32x8 states = (u32x8)(wv >> odd & 0xffff); /* in the even elements */
        const u32x8 twice = __builtin_shufflevector(states, states, 0, 0, 2, 2, 4, 4, 6, 6);
        const f32x8 v = lookup(q_value, twice * mul >> 22);
        v8_store(out + 8 * l, v * scales[l >> 2]);
    }
}

static void decode(const struct tmx_trellis_law *law, const uint32_t *w, int K,
                   const f32x8 scales[8], float *out) {
    if (law->id == TMX_TRELLIS_LAW_PAIR) {
        switch (K) {
        case 2: decode_pair_k(law->quantile_value, w, 2, scales, out); break;
        case 3: decode_pair_k(law->quantile_value, w, 3, scales, out); break;
        default: decode_pair_k(law->quantile_value, w, 4, scales, out); break;
        }
        return;
    }
    switch (K) {
    case 2: decode_k(law->value, w, 2, scales, out); break;
    case 3: decode_k(law->value, w, 3, scales, out); break;
    case 4: decode_k(law->value, w, 4, scales, out); break;
    case 5: decode_k(law->value, w, 5, scales, out); break;
    default: decode_k(law->value, w, 6, scales, out); break;
    }
}

void trellis_tile_operands(const struct tmx_trellis_matrix *m, int64_t tr, int64_t tc,
                           float *out) {
    f32x8 scales[8];
    tile_scales(m, tr, tc, scales);
    const int nw = tmx_trellis_words(m->K);
    decode(m->law, m->words + (tr * (m->cols / 16) + tc) * nw, m->K, scales, out);
}

void trellis_operands_lay(const float *x, int64_t cols, float *xp) {
    for (int64_t j = 0; j < cols / 16; j++)
        for (int q = 0; q < 4; q++) {
            const float *c = x + 16 * j + 2 * q;
            float *o = xp + 32 * j + 8 * q; /* [8] */
            o[0] = o[4] = c[0];
            o[1] = o[5] = c[1];
            o[2] = o[6] = c[8];
            o[3] = o[7] = c[9];
        }
}

void trellis_rows_mul(const struct tmx_trellis_matrix *m, int64_t r0, int64_t r1, int n,
                      const float *const *x, const float *xscale, float *const *y,
                      struct trellis_tiles_scratch *s) {
    const int64_t tiles_c = m->cols / 16; /* a multiple of 8, so of TRELLIS_CHUNK */
    const int nw = tmx_trellis_words(m->K);
    for (int64_t tr = r0 / 16; tr < r1 / 16; tr++) {
        memset(s->acc, 0, (size_t)n * sizeof s->acc[0]);
        f32x8 scales[8];
        for (int64_t tc0 = 0; tc0 < tiles_c; tc0 += TRELLIS_CHUNK) {
            for (int c = 0; c < TRELLIS_CHUNK; c++) {
                if ((16 * (tc0 + c)) % m->block == 0) tile_scales(m, tr, tc0 + c, scales);
                decode(m->law, m->words + (tr * tiles_c + tc0 + c) * nw, m->K, scales,
                       s->tiles[c]);
            }
            for (int i = 0; i < n; i++) {
                f32x8 acc[8]; /* lane quad n0: rows n0 (elements 0..3) and n0 + 8 (4..7) */
                for (int q = 0; q < 8; q++) acc[q] = v8_load(s->acc[i] + 8 * q);
                for (int c = 0; c < TRELLIS_CHUNK; c++) {
                    const float *xq = x[i] + 32 * (tc0 + c); /* [4][8] */
                    const f32x8 x0 = v8_load(xq), x1 = v8_load(xq + 8), x2 = v8_load(xq + 16),
                                x3 = v8_load(xq + 24);
                    const float *t = s->tiles[c];
                    for (int q = 0; q < 8; q++) {
                        acc[q] += v8_load(t + 32 * q) * x0;
                        acc[q] += v8_load(t + 32 * q + 8) * x1;
                        acc[q] += v8_load(t + 32 * q + 16) * x2;
                        acc[q] += v8_load(t + 32 * q + 24) * x3;
                    }
                }
                for (int q = 0; q < 8; q++) v8_store(s->acc[i] + 8 * q, acc[q]);
            }
        }
        for (int i = 0; i < n; i++) {
            const float scale = m->scale * xscale[i]; /* g and the vector's scale (§7) */
            float *out = y[i] + 16 * tr;
            for (int q = 0; q < 8; q++) {
                const float *a = s->acc[i] + 8 * q;
                out[q] = ((a[0] + a[1]) + (a[2] + a[3])) * scale;
                out[q + 8] = ((a[4] + a[5]) + (a[6] + a[7])) * scale;
            }
        }
    }
}
