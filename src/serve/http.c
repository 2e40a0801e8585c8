/* http.c: the transport -- libmicrohttpd's daemon and connections, request bodies, parking the
 * requests that wait for the engine, replies and server-sent-event streams, CORS, the access log,
 * and moe_serve_run(). Which handler a request reaches is router.c's business; what a handler
 * does with it, the adapters'.
 *
 * libmicrohttpd runs a few epoll workers (--http-threads), each serving many connections, so no
 * handler may block: a request that waits for the engine is parked (serve_park) -- its
 * connection is suspended, and the request's wake hook resumes it whenever the engine reports.
 * A stream's content reader parks the same way when it has nothing to send. While suspended,
 * libmicrohttpd neither reads the socket nor notices a hang-up, so one watcher thread does: it
 * keeps every parked exchange's socket in its own epoll set (EPOLLRDHUP), cancels the request of
 * a client that went away (the engine drops it at its next step), wakes exchanges at their
 * deadlines (queue timeout, SSE keep-alive), and closes connections that take longer than
 * --read-timeout to send a whole request, trickling or not. Beyond --max-connections (in all, or
 * from one address) connections are still accepted into a small reserve, and for each newcomer
 * the connection that has waited longest without a request is closed; past the reserve
 * libmicrohttpd refuses at accept.
 *
 * The trap: locks nest net->mu, then a request's mu, then libmicrohttpd's own. The engine holds
 * the request's mu when it wakes an exchange, so nothing under a request's mu may take net->mu;
 * ex->suspended and ex->news are guarded by the request's mu. Nothing here may touch the model
 * or the context; the tokenizer is immutable and safe to share. */
#include "serve_internal.h"

#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../model/model.h"

/* ==== Parameters ==== */

void moe_serve_params_default(moe_serve_params *p) {
    memset(p, 0, sizeof *p);
    p->host = "127.0.0.1";
    p->port = 8080;
    p->parallel = 4;
    p->cache_slots = -1; /* = parallel */
    p->n_threads = moe_cpu_cores();
    p->kv_type = MOE_TYPE_F16;
    p->queue_limit = 64;
    p->queue_timeout_s = 600;
    p->keepalive_s = 15;
    p->http_threads = 4;
    p->max_connections = 1024;
    p->max_connections_per_ip = 256;
    p->read_timeout_s = 10;
    p->reasoning_budget = -1;
    p->n_draft = 3;
}

/* ==== Connections and exchanges ==== */

/* One TCP connection, from accept to close (libmicrohttpd's socket context). */
typedef struct conn_entry {
    int fd;
    struct sockaddr_storage addr;
    bool busy;            /* a whole request arrived and is being answered */
    bool closing;         /* shut down here (read timeout, or room for a newcomer) */
    double waiting_since; /* not busy: since when it waits for a request */
} conn_entry;

struct serve_net {
    serve_server *srv;
    pthread_mutex_t mu; /* guards everything below and the exchanges' watch fields */
    conn_entry **conns; /* [n_conns] open connections */
    size_t n_conns, cap_conns;
    serve_exchange **watched; /* [n_watched] exchanges whose socket the watcher watches */
    size_t n_watched, cap_watched;
    uint64_t next_watch_id;
    int epoll_fd, poke_fd; /* the watcher's epoll set; an eventfd that wakes it */
    double sleep_until;    /* the watcher sleeps until then (or a poke, or a hang-up) */
    bool stopping;
    pthread_t watcher;
};

/* One request on its connection (libmicrohttpd's per-request pointer). */
struct serve_exchange {
    struct MHD_Connection *conn;
    conn_entry *ce;
    moe_strbuf body;
    bool too_large;
    double t_start;
    /* watched (net->mu): from the first park to the end of the request */
    serve_req *req; /* a reference; its wake hook points here */
    uint64_t watch_id;
    double deadline; /* wake at this time (0: none) */
    bool streaming;
    atomic_bool hung_up;
    /* parked (req->mu) */
    bool suspended, news;
    /* the continuation (only the thread running the exchange touches these) */
    serve_resume_fn resume;
    void (*drop)(void *ud);
    void *ud;
};

