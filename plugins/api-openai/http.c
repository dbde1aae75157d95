/* http.c: connections — accepting, parsing requests with http-parser, routing, authentication,
 * timeouts and writing responses (whole or chunked) on keep-alive connections.
 *
 * A connection reads one request at a time: when http-parser completes a message it is paused,
 * and bytes that arrive while the response is being produced (a pipelined next request) wait in
 * `pending`. The connection keeps reading meanwhile, so a client that goes away is noticed at
 * once and its job cancelled. A request must arrive whole within `timeout` of the previous
 * response (or of the accept): slow or idle clients are dropped. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

enum conn_state {
    CONN_READING, /* waiting for (the rest of) a request */
    CONN_BUSY,    /* a request is being answered */
    CONN_CLOSING, /* the last response is flushing; then the socket closes */
};

struct conn {
    struct api *api;
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t shutdown;
    int n_handles;  /* of tcp and timer, not yet closed: the struct is freed at 0 */
    int closed;     /* uv_close has been called */
    enum conn_state state;
    http_parser parser;
    int in_message; /* the parser has begun a request */
    int pumping;    /* inside conn_pump */
    int too_large;  /* the body passed max_body */
    int keep_alive;
    int expect_continue; /* the client waits for "100 Continue" before its body */
    const char *allow;   /* with a 405: the method the path takes */
    const char *method;  /* of the request being answered; NULL: it did not parse */
    int head;            /* a HEAD request: responses go without their body */
    const char *rest;    /* a prefix route's rest of the path, [n_rest], not NUL-terminated */
    size_t n_rest;
    struct buf url, body, field, value, auth;
    int in_value;   /* the last header callback was a value */
    struct buf pending; /* bytes not yet parsed */
    struct job *job;
    /* the request log line */
    uint64_t t_start;
    int status, n_prompt, n_completion;
    char peer[64];
    struct conn *prev, *next;
    char rbuf[64 << 10];
};

struct write_req {
    uv_write_t req;
    char *data;
};

/* --- writing ------------------------------------------------------------------------------- */

static void conn_close(struct conn *c);

static void on_write(uv_write_t *req, int status) {
    struct write_req *w = (struct write_req *)req;
    (void)status; /* a failed write shows up as a read error or EOF too */
    free(w->data);
    free(w);
}

/* Writes b's bytes and takes its memory. */
static void conn_write(struct conn *c, struct buf *b) {
    struct write_req *w = malloc(sizeof *w);
    if (c->closed || b->oom || !w) {
        free(w);
        buf_free(b);
        if (!c->closed) conn_close(c);
        return;
    }
    w->data = b->p;
    uv_buf_t ub = uv_buf_init(b->p, (unsigned)b->n);
    *b = (struct buf){0};
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &ub, 1, on_write) != 0) {
        free(w->data);
        free(w);
        conn_close(c);
    }
}

static const char *reason(int status) {
    switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Error";
    }
}

static void head(struct conn *c, struct buf *b, int status, const char *content_type) {
    c->status = status;
    buf_addf(b, "HTTP/1.1 %d %s\r\n", status, reason(status));
    if (content_type) buf_addf(b, "Content-Type: %s\r\n", content_type);
    if (c->api->cors_origin[0])
        buf_addf(b, "Access-Control-Allow-Origin: %s\r\n", c->api->cors_origin);
    buf_adds(b, c->keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n");
}

/* --- the response cycle -------------------------------------------------------------------- */

static void conn_pump(struct conn *c);

static void on_shutdown(uv_shutdown_t *req, int status) {
    (void)status;
    conn_close(req->data);
}

static void on_timer(uv_timer_t *t);

/* The current response is complete: log it, then read the next request or close. */
static void response_done(struct conn *c) {
    struct api *a = c->api;
    const double secs = (double)(uv_hrtime() - c->t_start) * 1e-9;
    const char *method = c->method ? c->method : "-", *url = c->method && c->url.p ? c->url.p : "-";
    if (c->n_prompt || c->n_completion)
        a->host->log(TMX_LOG_INFO, "%s %s %.200s %d %.3fs prompt=%d completion=%d", c->peer,
                     method, url, c->status, secs, c->n_prompt, c->n_completion);
    else
        a->host->log(TMX_LOG_INFO, "%s %s %.200s %d %.3fs", c->peer, method, url, c->status,
                     secs);
    c->method = NULL;
    c->job = NULL;
    if (c->closed) return;
    if (!c->keep_alive || a->stopping) {
        c->state = CONN_CLOSING; /* flush, then close; the timer bounds a client that stalls */
        c->shutdown.data = c;
        if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) != 0) conn_close(c);
        else uv_timer_start(&c->timer, on_timer, 5000, 0);
        return;
    }
    c->state = CONN_READING;
    http_parser_pause(&c->parser, 0);
    uv_timer_start(&c->timer, on_timer, a->timeout_ms, 0);
    conn_pump(c);
}

