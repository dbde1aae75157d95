/* plan.c: `tmx plan` — will a model fit these GPUs, and how much KV cache is left? Reads
 * headers only (tmx/plan.h); prints the plan of rank 0 as a table or as JSON. */
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tmx/kvcache.h"
#include "tmx/plan.h"

static const char usage[] =
    "usage: tmx plan [--model] DIR [options]\n\n"
    "Plans DIR on tensor-parallel GPUs from config.json, hf_quant_config.json and the\n"
    "safetensors headers (no tensor data): weights per rank, runtime allowance, KV cache,\n"
    "whether it fits, and the longest context / most sequences that do (docs/plan.md).\n\n"
    "  -m, --model DIR        model directory\n"
    "      --tp N             tensor-parallel ranks, one per GPU (default: the GPU count, or 1)\n"
    "      --gpus NxSIZE      GPUs and the memory of each, e.g. 4x96GiB or 8x80GB\n"
    "      --context N        positions per sequence (default: max_position_embeddings)\n"
    "      --kv DTYPE         KV cache type: f32, bf16, fp8 or int8 (default f32)\n"
    "      --seqs S           sequences held at once, config key max_running (default 1)\n"
    "      --batch B          tokens per step, config key batch (default 512)\n"
    "      --block-size N     positions per KV block, config key kv_block_size (default 16)\n"
    "      --reserve SIZE     fixed allowance per GPU for the CUDA context, cuBLASLt and NCCL\n"
    "                         (default 1GiB)\n"
    "      --virtual          plan from config.json alone: docs/model.md's tensors in BF16\n"
    "      --experts CODEC    with --virtual: bf16, trellis-e4m3 or trellis-fp4 routed experts\n"
    "                         (default: hf_quant_config.json's codec, else bf16)\n"
    "      --bits K           with --virtual: trellis bits per weight (default 3)\n"
    "      --json             print the plan as JSON\n";

static const double GIB = 1073741824.0;

static int parse_int(const char *name, const char *s, int *out) {
    long long v;
    if (cli_parse_int("plan", name, s, 1, INT_MAX, &v) < 0) return 0;
    *out = (int)v;
    return 1;
}

/* A size in GiB, or MiB below one GiB so that small models read too. */
static const char *human(char buf[32], uint64_t bytes) {
    const int gib = (double)bytes >= GIB;
    snprintf(buf, 32, "%.3f %s", (double)bytes / (gib ? GIB : GIB / 1024), gib ? "GiB" : "MiB");
    return buf;
}

static void row(const char *label, uint64_t bytes) {
    char h[32];
    printf("  %-44s %14s %16llu\n", label, human(h, bytes), (unsigned long long)bytes);
}