/* Wake the watcher (a full eventfd means it is woken already). */
static void poke(serve_net *n) {
    const uint64_t one = 1;
    const ssize_t w = write(n->poke_fd, &one, sizeof one);
    (void)w;
}

/* Under net->mu: wake ex at `deadline` (0: never); pokes the watcher if it sleeps past it. */
static void set_deadline(serve_net *n, serve_exchange *ex, double deadline) {
    ex->deadline = deadline;
    if (deadline > 0 && deadline < n->sleep_until) poke(n);
}

static bool same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                      &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr)) == 0;
    return true; /* other families: one "address" */
}

/* Under net->mu: close ce's connection (libmicrohttpd notices at its next look). */
static void conn_shut(conn_entry *ce) {
    shutdown(ce->fd, SHUT_RDWR);
    ce->closing = true;
}

/* Under net->mu, for the newcomer nc: over the limits (in all, or from its address), close the
 * connection that has waited longest without a request -- one from its address when that is the
 * limit crossed. */
static void make_room(serve_net *n, const conn_entry *nc) {
    const moe_serve_params *p = &n->srv->p;
    size_t live = 0, live_here = 0;
    conn_entry *oldest = NULL, *oldest_here = NULL;
    for (size_t i = 0; i < n->n_conns; i++) {
        conn_entry *c = n->conns[i];
        if (c->closing) continue;
        const bool here = same_address(&c->addr, &nc->addr);
        live++;
        live_here += here;
        if (c == nc || c->busy) continue;
        if (!oldest || c->waiting_since < oldest->waiting_since) oldest = c;
        if (here && (!oldest_here || c->waiting_since < oldest_here->waiting_since))
            oldest_here = c;
    }
    conn_entry *victim = NULL;
    if (live_here > (size_t)p->max_connections_per_ip)
        victim = oldest_here;
    else if (live > (size_t)p->max_connections)
        victim = oldest;
    if (!victim) return;
    conn_shut(victim);
    pthread_mutex_lock(&n->srv->metrics.mu);
    n->srv->metrics.conn_evicted++;
    pthread_mutex_unlock(&n->srv->metrics.mu);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    serve_server *srv = cls;
    serve_net *n = srv->net;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_entry *ce = moe_xcalloc(1, sizeof *ce);
        const union MHD_ConnectionInfo *fd =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        const union MHD_ConnectionInfo *addr =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        ce->fd = fd ? fd->connect_fd : -1;
        if (addr && addr->client_addr)
            memcpy(&ce->addr, addr->client_addr,
                   addr->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                            : sizeof(struct sockaddr_in));
        ce->waiting_since = serve_now();
        pthread_mutex_lock(&n->mu);
        if (n->n_conns == n->cap_conns) {
            n->cap_conns = n->cap_conns ? 2 * n->cap_conns : 64;
            n->conns = moe_xrealloc(n->conns, n->cap_conns * sizeof *n->conns);
        }
        n->conns[n->n_conns++] = ce;
        make_room(n, ce);
        const size_t open = n->n_conns;
        pthread_mutex_unlock(&n->mu);
        pthread_mutex_lock(&srv->metrics.mu);
        srv->metrics.conn_accepted++;
        srv->metrics.conn_open = (uint32_t)open;
        pthread_mutex_unlock(&srv->metrics.mu);
        *socket_context = ce;
        return;
    }
    conn_entry *ce = *socket_context;
    if (!ce) return;
    pthread_mutex_lock(&n->mu);
    for (size_t i = 0; i < n->n_conns; i++)
        if (n->conns[i] == ce) {
            n->conns[i] = n->conns[--n->n_conns];
            break;
        }
    const size_t open = n->n_conns;
    pthread_mutex_unlock(&n->mu);
    pthread_mutex_lock(&srv->metrics.mu);
    srv->metrics.conn_open = (uint32_t)open;
    pthread_mutex_unlock(&srv->metrics.mu);
    free(ce);
    *socket_context = NULL;
}

/* ==== Parking ==== */

/* The request's wake hook, and the watcher's (under req->mu): news for the exchange. */
static void exchange_wake(void *ud) {
    serve_exchange *ex = ud;
    ex->news = true;
    if (ex->suspended) {
        ex->suspended = false;
        MHD_resume_connection(ex->conn);
    }
}

