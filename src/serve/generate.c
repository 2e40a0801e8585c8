/* generate.c: the skeleton every generating endpoint shares, whatever its API -- set up the answer
 * (id, output parser), submit and wait for a stream, then either stream (the adapter's events
 * around every take of the engine's) or collect and answer with the whole response, and free
 * it all. An API adapter is a serve_adapter: its shape of the stream's first and last events,
 * of a failure, and of the whole response; everything else happens here once. Replays (the
 * tests' view of the adapters) run the same callbacks on given model text.
 *
 * The trap: once the stream is handed to the transport (serve_reply_sse), the request and the
 * state belong to the stream, which frees them when the connection ends -- the handler must not
 * touch either after serve_generate returns. */
#include "serve_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ==== Waiting for the engine ==== */

/* Submit and wait for admission; replies (and returns false) on a full queue, a timeout, a
 * hang-up or a server not ready. */
static bool submit_and_wait(serve_http *h, serve_api api, serve_req *req, serve_taken *t) {
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

/* Wait for the end of a generation, handing every take to feed (t first, as it may already hold
 * events). false when the client went away (the request is then cancelled). */
static bool wait_done(serve_http *h, serve_req *req, serve_taken *t,
                      void (*feed)(void *state, const serve_taken *t), void *state) {
    feed(state, t);
    while (!t->done) {
        if (serve_req_take(req, t, SERVE_POLL_MS / 1000.0)) {
            feed(state, t);
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

/* ==== The answer ==== */

void *serve_answer_new(const serve_adapter *a, size_t state_size, const char *id_prefix) {
    serve_answer *ans = moe_xcalloc(1, state_size);
    ans->adapter = a;
    ans->id_prefix = id_prefix;
    return ans;
}

/* Server, id, time, and the output parser for chat's reply (chat NULL: plain text) after the
 * rendered prompt (NULL: none). */
static void answer_init(serve_answer *ans, serve_server *srv, const serve_chat *chat,
                        const char *prompt) {
    ans->srv = srv;
    ans->created = (long)time(NULL);
    serve_make_id(srv, ans->id_prefix, ans->id, sizeof ans->id);
    serve_output_init(&ans->out, srv, chat, prompt);
}

const serve_tool_call *serve_answer_call(serve_answer *ans, const char *id_prefix,
                                         const serve_segment *seg) {
    ans->calls = moe_xrealloc(ans->calls, (ans->n_calls + 1) * sizeof *ans->calls);
    serve_tool_call *c = &ans->calls[ans->n_calls++];
    char id[48];
    serve_make_id(ans->srv, id_prefix, id, sizeof id);
    *c = (serve_tool_call){moe_xstrdup(id), moe_xstrdup(seg->name), moe_xstrdup(seg->arguments)};
    return c;
}

/* The adapter's fields, then the skeleton's, then the state. */
static void answer_free(void *state) {
    serve_answer *ans = state;
    ans->adapter->clear(ans);
    serve_output_free(&ans->out);
    serve_tool_calls_free(ans->calls, ans->n_calls);
    free(ans);
}

/* Why a finished generation has no answer, or NULL when it has one. */
static const char *failure(const serve_req *r, const char *cancelled) {
    if (r->finish == SERVE_FINISH_ERROR) return r->error;
    return r->finish == SERVE_FINISH_CANCELLED ? cancelled : NULL;
}

/* The transport's pump: the adapter's opening events, then every take, then its closing ones. */
static void stream_pump(serve_sse *sse, const serve_taken *t) {
    serve_answer *ans = sse->state;
    const serve_adapter *a = ans->adapter;
    serve_req *r = sse->req;
    ans->sse = sse;
    if (!ans->started) {
        ans->started = true;
        pthread_mutex_lock(&r->mu);
        a->stream_begin(ans, r);
        pthread_mutex_unlock(&r->mu);
    }
    a->feed(ans, t);
    if (!t->done) return;
    pthread_mutex_lock(&r->mu);
    const char *failed = failure(r, "the request was cancelled");
    if (failed) {
        a->stream_error(ans, failed);
        sse->h_copy.status = 500;
    } else {
        a->stream_end(ans, r);
    }
    pthread_mutex_unlock(&r->mu);
}

static void reply_whole(serve_http *h, serve_answer *ans, const serve_req *r) {
    const char *failed = failure(r, "cancelled");
    if (failed) {
        serve_reply_error(h, ans->adapter->api, 500, NULL, NULL, "generation failed: %s", failed);
        return;
    }
    moe_json j;
    moe_json_init(&j, false);
    ans->adapter->whole(&j, ans, r);
    serve_reply_json(h, 200, &j);
    moe_json_free(&j);
}

void serve_generate(serve_http *h, serve_answer *ans, serve_req *req, const serve_chat *chat,
                    const char *prompt, bool ok, bool stream) {
    const serve_adapter *a = ans->adapter;
    serve_taken t = {0};
    if (ok) answer_init(ans, h->srv, chat, prompt);
    if (ok && submit_and_wait(h, a->api, req, &t)) {
        if (stream) { /* the events already taken go out first */
            serve_reply_sse(h, req, &t, stream_pump, ans, answer_free, a->keepalive);
            return;
        }
        if (wait_done(h, req, &t, a->feed, ans)) reply_whole(h, ans, req);
    }
    serve_taken_free(&t);
    serve_req_release(req);
    answer_free(ans);
}

/* ==== Replaying model output ==== */

void serve_replay(serve_answer *ans, serve_server *srv, const serve_chat *chat, const char *prompt,
                  const char *text, size_t chunk, bool stream, moe_strbuf *out) {
    answer_init(ans, srv, chat, prompt);
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
    if (stream) {
        serve_sse sse = {.req = r, .state = ans, .pump = stream_pump, .j = j};
        stream_pump(&sse, &t);
        moe_strbuf_put(out, sse.out.s ? sse.out.s : "", sse.out.len);
        moe_strbuf_free(&sse.out);
        j = sse.j;
    } else {
        ans->adapter->feed(ans, &t);
        ans->adapter->whole(&j, ans, r);
        moe_strbuf_put(out, j.buf, j.len);
    }
    moe_strbuf_put(out, "", 0);
    moe_json_free(&j);
    serve_taken_free(&t);
    serve_req_release(r);
    answer_free(ans);
}
