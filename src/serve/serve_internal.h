/* serve_internal.h: what the files of src/serve/ share -- limits, the request and its event
 * queue (the only channel between HTTP threads and the engine thread), the scheduler, prompts
 * through the chat template and the output parser, metrics, the HTTP side (transport, router,
 * the helpers the API adapters use) and the generation skeleton the adapters plug into.
 *
 * The trap: a serve_req is shared by two threads. Its `gen` part is written once by the HTTP
 * thread before submit and only read after; everything the engine reports goes through the
 * event queue under req->mu; the engine-private per-stream state lives in the scheduler's
 * slots, never in the request. */
#ifndef MOE_SERVE_INTERNAL_H
#define MOE_SERVE_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"
#include "../chat/chat.h"
#include "../engine/engine.h"
#include "../text/text.h"
#include "serve.h"

/* ==== Limits (each a defence against a hostile or broken client) ==== */

#define SERVE_MAX_BODY_BYTES                                                                       \
    (16u << 20)                   /* request body: a long prompt fits, a runaway upload not */
#define SERVE_MAX_JSON_DEPTH   64 /* real requests nest < 10 deep; jansson recurses */
#define SERVE_MAX_HEADER_BYTES (64u << 10) /* per-connection memory for request line + headers */
#define SERVE_CONN_RESERVE                                                                         \
    32 /* libmicrohttpd accepts this many (and half of --max-connections) past our limit, where    \
        * each newcomer closes the idle-longest connection, so /health answers while idle          \
        * sockets fill the rest */
#define SERVE_MAX_STOP       16     /* stop strings per request (OpenAI allows 4) */
#define SERVE_MAX_STOP_BYTES 256    /* one stop string */
#define SERVE_MAX_BIAS       1024   /* logit_bias entries */
#define SERVE_MAX_MESSAGES   100000 /* messages in one conversation */
#define SERVE_MAX_TOOLS      1024
#define SERVE_MAX_CALL_DEPTH                                                                       \
    32                          /* a tool call's JSON from the model; our writer nests             \
                                 * it inside a response, under MOE_JSON_MAX_DEPTH */
#define SERVE_PREFILL_CHUNK 256 /* prompt rows per forward step, beside the decode rows */
#define SERVE_PROMPT_LOGPROB_ROWS                                                                  \
    64 /* prompt rows with logits per step (echo + logprobs): each holds a [n_vocab] row of the    \
        * logits buffer, sized at load */
#define SERVE_STOP_GRACE_S 1.0 /* at a stop, time for requests ended "cancelled" to answer */
#define SERVE_WATCH_MS     200 /* the watcher's longest sleep: read timeouts are this late */
#define SERVE_RANK_WATCH_S                                                                         \
    0.2 /* under mpirun: how often the engine thread looks for lost ranks                          \
         */
#define SERVE_RANK_LOST_LINGER_S                                                                   \
    5.0 /* a rank gone: requests and /health get 503 this long (a load balancer sees it), then     \
         * the job ends */
#define SERVE_MAX_THINK_TAG                                                                        \
    16 /* tokens of a reasoning tag (<think> is one or a few): longer ones are not tracked */
#define SERVE_MAX_THINK_TEXT                                                                       \
    32 /* bytes of a reasoning tag's text + 1: longer ones are tracked by their tokens only */
#define SERVE_CACHE_DISK_DEFAULT                                                                   \
    (8ull << 30) /* --cache-disk-size: a few long agent histories of a large model */

double serve_now(void); /* monotonic seconds */

/* ==== Requests and their event queue ==== */

typedef enum serve_finish {
    SERVE_FINISH_NONE,
    SERVE_FINISH_EOG,       /* the model ended its turn */
    SERVE_FINISH_STOP,      /* a stop string matched (stop_index says which) */
    SERVE_FINISH_LENGTH,    /* max_tokens reached or the context is full */
    SERVE_FINISH_CANCELLED, /* the client went away, or the wait timed out */
    SERVE_FINISH_ERROR,     /* the engine failed (message in error) */
} serve_finish;

