/* http.c: libmicrohttpd glue -- listening, routing, auth, CORS, request bodies, replies, SSE
 * streams, the operational endpoints (/health, /metrics, /tokenize, /detokenize), the access
 * log, and moe_serve_run().
 *
 * libmicrohttpd runs one thread per connection, so a handler may block: a non-streaming
 * request waits for its generation right in the access handler, and a stream's content reader
 * waits for the next tokens. Every such wait is a short timed wait in a loop that also polls the
 * client's socket for a hang-up (POLLRDHUP), so a client that goes away cancels its request at
 * the engine's next step, whether it was waiting in the queue or streaming. The trap: nothing
 * here may touch the model or the context; the tokenizer is immutable and safe to share. */
#include "serve_internal.h"

#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "../model/model.h"

/* ==== Parameters ==== */

void moe_serve_params_default(moe_serve_params *p) {
    memset(p, 0, sizeof *p);
    p->host = "127.0.0.1";
    p->port = 8080;
    p->parallel = 4;
    p->cache_slots = -1; /* = parallel */
    p->n_threads = 1;
    p->kv_type = MOE_KV_F16;
    p->queue_limit = 64;
    p->queue_timeout_s = 600;
    p->keepalive_s = 15;
}

/* ==== Per-connection state ==== */

typedef struct conn_state {
    moe_strbuf body;
    bool too_large;
    double t_start;
} conn_state;

/* ==== Replies ==== */

static const char *reason_api_type(serve_api api, int status) {
    if (api == SERVE_API_ANTHROPIC) {
        switch (status) {
        case 401:
            return "authentication_error";
        case 403:
            return "permission_error";
        case 404:
            return "not_found_error";
        case 413:
            return "request_too_large";
        case 429:
            return "rate_limit_error";
        case 503:
        case 529:
            return "overloaded_error";
        default:
            return status >= 500 ? "api_error" : "invalid_request_error";
        }
    }
    switch (status) {
    case 429:
        return "rate_limit_exceeded";
    case 503:
        return "overloaded_error";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static void add_common_headers(struct MHD_Response *r) {
    MHD_add_response_header(r, "Access-Control-Allow-Origin", "*");
}

void serve_reply_text(serve_http *h, int status, const char *content_type, const char *text,
                      size_t len) {
    if (h->replied) return;
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)text, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", content_type);
    add_common_headers(r);
    if (h->retry_after > 0) {
        char v[32];
        snprintf(v, sizeof v, "%d", h->retry_after);
        MHD_add_response_header(r, "Retry-After", v);
    }
    MHD_queue_response(h->conn, (unsigned)status, r);
    MHD_destroy_response(r);
    h->replied = true;
    h->status = status;
}

void serve_reply_json(serve_http *h, int status, const moe_json *j) {
    serve_reply_text(h, status, "application/json", j->buf, j->len);
}

void serve_reply_error(serve_http *h, serve_api api, int status, const char *param,
                       const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_json j;
    moe_json_init(&j, false);
    moe_json_object_begin(&j);
    if (api == SERVE_API_ANTHROPIC) {
        moe_json_kv_string(&j, "type", "error");
        moe_json_key(&j, "error");
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "type", reason_api_type(api, status));
        moe_json_kv_string(&j, "message", msg);
        moe_json_object_end(&j);
    } else {
        moe_json_key(&j, "error");
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "message", msg);
        moe_json_kv_string(&j, "type", reason_api_type(api, status));
        moe_json_key(&j, "param");
        if (param)
            moe_json_string(&j, param);
        else
            moe_json_null(&j);
        moe_json_key(&j, "code");
        if (code)
            moe_json_string(&j, code);
        else
            moe_json_null(&j);
        moe_json_object_end(&j);
    }
    moe_json_object_end(&j);
    serve_reply_json(h, status, &j);
    moe_json_free(&j);
}

const char *serve_header(serve_http *h, const char *name) {
    return MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, name);
}

