/* bench.c: `moe bench MODEL [-t THREADS] [--runs N] [--pp N] [--tg N] [--streams 1,2,4,8]
 * [--stream-steps N] [--depth 1024,4096] [--verify N] [--accept 0.87,0.66,0.52]
 * [--spec ngram|mtp --prompt-file F [--draft N]] [--mmap] [--exact-too] [--csv | --json]` --
 * throughput of a model on this machine beside the machine's read bandwidth (src/tools/bench.c
 * measures; this file parses and prints). With --spec, greedy decode after a real prompt is also
 * measured with and without speculation, through run's generation loop (generate.c). `moe bench
 * --server URL
 * [--concurrency N] [--tokens N] [--repeats N] [--start-cmd CMD] [--svg FILE] [--json]` -- load
 * on a running server instead (src/tools/bench_server.c).
 *
 * Every text and CSV line names the kernel table and thread count, so a pasted line still says
 * what it measured. JSON is one object: pp_tok_s, tg_tok_s, depths [{depth, pp_tok_s, tg_tok_s}],
 * streams [{n, aggregate_tok_s, per_stream_tok_s}], verify [{rows, steps_s, cost_ratio}],
 * projected [{drafts, tok_s}], read_bw_gb_s, active_bytes_per_token, isa, threads, and the
 * ranges; with --exact-too, exact_tok_s beside each tok_s of pp, tg, depths and streams. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"
#include "generate.h"

static const char usage_text[] =
    "  -t, --threads N   threads for the forward pass and the bandwidth probe (default: the\n"
    "                    physical cores)\n"
    "  --runs N          timed runs per test after one warm-up (default 5)\n"
    "  --pp N            prefill test: one forward of N prompt rows (default 512; 0 skips)\n"
    "  --tg N            decode test: N single-row steps (default 128; 0 skips)\n"
    "  --streams LIST    batched decode: stream counts (default 1,2,4,8; 0 skips)\n"
    "  --stream-steps N  decode steps per batched test (default 32)\n"
    "  --depth LIST      prefill (--pp) and decode (--tg) tests after that many tokens of\n"
    "                    context, e.g. 8192,32768 (ascending; the context is filled once,\n"
    "                    untimed, 512 rows a step)\n"
    "  --verify N        speculation's ceiling: verify steps of 1..N rows of one sequence (the\n"
    "                    refused rows rolled back) against a 1-row step, --stream-steps each\n"
    "                    (default 4; 0 skips)\n"
    "  --accept LIST     acceptance by draft position (e.g. 0.87,0.66,0.52: the fraction of\n"
    "                    steps whose 1st, 2nd, 3rd draft is kept): the decode rate projected\n"
    "                    with 1, 2, 3 drafts per step from the verify costs\n"
    "  --spec ngram|mtp  also measure greedy decode (--tg tokens) after the --prompt-file's\n"
    "                    text with this speculation and without, in alternate runs: tok/s of\n"
    "                    both, tokens per step, drafts kept by position (as --accept takes them)\n"
    "  --prompt-file F   the prompt for --spec (e.g. code an agent quotes back: ngram drafts)\n"
    "  --draft N         drafts per step with --spec (default 3)\n"
    "  --probe-mib N     bandwidth probe buffer (default 512)\n"
    "  --kv-type f16|f32|q8_0 KV cache element type (default f16)\n"
    "  --ctx N           positions per sequence (default: the model's, capped)\n"
    "  --expert-cache SIZE  routed experts read on demand into a cache of SIZE; reports the\n"
    "                    decode's hit rate and disk bytes per token beside a disk probe\n"
    "  --expert-stats FILE  keep the expert cache's use counts across runs in FILE\n"
    "  --pin-experts FILE   experts always resident, one \"LAYER EXPERT\" per line\n"
    "  --mmap            keep the weights in the mapped file (default: copy to anonymous memory;\n"
    "                    not repacked)\n"
    "  --no-repack       keep the weights in the file's layout (default: matrices whose type has\n"
    "                    a faster kernel on a 16-row interleaved layout are repacked at load,\n"
    "                    not with --exact-too)\n"
    "  --exact-too       run pp, tg, depth and stream tests on the exact path (MOE_EXACT=1,\n"
    "                    ggml's float order) too, runs alternated with the fast path's; text\n"
    "                    and JSON report both\n"
    "  --split experts|rows  under `mpirun -np K` (a `make MPI=1` build): each rank runs its\n"
    "                    share of the routed experts (whole experts, or its rows of every one);\n"
    "                    reports decode time split into compute, reduction and waiting (a rank\n"
    "                    keeps only its share: rows always, experts with --mmap)\n"
    "  --split-dense     with --split: dense FFNs and shared experts split by rows too\n"
    "  --csv | --json    machine-readable output\n"
    "moe bench --server URL: load on a running OpenAI-compatible server (moe serve, ...)\n"
    "  --concurrency N   requests streamed at once (default 16)\n"
    "  --tokens N        output tokens per request, exactly (ignore_eos; default 256)\n"
    "  --repeats N       rounds of N concurrent requests; tok/s is their median (default 3)\n"
    "  --start-cmd CMD   start the server with /bin/sh -c CMD first, time it to ready (GET\n"
    "                    URL/health answers 200), stop it at the end\n"
    "  --ready-timeout S seconds --start-cmd may take (default 600)\n"
    "  --api-key K       sent as Authorization: Bearer K\n"
    "  --prompt TEXT     each request's prompt, after its index (default: a story's start)\n"
    "  --svg FILE        the latency distribution (TTFT, inter-token) as an SVG chart\n"
    "  --json            one JSON object\n";

void moe_cmd_bench_options(FILE *out) {
    fputs(usage_text, out);
}

/* An integer option: flag, where its value goes, its range. */
typedef struct int_opt {
    const char *flag;
    int *dst;
    long long lo, hi;
} int_opt;

