/* media-bytes.c: raw bytes in, embeddings out, the smallest media plugin.
 *
 * What it is: a media plugin (kind "media", ops table struct tmx_media_i in tmx/plugin.h) for
 * mime type "application/octet-stream". It cuts the input into 16-byte chunks and turns each
 * into one embedding of `dim` floats: element i is chunk byte i mod (chunk length), mapped from
 * [0, 255] to [-1, 1]. The features mean nothing to a model; they are deterministic, so a test
 * can check every value, and they show the shape of the contract: n bytes in, ceil(n / 16)
 * placeholder tokens' worth of embeddings out.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND media NAME bytes SOURCES media-bytes.c); by hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -I core/include \
 *        -o libtmx-media-bytes.so tests/plugins/media-bytes.c
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir and add
 * "media.bytes" to the config's "load" list.
 *
 * What it shows: a NULL-terminated mime_types list, refusing a mime type with
 * TMX_ERR_UNSUPPORTED, and an output array the plugin mallocs and the caller frees. */
#include <stdlib.h>
#include <string.h>

#include "tmx/plugin.h"

#define BYTES_PER_TOKEN 16

static const char *const bytes_mime_types[] = {"application/octet-stream", NULL};

struct bytes_media {
    const struct tmx_host *host;
};

static enum tmx_status bytes_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                  void **ctx, char **err) {
    (void)opts;
    struct bytes_media *m = calloc(1, sizeof *m);
    if (!m) return host->err(err, TMX_ERR_NOMEM, "media bytes: out of memory");
    m->host = host;
    *ctx = m;
    return TMX_OK;
}

static void bytes_fini(void *ctx) { free(ctx); }

static enum tmx_status bytes_embed(void *ctx, const char *mime, const void *bytes,
                                   size_t n_bytes, int dim, float **emb, int *n_tokens,
                                   char **err) {
    const struct tmx_host *host = ((struct bytes_media *)ctx)->host;
    if (strcmp(mime, bytes_mime_types[0]) != 0)
        return host->err(err, TMX_ERR_UNSUPPORTED, "media bytes: cannot embed %s", mime);
    if (n_bytes == 0 || dim <= 0)
        return host->err(err, TMX_ERR_INVALID, "media bytes: %zu bytes into dim %d", n_bytes, dim);
    const size_t n = (n_bytes + BYTES_PER_TOKEN - 1) / BYTES_PER_TOKEN;
    if (n > (size_t)INT32_MAX)
        return host->err(err, TMX_ERR_INVALID, "media bytes: %zu bytes is too many", n_bytes);
    float *out = malloc(n * (size_t)dim * sizeof *out); /* [n][dim] */
    if (!out) return host->err(err, TMX_ERR_NOMEM, "media bytes: out of memory");
    const uint8_t *b = bytes;
    for (size_t t = 0; t < n; t++) {
        const uint8_t *chunk = b + t * BYTES_PER_TOKEN;
        const size_t len = t + 1 < n ? BYTES_PER_TOKEN : n_bytes - t * BYTES_PER_TOKEN;
        for (int i = 0; i < dim; i++)
            out[t * (size_t)dim + (size_t)i] = (float)chunk[(size_t)i % len] / 127.5f - 1.0f;
    }
    *emb = out;
    *n_tokens = (int)n;
    return TMX_OK;
}

static const struct tmx_media_i bytes_ops = {
    .struct_size = sizeof(struct tmx_media_i),
    .mime_types = bytes_mime_types,
    .init = bytes_init,
    .fini = bytes_fini,
    .embed = bytes_embed,
};

static const struct tmx_plugin bytes_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "bytes",
    .kind = TMX_PLUGIN_MEDIA,
    .version = "1.0.0",
    .ops = &bytes_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &bytes_plugin;
}
