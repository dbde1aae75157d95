/* test_comm.c: the threads backend of tmx/comm.h with 1..4 ranks (all-reduce F32/BF16 equal to
 * the rank-order sum on every rank, both all-reduce algorithms, all-gather, broadcast, barrier,
 * mismatched calls, a long mixed run), argument checks, and the mpi and nccl backends' answers
 * when they cannot start. The mpi backend itself runs under mpirun (tmx-comm-check). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tmx/comm.h"

/* --- running ranks on threads ------------------------------------------------------------------
 * CMocka's asserts cannot run on other threads: a rank counts its failures in `bad`, the test
 * asserts after joining. */
struct rank {
    tmx_comm_t *c;
    int bad;
    enum tmx_status st; /* the last failed call's status */
    char *err;
    const void *arg;
};

static void note(struct rank *rk, enum tmx_status st, char *err) {
    if (st == TMX_OK) return;
    rk->bad++, rk->st = st;
    if (!rk->err) rk->err = err;
    else free(err);
}

static void run_ranks(int n, void *(*fn)(void *), const void *arg, struct rank *rk) {
    tmx_comm_group_t *g = NULL;
    char *err = NULL;
    assert_int_equal(tmx_comm_group_new(n, &g, &err), TMX_OK);
    pthread_t th[8];
    for (int r = 0; r < n; r++) {
        rk[r] = (struct rank){tmx_comm_group_rank(g, r), 0, TMX_OK, NULL, arg};
        assert_non_null(rk[r].c);
        assert_int_equal(pthread_create(&th[r], NULL, fn, &rk[r]), 0);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    tmx_comm_group_free(g);
}

static void assert_all_good(int n, struct rank *rk) {
    for (int r = 0; r < n; r++) {
        if (rk[r].bad) print_error("rank %d: %d failures; %s\n", r, rk[r].bad,
                                   rk[r].err ? rk[r].err : "wrong results");
        assert_int_equal(rk[r].bad, 0);
    }
}

/* --- inputs and expected sums ----------------------------------------------------------------- */

/* Rank k's element i of vector `seed`: magnitudes over 2^-8..2^8, so that the order of the
 * additions shows in the rounding. */
static float value(uint32_t seed, int k, size_t i) {
    uint64_t x = ((uint64_t)seed << 40) ^ ((uint64_t)k << 32) ^ i;
    x = (x ^ (x >> 31)) * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 29)) * 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    float mant = (float)(x & 0xffffff) / (float)(1 << 23) - 1.0f; /* [-1, 1) */
    int e = (int)((x >> 24) % 17) - 8;
    return mant * (e < 0 ? 1.0f / (float)(1 << -e) : (float)(1 << e));
}

static void fill(void *buf, uint32_t seed, int k, size_t count, enum tmx_dtype dt) {
    for (size_t i = 0; i < count; i++) {
        float v = value(seed, k, i);
        if (dt == TMX_DTYPE_F32) ((float *)buf)[i] = v;
        else ((uint16_t *)buf)[i] = tmx_f32_to_bf16(v);
    }
}

/* The rank-order sum in F32, BF16 inputs widened and the sum rounded once. */
static void expect(void *out, uint32_t seed, int n, size_t count, enum tmx_dtype dt) {
    for (size_t i = 0; i < count; i++) {
        float acc = 0.0f;
        for (int k = 0; k < n; k++) {
            float v = value(seed, k, i);
            if (dt == TMX_DTYPE_BF16) v = tmx_bf16_to_f32(tmx_f32_to_bf16(v));
            acc = k ? acc + v : v;
        }
        if (dt == TMX_DTYPE_F32) ((float *)out)[i] = acc;
        else ((uint16_t *)out)[i] = tmx_f32_to_bf16(acc);
    }
}

/* One all-reduce of `count` elements, checked bit for bit against expect(). */
static void allreduce_once(struct rank *rk, uint32_t seed, size_t count, enum tmx_dtype dt) {
    const int n = tmx_comm_size(rk->c);
    size_t bytes = count * tmx_dtype_size(dt) + 1;
    unsigned char *buf = malloc(bytes), *want = malloc(bytes);
    if (!buf || !want) {
        rk->bad++;
    } else {
        fill(buf, seed, tmx_comm_rank(rk->c), count, dt);
        expect(want, seed, n, count, dt);
        char *err = NULL;
        enum tmx_status st = tmx_comm_allreduce_sum(rk->c, count ? buf : NULL, count, dt, &err);
        note(rk, st, err);
        if (st == TMX_OK && memcmp(buf, want, bytes - 1) != 0) rk->bad++;
    }
    free(buf);
    free(want);
}

