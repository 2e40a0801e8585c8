/* bench_server.c: `moe bench --server URL` -- load on a running OpenAI-compatible server: output
 * throughput, time to first token, inter-token latency, errors; and, with --start-cmd, how long
 * the server takes to become ready.
 *
 * Each request is one thread with one libcurl transfer of a streaming /v1/completions request
 * (ignore_eos, max_tokens = tokens, stream_options.include_usage); the SSE bytes are split into
 * events as they arrive and each event whose choice has text is a chunk, timed on arrival. The
 * count of tokens is the server's own usage.completion_tokens from the last chunk. The trap: chunk
 * times are when the bytes reached us -- events that arrive in one read share a time, so an
 * inter-token latency of 0 is real (the server or the network batched them), not a bug. */
#include "tools.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#define BENCH_SERVER_POLL_S    0.05       /* /health polling while a started server loads */
#define BENCH_SERVER_STOP_S    10         /* SIGTERM, then SIGKILL after this */
#define BENCH_SERVER_MAX_EVENT (1u << 20) /* one SSE event; a longer one is an error */

void moe_bench_server_params_default(moe_bench_server_params *p) {
    memset(p, 0, sizeof *p);
    p->concurrency = 16;
    p->tokens = 256;
    p->repeats = 3;
    p->prompt = "Once upon a time, there was a little";
    p->ready_timeout_s = 600;
}

/* ==== One request ==== */

typedef struct request {
    const moe_bench_server_params *p;
    int index;
    double t_start, t_end;
    double *chunk_t; /* arrival time of each chunk with text */
    size_t n_chunks, cap_chunks;
    long completion_tokens; /* from usage; -1 until seen */
    moe_strbuf pending;     /* bytes of an event not yet complete */
    char error[512];
    pthread_t thread;
    bool running; /* thread started: join it */
} request;

static void on_event(request *q, const char *ev, size_t len, double t) {
    const char *data = NULL;
    for (const char *line = ev; line < ev + len;) {
        const char *nl = memchr(line, '\n', (size_t)(ev + len - line));
        const char *end = nl ? nl : ev + len;
        if (end - line >= 5 && memcmp(line, "data:", 5) == 0) data = line + 5;
        line = end + 1;
    }
    if (!data) return; /* comments (keep-alives) and other fields */
    while (*data == ' ') data++;
    if (strncmp(data, "[DONE]", 6) == 0) return;
    /* a model may emit NUL bytes: the server escapes them as \u0000 */
    json_t *j = json_loadb(data, (size_t)(ev + len - data), JSON_ALLOW_NUL, NULL);
    if (!j) {
        if (!q->error[0])
            snprintf(q->error, sizeof q->error, "an event's data is not JSON: %.*s",
                     (int)(ev + len - data < 120 ? ev + len - data : 120), data);
        return;
    }
    /* a chunk with text is a token's (the closing one has only finish_reason) */
    json_t *text = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text");
    if (json_string_length(text) > 0) {
        if (q->n_chunks == q->cap_chunks) {
            q->cap_chunks = q->cap_chunks ? 2 * q->cap_chunks : 256;
            q->chunk_t = moe_xrealloc(q->chunk_t, q->cap_chunks * sizeof *q->chunk_t);
        }
        q->chunk_t[q->n_chunks++] = t;
    }
    json_t *usage = json_object_get(j, "usage");
    if (json_is_integer(json_object_get(usage, "completion_tokens")))
        q->completion_tokens =
            (long)json_integer_value(json_object_get(usage, "completion_tokens"));
    json_t *error = json_object_get(j, "error");
    if (error && !q->error[0])
        snprintf(q->error, sizeof q->error, "stream error: %s",
                 json_string_value(json_object_get(error, "message"))
                     ? json_string_value(json_object_get(error, "message"))
                     : "(no message)");
    json_decref(j);
}

static size_t on_bytes(char *data, size_t size, size_t n, void *ud) {
    request *q = ud;
    const double t = moe_now();
    moe_strbuf_put(&q->pending, data, size * n);
    /* complete events end with a blank line */
    size_t used = 0;
    for (;;) {
        char *start = q->pending.s + used;
        char *end = memmem(start, q->pending.len - used, "\n\n", 2);
        if (!end) break;
        on_event(q, start, (size_t)(end - start), t);
        used = (size_t)(end + 2 - q->pending.s);
    }
    memmove(q->pending.s, q->pending.s + used, q->pending.len - used);
    q->pending.len -= used;
    return q->pending.len > BENCH_SERVER_MAX_EVENT ? 0 : size * n;
}

