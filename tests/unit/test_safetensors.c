/* test_safetensors.c: the safetensors parser and checkpoint directories.
 *
 * Files are written from here into a fresh mkdtemp folder per test: each valid dtype, every
 * rejection the parser promises (asserting on the message, which must name the file and the
 * tensor), and sharded checkpoints whose index and shards agree or disagree. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <ftw.h>
#include <unistd.h>

#include "tmx/safetensors.h"

#define FILE_NAME "t.safetensors"

/* `u64 LE length | header | data_len bytes`; data byte i is pattern(i). */
static unsigned char pattern(size_t i) { return (unsigned char)(i * 7 + 1); }

static unsigned char *image(const char *header, size_t data_len, size_t *size) {
    size_t hlen = strlen(header);
    *size = 8 + hlen + data_len;
    unsigned char *buf = malloc(*size);
    assert_non_null(buf);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(buf + 8, header, hlen);
    for (size_t i = 0; i < data_len; i++) buf[8 + hlen + i] = pattern(i);
    return buf;
}

static void write_file(const char *dir, const char *file, const void *buf, size_t size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, size, f), size);
    assert_int_equal(fclose(f), 0);
}

static void write_st(const char *dir, const char *file, const char *header, size_t data_len) {
    size_t size;
    unsigned char *buf = image(header, data_len, &size);
    write_file(dir, file, buf, size);
    free(buf);
}

static void write_text(const char *dir, const char *file, const char *text) {
    write_file(dir, file, text, strlen(text));
}

/* Each test gets its own empty folder as state. */
static int make_dir(void **state) {
    char *dir = strdup("/tmp/tmx-st-XXXXXX");
    if (!dir || !mkdtemp(dir)) return -1;
    *state = dir;
    return 0;
}

static int remove_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int remove_dir(void **state) {
    int rc = nftw(*state, remove_one, 8, FTW_DEPTH | FTW_PHYS);
    free(*state);
    return rc;
}

/* --- valid files --------------------------------------------------------------------------- */

static void test_each_dtype(void **state) {
    const char *dir = *state;
    static const struct {
        const char *name;
        enum tmx_dtype dt;
        size_t size;
    } cases[] = {
        {"F32", TMX_DTYPE_F32, 4}, {"BF16", TMX_DTYPE_BF16, 2},       {"F16", TMX_DTYPE_F16, 2},
        {"U8", TMX_DTYPE_U8, 1},   {"F8_E4M3", TMX_DTYPE_F8_E4M3, 1}, {"I32", TMX_DTYPE_I32, 4},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char header[256], path[4096];
        size_t nbytes = 2 * 3 * cases[c].size;
        snprintf(header, sizeof header,
                 "{\"w\":{\"dtype\":\"%s\",\"shape\":[2,3],\"data_offsets\":[0,%zu]}}",
                 cases[c].name, nbytes);
        write_st(dir, FILE_NAME, header, nbytes);
        snprintf(path, sizeof path, "%s/%s", dir, FILE_NAME);

        struct tmx_safetensors *st = NULL;
        char *err = NULL;
        assert_int_equal(tmx_safetensors_open(path, &st, &err), TMX_OK);
        assert_null(err);
        assert_int_equal(tmx_safetensors_count(st), 1);
        struct tmx_tensor t;
        assert_string_equal(tmx_safetensors_at(st, 0, &t), "w");
        assert_int_equal(t.dtype, cases[c].dt);
        assert_int_equal(t.ndim, 2);
        assert_int_equal(t.shape[0], 2);
        assert_int_equal(t.shape[1], 3);
        assert_int_equal(tmx_tensor_nbytes(&t), nbytes);
        for (size_t i = 0; i < nbytes; i++)
            assert_int_equal(((unsigned char *)t.data)[i], pattern(i));
        tmx_safetensors_free(st);
    }
}

/* Tensors come back in offset order, point into the buffer exactly where the file says (no copy,
 * no realignment), and are found by name; gaps, empty and scalar tensors are fine. */
