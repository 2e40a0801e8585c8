/* bench.c: `moe bench MODEL` -- prefill, single-stream decode and batched decode throughput of a
 * model on this machine, beside the machine's own read bandwidth measured in the same run.
 *
 * Each test is timed `runs` times after one untimed warm-up; a figure is the median with the
 * range. Tokens are seeded pseudo-random ids, so routing spreads over experts as real text
 * does. What a forward reads from memory is counted from the model and the expert dispatch
 * counters (moe_ctx_expert_stats): every weight outside the routed experts (the output head,
 * attention, norms, routers, shared experts; one row of the embeddings per token), plus each
 * routed expert the step actually ran, once however many rows chose it. bytes / time is the
 * achieved GB/s, compared with the probe (moe_read_bandwidth on the same number of threads).
 * The trap: decode speed is bytes over bandwidth only for one row per step; prefill and
 * batched decode reuse each weight over many rows, so their GB/s is expected to be low. */
#include "tools.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../engine/engine.h"
#include "../quant/quant.h"

#define BENCH_PROBE_BYTES (512u << 20) /* far past any L3 here */
#define BENCH_SEED        0x62656e63u  /* "benc" */

void moe_bench_params_default(moe_bench_params *p) {
    memset(p, 0, sizeof *p);
    p->n_threads = 1;
    p->runs = 5;
    p->n_prompt = 512;
    p->n_gen = 128;
    p->stream_steps = 32;
    static const int streams[] = {1, 2, 4, 8};
    p->n_streams = 4;
    memcpy(p->streams, streams, sizeof streams);
    p->probe_bytes = BENCH_PROBE_BYTES;
    p->kv_type = MOE_TYPE_F16;
    p->verify_max = 4;
}

/* ==== What a forward reads ==== */

/* Bytes outside the routed experts read per forward, the embedding row bytes read per token,
 * and the bytes of one routed expert (gate + up + down of one layer, averaged over layers). */
static void weight_bytes(const moe_model *m, moe_bench_result *r) {
    uint64_t dense = 0, routed = 0;
    uint32_t moe_layers = 0;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(m->gguf); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(m->gguf, i);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (moe_tensor_role(name) == MOE_ROLE_ROUTED_EXPERTS)
            routed += t->n_bytes;
        else if (t != m->token_embd || m->output == m->token_embd)
            dense += t->n_bytes;
    }
    for (uint32_t il = 0; il < m->cfg.n_layer; il++)
        moe_layers += m->layers[il].plan.ffn == MOE_FFN_EXPERTS;
    r->dense_bytes = (double)dense;
    r->embd_row_bytes = (double)moe_type_row_bytes(m->token_embd->type, m->token_embd->ne[0]);
    r->moe_layers = moe_layers;
    r->expert_bytes =
        moe_layers && m->cfg.n_expert ? (double)routed / moe_layers / m->cfg.n_expert : 0.0;
}

/* ==== Timing ==== */

typedef struct bench_run {
    moe_ctx *ctx;
    uint32_t depth; /* tests of sequence 0 start at this position (its snapshot) */
    moe_row *rows;
    float *logits;
    uint64_t seed;
    uint32_t n_vocab;
    uint32_t verify_rows; /* > 0: each decode step is a verify step of this many rows of one
                           * sequence, of which only the first is kept */
    const moe_bench_result *r;
} bench_run;

static int32_t next_token(bench_run *b) {
    b->seed = b->seed * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((b->seed >> 33) % b->n_vocab);
}

/* Bytes one forward read: the dense part, the embedding rows, the experts the dispatch ran. */
static double forward_bytes(const bench_run *b, uint32_t n_rows) {
    const moe_expert_stats st = moe_ctx_expert_stats(b->ctx);
    return b->r->dense_bytes + n_rows * b->r->embd_row_bytes +
           (double)st.experts * b->r->expert_bytes;
}

/* One test run: `steps` forwards of n_seq rows each (one per sequence), or one prefill forward
 * of `prompt` rows of sequence 0. Sequence 0 starts at b->depth, the others empty. Returns
 * seconds; adds bytes read and experts run per MoE layer and token. */
