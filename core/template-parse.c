/* template-parse.c: tokens into the syntax tree, by recursive descent with Jinja's grammar and
 * precedence (loosest first):
 *   a if b else c  ·  or  ·  and  ·  not  ·  == != < <= > >= in, not in  ·  + -  ·  ~
 *   ·  * / // %  ·  ** (left-associative, as in Jinja)  ·  unary - +  ·  . [] ()
 *   ·  | filter and `is` test (these bind to the primary: "a" + b|tojson filters b only).
 * Every node and string lives in the template's arena. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

struct parser {
    struct tmx_template *t;
    const struct token *tk; /* the current token */
    int depth;              /* nesting of expressions */
    int loops;              /* enclosing for loops (for break / continue) */
    int blocks;             /* enclosing bodies: 1 at the top level, where macros go */
    enum tmx_status st;
    char **err;
};

/* Growable array of pointers, copied into the arena when complete. */
struct vec {
    void **v;
    int n, cap;
};

static void *p_fail(struct parser *p, const struct srcpos *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void *p_fail(struct parser *p, const struct srcpos *at, const char *fmt, ...) {
    if (p->st != TMX_OK) return NULL;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->st = tmx_err(p->err, TMX_ERR_INVALID, "%s:%d:%d: %s", p->t->name, at->line, at->col, msg);
    return NULL;
}

static void *p_oom(struct parser *p) {
    if (p->st == TMX_OK) p->st = tmx_err(p->err, TMX_ERR_NOMEM, "%s: out of memory", p->t->name);
    return NULL;
}

static void *p_new(struct parser *p, size_t size) {
    void *q = tpl_alloc(&p->t->arena, size);
    return q ? q : p_oom(p);
}

static int vec_push(struct parser *p, struct vec *v, void *item) {
    if (v->n == v->cap) {
        int cap = v->cap ? 2 * v->cap : 8;
        void **q = realloc(v->v, (size_t)cap * sizeof *q);
        if (!q) return p_oom(p), -1;
        v->v = q, v->cap = cap;
    }
    v->v[v->n++] = item;
    return 0;
}

/* Moves v into the arena; returns the array (NULL when empty or out of memory). */
static void *vec_finish(struct parser *p, struct vec *v) {
    void **out = NULL;
    if (v->n > 0 && (out = p_new(p, (size_t)v->n * sizeof *out)))
        memcpy(out, v->v, (size_t)v->n * sizeof *out);
    free(v->v);
    v->v = NULL;
    return out;
}

/* --- tokens ----------------------------------------------------------------------------- */

static int is_op(const struct parser *p, enum tpl_op op) {
    return p->tk->kind == T_OP && p->tk->op == op;
}

static int is_name(const struct parser *p, const char *name) {
    return p->tk->kind == T_NAME && p->tk->n == strlen(name) &&
           memcmp(p->tk->s, name, p->tk->n) == 0;
}

static int skip_op(struct parser *p, enum tpl_op op) {
    if (!is_op(p, op)) return 0;
    p->tk++;
    return 1;
}

static int skip_name(struct parser *p, const char *name) {
    if (!is_name(p, name)) return 0;
    p->tk++;
    return 1;
}

/* A token for messages: its text for names and operators, its kind otherwise. */
static const char *describe(const struct token *tk, char buf[48]) {
    switch (tk->kind) {
    case T_EOF: return "end of template";
    case T_TEXT: return "text";
    case T_PRINT_BEGIN: return "'{{'";
    case T_PRINT_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_STRING: return "string";
    case T_INT: case T_FLOAT: return "number";
    case T_NAME: case T_OP: break;
    }
    snprintf(buf, 48, "'%.*s'", tk->n < 40 ? (int)tk->n : 40, tk->s ? tk->s : "");
    return buf;
}

static int expect_op(struct parser *p, enum tpl_op op, const char *text) {
    if (skip_op(p, op)) return 0;
    char buf[48];
    p_fail(p, &p->tk->at, "expected '%s', got %s", text, describe(p->tk, buf));
    return -1;
}

static int expect_kind(struct parser *p, enum tok_kind kind) {
    if (p->tk->kind == kind) {
        p->tk++;
        return 0;
    }
    struct token want = {.kind = kind};
    char buf[48], buf2[48];
    p_fail(p, &p->tk->at, "expected %s, got %s", describe(&want, buf2), describe(p->tk, buf));
    return -1;
}

static const char *expect_ident(struct parser *p) {
    char buf[48];
    if (p->tk->kind != T_NAME)
        return p_fail(p, &p->tk->at, "expected a name, got %s", describe(p->tk, buf));
    const char *s = tpl_strndup(&p->t->arena, p->tk->s, p->tk->n);
    if (!s) return p_oom(p);
    p->tk++;
    return s;
}

/* --- expressions ------------------------------------------------------------------------ */

static struct expr *parse_expr(struct parser *p);
static struct expr *parse_or(struct parser *p);
static struct expr *parse_unary(struct parser *p, int with_filters);

static struct expr *new_expr(struct parser *p, enum expr_kind kind, const struct srcpos *at) {
    struct expr *e = p_new(p, sizeof *e);
    if (e) e->kind = kind, e->at = *at;
    return e;
}

static struct expr *new_const(struct parser *p, const struct srcpos *at, json_t *value) {
    struct tmx_template *t = p->t;
    if (!value) return p_oom(p);
    if (t->n_consts == t->cap_consts) {
        int cap = t->cap_consts ? 2 * t->cap_consts : 32;
        json_t **q = realloc(t->consts, (size_t)cap * sizeof *q);
        if (!q) return json_decref(value), p_oom(p);
        t->consts = q, t->cap_consts = cap;
    }
    t->consts[t->n_consts++] = value;
    struct expr *e = new_expr(p, X_CONST, at);
    if (e) e->value = value;
    return e;
}

static struct expr *binary(struct parser *p, enum expr_kind kind, enum tpl_op op,
                           const struct srcpos *at, struct expr *a, struct expr *b) {
    if (!a || !b) return NULL;
    struct expr *e = new_expr(p, kind, at);
    if (e) e->op = op, e->a = a, e->b = b;
    return e;
}

/* One more level of nesting in the tree being built. The evaluator recurses along the tree,
 * so its depth is bounded here, left-leaning chains (a + b + c, a.b.c, a|f|g) included. */
static int nest(struct parser *p, const struct srcpos *at) {
    if (++p->depth <= TPL_MAX_NESTING) return 0;
    p_fail(p, at, "expression nested too deeply");
    return -1;
}

/* (args): expressions and name=expr pairs. The '(' is current. */
static int parse_call_args(struct parser *p, struct args *out) {
    struct vec pos = {0}, names = {0}, kw = {0};
    int rc = 0;
    p->tk++;
    while (rc == 0 && !is_op(p, OP_RPAREN)) {
        if ((pos.n || kw.n) && expect_op(p, OP_COMMA, ",")) rc = -1;
        else if (is_op(p, OP_RPAREN)) break; /* trailing comma */
        else if (is_op(p, OP_MUL) || is_op(p, OP_POW))
            rc = (p_fail(p, &p->tk->at, "*args and **kwargs are not supported"), -1);
        else if (p->tk->kind == T_NAME && p->tk[1].kind == T_OP && p->tk[1].op == OP_ASSIGN) {
            const char *name = expect_ident(p);
            p->tk++;
            struct expr *value = name ? parse_expr(p) : NULL;
            rc = !value || vec_push(p, &names, (void *)name) || vec_push(p, &kw, value) ? -1 : 0;
        } else {
            struct expr *value = parse_expr(p);
            rc = !value || vec_push(p, &pos, value) ? -1 : 0;
        }
    }
    if (rc == 0) rc = expect_op(p, OP_RPAREN, ")");
    out->n_pos = pos.n, out->n_kw = kw.n;
    out->pos = vec_finish(p, &pos);
    out->kw_names = vec_finish(p, &names);
    out->kw = vec_finish(p, &kw);
    return rc || p->st != TMX_OK ? -1 : 0;
}

/* [a:b:c] or [a]: the '[' is past. */
static struct expr *parse_subscript(struct parser *p, struct expr *obj, const struct srcpos *at) {
    struct expr *parts[3] = {0};
    int n_colons = 0;
    for (;;) {
        if (!is_op(p, OP_COLON) && !is_op(p, OP_RBRACKET)) {
            if (!(parts[n_colons] = parse_expr(p))) return NULL;
        }
        if (n_colons < 2 && skip_op(p, OP_COLON)) n_colons++;
        else break;
    }
    if (expect_op(p, OP_RBRACKET, "]")) return NULL;
    if (n_colons == 0 && !parts[0]) return p_fail(p, at, "empty subscript");
    struct expr *e = new_expr(p, n_colons ? X_SLICE : X_ITEM, at);
    if (e) e->a = obj, e->b = parts[0], e->c = parts[1], e->d = parts[2];
    return e;
}

static struct expr *parse_postfix(struct parser *p, struct expr *e) {
    int depth = p->depth;
    while (e) {
        struct srcpos at = p->tk->at;
        if ((is_op(p, OP_DOT) || is_op(p, OP_LBRACKET) || is_op(p, OP_LPAREN)) && nest(p, &at))
            return NULL;
        if (skip_op(p, OP_DOT)) {
            if (p->tk->kind == T_INT) { /* a.0 is a[0] */
                struct expr *index = new_const(p, &p->tk->at, json_integer(p->tk->i));
                p->tk++;
                e = binary(p, X_ITEM, 0, &at, e, index);
            } else {
                const char *name = expect_ident(p);
                struct expr *attr = name ? new_expr(p, X_ATTR, &at) : NULL;
                if (attr) attr->a = e, attr->name = name;
                e = attr;
            }
        } else if (skip_op(p, OP_LBRACKET)) {
            e = parse_subscript(p, e, &at);
        } else if (is_op(p, OP_LPAREN)) { /* a call is placed where its callee starts */
            struct expr *call = new_expr(p, X_CALL, &e->at);
            if (call) call->a = e;
            e = call && parse_call_args(p, &call->args) == 0 ? call : NULL;
        } else {
            break;
        }
    }
    p->depth = depth;
    return e;
}

/* Filter or test name, dotted names allowed. */
static const char *parse_dotted(struct parser *p) {
    const char *name = expect_ident(p);
    while (name && is_op(p, OP_DOT)) {
        p->tk++;
        const char *more = expect_ident(p);
        if (!more) return NULL;
        size_t a = strlen(name), b = strlen(more);
        char *joined = p_new(p, a + b + 2);
        if (!joined) return NULL;
        memcpy(joined, name, a), joined[a] = '.', memcpy(joined + a + 1, more, b + 1);
        name = joined;
    }
    return name;
}

static struct expr *parse_primary(struct parser *p);

/* `| name(args)` and `is [not] name args` after an operand, any number of times. */
static struct expr *parse_filters(struct parser *p, struct expr *e) {
    int depth = p->depth;
    while (e) {
        struct srcpos at = p->tk->at;
        if ((is_op(p, OP_PIPE) || is_name(p, "is") || is_op(p, OP_LPAREN)) && nest(p, &at))
            return NULL;
        if (skip_op(p, OP_PIPE)) {
            struct expr *f = new_expr(p, X_FILTER, &at);
            if (!f || !(f->name = parse_dotted(p))) return NULL;
            f->a = e;
            if (is_op(p, OP_LPAREN) && parse_call_args(p, &f->args)) return NULL;
            e = f;
        } else if (skip_name(p, "is")) {
            struct expr *t = new_expr(p, X_TEST, &at);
            if (!t) return NULL;
            t->a = e;
            t->negated = skip_name(p, "not");
            if (!(t->name = parse_dotted(p))) return NULL;
            enum tok_kind k = p->tk->kind;
            if (is_op(p, OP_LPAREN)) {
                if (parse_call_args(p, &t->args)) return NULL;
            } else if ((k == T_NAME && !is_name(p, "else") && !is_name(p, "or") &&
                        !is_name(p, "and") && !is_name(p, "is")) ||
                       k == T_STRING || k == T_INT || k == T_FLOAT || is_op(p, OP_LBRACKET) ||
                       is_op(p, OP_LBRACE)) {
                struct expr *arg = parse_postfix(p, parse_primary(p));
                struct expr **pos = arg ? p_new(p, sizeof *pos) : NULL;
                if (!pos) return NULL;
                pos[0] = arg, t->args.pos = pos, t->args.n_pos = 1;
            }
            e = t;
        } else if (is_op(p, OP_LPAREN)) {
            struct expr *call = new_expr(p, X_CALL, &e->at);
            if (call) call->a = e;
            e = call && parse_call_args(p, &call->args) == 0 ? call : NULL;
        } else {
            break;
        }
    }
    p->depth = depth;
    return e;
}

/* ( ... ): a parenthesized expression, or a tuple (built as a list). '(' is past. */
static struct expr *parse_paren(struct parser *p, const struct srcpos *at) {
    struct vec items = {0};
    int tuple = 0;
    while (!is_op(p, OP_RPAREN)) {
        if (items.n) {
            if (expect_op(p, OP_COMMA, ",")) break;
            tuple = 1;
            if (is_op(p, OP_RPAREN)) break;
        }
        struct expr *e = parse_expr(p);
        if (!e || vec_push(p, &items, e)) break;
    }
    if (p->st != TMX_OK || expect_op(p, OP_RPAREN, ")")) return free(items.v), NULL;
    if (items.n == 1 && !tuple) {
        struct expr *e = items.v[0];
        free(items.v);
        return e;
    }
    struct expr *e = new_expr(p, X_LIST, at);
    if (!e) return free(items.v), NULL;
    e->n = items.n;
    e->items = vec_finish(p, &items);
    return p->st == TMX_OK ? e : NULL;
}

/* [a, b] or {k: v, ...}: the opening bracket is past. */
static struct expr *parse_display(struct parser *p, const struct srcpos *at, int dict) {
    struct vec items = {0};
    enum tpl_op close = dict ? OP_RBRACE : OP_RBRACKET;
    while (!is_op(p, close)) {
        if (items.n && (expect_op(p, OP_COMMA, ",") || is_op(p, close))) break;
        struct expr *e = parse_expr(p);
        if (!e || vec_push(p, &items, e)) break;
        if (dict) {
            if (expect_op(p, OP_COLON, ":")) break;
            if (!(e = parse_expr(p)) || vec_push(p, &items, e)) break;
        }
    }
    if (p->st != TMX_OK || expect_op(p, close, dict ? "}" : "]")) return free(items.v), NULL;
    struct expr *e = new_expr(p, dict ? X_DICT : X_LIST, at);
    if (!e) return free(items.v), NULL;
    e->n = dict ? items.n / 2 : items.n;
    e->items = vec_finish(p, &items);
    return p->st == TMX_OK ? e : NULL;
}

static struct expr *parse_primary(struct parser *p) {
    const struct token *tk = p->tk;
    struct srcpos at = tk->at;
    switch (tk->kind) {
    case T_NAME: {
        p->tk++;
        static const char *const consts[] = {"true", "True", "false", "False", "none", "None"};
        for (int i = 0; i < 6; i++) {
            if (tk->n == strlen(consts[i]) && memcmp(tk->s, consts[i], tk->n) == 0)
                return new_const(p, &at, i < 2 ? json_true() : i < 4 ? json_false() : json_null());
        }
        struct expr *e = new_expr(p, X_NAME, &at);
        if (e && !(e->name = tpl_strndup(&p->t->arena, tk->s, tk->n))) return p_oom(p);
        return e;
    }
    case T_STRING: {
        /* adjacent literals join, as in Python */
        struct sbuf b = {0};
        for (; p->tk->kind == T_STRING; p->tk++) sb_put(&b, p->tk->s, p->tk->n);
        json_t *s = b.oom ? NULL : str_new(b.p ? b.p : "", b.n);
        free(b.p);
        return new_const(p, &at, s);
    }
    case T_INT: p->tk++; return new_const(p, &at, json_integer(tk->i));
    case T_FLOAT: p->tk++; return new_const(p, &at, json_real(tk->f));
    case T_OP:
        if (skip_op(p, OP_LPAREN)) return parse_paren(p, &at);
        if (skip_op(p, OP_LBRACKET)) return parse_display(p, &at, 0);
        if (skip_op(p, OP_LBRACE)) return parse_display(p, &at, 1);
        break;
    default: break;
    }
    char buf[48];
    return p_fail(p, &at, "unexpected %s", describe(tk, buf));
}

static struct expr *parse_unary(struct parser *p, int with_filters) {
    struct srcpos at = p->tk->at;
    if (nest(p, &at)) return NULL;
    struct expr *e;
    if (is_op(p, OP_SUB) || is_op(p, OP_ADD)) {
        enum expr_kind kind = is_op(p, OP_SUB) ? X_NEG : X_POS;
        p->tk++;
        struct expr *a = parse_unary(p, 0);
        e = a ? new_expr(p, kind, &at) : NULL;
        if (e) e->a = a;
    } else {
        e = parse_primary(p);
    }
    e = parse_postfix(p, e);
    if (with_filters) e = parse_filters(p, e);
    p->depth--;
    return e;
}

static struct expr *parse_pow(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_unary(p, 1);
    while (e && is_op(p, OP_POW)) {
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_BINARY, OP_POW, &at, e, parse_unary(p, 1));
    }
    p->depth = depth;
    return e;
}

