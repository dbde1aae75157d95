/* tokenizer-load.c: reads a Hugging Face tokenizer.json or a .tiktoken rank file into the tables
 * of tokenizer-impl.h. Anything the encoder would get wrong is refused here, by file and field:
 * a normalizer, a model other than byte-level BPE, pre-tokenizers other than Split and
 * ByteLevel, added tokens that strip whitespace. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer-impl.h"

/* The pre-split regexes, as the reference implementations write them. */
static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char o200k_pattern[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

static const struct {
    const char *text;
    int32_t id;
} o200k_special[] = {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}};

/* Ids above this are surely a broken file, not a vocabulary. */
#define MAX_ID (1 << 24)

/* ---- shared steps ------------------------------------------------------------------------- */

/* Appends n bytes to tok->bytes (sized by the caller) as the bytes of token id. */
static void put_token(struct tmx_tokenizer *tok, int32_t id, const void *s, size_t n, int flags) {
    tok->tok[id] = (struct tok_entry){(uint32_t)tok->n_bytes, (uint32_t)n, (uint8_t)flags};
    memcpy(tok->bytes + tok->n_bytes, s, n);
    tok->n_bytes += n;
}

static enum tmx_status alloc_tables(struct tmx_tokenizer *tok, int n_vocab, size_t n_bytes,
                                    const char *path, char **err) {
    tok->n_vocab = n_vocab;
    tok->tok = calloc((size_t)n_vocab, sizeof *tok->tok);
    tok->bytes = malloc(n_bytes ? n_bytes : 1);
    if (!tok->tok || !tok->bytes)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory for %d tokens", path, n_vocab);
    return TMX_OK;
}

static enum tmx_status build_vocab(struct tmx_tokenizer *tok, const char *path, const char *field,
                                   char **err) {
    int32_t dup;
    if (tok_vocab_build(tok, &dup) != 0)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory for the vocabulary", path);
    if (dup >= 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s: token %d's bytes appear twice", path, field,
                       dup);
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        tok->byte_id[b] = tok_vocab_find(tok, &c, 1);
        if (tok->byte_id[b] < 0)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: %s has no token for byte 0x%02x (byte-level BPE needs all 256)",
                           path, field, b);
    }
    return TMX_OK;
}

/* Compiles one pre-tokenizer stage; pattern NULL makes a stage without a regex, and a literal
 * pattern is matched as plain text. */
static enum tmx_status add_split(struct tmx_tokenizer *tok, const char *pattern, int literal,
                                 int prefix_space, const char *path, const char *field,
                                 char **err) {
    if (tok->n_split == TOK_MAX_SPLITS)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: %s: more than %d pre-tokenizers", path, field,
                       TOK_MAX_SPLITS);
    pcre2_code *re = NULL;
    if (pattern) {
        int code;
        PCRE2_SIZE at;
        uint32_t options =
            PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
        re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, options, &code, &at, NULL);
        if (!re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            return tmx_err(err, TMX_ERR_INVALID, "%s: %s: regex error at offset %zu: %s", path,
                           field, (size_t)at, (const char *)msg);
        }
        pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* without JIT the interpreter runs it */
    }
    tok->split[tok->n_split++] = (struct tok_split){re, prefix_space};
    return TMX_OK;
}

struct added_key {
    unsigned char first;
    uint32_t len;
    int32_t id;
};

static int added_order(const void *pa, const void *pb) {
    const struct added_key *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1; /* longest first */
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Indexes the added tokens by first byte, longest first, for leftmost-longest matching. */
static enum tmx_status index_added(struct tmx_tokenizer *tok, const char *path, char **err) {
    int n = 0;
    for (int id = 0; id < tok->n_vocab; id++) n += (tok->tok[id].flags & TOK_ADDED) != 0;
    struct added_key *keys = malloc((size_t)(n ? n : 1) * sizeof *keys);
    tok->added = malloc((size_t)(n ? n : 1) * sizeof *tok->added);
    if (!keys || !tok->added) {
        free(keys);
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
    }
    int k = 0;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        const struct tok_entry *e = &tok->tok[id];
        if (e->flags & TOK_ADDED)
            keys[k++] = (struct added_key){(unsigned char)tok->bytes[e->off], e->len, id};
    }
    qsort(keys, (size_t)n, sizeof *keys, added_order);
    memset(tok->added_at, 0, sizeof tok->added_at);
    for (int i = 0; i < n; i++) {
        tok->added[i] = keys[i].id;
        tok->added_at[keys[i].first + 1]++;
    }
    for (int b = 0; b < 256; b++) tok->added_at[b + 1] += tok->added_at[b];
    free(keys);
    return TMX_OK;
}

