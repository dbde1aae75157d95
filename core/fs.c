/* fs.c: whole files read, paths resolved before anything is written, and removal of a folder
 * (tmx/fs.h). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tmx/fs.h"

enum tmx_status tmx_file_read(const char *path, char **out, size_t *len, char **err) {
    const int std_in = strcmp(path, "-") == 0;
    FILE *f = std_in ? stdin : fopen(path, "rb");
    if (!f)
        return tmx_err(err, errno == ENOENT ? TMX_ERR_NOT_FOUND : TMX_ERR_IO, "%s: %s", path,
                       strerror(errno));
    char *buf = NULL;
    size_t cap = 0, n;
    *len = 0;
    do {
        if (*len + 65536 + 1 > cap) { /* room for a full read and the NUL */
            char *p = realloc(buf, 2 * cap + 65536 + 1);
            if (!p) {
                free(buf);
                if (!std_in) fclose(f);
                return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = p;
            cap = 2 * cap + 65536 + 1;
        }
        *len += (n = fread(buf + *len, 1, cap - *len - 1, f));
    } while (n > 0);
    const int bad = ferror(f) ? errno : 0;
    if (!std_in) fclose(f);
    if (bad) {
        free(buf);
        return tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(bad));
    }
    buf[*len] = '\0';
    *out = buf;
    return TMX_OK;
}

char *tmx_path_resolve(const char *path) {
    char *cur = path[0] == '/' ? strdup("/") : realpath(".", NULL);
    for (const char *s = path; cur && *s;) {
        for (; *s == '/'; s++) {}
        const size_t m = strcspn(s, "/");
        if (m == 2 && s[0] == '.' && s[1] == '.') { /* cur has no links: its parent is lexical */
            char *slash = strrchr(cur, '/');
            slash[slash == cur] = 0;
        } else if (m > 0 && !(m == 1 && s[0] == '.')) {
            char *next = NULL, *real;
            struct stat sb;
            if (asprintf(&next, "%s%s%.*s", cur, strcmp(cur, "/") ? "/" : "", (int)m, s) < 0)
                next = NULL;
            else if (lstat(next, &sb) == 0 && (real = realpath(next, NULL))) {
                free(next);
                next = real;
            }
            free(cur);
            cur = next;
        }
        s += m;
    }
    return cur;
}

int tmx_path_within(const char *path, const char *dir) {
    char *p = tmx_path_resolve(path), *d = p ? tmx_path_resolve(dir) : NULL;
    int in = -1;
    if (p && d) {
        const size_t n = strlen(d);
        in = strncmp(p, d, n) == 0 && (p[n] == 0 || p[n] == '/' || (n == 1 && d[0] == '/'));
    }
    free(p);
    free(d);
    return in;
}

enum tmx_status tmx_remove_tree(const char *path, char **err) {
    struct stat sb;
    if (lstat(path, &sb) != 0)
        return errno == ENOENT ? TMX_OK : tmx_err(err, TMX_ERR_IO, "%s: %s", path,
                                                  strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return unlink(path) == 0 || errno == ENOENT
                   ? TMX_OK : tmx_err(err, TMX_ERR_IO, "%s: cannot remove: %s", path,
                                      strerror(errno));
    DIR *d = opendir(path);
    if (!d) return tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
    enum tmx_status st = TMX_OK;
    for (struct dirent *de; st == TMX_OK && (de = readdir(d));) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        char *sub = NULL;
        if (asprintf(&sub, "%s/%s", path, de->d_name) < 0)
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        else
            st = tmx_remove_tree(sub, err);
        free(sub);
    }
    closedir(d);
    if (st == TMX_OK && rmdir(path) != 0 && errno != ENOENT)
        st = tmx_err(err, TMX_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    return st;
}