typedef enum serve_event_kind {
    SERVE_EV_TOKEN,  /* a generated token (sample valid) and the text it released (maybe none) */
    SERVE_EV_TEXT,   /* text only: held-back bytes released at the end */
    SERVE_EV_PROMPT, /* a prompt token's log-probability (prompt_logprobs; no text), in order
                      * from the second prompt token */
} serve_event_kind;

typedef struct serve_event {
    serve_event_kind kind;
    size_t text_off, text_len; /* into the queue's text */
    moe_sample sample;         /* TOKEN: token id, logprob and alternatives */
} serve_event;

/* What the engine needs to run one generation; filled by the HTTP thread before submit. */
typedef struct serve_gen {
    int32_t *prompt; /* [n_prompt] token ids */
    uint32_t n_prompt;
    moe_sampler_params sampling; /* bias arrays point into bias_tokens / bias_values */
    int32_t *bias_tokens;
    float *bias_values;
    int64_t max_tokens; /* < 0: until end of generation or a full context */
    char *stop[SERVE_MAX_STOP];
    uint32_t n_stop;
    /* Reasoning (prompt.c fills it from the template's tags; the scheduler counts and limits):
     * the tags as tokens, whether the prompt leaves a block open, and at most think_budget
     * tokens inside blocks (< 0: no limit) -- when spent, think_close is fed as the next
     * tokens and the answer follows. A tag is seen as its tokens or as its text (a model may
     * spell it in other tokens). No tags (n_think_close 0): nothing is counted. */
    int32_t think_open[SERVE_MAX_THINK_TAG], think_close[SERVE_MAX_THINK_TAG];
    uint32_t n_think_open, n_think_close;
    char think_open_text[SERVE_MAX_THINK_TEXT], think_close_text[SERVE_MAX_THINK_TEXT];
    bool think_at_start;
    int64_t think_budget;
    bool logprobs;        /* report sample logprobs in events */
    bool prompt_logprobs; /* also every prompt token's after the first (SERVE_EV_PROMPT): the
                           * prompt is computed whole, no prefix reuse; max_tokens may be 0 */
    bool ignore_eos;
    moe_grammar *grammar;    /* constrained decoding (owned), or NULL */
    bool grammar_is_default; /* it is --grammar-file's: a response format replaces it */
} serve_gen;

void serve_gen_free(serve_gen *g);

typedef struct serve_sched serve_sched;

typedef enum serve_cache_source {
    SERVE_CACHE_NONE, /* nothing reused */
    SERVE_CACHE_RAM,  /* a resident sequence or snapshot */
    SERVE_CACHE_DISK, /* the disk prefix cache (--cache-dir) */
} serve_cache_source;

/* "none", "ram", "disk": what usage reports as cache_source */
const char *serve_cache_source_name(serve_cache_source s);

typedef struct serve_req {
    serve_gen gen; /* immutable once submitted */
    double t_submit;
    atomic_bool cancel; /* set by the HTTP side; the engine acts on it at the next step */
    /* called (under mu) at every event, admission and the end: the transport resumes the
     * connection waiting for it. Set and cleared by the transport under mu. */
    void (*wake)(void *ud);
    void *wake_ud;
    struct serve_req *next;    /* the scheduler's waiting list (under the scheduler's lock) */
    struct serve_sched *sched; /* set at submit: cancel wakes it */

    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;  /* signalled on every event */
    int refs;
    bool admitted, done;
    uint32_t n_cached;              /* prompt tokens reused instead of recomputed ... */
    serve_cache_source cached_from; /* ... and where they came from */
    uint32_t n_generated;
    uint32_t generated_at_cancel; /* n_generated when serve_req_cancel was first called */
    uint32_t n_reasoning; /* of them, inside reasoning blocks (counted when the tags are known) */
    double t_first_token;
    serve_finish finish;
    int stop_index; /* SERVE_FINISH_STOP: which stop string */
    char error[256];
    bool unavailable; /* failed because the server cannot go on (a rank of the job is gone): 503 */
    serve_event *events; /* pending, not yet taken by the HTTP side */
    size_t n_events, cap_events;
    moe_strbuf text; /* bytes the pending events point into */
} serve_req;