/* ---- tokenizer.json ----------------------------------------------------------------------- */

/* GPT-2's byte-level alphabet: printable Latin-1 bytes ('!'..'~', 0xa1..0xac, 0xae..0xff)
 * stand for themselves; the other 68 bytes take code points 256, 257, ... in byte order. */
#define BYTE_LEVEL_CPS (256 + 68)

static void byte_level_inverse(int16_t byte_of[BYTE_LEVEL_CPS]) {
    int next = 256;
    for (int cp = 0; cp < BYTE_LEVEL_CPS; cp++) byte_of[cp] = -1;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        byte_of[printable ? b : next++] = (int16_t)b;
    }
}

/* Writes the bytes a byte-level string stands for to out (room for strlen(s) bytes) and
 * returns their count. A string with characters outside the alphabet (added tokens, some odd
 * vocab entries) stands for its own UTF-8, as Hugging Face's ByteLevel decoder reads it. */
static size_t from_byte_level(const int16_t byte_of[BYTE_LEVEL_CPS], const char *s, size_t n,
                              unsigned char *out) {
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = (unsigned char)s[i];
        unsigned cp = c < 0x80 ? c : c < 0xe0 ? c & 0x1f : c < 0xf0 ? c & 0x0f : c & 0x07;
        size_t k = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4; /* jansson checked the UTF-8 */
        for (size_t j = 1; j < k && i + j < n; j++) cp = cp << 6 | ((unsigned char)s[i + j] & 0x3f);
        if (cp >= BYTE_LEVEL_CPS || byte_of[cp] < 0) {
            memcpy(out, s, n);
            return n;
        }
        out[w++] = (unsigned char)byte_of[cp];
        i += k;
    }
    return w;
}

/* obj[key], with JSON null read as absent. */
static json_t *member(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

/* The string member key, "" when absent; -1 when present but not a string. */
static int string_member(const json_t *obj, const char *key, const char **out) {
    json_t *v = member(obj, key);
    *out = v ? json_string_value(v) : "";
    return *out ? 0 : -1;
}

/* The boolean member key, dflt when absent; -1 when present but not a boolean. */
static int bool_member(const json_t *obj, const char *key, int dflt) {
    json_t *v = member(obj, key);
    return !v ? dflt : json_is_boolean(v) ? json_is_true(v) : -1;
}

static enum tmx_status parse_pre_item(struct tmx_tokenizer *tok, const json_t *item, int last,
                                      const char *path, const char *field, char **err) {
    const char *type;
    if (!json_is_object(item) || string_member(item, "type", &type) != 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s: expected an object with a string \"type\"",
                       path, field);
    if (strcmp(type, "ByteLevel") == 0) {
        int prefix = bool_member(item, "add_prefix_space", 1),
            regex = bool_member(item, "use_regex", 1);
        if (prefix < 0 || regex < 0)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: %s: add_prefix_space and use_regex must be booleans", path, field);
        if (!last) /* later stages would see byte-level characters, not text */
            return tmx_err(err, TMX_ERR_UNSUPPORTED,
                           "%s: %s: ByteLevel must be the last pre-tokenizer", path, field);
        return add_split(tok, regex ? gpt2_pattern : NULL, 0, prefix, path, field, err);
    }
    if (strcmp(type, "Split") != 0)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: %s.type \"%s\" is not supported (ByteLevel, Split and Sequence are)",
                       path, field, type);
    if (last) /* the vocabulary is byte-level: the words must be too */
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: %s: the last pre-tokenizer must be ByteLevel",
                       path, field);
    const json_t *pattern = member(item, "pattern");
    const char *behavior, *regex = NULL, *literal = NULL;
    if (string_member(item, "behavior", &behavior) != 0 || strcmp(behavior, "Isolated") != 0)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: %s.behavior must be \"Isolated\"", path,
                       field);
    if (bool_member(item, "invert", 0) != 0)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: %s.invert must be false", path, field);
    if (pattern) {
        regex = json_string_value(member(pattern, "Regex"));
        literal = json_string_value(member(pattern, "String"));
    }
    if (!regex == !literal)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: %s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", path,
                       field);
    return add_split(tok, regex ? regex : literal, !regex, 0, path, field, err);
}

