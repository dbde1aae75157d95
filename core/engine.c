/* engine.c: opening a model directory end to end — config, plugins, kernel set, checkpoint,
 * graph, tokenizer — and closing it in reverse order. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tmx/kvcache.h"
#include "tmx/manifest.h"
#include "tmx/tmx.h"

struct tmx_engine {
    struct tmx_config *cfg;
    struct tmx_plugins *plugins;
    struct tmx_kernels kernels;
    struct tmx_checkpoint *ck;
    struct tmx_model *model;
    struct tmx_tokenizer *tok;
};

/* A quantized build vouches for its files (tmx/manifest.h): their sizes and the absence of stray
 * expert files always, their SHA-256 with config key "verify". Checked before any is opened, so
 * that damage is reported by file name rather than as a parse error. */
static enum tmx_status verify_build(const char *dir, const struct tmx_config *cfg, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    if (access(path, F_OK) != 0) return TMX_OK;
    return tmx_manifest_verify(dir, tmx_config_bool(cfg, "verify"), err);
}

/* The KV cache from the config: room for max_running sequences of the context by default. */
static enum tmx_status kv_init(struct tmx_engine *e, char **err) {
    const struct tmx_kv_options o = {
        .n_ctx = tmx_engine_n_ctx(e),
        .n_batch = (int)tmx_config_int(e->cfg, "batch"),
        .max_seqs = (int)tmx_config_int(e->cfg, "max_running"),
        .block_size = (int)tmx_config_int(e->cfg, "kv_block_size"),
        .n_tokens = (int)tmx_config_int(e->cfg, "kv_tokens"),
        .dtype = tmx_kv_dtype_parse(tmx_config_str(e->cfg, "kv_dtype")),
        .prefix_cache = tmx_config_bool(e->cfg, "prefix_cache"),
        .graphs = tmx_config_bool(e->cfg, "graphs"),
    };
    return tmx_model_kv_init(e->model, &o, err);
}

enum tmx_status tmx_engine_open(const char *model_dir, const char *config_path, int n_overrides,
                                const char *const *overrides, struct tmx_engine **out,
                                char **err) {
    struct tmx_engine *e = calloc(1, sizeof *e);
    if (!e) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    enum tmx_status st = tmx_config_load(config_path, &e->cfg, err);
    for (int i = 0; st == TMX_OK && i < n_overrides; i++)
        st = tmx_config_set(e->cfg, overrides[i], err);
    if (st == TMX_OK) st = tmx_plugins_new(e->cfg, &e->plugins, err);
    if (st == TMX_OK) st = tmx_plugins_load_configured(e->plugins, err);
    if (st == TMX_OK) st = tmx_kernels_open(e->plugins, NULL, &e->kernels, err);
    if (st == TMX_OK) st = verify_build(model_dir, e->cfg, err);
    if (st == TMX_OK) st = tmx_checkpoint_open(model_dir, &e->ck, err);
    if (st == TMX_OK) st = tmx_model_load(e->ck, &e->kernels, e->plugins, &e->model, err);
    if (st == TMX_OK) st = kv_init(e, err);
    if (st == TMX_OK) {
        char path[4096];
        snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
        st = tmx_tokenizer_load(path, &e->tok, err);
    }
    if (st != TMX_OK) {
        tmx_engine_free(e);
        return st;
    }
    *out = e;
    return TMX_OK;
}

void tmx_engine_free(struct tmx_engine *e) {
    if (!e) return;
    tmx_tokenizer_free(e->tok);
    tmx_model_free(e->model);
    tmx_checkpoint_free(e->ck);
    if (e->kernels.ops) tmx_kernels_close(&e->kernels);
    tmx_plugins_free(e->plugins);
    tmx_config_free(e->cfg);
    free(e);
}

const struct tmx_config *tmx_engine_config(const struct tmx_engine *e) { return e->cfg; }
struct tmx_model *tmx_engine_model(struct tmx_engine *e) { return e->model; }
const struct tmx_tokenizer *tmx_engine_tokenizer(const struct tmx_engine *e) { return e->tok; }
const struct tmx_plugins *tmx_engine_plugins(const struct tmx_engine *e) { return e->plugins; }
struct tmx_plugins *tmx_engine_plugins_mut(struct tmx_engine *e) { return e->plugins; }
const char *tmx_engine_model_dir(const struct tmx_engine *e) { return tmx_checkpoint_dir(e->ck); }

int tmx_engine_n_vocab(const struct tmx_engine *e) {
    const int n_tok = tmx_tokenizer_n_vocab(e->tok), n_model = tmx_model_cfg(e->model)->vocab_size;
    return n_tok < n_model ? n_tok : n_model;
}

int tmx_engine_n_ctx(const struct tmx_engine *e) {
    const int64_t want = tmx_config_int(e->cfg, "context");
    const int max = tmx_model_cfg(e->model)->max_position_embeddings;
    return want > 0 && want < max ? (int)want : max;
}

void tmx_free(void *p) { free(p); }