void http_respond(struct conn *c, int status, const char *content_type, const char *body,
                  size_t len) {
    struct buf b = {0};
    head(c, &b, status, content_type);
    if (status == 429) buf_adds(&b, "Retry-After: 1\r\n");
    if (status == 405) buf_addf(&b, "Allow: %s\r\n", c->allow);
    buf_addf(&b, "Content-Length: %zu\r\n\r\n", len);
    if (!c->head) buf_add(&b, body, len);
    conn_write(c, &b);
    response_done(c);
}

void http_respond_json(struct conn *c, int status, json_t *body) {
    char *text = body ? json_dumps(body, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(body);
    if (!text) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":500}}";
        http_respond(c, 500, "application/json", oom, sizeof oom - 1);
        return;
    }
    http_respond(c, status, "application/json", text, strlen(text));
    free(text);
}

static const char *error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 500: return "server_error";
    case 503: return "unavailable_error";
    default: return "invalid_request_error";
    }
}

json_t *http_error_json(int status, const char *param, const char *msg) {
    return json_pack("{s:{s:s,s:s,s:s?,s:i}}", "error", "message", msg, "type",
                     error_type(status), "param", param && param[0] ? param : NULL, "code",
                     status);
}

void http_fail(struct conn *c, const struct api_fail *f) {
    http_respond_json(c, f->status, http_error_json(f->status, f->param, f->msg));
}

static void http_errorf(struct conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void http_errorf(struct conn *c, int status, const char *fmt, ...) {
    struct api_fail f = {.status = status};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f.msg, sizeof f.msg, fmt, ap);
    va_end(ap);
    http_fail(c, &f);
}

void http_stream_begin(struct conn *c, const char *content_type) {
    struct buf b = {0};
    head(c, &b, 200, content_type);
    buf_adds(&b, "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n");
    conn_write(c, &b);
}

void http_stream_send(struct conn *c, const char *p, size_t n) {
    if (n == 0) return; /* an empty chunk would end the stream */
    struct buf b = {0};
    buf_addf(&b, "%zx\r\n", n);
    buf_add(&b, p, n);
    buf_adds(&b, "\r\n");
    conn_write(c, &b);
}

void http_stream_end(struct conn *c) {
    struct buf b = {0};
    buf_adds(&b, "0\r\n\r\n");
    conn_write(c, &b);
    response_done(c);
}

struct api *conn_api(const struct conn *c) { return c->api; }

const char *conn_path_rest(const struct conn *c, size_t *n) {
    *n = c->n_rest;
    return c->rest;
}

void conn_set_job(struct conn *c, struct job *j) { c->job = j; }

void conn_log_tokens(struct conn *c, int prompt, int completion) {
    c->n_prompt += prompt;
    c->n_completion += completion;
}

/* --- routing ------------------------------------------------------------------------------- */

static const struct route {
    const char *path;
    enum http_method method;
    api_handler handler;
    int open;   /* served without the API key */
    int prefix; /* the path's start; the rest (conn_path_rest) names something */
} routes[] = {
    {"/v1/chat/completions", HTTP_POST, chat_handle, 0, 0},
    {"/v1/completions", HTTP_POST, completions_handle, 0, 0},
    {"/v1/models", HTTP_GET, models_handle, 0, 0},
    {"/v1/models/", HTTP_GET, model_handle, 0, 1},
    {"/health", HTTP_GET, health_handle, 1, 0},
    {"/metrics", HTTP_GET, metrics_handle, 0, 0},
    {"/tokenize", HTTP_POST, tokenize_handle, 0, 0},
    {"/detokenize", HTTP_POST, detokenize_handle, 0, 0},
};

