/* tmx/tokenizer.h: byte-level BPE tokenizers.
 *
 * Two file formats: Hugging Face tokenizer.json (model.type "BPE" with a ByteLevel
 * pre-tokenizer/decoder, optional Split pre-tokenizer regex, added/special tokens) and the
 * tiktoken rank format (`<base64 token> <rank>` per line, e.g. o200k_base.tiktoken).
 * The tokenizer owns all its memory; strings it returns stay valid until tmx_tokenizer_free.
 * A loaded tokenizer is read-only: any number of threads may encode and decode with it. */
#ifndef TMX_TOKENIZER_H
#define TMX_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"

struct tmx_tokenizer;

/* Loads tokenizer.json, or a .tiktoken file (by extension). For .tiktoken the pre-split regex
 * is o200k's and the special tokens are those o200k_base defines (<|endoftext|> = 199999,
 * <|endofprompt|> = 200018). Errors name the file and the field. */
enum tmx_status tmx_tokenizer_load(const char *path, struct tmx_tokenizer **out, char **err);
void tmx_tokenizer_free(struct tmx_tokenizer *tok);

/* Number of ids (largest id + 1, special tokens included). */
int tmx_tokenizer_n_vocab(const struct tmx_tokenizer *tok);

/* Encodes UTF-8 text (invalid UTF-8 is encoded byte by byte, never rejected). With
 * parse_special, special tokens written in the text become their ids; otherwise they are
 * encoded as ordinary text. Added tokens not marked special (tokenizer.json) always become their
 * ids, as in Hugging Face tokenizers. *ids is malloc'd (caller frees). */
enum tmx_status tmx_tokenizer_encode(const struct tmx_tokenizer *tok, const char *text, size_t len,
                                     int parse_special, int32_t **ids, size_t *n_ids, char **err);

/* The bytes of one token (not NUL-terminated: see *len), or NULL for an id out of range. */
const char *tmx_tokenizer_token_bytes(const struct tmx_tokenizer *tok, int32_t id, size_t *len);

/* Whether id is a special token (an added token tokenizer.json marks "special", or one of
 * .tiktoken's): what outputs leave out of their text by default. 0 for an id out of range. */
int tmx_tokenizer_is_special(const struct tmx_tokenizer *tok, int32_t id);

/* Id of a token given its exact text (e.g. "<|endoftext|>"), or -1. */
int32_t tmx_tokenizer_find(const struct tmx_tokenizer *tok, const char *text);

/* Decodes ids into a malloc'd NUL-terminated byte string (caller frees). Unknown ids are an
 * error naming the id. */
enum tmx_status tmx_tokenizer_decode(const struct tmx_tokenizer *tok, const int32_t *ids, size_t n,
                                     char **text, size_t *len, char **err);

/* Streaming decode: feed ids one at a time; emits only complete UTF-8 sequences and holds back
 * a trailing partial one until it completes (or until flush, which emits held bytes as U+FFFD).
 * Zero-initialise the struct before the first call. */
struct tmx_detok {
    unsigned char pending[8];
    int n_pending;
};

/* Appends to out (capacity cap, which must be >= 3 * token length + 12: each byte of a broken
 * sequence may become a 3-byte U+FFFD) and returns bytes written, or -1 for an unknown id or a
 * smaller cap. out is not NUL-terminated. flush needs cap >= 3. */
int tmx_detok_push(const struct tmx_tokenizer *tok, struct tmx_detok *st, int32_t id, char *out,
                   size_t cap);
int tmx_detok_flush(struct tmx_detok *st, char *out, size_t cap);

#endif