/* a is one of opts: its value v read (1), or a usage error reported (-1); 0: not one of them. */
static int take_int_opt(const int_opt *opts, size_t n_opts, const char *a, const char *v) {
    for (size_t k = 0; k < n_opts; k++) {
        if (strcmp(a, opts[k].flag) != 0) continue;
        long long n;
        if (!moe_arg_int("bench", a, v, opts[k].lo, opts[k].hi, &n)) return -1;
        *opts[k].dst = (int)n;
        return 1;
    }
    return 0;
}

/* ==== moe bench --server ==== */

/* The object on stdout, one line after it; frees the writer. */
static void json_emit(moe_json *j) {
    fwrite(j->buf, 1, j->len, stdout);
    fputc('\n', stdout);
    moe_json_free(j);
}

static void print_server_json(const moe_bench_server_result *r, const moe_bench_server_params *p) {
    moe_json j;
    moe_json_init(&j, true);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "url", p->url);
    const struct {
        const char *key;
        uint64_t v;
    } counts[] = {{"concurrency", (uint64_t)p->concurrency},
                  {"tokens", (uint64_t)p->tokens},
                  {"repeats", (uint64_t)p->repeats},
                  {"requests", (uint64_t)r->requests},
                  {"errors", (uint64_t)r->errors},
                  {"output_tokens", r->output_tokens},
                  {"ttft_samples", r->n_ttft},
                  {"itl_samples", r->n_itl}};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        moe_json_kv_uint(&j, counts[i].key, counts[i].v);
    const struct {
        const char *key;
        double v;
    } figures[] = {
        {"output_tok_s", r->tok_s.median},  {"output_tok_s_min", r->tok_s.min},
        {"output_tok_s_max", r->tok_s.max}, {"ttft_p50_ms", r->ttft_p50 * 1e3},
        {"ttft_p99_ms", r->ttft_p99 * 1e3}, {"itl_p50_ms", r->itl_p50 * 1e3},
        {"itl_p99_ms", r->itl_p99 * 1e3},
    };
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++)
        moe_json_kv_double(&j, figures[i].key, figures[i].v);
    moe_json_key(&j, "time_to_ready_s");
    if (r->time_to_ready_s >= 0)
        moe_json_double(&j, r->time_to_ready_s);
    else
        moe_json_null(&j);
    moe_json_key(&j, "first_error");
    if (r->errors)
        moe_json_string(&j, r->first_error);
    else
        moe_json_null(&j);
    moe_json_object_end(&j);
    json_emit(&j);
}

static void print_server_text(const moe_bench_server_result *r, const moe_bench_server_params *p) {
    printf("moe bench --server %s: %d concurrent requests x %d tokens, %d repeats\n", p->url,
           p->concurrency, p->tokens, p->repeats);
    if (r->time_to_ready_s >= 0)
        printf("time to ready:   %.3f s (--start-cmd)\n", r->time_to_ready_s);
    printf("output:          %.2f tok/s median (%.2f - %.2f), %llu tokens\n", r->tok_s.median,
           r->tok_s.min, r->tok_s.max, (unsigned long long)r->output_tokens);
    printf("time to first:   p50 %.2f ms, p99 %.2f ms (%zu requests)\n", r->ttft_p50 * 1e3,
           r->ttft_p99 * 1e3, r->n_ttft);
    printf("between tokens:  p50 %.2f ms, p99 %.2f ms (%zu gaps)\n", r->itl_p50 * 1e3,
           r->itl_p99 * 1e3, r->n_itl);
    printf("errors:          %d of %d requests%s%s\n", r->errors, r->requests,
           r->errors ? "; first: " : "", r->errors ? r->first_error : "");
}

/* The error on stderr; the exit status. */
static int failed(const moe_error *err) {
    fprintf(stderr, "moe bench: %s\n", err->msg);
    return 1;
}

