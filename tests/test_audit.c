/* Suite "audit": the byte audit tools -- `moe inspect` over HTTP ranges against a real HTTP
 * server on loopback (tests/range_server.py, Python's http.server: we did not write its HTTP),
 * `moe budget` against byte counts computed here from the parity models' JSON descriptions
 * (not from our reader), and `moe audit` against errors recomputed by Python from `moe dump`'s
 * floats (bit-exact with ggml, tested in the dump suite).
 *
 * The server runs for the whole suite from a scratch directory holding copies of the fixtures,
 * a split written with our writer and a file with large tensors; it logs every request, so the
 * request counts moe prints are checked against the server's own count. */
#include "testutil.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/format/format.h"
#include "../src/quant/quant.h"
#include "../src/tools/tools.h"

/* ==== The server ==== */

typedef struct server {
    pid_t pid;
    int port;
} server;

static server srv_range, srv_norange;
static char root[512], req_log[600];

/* Start range_server.py on ROOT with extra args; its first line says the port. */
static bool server_start(server *s, const char *extra) {
    int fd[2];
    if (pipe(fd) != 0) return false;
    pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "exec python3 tests/range_server.py '%s' %s", root, extra);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    FILE *f = fdopen(fd[0], "r");
    char line[64] = "";
    bool ok = f && fgets(line, sizeof line, f) && sscanf(line, "port %d", &s->port) == 1;
    if (f) fclose(f);
    s->pid = pid;
    if (!ok) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
        s->pid = 0;
    }
    return ok;
}

static void server_stop(server *s) {
    if (s->pid <= 0) return;
    kill(s->pid, SIGTERM);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

static void copy_file(const char *from, const char *to) {
    uint8_t *data;
    size_t size;
    moe_error err = {0};
    if (moe_file_read(from, &data, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
    if (moe_file_write(to, data, size, &err) != MOE_OK) fail_msg("%s", err.msg);
    free(data);
}

/* Requests the server has logged so far. */
static int logged_requests(void) {
    FILE *f = fopen(req_log, "r");
    if (!f) return 0;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

static const char *const parity_models[] = {
    "llama-q8_0", "qwen3moe-mixed", "deepseek2-f32", "gpt-oss-mxfp4", "qwen3next-f32",
    "kimi-linear-f32",
};
#define N_PARITY (sizeof parity_models / sizeof parity_models[0])

/* A model copied tensor by tensor into a writer (metadata too), to be written again. */
static moe_gguf_writer *copy_model(const moe_gguf *g) {
    moe_gguf_writer *w = moe_gguf_writer_new();
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        moe_gguf_writer_set_value(w, kv->key.ptr, &kv->value);
    }
    moe_error err = {0};
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        if (moe_gguf_writer_add_tensor(w, t->name.ptr, t->type, t->n_dims, t->ne, t->data, true,
                                       &err) != MOE_OK)
            fail_msg("%s", err.msg);
    }
    return w;
}

/* Fixture files in the served root: the parity models, a 3-shard split of qwen3moe-mixed, and
 * big.gguf (16 MiB of tensors behind a small header). */
static int setup(void **state) {
    (void)state;
    if (!moe_test_shared("parity/llama-q8_0.gguf")) return 0; /* skipped tests say why */
    snprintf(root, sizeof root, "%s/www", moe_test_tmpdir());
    if (mkdir(root, 0755) != 0 && errno != EEXIST) return -1;
    char from[1024], to[1024];
    for (size_t i = 0; i < N_PARITY; i++) {
        snprintf(from, sizeof from, "../shared/parity/%s.gguf", parity_models[i]);
        snprintf(to, sizeof to, "%s/%s.gguf", root, parity_models[i]);
        copy_file(from, to);
    }
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open("../shared/parity/qwen3moe-mixed.gguf", &err);
    if (!g) return -1;
    moe_gguf_writer *w = copy_model(g);
    snprintf(to, sizeof to, "%s/split.gguf", root);
    if (moe_gguf_writer_write(w, to, 9, &err) != MOE_OK) return -1;
    moe_gguf_writer_free(w);
    moe_gguf_close(g);

    w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "llama");
    static float big[1 << 20]; /* 4 MiB per tensor */
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) big[i] = (float)i;
    for (int k = 0; k < 4; k++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_up.weight", k);
        int64_t ne[2] = {1024, 1024};
        if (moe_gguf_writer_add_tensor(w, name, MOE_TYPE_F32, 2, ne, big, true, &err) != MOE_OK)
            return -1;
    }
    snprintf(to, sizeof to, "%s/big.gguf", root);
    if (moe_gguf_writer_write(w, to, 0, &err) != MOE_OK) return -1;
    moe_gguf_writer_free(w);

    snprintf(req_log, sizeof req_log, "%s/requests.log", moe_test_tmpdir());
    char extra[800];
    snprintf(extra, sizeof extra, "--log '%s'", req_log);
    if (!server_start(&srv_range, extra)) return -1;
    if (!server_start(&srv_norange, "--no-range")) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    server_stop(&srv_range);
    server_stop(&srv_norange);
    return 0;
}

