/* comm_check.c: the collectives of tmx/comm.h under one backend, checked and timed. Built as
 * bin/tmx-comm-check; ctest runs it for threads and under mpirun (tests/CMakeLists.txt),
 * tests/tp/netns.sh across two network namespaces.
 *
 *     tmx-comm-check --backend threads [--ranks N]     N threads of this process (default 2)
 *     mpirun -np N tmx-comm-check --backend mpi        one rank per process
 *     tmx-comm-check --backend nccl [--ranks N]        one thread per GPU (default 1), or
 *     mpirun -np N tmx-comm-check --backend nccl       one process per GPU, id through MPI
 *     [--iters K]                                      timed calls per size (default: 0.25 s)
 *
 * Checks: all-reduce F32 and BF16 of lengths 0..100003 against the rank-order sum (bit for bit;
 * nccl with several ranks within its rounding, and equal on every rank), all-gather, broadcast
 * from every root, barrier. Then the time per all-reduce for 1 KB..1 MB. Rank 0 prints one
 * PASS/FAIL line per check and the table; exit status 0 when all pass, 1 when one fails, 77 when
 * the backend cannot run here (nccl in a build without CUDA). nccl buffers are device memory
 * (cudaMalloc), so that part is compiled only when the build has CUDA. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tmx/comm.h"

#ifdef TMX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* --- buffers: host memory, or device memory for nccl ------------------------------------------ */

struct mem {
    void *(*alloc)(size_t n);
    void (*release)(void *p);
    void (*put)(void *dst, const void *src, size_t n); /* host -> buffer */
    void (*get)(void *dst, const void *src, size_t n); /* buffer -> host */
    void (*sync)(void *stream);                        /* the collectives queued so far are done */
};

/* Host memory, or the end of the check: ranks must not skip a collective the others make. */
static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "tmx-comm-check: out of memory\n");
        exit(1);
    }
    return p;
}

static void *host_alloc(size_t n) { return xmalloc(n); }
static void host_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static void host_sync(void *stream) { (void)stream; }
static const struct mem host_mem = {host_alloc, free, host_copy, host_copy, host_sync};

