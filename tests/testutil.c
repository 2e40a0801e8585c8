/* testutil.c: fixture lookup in ../shared, scratch directories, running the moe binary. */
#include "testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "../src/format/format.h"

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

double moe_test_row_rel_err(const float *ours, const float *ref, uint32_t n) {
    double max_ref = 0, max_diff = 0;
    for (uint32_t i = 0; i < n; i++) {
        max_ref = fmax(max_ref, fabs(ref[i]));
        max_diff = fmax(max_diff, fabs((double)ours[i] - ref[i]));
    }
    return max_ref > 0 ? max_diff / max_ref : max_diff;
}

const char *moe_test_python_numpy(void) {
    static const char *const candidates[] = {"/usr/bin/python3", "python3"};
    for (size_t i = 0; i < sizeof candidates / sizeof candidates[0]; i++) {
        char cmd[256], *out;
        snprintf(cmd, sizeof cmd, "%s -c 'import numpy' 2>&1", candidates[i]);
        const int rc = moe_test_run(cmd, &out);
        free(out);
        if (rc == 0) return candidates[i];
    }
    if (in_ci()) fail_msg("no python3 with numpy and CI=true: `make deps` installs python3-numpy");
    print_message("[  SKIP    ] no python3 with numpy (Debian python3-numpy)\n");
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
    if (out)
        *out = buf;
    else
        free(buf);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

void moe_test_run_ok(const char *cmd) {
    char *out = NULL;
    int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("`%s` failed (%d): %s", cmd, rc, out ? out : "");
    free(out);
}

const char *moe_test_synth(const char *file, const char *flags) {
    static char path[512];
    char cmd[2048], *out;
    snprintf(path, sizeof path, "%s/%s", moe_test_tmpdir(), file);
    snprintf(cmd, sizeof cmd, "%s synth -o %s %s", moe_test_bin(), path, flags);
    const int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("`%s` exited %d:\n%s", cmd, rc, out);
    free(out);
    return path;
}

/* ==== A server and HTTP ==== */

#define SERVER_START_SECONDS 30 /* load + listen; generous for ASan builds */
#define SERVER_STOP_SECONDS  10

bool moe_test_server_start(moe_test_server *s, const char *name, char *const extra[]) {
    char *const none[] = {NULL};
    return moe_test_server_start_with(s, name, none, moe_test_bin(), extra);
}

bool moe_test_server_start_with(moe_test_server *s, const char *name, char *const launcher[],
                                const char *bin, char *const extra[]) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    snprintf(s->log, sizeof s->log, "%s/%s.log", moe_test_tmpdir(), name);
    char *argv[48];
    int n = 0;
    for (int i = 0; launcher[i] && n < 16; i++) argv[n++] = launcher[i];
    argv[n++] = (char *)bin;
    argv[n++] = "serve";
    argv[n++] = "--port";
    argv[n++] = "0";
    for (int i = 0; extra[i] && n < 47; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    char cache[600];
    snprintf(cache, sizeof cache, "%s/cache", moe_test_tmpdir());
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        dup2(fds[1], 1);
        FILE *log = fopen(s->log, "w");
        if (log) dup2(fileno(log), 2);
        close(fds[0]);
        setenv("XDG_CACHE_HOME", cache, 1);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    s->pid = pid;
    char buf[4096];
    size_t len = 0;
    const time_t until = time(NULL) + SERVER_START_SECONDS;
    bool ready = false;
    while (!ready && time(NULL) < until && len < sizeof buf - 1) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (poll(&p, 1, 200) <= 0) continue;
        const ssize_t got = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (got <= 0) break;
        len += (size_t)got;
        buf[len] = '\0';
        ready = strstr(buf, "moe serve: ready") && strchr(strstr(buf, "moe serve: ready"), '\n');
    }
    close(fds[0]);
    const char *at = strstr(buf, "listening on ");
    if (!ready || !at) {
        print_message("moe serve (%s) did not become ready; its log: %s\n", name, s->log);
        return false;
    }
    sscanf(at + 13, "%127s", s->url);
    s->lead = 0;
    if (launcher[0]) { /* rank 0's pid, from /health */
        char url[256];
        long status = 0;
        snprintf(url, sizeof url, "%s/health", s->url);
        char *body = moe_test_http(url, NULL, &status);
        json_t *root = json_loads(body, 0, NULL);
        s->lead = (pid_t)json_integer_value(
            json_object_get(json_array_get(json_object_get(root, "ranks"), 0), "pid"));
        json_decref(root);
        free(body);
    }
    return true;
}

