/* model-config.c: config.json -> struct tmx_model_config, with docs/model.md's defaults, and
 * the core's members of hf_quant_config.json -> struct tmx_quant_config. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tmx/model.h"

/* Reading helpers: each returns TMX_OK and leaves *out alone when the field is absent and not
 * required; a present field of the wrong type is an error naming the file and the field. */
static enum tmx_status get_int(json_t *o, const char *key, int required, int *out,
                               const char *path, char **err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return required ? tmx_err(err, TMX_ERR_INVALID, "%s: missing field \"%s\"", path, key)
                        : TMX_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (1 << 30))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be a non-negative integer",
                       path, key);
    *out = (int)json_integer_value(v);
    return TMX_OK;
}

static enum tmx_status get_num(json_t *o, const char *key, double *out, const char *path,
                               char **err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return TMX_OK;
    if (!json_is_number(v))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be a number", path, key);
    *out = json_number_value(v);
    return TMX_OK;
}

/* A number that must be above 0, or with zero_ok at least 0 (rms_norm_eps: transformers takes 0).
 * JSON has no NaN or infinity and jansson refuses a number that overflows, so it is finite. */
static enum tmx_status get_positive(json_t *o, const char *key, int zero_ok, double *out,
                                    const char *path, char **err) {
    double v = 0;
    enum tmx_status st = get_num(o, key, &v, path, err);
    json_t *j = json_object_get(o, key);
    if (st != TMX_OK || !j || json_is_null(j)) return st;
    if (zero_ok ? v < 0 : v <= 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be %s 0, got %g", path, key,
                       zero_ok ? ">=" : ">", v);
    *out = v;
    return TMX_OK;
}

/* A token id that must be below vocab_size (read before it). */
static enum tmx_status check_id(const struct tmx_model_config *c, const char *key, long long id,
                                const char *path, char **err) {
    if (id >= 0 && id < c->vocab_size) return TMX_OK;
    return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\": %lld is not a token id below "
                   "vocab_size (%d)", path, key, id, c->vocab_size);
}

static enum tmx_status get_bool(json_t *o, const char *key, int *out, const char *path,
                                char **err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return TMX_OK;
    if (!json_is_boolean(v))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be true or false", path, key);
    *out = json_is_true(v);
    return TMX_OK;
}

static enum tmx_status get_str(json_t *o, const char *key, const char **out, const char *path,
                               char **err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return TMX_OK;
    if (!json_is_string(v))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be a string", path, key);
    *out = json_string_value(v);
    return TMX_OK;
}

static enum tmx_status parse_rope_scaling(json_t *root, struct tmx_model_config *c,
                                          const char *path, char **err) {
    json_t *rs = json_object_get(root, "rope_scaling");
    if (!rs || json_is_null(rs)) return TMX_OK;
    if (!json_is_object(rs))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"rope_scaling\" must be an object", path);
    const char *type = NULL;
    enum tmx_status st = get_str(rs, "rope_type", &type, path, err);
    if (st == TMX_OK && !type) st = get_str(rs, "type", &type, path, err);
    if (st != TMX_OK) return st;
    if (!type || strcmp(type, "default") == 0) return TMX_OK;
    c->rope_factor = 1.0;
    if ((st = get_num(rs, "factor", &c->rope_factor, path, err)) != TMX_OK) return st;
    if (c->rope_factor <= 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: rope_scaling.factor must be > 0", path);
    if (strcmp(type, "linear") == 0) {
        c->rope_type = TMX_ROPE_LINEAR;
        return TMX_OK;
    }
    if (strcmp(type, "llama3") == 0) {
        c->rope_type = TMX_ROPE_LLAMA3;
        c->rope_low_freq_factor = 1.0;
        c->rope_high_freq_factor = 4.0;
        c->rope_original_max_pos = 8192;
        if ((st = get_num(rs, "low_freq_factor", &c->rope_low_freq_factor, path, err)) ||
            (st = get_num(rs, "high_freq_factor", &c->rope_high_freq_factor, path, err)) ||
            (st = get_int(rs, "original_max_position_embeddings", 0, &c->rope_original_max_pos,
                          path, err)))
            return st;
        if (c->rope_high_freq_factor <= c->rope_low_freq_factor)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: rope_scaling.high_freq_factor must exceed low_freq_factor", path);
        return TMX_OK;
    }
    return tmx_err(err, TMX_ERR_UNSUPPORTED,
                   "%s: rope_scaling type \"%s\" is not supported (default, linear, llama3)", path,
                   type);
}

