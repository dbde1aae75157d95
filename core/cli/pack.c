/* pack.c: `tmx pack` — a TrellisMX build laid out per tensor-parallel rank (tmx/pack.h). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "tmx/pack.h"

static const char usage[] =
    "usage: tmx pack --tp N [options] CHECKPOINT OUT\n\n"
    "Lays out the TrellisMX build CHECKPOINT (made by tmx quantize) for N tensor-parallel\n"
    "ranks without coding any weight again: OUT/rank-R holds rank R's slice of every expert,\n"
    "the non-expert files, its trellismx-manifest.json and tmx-pack.json; OUT itself opens as\n"
    "the model (`tmx generate --model OUT --tp N`). Every source file is verified against\n"
    "CHECKPOINT/trellismx-manifest.json first. OUT must lie outside CHECKPOINT and be new,\n"
    "empty, or an earlier run of this pack, whose files a rerun keeps when intact (docs/tp.md).\n\n"
    "      --tp N             ranks (moe_intermediate_size must split into N slices of 128)\n"
    "      --full-closure     decode every expert slice of every rank through the codec and\n"
    "                         compare it with the same slice of the unsplit decode (bit for bit)\n"
    "      --set KEY=VALUE    configuration for finding the codec plugin, e.g. plugin_dir=DIR\n"
    "  -q, --quiet            no progress bar\n";

struct bar {
    int tty, last; /* stderr is a terminal; the last permille drawn (-1: none yet) */
    const char *phase;
};

/* A bar on stderr: redrawn in place on a terminal, else one line per 10 %. */
static void draw(void *arg, const char *phase, int64_t done, int64_t total) {
    struct bar *b = arg;
    if (b->phase && strcmp(b->phase, phase) != 0 && b->last >= 0 && b->tty) fputc('\n', stderr);
    if (!b->phase || strcmp(b->phase, phase) != 0) b->last = -1;
    b->phase = phase;
    const int pm = total > 0 ? (int)(done * 1000 / total) : 1000;
    if (pm == b->last || (!b->tty && b->last >= 0 && pm / 100 == b->last / 100 && pm < 1000))
        return;
    b->last = pm;
    char fill[41];
    memset(fill, '#', 40);
    memset(fill + pm * 40 / 1000, '.', 40 - (size_t)(pm * 40 / 1000));
    fill[40] = 0;
    fprintf(stderr, "%s%-8s [%s] %5.1f%%%s", b->tty ? "\r" : "", phase, fill, pm / 10.0,
            b->tty ? "" : "\n");
    if (b->tty && pm == 1000) fputc('\n', stderr);
    fflush(stderr);
}

int cmd_pack(int argc, char **argv) {
    static const struct option longopts[] = {
        {"tp", required_argument, 0, 'p'},       {"full-closure", no_argument, 0, 'f'},
        {"set", required_argument, 0, 'S'},      {"quiet", no_argument, 0, 'q'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    const char *overrides[TMX_CLI_MAX_OVERRIDES];
    struct tmx_pack_options o = {.overrides = overrides};
    int quiet = 0, c;
    while ((c = getopt_long(argc, argv, "qh", longopts, NULL)) != -1) {
        switch (c) {
        case 'p': {
            long long v;
            if (cli_parse_int("pack", "tp", optarg, 1, INT_MAX, &v) < 0) return 2;
            o.tp = (int)v;
            break;
        }
        case 'f': o.full_closure = 1; break;
        case 'S':
            if (o.n_overrides == TMX_CLI_MAX_OVERRIDES) {
                fprintf(stderr, "tmx pack: at most %d --set options\n", TMX_CLI_MAX_OVERRIDES);
                return 2;
            }
            overrides[o.n_overrides++] = optarg;
            break;
        case 'q': quiet = 1; break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (argc - optind != 2 || o.tp < 1) {
        fprintf(stderr, "tmx pack: --tp N, CHECKPOINT and OUT are required\n%s", usage);
        return 2;
    }
    o.checkpoint = argv[optind];
    o.out = argv[optind + 1];
    struct bar bar = {.tty = isatty(STDERR_FILENO), .last = -1};
    if (!quiet) {
        o.progress = draw;
        o.progress_arg = &bar;
    }
    struct tmx_pack_report rep;
    char *err = NULL;
    if (tmx_pack(&o, &rep, &err) != TMX_OK) {
        if (bar.tty && bar.last >= 0 && bar.last < 1000) fputc('\n', stderr);
        return cli_fail("pack", err);
    }
    printf("%s: tp = %d, files written: %d, kept from an earlier run: %d", o.out, o.tp,
           rep.written, rep.kept);
    if (o.full_closure)
        printf("; full closure: %lld expert slices decode bit for bit as the unsplit build",
               (long long)rep.slices_checked);
    printf("\n");
    return 0;
}
