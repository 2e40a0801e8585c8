/* Suite "audit": the byte audit tools -- `moe inspect` over HTTP ranges against a real HTTP
 * server on loopback (nginx from Debian, started by the suite: we did not write its HTTP),
 * `moe budget` against byte counts computed here from the parity models' JSON descriptions
 * (not from our reader), and `moe audit` against errors recomputed by Python from `moe dump`'s
 * floats (bit-exact with ggml, tested in the dump suite).
 *
 * The server runs for the whole suite from a scratch directory holding copies of the fixtures,
 * a split written with our writer and a file with large tensors; it logs every request, so the
 * request and byte counts moe prints are checked against the server's own. Without nginx the
 * tests that need it skip (fail under CI=true). */
#include "testutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../src/format/format.h"
#include "../src/quant/quant.h"
#include "../src/tools/tools.h"

/* ==== The server ==== */

/* nginx from Debian (`make deps`), one process (`master_process off`) in the foreground, with a
 * config generated into the scratch directory: pid, lock, logs and temp paths there too, so it
 * needs nothing from /etc or /var. It serves the scratch root at /, with ranges (nginx's own
 * static module); the same files without range support at /norange/ (`max_ranges 0`: a 200
 * with the whole file); /redirect/PATH as a 302 to /PATH; and /__sync/N as a 204 (see
 * log_sync). Every request goes to requests.log as "METHOD URI RANGE STATUS BODY_BYTES".
 *
 * The trap: nginx writes a request's log line after it has sent the response, so a client can
 * be done (moe exited) before the line is there. log_sync closes that gap. */

typedef struct server {
    pid_t pid;
    int port;
    char conf[600], error_log[600];
} server;

static server srv;
static char root[512], req_log[600];
static const char *nginx_missing; /* why there is no server, when there is none */

/* Timeouts for a server that should answer at once on loopback. */
#define SERVER_START_MS    10000
#define SERVER_STOP_MS     5000
#define SERVER_START_TRIES 5 /* another process may take the free port before nginx binds it */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* nginx's path: $PATH, then the sbin folders a non-root PATH may lack. NULL when absent. */
static const char *nginx_path(void) {
    static char found[1024];
    const char *path = getenv("PATH");
    char dirs[4096];
    snprintf(dirs, sizeof dirs, "%s:/usr/sbin:/usr/local/sbin:/sbin", path ? path : "");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(found, sizeof found, "%s/nginx", d);
        if (access(found, X_OK) == 0) return found;
    }
    return NULL;
}

/* A port nobody listens on now (the kernel's pick for port 0), or -1. */
static int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(s, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(s);
    return port;
}

static int connect_loopback(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        close(s);
        return -1;
    }
    return s;
}

/* GET path over HTTP/1.0 and read until nginx closes; the status, or -1. */
static int http_get_status(int port, const char *path) {
    int s = connect_loopback(port);
    if (s < 0) return -1;
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    int status = -1;
    if (write(s, buf, (size_t)n) == n) {
        char head[256]; /* the status line, then drain the rest */
        size_t got = 0;
        ssize_t r;
        while ((r = read(s, buf, sizeof buf)) > 0) {
            size_t k = (size_t)r < sizeof head - 1 - got ? (size_t)r : sizeof head - 1 - got;
            memcpy(head + got, buf, k);
            got += k;
        }
        head[got] = '\0';
        if (sscanf(head, "HTTP/1.%*d %d", &status) != 1) status = -1;
    }
    close(s);
    return status;
}

/* The *_temp_path directives this nginx has (`nginx -V`: a compiled-in path, module not left
 * out), each pointed at DIR; appended to conf. Naming a module nginx lacks is a config error,
 * leaving one out makes nginx create it under /var/lib/nginx. */
static void temp_paths(const char *nginx, const char *dir, char *conf, size_t cap) {
    static const struct {
        const char *name, *module;
    } paths[] = {
        {"client_body", NULL},
        {"proxy", "--without-http_proxy_module"},
        {"fastcgi", "--without-http_fastcgi_module"},
        {"uwsgi", "--without-http_uwsgi_module"},
        {"scgi", "--without-http_scgi_module"},
    };
    char cmd[1200], *v;
    snprintf(cmd, sizeof cmd, "'%s' -V", nginx);
    if (moe_test_run(cmd, &v) != 0) fail_msg("%s: %s", cmd, v);
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char flag[64]; /* --http-client-body-temp-path */
        snprintf(flag, sizeof flag, "--http-%s-temp-path", paths[i].name);
        for (char *c = flag; *c; c++) *c = *c == '_' ? '-' : *c;
        if (!paths[i].module || (strstr(v, flag) && !strstr(v, paths[i].module))) {
            size_t n = strlen(conf);
            snprintf(conf + n, cap - n, "    %s_temp_path '%s/nginx-%s';\n", paths[i].name, dir,
                     paths[i].name);
        }
    }
    free(v);
}

/* Write the config for `port` (see the top of this section). */
static void write_conf(server *s, const char *nginx, int port) {
    const char *tmp = moe_test_tmpdir();
    static char conf[8192];
    snprintf(conf, sizeof conf,
             "daemon off;\n"
             "master_process off;\n"
             "%s" /* CI runs as root: then the worker must be root to read the scratch dir */
             "pid '%s/nginx.pid';\n"
             "lock_file '%s/nginx.lock';\n"
             "error_log '%s' info;\n"
             "events { worker_connections 128; }\n"
             "http {\n"
             "    default_type application/octet-stream;\n"
             "    sendfile on;\n"
             "    keepalive_timeout 60s;\n"
             "    log_format audit '$request_method $request_uri $http_range $status "
             "$body_bytes_sent';\n"
             "    access_log '%s' audit;\n",
             geteuid() == 0 ? "user root;\n" : "", tmp, tmp, s->error_log, req_log);
    temp_paths(nginx, tmp, conf, sizeof conf);
    size_t n = strlen(conf);
    snprintf(conf + n, sizeof conf - n,
             "    server {\n"
             "        listen 127.0.0.1:%d;\n"
             "        root '%s';\n"
             "        location / { }\n"
             "        location /norange/ { alias '%s/'; max_ranges 0; }\n"
             "        location ~ ^/redirect(/.*)$ { return 302 $1; }\n"
             "        location /__sync/ { return 204; }\n"
             "    }\n"
             "}\n",
             port, root, root);
    moe_error err = {0};
    if (moe_file_write(s->conf, conf, strlen(conf), &err) != MOE_OK) fail_msg("%s", err.msg);
}

/* nginx's error log, for a message (caller frees). */
static char *error_log_text(const server *s) {
    uint8_t *data;
    size_t size;
    moe_error err = {0};
    if (moe_file_read(s->error_log, &data, &size, &err) != MOE_OK) return moe_xstrndup("", 0);
    char *text = moe_xstrndup((char *)data, size);
    free(data);
    return text;
}

/* Start nginx on a free port and wait until it accepts connections. The child asks the kernel
 * for SIGTERM when this process dies, so a test run killed mid-suite leaves no nginx behind.
 * False (with the error log printed) when it would not start. */
static bool server_start(server *s, const char *nginx) {
    const char *tmp = moe_test_tmpdir();
    snprintf(s->conf, sizeof s->conf, "%s/nginx.conf", tmp);
    snprintf(s->error_log, sizeof s->error_log, "%s/nginx-error.log", tmp);
    for (int attempt = 0; attempt < SERVER_START_TRIES; attempt++) {
        int port = free_port();
        if (port < 0) return false;
        write_conf(s, nginx, port);
        pid_t parent = getpid();
        pid_t pid = fork();
        if (pid < 0) return false;
        if (pid == 0) {
            if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent) _exit(126);
            int null = open("/dev/null", O_RDWR);
            if (null >= 0) dup2(null, 0);
            execl(nginx, "nginx", "-p", tmp, "-c", s->conf, "-e", s->error_log, (char *)NULL);
            _exit(127);
        }
        for (int waited = 0; waited < SERVER_START_MS; waited += 10) {
            int c = connect_loopback(port);
            if (c >= 0) {
                close(c);
                s->pid = pid;
                s->port = port;
                return true;
            }
            if (waitpid(pid, NULL, WNOHANG) == pid) break; /* exited: port taken? try again */
            sleep_ms(10);
        }
        kill(pid, SIGKILL); /* no-op when it has exited; reaped below */
        waitpid(pid, NULL, 0);
    }
    char *log = error_log_text(s);
    print_error("nginx would not start (%s -c %s):\n%s\n", nginx, s->conf, log);
    free(log);
    return false;
}

