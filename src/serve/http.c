/* http.c: the transport -- libmicrohttpd's daemon and connections, request bodies, sending
 * replies and server-sent-event streams, the access log, and moe_serve_run(). Which handler a
 * request reaches is router.c's business; what a handler does with it, the adapters'.
 *
 * libmicrohttpd runs one thread per connection, so a handler may block: a non-streaming
 * request waits for its generation right in the access handler, and a stream's content reader
 * waits for the next tokens. Every such wait is a short timed wait in a loop that also polls the
 * client's socket for a hang-up (POLLRDHUP), so a client that goes away cancels its request at
 * the engine's next step, whether it was waiting in the queue or streaming. The trap: nothing
 * here may touch the model or the context; the tokenizer is immutable and safe to share. */
#include "serve_internal.h"

#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "../model/model.h"

/* ==== Parameters ==== */

void moe_serve_params_default(moe_serve_params *p) {
    memset(p, 0, sizeof *p);
    p->host = "127.0.0.1";
    p->port = 8080;
    p->parallel = 4;
    p->cache_slots = -1; /* = parallel */
    p->n_threads = 1;
    p->kv_type = MOE_TYPE_F16;
    p->queue_limit = 64;
    p->queue_timeout_s = 600;
    p->keepalive_s = 15;
    p->reasoning_budget = -1;
}

/* ==== Per-connection state ==== */

typedef struct conn_state {
    moe_strbuf body;
    bool too_large;
    double t_start;
} conn_state;

/* ==== Replies ==== */

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

/* CORS preflight: any origin may call the API from a browser. */
static void reply_preflight(serve_http *h) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    add_common_headers(r);
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", "*");
    MHD_add_response_header(r, "Access-Control-Max-Age", "86400");
    MHD_queue_response(h->conn, 204, r);
    MHD_destroy_response(r);
    h->replied = true;
    h->status = 204;
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

static void access_log(serve_server *srv, const char *method, const char *path, int status,
                       double t_start, uint32_t prompt, uint32_t cached, uint32_t completion) {
    (void)srv;
    fprintf(stderr,
            "moe serve: access method=%s path=%s status=%d ms=%.1f prompt_tokens=%u "
            "cached_tokens=%u completion_tokens=%u\n",
            method, path, status, (serve_now() - t_start) * 1e3, prompt, cached, completion);
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
    serve_metrics_count(s->h_copy.srv, s->log_path, s->h_copy.status);
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

/* ==== Connections ==== */

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
        serve_reply_error(&h, serve_route_api(&h), 413, NULL, NULL,
                          "the request body is larger than %u bytes", SERVE_MAX_BODY_BYTES);
        *upload_size = 0;
    } else if (strcmp(method, "OPTIONS") == 0) {
        reply_preflight(&h);
    } else {
        serve_route(&h);
    }
    if (!h.replied && h.status != 499)
        serve_reply_error(&h, serve_route_api(&h), 500, NULL, NULL,
                          "internal error: no reply was made");
    if (h.status != -1) {
        access_log(srv, method, url, h.status, cs->t_start, h.log_prompt, h.log_cached,
                   h.log_completion);
        serve_metrics_count(srv, url, h.status);
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
    MOE_CHECK(params->model_path); /* the caller resolves a missing model (cli/'s demo) */
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
