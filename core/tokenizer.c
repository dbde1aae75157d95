/* tokenizer.c: byte-level BPE encode and decode over the tables of tokenizer-impl.h.
 *
 * Encoding runs in three steps. Added tokens are cut out of the text first (leftmost, longest
 * match). Each remaining span goes through the pre-tokenizer stages (PCRE2 regexes) into words.
 * Each word starts as one part per byte, and the adjacent pair of lowest rank is merged until
 * no pair has a rank; a heap of candidate pairs keeps that O(n log n) in the word's length.
 * Loading lives in tokenizer-load.c. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer-impl.h"

/* ---- hash maps ---------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static uint64_t tok_hash(const void *s, size_t n) {
    const unsigned char *p = s;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return mix64(h ^ w);
}

/* Smallest power of two that keeps n entries at most half full. */
static uint32_t table_size(size_t n) {
    uint32_t size = 16;
    while (size < 2 * n) size *= 2;
    return size;
}

int32_t tok_vocab_find(const struct tmx_tokenizer *tok, const void *s, size_t n) {
    const struct tok_bytes_map *m = &tok->vocab;
    if (!m->slot) return -1;
    uint32_t h = (uint32_t)tok_hash(s, n);
    for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->slot[i].id;
        if (id < 0) return -1;
        if (m->slot[i].hash == h && m->slot[i].len == n &&
            memcmp(tok->bytes + m->slot[i].off, s, n) == 0)
            return id;
    }
}

int tok_vocab_build(struct tmx_tokenizer *tok, int32_t *dup) {
    size_t n = 0;
    for (int id = 0; id < tok->n_vocab; id++) n += (tok->tok[id].flags & TOK_MODEL) != 0;
    struct tok_bytes_map *m = &tok->vocab;
    uint32_t size = table_size(n);
    m->slot = malloc(size * sizeof *m->slot);
    if (!m->slot) return -1;
    m->mask = size - 1;
    for (uint32_t i = 0; i < size; i++) m->slot[i].id = -1;
    *dup = -1;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        const struct tok_entry *e = &tok->tok[id];
        if (!(e->flags & TOK_MODEL)) continue;
        const char *key = tok->bytes + e->off;
        uint32_t h = (uint32_t)tok_hash(key, e->len), i = h & m->mask;
        for (; m->slot[i].id >= 0; i = (i + 1) & m->mask) {
            const struct tok_bytes_slot *o = &m->slot[i];
            if (o->hash == h && o->len == e->len && memcmp(tok->bytes + o->off, key, e->len) == 0)
                break;
        }
        if (m->slot[i].id >= 0) {
            if (*dup < 0) *dup = id;
            continue;
        }
        m->slot[i] = (struct tok_bytes_slot){h, id, e->off, e->len};
    }
    return 0;
}

int tok_pair_reserve(struct tok_pair_map *m, size_t n) {
    uint32_t size = table_size(n);
    m->slot = malloc(size * sizeof *m->slot);
    if (!m->slot) return -1;
    m->mask = size - 1;
    for (uint32_t i = 0; i < size; i++) m->slot[i].merged = -1;
    return 0;
}

void tok_pair_put(struct tok_pair_map *m, int32_t a, int32_t b, uint32_t rank, int32_t merged) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = (uint32_t)mix64(key) & m->mask;
    while (m->slot[i].merged >= 0) {
        if (m->slot[i].key == key) return;
        i = (i + 1) & m->mask;
    }
    m->slot[i].key = key;
    m->slot[i].rank = rank;
    m->slot[i].merged = merged;
}

#define NO_RANK UINT32_MAX

static uint32_t pair_find(const struct tok_pair_map *m, int32_t a, int32_t b, int32_t *merged) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint32_t i = (uint32_t)mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slot[i].merged < 0) return NO_RANK;
        if (m->slot[i].key == key) {
            *merged = m->slot[i].merged;
            return m->slot[i].rank;
        }
    }
}

/* ---- BPE on one word ---------------------------------------------------------------------- */

