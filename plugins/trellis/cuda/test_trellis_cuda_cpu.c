/* test_trellis_cuda_cpu.c: the parts of the device path that a machine without a GPU can
 * check. The operand bytes the bench expects from the GPU (reference.c) hold the spec's tile
 * values at the spec's positions; the kappa order and lane registers, put through
 * mma.m16n8k32 as the PTX ISA lays out its fragments (emulated), give W x exactly; and both
 * codec plugins carry the device ops, refusing a kernel set other than "cuda". */
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

static uint32_t reg_of(const uint8_t *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* Two tiles side by side (16 rows, 32 inputs) times 8 tokens through the emulated MMA, with
 * the registers and the kappa order the kernels use, equal the plain products exactly. */
static void test_mma_layout(void **state) {
    (void)state;
    for (int fp4 = 0; fp4 < 2; fp4++) {
        struct tmx_trellis_law law;
        law_init(&law, fp4);
        for (int rep = 0; rep < 20; rep++) {
            const int K = 2 + rep % 5;
            uint32_t w[2][8 * TMX_TRELLIS_K_MAX];
            uint8_t ops[2][TMX_TRELLIS_TILE], x[8][32], xk[8][32];
            float c[2][TMX_TRELLIS_TILE];
            for (int h = 0; h < 2; h++) {
                random_tile(K, w[h]);
                trellis_ref_operands(&law, w[h], K, ops[h]);
                tmx_trellis_decode_values(&law, w[h], K, c[h]);
            }
            for (int t = 0; t < 8; t++) {
                for (int i = 0; i < 32; i++) {
                    x[t][i] = (uint8_t)(rnd() & 0xff);
                    if ((x[t][i] & 0x7f) == 0x7f) x[t][i] ^= 1; /* no NaN */
                }
                trellis_ref_kappa(x[t], 32, xk[t]);
            }
            uint32_t a[32][4], b[32][2];
            double d[32][4];
            for (int l = 0; l < 32; l++) {
                const int g = l >> 2, q = l & 3;
                for (int i = 0; i < 4; i++) a[l][i] = reg_of(&ops[i >> 1][8 * l + 4 * (i & 1)]);
                b[l][0] = reg_of(&xk[g][4 * q]);
                b[l][1] = reg_of(&xk[g][16 + 4 * q]);
            }
            trellis_ref_mma(a, b, d);
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) {
                    const int r = (l >> 2) + 8 * (i >> 1), t = 2 * (l & 3) + (i & 1);
                    double y = 0.0;
                    for (int k = 0; k < 32; k++)
                        y += (double)c[k >> 4][16 * r + (k & 15)] * tmx_e4m3_to_f32(x[t][k]);
                    assert_true(d[l][i] == y);
                }
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
        cmocka_unit_test(test_plugins),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
