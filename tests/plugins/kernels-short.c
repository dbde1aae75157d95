/* kernels-short.c: a refusal test. Its ops table says it ends right after struct_size, so the
 * core must not read the ops that follow even though they are set. */
#include <stddef.h>
#include <stdlib.h>

#include "tmx/plugin.h"

static void short_fini(void *ctx) { free(ctx); }

static const struct tmx_kernels_i short_ops = {
    .struct_size = offsetof(struct tmx_kernels_i, init),
    .fini = short_fini,
};

static const struct tmx_plugin short_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "short",
    .kind = TMX_PLUGIN_KERNELS,
    .version = "1.0.0",
    .ops = &short_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &short_plugin;
}
