/* codec-int8.c: per-row absmax int8 weights, the smallest codec that does real work.
 *
 * What it is: a codec (kind "codec", ops table struct tmx_codec_i in tmx/plugin.h) for
 * quant_method "int8_absmax". A [rows][cols] F32 matrix packs into a U8 tensor of shape
 * [rows][4 + cols]: each row holds its scale s = max|w| / 127 as an F32 (host byte order), then
 * cols int8 values q = round(w / s), so that w ~ q * s with an error of at most s / 2.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND codec NAME int8 SOURCES codec-int8.c LIBS m); by
 * hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -I core/include \
 *        -o libtmx-codec-int8.so tests/plugins/codec-int8.c -lm
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir and add
 * "codec.int8" to the config's "load" list (or TMX_LOAD=codec.int8).
 *
 * What it shows: encode and decode as inverse halves of one format; a packed tensor whose
 * shape is checked before a byte is read; errors made with host->err, which the core frees;
 * memory handed to the caller with plain malloc, as the header says. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/plugin.h"

struct int8_codec {
    const struct tmx_host *host;
};

static enum tmx_status int8_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                 void **ctx, char **err) {
    (void)opts;
    struct int8_codec *c = calloc(1, sizeof *c);
    if (!c) return host->err(err, TMX_ERR_NOMEM, "codec int8: out of memory");
    c->host = host;
    *ctx = c;
    return TMX_OK;
}

static void int8_fini(void *ctx) { free(ctx); }

static enum tmx_status int8_encode(void *ctx, const float *w, int64_t rows, int64_t cols,
                                   struct tmx_tensor *packed, char **err) {
    struct int8_codec *c = ctx;
    if (rows <= 0 || cols <= 0)
        return c->host->err(err, TMX_ERR_INVALID, "codec int8: cannot encode a %lldx%lld matrix",
                            (long long)rows, (long long)cols);
    uint8_t *out = malloc((size_t)rows * (size_t)(4 + cols)); /* [rows][4 + cols] */
    if (!out) return c->host->err(err, TMX_ERR_NOMEM, "codec int8: out of memory");
    for (int64_t r = 0; r < rows; r++) {
        const float *row = w + r * cols;
        uint8_t *dst = out + r * (4 + cols);
        float absmax = 0.0f;
        for (int64_t j = 0; j < cols; j++) absmax = fmaxf(absmax, fabsf(row[j]));
        const float scale = absmax / 127.0f;
        memcpy(dst, &scale, 4);
        for (int64_t j = 0; j < cols; j++) {
            /* An all-zero row has scale 0; its values stay 0 instead of dividing by it. */
            const float q = scale > 0.0f ? rintf(row[j] / scale) : 0.0f;
            dst[4 + j] = (uint8_t)(int8_t)fmaxf(-127.0f, fminf(127.0f, q));
        }
    }
    *packed = (struct tmx_tensor){.dtype = TMX_DTYPE_U8, .ndim = 2, .shape = {rows, 4 + cols},
                                  .data = out};
    return TMX_OK;
}

static enum tmx_status int8_decode(void *ctx, const struct tmx_tensor *packed, int64_t rows,
                                   int64_t cols, float *out, char **err) {
    struct int8_codec *c = ctx;
    if (packed->dtype != TMX_DTYPE_U8 || packed->ndim != 2 || packed->shape[0] != rows ||
        packed->shape[1] != 4 + cols)
        return c->host->err(err, TMX_ERR_INVALID,
                            "codec int8: packed tensor must be U8 [%lld][%lld]", (long long)rows,
                            (long long)(4 + cols));
    const uint8_t *src = packed->data;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = src + r * (4 + cols);
        float scale;
        memcpy(&scale, row, 4);
        for (int64_t j = 0; j < cols; j++) out[r * cols + j] = (float)(int8_t)row[4 + j] * scale;
    }
    return TMX_OK;
}

static const struct tmx_codec_i int8_ops = {
    .struct_size = sizeof(struct tmx_codec_i),
    .quant_method = "int8_absmax",
    .init = int8_init,
    .fini = int8_fini,
    .decode = int8_decode,
    .encode = int8_encode,
};

static const struct tmx_plugin int8_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "int8",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .ops = &int8_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &int8_plugin;
}
