/* metrics.c: GET /metrics — the scheduler's counters in the Prometheus text format, named as vLLM
 * names them with a tmx: prefix, each labelled with the model name. Histogram buckets come
 * cumulative from the scheduler (tmx/serve.h), as Prometheus wants them. */
#include <stdio.h>

#include "api.h"

/* A label value with \, " and newlines escaped, as the text format requires. */
static void add_label(struct buf *b, const char *v) {
    for (; *v; v++) {
        if (*v == '\\' || *v == '"') buf_addf(b, "\\%c", *v);
        else if (*v == '\n') buf_adds(b, "\\n");
        else buf_add(b, v, 1);
    }
}

static void family(struct buf *b, const char *name, const char *type, const char *help) {
    buf_addf(b, "# HELP tmx:%s %s\n# TYPE tmx:%s %s\n", name, help, name, type);
}

/* One sample: tmx:<name>{model_name="..."<extra>} value */
static void sample(struct buf *b, const struct api *a, const char *name, const char *extra,
                   double v) {
    buf_addf(b, "tmx:%s{model_name=\"", name);
    add_label(b, a->model);
    buf_addf(b, "\"%s} %.15g\n", extra, v);
}

static void histogram(struct buf *b, const struct api *a, const char *name, const char *help,
                      const uint64_t *counts, double sum) {
    static const double bounds[TMX_SERVE_N_BUCKETS] = TMX_SERVE_LATENCY_BOUNDS;
    char bucket[96], le[48];
    family(b, name, "histogram", help);
    snprintf(bucket, sizeof bucket, "%s_bucket", name);
    for (int i = 0; i < TMX_SERVE_N_BUCKETS; i++) {
        if (i == TMX_SERVE_N_BUCKETS - 1) snprintf(le, sizeof le, ",le=\"+Inf\"");
        else snprintf(le, sizeof le, ",le=\"%g\"", bounds[i]);
        sample(b, a, bucket, le, (double)counts[i]);
    }
    snprintf(bucket, sizeof bucket, "%s_sum", name);
    sample(b, a, bucket, "", sum);
    snprintf(bucket, sizeof bucket, "%s_count", name);
    sample(b, a, bucket, "", (double)counts[TMX_SERVE_N_BUCKETS - 1]);
}

void metrics_handle(struct conn *c, const char *body, size_t len) {
    (void)body, (void)len;
    const struct api *a = conn_api(c);
    struct tmx_serve_metrics m;
    a->si->metrics(a->si->serve, &m);
    struct buf b = {0};
    family(&b, "num_requests_running", "gauge", "Requests holding a sequence now.");
    sample(&b, a, "num_requests_running", "", m.running);
    family(&b, "num_requests_waiting", "gauge", "Requests queued for a sequence.");
    sample(&b, a, "num_requests_waiting", "", m.waiting);
    family(&b, "kv_cache_usage_perc", "gauge", "Fraction of the KV cache in use (0 to 1).");
    sample(&b, a, "kv_cache_usage_perc", "", m.kv_usage);
    family(&b, "prompt_tokens_total", "counter", "Prompt tokens of submitted requests.");
    sample(&b, a, "prompt_tokens_total", "", (double)m.prompt_tokens);
    family(&b, "generation_tokens_total", "counter", "Tokens generated.");
    sample(&b, a, "generation_tokens_total", "", (double)m.generation_tokens);
    family(&b, "request_success_total", "counter", "Requests finished, by finish reason.");
    sample(&b, a, "request_success_total", ",finished_reason=\"stop\"",
           (double)m.finished[TMX_FINISH_STOP]);
    sample(&b, a, "request_success_total", ",finished_reason=\"length\"",
           (double)m.finished[TMX_FINISH_LENGTH]);
    sample(&b, a, "request_success_total", ",finished_reason=\"abort\"",
           (double)m.finished[TMX_FINISH_ABORT]);
    family(&b, "request_failure_total", "counter", "Requests the engine failed.");
    sample(&b, a, "request_failure_total", "", (double)m.finished[TMX_FINISH_ERROR]);
    family(&b, "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix "
           "cache.");
    sample(&b, a, "prefix_cache_queries_total", "", (double)m.prefix_cache_queries);
    family(&b, "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.");
    sample(&b, a, "prefix_cache_hits_total", "", (double)m.prefix_cache_hits);
    family(&b, "num_preemptions_total", "counter", "Requests preempted to recompute later "
           "because the KV cache was full.");
    sample(&b, a, "num_preemptions_total", "", (double)m.preemptions);
    histogram(&b, a, "time_to_first_token_seconds", "Seconds from submission to the first token.",
              m.ttft_count, m.ttft_sum);
    histogram(&b, a, "inter_token_latency_seconds", "Seconds between a request's tokens.",
              m.itl_count, m.itl_sum);
    if (b.oom) {
        buf_free(&b);
        http_respond_json(c, 500, http_error_json(500, NULL, "out of memory"));
        return;
    }
    http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", b.p, b.n);
    buf_free(&b);
}