static void print_text(const char *dir, const struct tmx_plan *p) {
    const struct tmx_model_config *c = &p->cfg;
    const struct tmx_plan_options *o = &p->opt;
    const int tp = o->tp;
    char label[128];
    printf("model     %s: %d layers (%d full-attention, %d sliding-window of %d), %d query / %d "
           "KV heads of %d, hidden %d, vocab %d", dir, c->n_layers, p->n_full, p->n_sliding,
           c->sliding_window, c->n_heads, c->n_kv_heads, c->head_dim, c->hidden, c->vocab_size);
    if (c->n_routed_experts)
        printf(", %d routed experts (top %d, latent %d, width %d)", c->n_routed_experts,
               c->n_experts_per_tok, c->moe_latent_size, c->moe_intermediate_size);
    printf("\nweights   %s: experts %s", o->virtual_model ? "virtual (docs/model.md's tensors, "
           "BF16)" : "from the safetensors headers", p->experts_codec);
    if (p->experts_bits) printf(" K=%d, block scales per %d", p->experts_bits, p->experts_block);
    printf("%s\n", p->attention_mxfp8 ? "; attention MXFP8" : "");
    char h1[32], h2[32], h3[32];
    printf("files     %s of tensors (%llu bytes) in %lld tensors", human(h1, p->file_bytes),
           (unsigned long long)p->file_bytes, (long long)p->n_tensors);
    if (!o->virtual_model) printf(", %d safetensors files", p->n_files);
    if (p->n_unused)
        printf("; %lld tensors (%s) are not part of the graph and not loaded",
               (long long)p->n_unused, human(h1, p->unused_bytes));
    printf("\nlayout    TP %d", tp);
    if (o->n_gpus) printf(" on %d x %s", o->n_gpus, human(h1, o->gpu_bytes));
    printf("; context %d, %d sequence%s, batch %d, KV %s in blocks of %d\n\n", o->context,
           p->seqs, p->seqs == 1 ? "" : "s", p->batch, tmx_kv_dtype_name(o->kv_dtype),
           o->block_size);

    printf("  %-44s %14s %16s\n", "per rank (rank 0, the largest share)", "", "bytes");
    printf("  sharded weights\n");
    snprintf(label, sizeof label, "  attention q/k/v/o (%d of %d KV heads)", c->n_kv_heads / tp,
             c->n_kv_heads);
    row(label, p->part_rank[TMX_PLAN_ATTENTION]);
    row("  routed experts (16x16-tile slices)", p->part_rank[TMX_PLAN_EXPERTS]);
    row("  dense and shared-expert MLPs (tile slices)", p->part_rank[TMX_PLAN_MLP]);
    row("  embedding + lm_head (vocabulary rows)", p->part_rank[TMX_PLAN_VOCAB]);
    printf("  replicated weights\n");
    row("  routers + correction biases", p->part_rank[TMX_PLAN_ROUTERS]);
    row("  bridges", p->part_rank[TMX_PLAN_BRIDGES]);
    row("  norms + residual gates", p->part_rank[TMX_PLAN_NORMS]);
    row("  codec: matrix scales g + sign vectors", p->part_rank[TMX_PLAN_CODEC]);
    row("weights", p->weights);
    printf("  runtime allowance\n");
    snprintf(label, sizeof label, "  step buffers (batch %d, %d sequence%s)", p->batch, p->seqs,
             p->seqs == 1 ? "" : "s");
    row(label, p->step_buffers);
    row("  kernel scratch (BF16 matmul split, x2)", p->kernel_scratch);
    row("  codec scratch (trellis expert block)", p->codec_scratch);
    row("  reserve (CUDA context, cuBLASLt, NCCL)", p->reserve);
    row("runtime", p->runtime);
    printf("  KV cache: %llu B per position on full-attention layers, %llu on sliding ones\n",
           (unsigned long long)p->kv_full_token, (unsigned long long)p->kv_sliding_token);
    snprintf(label, sizeof label, "  %d full-attention layers: %d positions", p->n_full,
             p->full_blocks * o->block_size);
    row(label, p->kv_full);
    snprintf(label, sizeof label, "  %d sliding-window layers: %d positions", p->n_sliding,
             p->sliding_blocks * o->block_size);
    row(label, p->kv_sliding);
    row("KV cache", p->kv);
    row("total", p->total);
    if (!o->n_gpus) {
        printf("\n(no --gpus: no fit or capacity)\n");
        return;
    }
    const uint64_t by = (uint64_t)(p->headroom < 0 ? -p->headroom : p->headroom);
    printf("\nfit       %s of %s per GPU: %s by %s\n", human(h1, p->total),
           human(h2, o->gpu_bytes), p->fits ? "fits, spare" : "DOES NOT FIT, short",
           human(h3, by));
    printf("capacity  longest context for %d sequence%s: ", p->seqs, p->seqs == 1 ? "" : "s");
    if (p->max_context) printf("%d%s\n", p->max_context,
                               p->max_context_capped ? " (max_position_embeddings; memory is "
                               "not the limit)" : "");
    else printf("none (weights and runtime alone do not fit)\n");
    printf("          most sequences at context %d: %d%s\n", o->context, p->max_seqs,
           p->max_seqs_capped ? " (the batch caps sequences per step; memory is not the limit)"
                              : "");
}

static json_t *bytes_obj(const char *const *names, const uint64_t *v, int n) {
    json_t *o = json_object();
    for (int i = 0; i < n; i++) json_object_set_new(o, names[i], json_integer((json_int_t)v[i]));
    return o;
}

