/* test_kernels_cpu.c: the CPU kernel set, loaded as the core loads plugins (dlopen and
 * tmx_plugin_entry) with a host table of the test's own. Its descriptor; every conformance case
 * with 1 and 2 threads; bitwise identical outputs with 1, 2 and 3 threads and, for matmul,
 * whatever the number of rows; option and argument errors reported through init and sync,
 * among them paged KV cache accesses outside the cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/conform.h"
#include "tmx/plugin.h"

#define PLUGIN_PATH TMX_BIN_DIR "/libtmx-kernels-cpu.so"

/* --- the test's host table ------------------------------------------------------------------- */

static int64_t opt_threads; /* what host->opt_int answers for "threads" */
static int n_errors_logged;

static void host_log(enum tmx_log_level level, const char *fmt, ...) {
    if (level == TMX_LOG_ERROR) n_errors_logged++;
    if (level == TMX_LOG_DEBUG) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("[log] ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static enum tmx_status host_err(char **err, enum tmx_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    tmx_verr(err, st, fmt, ap);
    va_end(ap);
    return st;
}

static const char *host_opt_str(const struct tmx_opts *opts, const char *name) {
    (void)opts, (void)name;
    return NULL;
}

static int64_t host_opt_int(const struct tmx_opts *opts, const char *name) {
    (void)opts;
    return strcmp(name, "threads") == 0 ? opt_threads : 0;
}

static double host_opt_float(const struct tmx_opts *opts, const char *name) {
    (void)opts, (void)name;
    return 0;
}

static int host_opt_bool(const struct tmx_opts *opts, const char *name) {
    (void)opts, (void)name;
    return 0;
}

/* As the core says where a value came from (tmx_opts_where). */
static const char *host_opt_where(const struct tmx_opts *opts, const char *name) {
    (void)opts;
    return strcmp(name, "threads") == 0 ? "tmx.json: plugins: kernels.cpu.threads" : name;
}

static const struct tmx_host host = {
    .struct_size = sizeof(struct tmx_host),
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .log = host_log,
    .err = host_err,
    .opt_str = host_opt_str,
    .opt_int = host_opt_int,
    .opt_float = host_opt_float,
    .opt_bool = host_opt_bool,
    .opt_where = host_opt_where,
};

/* --- the plugin ------------------------------------------------------------------------------ */

struct fixture {
    void *dl;
    const struct tmx_plugin *plugin;
    const struct tmx_kernels_i *ops;
};

static int load_plugin(void **state) {
    static struct fixture f;
    f.dl = dlopen(PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
    if (!f.dl) {
        fprintf(stderr, "dlopen %s: %s\n", PLUGIN_PATH, dlerror());
        return -1;
    }
    tmx_plugin_entry_fn entry;
    void *sym = dlsym(f.dl, TMX_PLUGIN_ENTRY_SYMBOL);
    memcpy(&entry, &sym, sizeof entry);
    char *err = NULL;
    f.plugin = entry ? entry(&host, &err) : NULL;
    if (!f.plugin) {
        fprintf(stderr, "%s: no descriptor: %s\n", PLUGIN_PATH, err ? err : "no entry symbol");
        free(err);
        return -1;
    }
    f.ops = f.plugin->ops;
    *state = &f;
    return 0;
}

static int unload_plugin(void **state) {
    struct fixture *f = *state;
    dlclose(f->dl);
    return 0;
}

static void *open_set(const struct fixture *f, int64_t threads) {
    opt_threads = threads;
    void *ctx = NULL;
    char *err = NULL;
    if (f->ops->init(&host, NULL, &ctx, &err) != TMX_OK) fail_msg("init: %s", err);
    return ctx;
}

/* --- descriptor ------------------------------------------------------------------------------ */

static void test_descriptor(void **state) {
    const struct fixture *f = *state;
    const struct tmx_plugin *p = f->plugin;
    assert_int_equal(p->abi_major, TMX_ABI_MAJOR);
    assert_int_equal(p->abi_minor, TMX_ABI_MINOR);
    assert_int_equal(p->struct_size, sizeof(struct tmx_plugin));
    assert_string_equal(p->name, "cpu");
    assert_int_equal(p->kind, TMX_PLUGIN_KERNELS);
    assert_string_equal(p->opts[0].name, "threads");
    assert_int_equal(p->opts[0].type, TMX_OPT_INT);
    assert_string_equal(p->opts[0].def, "0");
    assert_null(p->opts[1].name);

    const struct tmx_kernels_i *ops = f->ops;
    assert_int_equal(ops->struct_size, sizeof(struct tmx_kernels_i));
    assert_null(ops->graph_begin);
    assert_null(ops->graph_end);
    assert_null(ops->graph_launch);
    assert_null(ops->graph_free);
    assert_null(ops->native_stream);
    const void *members[] = {
        ops->init,      ops->fini,      ops->buf_alloc, ops->buf_free,    ops->buf_write,
        ops->buf_read,  ops->weight_import, ops->weight_free, ops->sync,  ops->embed,
        ops->rmsnorm,   ops->matmul,    ops->rope,      ops->kv_store,    ops->attention,
        ops->moe_route, ops->moe_experts, ops->swiglu,  ops->add_gated,   ops->gather,
        ops->moe_experts_partial, ops->moe_combine, ops->argmax, ops->matmul_multi,
        ops->topk,      ops->logit_edit, ops->add_rmsnorm,
    };
    for (size_t i = 0; i < sizeof members / sizeof members[0]; i++) assert_non_null(members[i]);
}

/* --- conformance ----------------------------------------------------------------------------- */

static void conform_all(const struct fixture *f, int64_t threads) {
    void *ctx = open_set(f, threads);
    size_t count = tmx_conform_count();
    struct tmx_conform_result *res = calloc(count, sizeof *res);
    assert_non_null(res);
    int n = 0, failed = 0;
    char *err = NULL;
    if (tmx_conform_run(f->ops, ctx, NULL, res, (int)count, &n, &err) != TMX_OK)
        fail_msg("%s", err);
    assert_int_equal(n, (int)count);
    for (int i = 0; i < n; i++) {
        printf("  %-4s %-48s err %.2e  tol %.0e  %s\n", res[i].pass ? "ok" : "FAIL", res[i].name,
               res[i].err, res[i].tol, tmx_status_str(res[i].status));
        failed += !res[i].pass;
    }
    assert_int_equal(failed, 0);
    free(res);
    f->ops->fini(ctx);
}

static void test_conform_1_thread(void **state) { conform_all(*state, 1); }

static void test_conform_2_threads(void **state) { conform_all(*state, 2); }

/* Every op: what 2 and 3 threads compute is bit for bit what 1 thread computes. The matmul and
 * moe_experts cases are large enough to split into several tasks. */
static void test_threads_bitwise(void **state) {
    const struct fixture *f = *state;
    void *ctx[3] = {open_set(f, 1), open_set(f, 2), open_set(f, 3)};
    for (size_t i = 0; i < tmx_conform_count(); i++) {
        const void *out[3];
        size_t nbytes[3];
        struct tmx_conform_case *c[3];
        for (int t = 0; t < 3; t++) {
            char *err = NULL;
            struct tmx_conform_result r;
            if (tmx_conform_case_new(i, f->ops, ctx[t], &c[t], &err) != TMX_OK)
                fail_msg("%s", err);
            tmx_conform_case_run(c[t]);
            if (tmx_conform_case_check(c[t], &r, &err) != TMX_OK) fail_msg("%s", err);
            assert_int_equal(r.status, TMX_OK);
            out[t] = tmx_conform_case_output(c[t], &nbytes[t]);
            assert_non_null(out[t]);
        }
        for (int t = 1; t < 3; t++) {
            assert_int_equal(nbytes[t], nbytes[0]);
            if (memcmp(out[t], out[0], nbytes[0]) != 0)
                fail_msg("%s: %d threads differ from 1", tmx_conform_name(i), t + 1);
        }
        for (int t = 0; t < 3; t++) tmx_conform_case_free(c[t]);
    }
    for (int t = 0; t < 3; t++) f->ops->fini(ctx[t]);
}

/* Case i's outputs, run as its op (parts 0) or as the ops it fuses (parts 1), into *out
 * (malloc'd); 0 when the op fuses none. */
static int outputs(const struct fixture *f, void *ctx, size_t i, int parts, void **out,
                   size_t *nbytes) {
    struct tmx_conform_case *c;
    struct tmx_conform_result r;
    char *err = NULL;
    if (tmx_conform_case_new(i, f->ops, ctx, &c, &err) != TMX_OK) fail_msg("%s", err);
    const int fused = parts ? tmx_conform_case_run_parts(c) : (tmx_conform_case_run(c), 1);
    if (fused) {
        if (tmx_conform_case_check(c, &r, &err) != TMX_OK) fail_msg("%s", err);
        const void *got = tmx_conform_case_output(c, nbytes);
        assert_non_null(got);
        *out = malloc(*nbytes);
        assert_non_null(*out);
        memcpy(*out, got, *nbytes);
    }
    tmx_conform_case_free(c);
    return fused;
}

/* A fused op (add_rmsnorm) gives bit for bit what the ops it stands for give. */
static void test_fused_equals_parts(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 2);
    int n_fused = 0;
    for (size_t i = 0; i < tmx_conform_count(); i++) {
        void *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if (!outputs(f, ctx, i, 1, &a, &na)) continue;
        outputs(f, ctx, i, 0, &b, &nb);
        assert_int_equal(na, nb);
        if (memcmp(a, b, na) != 0) fail_msg("%s: the fused op differs", tmx_conform_name(i));
        n_fused++;
        free(a);
        free(b);
    }
    assert_true(n_fused >= 4);
    f->ops->fini(ctx);
}

/* A token's output row does not depend on how many rows share the matmul: decode (n = 1)
 * reproduces a prefill of 70 rows bit for bit, for each weight dtype, tails included. */
static void test_matmul_batch_invariant(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 2);
    enum { M = 203, K = 517, N = 70 };
    const enum tmx_dtype dtypes[] = {TMX_DTYPE_F32, TMX_DTYPE_BF16, TMX_DTYPE_F16};
    float *x = malloc(sizeof(float) * N * K), *y = malloc(sizeof(float) * N * M);
    float *row = malloc(sizeof(float) * M), *wf = malloc(sizeof(float) * M * K);
    uint16_t *wh = malloc(sizeof(uint16_t) * M * K);
    assert_true(x && y && row && wf && wh);
    srand(7);
    for (int i = 0; i < N * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int i = 0; i < M * K; i++) wf[i] = (float)rand() / RAND_MAX - 0.5f;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        struct tmx_tensor w = {dtypes[d], 2, {M, K}, wf};
        if (dtypes[d] != TMX_DTYPE_F32) {
            for (int i = 0; i < M * K; i++)
                wh[i] = dtypes[d] == TMX_DTYPE_BF16 ? tmx_f32_to_bf16(wf[i])
                                                    : (uint16_t)(0x3000 + rand() % 0x1000);
            w.data = wh;
        }
        f->ops->matmul(ctx, y, x, &w, N);
        for (int t = 0; t < N; t++) {
            f->ops->matmul(ctx, row, x + (size_t)t * K, &w, 1);
            if (memcmp(row, y + (size_t)t * M, sizeof(float) * M) != 0)
                fail_msg("%s: row %d differs between n = 1 and n = %d", tmx_dtype_name(dtypes[d]),
                         t, N);
        }
        assert_int_equal(f->ops->sync(ctx), TMX_OK);
    }
    free(x), free(y), free(row), free(wf), free(wh);
    f->ops->fini(ctx);
}