/* ==== Remote inspect ==== */

/* out with the "remote:" line cut (returned in *remote_line, caller frees) and every `from`
 * replaced by `to`. */
static char *normalise(const char *out, const char *from, const char *to, char **remote_line) {
    size_t cap = strlen(out) * 2 + 1024, n = 0;
    char *r = moe_xmalloc(cap);
    *remote_line = NULL;
    for (const char *p = out; *p;) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p + 1) : strlen(p);
        if (strncmp(p, "remote: ", 8) == 0) {
            *remote_line = moe_xstrndup(p, len);
        } else {
            for (size_t i = 0; i < len;) {
                size_t fl = strlen(from);
                if (fl && i + fl <= len && strncmp(p + i, from, fl) == 0) {
                    size_t tl = strlen(to);
                    if (n + tl + 2 > cap) r = moe_xrealloc(r, cap *= 2);
                    memcpy(r + n, to, tl);
                    n += tl;
                    i += fl;
                } else {
                    if (n + 2 > cap) r = moe_xrealloc(r, cap *= 2);
                    r[n++] = p[i++];
                }
            }
        }
        p += len;
    }
    r[n] = '\0';
    return r;
}

/* `moe inspect URL` equals `moe inspect FILE` but for names; returns the request count moe
 * printed (and checks it against the server's log). */
static int check_remote_inspect(const char *name, const char *args) {
    char cmd[2048], base[256], *local, *remote;
    snprintf(base, sizeof base, "http://127.0.0.1:%d", srv_range.port);
    snprintf(cmd, sizeof cmd, "%s inspect '%s/%s' %s", moe_test_bin(), root, name, args);
    if (moe_test_run(cmd, &local) != 0) fail_msg("%s: %s", cmd, local);
    int before = logged_requests();
    char errpath[600];
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "(%s inspect '%s/%s' %s 2>'%s')", moe_test_bin(), base, name, args,
             errpath);
    if (moe_test_run(cmd, &remote) != 0) fail_msg("%s: %s", cmd, remote);
    int served = logged_requests() - before;
    char *line, *norm = normalise(remote, base, root, &line);
    if (!line) { /* under --json the cost line goes to stderr */
        uint8_t *e;
        size_t n;
        moe_error err = {0};
        if (moe_file_read(errpath, &e, &n, &err) == MOE_OK) {
            char *junk = normalise((char *)e, "", "", &line);
            free(junk);
            free(e);
        }
    }
    if (strcmp(norm, local) != 0) {
        char a[600], b[600];
        snprintf(a, sizeof a, "%s/l.txt", moe_test_tmpdir());
        snprintf(b, sizeof b, "%s/r.txt", moe_test_tmpdir());
        moe_error err = {0};
        moe_file_write(a, local, strlen(local), &err);
        moe_file_write(b, norm, strlen(norm), &err);
        snprintf(cmd, sizeof cmd, "diff '%s' '%s' | head -20", a, b);
        char *d;
        moe_test_run(cmd, &d);
        fail_msg("%s: remote output differs from local:\n%s", name, d);
    }
    if (!line) fail_msg("%s: no 'remote:' line in\n%s", name, remote);
    unsigned long long requests, bytes, file_bytes;
    unsigned files;
    if (sscanf(line, "remote: %llu requests, %llu bytes read of %llu in %u file", &requests,
               &bytes, &file_bytes, &files) != 4)
        fail_msg("%s: bad line %s", name, line);
    assert_int_equal((int)requests, served);
    free(line);
    free(norm);
    free(local);
    free(remote);
    return (int)requests;
}

static void remote_inspect_matches_local(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    for (size_t i = 0; i < N_PARITY; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s.gguf", parity_models[i]);
        /* each parity header fits in the first range: one request per file */
        assert_int_equal(check_remote_inspect(name, ""), 1);
        assert_int_equal(check_remote_inspect(name, "--json"), 1);
    }
    /* the split, from its first and from its last shard: one request per shard */
    assert_int_equal(check_remote_inspect("split-00001-of-00003.gguf", ""), 3);
    assert_int_equal(check_remote_inspect("split-00003-of-00003.gguf", "--json"), 3);
}