static moe_status run_once(bench_run *b, uint32_t prompt, uint32_t n_seq, uint32_t steps,
                           double *seconds, double *bytes, double *experts_per_tok,
                           moe_error *err) {
    const uint32_t depth = b->depth;
    for (uint32_t s = 0; s < n_seq || s < 1; s++)
        if (moe_ctx_seq_truncate(b->ctx, (int32_t)s, s ? 0 : depth, err) != MOE_OK)
            return err->code;
    *bytes = 0;
    double experts = 0;
    const double t0 = moe_now();
    if (prompt) {
        for (uint32_t i = 0; i < prompt; i++)
            b->rows[i] = (moe_row){.seq = 0,
                                   .pos = (int32_t)(depth + i),
                                   .token = next_token(b),
                                   .logits = i + 1 == prompt};
        if (moe_ctx_decode(b->ctx, b->rows, prompt, b->logits, err) != MOE_OK) return err->code;
        *bytes += forward_bytes(b, prompt);
    }
    for (uint32_t step = 0; step < steps && b->verify_rows; step++) {
        for (uint32_t k = 0; k < b->verify_rows; k++) /* the next token and its "drafts" */
            b->rows[k] = (moe_row){
                .seq = 0, .pos = (int32_t)(step + k), .token = next_token(b), .logits = true};
        if (moe_ctx_verify(b->ctx, b->rows, b->verify_rows, b->logits, err) != MOE_OK ||
            moe_ctx_seq_accept(b->ctx, 0, 1, err) != MOE_OK)
            return err->code;
        *bytes += forward_bytes(b, b->verify_rows);
    }
    for (uint32_t step = 0; step < steps && !b->verify_rows; step++) {
        for (uint32_t s = 0; s < n_seq; s++)
            b->rows[s] = (moe_row){.seq = (int32_t)s,
                                   .pos = (int32_t)((s ? 0 : depth) + step),
                                   .token = next_token(b),
                                   .logits = true};
        if (moe_ctx_decode(b->ctx, b->rows, n_seq, b->logits, err) != MOE_OK) return err->code;
        *bytes += forward_bytes(b, n_seq);
        experts += (double)moe_ctx_expert_stats(b->ctx).experts;
    }
    *seconds = moe_now() - t0;
    if (experts_per_tok && steps && b->r->moe_layers)
        *experts_per_tok = experts / steps / n_seq / b->r->moe_layers;
    return MOE_OK;
}

void moe_bench_median_range(double *v, int n, double *median, double *lo, double *hi) {
    *median = moe_median(v, n); /* sorted now */
    *lo = n > 0 ? v[0] : 0;
    *hi = n > 0 ? v[n - 1] : 0;
}

/* A test: warm-up, then `runs` timed runs; tok/s median and range, GB/s median. With exact_too,
 * every run (the warm-up too) is followed by one on the exact path. */
static moe_status run_test(bench_run *b, const moe_bench_params *p, uint32_t prompt, uint32_t n_seq,
                           uint32_t steps, moe_bench_figure *f, double *experts_per_tok,
                           moe_error *err) {
    double sec = 0, bytes = 0, tok_s[2][MOE_BENCH_MAX_RUNS] = {{0}},
           gb_s[2][MOE_BENCH_MAX_RUNS] = {{0}};
    const double tokens = prompt ? prompt : (double)n_seq * steps;
    const int paths = p->exact_too ? 2 : 1;
    double bytes_sum = 0;
    moe_status st = MOE_OK;
    for (int i = -1; i < p->runs && st == MOE_OK; i++)
        for (int e = 0; e < paths && st == MOE_OK; e++) {
            if (paths == 2) moe_exact_set(e);
            st = run_once(b, prompt, n_seq, steps, &sec, &bytes, i >= 0 ? experts_per_tok : NULL,
                          err);
            if (i < 0 || st != MOE_OK) continue; /* the warm-up */
            tok_s[e][i] = tokens / sec;
            gb_s[e][i] = bytes / sec / 1e9;
            if (e == 0) bytes_sum += bytes;
        }
    if (paths == 2) moe_exact_set(false);
    if (st != MOE_OK) return st;
    moe_bench_median_range(tok_s[0], p->runs, &f->median, &f->min, &f->max);
    f->gb_s = moe_median(gb_s[0], p->runs);
    f->bytes_per_token = bytes_sum / p->runs / tokens;
    if (paths == 2) {
        moe_bench_median_range(tok_s[1], p->runs, &f->exact_median, &f->exact_min, &f->exact_max);
        f->exact_gb_s = moe_median(gb_s[1], p->runs);
    }
    return MOE_OK;
}