/* layer_types, dense_layers and the per-layer flags they set. */
static enum tmx_status parse_layers(json_t *root, struct tmx_model_config *c, const char *path,
                                    char **err) {
    json_t *lt = json_object_get(root, "layer_types");
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt) || (int)json_array_size(lt) != c->n_layers)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: field \"layer_types\" must be an array of num_hidden_layers (%d) "
                           "strings", path, c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            const char *s = json_string_value(json_array_get(lt, (size_t)l));
            if (s && strcmp(s, "sliding_attention") == 0) c->sliding[l] = 1;
            else if (!s || strcmp(s, "full_attention") != 0)
                return tmx_err(err, TMX_ERR_INVALID,
                               "%s: layer_types[%d] must be \"sliding_attention\" or "
                               "\"full_attention\"", path, l);
        }
    }
    if (c->type == TMX_MODEL_LLAMA) {
        memset(c->dense, 1, (size_t)c->n_layers);
        return TMX_OK;
    }
    json_t *dl = json_object_get(root, "dense_layers");
    if (!dl || json_is_null(dl)) return TMX_OK;
    if (!json_is_array(dl))
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"dense_layers\" must be an array", path);
    for (size_t i = 0; i < json_array_size(dl); i++) {
        json_t *v = json_array_get(dl, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= c->n_layers)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: dense_layers[%zu] must be a layer id below %d", path, i,
                           c->n_layers);
        c->dense[json_integer_value(v)] = 1;
    }
    return TMX_OK;
}

/* Adds an end-of-sequence id once; false when the set is full. */
static int add_eos(struct tmx_model_config *c, int id) {
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == id) return 1;
    if (c->n_eos == TMX_MAX_EOS) return 0;
    c->eos_token_ids[c->n_eos++] = id;
    return 1;
}

/* "eos_token_id": an integer or a list, of config.json and then of generation_config.json
 * (which often lists more, e.g. gpt-oss's <|call|>); the union is kept. */
static enum tmx_status parse_eos(json_t *root, struct tmx_model_config *c, const char *path,
                                 char **err) {
    json_t *v = json_object_get(root, "eos_token_id");
    if (!v || json_is_null(v)) return TMX_OK;
    const int list = json_is_array(v);
    const size_t n = list ? json_array_size(v) : 1;
    for (size_t i = 0; i < n; i++) {
        json_t *e = list ? json_array_get(v, i) : v;
        if (!json_is_integer(e))
            return tmx_err(err, TMX_ERR_INVALID, "%s: field \"eos_token_id\" must be an integer "
                           "or a list of integers", path);
        enum tmx_status st = check_id(c, "eos_token_id", json_integer_value(e), path, err);
        if (st != TMX_OK) return st;
        if (!add_eos(c, (int)json_integer_value(e)))
            return tmx_err(err, TMX_ERR_INVALID, "%s: more than %d end-of-sequence ids", path,
                           TMX_MAX_EOS);
    }
    return TMX_OK;
}

/* The sampling defaults of generation_config.json that vLLM applies: temperature, top_p,
 * top_k, min_p, repetition_penalty and max_new_tokens (do_sample is not read). As vLLM, which
 * reads the file's difference from transformers' GenerationConfig(), a value equal to
 * transformers' default (`hf`: a top_k of 50) is not applied. */