bool serve_client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd pfd = {.fd = fd, .events = POLLRDHUP};
    if (poll(&pfd, 1, 0) <= 0) return false;
    return (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void serve_make_id(serve_server *srv, const char *prefix, char *out, size_t size) {
    const unsigned long n = atomic_fetch_add(&srv->next_id, 1);
    snprintf(out, size, "%s%08lx%08lx", prefix, (unsigned long)time(NULL) & 0xffffffffUL, n);
}

static void access_log(serve_server *srv, const char *method, const char *path, int status,
                       double t_start, uint32_t prompt, uint32_t cached, uint32_t completion) {
    (void)srv;
    fprintf(stderr,
            "moe serve: access method=%s path=%s status=%d ms=%.1f prompt_tokens=%u "
            "cached_tokens=%u completion_tokens=%u\n",
            method, path, status, (serve_now() - t_start) * 1e3, prompt, cached, completion);
}

static int endpoint_index(const char *path) {
    if (strcmp(path, "/v1/chat/completions") == 0) return 0;
    if (strcmp(path, "/v1/completions") == 0) return 1;
    if (strcmp(path, "/v1/messages") == 0) return 2;
    if (strcmp(path, "/v1/responses") == 0) return 3;
    if (strncmp(path, "/v1/", 4) == 0) return 4;
    return 5;
}

static const char *const endpoint_names[6] = {"chat_completions", "completions", "messages",
                                              "responses",        "other_v1",    "other"};

static void count_request(serve_server *srv, const char *path, int status) {
    int cls = status / 100 - 1;
    if (cls < 0 || cls > 4) cls = 4;
    pthread_mutex_lock(&srv->metrics.mu);
    srv->metrics.requests[endpoint_index(path)][cls]++;
    pthread_mutex_unlock(&srv->metrics.mu);
}

/* ==== SSE ==== */

void serve_sse_event(serve_sse *s, const char *event) {
    if (event) {
        moe_strbuf_puts(&s->out, "event: ");
        moe_strbuf_puts(&s->out, event);
        moe_strbuf_puts(&s->out, "\n");
    }
    moe_strbuf_puts(&s->out, "data: ");
    moe_strbuf_put(&s->out, s->j.buf, s->j.len);
    moe_strbuf_puts(&s->out, "\n\n");
    moe_json_reset(&s->j);
}

void serve_replay(const char *text, size_t chunk, serve_sse_pump pump,
                  void (*feed)(void *state, const serve_taken *t),
                  void (*whole)(moe_json *j, void *state, const serve_req *r), void *state,
                  moe_strbuf *out) {
    serve_req *r = serve_req_new();
    r->finish = SERVE_FINISH_EOG;
    r->admitted = r->done = true;
    serve_taken t = {.admitted = true, .done = true};
    const size_t n = strlen(text);
    if (!chunk) chunk = n ? n : 1;
    for (size_t off = 0; off < n; off += chunk) {
        if (t.n_events == t.cap_events) {
            t.cap_events = t.cap_events ? 2 * t.cap_events : 16;
            t.events = moe_xrealloc(t.events, t.cap_events * sizeof *t.events);
        }
        const size_t len = n - off < chunk ? n - off : chunk;
        t.events[t.n_events++] =
            (serve_event){.kind = SERVE_EV_TEXT, .text_off = t.text.len, .text_len = len};
        moe_strbuf_put(&t.text, text + off, len);
    }
    moe_json j;
    moe_json_init(&j, false);
    if (pump) {
        serve_sse sse = {.req = r, .state = state, .pump = pump, .j = j};
        pump(&sse, &t);
        moe_strbuf_put(out, sse.out.s ? sse.out.s : "", sse.out.len);
        moe_strbuf_free(&sse.out);
        j = sse.j;
    } else {
        feed(state, &t);
        whole(&j, state, r);
        moe_strbuf_put(out, j.buf, j.len);
    }
    moe_strbuf_put(out, "", 0);
    moe_json_free(&j);
    serve_taken_free(&t);
    serve_req_release(r);
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    serve_sse *s = cls;
    for (;;) {
        if (s->out_off < s->out.len) {
            size_t n = s->out.len - s->out_off;
            if (n > max) n = max;
            memcpy(buf, s->out.s + s->out_off, n);
            s->out_off += n;
            if (s->out_off == s->out.len) s->out.len = s->out_off = 0;
            s->last_write = serve_now();
            return (ssize_t)n;
        }
        if (s->ended) return MHD_CONTENT_READER_END_OF_STREAM;
        if (s->first_pending) {
            s->first_pending = false;
            s->pump(s, &s->taken);
            if (s->taken.done) s->ended = true;
            continue;
        }
        if (serve_client_gone(s->h_copy.fd)) {
            serve_req_cancel(s->req);
            s->h_copy.status = 499; /* client closed the request */
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        /* wait for events, but not past the next keep-alive */
        const double due = s->last_write + s->h_copy.srv->p.keepalive_s - serve_now();
        double wait = SERVE_POLL_MS / 1000.0;
        if (due < wait) wait = due > 0.001 ? due : 0.001;
        if (serve_req_take(s->req, &s->taken, wait)) {
            s->pump(s, &s->taken);
            if (s->taken.done) s->ended = true;
        } else if (serve_now() - s->last_write >= s->h_copy.srv->p.keepalive_s) {
            moe_strbuf_puts(&s->out, s->keepalive);
        }
    }
}

static void sse_free(void *cls) {
    serve_sse *s = cls;
    if (!s->ended) {
        serve_req_cancel(s->req);
        if (s->h_copy.status == 200) s->h_copy.status = 499;
    }
    uint32_t prompt, cached, completion;
    pthread_mutex_lock(&s->req->mu);
    prompt = s->req->gen.n_prompt;
    cached = s->req->n_cached;
    completion = s->req->n_generated;
    pthread_mutex_unlock(&s->req->mu);
    access_log(s->h_copy.srv, "POST", s->log_path, s->h_copy.status, s->t_start, prompt, cached,
               completion);
    count_request(s->h_copy.srv, s->log_path, s->h_copy.status);
    serve_req_release(s->req);
    serve_taken_free(&s->taken);
    moe_strbuf_free(&s->out);
    moe_json_free(&s->j);
    if (s->state_free) s->state_free(s->state);
    free(s);
}

void serve_reply_sse(serve_http *h, serve_req *req, serve_taken *first, serve_sse_pump pump,
                     void *state, void (*state_free)(void *), const char *keepalive) {
    serve_sse *s = moe_xcalloc(1, sizeof *s);
    s->taken = *first;
    memset(first, 0, sizeof *first);
    s->first_pending = true;
    s->h_copy = *h;
    s->h_copy.status = 200;
    s->req = req;
    s->pump = pump;
    s->state = state;
    s->state_free = state_free;
    s->keepalive = keepalive;
    s->last_write = serve_now();
    s->t_start = serve_now();
    snprintf(s->log_path, sizeof s->log_path, "%s", h->path);
    moe_json_init(&s->j, false);
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, s, sse_free);
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    add_common_headers(r);
    MHD_queue_response(h->conn, 200, r);
    MHD_destroy_response(r);
    h->replied = true;
    h->status = -1; /* logged by the stream when it ends */
}

/* ==== Shared request plumbing ==== */

/* Nesting depth of a JSON text, counting brackets outside strings (before jansson recurses). */
size_t serve_json_depth(const char *s, size_t n) {
    size_t depth = 0, max = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"')
            in_str = true;
        else if (c == '[' || c == '{') {
            if (++depth > max) max = depth;
        } else if ((c == ']' || c == '}') && depth)
            depth--;
    }
    return max;
}