static enum tmx_status parse_pre_tokenizer(struct tmx_tokenizer *tok, const json_t *root,
                                           const char *path, char **err) {
    const json_t *pre = member(root, "pre_tokenizer");
    const char *type = pre ? json_string_value(json_object_get(pre, "type")) : NULL;
    if (!type || strcmp(type, "Sequence") != 0)
        return parse_pre_item(tok, pre, 1, path, "pre_tokenizer", err);
    const json_t *items = json_object_get(pre, "pretokenizers");
    size_t n = json_array_size(items);
    if (n == 0)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: pre_tokenizer.pretokenizers: expected a non-empty array", path);
    for (size_t i = 0; i < n; i++) {
        char field[64];
        snprintf(field, sizeof field, "pre_tokenizer.pretokenizers[%zu]", i);
        enum tmx_status st =
            parse_pre_item(tok, json_array_get(items, i), i + 1 == n, path, field, err);
        if (st != TMX_OK) return st;
    }
    return TMX_OK;
}

/* Checks the model's options and sets tok->n_vocab's inputs: *max_id and *n_bytes. */
static enum tmx_status check_model(const json_t *model, const json_t *added, int64_t *max_id,
                                   size_t *n_bytes, const char *path, char **err) {
    const char *type, *prefix, *suffix;
    if (!json_is_object(model))
        return tmx_err(err, TMX_ERR_INVALID, "%s: model: expected an object", path);
    if (string_member(model, "type", &type) != 0 || (*type && strcmp(type, "BPE") != 0))
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: model.type \"%s\" is not supported (only \"BPE\")", path,
                       type ? type : "?");
    if (string_member(model, "continuing_subword_prefix", &prefix) != 0 || *prefix)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: model.continuing_subword_prefix is not supported", path);
    if (string_member(model, "end_of_word_suffix", &suffix) != 0 || *suffix)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: model.end_of_word_suffix is not supported",
                       path);
    if (bool_member(model, "byte_fallback", 0) != 0)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: model.byte_fallback is not supported", path);
    const json_t *dropout = member(model, "dropout");
    if (dropout && json_number_value(dropout) != 0)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: model.dropout is not supported", path);
    if (bool_member(model, "ignore_merges", 0) < 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: model.ignore_merges: expected a boolean", path);
    const json_t *vocab = member(model, "vocab"), *v;
    const char *key;
    if (!json_is_object(vocab))
        return tmx_err(err, TMX_ERR_INVALID, "%s: model.vocab: expected an object", path);
    if (!json_is_array(member(model, "merges")))
        return tmx_err(err, TMX_ERR_INVALID, "%s: model.merges: expected an array", path);
    *max_id = -1;
    *n_bytes = 0;
    json_object_foreach((json_t *)vocab, key, v) {
        json_int_t id = json_integer_value(v);
        if (!json_is_integer(v) || id < 0 || id >= MAX_ID || !*key)
            return tmx_err(
                err, TMX_ERR_INVALID,
                "%s: model.vocab[\"%s\"]: expected a non-empty token and an id in [0, %d)", path,
                key, MAX_ID);
        *max_id = id > *max_id ? id : *max_id;
        *n_bytes += strlen(key);
    }
    if (added && !json_is_array(added))
        return tmx_err(err, TMX_ERR_INVALID, "%s: added_tokens: expected an array", path);
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *a = json_array_get(added, i);
        json_int_t id = json_integer_value(json_object_get(a, "id"));
        const char *content = json_string_value(json_object_get(a, "content"));
        if (!json_is_integer(json_object_get(a, "id")) || id < 0 || id >= MAX_ID || !content ||
            !*content)
            return tmx_err(
                err, TMX_ERR_INVALID,
                "%s: added_tokens[%zu]: expected an id in [0, %d) and a non-empty content", path, i,
                MAX_ID);
        static const char *const unsupported[] = {"single_word", "lstrip", "rstrip"};
        for (int k = 0; k < 3; k++)
            if (bool_member(a, unsupported[k], 0) != 0)
                return tmx_err(err, TMX_ERR_UNSUPPORTED,
                               "%s: added_tokens[%zu].%s is not supported", path, i,
                               unsupported[k]);
        *max_id = id > *max_id ? id : *max_id;
        *n_bytes += json_string_length(json_object_get(a, "content"));
    }
    if (*max_id < 0) return tmx_err(err, TMX_ERR_INVALID, "%s: model.vocab is empty", path);
    return TMX_OK;
}