/* Speculation's ceiling: a 1-row step, then verify steps of 1..p->verify_max rows, and the rates
 * --accept projects from them. */
static moe_status verify_tests(bench_run *b, const moe_bench_params *p, moe_bench_result *r,
                               moe_error *err) {
    const uint32_t steps = (uint32_t)p->stream_steps;
    if (run_test(b, p, 0, 1, steps, &r->verify_base, NULL, err) != MOE_OK) return err->code;
    for (int k = 1; k <= p->verify_max; k++) {
        b->verify_rows = (uint32_t)k;
        const moe_status st = run_test(b, p, 0, 1, steps, &r->verify[k - 1], NULL, err);
        b->verify_rows = 0;
        if (st != MOE_OK) return st;
        r->verify_ratio[k - 1] = r->verify_base.median / r->verify[k - 1].median;
        r->n_verify = k;
    }
    double tokens = 1; /* expected tokens per step: the sampled one and the drafts kept */
    for (int d = 1; d <= p->n_accept && d < r->n_verify; d++) {
        tokens += p->accept[d - 1];
        r->projected_tok_s[d - 1] = r->verify_base.median * tokens / r->verify_ratio[d];
        r->n_projected = d;
    }
    return MOE_OK;
}

/* Sequence 0 from its length up to `depth` tokens, MOE_BENCH_FILL_ROWS rows per forward
 * (untimed), then a snapshot there so each decode run can go back to it. */
static moe_status fill_to(bench_run *b, uint32_t depth, int32_t *snapshot, moe_error *err) {
    for (uint32_t pos = moe_ctx_seq_len(b->ctx, 0); pos < depth;) {
        const uint32_t n = depth - pos < MOE_BENCH_FILL_ROWS ? depth - pos : MOE_BENCH_FILL_ROWS;
        for (uint32_t i = 0; i < n; i++)
            b->rows[i] = (moe_row){
                .seq = 0, .pos = (int32_t)(pos + i), .token = next_token(b), .logits = i + 1 == n};
        if (moe_ctx_decode(b->ctx, b->rows, n, b->logits, err) != MOE_OK) return err->code;
        pos += n;
    }
    *snapshot = moe_ctx_seq_snapshot(b->ctx, 0, err);
    return *snapshot < 0 ? err->code : MOE_OK;
}

/* The prefill and decode tests at each depth, ascending: the context is filled once, on from the
 * last. */
static moe_status run_depths(bench_run *b, const moe_bench_params *p, moe_bench_result *r,
                             moe_error *err) {
    moe_status st = MOE_OK;
    if (moe_ctx_seq_truncate(b->ctx, 0, 0, err) != MOE_OK) return err->code;
    for (int i = 0; st == MOE_OK && i < p->n_depths; i++) {
        int32_t snapshot = -1;
        const double t0 = moe_now();
        st = fill_to(b, (uint32_t)p->depths[i], &snapshot, err);
        r->fill_seconds += moe_now() - t0;
        b->depth = (uint32_t)p->depths[i];
        if (st == MOE_OK && p->n_prompt)
            st = run_test(b, p, (uint32_t)p->n_prompt, 0, 0, &r->pp_depth[i], NULL, err);
        const moe_indexer_time before = moe_ctx_indexer_time(b->ctx);
        if (st == MOE_OK && p->n_gen)
            st = run_test(b, p, 0, 1, (uint32_t)p->n_gen, &r->tg_depth[i], NULL, err);
        const moe_indexer_time after = moe_ctx_indexer_time(b->ctx);
        const double steps = (double)(p->runs + 1) * p->n_gen; /* the warm-up's too */
        r->score_ms[i] = 1e3 * (after.score_seconds - before.score_seconds) / steps;
        r->attend_ms[i] = 1e3 * (after.attend_seconds - before.attend_seconds) / steps;
        if (st == MOE_OK) st = moe_ctx_seq_truncate(b->ctx, 0, b->depth, err);
        if (snapshot >= 0) moe_ctx_snapshot_drop(b->ctx, snapshot);
    }
    b->depth = 0;
    return st;
}