json_t *serve_parse_body(serve_http *h, serve_api api) {
    if (serve_json_depth(h->body, h->body_len) > SERVE_MAX_JSON_DEPTH) {
        serve_reply_error(h, api, 400, NULL, NULL, "the JSON body nests deeper than %d levels",
                          SERVE_MAX_JSON_DEPTH);
        return NULL;
    }
    json_error_t e;
    json_t *v = json_loadb(h->body ? h->body : "", h->body_len, 0, &e);
    if (!v) {
        serve_reply_error(h, api, 400, NULL, NULL,
                          "could not parse the JSON body of the request: %s (line %d, column %d)",
                          e.text, e.line, e.column);
        return NULL;
    }
    if (!json_is_object(v)) {
        serve_reply_error(h, api, 400, NULL, NULL, "the JSON body must be an object");
        json_decref(v);
        return NULL;
    }
    return v;
}

static bool number_field(serve_http *h, serve_api api, json_t *body, const char *key, double lo,
                         double hi, double *out) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_number(v)) {
        serve_reply_error(h, api, 400, key, NULL, "%s: expected a number", key);
        return false;
    }
    const double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) {
        serve_reply_error(h, api, 400, key, NULL, "%s: %g is outside %g..%g", key, d, lo, hi);
        return false;
    }
    *out = d;
    return true;
}