/* Start watching req for ex: a reference, the wake hook, the socket in the watcher's set. News
 * that came before the hook was set would be lost, so the start counts as news. */
static void watch(serve_net *n, serve_exchange *ex, serve_req *req) {
    pthread_mutex_lock(&req->mu);
    req->refs++;
    req->wake = exchange_wake;
    req->wake_ud = ex;
    ex->news = true;
    pthread_mutex_unlock(&req->mu);
    pthread_mutex_lock(&n->mu);
    ex->req = req;
    ex->watch_id = ++n->next_watch_id;
    if (n->n_watched == n->cap_watched) {
        n->cap_watched = n->cap_watched ? 2 * n->cap_watched : 64;
        n->watched = moe_xrealloc(n->watched, n->cap_watched * sizeof *n->watched);
    }
    n->watched[n->n_watched++] = ex;
    struct epoll_event ev = {.events = EPOLLRDHUP, .data.u64 = ex->watch_id};
    if (ex->ce && ex->ce->fd >= 0) epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, ex->ce->fd, &ev);
    pthread_mutex_unlock(&n->mu);
}

static void count_hangup(serve_server *srv, bool streaming) {
    pthread_mutex_lock(&srv->metrics.mu);
    srv->metrics.hangups[streaming]++;
    pthread_mutex_unlock(&srv->metrics.mu);
}

/* The request is over for ex: out of the watcher's set, hook cleared, reference dropped; a
 * request still running is cancelled (its client is gone). */
static void unwatch(serve_net *n, serve_exchange *ex) {
    serve_req *req = ex->req;
    pthread_mutex_lock(&n->mu);
    for (size_t i = 0; i < n->n_watched; i++)
        if (n->watched[i] == ex) {
            n->watched[i] = n->watched[--n->n_watched];
            break;
        }
    if (ex->ce && ex->ce->fd >= 0) epoll_ctl(n->epoll_fd, EPOLL_CTL_DEL, ex->ce->fd, NULL);
    ex->req = NULL;
    pthread_mutex_unlock(&n->mu);
    pthread_mutex_lock(&req->mu);
    req->wake = NULL;
    req->wake_ud = NULL;
    const bool running = !req->done;
    pthread_mutex_unlock(&req->mu);
    if (running) {
        if (!atomic_load(&ex->hung_up)) count_hangup(n->srv, ex->streaming);
        serve_req_cancel(req);
    }
    serve_req_release(req);
}

void serve_park(serve_http *h, serve_req *req, double deadline, serve_resume_fn fn,
                void (*drop)(void *ud), void *ud) {
    serve_exchange *ex = h->ex;
    if (!ex->req) watch(h->srv->net, ex, req);
    MOE_CHECK(ex->req == req);
    ex->resume = fn;
    ex->drop = drop;
    ex->ud = ud;
    pthread_mutex_lock(&h->srv->net->mu);
    set_deadline(h->srv->net, ex, deadline);
    pthread_mutex_unlock(&h->srv->net->mu);
    h->parked = true;
}

/* Run the exchange's continuation once. */
static void resume_once(serve_http *h) {
    serve_exchange *ex = h->ex;
    serve_resume_fn fn = ex->resume;
    void *ud = ex->ud;
    ex->resume = NULL;
    ex->drop = NULL;
    h->parked = false;
    h->hung_up = atomic_load(&ex->hung_up);
    fn(h, ud);
}

/* After a handler parked: suspend the connection (h->parked stays true), unless news came
 * meanwhile -- then run the continuation again at once, which may end the exchange (h->parked
 * false: replied, or the client is gone). A continuation never parks once the client hung up. */
static void settle(serve_http *h) {
    serve_exchange *ex = h->ex;
    while (h->parked) {
        pthread_mutex_lock(&ex->req->mu);
        if (!ex->news && !atomic_load(&ex->hung_up)) {
            ex->suspended = true;
            MHD_suspend_connection(h->conn);
            pthread_mutex_unlock(&ex->req->mu);
            return;
        }
        ex->news = false;
        pthread_mutex_unlock(&ex->req->mu);
        resume_once(h);
    }
}

