/* text.c: byte buffers, the streaming UTF-8 repair and stop-string search (text.h). */
#include "text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- buffers ------------------------------------------------------------------------------- */

static int buf_reserve(struct buf *b, size_t extra) {
    if (b->oom) return 0;
    if (b->n + extra + 1 <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

void buf_add(struct buf *b, const void *p, size_t n) {
    if (n == 0 || !buf_reserve(b, n)) return;
    memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}

void buf_adds(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

void buf_addf(struct buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int need = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (need <= 0 || !buf_reserve(b, (size_t)need)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)need + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)need;
}

void buf_clear(struct buf *b) {
    b->n = 0;
    if (b->p) b->p[0] = 0;
}

void buf_free(struct buf *b) {
    free(b->p);
    *b = (struct buf){0};
}

/* --- UTF-8 repair -------------------------------------------------------------------------- */

static const char replacement[] = "\xEF\xBF\xBD"; /* U+FFFD */

void utf8_push(struct utf8_dec *d, const char *in, size_t n, struct buf *out) {
    const unsigned char *s = (const unsigned char *)in;
    size_t run = 0; /* start of the current run of ASCII/complete bytes copied as a block */
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = s[i];
        if (d->n == 0) {
            if (c < 0x80) continue; /* stays in the run */
            buf_add(out, s + run, i - run);
            run = i + 1;
            d->need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
                    : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
            if (d->need == 0) buf_add(out, replacement, 3);
            else d->pend[d->n++] = c;
            continue;
        }
        /* the second byte's range depends on the lead byte: no overlongs, surrogates or
         * code points above U+10FFFF */
        unsigned char lo = 0x80, hi = 0xBF;
        if (d->n == 1) {
            if (d->pend[0] == 0xE0) lo = 0xA0;
            else if (d->pend[0] == 0xED) hi = 0x9F;
            else if (d->pend[0] == 0xF0) lo = 0x90;
            else if (d->pend[0] == 0xF4) hi = 0x8F;
        }
        if (c < lo || c > hi) { /* the held sequence is broken; c starts afresh */
            buf_add(out, replacement, 3);
            d->n = 0;
            run = i;
            i--;
            continue;
        }
        d->pend[d->n++] = c;
        run = i + 1;
        if (d->n == d->need) {
            buf_add(out, d->pend, (size_t)d->n);
            d->n = 0;
        }
    }
    if (d->n == 0) buf_add(out, s + run, n - run);
}

void utf8_flush(struct utf8_dec *d, struct buf *out) {
    if (d->n) buf_add(out, replacement, 3);
    d->n = 0;
}

/* --- stop strings -------------------------------------------------------------------------- */

size_t text_find_any(const char *text, size_t n, size_t from, char *const *strs, int n_strs) {
    size_t best = SIZE_MAX;
    for (int i = 0; i < n_strs; i++) {
        const size_t len = strlen(strs[i]);
        if (len == 0 || from >= n) continue;
        const char *hit = memmem(text + from, n - from, strs[i], len);
        if (hit && (size_t)(hit - text) < best) best = (size_t)(hit - text);
    }
    return best;
}

size_t text_partial_suffix(const char *text, size_t n, char *const *strs, int n_strs) {
    size_t best = 0;
    for (int i = 0; i < n_strs; i++) {
        const size_t len = strlen(strs[i]);
        if (len == 0) continue;
        for (size_t k = len - 1 < n ? len - 1 : n; k > best; k--)
            if (memcmp(text + n - k, strs[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

int stops_init(struct stops *s, char *const *strs, int n) {
    *s = (struct stops){.strs = strs};
    s->len = calloc((size_t)(n ? n : 1), sizeof *s->len);
    s->border = calloc((size_t)(n ? n : 1), sizeof *s->border);
    if (!s->len || !s->border) return 0;
    for (int i = 0; i < n; i++) {
        const char *p = strs[i];
        const size_t len = strlen(p);
        size_t *b = malloc(len * sizeof *b);
        if (!b) return 0;
        s->len[i] = len;
        s->border[i] = b;
        s->n = i + 1;
        b[0] = 0;
        for (size_t k = 1, q = 0; k < len; k++) {
            while (q > 0 && p[k] != p[q]) q = b[q - 1];
            if (p[k] == p[q]) q++;
            b[k] = q;
        }
    }
    return 1;
}

void stops_free(struct stops *s) {
    for (int i = 0; i < s->n; i++) free(s->border[i]);
    free(s->border);
    free(s->len);
    *s = (struct stops){0};
}

size_t stops_feed(const struct stops *s, struct stops_scan *scan, const char *text, size_t n) {
    size_t first = SIZE_MAX;
    for (int i = 0; i < s->n; i++) {
        const char *p = s->strs[i];
        const size_t len = s->len[i], *b = s->border[i];
        size_t q = scan->state[i];
        for (size_t at = scan->read; at < n; at++) {
            while (q > 0 && text[at] != p[q]) q = b[q - 1];
            if (text[at] == p[q]) q++;
            if (q == len) { /* a whole match ends at `at` */
                if (at + 1 - len < first) first = at + 1 - len;
                q = b[len - 1];
            }
        }
        scan->state[i] = q;
    }
    scan->read = n;
    return first;
}

size_t stops_pending(const struct stops *s, const struct stops_scan *scan) {
    size_t most = 0;
    for (int i = 0; i < s->n; i++) most = scan->state[i] > most ? scan->state[i] : most;
    return most;
}
