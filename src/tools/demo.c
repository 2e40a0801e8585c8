/* demo.c: the built-in demo model -- synth's "tiny" preset (a small qwen3moe, Q8_0 weights,
 * seeded random values, a small SentencePiece-style vocabulary), written as GGUF into the
 * cache directory on first use so `moe run` works on a fresh machine with nothing downloaded.
 * The trap: bump DEMO_VERSION whenever the recipe changes, or old caches keep serving the
 * previous file. */
#include "tools.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEMO_VERSION 4

moe_status moe_demo_model_write(const char *path, moe_error *err) {
    moe_synth_params p;
    MOE_CHECK(moe_synth_preset("tiny", &p));
    static const moe_synth_rule q8_everywhere[] = {{".*", MOE_TYPE_Q8_0}};
    p.rules = q8_everywhere;
    p.n_rules = 1;
    p.name = "moe built-in demo (random weights)";
    p.mute_special_output = true;
    return moe_synth_write(&p, path, err);
}

/* ==== Cache ==== */

static bool make_dirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        const bool ok = mkdir(path, 0755) == 0 || errno == EEXIST;
        *p = '/';
        if (!ok) return false;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST;
}

char *moe_demo_model_path(moe_error *err) {
    char dir[4096];
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && xdg[0] == '/')
        snprintf(dir, sizeof dir, "%s/moe", xdg);
    else if (home && home[0])
        snprintf(dir, sizeof dir, "%s/.cache/moe", home);
    else
        snprintf(dir, sizeof dir, "/tmp/moe-cache");
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/demo-qwen3moe-v%d.gguf", dir, DEMO_VERSION);
    struct stat st;
    if (stat(path, &st) == 0) return moe_xstrdup(path);
    if (!make_dirs(dir)) {
        moe_error_set(err, MOE_ERR_IO, "cannot create cache directory %s: %s", dir,
                      strerror(errno));
        return NULL;
    }
    /* write aside and rename, so a concurrent or interrupted run never sees half a file */
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    if (moe_demo_model_write(tmp, err) != MOE_OK) {
        unlink(tmp);
        return NULL;
    }
    if (rename(tmp, path) != 0) {
        moe_error_set(err, MOE_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return NULL;
    }
    return moe_xstrdup(path);
}
