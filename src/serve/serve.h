/* serve: the HTTP server behind `moe serve` -- OpenAI, Anthropic and Responses APIs on one
 * continuous-batching scheduler.
 *
 * One engine thread owns the model, the context (KV cache of every sequence) and the
 * scheduler; a few HTTP threads (libmicrohttpd's epoll workers, each serving many connections)
 * parse and validate requests, tokenize, enqueue, and turn the engine's token events into JSON or
 * SSE without ever waiting for them (a waiting request is parked). The trap: nothing on
 * an HTTP thread may touch the model or the context -- they talk to the engine thread only
 * through a request's event queue (see serve_internal.h). */
#ifndef MOE_SERVE_H
#define MOE_SERVE_H

#include <stdbool.h>
#include <stdint.h>

#include "../engine/engine.h"

#define MOE_SERVE_MAX_API_KEYS 16

typedef struct moe_serve_params {
    const char *model_path;         /* the GGUF file (cli/ stands in the demo model's) */
    const char *alias;              /* model id in the APIs (NULL: the file name without .gguf) */
    const char *chat_template_file; /* a .jinja file over the model's own template, or NULL */
    const char *host;               /* address to bind (default 127.0.0.1) */
    int port;                       /* 0: any free port (printed on stdout) */
    const char *api_keys[MOE_SERVE_MAX_API_KEYS];
    int n_api_keys;              /* 0: no authentication */
    uint32_t n_ctx;              /* per sequence (0: the model's, capped) */
    int parallel;                /* streams decoded together */
    int cache_slots;             /* extra resident sequences kept for prefix reuse */
    int n_threads;               /* forward-pass threads */
    moe_type kv_type;            /* KV cache elements: F32 or F16 */
    int queue_limit;             /* requests waiting for a stream before 429 */
    double queue_timeout_s;      /* waiting longer than this: 503 */
    double keepalive_s;          /* SSE keep-alive interval */
    int step_delay_ms;           /* tests only: sleep after each forward step */
    bool use_mmap;               /* keep weights in the mapped file (default: anonymous memory) */
    bool no_repack;              /* --no-repack: the weights stay in the file's layout (else
                                  * moe_model_repack, in anonymous memory only) */
    uint64_t expert_cache_bytes; /* --expert-cache: routed experts read on demand (0: resident) */
    const char *cache_dir;       /* disk prefix cache directory, or NULL (off) */
    uint64_t cache_disk_bytes;   /* its size limit (0: SERVE_CACHE_DISK_DEFAULT) */
    const char *expert_stats, *pin_experts; /* --expert-stats, --pin-experts files, or NULL */
    int http_threads;                       /* libmicrohttpd's epoll workers */
    int max_connections; /* connections kept open; idle ones make room for newcomers */
    int max_connections_per_ip;
    double read_timeout_s;    /* a request's header and body must arrive within this */
    const char *cors;         /* "ORIGIN[,ORIGIN...]" allowed cross-origin ("*": any), or NULL */
    int64_t reasoning_budget; /* tokens of reasoning per reply before its block is closed
                               * (-1: no limit; 0: thinking off) */
    moe_spec_kind spec;       /* --spec: where each stream's speculative drafts come from */
    bool spec_given;          /* --spec was given; else mtp where the model has an MTP layer */
    moe_split split;          /* --split under mpirun: how the ranks share the routed experts */
    bool split_dense;         /* --split-dense: dense FFNs and shared experts split by rows too */
    uint32_t n_draft;         /* --draft N: drafts per stream and step (1..MOE_SPEC_MAX_DRAFT) */
    const char *grammar;      /* GBNF (checked) for requests that ask for no output format */
} moe_serve_params;

void moe_serve_params_default(moe_serve_params *p);
/* Load the model, listen, serve until SIGINT or SIGTERM. Prints "listening on http://HOST:PORT"
 * on stdout once the socket is bound. Returns the process exit status. */
int moe_serve_run(const moe_serve_params *p);
/* The other ranks of `mpirun -np K moe serve --split ...`: open the same model and context as
 * rank 0, then run rank 0's engine calls on them until it stops. Returns the exit status. */
int moe_serve_follow(const moe_serve_params *p);

#endif