static void test_layout(void **state) {
    (void)state;
    const char *header =
        "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"x\"},"
        "\"c\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[13,21]},"
        "\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},"
        "\"empty\":{\"dtype\":\"BF16\",\"shape\":[4,0],\"data_offsets\":[5,5]},"
        "\"scalar\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[21,25]},"
        "\"b\":{\"dtype\":\"F16\",\"shape\":[1,1,1,2],\"data_offsets\":[8,12]}}";
    size_t size;
    unsigned char *buf = image(header, 25, &size);
    const unsigned char *data = buf + 8 + strlen(header);
    struct tmx_safetensors *st = NULL;
    char *err = NULL;
    assert_int_equal(tmx_safetensors_parse(buf, size, FILE_NAME, &st, &err), TMX_OK);
    assert_int_equal(tmx_safetensors_count(st), 5);

    static const struct {
        const char *name;
        size_t begin;
        int ndim;
    } want[] = {{"a", 0, 1}, {"empty", 5, 2}, {"b", 8, 4}, {"c", 13, 1}, {"scalar", 21, 0}};
    for (size_t i = 0; i < 5; i++) {
        struct tmx_tensor t, f;
        assert_string_equal(tmx_safetensors_at(st, i, &t), want[i].name);
        assert_ptr_equal(t.data, data + want[i].begin);
        assert_int_equal(t.ndim, want[i].ndim);
        assert_int_equal(tmx_safetensors_find(st, want[i].name, &f), 0);
        assert_memory_equal(&t, &f, sizeof t);
    }
    struct tmx_tensor t;
    assert_int_equal(tmx_safetensors_find(st, "scalar", &t), 0);
    assert_int_equal(tmx_tensor_numel(&t), 1);
    assert_int_equal(tmx_safetensors_find(st, "d", &t), -1);
    assert_int_equal(tmx_safetensors_find(st, "__metadata__", &t), -1);
    assert_string_equal(tmx_safetensors_meta(st, "format"), "pt");
    assert_string_equal(tmx_safetensors_meta(st, "note"), "x");
    assert_null(tmx_safetensors_meta(st, "missing"));
    tmx_safetensors_free(st);
    free(buf);
}

/* Thousands of tensors, listed in reverse offset order: every one is found by name. */
static void test_many(void **state) {
    (void)state;
    enum { N = 5000 };
    size_t cap = (size_t)N * 100, len = 0;
    char *header = malloc(cap);
    assert_non_null(header);
    len += (size_t)snprintf(header, cap, "{");
    for (int i = N - 1; i >= 0; i--)
        len += (size_t)snprintf(header + len, cap - len,
                                "%s\"layers.%d.w\":{\"dtype\":\"F32\",\"shape\":[1],"
                                "\"data_offsets\":[%d,%d]}",
                                i == N - 1 ? "" : ",", i, 4 * i, 4 * i + 4);
    snprintf(header + len, cap - len, "}");
    size_t size;
    unsigned char *buf = image(header, 4 * N, &size);
    const unsigned char *data = buf + 8 + strlen(header);
    struct tmx_safetensors *st = NULL;
    char *err = NULL;
    assert_int_equal(tmx_safetensors_parse(buf, size, FILE_NAME, &st, &err), TMX_OK);
    assert_int_equal(tmx_safetensors_count(st), N);
    for (int i = 0; i < N; i++) {
        char name[32];
        struct tmx_tensor t;
        snprintf(name, sizeof name, "layers.%d.w", i);
        assert_int_equal(tmx_safetensors_find(st, name, &t), 0);
        assert_ptr_equal(t.data, data + 4 * i);
        assert_string_equal(tmx_safetensors_at(st, (size_t)i, NULL), name);
    }
    tmx_safetensors_free(st);
    free(buf);
    free(header);
}

/* --- rejections ---------------------------------------------------------------------------- */

/* Parses `header` followed by data_len bytes and expects failure with every `want` substring in
 * the message, which must start with the file name. */
