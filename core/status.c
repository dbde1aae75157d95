/* status.c: status names and the one-line error messages every fallible call returns. */
#include <stdio.h>
#include <stdlib.h>

#include "tmx/status.h"

const char *tmx_status_str(enum tmx_status st) {
    switch (st) {
    case TMX_OK: return "ok";
    case TMX_ERR_NOMEM: return "out of memory";
    case TMX_ERR_INVALID: return "invalid input";
    case TMX_ERR_UNSUPPORTED: return "unsupported";
    case TMX_ERR_DEVICE: return "device error";
    case TMX_ERR_ABI: return "ABI mismatch";
    case TMX_ERR_IO: return "I/O error";
    case TMX_ERR_NOT_FOUND: return "not found";
    case TMX_ERR_BUSY: return "busy";
    }
    return "unknown status";
}

enum tmx_status tmx_verr(char **err, enum tmx_status st, const char *fmt, va_list ap) {
    if (!err) return st;
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    char *msg = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (msg) {
        vsnprintf(msg, (size_t)n + 1, fmt, ap);
        /* Messages quote untrusted names and JSON excerpts; a control byte among them must not
         * break the one-line promise or a log line. */
        for (char *c = msg; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    }
    *err = msg;
    return st;
}

enum tmx_status tmx_err(char **err, enum tmx_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    tmx_verr(err, st, fmt, ap);
    va_end(ap);
    return st;
}