static int bench_server(int argc, char **argv) {
    moe_bench_server_params p;
    moe_bench_server_params_default(&p);
    const char *svg = NULL;
    bool json = false;
    double f;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const int_opt ints[] = {
            {"--concurrency", &p.concurrency, 1, MOE_BENCH_SERVER_MAX_CONCURRENCY},
            {"--tokens", &p.tokens, 1, 1 << 20},
            {"--repeats", &p.repeats, 1, MOE_BENCH_MAX_RUNS},
        };
        const int took = take_int_opt(ints, sizeof ints / sizeof ints[0], a, v);
        if (took < 0) return 2;
        bool taken = took > 0;
        const struct {
            const char *flag;
            const char **dst;
        } strs[] = {{"--server", &p.url},
                    {"--start-cmd", &p.start_cmd},
                    {"--api-key", &p.api_key},
                    {"--prompt", &p.prompt},
                    {"--svg", &svg}};
        for (size_t k = 0; k < sizeof strs / sizeof strs[0] && !taken; k++) {
            if (strcmp(a, strs[k].flag) != 0) continue;
            if (!v) return moe_cli_usage_error("bench", "%s needs a value", a);
            *strs[k].dst = v;
            taken = true;
        }
        if (taken) {
            i++;
        } else if (strcmp(a, "--ready-timeout") == 0) {
            if (!moe_arg_float("bench", a, v, 0.1, 1e6, &f)) return 2;
            p.ready_timeout_s = f;
            i++;
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (strcmp(a, "--help-options") == 0) {
            fputs(usage_text, stdout);
            return 0;
        } else if (a[0] == '-') {
            return moe_cli_unknown_option("bench", a);
        } else {
            return moe_cli_usage_error("bench", "--server: unexpected argument '%s'", a);
        }
    }
    char url[2048];
    snprintf(url, sizeof url, "%s", p.url);
    for (size_t len = strlen(url); len && url[len - 1] == '/';) url[--len] = '\0';
    p.url = url;
    moe_bench_server_result r;
    moe_error err = {0};
    if (moe_bench_server_run(&p, &r, &err) != MOE_OK) return failed(&err);
    (json ? print_server_json : print_server_text)(&r, &p);
    int rc = r.errors ? 1 : 0;
    if (svg) {
        char sub[2300];
        snprintf(sub, sizeof sub, "%s: %d concurrent x %d tokens, %d repeats; %.1f tok/s", p.url,
                 p.concurrency, p.tokens, p.repeats, r.tok_s.median);
        char *text = moe_latency_svg(&r, sub);
        if (moe_file_write(svg, text, strlen(text), &err) != MOE_OK) rc = failed(&err);
        free(text);
    }
    moe_bench_server_result_free(&r);
    return rc;
}

/* ==== Measured speculation (--spec, --prompt-file) ==== */

typedef struct spec_bench {
    moe_spec_kind kind; /* MOE_SPEC_NONE: not measured */
    const char *prompt_file;
    int n_draft;
    uint32_t n_prompt;
    moe_bench_figure plain, spec; /* decode tok/s (gb_s unused) */
    uint64_t steps, generated;    /* the timed speculative runs' */
    uint64_t drafted[MOE_SPEC_MAX_DRAFT], accepted[MOE_SPEC_MAX_DRAFT];
} spec_bench;

static const char *spec_name(moe_spec_kind k) {
    return k == MOE_SPEC_MTP ? "mtp" : k == MOE_SPEC_NGRAM ? "ngram" : "none";
}

/* One run: sequence 0 from empty, the prompt prefilled (untimed), n_gen greedy tokens with
 * g->opt.spec; returns decode tok/s, or -1 on an error (reported). */
static double spec_run(moe_gen *g, const int32_t *ids, size_t n_ids, int n_gen) {
    moe_error err = {0};
    moe_gen_reset(g);
    if (!moe_gen_prefill(g, ids, n_ids, &err) || !moe_gen_run(g, n_gen, NULL, &err)) {
        fprintf(stderr, "moe bench: --spec: %s\n", err.msg);
        return -1;
    }
    return g->gen_seconds > 0 ? (double)g->n_generated / g->gen_seconds : 0;
}

/* Warm-up, then p->runs pairs of runs, plain and speculative in turn (so that the machine's
 * drift falls on both); the replies must be equal (greedy: speculation changes no token). */
static bool spec_measure(const moe_bench_params *p, spec_bench *sb) {
    moe_gen_options o;
    moe_gen_options_default(&o);
    o.model_path = p->model_path;
    o.n_predict = p->n_gen;
    o.sampling.temperature = 0;
    o.ignore_eos = true;
    o.quiet = true;
    o.spec = sb->kind;
    o.spec_given = true;
    o.n_draft = (uint32_t)sb->n_draft;
    o.engine.n_threads = p->n_threads;
    o.engine.kv_type = p->kv_type;
    o.engine.expert_cache_bytes = p->expert_cache_bytes;
    moe_error err = {0};
    uint8_t *text = NULL;
    size_t size = 0;
    if (moe_file_read(sb->prompt_file, &text, &size, &err) != MOE_OK) {
        fprintf(stderr, "moe bench: --prompt-file: %s\n", err.msg);
        return false;
    }
    moe_gen g;
    if (!moe_gen_open(&g, &o, "bench")) {
        free(text);
        return false;
    }
    int32_t *ids = NULL;
    size_t n_ids = 0;
    moe_tokenizer_encode(g.tok, (const char *)text, size,
                         MOE_ENCODE_ADD_SPECIAL | MOE_ENCODE_PARSE_SPECIAL, &ids, &n_ids, &err);
    free(text);
    if (!err.code &&
        (n_ids == 0 || n_ids + (size_t)p->n_gen + (size_t)sb->n_draft + 1 > moe_ctx_n_ctx(g.ctx)))
        moe_error_set(&err, MOE_ERR_ARG,
                      "%s: %zu prompt tokens and --tg %d do not fit the context of %u (or the "
                      "prompt is empty)",
                      sb->prompt_file, n_ids, p->n_gen, moe_ctx_n_ctx(g.ctx));
    bool ok = !err.code;
    if (!ok) fprintf(stderr, "moe bench: --spec: %s\n", err.msg);
    sb->n_prompt = (uint32_t)n_ids;
    double plain[MOE_BENCH_MAX_RUNS], spec[MOE_BENCH_MAX_RUNS];
    char *reply = NULL;
    for (int run = -1; ok && run < p->runs; run++) { /* run -1: the warm-up */
        g.opt.spec = MOE_SPEC_NONE;
        const double a = spec_run(&g, ids, n_ids, p->n_gen);
        if (!reply) reply = moe_xstrdup(g.reply ? g.reply : "");
        g.opt.spec = sb->kind;
        const double b = spec_run(&g, ids, n_ids, p->n_gen);
        ok = a >= 0 && b >= 0;
        if (ok && strcmp(reply, g.reply ? g.reply : "") != 0) {
            fprintf(stderr, "moe bench: --spec %s changed the greedy reply: a bug\n",
                    spec_name(sb->kind));
            ok = false;
        }
        if (!ok || run < 0) continue;
        plain[run] = a;
        spec[run] = b;
        sb->steps += g.n_steps;
        sb->generated += g.n_generated;
        for (int k = 0; k < MOE_SPEC_MAX_DRAFT; k++) {
            sb->drafted[k] += g.drafted[k];
            sb->accepted[k] += g.accepted[k];
        }
    }
    if (ok) {
        moe_bench_median_range(plain, p->runs, &sb->plain.median, &sb->plain.min, &sb->plain.max);
        moe_bench_median_range(spec, p->runs, &sb->spec.median, &sb->spec.min, &sb->spec.max);
    }
    free(reply);
    free(ids);
    moe_gen_close(&g);
    return ok;
}

