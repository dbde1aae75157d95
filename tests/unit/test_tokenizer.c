/* test_tokenizer.c: byte-level BPE on small tokenizer.json fixtures written here, and on
 * o200k_base.tiktoken when ../shared/data is present. Ids against outside implementations are
 * checked by tests/python/test_tokenizer.py; this file checks the rules and the edges. */
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/tokenizer.h"

#define O200K_PATH TMX_SOURCE_DIR "/../shared/data/tokenizers/o200k_base.tiktoken"

static char tmp_dir[] = "/tmp/tmx-test-tokenizer-XXXXXX";
static char *written[64]; /* files to remove at the end */
static int n_written;

/* ---- helpers ------------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int put_utf8(uint32_t cp, char *out) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) return out[0] = (char)(0xc0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3f)), 2;
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Strict UTF-8 check (no overlongs, surrogates or code points past U+10FFFF). */
static int valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t c = s[i], cp;
        size_t k = c < 0x80             ? 1
                   : (c & 0xe0) == 0xc0 ? 2
                   : (c & 0xf0) == 0xe0 ? 3
                   : (c & 0xf8) == 0xf0 ? 4
                                        : 0;
        if (k == 0 || i + k > n) return 0;
        cp = k == 1 ? c : c & (0xff >> (k + 1));
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return 0;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += k;
    }
    return 1;
}

/* Random text from scripts that stress the pre-split and BPE: ASCII with whitespace runs,
 * Latin-1, Greek, combining marks, CJK, Hangul, emoji, mathematical letters. */
static size_t random_utf8(uint64_t *rng, char *out, size_t max_chars) {
    static const uint32_t ranges[][2] = {
        {0x20, 0x7e},     {'\t', '\r'},       {' ', ' '},         {'0', '9'},
        {0xa0, 0xff},     {0x391, 0x3c9},     {0x300, 0x36f},     {0x4e00, 0x9fff},
        {0xac00, 0xd7a3}, {0x1f300, 0x1faff}, {0x1d400, 0x1d7ff}, {0x85, 0x85},
    };
    size_t n_chars = rng_next(rng) % (max_chars + 1), w = 0;
    for (size_t i = 0; i < n_chars; i++) {
        const uint32_t *r = ranges[rng_next(rng) % (sizeof ranges / sizeof *ranges)];
        w += (size_t)put_utf8(r[0] + (uint32_t)(rng_next(rng) % (r[1] - r[0] + 1)), out + w);
    }
    return w;
}

static size_t random_bytes(uint64_t *rng, char *out, size_t max) {
    size_t n = rng_next(rng) % (max + 1);
    for (size_t i = 0; i < n; i++) out[i] = (char)rng_next(rng);
    return n;
}

static void expect_ids(const struct tmx_tokenizer *tok, const char *text, int special,
                       const int32_t *want, size_t n_want) {
    int32_t *ids = NULL;
    size_t n = 0;
    char *err = NULL;
    assert_int_equal(tmx_tokenizer_encode(tok, text, strlen(text), special, &ids, &n, &err),
                     TMX_OK);
    if (n != n_want) print_error("\"%s\": %zu ids, want %zu\n", text, n, n_want);
    assert_int_equal(n, n_want);
    for (size_t i = 0; i < n; i++) assert_int_equal(ids[i], want[i]);
    free(ids);
}
#define EXPECT_IDS(tok, text, special, ...)                                                        \
    expect_ids(tok, text, special, (const int32_t[]){__VA_ARGS__},                                 \
               sizeof((const int32_t[]){__VA_ARGS__}) / sizeof(int32_t))

static void expect_round_trip(const struct tmx_tokenizer *tok, const char *text, size_t len,
                              int special) {
    int32_t *ids = NULL;
    size_t n = 0, out_len = 0;
    char *err = NULL, *out = NULL;
    assert_int_equal(tmx_tokenizer_encode(tok, text, len, special, &ids, &n, &err), TMX_OK);
    assert_int_equal(tmx_tokenizer_decode(tok, ids, n, &out, &out_len, &err), TMX_OK);
    assert_int_equal(out_len, len);
    assert_memory_equal(out, text, len);
    assert_int_equal(out[len], '\0');
    free(ids);
    free(out);
}