static struct expr *parse_math2(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_pow(p);
    while (e &&
           (is_op(p, OP_MUL) || is_op(p, OP_DIV) || is_op(p, OP_FLOORDIV) || is_op(p, OP_MOD))) {
        enum tpl_op op = p->tk->op;
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_BINARY, op, &at, e, parse_pow(p));
    }
    p->depth = depth;
    return e;
}

static struct expr *parse_concat(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_math2(p);
    while (e && is_op(p, OP_TILDE)) {
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_BINARY, OP_TILDE, &at, e, parse_math2(p));
    }
    p->depth = depth;
    return e;
}

static struct expr *parse_math1(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_concat(p);
    while (e && (is_op(p, OP_ADD) || is_op(p, OP_SUB))) {
        enum tpl_op op = p->tk->op;
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_BINARY, op, &at, e, parse_concat(p));
    }
    p->depth = depth;
    return e;
}

static struct expr *parse_compare(struct parser *p) {
    struct srcpos at = p->tk->at;
    struct expr *first = parse_math1(p);
    struct vec operands = {0};
    enum tpl_op ops[64];
    int n = 0;
    while (first) {
        enum tpl_op op;
        if (p->tk->kind == T_OP && p->tk->op >= OP_EQ && p->tk->op <= OP_GE)
            op = p->tk->op, p->tk++;
        else if (skip_name(p, "in")) op = OP_IN;
        else if (is_name(p, "not") && p->tk[1].kind == T_NAME && p->tk[1].n == 2 &&
                 memcmp(p->tk[1].s, "in", 2) == 0)
            op = OP_NOTIN, p->tk += 2;
        else break;
        if (n == 64) return free(operands.v), p_fail(p, &at, "comparison chain too long");
        struct expr *b = parse_math1(p);
        if (!b || vec_push(p, &operands, b)) return free(operands.v), NULL;
        ops[n++] = op;
    }
    if (!first || n == 0) return free(operands.v), first;
    struct expr *e = new_expr(p, X_COMPARE, &at);
    if (!e) return free(operands.v), NULL;
    e->a = first, e->n = n;
    e->items = vec_finish(p, &operands);
    if ((e->ops = p_new(p, (size_t)n * sizeof *e->ops)))
        memcpy(e->ops, ops, (size_t)n * sizeof *ops);
    return p->st == TMX_OK ? e : NULL;
}