/* Reads the two tokens of merges[i] ("a b", or ["a", "b"]) into buf as bytes. */
static int merge_halves(const int16_t byte_of[BYTE_LEVEL_CPS], const json_t *m, unsigned char *buf,
                        size_t *na, size_t *nb) {
    const char *a, *b;
    size_t la, lb;
    if (json_is_string(m)) {
        a = json_string_value(m);
        const char *sp = strchr(a, ' ');
        if (!sp || sp == a || !sp[1] || strchr(sp + 1, ' ')) return -1;
        la = (size_t)(sp - a);
        b = sp + 1;
        lb = strlen(b);
    } else {
        a = json_string_value(json_array_get(m, 0));
        b = json_string_value(json_array_get(m, 1));
        if (json_array_size(m) != 2 || !a || !b || !*a || !*b) return -1;
        la = strlen(a);
        lb = strlen(b);
    }
    *na = from_byte_level(byte_of, a, la, buf);
    *nb = from_byte_level(byte_of, b, lb, buf + *na);
    return 0;
}

static enum tmx_status parse_merges(struct tmx_tokenizer *tok,
                                    const int16_t byte_of[BYTE_LEVEL_CPS], const json_t *merges,
                                    const char *path, char **err) {
    size_t n = json_array_size(merges), cap = 0;
    unsigned char *buf = NULL; /* [cap] the two halves, back to back */
    if (tok_pair_reserve(&tok->merges, n) != 0)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory for %zu merges", path, n);
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(merges, i);
        size_t need = json_is_string(m) ? json_string_length(m)
                                        : json_string_length(json_array_get(m, 0)) +
                                              json_string_length(json_array_get(m, 1));
        if (need > cap) {
            unsigned char *grown = realloc(buf, 2 * need);
            if (!grown) {
                free(buf);
                return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = grown;
            cap = 2 * need;
        }
        size_t na, nb;
        if (merge_halves(byte_of, m, buf, &na, &nb) != 0) {
            free(buf);
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"]", path, i);
        }
        int32_t a = tok_vocab_find(tok, buf, na), b = tok_vocab_find(tok, buf + na, nb);
        int32_t merged = tok_vocab_find(tok, buf, na + nb);
        if (a < 0 || b < 0 || merged < 0) {
            free(buf);
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: model.merges[%zu]: the %s token is not in model.vocab", path, i,
                           a < 0   ? "first"
                           : b < 0 ? "second"
                                   : "merged");
        }
        tok_pair_put(&tok->merges, a, b, (uint32_t)i, merged);
    }
    free(buf);
    return TMX_OK;
}