/* --- all-reduce ------------------------------------------------------------------------------- */

/* 0, 1, odd, block edges, and both sides of TMX_COMM_SMALL_BYTES for F32 and BF16. */
static const size_t lengths[] = {0, 1, 2, 3, 7, 255, 256, 257, 1001, 8192, 8193, 16385, 33333};
enum { N_LENGTHS = sizeof lengths / sizeof lengths[0] };

static void *allreduce_worker(void *p) {
    struct rank *rk = p;
    for (size_t i = 0; i < N_LENGTHS; i++) {
        allreduce_once(rk, (uint32_t)i, lengths[i], TMX_DTYPE_F32);
        allreduce_once(rk, (uint32_t)i + 100, lengths[i], TMX_DTYPE_BF16);
    }
    return NULL;
}

static void test_allreduce_is_the_rank_order_sum(void **state) {
    (void)state;
    struct rank rk[4];
    for (int n = 1; n <= 4; n++) {
        run_ranks(n, allreduce_worker, NULL, rk);
        assert_all_good(n, rk);
    }
}

/* ((1e8 + 1) - 1e8) + 2 is 2 in F32 (1e8 + 1 rounds to 1e8); the reverse order gives 1. */
static void *order_worker(void *p) {
    struct rank *rk = p;
    const float x[4] = {1e8f, 1.0f, -1e8f, 2.0f};
    float v = x[tmx_comm_rank(rk->c)];
    note(rk, tmx_comm_allreduce_sum(rk->c, &v, 1, TMX_DTYPE_F32, NULL), NULL);
    if (v != 2.0f) rk->bad++;
    return NULL;
}

static void test_allreduce_adds_in_rank_order(void **state) {
    (void)state;
    struct rank rk[4];
    run_ranks(4, order_worker, NULL, rk);
    assert_all_good(4, rk);
}

/* --- all-gather, broadcast, barrier ----------------------------------------------------------- */

static unsigned char byte_of(int k, size_t i) { return (unsigned char)(k * 131 + i * 7 + 1); }

static void *gather_bcast_worker(void *p) {
    struct rank *rk = p;
    const int n = tmx_comm_size(rk->c), me = tmx_comm_rank(rk->c);
    static const size_t sizes[] = {0, 1, 13, 4096, 100003};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const size_t nb = sizes[s];
        unsigned char *send = malloc(nb + 1), *recv = malloc((size_t)n * nb + 1);
        if (!send || !recv) {
            rk->bad++;
            free(send), free(recv);
            continue;
        }
        for (size_t i = 0; i < nb; i++) send[i] = byte_of(me, i);
        char *err = NULL;
        note(rk, tmx_comm_allgather(rk->c, send, recv, nb, &err), err);
        for (int k = 0; k < n; k++)
            for (size_t i = 0; i < nb; i++) rk->bad += recv[(size_t)k * nb + i] != byte_of(k, i);
        /* In place: this rank's block of recv is its input. */
        memset(recv, 0, (size_t)n * nb);
        memcpy(recv + (size_t)me * nb, send, nb);
        err = NULL;
        note(rk, tmx_comm_allgather(rk->c, recv + (size_t)me * nb, recv, nb, &err), err);
        for (int k = 0; k < n; k++)
            for (size_t i = 0; i < nb; i++) rk->bad += recv[(size_t)k * nb + i] != byte_of(k, i);
        for (int root = 0; root < n; root++) {
            for (size_t i = 0; i < nb; i++) send[i] = byte_of(me, i);
            err = NULL;
            note(rk, tmx_comm_broadcast(rk->c, send, nb, root, &err), err);
            for (size_t i = 0; i < nb; i++) rk->bad += send[i] != byte_of(root, i);
        }
        free(send);
        free(recv);
    }
    return NULL;
}

