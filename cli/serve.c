/* serve.c: `moe serve [MODEL] [options]` -- the HTTP server (src/serve/). Without a model, the
 * built-in demo model. Prompts use the model's chat template (or --chat-template-file). Runs
 * until SIGINT / SIGTERM. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/serve/serve.h"
#include "args.h"
#include "cli.h"

static const char usage_text[] =
    "  --host ADDR        address to bind (default 127.0.0.1)\n"
    "  --port N           port (default 8080; 0: any free port, printed on stdout)\n"
    "  --api-key K        require this key (Authorization: Bearer K or x-api-key: K); repeatable\n"
    "  --alias NAME       model id reported by the APIs (default: the file name)\n"
    "  --chat-template-file FILE.jinja  render prompts with this template, not the model's\n"
    "  --ctx N            context per sequence (default: the model's, at most 4096)\n"
    "  --parallel B       streams decoded together in one batch (default 4)\n"
    "  --cache-slots N    extra finished sequences kept for prefix reuse (default: B)\n"
    "  -t, --threads T    forward-pass threads (default: the physical cores)\n"
    "  --kv-type f32|f16|q8_0  KV cache element type (default f16)\n"
    "  --expert-cache SIZE  routed experts read from the file on demand into a cache of SIZE\n"
    "                     (e.g. 12G); everything else stays resident\n"
    "  --expert-stats FILE  keep the cache's use counts in FILE: a restart reads the experts used\n"
    "                     most first\n"
    "  --pin-experts FILE experts always resident, one \"LAYER EXPERT\" per line\n"
    "  --split none|experts|rows  under mpirun: rank 0 serves, the other ranks run its steps on\n"
    "                     their share of the routed experts (see moe run --help)\n"
    "  --split-dense      with --split: dense FFNs and shared experts split by rows too\n"
    "  --mmap             serve weights from the mapped file (default: read into anonymous\n"
    "                     memory at load, so the host cannot reclaim their pages; not repacked)\n"
    "  --no-repack        keep the weights in the file's layout (default: matrices whose type\n"
    "                     has a faster kernel on a 16-row interleaved layout are repacked at\n"
    "                     load: same bytes, same logits)\n"
    "  --queue N          requests allowed to wait for a stream before 429 (default 64)\n"
    "  --queue-timeout S  seconds a request may wait before 503 (default 600)\n"
    "  --keepalive S      seconds of silence before an SSE keep-alive (default 15)\n"
    "  --http-threads N   HTTP worker threads, each serving many connections (default 4)\n"
    "  --max-connections N  connections kept open (default 1024); past it each newcomer\n"
    "                     closes the one idle the longest, or is refused when none is idle\n"
    "  --max-connections-per-ip N  the same for one client address (default 256)\n"
    "  --read-timeout S   seconds a client has to send a whole request, and that an idle\n"
    "                     keep-alive connection stays open (default 10)\n"
    "  --cors ORIGIN[,ORIGIN...]  let web pages from these origins call the API ('*': any);\n"
    "                     default: none (same-origin pages only; other Origins get 403)\n"
    "  --reasoning-budget N  at most N tokens of reasoning per reply: then the think block is\n"
    "                     closed and the answer follows (default -1: no limit; 0: thinking off)\n"
    "  --spec ngram|mtp|none  speculative decoding: each stream's drafts (prompt lookup over\n"
    "                     its tokens, or the model's MTP head) verified together in one step;\n"
    "                     output unchanged (default mtp where the model has an MTP layer, else\n"
    "                     none)\n"
    "  --draft N          drafts per stream and step with --spec (default 3, at most 16)\n"
    "  --cache-dir DIR    disk prefix cache: finished sequences are saved to DIR and a prompt\n"
    "                     they start is loaded from there, also after a restart (off by default)\n"
    "  --cache-disk-size SIZE  its size limit, least recently used entries go first\n"
    "                     (default 8G; K, M, G, T)\n"
    "  --step-delay MS    for tests: sleep MS after every forward step\n"
    "  --grammar-file F   GBNF grammar for every request that sets no grammar, response_format\n"
    "                     or forced tool call of its own\n";

void moe_cmd_serve_options(FILE *out) {
    fputs(usage_text, out);
}

int moe_cmd_serve(int argc, char **argv) {
    moe_serve_params p;
    moe_serve_params_default(&p);
    moe_engine_args engine = {.n_ctx = p.n_ctx, .n_threads = p.n_threads, .kv_type = p.kv_type};
    long long n;
    double f;
    char *grammar = NULL;
    for (int i = 0; i < argc; i++) {
        const int taken = moe_engine_args_parse("serve", &engine, argc, argv, &i);
        if (taken < 0) return 2;
        if (taken) continue;
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define INT_OPT(flag, lo, hi, dst)                                                                 \
    if (strcmp(a, flag) == 0) {                                                                    \
        if (!moe_arg_int("serve", flag, v, lo, hi, &n)) return 2;                                  \
        dst = (int)n;                                                                              \
        i++;                                                                                       \
        continue;                                                                                  \
    }
#define FLOAT_OPT(flag, lo, hi, dst)                                                               \
    if (strcmp(a, flag) == 0) {                                                                    \
        if (!moe_arg_float("serve", flag, v, lo, hi, &f)) return 2;                                \
        dst = f;                                                                                   \
        i++;                                                                                       \
        continue;                                                                                  \
    }
        INT_OPT("--port", 0, 65535, p.port)
        INT_OPT("--parallel", 1, 256, p.parallel)
        INT_OPT("--cache-slots", 0, 4096, p.cache_slots)
        INT_OPT("--queue", 0, 1 << 20, p.queue_limit)
        INT_OPT("--step-delay", 0, 60000, p.step_delay_ms)
        INT_OPT("--http-threads", 1, 64, p.http_threads)
        INT_OPT("--max-connections", 16, 1 << 20, p.max_connections)
        INT_OPT("--max-connections-per-ip", 1, 1 << 20, p.max_connections_per_ip)
        FLOAT_OPT("--read-timeout", 1, 3600, p.read_timeout_s)
        INT_OPT("--reasoning-budget", -1, 1 << 30, p.reasoning_budget)
        INT_OPT("--draft", 1, MOE_SPEC_MAX_DRAFT, p.n_draft)
        FLOAT_OPT("--queue-timeout", 0.01, 1e7, p.queue_timeout_s)
        FLOAT_OPT("--keepalive", 0.01, 1e5, p.keepalive_s)
#undef INT_OPT
#undef FLOAT_OPT
        if (strcmp(a, "--spec") == 0) {
            if (!moe_arg_spec("serve", v, &p.spec)) return 2;
            p.spec_given = true;
            i++;
        } else if (strcmp(a, "--host") == 0 && v) {
            p.host = v;
            i++;
        } else if (strcmp(a, "--cors") == 0 && v) {
            p.cors = v;
            i++;
        } else if (strcmp(a, "--alias") == 0 && v) {
            p.alias = v;
            i++;
        } else if (strcmp(a, "--chat-template-file") == 0 && v) {
            p.chat_template_file = v;
            i++;
        } else if (strcmp(a, "--api-key") == 0 && v) {
            if (p.n_api_keys == MOE_SERVE_MAX_API_KEYS)
                return moe_cli_usage_error("serve", "at most %d --api-key", MOE_SERVE_MAX_API_KEYS);
            p.api_keys[p.n_api_keys++] = v;
            i++;
        } else if (strcmp(a, "--grammar-file") == 0 && v) {
            if (!(grammar = moe_cli_read_grammar("serve", v))) return 2;
            p.grammar = grammar;
            i++;
        } else if (strcmp(a, "--cache-dir") == 0 && v) {
            p.cache_dir = v;
            i++;
        } else if (strcmp(a, "--cache-disk-size") == 0) {
            if (!moe_arg_size("serve", a, v, &p.cache_disk_bytes)) return 2;
            if (p.cache_disk_bytes == 0)
                return moe_cli_usage_error("serve", "--cache-disk-size must be above 0");
            i++;
        } else if (strcmp(a, "--mmap") == 0) {
            p.use_mmap = true;
        } else if (strcmp(a, "--help-options") == 0) {
            fputs(usage_text, stdout);
            return 0;
        } else if (a[0] == '-') {
            return moe_cli_unknown_option("serve", a);
        } else if (!p.model_path) {
            p.model_path = a;
        } else {
            return moe_cli_usage_error("serve", "unexpected argument '%s'", a);
        }
    }
    p.n_ctx = engine.n_ctx;
    p.n_threads = engine.n_threads;
    p.kv_type = engine.kv_type;
    p.expert_cache_bytes = engine.expert_cache_bytes;
    p.expert_stats = engine.expert_stats;
    p.pin_experts = engine.pin_experts;
    p.split = engine.split;
    p.split_dense = engine.split_dense;
    p.no_repack = engine.no_repack;
    if (!moe_engine_args_check("serve", &engine)) return 2;
    if (p.cache_slots + p.parallel > 4096)
        return moe_cli_usage_error("serve", "--parallel + --cache-slots must stay <= 4096");
    char *path = moe_arg_model_path("serve", p.model_path);
    if (!path) return 1;
    if (!p.model_path && !p.alias) p.alias = "moe-demo";
    p.model_path = path;
    const int rc = moe_dist_rank() == 0 ? moe_serve_run(&p) : moe_serve_follow(&p);
    free(path);
    free(grammar);
    return rc;
}
