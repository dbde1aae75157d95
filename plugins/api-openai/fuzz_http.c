/* fuzz_http.c: a libFuzzer target for the HTTP request path — connection handling, parsing,
 * routing, request bodies, jobs and responses — of api.openai, run in-process over loopback TCP
 * against a fake serving table (bytes are tokens; every request yields four tokens).
 *
 *     cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DTMX_FUZZ=ON -DTMX_TESTS=OFF
 *     cmake --build build-fuzz --target fuzz_api_http && build-fuzz/bin/fuzz_api_http
 *
 * Each input is sent as is on a new connection, which is then half-closed; the server must
 * answer or close without crashing, leaking or hanging. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "api.h"

/* --- a fake engine: byte tokens, four tokens per request ---------------------------------- */

static char bytes[256];
static const int32_t eos = 0;
static const struct tmx_sampling_defaults defaults = TMX_SAMPLING_DEFAULTS;
static uint64_t next_id = 1;

static enum tmx_status fake_submit(struct tmx_serve *s, const struct tmx_request_params *p,
                                   tmx_token_cb cb, void *arg, uint64_t *id, char **err) {
    (void)s, (void)err;
    *id = next_id++;
    const int n = p->max_tokens < 4 ? p->max_tokens : 4;
    float top_lp[TMX_MAX_TOP_LOGPROBS] = {0};
    int32_t top_ids[TMX_MAX_TOP_LOGPROBS] = {0};
    for (int i = 0; i < n; i++) {
        const struct tmx_token_event ev = {
            .id = *id, .token = 'a' + i, .logprob = -1.0f,
            .n_top = p->top_logprobs > 0 ? p->top_logprobs : 0, .top_ids = top_ids,
            .top_logprobs = top_lp, .finish = i == n - 1 ? TMX_FINISH_LENGTH : TMX_FINISH_NONE,
            .n_prompt = p->n_prompt, .n_generated = i + 1};
        cb(arg, &ev);
    }
    return TMX_OK;
}

static void fake_cancel(struct tmx_serve *s, uint64_t id) { (void)s, (void)id; }

static void fake_metrics(struct tmx_serve *s, struct tmx_serve_metrics *m) {
    (void)s;
    *m = (struct tmx_serve_metrics){0};
}

static enum tmx_status fake_tokenize(struct tmx_serve *s, const char *text, size_t len,
                                     int parse_special, int32_t **ids, size_t *n, char **err) {
    (void)s, (void)parse_special, (void)err;
    *ids = malloc((len ? len : 1) * sizeof **ids);
    for (size_t i = 0; *ids && i < len; i++) (*ids)[i] = (unsigned char)text[i];
    *n = len;
    return *ids ? TMX_OK : TMX_ERR_NOMEM;
}

static const char *fake_token_bytes(struct tmx_serve *s, int32_t id, size_t *len) {
    (void)s;
    if (id < 0 || id > 255) return NULL;
    *len = 1;
    return &bytes[id];
}

static int fake_token_special(struct tmx_serve *s, int32_t id) {
    (void)s;
    return id == 0;
}

static int32_t fake_find_token(struct tmx_serve *s, const char *text) {
    (void)s, (void)text;
    return -1;
}

/* The "template": the context as JSON text. */
static enum tmx_status fake_render(struct tmx_serve *s, const json_t *ctx, char **text,
                                   size_t *len, char **err) {
    (void)s, (void)err;
    *text = json_dumps(ctx, JSON_COMPACT);
    *len = *text ? strlen(*text) : 0;
    return *text ? TMX_OK : TMX_ERR_NOMEM;
}

static const struct tmx_serve_i table = {
    .struct_size = sizeof table, .model_name = "fuzz", .max_model_len = 4096, .n_vocab = 256,
    .eos_ids = &eos, .n_eos = 1, .bos_id = -1, .submit = fake_submit, .cancel = fake_cancel,
    .metrics = fake_metrics, .tokenize = fake_tokenize, .token_bytes = fake_token_bytes,
    .find_token = fake_find_token, .chat_render = fake_render, .release = free,
    .max_requests = 72, .token_special = fake_token_special, .stop = fake_cancel,
    .defaults = &defaults};

/* --- a host table with the options' fuzzing values ---------------------------------------- */

static void host_log(enum tmx_log_level level, const char *fmt, ...) { (void)level, (void)fmt; }

static enum tmx_status host_err(char **err, enum tmx_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (err && vasprintf(err, fmt, ap) < 0) *err = NULL;
    va_end(ap);
    return st;
}

static const char *opt_str(const struct tmx_opts *o, const char *name) {
    (void)o;
    return strcmp(name, "host") == 0 ? "127.0.0.1" : "";
}

static int64_t opt_int(const struct tmx_opts *o, const char *name) {
    (void)o;
    return strcmp(name, "max_body") == 0 ? 65536 : strcmp(name, "timeout") == 0 ? 5 : 0;
}

static const struct tmx_host host = {.struct_size = sizeof host, .abi_major = TMX_ABI_MAJOR,
                                     .abi_minor = TMX_ABI_MINOR, .log = host_log,
                                     .err = host_err, .opt_str = opt_str, .opt_int = opt_int};

/* --- the harness --------------------------------------------------------------------------- */

const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *h, char **err);

static struct sockaddr_in server;

static void *serve(void *ctx) {
    const struct tmx_api_i *api = tmx_plugin_entry(&host, NULL)->ops;
    api->run(ctx, NULL);
    return NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    for (int i = 0; i < 256; i++) bytes[i] = (char)i;
    signal(SIGPIPE, SIG_IGN); /* as tmx serve: a client that hangs up is no crash */
    const struct tmx_api_i *api = tmx_plugin_entry(&host, NULL)->ops;
    void *ctx = NULL;
    char *err = NULL;
    if (api->init(&host, NULL, &table, &ctx, &err) != TMX_OK) {
        fprintf(stderr, "fuzz_api_http: %s\n", err);
        abort();
    }
    const struct api *a = ctx; /* port 0 was asked for: the one bound */
    server = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)a->port)};
    inet_pton(AF_INET, "127.0.0.1", &server.sin_addr);
    pthread_t t;
    pthread_create(&t, NULL, serve, ctx);
    pthread_detach(t);
    return 0;
}

/* A connected socket. Loopback ports run out at this rate (TIME_WAIT): wait for one to free. */
static int dial(void) {
    for (int attempt = 0; attempt < 10000; attempt++) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&server, sizeof server) == 0) return fd;
        if (fd >= 0) close(fd);
        usleep(1000);
    }
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const int fd = dial();
    for (size_t sent = 0; sent < size;) {
        const ssize_t n = send(fd, data + sent, size - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += (size_t)n;
    }
    shutdown(fd, SHUT_WR);
    char buf[65536];
    while (recv(fd, buf, sizeof buf, 0) > 0) {
    }
    close(fd);
    return 0;
}
