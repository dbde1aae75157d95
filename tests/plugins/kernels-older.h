/* kernels-older.h: kernels.cpu as a set built against an older ABI minor presents itself: the
 * same ops, with a table that ends before the first member of the next minor. It runs models
 * through the core's paths for older sets. It loads libtmx-kernels-cpu.so from the build's
 * bin/ and copies its descriptor; each kernels-cpuNN.c names one minor. */
#include <dlfcn.h>
#include <stddef.h>

#include "tmx/plugin.h"

static struct tmx_kernels_i older_ops;
static struct tmx_plugin older_plugin;

/* kernels.cpu renamed `name`, its ABI minor `minor` and its ops table `size` bytes long. */
static const struct tmx_plugin *older_set(const struct tmx_host *host, char **err,
                                          const char *name, uint16_t minor, size_t size) {
    static const char path[] = TMX_BIN_DIR "/libtmx-kernels-cpu.so";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL); /* kept open: older_ops points into it */
    if (!lib) {
        host->err(err, TMX_ERR_NOT_FOUND, "kernels %s: %s", name, dlerror());
        return NULL;
    }
    const struct tmx_plugin *(*entry)(const struct tmx_host *, char **);
    *(void **)&entry = dlsym(lib, TMX_PLUGIN_ENTRY_SYMBOL);
    const struct tmx_plugin *cpu = entry ? entry(host, err) : NULL;
    if (!cpu) {
        if (!entry) host->err(err, TMX_ERR_NOT_FOUND, "kernels %s: %s has no entry", name, path);
        return NULL;
    }
    older_ops = *(const struct tmx_kernels_i *)cpu->ops;
    older_ops.struct_size = size;
    older_plugin = *cpu;
    older_plugin.abi_minor = minor;
    older_plugin.name = name;
    older_plugin.ops = &older_ops;
    return &older_plugin;
}