static void *request_main(void *arg) {
    request *q = arg;
    const moe_bench_server_params *p = q->p;
    char prompt[1024];
    snprintf(prompt, sizeof prompt, "%d: %s", q->index, p->prompt);
    json_t *body = json_pack("{s:s,s:s,s:i,s:b,s:b,s:f,s:{s:b}}", "model", "bench", "prompt",
                             prompt, "max_tokens", p->tokens, "ignore_eos", 1, "stream", 1,
                             "temperature", 0.0, "stream_options", "include_usage", 1);
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s/v1/completions", p->url);
    struct curl_slist *hdr = curl_slist_append(NULL, "content-type: application/json");
    if (p->api_key) {
        snprintf(auth, sizeof auth, "authorization: Bearer %s", p->api_key);
        hdr = curl_slist_append(hdr, auth);
    }
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, text);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_bytes);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    q->completion_tokens = -1;
    q->t_start = moe_now();
    const CURLcode rc = curl_easy_perform(c);
    q->t_end = moe_now();
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    curl_slist_free_all(hdr);
    free(text);
    if (q->error[0]) return NULL;
    if (rc != CURLE_OK)
        snprintf(q->error, sizeof q->error, "%.200s: %s", url, curl_easy_strerror(rc));
    else if (status != 200)
        snprintf(q->error, sizeof q->error, "%.200s: HTTP %ld: %.120s", url, status,
                 q->pending.s ? q->pending.s : "");
    else if (q->completion_tokens != p->tokens)
        snprintf(q->error, sizeof q->error, "%.200s: %ld tokens streamed, %d asked for", url,
                 q->completion_tokens, p->tokens);
    return NULL;
}

/* ==== Starting a server ==== */

static size_t discard(char *data, size_t size, size_t n, void *ud) {
    (void)data;
    (void)ud;
    return size * n;
}

static bool health_ok(const moe_bench_server_params *p) {
    char url[2048];
    snprintf(url, sizeof url, "%s/health", p->url);
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 5L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    long status = 0;
    if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    return status == 200;
}

static void sleep_s(double s) {
    struct timespec d = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    nanosleep(&d, NULL);
}

/* Start the command in its own process group and wait for /health; its pid, or -1. */
static pid_t start_server(const moe_bench_server_params *p, double *ready_s, moe_error *err) {
    const double t0 = moe_now();
    const pid_t pid = fork();
    if (pid < 0) {
        moe_error_set(err, MOE_ERR_IO, "--start-cmd: fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0);
        execl("/bin/sh", "sh", "-c", p->start_cmd, (char *)NULL);
        _exit(127);
    }
    setpgid(pid, pid);
    while (moe_now() - t0 < p->ready_timeout_s) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            moe_error_set(err, MOE_ERR_IO,
                          "--start-cmd exited (status %d) before %s/health said 200",
                          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), p->url);
            return -1;
        }
        if (health_ok(p)) {
            *ready_s = moe_now() - t0;
            return pid;
        }
        sleep_s(BENCH_SERVER_POLL_S);
    }
    kill(-pid, SIGKILL);
    waitpid(pid, NULL, 0);
    moe_error_set(err, MOE_ERR_IO, "--start-cmd: %s/health did not say 200 within %g s", p->url,
                  p->ready_timeout_s);
    return -1;
}

static void stop_server(pid_t pid) {
    kill(-pid, SIGTERM);
    for (int i = 0; i < BENCH_SERVER_STOP_S * 20; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid) return;
        sleep_s(0.05);
    }
    kill(-pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* ==== The run ==== */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted v. */
static double percentile(const double *v, size_t n, double pct) {
    if (!n) return 0;
    size_t rank = (size_t)ceil(pct / 100.0 * (double)n);
    return v[rank ? rank - 1 : 0];
}

static void push(double **v, size_t *n, size_t *cap, double x) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 1024;
        *v = moe_xrealloc(*v, *cap * sizeof **v);
    }
    (*v)[(*n)++] = x;
}

