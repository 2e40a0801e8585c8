/* Suite "diskcache": `moe serve --cache-dir` across restarts, on stories260K and on hybrid
 * (recurrent) parity models.
 *
 * Per model: the reference texts come from a server without a cache (and, for stories260K, are
 * checked against run.c's greedy text); then servers are started one after another on the same
 * cache directory. A prompt served, the server restarted, the same prompt again: its prefix comes
 * from disk (cached_tokens = prompt - 1, cache_source "disk") and the greedy text is the same. A
 * prompt that shares only its first 8 tokens with a saved one takes those 8 (no recurrent layers)
 * or nothing (hybrid: no state there) and still makes its own text. Entries with a flipped byte
 * (in the payload: found when loaded; in the token ids: found at start-up), truncated entries
 * and an entry renamed to another prefix's key are all ignored and removed (counted in
 * /metrics), and the text is still right. With one slot, a prompt evicted from RAM by another
 * comes back from disk. A small --cache-disk-size keeps the directory under it. On glm-dsa
 * (sparse MLA: latent and indexer rows; tests/glm_dsa_reference.py's model and float64 logits,
 * through the engine's API since the model has no tokenizer) a loaded prefix continues as the
 * reference does. Prompts are token
 * ids: the parity fixtures' prompt (llama.cpp's tokens.json), and for stories260K run.c's greedy
 * tokens from BOS. */
#include "testutil.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include <math.h>

#include "../src/engine/engine.h"

#define N_PROMPT    16 /* prompt tokens */
#define N_GEN       16 /* greedy tokens asked for */
#define N_SHARED    8  /* tokens the second prompt shares with the first */
#define MAX_ENTRIES 64

typedef struct model_case {
    const char *name;
    const char *gguf;   /* under ../shared */
    const char *tokens; /* the json holding the prompt ("prompt" or run.c's "tokens") */
    bool hybrid;
} model_case;

static const model_case cases[] = {
    {"stories260K", "models/stories260K/stories260K.gguf",
     "models/stories260K/greedy_bos_tokens.json", false},
    {"qwen3next", "parity/qwen3next-f32.gguf", "parity/qwen3next-f32.tokens.json", true},
    {"kimi-linear", "parity/kimi-linear-f32.gguf", "parity/kimi-linear-f32.tokens.json", true},
    {"qwen35", "parity/qwen35-mtp-f32.gguf", "parity/qwen35-mtp-f32.tokens.json", true},
};

typedef struct reply {
    char *text;
    long cached;
    char source[16];
} reply;

static void reply_free(reply *r) {
    free(r->text);
    memset(r, 0, sizeof *r);
}

/* A greedy completion of the token ids. */
static reply complete(const moe_test_server *s, const int32_t *prompt, int n) {
    json_t *ids = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(ids, json_integer(prompt[i]));
    json_t *body = json_pack("{s:s,s:o,s:i,s:i,s:b}", "model", "x", "prompt", ids, "max_tokens",
                             N_GEN, "temperature", 0, "ignore_eos", 1);
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    char url[256];
    snprintf(url, sizeof url, "%s/v1/completions", s->url);
    long status;
    char *out = moe_test_http(url, text, &status);
    free(text);
    json_t *j = json_loads(out, 0, NULL);
    if (status != 200 || !j) fail_msg("%s: %ld %s (log %s)", url, status, out, s->log);
    json_t *details = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    const char *t = json_string_value(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
    const char *src = json_string_value(json_object_get(details, "cache_source"));
    if (!t || !src) fail_msg("reply without text or cache_source: %s", out);
    reply r = {.text = moe_xstrdup(t),
               .cached = (long)json_integer_value(json_object_get(details, "cached_tokens"))};
    snprintf(r.source, sizeof r.source, "%s", src);
    json_decref(j);
    free(out);
    return r;
}

/* One sample's value from /metrics (name with its labels), -1 when absent. */
static double metric(const moe_test_server *s, const char *name) {
    char url[256];
    snprintf(url, sizeof url, "%s/metrics", s->url);
    long status;
    char *out = moe_test_http(url, NULL, &status);
    double v = -1;
    for (const char *p = out; p && *p;) {
        const size_t n = strlen(name);
        if (strncmp(p, name, n) == 0 && p[n] == ' ') {
            v = strtod(p + n + 1, NULL);
            break;
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    free(out);
    return v;
}

/* The cache entries in dir: names (static) and sizes; returns how many. */
static int entries(const char *dir, char names[][600], off_t *sizes) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < MAX_ENTRIES) {
        const size_t len = strlen(de->d_name);
        if (len < 5 || strcmp(de->d_name + len - 4, ".kvc") != 0) continue;
        snprintf(names[n], 600, "%s/%s", dir, de->d_name);
        struct stat st;
        sizes[n] = stat(names[n], &st) == 0 ? st.st_size : -1;
        n++;
    }
    closedir(d);
    return n;
}

/* Flip one byte of the file at offset (from the end when negative). */
static void flip_byte(const char *path, long offset) {
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, offset, offset < 0 ? SEEK_END : SEEK_SET), 0);
    const long at = ftell(f);
    const int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, at, SEEK_SET), 0);
    fputc(c ^ 0x5a, f);
    fclose(f);
}

