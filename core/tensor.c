/* tensor.c: dtype names and sizes. */
#include <string.h>

#include "tmx/tensor.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[TMX_DTYPE_COUNT] = {
    [TMX_DTYPE_F32] = {"F32", 4},     [TMX_DTYPE_BF16] = {"BF16", 2}, [TMX_DTYPE_F16] = {"F16", 2},
    [TMX_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [TMX_DTYPE_U8] = {"U8", 1}, [TMX_DTYPE_I32] = {"I32", 4},
    [TMX_DTYPE_I8] = {"I8", 1},
};

size_t tmx_dtype_size(enum tmx_dtype dt) { return dt < TMX_DTYPE_COUNT ? dtypes[dt].size : 0; }

const char *tmx_dtype_name(enum tmx_dtype dt) {
    return dt < TMX_DTYPE_COUNT ? dtypes[dt].name : "?";
}

enum tmx_dtype tmx_dtype_from_name(const char *name) {
    for (int i = 0; i < TMX_DTYPE_COUNT; i++)
        if (strcmp(dtypes[i].name, name) == 0) return (enum tmx_dtype)i;
    return TMX_DTYPE_COUNT;
}

int64_t tmx_tensor_numel(const struct tmx_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t tmx_tensor_nbytes(const struct tmx_tensor *t) {
    return (size_t)tmx_tensor_numel(t) * tmx_dtype_size(t->dtype);
}