/* --- lifecycle, memory and errors ------------------------------------------------------------ */

static void test_init_options(void **state) {
    const struct fixture *f = *state;
    void *ctx = (void *)1;
    char *err = NULL;
    opt_threads = -1;
    assert_int_equal(f->ops->init(&host, NULL, &ctx, &err), TMX_ERR_INVALID);
    assert_null(ctx);
    assert_non_null(err);
    assert_non_null(strstr(err, "tmx.json: plugins: kernels.cpu.threads = -1: want 0"));
    free(err);
    f->ops->fini(NULL);
    ctx = open_set(f, 0); /* one thread per online CPU */
    f->ops->fini(ctx);
}

/* host_threads lends the set's pool (ABI 2.7): n_threads as configured, every item run once,
 * thread indexes below n_threads, and the pool still the set's for its own ops afterwards. */
struct lent_items {
    int seen[1000];
    int bad_thread;
};

static void lent_item(void *arg, int64_t item, int thread) {
    struct lent_items *l = arg;
    l->seen[item]++;
    if (thread < 0 || thread >= 3) l->bad_thread = 1;
}

static void test_host_threads(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 3);
    struct tmx_threads t = {0};
    f->ops->host_threads(ctx, &t);
    assert_int_equal(t.n_threads, 3);
    static struct lent_items l;
    for (int round = 0; round < 3; round++) {
        memset(&l, 0, sizeof l);
        t.run(t.pool, 1000, lent_item, &l);
        for (int i = 0; i < 1000; i++) assert_int_equal(l.seen[i], 1);
        assert_false(l.bad_thread);
    }
    float in[64], out[64];
    for (int i = 0; i < 64; i++) in[i] = (float)i / 8;
    f->ops->swiglu(ctx, out, in, in, 64);
    assert_int_equal(f->ops->sync(ctx), TMX_OK);
    for (int i = 0; i < 64; i++)
        assert_float_equal(out[i], in[i] * in[i] / (1 + expf(-in[i])), 1e-5);
    f->ops->fini(ctx);
}