/* SIGTERM (nginx's fast shutdown), then SIGKILL if it has not gone within SERVER_STOP_MS. */
static void server_stop(server *s) {
    if (s->pid <= 0) return;
    kill(s->pid, SIGTERM);
    int waited = 0;
    while (waitpid(s->pid, NULL, WNOHANG) == 0) {
        if (waited >= SERVER_STOP_MS) {
            kill(s->pid, SIGKILL);
            waitpid(s->pid, NULL, 0);
            break;
        }
        sleep_ms(10);
        waited += 10;
    }
    s->pid = 0;
}

/* In a test that needs the server: false when there is none (the test then skips, or fails
 * under CI=true, like an absent fixture). */
static bool have_server(void) {
    if (srv.pid > 0) return true;
    const char *ci = getenv("CI");
    if (ci && strcmp(ci, "true") == 0)
        fail_msg("%s and CI=true: `make deps` installs it", nginx_missing);
    print_message("[  SKIP    ] %s: `make deps` installs it\n", nginx_missing);
    return false;
}

#define SKIP_WITHOUT_SERVER()                                                                      \
    do {                                                                                           \
        if (!have_server()) {                                                                      \
            skip();                                                                                \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static void copy_file(const char *from, const char *to) {
    uint8_t *data;
    size_t size;
    moe_error err = {0};
    if (moe_file_read(from, &data, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
    if (moe_file_write(to, data, size, &err) != MOE_OK) fail_msg("%s", err.msg);
    free(data);
}

/* Wait until every request a finished client made is in the log. nginx is one process that
 * logs a request as it finishes sending the response, before it looks at the next event; so
 * once a request made now (/__sync/N) is logged, all earlier ones are. */
static void log_sync(void) {
    static unsigned seq;
    char path[64], want[80];
    snprintf(path, sizeof path, "/__sync/%u", ++seq);
    snprintf(want, sizeof want, "GET %s ", path);
    int status = http_get_status(srv.port, path);
    if (status != 204) fail_msg("nginx answered %s with %d, not 204", path, status);
    for (int waited = 0; waited < SERVER_START_MS; waited += 10) {
        uint8_t *data;
        size_t size;
        moe_error err = {0};
        if (moe_file_read(req_log, &data, &size, &err) == MOE_OK) {
            char *text = moe_xstrndup((char *)data, size);
            free(data);
            bool seen = strstr(text, want) != NULL;
            free(text);
            if (seen) return;
        }
        sleep_ms(10);
    }
    fail_msg("%s never reached %s", path, req_log);
}

/* Logged requests "METHOD URI" answered with `status` (after log_sync). */
static int logged_count(const char *method_uri, int status) {
    log_sync();
    FILE *f = fopen(req_log, "r");
    if (!f) fail_msg("no request log %s", req_log);
    char line[2048], want[1100];
    int n = 0, len = snprintf(want, sizeof want, "%s ", method_uri), st;
    while (fgets(line, sizeof line, f))
        n += strncmp(line, want, (size_t)len) == 0 && sscanf(line + len, "%*s %d", &st) == 1 &&
             st == status;
    fclose(f);
    return n;
}

/* Requests (and the body bytes sent for them) the server has logged so far, /__sync/ ones
 * left out. */
static int logged_requests(uint64_t *body_bytes) {
    log_sync();
    FILE *f = fopen(req_log, "r");
    if (!f) fail_msg("no request log %s", req_log);
    int n = 0;
    *body_bytes = 0;
    char line[2048], method[16], uri[1024], range[128];
    int status;
    unsigned long long bytes;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "%15s %1023s %127s %d %llu", method, uri, range, &status, &bytes) != 5)
            fail_msg("%s: bad line %s", req_log, line);
        if (strncmp(uri, "/__sync/", 8) == 0) continue;
        n++;
        *body_bytes += bytes;
    }
    fclose(f);
    return n;
}

static const char *const parity_models[] = {
    "llama-q8_0",    "qwen3moe-mixed",  "deepseek2-f32",   "gpt-oss-mxfp4",
    "qwen3next-f32", "kimi-linear-f32", "gemma4-moe-q4_0", "glm5next-f32",
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
    const char *nginx = nginx_path();
    if (!nginx) {
        nginx_missing = "nginx is not installed (not in $PATH nor /usr/sbin)";
        return 0; /* the tests that need it skip, or fail under CI=true */
    }
    return server_start(&srv, nginx) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    server_stop(&srv);
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
    snprintf(base, sizeof base, "http://127.0.0.1:%d", srv.port);
    snprintf(cmd, sizeof cmd, "%s inspect '%s/%s' %s", moe_test_bin(), root, name, args);
    if (moe_test_run(cmd, &local) != 0) fail_msg("%s: %s", cmd, local);
    uint64_t bytes_before, bytes_after;
    int before = logged_requests(&bytes_before);
    char errpath[600];
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "(%s inspect '%s/%s' %s 2>'%s')", moe_test_bin(), base, name, args,
             errpath);
    if (moe_test_run(cmd, &remote) != 0) fail_msg("%s: %s", cmd, remote);
    int served = logged_requests(&bytes_after) - before;
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
    if (sscanf(line, "remote: %llu requests, %llu bytes read of %llu in %u file", &requests, &bytes,
               &file_bytes, &files) != 4)
        fail_msg("%s: bad line %s", name, line);
    assert_int_equal((int)requests, served);
    assert_int_equal(bytes, bytes_after - bytes_before);
    free(line);
    free(norm);
    free(local);
    free(remote);
    return (int)requests;
}

static void remote_inspect_matches_local(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    SKIP_WITHOUT_SERVER();
    for (size_t i = 0; i < N_PARITY; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s.gguf", parity_models[i]);
        /* each parity header fits in the first range: one request per file */
        assert_int_equal(check_remote_inspect(name, ""), 1);
        assert_int_equal(check_remote_inspect(name, "--json"), 1);
    }
    assert_int_equal(check_remote_inspect("qwen3moe-mixed.gguf", "--formats"), 1);
    /* the split, from its first and from its last shard: one request per shard */
    assert_int_equal(check_remote_inspect("split-00001-of-00003.gguf", ""), 3);
    assert_int_equal(check_remote_inspect("split-00003-of-00003.gguf", "--json"), 3);
}

static void remote_reads_few_bytes(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    SKIP_WITHOUT_SERVER();
    char url[512], path[600];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/big.gguf", srv.port);
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
    snprintf(url, sizeof url, "http://127.0.0.1:%d/redirect/vocab.gguf", srv.port);
    h = moe_http_new();
    moe_http_set_first_range(h, 256);
    g = moe_gguf_open_url(h, url, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf_close(l);
    l = moe_gguf_open(path, &err);
    assert_int_equal(moe_gguf_n_kv(g), moe_gguf_n_kv(l));
    assert_int_equal(moe_gguf_shard_get(g, 0)->header_bytes,
                     moe_gguf_shard_get(l, 0)->header_bytes);
    uint64_t header = moe_gguf_shard_get(l, 0)->header_bytes;
    /* every request came through one redirect: 2 exchanges each */
    uint64_t ranges = moe_http_requests(h) / 2;
    assert_int_equal(moe_http_requests(h) % 2, 0);
    assert_true(ranges >= 2 && ranges <= 12);
    /* and nginx saw them so: a 302 and a 206 for each range */
    assert_int_equal(logged_count("GET /redirect/vocab.gguf", 302), (int)ranges);
    assert_int_equal(logged_count("GET /vocab.gguf", 206), (int)ranges);
    assert_true(moe_http_bytes(h) >= header);
    assert_true(moe_http_bytes(h) <= header + header / 4 + 256);
    moe_gguf_close(g);
    moe_gguf_close(l);
    moe_http_free(h);
}

static void remote_errors(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.gguf"));
    SKIP_WITHOUT_SERVER();
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s inspect http://127.0.0.1:%d/norange/llama-q8_0.gguf",
             moe_test_bin(), srv.port);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    if (!strstr(out, "does not support range requests") || !strstr(out, "HTTP 200"))
        fail_msg("no clear error for a server without ranges: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s inspect http://127.0.0.1:%d/missing.gguf", moe_test_bin(),
             srv.port);
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
             moe_test_bin(), srv.port);
    int rc = moe_test_run(cmd, &out);
    assert_int_equal(rename(b, a), 0);
    assert_int_equal(rc, 1);
    if (!strstr(out, "shard 2 of 3") || !strstr(out, "HTTP 404")) fail_msg("%s", out);
    free(out);
}

