/* encode.h: the TrellisMX encoder (docs/trellismx.md §11): one MoE layer's routed experts in,
 * experts/ and coupled/ files out (§10.2, §10.3), and the steps it is made of.
 *
 * A codec plugin's ops (struct tmx_codec_i, tmx/plugin.h) forward to it:
 *
 *     .layer_encode: return tmx_trellis_layer_encode(host, law, alpha, job, err);
 *     .quant_config: return tmx_trellis_quant_config(law, alpha, bits, buf, size);
 *
 * The steps, per matrix W[rows][cols] of one expert (rows = n_out, cols = k_in):
 * 1. rotate W and the Hessian of its inputs into the coded basis with the layer's coupled sign
 *    vectors (tmx_trellis_rotate_matrix, tmx_trellis_rotate_hessian);
 * 2. factor the rotated Hessian into LDLQ feedback (tmx_trellis_ldlq_factor);
 * 3. pick the scales and code every tile with the Viterbi search, strip by strip, feeding each
 *    tile column's error forward (tmx_trellis_matrix_encode).
 *
 * Like the rest of tmx-trellis this links nothing of the core: the layer encoder reaches it
 * through the host table; the other functions' messages are malloc'd (free them with free()). */
#ifndef TMX_TRELLIS_ENCODE_H
#define TMX_TRELLIS_ENCODE_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/plugin.h"
#include "trellis.h"

#define TMX_TRELLIS_EXPERTS_PER_FILE 32 /* experts per experts/ file (§10.2) */
#define TMX_TRELLIS_LDLQ_BLOCK 16       /* columns fed back together: one tile column */

/* Inputs per block scale: 32 for laws e4m3 and e4m3-pair (codecs trellis-e4m3 and
 * trellis-e4m3-pair), 16 for e2m1 (trellis-fp4). */
static inline int tmx_trellis_law_block(enum tmx_trellis_law_id law) {
    return law == TMX_TRELLIS_LAW_E2M1 ? 16 : 32;
}

/* Seed of coupled vector v (0 sign_latent_in, 1 sign_intermediate, 2 sign_latent_out) of MoE
 * layer `layer`, for tmx_trellis_signs_random: a build is a pure function of its inputs. */
static inline uint64_t tmx_trellis_sign_seed(int layer, int v) {
    return 0x7472656c6c69736dull ^ ((uint64_t)layer << 2 | (uint64_t)v); /* "trellism" */
}

/* --- a whole layer ------------------------------------------------------------------------ */

/* Encodes job's n_experts experts at K = job->bits and writes, under job->out_dir,
 * coupled/layer-LLL.safetensors and experts/layer-LLL-SSS-EEE.safetensors (32 experts a file)
 * through host->st_write. A NULL Hessian (no calibration inputs) means the identity: no error
 * feedback, plain squared error. Experts run on job->n_threads threads (< 1: one), a whole
 * expert per thread at a time: experts need no synchronization, and gate and up share their
 * Hessian's factor. The layer's streams are kept until every expert is coded (K/8 bytes per
 * weight), then written.
 * job->progress (if set) is called under a lock after every strip of 16 rows. job->proxy_err
 * (if set) gets tr(E H E^T) / tr(W H W^T) per matrix, E = W - W^, H the unregularized Hessian
 * (the identity where it is NULL). alpha is the e2m1 divisor (§4.2). */
enum tmx_status tmx_trellis_layer_encode(const struct tmx_host *host, enum tmx_trellis_law_id law,
                                         float alpha, const struct tmx_codec_encode_job *job,
                                         char **err);

/* The codec's members of hf_quant_config.json (§10.4) for a build at `bits`, as the text of a
 * JSON object: trellismx_version, law, bits, alpha (e2m1 only), block_size, activation,
 * hadamard_block, experts_per_file. tmx quantize adds quant_method, codec, mxfp8_tensors and
 * producer. Writes at most size bytes (snprintf) and returns the length it needed; -1 when
 * bits is not in 2..6. */
int tmx_trellis_quant_config(enum tmx_trellis_law_id law, float alpha, int bits, char *buf,
                             size_t size);

/* --- the steps (ldlq.c) ------------------------------------------------------------------- */

/* w[rows][cols] <- H diag(s_out) w diag(s_in) H: the operand matrix Q approximates it (§6). */
void tmx_trellis_rotate_matrix(float *w, int64_t rows, int64_t cols, const uint8_t *sign_out,
                               const uint8_t *sign_in);
/* h[n][n] <- H diag(s) h diag(s) H: the Hessian of inputs rotated as the matmul sees them. */
void tmx_trellis_rotate_hessian(double *h, int64_t n, const uint8_t *sign);

/* LDLQ feedback of a Hessian h[n][n] (n % 16 == 0): with h + lambda I = L L^T (Cholesky),
 * lambda = 0.025 mean(diag h), doubled on each failure up to 10 times, writes
 * a[n][n] = L Ld^-1 - I, Ld the 16x16 diagonal blocks of L: strictly block-lower, so that
 * coding 16-column blocks from last to first with target_j = w_j + sum_{i>j} e_i a_ij leaves an
 * error whose proxy is the sum of each block's own error weighted by Ld Ld^T. *lambda gets the
 * regularization that worked. Fails (TMX_ERR_INVALID) on a non-finite h, or on a zero diagonal
 * (no inputs: use no feedback). */
enum tmx_status tmx_trellis_ldlq_factor(const double *h, int64_t n, double *a, double *lambda,
                                        char **err);

/* *out = tr(e h e^T) / tr(w h w^T) with e = w - q, all [rows][cols], h [cols][cols] (NULL:
 * the identity); 0 when the denominator is 0. Fails only when out of memory. */
enum tmx_status tmx_trellis_proxy_error(const float *w, const float *q, int64_t rows,
                                        int64_t cols, const double *h, double *out, char **err);

/* --- one matrix (encode.c) ---------------------------------------------------------------- */

/* One matrix to code, in the rotated basis, and where its stream goes. */
struct tmx_trellis_encode_io {
    int64_t rows, cols;    /* multiples of 128 */
    const float *w;        /* [rows][cols] rotated weights (tmx_trellis_rotate_matrix) */
    const double *a;       /* [cols][cols] LDLQ feedback, or NULL: none */
    uint32_t *words;       /* out [rows/16][cols/16][8K] tile words, tiles row-major */
    uint8_t *scales;       /* out [rows][cols/block] E4M3 block scales */
    float scale;           /* out g */
    float *q;              /* out [rows][cols] g * B . C, as tmx_trellis_matrix_operands decodes */
    /* called after each strip of 16 rows with its tile count; may be NULL */
    void (*strip_done)(void *arg, int64_t tiles);
    void *strip_arg;
};

/* The scales: each block's RMS r maps to the code-unit step g * B = r / c, c the law's best
 * Gaussian scale at K, with g putting the largest block at B = 448. Then every strip of 16 rows,
 * tile columns last to first: target = w + feedback of the strip's error so far, divided by the
 * step, coded by `vit` (made for the same law and K). Fails only when out of memory or on a
 * non-finite weight. */
enum tmx_status tmx_trellis_matrix_encode(struct tmx_trellis_viterbi *vit,
                                          const struct tmx_trellis_law *law, int K,
                                          struct tmx_trellis_encode_io *io, char **err);

#endif