/* Fills the token table from model.vocab, then added_tokens. */
static enum tmx_status parse_tokens(struct tmx_tokenizer *tok,
                                    const int16_t byte_of[BYTE_LEVEL_CPS], const json_t *vocab,
                                    const json_t *added, const char *path, char **err) {
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        if (tok->tok[id].flags)
            return tmx_err(err, TMX_ERR_INVALID, "%s: model.vocab[\"%s\"]: id %d is used twice",
                           path, key, id);
        size_t n =
            from_byte_level(byte_of, key, strlen(key), (unsigned char *)tok->bytes + tok->n_bytes);
        tok->tok[id] = (struct tok_entry){(uint32_t)tok->n_bytes, (uint32_t)n, TOK_MODEL};
        tok->n_bytes += n;
    }
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *a = json_array_get(added, i);
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        const char *content = json_string_value(json_object_get(a, "content"));
        size_t n = json_string_length(json_object_get(a, "content"));
        int special = bool_member(a, "special", 0);
        struct tok_entry *e = &tok->tok[id];
        if (special < 0)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: added_tokens[%zu].special: expected a boolean", path, i);
        if (e->flags & TOK_ADDED)
            return tmx_err(err, TMX_ERR_INVALID, "%s: added_tokens[%zu]: id %d is listed twice",
                           path, i, id);
        if (e->flags & TOK_MODEL && (e->len != n || memcmp(tok->bytes + e->off, content, n) != 0))
            return tmx_err(err, TMX_ERR_UNSUPPORTED,
                           "%s: added_tokens[%zu]: id %d is a model.vocab token with other content",
                           path, i, id);
        if (!(e->flags & TOK_MODEL)) put_token(tok, id, content, n, 0);
        e->flags |= TOK_ADDED | (special ? TOK_SPECIAL : 0);
    }
    return TMX_OK;
}

static enum tmx_status load_json(struct tmx_tokenizer *tok, const char *path, char **err) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return json_error_code(&je) == json_error_cannot_open_file
                   ? tmx_err(err, TMX_ERR_IO, "%s: %s", path, je.text)
                   : tmx_err(err, TMX_ERR_INVALID, "%s: line %d: %s", path, je.line, je.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return tmx_err(err, TMX_ERR_INVALID, "%s: expected a JSON object at the top", path);
    }
    const json_t *model = member(root, "model"), *added = member(root, "added_tokens");
    const json_t *norm = member(root, "normalizer"), *dec = member(root, "decoder");
    const char *dec_type = json_string_value(json_object_get(dec, "type"));
    int16_t byte_of[BYTE_LEVEL_CPS];
    byte_level_inverse(byte_of);
    int64_t max_id = -1;
    size_t n_bytes = 0;
    enum tmx_status st = TMX_OK;
    if (norm) {
        const char *type = json_string_value(json_object_get(norm, "type"));
        st = tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (only null)",
                     path, type ? type : "?");
    } else if (!dec_type || strcmp(dec_type, "ByteLevel") != 0) {
        st = tmx_err(err, TMX_ERR_UNSUPPORTED,
                     "%s: decoder.type \"%s\" is not supported (only \"ByteLevel\")", path,
                     dec_type ? dec_type : "null");
    }
    if (st == TMX_OK) st = check_model(model, added, &max_id, &n_bytes, path, err);
    if (st == TMX_OK) st = parse_pre_tokenizer(tok, root, path, err);
    if (st == TMX_OK) st = alloc_tables(tok, (int)max_id + 1, n_bytes, path, err);
    if (st == TMX_OK) st = parse_tokens(tok, byte_of, member(model, "vocab"), added, path, err);
    if (st == TMX_OK) st = build_vocab(tok, path, "model.vocab", err);
    if (st == TMX_OK) st = parse_merges(tok, byte_of, member(model, "merges"), path, err);
    tok->ignore_merges = st == TMX_OK && bool_member(model, "ignore_merges", 0) == 1;
    json_decref(root);
    return st;
}

/* ---- .tiktoken ---------------------------------------------------------------------------- */

static int base64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* Decodes padded base64 s[0..n) into out (room for 3n/4 bytes); returns the length or -1. */
static long base64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4 != 0) return -1;
    size_t pad = (s[n - 1] == '=') + (s[n - 2] == '=');
    long w = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t quad = 0;
        for (size_t j = 0; j < 4; j++) {
            int v = i + j >= n - pad ? 0 : base64_value((unsigned char)s[i + j]);
            if (v < 0) return -1;
            quad = quad << 6 | (uint32_t)v;
        }
        out[w++] = (unsigned char)(quad >> 16);
        out[w++] = (unsigned char)(quad >> 8);
        out[w++] = (unsigned char)quad;
    }
    return w - (long)pad;
}

static char *read_file(const char *path, size_t *len, char **err, enum tmx_status *st) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long size = -1;
    if (f && fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size >= 0 && fseek(f, 0, SEEK_SET) == 0) buf = malloc((size_t)size + 1);
    if (buf && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        free(buf);
        buf = NULL;
    }
    if (!buf) *st = tmx_err(err, TMX_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
    if (f) fclose(f);
    if (buf) buf[size] = '\0';
    *len = (size_t)size;
    return buf;
}

