/* drafter-repeat.c: prompt-lookup drafting, the smallest drafter that pays off.
 *
 * What it is: a drafter (kind "drafter", ops table struct tmx_drafter_i in tmx/plugin.h). Text
 * that quotes its context (code edits, summaries, retrieved passages) often repeats itself, so
 * the tokens that followed an earlier occurrence of the context's last n tokens are a cheap
 * guess at what comes next. It matches the longest suffix it can, from `ngram` tokens down to
 * one, takes the most recent earlier occurrence, and proposes up to max_draft of the tokens
 * that followed it. The engine verifies every proposed token, so a bad guess costs only time.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND drafter NAME repeat SOURCES drafter-repeat.c);
 * by hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -I core/include \
 *        -o libtmx-drafter-repeat.so tests/plugins/drafter-repeat.c
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir and add
 * "drafter.repeat" to the config's "load" list. Its option: "plugins": {"drafter.repeat":
 * {"ngram": 2}} in the config file, TMX_DRAFTER_REPEAT_NGRAM=2, or
 * --set drafter.repeat.ngram=2.
 *
 * What it shows: an option table, and reading and checking an option in init. */
#include <stdlib.h>
#include <string.h>

#include "tmx/plugin.h"

#define REPEAT_NGRAM_MAX 64

struct repeat {
    int ngram; /* longest suffix matched */
};

static enum tmx_status repeat_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                   void **ctx, char **err) {
    const int64_t ngram = host->opt_int(opts, "ngram");
    if (ngram < 1 || ngram > REPEAT_NGRAM_MAX)
        return host->err(err, TMX_ERR_INVALID, "%s: must be in [1, %d], got %lld",
                         tmx_opt_where(host, opts, "ngram"), REPEAT_NGRAM_MAX, (long long)ngram);
    struct repeat *r = calloc(1, sizeof *r);
    if (!r) return host->err(err, TMX_ERR_NOMEM, "drafter repeat: out of memory");
    r->ngram = (int)ngram;
    *ctx = r;
    return TMX_OK;
}

static void repeat_fini(void *ctx) { free(ctx); }

static int repeat_propose(void *ctx, const int32_t *tokens, int n_tokens, int32_t *draft,
                          int max_draft) {
    const struct repeat *r = ctx;
    if (max_draft <= 0) return 0;
    for (int len = r->ngram < n_tokens ? r->ngram : n_tokens - 1; len >= 1; len--) {
        const int32_t *suffix = tokens + n_tokens - len;
        /* Most recent first; an occurrence must end before the suffix starts to be followed
         * by at least one token. */
        for (int start = n_tokens - len - 1; start >= 0; start--) {
            if (memcmp(tokens + start, suffix, (size_t)len * sizeof *tokens) != 0) continue;
            const int from = start + len;
            int n = n_tokens - from;
            if (n > max_draft) n = max_draft;
            memcpy(draft, tokens + from, (size_t)n * sizeof *draft);
            return n;
        }
    }
    return 0;
}

static const struct tmx_option repeat_opts[] = {
    {"ngram", TMX_OPT_INT, "3", "longest context suffix to look up (1 to 64 tokens)"},
    {0},
};

static const struct tmx_drafter_i repeat_ops = {
    .struct_size = sizeof(struct tmx_drafter_i),
    .init = repeat_init,
    .fini = repeat_fini,
    .propose = repeat_propose,
};

static const struct tmx_plugin repeat_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "repeat",
    .kind = TMX_PLUGIN_DRAFTER,
    .version = "1.0.0",
    .opts = repeat_opts,
    .ops = &repeat_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &repeat_plugin;
}