/* `moe serve GGUF` with two streams and two resident sequences, --cache-dir DIR (unless NULL),
 * then the options in extra (NULL-terminated; later ones win). */
static void start(moe_test_server *s, const char *name, const char *gguf, const char *dir,
                  char *const *extra) {
    char *args[24] = {(char *)gguf, "--ctx", "256", "--parallel", "2", "--cache-slots", "2"};
    int n = 7;
    if (dir) {
        args[n++] = "--cache-dir";
        args[n++] = (char *)dir;
    }
    for (int i = 0; extra && extra[i] && n < 23; i++) args[n++] = extra[i];
    args[n] = NULL;
    if (!moe_test_server_start(s, name, args)) fail_msg("%s did not start (log %s)", name, s->log);
}

static void stop(moe_test_server *s) {
    const int rc = moe_test_server_stop(s);
    if (rc != 0) fail_msg("server exited with %d (log %s)", rc, s->log);
}

static void expect_text(const reply *r, const char *want, const char *what) {
    if (strcmp(r->text, want) != 0)
        fail_msg("%s: text differs from the uncached server's\n got: [%s]\nwant: [%s]", what,
                 r->text, want);
}

/* The prompt: the fixture's first N_PROMPT tokens. */
static bool read_prompt(const model_case *mc, int32_t *prompt) {
    const char *path = moe_test_shared(mc->tokens);
    if (!path) return false;
    json_t *j = json_load_file(path, 0, NULL);
    json_t *ids = json_object_get(j, "prompt");
    if (!ids) ids = json_object_get(j, "tokens");
    if (json_array_size(ids) < N_PROMPT) fail_msg("%s: fewer than %d tokens", path, N_PROMPT);
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)json_integer_value(json_array_get(ids, i));
    json_decref(j);
    return true;
}