static struct expr *parse_not(struct parser *p) {
    struct srcpos at = p->tk->at;
    if (!skip_name(p, "not")) return parse_compare(p);
    if (nest(p, &at)) return NULL;
    struct expr *a = parse_not(p);
    p->depth--;
    struct expr *e = a ? new_expr(p, X_NOT, &at) : NULL;
    if (e) e->a = a;
    return e;
}

static struct expr *parse_and(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_not(p);
    while (e && is_name(p, "and")) {
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_AND, 0, &at, e, parse_not(p));
    }
    p->depth = depth;
    return e;
}

static struct expr *parse_or(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_and(p);
    while (e && is_name(p, "or")) {
        struct srcpos at = p->tk++->at;
        e = nest(p, &at) ? NULL : binary(p, X_OR, 0, &at, e, parse_and(p));
    }
    p->depth = depth;
    return e;
}

/* a if cond else b; without else the value is undefined when cond is false. */
static struct expr *parse_expr(struct parser *p) {
    int depth = p->depth;
    struct expr *e = parse_or(p);
    while (e && is_name(p, "if")) {
        struct srcpos at = p->tk++->at;
        struct expr *cond = parse_or(p), *other = NULL;
        if (cond && skip_name(p, "else") && (nest(p, &at) || !(other = parse_expr(p)))) return NULL;
        struct expr *c = cond ? new_expr(p, X_COND, &at) : NULL;
        if (c) c->a = cond, c->b = e, c->c = other;
        e = c;
    }
    p->depth = depth;
    return e;
}