bool serve_parse_sampling(serve_http *h, serve_api api, json_t *body, serve_gen *g,
                          const char *stop_field) {
    moe_sampler_params *sp = &g->sampling;
    double temperature = 1.0, top_p = 1.0, top_k = 0, min_p = 0, presence = 0, frequency = 0,
           repetition = 1.0;
    double seed = -1;
    if (!number_field(h, api, body, "temperature", 0, 2, &temperature) ||
        !number_field(h, api, body, "top_p", 0, 1, &top_p) ||
        !number_field(h, api, body, "top_k", 0, 1 << 30, &top_k) ||
        !number_field(h, api, body, "min_p", 0, 1, &min_p) ||
        !number_field(h, api, body, "presence_penalty", -2, 2, &presence) ||
        !number_field(h, api, body, "frequency_penalty", -2, 2, &frequency) ||
        !number_field(h, api, body, "repetition_penalty", 0.01, 100, &repetition) ||
        !number_field(h, api, body, "seed", -9.2e18, 9.2e18, &seed))
        return false;
    *sp = (moe_sampler_params){.temperature = (float)temperature,
                               .top_k = (int32_t)top_k,
                               .top_p = (float)top_p,
                               .min_p = (float)min_p,
                               .repeat_penalty = (float)repetition,
                               .presence_penalty = (float)presence,
                               .frequency_penalty = (float)frequency,
                               .penalty_last_n = 64,
                               .seed = seed >= 0 ? (uint64_t)seed
                                                 : (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)g};
    json_t *bias = json_object_get(body, "logit_bias");
    if (bias && !json_is_null(bias)) {
        if (!json_is_object(bias)) {
            serve_reply_error(h, api, 400, "logit_bias", NULL,
                              "logit_bias: expected an object of token id -> bias");
            return false;
        }
        const size_t n = json_object_size(bias);
        if (n > SERVE_MAX_BIAS) {
            serve_reply_error(h, api, 400, "logit_bias", NULL,
                              "logit_bias: %zu entries (at most %d)", n, SERVE_MAX_BIAS);
            return false;
        }
        g->bias_tokens = moe_xcalloc(n ? n : 1, sizeof(int32_t));
        g->bias_values = moe_xcalloc(n ? n : 1, sizeof(float));
        const uint32_t n_vocab = moe_tokenizer_n_vocab(serve_sched_tokenizer(h->srv->sched));
        const char *key;
        json_t *val;
        json_object_foreach(bias, key, val) {
            char *end;
            const long id = strtol(key, &end, 10);
            if (!*key || *end || id < 0 || id >= (long)n_vocab || !json_is_number(val) ||
                json_number_value(val) < -100 || json_number_value(val) > 100) {
                serve_reply_error(h, api, 400, "logit_bias", NULL,
                                  "logit_bias: '%s' must be a token id below %u mapped to a "
                                  "number in -100..100",
                                  key, n_vocab);
                return false;
            }
            const double b = json_number_value(val);
            g->bias_tokens[g->sampling.n_bias] = (int32_t)id;
            g->bias_values[g->sampling.n_bias++] = b <= -100 ? -INFINITY : (float)b;
        }
    }
    json_t *stop = stop_field ? json_object_get(body, stop_field) : NULL;
    if (stop && !json_is_null(stop)) {
        json_t *one = json_is_string(stop) ? stop : NULL;
        if (!one && !json_is_array(stop)) {
            serve_reply_error(h, api, 400, stop_field, NULL,
                              "%s: expected a string or an array of strings", stop_field);
            return false;
        }
        const size_t n = one ? 1 : json_array_size(stop);
        if (n > SERVE_MAX_STOP) {
            serve_reply_error(h, api, 400, stop_field, NULL, "%s: %zu strings (at most %d)",
                              stop_field, n, SERVE_MAX_STOP);
            return false;
        }
        for (size_t i = 0; i < n; i++) {
            json_t *v = one ? one : json_array_get(stop, i);
            if (!json_is_string(v) || json_string_length(v) == 0 ||
                json_string_length(v) > SERVE_MAX_STOP_BYTES) {
                serve_reply_error(h, api, 400, stop_field, NULL,
                                  "%s[%zu]: expected a non-empty string of at most %d bytes",
                                  stop_field, i, SERVE_MAX_STOP_BYTES);
                return false;
            }
            g->stop[g->n_stop++] = moe_xstrndup(json_string_value(v), json_string_length(v));
        }
    }
    return true;
}

bool serve_set_prompt(serve_http *h, serve_api api, int32_t *ids, size_t n, serve_gen *g) {
    const uint32_t n_ctx = serve_sched_n_ctx(h->srv->sched);
    if (n == 0) {
        free(ids);
        serve_reply_error(h, api, 400, NULL, NULL, "the prompt is empty");
        return false;
    }
    if (n >= n_ctx) {
        free(ids);
        serve_reply_error(h, api, 400, "messages", "context_length_exceeded",
                          "the prompt is too long: %zu tokens of %u (this model's maximum context "
                          "length is %u tokens, and at least one must be left to generate)",
                          n, n_ctx, n_ctx);
        return false;
    }
    g->prompt = ids;
    g->n_prompt = (uint32_t)n;
    h->log_prompt = (uint32_t)n;
    return true;
}

bool serve_tokenize_prompt(serve_http *h, serve_api api, const char *text, size_t len,
                           serve_gen *g) {
    const moe_tokenizer *tok = serve_sched_tokenizer(h->srv->sched);
    moe_error err = {0};
    size_t n = 0;
    int32_t *ids = NULL;
    if (moe_tokenizer_encode(tok, text, len, MOE_ENCODE_ADD_SPECIAL | MOE_ENCODE_PARSE_SPECIAL,
                             &ids, &n, &err) != MOE_OK) {
        serve_reply_error(h, api, 400, NULL, NULL, "cannot tokenize the prompt: %s", err.msg);
        return false;
    }
    return serve_set_prompt(h, api, ids, n, g);
}

bool serve_submit_and_wait(serve_http *h, serve_api api, serve_req *req, serve_taken *t) {
    switch (serve_sched_submit(h->srv->sched, req)) {
    case SERVE_SUBMIT_OK:
        break;
    case SERVE_SUBMIT_QUEUE_FULL:
        pthread_mutex_lock(&h->srv->metrics.mu);
        h->srv->metrics.rejected_queue_full++;
        pthread_mutex_unlock(&h->srv->metrics.mu);
        h->retry_after = 1;
        serve_reply_error(h, api, 429, NULL, "rate_limit_exceeded",
                          "too many requests waiting (%d): try again shortly",
                          h->srv->p.queue_limit);
        return false;
    case SERVE_SUBMIT_NOT_READY:
        serve_reply_error(h, api, 503, NULL, NULL, "the server is not ready (loading or stopping)");
        return false;
    }
    const double deadline = serve_now() + h->srv->p.queue_timeout_s;
    while (!t->admitted && !t->done) {
        if (serve_req_take(req, t, SERVE_POLL_MS / 1000.0) && (t->admitted || t->done)) break;
        if (serve_client_gone(h->fd)) {
            serve_req_cancel(req);
            h->status = 499;
            return false;
        }
        if (serve_now() > deadline) {
            serve_req_cancel(req);
            pthread_mutex_lock(&h->srv->metrics.mu);
            h->srv->metrics.rejected_timeout++;
            pthread_mutex_unlock(&h->srv->metrics.mu);
            h->retry_after = 1;
            serve_reply_error(h, api, 503, NULL, NULL,
                              "no stream became free within %.0f s: the server is overloaded",
                              h->srv->p.queue_timeout_s);
            return false;
        }
    }
    if (!t->admitted) {
        serve_reply_error(h, api, 503, NULL, NULL, "the request was cancelled (server stopping)");
        return false;
    }
    pthread_mutex_lock(&req->mu);
    h->log_cached = req->n_cached;
    pthread_mutex_unlock(&req->mu);
    return true;
}