/* Compares without an early exit, so that timing does not reveal how much of a key matched. */
static int key_matches(const char *want, const char *got, size_t got_len) {
    const size_t n = strlen(want);
    if (got_len != n) return 0;
    unsigned diff = 0;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(want[i] ^ got[i]);
    return diff == 0;
}

static int authorized(const struct conn *c) {
    const char *key = c->api->api_key;
    if (!key[0]) return 1;
    const char *v = c->auth.p ? c->auth.p : "";
    if (strncasecmp(v, "Bearer ", 7) != 0) return 0;
    v += 7;
    while (*v == ' ') v++;
    return key_matches(key, v, strlen(v));
}

/* A complete request is in c->url/body: answer it. */
static void dispatch(struct conn *c) {
    c->state = CONN_BUSY;
    c->method = http_method_str((enum http_method)c->parser.method);
    c->keep_alive = http_should_keep_alive(&c->parser) && !c->api->stopping;
    c->head = c->parser.method == HTTP_HEAD;
    uv_timer_stop(&c->timer);
    struct http_parser_url u;
    http_parser_url_init(&u);
    if (!c->url.p || http_parser_parse_url(c->url.p, c->url.n, 0, &u) != 0 ||
        !(u.field_set & (1 << UF_PATH))) {
        http_errorf(c, 400, "malformed request target");
        return;
    }
    const char *path = c->url.p + u.field_data[UF_PATH].off;
    const size_t plen = u.field_data[UF_PATH].len;
    const enum http_method method = (enum http_method)c->parser.method;
    const struct route *hit = NULL;
    c->allow = NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        const size_t n = strlen(routes[i].path);
        if (routes[i].prefix ? plen <= n : plen != n) continue;
        if (memcmp(routes[i].path, path, n) != 0) continue;
        c->allow = http_method_str(routes[i].method);
        c->rest = path + n;
        c->n_rest = plen - n;
        if (routes[i].method == method || (c->head && routes[i].method == HTTP_GET))
            hit = &routes[i];
    }
    if (!c->allow) {
        http_errorf(c, 404, "%.*s: no such endpoint", (int)(plen < 200 ? plen : 200), path);
        return;
    }
    if (!hit && method == HTTP_OPTIONS && c->api->cors_origin[0]) { /* CORS preflight */
        struct buf b = {0};
        head(c, &b, 204, NULL);
        buf_adds(&b, "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\n"
                     "Access-Control-Allow-Headers: Authorization, Content-Type\r\n"
                     "Access-Control-Max-Age: 86400\r\nContent-Length: 0\r\n\r\n");
        conn_write(c, &b);
        response_done(c);
        return;
    }
    if (!hit) {
        http_errorf(c, 405, "%.*s does not accept %s", (int)plen, path, http_method_str(method));
        return;
    }
    if (!hit->open && !authorized(c)) {
        http_errorf(c, 401, "invalid or missing API key: send \"Authorization: Bearer <key>\"");
        return;
    }
    hit->handler(c, c->body.p ? c->body.p : "", c->body.n);
}

/* --- parsing ------------------------------------------------------------------------------- */

static struct conn *parser_conn(http_parser *p) { return p->data; }

static int on_message_begin(http_parser *p) {
    struct conn *c = parser_conn(p);
    buf_clear(&c->url);
    buf_clear(&c->body);
    buf_clear(&c->auth);
    c->head = 0;
    c->expect_continue = 0;
    buf_clear(&c->field);
    buf_clear(&c->value);
    c->in_value = 0;
    c->in_message = 1;
    c->too_large = 0;
    c->n_prompt = c->n_completion = 0;
    c->t_start = uv_hrtime();
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t n) {
    buf_add(&parser_conn(p)->url, at, n);
    return 0;
}

