/* template-eval.c: runs the syntax tree against a context.
 *
 * Scopes follow Jinja: the top level, each macro call and each loop iteration have their own
 * frame; `set` writes to the innermost one (so a set inside a loop is gone after it, which is
 * why templates use namespace()); names are looked up frame by frame, then in the context,
 * then among the globals. A macro's frame sits directly on the top-level frame. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

enum flow { F_ERROR = -1, F_NEXT, F_BREAK, F_CONTINUE };

static int eval(struct render *r, struct frame *f, const struct expr *e, struct val *out);
static enum flow run_body(struct render *r, struct frame *f, const struct body *b,
                          struct sbuf *out);

int tpl_fail(struct render *r, const struct srcpos *at, const char *fmt, ...) {
    if (r->st != TMX_OK) return -1;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    for (char *c = msg; *c; c++) /* one line, even for raise_exception's text */
        if (*c == '\n' || *c == '\r') *c = ' ';
    r->st = tmx_err(&r->err, TMX_ERR_INVALID, "%s:%d:%d: %s", r->t->name, at->line, at->col, msg);
    return -1;
}

int tpl_oom(struct render *r) {
    if (r->st == TMX_OK)
        r->st = tmx_err(&r->err, TMX_ERR_NOMEM, "%s: out of memory, or a string over %u MiB",
                        r->t->name, TPL_MAX_STRING >> 20);
    return -1;
}

/* An undefined value used where a real one is needed. */
int tpl_undefined(struct render *r, const struct srcpos *at, const struct val *v) {
    if (v->name) return tpl_fail(r, at, "'%s' is undefined", v->name);
    return tpl_fail(r, at, "undefined value");
}

/* --- frames and namespaces -------------------------------------------------------------- */

static int vars_set(struct var **vars, int *n, int *cap, const char *name, struct val v) {
    for (int i = 0; i < *n; i++) {
        if (strcmp((*vars)[i].name, name) == 0) {
            val_drop(&(*vars)[i].v);
            (*vars)[i].v = v;
            return 0;
        }
    }
    if (*n == *cap) {
        int c = *cap ? 2 * *cap : 8;
        struct var *p = realloc(*vars, (size_t)c * sizeof *p);
        if (!p) return val_drop(&v), -1;
        *vars = p, *cap = c;
    }
    (*vars)[(*n)++] = (struct var){name, v};
    return 0;
}

/* Takes v. */
static int frame_set(struct render *r, struct frame *f, const char *name, struct val v) {
    return vars_set(&f->vars, &f->n, &f->cap, name, v) ? tpl_oom(r) : 0;
}

static void frame_clear(struct frame *f) {
    for (int i = 0; i < f->n; i++) val_drop(&f->vars[i].v);
    f->n = 0;
}

static void frame_free(struct frame *f) {
    frame_clear(f);
    free(f->vars);
}

struct ns *ns_new(struct render *r) {
    struct ns *ns = calloc(1, sizeof *ns);
    if (!ns) return tpl_oom(r), NULL;
    ns->next = r->namespaces;
    r->namespaces = ns;
    return ns;
}

/* Takes v; copies name. */
int ns_set(struct render *r, struct ns *ns, const char *name, struct val v) {
    for (int i = 0; i < ns->n; i++)
        if (strcmp(ns->vars[i].name, name) == 0)
            return vars_set(&ns->vars, &ns->n, &ns->cap, name, v) ? tpl_oom(r) : 0;
    char *copy = strdup(name);
    if (!copy || vars_set(&ns->vars, &ns->n, &ns->cap, copy, v)) {
        free(copy);
        return tpl_oom(r);
    }
    return 0;
}

static void ns_free_all(struct render *r) {
    for (struct ns *ns = r->namespaces, *next; ns; ns = next) {
        next = ns->next;
        for (int i = 0; i < ns->n; i++) val_drop(&ns->vars[i].v), free((char *)ns->vars[i].name);
        free(ns->vars);
        free(ns);
    }
}

