/* router.c: which handler a request reaches -- the endpoint table (method + path), API keys, the
 * model-loading gate, the API whose error shape a reply takes -- and the operational endpoints
 * (/health, /metrics, /tokenize, /detokenize, /v1/models' choice of shape) with the metrics'
 * Prometheus text. The trap: a route that reads the tokenizer or the model's context must say
 * needs_model, or it runs before the engine thread has loaded them. */
#include "serve_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ==== Endpoints, as the metrics count them ==== */

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

void serve_metrics_count(serve_server *srv, const char *path, int status) {
    int cls = status / 100 - 1;
    if (cls < 0 || cls > 4) cls = 4;
    pthread_mutex_lock(&srv->metrics.mu);
    srv->metrics.requests[endpoint_index(path)][cls]++;
    pthread_mutex_unlock(&srv->metrics.mu);
}

/* ==== Operational endpoints ==== */

/* {"status"} and, under mpirun, every rank: where it runs and what it holds, and whether it is
 * still there ("lost": the job is ending, 503 with the error naming it). */
static void health(serve_http *h) {
    const bool ready = serve_sched_ready(h->srv->sched);
    int n_ranks;
    const serve_rank *ranks = serve_sched_ranks(h->srv->sched, &n_ranks);
    char why[MOE_ERROR_MSG_MAX];
    const int lost = serve_sched_lost(h->srv->sched, why, sizeof why);
    moe_strbuf o = {0};
    if (lost >= 0) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_string(&j, why);
        moe_strbuf_printf(&o, "{\"status\":\"rank_lost\",\"error\":%s", j.buf);
        moe_json_free(&j);
    } else {
        moe_strbuf_printf(&o, "{\"status\":\"%s\"", ready ? "ok" : "loading");
    }
    if (n_ranks) {
        moe_strbuf_puts(&o, ",\"ranks\":[");
        for (int r = 0; r < n_ranks; r++) {
            char host[sizeof ranks[r].host + 1];
            snprintf(host, sizeof host, "%s", ranks[r].host);
            for (char *c = host; *c; c++) /* a host name never needs escaping; keep it so */
                if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = '?';
            moe_strbuf_printf(&o,
                              "%s{\"rank\":%d,\"status\":\"%s\",\"host\":\"%s\",\"pid\":%d,"
                              "\"routed_expert_bytes\":%llu,\"rss_bytes_at_start\":%llu}",
                              r ? "," : "", ranks[r].rank,
                              r == lost ? "lost"
                              : ready   ? "ok"
                                        : "stopped",
                              host, ranks[r].pid, (unsigned long long)ranks[r].routed_bytes,
                              (unsigned long long)ranks[r].rss_bytes);
        }
        moe_strbuf_puts(&o, "]");
    }
    moe_strbuf_puts(&o, "}");
    serve_reply_text(h, ready && lost < 0 ? 200 : 503, "application/json", o.s, o.len);
    moe_strbuf_free(&o);
}

const double serve_ttft_bounds[SERVE_TTFT_BUCKETS] = {0.01, 0.025, 0.05, 0.1, 0.25,
                                                      0.5,  1,     2.5,  5,   10};

/* Speculation: drafts and accepted drafts by position (1 = the first draft after the fed
 * token), and the tokens a stream's decode step chose on average. Caller holds m->mu. */
