/* test_manifest.c: trellismx-manifest.json (core/manifest.c, docs/trellismx.md §10.6).
 *
 * A small build folder (config, hf_quant_config, a shard, two expert chunks of one layer and
 * its coupled file) is written, its manifest made and checked; then each kind of damage must
 * fail verification naming the file: a changed byte (only when hashing), a truncated, missing
 * or stray file, and a manifest path leaving the folder. The writer refuses chunks with a gap
 * and a layer without its coupled file. Also the config key "verify" it is switched by. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "tmx/config.h"
#include "tmx/manifest.h"
#include "tmx/safetensors.h"

static char dir[] = "/tmp/tmx-manifest-XXXXXX";

static void put(const char *rel, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A safetensors file holding the named U8 tensors of `n` bytes each. */
static void put_st(const char *rel, int count, const char *const *names, int64_t n) {
    char path[512];
    uint8_t data[64];
    struct tmx_tensor t[3];
    for (int i = 0; i < count; i++) {
        for (int k = 0; k < n; k++) data[k] = (uint8_t)(17 * k + i);
        t[i] = (struct tmx_tensor){TMX_DTYPE_U8, 1, {n}, data};
    }
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    assert_int_equal(tmx_safetensors_write(path, count, names, t, NULL, NULL), TMX_OK);
}

static int setup(void **state) {
    (void)state;
    char cmd[600];
    strcpy(dir, "/tmp/tmx-manifest-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/experts' '%s/coupled'", dir, dir);
    assert_int_equal(system(cmd), 0);
    put("config.json", "{\"model_type\": \"muse_spark\", \"vocab_size\": 64, \"hidden_size\": 128,"
                       " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"dense_layers\":"
                       " [0], \"n_routed_experts\": 3, \"num_experts_per_tok\": 2,"
                       " \"moe_latent_size\": 128, \"moe_intermediate_size\": 128,"
                       " \"intermediate_size\": 256}\n");
    put("hf_quant_config.json", "{\"quant_method\": \"trellismx\", \"codec\": \"trellis-fp4\"}\n");
    put("tokenizer.json", "hello");
    const char *w[] = {"gate_proj.trellis"}, *v[] = {"sign_latent_in", "sign_intermediate",
                                                     "sign_latent_out"};
    put_st("model-00001-of-00001.safetensors", 1, w, 32);
    put_st("experts/layer-001-000-001.safetensors", 1, w, 64);
    put_st("experts/layer-001-002-002.safetensors", 1, w, 32);
    put_st("coupled/layer-001.safetensors", 3, v, 16);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

static void expect_fail(int hashes, const char *file, const char *what) {
    char *err = NULL;
    assert_int_not_equal(tmx_manifest_verify(dir, hashes, &err), TMX_OK);
    assert_non_null(err);
    if (!strstr(err, file) || !strstr(err, what))
        fail_msg("expected \"%s\" and \"%s\" in: %s", file, what, err);
    free(err);
}

static void test_write_and_verify(void **state) {
    (void)state;
    char *err = NULL, path[512];
    if (tmx_manifest_write(dir, &err) != TMX_OK) fail_msg("%s", err);
    assert_int_equal(tmx_manifest_verify(dir, 1, NULL), TMX_OK);

    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    json_t *m = json_load_file(path, 0, NULL);
    assert_non_null(m);
    assert_string_equal(json_string_value(json_object_get(m, "format")), "trellismx-manifest");
    assert_string_equal(json_string_value(json_object_get(m, "codec")), "trellis-fp4");
    json_t *files = json_object_get(m, "files");
    assert_int_equal(json_array_size(files), 7); /* everything but the manifest, sorted */
    assert_string_equal(json_string_value(json_object_get(json_array_get(files, 0), "path")),
                        "config.json");
    assert_string_equal(json_string_value(json_object_get(json_array_get(files, 1), "path")),
                        "coupled/layer-001.safetensors");
    json_t *tok = json_array_get(files, 6);
    assert_string_equal(json_string_value(json_object_get(tok, "path")), "tokenizer.json");
    assert_int_equal(json_integer_value(json_object_get(tok, "size")), 5);
    assert_string_equal(json_string_value(json_object_get(tok, "sha256")), /* of "hello" */
                        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
    json_t *layer = json_array_get(json_object_get(m, "layers"), 0);
    assert_int_equal(json_array_size(json_object_get(m, "layers")), 1);
    assert_int_equal(json_integer_value(json_object_get(layer, "layer")), 1);
    json_t *chunks = json_object_get(layer, "experts");
    assert_int_equal(json_array_size(chunks), 2);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(chunks, 1), "first")), 2);
    json_t *ch = json_object_get(json_object_get(layer, "coupled"), "sha256");
    assert_int_equal(strlen(json_string_value(json_object_get(ch, "sign_intermediate"))), 64);
    json_decref(m);
}