/* A run of the word's bytes that is one token so far; parts form a list in text order. A part
 * keeps its index (its first byte's position) for life, and dies (id -1) when its left
 * neighbour absorbs it. */
struct part {
    int32_t id;
    uint32_t start, len;
    int32_t prev, next; /* -1 at the ends */
};

/* Merging parts left and right (adjacent when pushed) gives token merged. */
struct cand {
    uint32_t rank;
    int32_t left, right, id_left, id_right, merged;
};

/* The state of one encode call; the tokenizer itself stays read-only (and shareable). */
struct enc {
    const struct tmx_tokenizer *tok;
    pcre2_match_data *md;
    int32_t *ids; /* [cap_ids] the output */
    size_t n_ids, cap_ids;
    struct part *part; /* [cap_word] */
    struct cand *heap; /* [3 * cap_word]: n-1 first pairs, then at most 2 per merge */
    size_t cap_word, n_heap;
    char *prefixed[TOK_MAX_SPLITS]; /* [cap_prefixed[i]] a piece with its added space */
    size_t cap_prefixed[TOK_MAX_SPLITS];
    char **err;
};

static enum tmx_status emit(struct enc *e, int32_t id) {
    if (e->n_ids == e->cap_ids) {
        size_t cap = e->cap_ids ? 2 * e->cap_ids : 256;
        int32_t *ids = realloc(e->ids, cap * sizeof *ids);
        if (!ids)
            return tmx_err(e->err, TMX_ERR_NOMEM, "tokenizer: out of memory for %zu ids", cap);
        e->ids = ids;
        e->cap_ids = cap;
    }
    e->ids[e->n_ids++] = id;
    return TMX_OK;
}

static int cand_less(const struct cand *a, const struct cand *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->left < b->left;
}

/* Pushes the pair (l, r) if it merges: lowest rank first, leftmost among equal ranks. */
static void heap_push(struct enc *e, const char *s, int32_t l, int32_t r) {
    const struct tmx_tokenizer *tok = e->tok;
    const struct part *pl = &e->part[l], *pr = &e->part[r];
    int32_t merged = -1;
    uint32_t rank;
    if (tok->rank_by_bytes) {
        merged = tok_vocab_find(tok, s + pl->start, pl->len + pr->len);
        rank = merged < 0 ? NO_RANK : (uint32_t)merged;
    } else {
        rank = pair_find(&tok->merges, pl->id, pr->id, &merged);
    }
    if (rank == NO_RANK) return;
    struct cand c = {rank, l, r, pl->id, pr->id, merged};
    size_t i = e->n_heap++;
    for (; i > 0 && cand_less(&c, &e->heap[(i - 1) / 2]); i = (i - 1) / 2)
        e->heap[i] = e->heap[(i - 1) / 2];
    e->heap[i] = c;
}

static struct cand heap_pop(struct enc *e) {
    struct cand top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!cand_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0) e->heap[i] = last;
    return top;
}