/* Streams text's ids through a tmx_detok: every chunk must be valid UTF-8, and for valid text
 * the chunks must add up to the text. */
static void expect_stream(const struct tmx_tokenizer *tok, const char *text, size_t len) {
    int32_t *ids = NULL;
    size_t n = 0, total = 0;
    char *err = NULL, *all = malloc(3 * len + 16), chunk[4096];
    struct tmx_detok st = {0};
    assert_int_equal(tmx_tokenizer_encode(tok, text, len, 0, &ids, &n, &err), TMX_OK);
    for (size_t i = 0; i < n; i++) {
        int w = tmx_detok_push(tok, &st, ids[i], chunk, sizeof chunk);
        assert_true(w >= 0);
        assert_true(valid_utf8((const unsigned char *)chunk, (size_t)w));
        memcpy(all + total, chunk, (size_t)w);
        total += (size_t)w;
    }
    int w = tmx_detok_flush(&st, chunk, sizeof chunk);
    assert_true(w >= 0 && valid_utf8((const unsigned char *)chunk, (size_t)w));
    memcpy(all + total, chunk, (size_t)w);
    total += (size_t)w;
    if (valid_utf8((const unsigned char *)text, len)) {
        assert_int_equal(w, 0);
        assert_int_equal(total, len);
        assert_memory_equal(all, text, len);
    } else {
        assert_true(valid_utf8((const unsigned char *)all, total));
    }
    free(ids);
    free(all);
}

/* ---- fixtures ----------------------------------------------------------------------------- */

/* GPT-2's byte-level character for byte b, as UTF-8. */
static const char *byte_char(int b, char out[4]) {
    int cp = b, next = 256;
    for (int c = 0; c < 256; c++) {
        int printable = (c >= '!' && c <= '~') || (c >= 0xa1 && c <= 0xac) || c >= 0xae;
        if (!printable && c == b) cp = next;
        if (!printable) next++;
    }
    out[put_utf8((uint32_t)cp, out)] = '\0';
    return out;
}

/* A tiny byte-level BPE: ids 0..255 are the bytes, merge i makes id 256 + i, "abc" is 270
 * (in the vocabulary, made by no merge), then three added tokens. */
static const char *const tiny_merges[][2] = {
    {"h", "e"},    {"l", "l"},  {"he", "ll"}, {"Ġ", "w"},
    {"hell", "o"}, {"Ġw", "o"}, {"Ġ", "h"},   {"3", "4"},
};
enum {
    TINY_HELLO = 260,
    TINY_SPACE_WO = 261,
    TINY_34 = 263,
    TINY_ABC = 270,
    TINY_END = 300,
    TINY_END_BANG = 301,
    TINY_THINK = 302
};

static json_t *added_token(int id, const char *content, int special) {
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content,
                     "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                     special);
}

static json_t *tiny_tokenizer(int merges_as_pairs) {
    json_t *vocab = json_object(), *merges = json_array();
    char c[4];
    for (int b = 0; b < 256; b++) json_object_set_new(vocab, byte_char(b, c), json_integer(b));
    for (size_t i = 0; i < sizeof tiny_merges / sizeof *tiny_merges; i++) {
        const char *a = tiny_merges[i][0], *b = tiny_merges[i][1];
        char both[32], line[32];
        snprintf(both, sizeof both, "%s%s", a, b);
        snprintf(line, sizeof line, "%s %s", a, b);
        json_object_set_new(vocab, both, json_integer(256 + (int)i));
        json_array_append_new(merges,
                              merges_as_pairs ? json_pack("[s, s]", a, b) : json_string(line));
    }
    json_object_set_new(vocab, "abc", json_integer(TINY_ABC));
    return json_pack(
        "{s:s, s:n, s:[o, o, o], s:n, s:{s:s, s:b, s:b}, s:n, s:{s:s, s:b, s:b}, "
        "s:{s:s, s:n, s:o, s:o, s:b}}",
        "version", "1.0", "truncation", "added_tokens", added_token(TINY_END, "<|end|>", 1),
        added_token(TINY_END_BANG, "<|end|>!", 1), added_token(TINY_THINK, "<think>", 0),
        "normalizer", "pre_tokenizer", "type", "ByteLevel", "add_prefix_space", 0, "use_regex", 1,
        "post_processor", "decoder", "type", "ByteLevel", "add_prefix_space", 1, "use_regex", 1,
        "model", "type", "BPE", "dropout", "vocab", vocab, "merges", merges, "ignore_merges", 0);
}