static void test_allgather_and_broadcast(void **state) {
    (void)state;
    struct rank rk[4];
    for (int n = 1; n <= 4; n++) {
        run_ranks(n, gather_bcast_worker, NULL, rk);
        assert_all_good(n, rk);
    }
}

/* Nobody leaves barrier i before everyone has arrived at it. */
static atomic_int arrivals;

static void *barrier_worker(void *p) {
    struct rank *rk = p;
    const int n = tmx_comm_size(rk->c);
    for (int i = 0; i < 2000; i++) {
        atomic_fetch_add(&arrivals, 1);
        note(rk, tmx_comm_barrier(rk->c, NULL), NULL);
        if (atomic_load(&arrivals) < n * (i + 1)) rk->bad++;
    }
    return NULL;
}

static void test_barrier_waits_for_everyone(void **state) {
    (void)state;
    struct rank rk[4];
    for (int n = 1; n <= 4; n++) {
        atomic_store(&arrivals, 0);
        run_ranks(n, barrier_worker, NULL, rk);
        assert_all_good(n, rk);
        assert_int_equal(atomic_load(&arrivals), n * 2000);
    }
}

/* --- many calls ------------------------------------------------------------------------------- */

/* A decode-like stream of small all-reduces, with large ones, broadcasts and barriers between,
 * so that ranks run ahead into the next call while others still read the last. */
static void *stress_worker(void *p) {
    struct rank *rk = p;
    const int n = tmx_comm_size(rk->c), me = tmx_comm_rank(rk->c);
    for (int it = 0; it < 3000 && !rk->bad; it++) {
        allreduce_once(rk, (uint32_t)it, (size_t)(it * 37 % 700 + 1),
                       it & 1 ? TMX_DTYPE_BF16 : TMX_DTYPE_F32);
        if (it % 50 == 0) allreduce_once(rk, (uint32_t)it + 7, 20000, TMX_DTYPE_F32);
        if (it % 5 == 0) {
            int v = me == it % n ? it : -1;
            note(rk, tmx_comm_broadcast(rk->c, &v, sizeof v, it % n, NULL), NULL);
            rk->bad += v != it;
        }
        if (it % 3 == 0) note(rk, tmx_comm_barrier(rk->c, NULL), NULL);
    }
    return NULL;
}

static void test_many_mixed_calls(void **state) {
    (void)state;
    struct rank rk[4];
    for (int n = 2; n <= 4; n += 2) {
        run_ranks(n, stress_worker, NULL, rk);
        assert_all_good(n, rk);
    }
}

/* Waits that only sleep, and waits that spin a long time first (the default depends on the
 * machine's CPU count). */
static void test_barrier_spin_settings(void **state) {
    (void)state;
    struct rank rk[3];
    const char *spins[] = {"0", "2000"};
    for (int i = 0; i < 2; i++) {
        setenv("TMX_COMM_SPIN_US", spins[i], 1);
        run_ranks(3, allreduce_worker, NULL, rk);
        unsetenv("TMX_COMM_SPIN_US");
        assert_all_good(3, rk);
    }
}

/* --- wrong calls ------------------------------------------------------------------------------ */

/* Rank 1 all-reduces one element more than rank 0: both are told, neither hangs, and the next
 * matching call works. */
static void *mismatch_worker(void *p) {
    struct rank *rk = p;
    const int me = tmx_comm_rank(rk->c);
    float v[3] = {1, 2, 3};
    char *err = NULL;
    enum tmx_status st = tmx_comm_allreduce_sum(rk->c, v, 2 + (size_t)me, TMX_DTYPE_F32, &err);
    if (st != TMX_ERR_INVALID || !err || !strstr(err, "called allreduce")) rk->bad++;
    free(err);
    v[0] = 1.0f;
    note(rk, tmx_comm_allreduce_sum(rk->c, v, 1, TMX_DTYPE_F32, NULL), NULL);
    rk->bad += v[0] != 2.0f;
    return NULL;
}

static void test_mismatched_calls_fail_on_every_rank(void **state) {
    (void)state;
    struct rank rk[2];
    run_ranks(2, mismatch_worker, NULL, rk);
    assert_all_good(2, rk);
}

