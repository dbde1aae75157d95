/* inspect.c: `tmx inspect` — what a checkpoint holds and what tmx needs to run it, without
 * loading any weight. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tmx/manifest.h"

static const char usage[] =
    "usage: tmx inspect [--model] DIR [options]\n\n"
    "Prints the model's config, every tensor (dtype, shape, bytes, file), totals by dtype, and\n"
    "the plugins that running it needs next to those this configuration loads.\n\n"
    "      --no-tensors       print config, totals and plugins only\n"
    "      --verify           only check a quantized build against its trellismx-manifest.json:\n"
    "                         every file's size and SHA-256, no stray expert files\n"
    CLI_ENGINE_USAGE;

static void print_config(const struct tmx_model_config *c) {
    int n_sliding = 0, n_dense = 0;
    for (int l = 0; l < c->n_layers; l++) {
        n_sliding += c->sliding[l];
        n_dense += c->dense[l];
    }
    printf("config:\n");
    printf("  model_type        %s\n", c->type == TMX_MODEL_MUSE ? "muse_spark" : "llama");
    printf("  vocab_size        %d\n", c->vocab_size);
    printf("  hidden_size       %d\n", c->hidden);
    printf("  layers            %d (%d sliding, window %d; %d full; %d dense MLP, %d MoE)\n",
           c->n_layers, n_sliding, c->sliding_window, c->n_layers - n_sliding, n_dense,
           c->n_layers - n_dense);
    printf("  attention         %d query heads, %d KV heads, head_dim %d\n", c->n_heads,
           c->n_kv_heads, c->head_dim);
    printf("  rope              theta %g, local theta %g%s\n", c->rope_theta,
           c->rope_local_theta, c->rope_type == TMX_ROPE_LLAMA3   ? ", llama3 scaling"
                                : c->rope_type == TMX_ROPE_LINEAR ? ", linear scaling" : "");
    printf("  max_position      %d\n", c->max_position_embeddings);
    if (n_dense) printf("  intermediate      %d\n", c->intermediate_size);
    if (n_dense < c->n_layers)
        printf("  experts           %d routed (top %d, %s, scale %g%s), %d shared; latent %d, "
               "intermediate %d\n",
               c->n_routed_experts, c->n_experts_per_tok,
               c->router_score == TMX_ROUTER_SIGMOID ? "sigmoid" : "softmax",
               c->routed_scaling_factor, c->norm_topk_prob ? ", normalized" : "",
               c->n_shared_experts, c->moe_latent_size, c->moe_intermediate_size);
    printf("  residual_gates    %s\n", c->residual_gates ? "yes" : "no");
    printf("  tie_embeddings    %s\n", c->tie_word_embeddings ? "yes" : "no");
}

static void print_tensors(const struct tmx_checkpoint *ck, int list) {
    size_t bytes[TMX_DTYPE_COUNT] = {0}, count[TMX_DTYPE_COUNT] = {0};
    int64_t params = 0;
    const size_t n = tmx_checkpoint_count(ck);
    if (list) printf("tensors:\n");
    for (size_t i = 0; i < n; i++) {
        struct tmx_tensor t;
        const char *file;
        const char *name = tmx_checkpoint_at(ck, i, &t, &file);
        bytes[t.dtype] += tmx_tensor_nbytes(&t);
        count[t.dtype]++;
        params += tmx_tensor_numel(&t);
        if (!list) continue;
        char shape[96];
        int off = 0;
        for (int d = 0; d < t.ndim; d++)
            off += snprintf(shape + off, sizeof shape - (size_t)off, "%s%lld", d ? ", " : "",
                            (long long)t.shape[d]);
        if (t.ndim == 0) shape[0] = '\0';
        printf("  %-56s %-8s [%s] %zu bytes  %s\n", name, tmx_dtype_name(t.dtype), shape,
               tmx_tensor_nbytes(&t), file);
    }
    size_t total = 0;
    printf("totals:\n");
    for (int d = 0; d < TMX_DTYPE_COUNT; d++) {
        if (!count[d]) continue;
        printf("  %-8s %6zu tensors %14zu bytes\n", tmx_dtype_name((enum tmx_dtype)d), count[d],
               bytes[d]);
        total += bytes[d];
    }
    printf("  all      %6zu tensors %14zu bytes, %lld elements\n", n, total, (long long)params);
}

/* The codec a checkpoint's hf_quant_config.json asks for, if any; a file that does not read is
 * printed and returned (the model would not load). */
