/* fuzz_tokenizer.c: libFuzzer target for the tokenizer on untrusted text (a request's prompt).
 *
 * The tokenizer is muse-mini's (byte-level BPE, models/muse-mini/tokenizer.json; another with
 * TMX_FUZZ_TOKENIZER). The input's first byte chooses whether special tokens are parsed; the
 * rest is the text. Every input must encode, and decode back to exactly its bytes (byte-level
 * BPE loses nothing, special tokens included); fed id by id to the streaming decoder, valid
 * UTF-8 must come out whole, in order. ASan and UBSan catch the rest. Build with -DTMX_FUZZ=ON
 * and clang, as tools/fuzz.sh does. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct tmx_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *path = getenv("TMX_FUZZ_TOKENIZER");
    if (!path) path = TMX_SOURCE_DIR "/models/muse-mini/tokenizer.json";
    char *err = NULL;
    if (tmx_tokenizer_load(path, &tok, &err) != TMX_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err ? err : "out of memory");
        abort();
    }
    return 0;
}

/* Whether s[0..n) is valid UTF-8 (no overlong forms, surrogates or values past U+10FFFF). */
static int valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i], k = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2
                              : (c & 0xf0) == 0xe0 ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        if (k == 0 || i + k > n) return 0;
        for (unsigned j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return 0;
        if ((c == 0xe0 && s[i + 1] < 0xa0) || (c == 0xed && s[i + 1] >= 0xa0) ||
            (c == 0xf0 && s[i + 1] < 0x90) || (c == 0xf4 && s[i + 1] >= 0x90))
            return 0;
        i += k;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0 || size > 4096) return 0;
    const int special = data[0] & 1;
    const char *text = (const char *)data + 1;
    const size_t len = size - 1;
    int32_t *ids = NULL;
    size_t n = 0;
    char *err = NULL;
    if (tmx_tokenizer_encode(tok, text, len, special, &ids, &n, &err) != TMX_OK) abort();
    char *back = NULL;
    size_t back_len = 0;
    if (tmx_tokenizer_decode(tok, ids, n, &back, &back_len, &err) != TMX_OK) abort();
    if (back_len != len || memcmp(back, text, len) != 0) abort();

    if (valid_utf8((const unsigned char *)text, len)) {
        struct tmx_detok st = {0};
        char *out = malloc(3 * len + 64), piece[3 * 256 + 12];
        size_t at = 0;
        for (size_t i = 0; out && i < n; i++) {
            size_t tl;
            if (!tmx_tokenizer_token_bytes(tok, ids[i], &tl) || 3 * tl + 12 > sizeof piece) abort();
            const int w = tmx_detok_push(tok, &st, ids[i], piece, sizeof piece);
            if (w < 0 || at + (size_t)w > 3 * len + 64) abort();
            memcpy(out + at, piece, (size_t)w);
            at += (size_t)w;
        }
        const int w = out ? tmx_detok_flush(&st, piece, sizeof piece) : 0;
        if (out && (w != 0 || at != len || memcmp(out, text, len) != 0)) abort();
        free(out);
    }
    free(back);
    free(ids);
    return 0;
}
