/* attention.c: the grouped-query attention block -- q/k/v projections of the normed input (with
 * biases where the arch has them; without attn_v, V is the raw K projection), optional per-head
 * QK-norm and weightless V-norm, rope (with freq factors where the layer has them), the KV cache
 * write, causal attention per row (sinks and sliding windows where the layer has them), an
 * optional output gate (qwen3next: attn_q yields [q, gate] per head, out *= sigmoid(gate)),
 * output projection, optional output norm. Head widths, kv heads and rope are the layer's plan.
 *
 * Rows of one sequence in a batch attend to each other causally because every row's K/V is
 * written before any row attends, and a row at position p reads positions 0..p only (the last
 * `window` of them in a windowed layer). moe_attend_rows is shared with the MLA block. */
#include "engine_internal.h"

#include <math.h>
#include <string.h>

typedef struct attn_job {
    moe_ctx *c;
    const moe_row *rows;
    uint32_t layer, window;
    bool latent_v;
    const moe_attn_shape *shape;
} attn_job;

/* The job's layer's cache of seq from position `first` as the attention kernels take it. */
static moe_attn_kv attn_kv(const attn_job *j, int32_t seq, uint32_t first) {
    const moe_kv_span k = moe_kv_span_of(j->c, false, seq, j->layer),
                      v = j->latent_v ? k : moe_kv_span_of(j->c, true, seq, j->layer);
    return (moe_attn_kv){.k = k.at + first * k.stride,
                         .v = v.at + first * v.stride,
                         .k_stride = (int64_t)k.stride,
                         .v_stride = (int64_t)v.stride,
                         .k_head = (int64_t)k.head,
                         .v_head = (int64_t)v.head};
}

static void attention_rows(void *arg, int64_t begin, int64_t end, int thread) {
    const attn_job *j = arg;
    moe_ctx *c = j->c;
    const moe_attn_shape *s = j->shape;
    const int64_t q_w = (int64_t)s->n_head * s->head_dim_k;
    const int64_t att_w = (int64_t)s->n_head * s->head_dim_v;
    for (int64_t r = begin; r < end; r++) {
        const moe_row *row = &j->rows[r];
        /* a windowed layer masks key j for query p when p - j >= window */
        const uint32_t first =
            j->window && (uint32_t)row->pos >= j->window ? (uint32_t)row->pos - j->window + 1 : 0;
        const moe_attn_kv kv = attn_kv(j, row->seq, first);
        moe_attention_row(s, c->q + r * q_w, &kv, row->pos + 1 - first, c->att + r * att_w,
                          c->scores + (int64_t)thread * c->p.n_ctx);
    }
}

/* Rows of [n_head][q, gate] become q rows [n_head][head_dim] and gate rows (in place: each
 * destination lies at or before its source). */
static void split_q_gate(moe_ctx *c, uint32_t n_rows, int64_t hd) {
    const int64_t n_head = c->m->cfg.n_head;
    for (int64_t i = 0; i < (int64_t)n_rows * n_head; i++) {
        const float *src = c->q + i * 2 * hd;
        memcpy(c->att_gate + i * hd, src + hd, sizeof(float) * (size_t)hd);
        memmove(c->q + i * hd, src, sizeof(float) * (size_t)hd);
    }
}

/* The fast path: rows in blocks of one sequence (consecutive rows, at most
 * MOE_ATTN_BLOCK_ROWS), each block x kv head x head range one work item of moe_attention_tiled.
 * The head ranges split a group only when blocks x kv heads would leave threads idle (decode,
 * MLA's single latent head); how rows and heads are grouped never changes a row's bits. */
typedef struct tiled_job {
    attn_job a;
    const uint32_t *block;       /* [n_blocks + 1] first row of each block */
    int n_head_kv, split, chunk; /* items per block: n_head_kv * split of chunk heads */
} tiled_job;

static void attention_tiled(void *arg, int64_t begin, int64_t end, int thread) {
    const tiled_job *t = arg;
    const attn_job *j = &t->a;
    moe_ctx *c = j->c;
    const moe_attn_shape *s = j->shape;
    const int group = s->n_head / s->n_head_kv;
    for (int64_t item = begin; item < end; item++) {
        const int64_t blk = item / ((int64_t)t->n_head_kv * t->split);
        const int part = (int)(item % ((int64_t)t->n_head_kv * t->split));
        const int h0 = part / t->split * group + part % t->split * t->chunk;
        const int h1 = h0 + t->chunk < (part / t->split + 1) * group
                           ? h0 + t->chunk
                           : (part / t->split + 1) * group;
        if (h0 >= h1) continue;
        const uint32_t r0 = t->block[blk], n = t->block[blk + 1] - r0;
        int64_t first[MOE_ATTN_BLOCK_ROWS], last[MOE_ATTN_BLOCK_ROWS];
        for (uint32_t r = 0; r < n; r++) {
            const int32_t pos = j->rows[r0 + r].pos;
            /* a windowed layer masks key j for query p when p - j >= window */
            first[r] = j->window && (uint32_t)pos >= j->window ? pos - (int64_t)j->window + 1 : 0;
            last[r] = pos;
        }
        const int32_t seq = j->rows[r0].seq;
        const moe_attn_block b = {.q = c->q + (int64_t)r0 * s->n_head * s->head_dim_k,
                                  .out = c->att + (int64_t)r0 * s->n_head * s->head_dim_v,
                                  .first = first,
                                  .last = last,
                                  .n_rows = (int)n,
                                  .kv = attn_kv(j, seq, 0),
                                  .scratch = c->attn_scratch + (size_t)thread * c->attn_scratch_n};
        moe_attention_tiled(s, &b, h0, h1);
    }
}