/* ==== The watcher ==== */

/* Under net->mu: the watched exchange with this id, or NULL (it ended meanwhile). */
static serve_exchange *watched_by_id(serve_net *n, uint64_t id) {
    for (size_t i = 0; i < n->n_watched; i++)
        if (n->watched[i]->watch_id == id) return n->watched[i];
    return NULL;
}

static void wake_locked(serve_exchange *ex) {
    pthread_mutex_lock(&ex->req->mu);
    exchange_wake(ex);
    pthread_mutex_unlock(&ex->req->mu);
}

/* Under net->mu: the client of ex went away. */
static void hung_up(serve_net *n, serve_exchange *ex) {
    if (atomic_exchange(&ex->hung_up, true)) return;
    epoll_ctl(n->epoll_fd, EPOLL_CTL_DEL, ex->ce->fd, NULL);
    pthread_mutex_lock(&ex->req->mu);
    const bool running = !ex->req->done;
    pthread_mutex_unlock(&ex->req->mu);
    if (running) count_hangup(n->srv, ex->streaming);
    serve_req_cancel(ex->req);
    wake_locked(ex);
}

/* Under net->mu: wake exchanges whose deadline passed, close connections past the read
 * timeout; the milliseconds until the next deadline (at most SERVE_WATCH_MS). */
static int watch_times(serve_net *n) {
    const double now = serve_now();
    double next = now + SERVE_WATCH_MS / 1000.0;
    for (size_t i = 0; i < n->n_watched; i++) {
        serve_exchange *ex = n->watched[i];
        if (ex->deadline <= 0) continue;
        if (ex->deadline <= now) {
            ex->deadline = 0;
            wake_locked(ex);
        } else if (ex->deadline < next) {
            next = ex->deadline;
        }
    }
    uint64_t timed_out = 0;
    for (size_t i = 0; i < n->n_conns; i++) {
        conn_entry *c = n->conns[i];
        if (!c->busy && !c->closing && now - c->waiting_since > n->srv->p.read_timeout_s) {
            conn_shut(c);
            timed_out++;
        }
    }
    if (timed_out) {
        pthread_mutex_lock(&n->srv->metrics.mu);
        n->srv->metrics.conn_read_timeouts += timed_out;
        pthread_mutex_unlock(&n->srv->metrics.mu);
    }
    n->sleep_until = next;
    return (int)ceil((next - now) * 1000.0);
}

static void *watcher_main(void *arg) {
    serve_net *n = arg;
    struct epoll_event evs[64];
    for (;;) {
        pthread_mutex_lock(&n->mu);
        const int wait_ms = watch_times(n);
        pthread_mutex_unlock(&n->mu);
        const int k = epoll_wait(n->epoll_fd, evs, 64, wait_ms > 0 ? wait_ms : 1);
        pthread_mutex_lock(&n->mu);
        n->sleep_until = 0; /* awake: no pokes needed */
        for (int i = 0; i < k; i++) {
            if (evs[i].data.u64 == 0) {
                uint64_t pokes;
                const ssize_t r = read(n->poke_fd, &pokes, sizeof pokes);
                (void)r;
                continue;
            }
            serve_exchange *ex = watched_by_id(n, evs[i].data.u64);
            if (ex) hung_up(n, ex);
        }
        const bool stop = n->stopping;
        pthread_mutex_unlock(&n->mu);
        if (stop) return NULL;
    }
}

/* Up to `seconds` for every watched exchange to end: resumed ones answer (their request ended
 * cancelled) before the daemon closes their connections. */
static void wait_unwatched(serve_net *n, double seconds) {
    const double until = serve_now() + seconds;
    for (;;) {
        pthread_mutex_lock(&n->mu);
        const size_t left = n->n_watched;
        pthread_mutex_unlock(&n->mu);
        if (!left || serve_now() > until) return;
        const struct timespec d = {0, 10 * 1000000L};
        nanosleep(&d, NULL);
    }
}

