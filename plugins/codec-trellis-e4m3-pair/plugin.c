/* plugin.c: codec.trellis-e4m3-pair, TrellisMX experts coded by the experimental law e4m3-pair
 * (docs/trellismx.md §14: one trellis state for two weights, their E4M3 codes from a table of
 * 65536 pairs): block scales per 32 inputs and activations E4M3 per token, as trellis-e4m3.
 * It exists to measure the law's quality end to end before a GPU decides its speed; it has no
 * device path, so a build with it runs on kernel sets that compute on the host. */
#include "codec.h"

static enum tmx_status pair_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                 void **ctx, char **err) {
    return tmx_trellis_codec_init(host, opts, TMX_TRELLIS_CODEC_PAIR, ctx, err);
}

static const struct tmx_codec_i pair_ops = {
    .struct_size = sizeof(struct tmx_codec_i),
    .init = pair_init,
    .fini = tmx_trellis_codec_fini,
    TMX_TRELLIS_CODEC_HOST_OPS,
};

static const struct tmx_option pair_options[] = {
    {"threads", TMX_OPT_INT, "0",
     "worker threads when the kernel set lends none (kernels.cpu lends its); 0: one per core"},
    {"activations", TMX_OPT_STRING, "serving",
     "\"serving\": E4M3 per token, as a GPU multiplies; \"f32\": unquantized"},
    {0},
};

static const struct tmx_plugin pair_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "trellis-e4m3-pair",
    .kind = TMX_PLUGIN_CODEC,
    .version = "0.1.0",
    .opts = pair_options,
    .ops = &pair_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &pair_plugin;
}
