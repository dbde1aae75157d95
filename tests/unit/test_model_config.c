/* test_model_config.c: config.json and generation_config.json as core/model-config.c reads them.
 *
 * Fields that would make the graph compute NaN (a RoPE base of 0, a negative RMSNorm epsilon),
 * leave it no positions, or name a token the embedding does not have are refused when the file
 * loads, in one line naming the file and the field; their edge values still load. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/model.h"

static char dir[] = "/tmp/tmx-model-config-XXXXXX";

/* One dense layer, vocab 64, and the fields of `extra`. */
static void write_config(const char *extra) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"model_type\": \"llama\", \"vocab_size\": 64, \"hidden_size\": 32,"
            " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"intermediate_size\": 64"
            "%s%s}\n", *extra ? ", " : "", extra);
    fclose(f);
}

static void write_generation_config(const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (!text) {
        unlink(path);
        return;
    }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static int setup(void **state) {
    (void)state;
    strcpy(dir, "/tmp/tmx-model-config-XXXXXX");
    assert_non_null(mkdtemp(dir));
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    write_generation_config(NULL);
    rmdir(dir);
    return 0;
}

static void expect_refused(const char *file, const char *field, const char *why) {
    struct tmx_model_config c;
    char *err = NULL;
    assert_int_equal(tmx_model_config_load(dir, &c, &err), TMX_ERR_INVALID);
    assert_non_null(err);
    char want[600];
    snprintf(want, sizeof want, "%s/%s: field \"%s\"", dir, file, field);
    if (strncmp(err, want, strlen(want)) != 0 || !strstr(err, why))
        fail_msg("\"%s\" is not \"%s...%s\"", err, want, why);
    assert_null(strchr(err, '\n'));
    free(err);
}

static void test_refused(void **state) {
    (void)state;
    static const struct {
        const char *extra, *field, *why;
    } cases[] = {
        {"\"rope_theta\": 0", "rope_theta", "must be > 0, got 0"},
        {"\"rope_theta\": -10000", "rope_theta", "must be > 0, got -10000"},
        {"\"rope_local_theta\": 0", "rope_local_theta", "must be > 0, got 0"},
        {"\"rope_local_theta\": -1", "rope_local_theta", "must be > 0, got -1"},
        {"\"rms_norm_eps\": -1e-6", "rms_norm_eps", "must be >= 0, got -1e-06"},
        {"\"max_position_embeddings\": 0", "max_position_embeddings", "must be at least 1"},
        {"\"bos_token_id\": 100000", "bos_token_id", "100000 is not a token id below vocab_size"},
        {"\"bos_token_id\": 64", "bos_token_id", "64 is not a token id below vocab_size (64)"},
        {"\"eos_token_id\": 64", "eos_token_id", "64 is not a token id below vocab_size (64)"},
        {"\"eos_token_id\": [2, -1]", "eos_token_id", "-1 is not a token id"},
        {"\"eos_token_id\": 4294967298", "eos_token_id", "4294967298 is not a token id"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_config(cases[i].extra);
        expect_refused("config.json", cases[i].field, cases[i].why);
    }
    write_config("");
    write_generation_config("{\"eos_token_id\": [2, 70]}");
    expect_refused("generation_config.json", "eos_token_id", "70 is not a token id");
    write_generation_config(NULL);
}

static void test_edges_load(void **state) {
    (void)state;
    write_config("\"rms_norm_eps\": 0, \"rope_theta\": 1e-3, \"rope_local_theta\": 5,"
                 " \"max_position_embeddings\": 1, \"bos_token_id\": 63,"
                 " \"eos_token_id\": [0, 63]");
    write_generation_config("{\"eos_token_id\": 62}");
    struct tmx_model_config c;
    char *err = NULL;
    if (tmx_model_config_load(dir, &c, &err) != TMX_OK) fail_msg("%s", err);
    assert_true(c.rms_norm_eps == 0 && c.rope_theta == 1e-3 && c.rope_local_theta == 5);
    assert_int_equal(c.max_position_embeddings, 1);
    assert_int_equal(c.bos_token_id, 63);
    assert_int_equal(c.n_eos, 3);
    write_generation_config(NULL);
    /* absent: the defaults, rope_local_theta following rope_theta */
    write_config("\"rope_theta\": 500000");
    assert_int_equal(tmx_model_config_load(dir, &c, &err), TMX_OK);
    assert_true(c.rope_local_theta == 500000 && c.rms_norm_eps == 1e-6);
    assert_int_equal(c.max_position_embeddings, 4096);
}

/* generation_config.json's sampling values, as vLLM takes them: those that differ from
 * transformers' defaults, checked. */
static void test_sampling_defaults(void **state) {
    (void)state;
    write_config("");
    struct tmx_model_config c;
    char *err = NULL;
    assert_int_equal(tmx_model_config_load(dir, &c, &err), TMX_OK); /* no file: OpenAI's */
    assert_true(c.gen.temperature == 1 && c.gen.top_p == 1 && c.gen.min_p == 0 &&
                c.gen.repetition_penalty == 1);
    assert_int_equal(c.gen.top_k, 0);
    assert_int_equal(c.gen.max_tokens, 0);
    assert_int_equal(c.gen.from_file, 0);
    write_generation_config("{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9, "
                            "\"top_k\": 20, \"min_p\": 0.05, \"repetition_penalty\": 1.1, "
                            "\"max_new_tokens\": 300}");
    if (tmx_model_config_load(dir, &c, &err) != TMX_OK) fail_msg("%s", err);
    assert_true(c.gen.temperature == 0.6f && c.gen.top_p == 0.9f && c.gen.min_p == 0.05f &&
                c.gen.repetition_penalty == 1.1f);
    assert_int_equal(c.gen.top_k, 20);
    assert_int_equal(c.gen.max_tokens, 300);
    assert_int_equal(c.gen.from_file, 6);
    write_generation_config("{\"top_k\": 50, \"temperature\": 1.0, \"do_sample\": false}");
    assert_int_equal(tmx_model_config_load(dir, &c, &err), TMX_OK);
    assert_int_equal(c.gen.top_k, 0); /* transformers' default: not applied, as in vLLM */
    assert_int_equal(c.gen.from_file, 0);
    static const struct {
        const char *text, *field, *why;
    } bad[] = {
        {"{\"temperature\": -0.5}", "temperature", "must be a number in [0, 100], got -0.5"},
        {"{\"top_p\": 0}", "top_p", "must be a number in (0, 1], got 0"},
        {"{\"top_k\": 2.5}", "top_k", "must be an integer"},
        {"{\"min_p\": 2}", "min_p", "got 2"},
        {"{\"repetition_penalty\": 0}", "repetition_penalty", "(0, 100]"},
        {"{\"max_new_tokens\": -3}", "max_new_tokens", "must be an integer in [1, "},
        {"{\"temperature\": \"hot\"}", "temperature", "must be a number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_generation_config(bad[i].text);
        expect_refused("generation_config.json", bad[i].field, bad[i].why);
    }
    write_generation_config(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edges_load, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sampling_defaults, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