static serve_net *net_start(serve_server *srv) {
    serve_net *n = moe_xcalloc(1, sizeof *n);
    n->srv = srv;
    pthread_mutex_init(&n->mu, NULL);
    n->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    n->poke_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (n->epoll_fd < 0 || n->poke_fd < 0) moe_die("cannot create the watcher's epoll set");
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 0};
    epoll_ctl(n->epoll_fd, EPOLL_CTL_ADD, n->poke_fd, &ev);
    if (pthread_create(&n->watcher, NULL, watcher_main, n) != 0)
        moe_die("cannot start the connection watcher");
    return n;
}

static void net_stop(serve_net *n) {
    pthread_mutex_lock(&n->mu);
    n->stopping = true;
    pthread_mutex_unlock(&n->mu);
    poke(n);
    pthread_join(n->watcher, NULL);
    close(n->epoll_fd);
    close(n->poke_fd);
    for (size_t i = 0; i < n->n_conns; i++) free(n->conns[i]);
    free(n->conns);
    free(n->watched);
    pthread_mutex_destroy(&n->mu);
    free(n);
}

/* ==== CORS ==== */

/* Whether origin is http:// or https:// followed by exactly the host (a Host header's value, or
 * the first of X-Forwarded-Host's list). */
static bool origin_is_host(const char *origin, const char *host) {
    if (!host) return false;
    const size_t n = strcspn(host, ", ");
    const char *rest = strncmp(origin, "http://", 7) == 0    ? origin + 7
                       : strncmp(origin, "https://", 8) == 0 ? origin + 8
                                                             : NULL;
    return rest && n && strlen(rest) == n && strncasecmp(rest, host, n) == 0;
}

/* The Origin header's verdict: 0 none (not a browser), 1 allowed (same origin as Host -- or as
 * X-Forwarded-Host, the host a reverse proxy, HTTPS or not, was asked for; a page cannot set
 * that header on a cross-origin request without a preflight, which is refused --, or in
 * --cors), -1 refused. */
static int origin_check(serve_http *h) {
    const char *origin = serve_header(h, "Origin");
    if (!origin) return 0;
    if (origin_is_host(origin, serve_header(h, "Host")) ||
        origin_is_host(origin, serve_header(h, "X-Forwarded-Host")))
        return 1;
    const char *list = h->srv->p.cors;
    const size_t len = strlen(origin);
    while (list && *list) {
        const size_t n = strcspn(list, ",");
        if ((n == 1 && list[0] == '*') || (n == len && strncasecmp(list, origin, n) == 0)) {
            h->cors_origin = origin;
            return 1;
        }
        list += n + (list[n] == ',');
    }
    return -1;
}

static void add_common_headers(serve_http *h, struct MHD_Response *r) {
    if (!h->cors_origin) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", h->cors_origin);
    MHD_add_response_header(r, "Vary", "Origin");
    MHD_add_response_header(r, "Access-Control-Expose-Headers", "Retry-After");
}

/* OPTIONS: a browser's preflight, answered for an allowed origin (refused ones got 403). */
static void reply_preflight(serve_http *h) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    MHD_add_response_header(r, "Allow", "GET, POST, OPTIONS");
    if (h->cors_origin) {
        add_common_headers(h, r);
        const char *want = serve_header(h, "Access-Control-Request-Headers");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        MHD_add_response_header(r, "Access-Control-Allow-Headers",
                                want ? want
                                     : "authorization, content-type, x-api-key, "
                                       "anthropic-version");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    }
    MHD_queue_response(h->conn, 204, r);
    MHD_destroy_response(r);
    h->replied = true;
    h->status = 204;
}

/* ==== Replies ==== */

