/* kernels-opts.c: a test plugin that declares one option of each type, for the option
 * resolution tests (precedence, parsing, and the core "threads" key standing in for a kernel
 * set's own "threads" default). It has no ops, so it can be loaded but never opened. */
#include "tmx/plugin.h"

static const struct tmx_option opts_table[] = {
    {"threads", TMX_OPT_INT, "1", "worker threads"},
    {"scale", TMX_OPT_FLOAT, "0.5", "a number"},
    {"fast-math", TMX_OPT_BOOL, "false", "a switch with a dash in its name"},
    {"label", TMX_OPT_STRING, "none", "a string"},
    {0},
};

static const struct tmx_kernels_i opts_ops = {.struct_size = sizeof(struct tmx_kernels_i)};

static const struct tmx_plugin opts_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "opts",
    .kind = TMX_PLUGIN_KERNELS,
    .version = "1.0.0",
    .opts = opts_table,
    .ops = &opts_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &opts_plugin;
}