bool serve_wait_done(serve_http *h, serve_req *req, serve_taken *t,
                     void (*on_events)(void *ud, const serve_taken *t), void *ud) {
    on_events(ud, t);
    while (!t->done) {
        if (serve_req_take(req, t, SERVE_POLL_MS / 1000.0)) {
            on_events(ud, t);
            continue;
        }
        if (serve_client_gone(h->fd)) {
            serve_req_cancel(req);
            h->status = 499;
            return false;
        }
    }
    pthread_mutex_lock(&req->mu);
    h->log_completion = req->n_generated;
    pthread_mutex_unlock(&req->mu);
    return true;
}

void serve_json_value(moe_json *j, json_t *v) {
    /* a client's value echoed back must not nest past our writer's limit (which would end the
     * process): deeper levels are written as null */
    if ((json_is_object(v) || json_is_array(v)) && j->depth + 1 >= MOE_JSON_MAX_DEPTH) {
        moe_json_null(j);
        return;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        moe_json_object_begin(j);
        const char *key;
        json_t *val;
        json_object_foreach(v, key, val) {
            moe_json_key(j, key);
            serve_json_value(j, val);
        }
        moe_json_object_end(j);
        break;
    }
    case JSON_ARRAY: {
        moe_json_array_begin(j);
        size_t i;
        json_t *val;
        json_array_foreach(v, i, val) serve_json_value(j, val);
        moe_json_array_end(j);
        break;
    }
    case JSON_STRING:
        moe_json_string_n(j, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        moe_json_int(j, json_integer_value(v));
        break;
    case JSON_REAL:
        moe_json_double(j, json_real_value(v));
        break;
    case JSON_TRUE:
        moe_json_bool(j, true);
        break;
    case JSON_FALSE:
        moe_json_bool(j, false);
        break;
    case JSON_NULL:
        moe_json_null(j);
        break;
    }
}

void serve_json_token_piece(moe_json *j, const moe_tokenizer *tok, int32_t id) {
    size_t len;
    const char *p = moe_tokenizer_token_piece(tok, id, true, &len);
    moe_json_string_n(j, p, len);
}

void serve_json_token_bytes(moe_json *j, const moe_tokenizer *tok, int32_t id) {
    size_t len;
    const unsigned char *p = (const unsigned char *)moe_tokenizer_token_piece(tok, id, true, &len);
    moe_json_array_begin(j);
    for (size_t i = 0; i < len; i++) moe_json_int(j, p[i]);
    moe_json_array_end(j);
}

/* ==== Operational endpoints ==== */

static void health(serve_http *h) {
    const bool ready = serve_sched_ready(h->srv->sched);
    const char *body = ready ? "{\"status\":\"ok\"}" : "{\"status\":\"loading\"}";
    serve_reply_text(h, ready ? 200 : 503, "application/json", body, strlen(body));
}

const double serve_ttft_bounds[SERVE_TTFT_BUCKETS] = {0.01, 0.025, 0.05, 0.1, 0.25,
                                                      0.5,  1,     2.5,  5,   10};

