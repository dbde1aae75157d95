/* harmony.c: reading gpt-oss output, which the model writes as harmony messages (text.h).
 *
 * A message is `<|start|>ROLE HEADER<|message|>BODY` ended by <|end|>, <|return|> (the turn is
 * over) or <|call|> (a tool call waits for its answer). The prompt ends with `<|start|>assistant`,
 * so the output's first message begins right at its header. The header holds a channel
 * (`<|channel|>analysis`), maybe a recipient (`to=functions.NAME`, before or after the channel)
 * and a content type (`<|constrain|>json` or a bare `json`), in that grammar's loose order:
 *
 *   <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>hi
 *   <|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>
 *   <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>
 *
 * The analysis channel is reasoning; final and commentary (a preamble to calls) are content; a
 * message to functions.NAME is a call. The parser reads the output as it grows and consumes each
 * byte once: a tail that may still become a control token waits for the next read, and a header
 * is held whole until its <|message|>. What turns out not to be a header (cut by another control
 * token or the output's end, or too long for one) becomes content as the model wrote it: the
 * server must not invent structure the model did not write. */
#include <stdlib.h>
#include <string.h>

#include "text.h"

/* The control tokens, as the tokenizer spells them; text.c's searches take {0}-ended lists. */
enum { TOK_START, TOK_CHANNEL, TOK_CONSTRAIN, TOK_MESSAGE, TOK_END, TOK_RETURN, TOK_CALL, N_TOK };
static char *const tokens[] = {"<|start|>", "<|channel|>", "<|constrain|>", "<|message|>",
                               "<|end|>", "<|return|>", "<|call|>", NULL};

/* Longer than any header a model writes (role, recipient, channel, content type): past it the
 * text is content, so that a stream does not hold back output that was never a header. */
#define MAX_HEAD 256

void harmony_init(struct harmony *h, int max_calls) {
    *h = (struct harmony){.max_calls = max_calls};
}

void harmony_fini(struct harmony *h) {
    buf_free(&h->head);
    buf_free(&h->name);
    buf_free(&h->args);
    buf_free(&h->content);
    buf_free(&h->reasoning);
    json_decref(h->calls);
    *h = (struct harmony){0};
}

static int is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static int prefix_of(const char *s, size_t n, const char *lit) {
    return n <= strlen(lit) && memcmp(s, lit, n) == 0;
}

static int begins(const char *s, size_t n, const char *lit) {
    return n >= strlen(lit) && memcmp(s, lit, strlen(lit)) == 0;
}

/* --- headers -------------------------------------------------------------------------------- */

/* The word after `key` in the header: up to a space, a control token or the end. *n = 0: none.
 * A key that is a plain word ("to=") must start the header or follow a space or a token. */
static const char *head_field(const char *head, const char *key, size_t *n) {
    *n = 0;
    for (const char *at = strstr(head, key); at; at = strstr(at + 1, key)) {
        if (key[0] != '<' && at > head && !is_space(at[-1]) && at[-1] != '>') continue;
        const char *v = at + strlen(key);
        while (v[*n] && !is_space(v[*n]) && !(v[*n] == '<' && v[*n + 1] == '|')) (*n)++;
        return v;
    }
    return NULL;
}

static size_t n_calls(const struct harmony *h) { return h->calls ? json_array_size(h->calls) : 0; }

/* The header is complete: where the body goes. Other recipients than functions.* are the
 * model's built-in tools (browser, python), which this server does not run: their calls are
 * the model's own working, so they go with the reasoning. */
static void open_body(struct harmony *h) {
    const char *head = h->head.p ? h->head.p : "";
    size_t n_to, n_channel;
    const char *to = head_field(head, "to=", &n_to);
    const char *channel = head_field(head, "<|channel|>", &n_channel);
    const size_t fn = strlen("functions.");
    h->state = HARMONY_BODY;
    h->dest = HARMONY_CONTENT;
    if (n_to > fn && memcmp(to, "functions.", fn) == 0) {
        h->dest = (int)n_calls(h) < h->max_calls ? HARMONY_CALL : HARMONY_DROP;
        buf_clear(&h->name);
        buf_clear(&h->args);
        buf_add(&h->name, to + fn, n_to - fn);
    } else if (n_to > 0 || (n_channel == 8 && memcmp(channel, "analysis", 8) == 0)) {
        h->dest = HARMONY_REASONING;
    }
    buf_clear(&h->head);
}

/* What was held as a header was not one: it is content, as written. */
static void not_a_header(struct harmony *h) {
    buf_add(&h->content, h->head.p, h->head.n);
    buf_clear(&h->head);
    h->state = HARMONY_BODY;
    h->dest = HARMONY_CONTENT;
}

/* --- messages ------------------------------------------------------------------------------- */

/* A call's arguments as a JSON string: compact when they are an object, else as written (the
 * client validates them, as OpenAI's own models may write broken JSON too). */
