/* tmx/manifest.h: trellismx-manifest.json, the integrity record of a quantized build
 * (docs/trellismx.md §10.6): the size and SHA-256 of every file, the expert chunks of each MoE
 * layer and the hashes of its coupled sign vectors.
 *
 * tmx quantize writes it last; tmx inspect --verify and the engine (config key "verify") check
 * a build against it, so that a changed, truncated, missing or stray file fails by name. */
#ifndef TMX_MANIFEST_H
#define TMX_MANIFEST_H

#include "tmx/status.h"

#define TMX_MANIFEST_NAME "trellismx-manifest.json"

/* Scans the build folder `dir` and writes dir/trellismx-manifest.json: every file but the
 * manifest (sorted by path), and, from experts/layer-LLL-SSS-EEE.safetensors and
 * coupled/layer-LLL.safetensors, the layers. The codec is hf_quant_config.json's "codec".
 * Rejects a file under experts/ or coupled/ whose name is not of that form, a layer whose
 * chunks leave a gap or overlap or do not end at config.json's n_routed_experts - 1, and a
 * layer without its coupled file. */
enum tmx_status tmx_manifest_write(const char *dir, char **err);

/* Checks `dir` against its manifest: the manifest's fields, every listed file's presence and
 * size, and with `hashes` its SHA-256 and the coupled vectors' hashes; every file under experts/
 * or coupled/ must be listed, and every layer's chunks must cover its experts from 0 without
 * gap or overlap. Each failure is one line naming the file. */
enum tmx_status tmx_manifest_verify(const char *dir, int hashes, char **err);

/* out <- the SHA-256 of the file at path in lower-case hex (read in 1 MiB pieces). */
enum tmx_status tmx_manifest_sha256_file(const char *path, char out[65], char **err);

#endif
