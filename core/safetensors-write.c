/* safetensors-write.c: writing safetensors files (the quantizer and codec encoders). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/safetensors.h"

/* The header JSON: {"__metadata__": {...}, name: {dtype, shape, data_offsets}, ...}, offsets
 * assigned in order with each tensor aligned to 8 bytes. Returns a malloc'd string. */
static char *header_json(int n, const char *const *names, const struct tmx_tensor *t,
                         const char *const *meta_kv, size_t *data_size) {
    json_t *root = json_object();
    if (meta_kv && meta_kv[0]) {
        json_t *meta = json_object();
        for (int i = 0; meta_kv[i] && meta_kv[i + 1]; i += 2)
            json_object_set_new(meta, meta_kv[i], json_string(meta_kv[i + 1]));
        json_object_set_new(root, "__metadata__", meta);
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        const size_t nb = tmx_tensor_nbytes(&t[i]);
        json_object_set_new(root, names[i],
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", tmx_dtype_name(t[i].dtype),
                                      "shape", shape, "data_offsets", (json_int_t)off,
                                      (json_int_t)(off + nb)));
        off = (off + nb + 7) & ~(size_t)7;
    }
    *data_size = off;
    char *s = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    return s;
}

enum tmx_status tmx_safetensors_write(const char *path, int n, const char *const *names,
                                      const struct tmx_tensor *tensors, const char *const *meta_kv,
                                      char **err) {
    size_t data_size;
    char *hdr = header_json(n, names, tensors, meta_kv, &data_size);
    if (!hdr) return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
    /* pad the header with spaces so the data section starts 8-byte aligned */
    const size_t len = strlen(hdr), padded = (len + 8 + 7) / 8 * 8 - 8;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        free(hdr);
        return tmx_err(err, TMX_ERR_IO, "%s: cannot create: %m", tmp);
    }
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    int ok = fwrite(le, 1, 8, f) == 8 && fwrite(hdr, 1, len, f) == len;
    for (size_t i = len; ok && i < padded; i++) ok = fputc(' ', f) != EOF;
    free(hdr);
    static const uint8_t zeros[8];
    for (int i = 0; ok && i < n; i++) {
        const size_t nb = tmx_tensor_nbytes(&tensors[i]);
        ok = (nb == 0 || fwrite(tensors[i].data, 1, nb, f) == nb) && /* empty: data may be NULL */
             fwrite(zeros, 1, ((nb + 7) & ~(size_t)7) - nb, f) == ((nb + 7) & ~(size_t)7) - nb;
    }
    if (fclose(f) != 0) ok = 0;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return tmx_err(err, TMX_ERR_IO, "%s: write failed: %m", path);
    }
    return TMX_OK;
}