/* What {{ }} holds: an expression, or a bare tuple a, b. */
static struct expr *parse_tuple(struct parser *p) {
    struct srcpos at = p->tk->at;
    struct expr *e = parse_expr(p);
    if (!e || !is_op(p, OP_COMMA)) return e;
    struct vec items = {0};
    if (vec_push(p, &items, e)) return NULL;
    while (skip_op(p, OP_COMMA) && p->tk->kind != T_PRINT_END && p->tk->kind != T_BLOCK_END) {
        if (!(e = parse_expr(p)) || vec_push(p, &items, e)) return free(items.v), NULL;
    }
    struct expr *list = new_expr(p, X_LIST, &at);
    if (!list) return free(items.v), NULL;
    list->n = items.n;
    list->items = vec_finish(p, &items);
    return list;
}

/* --- statements ------------------------------------------------------------------------- */

static int parse_body(struct parser *p, struct body *out, const char *const *ends, int n_ends);

static struct stmt *new_stmt(struct parser *p, enum stmt_kind kind, const struct srcpos *at) {
    struct stmt *s = p_new(p, sizeof *s);
    if (s) s->kind = kind, s->at = *at;
    return s;
}

/* Names for `for` and `set` targets: a or a, b or (a, b). */
static int parse_targets(struct parser *p, struct stmt *s) {
    struct vec names = {0};
    int paren = skip_op(p, OP_LPAREN);
    do {
        if (paren && is_op(p, OP_RPAREN)) break;
        const char *name = expect_ident(p);
        if (!name || vec_push(p, &names, (void *)name)) return free(names.v), -1;
    } while (skip_op(p, OP_COMMA));
    if (paren && expect_op(p, OP_RPAREN, ")")) return free(names.v), -1;
    s->n_names = names.n;
    s->names = vec_finish(p, &names);
    return p->st == TMX_OK ? 0 : -1;
}