/* The fraction of steps whose k-th draft was kept (what --accept takes). */
static double spec_profile(const spec_bench *sb, int k) {
    return sb->steps ? (double)sb->accepted[k] / (double)sb->steps : 0;
}

static void print_spec_text(const spec_bench *sb, const moe_bench_result *r,
                            const moe_bench_params *p) {
    printf("measured speculation: --spec %s --draft %d, greedy tg%d after %s (%u prompt tokens), "
           "median of %d runs alternated with plain decode  [%s, %d threads]\n",
           spec_name(sb->kind), sb->n_draft, p->n_gen, sb->prompt_file, sb->n_prompt, p->runs,
           r->isa, r->threads);
    printf("%-12s %10.2f %8.2f - %8.2f\n", "plain", sb->plain.median, sb->plain.min, sb->plain.max);
    printf("%-12s %10.2f %8.2f - %8.2f  %.2fx plain\n", spec_name(sb->kind), sb->spec.median,
           sb->spec.min, sb->spec.max,
           sb->plain.median > 0 ? sb->spec.median / sb->plain.median : 0);
    printf("%.2f tokens per step; drafts kept by position:",
           sb->steps ? (double)sb->generated / (double)sb->steps : 0.0);
    for (int k = 0; k < sb->n_draft && sb->drafted[k]; k++)
        printf(" %d: %.0f%% of %llu", k + 1, 100.0 * (double)sb->accepted[k] / sb->drafted[k],
               (unsigned long long)sb->drafted[k]);
    printf("; as --accept:");
    for (int k = 0; k < sb->n_draft; k++) printf("%s%.2f", k ? "," : " ", spec_profile(sb, k));
    printf("\n");
}

/* With --exact-too: a figure's exact-path line, under its fast-path one. */
static void print_exact(const moe_bench_result *r, const moe_bench_figure *f, double probe) {
    if (f->exact_median <= 0) return;
    printf("%-12s %10.2f %8.2f - %8.2f %11s %8.1f %7.0f%%  %s, %d  (fast path %.2fx)\n", "  exact",
           f->exact_median, f->exact_min, f->exact_max, "", f->exact_gb_s,
           100 * f->exact_gb_s / probe, r->isa, r->threads, f->median / f->exact_median);
}