static enum tmx_status bpe_word(struct enc *e, const char *s, size_t n) {
    const struct tmx_tokenizer *tok = e->tok;
    if (n == 1) return emit(e, tok->byte_id[(unsigned char)s[0]]);
    if (tok->ignore_merges) {
        int32_t id = tok_vocab_find(tok, s, n);
        if (id >= 0) return emit(e, id);
    }
    if (n > e->cap_word) {
        size_t cap = n > 2 * e->cap_word ? n : 2 * e->cap_word;
        struct part *part = realloc(e->part, cap * sizeof *part);
        if (!part) return tmx_err(e->err, TMX_ERR_NOMEM, "tokenizer: out of memory for a word");
        e->part = part;
        struct cand *heap = realloc(e->heap, 3 * cap * sizeof *heap);
        if (!heap) return tmx_err(e->err, TMX_ERR_NOMEM, "tokenizer: out of memory for a word");
        e->heap = heap;
        e->cap_word = cap;
    }
    struct part *p = e->part;
    for (size_t i = 0; i < n; i++)
        p[i] = (struct part){tok->byte_id[(unsigned char)s[i]], (uint32_t)i, 1, (int32_t)i - 1,
                             i + 1 < n ? (int32_t)i + 1 : -1};
    e->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++) heap_push(e, s, (int32_t)i, (int32_t)i + 1);
    while (e->n_heap > 0) {
        struct cand c = heap_pop(e);
        struct part *l = &p[c.left], *r = &p[c.right];
        if (l->next != c.right || l->id != c.id_left || r->id != c.id_right) continue; /* stale */
        l->id = c.merged;
        l->len += r->len;
        l->next = r->next;
        r->id = -1;
        if (l->next >= 0) p[l->next].prev = c.left;
        if (l->prev >= 0) heap_push(e, s, l->prev, c.left);
        if (l->next >= 0) heap_push(e, s, c.left, l->next);
    }
    for (int32_t i = 0; i >= 0; i = p[i].next) {
        enum tmx_status st = emit(e, p[i].id);
        if (st != TMX_OK) return st;
    }
    return TMX_OK;
}

/* ---- pre-tokenizer stages ----------------------------------------------------------------- */

/* Bytes to step over at s: one UTF-8 character, or one byte where the UTF-8 is broken. */
static size_t utf8_step(const char *s, size_t n) {
    unsigned char c = (unsigned char)s[0];
    size_t want = c < 0xc0 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    if (want > n) return 1;
    for (size_t i = 1; i < want; i++)
        if (((unsigned char)s[i] & 0xc0) != 0x80) return 1;
    return want;
}

/* Finds the next match of re in s[from..n) at [*ms, *me); returns 1, 0 when none, -1 on error. */
static int find_match(struct enc *e, const pcre2_code *re, const char *s, size_t n, size_t from,
                      size_t *ms, size_t *me) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, 0, e->md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) /* a very long match: the interpreter has more room */
        rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_JIT, e->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(rc, msg, sizeof msg);
        tmx_err(e->err, TMX_ERR_INVALID, "tokenizer: pre-split regex failed at byte %zu: %s", from,
                (const char *)msg);
        return -1;
    }
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

static enum tmx_status split_piece(struct enc *e, int stage, const char *s, size_t n) {
    const struct tmx_tokenizer *tok = e->tok;
    if (stage == tok->n_split) return bpe_word(e, s, n);
    const struct tok_split *sp = &tok->split[stage];
    if (sp->prefix_space && s[0] != ' ') {
        if (n + 1 > e->cap_prefixed[stage]) {
            char *buf = realloc(e->prefixed[stage], 2 * n + 1);
            if (!buf) return tmx_err(e->err, TMX_ERR_NOMEM, "tokenizer: out of memory");
            e->prefixed[stage] = buf;
            e->cap_prefixed[stage] = 2 * n + 1;
        }
        e->prefixed[stage][0] = ' ';
        memcpy(e->prefixed[stage] + 1, s, n);
        s = e->prefixed[stage];
        n++;
    }
    if (!sp->re) return split_piece(e, stage + 1, s, n);
    /* Matches and the gaps between them are both parts. Gaps are rare (the patterns in use
     * match every valid character) but hold broken UTF-8, which no pattern item matches. */
    enum tmx_status st = TMX_OK;
    size_t from = 0, gap = 0, ms, me;
    while (from < n && st == TMX_OK) {
        int found = find_match(e, sp->re, s, n, from, &ms, &me);
        if (found < 0) return TMX_ERR_INVALID;
        if (!found) break;
        if (me == ms) { /* an empty match cuts nothing */
            from = ms + utf8_step(s + ms, n - ms);
            continue;
        }
        if (ms > gap) st = split_piece(e, stage + 1, s + gap, ms - gap);
        if (st == TMX_OK) st = split_piece(e, stage + 1, s + ms, me - ms);
        gap = from = me;
    }
    if (st == TMX_OK && gap < n) st = split_piece(e, stage + 1, s + gap, n - gap);
    return st;
}

