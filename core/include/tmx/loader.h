/* tmx/loader.h: finding, loading and checking plugins, and the core's host table.
 *
 * A plugin `<kind>.<name>` is the file libtmx-<kind>-<name>.so, searched in: the config's
 * plugin_dir, each folder of TMX_PLUGIN_PATH (':'-separated), the folder of the running
 * executable, libtmx.so's folder, then the install folder. Loading runs the ABI checks of tmx/plugin.h and resolves
 * the plugin's options from the config (unknown option names are an error naming the key).
 *
 * Ownership: struct tmx_plugins owns every dlopen handle; descriptors it hands out are valid
 * until tmx_plugins_free, which must come after every instance of those plugins is finished. */
#ifndef TMX_LOADER_H
#define TMX_LOADER_H

#include <stddef.h>

#include "tmx/config.h"
#include "tmx/plugin.h"

struct tmx_plugins;

/* The host table the core passes to every plugin. */
const struct tmx_host *tmx_host_get(void);

/* cfg must outlive the result. */
enum tmx_status tmx_plugins_new(const struct tmx_config *cfg, struct tmx_plugins **out, char **err);
void tmx_plugins_free(struct tmx_plugins *ps);

/* Finds and loads libtmx-<kind>-<name>.so. Loading a plugin already loaded returns it again. */
enum tmx_status tmx_plugins_load(struct tmx_plugins *ps, enum tmx_plugin_kind kind,
                                 const char *name, const struct tmx_plugin **out, char **err);
/* Loads a plugin from an explicit path; a second plugin with the same kind and name is an error. */
enum tmx_status tmx_plugins_load_file(struct tmx_plugins *ps, const char *path,
                                      const struct tmx_plugin **out, char **err);
/* Loads every plugin the config's "load" list names. */
enum tmx_status tmx_plugins_load_configured(struct tmx_plugins *ps, char **err);

size_t tmx_plugins_count(const struct tmx_plugins *ps);
/* i-th loaded plugin; *path (if non-NULL) gets the file it came from. */
const struct tmx_plugin *tmx_plugins_at(const struct tmx_plugins *ps, size_t i, const char **path);
/* The resolved options of a loaded plugin. */
const struct tmx_opts *tmx_plugins_opts(const struct tmx_plugins *ps, const struct tmx_plugin *p);

/* A kernel set ready to run: its ops table and the ctx its init returned. */
struct tmx_kernels {
    const struct tmx_plugin *plugin;
    const struct tmx_kernels_i *ops;
    void *ctx;
};

/* Loads kernels.<name> (name NULL: the config's "kernels"), checks that its ops table holds
 * every op the model graph calls (a missing one is an error naming the op and the file), and
 * runs its init. */
enum tmx_status tmx_kernels_open(struct tmx_plugins *ps, const char *name, struct tmx_kernels *out,
                                 char **err);
void tmx_kernels_close(struct tmx_kernels *k);

#endif