int moe_test_server_stop(moe_test_server *s) {
    return moe_test_server_stop_via(s, s->lead ? s->lead : s->pid);
}

int moe_test_server_stop_via(moe_test_server *s, pid_t signalled) {
    if (s->pid <= 0) return 0;
    kill(signalled, SIGTERM);
    return moe_test_server_wait(s, SERVER_STOP_SECONDS);
}

int moe_test_server_wait(moe_test_server *s, int seconds) {
    int status = 0;
    for (int i = 0; i < seconds * 20; i++) {
        const pid_t r = waitpid(s->pid, &status, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        struct timespec d = {0, 50 * 1000000L};
        nanosleep(&d, NULL);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    s->pid = 0;
    return -1;
}

static size_t curl_collect(char *p, size_t size, size_t n, void *ud) {
    moe_strbuf_put(ud, p, size * n);
    return size * n;
}

void *moe_test_http_handle(const char *url, const char *body, void *headers, moe_strbuf *out) {
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    if (body) curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, curl_collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    return c;
}

char *moe_test_http(const char *url, const char *body, long *status) {
    moe_strbuf out = {0};
    struct curl_slist *hdr = curl_slist_append(NULL, "content-type: application/json");
    CURL *c = moe_test_http_handle(url, body, hdr, &out);
    const CURLcode rc = curl_easy_perform(c);
    *status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    curl_slist_free_all(hdr);
    curl_easy_cleanup(c);
    if (rc != CURLE_OK) fail_msg("%s %s: %s", body ? "POST" : "GET", url, curl_easy_strerror(rc));
    moe_strbuf_put(&out, "", 0);
    return out.s;
}

/* ==== 8 streams together equal each alone ==== */

#define STREAMS       8
#define STREAM_TOKENS 64

/* Stream i's completion request (the spec suite's prompts). */
static char *stream_request(int i, double temp) {
    static const int base[] = {403, 407, 261, 378, 432, 383, 286, 376, 298, 315, 421, 395};
    json_t *prompt = json_pack("[i]", 1);
    for (int k = 0; k < 9; k++)
        json_array_append_new(prompt, json_integer(base[(i + k % (2 + i % 4)) % 12]));
    json_t *b = json_pack("{s:s,s:o,s:i,s:f,s:i}", "model", "x", "prompt", prompt, "max_tokens",
                          STREAM_TOKENS, "temperature", temp, "seed", 7 + i);
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return body;
}

/* choices[0].text of a completion reply, as a JSON string (a random model's text may hold NUL);
 * fails the test on anything else. */
static char *completion_text(const char *reply, long status) {
    json_t *r = json_loads(reply, JSON_ALLOW_NUL, NULL);
    json_t *text = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "text");
    if (status != 200 || !json_is_string(text)) fail_msg("completion: %ld %s", status, reply);
    char *out = json_dumps(text, JSON_ENCODE_ANY);
    json_decref(r);
    return out;
}

double moe_test_metric(const char *metrics, const char *name) {
    double sum = 0;
    const size_t n = strlen(name);
    for (const char *line = metrics; line && *line; line = strchr(line, '\n'), line += !!line) {
        if (strncmp(line, name, n) != 0 || (line[n] != ' ' && line[n] != '{')) continue;
        const char *v = strchr(line, ' ');
        if (v) sum += strtod(v + 1, NULL);
    }
    return sum;
}

/* args = MODEL --ctx 256 -t 1 --parallel PARALLEL [--spec none] EXTRA... */
static void stream_server_args(char **args, const char *model, const char *parallel, bool plain,
                               char *const *extra) {
    int n = 0;
    char *const head[] = {(char *)model, "--ctx", "256", "-t", "1", "--parallel", (char *)parallel};
    for (size_t i = 0; i < sizeof head / sizeof head[0]; i++) args[n++] = head[i];
    if (plain) {
        args[n++] = "--spec";
        args[n++] = "none";
    }
    while (extra && *extra && n < 31) args[n++] = *extra++;
    args[n] = NULL;
}

char *moe_test_streams_equal_alone(const moe_test_streams *t) {
    char *const none[] = {NULL};
    char *const *launcher = t->launcher ? t->launcher : none;
    const char *bin = t->bin ? t->bin : moe_test_bin();
    char *plain_args[32], *args[32];
    stream_server_args(plain_args, t->model, "1", true, t->alone_extra);
    stream_server_args(args, t->model, "8", false, t->together);
    moe_test_server plain = {0}, srv = {0};
    if (!moe_test_server_start_with(&plain, "streams-alone", launcher, bin, plain_args) ||
        !moe_test_server_start_with(&srv, "streams-together", launcher, bin, args))
        fail_msg("a server did not start (logs: %s, %s)", plain.log, srv.log);
    char *alone[STREAMS], *body[STREAMS], url[256];
    snprintf(url, sizeof url, "%s/v1/completions", plain.url);
    for (int i = 0; i < STREAMS; i++) {
        body[i] = stream_request(i, t->temp);
        long status;
        char *reply = moe_test_http(url, body[i], &status);
        alone[i] = completion_text(reply, status);
        free(reply);
    }
    CURLM *multi = curl_multi_init();
    CURL *easy[STREAMS];
    moe_strbuf out[STREAMS] = {0};
    struct curl_slist *hdr = curl_slist_append(NULL, "content-type: application/json");
    snprintf(url, sizeof url, "%s/v1/completions", srv.url);
    for (int i = 0; i < STREAMS; i++) {
        easy[i] = moe_test_http_handle(url, body[i], hdr, &out[i]);
        curl_multi_add_handle(multi, easy[i]);
    }
    for (int running = 1; running;) {
        if (curl_multi_perform(multi, &running) != CURLM_OK) fail_msg("curl_multi_perform");
        if (running) curl_multi_poll(multi, NULL, 0, 1000, NULL);
    }
    for (int i = 0; i < STREAMS; i++) {
        long status = 0;
        curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &status);
        moe_strbuf_put(&out[i], "", 0);
        char *text = completion_text(out[i].s, status);
        if (strcmp(text, alone[i]) != 0)
            fail_msg("%s, temperature %g, stream %d: with %s among 8 streams\n%s\nbut alone\n%s",
                     t->model, t->temp, i, t->what, text, alone[i]);
        free(text);
        free(alone[i]);
        free(body[i]);
        moe_strbuf_free(&out[i]);
        curl_multi_remove_handle(multi, easy[i]);
        curl_easy_cleanup(easy[i]);
    }
    curl_multi_cleanup(multi);
    curl_slist_free_all(hdr);
    snprintf(url, sizeof url, "%s/metrics", srv.url);
    long metrics_status;
    char *metrics = moe_test_http(url, NULL, &metrics_status);
    const int a = moe_test_server_stop(&plain), b = moe_test_server_stop(&srv);
    if (a != 0 || b != 0)
        fail_msg("servers exited with %d and %d (logs: %s, %s)", a, b, plain.log, srv.log);
    return metrics;
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

/* ==== Python Jinja2 ==== */

json_t *moe_test_render_jinja(json_t *spec, const char *name) {
    char in_path[600], out_path[600], cmd[1400];
    snprintf(in_path, sizeof in_path, "%s/%s-cases.json", moe_test_tmpdir(), name);
    snprintf(out_path, sizeof out_path, "%s/%s-rendered.json", moe_test_tmpdir(), name);
    if (json_dump_file(spec, in_path, 0) != 0) fail_msg("cannot write %s", in_path);
    snprintf(cmd, sizeof cmd, "python3 tests/render_jinja.py '%s' '%s'", in_path, out_path);
    char *log;
    const int rc = moe_test_run(cmd, &log);
    if (rc != 0) fail_msg("python3 tests/render_jinja.py failed (%d): %s", rc, log);
    free(log);
    json_error_t je;
    json_t *results = json_load_file(out_path, 0, &je);
    if (!json_is_array(results)) fail_msg("%s: %s", out_path, je.text);
    return results;
}

/* ==== A chat model for the template tests ==== */

const char *moe_test_chat_model(const char *name, const char *template_rel) {
    static char path[8][1024];
    static unsigned next;
    const char *src = moe_test_shared("models/stories260K/stories260K.gguf");
    const char *tpl_path = template_rel ? moe_test_shared(template_rel) : NULL;
    if (!src || (template_rel && !tpl_path)) return NULL;
    char *out = path[next++ % 8];
    snprintf(out, sizeof path[0], "%s/%s.gguf", moe_test_tmpdir(), name);
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(src, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf_writer *w = moe_gguf_writer_new();
    const moe_str *texts = NULL;
    const int32_t *types = NULL;
    uint64_t n_vocab = 0;
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        if (!strcmp(kv->key.ptr, "tokenizer.ggml.tokens")) {
            texts = kv->value.arr.data;
            n_vocab = kv->value.arr.n;
        } else if (!strcmp(kv->key.ptr, "tokenizer.ggml.token_type")) {
            types = kv->value.arr.data;
        } else {
            moe_gguf_writer_set_value(w, kv->key.ptr, &kv->value);
        }
    }
    if (!texts || !types || n_vocab < 8) fail_msg("%s: no usable vocabulary", src);
    /* ids 3 and 4 (byte tokens <0x00>, <0x01>) become ChatML's control tokens */
    const char **new_texts = moe_xmalloc(n_vocab * sizeof *new_texts);
    int32_t *new_types = moe_xmalloc(n_vocab * sizeof *new_types);
    char **owned = moe_xcalloc(n_vocab, sizeof *owned);
    for (uint64_t i = 0; i < n_vocab; i++) {
        owned[i] = moe_xstrndup(texts[i].ptr, texts[i].len);
        new_texts[i] = owned[i];
        new_types[i] = types[i];
    }
    new_texts[3] = "<|im_start|>";
    new_texts[4] = "<|im_end|>";
    new_types[3] = new_types[4] = 3; /* GGUF token type CONTROL */
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.tokens", MOE_GGUF_STRING, new_texts, n_vocab);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOE_GGUF_I32, new_types, n_vocab);
    if (tpl_path) {
        uint8_t *tpl;
        size_t size;
        if (moe_file_read(tpl_path, &tpl, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
        moe_gguf_writer_set_str(w, "tokenizer.chat_template", (const char *)tpl);
        free(tpl);
    }
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        if (moe_gguf_writer_add_tensor(w, t->name.ptr, t->type, t->n_dims, t->ne, t->data, true,
                                       &err) != MOE_OK)
            fail_msg("%s: %s", out, err.msg);
    }
    if (moe_gguf_writer_write(w, out, 0, &err) != MOE_OK) fail_msg("%s: %s", out, err.msg);
    for (uint64_t i = 0; i < n_vocab; i++) free(owned[i]);
    free(owned);
    free(new_texts);
    free(new_types);
    moe_gguf_writer_free(w);
    moe_gguf_close(g);
    return out;
}

/* Whether s is one of the NULL-terminated list (whole: exact; else: contains one), or not. */
static bool listed(const char *s, const char *const *list, bool whole) {
    for (; list && *list; list++)
        if (whole ? strcmp(s, *list) == 0 : strstr(s, *list) != NULL) return true;
    return false;
}

void moe_test_copy_gguf(const char *src, const char *dst, const char *const *drop_keys,
                        const char *const *drop_tensors, bool dequantize) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(src, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf_writer *w = moe_gguf_writer_new();
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        if (!listed(kv->key.ptr, drop_keys, true))
            moe_gguf_writer_set_value(w, kv->key.ptr, &kv->value);
    }
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        if (listed(t->name.ptr, drop_tensors, false)) continue;
        float *f = NULL;
        if (dequantize) {
            f = moe_xmalloc(t->n_values * sizeof *f);
            moe_type_traits_get(t->type)->to_float(t->data, f, (int64_t)t->n_values);
        }
        if (moe_gguf_writer_add_tensor(w, t->name.ptr, f ? MOE_TYPE_F32 : t->type, t->n_dims, t->ne,
                                       f ? (const void *)f : t->data, !f, &err) != MOE_OK)
            fail_msg("%s", err.msg);
        free(f);
    }
    if (moe_gguf_writer_write(w, dst, 0, &err) != MOE_OK) fail_msg("%s", err.msg);
    moe_gguf_writer_free(w);
    moe_gguf_close(g);
}

json_t *moe_test_run_json(const char *cmd) {
    char full[4096], *out;
    snprintf(full, sizeof full, "(%s 2>/dev/null)", cmd);
    int rc = moe_test_run(full, &out);
    if (rc != 0) fail_msg("%s exited %d: %s", cmd, rc, out);
    json_error_t e;
    json_t *j = json_loads(out, 0, &e);
    if (!j) fail_msg("%s: not JSON (%s): %.300s", cmd, e.text, out);
    free(out);
    return j;
}

uint64_t moe_test_json_uint(json_t *object, const char *key) {
    json_t *v = json_object_get(object, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0) fail_msg("no unsigned integer '%s'", key);
    return (uint64_t)json_integer_value(v);
}