static void expect_reject_image(const unsigned char *buf, size_t size, enum tmx_status status,
                                const char *const *want) {
    struct tmx_safetensors *st = NULL;
    char *err = NULL;
    enum tmx_status s = tmx_safetensors_parse(buf, size, FILE_NAME, &st, &err);
    assert_int_equal(s, status);
    assert_null(st);
    assert_non_null(err);
    assert_int_equal(strncmp(err, FILE_NAME ": ", strlen(FILE_NAME) + 2), 0);
    assert_null(strchr(err, '\n'));
    for (; *want; want++) {
        if (!strstr(err, *want)) fail_msg("message \"%s\" lacks \"%s\"", err, *want);
    }
    free(err);
}

#define REJECT(status, header, data_len, ...)                                                      \
    do {                                                                                           \
        size_t size_;                                                                              \
        unsigned char *buf_ = image(header, data_len, &size_);                                     \
        expect_reject_image(buf_, size_, status, (const char *const[]){__VA_ARGS__, NULL});        \
        free(buf_);                                                                                \
    } while (0)

#define ENTRY(body) "{\"w\":{" body "}}"

static void test_reject_framing(void **state) {
    (void)state;
    static const char *const too_short[] = {"too short", NULL};
    expect_reject_image((const unsigned char *)"\x02\0\0\0", 4, TMX_ERR_INVALID, too_short);

    static const char *const past_end[] = {"header length 100 runs past the end", "(12 bytes)",
                                           NULL};
    expect_reject_image((const unsigned char *)"\x64\0\0\0\0\0\0\0{}xx", 12, TMX_ERR_INVALID,
                        past_end);

    static const char *const absurd[] = {"header length 200000000 is absurd", NULL};
    expect_reject_image((const unsigned char *)"\0\xc2\xeb\x0b\0\0\0\0{}", 10, TMX_ERR_INVALID,
                        absurd);

    REJECT(TMX_ERR_INVALID, "{\"w\":", 0, "header JSON");
    REJECT(TMX_ERR_INVALID, "[1, 2]", 0, "header is not a JSON object");
    REJECT(TMX_ERR_INVALID,
           "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
           "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
           2, "header JSON", "duplicate object key", "\"w\"");
    REJECT(TMX_ERR_INVALID, "{\"__metadata__\":[\"a\"]}", 0,
           "\"__metadata__\" is not a JSON object");
    REJECT(TMX_ERR_INVALID, "{\"__metadata__\":{\"k\":1}}", 0,
           "\"__metadata__\" value for 'k' is not a string");
}

static void test_reject_entries(void **state) {
    (void)state;
    REJECT(TMX_ERR_INVALID, "{\"w\":[1]}", 0, "tensor 'w': entry is not a JSON object");
    REJECT(TMX_ERR_INVALID, ENTRY("\"shape\":[1],\"data_offsets\":[0,4]"), 4,
           "tensor 'w': \"dtype\" is missing");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]"), 4,
           "tensor 'w': \"dtype\" is missing or not a string");
    REJECT(TMX_ERR_UNSUPPORTED, ENTRY("\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]"), 8,
           "tensor 'w': dtype F64 is not one tmx reads");
    REJECT(TMX_ERR_UNSUPPORTED, ENTRY("\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]"), 8,
           "tensor 'w': dtype I64 is not one tmx reads");
    /* MXFP8 is tmx's in-memory weight format, never a file's dtype */
    REJECT(TMX_ERR_UNSUPPORTED,
           ENTRY("\"dtype\":\"MXFP8\",\"shape\":[1],\"data_offsets\":[0,1]"), 1,
           "tensor 'w': dtype MXFP8 is not one tmx reads");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"data_offsets\":[0,4]"), 4,
           "tensor 'w': \"shape\" is missing or not an array");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,4]"), 4,
           "tensor 'w': \"shape\" is missing or not an array");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1,-2],\"data_offsets\":[0,4]"), 4,
           "tensor 'w': shape[1] is not a non-negative integer");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]"), 4,
           "tensor 'w': shape[0] is not a non-negative integer");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]"), 4,
           "tensor 'w': shape[0] is not a non-negative integer");
    REJECT(TMX_ERR_UNSUPPORTED,
           ENTRY("\"dtype\":\"U8\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,1]"), 1,
           "tensor 'w': 5 dims, tmx reads at most 4");
    REJECT(TMX_ERR_INVALID,
           ENTRY("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]"), 0,
           "tensor 'w': byte size of the shape overflows");
    REJECT(TMX_ERR_INVALID,
           ENTRY("\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]"), 0,
           "tensor 'w': byte size of the shape overflows");
}

