/* bench-badopt.c: a refusal test. Its option table gives an int option a default that is not
 * an integer. */
#include "tmx/plugin.h"

static const struct tmx_option badopt_opts[] = {
    {"repeats", TMX_OPT_INT, "many", "how often to run each case"},
    {0},
};

static const struct tmx_bench_i badopt_ops = {.struct_size = sizeof(struct tmx_bench_i)};

static const struct tmx_plugin badopt_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "badopt",
    .kind = TMX_PLUGIN_BENCH,
    .version = "1.0.0",
    .opts = badopt_opts,
    .ops = &badopt_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &badopt_plugin;
}
