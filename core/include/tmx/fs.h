/* tmx/fs.h: reading a whole file, and what the commands that write folders (tmx quantize,
 * tmx pack, tmx eval-kld) need to keep from writing over their inputs or over files they did not
 * make. */
#ifndef TMX_FS_H
#define TMX_FS_H

#include "tmx/status.h"

#include <stddef.h>

/* Reads the whole file at `path` ("-": standard input) into *out, malloc'd and NUL-terminated
 * (the caller frees it), *len bytes before the NUL. TMX_ERR_NOT_FOUND when it does not exist,
 * TMX_ERR_IO when it cannot be read; messages start with `path`. */
enum tmx_status tmx_file_read(const char *path, char **out, size_t *len, char **err);

/* The absolute, link-free form of `path`, which need not exist: part by part, each that exists
 * through realpath(3), the others as written, "." and ".." as in a folder made there. malloc'd
 * (the caller frees it); NULL with errno set on failure. */
char *tmx_path_resolve(const char *path);

/* 1 when `path` is `dir` or lies under it (both resolved), 0 when not, -1 (errno set) when
 * either cannot be resolved. */
int tmx_path_within(const char *path, const char *dir);

/* Removes `path` and, when it is a folder, everything in it; links are removed, not followed.
 * A `path` that does not exist is no error. */
enum tmx_status tmx_remove_tree(const char *path, char **err);

#endif