static enum tmx_status print_plugins(const char *dir, const struct tmx_config *cfg,
                                     const struct tmx_plugins *ps, char **err) {
    printf("plugins needed:\n  kernels.%s    (config key \"kernels\")\n",
           tmx_config_str(cfg, "kernels"));
    struct tmx_quant_config q;
    const enum tmx_status st = tmx_quant_config_load(dir, &q, err);
    if (st != TMX_OK)
        printf("  codec unknown: %s\n", *err);
    else if (!q.present)
        printf("  no codec (no hf_quant_config.json: dense weights)\n");
    else
        printf("  codec.%s for quant_method \"%s\" (%s)\n", *q.codec ? q.codec : "?",
               q.quant_method, q.path);
    printf("plugins loaded:\n");
    for (size_t i = 0; i < tmx_plugins_count(ps); i++) {
        const char *file;
        const struct tmx_plugin *p = tmx_plugins_at(ps, i, &file);
        printf("  %s.%s %s  %s\n", tmx_plugin_kind_name(p->kind), p->name, p->version, file);
    }
    return st;
}

int cmd_inspect(int argc, char **argv) {
    static const struct option longopts[] = {{"no-tensors", no_argument, 0, 'N'},
                                              {"verify", no_argument, 0, 'V'},
                                              {"help", no_argument, 0, 'h'},
                                              CLI_ENGINE_LONGOPTS,
                                              {0, 0, 0, 0}};
    struct cli_engine_opts eo = {0};
    int list = 1, verify = 0, c, r;
    while ((c = getopt_long(argc, argv, "h" CLI_ENGINE_SHORTOPTS, longopts, NULL)) != -1) {
        if ((r = cli_engine_opt(&eo, c, optarg)) != 0) {
            if (r < 0) return 2;
            continue;
        }
        if (c == 'N') list = 0;
        else if (c == 'V') verify = 1;
        else if (c == 'h') {
            fputs(usage, stdout);
            return 0;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    if (!eo.model && optind < argc) eo.model = argv[optind++];
    if (optind < argc) {
        fprintf(stderr, "tmx inspect: unexpected argument \"%s\"\n%s", argv[optind], usage);
        return 2;
    }
    if (!eo.model) {
        fputs(usage, stderr);
        return 2;
    }
    char *err = NULL;
    if (verify) {
        if (tmx_manifest_verify(eo.model, 1, &err) != TMX_OK) return cli_fail("inspect", err);
        printf("%s: every file matches %s (size and SHA-256)\n", eo.model, TMX_MANIFEST_NAME);
        return 0;
    }
    struct tmx_config *cfg = NULL;
    struct tmx_plugins *ps = NULL;
    struct tmx_checkpoint *ck = NULL;
    struct tmx_model_config mc;
    const struct tmx_plugin *kernels;
    enum tmx_status st = tmx_config_load(eo.config, &cfg, &err);
    for (int i = 0; st == TMX_OK && i < eo.n_overrides; i++)
        st = tmx_config_set(cfg, eo.overrides[i], &err);
    if (st == TMX_OK) st = tmx_model_config_load(eo.model, &mc, &err);
    if (st == TMX_OK) st = tmx_checkpoint_open(eo.model, &ck, &err);
    if (st == TMX_OK) st = tmx_plugins_new(cfg, &ps, &err);
    if (st == TMX_OK) st = tmx_plugins_load(ps, TMX_PLUGIN_KERNELS,
                                            tmx_config_str(cfg, "kernels"), &kernels, &err);
    if (st == TMX_OK) st = tmx_plugins_load_configured(ps, &err);
    if (st == TMX_OK) {
        printf("model: %s\n", eo.model);
        print_config(&mc);
        print_tensors(ck, list);
        st = print_plugins(eo.model, cfg, ps, &err);
    }
    tmx_plugins_free(ps);
    tmx_checkpoint_free(ck);
    tmx_config_free(cfg);
    return st == TMX_OK ? 0 : cli_fail("inspect", err);
}