/* ==== moe budget ==== */

static json_t *run_json(const char *cmd) {
    return moe_test_run_json(cmd);
}

static uint64_t jnum(json_t *o, const char *key) {
    return moe_test_json_uint(o, key);
}

/* ggml's values per block of a type (by name), for the row splits below. */
static uint64_t block_values(const char *type) {
    static const char *const per32[] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "IQ4_NL"};
    if (!strcmp(type, "F32") || !strcmp(type, "F16") || !strcmp(type, "BF16")) return 1;
    for (size_t i = 0; i < sizeof per32 / sizeof per32[0]; i++)
        if (!strcmp(type, per32[i])) return 32;
    return 256; /* the K and IQ super-blocks */
}

/* The parity description d's blk.LAYER.ffn_down_exps.weight: its ne[0] and type (0 / "F32"
 * when the layer has none). */
static json_t *down_of(json_t *d, int layer) {
    char want[64];
    snprintf(want, sizeof want, "blk.%d.ffn_down_exps.weight", layer);
    size_t k;
    json_t *t;
    json_array_foreach(json_object_get(d, "tensors"), k, t) {
        if (!strcmp(json_string_value(json_object_get(t, "name")), want)) return t;
    }
    return NULL;
}
static uint64_t down_ff(json_t *d, int layer) {
    json_t *t = down_of(d, layer);
    return t ? (uint64_t)json_integer_value(json_array_get(json_object_get(t, "ne"), 0)) : 0;
}
static const char *down_type(json_t *d, int layer) {
    json_t *t = down_of(d, layer);
    return t ? json_string_value(json_object_get(t, "type")) : "F32";
}

/* The part a tensor name belongs to, by the llama.cpp naming rules (written out here rather
 * than taken from tools/, so a change of the rules there shows up). */
static const char *part_of(const char *name, uint64_t n_trunk) {
    if (!strncmp(name, "blk.", 4) && strtoull(name + 4, NULL, 10) >= n_trunk) return "mtp_layers";
    if (strstr(name, "_exps")) return "routed_experts";
    if (strstr(name, "_shexp")) return "shared_experts";
    if (strstr(name, "norm")) return "norms_other";
    const char *b = strncmp(name, "blk.", 4) == 0 ? strchr(name + 4, '.') + 1 : name;
    if (b != name && !strncmp(b, "hc_", 3)) return "hyper_connections";
    if (!strncmp(b, "attn_", 5) || !strncmp(b, "ssm_", 4) || !strncmp(b, "indexer", 7))
        return "attention";
    if (!strncmp(b, "ffn_gate.", 9) || !strncmp(b, "ffn_up.", 7) || !strncmp(b, "ffn_down.", 9))
        return "dense_ffn";
    if (!strcmp(name, "token_embd.weight") || !strcmp(name, "output.weight"))
        return "embeddings_output";
    return "norms_other";
}

static uint64_t cfg(json_t *c, const char *key) {
    return jnum(c, key);
}
static uint64_t meta(json_t *m, const char *key) {
    return jnum(m, key);
}

/* KV bytes per token (f16, all tokens) and per sliding-window token, and the f32 state bytes
 * per stream, from the parity config as the architectures define them. */
static void hand_kv(json_t *d, uint64_t *kv, uint64_t *swa, uint64_t *state, uint64_t *index) {
    json_t *c = json_object_get(d, "config"), *md = json_object_get(d, "metadata");
    const char *arch = json_string_value(json_object_get(c, "arch"));
    if (!arch) arch = json_string_value(json_object_get(d, "arch")); /* glm5next-f32's place */
    uint64_t L = cfg(c, "n_layer");
    *kv = *swa = *state = *index = 0;
    if (!strcmp(arch, "llama") || !strcmp(arch, "qwen3moe")) {
        *kv = L * 2 * cfg(c, "n_head_kv") * cfg(c, "head_dim") * 2;
    } else if (!strcmp(arch, "deepseek2")) {
        *kv = L * (cfg(c, "kv_lora_rank") + cfg(c, "qk_rope_head_dim")) * 2;
    } else if (!strcmp(arch, "gpt-oss")) { /* even layers slide */
        uint64_t per = 2 * cfg(c, "n_head_kv") * cfg(c, "head_dim") * 2;
        *swa = (L + 1) / 2 * per;
        *kv = L / 2 * per;
    } else if (!strcmp(arch, "qwen3next")) { /* every full_attn_interval-th layer is full */
        uint64_t full = L / cfg(c, "full_attn_interval");
        *kv = full * 2 * cfg(c, "n_head_kv") * cfg(c, "head_dim") * 2;
        uint64_t hd = cfg(c, "lin_head_dim"), kh = cfg(c, "lin_k_heads"),
                 vh = cfg(c, "lin_v_heads");
        uint64_t conv = meta(md, "qwen3next.ssm.conv_kernel");
        /* conv tail over q, k (kh heads) and v (vh heads); a hd x hd matrix per v head */
        *state = (L - full) * ((conv - 1) * (2 * kh * hd + vh * hd) + vh * hd * hd) * 4;
    } else if (!strcmp(arch, "gemma4")) { /* swa_pattern: 1 = sliding, its own heads and width */
        json_t *pattern = json_object_get(c, "swa_pattern"),
               *kv_heads = json_object_get(c, "n_head_kv_per_layer");
        for (uint64_t l = 0; l < L; l++) {
            const bool sliding = json_integer_value(json_array_get(pattern, l)) != 0;
            const uint64_t per = 2 * (uint64_t)json_integer_value(json_array_get(kv_heads, l)) *
                                 cfg(c, sliding ? "head_dim_swa" : "head_dim_full") * 2;
            *(sliding ? swa : kv) += per;
        }
    } else if (!strcmp(arch, "kimi-linear")) {
        uint64_t full = json_array_size(json_object_get(c, "full_attn_layers"));
        *kv = full * (cfg(c, "kv_lora_rank") + cfg(c, "qk_rope_head_dim")) * 2;
        uint64_t hd = cfg(c, "kda_head_dim"), h = cfg(c, "n_head");
        uint64_t conv = meta(md, "kimi-linear.ssm.conv_kernel");
        *state = (L - full) * ((conv - 1) * 3 * h * hd + h * hd * hd) * 4;
    } else if (!strcmp(arch, "glm5next")) { /* DSA layers: the latent (no rope part) and the
                                             * indexer's f32 key, pooling logits, pooled key */
        uint64_t dsa = 0;
        for (uint64_t l = 0; l < L; l++)
            dsa += !strcmp(json_string_value(json_array_get(json_object_get(c, "layer_kinds"), l)),
                           "DSA");
        *kv = dsa * cfg(c, "kv_lora") * 2;
        *index = dsa * 3 * cfg(c, "idx_d") * 4;
        uint64_t hd = cfg(c, "kda_hd"), h = cfg(c, "n_head"), conv = cfg(c, "d_conv");
        *state = (L - dsa) * ((conv - 1) * 3 * h * hd + h * hd * hd) * 4;
    } else {
        fail_msg("no hand formula for %s", arch);
    }
}

