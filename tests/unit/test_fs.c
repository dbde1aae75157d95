/* test_fs.c: whole files read, paths resolved before writing, and folder removal (core/fs.c,
 * tmx/fs.h).
 *
 * A file larger than one read comes back whole and NUL-terminated, an empty one as "", a missing
 * one as TMX_ERR_NOT_FOUND and a folder as TMX_ERR_IO, each message naming the path.
 * In a temporary folder holding a/b, a link to a and a file: paths that exist resolve as
 * realpath(3) has them; paths that do not resolve through their nearest existing parent, with
 * "." and ".." taken as written and repeated or trailing slashes dropped; "within" holds for a
 * folder itself and what lies under it (also through a link or ".."), not for a sibling whose
 * name starts alike. Removal takes a tree with a link in it without following the link, and a
 * missing path is no error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/fs.h"

static char dir[] = "/tmp/tmx-fs-XXXXXX";
static char root[4096]; /* dir, resolved */

static void path(char *buf, const char *rel) { snprintf(buf, 4096, "%s/%s", dir, rel); }

static int setup(void **state) {
    (void)state;
    char p[4096];
    strcpy(dir, "/tmp/tmx-fs-XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_non_null(realpath(dir, root));
    path(p, "a");
    assert_int_equal(mkdir(p, 0777), 0);
    path(p, "a/b");
    assert_int_equal(mkdir(p, 0777), 0);
    path(p, "ab");
    assert_int_equal(mkdir(p, 0777), 0);
    path(p, "a/b/f");
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fclose(f);
    char target[4096];
    path(target, "a");
    path(p, "link");
    assert_int_equal(symlink(target, p), 0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    return tmx_remove_tree(dir, NULL) == TMX_OK ? 0 : -1;
}

/* tmx_path_resolve(dir/rel) must be root/want. */
static void resolves(const char *rel, const char *want) {
    char p[4096], expect[4200];
    path(p, rel);
    snprintf(expect, sizeof expect, "%s%s%s", root, *want ? "/" : "", want);
    char *got = tmx_path_resolve(p);
    assert_non_null(got);
    assert_string_equal(got, expect);
    free(got);
}

static void test_resolve(void **state) {
    (void)state;
    resolves("a/b", "a/b");
    resolves("link/b/f", "a/b/f");
    resolves("a/new", "a/new");
    resolves("a/new/deeper/", "a/new/deeper");
    resolves("link//new/./x", "a/new/x");
    resolves("new/../a/b", "a/b");
    resolves("a/new/../../link/b", "a/b");
    resolves("a/b/f/x", "a/b/f/x"); /* a file on the way: ENOTDIR, resolved as written */
    resolves("new/..", "");
    char *got = tmx_path_resolve("/");
    assert_string_equal(got, "/");
    free(got);
    got = tmx_path_resolve("/nonesuch-tmx/x/..");
    assert_string_equal(got, "/nonesuch-tmx");
    free(got);
}

static void test_within(void **state) {
    (void)state;
    char a[4096], p[4096];
    path(a, "a");
    path(p, "a");
    assert_int_equal(tmx_path_within(p, a), 1);
    path(p, "a/b/f");
    assert_int_equal(tmx_path_within(p, a), 1);
    path(p, "link/new");
    assert_int_equal(tmx_path_within(p, a), 1);
    path(p, "ab/x/../..//a/");
    assert_int_equal(tmx_path_within(p, a), 1);
    path(p, "ab");
    assert_int_equal(tmx_path_within(p, a), 0);
    assert_int_equal(tmx_path_within(a, p), 0);
    assert_int_equal(tmx_path_within(a, "/"), 1);
}

static void test_remove_tree(void **state) {
    (void)state;
    char p[4096], keep[4096];
    path(p, "ab/link-to-a");
    path(keep, "a");
    assert_int_equal(symlink(keep, p), 0);
    path(p, "ab");
    assert_int_equal(tmx_remove_tree(p, NULL), TMX_OK);
    assert_int_equal(access(p, F_OK), -1);
    path(keep, "a/b/f");
    assert_int_equal(access(keep, F_OK), 0); /* the link went, not what it named */
    assert_int_equal(tmx_remove_tree(p, NULL), TMX_OK);
}

static void test_file_read(void **state) {
    (void)state;
    char p[4096], *text = NULL, *err = NULL;
    size_t len = 1, big = 200000; /* more than one 64 KiB read */
    path(p, "a/b/f");
    assert_int_equal(tmx_file_read(p, &text, &len, NULL), TMX_OK);
    assert_int_equal(len, 0);
    assert_string_equal(text, "");
    free(text);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    for (size_t i = 0; i < big; i++) fputc('a' + (int)(i % 26), f);
    fclose(f);
    assert_int_equal(tmx_file_read(p, &text, &len, NULL), TMX_OK);
    assert_int_equal(len, big);
    assert_int_equal(strlen(text), big);
    assert_int_equal(text[big - 1], 'a' + (int)((big - 1) % 26));
    free(text);
    path(p, "missing");
    assert_int_equal(tmx_file_read(p, &text, &len, &err), TMX_ERR_NOT_FOUND);
    assert_non_null(strstr(err, p));
    free(err);
    path(p, "a");
    assert_int_equal(tmx_file_read(p, &text, &len, &err), TMX_ERR_IO);
    assert_non_null(strstr(err, "Is a directory"));
    free(err);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_resolve, setup, teardown),
        cmocka_unit_test_setup_teardown(test_within, setup, teardown),
        cmocka_unit_test_setup_teardown(test_remove_tree, setup, teardown),
        cmocka_unit_test_setup_teardown(test_file_read, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
