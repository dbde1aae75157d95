/* codec.h: the TrellisMX codec plugins, trellis-e4m3 and trellis-fp4: loading a build's
 * experts and running them on the CPU, plus the encoder's entry points for tmx quantize.
 *
 * Each plugin (plugin.c in plugins/codec-trellis-e4m3 and -fp4) is a descriptor whose struct
 * tmx_codec_i points at the functions below; its init names which codec it is, and everything
 * else is shared. The ops follow tmx/plugin.h: a ctx per init, a layer per layer_load;
 * moe_experts and expert_decode run on host memory. Calls on one ctx come from one thread at
 * a time (the model graph's); moe_experts spreads its work over the ctx's own threads, or
 * over the kernel set's once the core lends them (use_threads).
 *
 * Options (the plugin's option table declares them; the core resolves them):
 *   threads      int     worker threads until a kernel set lends its (kernels.cpu does), 0 =
 *                        one per core (default: the core key `threads`)
 *   activations  string  "serving": activations quantized as docs/trellismx.md §7 says (E4M3
 *                        per token / NVFP4), the formats a GPU multiplies; "f32": unquantized
 *                        F32 activations against the same weights. */
#ifndef TMX_TRELLIS_CODEC_H
#define TMX_TRELLIS_CODEC_H

#include <stdint.h>

#include "tmx/plugin.h"
#include "trellis.h"

/* The α tmx writes for law e2m1 (docs/trellismx.md §4.2). */
#define TMX_TRELLIS_ALPHA 0.5625f

/* The two codecs of docs/trellismx.md §0, the experimental one of §14, and what each fixes
 * in hf_quant_config.json. */
enum tmx_trellis_codec_id {
    TMX_TRELLIS_CODEC_E4M3 = 0,
    TMX_TRELLIS_CODEC_FP4 = 1,
    TMX_TRELLIS_CODEC_PAIR = 2,
};

struct tmx_trellis_codec_spec {
    const char *name;             /* "trellis-e4m3" / "trellis-fp4" / "trellis-e4m3-pair" */
    enum tmx_trellis_law_id law;  /* e4m3 / e2m1 / e4m3-pair */
    int block;                    /* inputs per block scale: 32 / 16 / 32 */
    const char *activation;       /* "e4m3-token" / "nvfp4-token" / "e4m3-token" */
};

const struct tmx_trellis_codec_spec *tmx_trellis_codec_spec(enum tmx_trellis_codec_id id);

/* hf_quant_config.json of a build, checked against §10.4. */
struct tmx_trellis_quant_config {
    enum tmx_trellis_codec_id codec;
    int bits;             /* K */
    float alpha;          /* law e2m1's divisor; 1 for e4m3 */
    int experts_per_file;
};

/* Reads and checks `path` for codec `want`: a missing field, a wrong type, a value outside
 * §10.4's table, or another codec is an error naming the file and the field. */
enum tmx_status tmx_trellis_quant_config_read(const char *path, enum tmx_trellis_codec_id want,
                                              struct tmx_trellis_quant_config *out, char **err);

/* --- struct tmx_codec_i ------------------------------------------------------------------- */

/* *ctx (its threads and buffers) is freed by tmx_trellis_codec_fini, after every layer. */
enum tmx_status tmx_trellis_codec_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                       enum tmx_trellis_codec_id id, void **ctx, char **err);
void tmx_trellis_codec_fini(void *ctx);
/* tmx_codec_i.use_threads: moe_experts runs on the kernel set's threads from now on. */
void tmx_trellis_codec_use_threads(void *ctx, const struct tmx_threads *threads);
/* Reads hf_quant_config.json, experts/layer-LLL-SSS-EEE.safetensors and
 * coupled/layer-LLL.safetensors of info->model_dir (§10), checks every name, dtype, shape and
 * metadata field, expands the block scales (CSF) and keeps the trellis words and sign vectors
 * as views of the mmapped files. *layer owns the mappings and the scales until
 * tmx_trellis_codec_layer_free. _slice opens rank `rank` of n_ranks: the rank's slice of the
 * intermediate dimension, which must be a multiple of 128 (the Hadamard blocks of §6, which
 * hold whole tiles and block-scale groups): gate and up keep their slices' rows, down its
 * columns (copied). */
enum tmx_status tmx_trellis_codec_layer_load(void *ctx, const struct tmx_codec_layer_info *info,
                                             void **layer, char **err);