static void print_json(const char *dir, const struct tmx_plan *p) {
    const struct tmx_plan_options *o = &p->opt;
    const char *parts[TMX_PLAN_N_PARTS];
    for (int i = 0; i < TMX_PLAN_N_PARTS; i++) parts[i] = tmx_plan_part_name(i);
    json_t *r = json_object();
    json_object_set_new(r, "model", json_string(dir));
    json_object_set_new(r, "virtual", json_boolean(o->virtual_model));
    json_object_set_new(r, "experts", json_string(p->experts_codec));
    json_object_set_new(r, "experts_bits", json_integer(p->experts_bits));
    json_object_set_new(r, "attention_mxfp8", json_boolean(p->attention_mxfp8));
    json_object_set_new(r, "tp", json_integer(o->tp));
    json_object_set_new(r, "gpus", json_integer(o->n_gpus));
    json_object_set_new(r, "gpu_bytes", json_integer((json_int_t)o->gpu_bytes));
    json_object_set_new(r, "context", json_integer(o->context));
    json_object_set_new(r, "seqs", json_integer(p->seqs));
    json_object_set_new(r, "batch", json_integer(p->batch));
    json_object_set_new(r, "block_size", json_integer(o->block_size));
    json_object_set_new(r, "kv_dtype", json_string(tmx_kv_dtype_name(o->kv_dtype)));
    json_object_set_new(r, "files", json_integer(p->n_files));
    json_object_set_new(r, "tensors", json_integer(p->n_tensors));
    json_object_set_new(r, "file_bytes", json_integer((json_int_t)p->file_bytes));
    json_object_set_new(r, "unused_tensors", json_integer(p->n_unused));
    json_object_set_new(r, "unused_bytes", json_integer((json_int_t)p->unused_bytes));
    json_object_set_new(r, "model_bytes", bytes_obj(parts, p->part_model, TMX_PLAN_N_PARTS));
    json_object_set_new(r, "rank_bytes", bytes_obj(parts, p->part_rank, TMX_PLAN_N_PARTS));
    static const char *const w[3] = {"sharded", "replicated", "weights"};
    const uint64_t wv[3] = {p->sharded, p->replicated, p->weights};
    json_object_set_new(r, "weights", bytes_obj(w, wv, 3));
    static const char *const rt[5] = {"step_buffers", "kernel_scratch", "codec_scratch",
                                      "reserve", "runtime"};
    const uint64_t rv[5] = {p->step_buffers, p->kernel_scratch, p->codec_scratch, p->reserve,
                            p->runtime};
    json_object_set_new(r, "runtime", bytes_obj(rt, rv, 5));
    static const char *const kv[7] = {"full_per_position", "sliding_per_position",
                                      "full_positions", "sliding_positions", "full", "sliding",
                                      "kv"};
    const uint64_t kvv[7] = {p->kv_full_token, p->kv_sliding_token,
                             (uint64_t)p->full_blocks * (uint64_t)o->block_size,
                             (uint64_t)p->sliding_blocks * (uint64_t)o->block_size, p->kv_full,
                             p->kv_sliding, p->kv};
    json_t *kvo = bytes_obj(kv, kvv, 7);
    json_object_set_new(kvo, "full_layers", json_integer(p->n_full));
    json_object_set_new(kvo, "sliding_layers", json_integer(p->n_sliding));
    json_object_set_new(r, "kv_cache", kvo);
    json_object_set_new(r, "total", json_integer((json_int_t)p->total));
    if (o->n_gpus) {
        json_object_set_new(r, "fits", json_boolean(p->fits));
        json_object_set_new(r, "headroom", json_integer(p->headroom));
        json_object_set_new(r, "max_context", json_integer(p->max_context));
        json_object_set_new(r, "max_context_capped", json_boolean(p->max_context_capped));
        json_object_set_new(r, "max_seqs", json_integer(p->max_seqs));
        json_object_set_new(r, "max_seqs_capped", json_boolean(p->max_seqs_capped));
    }
    char *s = json_dumps(r, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    if (s) puts(s);
    free(s);
    json_decref(r);
}

int cmd_plan(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"tp", required_argument, 0, 'T'},
        {"gpus", required_argument, 0, 'g'},    {"context", required_argument, 0, 'C'},
        {"kv", required_argument, 0, 'k'},      {"seqs", required_argument, 0, 's'},
        {"batch", required_argument, 0, 'b'},   {"block-size", required_argument, 0, 'B'},
        {"reserve", required_argument, 0, 'r'}, {"virtual", no_argument, 0, 'v'},
        {"experts", required_argument, 0, 'e'}, {"bits", required_argument, 0, 'K'},
        {"json", no_argument, 0, 'j'},          {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    struct tmx_plan_options o = {.kv_dtype = TMX_DTYPE_F32};
    const char *dir = NULL;
    int json = 0, c, ok = 1;
    char *msg = NULL;
    while (ok && (c = getopt_long(argc, argv, "hm:", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': dir = optarg; break;
        case 'T': ok = parse_int("tp", optarg, &o.tp); break;
        case 'C': ok = parse_int("context", optarg, &o.context); break;
        case 's': ok = parse_int("seqs", optarg, &o.seqs); break;
        case 'b': ok = parse_int("batch", optarg, &o.batch); break;
        case 'B': ok = parse_int("block-size", optarg, &o.block_size); break;
        case 'K': ok = parse_int("bits", optarg, &o.bits); break;
        case 'v': o.virtual_model = 1; break;
        case 'e': o.experts = optarg; break;
        case 'j': json = 1; break;
        case 'g':
            if (tmx_plan_parse_gpus(optarg, &o.n_gpus, &o.gpu_bytes, &msg) != TMX_OK)
                return cli_fail("plan", msg);
            break;
        case 'r':
            if (tmx_plan_parse_size(optarg, &o.reserve, &msg) != TMX_OK) {
                fprintf(stderr, "tmx plan: --reserve: %s\n", msg ? msg : "out of memory");
                free(msg);
                return 2;
            }
            break;
        case 'k':
            if ((o.kv_dtype = tmx_kv_dtype_parse(optarg)) == TMX_DTYPE_COUNT) {
                fprintf(stderr, "tmx plan: --kv: \"%s\" is not f32, bf16, fp8 or int8\n", optarg);
                return 2;
            }
            break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (!ok) return 2;
    if (!dir && optind < argc) dir = argv[optind++];
    if (!dir || optind < argc) {
        fprintf(stderr, "tmx plan: %s\n", dir ? "one model directory only" : "a model directory "
                "is required (tmx plan DIR)");
        return 2;
    }
    struct tmx_plan *p = malloc(sizeof *p);
    if (!p) return cli_fail("plan", NULL);
    if (tmx_plan_compute(dir, &o, p, &msg) != TMX_OK) {
        free(p);
        return cli_fail("plan", msg);
    }
    if (json) print_json(dir, p);
    else print_text(dir, p);
    const int rc = o.n_gpus && !p->fits ? 3 : 0;
    free(p);
    return rc;
}