static void test_buffers(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 2);
    unsigned char *buf = NULL, back[100], data[100];
    assert_int_equal(f->ops->buf_alloc(ctx, sizeof data, (void **)&buf), TMX_OK);
    assert_int_equal((uintptr_t)buf % 64, 0);
    for (size_t i = 0; i < sizeof data; i++) {
        assert_int_equal(buf[i], 0);
        data[i] = (unsigned char)(i * 7);
    }
    assert_int_equal(f->ops->buf_write(ctx, buf + 3, data, sizeof data - 3), TMX_OK);
    assert_int_equal(f->ops->buf_read(ctx, back, buf + 3, sizeof data - 3), TMX_OK);
    assert_memory_equal(back, data, sizeof data - 3);
    f->ops->buf_free(ctx, buf);

    float w[6] = {1, 2, 3, 4, 5, 6};
    struct tmx_tensor h = {TMX_DTYPE_F32, 2, {2, 3}, w}, d;
    char *err = NULL;
    assert_int_equal(f->ops->weight_import(ctx, &h, &d, &err), TMX_OK);
    assert_ptr_equal(d.data, w); /* aliased, not copied */
    assert_int_equal(d.shape[1], 3);
    f->ops->weight_free(ctx, &d);
    assert_int_equal(w[5], 6);
    f->ops->fini(ctx);
}

