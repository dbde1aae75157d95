/* trellis.h: the TrellisMX v1 codec core. docs/trellismx.md is the normative spec; this header
 * names its rules and the functions that implement them.
 *
 * tmx-trellis is a static library linked into both codec plugins, the encoder and the tests.
 * Plugins link nothing of the core, so neither does this library: its messages are malloc'd
 * one-line strings made the way tmx_err() makes them (the caller frees them with free()).
 *
 * Vocabulary:
 * - A tile is a 16x16 block of a weight matrix W[n_out][k_in]: 256 weights of K bits each
 *   (K = 2..6), stored as 8*K uint32 words. Bit b of the tile is bit 31 - b%32 of word b/32.
 * - Trellis position t (0..255) owns bits [t*K, t*K + K) and holds the weight at tile index
 *   tmx_trellis_pos(t): the mma m16n8k16 B-fragment order.
 * - Its state is the 16-bit window of bits ending at bit (t+1)*K, read around the tile's end.
 * - A decode law maps a state to an operand code: an E4M3 byte (law e4m3) or an E2M1 nibble
 *   (law e2m1), through sigma(state), the byte sum of state * 0x83DCD12D, and v(sigma). The
 *   experimental law e4m3-pair (not TrellisMX v1, docs/trellismx.md §14) maps the state of
 *   every odd position 2t + 1 to the E4M3 codes of positions 2t and 2t + 1, by a table of
 *   65536 pairs; its searches step two positions (2K bits) at a time, so K is 2..4.
 * - "Tile order" for float data means tile row-major: index 16*r + c, r the output row (n) and
 *   c the input column (k) inside the tile. */
#ifndef TMX_TRELLIS_H
#define TMX_TRELLIS_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"

#define TMX_TRELLIS_VERSION 1
#define TMX_TRELLIS_TILE 256        /* weights per tile */
#define TMX_TRELLIS_K_MIN 2
#define TMX_TRELLIS_K_MAX 6
#define TMX_TRELLIS_MUL 0x83DCD12Du /* the state multiplier of both laws */
#define TMX_TRELLIS_SIGMAS 1021     /* sigma is 0..1020 */
#define TMX_TRELLIS_HADAMARD 128    /* rotation block */

/* 32-bit words of one tile at K bits per weight. */
static inline int tmx_trellis_words(int K) { return 8 * K; }

/* Tile index (16*n + k) of trellis position t: lane l = t/8 holds k rows 2(l%4) + {0,1,8,9}
 * of columns n = l/4 and l/4 + 8, as its two m16n8k16 B fragments. */
static inline int tmx_trellis_pos(int t) {
    int l = t >> 3, j = t & 7;
    int k = 2 * (l & 3) + (j & 1) + 8 * ((j >> 1) & 1);
    int n = (l >> 2) + 8 * (j >> 2);
    return 16 * n + k;
}

/* --- bitstream.c: symbols <-> words ------------------------------------------------------- */

/* words[8K] <- syms[256], each < 2^K. */
void tmx_trellis_pack(const uint8_t *syms, int K, uint32_t *words);
/* syms[256] <- words[8K]. */
void tmx_trellis_unpack(const uint32_t *words, int K, uint8_t *syms);
/* The state of trellis position t (0..255). */
uint16_t tmx_trellis_state(const uint32_t *words, int K, int t);
/* states[256]: every position's state, in trellis order. */
void tmx_trellis_states(const uint32_t *words, int K, uint16_t *states);

/* --- laws.c: number formats and decode laws ----------------------------------------------- */

/* OCP E4M3 ("fn") and E2M1 from f32, round to nearest even; the sign of the input is kept,
 * zero included. E4M3: magnitudes above 448 (and infinities) saturate to 448 (0x7E/0xFE), NaN
 * gives 0x7F (PTX cvt.rn.satfinite.e4m3x2 gives the same). E2M1: magnitudes above 6 (and
 * infinities) saturate to 6 (0x7/0xF), NaN gives 0x7. Decode E4M3 bytes with tmx_e4m3_to_f32()
 * from tmx/tensor.h. */
