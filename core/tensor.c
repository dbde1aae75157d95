/* tensor.c: dtype names and sizes. */
#include <math.h>
#include <string.h>

#include "tmx/tensor.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[TMX_DTYPE_COUNT] = {
    [TMX_DTYPE_F32] = {"F32", 4},     [TMX_DTYPE_BF16] = {"BF16", 2}, [TMX_DTYPE_F16] = {"F16", 2},
    [TMX_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [TMX_DTYPE_U8] = {"U8", 1}, [TMX_DTYPE_I32] = {"I32", 4},
    [TMX_DTYPE_I8] = {"I8", 1},       [TMX_DTYPE_MXFP8] = {"MXFP8", 1},
};

size_t tmx_dtype_size(enum tmx_dtype dt) { return dt < TMX_DTYPE_COUNT ? dtypes[dt].size : 0; }

const char *tmx_dtype_name(enum tmx_dtype dt) {
    return dt < TMX_DTYPE_COUNT ? dtypes[dt].name : "?";
}

enum tmx_dtype tmx_dtype_from_name(const char *name) {
    for (int i = 0; i < TMX_DTYPE_COUNT; i++)
        if (i != TMX_DTYPE_MXFP8 && strcmp(dtypes[i].name, name) == 0) return (enum tmx_dtype)i;
    return TMX_DTYPE_COUNT;
}

int64_t tmx_tensor_numel(const struct tmx_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t tmx_tensor_nbytes(const struct tmx_tensor *t) {
    const size_t n = (size_t)tmx_tensor_numel(t);
    return t->dtype == TMX_DTYPE_MXFP8 ? n + n / 32 : n * tmx_dtype_size(t->dtype);
}

void tmx_mxfp8_to_bf16(const struct tmx_tensor *mx, uint16_t *out) {
    const int64_t n = tmx_tensor_numel(mx);
    const uint8_t *q = mx->data, *scale = q + n; /* one scale per 32 codes, in order */
    for (int64_t b = 0; b < n / 32; b++) {
        /* 2^(scale - 127) is a float for every scale but 255 (2^128): there a product is the
         * rounded ldexpf, and only there ldexpf is needed, code by code */
        const int e = (int)scale[b] - 127;
        const float f = ldexpf(1.0f, e);
        for (int64_t i = 32 * b; i < 32 * b + 32; i++) {
            const float x = tmx_e4m3_to_f32(q[i]);
            out[i] = tmx_f32_to_bf16(e < 128 ? x * f : ldexpf(x, e));
        }
    }
}