int moe_attn_split(const moe_ctx *c, int64_t items, int group) {
    /* Items enough for every thread (4 each when they come cheap). A part of a group costs its
     * own pass of conversion over the K / V tiles, and fewer than 16 query vectors cost as much
     * as 16 (a register's lanes), so past one item per thread a group splits only into parts of
     * 16 heads or more. */
    const int64_t threads = moe_pool_n_threads(c->pool);
    int split = 1;
    while (split < group && (items * split < threads ||
                             (items * split < 4 * threads && (group + split - 1) / split >= 32)))
        split *= 2;
    return split;
}

void moe_attend_rows(moe_ctx *c, const moe_attn_shape *shape, uint32_t layer, const moe_row *rows,
                     uint32_t n_rows, uint32_t window, bool latent_v) {
    attn_job job = {.c = c,
                    .rows = rows,
                    .layer = layer,
                    .window = window,
                    .latent_v = latent_v,
                    .shape = shape};
    const double start = moe_profile_start();
    if (moe_exact()) { /* ggml's order: each row over its whole prefix */
        moe_pool_for(c->pool, n_rows, 1, attention_rows, &job);
        moe_profile_part("attention (QK, softmax, V)", start);
        return;
    }
    int64_t n_blocks = 0;
    for (uint32_t r = 0; r < n_rows; r++)
        if (r == 0 || rows[r].seq != rows[r - 1].seq ||
            r - c->attn_block[n_blocks - 1] == MOE_ATTN_BLOCK_ROWS)
            c->attn_block[n_blocks++] = r;
    c->attn_block[n_blocks] = n_rows;
    const int group = shape->n_head / shape->n_head_kv;
    const int split = moe_attn_split(c, n_blocks * shape->n_head_kv, group);
    tiled_job t = {.a = job,
                   .block = c->attn_block,
                   .n_head_kv = shape->n_head_kv,
                   .split = split,
                   .chunk = (group + split - 1) / split};
    moe_pool_for(c->pool, n_blocks * shape->n_head_kv * split, 1, attention_tiled, &t);
    moe_profile_part("attention (QK, softmax, V)", start);
}

/* Rope on the rows' q and k, then their k and v into the cache: each row on its own (rows of a
 * sequence write distinct positions), ROPE_ROWS rows per work item. */
#define ROPE_ROWS 4

typedef struct rope_job {
    moe_ctx *c;
    const moe_row *rows;
    const moe_rope_params *rope;
    uint32_t layer;
    int n_head, n_head_kv, hd_k, hd_v;
} rope_job;

static void rope_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const rope_job *j = arg;
    moe_ctx *c = j->c;
    const int64_t q_w = (int64_t)j->n_head * j->hd_k, k_w = (int64_t)j->n_head_kv * j->hd_k,
                  v_w = (int64_t)j->n_head_kv * j->hd_v;
    for (int64_t r = begin; r < end; r++) {
        const moe_row *row = &j->rows[r];
        moe_rope(c->q + r * q_w, j->n_head, j->hd_k, row->pos, j->rope);
        moe_rope(c->k + r * k_w, j->n_head_kv, j->hd_k, row->pos, j->rope);
        const moe_kv_span k = moe_kv_span_of(c, false, row->seq, j->layer),
                          v = moe_kv_span_of(c, true, row->seq, j->layer);
        for (int h = 0; h < j->n_head_kv; h++) { /* each head into its own run of positions */
            moe_kv_store(c, k.at + h * k.head + (uint64_t)row->pos * k.stride,
                         c->k + r * k_w + h * j->hd_k, (uint64_t)j->hd_k);
            moe_kv_store(c, v.at + h * v.head + (uint64_t)row->pos * v.stride,
                         c->v + r * v_w + h * j->hd_v, (uint64_t)j->hd_v);
        }
    }
}