uint8_t tmx_trellis_e4m3_round(float x);
uint8_t tmx_trellis_e2m1_round(float x);
float tmx_trellis_e2m1_to_f32(uint8_t nibble);

/* sigma(state) = the sum of the four bytes of state * 0x83DCD12D (mod 2^32). */
static inline int tmx_trellis_sigma(uint16_t state) {
    uint32_t x = (uint32_t)state * TMX_TRELLIS_MUL;
    return (int)((x & 0xff) + ((x >> 8) & 0xff) + ((x >> 16) & 0xff) + (x >> 24));
}

/* v(sigma): EXL3's mul1 value, fp16(fma(1024 + sigma, 0x1EEE, 0xC931)) with the constants as
 * fp16 (1774/2^18 and -1329/2^7) and one round to nearest even in fp16. Exact in f32. */
float tmx_trellis_v(int sigma);

enum tmx_trellis_law_id {
    TMX_TRELLIS_LAW_E4M3 = 0, /* code = RNE_E4M3(v(sigma)) */
    TMX_TRELLIS_LAW_E2M1 = 1, /* code = RNE_E2M1(v(sigma) / alpha) */
    TMX_TRELLIS_LAW_PAIR = 2, /* e4m3-pair: codes of 2t, 2t + 1 = pairs[state of 2t + 1] */
};

#define TMX_TRELLIS_PAIR_K_MAX 4 /* law e4m3-pair: 16 - 2K bits of a state carry over */
#define TMX_TRELLIS_PAIR_M0 0x5D9DC9F9u /* law e4m3-pair: code i = Q[s * M_i >> 22] (§14) */
#define TMX_TRELLIS_PAIR_M1 0x9531985Du

/* The largest K a law codes at (K_MIN is every law's least). */
static inline int tmx_trellis_k_max(enum tmx_trellis_law_id law) {
    return law == TMX_TRELLIS_LAW_PAIR ? TMX_TRELLIS_PAIR_K_MAX : TMX_TRELLIS_K_MAX;
}

/* A law's tables; caller-owned, filled by tmx_trellis_law_init, nothing to free. */
struct tmx_trellis_law {
    enum tmx_trellis_law_id id;
    float alpha;                           /* e2m1 divisor; 1 for e4m3 */
    uint8_t code[TMX_TRELLIS_SIGMAS];      /* sigma -> E4M3 byte or E2M1 nibble (v1 laws) */
    float value[TMX_TRELLIS_SIGMAS];       /* sigma -> the value of that code (v1 laws) */
    const uint16_t *pairs; /* e4m3-pair: [65536] code 0 | code 1 << 8 by state (static) */
    const uint8_t *quantiles; /* e4m3-pair: Q[1024], the codes the pairs draw from (static) */
    float quantile_value[1024]; /* e4m3-pair: the value of each Q[j] */
};

/* Fills `law`. alpha is read for e2m1 only and must be positive and finite. */
enum tmx_status tmx_trellis_law_init(struct tmx_trellis_law *law, enum tmx_trellis_law_id id,
                                     float alpha, char **err);
/* "e4m3" / "e2m1"; the inverse returns -1 for any other name. */
const char *tmx_trellis_law_name(enum tmx_trellis_law_id id);
int tmx_trellis_law_from_name(const char *name);

/* Operand codes of a tile in trellis order. e4m3, e4m3-pair: out[256] bytes. e2m1: out[128],
 * position 2i in the low nibble of out[i] and 2i+1 in the high nibble. */
void tmx_trellis_decode_codes(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                              uint8_t *out);
/* The code values of a tile in tile order: out[16][16]. */
void tmx_trellis_decode_values(const struct tmx_trellis_law *law, const uint32_t *words, int K,
                               float *out);
