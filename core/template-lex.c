/* template-lex.c: a template's text into tokens, with Jinja's whitespace rules as transformers
 * configures them.
 *
 * The source is first normalized as Jinja does: \r\n and \r become \n, and one trailing newline
 * is dropped. Text between tags becomes T_TEXT after whitespace control:
 *   {%- {{- {#-   strip all whitespace before the tag;
 *   -%} -}} -#}   strip all whitespace after it;
 *   lstrip_blocks  a {% or {# alone on its line after spaces drops those spaces ({%+ keeps them);
 *   trim_blocks    one newline right after %} or #} is dropped (+%} keeps it).
 * Comments vanish. Inside {{ }} and {% %} come names, literals and operators; a closing }} or %}
 * counts only when brackets are balanced, so {{ {'a': {'b': 1}} }} works. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

struct lexer {
    struct tmx_template *t;
    const char *s; /* normalized source, in the arena */
    size_t n, pos;
    int line;
    size_t line_start; /* offset of the current line's first byte */
    int line_starting; /* the last thing consumed ended a line (for lstrip_blocks) */
    struct token *toks;
    int n_toks, cap;
    char **err;
};

static enum tmx_status lex_fail(struct lexer *lx, size_t at, const char *what) {
    int line = 1;
    size_t start = 0;
    for (size_t i = 0; i < at && i < lx->n; i++)
        if (lx->s[i] == '\n') line++, start = i + 1;
    return tmx_err(lx->err, TMX_ERR_INVALID, "%s:%d:%d: %s", lx->t->name, line,
                   (int)(at - start) + 1, what);
}

/* Moves to offset to, keeping the line count. */
static void advance(struct lexer *lx, size_t to) {
    for (; lx->pos < to; lx->pos++)
        if (lx->s[lx->pos] == '\n') lx->line++, lx->line_start = lx->pos + 1;
}