void serve_reply_text(serve_http *h, int status, const char *content_type, const char *text,
                      size_t len) {
    if (h->replied) return;
    if (!h->conn) {
        if (h->offline_reply) moe_strbuf_put(h->offline_reply, text, len);
        h->replied = true;
        h->status = status;
        return;
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)text, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", content_type);
    add_common_headers(h, r);
    for (const char *const *x = h->extra_headers; x && x[0] && x[1]; x += 2)
        MHD_add_response_header(r, x[0], x[1]);
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

const char *serve_header(serve_http *h, const char *name) {
    return h->conn ? MHD_lookup_connection_value(h->conn, MHD_HEADER_KIND, name) : NULL;
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

/* libmicrohttpd asks for stream bytes: what the pump wrote, else the engine's news, else a
 * keep-alive when due, else park until one of these (returning 0 with the connection
 * suspended). */
static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    serve_sse *s = cls;
    serve_exchange *ex = s->h_copy.ex;
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
        if (atomic_load(&ex->hung_up)) {
            s->h_copy.status = 499; /* client closed the request */
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        pthread_mutex_lock(&s->req->mu);
        ex->news = false;
        pthread_mutex_unlock(&s->req->mu);
        if (serve_req_take(s->req, &s->taken, 0)) {
            s->pump(s, &s->taken);
            if (s->taken.done) s->ended = true;
            continue;
        }
        const double due = s->last_write + s->h_copy.srv->p.keepalive_s;
        if (serve_now() >= due) {
            moe_strbuf_puts(&s->out, s->keepalive);
            continue;
        }
        pthread_mutex_lock(&s->h_copy.srv->net->mu);
        set_deadline(s->h_copy.srv->net, ex, due);
        pthread_mutex_unlock(&s->h_copy.srv->net->mu);
        pthread_mutex_lock(&s->req->mu);
        const bool again = ex->news || atomic_load(&ex->hung_up);
        if (!again) {
            ex->suspended = true;
            MHD_suspend_connection(s->h_copy.conn);
        }
        pthread_mutex_unlock(&s->req->mu);
        if (!again) return 0;
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
    s->t_start = h->ex->t_start;
    snprintf(s->log_path, sizeof s->log_path, "%s", h->path);
    moe_json_init(&s->j, false);
    if (!h->ex->req) watch(h->srv->net, h->ex, req);
    h->ex->streaming = true;
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, s, sse_free);
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    add_common_headers(h, r);
    MHD_queue_response(h->conn, 200, r);
    MHD_destroy_response(r);
    h->replied = true;
    h->status = -1; /* logged by the stream when it ends */
}

/* ==== Requests ==== */

/* The first call for a request: its exchange, and whether the body may come (Content-Length
 * within SERVE_MAX_BODY_BYTES). */
static serve_exchange *exchange_new(struct MHD_Connection *conn) {
    serve_exchange *ex = moe_xcalloc(1, sizeof *ex);
    ex->conn = conn;
    ex->t_start = serve_now();
    atomic_init(&ex->hung_up, false);
    const union MHD_ConnectionInfo *sc =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    ex->ce = sc ? sc->socket_context : NULL;
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoull(cl, NULL, 10) > SERVE_MAX_BODY_BYTES) ex->too_large = true;
    return ex;
}