/* Writes text to a file in the test folder and returns its path (freed at the end). */
static const char *write_text(const char *name, const char *text) {
    char *path = malloc(strlen(tmp_dir) + strlen(name) + 2);
    sprintf(path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    assert_true(n_written < (int)(sizeof written / sizeof *written));
    written[n_written++] = path;
    return path;
}

static const char *write_json(const char *name, json_t *root) {
    char *text = json_dumps(root, JSON_INDENT(1));
    const char *path = write_text(name, text);
    free(text);
    json_decref(root);
    return path;
}

static struct tmx_tokenizer *load_ok(const char *path) {
    struct tmx_tokenizer *tok = NULL;
    char *err = NULL;
    enum tmx_status st = tmx_tokenizer_load(path, &tok, &err);
    if (st != TMX_OK) print_error("%s\n", err);
    assert_int_equal(st, TMX_OK);
    return tok;
}

static struct tmx_tokenizer *load_tiny(const char *name, json_t *root) {
    return load_ok(write_json(name, root));
}

static struct tmx_tokenizer *load_o200k(void) {
    if (access(O200K_PATH, R_OK) != 0) {
        print_message("skipping: %s is absent\n", O200K_PATH);
        return NULL;
    }
    return load_ok(O200K_PATH);
}

/* ---- tokenizer.json: merges, pre-tokenizers, added tokens ---------------------------------- */

static void test_merge_order(void **state) {
    (void)state;
    for (int pairs = 0; pairs <= 1; pairs++) { /* both spellings of merges exist in the wild */
        struct tmx_tokenizer *tok =
            load_tiny(pairs ? "pairs.json" : "strings.json", tiny_tokenizer(pairs));
        assert_int_equal(tmx_tokenizer_n_vocab(tok), TINY_THINK + 1);
        /* "hello" merges by rank: he, ll, hell, hello; " world" gets Ġw, then Ġwo. */
        EXPECT_IDS(tok, "hello world", 0, TINY_HELLO, TINY_SPACE_WO, 'r', 'l', 'd');
        /* Equal ranks merge leftmost first. */
        EXPECT_IDS(tok, "lll", 0, 257, 'l');
        /* "abc" is in the vocabulary but no merge makes it. */
        EXPECT_IDS(tok, "abc", 0, 'a', 'b', 'c');
        EXPECT_IDS(tok, "12345", 0, '1', '2', TINY_34, '5');
        tmx_tokenizer_free(tok);
    }
}

static void test_ignore_merges(void **state) {
    (void)state;
    json_t *root = tiny_tokenizer(0);
    json_object_set_new(json_object_get(root, "model"), "ignore_merges", json_true());
    struct tmx_tokenizer *tok = load_tiny("ignore_merges.json", root);
    EXPECT_IDS(tok, "abc", 0, TINY_ABC);
    EXPECT_IDS(tok, "abcd", 0, 'a', 'b', 'c', 'd');
    EXPECT_IDS(tok, "hello", 0, TINY_HELLO);
    tmx_tokenizer_free(tok);
}

static void test_pre_tokenizers(void **state) {
    (void)state;
    /* Llama 3 style: digits cut in threes by a Split, then ByteLevel without its own regex. */
    json_t *root = tiny_tokenizer(0);
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b}]}", "type",
                                  "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
                                  "\\p{N}{1,3}", "behavior", "Isolated", "invert", 0, "type",
                                  "ByteLevel", "add_prefix_space", 0, "use_regex", 0));
    struct tmx_tokenizer *tok = load_tiny("split.json", root);
    EXPECT_IDS(tok, "12345", 0, '1', '2', '3', '4', '5'); /* "123" "45": no 3|4 pair */
    EXPECT_IDS(tok, "2345", 0, '2', TINY_34, '5');        /* "234" "5" */
    EXPECT_IDS(tok, "1234", 0, '1', '2', '3', '4');
    EXPECT_IDS(tok, "34x", 0, TINY_34, 'x');
    /* Gaps between matches are words too: " hello" stays whole without the GPT-2 regex. */
    EXPECT_IDS(tok, "1 hello", 0, '1', ' ', TINY_HELLO);
    tmx_tokenizer_free(tok);

    /* A literal Split pattern. */
    root = tiny_tokenizer(0);
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s, s:b, s:b}]}", "type",
                                  "Sequence", "pretokenizers", "type", "Split", "pattern", "String",
                                  "3", "behavior", "Isolated", "type", "ByteLevel",
                                  "add_prefix_space", 0, "use_regex", 0));
    tok = load_tiny("split_string.json", root);
    EXPECT_IDS(tok, "12345", 0, '1', '2', '3', '4', '5');
    EXPECT_IDS(tok, "1245", 0, '1', '2', '4', '5');
    tmx_tokenizer_free(tok);

    /* add_prefix_space: each span between added tokens gets its own leading space. */
    root = tiny_tokenizer(0);
    json_object_set_new(json_object_get(root, "pre_tokenizer"), "add_prefix_space", json_true());
    tok = load_tiny("prefix_space.json", root);
    EXPECT_IDS(tok, "hello", 0, ' ', TINY_HELLO);
    EXPECT_IDS(tok, " hello", 0, ' ', TINY_HELLO);
    EXPECT_IDS(tok, "hello<|end|>hello", 1, ' ', TINY_HELLO, TINY_END, ' ', TINY_HELLO);
    tmx_tokenizer_free(tok);
}

