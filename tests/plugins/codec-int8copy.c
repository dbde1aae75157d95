/* codec-int8copy.c: a refusal test. A second file that calls itself codec.int8: loading it as
 * codec.int8copy is a name mismatch, loading it beside codec-int8 a duplicate. */
#include "tmx/plugin.h"

static const struct tmx_codec_i int8copy_ops = {.struct_size = sizeof(struct tmx_codec_i)};

static const struct tmx_plugin int8copy_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "int8",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .ops = &int8copy_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &int8copy_plugin;
}