static struct val lookup(struct render *r, struct frame *f, const char *name) {
    for (; f; f = f->parent)
        for (int i = f->n - 1; i >= 0; i--)
            if (strcmp(f->vars[i].name, name) == 0) return val_dup(&f->vars[i].v);
    json_t *j = json_object_get(r->context, name);
    if (j) return val_json(json_incref(j));
    enum tpl_fn fn;
    if (tpl_global_find(name, &fn)) return (struct val){.kind = V_FUNC, .fn = fn};
    return val_undef(name);
}

/* --- calls ------------------------------------------------------------------------------ */

static void argv_drop(struct argv *a) {
    for (int i = 0; i < a->n_pos; i++) val_drop(&a->pos[i]);
    for (int i = 0; i < a->n_kw; i++) val_drop(&a->kw[i]);
    free(a->pos);
    free(a->kw);
    *a = (struct argv){0};
}

static int eval_args(struct render *r, struct frame *f, const struct args *in, struct argv *out) {
    *out = (struct argv){.n_pos = in->n_pos, .n_kw = in->n_kw, .kw_names = in->kw_names};
    out->pos = calloc((size_t)in->n_pos + 1, sizeof *out->pos);
    out->kw = calloc((size_t)in->n_kw + 1, sizeof *out->kw);
    if (!out->pos || !out->kw) return argv_drop(out), tpl_oom(r);
    for (int i = 0; i < in->n_pos; i++)
        if (eval(r, f, in->pos[i], &out->pos[i])) return argv_drop(out), -1;
    for (int i = 0; i < in->n_kw; i++)
        if (eval(r, f, in->kw[i], &out->kw[i])) return argv_drop(out), -1;
    return 0;
}

static int call_macro(struct render *r, const struct srcpos *at, const struct stmt *m,
                      struct argv *a, struct val *out) {
    if (a->n_pos > m->n_names)
        return tpl_fail(r, at, "macro '%s' takes not more than %d argument(s)", m->name,
                        m->n_names);
    for (int k = 0; k < a->n_kw; k++) {
        int i = 0;
        while (i < m->n_names && strcmp(m->names[i], a->kw_names[k]) != 0) i++;
        if (i == m->n_names || i < a->n_pos)
            return tpl_fail(r, at, "macro '%s' got an unexpected or repeated argument '%s'",
                            m->name, a->kw_names[k]);
    }
    if (r->depth >= TPL_MAX_CALL_DEPTH) return tpl_fail(r, at, "macro calls nested too deeply");
    if (++r->steps > TPL_MAX_STEPS) return tpl_fail(r, at, "template runs too long");
    struct frame mf = {.parent = r->top};
    int rc = 0;
    for (int i = 0; i < m->n_names && rc == 0; i++) {
        struct val v = val_undef(m->names[i]);
        const struct val *given = argv_get(a, i, m->names[i]);
        if (given) v = val_dup(given);
        else if (m->defaults[i]) rc = eval(r, &mf, m->defaults[i], &v);
        if (rc == 0) rc = frame_set(r, &mf, m->names[i], v);
    }
    struct sbuf b = {0};
    r->depth++;
    if (rc == 0 && run_body(r, &mf, &m->body, &b) == F_ERROR) rc = -1;
    r->depth--;
    frame_free(&mf);
    if (rc) return free(b.p), -1;
    *out = val_json(str_from_sbuf(&b));
    return out->j ? 0 : tpl_oom(r);
}

static int call(struct render *r, const struct srcpos *at, const struct val *fn, struct argv *a,
                struct val *out) {
    if (fn->kind == V_MACRO) return call_macro(r, at, fn->macro, a, out);
    if (fn->kind == V_FUNC) return tpl_global(r, at, fn->fn, a, out);
    if (fn->kind == V_UNDEF) return tpl_undefined(r, at, fn);
    return tpl_fail(r, at, "'%s' object is not callable", val_type_name(fn));
}