serve_req *serve_req_new(void); /* refs = 1 (the HTTP side) */
void serve_req_release(serve_req *r);
void serve_req_cancel(serve_req *r);
/* Engine side, under r->mu: wake whoever waits for r (its condition and its wake hook). */
void serve_req_notify(serve_req *r);

/* The HTTP side's copy of events taken from a request (reused across takes). */
typedef struct serve_taken {
    serve_event *events;
    size_t n_events, cap_events;
    moe_strbuf text;
    bool admitted, done; /* state as of this take */
} serve_taken;

/* Wait up to timeout_s for events, admission or the end; moves pending events into t. Returns
 * true when something changed (events, newly admitted, done). */
bool serve_req_take(serve_req *r, serve_taken *t, double timeout_s);
void serve_taken_free(serve_taken *t);

/* ==== Metrics (Prometheus text at /metrics) ==== */

#define SERVE_TTFT_BUCKETS 10

typedef struct serve_metrics {
    pthread_mutex_t mu;
    uint64_t requests[6][5]; /* [endpoint][status class 1xx..5xx] */
    uint64_t prompt_tokens, generated_tokens, cached_tokens;
    uint64_t prefix_hits, cancelled, rejected_queue_full, rejected_timeout;
    uint64_t disk_hits, disk_tokens; /* of prefix_hits / cached_tokens: from the disk cache */
    bool disk_cache;                 /* --cache-dir given: disk_stats below are live */
    moe_disk_cache_stats disk_stats;
    uint64_t hangups[2];              /* clients gone mid-request: [0] whole replies, [1] streams */
    uint64_t tokens_after_cancel;     /* generated after a cancel was asked (a step's worth) */
    uint32_t tokens_after_cancel_max; /* the most for one request */
    uint64_t conn_accepted, conn_evicted, conn_read_timeouts;
    uint32_t conn_open;                     /* connections open now */
    uint32_t conn_limit, conn_limit_per_ip; /* the limits (--max-connections ...) */
    double read_timeout_s;
    double prefill_seconds, decode_seconds;
    uint64_t prefill_rows, decode_rows;
    double prefill_tps, decode_tps; /* the last step's rate */
    uint32_t decode_batch_max;      /* most decode rows (streams) in one forward step */
    /* speculation (--spec): drafts verified and kept by draft position; a stream's decode steps
     * and the tokens they chose (tokens per step: the second over the first) */
    uint64_t spec_drafted[MOE_SPEC_MAX_DRAFT], spec_accepted[MOE_SPEC_MAX_DRAFT];
    uint64_t stream_steps, stream_step_tokens;
    uint32_t spec_streams_max; /* most streams with drafts in one verify step */
    uint64_t ttft_buckets[SERVE_TTFT_BUCKETS + 1], ttft_count;
    double ttft_sum;
    uint32_t active, waiting, resident;
    moe_expert_cache_stats expert_cache; /* --expert-cache's counters (slots 0: no cache) */
} serve_metrics;

extern const double serve_ttft_bounds[SERVE_TTFT_BUCKETS];
void serve_metrics_write(serve_metrics *m, moe_strbuf *out);
/* The prefix cache's part (sched.c): hits and tokens by source (RAM, disk), the disk cache's
 * entries, bytes, writes, evictions and damaged entries. Called with m->mu held. */
void serve_metrics_write_prefix_cache(const serve_metrics *m, moe_strbuf *out);

/* ==== Scheduler: the engine thread ==== */