/* ==== The disk ==== */

#define DISK_BLOCK ((uint64_t)4 << 20)   /* one read */
#define DISK_PROBE ((uint64_t)512 << 20) /* at most this much of the file */

typedef struct disk_job {
    int fd;
    uint8_t *buf; /* [n_threads][DISK_BLOCK] aligned */
    uint64_t bytes[64];
} disk_job;

static void disk_blocks(void *arg, int64_t begin, int64_t end, int thread) {
    disk_job *j = arg;
    for (int64_t b = begin; b < end; b++) {
        const ssize_t n = pread(j->fd, j->buf + (uint64_t)thread * DISK_BLOCK, DISK_BLOCK,
                                (off_t)((uint64_t)b * DISK_BLOCK));
        if (n > 0 && thread < 64) j->bytes[thread] += (uint64_t)n;
    }
}

/* The expert cache's read path at full speed: the model file read in DISK_BLOCK pieces on the
 * pool's threads, with O_DIRECT where it is allowed (what the cache does), up to DISK_PROBE. */
static void disk_probe(const char *path, moe_ctx *ctx, double *mib_s, bool *direct) {
    *mib_s = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    *direct = fd >= 0;
    if (fd < 0) fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) close(fd);
        return;
    }
    const int n_threads = moe_ctx_n_threads(ctx);
    disk_job j = {.fd = fd, .buf = aligned_alloc(4096, (size_t)(DISK_BLOCK * (uint64_t)n_threads))};
    if (!j.buf) moe_die("out of memory (disk probe)");
    const uint64_t size = (uint64_t)st.st_size < DISK_PROBE ? (uint64_t)st.st_size : DISK_PROBE;
    const double t0 = moe_now();
    moe_pool_for(moe_ctx_pool(ctx), (int64_t)((size + DISK_BLOCK - 1) / DISK_BLOCK), 1, disk_blocks,
                 &j);
    const double sec = moe_now() - t0;
    uint64_t total = 0;
    for (int i = 0; i < 64; i++) total += j.bytes[i];
    if (sec > 0) *mib_s = (double)total / 1048576.0 / sec;
    free(j.buf);
    close(fd);
}

/* ==== Entry ==== */