/* f(args), where obj.name(args) is a method unless obj is a namespace. */
static int eval_call(struct render *r, struct frame *f, const struct expr *e, struct val *out) {
    struct val callee = val_undef(NULL), obj = val_undef(NULL);
    struct argv a;
    int rc;
    if (e->a->kind == X_ATTR) {
        if (eval(r, f, e->a->a, &obj)) return -1;
        if (obj.kind == V_NS) {
            tpl_getattr(&obj, e->a->name, &callee);
            if (callee.kind == V_UNDEF) callee.name = e->a->name; /* the template's: lives on */
        }
    } else if (eval(r, f, e->a, &callee)) {
        return -1;
    }
    rc = eval_args(r, f, &e->args, &a);
    if (rc == 0) {
        if (e->a->kind == X_ATTR && obj.kind != V_NS) {
            if (obj.kind == V_UNDEF) rc = tpl_undefined(r, &e->at, &obj);
            else rc = tpl_method(r, &e->at, &obj, e->a->name, &a, out);
        } else {
            rc = call(r, &e->at, &callee, &a, out);
        }
        argv_drop(&a);
    }
    val_drop(&callee);
    val_drop(&obj);
    return rc;
}

/* --- expressions ------------------------------------------------------------------------ */

static int eval_display(struct render *r, struct frame *f, const struct expr *e, struct val *out) {
    json_t *c = e->kind == X_DICT ? json_object() : json_array();
    if (!c) return tpl_oom(r);
    for (int i = 0; i < e->n; i++) {
        struct val k = val_undef(NULL), v;
        const struct expr *item = e->kind == X_DICT ? e->items[2 * i + 1] : e->items[i];
        if (e->kind == X_DICT && eval(r, f, e->items[2 * i], &k)) return json_decref(c), -1;
        if (e->kind == X_DICT && !val_is(&k, JSON_STRING)) {
            val_drop(&k), json_decref(c);
            return tpl_fail(r, &e->items[2 * i]->at, "dict keys must be strings");
        }
        if (eval(r, f, item, &v)) return val_drop(&k), json_decref(c), -1;
        json_t *j = val_to_json(&v);
        val_drop(&v);
        if (!j) {
            val_drop(&k), json_decref(c);
            return tpl_fail(r, &item->at, "a %s cannot be stored in a list or dict",
                            val_type_name(&v));
        }
        int bad = e->kind == X_DICT ? json_object_set_new(c, json_string_value(k.j), j)
                                    : json_array_append_new(c, j);
        val_drop(&k);
        if (bad) return json_decref(c), tpl_oom(r);
    }
    *out = val_json(c);
    return 0;
}

static int eval_compare(struct render *r, struct frame *f, const struct expr *e, struct val *out) {
    struct val a, b;
    int result = 1;
    if (eval(r, f, e->a, &a)) return -1;
    for (int i = 0; i < e->n && result; i++) {
        if (eval(r, f, e->items[i], &b)) return val_drop(&a), -1;
        int rc = tpl_compare(r, &e->items[i]->at, e->ops[i], &a, &b, &result);
        val_drop(&a);
        a = b;
        if (rc) return val_drop(&a), -1;
    }
    val_drop(&a);
    *out = val_json(json_boolean(result));
    return 0;
}

static int eval_filter(struct render *r, struct frame *f, const struct expr *e, struct val *out) {
    struct val a;
    struct argv args;
    if (eval(r, f, e->a, &a)) return -1;
    if (eval_args(r, f, &e->args, &args)) return val_drop(&a), -1;
    int rc;
    if (e->kind == X_FILTER) {
        rc = tpl_filter(r, &e->at, e->name, &a, &args, out);
    } else {
        int result = 0;
        rc = tpl_test(r, &e->at, e->name, &a, &args, &result);
        if (rc == 0) *out = val_json(json_boolean(result != e->negated));
    }
    argv_drop(&args);
    val_drop(&a);
    return rc;
}