void serve_metrics_write(serve_metrics *m, moe_strbuf *o) {
    pthread_mutex_lock(&m->mu);
    moe_strbuf_puts(o, "# HELP moe_requests_total HTTP requests by endpoint and status class.\n"
                      "# TYPE moe_requests_total counter\n");
    for (int e = 0; e < 6; e++)
        for (int c = 0; c < 5; c++)
            if (m->requests[e][c])
                moe_strbuf_printf(o, "moe_requests_total{endpoint=\"%s\",status=\"%dxx\"} %llu\n",
                                 endpoint_names[e], c + 1, (unsigned long long)m->requests[e][c]);
#define GAUGE(name, help, fmt, v)                                                                  \
    moe_strbuf_printf(o, "# HELP " name " " help "\n# TYPE " name " gauge\n" name " " fmt "\n", v)
#define COUNTER(name, help, fmt, v)                                                                \
    moe_strbuf_printf(o, "# HELP " name " " help "\n# TYPE " name " counter\n" name " " fmt "\n", v)
    GAUGE("moe_queue_depth", "Requests waiting for a stream.", "%u", m->waiting);
    GAUGE("moe_streams_active", "Streams being generated.", "%u", m->active);
    GAUGE("moe_sequences_resident", "Finished sequences kept for prefix reuse.", "%u", m->resident);
    COUNTER("moe_prompt_tokens_total", "Prompt tokens run through the model (after reuse).", "%llu",
            (unsigned long long)m->prompt_tokens);
    COUNTER("moe_generated_tokens_total", "Tokens generated.", "%llu",
            (unsigned long long)m->generated_tokens);
    COUNTER("moe_prefix_cache_hits_total", "Requests that reused a resident prefix.", "%llu",
            (unsigned long long)m->prefix_hits);
    COUNTER("moe_prefix_cache_tokens_total", "Prompt tokens reused instead of recomputed.", "%llu",
            (unsigned long long)m->cached_tokens);
    COUNTER("moe_requests_cancelled_total", "Requests cancelled (client gone, timeout).", "%llu",
            (unsigned long long)m->cancelled);
    COUNTER("moe_requests_rejected_queue_full_total", "429 replies: the queue was full.", "%llu",
            (unsigned long long)m->rejected_queue_full);
    COUNTER("moe_requests_rejected_timeout_total", "503 replies: waited past the timeout.", "%llu",
            (unsigned long long)m->rejected_timeout);
    COUNTER("moe_prefill_seconds_total", "Forward time spent on prompt rows.", "%.6f",
            m->prefill_seconds);
    COUNTER("moe_decode_seconds_total", "Forward time spent on decode rows.", "%.6f",
            m->decode_seconds);
    GAUGE("moe_prefill_tokens_per_second", "Prompt throughput of the last step with prompt rows.",
          "%.3f", m->prefill_tps);
    GAUGE("moe_decode_tokens_per_second", "Decode throughput (all streams) of the last step.",
          "%.3f", m->decode_tps);
    GAUGE("moe_decode_batch_rows_max", "Most streams decoded together in one forward step.", "%u",
          m->decode_batch_max);
#undef GAUGE
#undef COUNTER
    moe_strbuf_puts(o, "# HELP moe_time_to_first_token_seconds From submit to the first token.\n"
                      "# TYPE moe_time_to_first_token_seconds histogram\n");
    uint64_t cum = 0;
    for (int b = 0; b < SERVE_TTFT_BUCKETS; b++) {
        cum += m->ttft_buckets[b];
        moe_strbuf_printf(o, "moe_time_to_first_token_seconds_bucket{le=\"%g\"} %llu\n",
                         serve_ttft_bounds[b], (unsigned long long)cum);
    }
    moe_strbuf_printf(o, "moe_time_to_first_token_seconds_bucket{le=\"+Inf\"} %llu\n",
                     (unsigned long long)m->ttft_count);
    moe_strbuf_printf(o, "moe_time_to_first_token_seconds_sum %.6f\n", m->ttft_sum);
    moe_strbuf_printf(o, "moe_time_to_first_token_seconds_count %llu\n",
                     (unsigned long long)m->ttft_count);
    pthread_mutex_unlock(&m->mu);
}

static void metrics(serve_http *h) {
    moe_strbuf o = {0};
    serve_metrics_write(&h->srv->metrics, &o);
    serve_reply_text(h, 200, "text/plain; version=0.0.4", o.s, o.len);
    moe_strbuf_free(&o);
}

static void tokenize(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    json_t *content = json_object_get(body, "content");
    if (!json_is_string(content)) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "content", NULL, "content: expected a string");
        json_decref(body);
        return;
    }
    const bool special = json_is_true(json_object_get(body, "add_special"));
    int32_t *ids = NULL;
    size_t n = 0;
    moe_error err = {0};
    if (moe_tokenizer_encode(serve_sched_tokenizer(h->srv->sched), json_string_value(content),
                             json_string_length(content),
                             MOE_ENCODE_PARSE_SPECIAL | (special ? MOE_ENCODE_ADD_SPECIAL : 0),
                             &ids, &n, &err) != MOE_OK) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "content", NULL, "%s", err.msg);
    } else {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_key(&j, "tokens");
        moe_json_array_begin(&j);
        for (size_t i = 0; i < n; i++) moe_json_int(&j, ids[i]);
        moe_json_array_end(&j);
        moe_json_object_end(&j);
        serve_reply_json(h, 200, &j);
        moe_json_free(&j);
    }
    free(ids);
    json_decref(body);
}

