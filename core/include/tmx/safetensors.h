/* tmx/safetensors.h: safetensors files and Hugging Face checkpoint directories.
 *
 * A safetensors file is `u64 little-endian header length N | N bytes of JSON header | data`.
 * The header maps tensor names to {dtype, shape, data_offsets: [begin, end)} relative to the
 * data section, plus an optional "__metadata__" object of strings. tmx maps the file read-only
 * and hands out tensors whose data points into the mapping: they are valid until the file (or
 * checkpoint) is freed. */
#ifndef TMX_SAFETENSORS_H
#define TMX_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"
#include "tmx/tensor.h"

struct tmx_safetensors;

/* Parses a whole file image already in memory (buf stays owned by the caller and must outlive
 * the result). Rejects: a header length that does not fit the buffer, a header that is not a
 * JSON object, unknown dtypes, shapes whose byte size disagrees with data_offsets, offsets out
 * of the data section, overlapping tensors, and duplicate names. `name` is used in messages. */
enum tmx_status tmx_safetensors_parse(const void *buf, size_t size, const char *name,
                                      struct tmx_safetensors **out, char **err);
/* mmaps `path` and parses it; the mapping belongs to the result. */
enum tmx_status tmx_safetensors_open(const char *path, struct tmx_safetensors **out, char **err);
void tmx_safetensors_free(struct tmx_safetensors *st);

size_t tmx_safetensors_count(const struct tmx_safetensors *st);
/* i-th tensor in file order (sorted by data offset); returns its name. */
const char *tmx_safetensors_at(const struct tmx_safetensors *st, size_t i, struct tmx_tensor *t);
/* Returns 0 and fills *t, or -1 if no tensor has that name. */
int tmx_safetensors_find(const struct tmx_safetensors *st, const char *name, struct tmx_tensor *t);
/* "__metadata__" value for key, or NULL. */
const char *tmx_safetensors_meta(const struct tmx_safetensors *st, const char *key);

/* Writes a safetensors file: n tensors (host data) named names[i], in that order, each aligned
 * to 8 bytes; meta_kv is NULL or a NULL-terminated list of key, value, key, value, ... strings
 * for "__metadata__". Writes to path + ".tmp" and renames, so a reader never sees half a file. */
enum tmx_status tmx_safetensors_write(const char *path, int n, const char *const *names,
                                      const struct tmx_tensor *tensors, const char *const *meta_kv,
                                      char **err);

/* --- checkpoint directories ---------------------------------------------------------------- */

struct tmx_checkpoint;

/* Opens a Hugging Face model directory: model.safetensors, or the shards listed by
 * model.safetensors.index.json ("weight_map": tensor name -> file). Every shard is mmapped; a
 * tensor listed in the index but missing from its shard, or present in two files, is an error
 * naming both; so is a tensor a shard holds but the index leaves out. Without an index it opens
 * model.safetensors, or else the directory's only *.safetensors file (several need the index).
 * config.json is not parsed here (see tmx/model.h). */
enum tmx_status tmx_checkpoint_open(const char *dir, struct tmx_checkpoint **out, char **err);
void tmx_checkpoint_free(struct tmx_checkpoint *ck);

const char *tmx_checkpoint_dir(const struct tmx_checkpoint *ck);
size_t tmx_checkpoint_count(const struct tmx_checkpoint *ck);
/* i-th tensor, sorted by name; returns the name, fills *t, and (if file non-NULL) the name of
 * the file it lives in. */
const char *tmx_checkpoint_at(const struct tmx_checkpoint *ck, size_t i, struct tmx_tensor *t,
                              const char **file);
/* Returns 0 and fills *t, or -1 if absent. */
int tmx_checkpoint_find(const struct tmx_checkpoint *ck, const char *name, struct tmx_tensor *t);
/* The index of tensor `name` in tmx_checkpoint_at's order, or -1 if absent. */
int64_t tmx_checkpoint_index(const struct tmx_checkpoint *ck, const char *name);

#endif