static struct stmt *parse_if(struct parser *p, const struct srcpos *at) {
    static const char *const ends[] = {"elif", "else", "endif"};
    struct stmt *s = new_stmt(p, S_IF, at);
    if (!s || !(s->cond = parse_or(p)) || expect_kind(p, T_BLOCK_END)) return NULL;
    int end = parse_body(p, &s->body, ends, 3);
    if (end == 0) { /* elif: an if nested in else */
        struct srcpos elif_at = p->tk[-1].at;
        if (++p->blocks > TPL_MAX_NESTING) return p_fail(p, &elif_at, "blocks nested too deeply");
        struct stmt *nested = parse_if(p, &elif_at);
        p->blocks--;
        struct stmt **v = nested ? p_new(p, sizeof *v) : NULL;
        if (!v) return NULL;
        v[0] = nested, s->other.v = v, s->other.n = 1;
        return s;
    }
    if (end == 1 && (expect_kind(p, T_BLOCK_END) || parse_body(p, &s->other, ends + 2, 1) < 0))
        return NULL;
    return end >= 0 && expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
}

static struct stmt *parse_for(struct parser *p, const struct srcpos *at) {
    static const char *const ends[] = {"else", "endfor"};
    struct stmt *s = new_stmt(p, S_FOR, at);
    if (!s || parse_targets(p, s)) return NULL;
    if (!skip_name(p, "in")) return p_fail(p, &p->tk->at, "expected 'in'");
    if (!(s->value = parse_or(p))) return NULL;
    if (skip_name(p, "if") && !(s->cond = parse_expr(p))) return NULL;
    if (is_name(p, "recursive")) return p_fail(p, &p->tk->at, "recursive loops are not supported");
    if (expect_kind(p, T_BLOCK_END)) return NULL;
    p->loops++;
    int end = parse_body(p, &s->body, ends, 2);
    p->loops--;
    if (end == 0 && (expect_kind(p, T_BLOCK_END) || parse_body(p, &s->other, ends + 1, 1) < 0))
        return NULL;
    return end >= 0 && expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
}

