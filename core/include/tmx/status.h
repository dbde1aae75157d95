/* tmx/status.h: status codes and error messages shared by the core and every plugin.
 *
 * Every fallible function returns enum tmx_status. Where a caller wants a reason, the function
 * also takes `char **err`: on failure it stores a malloc'd one-line message there (the caller
 * frees it); on success it leaves *err untouched. Library code never calls exit(). */
#ifndef TMX_STATUS_H
#define TMX_STATUS_H

#include <stdarg.h>

enum tmx_status {
    TMX_OK = 0,
    TMX_ERR_NOMEM = -1,       /* allocation failed */
    TMX_ERR_INVALID = -2,     /* bad input: file, field or parameter named in the message */
    TMX_ERR_UNSUPPORTED = -3, /* valid, but not something this build or plugin does */
    TMX_ERR_DEVICE = -4,      /* a device (GPU) call failed */
    TMX_ERR_ABI = -5,         /* a plugin built for another ABI */
    TMX_ERR_IO = -6,          /* open/read/mmap failed */
    TMX_ERR_NOT_FOUND = -7,   /* a named file, plugin, symbol or tensor does not exist */
    TMX_ERR_BUSY = -8,        /* a bounded queue is full: try again later */
};

const char *tmx_status_str(enum tmx_status st);

/* Formats a message into a new malloc'd string and stores it in *err (if err is non-NULL),
 * replacing nothing: *err must be NULL or the caller leaks. Returns st, so that error paths read
 * `return tmx_err(err, TMX_ERR_INVALID, "%s: bad dtype", path);`. */
enum tmx_status tmx_err(char **err, enum tmx_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
enum tmx_status tmx_verr(char **err, enum tmx_status st, const char *fmt, va_list ap);

#endif