/* The q, k and v projections as one parallel pass (one hand-out, not three; the small k and v
 * matrices stream within q's pass instead of each paying a pass's start and end): x's rows into
 * y[0..2], each task converting them into its own part of the scratch from `scratch` on (NULL:
 * tasks for their sizes only), or sharing q's conversion where their dots take the same
 * (moe_matmul_many). Without attn_v there is no v task. Returns the tasks. */
static int qkv_tasks(const moe_attn_weights *w, const float *x, uint32_t n_rows, float *const y[3],
                     uint8_t *scratch, moe_matmul_task t[3]) {
    const moe_tensor *m[3] = {w->wq, w->wk, w->wv};
    int n = 0;
    for (int i = 0; i < 3; i++)
        if (m[i]) {
            t[n++] = (moe_matmul_task){m[i], 0, x, n_rows, y[i], scratch};
            if (scratch) scratch += moe_matmul_scratch_bytes(m[i], n_rows);
        }
    return n;
}

uint64_t moe_attention_scratch_bytes(const moe_layer_weights *l, uint32_t n_rows) {
    if (l->plan.mixer != MOE_MIXER_ATTENTION) return 0;
    moe_matmul_task t[3];
    uint64_t bytes = 0;
    for (int i = 0, n = qkv_tasks(&l->attn, NULL, n_rows, (float *[3]){0}, NULL, t); i < n; i++)
        bytes += moe_matmul_scratch_bytes(t[i].w, n_rows);
    return bytes;
}

void moe_block_attention(moe_ctx *c, const moe_layer_weights *l, uint32_t il, const moe_row *rows,
                         uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_attn_weights *w = &l->attn;
    const moe_layer_plan *p = &l->plan;
    const int64_t n_embd = cfg->n_embd, hd_k = p->head_dim_k, hd_v = p->head_dim_v;
    const int64_t n_head = cfg->n_head, n_head_kv = p->n_head_kv;
    const int64_t q_w = n_head * hd_k, k_w = n_head_kv * hd_k, v_w = n_head_kv * hd_v;
    moe_rope_params rope = moe_rope_params_of_layer(cfg, p);
    rope.freq_factors = w->rope_freqs ? (const float *)w->rope_freqs->data : NULL;
    const moe_attn_shape shape = {.n_head = (int)n_head,
                                  .n_head_kv = (int)n_head_kv,
                                  .head_dim_k = (int)hd_k,
                                  .head_dim_v = (int)hd_v,
                                  .scale = cfg->kq_scale,
                                  .kv_type = c->p.kv_type,
                                  .sinks = w->sinks ? (const float *)w->sinks->data : NULL};
    moe_matmul_task qkv[3];
    moe_matmul_many(
        c->pool, qkv,
        qkv_tasks(w, c->xn, n_rows, (float *[3]){c->q, c->k, c->v}, c->mm_scratch, qkv));
    if (cfg->attn_output_gate) split_q_gate(c, n_rows, hd_k);
    if (!w->wv) /* V is the raw K projection (hd_k == hd_v, checked at load) */
        memcpy(c->v, c->k, sizeof(float) * (size_t)(n_rows * k_w));
    moe_add_bias(c->q, w->bq, 0, n_rows, q_w);
    moe_add_bias(c->k, w->bk, 0, n_rows, k_w);
    moe_add_bias(c->v, w->bv, 0, n_rows, v_w);
    double start = moe_profile_start();
    if (w->q_norm) {
        const float *qn = (const float *)w->q_norm->data, *kn = (const float *)w->k_norm->data;
        moe_rmsnorm_rows(c->pool, c->q, c->q, qn, (int64_t)n_rows * n_head, hd_k, cfg->rms_eps);
        moe_rmsnorm_rows(c->pool, c->k, c->k, kn, (int64_t)n_rows * n_head_kv, hd_k, cfg->rms_eps);
    }
    if (cfg->attn_v_norm)
        moe_rmsnorm_rows(c->pool, c->v, c->v, NULL, (int64_t)n_rows * n_head_kv, hd_v,
                         cfg->rms_eps);
    moe_profile_part("rmsnorm", start);
    start = moe_profile_start();
    rope_job rj = {c, rows, &rope, il, (int)n_head, (int)n_head_kv, (int)hd_k, (int)hd_v};
    moe_pool_for(c->pool, n_rows, ROPE_ROWS, rope_rows, &rj);
    moe_profile_part("rope + KV store", start);
    moe_attend_rows(c, &shape, il, rows, n_rows, l->plan.window, false);
    if (cfg->attn_output_gate)
        moe_gate_mul(c->att, c->att_gate, (int64_t)n_rows * n_head * hd_v, MOE_GATE_SIGMOID);
    moe_matmul(c->pool, w->wo, 0, c->att, n_rows, c->y, c->mm_scratch);
    moe_add_bias(c->y, w->bo, 0, n_rows, n_embd);
    moe_rows_post_norm(c, c->y, l->attn_post_norm, n_rows, n_embd);
}