static enum tmx_status parse_sampling(json_t *root, struct tmx_sampling_defaults *g,
                                      const char *path, char **err) {
    static const struct {
        const char *key;
        double hf, lo, hi; /* [lo, hi], lo excluded when open */
        int open, integer;
    } field[] = {
        {"temperature", 1, 0, 100, 0, 0},        {"top_p", 1, 0, 1, 1, 0},
        {"top_k", 50, 0, 1 << 30, 0, 1},         {"min_p", 0, 0, 1, 0, 0},
        {"repetition_penalty", 1, 0, 100, 1, 0}, {"max_new_tokens", 0, 1, 1 << 30, 0, 1},
    };
    double v[6] = {g->temperature, g->top_p, g->top_k, g->min_p, g->repetition_penalty,
                   g->max_tokens};
    for (int i = 0; i < 6; i++) {
        double x = field[i].hf;
        enum tmx_status st = get_num(root, field[i].key, &x, path, err);
        if (st != TMX_OK) return st;
        if (x == field[i].hf) continue;
        if (!(field[i].open ? x > field[i].lo : x >= field[i].lo) || !(x <= field[i].hi) ||
            (field[i].integer && x != (double)(int)x))
            return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be %s in %s%g, %g], got "
                           "%g", path, field[i].key, field[i].integer ? "an integer" : "a number",
                           field[i].open ? "(" : "[", field[i].lo, field[i].hi, x);
        v[i] = x;
        g->from_file++;
    }
    g->temperature = (float)v[0];
    g->top_p = (float)v[1];
    g->top_k = (int)v[2];
    g->min_p = (float)v[3];
    g->repetition_penalty = (float)v[4];
    g->max_tokens = (int)v[5];
    return TMX_OK;
}

/* generation_config.json is optional: its eos_token_id and sampling defaults. */
static enum tmx_status parse_generation_config(const char *dir, struct tmx_model_config *c,
                                               char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    c->gen = (struct tmx_sampling_defaults)TMX_SAMPLING_DEFAULTS;
    FILE *f = fopen(path, "r");
    if (!f) return TMX_OK;
    json_error_t jerr;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", path, jerr.line, jerr.column,
                       jerr.text);
    enum tmx_status st = !json_is_object(root)
                             ? tmx_err(err, TMX_ERR_INVALID, "%s: not a JSON object", path)
                             : parse_eos(root, c, path, err);
    if (st == TMX_OK) st = parse_sampling(root, &c->gen, path, err);
    json_decref(root);
    return st;
}

/* The checks that make the graph's shapes consistent, so the forward pass can trust them. */
static enum tmx_status check(const struct tmx_model_config *c, const char *path, char **err) {
    if (c->max_position_embeddings < 1)
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"max_position_embeddings\" must be at "
                       "least 1", path);
    if (c->n_layers < 1 || c->n_layers > TMX_MAX_LAYERS)
        return tmx_err(err, TMX_ERR_INVALID, "%s: num_hidden_layers must be 1..%d", path,
                       TMX_MAX_LAYERS);
    if (c->n_heads < 1 || c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: num_key_value_heads (%d) must divide num_attention_heads (%d)", path,
                       c->n_kv_heads, c->n_heads);
    if (c->head_dim < 2 || c->head_dim % 2)
        return tmx_err(err, TMX_ERR_INVALID, "%s: head_dim must be even", path);
    int any_sliding = 0, any_dense = 0, any_moe = 0;
    for (int l = 0; l < c->n_layers; l++) {
        any_sliding |= c->sliding[l];
        any_dense |= c->dense[l];
        any_moe |= !c->dense[l];
    }
    if (any_sliding && c->sliding_window < 1)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: field \"sliding_window\" is required by sliding_attention layers",
                       path);
    if (any_dense && c->intermediate_size < 1)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: field \"intermediate_size\" is required by dense layers", path);
    if (any_moe) {
        if (c->n_routed_experts < 1 || c->moe_latent_size < 1 || c->moe_intermediate_size < 1)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: MoE layers need n_routed_experts, moe_latent_size and "
                           "moe_intermediate_size", path);
        if (c->n_experts_per_tok < 1 || c->n_experts_per_tok > c->n_routed_experts)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: num_experts_per_tok must be 1..n_routed_experts", path);
    }
    return TMX_OK;
}