static void add_call(struct harmony *h) {
    size_t a = 0, b = h->args.n;
    while (a < b && is_space(h->args.p[a])) a++;
    while (b > a && is_space(h->args.p[b - 1])) b--;
    json_t *obj = a < b ? json_loadb(h->args.p + a, b - a, 0, NULL) : NULL;
    char *compact = json_is_object(obj) ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_t *args = compact ? json_string(compact)
                 : a < b ? json_stringn(h->args.p + a, b - a) : json_string("{}");
    json_t *name = json_stringn(h->name.p ? h->name.p : "", h->name.n);
    if (!h->calls) h->calls = json_array();
    if (!h->calls || !args || !name ||
        json_array_append_new(h->calls, json_pack("{s:o,s:o}", "name", name, "arguments", args)))
        h->oom = 1;
    free(compact);
    json_decref(obj);
}

/* The current message ends (at an end token, a new message, or the output's end). */
static void end_message(struct harmony *h) {
    if (h->state == HARMONY_HEAD) not_a_header(h);
    if (h->state == HARMONY_BODY && h->dest == HARMONY_CALL) add_call(h);
    h->state = HARMONY_BETWEEN;
}

static void on_text(struct harmony *h, const char *s, size_t n) {
    if (h->state == HARMONY_BETWEEN) { /* text outside any message is content */
        while (n > 0 && is_space(*s)) s++, n--;
        if (n == 0) return;
        h->state = HARMONY_BODY;
        h->dest = HARMONY_CONTENT;
    }
    if (h->state == HARMONY_HEAD) {
        buf_add(&h->head, s, n);
        if (h->head.n > MAX_HEAD) not_a_header(h);
        return;
    }
    struct buf *to = h->dest == HARMONY_CONTENT ? &h->content
                   : h->dest == HARMONY_REASONING ? &h->reasoning
                   : h->dest == HARMONY_CALL ? &h->args : NULL;
    if (to) buf_add(to, s, n);
}

/* Control tokens that mean nothing where they stand are dropped: they never reach content. */
static void on_token(struct harmony *h, int t) {
    switch (t) {
    case TOK_START: /* kept in the header, in case that turns out to be text */
        end_message(h);
        h->state = HARMONY_HEAD;
        buf_adds(&h->head, tokens[t]);
        break;
    case TOK_CHANNEL: /* a channel outside a header opens a new message (no <|start|> seen) */
        if (h->state != HARMONY_HEAD) end_message(h);
        h->state = HARMONY_HEAD;
        buf_adds(&h->head, tokens[t]);
        break;
    case TOK_CONSTRAIN:
        if (h->state == HARMONY_HEAD) buf_adds(&h->head, tokens[t]);
        break;
    case TOK_MESSAGE:
        if (h->state == HARMONY_HEAD) open_body(h);
        break;
    default: /* <|end|>, <|return|>, <|call|> */
        end_message(h);
    }
}

/* The output's first bytes: a header (a channel, a recipient or the message itself) or,
 * from a model that skips the format, plain content. Returns 0 while it cannot tell yet. */
static int on_first(struct harmony *h, const char *s, size_t n, int end) {
    const int header = begins(s, n, tokens[TOK_CHANNEL]) || begins(s, n, tokens[TOK_CONSTRAIN]) ||
                       begins(s, n, tokens[TOK_MESSAGE]) || begins(s, n, "to=") ||
                       begins(s, n, " to=");
    if (!header && !end && (n == 0 || prefix_of(s, n, "to=") || prefix_of(s, n, " to=")))
        return 0;
    h->state = header ? HARMONY_HEAD : HARMONY_BODY;
    h->dest = HARMONY_CONTENT;
    return 1;
}

static int token_at(const char *s) {
    int t = 0;
    while (t < N_TOK && strncmp(s, tokens[t], strlen(tokens[t])) != 0) t++;
    return t;
}

void harmony_read(struct harmony *h, const char *text, size_t n, int end) {
    if (h->state == HARMONY_DONE || n < h->pos) return;
    const size_t stop = end ? n : n - text_partial_suffix(text + h->pos, n - h->pos, tokens, N_TOK);
    if (h->state == HARMONY_FIRST && !on_first(h, text + h->pos, stop - h->pos, end)) return;
    while (h->pos < stop) {
        size_t at = text_find_any(text, stop, h->pos, tokens, N_TOK);
        if (at == SIZE_MAX) at = stop;
        on_text(h, text + h->pos, at - h->pos);
        h->pos = at;
        if (at == stop) break;
        const int t = token_at(text + at);
        h->pos += strlen(tokens[t]);
        on_token(h, t);
    }
    if (end) {
        end_message(h);
        h->state = HARMONY_DONE;
    }
    h->oom |= h->head.oom | h->name.oom | h->args.oom | h->content.oom | h->reasoning.oom;
}