/* The whole request is here: answer it (or start what answers it later). */
static void dispatch(serve_http *h) {
    serve_exchange *ex = h->ex;
    if (ex->ce) {
        pthread_mutex_lock(&h->srv->net->mu);
        ex->ce->busy = true;
        pthread_mutex_unlock(&h->srv->net->mu);
    }
    const int origin = origin_check(h);
    if (ex->too_large)
        serve_reply_error(h, serve_route_api(h), 413, NULL, NULL,
                          "the request body is larger than %u bytes", SERVE_MAX_BODY_BYTES);
    else if (origin < 0)
        serve_reply_error(h, serve_route_api(h), 403, NULL, NULL,
                          "cross-origin requests from %s are not allowed (start the server with "
                          "--cors ORIGIN to allow one)",
                          serve_header(h, "Origin"));
    else if (strcmp(h->method, "OPTIONS") == 0)
        reply_preflight(h);
    else
        serve_route(h);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    serve_server *srv = cls;
    serve_exchange *ex = *con_cls;
    if (!ex) {
        ex = *con_cls = exchange_new(conn);
        if (!ex->too_large) return MHD_YES;
    }
    if (*upload_size) { /* past the limit, the rest is read and dropped: 413 at the end */
        if (!ex->too_large && *upload_size > SERVE_MAX_BODY_BYTES - ex->body.len) {
            ex->too_large = true;
            moe_strbuf_free(&ex->body);
        } else if (!ex->too_large) {
            moe_strbuf_put(&ex->body, upload, *upload_size);
        }
        *upload_size = 0;
        return MHD_YES;
    }
    serve_http h = {.srv = srv,
                    .conn = conn,
                    .ex = ex,
                    .method = method,
                    .path = url,
                    .body = ex->body.s,
                    .body_len = ex->body.len,
                    .status = 0};
    if (ex->resume) {
        origin_check(&h); /* the reply's CORS headers */
        pthread_mutex_lock(&ex->req->mu);
        ex->news = false;
        pthread_mutex_unlock(&ex->req->mu);
        resume_once(&h);
    } else {
        dispatch(&h);
    }
    if (h.parked) settle(&h);
    if (h.parked) return MHD_YES; /* suspended until there is news */
    if (!h.replied && h.status != 499)
        serve_reply_error(&h, serve_route_api(&h), 500, NULL, NULL,
                          "internal error: no reply was made");
    if (h.status != -1) {
        access_log(srv, method, url, h.status, ex->t_start, h.log_prompt, h.log_cached,
                   h.log_completion);
        serve_metrics_count(srv, url, h.status);
    }
    if (!h.replied) return MHD_NO; /* the client is gone: close */
    return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn, (void)toe;
    serve_server *srv = cls;
    serve_exchange *ex = *con_cls;
    if (!ex) return;
    if (ex->req) unwatch(srv->net, ex);
    if (ex->drop) ex->drop(ex->ud);
    if (ex->ce) {
        pthread_mutex_lock(&srv->net->mu);
        ex->ce->busy = false;
        ex->ce->waiting_since = serve_now();
        pthread_mutex_unlock(&srv->net->mu);
    }
    moe_strbuf_free(&ex->body);
    free(ex);
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

/* Before listening: the file opens as a model moe runs (every tensor bound; weights mapped,
 * not read), its tokenizer loads and matches it, and --spec applies to it (mtp by default where
 * it has an MTP layer) -- a wrong path, file or --spec fails here, not after "listening". The
 * engine thread loads it for real. */
static bool model_check(moe_serve_params *p, char *out, size_t out_size) {
    const char *path = p->model_path;
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    moe_tokenizer *tok = m ? moe_tokenizer_from_gguf(m->gguf, &err) : NULL;
    if (tok && moe_tokenizer_n_vocab(tok) != m->cfg.n_vocab)
        moe_error_set(&err, MOE_ERR_FORMAT, "%s: the vocabulary has %u tokens but the model %u",
                      path, moe_tokenizer_n_vocab(tok), m->cfg.n_vocab);
    if (tok && !err.code) serve_spec_resolve(p, m, &err);
    moe_tokenizer_free(tok);
    moe_model_free(m);
    if (err.code) snprintf(out, out_size, "%s", err.msg);
    return !err.code;
}

/* libmicrohttpd's own limit behind --max-connections: connections are accepted past ours while
 * make_room closes the idle-longest for each newcomer (closed ones count until libmicrohttpd has
 * seen them go, and a burst of newcomers outruns that); refused at accept past it. One address
 * gets the same backstop: with its own smaller one, a burst from the address that floods would
 * shut out that address's next /health until the closes catch up (make_room keeps it to
 * --max-connections-per-ip live connections either way). */
static unsigned backstop(int limit) {
    return (unsigned)limit + (unsigned)limit / 2 + SERVE_CONN_RESERVE;
}

/* Enough descriptors for every connection libmicrohttpd may accept, the model and spare:
 * raise the soft limit towards the hard one, and cap the connections to what it allows. */
static void fit_fd_limit(moe_serve_params *p) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    const rlim_t want = (rlim_t)backstop(p->max_connections) + 64;
    if (rl.rlim_cur < want) {
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur < want) {
        const int fit = rl.rlim_cur > SERVE_CONN_RESERVE + 64 + 32
                            ? (int)((rl.rlim_cur - SERVE_CONN_RESERVE - 64) * 2 / 3)
                            : 16;
        fprintf(stderr,
                "moe serve: the file descriptor limit (%llu) allows %d connections, not %d\n",
                (unsigned long long)rl.rlim_cur, fit, p->max_connections);
        p->max_connections = fit;
    }
    if (p->max_connections_per_ip > p->max_connections)
        p->max_connections_per_ip = p->max_connections;
}