/* ---- encode ------------------------------------------------------------------------------- */

/* The longest added token at the start of s[0..n), or -1; specials count only if asked. */
static int32_t added_match(const struct tmx_tokenizer *tok, const char *s, size_t n,
                           int parse_special) {
    unsigned char b = (unsigned char)s[0];
    for (uint32_t k = tok->added_at[b]; k < tok->added_at[b + 1]; k++) {
        const struct tok_entry *t = &tok->tok[tok->added[k]];
        if ((t->flags & TOK_SPECIAL) && !parse_special) continue;
        if (t->len <= n && memcmp(tok->bytes + t->off, s, t->len) == 0) return tok->added[k];
    }
    return -1;
}

static enum tmx_status encode_text(struct enc *e, const char *text, size_t len, int parse_special) {
    const struct tmx_tokenizer *tok = e->tok;
    size_t seg = 0; /* start of the text since the last added token */
    for (size_t i = 0; i < len;) {
        unsigned char b = (unsigned char)text[i];
        int32_t id = tok->added_at[b] == tok->added_at[b + 1]
                         ? -1
                         : added_match(tok, text + i, len - i, parse_special);
        if (id < 0) {
            i++;
            continue;
        }
        enum tmx_status st = i > seg ? split_piece(e, 0, text + seg, i - seg) : TMX_OK;
        if (st == TMX_OK) st = emit(e, id);
        if (st != TMX_OK) return st;
        i += tok->tok[id].len;
        seg = i;
    }
    return seg < len ? split_piece(e, 0, text + seg, len - seg) : TMX_OK;
}

enum tmx_status tmx_tokenizer_encode(const struct tmx_tokenizer *tok, const char *text, size_t len,
                                     int parse_special, int32_t **ids, size_t *n_ids, char **err) {
    struct enc e = {.tok = tok, .err = err};
    e.md = pcre2_match_data_create(1, NULL);
    enum tmx_status st = e.md ? encode_text(&e, text, len, parse_special)
                              : tmx_err(err, TMX_ERR_NOMEM, "tokenizer: out of memory");
    pcre2_match_data_free(e.md);
    free(e.part);
    free(e.heap);
    for (int i = 0; i < TOK_MAX_SPLITS; i++) free(e.prefixed[i]);
    if (st != TMX_OK) {
        free(e.ids);
        return st;
    }
    if (!e.ids) e.ids = malloc(sizeof *e.ids); /* a valid pointer even for empty text */
    if (!e.ids) return tmx_err(err, TMX_ERR_NOMEM, "tokenizer: out of memory");
    *ids = e.ids;
    *n_ids = e.n_ids;
    return TMX_OK;
}

/* ---- lookups and decode ------------------------------------------------------------------- */

int tmx_tokenizer_n_vocab(const struct tmx_tokenizer *tok) { return tok->n_vocab; }

const char *tmx_tokenizer_token_bytes(const struct tmx_tokenizer *tok, int32_t id, size_t *len) {
    if (id < 0 || id >= tok->n_vocab || tok->tok[id].len == 0) return NULL;
    *len = tok->tok[id].len;
    return tok->bytes + tok->tok[id].off;
}

int tmx_tokenizer_is_special(const struct tmx_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab && (tok->tok[id].flags & TOK_SPECIAL);
}

int32_t tmx_tokenizer_find(const struct tmx_tokenizer *tok, const char *text) {
    size_t n = strlen(text);
    if (n == 0) return -1;
    int32_t id = added_match(tok, text, n, 1);
    if (id >= 0 && tok->tok[id].len == n) return id;
    return tok_vocab_find(tok, text, n);
}

