/* test_trellis_cuda_cpu.c: the parts of the device path that a machine without a GPU can
 * check. The operand bytes the bench expects from the GPU (reference.c) hold the spec's tile
 * values at the spec's positions; the lanes' states, byte-sum MMAs, A fragments and staged
 * activations, put through mma.m16n8k32 (u8) and mma.m16n8k16 (f16) as the PTX ISA lays out
 * their fragments (emulated), give the spec's values at the positions the kernels assume and
 * W x exactly, and so do the native FP4 form's codes and staging through the block-scaled
 * mma.m16n8k64; and both codec plugins carry the device ops, refusing a kernel set other than
 * "cuda". */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "reference.h"
#include "tmx/plugin.h"
#include "tmx/tensor.h"

static uint64_t rng = 0x5eedcafe;
static uint32_t rnd(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}

static void law_init(struct tmx_trellis_law *law, int fp4) {
    assert_int_equal(tmx_trellis_law_init(law, fp4 ? TMX_TRELLIS_LAW_E2M1 : TMX_TRELLIS_LAW_E4M3,
                                          0.5625f, NULL),
                     TMX_OK);
}

static void random_tile(int K, uint32_t *w) {
    for (int i = 0; i < tmx_trellis_words(K); i++) w[i] = rnd();
}

/* Byte t of the reference operands is the value of tile position tmx_trellis_pos(t). */
static void test_operands(void **state) {
    (void)state;
    for (int fp4 = 0; fp4 < 2; fp4++) {
        struct tmx_trellis_law law;
        law_init(&law, fp4);
        for (int K = TMX_TRELLIS_K_MIN; K <= TMX_TRELLIS_K_MAX; K++)
            for (int rep = 0; rep < 50; rep++) {
                uint32_t w[8 * TMX_TRELLIS_K_MAX];
                uint8_t ops[TMX_TRELLIS_TILE];
                float values[TMX_TRELLIS_TILE];
                random_tile(K, w);
                trellis_ref_operands(&law, w, K, ops);
                tmx_trellis_decode_values(&law, w, K, values);
                for (int t = 0; t < TMX_TRELLIS_TILE; t++)
                    assert_true(tmx_e4m3_to_f32(ops[t]) == values[tmx_trellis_pos(t)]);
            }
    }
}

/* --- the lanes of decode.cuh and mm.cu, emulated ------------------------------------------- */

/* lane_window_of and lane_states: the lane's eight states from the tile's words. */
static void lane_states(const uint32_t *w, int K, int lane, uint32_t s[8]) {
    const int nw = 8 * K;
    int b = 8 * lane * K + K - 16;
    if (b < 0) b += 256 * K;
    const int i0 = b >> 5, off = b & 31, i1 = i0 + 1 == nw ? 0 : i0 + 1,
              i2 = i1 + 1 == nw ? 0 : i1 + 1;
    const uint64_t win = ((uint64_t)w[i0] << 32 | w[i1]) << off | (off ? w[i2] >> (32 - off) : 0);
    for (int j = 0; j < 8; j++) s[j] = (uint32_t)(win >> (48 - j * K)) & 0xffffu;
}

/* mma.m16n8k32 u8 -> s32 as the PTX ISA lays out its fragments: a_i byte j at row
 * g + 8(i & 1), column 4q + j + 16(i >> 1); b_i byte j at row 4q + j + 16i, column g; d_i at
 * row g + 8(i >> 1), column 2q + (i & 1); every element of C is c. */
static void mma_u8(const uint32_t a[32][4], const uint32_t b[32][2], uint32_t c,
                   uint32_t d[32][4]) {
    uint32_t A[16][32], B[32][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, q = l & 3;
        for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 4; i++)
                A[g + 8 * (i & 1)][4 * q + j + 16 * (i >> 1)] = a[l][i] >> (8 * j) & 0xff;
            for (int i = 0; i < 2; i++) B[4 * q + j + 16 * i][g] = b[l][i] >> (8 * j) & 0xff;
        }
    }
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < 4; i++) {
            uint32_t sum = c;
            for (int k = 0; k < 32; k++)
                sum += A[(l >> 2) + 8 * (i >> 1)][k] * B[k][2 * (l & 3) + (i & 1)];
            d[l][i] = sum;
        }
}

