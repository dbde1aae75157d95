/* plugin.c: codec.trellis-e4m3, TrellisMX experts with E4M3 operands (docs/trellismx.md): law
 * e4m3, block scales per 32 inputs, activations E4M3 per token. The implementation is shared
 * with codec.trellis-fp4 and lives in plugins/trellis (codec.h); the device path, in a build
 * with CUDA, in plugins/trellis/cuda. */
#include "codec.h"

static enum tmx_status e4m3_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                 void **ctx, char **err) {
    return tmx_trellis_codec_init(host, opts, TMX_TRELLIS_CODEC_E4M3, ctx, err);
}

static const struct tmx_codec_i e4m3_ops = {
    .struct_size = sizeof(struct tmx_codec_i),
    .init = e4m3_init,
    TMX_TRELLIS_CODEC_HOST_OPS,
    TMX_TRELLIS_CODEC_DEVICE_OPS,
};

static const struct tmx_option e4m3_options[] = {
    {"threads", TMX_OPT_INT, "0",
     "worker threads when the kernel set lends none (kernels.cpu lends its); 0: one per core"},
    {"activations", TMX_OPT_STRING, "serving",
     "\"serving\": E4M3 per token, as a GPU multiplies; \"f32\": unquantized"},
    {0},
};

static const struct tmx_plugin e4m3_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "trellis-e4m3",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .opts = e4m3_options,
    .ops = &e4m3_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &e4m3_plugin;
}
