/* testutil.c: fixture lookup in ../shared, scratch directories, running the moe binary. */
#include "testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
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

/* ==== Seeded random numbers ==== */

/* ==== Quantization fixtures ==== */

#define MAX_QUANT_FIXTURES 32

int moe_test_quant_fixtures(const moe_test_quant_fixture **out) {
    static moe_test_quant_fixture fixtures[MAX_QUANT_FIXTURES];
    static int count = -1; /* -1: not read yet */
    *out = fixtures;
    if (count >= 0) {
        if (count == 0) skip();
        return count;
    }
    count = 0;
    const char *path = moe_test_shared("quant/MANIFEST.json");
    if (!path) {
        skip();
        return 0;
    }
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) fail_msg("%s:%d: %s", path, jerr.line, jerr.text);
    json_t *types = json_object_get(root, "types");
    if (!json_is_array(types) || json_array_size(types) > MAX_QUANT_FIXTURES)
        fail_msg("%s: no usable \"types\" array", path);
    size_t i;
    json_t *t;
    json_array_foreach(types, i, t) {
        moe_test_quant_fixture *f = &fixtures[count++];
        snprintf(f->name, sizeof f->name, "%s", json_string_value(json_object_get(t, "type")));
        if (!moe_type_from_name(f->name, &f->type))
            fail_msg("unknown type %s in manifest", f->name);
        f->row_len = json_integer_value(json_object_get(t, "row_len"));
        f->n_rows = json_integer_value(json_object_get(t, "n_rows"));
        f->block_values = json_integer_value(json_object_get(t, "block_size_values"));
        f->block_bytes = (size_t)json_integer_value(json_object_get(t, "bytes_per_block"));
        f->has_src = json_is_true(json_object_get(t, "src_stored"));
        snprintf(f->dot_type, sizeof f->dot_type, "%s",
                 json_string_value(json_object_get(t, "ggml_cpu_vec_dot_type")));
    }
    json_decref(root);
    if (count == 0) fail_msg("%s lists no types", path);
    return count;
}

uint8_t *moe_test_quant_read(const moe_test_quant_fixture *f, const char *suffix, size_t expect) {
    char rel[128];
    snprintf(rel, sizeof rel, "quant/%s.%s", f->name, suffix);
    size_t size;
    uint8_t *data = moe_test_shared_read(rel, &size);
    if (!data) fail_msg("fixture %s vanished", rel);
    if (size != expect) fail_msg("%s: %zu bytes, expected %zu", rel, size, expect);
    return data;
}