static void print_text(const moe_bench_result *r, const moe_bench_params *p) {
    const moe_bandwidth *bw = &r->bandwidth;
    const double probe = bw->median_gb_s;
    printf("moe bench: %s, %u layers, %u experts (%u used); weights %s (%.2f GB, %.1f s); "
           "KV %s; kernels %s, %d threads, median of %d runs (range)\n",
           r->arch, r->n_layer, r->n_expert, r->n_expert_used,
           r->in_memory ? "in anonymous memory" : "mapped from the file",
           (double)r->loaded_bytes / 1e9, r->load_seconds, moe_type_name(p->kv_type), r->isa,
           r->threads, r->runs);
    printf("read bandwidth: %.1f GB/s (%.1f-%.1f; probe: %d threads, %d-byte loads, %zu MiB)  "
           "[%s, %d threads]\n",
           probe, bw->min_gb_s, bw->max_gb_s, bw->threads, bw->load_bytes, bw->bytes >> 20, r->isa,
           r->threads);
    if (r->active_bytes_per_token > 0 && (r->experts_per_token > 0 || !r->n_expert))
        printf("active bytes per token: %.1f MB (dense %.1f MB + routed experts %.1f MB: %.2f of "
               "%u experts x %u layers x %.2f MB)  [%s, %d threads]\n",
               r->active_bytes_per_token / 1e6, (r->dense_bytes + r->embd_row_bytes) / 1e6,
               r->experts_per_token * r->moe_layers * r->expert_bytes / 1e6, r->experts_per_token,
               r->n_expert, r->moe_layers, r->expert_bytes / 1e6, r->isa, r->threads);
    else /* the routed experts a token reads are counted in the single-stream decode test */
        printf("active bytes per token: not measured (dense %.1f MB; the routed experts are "
               "counted by the decode test, --tg N)  [%s, %d threads]\n",
               (r->dense_bytes + r->embd_row_bytes) / 1e6, r->isa, r->threads);
    if (p->split != MOE_SPLIT_NONE && r->tg_seconds > 0) {
        const double tokens = (double)(p->runs + 1) * p->n_gen, ms = 1e3 / tokens;
        const moe_dist_times *d = &r->tg_dist;
        printf("ranks: %d, routed experts split by %s; decode per token: compute %.2f ms, "
               "reduction %.3f ms, waiting %.3f ms (%.1f sums of %.1f KiB per token)\n",
               r->ranks, p->split == MOE_SPLIT_ROWS ? "rows" : "expert",
               (r->tg_seconds - d->reduce_seconds - d->wait_seconds) * ms, d->reduce_seconds * ms,
               d->wait_seconds * ms, (double)d->sums / tokens,
               d->sums ? (double)d->bytes / (double)d->sums / 1024.0 : 0.0);
    }
    const moe_expert_cache_stats *cs = &r->tg_cache;
    if (cs->slots && r->tg_cache_tokens > 0) {
        const double per_tok = (double)cs->bytes_read / 1048576.0 / r->tg_cache_tokens;
        printf("expert cache: %u experts of %.2f MiB (%.0f%% of the %u x %u), decode: hit rate "
               "%.1f%%, %.2f MiB from disk per token read at %.0f MiB/s, %.1f ms per token "
               "waiting for reads; disk probe: %.0f MiB/s%s, so the disk alone allows %.1f tok/s\n",
               cs->slots, (double)cs->slot_bytes / 1048576.0,
               100.0 * cs->slots / ((double)r->moe_layers * r->n_expert), r->moe_layers,
               r->n_expert, 100.0 * (double)cs->hits / (double)(cs->hits + cs->misses + !cs->hits),
               per_tok,
               cs->busy_seconds > 0 ? (double)cs->bytes_read / 1048576.0 / cs->busy_seconds : 0.0,
               1e3 * cs->read_seconds / r->tg_cache_tokens, r->disk_mib_s,
               r->disk_direct ? " (O_DIRECT)" : " (through the page cache)",
               per_tok > 0 ? r->disk_mib_s / per_tok : 0.0);
    }
    printf("%-12s %10s %19s %11s %8s %8s  isa, threads  [%s, %d threads]\n", "test", "tok/s",
           "range", "per stream", "GB/s", "% probe", r->isa, r->threads);
    const struct {
        const char *name;
        const moe_bench_figure *f;
    } tests[] = {{"pp", &r->pp}, {"tg", &r->tg}};
    char label[32];
    for (int i = 0; i < 2; i++) {
        const moe_bench_figure *f = tests[i].f;
        if (f->median <= 0) continue;
        snprintf(label, sizeof label, "%s%d", tests[i].name, i ? p->n_gen : p->n_prompt);
        printf("%-12s %10.2f %8.2f - %8.2f %11s %8.1f %7.0f%%  %s, %d\n", label, f->median, f->min,
               f->max, "", f->gb_s, 100 * f->gb_s / probe, r->isa, r->threads);
        print_exact(r, f, probe);
    }
    for (int i = 0; i < p->n_depths; i++) {
        const moe_bench_figure *f = &r->pp_depth[i];
        snprintf(label, sizeof label, "pp%d@d%d", p->n_prompt, p->depths[i]);
        if (f->median > 0)
            printf("%-12s %10.2f %8.2f - %8.2f %11s %8.1f %7.0f%%  %s, %d\n", label, f->median,
                   f->min, f->max, "", f->gb_s, 100 * f->gb_s / probe, r->isa, r->threads);
        f = &r->tg_depth[i];
        if (f->median <= 0) continue;
        snprintf(label, sizeof label, "tg%d@d%d", p->n_gen, p->depths[i]);
        printf("%-12s %10.2f %8.2f - %8.2f %11s %8.1f %7.0f%%  %s, %d  (%.2f ms per token", label,
               f->median, f->min, f->max, "", f->gb_s, 100 * f->gb_s / probe, r->isa, r->threads,
               f->median > 0 ? 1e3 / f->median : 0.0);
        if (r->score_ms[i] > 0 || r->attend_ms[i] > 0)
            printf("; sparse MLA layers: indexer scoring %.3f ms, attention %.3f ms",
                   r->score_ms[i], r->attend_ms[i]);
        printf(")\n");
        print_exact(r, f, probe);
    }
    if (p->n_depths)
        printf("context filled to %d tokens in %.1f s (untimed)  [%s, %d threads]\n",
               p->depths[p->n_depths - 1], r->fill_seconds, r->isa, r->threads);
    for (int i = 0; i < r->n_streams; i++) {
        const moe_bench_stream *s = &r->streams[i];
        snprintf(label, sizeof label, "streams %d", s->n);
        printf("%-12s %10.2f %8.2f - %8.2f %11.2f %8.1f %7.0f%%  %s, %d\n", label,
               s->aggregate.median, s->aggregate.min, s->aggregate.max, s->per_stream_tok_s,
               s->aggregate.gb_s, 100 * s->aggregate.gb_s / probe, r->isa, r->threads);
        print_exact(r, &s->aggregate, probe);
    }
    if (!r->n_verify) return;
    printf("verify steps (one sequence, all but the first row rolled back), %d steps each  [%s, "
           "%d threads]\n",
           p->stream_steps, r->isa, r->threads);
    printf("%-12s %10s %19s %11s  isa, threads  [%s, %d threads]\n", "test", "steps/s", "range",
           "cost x 1-row", r->isa, r->threads);
    printf("%-12s %10.2f %8.2f - %8.2f %11.2f  %s, %d\n", "decode 1", r->verify_base.median,
           r->verify_base.min, r->verify_base.max, 1.0, r->isa, r->threads);
    for (int k = 1; k <= r->n_verify; k++) {
        const moe_bench_figure *f = &r->verify[k - 1];
        snprintf(label, sizeof label, "verify %d", k);
        printf("%-12s %10.2f %8.2f - %8.2f %11.2f  %s, %d\n", label, f->median, f->min, f->max,
               r->verify_ratio[k - 1], r->isa, r->threads);
    }
    for (int d = 1; d <= r->n_projected; d++) {
        double tokens = 1;
        for (int i = 0; i < d; i++) tokens += p->accept[i];
        printf("projected with %d draft%s: %.2f tokens per step at %.2fx the cost of a 1-row step: "
               "%.2f tok/s (%.2fx plain decode)  [%s, %d threads]\n",
               d, d > 1 ? "s" : "", tokens, r->verify_ratio[d], r->projected_tok_s[d - 1],
               r->projected_tok_s[d - 1] / r->verify_base.median, r->isa, r->threads);
    }
}