static struct stmt *parse_set(struct parser *p, const struct srcpos *at) {
    static const char *const ends[] = {"endset"};
    struct stmt *s = new_stmt(p, S_SET, at);
    if (!s || parse_targets(p, s)) return NULL;
    if (s->n_names == 1 && skip_op(p, OP_DOT) && !(s->attr = expect_ident(p))) return NULL;
    if (skip_op(p, OP_ASSIGN)) {
        if (!(s->value = parse_tuple(p))) return NULL;
        return expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
    }
    if (s->n_names != 1 || s->attr) return p_fail(p, &p->tk->at, "expected '='");
    s->kind = S_SET_BLOCK;
    struct expr **tail = &s->filters;
    while (is_op(p, OP_PIPE)) { /* {% set x | f | g %}: filters over the body, in order */
        struct srcpos fat = p->tk++->at;
        struct expr *f = new_expr(p, X_FILTER, &fat);
        if (!f || !(f->name = parse_dotted(p))) return NULL;
        if (is_op(p, OP_LPAREN) && parse_call_args(p, &f->args)) return NULL;
        *tail = f, tail = &f->a;
    }
    if (expect_kind(p, T_BLOCK_END) || parse_body(p, &s->body, ends, 1) < 0) return NULL;
    return expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
}