static int eval(struct render *r, struct frame *f, const struct expr *e, struct val *out) {
    struct val a, b;
    int rc = 0;
    *out = val_undef(NULL);
    switch (e->kind) {
    case X_CONST: *out = val_json(json_incref(e->value)); return 0;
    case X_NAME: *out = lookup(r, f, e->name); return 0;
    case X_LIST: case X_DICT: return eval_display(r, f, e, out);
    case X_ATTR:
        if (eval(r, f, e->a, &a)) return -1;
        tpl_getattr(&a, e->name, out);
        if (out->kind == V_UNDEF) out->name = e->name; /* the template's: lives on */
        val_drop(&a);
        return 0;
    case X_ITEM:
        if (eval(r, f, e->a, &a)) return -1;
        if (eval(r, f, e->b, &b)) return val_drop(&a), -1;
        rc = tpl_getitem(r, &a, &b, out);
        val_drop(&a), val_drop(&b);
        return rc;
    case X_SLICE: {
        struct val bound[3] = {val_undef(NULL), val_undef(NULL), val_undef(NULL)};
        const struct expr *parts[3] = {e->b, e->c, e->d};
        const struct val *bp[3] = {&bound[0], &bound[1], &bound[2]};
        if (eval(r, f, e->a, &a)) return -1;
        for (int k = 0; k < 3 && rc == 0; k++)
            if (parts[k]) rc = eval(r, f, parts[k], &bound[k]);
        if (rc == 0) rc = tpl_slice(r, &e->at, &a, bp, out);
        for (int k = 0; k < 3; k++) val_drop(&bound[k]);
        val_drop(&a);
        return rc;
    }
    case X_CALL: return eval_call(r, f, e, out);
    case X_FILTER: case X_TEST: return eval_filter(r, f, e, out);
    case X_NOT:
        if (eval(r, f, e->a, &a)) return -1;
        *out = val_json(json_boolean(!val_truthy(&a)));
        val_drop(&a);
        return 0;
    case X_NEG: case X_POS:
        if (eval(r, f, e->a, &a)) return -1;
        rc = tpl_unary(r, &e->at, e->kind == X_NEG, &a, out);
        val_drop(&a);
        return rc;
    case X_BINARY:
        if (eval(r, f, e->a, &a)) return -1;
        if (eval(r, f, e->b, &b)) return val_drop(&a), -1;
        if (e->op == OP_TILDE) {
            struct sbuf s = {0};
            val_str(&s, &a), val_str(&s, &b);
            *out = val_json(str_from_sbuf(&s));
            rc = out->j ? 0 : tpl_oom(r);
        } else {
            rc = tpl_arith(r, &e->at, e->op, &a, &b, out);
        }
        val_drop(&a), val_drop(&b);
        return rc;
    case X_AND: case X_OR: /* the deciding operand is the value, as in Python */
        if (eval(r, f, e->a, &a)) return -1;
        if (val_truthy(&a) == (e->kind == X_OR)) return *out = a, 0;
        val_drop(&a);
        return eval(r, f, e->b, out);
    case X_COMPARE: return eval_compare(r, f, e, out);
    case X_COND:
        if (eval(r, f, e->a, &a)) return -1;
        rc = val_truthy(&a);
        val_drop(&a);
        if (rc) return eval(r, f, e->b, out);
        return e->c ? eval(r, f, e->c, out) : 0;
    }
    return tpl_fail(r, &e->at, "unknown expression");
}

/* --- statements ------------------------------------------------------------------------- */

/* Binds the targets of a for or set: one name takes the value, several unpack a list. */
static int bind(struct render *r, struct frame *f, const struct stmt *s, const struct val *v) {
    if (s->n_names == 1) return frame_set(r, f, s->names[0], val_dup(v));
    if (!val_is(v, JSON_ARRAY) || json_array_size(v->j) != (size_t)s->n_names)
        return tpl_fail(r, &s->at, "cannot unpack %s into %d names", val_type_name(v), s->n_names);
    for (int i = 0; i < s->n_names; i++)
        if (frame_set(r, f, s->names[i], val_json(json_incref(json_array_get(v->j, (size_t)i)))))
            return -1;
    return 0;
}

/* What a loop or a filter walks: a list's items, a dict's keys, a string's characters;
 * nothing for undefined. A new list, or NULL (failed, with the error set). */
