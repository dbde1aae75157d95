/* kernels-cpu24.c: kernels.cpu as built against ABI 2.4: its table ends before the 2.5 member
 * `logit_edit` (top steps, but requests with logit bias or penalties read their logits back). */
#include "kernels-older.h"

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    return older_set(host, err, "cpu24", 4, offsetof(struct tmx_kernels_i, logit_edit));
}
