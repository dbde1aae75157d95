/* sse.c: server-sent events as the OpenAI clients read them: each event one `data: <json>`
 * line and a blank line, the stream closed by `data: [DONE]`. A chunk of the chunked response
 * carries exactly one event, so that clients see it as soon as it is written. */
#include <stdlib.h>
#include <string.h>

#include "api.h"

void sse_begin(struct conn *c) { http_stream_begin(c, "text/event-stream; charset=utf-8"); }

void sse_send(struct conn *c, json_t *event) {
    char *text = event ? json_dumps(event, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(event);
    struct buf b = {0};
    if (text) {
        buf_adds(&b, "data: ");
        buf_adds(&b, text);
        buf_adds(&b, "\n\n");
    } else {
        buf_adds(&b, "data: {\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                     "\"param\":null,\"code\":500}}\n\n");
    }
    free(text);
    if (!b.oom) http_stream_send(c, b.p, b.n);
    buf_free(&b);
}

void sse_done(struct conn *c) {
    static const char done[] = "data: [DONE]\n\n";
    http_stream_send(c, done, sizeof done - 1);
    http_stream_end(c);
}