static void budget_parity_models(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.json"));
    for (size_t i = 0; i < N_PARITY; i++) {
        char path[512], cmd[2048];
        snprintf(path, sizeof path, "../shared/parity/%s.json", parity_models[i]);
        json_error_t e;
        json_t *d = json_load_file(path, 0, &e);
        if (!d) fail_msg("%s: %s", path, e.text);
        /* expected weights by part, parameters, and device 0's share of 3-way row sharding */
        const char *parts[] = {"routed_experts",    "shared_experts",    "attention",
                               "dense_ffn",         "embeddings_output", "norms_other",
                               "hyper_connections", "mtp_layers"};
        enum { N_PARTS = sizeof parts / sizeof parts[0] };
        uint64_t want[N_PARTS] = {0}, params = 0, routed_dev0 = 0, routed_dev2 = 0;
        const uint64_t n_trunk = cfg(json_object_get(d, "config"), "n_layer");
        size_t k;
        json_t *t;
        json_array_foreach(json_object_get(d, "tensors"), k, t) {
            const char *name = json_string_value(json_object_get(t, "name"));
            json_t *ne = json_object_get(t, "ne");
            uint64_t n = 1, bytes = jnum(t, "n_bytes");
            for (size_t x = 0; x < json_array_size(ne); x++)
                n *= (uint64_t)json_integer_value(json_array_get(ne, x));
            params += n;
            for (size_t p = 0; p < N_PARTS; p++)
                if (!strcmp(part_of(name, n_trunk), parts[p])) want[p] += bytes;
            if (!strcmp(part_of(name, n_trunk), "routed_experts")) {
                /* split by rows as the engine runs it: each layer's intermediate (its down's
                 * ne[0]) in whole blocks of the down's type, blocks nb * d / 3 .. nb * (d+1) / 3
                 * on device d; every expert tensor but the down bias and scale is cut along it,
                 * so its bytes scale with the device's share */
                int layer = -1;
                sscanf(name, "blk.%d.", &layer);
                const uint64_t ff = layer >= 0 ? down_ff(d, layer) : 0,
                               nb = ff ? ff / block_values(down_type(d, layer)) : 0;
                const bool whole = !ff || strstr(name, "ffn_down_exps.bias") ||
                                   strstr(name, "ffn_down_exps.scale");
                routed_dev0 += whole ? bytes : bytes * (nb / 3) / nb;
                routed_dev2 += whole ? bytes : bytes * (nb - nb * 2 / 3) / nb;
            }
        }
        assert_int_equal(params, jnum(d, "n_params"));
        uint64_t kv, swa, st, index;
        hand_kv(d, &kv, &swa, &st, &index);

        uint64_t ctx = 1000, streams = 3, mem = 1ull << 30;
        snprintf(cmd, sizeof cmd,
                 "%s budget ../shared/parity/%s.gguf --json --devices 3 "
                 "--mem-per-device 1 --ctx %" PRIu64 " --streams %" PRIu64,
                 moe_test_bin(), parity_models[i], ctx, streams);
        json_t *b = run_json(cmd);
        json_t *m = json_array_get(json_object_get(b, "models"), 0);
        assert_int_equal(jnum(m, "n_params"), params);
        json_t *w = json_object_get(m, "weights");
        for (size_t p = 0; p < N_PARTS; p++)
            if (jnum(w, parts[p]) != want[p])
                fail_msg("%s: %s %" PRIu64 " bytes, expected %" PRIu64, parity_models[i], parts[p],
                         jnum(w, parts[p]), want[p]);
        assert_int_equal(jnum(m, "kv_bytes_per_token"), kv);
        assert_int_equal(jnum(m, "swa_kv_bytes_per_token"), swa);
        assert_int_equal(jnum(m, "state_bytes_per_stream"), st);
        assert_int_equal(jnum(m, "index_bytes_per_token"), index);
        json_t *devs = json_object_get(m, "devices");
        assert_int_equal(json_array_size(devs), 3);
        json_t *d0 = json_object_get(json_array_get(devs, 0), "parts");
        json_t *d2 = json_object_get(json_array_get(devs, 2), "parts");
        assert_int_equal(jnum(d0, "routed_experts"), routed_dev0);
        assert_int_equal(jnum(d2, "routed_experts"), routed_dev2);
        assert_int_equal(jnum(d2, "attention"), want[2]); /* replicated */
        uint64_t window = jnum(m, "window");
        uint64_t swa_tokens = window && window < ctx ? window : ctx;
        assert_int_equal(jnum(d0, "kv_cache"), streams * (ctx * kv + swa_tokens * swa));
        assert_int_equal(jnum(d0, "recurrent_state"), streams * st);
        assert_int_equal(jnum(d0, "indexer_cache"), streams * ctx * index);
        uint64_t total = 0;
        const char *all[] = {
            "routed_experts",    "shared_experts",  "attention",  "dense_ffn", "hyper_connections",
            "embeddings_output", "norms_other",     "mtp_layers", "vision",    "kv_cache",
            "indexer_cache",     "recurrent_state", "scratch"};
        /* the largest device: split by blocks the last takes the larger share, not the first */
        for (size_t dev = 0; dev < 3; dev++) {
            json_t *parts_d = json_object_get(json_array_get(devs, dev), "parts");
            uint64_t sum = 0;
            for (size_t p = 0; p < sizeof all / sizeof all[0]; p++) sum += jnum(parts_d, all[p]);
            if (sum > total) total = sum;
        }
        assert_int_equal(jnum(m, "device_total_max"), total);
        assert_int_equal((uint64_t)json_integer_value(json_object_get(m, "spare")), mem - total);
        assert_true(json_is_true(json_object_get(m, "fits")));

        /* the largest context and stream count are the edges of fitting */
        uint64_t max_ctx = jnum(m, "max_ctx"), max_streams = jnum(m, "max_streams");
        uint64_t train = jnum(m, "ctx_train");
        json_decref(b);
        assert_true(max_ctx >= 1 && max_streams >= streams);
        struct {
            uint64_t c, s;
            bool fits;
        } edge[] = {{max_ctx, streams, true},
                    {max_ctx + 1, streams, max_ctx == train},
                    {ctx, max_streams, true},
                    {ctx, max_streams + 1, false}};
        for (size_t x = 0; x < 4; x++) {
            snprintf(cmd, sizeof cmd,
                     "%s budget ../shared/parity/%s.gguf --json --devices 3 "
                     "--mem-per-device 1 --ctx %" PRIu64 " --streams %" PRIu64,
                     moe_test_bin(), parity_models[i], edge[x].c, edge[x].s);
            b = run_json(cmd);
            m = json_array_get(json_object_get(b, "models"), 0);
            if (json_is_true(json_object_get(m, "fits")) != edge[x].fits)
                fail_msg("%s: ctx %" PRIu64 " streams %" PRIu64 ": fits should be %d",
                         parity_models[i], edge[x].c, edge[x].s, edge[x].fits);
            json_decref(b);
        }
        json_decref(d);
    }
}

/* ==== A GGUF header of a known model's shapes, written here byte by byte ==== */

typedef struct hdr {
    FILE *f;
} hdr;
static void h_u32(hdr *h, uint32_t v) {
    fwrite(&v, 4, 1, h->f);
}
static void h_u64(hdr *h, uint64_t v) {
    fwrite(&v, 8, 1, h->f);
}
static void h_str(hdr *h, const char *s) {
    h_u64(h, strlen(s));
    fwrite(s, 1, strlen(s), h->f);
}
static void h_kv_u32(hdr *h, const char *k, uint32_t v) {
    h_str(h, k);
    h_u32(h, 4); /* GGUF_TYPE_UINT32 */
    h_u32(h, v);
}
static void h_kv_f32(hdr *h, const char *k, float v) {
    h_str(h, k);
    h_u32(h, 6); /* GGUF_TYPE_FLOAT32 */
    fwrite(&v, 4, 1, h->f);
}

typedef struct spec {
    char name[64];
    uint32_t type, n_dims;
    uint64_t ne[3];
} spec;

/* Row bytes of the types used below: ggml's block sizes, written out. */
static uint64_t spec_bytes(const spec *s) {
    uint64_t n = s->ne[0] * s->ne[1] * s->ne[2];
    switch (s->type) {
    case 0:
        return n * 4; /* F32 */
    case 8:
        return n / 32 * 34; /* Q8_0 */
    case 12:
        return n / 256 * 144; /* Q4_K */
    case 14:
        return n / 256 * 210; /* Q6_K */
    }
    return 0;
}

/* Qwen3-30B-A3B: 48 layers, n_embd 2048, 32 heads of 128 (4 KV heads), 128 experts of
 * 3 x 2048 x 768 (8 used), vocabulary 151936, untied output. The file is sparse: the header
 * then a hole up to the size the tensors need. */