static void test_reject_offsets(void **state) {
    (void)state;
    const char *bad_offsets = "tensor 'w': \"data_offsets\" is not [begin, end]";
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1]"), 4, bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]"), 4,
           bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]"), 8,
           bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]"), 4,
           bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.5]"), 8,
           bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"a\":0}"), 4,
           bad_offsets);
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]"), 8,
           "tensor 'w': data_offsets begin 8 is after end 4");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]"), 7,
           "tensor 'w': data_offsets end 8 is past the data section (7 bytes)");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]"), 24,
           "tensor 'w': shape and dtype F32 need 24 bytes but data_offsets span 20");
    REJECT(TMX_ERR_INVALID, ENTRY("\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,2]"), 2,
           "tensor 'w': shape and dtype BF16 need 0 bytes but data_offsets span 2");
    REJECT(TMX_ERR_INVALID,
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
           12, "tensors 'a' [0, 8) and 'b' [4, 12) overlap");
    /* Same range twice, listed in the other order. */
    REJECT(TMX_ERR_INVALID,
           "{\"y\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]},"
           "\"x\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
           6, "tensors 'x' [2, 6) and 'y' [2, 6) overlap");
}

static void test_open_errors(void **state) {
    const char *dir = *state;
    char path[4096];
    struct tmx_safetensors *st = NULL;
    char *err = NULL;

    snprintf(path, sizeof path, "%s/absent.safetensors", dir);
    assert_int_equal(tmx_safetensors_open(path, &st, &err), TMX_ERR_NOT_FOUND);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "No such file or directory"));
    free(err);
    err = NULL;

    assert_int_equal(tmx_safetensors_open(dir, &st, &err), TMX_ERR_IO);
    assert_non_null(strstr(err, "not a regular file"));
    free(err);
    err = NULL;

    write_file(dir, "empty.safetensors", "", 0);
    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    assert_int_equal(tmx_safetensors_open(path, &st, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "too short"));
    free(err);
    assert_null(st);
}

/* --- checkpoint directories ---------------------------------------------------------------- */

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"
#define INDEX "model.safetensors.index.json"

/* Two F32 tensors of shape [2]; data byte i of the file is pattern(i). */
static void write_pair(const char *dir, const char *file, const char *a, const char *b) {
    char header[512];
    snprintf(header, sizeof header,
             "{\"%s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"%s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
             a, b);
    write_st(dir, file, header, 16);
}

static void write_index(const char *dir, const char *weight_map) {
    char text[1024];
    snprintf(text, sizeof text, "{\"metadata\":{\"total_size\":32},\"weight_map\":{%s}}",
             weight_map);
    write_text(dir, INDEX, text);
}

static const char *four_tensors = "\"norm\":\"" SHARD2 "\",\"embed\":\"" SHARD1 "\","
                                  "\"head\":\"" SHARD2 "\",\"layer0\":\"" SHARD1 "\"";

/* Opens dir and expects failure with status and every `want` substring in the message. */
static void expect_ck_reject(const char *dir, enum tmx_status status, const char *const *want) {
    struct tmx_checkpoint *ck = NULL;
    char *err = NULL;
    assert_int_equal(tmx_checkpoint_open(dir, &ck, &err), status);
    assert_null(ck);
    assert_non_null(err);
    assert_null(strchr(err, '\n'));
    for (; *want; want++) {
        if (!strstr(err, *want)) fail_msg("message \"%s\" lacks \"%s\"", err, *want);
    }
    free(err);
}

#define CK_REJECT(dir, status, ...)                                                                \
    expect_ck_reject(dir, status, (const char *const[]){__VA_ARGS__, NULL})