static void restart_model(const model_case *mc) {
    const char *gguf = moe_test_shared(mc->gguf);
    int32_t p[N_PROMPT], r[N_PROMPT];
    if (!gguf || !read_prompt(mc, p)) {
        skip();
        return;
    }
    /* r: p's first N_SHARED tokens, then others */
    memcpy(r, p, sizeof r);
    for (int i = N_SHARED; i < N_PROMPT; i++) r[i] = 300 + i;
    char dir[600], name[128];
    snprintf(dir, sizeof dir, "%s/cache-%s", moe_test_tmpdir(), mc->name);
    moe_test_server srv = {0};

    /* references: no cache directory */
    snprintf(name, sizeof name, "%s-nocache", mc->name);
    start(&srv, name, gguf, NULL, NULL);
    reply ref_p = complete(&srv, p, N_PROMPT), ref_r = complete(&srv, r, N_PROMPT);
    stop(&srv);
    if (!mc->hybrid) { /* run.c's greedy text from BOS continues the prompt with ref_p */
        char *runc = (char *)moe_test_shared_read("models/stories260K/runc_greedy_bos_n256.txt",
                                                  &(size_t){0});
        if (!runc || !strstr(runc, ref_p.text))
            fail_msg("stories260K greedy [%s] is not in run.c's text", ref_p.text);
        free(runc);
    }

    /* a fresh directory: nothing from disk; the entries are written by the time it stops */
    snprintf(name, sizeof name, "%s-first", mc->name);
    start(&srv, name, gguf, dir, NULL);
    reply a = complete(&srv, p, N_PROMPT);
    assert_string_equal(a.source, "none");
    expect_text(&a, ref_p.text, "first server");
    stop(&srv);
    char files[MAX_ENTRIES][600];
    off_t sizes[MAX_ENTRIES];
    const int n_first = entries(dir, files, sizes);
    /* the whole sequence; a hybrid also at its prompt's snapshot */
    assert_int_equal(n_first, mc->hybrid ? 2 : 1);

    /* restarted: r first (shares N_SHARED tokens with the saved one), then p */
    snprintf(name, sizeof name, "%s-restarted", mc->name);
    start(&srv, name, gguf, dir, NULL);
    reply b_r = complete(&srv, r, N_PROMPT), b = complete(&srv, p, N_PROMPT);
    expect_text(&b_r, ref_r.text, "restarted, the other prompt");
    if (mc->hybrid) {
        assert_int_equal(b_r.cached, 0); /* no recurrent state at N_SHARED anywhere */
    } else {
        assert_int_equal(b_r.cached, N_SHARED);
        assert_string_equal(b_r.source, "disk");
    }
    expect_text(&b, ref_p.text, "restarted, the same prompt");
    assert_int_equal(b.cached, N_PROMPT - 1);
    assert_string_equal(b.source, "disk");
    assert_true(metric(&srv, "moe_prefix_cache_hits_total{source=\"disk\"}") ==
                (mc->hybrid ? 1 : 2));
    assert_true(metric(&srv, "moe_disk_cache_corrupt_total") == 0);
    stop(&srv);

    /* every entry with its last byte flipped: found when loaded, removed, not used */
    const int n_saved = entries(dir, files, sizes);
    assert_true(n_saved >= 2);
    for (int i = 0; i < n_saved; i++) flip_byte(files[i], -1);
    snprintf(name, sizeof name, "%s-flipped", mc->name);
    start(&srv, name, gguf, dir, NULL);
    reply c = complete(&srv, p, N_PROMPT);
    expect_text(&c, ref_p.text, "after a flipped byte");
    assert_string_not_equal(c.source, "disk");
    assert_true(metric(&srv, "moe_disk_cache_corrupt_total") >= 1);
    stop(&srv);

    /* truncated entries, a flipped token id and an entry under another prefix's name: all
     * removed at start-up */
    const int n_now = entries(dir, files, sizes);
    assert_true(n_now >= 1);
    char forged[700];
    snprintf(forged, sizeof forged, "%.*s0000000000000001.kvc",
             (int)(strrchr(files[0], '-') + 1 - files[0]), files[0]);
    char cmd[1500];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", files[0], forged);
    assert_int_equal(system(cmd), 0);
    for (int i = 0; i < n_now; i++) {
        if (i % 2 == 0)
            assert_int_equal(truncate(files[i], sizes[i] - 1), 0);
        else
            flip_byte(files[i], 100); /* in the token ids: the header checksum */
    }
    snprintf(name, sizeof name, "%s-damaged", mc->name);
    start(&srv, name, gguf, dir, NULL);
    const double n_corrupt = metric(&srv, "moe_disk_cache_corrupt_total");
    if (n_corrupt != n_now + 1)
        fail_msg("%g damaged entries found, %d made (log %s)", n_corrupt, n_now + 1, srv.log);
    assert_true(metric(&srv, "moe_disk_cache_entries") == 0);
    reply d = complete(&srv, p, N_PROMPT);
    expect_text(&d, ref_p.text, "after truncation");
    assert_string_equal(d.source, "none");
    stop(&srv);

    reply_free(&ref_p);
    reply_free(&ref_r);
    reply_free(&a);
    reply_free(&b);
    reply_free(&b_r);
    reply_free(&c);
    reply_free(&d);
}

static void restart(void **state) {
    restart_model(*state);
}

/* One stream, no resident sequences: a second prompt evicts the first from RAM (waiting for its
 * save to finish), and the first again comes back from disk. */