static uint64_t write_qwen3_30b(const char *path, uint64_t *params) {
    spec *t = moe_xcalloc(48 * 13 + 3, sizeof *t);
    size_t n = 0;
#define T(nm, ty, nd, a, b, c)                                                                     \
    (snprintf(t[n].name, 64, "%s", nm), t[n].type = ty, t[n].n_dims = nd, t[n].ne[0] = a,          \
     t[n].ne[1] = b, t[n].ne[2] = c, n++)
    T("token_embd.weight", 12, 2, 2048, 151936, 1);
    T("output_norm.weight", 0, 1, 2048, 1, 1);
    T("output.weight", 14, 2, 2048, 151936, 1);
    for (int l = 0; l < 48; l++) {
        char b[64];
#define L(nm, ty, nd, a, bb, c) (snprintf(b, sizeof b, "blk.%d.%s", l, nm), T(b, ty, nd, a, bb, c))
        L("attn_norm.weight", 0, 1, 2048, 1, 1);
        L("attn_q.weight", 8, 2, 2048, 4096, 1);
        L("attn_k.weight", 8, 2, 2048, 512, 1);
        L("attn_v.weight", 8, 2, 2048, 512, 1);
        L("attn_output.weight", 8, 2, 4096, 2048, 1);
        L("attn_q_norm.weight", 0, 1, 128, 1, 1);
        L("attn_k_norm.weight", 0, 1, 128, 1, 1);
        L("ffn_norm.weight", 0, 1, 2048, 1, 1);
        L("ffn_gate_inp.weight", 0, 2, 2048, 128, 1);
        L("ffn_gate_exps.weight", 12, 3, 2048, 768, 128);
        L("ffn_up_exps.weight", 12, 3, 2048, 768, 128);
        L("ffn_down_exps.weight", 14, 3, 768, 2048, 128);
#undef L
    }
#undef T
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    hdr h = {f};
    fwrite("GGUF", 1, 4, f);
    h_u32(&h, 3);
    h_u64(&h, n);
    h_u64(&h, 13);
    h_str(&h, "general.architecture");
    h_u32(&h, 8); /* GGUF_TYPE_STRING */
    h_str(&h, "qwen3moe");
    h_kv_u32(&h, "qwen3moe.block_count", 48);
    h_kv_u32(&h, "qwen3moe.context_length", 40960);
    h_kv_u32(&h, "qwen3moe.embedding_length", 2048);
    h_kv_u32(&h, "qwen3moe.feed_forward_length", 6144);
    h_kv_u32(&h, "qwen3moe.attention.head_count", 32);
    h_kv_u32(&h, "qwen3moe.attention.head_count_kv", 4);
    h_kv_u32(&h, "qwen3moe.attention.key_length", 128);
    h_kv_u32(&h, "qwen3moe.attention.value_length", 128);
    h_kv_u32(&h, "qwen3moe.expert_count", 128);
    h_kv_u32(&h, "qwen3moe.expert_used_count", 8);
    h_kv_u32(&h, "qwen3moe.expert_feed_forward_length", 768);
    h_kv_f32(&h, "qwen3moe.attention.layer_norm_rms_epsilon", 1e-6f);
    uint64_t off = 0;
    *params = 0;
    for (size_t i = 0; i < n; i++) {
        h_str(&h, t[i].name);
        h_u32(&h, t[i].n_dims);
        for (uint32_t d = 0; d < t[i].n_dims; d++) h_u64(&h, t[i].ne[d]);
        h_u32(&h, t[i].type);
        h_u64(&h, off);
        off += (spec_bytes(&t[i]) + 31) / 32 * 32;
        *params += t[i].ne[0] * t[i].ne[1] * t[i].ne[2];
    }
    long header = ftell(f);
    uint64_t data = ((uint64_t)header + 31) / 32 * 32;
    assert_int_equal(fflush(f), 0);
    assert_int_equal(ftruncate(fileno(f), (off_t)(data + off)), 0);
    fclose(f);
    free(t);
    return data + off;
}