static void csv_row(const moe_bench_result *r, const char *test, int n, const moe_bench_figure *f,
                    double per_stream) {
    printf("%s,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.2f,%.3f,%.0f,%s,%d,%d\n", test, n, f->median, f->min,
           f->max, per_stream, f->gb_s, 100 * f->gb_s / r->bandwidth.median_gb_s,
           r->bandwidth.median_gb_s, r->active_bytes_per_token, r->isa, r->threads, r->runs);
}

static void print_csv(const moe_bench_result *r, const moe_bench_params *p, const spec_bench *sb) {
    char pp[32], tg[32];
    snprintf(pp, sizeof pp, "pp%d", p->n_prompt);
    snprintf(tg, sizeof tg, "tg%d", p->n_gen);
    printf("test,streams,tok_s,tok_s_min,tok_s_max,per_stream_tok_s,gb_s,pct_of_probe,"
           "read_bw_gb_s,active_bytes_per_token,isa,threads,runs\n");
    if (r->pp.median > 0) csv_row(r, pp, 1, &r->pp, r->pp.median);
    if (r->tg.median > 0) csv_row(r, tg, 1, &r->tg, r->tg.median);
    for (int i = 0; i < p->n_depths; i++) {
        snprintf(pp, sizeof pp, "pp%d@d%d", p->n_prompt, p->depths[i]);
        if (r->pp_depth[i].median > 0) csv_row(r, pp, 1, &r->pp_depth[i], r->pp_depth[i].median);
        snprintf(tg, sizeof tg, "tg%d@d%d", p->n_gen, p->depths[i]);
        if (r->tg_depth[i].median > 0) csv_row(r, tg, 1, &r->tg_depth[i], r->tg_depth[i].median);
    }
    for (int i = 0; i < r->n_streams; i++)
        csv_row(r, "streams", r->streams[i].n, &r->streams[i].aggregate,
                r->streams[i].per_stream_tok_s);
    if (r->n_verify) csv_row(r, "decode1", 1, &r->verify_base, r->verify_base.median);
    for (int k = 1; k <= r->n_verify; k++) /* "streams": rows of the step; tok_s: steps per s */
        csv_row(r, "verify", k, &r->verify[k - 1], r->verify[k - 1].median);
    if (!sb->kind) return; /* "streams": the drafts per step */
    snprintf(tg, sizeof tg, "spec_plain_tg%d", p->n_gen);
    csv_row(r, tg, 0, &sb->plain, sb->plain.median);
    snprintf(tg, sizeof tg, "spec_%s_tg%d", spec_name(sb->kind), p->n_gen);
    csv_row(r, tg, sb->n_draft, &sb->spec, sb->spec.median);
}

static void json_figure(moe_json *j, const char *prefix, const moe_bench_figure *f) {
    char key[64];
    const struct {
        const char *suffix;
        double v;
    } fields[] = {
        {"tok_s", f->median}, {"tok_s_min", f->min}, {"tok_s_max", f->max}, {"gb_s", f->gb_s}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        snprintf(key, sizeof key, "%s%s", prefix, fields[i].suffix);
        moe_json_key(j, key);
        moe_json_double(j, fields[i].v);
    }
    if (f->exact_median <= 0) return;
    snprintf(key, sizeof key, "%sexact_tok_s", prefix);
    moe_json_kv_double(j, key, f->exact_median);
}

/* The "spec" object of --json: the measured rates, tokens per step, drafts by position. */
static void json_spec(moe_json *j, const spec_bench *sb) {
    moe_json_key(j, "spec");
    if (!sb->kind) {
        moe_json_null(j);
        return;
    }
    moe_json_object_begin(j);
    moe_json_kv_string(j, "kind", spec_name(sb->kind));
    moe_json_kv_int(j, "draft", sb->n_draft);
    moe_json_kv_string(j, "prompt_file", sb->prompt_file);
    moe_json_kv_int(j, "prompt_tokens", sb->n_prompt);
    json_figure(j, "plain_", &sb->plain);
    json_figure(j, "spec_", &sb->spec);
    moe_json_kv_double(j, "tokens_per_step",
                       sb->steps ? (double)sb->generated / (double)sb->steps : 0.0);
    moe_json_key(j, "positions");
    moe_json_array_begin(j);
    for (int k = 0; k < sb->n_draft; k++) {
        moe_json_object_begin(j);
        moe_json_kv_int(j, "position", k + 1);
        moe_json_kv_uint(j, "drafted", sb->drafted[k]);
        moe_json_kv_uint(j, "accepted", sb->accepted[k]);
        moe_json_kv_double(j, "accept", spec_profile(sb, k));
        moe_json_object_end(j);
    }
    moe_json_array_end(j);
    moe_json_object_end(j);
}

