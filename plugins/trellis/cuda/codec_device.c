/* codec_device.c: the device path of codec.trellis-e4m3 and codec.trellis-fp4 (tmx/plugin.h:
 * device_load, device_free, device_moe_experts) over the CUDA side in trellis_cuda.h. The
 * host layer (layer.c) is flattened into the description the device copies; checks and
 * messages are here, the kernels in moe.cu and mm.cu. */
#include <stdlib.h>
#include <string.h>

#include "codec_impl.h"
#include "trellis_cuda.h"

/* What device_load hands back. */
struct trellis_device {
    struct trellis_cuda_layer *cuda;
    int layer, latent;
};

void tmx_trellis_codec_device_fini(void *ctx) {
    struct trellis_codec *c = ctx;
    if (c) trellis_cuda_scratch_free(c->device);
    tmx_trellis_codec_fini(ctx);
}

enum tmx_status tmx_trellis_codec_device_load(void *ctx, void *layer, const char *kernels,
                                              void *stream, void **dev, char **err) {
    const struct trellis_codec *c = ctx;
    const struct trellis_layer *l = layer;
    const char *name = c->spec->name;
    *dev = NULL;
    if (!kernels || strcmp(kernels, "cuda") != 0)
        return c->host->err(err, TMX_ERR_UNSUPPORTED, "codec.%s: no device path for kernel "
                            "set \"%s\"", name, kernels ? kernels : "");
    if (!c->serving)
        return c->host->err(err, TMX_ERR_UNSUPPORTED, "codec.%s: the GPU multiplies the "
                            "serving formats only; option activations = \"f32\" is host-only",
                            name);
    const int n_mat = 3 * l->n_experts;
    const uint32_t **words = malloc((size_t)n_mat * sizeof *words);
    const uint8_t **scales = malloc((size_t)n_mat * sizeof *scales);
    float *g = malloc((size_t)n_mat * sizeof *g);
    struct trellis_device *d = calloc(1, sizeof *d);
    enum tmx_status st = TMX_OK;
    if (!words || !scales || !g || !d) {
        st = c->host->err(err, TMX_ERR_NOMEM, "codec.%s: out of memory", name);
        goto done;
    }
    uint8_t lut[TMX_TRELLIS_SIGMAS]; /* law e2m1: the E4M3 byte of each code's value (§1.2) */
    static const uint8_t e4m3_of_e2m1[8] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C};
    for (int s = 0; s < TMX_TRELLIS_SIGMAS; s++)
        lut[s] = (uint8_t)((l->law.code[s] & 0x8 ? 0x80 : 0) | e4m3_of_e2m1[l->law.code[s] & 7]);
    for (int i = 0; i < n_mat; i++) {
        words[i] = l->mat[i].words;
        scales[i] = l->mat[i].scales;
        g[i] = l->mat[i].scale;
    }
    const struct trellis_cuda_layer_desc desc = {
        .fp4 = c->id == TMX_TRELLIS_CODEC_FP4, .K = l->mat[0].K, .n_experts = l->n_experts,
        .latent = l->latent, .inter = l->inter, .lut = lut, .words = words, .scales = scales,
        .g = g, .sign_in = l->sign_in, .sign_mid = l->sign_mid, .sign_out = l->sign_out};
    char msg[256];
    if (trellis_cuda_layer_new(&desc, stream, &d->cuda, msg, sizeof msg)) {
        st = c->host->err(err, TMX_ERR_DEVICE, "codec.%s: layer %d: %s", name, l->layer, msg);
        goto done;
    }
    d->layer = l->layer;
    d->latent = l->latent;
    *dev = d;
    d = NULL;
done:
    free(words);
    free(scales);
    free(g);
    free(d);
    return st;
}

void tmx_trellis_codec_device_free(void *ctx, void *dev) {
    (void)ctx;
    struct trellis_device *d = dev;
    if (!d) return;
    trellis_cuda_layer_free(d->cuda);
    free(d);
}

enum tmx_status tmx_trellis_codec_device_moe_experts(void *ctx, void *dev, void *stream,
                                                     float *out, const float *z,
                                                     const int32_t *ids, const float *weights,
                                                     int n, int k,
                                                     const struct tmx_tensor *post_norm,
                                                     float eps, char **err) {
    struct trellis_codec *c = ctx;
    const struct trellis_device *d = dev;
    const char *name = c->spec->name;
    if (n < 0 || k < 1)
        return c->host->err(err, TMX_ERR_INVALID, "codec.%s: moe_experts: %d tokens, top %d",
                            name, n, k);
    enum trellis_cuda_norm norm = TRELLIS_CUDA_NORM_NONE;
    if (post_norm) {
        norm = post_norm->dtype == TMX_DTYPE_F32    ? TRELLIS_CUDA_NORM_F32
               : post_norm->dtype == TMX_DTYPE_BF16 ? TRELLIS_CUDA_NORM_BF16
               : post_norm->dtype == TMX_DTYPE_F16  ? TRELLIS_CUDA_NORM_F16
                                                    : TRELLIS_CUDA_NORM_NONE;
        if (norm == TRELLIS_CUDA_NORM_NONE || post_norm->ndim != 1 ||
            post_norm->shape[0] != d->latent)
            return c->host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d: the post-expert "
                                "norm must be F32, BF16 or F16 [%d]", name, d->layer, d->latent);
    }
    char msg[256];
    if (trellis_cuda_moe((struct trellis_cuda_scratch **)&c->device, d->cuda, stream, out, z,
                         ids, weights, n, k, post_norm ? post_norm->data : NULL, norm, eps, NULL,
                         msg, sizeof msg))
        return c->host->err(err, TMX_ERR_DEVICE, "codec.%s: layer %d: %s", name, d->layer, msg);
    return TMX_OK;
}