static void test_added_tokens(void **state) {
    (void)state;
    struct tmx_tokenizer *tok = load_tiny("added.json", tiny_tokenizer(1));
    EXPECT_IDS(tok, "a<|end|>b", 1, 'a', TINY_END, 'b');
    EXPECT_IDS(tok, "<|end|>!", 1, TINY_END_BANG); /* the longest match wins */
    EXPECT_IDS(tok, "<|end|>?", 1, TINY_END, '?');
    EXPECT_IDS(tok, "<|end|><|end|>", 1, TINY_END, TINY_END);
    /* Without parse_special the text is text. */
    EXPECT_IDS(tok, "<|end|>", 0, '<', '|', 'e', 'n', 'd', '|', '>');
    expect_round_trip(tok, "x<|end|>!y", 10, 0);
    /* A non-special added token is part of the vocabulary: always matched. */
    EXPECT_IDS(tok, "x<think>y", 0, 'x', TINY_THINK, 'y');
    EXPECT_IDS(tok, "<thin", 1, '<', 't', 'h', 'i', 'n');

    assert_int_equal(tmx_tokenizer_find(tok, "<|end|>"), TINY_END);
    assert_int_equal(tmx_tokenizer_find(tok, "<think>"), TINY_THINK);
    assert_int_equal(tmx_tokenizer_find(tok, "hello"), TINY_HELLO);
    assert_int_equal(tmx_tokenizer_find(tok, " wo"), TINY_SPACE_WO); /* raw bytes, not "Ġwo" */
    assert_int_equal(tmx_tokenizer_find(tok, "<|end"), -1);
    assert_int_equal(tmx_tokenizer_find(tok, ""), -1);
    size_t len = 0;
    const char *b = tmx_tokenizer_token_bytes(tok, TINY_END, &len);
    assert_int_equal(len, 7);
    assert_memory_equal(b, "<|end|>", 7);
    b = tmx_tokenizer_token_bytes(tok, 0x0a, &len); /* "Ċ" in the file */
    assert_int_equal(len, 1);
    assert_int_equal(b[0], '\n');
    assert_null(tmx_tokenizer_token_bytes(tok, 290, &len)); /* a hole */
    assert_null(tmx_tokenizer_token_bytes(tok, -1, &len));
    assert_null(tmx_tokenizer_token_bytes(tok, TINY_THINK + 1, &len));

    int32_t *ids = NULL;
    size_t n = 7;
    char *err = NULL, *text = NULL;
    assert_int_equal(tmx_tokenizer_encode(tok, "", 0, 1, &ids, &n, &err), TMX_OK);
    assert_int_equal(n, 0);
    free(ids);
    const int32_t bad[] = {'a', 290};
    assert_int_equal(tmx_tokenizer_decode(tok, bad, 2, &text, &len, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "290"));
    free(err);
    tmx_tokenizer_free(tok);
}

