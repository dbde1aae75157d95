/* tmx/config.h: the engine configuration.
 *
 * One JSON file (jansson). Every key has a documented default (docs/config.md), an environment
 * override and a command-line override; precedence: command line > environment > file >
 * default. Unknown keys are an error naming the key and the file.
 *
 * Core keys: plugin_dir, kernels, load, threads, context, batch, seed, log_level, verify, tp, ...
 * (docs/config.md lists them all). Plugin
 * options live under "plugins": {"<kind>.<name>": {"<option>": value}} and are checked against
 * the plugin's option table when it loads (see tmx/loader.h).
 *
 * The config owns every string it returns; they live until tmx_config_free. */
#ifndef TMX_CONFIG_H
#define TMX_CONFIG_H

#include <stdint.h>

#include "tmx/status.h"

struct tmx_config;

/* Reads `path` (NULL: defaults only), then applies TMX_* environment overrides. */
enum tmx_status tmx_config_load(const char *path, struct tmx_config **out, char **err);
void tmx_config_free(struct tmx_config *cfg);

/* Command-line override "key=value": a core key ("threads=4") or a plugin option
 * ("kernels.cpu.threads=4"). The value is parsed as the key's type. */
enum tmx_status tmx_config_set(struct tmx_config *cfg, const char *assignment, char **err);

/* Core keys. A key that is not a core key of that type is a programming error (abort). */
const char *tmx_config_str(const struct tmx_config *cfg, const char *key);
int64_t tmx_config_int(const struct tmx_config *cfg, const char *key);
int tmx_config_bool(const struct tmx_config *cfg, const char *key); /* 0 or 1 */

/* "load": plugins to load besides the kernel set, as "<kind>.<name>" strings. */
int tmx_config_load_count(const struct tmx_config *cfg);
const char *tmx_config_load_at(const struct tmx_config *cfg, int i);

/* Writes the resolved configuration (defaults, file, env, CLI applied) as JSON to stdout. */
void tmx_config_print(const struct tmx_config *cfg);

/* --- plugin options: what the loader (tmx/loader.h) uses ---------------------------------- */

struct tmx_plugin;
struct tmx_opts;

/* Checks the option table of plugin p (loaded from the file `path`, which messages name) and
 * resolves each option from, in order: the command line, TMX_<KIND>_<NAME>_<OPTION> (read now),
 * the file's "plugins" section, then the table's default; a kernel set's or codec's int option
 * "threads" takes the core key "threads" before its default. An option set in the file or on
 * the command line that the table lacks, or a value that is not of the option's type, is an
 * error naming the plugin, the option and where it was set. *out is freed with tmx_opts_free. */
enum tmx_status tmx_config_plugin_opts(const struct tmx_config *cfg, const struct tmx_plugin *p,
                                       const char *path, struct tmx_opts **out, char **err);
void tmx_opts_free(struct tmx_opts *opts);

/* Resolved values, as struct tmx_host hands them to plugins. An option that the table does not
 * declare with that type gives NULL / 0. Strings live as long as opts. */
const char *tmx_opts_str(const struct tmx_opts *opts, const char *name);
int64_t tmx_opts_int(const struct tmx_opts *opts, const char *name);
double tmx_opts_float(const struct tmx_opts *opts, const char *name);
int tmx_opts_bool(const struct tmx_opts *opts, const char *name);
/* Where the value of option `name` came from, for messages: "models/x/tmx.json: plugins:
 * kernels.cpu.threads", "command line: ...", "TMX_KERNELS_CPU_THREADS: ...", or
 * "kernels.cpu.threads (default)". Lives as long as opts; `name` itself when not declared. */
const char *tmx_opts_where(const struct tmx_opts *opts, const char *name);
/* Sets an int option the table declares (a tensor-parallel rank's "device"); returns 0, changing
 * nothing, when it declares none of that name and type. */
int tmx_opts_set_int(struct tmx_opts *opts, const char *name, int64_t value);

#endif