static void test_changed_byte(void **state) {
    (void)state;
    assert_int_equal(tmx_manifest_write(dir, NULL), TMX_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/experts/layer-001-000-001.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    fseek(f, -3, SEEK_END);
    const int c = fgetc(f);
    fseek(f, -3, SEEK_END);
    fputc(c ^ 0x10, f);
    fclose(f);
    assert_int_equal(tmx_manifest_verify(dir, 0, NULL), TMX_OK); /* sizes only */
    expect_fail(1, "experts/layer-001-000-001.safetensors", "SHA-256 differs");
}

static void test_truncated_missing_stray(void **state) {
    (void)state;
    assert_int_equal(tmx_manifest_write(dir, NULL), TMX_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/experts/layer-001-002-002.safetensors", dir);
    assert_int_equal(truncate(path, 40), 0);
    expect_fail(0, "experts/layer-001-002-002.safetensors", "40 bytes");
    assert_int_equal(unlink(path), 0);
    expect_fail(0, "experts/layer-001-002-002.safetensors", "missing");

    teardown(state); /* a fresh folder */
    setup(state);
    assert_int_equal(tmx_manifest_write(dir, NULL), TMX_OK);
    put("experts/stray.bin", "x");
    expect_fail(0, "experts/stray.bin", "not listed");
}

static void test_unsafe_path(void **state) {
    (void)state;
    assert_int_equal(tmx_manifest_write(dir, NULL), TMX_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    json_t *m = json_load_file(path, 0, NULL);
    json_t *first = json_array_get(json_object_get(m, "files"), 0);
    json_object_set_new(first, "path", json_string("../config.json"));
    json_dump_file(m, path, 0);
    json_decref(m);
    expect_fail(0, TMX_MANIFEST_NAME, "relative path");
}

/* A fresh manifest edited by fn, then verified: it must fail naming `what`. */
static void expect_edit_fails(void (*fn)(json_t *m), const char *what) {
    char path[512];
    assert_int_equal(tmx_manifest_write(dir, NULL), TMX_OK);
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    json_t *m = json_load_file(path, 0, NULL);
    assert_non_null(m);
    fn(m);
    json_dump_file(m, path, 0);
    json_decref(m);
    expect_fail(0, TMX_MANIFEST_NAME, what);
}

static json_t *layer0(json_t *m) { return json_array_get(json_object_get(m, "layers"), 0); }
static json_t *chunk(json_t *m, size_t i) {
    return json_array_get(json_object_get(layer0(m), "experts"), i);
}
static void codec_nope(json_t *m) { json_object_set_new(m, "codec", json_string("nope")); }
static void dense_layer(json_t *m) { json_object_set_new(layer0(m), "layer", json_integer(0)); }
static void no_such_layer(json_t *m) { json_object_set_new(layer0(m), "layer", json_integer(9)); }
static void layer_twice(json_t *m) {
    json_array_append_new(json_object_get(m, "layers"), json_deep_copy(layer0(m)));
}
static void no_layers(json_t *m) { json_array_clear(json_object_get(m, "layers")); }
static void past_last(json_t *m) { json_object_set_new(chunk(m, 1), "last", json_integer(5)); }
static void short_of_last(json_t *m) {
    json_array_remove(json_object_get(layer0(m), "experts"), 1);
}
static void swapped_paths(json_t *m) {
    json_t *a = json_incref(json_object_get(chunk(m, 0), "path"));
    json_object_set(chunk(m, 0), "path", json_object_get(chunk(m, 1), "path"));
    json_object_set_new(chunk(m, 1), "path", a);
}

/* "codec" and "layers" against the build's hf_quant_config.json and config.json (layer 1 of 2
 * is MoE, 3 experts). */
static void test_layers_against_config(void **state) {
    (void)state;
    expect_edit_fails(codec_nope, "codec \"nope\" is not hf_quant_config.json's (trellis-fp4)");
    expect_edit_fails(dense_layer, "layer 0 is not an MoE layer");
    expect_edit_fails(no_such_layer, "layer 9 is not an MoE layer");
    expect_edit_fails(layer_twice, "layer 1 is not an MoE layer of config.json listed once");
    expect_edit_fails(no_layers, "MoE layer 1 is missing");
    expect_edit_fails(past_last, "passes the last (2)");
    expect_edit_fails(short_of_last, "its chunks end at expert 1 of 3");
    expect_edit_fails(swapped_paths, "should be experts/layer-001-000-001.safetensors");
}

static void test_writer_refuses(void **state) {
    (void)state;
    char path[512], *err = NULL;
    snprintf(path, sizeof path, "%s/experts/layer-001-000-001.safetensors", dir);
    assert_int_equal(unlink(path), 0);
    assert_int_not_equal(tmx_manifest_write(dir, &err), TMX_OK);
    assert_non_null(strstr(err, "experts/layer-001-002-002.safetensors"));
    assert_non_null(strstr(err, "gap"));
    free(err);
    err = NULL;
    teardown(state);
    setup(state);
    snprintf(path, sizeof path, "%s/coupled/layer-001.safetensors", dir);
    assert_int_equal(unlink(path), 0);
    assert_int_not_equal(tmx_manifest_write(dir, &err), TMX_OK);
    assert_non_null(strstr(err, "coupled/layer-001.safetensors: missing"));
    free(err);
}

static void test_config_verify_key(void **state) {
    (void)state;
    struct tmx_config *cfg;
    char *err = NULL;
    unsetenv("TMX_VERIFY");
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_bool(cfg, "verify"), 1);
    assert_int_equal(tmx_config_set(cfg, "verify=false", NULL), TMX_OK);
    assert_int_equal(tmx_config_bool(cfg, "verify"), 0);
    assert_int_equal(tmx_config_set(cfg, "verify=maybe", &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "verify"));
    free(err);
    tmx_config_free(cfg);
    setenv("TMX_VERIFY", "0", 1);
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_bool(cfg, "verify"), 0);
    tmx_config_free(cfg);
    unsetenv("TMX_VERIFY");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_write_and_verify, setup, teardown),
        cmocka_unit_test_setup_teardown(test_changed_byte, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncated_missing_stray, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsafe_path, setup, teardown),
        cmocka_unit_test_setup_teardown(test_writer_refuses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layers_against_config, setup, teardown),
        cmocka_unit_test(test_config_verify_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