static struct stmt *parse_macro(struct parser *p, const struct srcpos *at) {
    static const char *const ends[] = {"endmacro"};
    struct stmt *s = new_stmt(p, S_MACRO, at);
    if (!s || !(s->name = expect_ident(p)) || expect_op(p, OP_LPAREN, "(")) return NULL;
    struct vec names = {0}, defaults = {0};
    while (!is_op(p, OP_RPAREN) && p->st == TMX_OK) {
        if (names.n && expect_op(p, OP_COMMA, ",")) break;
        const char *name = expect_ident(p);
        struct expr *def = NULL;
        if (name && skip_op(p, OP_ASSIGN)) def = parse_expr(p);
        if (p->st == TMX_OK) vec_push(p, &names, (void *)name), vec_push(p, &defaults, def);
    }
    s->n_names = names.n;
    s->names = vec_finish(p, &names);
    s->defaults = vec_finish(p, &defaults);
    if (p->st != TMX_OK || expect_op(p, OP_RPAREN, ")") || expect_kind(p, T_BLOCK_END)) return NULL;
    if (parse_body(p, &s->body, ends, 1) < 0) return NULL;
    return expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
}

/* One {% ... %} statement; the keyword is current. NULL with p->st OK: nothing to add. */
static struct stmt *parse_block(struct parser *p, struct vec *stmts) {
    struct srcpos at = p->tk->at;
    if (skip_name(p, "if")) return parse_if(p, &at);
    if (skip_name(p, "for")) return parse_for(p, &at);
    if (skip_name(p, "set")) return parse_set(p, &at);
    if (skip_name(p, "macro")) {
        if (p->blocks > 1) return p_fail(p, &at, "macros must be defined at the top level");
        return parse_macro(p, &at);
    }
    if (is_name(p, "break") || is_name(p, "continue")) {
        int brk = is_name(p, "break");
        p->tk++;
        if (!p->loops) return p_fail(p, &at, "'%s' outside a loop", brk ? "break" : "continue");
        struct stmt *s = new_stmt(p, brk ? S_BREAK : S_CONTINUE, &at);
        return s && expect_kind(p, T_BLOCK_END) == 0 ? s : NULL;
    }
    if (skip_name(p, "generation")) { /* transformers' assistant-mask marker: renders its body */
        static const char *const ends[] = {"endgeneration"};
        struct body body = {0};
        if (expect_kind(p, T_BLOCK_END) || parse_body(p, &body, ends, 1) < 0 ||
            expect_kind(p, T_BLOCK_END))
            return NULL;
        for (int i = 0; i < body.n; i++)
            if (vec_push(p, stmts, body.v[i])) return NULL;
        return NULL;
    }
    if (p->tk->kind == T_NAME)
        return p_fail(p, &at, "unknown or unexpected tag '%.*s'", (int)p->tk->n, p->tk->s);
    return p_fail(p, &at, "expected a tag name");
}