typedef enum serve_submit_result {
    SERVE_SUBMIT_OK,
    SERVE_SUBMIT_QUEUE_FULL,
    SERVE_SUBMIT_NOT_READY,
    SERVE_SUBMIT_RANK_LOST, /* a rank of the mpirun job is gone (serve_sched_lost says which) */
} serve_submit_result;

/* Starts the engine thread, which loads the model; serve_sched_wait_loaded() reports how that
 * went. */
serve_sched *serve_sched_start(const moe_serve_params *p, serve_metrics *metrics);
bool serve_sched_wait_loaded(serve_sched *s, char *err, size_t err_size);
/* A scheduler without an engine thread or model, for fuzzing the request parsers: its
 * tokenizer (taken) and context length answer as after a load; every submit is refused
 * (SERVE_SUBMIT_NOT_READY). Freed with serve_sched_free; never started or stopped. */
serve_sched *serve_sched_offline(moe_tokenizer *tok, uint32_t n_ctx);
bool serve_sched_ready(serve_sched *s);
/* End every request (cancelled) and the thread; submits fail from here on. */
void serve_sched_stop(serve_sched *s);
void serve_sched_free(serve_sched *s); /* after stop, once no HTTP thread can reach it */
serve_submit_result serve_sched_submit(serve_sched *s, serve_req *r);
/* Valid once loaded (immutable afterwards). */
/* A rank of an mpirun job as /health reports it (gathered once the context is made). */
typedef struct serve_rank {
    int32_t rank, pid;
    char host[64];
    uint64_t routed_bytes; /* of the routed experts it holds */
    uint64_t rss_bytes;    /* its resident set then */
} serve_rank;
/* Every rank's (rank 0 of a job of more than one; else NULL and *n = 0). */
const serve_rank *serve_sched_ranks(serve_sched *s, int *n);
/* Under mpirun, once a rank is gone (moe_dist_lost): which (its index in the ranks; else -1)
 * and the message naming it into msg. The engine thread then fails every request with it (new
 * ones get SERVE_SUBMIT_RANK_LOST), and SERVE_RANK_LOST_LINGER_S later signals the process to
 * stop, so the job ends with that message. */
int serve_sched_lost(serve_sched *s, char *msg, size_t size);
const moe_tokenizer *serve_sched_tokenizer(serve_sched *s);
const moe_model *serve_sched_model(serve_sched *s);
uint32_t serve_sched_n_ctx(serve_sched *s);
/* The resident sequences kept beside the streams: --cache-slots, or its default (= --parallel).
 * Every rank of an mpirun job sizes its context with it: a follower with fewer sequences than
 * rank 0 would refuse a step rank 0 runs. */
int serve_cache_slots(const moe_serve_params *p);
/* --spec as it applies to model m: mtp when not given and m has an MTP layer; false with err
 * set when mtp is asked of a model without one. */
bool serve_spec_resolve(moe_serve_params *p, const moe_model *m, moe_error *err);

/* ==== Prompts and output: the model's chat template and its output parser (prompt.c) ==== */

typedef struct serve_tool_call {
    char *id, *name;
    char *arguments; /* JSON text of the arguments object */
} serve_tool_call;

void serve_tool_calls_free(serve_tool_call *calls, size_t n);

typedef struct serve_message {
    char *role;           /* system, user, assistant, tool */
    moe_strbuf content;   /* text, parts joined: NUL bytes may be inside (len counts) */
    moe_strbuf reasoning; /* assistant thinking (.s NULL: none) */
    serve_tool_call *tool_calls;
    size_t n_tool_calls;
    char *tool_call_id, *name; /* role tool: which call this answers */
} serve_message;