static void test_checkpoint_single(void **state) {
    const char *dir = *state;
    write_pair(dir, "model.safetensors", "z.weight", "a.weight");
    struct tmx_checkpoint *ck = NULL;
    char *err = NULL;
    assert_int_equal(tmx_checkpoint_open(dir, &ck, &err), TMX_OK);
    assert_string_equal(tmx_checkpoint_dir(ck), dir);
    assert_int_equal(tmx_checkpoint_count(ck), 2);
    struct tmx_tensor t;
    const char *file;
    assert_string_equal(tmx_checkpoint_at(ck, 0, &t, &file), "a.weight");
    assert_string_equal(file, "model.safetensors");
    assert_int_equal(((unsigned char *)t.data)[0], pattern(8));
    assert_string_equal(tmx_checkpoint_at(ck, 1, &t, NULL), "z.weight");
    assert_int_equal(((unsigned char *)t.data)[0], pattern(0));
    assert_int_equal(tmx_checkpoint_find(ck, "a.weight", &t), 0);
    assert_int_equal(((unsigned char *)t.data)[0], pattern(8));
    assert_int_equal(tmx_checkpoint_find(ck, "b.weight", &t), -1);
    tmx_checkpoint_free(ck);
}

/* Without an index: model.safetensors, or else one *.safetensors of any name; two need the
 * index. */
static void test_checkpoint_no_index(void **state) {
    const char *dir = *state;
    CK_REJECT(dir, TMX_ERR_NOT_FOUND, dir, "no model.safetensors or " INDEX);

    write_pair(dir, "consolidated.safetensors", "a", "b");
    write_text(dir, "config.json", "{}");
    struct tmx_checkpoint *ck = NULL;
    char *err = NULL;
    assert_int_equal(tmx_checkpoint_open(dir, &ck, &err), TMX_OK);
    const char *file;
    assert_string_equal(tmx_checkpoint_at(ck, 1, NULL, &file), "b");
    assert_string_equal(file, "consolidated.safetensors");
    tmx_checkpoint_free(ck);

    write_pair(dir, "other.safetensors", "c", "d");
    CK_REJECT(dir, TMX_ERR_INVALID, dir, "2 .safetensors files and no " INDEX);

    write_pair(dir, "model.safetensors", "e", "f");
    assert_int_equal(tmx_checkpoint_open(dir, &ck, &err), TMX_OK);
    assert_string_equal(tmx_checkpoint_at(ck, 0, NULL, &file), "e");
    assert_string_equal(file, "model.safetensors");
    tmx_checkpoint_free(ck);

    char missing[4096];
    snprintf(missing, sizeof missing, "%s/absent", dir);
    CK_REJECT(missing, TMX_ERR_NOT_FOUND, missing, "No such file or directory");
}

static void test_checkpoint_sharded(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_pair(dir, SHARD2, "norm", "head");
    write_index(dir, four_tensors);

    struct tmx_checkpoint *ck = NULL;
    char *err = NULL;
    assert_int_equal(tmx_checkpoint_open(dir, &ck, &err), TMX_OK);
    assert_null(err);
    assert_int_equal(tmx_checkpoint_count(ck), 4);
    static const struct {
        const char *name, *file;
        size_t begin;
    } want[] = {{"embed", SHARD1, 8}, {"head", SHARD2, 8}, {"layer0", SHARD1, 0},
                {"norm", SHARD2, 0}};
    for (size_t i = 0; i < 4; i++) {
        struct tmx_tensor t, f;
        const char *file;
        assert_string_equal(tmx_checkpoint_at(ck, i, &t, &file), want[i].name);
        assert_string_equal(file, want[i].file);
        assert_int_equal(t.dtype, TMX_DTYPE_F32);
        assert_int_equal(t.shape[0], 2);
        for (size_t b = 0; b < 8; b++)
            assert_int_equal(((unsigned char *)t.data)[b], pattern(want[i].begin + b));
        assert_int_equal(tmx_checkpoint_find(ck, want[i].name, &f), 0);
        assert_ptr_equal(f.data, t.data);
    }
    assert_int_equal(tmx_checkpoint_find(ck, "lm_head", NULL), -1);
    tmx_checkpoint_free(ck);
}