enum tmx_status tmx_trellis_codec_layer_load_slice(void *ctx,
                                                   const struct tmx_codec_layer_info *info,
                                                   int rank, int n_ranks, void **layer,
                                                   char **err);
void tmx_trellis_codec_layer_free(void *ctx, void *layer);
/* tmx_kernels_i.moe_experts on host memory, in the rotated basis of §6. */
enum tmx_status tmx_trellis_codec_moe_experts(void *ctx, void *layer, float *out, const float *z,
                                              const int32_t *ids, const float *weights, int n,
                                              int k, const struct tmx_tensor *post_norm,
                                              float eps, char **err);
/* tmx_codec_i.moe_experts_partial (tensor parallelism): ye[n][k][latent], each pair's output
 * over the layer's slice of the intermediate dimension, unrotated, neither normalized nor
 * weighted. */
enum tmx_status tmx_trellis_codec_moe_experts_partial(void *ctx, void *layer, float *ye,
                                                      const float *z, const int32_t *ids, int n,
                                                      int k, char **err);
/* w (caller-owned, [rows][cols] of the projection) = diag(s_out) H (g B . C) H diag(s_in) of
 * one projection (0 gate, 1 up, 2 down). */
enum tmx_status tmx_trellis_codec_expert_decode(void *ctx, void *layer, int expert, int proj,
                                                float *w, char **err);
/* tmx quantize's ops: the encoder of encode.h and the codec's members of hf_quant_config.json,
 * for this codec's law at α = TMX_TRELLIS_ALPHA. */
enum tmx_status tmx_trellis_codec_layer_encode(void *ctx, const struct tmx_codec_encode_job *job,
                                               char **err);
int tmx_trellis_codec_quant_config(void *ctx, int bits, char *buf, size_t size);

/* The members of a plugin's struct tmx_codec_i that every TrellisMX codec shares on the host:
 * all but struct_size, init, fini and the device path. */
#define TMX_TRELLIS_CODEC_HOST_OPS                                                             \
    .quant_method = "trellismx", .layer_load = tmx_trellis_codec_layer_load,                   \
    .layer_free = tmx_trellis_codec_layer_free, .moe_experts = tmx_trellis_codec_moe_experts,  \
    .expert_decode = tmx_trellis_codec_expert_decode,                                          \
    .layer_encode = tmx_trellis_codec_layer_encode,                                            \
    .quant_config = tmx_trellis_codec_quant_config,                                            \
    .layer_load_slice = tmx_trellis_codec_layer_load_slice,                                    \
    .moe_experts_partial = tmx_trellis_codec_moe_experts_partial,                              \
    .use_threads = tmx_trellis_codec_use_threads

/* --- the device path (plugins/trellis/cuda, built when CUDA is: TMX_TRELLIS_CUDA) --------- */

/* tmx_trellis_codec_fini that also frees the device buffers. */
void tmx_trellis_codec_device_fini(void *ctx);
/* Copies a layer to the GPU for kernel set "cuda" (any other: TMX_ERR_UNSUPPORTED, as is
 * activations = "f32": the device multiplies the serving formats only). */
enum tmx_status tmx_trellis_codec_device_load(void *ctx, void *layer, const char *kernels,
                                              void *stream, void **dev, char **err);
void tmx_trellis_codec_device_free(void *ctx, void *dev);
/* moe_experts on device buffers, queued on `stream` (a cudaStream_t). */
enum tmx_status tmx_trellis_codec_device_moe_experts(void *ctx, void *dev, void *stream,
                                                     float *out, const float *z,
                                                     const int32_t *ids, const float *weights,
                                                     int n, int k,
                                                     const struct tmx_tensor *post_norm,
                                                     float eps, char **err);

/* fini and the device path of a codec that has device kernels: the device members in a build
 * with CUDA, the host fini without. */
#ifdef TMX_TRELLIS_CUDA
#define TMX_TRELLIS_CODEC_DEVICE_OPS                                                           \
    .fini = tmx_trellis_codec_device_fini, .device_load = tmx_trellis_codec_device_load,       \
    .device_free = tmx_trellis_codec_device_free,                                              \
    .device_moe_experts = tmx_trellis_codec_device_moe_experts
#else
#define TMX_TRELLIS_CODEC_DEVICE_OPS .fini = tmx_trellis_codec_fini
#endif

#endif
