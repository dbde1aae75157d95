/* media-small.c: a refusal test. Its descriptor claims to be smaller than ABI 1.0's. */
#include <stddef.h>

#include "tmx/plugin.h"

static const struct tmx_plugin small_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = offsetof(struct tmx_plugin, kind),
    .name = "small",
    .kind = TMX_PLUGIN_MEDIA,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &small_plugin;
}
