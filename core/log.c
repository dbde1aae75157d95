/* log.c: one-line messages on stderr, filtered by level. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/log.h"

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static const char *const level_tags[] = {"error: ", "warning: ", "", "debug: "};

/* -1 until first use, when TMX_LOG_LEVEL (or "info") decides. */
static atomic_int current_level = -1;

enum tmx_status tmx_log_level_parse(const char *name, enum tmx_log_level *level) {
    for (int i = TMX_LOG_ERROR; i <= TMX_LOG_DEBUG; i++) {
        if (strcmp(name, level_names[i]) == 0) {
            *level = (enum tmx_log_level)i;
            return TMX_OK;
        }
    }
    return TMX_ERR_INVALID;
}

enum tmx_log_level tmx_log_level(void) {
    int lv = atomic_load(&current_level);
    if (lv < 0) {
        enum tmx_log_level from_env = TMX_LOG_INFO;
        const char *env = getenv("TMX_LOG_LEVEL");
        if (env) tmx_log_level_parse(env, &from_env); /* a bad value leaves "info" */
        int unset = -1;
        atomic_compare_exchange_strong(&current_level, &unset, (int)from_env);
        lv = atomic_load(&current_level);
    }
    return (enum tmx_log_level)lv;
}

void tmx_log_set_level(enum tmx_log_level level) { atomic_store(&current_level, (int)level); }

void tmx_log(enum tmx_log_level level, const char *fmt, ...) {
    if ((unsigned)level > (unsigned)tmx_log_level()) return;
    va_list ap;
    va_start(ap, fmt);
    /* One locked write per line, so lines from several threads never interleave. */
    flockfile(stderr);
    fprintf(stderr, "tmx: %s", level_tags[level]);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    funlockfile(stderr);
    va_end(ap);
}