/* mma.m16n8k16 in double: a_i half e at row g + 8(i & 1), column 2q + e + 8(i >> 1); b_i half
 * e at row 2q + e + 8i, column g; d_i at row g + 8(i >> 1), column 2q + (i & 1). */
static void mma_f16(const double a[32][4][2], const double b[32][2][2], double d[32][4]) {
    double A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, q = l & 3;
        for (int e = 0; e < 2; e++) {
            for (int i = 0; i < 4; i++) A[g + 8 * (i & 1)][2 * q + e + 8 * (i >> 1)] = a[l][i][e];
            for (int i = 0; i < 2; i++) B[2 * q + e + 8 * i][g] = b[l][i][e];
        }
    }
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < 4; i++) {
            double sum = 0.0;
            for (int k = 0; k < 16; k++)
                sum += A[(l >> 2) + 8 * (i >> 1)][k] * B[k][2 * (l & 3) + (i & 1)];
            d[l][i] = sum;
        }
}

/* __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of y:x. */
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
    const uint64_t v = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)(v >> (8 * (sel >> (4 * i) & 7)) & 0xff) << (8 * i);
    return r;
}

/* One tile times 8 tokens as the kernels compute it: the lanes' states multiplied by
 * 0x83DCD12D, summed by two u8 MMAs (sum_bytes), the sums turned into values by the law and
 * placed in the A fragment (lane_operands), the activations in kappa order staged in lambda
 * order (lambda_words), one f16 MMA: equal to the plain products in double. The sums also
 * equal sigma + c of the states the lanes assume, at the columns decode_kernel writes. */
static void test_mma_layout(void **state) {
    (void)state;
    for (int fp4 = 0; fp4 < 2; fp4++) {
        struct tmx_trellis_law law;
        law_init(&law, fp4);
        for (int rep = 0; rep < 20; rep++) {
            const int K = 2 + rep % 5;
            uint32_t w[8 * TMX_TRELLIS_K_MAX];
            uint8_t x[8][16], xk[8][16];
            float c[TMX_TRELLIS_TILE];
            random_tile(K, w);
            tmx_trellis_decode_values(&law, w, K, c);
            for (int t = 0; t < 8; t++) {
                for (int i = 0; i < 16; i++) {
                    x[t][i] = (uint8_t)(rnd() & 0xff);
                    if ((x[t][i] & 0x7f) == 0x7f) x[t][i] ^= 1; /* no NaN */
                }
                trellis_ref_kappa(x[t], 16, xk[t]);
            }
            const uint32_t base = fp4 ? 0 : 0x6400;
            uint32_t a8[2][32][4], sum[32][2], d8[2][32][4];
            for (int l = 0; l < 32; l++) {
                uint32_t s[8];
                lane_states(w, K, l, s);
                for (int j = 0; j < 8; j++) {
                    assert_int_equal(s[j], tmx_trellis_state(w, K, 8 * l + j));
                    s[j] *= 0x83DCD12Du;
                }
                const uint32_t a[2][4] = {{s[0], s[4], s[1], s[5]}, {s[2], s[6], s[3], s[7]}};
                memcpy(a8[0][l], a[0], sizeof a[0]);
                memcpy(a8[1][l], a[1], sizeof a[1]);
                const int g = l >> 2, q = l & 3;
                sum[l][0] = q == g ? 0x01010101u : 0u;
                sum[l][1] = q + 4 == g ? 0x01010101u : 0u;
            }
            mma_u8(a8[0], sum, base, d8[0]);
            mma_u8(a8[1], sum, base, d8[1]);
            double av[32][4][2], bv[32][2][2], d[32][4];
            for (int l = 0; l < 32; l++) {
                const int g = l >> 2, q = l & 3;
                for (int i = 0; i < 4; i++)
                    for (int e = 0; e < 2; e++) {
                        const uint32_t sig = d8[i >> 1][l][2 * (i & 1) + e] - base;
                        const int row = g + 8 * (i & 1),
                                  col = 8 * (i >> 1) + 4 * (q & 1) + (q >> 1) + 2 * e;
                        const int pos = 8 * (4 * g + (col & 7) / 2) + (col & 1) +
                                        2 * (col >> 3) + 4 * (i & 1);
                        assert_int_equal(tmx_trellis_pos(pos), 16 * row + col);
                        assert_int_equal(sig, tmx_trellis_sigma(tmx_trellis_state(w, K, pos)));
                        av[l][i][e] = law.value[sig];
                        assert_true(av[l][i][e] == c[16 * row + col]);
                    }
                /* the staged word of lane q: lambda word q of the token's kappa words */
                uint32_t kw[4];
                memcpy(kw, xk[g], sizeof kw);
                const uint32_t lw = q == 0   ? byte_perm(kw[0], kw[1], 0x6240)
                                    : q == 1 ? byte_perm(kw[2], kw[3], 0x6240)
                                    : q == 2 ? byte_perm(kw[0], kw[1], 0x7351)
                                             : byte_perm(kw[2], kw[3], 0x7351);
                for (int i = 0; i < 2; i++)
                    for (int e = 0; e < 2; e++)
                        bv[l][i][e] = tmx_e4m3_to_f32(lw >> (16 * i + 8 * e) & 0xff);
            }
            mma_f16(av, bv, d);
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) {
                    const int r = (l >> 2) + 8 * (i >> 1), t = 2 * (l & 3) + (i & 1);
                    double y = 0.0;
                    for (int k = 0; k < 16; k++)
                        y += (double)c[16 * r + k] * tmx_e4m3_to_f32(x[t][k]);
                    assert_true(d[l][i] == y);
                }
        }
    }
}

