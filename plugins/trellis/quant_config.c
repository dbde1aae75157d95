/* quant_config.c: the codecs' fixed parameters, and hf_quant_config.json as a reader checks it
 * (docs/trellismx.md §10.4). */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "codec.h"
#include "impl.h"

static const struct tmx_trellis_codec_spec specs[3] = {
    {"trellis-e4m3", TMX_TRELLIS_LAW_E4M3, 32, "e4m3-token"},
    {"trellis-fp4", TMX_TRELLIS_LAW_E2M1, 16, "nvfp4-token"},
    {"trellis-e4m3-pair", TMX_TRELLIS_LAW_PAIR, 32, "e4m3-token"},
};

const struct tmx_trellis_codec_spec *tmx_trellis_codec_spec(enum tmx_trellis_codec_id id) {
    return &specs[id];
}

/* The field `name` of q as a JSON value of type `type` (JSON_REAL: any number); an error naming
 * it when absent or of another type. */
static enum tmx_status field(const char *path, json_t *q, const char *name, json_type type,
                             json_t **out, char **err) {
    static const char *const type_names[] = {"an object", "an array", "a string", "an integer",
                                             "a number", "a boolean", "a boolean", "null"};
    json_t *v = json_object_get(q, name);
    if (!v) return trellis_err(err, TMX_ERR_INVALID, "%s: field \"%s\" is missing", path, name);
    const int ok = type == JSON_REAL ? json_is_number(v) : json_typeof(v) == type;
    if (!ok)
        return trellis_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be %s", path, name,
                           type_names[type]);
    *out = v;
    return TMX_OK;
}

static enum tmx_status string_is(const char *path, json_t *q, const char *name, const char *want,
                                 char **err) {
    json_t *v = NULL;
    enum tmx_status st = field(path, q, name, JSON_STRING, &v, err);
    if (st == TMX_OK && strcmp(json_string_value(v), want) != 0)
        st = trellis_err(err, TMX_ERR_INVALID, "%s: field \"%s\" is \"%s\", expected \"%s\"", path,
                         name, json_string_value(v), want);
    return st;
}

static enum tmx_status int_in(const char *path, json_t *q, const char *name, json_int_t lo,
                              json_int_t hi, int *out, char **err) {
    json_t *v = NULL;
    enum tmx_status st = field(path, q, name, JSON_INTEGER, &v, err);
    if (st != TMX_OK) return st;
    const json_int_t i = json_integer_value(v);
    if (i < lo || i > hi) {
        if (lo == hi)
            return trellis_err(err, TMX_ERR_INVALID, "%s: field \"%s\" is %lld, expected %lld",
                               path, name, (long long)i, (long long)lo);
        return trellis_err(err, TMX_ERR_INVALID, "%s: field \"%s\" is %lld, not in %lld..%lld",
                           path, name, (long long)i, (long long)lo, (long long)hi);
    }
    *out = (int)i;
    return TMX_OK;
}

static enum tmx_status check(const char *path, json_t *q, enum tmx_trellis_codec_id want,
                             struct tmx_trellis_quant_config *out, char **err) {
    const struct tmx_trellis_codec_spec *spec = &specs[want];
    json_t *v = NULL;
    int version, block, hadamard;
    enum tmx_status st;
    if ((st = string_is(path, q, "quant_method", "trellismx", err)) ||
        (st = int_in(path, q, "trellismx_version", TMX_TRELLIS_VERSION, TMX_TRELLIS_VERSION,
                     &version, err)) ||
        (st = string_is(path, q, "codec", spec->name, err)) ||
        (st = string_is(path, q, "law", tmx_trellis_law_name(spec->law), err)) ||
        (st = int_in(path, q, "bits", TMX_TRELLIS_K_MIN, tmx_trellis_k_max(spec->law),
                     &out->bits, err)) ||
        (st = int_in(path, q, "block_size", spec->block, spec->block, &block, err)) ||
        (st = string_is(path, q, "activation", spec->activation, err)) ||
        (st = int_in(path, q, "hadamard_block", TMX_TRELLIS_HADAMARD, TMX_TRELLIS_HADAMARD,
                     &hadamard, err)) ||
        (st = int_in(path, q, "experts_per_file", 1, 1 << 20, &out->experts_per_file, err)) ||
        (st = field(path, q, "mxfp8_tensors", JSON_ARRAY, &v, err)))
        return st;
    for (size_t i = 0; i < json_array_size(v); i++)
        if (!json_is_string(json_array_get(v, i)))
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: field \"mxfp8_tensors\": entry %zu is not a string", path, i);

    out->codec = want;
    out->alpha = 1.0f;
    if (spec->law != TMX_TRELLIS_LAW_E2M1) {
        if (json_object_get(q, "alpha"))
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: field \"alpha\": law %s has no alpha (e2m1 only)", path,
                               tmx_trellis_law_name(spec->law));
        return TMX_OK;
    }
    if ((st = field(path, q, "alpha", JSON_REAL, &v, err))) return st;
    const double a = json_number_value(v);
    if (!(a > 0.0 && (double)(float)a == a && isfinite((float)a)))
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: field \"alpha\" is %.17g, not a positive finite binary32 number",
                           path, a);
    out->alpha = (float)a;
    return TMX_OK;
}

enum tmx_status tmx_trellis_quant_config_read(const char *path, enum tmx_trellis_codec_id want,
                                              struct tmx_trellis_quant_config *out, char **err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return trellis_err(err, errno == ENOENT ? TMX_ERR_NOT_FOUND : TMX_ERR_IO, "%s: %s", path,
                           strerror(errno));
    json_error_t jerr;
    json_t *q = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!q)
        return trellis_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", path, jerr.line, jerr.column,
                           jerr.text);
    enum tmx_status st = json_is_object(q) ? check(path, q, want, out, err)
                                           : trellis_err(err, TMX_ERR_INVALID,
                                                         "%s: not a JSON object", path);
    json_decref(q);
    return st;
}
