/* tmx/log.h: the core's logger, also handed to plugins as tmx_host.log.
 *
 * One line per call on stderr, prefixed "tmx: " (and "error: ", "warning: " or "debug: " for
 * those levels). Messages above the current level are dropped. The level starts from the
 * environment variable TMX_LOG_LEVEL ("error", "warn", "info", "debug"; default "info") and
 * tmx_plugins_new (tmx/loader.h) sets it from the config's log_level. Safe from any thread. */
#ifndef TMX_LOG_H
#define TMX_LOG_H

#include "tmx/plugin.h"
#include "tmx/status.h"

void tmx_log(enum tmx_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

void tmx_log_set_level(enum tmx_log_level level);
enum tmx_log_level tmx_log_level(void);

/* "error", "warn", "info" or "debug" -> *level; anything else is TMX_ERR_INVALID. */
enum tmx_status tmx_log_level_parse(const char *name, enum tmx_log_level *level);

#endif
