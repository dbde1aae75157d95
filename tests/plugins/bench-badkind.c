/* bench-badkind.c: a refusal test. Declares plugin kind 42, which no core knows. */
#include "tmx/plugin.h"

static const struct tmx_bench_i badkind_ops = {.struct_size = sizeof(struct tmx_bench_i)};

static const struct tmx_plugin badkind_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "badkind",
    .kind = (enum tmx_plugin_kind)42,
    .version = "1.0.0",
    .ops = &badkind_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &badkind_plugin;
}
