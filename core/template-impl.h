/* template-impl.h: the chat-template interpreter's internals, shared by its files:
 *   template-lex.c     source text -> tokens (whitespace control, trim/lstrip_blocks)
 *   template-parse.c   tokens -> syntax tree
 *   template-value.c   values and Python's rules for them (truth, equality, order, str, repr)
 *   template-json.c    Python's json.dumps and float repr
 *   template-eval.c    statements, expressions and scopes
 *   template-ops.c     operators: . [] slices, arithmetic, comparison, membership
 *   template-filter.c  filters
 *   template-test.c    tests (`x is defined`)
 *   template-method.c  string and dict methods, global functions
 *   template-load.c    finding a model's chat template */
#ifndef TMX_TEMPLATE_IMPL_H
#define TMX_TEMPLATE_IMPL_H

#include <jansson.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "tmx/status.h"
#include "tmx/template.h"

/* Guards against inputs that would exhaust the stack or memory: Jinja's sandbox caps range()
 * the same way; the rest bound what a hostile template or request can ask for. */
#define TPL_MAX_NESTING 100        /* parser: nested expressions, nested blocks */
#define TPL_MAX_CALL_DEPTH 64      /* evaluator: nested macro calls */
#define TPL_MAX_RANGE 100000       /* items of one range() */
#define TPL_MAX_STEPS 1000000      /* loop iterations and macro calls in one render */
#define TPL_MAX_STRING (64u << 20) /* bytes of one string, and of the output */

/* --- memory ----------------------------------------------------------------------------- */

/* Bump allocator for everything a parsed template owns; freed at once. */
struct tpl_chunk;
struct tpl_arena {
    struct tpl_chunk *head;
};

/* Growable byte string. A failed allocation, or growth past TPL_MAX_STRING, sets oom; later
 * appends then do nothing. */
struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
};

/* --- tokens ----------------------------------------------------------------------------- */

enum tok_kind {
    T_EOF,
    T_TEXT,        /* template data between tags: s, n */
    T_PRINT_BEGIN, /* {{ */
    T_PRINT_END,   /* }} */
    T_BLOCK_BEGIN, /* {% */
    T_BLOCK_END,   /* %} */
    T_NAME,        /* s, n */
    T_STRING,      /* s, n: escapes decoded */
    T_INT,         /* i */
    T_FLOAT,       /* f */
    T_OP,          /* op */
};

enum tpl_op {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_TILDE,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN,
    OP_ASSIGN, OP_LPAREN, OP_RPAREN, OP_LBRACKET, OP_RBRACKET, OP_LBRACE, OP_RBRACE,
    OP_COMMA, OP_DOT, OP_COLON, OP_PIPE, OP_SEMICOLON,
};

struct srcpos {
    int line, col; /* 1-based; col counts bytes */
};

struct token {
    enum tok_kind kind;
    struct srcpos at;
    const char *s; /* T_TEXT, T_NAME, T_STRING: into the template's arena or source */
    size_t n;
    int64_t i;
    double f;
    enum tpl_op op;
};

/* --- syntax tree ------------------------------------------------------------------------ */

enum expr_kind {
    X_CONST,   /* value */
    X_NAME,    /* name */
    X_LIST,    /* items: [n] (tuples too) */
    X_DICT,    /* items: [2n] key, value, key, value... */
    X_ATTR,    /* a.name */
    X_ITEM,    /* a[b] */
    X_SLICE,   /* a[b:c:d], each of b, c, d optional */
    X_CALL,    /* a(args) */
    X_FILTER,  /* a | name(args) */
    X_TEST,    /* a is [not] name(args) */
    X_NOT,     /* not a */
    X_NEG,     /* -a */
    X_POS,     /* +a */
    X_BINARY,  /* a op b: arithmetic and ~ */
    X_AND,     /* a and b */
    X_OR,      /* a or b */
    X_COMPARE, /* a op b [op c ...]: chained as in Python */
    X_COND,    /* b if a else c (c optional) */
};

struct expr;

struct args {
    struct expr **pos; /* [n_pos] */
    int n_pos;
    const char **kw_names; /* [n_kw] */
    struct expr **kw;      /* [n_kw] */
    int n_kw;
};

struct expr {
    struct srcpos at;
    enum expr_kind kind;
    enum tpl_op op;    /* X_BINARY */
    int negated;       /* X_TEST */
    const char *name;  /* X_NAME, X_ATTR, X_FILTER, X_TEST */
    json_t *value;     /* X_CONST: owned by the template */
    struct expr *a, *b, *c, *d;
    struct expr **items; /* X_LIST, X_DICT; X_COMPARE: the operands after a */
    enum tpl_op *ops;    /* X_COMPARE: [n] */
    int n;
    struct args args; /* X_CALL, X_FILTER, X_TEST */
};