/* Every state's code value: v0[65536]; law e4m3-pair: v0 of the pair's first position and, if
 * v1 is not NULL, v1[65536] of its second. */
void tmx_trellis_state_values(const struct tmx_trellis_law *law, float *v0, float *v1);

/* --- viterbi.c: the encoder of one tile --------------------------------------------------- */

struct tmx_trellis_viterbi; /* tables and buffers for one law and K; one per thread */

/* Copies what it needs of `law` (the caller may free it afterwards); ~0.3 MB plus 256 bytes per
 * history (2^(16-K) of them). */
enum tmx_status tmx_trellis_viterbi_new(const struct tmx_trellis_law *law, int K,
                                        struct tmx_trellis_viterbi **out, char **err);
void tmx_trellis_viterbi_free(struct tmx_trellis_viterbi *vit);
/* Finds the tail-biting stream whose decoded values are closest to target[16][16] (tile order,
 * in code units: block and matrix scales already divided out) in squared error. Writes
 * words[8K] and returns that squared error. target must be finite. */
double tmx_trellis_viterbi_encode(struct tmx_trellis_viterbi *vit, const float *target,
                                  uint32_t *words);

/* --- hadamard.c: rotations ---------------------------------------------------------------- */

/* x <- H x on every block of 128 (n % 128 == 0): the normalized Sylvester Hadamard, computed
 * in f32 as the spec fixes it (butterfly stages h = 1, 2, ..., 64, then one multiply by
 * f32(1/sqrt(128))), so that every implementation gets the same bits. */
void tmx_trellis_hadamard(float *x, int64_t n);
/* Sign vectors are bits: element i is negated when bit i%8 of bits[i/8] is set. */
void tmx_trellis_signs_apply(const uint8_t *bits, float *x, int64_t n);
/* bits[n/8] from a seed (splitmix64); any bits are valid, this is how tmx draws them. */
void tmx_trellis_signs_random(uint64_t seed, uint8_t *bits, int64_t n);
/* x <- H (s . x): an activation entering a matrix; and x <- s . (H x): one leaving it. */
void tmx_trellis_rotate(const uint8_t *signs, float *x, int64_t n);
void tmx_trellis_unrotate(const uint8_t *signs, float *x, int64_t n);

/* --- csf.c: lossless block scales --------------------------------------------------------- */

/* Legal block scales are E4M3 codes 0x00..0x7E: non-negative and not NaN. */
#define TMX_TRELLIS_SCALE_MAX 0x7E
/* A row's window is [base, base + 15]; base <= 111 keeps every window legal. */
#define TMX_TRELLIS_CSF_BASE_MAX 111

/* Bytes of the fixed stream of a [rows][cols] scale plane: per 16-row slab, 16 base bytes and
 * 16 rows of cols/2 nibble bytes. */
static inline int64_t tmx_trellis_csf_fixed_size(int64_t rows, int64_t cols) {
    return rows * (1 + cols / 2);
}

/* Compresses scales[rows][cols] (rows % 16 == 0, cols even, rows*cols <= 2^24, legal codes).
 * fixed[tmx_trellis_csf_fixed_size()] is caller-provided; *exceptions is malloc'd and the
 * caller frees it (NULL when there are none, and on failure); *n_exceptions is its length. */
enum tmx_status tmx_trellis_csf_encode(const uint8_t *scales, int64_t rows, int64_t cols,
                                       uint8_t *fixed, uint32_t **exceptions,
                                       int64_t *n_exceptions, char **err);
/* Expands and validates: scales[rows][cols] <- fixed[fixed_size] + exceptions[n_exceptions].
 * Rejects a wrong fixed size, a base above 111, exception positions out of range or not
 * strictly increasing, an exception byte that is illegal or inside its row's window, and a
 * non-zero nibble under an exception. `name` (a file and tensor) starts every message. */
enum tmx_status tmx_trellis_csf_decode(const char *name, const uint8_t *fixed, int64_t fixed_size,
                                       const uint32_t *exceptions, int64_t n_exceptions,
                                       int64_t rows, int64_t cols, uint8_t *scales, char **err);