/* ---- round trips and streaming ------------------------------------------------------------ */

static void round_trips(const struct tmx_tokenizer *tok, uint64_t seed, int n_texts) {
    uint64_t rng = seed;
    char *buf = malloc(4 * 400 + 1);
    for (int i = 0; i < n_texts; i++) {
        size_t n = random_utf8(&rng, buf, 400);
        expect_round_trip(tok, buf, n, i & 1);
        expect_stream(tok, buf, n);
        n = random_bytes(&rng, buf, 300);
        expect_round_trip(tok, buf, n, i & 1);
        expect_stream(tok, buf, n);
    }
    /* Long words and whitespace runs: the merge heap and the regex at length. */
    size_t big = 200000;
    char *s = malloc(big);
    memset(s, ' ', big);
    expect_round_trip(tok, s, big, 0);
    for (size_t i = 0; i < big; i++) s[i] = (char)('a' + rng_next(&rng) % 26);
    expect_round_trip(tok, s, big, 0);
    for (size_t i = 0; i < big; i++) s[i] = (char)(i % 3 ? '\n' : ' ');
    expect_round_trip(tok, s, big, 0);
    free(s);
    free(buf);
}

static void test_round_trip_json(void **state) {
    (void)state;
    struct tmx_tokenizer *tok = load_tiny("round_trip.json", tiny_tokenizer(0));
    round_trips(tok, 0x9e3779b97f4a7c15ull, 300);
    tmx_tokenizer_free(tok);
}

static void test_detok(void **state) {
    (void)state;
    struct tmx_tokenizer *tok = load_tiny("detok.json", tiny_tokenizer(0));
    struct tmx_detok st = {0};
    char out[64];
    /* U+1F389 arrives one byte token at a time: nothing until it is whole. */
    const unsigned char party[4] = {0xf0, 0x9f, 0x8e, 0x89};
    for (int i = 0; i < 3; i++)
        assert_int_equal(tmx_detok_push(tok, &st, party[i], out, sizeof out), 0);
    assert_int_equal(tmx_detok_push(tok, &st, party[3], out, sizeof out), 4);
    assert_memory_equal(out, party, 4);
    /* A stray byte becomes U+FFFD; so does a sequence cut short by the next token. */
    assert_int_equal(tmx_detok_push(tok, &st, 0xff, out, sizeof out), 3);
    assert_memory_equal(out, "\xef\xbf\xbd", 3);
    assert_int_equal(tmx_detok_push(tok, &st, 0xe2, out, sizeof out), 0);
    assert_int_equal(tmx_detok_push(tok, &st, 0x82, out, sizeof out), 0);
    assert_int_equal(tmx_detok_push(tok, &st, 'A', out, sizeof out), 4);
    assert_memory_equal(out,
                        "\xef\xbf\xbd"
                        "A",
                        4);
    /* A surrogate's lead is invalid after its first byte: two maximal subparts. */
    assert_int_equal(tmx_detok_push(tok, &st, 0xed, out, sizeof out), 0);
    assert_int_equal(tmx_detok_push(tok, &st, 0xa0, out, sizeof out), 6);
    /* flush hands over what is held as one U+FFFD, then nothing. */
    assert_int_equal(tmx_detok_push(tok, &st, 0xf0, out, sizeof out), 0);
    assert_int_equal(tmx_detok_flush(&st, out, sizeof out), 3);
    assert_memory_equal(out, "\xef\xbf\xbd", 3);
    assert_int_equal(tmx_detok_flush(&st, out, sizeof out), 0);
    /* Unknown ids and a buffer too small for the worst case are refused. */
    assert_int_equal(tmx_detok_push(tok, &st, 290, out, sizeof out), -1);
    assert_int_equal(tmx_detok_push(tok, &st, TINY_HELLO, out, 3 * 5 + 11), -1);
    assert_int_equal(tmx_detok_push(tok, &st, TINY_HELLO, out, 3 * 5 + 12), 5);
    tmx_tokenizer_free(tok);
}

