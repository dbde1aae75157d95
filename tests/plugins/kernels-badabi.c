/* kernels-badabi.c: a refusal test. Built for ABI 99.0; the core must refuse it naming both
 * versions. */
#include "tmx/plugin.h"

static const struct tmx_kernels_i badabi_ops = {.struct_size = sizeof(struct tmx_kernels_i)};

static const struct tmx_plugin badabi_plugin = {
    .abi_major = 99,
    .abi_minor = 0,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "badabi",
    .kind = TMX_PLUGIN_KERNELS,
    .version = "1.0.0",
    .ops = &badabi_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &badabi_plugin;
}
