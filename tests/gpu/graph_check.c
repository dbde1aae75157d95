/* graph_check.c: the graph ops of a kernel set (graph_begin, graph_end, graph_launch,
 * graph_free), checked on a GPU by tests/gpu/run.sh. Built by kernels/cuda/CMakeLists.txt as
 * bin/tmx-graph-check; needs a device, so it is no ctest case.
 *
 *     tmx-graph-check [KERNELS]      (default cuda)
 *
 * 1. Every conformance case once eagerly (which also grows the set's scratch), then again on a
 *    fresh copy of its inputs with the op captured into a graph and launched: the replay must
 *    pass the case's tolerance and match the eager output bit for bit.
 * 2. A chain rmsnorm -> matmul -> swiglu -> add_gated captured once and launched three times,
 *    the input rewritten with buf_write before each launch: every launch must match the same
 *    chain run eagerly on that input, bit for bit.
 * 3. A device-side error (an embed id outside the table) must fail the next sync with
 *    TMX_ERR_INVALID, and the sync after it must succeed.
 * 4. Every case of a fused op (add_rmsnorm) run as the ops it stands for must give the fused
 *    op's outputs bit for bit.
 * Prints one line per check and exits 1 if any fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "set.h"
#include "tmx/conform.h"

static int n_failed;

static void report(const char *what, int ok, const char *detail) {
    printf("%-56s %s%s%s\n", what, ok ? "PASS" : "FAIL", detail ? "  " : "", detail ? detail : "");
    n_failed += !ok;
}

/* --- 1. every conformance case through a graph ------------------------------------------------ */

enum { EAGER, GRAPH, PARTS };

/* Runs case i (eagerly, captured and launched, or as the ops its op fuses); *out gets a copy of
 * its outputs. 0 when it could not, or (PARTS) its op fuses none. */
static int run_case(const struct tmx_kernels *k, size_t i, int how, struct tmx_conform_result *r,
                    void **out, size_t *nbytes) {
    struct tmx_conform_case *c;
    char *err = NULL;
    *out = NULL;
    if (tmx_conform_case_new(i, k->ops, k->ctx, &c, &err) != TMX_OK) {
        fprintf(stderr, "%s\n", err ? err : "case setup failed");
        free(err);
        return 0;
    }
    int ok = 1;
    if (how == PARTS) {
        ok = tmx_conform_case_run_parts(c);
    } else if (how == GRAPH) {
        void *g = NULL;
        ok = k->ops->graph_begin(k->ctx) == TMX_OK;
        if (ok) tmx_conform_case_run(c);
        ok = ok && k->ops->graph_end(k->ctx, &g) == TMX_OK;
        ok = ok && k->ops->graph_launch(k->ctx, g) == TMX_OK;
        if (g) k->ops->graph_free(k->ctx, g);
    } else {
        tmx_conform_case_run(c);
    }
    ok = ok && tmx_conform_case_check(c, r, &err) == TMX_OK;
    const void *got = ok ? tmx_conform_case_output(c, nbytes) : NULL;
    if (got && (*out = malloc(*nbytes))) memcpy(*out, got, *nbytes);
    tmx_conform_case_free(c);
    free(err);
    return ok && *out;
}

static void check_cases(const struct tmx_kernels *k) {
    int n_ok = 0, n_lacking = 0, n = (int)tmx_conform_count();
    for (size_t i = 0; i < (size_t)n; i++) {
        struct tmx_conform_result eager, replay;
        void *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        const int ran = run_case(k, i, EAGER, &eager, &a, &na);
        if (eager.status == TMX_ERR_UNSUPPORTED) { /* an optional op the set does not have */
            n_lacking++;
            free(a);
            continue;
        }
        int ok = ran && run_case(k, i, GRAPH, &replay, &b, &nb) && replay.pass && na == nb &&
                 memcmp(a, b, na) == 0;
        if (!ok) {
            char detail[96];
            snprintf(detail, sizeof detail, "replay err %.3e (tol %.1e), %s", replay.err,
                     replay.tol, a && b && na == nb && !memcmp(a, b, na) ? "same bytes"
                                                                        : "bytes differ");
            report(tmx_conform_name(i), 0, detail);
        }
        n_ok += ok;
        free(a);
        free(b);
    }
    char detail[96];
    snprintf(detail, sizeof detail, "%d of %d cases (%d of optional ops it lacks skipped)", n_ok,
             n - n_lacking, n_lacking);
    report("graph: every conformance case captured and replayed", n_ok == n - n_lacking, detail);
}