json_t *tpl_items(struct render *r, const struct srcpos *at, const char *what,
                  const struct val *v) {
    json_t *items = NULL;
    if (v->kind == V_UNDEF) items = json_array();
    else if (val_is(v, JSON_ARRAY)) items = json_incref(v->j);
    else if (val_is(v, JSON_OBJECT)) items = dict_list(v->j, 0);
    else if (val_is(v, JSON_STRING)) items = str_chars(v->j);
    else return tpl_fail(r, at, "%s: '%s' object is not iterable", what, val_type_name(v)), NULL;
    return items ? items : (tpl_oom(r), NULL);
}

static json_t *loop_object(json_t *items, size_t i) {
    size_t n = json_array_size(items);
    json_t *loop = json_object();
    if (!loop) return NULL;
    json_object_set_new(loop, "index", json_integer((json_int_t)i + 1));
    json_object_set_new(loop, "index0", json_integer((json_int_t)i));
    json_object_set_new(loop, "revindex", json_integer((json_int_t)(n - i)));
    json_object_set_new(loop, "revindex0", json_integer((json_int_t)(n - i - 1)));
    json_object_set_new(loop, "first", json_boolean(i == 0));
    json_object_set_new(loop, "last", json_boolean(i + 1 == n));
    json_object_set_new(loop, "length", json_integer((json_int_t)n));
    json_object_set_new(loop, "depth", json_integer(1));
    json_object_set_new(loop, "depth0", json_integer(0));
    if (i > 0) json_object_set(loop, "previtem", json_array_get(items, i - 1));
    if (i + 1 < n) json_object_set(loop, "nextitem", json_array_get(items, i + 1));
    size_t want = 9 + (i > 0) + (i + 1 < n);
    return json_object_size(loop) == want ? loop : (json_decref(loop), NULL);
}

static enum flow run_for(struct render *r, struct frame *f, const struct stmt *s,
                         struct sbuf *out) {
    struct val it;
    if (eval(r, f, s->value, &it)) return F_ERROR;
    json_t *items = tpl_items(r, &s->value->at, "for", &it);
    val_drop(&it);
    if (!items) return F_ERROR;
    struct frame lf = {.parent = f};
    enum flow fl = F_NEXT;
    if (s->cond) { /* `for x in xs if c`: the loop sees only the items that pass */
        json_t *kept = json_array();
        for (size_t i = 0; kept && i < json_array_size(items) && fl == F_NEXT; i++) {
            struct val item = val_json(json_incref(json_array_get(items, i))), c = val_undef(NULL);
            frame_clear(&lf);
            if (bind(r, &lf, s, &item) || eval(r, &lf, s->cond, &c)) fl = F_ERROR;
            else if (val_truthy(&c) && json_array_append(kept, item.j)) fl = F_ERROR, tpl_oom(r);
            val_drop(&c);
            val_drop(&item);
        }
        json_decref(items);
        if (!kept) fl = F_ERROR, tpl_oom(r);
        items = kept;
    }
    size_t n = items ? json_array_size(items) : 0;
    for (size_t i = 0; i < n && fl != F_ERROR; i++) {
        if (++r->steps > TPL_MAX_STEPS) {
            fl = F_ERROR, tpl_fail(r, &s->at, "template runs too long");
            break;
        }
        struct val item = val_json(json_incref(json_array_get(items, i)));
        frame_clear(&lf);
        if (bind(r, &lf, s, &item)) {
            fl = F_ERROR;
        } else {
            json_t *loop = loop_object(items, i);
            if (!loop) fl = F_ERROR, tpl_oom(r);
            else if (frame_set(r, &lf, "loop", val_json(loop))) fl = F_ERROR;
            else fl = run_body(r, &lf, &s->body, out);
        }
        val_drop(&item);
        if (fl == F_BREAK) break;
        if (fl == F_CONTINUE) fl = F_NEXT;
    }
    frame_free(&lf);
    json_decref(items);
    if (fl == F_ERROR) return F_ERROR;
    return n == 0 ? run_body(r, f, &s->other, out) : F_NEXT;
}