/* Bad arguments: the op does nothing, logs one error, and the next sync (only) returns it. */
static void test_errors(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 2);
    const struct tmx_kernels_i *ops = f->ops;
    char *err = NULL;
    int32_t packed[4] = {0};
    struct tmx_tensor h = {TMX_DTYPE_I32, 1, {4}, packed}, d;
    assert_int_equal(ops->weight_import(ctx, &h, &d, &err), TMX_ERR_UNSUPPORTED);
    assert_non_null(strstr(err, "I32"));
    free(err);

    float x[8] = {0}, y[8] = {0}, wdata[8] = {0};
    struct tmx_tensor vec = {TMX_DTYPE_F32, 1, {8}, wdata};
    int logged = n_errors_logged;
    ops->matmul(ctx, y, x, &vec, 1);
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    assert_int_equal(ops->sync(ctx), TMX_OK);

    struct tmx_tensor table = {TMX_DTYPE_F32, 2, {2, 4}, wdata};
    int32_t ids[2] = {1, 2};
    ops->embed(ctx, y, &table, ids, 2);
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);

    struct tmx_tensor fp8 = {TMX_DTYPE_F8_E4M3, 2, {2, 4}, wdata};
    struct tmx_kv_cache kv = {TMX_DTYPE_F32, 1, 2, 2, 1, x, y, NULL, NULL};
    int32_t zero[1] = {0};
    ops->matmul(ctx, y, x, &fp8, 1);
    ops->attention(ctx, y, x, &kv, zero, 1, zero, zero, 1, 3, 0, 1.0f); /* 3 heads over 2 */
    assert_int_equal(ops->sync(ctx), TMX_ERR_UNSUPPORTED);               /* the first failure */
    assert_int_equal(n_errors_logged, logged + 4);
    ops->fini(ctx);
}