static void detokenize(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    json_t *tokens = json_object_get(body, "tokens");
    const moe_tokenizer *tok = serve_sched_tokenizer(h->srv->sched);
    const size_t n = json_array_size(tokens);
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (n ? n : 1));
    bool ok = json_is_array(tokens);
    for (size_t i = 0; ok && i < n; i++) {
        json_t *v = json_array_get(tokens, i);
        ok = json_is_integer(v) && json_integer_value(v) >= 0 &&
             json_integer_value(v) < (json_int_t)moe_tokenizer_n_vocab(tok);
        if (ok) ids[i] = (int32_t)json_integer_value(v);
    }
    if (!ok) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "tokens", NULL,
                          "tokens: expected an array of token ids below %u",
                          moe_tokenizer_n_vocab(tok));
    } else {
        char *text = NULL;
        size_t len = 0;
        moe_error err = {0};
        moe_tokenizer_decode(tok, ids, n, MOE_DECODE_SKIP_SPECIAL, &text, &len, &err);
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_key(&j, "content");
        moe_json_string_n(&j, text ? text : "", len);
        moe_json_object_end(&j);
        serve_reply_json(h, 200, &j);
        moe_json_free(&j);
        free(text);
    }
    free(ids);
    json_decref(body);
}

static void models(serve_http *h) {
    if (serve_header(h, "anthropic-version"))
        serve_anthropic_models(h);
    else
        serve_openai_models(h);
}

/* ==== Routing ==== */

typedef struct route {
    const char *method, *path;
    void (*fn)(serve_http *h);
    bool needs_auth, needs_model;
} route;

static const route routes[] = {
    {"GET", "/health", health, false, false},
    {"GET", "/metrics", metrics, true, false},
    {"GET", "/v1/models", models, true, true},
    {"POST", "/v1/chat/completions", serve_openai_chat, true, true},
    {"POST", "/v1/completions", serve_openai_completions, true, true},
    {"POST", "/v1/responses", serve_openai_responses, true, true},
    {"POST", "/v1/messages", serve_anthropic_messages, true, true},
    {"POST", "/v1/messages/count_tokens", serve_anthropic_count_tokens, true, true},
    {"POST", "/apply-template", serve_openai_apply_template, true, true},
    {"POST", "/tokenize", tokenize, true, true},
    {"POST", "/detokenize", detokenize, true, true},
};

static serve_api api_of(serve_http *h) {
    return strncmp(h->path, "/v1/messages", 12) == 0 || serve_header(h, "anthropic-version")
               ? SERVE_API_ANTHROPIC
               : SERVE_API_OPENAI;
}

static bool authorized(serve_http *h) {
    const moe_serve_params *p = &h->srv->p;
    if (p->n_api_keys == 0) return true;
    const char *key = serve_header(h, "x-api-key");
    const char *auth = serve_header(h, "Authorization");
    if (!key && auth && strncasecmp(auth, "Bearer ", 7) == 0) key = auth + 7;
    if (!key) return false;
    for (int i = 0; i < p->n_api_keys; i++)
        if (strcmp(key, p->api_keys[i]) == 0) return true;
    return false;
}

static void dispatch(serve_http *h) {
    if (strcmp(h->method, "OPTIONS") == 0) {
        struct MHD_Response *r =
            MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
        add_common_headers(r);
        MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        MHD_add_response_header(r, "Access-Control-Allow-Headers", "*");
        MHD_add_response_header(r, "Access-Control-Max-Age", "86400");
        MHD_queue_response(h->conn, 204, r);
        MHD_destroy_response(r);
        h->replied = true;
        h->status = 204;
        return;
    }
    const serve_api api = api_of(h);
    const route *found = NULL;
    bool path_known = false;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(routes[i].path, h->path) != 0) continue;
        path_known = true;
        if (strcmp(routes[i].method, h->method) == 0) found = &routes[i];
    }
    if (!found) {
        if (path_known)
            serve_reply_error(h, api, 405, NULL, NULL, "%s is not allowed on %s", h->method,
                              h->path);
        else
            serve_reply_error(h, api, 404, NULL, "unknown_url", "no such endpoint: %s %s",
                              h->method, h->path);
        return;
    }
    if (found->needs_auth && !authorized(h)) {
        if (api == SERVE_API_ANTHROPIC)
            serve_reply_error(h, api, 401, NULL, NULL, "invalid x-api-key");
        else
            serve_reply_error(h, api, 401, NULL, "invalid_api_key",
                              "Incorrect API key provided. Send it as 'Authorization: Bearer KEY' "
                              "or 'x-api-key: KEY'.");
        return;
    }
    if (found->needs_model && !serve_sched_ready(h->srv->sched)) {
        h->retry_after = 5;
        serve_reply_error(h, api, 503, NULL, NULL, "the model is loading");
        return;
    }
    found->fn(h);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    serve_server *srv = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        cs = moe_xcalloc(1, sizeof *cs);
        cs->t_start = serve_now();
        *con_cls = cs;
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > SERVE_MAX_BODY_BYTES) cs->too_large = true;
        if (!cs->too_large) return MHD_YES;
    }
    if (*upload_size && !cs->too_large) {
        if (*upload_size > SERVE_MAX_BODY_BYTES - cs->body.len) {
            cs->too_large = true;
            moe_strbuf_free(&cs->body);
        } else {
            moe_strbuf_put(&cs->body, upload, *upload_size);
        }
        *upload_size = 0;
        return MHD_YES;
    }
    serve_http h = {.srv = srv,
                    .conn = conn,
                    .method = method,
                    .path = url,
                    .body = cs->body.s,
                    .body_len = cs->body.len,
                    .fd = -1,
                    .status = 0};
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) h.fd = ci->connect_fd;
    if (cs->too_large) {
        serve_reply_error(&h, api_of(&h), 413, NULL, NULL,
                          "the request body is larger than %u bytes", SERVE_MAX_BODY_BYTES);
        *upload_size = 0;
    } else {
        dispatch(&h);
    }
    if (!h.replied && h.status != 499)
        serve_reply_error(&h, api_of(&h), 500, NULL, NULL, "internal error: no reply was made");
    if (h.status != -1) {
        access_log(srv, method, url, h.status, cs->t_start, h.log_prompt, h.log_cached,
                   h.log_completion);
        count_request(srv, url, h.status);
    }
    if (!h.replied) return MHD_NO; /* the client is gone: close */
    return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)conn, (void)toe;
    conn_state *cs = *con_cls;
    if (!cs) return;
    moe_strbuf_free(&cs->body);
    free(cs);
    *con_cls = NULL;
}