#ifdef TMX_HAVE_CUDA
/* A CUDA failure ends the check: it is a test program, and the rank cannot continue. */
static void cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "tmx-comm-check: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
}
static void *dev_alloc(size_t n) {
    void *p = NULL;
    cuda_ok(cudaMalloc(&p, n ? n : 1), "cudaMalloc");
    return p;
}
static void dev_release(void *p) { cuda_ok(cudaFree(p), "cudaFree"); }
static void dev_put(void *dst, const void *src, size_t n) {
    cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
static void dev_get(void *dst, const void *src, size_t n) {
    cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
static void dev_sync(void *stream) { cuda_ok(cudaStreamSynchronize(stream), "stream sync"); }
static const struct mem dev_mem = {dev_alloc, dev_release, dev_put, dev_get, dev_sync};
#endif

/* --- one rank --------------------------------------------------------------------------------- */

struct rank {
    tmx_comm_t *c;    /* the communicator checked */
    tmx_comm_t *host; /* the same ranks with host buffers (c itself, or nccl's boot): verdicts */
    const struct mem *mem;
    void *stream;     /* nccl: c's stream */
    int iters;        /* timed calls per size (rounded up to tens); 0: a quarter second's worth */
    int failed;       /* checks that failed */
    int device;       /* nccl: the CUDA device */
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A failed call prints its message and counts against the current check. */
static int ok(struct rank *rk, enum tmx_status st, char *err) {
    if (st == TMX_OK) return 1;
    fprintf(stderr, "tmx-comm-check: rank %d: %s\n", tmx_comm_rank(rk->host),
            err ? err : tmx_status_str(st));
    free(err);
    return 0;
}

/* Every rank's count of bad results is summed; rank 0 prints the verdict. */
static void verdict(struct rank *rk, const char *what, int bad) {
    float sum = (float)bad;
    if (!ok(rk, tmx_comm_allreduce_sum(rk->host, &sum, 1, TMX_DTYPE_F32, NULL), NULL)) sum = 1;
    if (tmx_comm_rank(rk->host) == 0) printf("%s %s\n", sum == 0 ? "PASS" : "FAIL", what);
    rk->failed += sum != 0;
}

/* Rank k's element i of vector `seed`, magnitudes 2^-8..2^8 (the order of the additions shows
 * in the rounding). */
static float value(uint32_t seed, int k, size_t i) {
    uint64_t x = ((uint64_t)seed << 40) ^ ((uint64_t)k << 32) ^ i;
    x = (x ^ (x >> 31)) * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 29)) * 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    float mant = (float)(x & 0xffffff) / (float)(1 << 23) - 1.0f;
    int e = (int)((x >> 24) % 17) - 8;
    return mant * (e < 0 ? 1.0f / (float)(1 << -e) : (float)(1 << e));
}

static float widen(const void *buf, size_t i, enum tmx_dtype dt) {
    return dt == TMX_DTYPE_F32 ? ((const float *)buf)[i]
                               : tmx_bf16_to_f32(((const uint16_t *)buf)[i]);
}

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* One all-reduce of count elements. threads, mpi and one nccl rank must give the rank-order sum
 * exactly; nccl with several ranks adds in its own order, rounding BF16 at each step: within
 * n roundings of the sum of magnitudes. Every rank must hold the same bits. */
static int allreduce_case(struct rank *rk, uint32_t seed, size_t count, enum tmx_dtype dt) {
    const int n = tmx_comm_size(rk->c), me = tmx_comm_rank(rk->c);
    const size_t es = dt == TMX_DTYPE_F32 ? 4 : 2, bytes = count * es;
    const int exact = tmx_comm_backend(rk->c) != TMX_COMM_NCCL || n == 1;
    unsigned char *in = xmalloc(bytes), *got = xmalloc(bytes);
    for (size_t i = 0; i < count; i++) {
        float v = value(seed, me, i);
        if (dt == TMX_DTYPE_F32) ((float *)in)[i] = v;
        else ((uint16_t *)in)[i] = tmx_f32_to_bf16(v);
    }
    void *buf = rk->mem->alloc(bytes);
    rk->mem->put(buf, in, bytes);
    char *err = NULL;
    int bad = !ok(rk, tmx_comm_allreduce_sum(rk->c, buf, count, dt, &err), err);
    rk->mem->sync(rk->stream);
    rk->mem->get(got, buf, bytes);
    const float ulp = dt == TMX_DTYPE_F32 ? 0x1p-23f : 0x1p-8f;
    for (size_t i = 0; i < count; i++) {
        float acc = 0.0f, mag = 0.0f;
        for (int k = 0; k < n; k++) {
            float v = value(seed, k, i);
            if (dt == TMX_DTYPE_BF16) v = tmx_bf16_to_f32(tmx_f32_to_bf16(v));
            acc = k ? acc + v : v;
            mag += fabsf(v);
        }
        float want = dt == TMX_DTYPE_F32 ? acc : tmx_bf16_to_f32(tmx_f32_to_bf16(acc));
        float g = widen(got, i, dt);
        bad += exact ? memcmp(&g, &want, sizeof g) != 0 : fabsf(g - want) > (float)n * ulp * mag;
    }
    /* the same bits on every rank */
    uint64_t h = fnv(got, bytes), *all = xmalloc((size_t)n * sizeof h);
    bad += !ok(rk, tmx_comm_allgather(rk->host, &h, all, sizeof h, NULL), NULL);
    for (int k = 0; k < n; k++) bad += all[k] != h;
    free(all);
    rk->mem->release(buf);
    free(in);
    free(got);
    return bad;
}

static unsigned char byte_of(int k, size_t i) { return (unsigned char)(k * 131 + i * 7 + 1); }

static int gather_bcast_case(struct rank *rk, size_t nb) {
    const int n = tmx_comm_size(rk->c), me = tmx_comm_rank(rk->c);
    unsigned char *h = xmalloc((size_t)n * nb);
    void *send = rk->mem->alloc(nb), *recv = rk->mem->alloc((size_t)n * nb);
    for (size_t i = 0; i < nb; i++) h[i] = byte_of(me, i);
    rk->mem->put(send, h, nb);
    int bad = !ok(rk, tmx_comm_allgather(rk->c, send, recv, nb, NULL), NULL);
    rk->mem->sync(rk->stream);
    rk->mem->get(h, recv, (size_t)n * nb);
    for (int k = 0; k < n; k++)
        for (size_t i = 0; i < nb; i++) bad += h[(size_t)k * nb + i] != byte_of(k, i);
    for (int root = 0; root < n; root++) {
        for (size_t i = 0; i < nb; i++) h[i] = byte_of(me, i);
        rk->mem->put(send, h, nb);
        bad += !ok(rk, tmx_comm_broadcast(rk->c, send, nb, root, NULL), NULL);
        rk->mem->sync(rk->stream);
        rk->mem->get(h, send, nb);
        for (size_t i = 0; i < nb; i++) bad += h[i] != byte_of(root, i);
    }
    rk->mem->release(send);
    rk->mem->release(recv);
    free(h);
    return bad;
}

/* Seconds per all-reduce of `bytes`, on rank 0's clock: chunks of ten calls until they have
 * taken a quarter second (or made --iters calls); between chunks, untimed, rank 0 tells the
 * others whether to go on. */
static double time_allreduce(struct rank *rk, size_t bytes, enum tmx_dtype dt, void *buf) {
    const size_t count = bytes / (dt == TMX_DTYPE_F32 ? 4 : 2);
    double spent = 0.0;
    int calls = 0, bad = 0, more = 1;
    while (more && !bad) {
        double t0 = now();
        for (int i = 0; i < 10 && !bad; i++)
            bad += !ok(rk, tmx_comm_allreduce_sum(rk->c, buf, count, dt, NULL), NULL);
        rk->mem->sync(rk->stream);
        spent += now() - t0, calls += 10;
        more = rk->iters ? calls < rk->iters : spent < 0.25;
        bad += !ok(rk, tmx_comm_broadcast(rk->host, &more, sizeof more, 0, NULL), NULL);
    }
    return bad ? -1.0 : spent / calls;
}

static void rank_main(struct rank *rk) {
    const int me = tmx_comm_rank(rk->c), n = tmx_comm_size(rk->c);
    if (me == 0)
        printf("tmx-comm-check: backend %s, %d rank%s\n",
               tmx_comm_backend_name(tmx_comm_backend(rk->c)), n, n == 1 ? "" : "s");

    static const size_t lengths[] = {0, 1, 3, 256, 1001, 8193, 16385, 100003};
    enum { N_LENGTHS = sizeof lengths / sizeof lengths[0] };
    const enum tmx_dtype dts[2] = {TMX_DTYPE_F32, TMX_DTYPE_BF16};
    for (int d = 0; d < 2; d++) {
        int bad = 0;
        for (size_t i = 0; i < N_LENGTHS; i++)
            bad += allreduce_case(rk, (uint32_t)(i + 10 * d), lengths[i], dts[d]);
        char what[96];
        snprintf(what, sizeof what, "allreduce %s, %d lengths 0..%zu", d ? "bf16" : "f32",
                 (int)N_LENGTHS, lengths[N_LENGTHS - 1]);
        verdict(rk, what, bad);
    }
    int bad = 0;
    static const size_t sizes[] = {1, 1000, 65536 + 3};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        bad += gather_bcast_case(rk, sizes[i]);
    verdict(rk, "allgather and broadcast from every root, 1..65539 bytes", bad);
    bad = 0;
    for (int i = 0; i < 100; i++) bad += !ok(rk, tmx_comm_barrier(rk->c, NULL), NULL);
    rk->mem->sync(rk->stream);
    verdict(rk, "100 barriers", bad);

    if (me == 0)
        printf("allreduce latency, us per call (rank 0)\n%10s %10s %10s\n", "bytes", "f32",
               "bf16");
    const size_t max = (size_t)1 << 20;
    void *buf = rk->mem->alloc(max);
    unsigned char *zero = xmalloc(max);
    memset(zero, 0, max);
    rk->mem->put(buf, zero, max); /* sums of zeros stay zero */
    bad = 0;
    for (size_t bytes = 1024; bytes <= max; bytes *= 4) {
        double f = time_allreduce(rk, bytes, TMX_DTYPE_F32, buf),
               b = time_allreduce(rk, bytes, TMX_DTYPE_BF16, buf);
        bad += f < 0 || b < 0;
        if (me == 0) printf("%10zu %10.1f %10.1f\n", bytes, f * 1e6, b * 1e6);
    }
    rk->mem->release(buf);
    free(zero);
    verdict(rk, "timed allreduces", bad);
    if (me == 0) printf("%s\n", rk->failed ? "FAIL" : "PASS");
}

/* --- backends --------------------------------------------------------------------------------- */

static void *threads_rank(void *p) {
    rank_main(p);
    return NULL;
}

#ifdef TMX_HAVE_CUDA
/* An nccl rank: on its device, with a stream of its own, the communicator made through boot
 * (rk->host). */
static void *nccl_rank(void *p) {
    struct rank *rk = p;
    cuda_ok(cudaSetDevice(rk->device), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    char *err = NULL;
    if (!ok(rk, tmx_comm_nccl_new(rk->host, &rk->c, &err), err)) {
        rk->failed = 1;
    } else {
        rk->stream = stream;
        tmx_comm_set_stream(rk->c, stream);
        rank_main(rk);
        tmx_comm_free(rk->c);
    }
    cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");
    return NULL;
}
#endif

static int usage(const char *why) {
    fprintf(stderr,
            "tmx-comm-check: %s\n"
            "usage: tmx-comm-check --backend threads|mpi|nccl [--ranks N] [--iters K]\n",
            why);
    return 2;
}

/* mpi, or nccl under mpirun: this process is one rank. */
static int run_mpi(int nccl, int ranks, int iters) {
    tmx_comm_t *c = NULL;
    char *err = NULL;
    if (tmx_comm_mpi_new(&c, &err) != TMX_OK) {
        fprintf(stderr, "tmx-comm-check: %s\n", err);
        free(err);
        return 1;
    }
    if (ranks && ranks != tmx_comm_size(c)) {
        fprintf(stderr, "tmx-comm-check: --ranks %d, but mpirun started %d\n", ranks,
                tmx_comm_size(c));
        tmx_comm_free(c);
        return 2;
    }
    struct rank rk = {nccl ? NULL : c, c, &host_mem, NULL, iters, 0, 0};
    if (!nccl) {
        rank_main(&rk);
    } else {
#ifdef TMX_HAVE_CUDA
        int ndev = 0;
        cuda_ok(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount");
        const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        rk.device = (local ? atoi(local) : tmx_comm_rank(c)) % ndev;
        rk.mem = &dev_mem;
        nccl_rank(&rk);
#endif
    }
    tmx_comm_free(c);
    return rk.failed ? 1 : 0;
}

/* threads, or nccl without mpirun: ranks are threads of this process (nccl: one per GPU). */
static int run_threads(int nccl, int ranks, int iters) {
    void *(*fn)(void *) = threads_rank;
#ifdef TMX_HAVE_CUDA
    int ndev = 0;
    if (nccl) {
        cuda_ok(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount");
        if (ranks > ndev) {
            fprintf(stderr, "tmx-comm-check: %d nccl ranks need %d GPUs; this machine has %d\n",
                    ranks, ranks, ndev);
            return 2;
        }
        fn = nccl_rank;
    }
#endif
    tmx_comm_group_t *g = NULL;
    char *err = NULL;
    if (tmx_comm_group_new(ranks, &g, &err) != TMX_OK) {
        fprintf(stderr, "tmx-comm-check: %s\n", err);
        free(err);
        return 1;
    }
    struct rank rk[64];
    pthread_t th[64];
    for (int r = 0; r < ranks; r++) {
        tmx_comm_t *c = tmx_comm_group_rank(g, r);
        rk[r] = (struct rank){nccl ? NULL : c, c, &host_mem, NULL, iters, 0, r};
#ifdef TMX_HAVE_CUDA
        if (nccl) rk[r].mem = &dev_mem;
#endif
        if (pthread_create(&th[r], NULL, fn, &rk[r]) != 0) {
            fprintf(stderr, "tmx-comm-check: cannot start thread %d\n", r);
            exit(1); /* the started ranks wait for this one */
        }
    }
    int failed = 0;
    for (int r = 0; r < ranks; r++) {
        pthread_join(th[r], NULL);
        failed |= rk[r].failed;
    }
    tmx_comm_group_free(g);
    return failed ? 1 : 0;
}

int main(int argc, char **argv) {
    const char *backend = NULL;
    int ranks = 0, iters = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) backend = argv[++i];
        else if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) ranks = atoi(argv[++i]);
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = atoi(argv[++i]);
        else return usage(argv[i]);
    }
    if (!backend) return usage("--backend is required");
    const int mpi = strcmp(backend, "mpi") == 0, nccl = strcmp(backend, "nccl") == 0;
    if (!mpi && !nccl && strcmp(backend, "threads") != 0)
        return usage("--backend: expected threads, mpi or nccl");
    if (ranks < 0 || ranks > 64) return usage("--ranks: expected 1..64");
    if (iters < 0) return usage("--iters: expected a count of calls");
#ifndef TMX_HAVE_CUDA
    if (nccl) {
        fprintf(stderr, "tmx-comm-check: SKIP: built without CUDA, and the nccl check needs "
                        "device buffers\n");
        return 77;
    }
#endif
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (mpi || (nccl && tmx_comm_mpi_launched())) return run_mpi(nccl, ranks, iters);
    return run_threads(nccl, ranks ? ranks : nccl ? 1 : 2, iters);
}