/* Keeps the headers the server reads; the others are dropped as they complete. */
static void header_done(struct conn *c) {
    if (c->field.n == 13 && strncasecmp(c->field.p, "authorization", 13) == 0) {
        buf_clear(&c->auth);
        buf_add(&c->auth, c->value.p, c->value.n);
    }
    if (c->field.n == 6 && strncasecmp(c->field.p, "expect", 6) == 0 && c->value.n == 12 &&
        strncasecmp(c->value.p, "100-continue", 12) == 0)
        c->expect_continue = 1;
    buf_clear(&c->field);
    buf_clear(&c->value);
}

static int on_header_field(http_parser *p, const char *at, size_t n) {
    struct conn *c = parser_conn(p);
    if (c->in_value) header_done(c);
    c->in_value = 0;
    buf_add(&c->field, at, n);
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t n) {
    struct conn *c = parser_conn(p);
    c->in_value = 1;
    buf_add(&c->value, at, n);
    return 0;
}

static int on_headers_complete(http_parser *p) {
    struct conn *c = parser_conn(p);
    if (c->in_value) header_done(c);
    if ((p->flags & F_CONTENTLENGTH) && p->content_length > c->api->max_body) {
        c->too_large = 1;
        return -1;
    }
    if (c->expect_continue) {
        struct buf b = {0};
        buf_adds(&b, "HTTP/1.1 100 Continue\r\n\r\n");
        conn_write(c, &b);
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n) {
    struct conn *c = parser_conn(p);
    if (c->body.n + n > c->api->max_body) { /* chunked bodies have no length up front */
        c->too_large = 1;
        return -1;
    }
    buf_add(&c->body, at, n);
    return 0;
}

static int on_message_complete(http_parser *p) {
    http_parser_pause(p, 1); /* one request at a time: the rest waits in `pending` */
    return 0;
}

static const http_parser_settings settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

/* Parses what is pending while the connection waits for a request; answers each request that
 * completes. Iterative, so that many pipelined requests answered at once do not recurse. */
static void conn_pump(struct conn *c) {
    if (c->pumping) return;
    c->pumping = 1;
    while (c->state == CONN_READING && c->pending.n > 0) {
        struct buf in = c->pending;
        c->pending = (struct buf){0};
        const size_t used = http_parser_execute(&c->parser, &settings, in.p, in.n);
        const enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
        if (e == HPE_PAUSED) {
            buf_add(&c->pending, in.p + used, in.n - used);
            buf_free(&in);
            c->in_message = 0;
            if (c->url.oom || c->body.oom || c->pending.oom) {
                c->keep_alive = 0;
                http_errorf(c, 500, "out of memory");
            } else {
                dispatch(c);
            }
            continue;
        }
        buf_free(&in);
        if (e == HPE_OK && !c->parser.upgrade) continue;
        c->state = CONN_BUSY; /* answer the error, then close: the stream is out of step */
        c->keep_alive = 0;
        if (c->too_large)
            http_errorf(c, 413, "request body exceeds %zu bytes (option api.openai.max_body)",
                        c->api->max_body);
        else if (e == HPE_HEADER_OVERFLOW)
            http_errorf(c, 431, "request headers exceed %d bytes", HTTP_MAX_HEADER_SIZE);
        else if (e == HPE_OK)
            http_errorf(c, 400, "protocol upgrades are not supported");
        else
            http_errorf(c, 400, "malformed HTTP request: %s", http_errno_description(e));
    }
    c->pumping = 0;
}

/* --- connection lifetime ------------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h) {
    struct conn *c = h->data;
    if (--c->n_handles > 0) return;
    struct api *a = c->api;
    buf_free(&c->url);
    buf_free(&c->body);
    buf_free(&c->field);
    buf_free(&c->value);
    buf_free(&c->auth);
    buf_free(&c->pending);
    free(c);
    api_check_done(a);
}

static void conn_close(struct conn *c) {
    if (c->closed) return;
    c->closed = 1;
    c->state = CONN_CLOSING;
    if (c->job) {
        struct job *j = c->job;
        c->job = NULL;
        job_detach(j);
    }
    if (c->prev) c->prev->next = c->next;
    else c->api->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_handle_closed);
}

static void on_timer(uv_timer_t *t) {
    struct conn *c = t->data;
    if (c->state == CONN_READING && c->in_message) { /* a request began but did not finish */
        c->state = CONN_BUSY;
        c->keep_alive = 0;
        http_errorf(c, 408, "the request did not arrive within %.0f s (option "
                    "api.openai.timeout)", (double)c->api->timeout_ms / 1000);
        return;
    }
    conn_close(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *out) {
    struct conn *c = h->data;
    (void)suggested;
    *out = uv_buf_init(c->rbuf, sizeof c->rbuf);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *in) {
    struct conn *c = s->data;
    if (nread < 0) { /* EOF or reset: the client is gone, and with it any job of its request */
        conn_close(c);
        return;
    }
    if (nread == 0 || c->state == CONN_CLOSING) return;
    /* while busy, a client may pipeline its next request, but not without bound */
    if (c->state == CONN_BUSY && c->pending.n + (size_t)nread > c->api->max_body + (1u << 20)) {
        conn_close(c);
        return;
    }
    buf_add(&c->pending, in->base, (size_t)nread);
    if (c->pending.oom) {
        conn_close(c);
        return;
    }
    conn_pump(c);
}