static void test_bad_arguments(void **state) {
    (void)state;
    tmx_comm_group_t *g = NULL;
    char *err = NULL;
    assert_int_equal(tmx_comm_group_new(0, &g, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "0 ranks"));
    free(err), err = NULL;
    assert_null(g);
    setenv("TMX_COMM_SPIN_US", "lots", 1);
    assert_int_equal(tmx_comm_group_new(2, &g, &err), TMX_ERR_INVALID);
    unsetenv("TMX_COMM_SPIN_US");
    assert_non_null(strstr(err, "TMX_COMM_SPIN_US"));
    free(err), err = NULL;

    assert_int_equal(tmx_comm_group_new(1, &g, &err), TMX_OK);
    assert_null(tmx_comm_group_rank(g, 1));
    assert_null(tmx_comm_group_rank(g, -1));
    tmx_comm_t *c = tmx_comm_group_rank(g, 0);
    assert_int_equal(tmx_comm_rank(c), 0);
    assert_int_equal(tmx_comm_size(c), 1);
    assert_int_equal(tmx_comm_backend(c), TMX_COMM_THREADS);
    assert_string_equal(tmx_comm_backend_name(tmx_comm_backend(c)), "threads");
    tmx_comm_free(c); /* a group's communicator: nothing happens */
    uint16_t h[2] = {0};
    assert_int_equal(tmx_comm_allreduce_sum(c, h, 2, TMX_DTYPE_F16, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "F16"));
    free(err), err = NULL;
    assert_int_equal(tmx_comm_broadcast(c, h, 2, 1, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "root 1"));
    free(err), err = NULL;
    assert_int_equal(tmx_comm_allgather(c, NULL, h, 2, &err), TMX_ERR_INVALID);
    free(err), err = NULL;
    assert_int_equal(tmx_comm_barrier(NULL, &err), TMX_ERR_INVALID);
    free(err), err = NULL;
    tmx_comm_group_free(g);
    tmx_comm_group_free(NULL);
}

/* --- mpi and nccl that cannot start ----------------------------------------------------------- */

static void test_mpi_outside_mpirun(void **state) {
    (void)state;
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMIX_RANK");
    assert_int_equal(tmx_comm_mpi_launched(), 0);
    tmx_comm_t *c = (tmx_comm_t *)1;
    char *err = NULL;
    assert_int_equal(tmx_comm_mpi_new(&c, &err), TMX_ERR_UNSUPPORTED);
    assert_null(c);
    /* "not started by mpirun" or "built without MPI" */
    assert_true(strstr(err, "mpirun") || strstr(err, "without MPI"));
    free(err);
}

static void *nccl_worker(void *p) {
    struct rank *rk = p;
    tmx_comm_t *c = NULL;
    char *err = NULL;
    enum tmx_status st = tmx_comm_nccl_new(rk->c, &c, &err);
    if (st != TMX_ERR_UNSUPPORTED || c || !err || !strstr(err, rk->arg)) rk->bad++;
    free(err);
    tmx_comm_free(c);
    return NULL;
}

/* Both ranks are told, naming the library, and neither waits for the other. (The library is
 * opened once per process: this sets its name before any test opens it.) */
static void test_nccl_without_the_library(void **state) {
    (void)state;
    char *err = NULL;
    tmx_comm_t *c = NULL;
    assert_int_equal(tmx_comm_nccl_new(NULL, &c, &err), TMX_ERR_INVALID);
    free(err);
    const char *lib = "/nonexistent/libnccl.so.2";
    setenv("TMX_NCCL_LIBRARY", lib, 1);
    struct rank rk[2];
    run_ranks(2, nccl_worker, lib, rk);
    assert_all_good(2, rk);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_allreduce_is_the_rank_order_sum),
        cmocka_unit_test(test_allreduce_adds_in_rank_order),
        cmocka_unit_test(test_allgather_and_broadcast),
        cmocka_unit_test(test_barrier_waits_for_everyone),
        cmocka_unit_test(test_many_mixed_calls),
        cmocka_unit_test(test_barrier_spin_settings),
        cmocka_unit_test(test_mismatched_calls_fail_on_every_rank),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_mpi_outside_mpirun),
        cmocka_unit_test(test_nccl_without_the_library),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
