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
    .init = fp4_init,
    TMX_TRELLIS_CODEC_HOST_OPS,
    TMX_TRELLIS_CODEC_DEVICE_OPS,
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