/* One request's conversation in OpenAI's terms, whichever API it came through. */
typedef struct serve_chat {
    serve_message *msgs;
    size_t n_msgs, cap_msgs;
    json_t *tools; /* OpenAI form: [{"type":"function","function":{name,description,parameters}}] */
    bool tool_choice_none;
    bool tool_required;      /* tool_choice required / a named tool / Anthropic any / tool */
    char *tool_name;         /* ... that one tool, or NULL: any of them */
    json_t *response_schema; /* structured output: a JSON schema, or NULL (json_object mode is
                              * {"type": "object"}) */
    json_t *kwargs; /* template variables from the request (serve_parse_template_kwargs), or NULL */
    int64_t think_budget; /* the request's thinking.budget_tokens, or -1 */
} serve_chat;

serve_message *serve_chat_add(serve_chat *c, const char *role);
void serve_chat_free(serve_chat *c);

typedef struct serve_server serve_server;
typedef struct serve_http serve_http;
typedef enum serve_api {
    SERVE_API_OPENAI,
    SERVE_API_ANTHROPIC,
} serve_api;

/* The server's template: --chat-template-file, the GGUF's, or the built-in ChatML; false (with
 * the reason) when the one asked for does not parse. */
bool serve_template_load(serve_server *srv, char *err, size_t err_size);
/* Template variables a request may set: add_generation_prompt (true), enable_thinking,
 * reasoning_effort (also Responses' reasoning.effort; "none" also sets enable_thinking false),
 * Anthropic's thinking.type, and every member of chat_template_kwargs (last, so it wins); and
 * thinking.budget_tokens. Replies 400 on a bad field. */
bool serve_parse_template_kwargs(serve_http *h, serve_api api, json_t *body, serve_chat *chat);
/* tool_choice asks for a call (of `name`, or any tool when NULL): 400 naming `field` when the
 * request has no tools or none of that name. */
bool serve_chat_force_tool(serve_http *h, serve_api api, serve_chat *chat, const char *name,
                           const char *field);
/* response_format (chat completions: {type: text | json_object | json_schema, json_schema:
 * {schema}}) or Responses' text.format ({type, schema}); 400 naming field when malformed. */
bool serve_parse_response_format(serve_http *h, serve_api api, json_t *format, const char *field,
                                 serve_chat *chat);
/* Render the conversation with the template and tokenize it into g; *text (may be NULL) gets
 * the prompt, *text_len (may be NULL) its length. Then the reasoning controls: the template's
 * reasoning tags as tokens, and the budget -- the least of --reasoning-budget, the request's
 * thinking.budget_tokens and, for a template without the switch asked for, 0 for thinking off
 * (enable_thinking false) or a budget for a low reasoning_effort. A budget of 0 with the prompt
 * inside a reasoning block closes the block in the prompt itself. Last, when the request forces
 * a tool call or asks for JSON, the grammar that makes the reply one (400 when it cannot be
 * built, or when the request also has its own `grammar`). Replies 400 with the template's
 * message when it raises, or when the prompt does not fit the context. */
bool serve_chat_prompt(serve_http *h, serve_api api, const serve_chat *chat, serve_gen *g,
                       char **text, size_t *text_len);

/* Model text -> content, reasoning and tool calls, as it streams. */
typedef enum serve_segment_kind {
    SERVE_SEG_CONTENT,
    SERVE_SEG_REASONING,
    SERVE_SEG_TOOL_CALL,
} serve_segment_kind;

typedef struct serve_segment {
    serve_segment_kind kind;
    const char *text; /* CONTENT / REASONING */
    size_t len;
    const char *name, *arguments; /* TOOL_CALL: arguments as compact JSON text */
} serve_segment;

typedef void (*serve_segment_fn)(void *ud, const serve_segment *seg);

typedef struct serve_output {
    moe_chat_parser *parser; /* NULL: plain text, all content (/v1/completions) */
    moe_chat_delta delta;
} serve_output;

/* The parser for a chat request's reply: the template's format and reasoning tags, whether
 * `prompt` left reasoning open, the request's tools (none: call markup is content). chat NULL:
 * plain text. */
void serve_output_init(serve_output *o, const serve_server *srv, const serve_chat *chat,
                       const char *prompt);