/* The index names a tensor its shard lacks. */
static void test_checkpoint_index_missing_tensor(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_pair(dir, SHARD2, "norm", "head");
    write_index(dir, "\"norm\":\"" SHARD2 "\",\"embed\":\"" SHARD1 "\",\"head\":\"" SHARD2 "\","
                     "\"layer0\":\"" SHARD1 "\",\"layer1\":\"" SHARD2 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID,
              "tensor 'layer1' is listed in " INDEX ", but " SHARD2 " lacks it");
}

/* A shard holds a tensor the index leaves out. */
static void test_checkpoint_unlisted_tensor(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_pair(dir, SHARD2, "norm", "head");
    write_index(dir, "\"norm\":\"" SHARD2 "\",\"embed\":\"" SHARD1 "\",\"layer0\":\"" SHARD1 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID, SHARD2 ": tensor 'head' is not listed in " INDEX);
}

static void test_checkpoint_two_shards(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_pair(dir, SHARD2, "norm", "embed");
    write_index(dir, "\"norm\":\"" SHARD2 "\",\"embed\":\"" SHARD1 "\",\"layer0\":\"" SHARD1 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID, "tensor 'embed' is in two shards, " SHARD1 " and " SHARD2);
}

/* The index puts a tensor in one shard; it lives in the other. */
static void test_checkpoint_wrong_shard(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_pair(dir, SHARD2, "norm", "head");
    write_index(dir, "\"norm\":\"" SHARD2 "\",\"embed\":\"" SHARD1 "\",\"head\":\"" SHARD1 "\","
                     "\"layer0\":\"" SHARD1 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID,
              "tensor 'head' is in " SHARD2 ", but " INDEX " puts it in " SHARD1);
}

static void test_checkpoint_missing_shard(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_index(dir, four_tensors);
    CK_REJECT(dir, TMX_ERR_NOT_FOUND, SHARD2, "No such file or directory");
}

static void test_checkpoint_bad_index(void **state) {
    const char *dir = *state;
    write_pair(dir, SHARD1, "layer0", "embed");
    write_text(dir, INDEX, "{\"weight_map\":");
    CK_REJECT(dir, TMX_ERR_INVALID, INDEX ": line 1");
    write_text(dir, INDEX, "{\"metadata\":{}}");
    CK_REJECT(dir, TMX_ERR_INVALID, INDEX ": \"weight_map\" is missing or not an object");
    write_index(dir, "\"layer0\":\"" SHARD1 "\",\"embed\":3");
    CK_REJECT(dir, TMX_ERR_INVALID, "weight_map entry for 'embed' is not a file name");
    write_index(dir, "\"layer0\":\"" SHARD1 "\",\"embed\":\"../" SHARD1 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID, "weight_map entry for 'embed' is not a file name");
    write_index(dir, "\"layer0\":\"" SHARD1 "\",\"layer0\":\"" SHARD1 "\"");
    CK_REJECT(dir, TMX_ERR_INVALID, INDEX, "duplicate");
    /* A broken shard reports its own path. */
    write_index(dir, "\"layer0\":\"" SHARD1 "\",\"embed\":\"" SHARD1 "\"");
    write_file(dir, SHARD1, "\x02\0\0\0", 4);
    CK_REJECT(dir, TMX_ERR_INVALID, SHARD1 ": ", "too short");
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, make_dir, remove_dir)
    const struct CMUnitTest tests[] = {
        T(test_each_dtype),
        T(test_layout),
        T(test_many),
        T(test_reject_framing),
        T(test_reject_entries),
        T(test_reject_offsets),
        T(test_open_errors),
        T(test_checkpoint_single),
        T(test_checkpoint_no_index),
        T(test_checkpoint_sharded),
        T(test_checkpoint_index_missing_tensor),
        T(test_checkpoint_unlisted_tensor),
        T(test_checkpoint_two_shards),
        T(test_checkpoint_wrong_shard),
        T(test_checkpoint_missing_shard),
        T(test_checkpoint_bad_index),
    };
#undef T
    return cmocka_run_group_tests(tests, NULL, NULL);
}