static struct token *emit(struct lexer *lx, enum tok_kind kind, size_t at) {
    if (lx->n_toks == lx->cap) {
        int cap = lx->cap ? 2 * lx->cap : 256;
        struct token *p = realloc(lx->toks, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        lx->toks = p, lx->cap = cap;
    }
    struct token *tk = &lx->toks[lx->n_toks++];
    memset(tk, 0, sizeof *tk);
    tk->kind = kind;
    tk->at.line = lx->line;
    tk->at.col = (int)(at - lx->line_start) + 1;
    return tk;
}

/* Length of the Python whitespace character at s[at], or 0. */
static size_t space_at(const char *s, size_t n, size_t at) {
    size_t next = at;
    uint32_t cp = utf8_decode(s, n, &next);
    return py_isspace(cp) ? next - at : 0;
}

static size_t skip_space(const char *s, size_t n, size_t at) {
    for (size_t k; at < n && (k = space_at(s, n, at)) > 0;) at += k;
    return at;
}

/* The end of s[from..to) without its trailing whitespace (Python's str.rstrip()). */
static size_t rstrip_end(const char *s, size_t from, size_t to) {
    size_t end = to;
    while (end > from) {
        size_t start = end - 1;
        while (start > from && ((unsigned char)s[start] & 0xc0) == 0x80) start--;
        if (!space_at(s, end, start)) break;
        end = start;
    }
    return end;
}

/* --- literals --------------------------------------------------------------------------- */

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads k hex digits at s[at]; -1 if they are not there. */
static long read_hex(const char *s, size_t n, size_t at, int k) {
    long v = 0;
    for (int i = 0; i < k; i++) {
        int h = at + i < n ? hex_value(s[at + i]) : -1;
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

/* A quoted string at lx->pos, decoded with Python's unicode-escape rules (an unknown escape
 * keeps its backslash). */
static enum tmx_status lex_string(struct lexer *lx, struct token *tk) {
    const char *s = lx->s;
    char quote = s[lx->pos];
    size_t start = lx->pos, i = start + 1;
    struct sbuf b = {0};
    while (i < lx->n && s[i] != quote) {
        if (s[i] != '\\') {
            sb_putc(&b, s[i++]);
            continue;
        }
        if (i + 1 >= lx->n) break;
        char c = s[i + 1];
        const char *simple = strchr("\\'\"abfnrtv", c);
        if (c && simple) {
            static const char out[] = "\\'\"\a\b\f\n\r\t\v";
            sb_putc(&b, out[simple - "\\'\"abfnrtv"]);
            i += 2;
        } else if (c == '\n') {
            i += 2; /* a line continuation */
        } else if (c >= '0' && c <= '7') {
            uint32_t cp = 0;
            size_t k = i + 1;
            for (int d = 0; d < 3 && k < lx->n && s[k] >= '0' && s[k] <= '7'; d++, k++)
                cp = cp * 8 + (uint32_t)(s[k] - '0');
            utf8_put(&b, cp);
            i = k;
        } else if (c == 'x' || c == 'u' || c == 'U') {
            int k = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            long cp = read_hex(s, lx->n, i + 2, k);
            if (cp < 0 || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
                free(b.p);
                return lex_fail(lx, i, "bad escape in string literal");
            }
            utf8_put(&b, (uint32_t)cp);
            i += 2 + (size_t)k;
        } else {
            sb_putc(&b, '\\');
            i++;
        }
    }
    if (i >= lx->n) {
        free(b.p);
        return lex_fail(lx, start, "unterminated string literal");
    }
    tk->s = b.oom ? NULL : tpl_strndup(&lx->t->arena, b.p ? b.p : "", b.n);
    tk->n = b.n;
    free(b.p);
    if (!tk->s) return TMX_ERR_NOMEM;
    advance(lx, i + 1);
    return TMX_OK;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Digits with single underscores between them, from at; returns the end (at if none). */
static size_t digits(const char *s, size_t n, size_t at) {
    size_t i = at;
    while (i < n && is_digit(s[i])) {
        i++;
        if (i + 1 < n && s[i] == '_' && is_digit(s[i + 1])) i++;
    }
    return i;
}

/* An integer or float at lx->pos. A float needs a fraction or an exponent, and may not follow
 * a dot (so that a.0.1 is two item lookups). */
static enum tmx_status lex_number(struct lexer *lx, struct token *tk) {
    const char *s = lx->s;
    size_t start = lx->pos, end = digits(s, lx->n, start), e = end;
    int after_dot = start > 0 && s[start - 1] == '.';
    int is_float = 0;
    if (!after_dot) {
        if (e + 1 < lx->n && s[e] == '.' && is_digit(s[e + 1]))
            e = digits(s, lx->n, e + 1), is_float = 1;
        if (e < lx->n && (s[e] == 'e' || s[e] == 'E')) {
            size_t x = e + 1;
            if (x < lx->n && (s[x] == '+' || s[x] == '-')) x++;
            if (x < lx->n && is_digit(s[x])) e = digits(s, lx->n, x), is_float = 1;
        }
    }
    if (!is_float) e = end;
    char buf[64];
    size_t k = 0;
    if (e - start >= sizeof buf) return lex_fail(lx, start, "number literal too long");
    for (size_t i = start; i < e; i++)
        if (s[i] != '_') buf[k++] = s[i];
    buf[k] = 0;
    errno = 0;
    if (is_float) {
        tk->kind = T_FLOAT;
        tk->f = strtod(buf, NULL);
    } else {
        tk->kind = T_INT;
        tk->i = strtoll(buf, NULL, 10);
        if (errno == ERANGE) return lex_fail(lx, start, "integer literal out of range");
    }
    advance(lx, e);
    return TMX_OK;
}

static const struct {
    const char *text;
    enum tpl_op op;
} ops[] = { /* longest first */
    {"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {"<=", OP_LE},
    {">=", OP_GE},       {"+", OP_ADD},  {"-", OP_SUB}, {"*", OP_MUL}, {"/", OP_DIV},
    {"%", OP_MOD},       {"~", OP_TILDE}, {"<", OP_LT}, {">", OP_GT},  {"=", OP_ASSIGN},
    {"(", OP_LPAREN},    {")", OP_RPAREN}, {"[", OP_LBRACKET}, {"]", OP_RBRACKET},
    {"{", OP_LBRACE},    {"}", OP_RBRACE}, {",", OP_COMMA}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE},      {";", OP_SEMICOLON},
};

/* --- tags ------------------------------------------------------------------------------- */

static int starts(const struct lexer *lx, const char *w) {
    size_t k = strlen(w);
    return lx->n - lx->pos >= k && memcmp(lx->s + lx->pos, w, k) == 0;
}

/* The inside of {{ }} or {% %} (block says which), through its closing marker. */
static enum tmx_status lex_tag(struct lexer *lx, int block) {
    const char *s = lx->s;
    char open[TPL_MAX_NESTING];
    int depth = 0;
    size_t tag_start = lx->pos;
    for (;;) {
        if (lx->pos >= lx->n)
            return lex_fail(lx, tag_start, block ? "missing '%}'" : "missing '}}'");
        size_t at = lx->pos;
        if (depth == 0) {
            const char *end = block ? "%}" : "}}";
            int strip = starts(lx, block ? "-%}" : "-}}"), keep = block && starts(lx, "+%}");
            if (strip || keep || starts(lx, end)) {
                size_t to = at + 2 + (size_t)(strip || keep);
                if (strip) to = skip_space(s, lx->n, to);
                else if (block && !keep && to < lx->n && s[to] == '\n') to++; /* trim_blocks */
                if (!emit(lx, block ? T_BLOCK_END : T_PRINT_END, at)) return TMX_ERR_NOMEM;
                advance(lx, to);
                lx->line_starting = s[to - 1] == '\n';
                return TMX_OK;
            }
        }
        char c = s[at];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
            advance(lx, at + 1);
            continue;
        }
        struct token *tk = emit(lx, T_OP, at);
        if (!tk) return TMX_ERR_NOMEM;
        tk->s = s + at; /* operators keep their text, for messages */
        enum tmx_status st = TMX_OK;
        if (is_digit(c)) {
            st = lex_number(lx, tk);
        } else if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            size_t e = at + 1;
            while (e < lx->n && (s[e] == '_' || is_digit(s[e]) || (s[e] >= 'a' && s[e] <= 'z') ||
                                 (s[e] >= 'A' && s[e] <= 'Z')))
                e++;
            tk->kind = T_NAME, tk->s = s + at, tk->n = e - at;
            advance(lx, e);
        } else if (c == '\'' || c == '"') {
            tk->kind = T_STRING;
            st = lex_string(lx, tk);
        } else {
            size_t k = 0;
            while (k < sizeof ops / sizeof ops[0] && !starts(lx, ops[k].text)) k++;
            if (k == sizeof ops / sizeof ops[0]) return lex_fail(lx, at, "unexpected character");
            tk->op = ops[k].op, tk->n = strlen(ops[k].text);
            if (c == '(' || c == '[' || c == '{') {
                if (depth == TPL_MAX_NESTING) return lex_fail(lx, at, "brackets nested too deeply");
                open[depth++] = c == '(' ? ')' : c == '[' ? ']' : '}';
            } else if (c == ')' || c == ']' || c == '}') {
                if (depth == 0 || open[depth - 1] != c)
                    return lex_fail(lx, at, "unbalanced bracket");
                depth--;
            }
            advance(lx, at + strlen(ops[k].text));
        }
        if (st != TMX_OK) return st;
    }
}

/* A comment from lx->pos (just after {#, and its sign) through #}. */
static enum tmx_status lex_comment(struct lexer *lx, size_t open_at) {
    const char *s = lx->s;
    for (size_t i = lx->pos; i + 1 < lx->n; i++) {
        if (s[i] == '#' && s[i + 1] == '}') {
            int sign = i > lx->pos ? s[i - 1] : 0;
            size_t to = i + 2;
            if (sign == '-') to = skip_space(s, lx->n, to);
            else if (sign != '+' && to < lx->n && s[to] == '\n') to++;
            advance(lx, to);
            lx->line_starting = s[to - 1] == '\n';
            return TMX_OK;
        }
    }
    return lex_fail(lx, open_at, "missing '#}'");
}

/* Text from lx->pos up to the tag at `tag` whose sign (the character after its opener) is
 * sign; kind is '{', '%' or '#'. */
static enum tmx_status lex_text(struct lexer *lx, size_t tag, char kind, char sign) {
    const char *s = lx->s;
    size_t end = tag;
    if (sign == '-') {
        end = rstrip_end(s, lx->pos, tag);
    } else if (sign != '+' && kind != '{') {
        size_t nl = tag, l;
        while (nl > lx->pos && s[nl - 1] != '\n') nl--;
        l = nl;
        if ((l > lx->pos || lx->line_starting) && l < tag && skip_space(s, tag, l) == tag) end = l;
    }
    if (end > lx->pos) {
        struct token *tk = emit(lx, T_TEXT, lx->pos);
        if (!tk) return TMX_ERR_NOMEM;
        tk->s = s + lx->pos, tk->n = end - lx->pos;
    }
    advance(lx, tag);
    return TMX_OK;
}

/* Strict UTF-8: what the source may hold, since its strings become JSON strings. */
static size_t bad_utf8_at(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80             ? 1
                   : (c & 0xe0) == 0xc0 ? 2
                   : (c & 0xf0) == 0xe0 ? 3
                   : (c & 0xf8) == 0xf0 ? 4
                                        : 0;
        if (k == 0 || i + k > n) return i;
        uint32_t cp = k == 1 ? c : c & (0xffu >> (k + 1));
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return i;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
        i += k;
    }
    return n;
}

enum tmx_status tpl_lex(struct tmx_template *t, const char *src, size_t len, struct token **toks,
                        int *n_toks, char **err) {
    char *s = tpl_alloc(&t->arena, len + 1);
    if (!s) return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", t->name);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n > 0 && s[n - 1] == '\n') n--;

    struct lexer lx = {.t = t, .s = s, .n = n, .line = 1, .line_starting = 1, .err = err};
    size_t bad = bad_utf8_at((const unsigned char *)s, n);
    enum tmx_status st = bad < n ? lex_fail(&lx, bad, "invalid UTF-8") : TMX_OK;
    while (st == TMX_OK && lx.pos < n) {
        const char *tag = lx.s + lx.pos;
        for (;;) {
            tag = memchr(tag, '{', (size_t)(lx.s + n - tag));
            if (!tag || tag + 1 >= lx.s + n || tag[1] == '{' || tag[1] == '%' || tag[1] == '#')
                break;
            tag++;
        }
        size_t at = tag && tag + 1 < lx.s + n ? (size_t)(tag - lx.s) : n;
        char kind = at < n ? s[at + 1] : 0;
        char sign = at + 2 < n && (s[at + 2] == '-' || s[at + 2] == '+') ? s[at + 2] : 0;
        st = lex_text(&lx, at, kind, sign);
        if (st != TMX_OK || at == n) break;
        advance(&lx, at + 2 + (sign != 0));
        if (kind == '#') {
            st = lex_comment(&lx, at);
        } else if (!emit(&lx, kind == '%' ? T_BLOCK_BEGIN : T_PRINT_BEGIN, at)) {
            st = TMX_ERR_NOMEM;
        } else {
            st = lex_tag(&lx, kind == '%');
        }
    }
    if (st == TMX_OK && !emit(&lx, T_EOF, lx.pos)) st = TMX_ERR_NOMEM;
    if (st == TMX_ERR_NOMEM) tmx_err(err, st, "%s: out of memory", t->name);
    if (st != TMX_OK) {
        free(lx.toks);
        return st;
    }
    *toks = lx.toks;
    *n_toks = lx.n_toks;
    return TMX_OK;
}
