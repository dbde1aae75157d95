/* plugin.c: codec.trellis-fp4, TrellisMX experts with E2M1 operands (docs/trellismx.md): law
 * e2m1, block scales per 16 inputs, activations NVFP4. The implementation is shared with
 * codec.trellis-e4m3 and lives in plugins/trellis (codec.h); the device path, in a build with
 * CUDA, in plugins/trellis/cuda. */
#include "codec.h"

static enum tmx_status fp4_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                void **ctx, char **err) {
    return tmx_trellis_codec_init(host, opts, TMX_TRELLIS_CODEC_FP4, ctx, err);
}

static const struct tmx_codec_i fp4_ops = {
    .struct_size = sizeof(struct tmx_codec_i),
    .quant_method = "trellismx",
    .init = fp4_init,
#ifdef TMX_TRELLIS_CUDA
    .fini = tmx_trellis_codec_device_fini,
#else
    .fini = tmx_trellis_codec_fini,
#endif
    .layer_load = tmx_trellis_codec_layer_load,
    .layer_free = tmx_trellis_codec_layer_free,
    .moe_experts = tmx_trellis_codec_moe_experts,
    .expert_decode = tmx_trellis_codec_expert_decode,
    .layer_encode = tmx_trellis_codec_layer_encode,
    .quant_config = tmx_trellis_codec_quant_config,
#ifdef TMX_TRELLIS_CUDA
    .device_load = tmx_trellis_codec_device_load,
    .device_free = tmx_trellis_codec_device_free,
    .device_moe_experts = tmx_trellis_codec_device_moe_experts,
#endif
    .layer_load_slice = tmx_trellis_codec_layer_load_slice,
    .moe_experts_partial = tmx_trellis_codec_moe_experts_partial,
    .use_threads = tmx_trellis_codec_use_threads,
};

static const struct tmx_option fp4_options[] = {
    {"threads", TMX_OPT_INT, "0",
     "worker threads when the kernel set lends none (kernels.cpu lends its); 0: one per core"},
    {"activations", TMX_OPT_STRING, "serving",
     "\"serving\": NVFP4, as a GPU multiplies; \"f32\": unquantized"},
    {0},
};

static const struct tmx_plugin fp4_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "trellis-fp4",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .opts = fp4_options,
    .ops = &fp4_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &fp4_plugin;
}