/* ---- malformed files ---------------------------------------------------------------------- */

static void expect_load_error(const char *path, enum tmx_status want, const char *field) {
    struct tmx_tokenizer *tok = NULL;
    char *err = NULL;
    enum tmx_status st = tmx_tokenizer_load(path, &tok, &err);
    if (st != want || !err || !strstr(err, path) || !strstr(err, field))
        print_error("%s: status %d, message \"%s\"; want %d naming \"%s\"\n", path, st,
                    err ? err : "(none)", want, field);
    assert_int_equal(st, want);
    assert_null(tok);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, field));
    free(err);
}

static void test_malformed(void **state) {
    (void)state;
    json_t *root;
    expect_load_error(write_text("broken.json", "{\"model\": "), TMX_ERR_INVALID, "line");
    expect_load_error(write_text("array.json", "[1, 2]"), TMX_ERR_INVALID, "object");
    expect_load_error(TMX_SOURCE_DIR "/no/such/tokenizer.json", TMX_ERR_IO, "tokenizer.json");

    root = tiny_tokenizer(0);
    json_object_set_new(json_object_get(root, "model"), "type", json_string("Unigram"));
    expect_load_error(write_json("unigram.json", root), TMX_ERR_UNSUPPORTED, "model.type");

    root = tiny_tokenizer(0);
    json_object_set_new(root, "normalizer", json_pack("{s:s}", "type", "NFC"));
    expect_load_error(write_json("nfc.json", root), TMX_ERR_UNSUPPORTED, "normalizer");

    root = tiny_tokenizer(0);
    json_object_set_new(root, "decoder", json_pack("{s:s}", "type", "WordPiece"));
    expect_load_error(write_json("decoder.json", root), TMX_ERR_UNSUPPORTED, "decoder.type");

    root = tiny_tokenizer(0);
    json_object_set_new(root, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
    expect_load_error(write_json("whitespace.json", root), TMX_ERR_UNSUPPORTED,
                      "pre_tokenizer.type");

    root = tiny_tokenizer(0);
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}]}", "type", "Sequence",
                                  "pretokenizers", "type", "Split", "pattern", "Regex", "(\\p{L}",
                                  "behavior", "Isolated", "type", "ByteLevel"));
    expect_load_error(write_json("bad_regex.json", root), TMX_ERR_INVALID, "pretokenizers[0]");

    root = tiny_tokenizer(0);
    json_object_set_new(root, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}]}", "type", "Sequence",
                                  "pretokenizers", "type", "Split", "pattern", "Regex", "\\s",
                                  "behavior", "Removed", "type", "ByteLevel"));
    expect_load_error(write_json("removed.json", root), TMX_ERR_UNSUPPORTED,
                      "pretokenizers[0].behavior");

    root = tiny_tokenizer(0);
    json_array_append_new(json_object_get(json_object_get(root, "model"), "merges"),
                          json_string("x nope"));
    expect_load_error(write_json("merge_oov.json", root), TMX_ERR_INVALID, "model.merges[8]");

    root = tiny_tokenizer(0);
    json_array_append_new(json_object_get(json_object_get(root, "model"), "merges"),
                          json_string("xyz"));
    expect_load_error(write_json("merge_shape.json", root), TMX_ERR_INVALID, "model.merges[8]");

    root = tiny_tokenizer(0);
    json_object_del(json_object_get(json_object_get(root, "model"), "vocab"),
                    "\xc4\x80"); /* byte 0 */
    expect_load_error(write_json("no_byte.json", root), TMX_ERR_INVALID, "byte 0x00");

    root = tiny_tokenizer(0);
    json_object_set_new(json_object_get(json_object_get(root, "model"), "vocab"), "zz",
                        json_integer(-4));
    expect_load_error(write_json("negative_id.json", root), TMX_ERR_INVALID, "model.vocab[\"zz\"]");

    root = tiny_tokenizer(0);
    json_object_set_new(json_array_get(json_object_get(root, "added_tokens"), 1), "lstrip",
                        json_true());
    expect_load_error(write_json("lstrip.json", root), TMX_ERR_UNSUPPORTED,
                      "added_tokens[1].lstrip");

    root = tiny_tokenizer(0);
    json_object_set_new(json_array_get(json_object_get(root, "added_tokens"), 0), "content",
                        json_string("other"));
    json_object_set_new(json_array_get(json_object_get(root, "added_tokens"), 0), "id",
                        json_integer(5));
    expect_load_error(write_json("added_clash.json", root), TMX_ERR_UNSUPPORTED, "added_tokens[0]");

    expect_load_error(write_text("bad.tiktoken", "aGVsbG8= 0\n!!!! 1\n"), TMX_ERR_INVALID,
                      "bad.tiktoken:2");
    expect_load_error(write_text("rank.tiktoken", "aGVsbG8= x\n"), TMX_ERR_INVALID,
                      "rank.tiktoken:1");
    expect_load_error(write_text("dup.tiktoken", "aGVsbG8= 0\naGk= 0\n"), TMX_ERR_INVALID,
                      "rank 0");
    expect_load_error(write_text("short.tiktoken", "aGVsbG8= 0\n"), TMX_ERR_INVALID, "byte 0x00");
    expect_load_error(write_text("twice.tiktoken", "aGk= 0\naGk= 1\n"), TMX_ERR_INVALID,
                      "token 1's bytes appear twice");
}