/* --- 2. one graph, inputs rewritten between launches ------------------------------------------ */

#define D 256 /* hidden width */
#define M 512 /* matmul rows: gate and up halves of M / 2 each */

struct chain {
    const struct tmx_kernels *k;
    struct tmx_tensor norm_w, w, gate_w;
    float *x, *h, *y, *out; /* device: x [D], h [D], y [M], out [D] (starts as x) */
};

static void chain_ops(const struct chain *ch) {
    const struct tmx_kernels_i *o = ch->k->ops;
    void *ctx = ch->k->ctx;
    o->rmsnorm(ctx, ch->h, ch->x, &ch->norm_w, 1, D, 1e-5f);
    o->matmul(ctx, ch->y, ch->h, &ch->w, 1);
    o->swiglu(ctx, ch->y, ch->y, ch->y + M / 2, M / 2);
    o->add_gated(ctx, ch->out, ch->y, &ch->gate_w, 1, M / 2 < D ? M / 2 : D);
}

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
}

static int import(const struct tmx_kernels *k, int64_t rows, int64_t cols, unsigned *seed,
                  struct tmx_tensor *dev) {
    size_t count = (size_t)(rows * (cols ? cols : 1));
    uint16_t *bf = malloc(count * sizeof *bf);
    if (!bf) return 0;
    for (size_t i = 0; i < count; i++) bf[i] = tmx_f32_to_bf16(frand(seed));
    struct tmx_tensor h = {TMX_DTYPE_BF16, cols ? 2 : 1, {rows, cols}, bf};
    char *err = NULL;
    int ok = k->ops->weight_import(k->ctx, &h, dev, &err) == TMX_OK;
    free(err);
    free(bf);
    return ok;
}

/* Writes input x (and out = x), runs eagerly or launches g, reads out back. */
static int chain_step(const struct chain *ch, const float *x, void *g, float *got) {
    const struct tmx_kernels_i *o = ch->k->ops;
    void *ctx = ch->k->ctx;
    if (o->buf_write(ctx, ch->x, x, D * sizeof *x) != TMX_OK ||
        o->buf_write(ctx, ch->out, x, D * sizeof *x) != TMX_OK)
        return 0;
    if (g) {
        if (o->graph_launch(ctx, g) != TMX_OK) return 0;
    } else {
        chain_ops(ch);
    }
    return o->sync(ctx) == TMX_OK && o->buf_read(ctx, got, ch->out, D * sizeof *got) == TMX_OK;
}

