/* drafter-null.c: a refusal test. Its entry declines to load, with a reason the core must
 * pass on. */
#include "tmx/plugin.h"

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    host->err(err, TMX_ERR_UNSUPPORTED, "drafter null: needs a feature this machine lacks");
    return NULL;
}