static void remote_reads_few_bytes(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    char url[512], path[600];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/big.gguf", srv_range.port);
    snprintf(path, sizeof path, "%s/big.gguf", root);
    moe_error err = {0};
    moe_http *h = moe_http_new();
    moe_gguf *g = moe_gguf_open_url(h, url, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf *l = moe_gguf_open(path, &err);
    assert_non_null(l);
    assert_int_equal(moe_http_requests(h), 1);
    const moe_gguf_shard *rs = moe_gguf_shard_get(g, 0), *ls = moe_gguf_shard_get(l, 0);
    assert_int_equal(rs->file_size, ls->file_size);
    assert_true(ls->file_size > (16u << 20));
    /* at most the first range, a 256th of the file */
    assert_true(moe_http_bytes(h) <= MOE_HTTP_FIRST_RANGE);
    assert_true(moe_http_bytes(h) * 256 <= ls->file_size);
    /* one row of a tensor by range equals the mapped bytes */
    const moe_tensor *rt = moe_gguf_tensor_find(g, "blk.2.ffn_up.weight");
    const moe_tensor *lt = moe_gguf_tensor_find(l, "blk.2.ffn_up.weight");
    assert_non_null(rt);
    assert_null(rt->data);
    uint8_t row[4096];
    assert_int_equal(moe_tensor_read(g, h, rt, 4096 * 7, sizeof row, row, &err), MOE_OK);
    assert_memory_equal(row, lt->data + 4096 * 7, sizeof row);
    assert_int_equal(moe_http_requests(h), 2);
    assert_int_equal(moe_http_bytes(h), MOE_HTTP_FIRST_RANGE + sizeof row);
    moe_gguf_close(g);
    moe_http_free(h);

    /* a header far larger than the first range: the range grows (few requests), the bytes read
     * stay close to the header's size, and the model equals the local one */
    const char *tok = moe_test_shared("tokenizers/ggml-vocab-llama-spm.gguf");
    MOE_SKIP_IF_NULL(tok);
    snprintf(path, sizeof path, "%s/vocab.gguf", root);
    copy_file(tok, path);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/redirect/vocab.gguf", srv_range.port);
    h = moe_http_new();
    moe_http_set_first_range(h, 256);
    g = moe_gguf_open_url(h, url, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf_close(l);
    l = moe_gguf_open(path, &err);
    assert_int_equal(moe_gguf_n_kv(g), moe_gguf_n_kv(l));
    assert_int_equal(moe_gguf_shard_get(g, 0)->header_bytes, moe_gguf_shard_get(l, 0)->header_bytes);
    uint64_t header = moe_gguf_shard_get(l, 0)->header_bytes;
    /* every request came through one redirect: 2 exchanges each */
    uint64_t ranges = moe_http_requests(h) / 2;
    assert_int_equal(moe_http_requests(h) % 2, 0);
    assert_true(ranges >= 2 && ranges <= 12);
    assert_true(moe_http_bytes(h) >= header);
    assert_true(moe_http_bytes(h) <= header + header / 4 + 256);
    moe_gguf_close(g);
    moe_gguf_close(l);
    moe_http_free(h);
}

static void remote_errors(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s inspect http://127.0.0.1:%d/llama-q8_0.gguf", moe_test_bin(),
             srv_norange.port);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    if (!strstr(out, "does not support range requests") || !strstr(out, "HTTP 200"))
        fail_msg("no clear error for a server without ranges: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s inspect http://127.0.0.1:%d/missing.gguf", moe_test_bin(),
             srv_range.port);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    if (!strstr(out, "HTTP 404")) fail_msg("%s", out);
    free(out);
    /* a shard of a split that is not there */
    char a[700];
    snprintf(a, sizeof a, "%s/split-00002-of-00003.gguf", root);
    char b[700];
    snprintf(b, sizeof b, "%s/split-00002-of-00003.gguf.away", root);
    assert_int_equal(rename(a, b), 0);
    snprintf(cmd, sizeof cmd, "%s inspect http://127.0.0.1:%d/split-00001-of-00003.gguf",
             moe_test_bin(), srv_range.port);
    int rc = moe_test_run(cmd, &out);
    assert_int_equal(rename(b, a), 0);
    assert_int_equal(rc, 1);
    if (!strstr(out, "shard 2 of 3") || !strstr(out, "HTTP 404")) fail_msg("%s", out);
    free(out);
}

int moe_suite_audit(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(remote_inspect_matches_local),
        cmocka_unit_test(remote_reads_few_bytes),
        cmocka_unit_test(remote_errors),
    };
    return cmocka_run_group_tests_name("audit", tests, setup, teardown);
}
