/* tmx/pack.h: the per-rank layout of a TrellisMX build for tensor parallelism (docs/tp.md,
 * "tmx pack").
 *
 * A pack of a build for tp = N is a folder OUT:
 *
 *     OUT/tmx-pack.json          the pack index: tp, the source manifest's SHA-256, each rank's
 *                                folder and the SHA-256 of its manifest
 *     OUT/config.json, ...       the build's non-expert files, whole (what the engine opens)
 *     OUT/tmx-pack.log           the files written: what a rerun checks and keeps
 *     OUT/rank-R/                rank R's build: the non-expert files (hard links to OUT's,
 *                                copies where links fail), coupled/ whole, experts/ holding
 *                                rank R's slice of every expert (gate/up rows, down columns
 *                                [R·inter/N, (R+1)·inter/N)), its own trellismx-manifest.json
 *                                and tmx-pack.json (tp, rank, source manifest SHA-256)
 *
 * No weight is coded again: the trellis words are cut on tile boundaries, the block scales are
 * cut and their CSF streams written again (a lossless encoding of the same bytes). */
#ifndef TMX_PACK_H
#define TMX_PACK_H

#include <stdint.h>

#include "tmx/status.h"

#define TMX_PACK_NAME "tmx-pack.json"

struct tmx_pack_options {
    const char *checkpoint;          /* a TrellisMX build with its trellismx-manifest.json */
    const char *out;                 /* the pack's folder (made if missing) */
    int tp;                          /* ranks, >= 1 */
    int full_closure;                /* decode every slice and compare with the unsplit decode */
    int n_overrides;                 /* config assignments for the codec's plugin registry */
    const char *const *overrides;
    /* called after each step of a phase ("verify", "pack", "closure"); may be NULL */
    void (*progress)(void *arg, const char *phase, int64_t done, int64_t total);
    void *progress_arg;
};

struct tmx_pack_report {
    int written;                     /* files written by this run */
    int kept;                        /* files a previous run wrote, found intact and kept */
    int64_t slices_checked;          /* --full-closure: expert matrices compared */
};

/* Verifies every file of o->checkpoint against its manifest, then writes the pack (skipping
 * files that OUT/tmx-pack.log records and that still match), each under a temporary name
 * renamed when complete. Refuses an OUT that is o->checkpoint or lies inside it, one that holds
 * a pack of another checkpoint or tp, and one that holds any file an earlier run of this pack
 * did not write (the log names every file before it is written). */
enum tmx_status tmx_pack(const struct tmx_pack_options *o, struct tmx_pack_report *report,
                         char **err);

/* Where rank `rank` of n_ranks finds its experts in model folder `dir`: *rank_dir (malloc'd,
 * the caller frees it) is dir itself for a plain build, and dir/rank-R for a pack, whose index
 * must be for n_ranks ranks and whose rank folder must hold every file its manifest lists at
 * its size. */
enum tmx_status tmx_pack_rank_dir(const char *dir, int rank, int n_ranks, char **rank_dir,
                                  char **err);

#endif