/* Each piece of text the feed settles goes to fn; bytes that may start a marker wait. */
void serve_output_feed(serve_output *o, const char *text, size_t len, serve_segment_fn fn,
                       void *ud);
void serve_output_finish(serve_output *o, serve_segment_fn fn, void *ud);
void serve_output_free(serve_output *o);

/* ==== Transport (http.c): the server, one request's exchange, replies, streams ==== */

typedef struct serve_net serve_net; /* http.c's: connections, the watcher */

struct serve_server {
    moe_serve_params p;
    serve_net *net;
    char model_id[256];
    serve_sched *sched;
    moe_chat_template *tmpl; /* immutable once loaded: every HTTP thread renders with it */
    char tmpl_origin[512];   /* for the start-up line */
    serve_metrics metrics;
    double t_start;
    atomic_ulong next_id;
};

typedef struct serve_exchange serve_exchange; /* http.c's: one request on its connection */

/* One HTTP exchange, from the access handler's point of view (rebuilt at every call). */
struct serve_http {
    serve_server *srv;
    struct MHD_Connection *conn; /* NULL: an exchange without a connection (fuzz/http.c): the
                                  * reply's body goes to offline_reply, headers are absent */
    moe_strbuf *offline_reply;
    serve_exchange *ex;
    const char *method, *path;
    const char *body;
    size_t body_len;
    int status; /* what was sent (access log, metrics); 499: the client went away */
    bool replied;
    bool parked;             /* serve_park was called: the exchange goes on later */
    bool hung_up;            /* resumed because the client went away */
    int retry_after;         /* seconds for a Retry-After header, 0: none */
    const char *cors_origin; /* an allowed cross-origin request's Origin: echoed back */
    uint32_t log_prompt, log_completion, log_cached;
    /* more reply headers (web.c's page): name, value, ..., NULL */
    const char *const *extra_headers;
};

void serve_reply_json(serve_http *h, int status, const moe_json *j);
void serve_reply_text(serve_http *h, int status, const char *content_type, const char *text,
                      size_t len);

/* A handler that must wait for the engine parks its exchange instead of blocking an HTTP
 * thread: fn(h, ud) runs again, on an HTTP thread with h rebuilt, at every piece of news of req
 * (events, admission, the end), after the client hung up (h->hung_up; req is then cancelled),
 * and at `deadline` (serve_now() seconds; 0: none). While parked, libmicrohttpd does not look
 * at the connection; the transport's watcher does. fn replies, hands over a stream, parks again,
 * or (client gone) does none of these. drop(ud) frees ud if the connection ends while parked. */
typedef void (*serve_resume_fn)(serve_http *h, void *ud);
void serve_park(serve_http *h, serve_req *req, double deadline, serve_resume_fn fn,
                void (*drop)(void *ud), void *ud);
const char *serve_header(serve_http *h, const char *name);

/* web.c: GET / (the chat page), /chat.js, /chat.css, embedded in the binary. */
void serve_web_asset(serve_http *h);

/* A server-sent-event stream: the pump (generate.c's) turns taken events into SSE bytes. */
typedef struct serve_sse serve_sse;
typedef void (*serve_sse_pump)(serve_sse *s, const serve_taken *t);
struct serve_sse {
    serve_http h_copy; /* srv, ex, for the pump and the transport */
    serve_req *req;
    serve_taken taken;
    moe_strbuf out; /* SSE bytes not yet handed over */
    size_t out_off;
    bool ended;
    bool first_pending; /* taken holds events not yet pumped */
    double last_write;
    const char *keepalive; /* bytes sent after keepalive_s of silence */
    serve_sse_pump pump;
    void (*state_free)(void *state);
    void *state;
    moe_json j; /* scratch for event payloads */
    double t_start;
    char log_path[64];
};

/* Hand the request's stream to libmicrohttpd; the SSE object owns req, state and the events
 * already taken in *first (which it moves from) from here on. */