static enum tmx_status parse(json_t *root, struct tmx_model_config *c, const char *path,
                             char **err) {
    const char *type = NULL;
    enum tmx_status st = get_str(root, "model_type", &type, path, err);
    if (st) return st;
    if (!type) return tmx_err(err, TMX_ERR_INVALID, "%s: missing field \"model_type\"", path);
    if (strcmp(type, "muse_spark") == 0) c->type = TMX_MODEL_MUSE;
    else if (strcmp(type, "llama") == 0 || strcmp(type, "qwen3") == 0) c->type = TMX_MODEL_LLAMA;
    else
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: model_type \"%s\" is not supported (muse_spark, llama, qwen3)", path,
                       type);

    c->max_position_embeddings = 4096;
    c->rope_theta = 10000.0;
    c->rms_norm_eps = 1e-6;
    c->routed_scaling_factor = 1.0;
    c->norm_topk_prob = 1;
    c->bos_token_id = -1;
    c->rope_local_theta = -1;
    c->n_kv_heads = -1;
    c->head_dim = -1;
    const char *score = NULL;
    if ((st = get_int(root, "vocab_size", 1, &c->vocab_size, path, err)) ||
        (st = get_int(root, "hidden_size", 1, &c->hidden, path, err)) ||
        (st = get_int(root, "num_hidden_layers", 1, &c->n_layers, path, err)) ||
        (st = get_int(root, "num_attention_heads", 1, &c->n_heads, path, err)) ||
        (st = get_int(root, "num_key_value_heads", 0, &c->n_kv_heads, path, err)) ||
        (st = get_int(root, "head_dim", 0, &c->head_dim, path, err)) ||
        (st = get_int(root, "sliding_window", 0, &c->sliding_window, path, err)) ||
        (st = get_positive(root, "rope_theta", 0, &c->rope_theta, path, err)) ||
        (st = get_positive(root, "rope_local_theta", 0, &c->rope_local_theta, path, err)) ||
        (st = get_int(root, "max_position_embeddings", 0, &c->max_position_embeddings, path,
                      err)) ||
        (st = get_positive(root, "rms_norm_eps", 1, &c->rms_norm_eps, path, err)) ||
        (st = get_bool(root, "tie_word_embeddings", &c->tie_word_embeddings, path, err)) ||
        (st = get_int(root, "intermediate_size", 0, &c->intermediate_size, path, err)) ||
        (st = get_int(root, "n_routed_experts", 0, &c->n_routed_experts, path, err)) ||
        (st = get_int(root, "num_experts_per_tok", 0, &c->n_experts_per_tok, path, err)) ||
        (st = get_int(root, "moe_latent_size", 0, &c->moe_latent_size, path, err)) ||
        (st = get_int(root, "moe_intermediate_size", 0, &c->moe_intermediate_size, path, err)) ||
        (st = get_int(root, "n_shared_experts", 0, &c->n_shared_experts, path, err)) ||
        (st = get_num(root, "routed_scaling_factor", &c->routed_scaling_factor, path, err)) ||
        (st = get_bool(root, "norm_topk_prob", &c->norm_topk_prob, path, err)) ||
        (st = get_str(root, "router_score", &score, path, err)) ||
        (st = get_bool(root, "residual_gates", &c->residual_gates, path, err)) ||
        (st = get_int(root, "bos_token_id", 0, &c->bos_token_id, path, err)) ||
        (st = parse_eos(root, c, path, err)) || (st = parse_rope_scaling(root, c, path, err)))
        return st;
    if (c->bos_token_id >= 0 && (st = check_id(c, "bos_token_id", c->bos_token_id, path, err)))
        return st;
    if (c->n_kv_heads < 0) c->n_kv_heads = c->n_heads;
    if (c->head_dim < 0) c->head_dim = c->n_heads ? c->hidden / c->n_heads : 0;
    if (c->rope_local_theta < 0) c->rope_local_theta = c->rope_theta;
    if (score && strcmp(score, "softmax") == 0) c->router_score = TMX_ROUTER_SOFTMAX;
    else if (score && strcmp(score, "sigmoid") != 0)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: field \"router_score\" must be \"sigmoid\" or \"softmax\"", path);
    if (c->n_layers > TMX_MAX_LAYERS)
        return tmx_err(err, TMX_ERR_INVALID, "%s: num_hidden_layers must be 1..%d", path,
                       TMX_MAX_LAYERS);
    if ((st = parse_layers(root, c, path, err))) return st;
    return check(c, path, err);
}