static enum flow run_set(struct render *r, struct frame *f, const struct stmt *s) {
    struct val v;
    if (s->kind == S_SET_BLOCK) {
        struct frame bf = {.parent = f};
        struct sbuf b = {0};
        enum flow fl = run_body(r, &bf, &s->body, &b);
        frame_free(&bf);
        if (fl == F_ERROR) return free(b.p), F_ERROR;
        v = val_json(str_from_sbuf(&b));
        if (!v.j) return tpl_oom(r), F_ERROR;
        for (const struct expr *e = s->filters; e; e = e->a) {
            struct argv args;
            struct val next;
            if (eval_args(r, f, &e->args, &args)) return val_drop(&v), F_ERROR;
            int rc = tpl_filter(r, &e->at, e->name, &v, &args, &next);
            argv_drop(&args);
            val_drop(&v);
            if (rc) return F_ERROR;
            v = next;
        }
        return frame_set(r, f, s->names[0], v) ? F_ERROR : F_NEXT;
    }
    if (eval(r, f, s->value, &v)) return F_ERROR;
    if (!s->attr) {
        int rc = bind(r, f, s, &v);
        val_drop(&v);
        return rc ? F_ERROR : F_NEXT;
    }
    struct val ns = lookup(r, f, s->names[0]);
    int rc = ns.kind == V_NS
                 ? ns_set(r, ns.ns, s->attr, v)
                 : (val_drop(&v),
                    tpl_fail(r, &s->at, "cannot assign attribute on non-namespace object"));
    val_drop(&ns);
    return rc ? F_ERROR : F_NEXT;
}

static enum flow run_body(struct render *r, struct frame *f, const struct body *b,
                          struct sbuf *out) {
    for (int i = 0; i < b->n; i++) {
        const struct stmt *s = b->v[i];
        enum flow fl = F_NEXT;
        struct val v;
        switch (s->kind) {
        case S_TEXT: sb_put(out, s->text, s->n_text); break;
        case S_PRINT:
            if (eval(r, f, s->value, &v)) return F_ERROR;
            val_str(out, &v);
            val_drop(&v);
            break;
        case S_IF:
            if (eval(r, f, s->cond, &v)) return F_ERROR;
            fl = run_body(r, f, val_truthy(&v) ? &s->body : &s->other, out);
            val_drop(&v);
            break;
        case S_FOR: fl = run_for(r, f, s, out); break;
        case S_SET: case S_SET_BLOCK: fl = run_set(r, f, s); break;
        case S_MACRO:
            if (frame_set(r, f, s->name, (struct val){.kind = V_MACRO, .macro = s})) return F_ERROR;
            break;
        case S_BREAK: return F_BREAK;
        case S_CONTINUE: return F_CONTINUE;
        }
        if (fl != F_NEXT) return fl;
        if (out->oom) return tpl_fail(r, &s->at, "output too long or out of memory"), F_ERROR;
    }
    return F_NEXT;
}

enum tmx_status tmx_template_render(const struct tmx_template *t, const json_t *context,
                                    const struct tm *now, char **out, size_t *len, char **err) {
    if (!json_is_object(context))
        return tmx_err(err, TMX_ERR_INVALID, "%s: the render context must be a JSON object",
                       t->name);
    struct render r = {.t = t, .context = context};
    if (now) {
        r.now = *now;
    } else {
        time_t clock = time(NULL);
        localtime_r(&clock, &r.now);
    }
    struct frame top = {0};
    struct sbuf b = {0};
    r.top = &top;
    enum flow fl = run_body(&r, &top, &t->root, &b);
    frame_free(&top);
    ns_free_all(&r);
    if (fl == F_ERROR || r.st != TMX_OK) {
        free(b.p);
        if (err) *err = r.err;
        else free(r.err);
        return r.st != TMX_OK ? r.st : TMX_ERR_INVALID;
    }
    if (len) *len = b.n;
    *out = b.p ? b.p : strdup("");
    return *out ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", t->name);
}