static void ram_eviction(void **state) {
    const model_case *mc = *state;
    const char *gguf = moe_test_shared(mc->gguf);
    int32_t p[N_PROMPT], q[N_PROMPT];
    if (!gguf || !read_prompt(mc, p)) {
        skip();
        return;
    }
    q[0] = p[0]; /* BOS, then nothing in common */
    for (int i = 1; i < N_PROMPT; i++) q[i] = 320 + i;
    char dir[600], name[128];
    snprintf(dir, sizeof dir, "%s/evict-%s", moe_test_tmpdir(), mc->name);
    char *one_slot[] = {"--parallel", "1", "--cache-slots", "0", NULL};
    moe_test_server srv = {0};
    snprintf(name, sizeof name, "%s-evict-nocache", mc->name);
    start(&srv, name, gguf, NULL, one_slot);
    reply ref = complete(&srv, p, N_PROMPT);
    stop(&srv);
    snprintf(name, sizeof name, "%s-evict", mc->name);
    start(&srv, name, gguf, dir, one_slot);
    reply a = complete(&srv, p, N_PROMPT), other = complete(&srv, q, N_PROMPT),
          b = complete(&srv, p, N_PROMPT);
    assert_string_equal(a.source, "none");
    assert_string_not_equal(other.source, "disk");
    assert_int_equal(b.cached, N_PROMPT - 1);
    assert_string_equal(b.source, "disk");
    expect_text(&a, ref.text, "first");
    expect_text(&b, ref.text, "from disk after eviction");
    stop(&srv);
    reply_free(&ref);
    reply_free(&a);
    reply_free(&other);
    reply_free(&b);
}

/* ==== Sparse MLA: the indexer's rows go to disk too ==== */

#define DSA_SAVED 30 /* of the reference's 40 tokens; its indexer selects 6 from position 6 on */

/* Prefill ids[0..n) of seq in one call; the logits of its last row into out (or none). */
static void feed(moe_ctx *c, int32_t seq, const int32_t *ids, uint32_t from, uint32_t to,
                 float *out) {
    moe_row rows[64];
    for (uint32_t i = from; i < to; i++)
        rows[i - from] =
            (moe_row){.seq = seq, .pos = (int32_t)i, .token = ids[i], .logits = out != NULL};
    moe_error err = {0};
    if (moe_ctx_decode(c, rows, to - from, out, &err) != MOE_OK) fail_msg("%s", err.msg);
}

/* glm-dsa (tests/glm_dsa_reference.py writes the model and its float64 logits): 30 tokens saved
 * from one context, loaded into another (a restart), the last 10 fed after them: their logits
 * equal those of the context that computed all 40 bit for bit, and the reference's within
 * 1e-4 of each row's largest; without the loaded rows they would not. */