/* Statements until one of ends[] (returned as its index, the keyword consumed) or, with no
 * ends, the end of the template (returns n_ends). -1 on error. */
static int parse_body(struct parser *p, struct body *out, const char *const *ends, int n_ends) {
    struct vec stmts = {0};
    int found = -1;
    struct srcpos open_at = p->tk->at;
    if (++p->blocks > TPL_MAX_NESTING) return p_fail(p, &open_at, "blocks nested too deeply"), -1;
    while (p->st == TMX_OK) {
        const struct token *tk = p->tk;
        struct stmt *s = NULL;
        if (tk->kind == T_EOF) {
            if (n_ends == 0) found = 0;
            else p_fail(p, &tk->at, "unexpected end of template, expected '%s'", ends[n_ends - 1]);
            break;
        } else if (tk->kind == T_TEXT) {
            if ((s = new_stmt(p, S_TEXT, &tk->at))) s->text = tk->s, s->n_text = tk->n;
            p->tk++;
        } else if (tk->kind == T_PRINT_BEGIN) {
            p->tk++;
            if ((s = new_stmt(p, S_PRINT, &tk->at)) && (s->value = parse_tuple(p)))
                expect_kind(p, T_PRINT_END);
        } else if (tk->kind == T_BLOCK_BEGIN) {
            p->tk++;
            for (int i = 0; i < n_ends && found < 0; i++)
                if (is_name(p, ends[i])) found = i;
            if (found >= 0) {
                p->tk++;
                break;
            }
            s = parse_block(p, &stmts);
        } else {
            char buf[48];
            p_fail(p, &tk->at, "unexpected %s", describe(tk, buf));
        }
        if (s && p->st == TMX_OK) vec_push(p, &stmts, s);
    }
    p->blocks--;
    out->n = stmts.n;
    out->v = vec_finish(p, &stmts);
    return p->st == TMX_OK ? (n_ends == 0 ? 0 : found) : -1;
}

enum tmx_status tpl_parse(struct tmx_template *t, const struct token *toks, char **err) {
    struct parser p = {.t = t, .tk = toks, .err = err};
    parse_body(&p, &t->root, NULL, 0);
    return p.st;
}

enum tmx_status tmx_template_parse(const char *src, size_t len, const char *name,
                                   struct tmx_template **out, char **err) {
    struct tmx_template *t = calloc(1, sizeof *t);
    if (!t || !(t->name = strdup(name ? name : "template"))) {
        free(t);
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", name ? name : "template");
    }
    struct token *toks = NULL;
    int n_toks = 0;
    enum tmx_status st = tpl_lex(t, src, len, &toks, &n_toks, err);
    if (st == TMX_OK) st = tpl_parse(t, toks, err);
    free(toks);
    if (st != TMX_OK) {
        tmx_template_free(t);
        return st;
    }
    *out = t;
    return TMX_OK;
}

void tmx_template_free(struct tmx_template *t) {
    if (!t) return;
    for (int i = 0; i < t->n_consts; i++) json_decref(t->consts[i]);
    free(t->consts);
    tpl_arena_free(&t->arena);
    free(t->name);
    free(t);
}