static void print_json(const moe_bench_result *r, const moe_bench_params *p, const spec_bench *sb) {
    moe_json j;
    moe_json_init(&j, true);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "model", p->model_path);
    moe_json_kv_string(&j, "isa", r->isa);
    moe_json_kv_int(&j, "threads", r->threads);
    moe_json_kv_int(&j, "runs", r->runs);
    moe_json_kv_bool(&j, "weights_in_memory", r->in_memory);
    moe_json_kv_int(&j, "n_prompt", p->n_prompt);
    moe_json_kv_int(&j, "n_gen", p->n_gen);
    json_figure(&j, "pp_", &r->pp);
    json_figure(&j, "tg_", &r->tg);
    moe_json_key(&j, "depths");
    moe_json_array_begin(&j);
    for (int i = 0; i < p->n_depths; i++) {
        moe_json_object_begin(&j);
        moe_json_kv_int(&j, "depth", p->depths[i]);
        json_figure(&j, "pp_", &r->pp_depth[i]);
        json_figure(&j, "tg_", &r->tg_depth[i]);
        moe_json_kv_double(&j, "indexer_score_ms_per_token", r->score_ms[i]);
        moe_json_kv_double(&j, "indexer_attend_ms_per_token", r->attend_ms[i]);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    moe_json_kv_double(&j, "fill_seconds", r->fill_seconds);
    moe_json_key(&j, "streams");
    moe_json_array_begin(&j);
    for (int i = 0; i < r->n_streams; i++) {
        const moe_bench_stream *s = &r->streams[i];
        moe_json_object_begin(&j);
        moe_json_kv_int(&j, "n", s->n);
        moe_json_kv_double(&j, "aggregate_tok_s", s->aggregate.median);
        if (s->aggregate.exact_median > 0)
            moe_json_kv_double(&j, "aggregate_exact_tok_s", s->aggregate.exact_median);
        moe_json_kv_double(&j, "aggregate_tok_s_min", s->aggregate.min);
        moe_json_kv_double(&j, "aggregate_tok_s_max", s->aggregate.max);
        moe_json_kv_double(&j, "per_stream_tok_s", s->per_stream_tok_s);
        moe_json_kv_double(&j, "gb_s", s->aggregate.gb_s);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    moe_json_kv_double(&j, "decode1_steps_s", r->verify_base.median);
    moe_json_key(&j, "verify");
    moe_json_array_begin(&j);
    for (int k = 1; k <= r->n_verify; k++) {
        moe_json_object_begin(&j);
        moe_json_kv_int(&j, "rows", k);
        moe_json_kv_double(&j, "steps_s", r->verify[k - 1].median);
        moe_json_kv_double(&j, "cost_ratio", r->verify_ratio[k - 1]);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    moe_json_key(&j, "projected");
    moe_json_array_begin(&j);
    for (int d = 1; d <= r->n_projected; d++) {
        moe_json_object_begin(&j);
        moe_json_kv_int(&j, "drafts", d);
        moe_json_kv_double(&j, "tok_s", r->projected_tok_s[d - 1]);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    json_spec(&j, sb);
    const struct {
        const char *key;
        double v;
    } facts[] = {
        {"read_bw_gb_s", r->bandwidth.median_gb_s},
        {"read_bw_gb_s_min", r->bandwidth.min_gb_s},
        {"read_bw_gb_s_max", r->bandwidth.max_gb_s},
        {"active_bytes_per_token", r->active_bytes_per_token},
        {"dense_bytes", r->dense_bytes},
        {"expert_bytes", r->expert_bytes},
        {"experts_per_token_layer", r->experts_per_token},
        {"tg_pct_of_read_bw",
         r->bandwidth.median_gb_s > 0 ? 100 * r->tg.gb_s / r->bandwidth.median_gb_s : 0},
    };
    for (size_t i = 0; i < sizeof facts / sizeof facts[0]; i++) {
        moe_json_key(&j, facts[i].key);
        moe_json_double(&j, facts[i].v);
    }
    moe_json_object_end(&j);
    json_emit(&j);
}

/* "1,2,4,8" into out[0..*n) (values 1..hi, at most max of them); "0" clears the list. */
static bool parse_list(const char *text, int *out, int *n, int max, long hi) {
    *n = 0;
    if (!text) return false;
    if (strcmp(text, "0") == 0) return true;
    const char *s = text;
    while (*s) {
        char *end;
        const long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > hi || *n == max || (*end && *end != ',')) return false;
        out[(*n)++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return *n > 0;
}

/* "0.87,0.66,0.52" into p->accept: fractions in [0, 1], each at most the one before. */
static bool parse_accept(const char *text, moe_bench_params *p) {
    p->n_accept = 0;
    for (const char *s = text; s && *s;) {
        char *end;
        const double v = strtod(s, &end);
        if (end == s || !(v >= 0 && v <= 1) || p->n_accept == MOE_SPEC_MAX_DRAFT ||
            (p->n_accept && v > p->accept[p->n_accept - 1]) || (*end && *end != ','))
            return false;
        p->accept[p->n_accept++] = v;
        s = *end ? end + 1 : end;
    }
    return p->n_accept > 0;
}

int moe_cmd_bench(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--server") == 0) return bench_server(argc, argv);
    moe_bench_params p;
    moe_bench_params_default(&p);
    p.n_threads = moe_cpu_cores();
    bool csv = false, json = false;
    int probe_mib = (int)(p.probe_bytes >> 20);
    spec_bench sb = {.kind = MOE_SPEC_NONE, .n_draft = 3};
    moe_engine_args engine = {.n_threads = p.n_threads, .kv_type = p.kv_type};
    for (int i = 0; i < argc; i++) {
        const int engine_arg = moe_engine_args_parse("bench", &engine, argc, argv, &i);
        if (engine_arg < 0) return 2;
        if (engine_arg) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const int_opt ints[] = {
            {"--runs", &p.runs, 1, MOE_BENCH_MAX_RUNS},
            {"--pp", &p.n_prompt, 0, 65536},
            {"--tg", &p.n_gen, 0, 65536},
            {"--stream-steps", &p.stream_steps, 1, 65536},
            {"--probe-mib", &probe_mib, 4, 1 << 20},
            {"--verify", &p.verify_max, 0, MOE_BENCH_MAX_VERIFY},
            {"--draft", &sb.n_draft, 1, MOE_SPEC_MAX_DRAFT},
        };
        const int took = take_int_opt(ints, sizeof ints / sizeof ints[0], a, v);
        if (took < 0) return 2;
        if (took) {
            i++;
            continue;
        }
        if (strcmp(a, "--streams") == 0) {
            if (!parse_list(v, p.streams, &p.n_streams, MOE_BENCH_MAX_STREAMS,
                            MOE_BENCH_MAX_STREAM_ROWS))
                return moe_cli_usage_error("bench",
                                           "--streams expects counts like 1,2,4,8 "
                                           "(1..%d, at most %d) or 0, got '%s'",
                                           MOE_BENCH_MAX_STREAM_ROWS, MOE_BENCH_MAX_STREAMS,
                                           v ? v : "");
            i++;
        } else if (strcmp(a, "--accept") == 0) {
            if (!parse_accept(v, &p))
                return moe_cli_usage_error("bench",
                                           "--accept expects up to %d fractions in [0, 1], each at "
                                           "most the one before (e.g. 0.87,0.66,0.52), got '%s'",
                                           MOE_SPEC_MAX_DRAFT, v ? v : "");
            i++;
        } else if (strcmp(a, "--depth") == 0) {
            if (!parse_list(v, p.depths, &p.n_depths, MOE_BENCH_MAX_DEPTHS, MOE_BENCH_MAX_DEPTH))
                return moe_cli_usage_error("bench",
                                           "--depth expects token counts like 1024,4096 "
                                           "(1..%d, at most %d), got '%s'",
                                           MOE_BENCH_MAX_DEPTH, MOE_BENCH_MAX_DEPTHS, v ? v : "");
            i++;
        } else if (strcmp(a, "--spec") == 0) {
            if (!moe_arg_spec("bench", v, &sb.kind)) return 2;
            i++;
        } else if (strcmp(a, "--prompt-file") == 0) {
            if (!v) return moe_cli_usage_error("bench", "--prompt-file needs a file");
            sb.prompt_file = v;
            i++;
        } else if (strcmp(a, "--mmap") == 0) {
            p.use_mmap = true;
        } else if (strcmp(a, "--exact-too") == 0) {
            p.exact_too = true;
        } else if (strcmp(a, "--csv") == 0) {
            csv = true;
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (strcmp(a, "--help-options") == 0) {
            fputs(usage_text, stdout);
            return 0;
        } else if (a[0] == '-') {
            return moe_cli_unknown_option("bench", a);
        } else if (!p.model_path) {
            p.model_path = a;
        } else {
            return moe_cli_usage_error("bench", "unexpected argument '%s'", a);
        }
    }
    if (!p.model_path) return moe_cli_usage_error("bench", "a model file is required");
    if (engine.n_ctx)
        return moe_cli_usage_error("bench", "--ctx: bench sizes its context from --pp and --tg");
    p.n_threads = engine.n_threads;
    p.kv_type = engine.kv_type;
    p.expert_cache_bytes = engine.expert_cache_bytes;
    p.split = engine.split;
    p.split_dense = engine.split_dense;
    p.no_repack = engine.no_repack;
    if (!moe_engine_args_check("bench", &engine)) return 2;
    p.probe_bytes = (size_t)probe_mib << 20;
    if (csv && json) return moe_cli_usage_error("bench", "--csv and --json exclude each other");
    if (sb.kind && (!sb.prompt_file || !p.n_gen))
        return moe_cli_usage_error("bench",
                                   "--spec %s measures decode after a prompt: it needs "
                                   "--prompt-file F and --tg above 0",
                                   spec_name(sb.kind));
    if (!sb.kind && sb.prompt_file)
        return moe_cli_usage_error("bench", "--prompt-file is the prompt of --spec ngram|mtp");
    moe_bench_result r;
    moe_error err = {0};
    if (moe_bench_run(&p, &r, &err) != MOE_OK) {
        fprintf(stderr, "moe bench: %s\n", err.msg);
        return 1;
    }
    if (sb.kind && !spec_measure(&p, &sb)) return 1;
    if (json) {
        print_json(&r, &p, &sb);
    } else if (csv) {
        print_csv(&r, &p, &sb);
    } else {
        print_text(&r, &p);
        if (sb.kind) print_spec_text(&sb, &r, &p);
    }
    return 0;
}