enum stmt_kind {
    S_TEXT,     /* text, n_text */
    S_PRINT,    /* {{ value }} */
    S_IF,       /* if cond: body else other (elif nests in other) */
    S_FOR,      /* for names in value [if cond]: body else other */
    S_SET,      /* set names = value, or set names[0].attr = value */
    S_SET_BLOCK,/* set names[0] [| filters]: body endset */
    S_MACRO,    /* macro name(names = defaults): body */
    S_BREAK,
    S_CONTINUE,
};

struct body {
    struct stmt **v; /* [n] */
    int n;
};

struct stmt {
    struct srcpos at;
    enum stmt_kind kind;
    const char *text; /* S_TEXT */
    size_t n_text;
    struct expr *value, *cond;
    const char **names; /* [n_names]: targets, or macro parameters */
    int n_names;
    const char *attr;        /* S_SET on a namespace attribute */
    const char *name;        /* S_MACRO */
    struct expr **defaults;  /* S_MACRO: [n_names], NULL where a parameter has none */
    struct expr *filters;    /* S_SET_BLOCK: X_FILTERs to apply in order, linked by a */
    struct body body, other;
};

struct tmx_template {
    char *name;
    struct tpl_arena arena;
    struct body root;
    json_t **consts; /* [n_consts] every X_CONST value, to release */
    int n_consts, cap_consts;
};

/* --- values ----------------------------------------------------------------------------- */

enum val_kind {
    V_UNDEF, /* undefined; name: what was looked up (for messages), or NULL */
    V_JSON,  /* none, bool, int, float, str, list, dict: j holds one reference */
    V_NS,    /* namespace(): ns, owned by the render */
    V_MACRO, /* macro: stmt */
    V_FUNC,  /* global function: fn */
};

enum tpl_fn { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME_NOW };

struct ns;

struct val {
    enum val_kind kind;
    json_t *j;                /* V_JSON */
    struct ns *ns;            /* V_NS */
    const struct stmt *macro; /* V_MACRO: its S_MACRO statement */
    enum tpl_fn fn;           /* V_FUNC */
    const char *name;         /* V_UNDEF: the name looked up, or NULL */
};

struct var {
    const char *name;
    struct val v;
};

/* A namespace's attributes; names are owned. */
struct ns {
    struct ns *next;  /* the render's list of namespaces */
    struct var *vars; /* [n] */
    int n, cap;
    int printing;     /* inside its own text: a namespace that holds itself prints once */
};

/* One scope: a macro call, a loop iteration, or the template's top level (parent NULL). */
struct frame {
    struct frame *parent;
    struct var *vars; /* [n]: names point into the template */
    int n, cap;
};

/* Arguments after evaluation. */
struct argv {
    struct val *pos; /* [n_pos] */
    int n_pos;
    const char **kw_names;
    struct val *kw; /* [n_kw] */
    int n_kw;
};

/* One render in progress. */
struct render {
    const struct tmx_template *t;
    const json_t *context;
    struct tm now;
    struct frame *top; /* the template-level frame */
    struct ns *namespaces;
    int depth;  /* macro calls in progress */
    long steps; /* loop iterations and macro calls so far */
    enum tmx_status st;
    char *err;
};

#pragma GCC visibility push(hidden)

void *tpl_alloc(struct tpl_arena *a, size_t n); /* zeroed; NULL when out of memory */
char *tpl_strndup(struct tpl_arena *a, const char *s, size_t n);
void tpl_arena_free(struct tpl_arena *a);

void sb_put(struct sbuf *b, const char *s, size_t n);
void sb_puts(struct sbuf *b, const char *s);
void sb_putc(struct sbuf *b, char c);
void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Lexer: the whole template at once. *toks is malloc'd, [*n_toks] ending with T_EOF. */
enum tmx_status tpl_lex(struct tmx_template *t, const char *src, size_t len, struct token **toks,
                        int *n_toks, char **err);
/* Parser: fills t->root. */
enum tmx_status tpl_parse(struct tmx_template *t, const struct token *toks, char **err);