int moe_serve_run(const moe_serve_params *params) {
    MOE_CHECK(params->model_path); /* the caller resolves a missing model (cli/'s demo) */
    serve_server *srv = moe_xcalloc(1, sizeof *srv);
    srv->p = *params;
    srv->p.cache_slots = serve_cache_slots(&srv->p);
    srv->t_start = serve_now();
    pthread_mutex_init(&srv->metrics.mu, NULL);
    atomic_init(&srv->next_id, 1);
    model_id_from_path(srv, srv->p.model_path);
    fit_fd_limit(&srv->p);
    srv->metrics.conn_limit = (uint32_t)srv->p.max_connections;
    srv->metrics.conn_limit_per_ip = (uint32_t)srv->p.max_connections_per_ip;
    srv->metrics.read_timeout_s = srv->p.read_timeout_s;

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
    if (!model_check(&srv->p, terr, sizeof terr) ||
        !serve_template_load(srv, terr, sizeof terr)) { /* before any request can render */
        fprintf(stderr, "moe serve: %s\n", terr);
        freeaddrinfo(ai);
        free(srv);
        return 1;
    }
    srv->sched = serve_sched_start(&srv->p, &srv->metrics);
    srv->net = net_start(srv);
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* libmicrohttpd's own limits sit above ours: make_room closes idle connections first */
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)srv->p.port, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR,
        ai->ai_addr, MHD_OPTION_THREAD_POOL_SIZE, (unsigned)srv->p.http_threads,
        MHD_OPTION_CONNECTION_LIMIT, backstop(srv->p.max_connections),
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, backstop(srv->p.max_connections),
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)SERVE_MAX_HEADER_BYTES,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)ceil(srv->p.read_timeout_s),
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
        srv, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!d) {
        fprintf(stderr, "moe serve: cannot listen on %s:%d (address in use?)\n", srv->p.host,
                srv->p.port);
        net_stop(srv->net);
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
    fprintf(stderr,
            "moe serve: connections: %d kept open (%d per address), %g s to send a request, %d "
            "HTTP threads, cross-origin: %s\n",
            srv->p.max_connections, srv->p.max_connections_per_ip, srv->p.read_timeout_s,
            srv->p.http_threads, srv->p.cors ? srv->p.cors : "none (--cors)");
    char err[MOE_ERROR_MSG_MAX];
    int rc = 0;
    if (!serve_sched_wait_loaded(srv->sched, err, sizeof err)) {
        fprintf(stderr, "moe serve: %s\n", err);
        rc = 1;
    } else {
        const moe_model *m = serve_sched_model(srv->sched);
        fprintf(stderr,
                "moe serve: model %s (%s, %u layers), context %u per sequence, %d streams + %d "
                "resident sequences, chat template %s, %d threads, %s, speculation %s\n",
                srv->model_id, m->cfg.arch_name, m->cfg.n_layer, serve_sched_n_ctx(srv->sched),
                srv->p.parallel, srv->p.cache_slots, srv->tmpl_origin, srv->p.n_threads,
                srv->p.n_api_keys ? "API key required" : "no API key",
                srv->p.spec == MOE_SPEC_MTP     ? "mtp"
                : srv->p.spec == MOE_SPEC_NGRAM ? "ngram"
                                                : "none");
        printf("moe serve: ready (loaded in %.2f s)\n", serve_now() - srv->t_start);
        fflush(stdout);
        int sig = 0;
        sigwait(&sigs, &sig);
        char lost[MOE_ERROR_MSG_MAX];
        if (serve_sched_lost(srv->sched, lost, sizeof lost) >= 0) { /* the engine signalled */
            fprintf(stderr, "moe serve: %s\n", lost);
            rc = 1;
        } else {
            fprintf(stderr, "moe serve: signal %d: stopping\n", sig);
        }
    }
    serve_sched_stop(srv->sched); /* ends every request: each parked exchange is resumed */
    wait_unwatched(srv->net, SERVE_STOP_GRACE_S);
    MHD_stop_daemon(d);
    net_stop(srv->net);
    serve_sched_free(srv->sched);
    moe_chat_template_free(srv->tmpl);
    pthread_mutex_destroy(&srv->metrics.mu);
    free(srv);
    return rc;
}