static void check_chain(const struct tmx_kernels *k) {
    struct chain ch = {.k = k};
    const struct tmx_kernels_i *o = k->ops;
    unsigned seed = 12345;
    void *bufs[4] = {0}, *g = NULL;
    int ok = import(k, D, 0, &seed, &ch.norm_w) && import(k, M, D, &seed, &ch.w) &&
             import(k, D, 0, &seed, &ch.gate_w);
    size_t sizes[4] = {D, D, M, D};
    for (int i = 0; i < 4 && ok; i++) ok = o->buf_alloc(k->ctx, sizes[i] * sizeof(float), &bufs[i]) == TMX_OK;
    if (ok) {
        ch.x = bufs[0], ch.h = bufs[1], ch.y = bufs[2], ch.out = bufs[3];
        ok = o->graph_begin(k->ctx) == TMX_OK;
        if (ok) chain_ops(&ch);
        ok = ok && o->graph_end(k->ctx, &g) == TMX_OK && g;
    }
    int same = ok;
    for (int launch = 0; launch < 3 && ok; launch++) {
        float x[D], eager[D], replay[D];
        for (int i = 0; i < D; i++) x[i] = frand(&seed) * (float)(launch + 1);
        ok = chain_step(&ch, x, NULL, eager) && chain_step(&ch, x, g, replay);
        same = same && ok && memcmp(eager, replay, sizeof eager) == 0;
    }
    report("graph: one capture, 3 launches on rewritten inputs", ok && same,
           ok ? (same ? "bitwise equal to eager" : "differs from eager") : "an op failed");
    if (g) o->graph_free(k->ctx, g);
    for (int i = 0; i < 4; i++)
        if (bufs[i]) o->buf_free(k->ctx, bufs[i]);
    o->weight_free(k->ctx, &ch.norm_w);
    o->weight_free(k->ctx, &ch.w);
    o->weight_free(k->ctx, &ch.gate_w);
}

/* --- 3. a device-side error surfaces at sync -------------------------------------------------- */

static void check_device_error(const struct tmx_kernels *k) {
    const struct tmx_kernels_i *o = k->ops;
    unsigned seed = 7;
    struct tmx_tensor table = {0};
    void *ids = NULL, *out = NULL;
    int32_t bad[2] = {3, 40}; /* the table has 8 rows */
    int ok = import(k, 8, 16, &seed, &table) &&
             o->buf_alloc(k->ctx, sizeof bad, &ids) == TMX_OK &&
             o->buf_alloc(k->ctx, 2 * 16 * sizeof(float), &out) == TMX_OK &&
             o->buf_write(k->ctx, ids, bad, sizeof bad) == TMX_OK && o->sync(k->ctx) == TMX_OK;
    enum tmx_status first = TMX_OK, second = TMX_ERR_INVALID;
    if (ok) {
        o->embed(k->ctx, out, &table, ids, 2);
        first = o->sync(k->ctx);
        second = o->sync(k->ctx);
    }
    report("device error: bad embed id fails the next sync only",
           ok && first == TMX_ERR_INVALID && second == TMX_OK, NULL);
    if (out) o->buf_free(k->ctx, out);
    if (ids) o->buf_free(k->ctx, ids);
    o->weight_free(k->ctx, &table);
}

/* --- 4. fused ops against their parts ---------------------------------------------------------- */

static void check_fused(const struct tmx_kernels *k) {
    int n_fused = 0, n_same = 0;
    for (size_t i = 0; i < tmx_conform_count(); i++) {
        struct tmx_conform_result fused, parts;
        void *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if (run_case(k, i, PARTS, &parts, &b, &nb)) {
            n_fused++;
            n_same += run_case(k, i, EAGER, &fused, &a, &na) && na == nb && !memcmp(a, b, na);
        }
        free(a);
        free(b);
    }
    char detail[64];
    snprintf(detail, sizeof detail, "%d of %d cases bitwise equal", n_same, n_fused);
    report("fused ops equal the ops they stand for", n_fused > 0 && n_same == n_fused, detail);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cuda";
    struct tool_set set;
    if (!tool_set_open(&set, "tmx-graph-check", name)) return 1;
    const struct tmx_kernels k = set.k;
    if (!k.ops->graph_begin || !k.ops->graph_end || !k.ops->graph_launch || !k.ops->graph_free) {
        report("graph ops present", 0, NULL);
    } else {
        check_cases(&k);
        check_chain(&k);
    }
    check_device_error(&k);
    check_fused(&k);
    report("native_stream", k.ops->native_stream && k.ops->native_stream(k.ctx) != NULL, NULL);
    tool_set_close(&set);
    return n_failed ? 1 : 0;
}