/* Errors: the first one wins; later ones (raised while unwinding) are dropped. Return -1. */
int tpl_fail(struct render *r, const struct srcpos *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int tpl_oom(struct render *r);

/* Values. A struct val returned through an out parameter belongs to the caller (val_drop). */
struct val val_undef(const char *name);
struct val val_json(json_t *j); /* takes the reference; NULL (allocation failed) stays NULL */
struct val val_dup(const struct val *v);
void val_drop(struct val *v);
int val_is(const struct val *v, json_type type); /* v may be NULL (a missing argument) */
int val_truthy(const struct val *v);
const char *val_type_name(const struct val *v);
int val_is_number(const struct val *v); /* int, float or bool */
double val_number(const struct val *v);
/* Python's str(v) and repr(v), appended to b. */
void val_str(struct sbuf *b, const struct val *v);
void val_repr(struct sbuf *b, const struct val *v);
/* Python ==; and <, returning -1 when the two cannot be ordered. */
int val_eq(const struct val *a, const struct val *b);
int json_eq(const json_t *a, const json_t *b);
int val_less(const struct val *a, const struct val *b, int *less);
/* A value as a JSON value to store in a list or dict: undefined becomes null, and what JSON
 * cannot hold (a namespace, a macro) is NULL. Returns a new reference. */
json_t *val_to_json(const struct val *v);

/* Python string helpers over UTF-8. */
json_t *str_new(const char *s, size_t n); /* copies; s must be valid UTF-8 */
json_t *str_from_sbuf(struct sbuf *b);    /* frees b's buffer; NULL if b ran out of memory */
size_t utf8_count(const char *s, size_t n);
size_t utf8_advance(const char *s, size_t n, size_t at, size_t k); /* byte offset k chars on */
uint32_t utf8_decode(const char *s, size_t n, size_t *at);          /* advances *at */
void utf8_put(struct sbuf *b, uint32_t cp);
int py_isspace(uint32_t cp);

/* Python's json.dumps(v, ensure_ascii=, indent=, separators=, sort_keys=): indent NULL is
 * None, else the text of one level; item_sep / key_sep NULL are the defaults for that indent. */
struct dump_opts {
    const char *indent;
    const char *item_sep, *key_sep;
    int sort_keys, ensure_ascii;
};
void json_dump_py(struct sbuf *b, const json_t *v, const struct dump_opts *o);
void float_repr(struct sbuf *b, double x);

/* Evaluator entry points used by filters and methods. */
struct ns *ns_new(struct render *r); /* owned by the render */
int ns_set(struct render *r, struct ns *ns, const char *name, struct val v); /* takes v */
/* An undefined value used where a real one is needed: fails with its name. */
int tpl_undefined(struct render *r, const struct srcpos *at, const struct val *v);

/* Operators (template-ops.c). obj.name is a dict key or a namespace attribute, obj[key] an
 * item; both are undefined when missing, with no name (the caller may give it one that lives as
 * long as the value). bound[3] are a slice's start, stop and step. */
void tpl_getattr(const struct val *obj, const char *name, struct val *out);
int tpl_getitem(struct render *r, const struct val *obj, const struct val *key, struct val *out);
int tpl_slice(struct render *r, const struct srcpos *at, const struct val *obj,
              const struct val *bound[3], struct val *out);
int tpl_unary(struct render *r, const struct srcpos *at, int negate, const struct val *a,
              struct val *out); /* -a, +a */
int tpl_arith(struct render *r, const struct srcpos *at, enum tpl_op op, const struct val *a,
              const struct val *b, struct val *out); /* + - * / // % ** */
int tpl_compare(struct render *r, const struct srcpos *at, enum tpl_op op, const struct val *a,
                const struct val *b, int *result); /* == != < <= > >= in, not in */

/* Filters and tests by name: a is the operand (borrowed), args evaluated. */
int tpl_filter(struct render *r, const struct srcpos *at, const char *name, const struct val *a,
               struct argv *args, struct val *out);
int tpl_test(struct render *r, const struct srcpos *at, const char *name, const struct val *a,
             struct argv *args, int *result);
/* obj.name(args) for str, dict and list values; global functions. */
int tpl_method(struct render *r, const struct srcpos *at, const struct val *obj,
               const char *name, struct argv *args, struct val *out);
int tpl_global(struct render *r, const struct srcpos *at, enum tpl_fn fn, struct argv *args,
               struct val *out);
int tpl_global_find(const char *name, enum tpl_fn *fn);
/* The argument called name, or at position pos; NULL when not given. */
const struct val *argv_get(const struct argv *a, int pos, const char *name);
/* Fails unless every argument is one the callee knows ([n] names, in positional order). */
int argv_check(struct render *r, const struct srcpos *at, const char *callee,
               const struct argv *a, const char *const *names, int n);

/* Python str methods shared by filters and methods; results are new references or NULL. */
json_t *str_strip(const json_t *s, const json_t *chars, int left, int right);
json_t *str_replace(const json_t *s, const json_t *old, const json_t *rep, int64_t count);
json_t *str_case(const json_t *s, int mode); /* see template-method.c */
json_t *str_splitlines(const char *s, size_t n);
json_t *str_chars(const json_t *s); /* one string per code point */
/* A dict's keys (which 0), values (1) or [key, value] pairs (2), as a new list. */
json_t *dict_list(const json_t *d, int which);
/* What loops and filters iterate: list items, dict keys, characters; undefined is empty. */
json_t *tpl_items(struct render *r, const struct srcpos *at, const char *what, const struct val *v);

#pragma GCC visibility pop

#endif
