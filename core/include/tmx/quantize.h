/* tmx/quantize.h: `tmx quantize` as a library: a BF16/F32 Muse checkpoint and calibration text
 * in, a build of a codec out (docs/trellismx.md §10 lays out the trellis codecs' builds).
 *
 * 1. Calibration windows run through the model (tmx_seq_set_capture); every MoE layer's
 *    post-bridge latents and routing are kept.
 * 2. Non-expert tensors: the attention projections become MXFP8 (§10.5), every other tensor is
 *    copied as it is; routed-expert tensors are left out. Shards plus index.
 * 3. Layer by layer: per expert, the F64 Hessians of its inputs z (gate and up share it) and of
 *    its intermediate silu(gate z) * up z (down), over the tokens routed to it; an expert no
 *    token reached gets the layer's latents sampled evenly, routed to it counterfactually
 *    (counted apart). Then the codec's layer_encode writes the layer's files.
 * 4. config.json, tokenizer and generation files, hf_quant_config.json (generic members plus
 *    the codec's own), quantize-report.json (per-matrix proxy error, routing coverage,
 *    timings) and last trellismx-manifest.json (tmx/manifest.h). */
#ifndef TMX_QUANTIZE_H
#define TMX_QUANTIZE_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"

/* The calibration text used without one of the caller's: a few KB of public-domain English. */
extern const char tmx_quantize_builtin_calib[];

enum tmx_quantize_stage {
    TMX_QUANTIZE_CALIBRATE,  /* done/total: calibration tokens run */
    TMX_QUANTIZE_ENCODE,     /* done/total: tiles of all layers coded (a codec that reports) */
    TMX_QUANTIZE_LAYER_DONE, /* one MoE layer written: layer, seconds, coverage, proxy */
    TMX_QUANTIZE_WRITE,      /* non-expert tensors, then the build's small files */
};

struct tmx_quantize_progress {
    enum tmx_quantize_stage stage;
    int64_t done, total;
    int layer;               /* layer id (ENCODE, LAYER_DONE) */
    int moe_index, n_moe;    /* it is MoE layer moe_index + 1 of n_moe */
    double seconds;          /* LAYER_DONE: time the layer took */
    int n_supplemented;      /* LAYER_DONE: experts coded from counterfactual inputs */
    double proxy_mean;       /* LAYER_DONE: mean proxy error of its matrices */
};

struct tmx_quantize_params {
    const char *model_dir;   /* BF16, F16 or F32 checkpoint */
    const char *out_dir;     /* absent or an empty folder */
    const char *codec;       /* plugin codec.<codec>, which must have layer_encode */
    int bits;                /* bits per weight, handed to the codec */
    const char *calib_text;  /* UTF-8, calib_len bytes; NULL: tmx_quantize_builtin_calib */
    size_t calib_len;
    const char *calib_name;  /* where calib_text came from, for the report */
    int64_t max_tokens;      /* calibration tokens at most; <= 0: 8192 */
    int window;              /* tokens per calibration window (BOS included); <= 0: 512 */
    /* the engine on model_dir, as tmx_engine_open takes them; config key "threads" sets the
     * encoder's threads too (0: one per core) */
    const char *config_path;
    int n_overrides;
    const char *const *overrides;
    /* called from the calling thread and the codec's (serialized); may be NULL */
    void (*progress)(void *arg, const struct tmx_quantize_progress *p);
    void *progress_arg;
};

/* Runs the whole quantization. The build is made in OUT.partial-PID beside out_dir (OUT: out_dir
 * with its links resolved; PID: this process's) and renamed to OUT once its manifest is written,
 * so that OUT holds a whole build or nothing. On failure that folder is removed; one left by a
 * run that died (a signal) is removed by the next run on the same OUT, which logs it. Every
 * failure is one line naming the file, tensor, layer or parameter. */
enum tmx_status tmx_quantize(const struct tmx_quantize_params *p, char **err);

#endif