/* One repeat: every request at once; adds its samples to r, returns its output tok/s. */
static double run_repeat(const moe_bench_server_params *p, int repeat, moe_bench_server_result *r,
                         size_t *cap_ttft, size_t *cap_itl) {
    request *qs = moe_xcalloc((size_t)p->concurrency, sizeof *qs);
    const double t0 = moe_now();
    for (int i = 0; i < p->concurrency; i++) {
        qs[i].p = p;
        qs[i].index = repeat * p->concurrency + i;
        qs[i].running = pthread_create(&qs[i].thread, NULL, request_main, &qs[i]) == 0;
        if (!qs[i].running)
            snprintf(qs[i].error, sizeof qs[i].error, "cannot start a request thread");
    }
    uint64_t tokens = 0;
    for (int i = 0; i < p->concurrency; i++) {
        request *q = &qs[i];
        if (q->running) pthread_join(q->thread, NULL);
        r->requests++;
        if (q->error[0]) {
            if (!r->errors++) snprintf(r->first_error, sizeof r->first_error, "%s", q->error);
        } else {
            tokens += (uint64_t)q->completion_tokens;
            if (q->n_chunks) push(&r->ttft, &r->n_ttft, cap_ttft, q->chunk_t[0] - q->t_start);
            for (size_t k = 1; k < q->n_chunks; k++)
                push(&r->itl, &r->n_itl, cap_itl, q->chunk_t[k] - q->chunk_t[k - 1]);
        }
        free(q->chunk_t);
        moe_strbuf_free(&q->pending);
    }
    const double wall = moe_now() - t0;
    free(qs);
    r->output_tokens += tokens;
    return wall > 0 ? (double)tokens / wall : 0;
}

moe_status moe_bench_server_run(const moe_bench_server_params *p, moe_bench_server_result *r,
                                moe_error *err) {
    memset(r, 0, sizeof *r);
    r->time_to_ready_s = -1;
    if (p->concurrency < 1 || p->concurrency > MOE_BENCH_SERVER_MAX_CONCURRENCY || p->tokens < 1 ||
        p->repeats < 1 || p->repeats > MOE_BENCH_MAX_RUNS)
        return moe_error_set(err, MOE_ERR_ARG,
                             "bench --server: concurrency 1..%d, tokens >= 1, repeats 1..%d",
                             MOE_BENCH_SERVER_MAX_CONCURRENCY, MOE_BENCH_MAX_RUNS);
    if (strncmp(p->url, "http://", 7) != 0 && strncmp(p->url, "https://", 8) != 0)
        return moe_error_set(err, MOE_ERR_ARG, "bench --server: '%s' is not an http(s):// URL",
                             p->url);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pid_t server = -1;
    if (p->start_cmd) {
        server = start_server(p, &r->time_to_ready_s, err);
        if (server < 0) return err->code;
    }
    double *rates = moe_xcalloc((size_t)p->repeats, sizeof *rates);
    size_t cap_ttft = 0, cap_itl = 0;
    for (int k = 0; k < p->repeats; k++) rates[k] = run_repeat(p, k, r, &cap_ttft, &cap_itl);
    if (server > 0) stop_server(server);
    qsort(rates, (size_t)p->repeats, sizeof *rates, cmp_double);
    r->tok_s.min = rates[0];
    r->tok_s.max = rates[p->repeats - 1];
    r->tok_s.median = moe_median(rates, p->repeats);
    free(rates);
    if (r->n_ttft) qsort(r->ttft, r->n_ttft, sizeof *r->ttft, cmp_double);
    if (r->n_itl) qsort(r->itl, r->n_itl, sizeof *r->itl, cmp_double);
    r->ttft_p50 = percentile(r->ttft, r->n_ttft, 50);
    r->ttft_p99 = percentile(r->ttft, r->n_ttft, 99);
    r->itl_p50 = percentile(r->itl, r->n_itl, 50);
    r->itl_p99 = percentile(r->itl, r->n_itl, 99);
    return MOE_OK;
}

void moe_bench_server_result_free(moe_bench_server_result *r) {
    free(r->ttft);
    free(r->itl);
    r->ttft = r->itl = NULL;
    r->n_ttft = r->n_itl = 0;
}