/* ==== Running ==== */

static void model_id_from_path(serve_server *srv, const char *path) {
    if (srv->p.alias) {
        snprintf(srv->model_id, sizeof srv->model_id, "%s", srv->p.alias);
        return;
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(srv->model_id, sizeof srv->model_id, "%s", base);
    char *dot = strstr(srv->model_id, ".gguf");
    if (dot && dot[5] == '\0') *dot = '\0';
}

int moe_serve_run(const moe_serve_params *params) {
    serve_server *srv = moe_xcalloc(1, sizeof *srv);
    srv->p = *params;
    if (srv->p.cache_slots < 0) srv->p.cache_slots = srv->p.parallel;
    srv->t_start = serve_now();
    pthread_mutex_init(&srv->metrics.mu, NULL);
    atomic_init(&srv->next_id, 1);
    model_id_from_path(srv, srv->p.model_path);

    /* every thread started from here on inherits the mask: signals arrive only at sigwait */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *ai = NULL;
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", srv->p.port);
    if (getaddrinfo(srv->p.host, port_text, &hints, &ai) != 0 || !ai) {
        fprintf(stderr, "moe serve: cannot resolve host '%s'\n", srv->p.host);
        free(srv);
        return 1;
    }
    char terr[MOE_ERROR_MSG_MAX + 128];
    if (!serve_template_load(srv, terr, sizeof terr)) { /* before any request can render */
        fprintf(stderr, "moe serve: %s\n", terr);
        freeaddrinfo(ai);
        free(srv);
        return 1;
    }
    srv->sched = serve_sched_start(&srv->p, &srv->metrics);
    unsigned flags =
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)srv->p.port, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR,
        ai->ai_addr, MHD_OPTION_CONNECTION_LIMIT, (unsigned)SERVE_MAX_CONNECTIONS,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)SERVE_MAX_HEADER_BYTES,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)SERVE_CONN_TIMEOUT_S, MHD_OPTION_NOTIFY_COMPLETED,
        on_completed, srv, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!d) {
        fprintf(stderr, "moe serve: cannot listen on %s:%d (address in use?)\n", srv->p.host,
                srv->p.port);
        serve_sched_stop(srv->sched);
        serve_sched_free(srv->sched);
        moe_chat_template_free(srv->tmpl);
        free(srv);
        return 1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    const int port = di ? di->port : srv->p.port;
    printf("moe serve: listening on http://%s:%d\n", srv->p.host, port);
    fflush(stdout);
    char err[MOE_ERROR_MSG_MAX];
    int rc = 0;
    if (!serve_sched_wait_loaded(srv->sched, err, sizeof err)) {
        fprintf(stderr, "moe serve: %s\n", err);
        rc = 1;
    } else {
        const moe_model *m = serve_sched_model(srv->sched);
        fprintf(stderr,
                "moe serve: model %s (%s, %u layers), context %u per sequence, %d streams + %d "
                "resident sequences, chat template %s, %d threads, %s\n",
                srv->model_id, m->cfg.arch_name, m->cfg.n_layer, serve_sched_n_ctx(srv->sched),
                srv->p.parallel, srv->p.cache_slots, srv->tmpl_origin, srv->p.n_threads,
                srv->p.n_api_keys ? "API key required" : "no API key");
        printf("moe serve: ready\n");
        fflush(stdout);
        int sig = 0;
        sigwait(&sigs, &sig);
        fprintf(stderr, "moe serve: signal %d: stopping\n", sig);
    }
    serve_sched_stop(srv->sched); /* ends every stream: waiting HTTP threads return */
    MHD_stop_daemon(d);
    serve_sched_free(srv->sched);
    moe_chat_template_free(srv->tmpl);
    pthread_mutex_destroy(&srv->metrics.mu);
    free(srv);
    return rc;
}
