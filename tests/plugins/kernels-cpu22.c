/* kernels-cpu22.c: kernels.cpu as built against ABI 2.2: its table ends before the 2.3 member
 * `argmax` (greedy steps read the logits back, and there is no topk). */
#include "kernels-older.h"

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    return older_set(host, err, "cpu22", 2, offsetof(struct tmx_kernels_i, argmax));
}