static void on_connection(uv_stream_t *server, int status) {
    struct api *a = server->data;
    if (status < 0) {
        a->host->log(TMX_LOG_WARN, "api.openai: accept failed: %s", uv_strerror(status));
        return;
    }
    struct conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->api = a;
    uv_tcp_init(&a->loop, &c->tcp);
    c->tcp.data = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        c->n_handles = 1;
        c->closed = 1;
        uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
        return;
    }
    uv_timer_init(&a->loop, &c->timer);
    c->timer.data = c;
    c->n_handles = 2;
    c->next = a->conns;
    if (a->conns) a->conns->prev = c;
    a->conns = c;
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->t_start = uv_hrtime();
    struct sockaddr_storage ss;
    int len = sizeof ss;
    snprintf(c->peer, sizeof c->peer, "-");
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0) {
        char ip[48] = "";
        const int v6 = ss.ss_family == AF_INET6;
        if (v6) uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
        else uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
        snprintf(c->peer, sizeof c->peer, "%s", ip);
    }
    uv_tcp_nodelay(&c->tcp, 1); /* stream chunks go out as they are written */
    uv_timer_start(&c->timer, on_timer, a->timeout_ms, 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) conn_close(c);
}

int http_addr(const char *host, int port, struct sockaddr_storage *addr) {
    return uv_ip4_addr(host, port, (struct sockaddr_in *)addr) == 0 ||
           uv_ip6_addr(host, port, (struct sockaddr_in6 *)addr) == 0;
}

enum tmx_status http_listen(struct api *a, char **err) {
    struct sockaddr_storage addr;
    http_addr(a->bind_host, a->port, &addr); /* checked by the plugin's options (plugin.c) */
    uv_tcp_init(&a->loop, &a->listener);
    a->listener.data = a;
    a->listening = 1;
    int rc = uv_tcp_bind(&a->listener, (const struct sockaddr *)&addr, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&a->listener, 511, on_connection);
    if (rc != 0)
        return a->host->err(err, TMX_ERR_IO, "api.openai: cannot listen on %s:%d: %s",
                            a->bind_host, a->port, uv_strerror(rc));
    struct sockaddr_storage bound;
    int len = sizeof bound;
    if (uv_tcp_getsockname(&a->listener, (struct sockaddr *)&bound, &len) == 0) /* port 0 */
        a->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
    return TMX_OK;
}

void http_shutdown(struct api *a) {
    if (a->listening) {
        uv_close((uv_handle_t *)&a->listener, NULL);
        a->listening = 0;
    }
    for (struct conn *c = a->conns, *next; c; c = next) {
        next = c->next;
        if (c->job) job_fail(c->job, 503, "the server is shutting down");
        else if (c->state == CONN_READING) conn_close(c);
    }
}
