/* err.c: one-line error messages, made as tmx_err() makes them, without linking libtmx. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "impl.h"

enum tmx_status trellis_err(char **err, enum tmx_status st, const char *fmt, ...) {
    if (!err) return st;
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    char *msg = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (msg) vsnprintf(msg, (size_t)n + 1, fmt, ap);
    va_end(ap);
    *err = msg;
    return st;
}