/* e2m1x4_of_e4m3x4 one byte at a time: the E2M1 code of an E4M3 byte holding an E2M1 value. */
static uint32_t e2m1_of_e4m3(uint32_t b) {
    const uint32_t mag = b & 0x7f, e = mag >> 2;
    return ((e > 12 ? e - 12 : 0) + (mag == 0x30)) | (b >> 4 & 8);
}

/* mma.m16n8k64 .kind::mxf4nvf4 .block_scale.scale_vec::4X in double, as the PTX ISA lays it
 * out: a_i code j (bits 4j..) at row g + 8(i & 1), column 8q + j + 32(i >> 1); b_i code j at row
 * 8q + j + 32i, column g; scale byte k of row g (g + 8) from lane 4g (4g + 1), of column g from
 * lane 4g, for columns (rows) 16k..16k + 15; d_i at row g + 8(i >> 1), column 2q + (i & 1). */
static void mma_e2m1(const uint32_t a[32][4], const uint32_t b[32][2], const uint32_t sa[32],
                     const uint32_t sb[32], double d[32][4]) {
    double A[16][64], B[64][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, q = l & 3;
        for (int j = 0; j < 8; j++) {
            for (int i = 0; i < 4; i++)
                A[g + 8 * (i & 1)][8 * q + j + 32 * (i >> 1)] =
                    tmx_trellis_e2m1_to_f32(a[l][i] >> (4 * j) & 0xf);
            for (int i = 0; i < 2; i++)
                B[8 * q + j + 32 * i][g] = tmx_trellis_e2m1_to_f32(b[l][i] >> (4 * j) & 0xf);
        }
    }
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < 4; i++) {
            const int r = (l >> 2) + 8 * (i >> 1), n = 2 * (l & 3) + (i & 1);
            const uint32_t sr = sa[4 * (r & 7) + (r >> 3)], sn = sb[4 * n];
            double sum = 0.0;
            for (int k = 0; k < 64; k++)
                sum += A[r][k] * tmx_e4m3_to_f32(sr >> (8 * (k / 16)) & 0xff) * B[k][n] *
                       tmx_e4m3_to_f32(sn >> (8 * (k / 16)) & 0xff);
            d[l][i] = sum;
        }
}

