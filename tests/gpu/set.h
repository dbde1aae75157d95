/* set.h: what the standalone tools under tests/gpu share: one kernel set opened by name with
 * the default config, and closed. Header-only: each tool stays one file and one executable. */
#ifndef TMX_TESTS_GPU_SET_H
#define TMX_TESTS_GPU_SET_H

#include <stdio.h>
#include <stdlib.h>

#include "tmx/config.h"
#include "tmx/loader.h"

struct tool_set {
    struct tmx_config *cfg;
    struct tmx_plugins *ps;
    struct tmx_kernels k;
};

/* Opens kernel set `name`; on a failure prints "<tool>: <message>" and returns 0. */
static inline int tool_set_open(struct tool_set *s, const char *tool, const char *name) {
    char *err = NULL;
    *s = (struct tool_set){0};
    if (tmx_config_load(NULL, &s->cfg, &err) == TMX_OK &&
        tmx_plugins_new(s->cfg, &s->ps, &err) == TMX_OK &&
        tmx_kernels_open(s->ps, name, &s->k, &err) == TMX_OK)
        return 1;
    fprintf(stderr, "%s: %s\n", tool, err ? err : "out of memory");
    free(err);
    tmx_plugins_free(s->ps);
    tmx_config_free(s->cfg);
    return 0;
}

static inline void tool_set_close(struct tool_set *s) {
    tmx_kernels_close(&s->k);
    tmx_plugins_free(s->ps);
    tmx_config_free(s->cfg);
}

#endif