static void budget_known_model(void **state) {
    (void)state;
    char path[600], cmd[2048];
    snprintf(path, sizeof path, "%s/qwen3-30b-a3b-shapes.gguf", root[0] ? root : moe_test_tmpdir());
    uint64_t params;
    write_qwen3_30b(path, &params);
    /* by hand: embeddings + output + final norm, and per layer attention, norms, router and
     * the 128 experts of 3 x 2048 x 768 */
    uint64_t per_layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 +
                         2048 * 128 + 3ull * 2048 * 768 * 128;
    uint64_t expect = 2ull * 151936 * 2048 + 2048 + 48 * per_layer;
    assert_int_equal(params, expect);
    assert_true(expect > 30400000000ull && expect < 30600000000ull); /* "30.5B" */
    snprintf(cmd, sizeof cmd, "%s budget '%s' --json --mem-per-device 64 --ctx 32768",
             moe_test_bin(), path);
    json_t *b = run_json(cmd);
    json_t *m = json_array_get(json_object_get(b, "models"), 0);
    assert_int_equal(jnum(m, "n_params"), expect);
    /* KV per token: 48 layers x (K + V) x 4 KV heads x 128 x 2 bytes (f16) = 96 KiB */
    assert_int_equal(jnum(m, "kv_bytes_per_token"), 48 * 2 * 4 * 128 * 2);
    assert_int_equal(jnum(m, "kv_bytes_per_token"), 98304);
    json_t *d0 = json_object_get(json_array_get(json_object_get(m, "devices"), 0), "parts");
    assert_int_equal(jnum(d0, "kv_cache"), 98304ull * 32768);
    assert_int_equal(jnum(d0, "routed_experts"),
                     48ull * 128 * (2 * 768 * 2048 / 256 * 144 + 2048 * 768 / 256 * 210));
    json_decref(b);
    /* q8_0 KV: rows of 512 values in 16 blocks of 34 bytes */
    snprintf(cmd, sizeof cmd, "%s budget '%s' --json --kv-type q8_0 --mem-per-device 64",
             moe_test_bin(), path);
    b = run_json(cmd);
    m = json_array_get(json_object_get(b, "models"), 0);
    assert_int_equal(jnum(m, "kv_bytes_per_token"), 48 * 2 * 16 * 34);
    json_decref(b);

    /* text: the fit line, on 2 devices of 10 GiB (short) and of 24 GiB (fits) */
    char *out;
    snprintf(cmd, sizeof cmd, "%s budget '%s' --devices 2 --mem-per-device 10", moe_test_bin(),
             path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (!strstr(out, "short by ") || !strstr(out, "split 2 ways")) fail_msg("%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s budget '%s' --devices 2 --mem-per-device 24", moe_test_bin(),
             path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (!strstr(out, "fits with ") || !strstr(out, "largest context that fits"))
        fail_msg("%s", out);
    free(out);
}

/* ==== The SVG in a browser ==== */

/* Python's check of Chromium's screenshot of an SVG (argv: png svg): a PNG of the SVG's size
 * (zlib and struct only: 8-bit RGB/RGBA, the five filters), not blank (>= 1% of its pixels not
 * white), and every bar segment at least 2 px each way (the SVG's <rect>s with a <title>, in
 * the SVG's own pixel coordinates: no transforms on them) drawn where the SVG puts it: its fill
 * exactly at its centre pixel, which lies wholly inside it. Prints "segments_checked". */
static const char py_png_check[] =
    "import struct,sys,zlib,xml.etree.ElementTree as E\n"
    "d=open(sys.argv[1],'rb').read()\n"
    "assert d[:8]==b'\\x89PNG\\r\\n\\x1a\\n','not a PNG'\n"
    "p,idat=8,b''\n"
    "while p<len(d):\n"
    "    n,t=struct.unpack('>I4s',d[p:p+8]); c=d[p+8:p+8+n]; p+=12+n\n"
    "    if t==b'IHDR': w,h,bd,ct,_,_,il=struct.unpack('>IIBBBBB',c)\n"
    "    elif t==b'IDAT': idat+=c\n"
    "assert bd==8 and ct in (2,6) and il==0,(bd,ct,il)\n"
    "r=E.parse(sys.argv[2]).getroot(); ns='{http://www.w3.org/2000/svg}'\n"
    "assert (w,h)==(int(float(r.get('width'))),int(float(r.get('height')))),(w,h)\n"
    "bpp=3 if ct==2 else 4; s=w*bpp; raw=zlib.decompress(idat); prev=bytearray(s); rows=[]; i=0\n"
    "for y in range(h):\n"
    "    f=raw[i]; ln=bytearray(raw[i+1:i+1+s]); i+=1+s\n"
    "    for x in range(s):\n"
    "        a=ln[x-bpp] if x>=bpp else 0; b=prev[x]; c=prev[x-bpp] if x>=bpp else 0\n"
    "        if f==1: ln[x]=(ln[x]+a)&255\n"
    "        elif f==2: ln[x]=(ln[x]+b)&255\n"
    "        elif f==3: ln[x]=(ln[x]+(a+b)//2)&255\n"
    "        elif f==4:\n"
    "            pa,pb,pc=abs(b-c),abs(a-c),abs(a+b-2*c)\n"
    "            ln[x]=(ln[x]+(a if pa<=pb and pa<=pc else b if pb<=pc else c))&255\n"
    "    rows.append([bytes(ln[x:x+3]) for x in range(0,s,bpp)]); prev=ln\n"
    "ink=sum(1 for row in rows for q in row if q!=b'\\xff\\xff\\xff')\n"
    "assert ink*100>=w*h,'blank: %d of %d pixels not white'%(ink,w*h)\n"
    "n=0\n"
    "for x in r.iter(ns+'rect'):\n"
    "    if x.find(ns+'title') is None: continue\n"
    "    X,Y,W,H=(float(x.get(k)) for k in ('x','y','width','height'))\n"
    "    if W<2 or H<2: continue\n"
    "    got=rows[int(Y+H/2)][int(X+W/2)]; want=bytes.fromhex(x.get('fill').lstrip('#'))\n"
    "    assert got==want,'%s: %s at its centre, not "
    "%s'%(x.find(ns+'title').text,got.hex(),want.hex())\n"
    "    n+=1\n"
    "print(n)\n";

/* Render the SVG with headless Chromium (Debian's, `make deps`) and check the screenshot with
 * py_png_check. Without Chromium: a message (a failure under CI=true). */
static void check_svg_in_chromium(const char *svg) {
    if (moe_test_run("command -v chromium >/dev/null", NULL) != 0) {
        const char *ci = getenv("CI");
        if (ci && strcmp(ci, "true") == 0)
            fail_msg("chromium is missing and CI=true: `make deps` installs it");
        print_message("[  SKIP    ] chromium is not installed: the SVG is not rendered in a "
                      "browser (`make deps` installs it)\n");
        return;
    }
    char head[512] = "";
    FILE *f = fopen(svg, "r");
    if (!f) fail_msg("%s: %s", svg, strerror(errno));
    size_t n = fread(head, 1, sizeof head - 1, f);
    head[n] = '\0';
    fclose(f);
    const char *tag = strstr(head, "<svg ");
    int width = 0, height = 0;
    const char *wa = tag ? strstr(tag, " width=\"") : NULL,
               *ha = tag ? strstr(tag, " height=\"") : NULL;
    if (!wa || !ha || sscanf(wa, " width=\"%d", &width) != 1 ||
        sscanf(ha, " height=\"%d", &height) != 1 || width <= 0 || height <= 0)
        fail_msg("%s: no width and height on <svg>:\n%s", svg, head);
    /* as root (CI) Chromium needs --no-sandbox; the network flags keep it off a closed network */
    char png[700], py[700], cmd[4096], *out;
    snprintf(png, sizeof png, "%s.chromium.png", svg);
    snprintf(
        cmd, sizeof cmd,
        "(timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic "
        "--no-first-run --disable-background-networking --disable-component-update "
        "--disable-sync --disable-dev-shm-usage --hide-scrollbars --user-data-dir='%s/chromium' "
        "--window-size=%d,%d --screenshot='%s' 'file://%s' && test -s '%s')",
        moe_test_tmpdir(), width, height, png, svg, png);
    if (moe_test_run(cmd, &out) != 0) fail_msg("chromium did not render %s:\n%s", svg, out);
    free(out);
    snprintf(py, sizeof py, "%s/png_check.py", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(py, py_png_check, strlen(py_png_check), &err), MOE_OK);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s'", py, png, svg);
    if (moe_test_run(cmd, &out) != 0) fail_msg("chromium's screenshot of %s: %s", svg, out);
    /* the parts of each bar tall enough to see: experts, attention, KV cache, scratch... */
    if (atoi(out) < 10) fail_msg("too few bar segments checked in chromium's screenshot: %s", out);
    free(out);
}

/* A ladder of two builds of qwen3moe-mixed (as stored, and with every quantized matrix widened
 * to F32 by our writer) at a memory between their needs: the table, the largest that fits, and
 * an SVG that is well-formed XML with a title, axis label, legend, the memory line and one bar
 * per rung and per device (Python's XML parser), rendered by rsvg-convert where installed and
 * by headless Chromium (check_svg_in_chromium). */
static void budget_ladder_and_svg(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen3moe-mixed.gguf"));
    char wide[600], svg[600], cmd[4096], *out;
    snprintf(wide, sizeof wide, "%s/qwen3moe-f32.gguf", moe_test_tmpdir());
    snprintf(svg, sizeof svg, "%s/budget.svg", moe_test_tmpdir());
    moe_test_copy_gguf("../shared/parity/qwen3moe-mixed.gguf", wide, NULL, NULL, true);

    snprintf(cmd, sizeof cmd,
             "%s budget '%s' ../shared/parity/qwen3moe-mixed.gguf --ladder "
             "--json --mem-per-device 1",
             moe_test_bin(), wide);
    json_t *b = run_json(cmd);
    json_t *ms = json_object_get(b, "models");
    assert_int_equal(json_array_size(ms), 2);
    /* rungs ascend by size: the stored build first */
    uint64_t small = jnum(json_array_get(ms, 0), "device_total_max");
    uint64_t big = jnum(json_array_get(ms, 1), "device_total_max");
    assert_true(small < big);
    assert_true(strstr(json_string_value(json_object_get(json_array_get(ms, 0), "name")), "mixed"));
    json_decref(b);
    double mid = (double)(small + big) / 2 / (1024.0 * 1024 * 1024);
    snprintf(cmd, sizeof cmd,
             "%s budget '%s' ../shared/parity/qwen3moe-mixed.gguf --ladder "
             "--mem-per-device %.9f --svg '%s'",
             moe_test_bin(), wide, mid, svg);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (!strstr(out, "largest that fits: ../shared/parity/qwen3moe-mixed.gguf"))
        fail_msg("%s", out);
    free(out);
    snprintf(cmd, sizeof cmd,
             "%s budget '%s' ../shared/parity/qwen3moe-mixed.gguf --ladder "
             "--mem-per-device %.9f --json",
             moe_test_bin(), wide, mid);
    b = run_json(cmd);
    assert_true(strstr(json_string_value(json_object_get(b, "largest_fit")), "mixed"));
    json_decref(b);

    snprintf(cmd, sizeof cmd,
             "python3 -c 'import xml.etree.ElementTree as E\nr=E.parse(\"%s\").getroot()\n"
             "ns=\"{http://www.w3.org/2000/svg}\"\n"
             "texts=[t.text or \"\" for t in r.iter(ns+\"text\")]\n"
             "assert any(t.startswith(\"Quant ladder\") for t in texts)\n"
             "assert any(t.startswith(\"Memory per device\") for t in texts)\n"
             "assert any(t.startswith(\"memory (\") for t in texts)\n"
             "assert \"parts\" in texts and \"routed experts\" in texts and \"KV cache\" in texts\n"
             "assert any(\"qwen3moe-f32.gguf\" in t for t in texts)\n"
             "assert sum(1 for t in texts if t.endswith(\"(short)\"))==1\n"
             "print(len([x for x in r.iter(ns+\"rect\") if x.find(ns+\"title\") is not None]))'",
             svg);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    /* segments: >= 5 non-empty parts in each of 2 rungs + 1 device bar */
    assert_true(atoi(out) >= 15);
    free(out);
    if (moe_test_run("command -v rsvg-convert >/dev/null", NULL) == 0) {
        snprintf(cmd, sizeof cmd, "rsvg-convert '%s' -o '%s.png' && test -s '%s.png'", svg, svg,
                 svg);
        assert_int_equal(moe_test_run(cmd, NULL), 0);
    }
    check_svg_in_chromium(svg);

    snprintf(cmd, sizeof cmd,
             "%s budget ../shared/parity/qwen3moe-mixed.gguf "
             "../shared/parity/llama-q8_0.gguf --ladder",
             moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    if (!strstr(out, "builds of one model")) fail_msg("%s", out);
    free(out);
}

/* ==== moe audit ==== */

/* Python's own computation of the three metrics for one (tensor, expert) of an audit: the
 * rows come from `moe dump` of both files (its floats are bit-exact with ggml, see the dump
 * suite), X is redrawn with the documented splitmix64 + Box-Muller recipe. Prints
 * "rel_fro cosine matvec_rel". */
static const char *const py_metrics =
    "import math,struct,sys\n"
    "q,w,rows,cols,seed=sys.argv[1],sys.argv[2],int(sys.argv[3]),int(sys.argv[4]),int(sys.argv[5])"
    "\n"
    "def load(p):\n"
    "    b=open(p,'rb').read(); return struct.unpack('<%df'%(len(b)//4),b)\n"
    "Q,W=load(q),load(w)\n"
    "assert len(Q)==len(W)==rows*cols\n"
    "M=(1<<64)-1; s=seed\n"
    "def nxt():\n"
    "    global s\n"
    "    s=(s+0x9e3779b97f4a7c15)&M; z=s\n"
    "    z=((z^(z>>30))*0xbf58476d1ce4e5b9)&M; z=((z^(z>>27))*0x94d049bb133111eb)&M\n"
    "    return z^(z>>31)\n"
    "X=[]\n"
    "while len(X)<cols*64:\n"
    "    u1=((nxt()>>11)+1)*2.0**-53; u2=((nxt()>>11)+1)*2.0**-53\n"
    "    r=math.sqrt(-2*math.log(u1)); "
    "X+=[r*math.cos(6.283185307179586*u2),r*math.sin(6.283185307179586*u2)]\n"
    "ee=ww=qq=qw=ex2=wx2=0.0\n"
    "for i in range(rows):\n"
    "    ex=[0.0]*64; wx=[0.0]*64\n"
    "    for c in range(cols):\n"
    "        a=Q[i*cols+c]; b=W[i*cols+c]; d=a-b\n"
    "        ee+=d*d; ww+=b*b; qq+=a*a; qw+=a*b\n"
    "        xc=X[c*64:c*64+64]\n"
    "        for j in range(64):\n"
    "            ex[j]+=d*xc[j]; wx[j]+=b*xc[j]\n"
    "    ex2+=sum(v*v for v in ex); wx2+=sum(v*v for v in wx)\n"
    "print('%.17g %.17g %.17g'%(math.sqrt(ee/ww),qw/math.sqrt(qq*ww),math.sqrt(ex2/wx2)))\n";

/* Seeded float rows with a heavier tail than a normal (one value in 64 four times larger), so
 * the formats' handling of outliers shows in their errors. */
static void synth_floats(float *f, uint64_t n, uint64_t seed) {
    double *x = moe_xmalloc(((n + 63) / 64 * 64) * sizeof *x);
    moe_audit_normals(seed, (n + 63) / 64, x);
    for (uint64_t i = 0; i < n; i++) f[i] = (float)(0.02 * x[i] * (i % 64 == 7 ? 4.0 : 1.0));
    free(x);
}

static const moe_type audit_types[] = {MOE_TYPE_Q8_0,   MOE_TYPE_Q6_K,   MOE_TYPE_Q4_K,
                                       MOE_TYPE_IQ4_XS, MOE_TYPE_IQ4_NL, MOE_TYPE_Q4_0};
#define N_AUDIT_TYPES (sizeof audit_types / sizeof audit_types[0])

/* ref.gguf (F32) and q_<TYPE>.gguf (the same tensors quantized by our from_float): an expert
 * tensor [256, 48, 4] and a matrix [512, 40]. */
static void write_audit_models(const char *dir) {
    static const struct {
        const char *name;
        uint32_t n_dims;
        int64_t ne[3];
    } ts[] = {
        {"blk.0.ffn_up_exps.weight", 3, {256, 48, 4}},
        {"blk.0.attn_q.weight", 2, {512, 40, 1}},
    };
    moe_error err = {0};
    char path[700];
    float *src[2];
    for (size_t k = 0; k < 2; k++) {
        uint64_t n = (uint64_t)(ts[k].ne[0] * ts[k].ne[1] * ts[k].ne[2]);
        src[k] = moe_xmalloc(n * sizeof(float));
        synth_floats(src[k], n, 1000 + k);
    }
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "llama");
    for (size_t k = 0; k < 2; k++)
        assert_int_equal(moe_gguf_writer_add_tensor(w, ts[k].name, MOE_TYPE_F32, ts[k].n_dims,
                                                    ts[k].ne, src[k], false, &err),
                         MOE_OK);
    snprintf(path, sizeof path, "%s/ref.gguf", dir);
    assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);
    for (size_t t = 0; t < N_AUDIT_TYPES; t++) {
        const moe_type_traits *tr = moe_type_traits_get(audit_types[t]);
        w = moe_gguf_writer_new();
        moe_gguf_writer_set_str(w, "general.architecture", "llama");
        for (size_t k = 0; k < 2; k++) {
            uint64_t n = (uint64_t)(ts[k].ne[0] * ts[k].ne[1] * ts[k].ne[2]);
            void *q = moe_xmalloc(n / (uint64_t)tr->block_values * tr->block_bytes);
            tr->from_float(src[k], q, (int64_t)n);
            assert_int_equal(moe_gguf_writer_add_tensor(w, ts[k].name, audit_types[t], ts[k].n_dims,
                                                        ts[k].ne, q, false, &err),
                             MOE_OK);
            free(q);
        }
        snprintf(path, sizeof path, "%s/q_%s.gguf", dir, tr->name);
        assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
        moe_gguf_writer_free(w);
    }
    free(src[0]);
    free(src[1]);
}

/* Check every row of an audit JSON against Python's computation from `moe dump`. */
static void check_against_python(json_t *a, const char *quant, const char *ref) {
    char py[600], cmd[4096], qf[600], wf[600], *out;
    snprintf(py, sizeof py, "%s/metrics.py", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(py, py_metrics, strlen(py_metrics), &err), MOE_OK);
    snprintf(qf, sizeof qf, "%s/q.f32", moe_test_tmpdir());
    snprintf(wf, sizeof wf, "%s/w.f32", moe_test_tmpdir());
    size_t i;
    json_t *row;
    json_array_foreach(json_object_get(a, "tensors"), i, row) {
        const char *name = json_string_value(json_object_get(row, "tensor"));
        json_t *e = json_object_get(row, "expert");
        uint64_t rows = jnum(row, "rows"), cols = jnum(row, "cols");
        /* dump's rows of a 3-D tensor are expert-major: expert e starts at e * ne[1] */
        moe_gguf *g = moe_gguf_open(quant, &err);
        assert_non_null(g);
        uint64_t ne1 = (uint64_t)moe_gguf_tensor_find(g, name)->ne[1];
        moe_gguf_close(g);
        uint64_t first = json_is_integer(e) ? (uint64_t)json_integer_value(e) * ne1 : 0;
        for (int k = 0; k < 2; k++) {
            snprintf(cmd, sizeof cmd, "%s dump '%s' '%s' --rows %" PRIu64 ":%" PRIu64 " --out '%s'",
                     moe_test_bin(), k ? ref : quant, name, first, first + rows, k ? wf : qf);
            if (moe_test_run(cmd, &out) != 0) fail_msg("%s: %s", cmd, out);
            free(out);
        }
        snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s' %" PRIu64 " %" PRIu64 " %" PRIu64, py, qf,
                 wf, rows, cols, jnum(a, "seed"));
        if (moe_test_run(cmd, &out) != 0) fail_msg("%s: %s", cmd, out);
        double want[3];
        assert_int_equal(sscanf(out, "%lf %lf %lf", &want[0], &want[1], &want[2]), 3);
        free(out);
        const char *keys[3] = {"rel_fro", "cosine", "matvec_rel"};
        for (int k = 0; k < 3; k++) {
            double got = json_real_value(json_object_get(row, keys[k]));
            if (fabs(got - want[k]) > 1e-9 * fabs(want[k]) + 1e-15)
                fail_msg("%s expert %lld %s: moe %.17g, python %.17g", name,
                         json_is_integer(e) ? (long long)json_integer_value(e) : -1LL, keys[k], got,
                         want[k]);
        }
    }
}