enum tmx_status tmx_tokenizer_decode(const struct tmx_tokenizer *tok, const int32_t *ids, size_t n,
                                     char **text, size_t *len, char **err) {
    size_t total = 0, tlen;
    for (size_t i = 0; i < n; i++) {
        if (!tmx_tokenizer_token_bytes(tok, ids[i], &tlen))
            return tmx_err(err, TMX_ERR_INVALID, "tokenizer: unknown token id %d (at %zu of %zu)",
                           ids[i], i, n);
        total += tlen;
    }
    char *out = malloc(total + 1);
    if (!out) return tmx_err(err, TMX_ERR_NOMEM, "tokenizer: out of memory for %zu bytes", total);
    char *w = out;
    for (size_t i = 0; i < n; i++) {
        const char *t = tmx_tokenizer_token_bytes(tok, ids[i], &tlen);
        memcpy(w, t, tlen);
        w += tlen;
    }
    *w = '\0';
    *text = out;
    *len = total;
    return TMX_OK;
}

/* ---- streaming decode --------------------------------------------------------------------- */

/* The held bytes followed by the new token, read as one string without copying. */
struct span2 {
    const unsigned char *a, *b;
    size_t na, n;
};

static unsigned span_at(const struct span2 *s, size_t i) {
    return i < s->na ? s->a[i] : s->b[i - s->na];
}

/* The UTF-8 sequence at position i: its length k > 0 when whole and valid; 0 when valid so far
 * but cut off by the end; -k when its first k bytes are a maximal invalid subpart (Unicode's
 * rule for U+FFFD substitution, as Python's errors="replace" applies it). */
static int utf8_seq(const struct span2 *s, size_t i) {
    unsigned c = span_at(s, i);
    if (c < 0x80) return 1;
    if (c < 0xc2 || c > 0xf4) return -1; /* a continuation byte, or a lead never valid */
    int want = c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    /* The second byte's range excludes overlong forms, surrogates and code points > U+10FFFF. */
    unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
    unsigned hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
    for (int k = 1; k < want; k++, lo = 0x80, hi = 0xbf) {
        if (i + k >= s->n) return 0;
        unsigned d = span_at(s, i + k);
        if (d < lo || d > hi) return -k;
    }
    return want;
}

static const char replacement[3] = {(char)0xef, (char)0xbf, (char)0xbd}; /* U+FFFD */

int tmx_detok_push(const struct tmx_tokenizer *tok, struct tmx_detok *st, int32_t id, char *out,
                   size_t cap) {
    size_t len;
    const char *t = tmx_tokenizer_token_bytes(tok, id, &len);
    if (!t || cap < 3 * len + 12 || st->n_pending < 0 || st->n_pending > 3) return -1;
    struct span2 s = {st->pending, (const unsigned char *)t, (size_t)st->n_pending,
                      (size_t)st->n_pending + len};
    size_t i = 0, w = 0;
    while (i < s.n) {
        int k = utf8_seq(&s, i);
        if (k == 0) break;
        if (k < 0) {
            memcpy(out + w, replacement, 3);
            w += 3;
            i += (size_t)-k;
            continue;
        }
        for (int j = 0; j < k; j++) out[w++] = (char)span_at(&s, i + j);
        i += (size_t)k;
    }
    unsigned char held[4]; /* a cut-off sequence: at most 3 bytes */
    size_t n_held = s.n - i;
    for (size_t j = 0; j < n_held; j++) held[j] = (unsigned char)span_at(&s, i + j);
    memcpy(st->pending, held, n_held);
    st->n_pending = (int)n_held;
    return (int)w;
}

int tmx_detok_flush(struct tmx_detok *st, char *out, size_t cap) {
    if (st->n_pending == 0) return 0;
    if (cap < 3) return -1;
    st->n_pending = 0;
    memcpy(out, replacement, 3);
    return 3;
}

void tmx_tokenizer_free(struct tmx_tokenizer *tok) {
    if (!tok) return;
    for (int i = 0; i < tok->n_split; i++) pcre2_code_free(tok->split[i].re);
    free(tok->vocab.slot);
    free(tok->merges.slot);
    free(tok->added);
    free(tok->tok);
    free(tok->bytes);
    free(tok);
}