void serve_reply_sse(serve_http *h, serve_req *req, serve_taken *first, serve_sse_pump pump,
                     void *state, void (*state_free)(void *), const char *keepalive);
/* Append one SSE event (event line only when event is not NULL) whose data is the JSON in s->j. */
void serve_sse_event(serve_sse *s, const char *event);

/* ==== Helpers the adapters share (request.c) ==== */

/* An error in the API's shape; the error type follows from the status. param: the request
 * field at fault, or NULL; code: OpenAI's error code (invalid_api_key, ...), or NULL. */
void serve_reply_error(serve_http *h, serve_api api, int status, const char *param,
                       const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
/* In a parser returning bool: answer 400 naming the request field at fault, and return false. */
#define SERVE_BAD(h, api, field, ...)                                                              \
    do {                                                                                           \
        serve_reply_error(h, api, 400, field, NULL, __VA_ARGS__);                                  \
        return false;                                                                              \
    } while (0)
/* PREFIX + time + a counter: unique within the server's life. */
void serve_make_id(serve_server *srv, const char *prefix, char *out, size_t size);
/* Sampling fields common to the APIs (temperature, top_p, top_k, min_p, seed, penalties,
 * logit_bias, stop); replies 400 naming the field and returns false on a bad value. */
bool serve_parse_sampling(serve_http *h, serve_api api, json_t *body, serve_gen *g,
                          const char *stop_field);
/* Take ids (malloc'd; freed on failure) as g's prompt, checking it fits the context (400 "N
 * tokens of M"). */
bool serve_set_prompt(serve_http *h, serve_api api, int32_t *ids, size_t n, serve_gen *g);
/* Tokenize a raw prompt (specials parsed: /v1/completions) into g->prompt via serve_set_prompt. */
bool serve_tokenize_prompt(serve_http *h, serve_api api, const char *text, size_t len,
                           serve_gen *g);
/* Parse the body as JSON (400 on malformed or too deep), returning an object or NULL. */
json_t *serve_parse_body(serve_http *h, serve_api api);

/* Nesting depth of a JSON text, counting brackets outside strings (cheap, no recursion). */
size_t serve_json_depth(const char *s, size_t n);
/* Write a jansson value through our writer. */
void serve_json_value(moe_json *j, json_t *v);
/* Write a token's text piece (raw bytes) as a JSON string / array of byte values. */
void serve_json_token_piece(moe_json *j, const moe_tokenizer *tok, int32_t id);
void serve_json_token_bytes(moe_json *j, const moe_tokenizer *tok, int32_t id);

/* ==== The generation skeleton (generate.c) ==== */

typedef struct serve_adapter serve_adapter;

/* The answer to one generating request, whatever its API: the first member of every adapter's
 * per-request state (so the state and its answer are one pointer). */
typedef struct serve_answer {
    const serve_adapter *adapter;
    const char *id_prefix; /* of the response's id */
    serve_server *srv;
    serve_sse *sse;   /* streaming: the stream, set before each callback; NULL: a whole response */
    serve_output out; /* the model's text -> content, reasoning, tool calls */
    serve_tool_call *calls; /* [n_calls] the model's tool calls so far (serve_answer_call) */
    size_t n_calls;
    char id[64];  /* the response's id */
    long created; /* unix seconds */
    bool started; /* streaming: the opening events are out */
} serve_answer;

/* One API's shape of a generation's reply. Each callback gets the state (a serve_answer first);
 * the stream_* ones run under the request's lock and write events into answer.sse with
 * serve_sse_event. */
struct serve_adapter {
    serve_api api;         /* the shape of its errors */
    const char *keepalive; /* SSE bytes sent after keepalive_s of silence */
    /* streaming: the events before any output */
    void (*stream_begin)(void *state, const serve_req *r);
    /* both ways: taken events through the output parser (answer.sse says which way) */
    void (*feed)(void *state, const serve_taken *t);
    /* streaming: the closing events of a generation that finished, or that failed (why) */
    void (*stream_end)(void *state, const serve_req *r);
    void (*stream_error)(void *state, const char *why);
    /* the whole response of a finished generation */
    void (*whole)(moe_json *j, void *state, const serve_req *r);
    /* free what the adapter's own fields hold (the skeleton frees its part and the state) */
    void (*clear)(void *state);
};

/* A zeroed state of state_size bytes (a serve_answer first) for the adapter. */
void *serve_answer_new(const serve_adapter *a, size_t state_size, const char *id_prefix);
/* Record a tool call the model made in ans->calls, under a new id (serve_make_id with id_prefix).
 */
const serve_tool_call *serve_answer_call(serve_answer *ans, const char *id_prefix,
                                         const serve_segment *seg);
/* Everything after parsing a generating request. ok false (the parsing has replied): only frees.
 * Else: the answer's id and output parser, submit and wait for a stream (429 / 503 / hang-up), then
 * stream (the adapter's events around every take) or wait for the end and reply the whole response
 * (500 in the API's shape when the generation failed). req and the state are freed, or belong
 * to the stream; chat and prompt stay the caller's. */
void serve_generate(serve_http *h, serve_answer *ans, serve_req *req, const serve_chat *chat,
                    const char *prompt, bool ok, bool stream);

/* ==== Replaying model output (the tests' view of the adapters) ====
 * A finished generation whose model output was `text`, arriving in pieces of `chunk` bytes (0:
 * whole), through the adapter's own callbacks: the stream's SSE bytes into *out, or the whole
 * response JSON. Requests run the same callbacks on the engine's events; tests use this to
 * check the APIs' shapes without a model. Frees the state. */
void serve_replay(serve_answer *ans, serve_server *srv, const serve_chat *chat, const char *prompt,
                  const char *text, size_t chunk, bool stream, moe_strbuf *out);
/* Per API: the request's conversation (tools) and rendered prompt set up the output parser as a
 * live request would. */
void serve_openai_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                         const char *text, size_t chunk, bool stream, moe_strbuf *out);
void serve_anthropic_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                            const char *text, size_t chunk, bool stream, moe_strbuf *out);
void serve_responses_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                            const char *text, size_t chunk, bool stream, moe_strbuf *out);

