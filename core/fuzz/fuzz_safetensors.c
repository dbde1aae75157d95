/* fuzz_safetensors.c: libFuzzer target for tmx_safetensors_parse.
 *
 * Every input is either rejected with a one-line message, or yields tensors that lie wholly
 * inside the input, come in offset order without overlapping, and are found again by name.
 * ASan catches reads past the input; the checks below catch what it cannot. Run through
 * tools/fuzz.sh. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct tmx_safetensors *st = NULL;
    char *err = NULL;
    if (tmx_safetensors_parse(data, size, "fuzz", &st, &err) != TMX_OK) {
        if (!err || strchr(err, '\n') || strncmp(err, "fuzz: ", 6) != 0) abort();
        free(err);
        return 0;
    }

    const uint8_t *end = data + size, *prev = data, *prev_end = data;
    for (size_t i = 0; i < tmx_safetensors_count(st); i++) {
        struct tmx_tensor t, found;
        const char *name = tmx_safetensors_at(st, i, &t);
        const uint8_t *p = t.data;
        size_t n = tmx_tensor_nbytes(&t);
        if (t.dtype >= TMX_DTYPE_COUNT || t.ndim < 0 || t.ndim > TMX_MAX_DIMS) abort();
        if (p < data + 8 || p > end || n > (size_t)(end - p)) abort();
        if (p < prev || (n && p < prev_end)) abort();
        if (tmx_safetensors_find(st, name, &found) != 0 || found.data != t.data ||
            found.dtype != t.dtype || found.ndim != t.ndim)
            abort();
        if (n) {
            /* Touch both ends, so that ASan sees any range that leaves the input. */
            volatile uint8_t sink = p[0] ^ p[n - 1];
            (void)sink;
            prev_end = p + n;
        }
        prev = p;
    }
    tmx_safetensors_meta(st, "format");
    tmx_safetensors_free(st);
    return 0;
}
