/* quantize-impl.h: what the files of tmx quantize (quantize*.c) share and keep to themselves. */
#ifndef TMX_QUANTIZE_IMPL_H
#define TMX_QUANTIZE_IMPL_H

#include <jansson.h>
#include <stdint.h>

#include "tmx/safetensors.h"
#include "tmx/status.h"

/* What calibration captured in one MoE layer. */
struct calib_layer {
    int64_t n;     /* token rows */
    float *z;      /* [n][latent] post-bridge latents */
    int32_t *ids;  /* [n][k] routed experts */
};

/* One layer's Hessians (quantize-hessian.c): sums of x x^T over each expert's inputs. */
struct layer_hessians {
    double **h_in;         /* [E] of [latent][latent]: z, for gate and up */
    double **h_mid;        /* [E] of [inter][inter]: silu(gate z) * up z, for down */
    int64_t *natural;      /* [E] calibration tokens routed to the expert */
    int64_t *supplemental; /* [E] counterfactual inputs, for experts no token reached */
};

/* Computes the Hessians of layer cl for its E experts (gate, up: [E] of [inter][latent] F32)
 * on n_threads threads. */
enum tmx_status quantize_hessians(const struct calib_layer *cl, int k, int E, int latent,
                                  int inter, const float *const *gate, const float *const *up,
                                  int n_threads, struct layer_hessians *out, char **err);
void quantize_hessians_free(struct layer_hessians *h, int E);

/* quantize-write.c: the model shards of every non-expert tensor (attention projections as
 * MXFP8, whose names are appended to mxfp8_names), their index, and the small files of the
 * model folder that a build keeps (config, tokenizer, generation config, chat template). */
enum tmx_status quantize_write_dense(const struct tmx_checkpoint *ck, const char *out_dir,
                                     json_t *mxfp8_names, char **err);
enum tmx_status quantize_copy_files(const char *in_dir, const char *out_dir, char **err);

#endif