/* ==== Routing (router.c) ==== */

/* The handler for h's method and path, behind the API key and model-loading checks; 404, 405,
 * 401 or 503 in the request's API shape otherwise. */
void serve_route(serve_http *h);
/* The API whose error shape a reply to h takes: Anthropic for /v1/messages* or an
 * anthropic-version header, else OpenAI. */
serve_api serve_route_api(serve_http *h);
/* One finished exchange: its endpoint's counter for the status class (in /metrics). */
void serve_metrics_count(serve_server *srv, const char *path, int status);

/* ==== API adapters (routes) ==== */

void serve_openai_chat(serve_http *h);
void serve_openai_completions(serve_http *h);
void serve_openai_models(serve_http *h);
void serve_openai_apply_template(serve_http *h);
void serve_openai_responses(serve_http *h);
void serve_anthropic_messages(serve_http *h);
void serve_anthropic_count_tokens(serve_http *h);
void serve_anthropic_models(serve_http *h);

/* OpenAI content (a string, null, or text parts) appended to *out as one string; false after
 * answering 400. */
bool serve_openai_content_text(serve_http *h, json_t *content, const char *field, moe_strbuf *out);

/* Anthropic's and Responses' flat tool definitions ({type, name, description, <schema_key>})
 * in OpenAI's nested shape, the one chat templates expect. keep_type: the type kept ("function");
 * NULL keeps untyped and "custom" entries (Anthropic). Other types (server tools) are skipped.
 * NULL with *bad = the index of an entry without a string name. */
json_t *serve_tools_from_flat(json_t *tools, const char *keep_type, const char *schema_key,
                              size_t *bad);

#endif