/* The native FP4 form (decode.cuh lane_codes_e2m1, mm.cu stage_tile_native): a step of four
 * tiles times 8 tokens. Each tile pair's states go through four u8 MMAs (one tile in a0, a1,
 * the other in a2, a3), the sums give codes packed two a byte, and the codes land, with the
 * block scales, where the block-scaled MMA needs them: the sums equal sigma at the positions
 * the kernels assume (nu order), and the MMA gives W x exactly. */
static void test_native_layout(void **state) {
    (void)state;
    struct tmx_trellis_law law;
    law_init(&law, 1);
    for (int rep = 0; rep < 20; rep++) {
        const int K = 2 + rep % 5;
        uint32_t w[4][8 * TMX_TRELLIS_K_MAX], sa[32], sb[32], a[32][4] = {{0}}, b[32][2];
        float c[4][TMX_TRELLIS_TILE];
        uint8_t ws[16][4], xs[8][4], xn[8][64], xk[8][64];
        for (int u = 0; u < 4; u++) {
            random_tile(K, w[u]);
            tmx_trellis_decode_values(&law, w[u], K, c[u]);
        }
        for (int r = 0; r < 16; r++)
            for (int u = 0; u < 4; u++) ws[r][u] = (uint8_t)(0x28 + rnd() % 40);
        for (int t = 0; t < 8; t++) {
            uint8_t e4[64];
            for (int i = 0; i < 64; i++) {
                xn[t][i] = (uint8_t)(rnd() & 0xf);
                e4[i] = trellis_ref_e2m1_as_e4m3(xn[t][i]);
            }
            for (int u = 0; u < 4; u++) xs[t][u] = (uint8_t)(0x28 + rnd() % 40);
            trellis_ref_kappa(e4, 64, xk[t]);
        }
        /* the weights: lane_codes_e2m1 for pairs (0, 1) -> a0, a1 and (2, 3) -> a2, a3 */
        for (int pair = 0; pair < 2; pair++) {
            uint32_t s[2][32][8], in[32][4], sum[32][2], d[4][32][4];
            for (int l = 0; l < 32; l++) {
                const int g = l >> 2, q = l & 3;
                for (int h = 0; h < 2; h++) {
                    lane_states(w[2 * pair + h], K, l, s[h][l]);
                    for (int j = 0; j < 8; j++) s[h][l][j] *= 0x83DCD12Du;
                }
                sum[l][0] = q == g ? 0x01010101u : 0u;
                sum[l][1] = q + 4 == g ? 0x01010101u : 0u;
            }
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) {
                    in[l][0] = s[0][l][j];
                    in[l][1] = s[0][l][j + 4];
                    in[l][2] = s[1][l][j];
                    in[l][3] = s[1][l][j + 4];
                }
                mma_u8(in, sum, 0, d[j]);
            }
            for (int l = 0; l < 32; l++) {
                const int g = l >> 2, q = l & 3, u = 2 * pair + (q >> 1);
                for (int i = 0; i < 8; i++)
                    for (int h = 0; h < 2; h++) { /* r0 (row g), r1 (row g + 8) */
                        const uint32_t sig = d[i >> 1][l][2 * h + (i & 1)];
                        const int t = 2 * (q & 1) + (i & 1), j = i >> 1;
                        const int pos = 8 * (4 * g + t) + j + 4 * h;
                        const int col = 2 * t + (j & 1) + 8 * (j >> 1); /* 2t, 2t+1, 2t+8, 2t+9 */
                        assert_int_equal(tmx_trellis_pos(pos), 16 * (g + 8 * h) + col);
                        assert_int_equal(sig, tmx_trellis_sigma(tmx_trellis_state(w[u], K, pos)));
                        a[l][2 * pair + h] |= (uint32_t)law.code[sig] << (4 * i);
                    }
            }
        }
        /* the activations: stage_tile_native's words of each token, and the scales */
        for (int l = 0; l < 32; l++) {
            const int g = l >> 2, q = l & 3;
            uint32_t words[8] = {0};
            for (int u = 0; u < 4; u++) {
                uint32_t kw[4], cw[4];
                memcpy(kw, xk[g] + 16 * u, sizeof kw);
                for (int m = 0; m < 4; m++) {
                    cw[m] = 0;
                    for (int j = 0; j < 4; j++)
                        cw[m] |= e2m1_of_e4m3(kw[m] >> (8 * j) & 0xff) << (8 * j);
                }
                words[4 * (u & 1) + (u >> 1)] = cw[0] + cw[1] * 16u;
                words[4 * (u & 1) + (u >> 1) + 2] = cw[2] + cw[3] * 16u;
            }
            b[l][0] = words[2 * q];
            b[l][1] = words[2 * q + 1];
            sb[l] = (uint32_t)xs[g][0] | (uint32_t)xs[g][1] << 8 | (uint32_t)xs[g][2] << 16 |
                    (uint32_t)xs[g][3] << 24;
            const int r = g + 8 * (q & 1); /* lanes q = 0, 1; q = 2, 3 unused */
            sa[l] = (uint32_t)ws[r][0] | (uint32_t)ws[r][1] << 8 | (uint32_t)ws[r][2] << 16 |
                    (uint32_t)ws[r][3] << 24;
        }
        double d[32][4];
        mma_e2m1(a, b, sa, sb, d);
        for (int l = 0; l < 32; l++)
            for (int i = 0; i < 4; i++) {
                const int r = (l >> 2) + 8 * (i >> 1), t = 2 * (l & 3) + (i & 1);
                double y = 0.0;
                for (int u = 0; u < 4; u++)
                    for (int k = 0; k < 16; k++)
                        y += (double)c[u][16 * r + k] * tmx_e4m3_to_f32(ws[r][u]) *
                             tmx_trellis_e2m1_to_f32(xn[t][16 * u + k]) * tmx_e4m3_to_f32(xs[t][u]);
                assert_true(d[l][i] == y);
            }
    }
}

