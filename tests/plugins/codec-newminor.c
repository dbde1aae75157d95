/* codec-newminor.c: a refusal test. Built for ABI 1.99, newer than the core; the core must
 * refuse it naming both versions. */
#include "tmx/plugin.h"

static const struct tmx_codec_i newminor_ops = {.struct_size = sizeof(struct tmx_codec_i)};

static const struct tmx_plugin newminor_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = 99,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "newminor",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .ops = &newminor_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &newminor_plugin;
}