/* Parses "<base64> <rank>" lines, giving token rank the decoded bytes. */
static enum tmx_status parse_ranks(struct tmx_tokenizer *tok, const char *text, size_t len,
                                   const char *path, char **err) {
    size_t line = 1;
    for (const char *s = text, *end = text + len; s < end; line++) {
        const char *eol = memchr(s, '\n', (size_t)(end - s));
        if (!eol) eol = end;
        const char *next = eol + 1, *sp = memchr(s, ' ', (size_t)(eol - s));
        if (eol > s && eol[-1] == '\r') eol--;
        if (eol == s) { /* a blank line */
            s = next;
            continue;
        }
        char *stop = NULL;
        long rank = sp ? strtol(sp + 1, &stop, 10) : -1;
        if (!sp || stop != eol || rank < 0 || rank >= tok->n_vocab)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s:%zu: expected \"<base64> <rank>\" with a rank below %d", path, line,
                           tok->n_vocab);
        if (tok->tok[rank].len)
            return tmx_err(err, TMX_ERR_INVALID, "%s:%zu: rank %ld is given twice", path, line,
                           rank);
        long n = base64_decode(s, (size_t)(sp - s), (unsigned char *)tok->bytes + tok->n_bytes);
        if (n <= 0) return tmx_err(err, TMX_ERR_INVALID, "%s:%zu: bad base64", path, line);
        tok->tok[rank] = (struct tok_entry){(uint32_t)tok->n_bytes, (uint32_t)n, TOK_MODEL};
        tok->n_bytes += (size_t)n;
        s = next;
    }
    return TMX_OK;
}

static enum tmx_status load_tiktoken(struct tmx_tokenizer *tok, const char *path, char **err) {
    enum tmx_status st = TMX_OK;
    size_t len;
    char *text = read_file(path, &len, err, &st);
    if (!text) return st;
    /* Ranks are dense from 0 in the files in use, so a line count bounds the largest. */
    size_t n_lines = 1, n_bytes = len;
    for (size_t i = 0; i < len; i++) n_lines += text[i] == '\n';
    int32_t n_vocab = n_lines < MAX_ID ? (int32_t)n_lines : MAX_ID;
    for (size_t i = 0; i < sizeof o200k_special / sizeof *o200k_special; i++) {
        if (o200k_special[i].id >= n_vocab) n_vocab = o200k_special[i].id + 1;
        n_bytes += strlen(o200k_special[i].text);
    }
    st = alloc_tables(tok, n_vocab, n_bytes, path, err);
    if (st == TMX_OK) st = parse_ranks(tok, text, len, path, err);
    free(text);
    for (size_t i = 0; st == TMX_OK && i < sizeof o200k_special / sizeof *o200k_special; i++) {
        int32_t id = o200k_special[i].id;
        if (tok->tok[id].len)
            return tmx_err(err, TMX_ERR_INVALID, "%s: rank %d is also the special token %s", path,
                           id, o200k_special[i].text);
        put_token(tok, id, o200k_special[i].text, strlen(o200k_special[i].text),
                  TOK_ADDED | TOK_SPECIAL);
    }
    while (st == TMX_OK && tok->n_vocab > 0 && tok->tok[tok->n_vocab - 1].len == 0) tok->n_vocab--;
    if (st == TMX_OK) st = build_vocab(tok, path, "ranks", err);
    if (st == TMX_OK) st = add_split(tok, o200k_pattern, 0, 0, path, "o200k pattern", err);
    tok->rank_by_bytes = 1;
    tok->ignore_merges = 1;
    return st;
}

enum tmx_status tmx_tokenizer_load(const char *path, struct tmx_tokenizer **out, char **err) {
    struct tmx_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
    size_t n = strlen(path);
    int tiktoken = n >= 9 && strcmp(path + n - 9, ".tiktoken") == 0;
    enum tmx_status st = tiktoken ? load_tiktoken(tok, path, err) : load_json(tok, path, err);
    if (st == TMX_OK) st = index_added(tok, path, err);
    if (st != TMX_OK) {
        tmx_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return TMX_OK;
}