/* ---- o200k_base.tiktoken ------------------------------------------------------------------ */

static void test_o200k(void **state) {
    (void)state;
    struct tmx_tokenizer *tok = load_o200k();
    if (!tok) skip();
    assert_int_equal(tmx_tokenizer_n_vocab(tok), 200019);
    assert_int_equal(tmx_tokenizer_find(tok, "<|endoftext|>"), 199999);
    assert_int_equal(tmx_tokenizer_find(tok, "<|endofprompt|>"), 200018);
    assert_int_equal(tmx_tokenizer_find(tok, "hello"), 24912);
    size_t len;
    assert_null(tmx_tokenizer_token_bytes(tok, 199998, &len));
    EXPECT_IDS(tok, "hello world", 0, 24912, 2375);
    EXPECT_IDS(tok, "<|endoftext|>hi", 1, 199999, 3686);
    /* U+1F389 is two tokens whose boundary splits the character. */
    EXPECT_IDS(tok, "\xf0\x9f\x8e\x89", 0, 71344, 231);
    expect_round_trip(tok, "<|endoftext|>hi", 15, 0);
    round_trips(tok, 0x2545f4914f6cdd1dull, 300);
    tmx_tokenizer_free(tok);
}

static void test_o200k_stream(void **state) {
    (void)state;
    struct tmx_tokenizer *tok = load_o200k();
    if (!tok) skip();
    /* Mathematical letters come out as three tokens each, none of them whole UTF-8. */
    const char *text = "\xf0\x9d\x94\x98\xf0\x9d\x94\xab\xf0\x9d\x94\xa6 \xe6\x97\xa5\xe6\x9c\xac";
    expect_stream(tok, text, strlen(text));
    tmx_tokenizer_free(tok);
}

static int setup(void **state) {
    (void)state;
    return mkdtemp(tmp_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    for (int i = 0; i < n_written; i++) {
        unlink(written[i]);
        free(written[i]);
    }
    return rmdir(tmp_dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_merge_order),     cmocka_unit_test(test_ignore_merges),
        cmocka_unit_test(test_pre_tokenizers),  cmocka_unit_test(test_added_tokens),
        cmocka_unit_test(test_round_trip_json), cmocka_unit_test(test_detok),
        cmocka_unit_test(test_malformed),       cmocka_unit_test(test_o200k),
        cmocka_unit_test(test_o200k_stream),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