/* --- the plugins -------------------------------------------------------------------------- */

static enum tmx_status host_err(char **err, enum tmx_status st, const char *fmt, ...) {
    if (!err) return st;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(err, fmt, ap) < 0) *err = NULL;
    va_end(ap);
    return st;
}

static const char *host_opt_str(const struct tmx_opts *opts, const char *name) {
    (void)opts;
    return strcmp(name, "activations") == 0 ? "serving" : NULL;
}

static int64_t host_opt_int(const struct tmx_opts *opts, const char *name) {
    (void)opts, (void)name;
    return 1;
}

static const struct tmx_host host = {.struct_size = sizeof host, .abi_major = TMX_ABI_MAJOR,
                                     .abi_minor = TMX_ABI_MINOR, .err = host_err,
                                     .opt_str = host_opt_str, .opt_int = host_opt_int};

static void check_plugin(const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/libtmx-codec-%s.so", TMX_BIN_DIR, name);
    void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    assert_non_null(so);
    tmx_plugin_entry_fn entry = (tmx_plugin_entry_fn)dlsym(so, TMX_PLUGIN_ENTRY_SYMBOL);
    assert_non_null(entry);
    const struct tmx_plugin *p = entry(&host, NULL);
    assert_non_null(p);
    const struct tmx_codec_i *ops = p->ops;
    assert_true(ops->struct_size >= offsetof(struct tmx_codec_i, device_moe_experts) +
                                        sizeof ops->device_moe_experts);
    assert_non_null(ops->device_load);
    assert_non_null(ops->device_free);
    assert_non_null(ops->device_moe_experts);
    void *ctx = NULL, *dev = NULL;
    char *err = NULL;
    assert_int_equal(ops->init(&host, NULL, &ctx, &err), TMX_OK);
    assert_int_equal(ops->device_load(ctx, NULL, "cpu", NULL, &dev, &err), TMX_ERR_UNSUPPORTED);
    assert_null(dev);
    assert_non_null(strstr(err, "no device path for kernel set \"cpu\""));
    free(err);
    ops->fini(ctx);
    dlclose(so);
}

static void test_plugins(void **state) {
    (void)state;
    check_plugin("trellis-e4m3");
    check_plugin("trellis-fp4");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_operands),
        cmocka_unit_test(test_mma_layout),
        cmocka_unit_test(test_native_layout),
        cmocka_unit_test(test_plugins),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