/* The paged ops refuse what would read or write outside the cache, and caches they cannot
 * decode; a refused op writes nothing. */
static void test_paged_errors(void **state) {
    const struct fixture *f = *state;
    void *ctx = open_set(f, 2);
    const struct tmx_kernels_i *ops = f->ops;
    float k[8] = {1, 2, 3, 4, 5, 6, 7, 8}, kc[16] = {0}, vc[16] = {0}, out[8];
    float ks[4] = {0}, vs[4] = {0};
    /* 2 blocks of 2 slots, 1 KV head of 4 */
    struct tmx_kv_cache kv = {TMX_DTYPE_F32, 2, 2, 1, 4, kc, vc, NULL, NULL};
    int32_t slots[2] = {1, 4}, seq[1] = {0}, pos[1] = {3}, table[2] = {1, -1};
    int logged = n_errors_logged;

    ops->kv_store(ctx, &kv, k, k, slots, 2); /* slot 4 is past the cache */
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    assert_float_equal(kc[4], 0, 0);
    slots[1] = -1; /* skipped */
    ops->kv_store(ctx, &kv, k, k, slots, 2);
    assert_int_equal(ops->sync(ctx), TMX_OK);
    assert_memory_equal(kc + 4, k, 4 * sizeof *k);

    ops->attention(ctx, out, k, &kv, table, 2, seq, pos, 1, 1, 0, 1.0f); /* reads entry 1: -1 */
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    ops->attention(ctx, out, k, &kv, table, 2, seq, pos, 1, 1, 2, 1.0f); /* window 2: block 1 */
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    table[0] = 0, table[1] = 1, pos[0] = 4; /* position 4 needs a third table entry */
    ops->attention(ctx, out, k, &kv, table, 2, seq, pos, 1, 1, 0, 1.0f);
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);

    kv.dtype = TMX_DTYPE_F8_E4M3; /* scales missing */
    ops->kv_store(ctx, &kv, k, k, slots, 2);
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    kv.k_scale = ks, kv.v_scale = vs, kv.dtype = TMX_DTYPE_F16;
    ops->kv_store(ctx, &kv, k, k, slots, 2);
    assert_int_equal(ops->sync(ctx), TMX_ERR_UNSUPPORTED);

    int32_t rows[2] = {0, -1};
    ops->gather(ctx, out, k, rows, 2, 4);
    assert_int_equal(ops->sync(ctx), TMX_ERR_INVALID);
    assert_int_equal(n_errors_logged, logged + 7);
    ops->fini(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_descriptor),
        cmocka_unit_test(test_init_options),
        cmocka_unit_test(test_host_threads),
        cmocka_unit_test(test_buffers),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_paged_errors),
        cmocka_unit_test(test_conform_1_thread),
        cmocka_unit_test(test_conform_2_threads),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_fused_equals_parts),
        cmocka_unit_test(test_matmul_batch_invariant),
    };
    return cmocka_run_group_tests(tests, load_plugin, unload_plugin);
}