/* Checks a starts array: starts[0] == 0, non-decreasing, starts[n_experts] == n_exceptions. */
enum tmx_status tmx_trellis_csf_check_starts(const char *name, const int32_t *starts,
                                             int64_t n_experts, int64_t n_exceptions,
                                             char **err);

/* --- act.c: activation formats ------------------------------------------------------------ */

/* The smallest e in [-127, 127] with amax <= max * 2^e; 0 when amax is 0 (amax finite). */
int tmx_trellis_pow2_exp(float amax, float max);
/* e4m3 codec, one token: q[i] = RNE_E4M3(x[i] / 2^e) with e = pow2_exp(max|x|, 448); returns
 * the scale 2^e. x must be finite. */
float tmx_trellis_act_e4m3(const float *x, int64_t n, uint8_t *q);
/* fp4 codec (NVFP4), one token, n % 16 == 0: tensor scale 2^e with e = pow2_exp(max|x|, 2688),
 * block scale s_b = RNE_E4M3(max|x_b| / (6 * 2^e)), q = RNE_E2M1(x / (s_b * 2^e)) (all zero
 * where s_b = 0). q[n/2] packs element 2i in the low nibble; scales[n/16]. Returns 2^e. */
float tmx_trellis_act_nvfp4(const float *x, int64_t n, uint8_t *q, uint8_t *scales);
/* MXFP8 (non-expert weights), n % 32 == 0: per block of 32, e = pow2_exp(max|x_b|, 448),
 * scales[b] = e + 127 (UE8M0), q = RNE_E4M3(x / 2^e). */
void tmx_trellis_mxfp8_quantize(const float *x, int64_t n, uint8_t *q, uint8_t *scales);

/* --- matrix.c: a whole matrix ------------------------------------------------------------- */

/* One trellis-coded matrix W[rows][cols] (rows = n_out, cols = k_in, both multiples of 128),
 * as views of the caller's buffers. */
struct tmx_trellis_matrix {
    const struct tmx_trellis_law *law;
    int K;
    int block;               /* inputs per block scale: 32 (law e4m3) or 16 (law e2m1) */
    int64_t rows, cols;
    const uint32_t *words;   /* [rows/16][cols/16][8K], tiles row-major */
    const uint8_t *scales;   /* [rows][cols/block] E4M3, expanded */
    float scale;             /* g, the FP32 matrix scale */
    const uint8_t *sign_in;  /* [cols/8] s_in bits */
    const uint8_t *sign_out; /* [rows/8] s_out bits */
};

/* Checks geometry, K, block, scale and block-scale codes; names the field at fault. */
enum tmx_status tmx_trellis_matrix_check(const struct tmx_trellis_matrix *m, char **err);
/* q[rows][cols] = g * B . C: the rotated matrix the expert matmul multiplies. */
void tmx_trellis_matrix_operands(const struct tmx_trellis_matrix *m, float *q);
/* w[rows][cols] = diag(s_out) H (g * B . C) H diag(s_in). */
void tmx_trellis_matrix_dequant(const struct tmx_trellis_matrix *m, float *w);

/* --- gauss.c: quality on i.i.d. Gaussian data --------------------------------------------- */

/* x[n] <- i.i.d. N(0,1) draws from the generator state *state (splitmix64, Box-Muller). */
void tmx_trellis_gauss_fill(uint64_t *state, float *x, int64_t n);
/* Encodes n_tiles tiles of N(0,1) data drawn from `seed` at the best scale c (a golden-section
 * search over c on the first 64 tiles): target = c*x, reconstruction = decoded/c. Writes the
 * relative MSE sum((x - x^)^2) / sum(x^2) and c. */
enum tmx_status tmx_trellis_gauss_mse(const struct tmx_trellis_law *law, int K, int n_tiles,
                                      uint64_t seed, double *rel_mse, double *scale, char **err);

#endif