moe_status moe_bench_run(const moe_bench_params *p, moe_bench_result *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    if (p->runs < 1 || p->runs > MOE_BENCH_MAX_RUNS || p->n_threads < 1 || p->n_prompt < 0 ||
        p->n_gen < 0 || p->stream_steps < 1 || p->n_streams < 0 ||
        p->n_streams > MOE_BENCH_MAX_STREAMS || p->verify_max < 0 ||
        p->verify_max > MOE_BENCH_MAX_VERIFY || p->n_accept < 0 || p->n_accept > MOE_SPEC_MAX_DRAFT)
        return moe_error_set(err, MOE_ERR_ARG,
                             "bench: runs 1..%d, threads >= 1, up to %d "
                             "stream counts, verify steps of at most %d rows",
                             MOE_BENCH_MAX_RUNS, MOE_BENCH_MAX_STREAMS, MOE_BENCH_MAX_VERIFY);
    if (p->n_accept && p->n_accept >= p->verify_max)
        return moe_error_set(err, MOE_ERR_ARG,
                             "bench: --accept gives %d draft positions, so verify steps of up to "
                             "%d rows are needed (--verify %d)",
                             p->n_accept, p->n_accept + 1, p->n_accept + 1);
    if (p->n_depths < 0 || p->n_depths > MOE_BENCH_MAX_DEPTHS ||
        (p->n_depths && !p->n_gen && !p->n_prompt))
        return moe_error_set(err, MOE_ERR_ARG,
                             "bench: up to %d depths, with prefill (--pp) or decode (--tg) tests",
                             MOE_BENCH_MAX_DEPTHS);
    for (int i = 0; i < p->n_depths; i++)
        if (p->depths[i] < 1 || p->depths[i] > MOE_BENCH_MAX_DEPTH ||
            (i && p->depths[i] <= p->depths[i - 1]))
            return moe_error_set(err, MOE_ERR_ARG,
                                 "bench: depth %d: depths ascend, each 1..%d tokens", p->depths[i],
                                 MOE_BENCH_MAX_DEPTH);
    uint32_t max_seq = 1;
    for (int i = 0; i < p->n_streams; i++) {
        if (p->streams[i] < 1 || p->streams[i] > MOE_BENCH_MAX_STREAM_ROWS)
            return moe_error_set(err, MOE_ERR_ARG, "bench: %d streams (1..%d)", p->streams[i],
                                 MOE_BENCH_MAX_STREAM_ROWS);
        if ((uint32_t)p->streams[i] > max_seq) max_seq = (uint32_t)p->streams[i];
    }
    r->runs = p->runs;
    r->threads = p->n_threads;
    r->isa = moe_kernels_get()->name;
    r->in_memory = !p->use_mmap;

    /* The bandwidth probe runs between opening the model and reading its weights: the peak is
     * then the larger of the probe's buffer and the weights, not their sum. One pool does both. */
    moe_pool *pool = moe_pool_new(p->n_threads);
    double t = moe_now();
    moe_model *m = moe_model_load(p->model_path, err);
    r->load_seconds = moe_now() - t;
    moe_status st =
        m ? moe_read_bandwidth(pool, p->probe_bytes, p->runs, &r->bandwidth, err) : err->code;
    if (st == MOE_OK && !p->use_mmap) {
        t = moe_now();
        st = moe_gguf_to_memory_except(m->gguf, pool,
                                       p->expert_cache_bytes || p->split == MOE_SPLIT_ROWS
                                           ? moe_model_is_routed /* read apart, or not at all */
                                           : NULL,
                                       m, &r->loaded_bytes, err);
        r->load_seconds += moe_now() - t;
    }
    moe_layout_report repack;
    if (st == MOE_OK && !p->use_mmap && !p->no_repack && !p->exact_too) {
        t = moe_now();
        st = moe_model_repack(m, !p->expert_cache_bytes && p->split == MOE_SPLIT_NONE, pool,
                              &repack, err);
        r->load_seconds += moe_now() - t;
        if (st == MOE_OK) moe_layout_report_print("moe bench", &repack);
    }
    moe_pool_free(pool);
    if (st != MOE_OK) {
        moe_model_free(m);
        return st;
    }
    snprintf(r->arch, sizeof r->arch, "%s", m->cfg.arch_name ? m->cfg.arch_name : "?");
    r->n_layer = m->cfg.n_layer;
    r->n_expert = m->cfg.n_expert;
    r->n_expert_used = m->cfg.n_expert_used;
    weight_bytes(m, r);

    const uint32_t deepest = p->n_depths ? (uint32_t)p->depths[p->n_depths - 1] : 0;
    const uint32_t steps =
        (uint32_t)(p->n_gen > p->stream_steps ? p->n_gen : p->stream_steps) + deepest;
    uint32_t max_rows = (uint32_t)p->n_prompt > max_seq ? (uint32_t)p->n_prompt : max_seq;
    if (deepest && max_rows < MOE_BENCH_FILL_ROWS) max_rows = MOE_BENCH_FILL_ROWS;
    if ((uint32_t)p->verify_max > max_rows) max_rows = (uint32_t)p->verify_max;
    const uint32_t prefill = (uint32_t)p->n_prompt + deepest; /* the deepest pp test's end */
    moe_ctx_params cp = {.n_ctx = (prefill > steps ? prefill : steps) + (uint32_t)p->verify_max + 1,
                         .n_verify = (uint32_t)p->verify_max,
                         .n_seq = max_seq,
                         .max_rows = max_rows,
                         .kv_type = p->kv_type,
                         .n_threads = p->n_threads,
                         .expert_cache_bytes = p->expert_cache_bytes,
                         .split = p->split,
                         .split_dense = p->split_dense};
    moe_ctx *ctx = moe_ctx_new(m, &cp, err);
    if (!ctx) {
        moe_model_free(m);
        return err->code;
    }
    bench_run b = {.ctx = ctx,
                   .rows = moe_xmalloc(sizeof(moe_row) * max_rows),
                   .logits = moe_xmalloc(
                       sizeof(float) * (size_t)m->cfg.n_vocab *
                       (max_seq > (uint32_t)p->verify_max ? max_seq : (uint32_t)p->verify_max)),
                   .seed = BENCH_SEED,
                   .n_vocab = m->cfg.n_vocab,
                   .r = r};
    st = MOE_OK;
    if (p->n_prompt > 0) st = run_test(&b, p, (uint32_t)p->n_prompt, 0, 0, &r->pp, NULL, err);
    if (st == MOE_OK && p->n_gen > 0) {
        const moe_expert_cache_stats before = moe_ctx_expert_cache_stats(ctx);
        const moe_dist_times dist_before = moe_dist_timing();
        const double t_tg = moe_now();
        st = run_test(&b, p, 0, 1, (uint32_t)p->n_gen, &r->tg, &r->experts_per_token, err);
        r->tg_seconds = moe_now() - t_tg;
        r->tg_dist = moe_dist_timing();
        r->tg_dist.wait_seconds -= dist_before.wait_seconds;
        r->tg_dist.reduce_seconds -= dist_before.reduce_seconds;
        r->tg_dist.sums -= dist_before.sums;
        r->tg_dist.bytes -= dist_before.bytes;
        r->ranks = moe_dist_size();
        r->active_bytes_per_token = r->tg.bytes_per_token;
        r->tg_cache = moe_ctx_expert_cache_stats(ctx);
        r->tg_cache.hits -= before.hits;
        r->tg_cache.misses -= before.misses;
        r->tg_cache.evictions -= before.evictions;
        r->tg_cache.bytes_read -= before.bytes_read;
        r->tg_cache.read_seconds -= before.read_seconds;
        r->tg_cache.busy_seconds -= before.busy_seconds;
        r->tg_cache_tokens = (double)(p->runs + 1) * p->n_gen; /* run_test warms up once */
    }
    if (st == MOE_OK && p->n_depths) st = run_depths(&b, p, r, err);
    if (st == MOE_OK && p->expert_cache_bytes)
        disk_probe(p->model_path, ctx, &r->disk_mib_s, &r->disk_direct);
    for (int i = 0; st == MOE_OK && i < p->n_streams; i++) {
        moe_bench_stream *s = &r->streams[r->n_streams++];
        s->n = p->streams[i];
        st =
            run_test(&b, p, 0, (uint32_t)s->n, (uint32_t)p->stream_steps, &s->aggregate, NULL, err);
        s->per_stream_tok_s = s->aggregate.median / s->n;
    }
    if (st == MOE_OK && p->verify_max > 0) st = verify_tests(&b, p, r, err);
    if (st == MOE_OK && p->n_gen == 0 && r->n_streams && r->streams[0].n == 1)
        r->active_bytes_per_token = r->streams[0].aggregate.bytes_per_token;
    free(b.rows);
    free(b.logits);
    moe_ctx_free(ctx);
    moe_model_free(m);
    return st;
}