static void indexer_rows(void **state) {
    (void)state;
    const char *python = moe_test_python_numpy();
    MOE_SKIP_IF_NULL(python);
    char dir[600], cmd[1400], path[700], *out;
    snprintf(dir, sizeof dir, "%s/dsa", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "mkdir -p %s && %s tests/glm_dsa_reference.py %s 15", dir, python,
             dir);
    if (moe_test_run(cmd, &out) != 0) fail_msg("%s failed:\n%s", cmd, out);
    free(out);
    moe_error err = {0};
    snprintf(path, sizeof path, "%s/glm-dsa.gguf", dir);
    moe_model *m = moe_model_load(path, &err);
    if (!m) fail_msg("%s", err.msg);
    const uint32_t nv = m->cfg.n_vocab, n = 40;
    snprintf(path, sizeof path, "%s/tokens.txt", dir);
    uint8_t *text;
    size_t size;
    assert_int_equal(moe_file_read(path, &text, &size, &err), MOE_OK);
    int32_t ids[64];
    char *p = (char *)text;
    for (uint32_t i = 0; i < n; i++, p++) ids[i] = (int32_t)strtol(p, &p, 10);
    free(text);
    float *ref;
    snprintf(path, sizeof path, "%s/logits.f32", dir);
    assert_int_equal(moe_file_read(path, (uint8_t **)&ref, &size, &err), MOE_OK);
    assert_true(size >= sizeof(float) * n * nv); /* the reference's first n rows of its n_tok */

    const moe_ctx_params cp = {.n_ctx = 64, .n_seq = 2, .max_rows = 64, .kv_type = MOE_TYPE_F32};
    char cache[700];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    float *whole = moe_xmalloc(sizeof(float) * nv), *loaded = moe_xmalloc(sizeof(float) * nv);
    moe_ctx *a = moe_ctx_new(m, &cp, &err), *b = moe_ctx_new(m, &cp, &err);
    assert_non_null(a);
    assert_non_null(b);
    feed(a, 0, ids, 0, DSA_SAVED, NULL);
    moe_disk_cache *d = moe_disk_cache_open(a, cache, 1 << 30, &err);
    assert_non_null(d);
    assert_true(moe_disk_cache_save(d, 0, DSA_SAVED));
    moe_disk_cache_close(d); /* written */
    d = moe_disk_cache_open(b, cache, 1 << 30, &err);
    assert_non_null(d);
    moe_disk_hit hit;
    assert_int_equal(moe_disk_cache_find(d, ids, n - 1, &hit), DSA_SAVED);
    uint32_t reused;
    assert_int_equal(moe_ctx_seq_reuse(b, 1, ids, n - 1, &reused, &err), MOE_OK);
    assert_int_equal(reused, 0);
    assert_int_equal(moe_disk_cache_load_begin(d, 1, &hit, ids, n - 1, &err), MOE_OK);
    moe_disk_cache_wait(d, 1);
    assert_true(moe_disk_cache_load_end(d, 1, &err));
    assert_int_equal(err.code, MOE_OK);
    assert_int_equal(moe_ctx_seq_len(b, 1), DSA_SAVED);
    for (uint32_t i = DSA_SAVED; i < n; i++) {
        feed(a, 0, ids, i, i + 1, whole);
        feed(b, 1, ids, i, i + 1, loaded);
        assert_memory_equal(whole, loaded, sizeof(float) * nv);
        double max_ref = 0, max_diff = 0;
        for (uint32_t k = 0; k < nv; k++) {
            const double r = ref[(size_t)i * nv + k];
            max_ref = fmax(max_ref, fabs(r));
            max_diff = fmax(max_diff, fabs(loaded[k] - r));
        }
        if (max_diff > 1e-4 * max_ref)
            fail_msg("position %u: logits %g off the reference (largest %g)", i, max_diff, max_ref);
    }
    moe_disk_cache_close(d);
    moe_ctx_free(a);
    moe_ctx_free(b);
    moe_model_free(m);
    free(whole);
    free(loaded);
    free(ref);
}

/* --cache-disk-size: the directory stays under it, the least recently used going first. */
static void size_limit(void **state) {
    (void)state;
    const char *gguf = moe_test_shared(cases[0].gguf);
    int32_t p[N_PROMPT];
    if (!gguf || !read_prompt(&cases[0], p)) {
        skip();
        return;
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/cache-limit", moe_test_tmpdir());
    moe_test_server srv = {0};
    /* one entry of stories260K at --ctx 256, f16 KV: 31 positions of 5 layers x 2 x 64 values */
    start(&srv, "limit-probe", gguf, dir, NULL);
    reply first = complete(&srv, p, N_PROMPT);
    reply_free(&first);
    stop(&srv);
    char files[MAX_ENTRIES][600];
    off_t sizes[MAX_ENTRIES];
    assert_int_equal(entries(dir, files, sizes), 1);
    char limit[32];
    snprintf(limit, sizeof limit, "%lld", (long long)(sizes[0] * 5 / 2));
    start(&srv, "limit", gguf, dir, (char *[]){"--cache-disk-size", limit, NULL});
    for (int k = 0; k < 6; k++) { /* six prompts that share only BOS */
        int32_t q[N_PROMPT];
        for (int i = 0; i < N_PROMPT; i++) q[i] = i ? 260 + 17 * k + i : 1;
        reply r = complete(&srv, q, N_PROMPT);
        reply_free(&r);
    }
    stop(&srv);
    const int n = entries(dir, files, sizes);
    off_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    if (n != 2 || total > atoll(limit))
        fail_msg("%d entries, %lld bytes, limit %s", n, (long long)total, limit);
}

int moe_suite_diskcache(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(restart, (void *)&cases[0]),
        cmocka_unit_test_prestate(restart, (void *)&cases[1]),
        cmocka_unit_test_prestate(restart, (void *)&cases[2]),
        cmocka_unit_test_prestate(restart, (void *)&cases[3]),
        cmocka_unit_test_prestate(ram_eviction, (void *)&cases[0]),
        cmocka_unit_test_prestate(ram_eviction, (void *)&cases[1]),
        cmocka_unit_test(size_limit),
        cmocka_unit_test(indexer_rows),
    };
    return cmocka_run_group_tests_name("diskcache", tests, NULL, NULL);
}
