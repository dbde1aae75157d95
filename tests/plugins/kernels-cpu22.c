/* kernels-cpu22.c: kernels.cpu as a set built against ABI 2.2 presents itself: the same ops,
 * with a table that ends before the 2.3 member `argmax`. It runs models through the core's
 * paths for older sets (greedy steps that read the logits back). It loads
 * libtmx-kernels-cpu.so from the build's bin/ and copies its descriptor. */
#include <dlfcn.h>
#include <stddef.h>

#include "tmx/plugin.h"

static struct tmx_kernels_i ops22;
static struct tmx_plugin plugin22;

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    static const char path[] = TMX_BIN_DIR "/libtmx-kernels-cpu.so";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL); /* kept open: ops22 points into it */
    if (!lib) {
        host->err(err, TMX_ERR_NOT_FOUND, "kernels cpu22: %s", dlerror());
        return NULL;
    }
    const struct tmx_plugin *(*entry)(const struct tmx_host *, char **);
    *(void **)&entry = dlsym(lib, TMX_PLUGIN_ENTRY_SYMBOL);
    const struct tmx_plugin *cpu = entry ? entry(host, err) : NULL;
    if (!cpu) {
        if (!entry) host->err(err, TMX_ERR_NOT_FOUND, "kernels cpu22: %s has no entry", path);
        return NULL;
    }
    ops22 = *(const struct tmx_kernels_i *)cpu->ops;
    ops22.struct_size = offsetof(struct tmx_kernels_i, argmax);
    plugin22 = *cpu;
    plugin22.abi_minor = 2;
    plugin22.name = "cpu22";
    plugin22.ops = &ops22;
    return &plugin22;
}