static void audit_synthetic_types(void **state) {
    (void)state;
    char dir[600], cmd[4096], q[700], ref[700];
    snprintf(dir, sizeof dir, "%s", root[0] ? root : moe_test_tmpdir());
    write_audit_models(dir);
    snprintf(ref, sizeof ref, "%s/ref.gguf", dir);
    double fro[N_AUDIT_TYPES];
    for (size_t t = 0; t < N_AUDIT_TYPES; t++) {
        snprintf(q, sizeof q, "%s/q_%s.gguf", dir, moe_type_name(audit_types[t]));
        snprintf(cmd, sizeof cmd, "%s audit '%s' '%s' --json --experts 1,3 --rows 24",
                 moe_test_bin(), q, ref);
        json_t *a = run_json(cmd);
        json_t *rows = json_object_get(a, "tensors");
        /* the expert tensor twice (experts 1 and 3), the matrix once */
        assert_int_equal(json_array_size(rows), 3);
        assert_int_equal(jnum(json_array_get(rows, 0), "expert"), 1);
        assert_int_equal(jnum(json_array_get(rows, 1), "expert"), 3);
        assert_true(json_is_null(json_object_get(json_array_get(rows, 2), "expert")));
        assert_int_equal(jnum(json_array_get(rows, 2), "rows"), 24);
        fro[t] = json_real_value(json_object_get(json_array_get(rows, 2), "rel_fro"));
        double cosine = json_real_value(json_object_get(json_array_get(rows, 2), "cosine"));
        double matvec = json_real_value(json_object_get(json_array_get(rows, 2), "matvec_rel"));
        /* for a random X, ||E X|| / ||W X|| is close to ||E|| / ||W|| */
        assert_true(matvec > 0.5 * fro[t] && matvec < 2 * fro[t]);
        assert_true(cosine > 1 - fro[t] * fro[t] && cosine < 1);
        check_against_python(a, q, ref);
        json_decref(a);
    }
    /* the formats in the order their bits say: Q8_0 << Q6_K < Q4_K / IQ4 < Q4_0 */
    assert_true(fro[0] < 0.01);
    assert_true(fro[0] * 3 < fro[1]);
    assert_true(fro[1] * 2 < fro[2]);
    for (size_t t = 2; t < N_AUDIT_TYPES; t++) assert_true(fro[t] > 0.02 && fro[t] < 0.2);
    assert_true(fro[3] < fro[5] && fro[4] < fro[5]); /* IQ4_XS, IQ4_NL beat Q4_0 */
    assert_true(fro[2] < fro[5]);                    /* Q4_K beats Q4_0 */

    /* --tensor selects by regex */
    snprintf(q, sizeof q, "%s/q_Q4_K.gguf", dir);
    snprintf(cmd, sizeof cmd, "%s audit '%s' '%s' --json --tensor 'attn_q\\.' --rows 8",
             moe_test_bin(), q, ref);
    json_t *a = run_json(cmd);
    assert_int_equal(json_array_size(json_object_get(a, "tensors")), 1);
    json_decref(a);
    char *out;
    snprintf(cmd, sizeof cmd, "%s audit '%s' '%s' --experts 9", moe_test_bin(), q, ref);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    if (!strstr(out, "expert 9, but it has 4 experts")) fail_msg("%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s audit '%s' '%s' --tensor '('", moe_test_bin(), q, ref);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    free(out);
}

