/* testutil.c: fixture lookup in ../shared, scratch directories, running the moe binary. */
#include "testutil.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int in_ci(void) {
    const char *ci = getenv("CI");
    return ci && strcmp(ci, "true") == 0;
}

const char *moe_test_shared(const char *relpath) {
    static char paths[16][1024];
    static unsigned next;
    char *p = paths[next++ % 16];
    const char *root = getenv("MOE_SHARED");
    snprintf(p, sizeof paths[0], "%s/%s", root ? root : "../shared", relpath);
    struct stat st;
    if (stat(p, &st) == 0) return p;
    if (in_ci()) fail_msg("fixture %s is missing and CI=true: ../shared must be present", p);
    print_message("[  SKIP    ] fixture %s is absent (set MOE_SHARED or check out ../shared)\n", p);
    return NULL;
}

uint8_t *moe_test_shared_read(const char *relpath, size_t *size) {
    const char *p = moe_test_shared(relpath);
    if (!p) return NULL;
    uint8_t *data;
    moe_error err = {0};
    if (moe_file_read(p, &data, size, &err) != MOE_OK) fail_msg("%s", err.msg);
    return data;
}

const char *moe_test_fixture(const char *relpath) {
    static char paths[16][1024];
    static unsigned next;
    char *p = paths[next++ % 16];
    snprintf(p, sizeof paths[0], "build/fixtures/%s", relpath);
    struct stat st;
    if (stat(p, &st) == 0) return p;
    if (in_ci()) fail_msg("fixture %s is missing and CI=true: run `make fixtures`", p);
    print_message("[  SKIP    ] fixture %s is absent (run `make fixtures`)\n", p);
    return NULL;
}

static char tmpdir[256];

static void remove_tmpdir(void) {
    if (!tmpdir[0]) return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
}

const char *moe_test_tmpdir(void) {
    if (!tmpdir[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpdir, sizeof tmpdir, "%s/moe-test-XXXXXX", base ? base : "/tmp");
        if (!mkdtemp(tmpdir)) fail_msg("mkdtemp: %s", strerror(errno));
        atexit(remove_tmpdir);
    }
    return tmpdir;
}

const char *moe_test_bin(void) {
    const char *b = getenv("MOE_BIN");
    return b ? b : "./moe";
}

int moe_test_run(const char *cmd, char **out) {
    char full[8192];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p) fail_msg("popen %s failed", cmd);
    size_t cap = 4096, n = 0;
    char *buf = moe_xmalloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += got;
        if (cap - n < 2) buf = moe_xrealloc(buf, cap *= 2);
    }
    buf[n] = '\0';
    int status = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}
