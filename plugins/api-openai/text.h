/* text.h: the text side of the openai front end, free of sockets and of the engine, so that unit
 * tests link it alone: growable byte buffers, a streaming UTF-8 repair, stop strings, the
 * tool-call formats that models write, and gpt-oss's harmony messages. */
#ifndef TMX_API_OPENAI_TEXT_H
#define TMX_API_OPENAI_TEXT_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* A growable byte string, always NUL-terminated once non-empty. An allocation failure sets oom;
 * later appends do nothing, so callers check oom once at the end. Zero-initialise before use. */
struct buf {
    char *p;
    size_t n, cap;
    int oom;
};

void buf_add(struct buf *b, const void *p, size_t n);
void buf_adds(struct buf *b, const char *s);
void buf_addf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void buf_clear(struct buf *b); /* n = 0, memory kept */
void buf_free(struct buf *b);

/* Streaming UTF-8 repair: bytes in, valid UTF-8 out. A sequence that may still complete is held
 * back until the next push; each maximal invalid subpart becomes U+FFFD (as WHATWG decoders do),
 * so no output chunk ever carries a broken sequence. Zero-initialise before the first push. */
struct utf8_dec {
    unsigned char pend[4];
    int n, need;
};

void utf8_push(struct utf8_dec *d, const char *in, size_t n, struct buf *out);
/* Ends the stream: a held incomplete sequence becomes U+FFFD. */
void utf8_flush(struct utf8_dec *d, struct buf *out);

/* Fixed markers (tool calls, harmony tokens). text_find_any finds the earliest occurrence of
 * any of the strings in text[0..n) that starts at or after `from`; returns its offset, or
 * SIZE_MAX. */
size_t text_find_any(const char *text, size_t n, size_t from, char *const *strs, int n_strs);
/* The length of the longest suffix of text[0..n) that is a proper prefix of one of the strings:
 * text a stream must hold back because the next token may complete a match. Quadratic in the
 * strings' lengths: for short markers, not for a request's stop strings (struct stops). */
size_t text_partial_suffix(const char *text, size_t n, char *const *strs, int n_strs);

/* A request's stop strings, searched in an output that only grows: each string's
 * Knuth-Morris-Pratt automaton, so that the bytes a token adds cost their number whatever the
 * strings' lengths (a client may send 16 strings of a megabyte). */
#define STOPS_MAX 16 /* strings a request may give */

struct stops {
    int n;
    char *const *strs; /* [n], not owned, none empty */
    size_t *len;       /* [n] */
    size_t **border;   /* [n][len[i]]: the longest proper border of strs[i][0..k] */
};

/* Where one output stands: its first `read` bytes went through every automaton, and state[i]
 * is the length of the longest tail of them that begins strs[i]. Zero-initialise. */
struct stops_scan {
    size_t state[STOPS_MAX];
    size_t read;
};

/* 0: out of memory (s is then empty and safe to free). n <= STOPS_MAX. */
int stops_init(struct stops *s, char *const *strs, int n);
void stops_free(struct stops *s);
/* Reads text[scan->read..n): where the first of the stop strings that end there begins (the
 * earliest start among them), or SIZE_MAX. */
size_t stops_feed(const struct stops *s, struct stops_scan *scan, const char *text, size_t n);
/* The longest tail of what was read that may still become a stop string: what a stream holds
 * back. */
size_t stops_pending(const struct stops *s, const struct stops_scan *scan);

/* --- tool calls -----------------------------------------------------------------------------
 * How a model family writes function calls into its output. The front end picks the format from
 * the tokenizer's special tokens, holds back output from the first marker on, and parses it when
 * the choice ends. */
enum tool_format {
    TOOL_FORMAT_NONE = 0,
    TOOL_FORMAT_HERMES, /* Qwen 2.5/3, Hermes: <tool_call>{"name", "arguments"}</tool_call> */
    TOOL_FORMAT_LLAMA3, /* Llama 3.1/3.2: a bare {"name", "parameters"} message, or after
                           <|python_tag|>; several calls separated by ';' */
    TOOL_FORMAT_HARMONY, /* gpt-oss: the whole output is harmony messages, calls among them;
                            read by struct harmony below, not by the two functions after */
};

/* The strings that open a tool call in `format`'s output ({0}-terminated lists). For Llama 3 a
 * '{' also opens one when it is the first non-space character of the message (tool_starts_at). */
extern char *const tool_markers_hermes[];
extern char *const tool_markers_llama3[];

/* Where the tool calls of `text` (the output so far) begin: the first marker, or for Llama 3 a
 * leading '{'. SIZE_MAX: none yet. *hold gets how many trailing bytes may still become one. */
size_t tool_starts_at(enum tool_format format, const char *text, size_t n, size_t *hold);

/* Parses text[0..n), which starts where tool_starts_at said, into a new JSON array of
 * {"name": string, "arguments": string holding a JSON object}. NULL when the text is not a
 * well-formed sequence of calls (the caller then returns it as plain content). */
json_t *tool_calls_parse(enum tool_format format, const char *text, size_t n);

/* --- harmony (harmony.c) ----------------------------------------------------------------------
 * gpt-oss writes channels: `<|channel|>analysis<|message|>...<|end|>` is reasoning,
 * `<|start|>assistant<|channel|>final<|message|>...` content, and a message addressed
 * `to=functions.NAME` a tool call. The parser reads a chat output as it grows, sorting it into
 * content, reasoning and calls; the control tokens never reach content, except in text that
 * claimed to be a header and was not one (kept as the model wrote it). */
enum harmony_state { HARMONY_FIRST = 0, HARMONY_HEAD, HARMONY_BODY, HARMONY_BETWEEN, HARMONY_DONE };
enum harmony_dest { HARMONY_CONTENT, HARMONY_REASONING, HARMONY_CALL, HARMONY_DROP };

struct harmony {
    enum harmony_state state;
    enum harmony_dest dest; /* where the current message's body goes */
    int max_calls;          /* calls kept; later ones are dropped (0: the request has no tools) */
    int oom;                /* an allocation failed: the results are incomplete */
    size_t pos;             /* bytes of the output read */
    struct buf head;        /* the current message's header, until its <|message|> */
    struct buf name, args;  /* the current call's function name and arguments */
    struct buf content, reasoning; /* what the client sees */
    json_t *calls;          /* [{"name", "arguments": JSON text}]; NULL until the first */
};

void harmony_init(struct harmony *h, int max_calls);
void harmony_fini(struct harmony *h);
/* Reads text[pos..n) (text[0..n) is the output so far, text[0..pos) read before), all but a
 * tail that may still become a control token; `end`: the output is complete, read it all. */
void harmony_read(struct harmony *h, const char *text, size_t n, int end);

#endif