/* IQ2_S and IQ3_S (no quantizer of ours): qwen3moe-mixed's own matrices against a reference
 * made by adding seeded noise to their dequantized values -- the audit's numbers must still be
 * Python's, and rel_fro must come out as the noise's relative size. */
static void audit_iq_and_remote(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen3moe-mixed.gguf"));
    char ref[700], q[700], cmd[4096];
    snprintf(q, sizeof q, "%s/qwen3moe-mixed.gguf", root);
    snprintf(ref, sizeof ref, "%s/qwen3moe-ref.gguf", root);
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(q, &err);
    assert_non_null(g);
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "qwen3moe");
    double noise = 0.05;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        float *f = moe_xmalloc(t->n_values * sizeof *f), *z = moe_xmalloc(t->n_values * sizeof *z);
        moe_type_traits_get(t->type)->to_float(t->data, f, (int64_t)t->n_values);
        synth_floats(z, t->n_values, 77 + i);
        /* add noise proportional to each row's RMS */
        for (uint64_t r = 0; r < t->n_values / (uint64_t)t->ne[0]; r++) {
            double ss = 0;
            for (int64_t c = 0; c < t->ne[0]; c++)
                ss += (double)f[r * t->ne[0] + c] * f[r * t->ne[0] + c];
            double rms = sqrt(ss / (double)t->ne[0]);
            for (int64_t c = 0; c < t->ne[0]; c++)
                f[r * t->ne[0] + c] +=
                    (float)(noise * rms * z[r * t->ne[0] + c] / 0.02 * (c % 64 == 7 ? 0.25 : 1.0));
        }
        assert_int_equal(moe_gguf_writer_add_tensor(w, t->name.ptr, MOE_TYPE_F32, t->n_dims, t->ne,
                                                    f, false, &err),
                         MOE_OK);
        free(f);
        free(z);
    }
    assert_int_equal(moe_gguf_writer_write(w, ref, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);

    snprintf(cmd, sizeof cmd,
             "%s audit '%s' '%s' --json --tensor 'blk\\.1\\.ffn_(gate|down)_exps' "
             "--experts 0,5 --rows 16",
             moe_test_bin(), q, ref);
    json_t *a = run_json(cmd);
    json_t *rows = json_object_get(a, "tensors");
    assert_int_equal(json_array_size(rows), 4);
    size_t i;
    json_t *row;
    bool seen_iq2 = false, seen_iq3 = false;
    json_array_foreach(rows, i, row) {
        const char *fmt = json_string_value(json_object_get(row, "format"));
        seen_iq2 |= !strcmp(fmt, "IQ2_S");
        seen_iq3 |= !strcmp(fmt, "IQ3_S");
        double fro = json_real_value(json_object_get(row, "rel_fro"));
        assert_true(fro > noise * 0.8 && fro < noise * 1.25);
    }
    assert_true(seen_iq2 && seen_iq3);
    check_against_python(a, q, ref);

    /* the same audit over HTTP: the same numbers, and exactly the selected rows' bytes */
    if (!have_server()) {
        json_decref(a);
        moe_gguf_close(g);
        skip();
        return;
    }
    char url_q[700], url_r[700];
    snprintf(url_q, sizeof url_q, "http://127.0.0.1:%d/qwen3moe-mixed.gguf", srv.port);
    snprintf(url_r, sizeof url_r, "http://127.0.0.1:%d/qwen3moe-ref.gguf", srv.port);
    snprintf(cmd, sizeof cmd,
             "%s audit '%s' '%s' --json --tensor 'blk\\.1\\.ffn_(gate|down)_exps' "
             "--experts 0,5 --rows 16",
             moe_test_bin(), url_q, url_r);
    json_t *b = run_json(cmd);
    json_array_foreach(rows, i, row) {
        json_t *other = json_array_get(json_object_get(b, "tensors"), i);
        assert_true(json_real_value(json_object_get(row, "rel_fro")) ==
                    json_real_value(json_object_get(other, "rel_fro")));
        assert_true(json_real_value(json_object_get(row, "matvec_rel")) ==
                    json_real_value(json_object_get(other, "matvec_rel")));
    }
    json_decref(b);
    char *out, errpath[700];
    snprintf(errpath, sizeof errpath, "%s/audit.err", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "(%s audit '%s' '%s' --tensor 'blk\\.1\\.ffn_(gate|down)_exps' "
             "--experts 0,5 --rows 16 >/dev/null; cat /dev/null) && %s audit '%s' '%s' "
             "--tensor 'blk\\.1\\.ffn_(gate|down)_exps' --experts 0,5 --rows 16 | tail -1",
             moe_test_bin(), url_q, url_r, moe_test_bin(), url_q, url_r);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    unsigned long long all_req, all_bytes, row_req, row_bytes;
    if (sscanf(out, "remote: %llu requests, %llu bytes read (%llu requests, %llu bytes", &all_req,
               &all_bytes, &row_req, &row_bytes) != 4)
        fail_msg("%s", out);
    free(out);
    /* 4 (tensor, expert) pairs, one range in each file: rows x row bytes (IQ2_S 82 and IQ3_S
     * 110 bytes per 256 values; F32 1024 bytes per row of 256) */
    uint64_t want = 2 * 16 * (82 + 110) + 4 * 16 * 1024;
    assert_int_equal(row_req, 8);
    assert_int_equal(row_bytes, want);
    assert_int_equal(all_req, 2 + 8); /* one header range per file */
    json_decref(a);
    moe_gguf_close(g);
}

int moe_suite_audit(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(remote_inspect_matches_local),
        cmocka_unit_test(remote_reads_few_bytes),
        cmocka_unit_test(remote_errors),
        cmocka_unit_test(budget_parity_models),
        cmocka_unit_test(budget_known_model),
        cmocka_unit_test(budget_ladder_and_svg),
        cmocka_unit_test(audit_synthetic_types),
        cmocka_unit_test(audit_iq_and_remote),
    };
    return cmocka_run_group_tests_name("audit", tests, setup, teardown);
}
