/* generate.c: the skeleton every generating endpoint shares, whatever its API -- set up the answer
 * (id, output parser), submit and wait for a stream, then either stream (the adapter's events
 * around every take of the engine's) or collect and answer with the whole response, and free
 * it all. An API adapter is a serve_adapter: its shape of the stream's first and last events,
 * of a failure, and of the whole response; everything else happens here once. Replays (the
 * tests' view of the adapters) run the same callbacks on given model text.
 *
 * Nothing here waits: after submitting, the exchange is parked (serve_park) and the continuation
 * runs again at every piece of news from the engine.
 *
 * The trap: once the stream is handed to the transport (serve_reply_sse), the request and the
 * state belong to the stream, which frees them when the connection ends -- the handler must not
 * touch either after serve_generate returns; before that, they belong to the parked job. */
#include "serve_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

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
        sse->h_copy.status = r->unavailable ? 503 : 500;
    } else {
        a->stream_end(ans, r);
    }
    pthread_mutex_unlock(&r->mu);
}

static void reply_whole(serve_http *h, serve_answer *ans, const serve_req *r) {
    const char *failed = failure(r, "cancelled");
    if (failed) {
        serve_reply_error(h, ans->adapter->api, r->unavailable ? 503 : 500, NULL,
                          r->unavailable ? "rank_lost" : NULL, "generation failed: %s", failed);
        return;
    }
    moe_json j;
    moe_json_init(&j, false);
    ans->adapter->whole(&j, ans, r);
    serve_reply_json(h, 200, &j);
    moe_json_free(&j);
}

/* ==== Waiting for the engine ==== */

/* A submitted generation between its continuations (the exchange is parked in between). */
typedef struct gen_job {
    serve_answer *ans;
    serve_req *req;
    serve_taken t;
    bool stream;
    double deadline; /* waiting for a stream past this: 503 */
} gen_job;

static void job_free(void *ud) {
    gen_job *g = ud;
    serve_taken_free(&g->t);
    serve_req_release(g->req);
    if (g->ans) answer_free(g->ans);
    free(g);
}

static void count(serve_server *srv, uint64_t *counter) {
    pthread_mutex_lock(&srv->metrics.mu);
    (*counter)++;
    pthread_mutex_unlock(&srv->metrics.mu);
}

/* The continuation: runs at every piece of news. Waits (parked) for admission -- 503 past the
 * queue timeout -- then hands a stream to the transport, or feeds the answer until the end and
 * replies with it. A client gone: no reply (the transport cancelled the request). */
static void job_resume(serve_http *h, void *ud) {
    gen_job *g = ud;
    const serve_adapter *a = g->ans->adapter;
    if (h->hung_up) {
        h->status = 499;
        job_free(g);
        return;
    }
    serve_req_take(g->req, &g->t, 0);
    if (!g->t.admitted && !g->t.done) {
        if (serve_now() <= g->deadline) {
            serve_park(h, g->req, g->deadline, job_resume, job_free, g);
            return;
        }
        serve_req_cancel(g->req);
        count(h->srv, &h->srv->metrics.rejected_timeout);
        h->retry_after = 1;
        serve_reply_error(h, a->api, 503, NULL, NULL,
                          "no stream became free within %.0f s: the server is overloaded",
                          h->srv->p.queue_timeout_s);
    } else if (!g->t.admitted) {
        pthread_mutex_lock(&g->req->mu);
        if (g->req->unavailable) /* a rank of the job gone: the message names it */
            serve_reply_error(h, a->api, 503, NULL, "rank_lost", "%s", g->req->error);
        else
            serve_reply_error(h, a->api, 503, NULL, NULL,
                              "the request was cancelled (server stopping)");
        pthread_mutex_unlock(&g->req->mu);
    } else if (g->stream) { /* the events already taken go out first */
        serve_reply_sse(h, g->req, &g->t, stream_pump, g->ans, answer_free, a->keepalive);
        g->req = NULL;
        g->ans = NULL;
    } else {
        a->feed(g->ans, &g->t);
        if (!g->t.done) {
            serve_park(h, g->req, 0, job_resume, job_free, g);
            return;
        }
        pthread_mutex_lock(&g->req->mu);
        h->log_prompt = g->req->gen.n_prompt;
        h->log_cached = g->req->n_cached;
        h->log_completion = g->req->n_generated;
        pthread_mutex_unlock(&g->req->mu);
        reply_whole(h, g->ans, g->req);
    }
    job_free(g);
}

void serve_generate(serve_http *h, serve_answer *ans, serve_req *req, const serve_chat *chat,
                    const char *prompt, bool ok, bool stream) {
    const serve_adapter *a = ans->adapter;
    if (!ok) {
        serve_req_release(req);
        answer_free(ans);
        return;
    }
    answer_init(ans, h->srv, chat, prompt);
    switch (serve_sched_submit(h->srv->sched, req)) {
    case SERVE_SUBMIT_OK:
        break;
    case SERVE_SUBMIT_QUEUE_FULL:
        count(h->srv, &h->srv->metrics.rejected_queue_full);
        h->retry_after = 1;
        serve_reply_error(h, a->api, 429, NULL, "rate_limit_exceeded",
                          "too many requests waiting (%d): try again shortly",
                          h->srv->p.queue_limit);
        serve_req_release(req);
        answer_free(ans);
        return;
    case SERVE_SUBMIT_NOT_READY:
        serve_reply_error(h, a->api, 503, NULL, NULL,
                          "the server is not ready (loading or stopping)");
        serve_req_release(req);
        answer_free(ans);
        return;
    case SERVE_SUBMIT_RANK_LOST: {
        char why[MOE_ERROR_MSG_MAX];
        serve_sched_lost(h->srv->sched, why, sizeof why);
        serve_reply_error(h, a->api, 503, NULL, "rank_lost", "%s", why);
        serve_req_release(req);
        answer_free(ans);
        return;
    }
    }
    gen_job *g = moe_xcalloc(1, sizeof *g);
    *g = (gen_job){.ans = ans,
                   .req = req,
                   .stream = stream,
                   .deadline = serve_now() + h->srv->p.queue_timeout_s};
    job_resume(h, g);
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
