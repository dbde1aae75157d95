/* tmx/conform.h: conformance cases for kernel sets (struct tmx_kernels_i).
 *
 * In the spirit of ggml's test-backend-ops and FFmpeg's checkasm. A fixed table holds cases for
 * every op of tmx/kernels.h at several shapes, weight dtypes and variants (GQA ratios, sliding
 * and full windows, one token and many). A case makes seeded random inputs (the same values on
 * every run and for every kernel set), uploads them with the set's own buf_alloc, buf_write and
 * weight_import, runs the op, syncs, reads the outputs back with buf_read, and compares them
 * with a plain reference in conform.c that computes in double. The error of a float output is
 * the normalized max error max|got - ref| / max|ref|, which must not exceed the op's tolerance;
 * integer outputs (router ids) must match exactly.
 *
 * KV cache cases run on paged caches of every cache dtype (F32, BF16, F8_E4M3, I8) with block
 * sizes 1, 5 and 16: several sequences per call with their tokens interleaved, block ids
 * shuffled, tables holding -1 for blocks outside every window (attention must not read them)
 * and slots of -1 (kv_store must skip them). kv_store's outputs are the whole cache and must
 * follow tmx/kernels.h's rounding bit for bit, scales included (tolerance 0; the row is divided
 * by its scale in F32, not multiplied by a reciprocal); codes are compared as values, so an F8
 * -0 matches +0. attention's reference dequantizes the cache's bytes, so its tolerance is the
 * same for every dtype.
 *
 * The optional tensor-parallel ops have cases too: moe_experts_partial (each pair's y_e, no
 * norm, no weight, zeros for another rank's experts) and moe_combine (the norm and the weighted
 * sum over all-reduced pair rows of several magnitudes). A set without them gets
 * TMX_ERR_UNSUPPORTED for those cases: filter them out ("moe_experts/" does not select
 * "moe_experts_partial/") when checking a set meant for one rank only.
 *
 * To check a kernel set: tmx_conform_run(). To time an op or compare two sets, use the parts in
 * order: tmx_conform_case_new (inputs made and uploaded, reference computed), tmx_conform_case_run
 * (the op once, no sync; repeat it to time), tmx_conform_case_check (sync, read back, compare;
 * meaningful after exactly one run, since rope, add_gated and in-place variants change their
 * inputs), tmx_conform_case_free. */
#ifndef TMX_CONFORM_H
#define TMX_CONFORM_H

#include <stddef.h>

#include "tmx/kernels.h"
#include "tmx/status.h"

/* The case table. Names read "<op>/<variant>/<shape>", e.g. "matmul/bf16/n17-m67-k131", so a
 * filter of "matmul/" selects one op. */
size_t tmx_conform_count(void);
const char *tmx_conform_name(size_t i);
/* The struct tmx_kernels_i member case i calls: "matmul", "moe_experts", ... */
const char *tmx_conform_op(size_t i);

struct tmx_conform_result {
    const char *name;       /* the case's name (static storage) */
    enum tmx_status status; /* what the kernel set's sync returned; TMX_ERR_UNSUPPORTED when the
                               set lacks the op */
    double err;             /* largest normalized max error over the outputs; INFINITY on an
                               integer mismatch, a NaN or a failed op */
    double tol;             /* the op's tolerance */
    int pass;               /* status == TMX_OK && err <= tol */
};

/* One case set up on one kernel set. It owns its buffers and imported weights; free it before
 * the kernel set's fini. */
struct tmx_conform_case;

/* Makes case i's inputs, uploads them through `ops` and `ctx`, and computes the reference.
 * Fails only when the kernel set cannot allocate, write or import (message names the case). */
enum tmx_status tmx_conform_case_new(size_t i, const struct tmx_kernels_i *ops, void *ctx,
                                     struct tmx_conform_case **out, char **err);
/* Calls the op once. Does nothing when the set lacks the op. */
void tmx_conform_case_run(struct tmx_conform_case *c);
/* In place of tmx_conform_case_run, for a case whose op fuses others (add_rmsnorm: add_gated,
 * then rmsnorm): calls those once each, so that a check's outputs can be compared bit for bit
 * with the fused op's. Returns 0 (and calls nothing) for an op that fuses none. */
int tmx_conform_case_run_parts(struct tmx_conform_case *c);
/* Syncs, reads the outputs back and fills *res. A failed op or a mismatch is a result, not an
 * error: the return is an error only when a buf_read fails. */
enum tmx_status tmx_conform_case_check(struct tmx_conform_case *c, struct tmx_conform_result *res,
                                       char **err);
/* The outputs as read by the last check, concatenated in the op's argument order (e.g. ids then
 * weights for moe_route; kv_store: k, v, then k_scale, v_scale for F8 and I8), each padded to
 * a multiple of 4 bytes; NULL before any check. Owned by the case. */
const void *tmx_conform_case_output(const struct tmx_conform_case *c, size_t *nbytes);
/* Safe with NULL. */
void tmx_conform_case_free(struct tmx_conform_case *c);

/* Runs every case whose name contains `filter` (NULL: all) on one kernel set. The first
 * max_results results go to `results`; *n_results gets the number of cases run. Returns an
 * error only when a case could not be set up or read back; check each result's `pass`. */
enum tmx_status tmx_conform_run(const struct tmx_kernels_i *ops, void *ctx, const char *filter,
                                struct tmx_conform_result *results, int max_results,
                                int *n_results, char **err);

#endif
