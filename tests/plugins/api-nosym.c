/* api-nosym.c: a refusal test. Exports a misspelt entry point and no tmx_plugin_entry. */
#include "tmx/plugin.h"

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entrypoint(const struct tmx_host *host,
                                                                 char **err) {
    (void)host, (void)err;
    return NULL;
}
