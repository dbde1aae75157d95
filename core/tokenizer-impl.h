/* tokenizer-impl.h: the tokenizer's tables, shared by tokenizer.c (encode, decode) and
 * tokenizer-load.c (tokenizer.json and .tiktoken readers). Not a public header.
 *
 * Every token is kept as its raw bytes: tokenizer.json's byte-level strings ("Ġthe") are mapped
 * back to bytes (" the") when loading, so both formats share one encoder. */
#ifndef TMX_TOKENIZER_IMPL_H
#define TMX_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "tmx/tokenizer.h"

enum {
    TOK_MODEL = 1,   /* a BPE vocabulary entry: reachable by merging bytes */
    TOK_ADDED = 2,   /* an added token: matched whole in the text before pre-splitting */
    TOK_SPECIAL = 4, /* an added token matched only when the caller asks (parse_special) */
};

struct tok_entry {
    uint32_t off, len; /* bytes[off .. off+len); len 0: no token has this id */
    uint8_t flags;     /* TOK_* */
};

/* Open addressing, linear probing, power-of-two size, at most half full. */
struct tok_bytes_slot { /* the key's place is copied in so that a probe reads one line */
    uint32_t hash;
    int32_t id; /* -1: empty */
    uint32_t off, len;
};
struct tok_bytes_map { /* token bytes -> id (model tokens only) */
    struct tok_bytes_slot *slot; /* [mask + 1] */
    uint32_t mask;
};

struct tok_pair_slot {
    uint64_t key; /* left id << 32 | right id */
    uint32_t rank;
    int32_t merged; /* -1: empty */
};
struct tok_pair_map { /* (left id, right id) -> merge rank and merged id */
    struct tok_pair_slot *slot; /* [mask + 1] */
    uint32_t mask;
};

/* One pre-tokenizer stage. A piece entering the stage gets a leading space if asked, is cut by
 * the regex into matches and the gaps between them (HF "Isolated"), and each part goes on to
 * the next stage; after the last stage a part is one BPE word. */
struct tok_split {
    pcre2_code *re; /* NULL: the piece passes whole */
    int prefix_space;
};
#define TOK_MAX_SPLITS 8

struct tmx_tokenizer {
    int n_vocab;
    struct tok_entry *tok; /* [n_vocab] */
    char *bytes;           /* every token's bytes back to back */
    size_t n_bytes;

    struct tok_bytes_map vocab;
    struct tok_pair_map merges; /* tokenizer.json; empty for .tiktoken */
    int rank_by_bytes;          /* .tiktoken: a pair's rank is the id of its concatenation */
    int ignore_merges;          /* a word that is a whole token is taken as is */
    int32_t byte_id[256];       /* the token of each single byte */

    int32_t *added;         /* [added_at[256]] ids of added tokens, by first byte, longest first */
    uint32_t added_at[257]; /* added[added_at[b] .. added_at[b+1]) start with byte b */

    struct tok_split split[TOK_MAX_SPLITS];
    int n_split;
};

/* Shared by the two files only: hidden, so that calls stay direct and inlinable. */
#pragma GCC visibility push(hidden)
/* Returns the id of these bytes in tok->vocab, or -1. */
int32_t tok_vocab_find(const struct tmx_tokenizer *tok, const void *s, size_t n);
/* Indexes every TOK_MODEL entry. Returns 0, or -1 when out of memory; *dup is the first id whose
 * bytes an earlier id already has, or -1. */
int tok_vocab_build(struct tmx_tokenizer *tok, int32_t *dup);
int tok_pair_reserve(struct tok_pair_map *m, size_t n);
/* Keeps the first rank given for a pair (the file's earlier merge wins). */
void tok_pair_put(struct tok_pair_map *m, int32_t a, int32_t b, uint32_t rank, int32_t merged);
#pragma GCC visibility pop

#endif