enum tmx_status tmx_model_config_load(const char *dir, struct tmx_model_config *cfg, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t jerr;
    if (access(path, R_OK) != 0)
        return tmx_err(err, errno == ENOENT ? TMX_ERR_NOT_FOUND : TMX_ERR_IO, "%s: %s", path,
                       strerror(errno));
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", path, jerr.line, jerr.column,
                       jerr.text);
    memset(cfg, 0, sizeof *cfg);
    enum tmx_status st = json_is_object(root)
                             ? parse(root, cfg, path, err)
                             : tmx_err(err, TMX_ERR_INVALID, "%s: not a JSON object", path);
    json_decref(root);
    return st == TMX_OK ? parse_generation_config(dir, cfg, err) : st;
}

/* A string member into buf[size]; absent leaves buf alone. */
static enum tmx_status get_name(json_t *o, const char *key, char *buf, size_t size,
                                const char *path, char **err) {
    const char *v = NULL;
    enum tmx_status st = get_str(o, key, &v, path, err);
    if (st != TMX_OK || !v) return st;
    if (strlen(v) >= size)
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be shorter than %zu bytes",
                       path, key, size);
    snprintf(buf, size, "%s", v);
    return TMX_OK;
}

enum tmx_status tmx_quant_config_load(const char *dir, struct tmx_quant_config *q, char **err) {
    memset(q, 0, sizeof *q);
    snprintf(q->path, sizeof q->path, "%s/hf_quant_config.json", dir);
    if (access(q->path, F_OK) != 0) return TMX_OK;
    json_error_t jerr;
    json_t *root = json_load_file(q->path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", q->path, jerr.line, jerr.column,
                       jerr.text);
    enum tmx_status st = json_is_object(root)
                             ? TMX_OK
                             : tmx_err(err, TMX_ERR_INVALID, "%s: not a JSON object", q->path);
    if (st == TMX_OK)
        st = get_name(root, "quant_method", q->quant_method, sizeof q->quant_method, q->path,
                      err);
    if (st == TMX_OK) st = get_name(root, "codec", q->codec, sizeof q->codec, q->path, err);
    if (st == TMX_OK) st = get_int(root, "bits", 0, &q->bits, q->path, err);
    if (st == TMX_OK) st = get_int(root, "block_size", 0, &q->block_size, q->path, err);
    if (st == TMX_OK)
        st = get_int(root, "experts_per_file", 0, &q->experts_per_file, q->path, err);
    json_t *mx = json_object_get(root, "mxfp8_tensors");
    if (st == TMX_OK && mx && !json_is_null(mx) && !json_is_array(mx))
        st = tmx_err(err, TMX_ERR_INVALID, "%s: field \"mxfp8_tensors\" must be an array",
                     q->path);
    if (st == TMX_OK) {
        q->mxfp8 = json_array_size(mx) > 0;
        q->present = 1;
    }
    json_decref(root);
    return st;
}