static void spec_metrics_write(const serve_metrics *m, moe_strbuf *o) {
    moe_strbuf_puts(o, "# HELP moe_spec_drafts_total Draft tokens verified, by draft position.\n"
                       "# TYPE moe_spec_drafts_total counter\n");
    for (int k = 0; k < MOE_SPEC_MAX_DRAFT && m->spec_drafted[k]; k++)
        moe_strbuf_printf(o, "moe_spec_drafts_total{position=\"%d\"} %llu\n", k + 1,
                          (unsigned long long)m->spec_drafted[k]);
    moe_strbuf_puts(o, "# HELP moe_spec_drafts_accepted_total Draft tokens kept (equal to the "
                       "sampler's pick), by draft position.\n"
                       "# TYPE moe_spec_drafts_accepted_total counter\n");
    for (int k = 0; k < MOE_SPEC_MAX_DRAFT && m->spec_drafted[k]; k++)
        moe_strbuf_printf(o, "moe_spec_drafts_accepted_total{position=\"%d\"} %llu\n", k + 1,
                          (unsigned long long)m->spec_accepted[k]);
    moe_strbuf_puts(o, "# HELP moe_spec_acceptance_ratio Accepted over verified drafts, by draft "
                       "position.\n# TYPE moe_spec_acceptance_ratio gauge\n");
    for (int k = 0; k < MOE_SPEC_MAX_DRAFT && m->spec_drafted[k]; k++)
        moe_strbuf_printf(o, "moe_spec_acceptance_ratio{position=\"%d\"} %.4f\n", k + 1,
                          (double)m->spec_accepted[k] / (double)m->spec_drafted[k]);
    moe_strbuf_printf(o,
                      "# HELP moe_decode_stream_steps_total Decode steps summed over streams.\n"
                      "# TYPE moe_decode_stream_steps_total counter\n"
                      "moe_decode_stream_steps_total %llu\n"
                      "# HELP moe_decode_tokens_per_step Tokens a stream's decode step chose, on "
                      "average (above 1: drafts kept).\n"
                      "# TYPE moe_decode_tokens_per_step gauge\n"
                      "moe_decode_tokens_per_step %.4f\n"
                      "# HELP moe_spec_verify_streams_max Most streams whose drafts were verified "
                      "in one step.\n"
                      "# TYPE moe_spec_verify_streams_max gauge\n"
                      "moe_spec_verify_streams_max %u\n",
                      (unsigned long long)m->stream_steps,
                      m->stream_steps ? (double)m->stream_step_tokens / (double)m->stream_steps
                                      : 0.0,
                      m->spec_streams_max);
}

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
    serve_metrics_write_prefix_cache(m, o);
    COUNTER("moe_requests_cancelled_total", "Requests cancelled (client gone, timeout).", "%llu",
            (unsigned long long)m->cancelled);
    COUNTER("moe_requests_rejected_queue_full_total", "429 replies: the queue was full.", "%llu",
            (unsigned long long)m->rejected_queue_full);
    COUNTER("moe_requests_rejected_timeout_total", "503 replies: waited past the timeout.", "%llu",
            (unsigned long long)m->rejected_timeout);
    const moe_expert_cache_stats *ec = &m->expert_cache;
    if (ec->slots) {
        GAUGE("moe_expert_cache_slots", "Experts the --expert-cache holds.", "%u", ec->slots);
        COUNTER("moe_expert_cache_hits_total", "Experts a step found resident.", "%llu",
                (unsigned long long)ec->hits);
        COUNTER("moe_expert_cache_misses_total", "Experts a step had to read from the file.",
                "%llu", (unsigned long long)ec->misses);
        COUNTER("moe_expert_cache_read_ahead_total", "Experts read ahead of the step needing them.",
                "%llu", (unsigned long long)ec->read_ahead);
        COUNTER("moe_expert_cache_read_bytes_total", "Bytes of experts read from the model file.",
                "%llu", (unsigned long long)ec->bytes_read);
        COUNTER("moe_expert_cache_stall_seconds_total", "Time steps waited for expert reads.",
                "%.6f", ec->read_seconds);
        COUNTER("moe_expert_cache_read_busy_seconds_total",
                "Time at least one expert read was in flight (read bytes over it: bandwidth).",
                "%.6f", ec->busy_seconds);
    }
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
    spec_metrics_write(m, o);
    moe_strbuf_printf(o,
                      "# HELP moe_client_hangups_total Requests whose client went away before the "
                      "reply ended (their generation is cancelled).\n"
                      "# TYPE moe_client_hangups_total counter\n"
                      "moe_client_hangups_total{mode=\"whole\"} %llu\n"
                      "moe_client_hangups_total{mode=\"stream\"} %llu\n",
                      (unsigned long long)m->hangups[0], (unsigned long long)m->hangups[1]);
    COUNTER("moe_tokens_after_cancel_total",
            "Tokens generated after a cancel was asked (the step already running).", "%llu",
            (unsigned long long)m->tokens_after_cancel);
    GAUGE("moe_tokens_after_cancel_max", "The most tokens one request generated after its cancel.",
          "%u", m->tokens_after_cancel_max);
    GAUGE("moe_connections_open", "TCP connections open now.", "%u", m->conn_open);
    GAUGE("moe_connections_limit", "--max-connections: connections kept open.", "%u",
          m->conn_limit);
    GAUGE("moe_connections_limit_per_ip", "--max-connections-per-ip.", "%u", m->conn_limit_per_ip);
    GAUGE("moe_read_timeout_seconds", "--read-timeout: time to send a whole request.", "%g",
          m->read_timeout_s);
    COUNTER("moe_connections_accepted_total", "TCP connections accepted.", "%llu",
            (unsigned long long)m->conn_accepted);
    COUNTER("moe_connections_evicted_total",
            "Idle connections closed to make room for a newcomer (over a limit).", "%llu",
            (unsigned long long)m->conn_evicted);
    COUNTER("moe_connections_read_timeouts_total",
            "Connections closed for not sending a whole request within --read-timeout.", "%llu",
            (unsigned long long)m->conn_read_timeouts);
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
    {"GET", "/", serve_web_asset, false, false},
    {"GET", "/chat.js", serve_web_asset, false, false},
    {"GET", "/chat.css", serve_web_asset, false, false},
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

serve_api serve_route_api(serve_http *h) {
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

void serve_route(serve_http *h) {
    const serve_api api = serve_route_api(h);
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
