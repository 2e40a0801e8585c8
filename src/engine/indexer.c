/* indexer.c: the lightning indexer of sparse MLA layers and the attention that reads only what it
 * selects -- pooled (GLM-5.3's DSA: kpool > 1) or per token (DeepSeek-V3.2 / GLM-5: kpool 1).
 *
 * Every cached position of an indexed layer keeps an indexer row beside its latent: its key
 * (LayerNorm'd projection, roped where the model ropes it) and, when positions are pooled, its
 * pooling logits and -- in the first cell of each complete pool of kpool positions -- the pool's
 * key, the per-channel softmax-weighted mix of its members. A query scores every complete pool
 * (per indexer head ReLU(q . K), weighted by a per-token projection) and attends to the
 * top_k / kpool best pools plus the incomplete tail; while there are no more complete pools than
 * that, it attends to everything (exactly dense). A layer that shares its selection (GLM-5.2's
 * "shared" indexer layers) attends to what the last scoring layer chose for the same row. Keys
 * and pools are written for every row before any row scores, so rows of one call see the pools
 * earlier rows closed, and a prompt split anywhere gives the same selections. Decode cost:
 * scoring grows with the pools, attention stays at top_k + kpool - 1 keys. Ties rank the earlier
 * pool first. */
#include "engine_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/ops.h"

static uint64_t row_floats(const moe_model_config *c) {
    return moe_index_row_values(c);
}

/* Where a pool's key sits in its first cell's row (with kpool 1, the position's own key). */
static int64_t pool_key_at(const moe_model_config *c) {
    return c->idx_kpool > 1 ? 2 * (int64_t)c->idx_head_dim : 0;
}

/* Keys a sparse query attends to at most: the selected pools and the tail. */
static uint32_t max_selected(const moe_model_config *c) {
    return c->idx_top_k + c->idx_kpool - 1;
}

void moe_indexer_plan(const moe_model *m, uint32_t n_layer_run, uint32_t *n_layer,
                      uint64_t *floats_per_token) {
    *n_layer = 0;
    for (uint32_t il = 0; il < n_layer_run; il++)
        *n_layer += m->cfg.layer[il].indexed && !m->cfg.layer[il].index_shared;
    *floats_per_token = *n_layer ? *n_layer * row_floats(&m->cfg) : 0;
}

void moe_indexer_alloc(moe_ctx *c, uint32_t n_layer_run) {
    const moe_model_config *cfg = &c->m->cfg;
    moe_index_ctx *ix = &c->idx;
    uint64_t per_token;
    moe_indexer_plan(c->m, n_layer_run, &ix->n_layer, &per_token);
    if (!ix->n_layer) return;
    const int n_threads = moe_pool_n_threads(c->pool);
    const uint64_t rows = c->p.max_rows, id = cfg->idx_head_dim, ih = cfg->idx_n_head;
    ix->slot = moe_xcalloc(n_layer_run, sizeof *ix->slot);
    for (uint32_t il = 0, n = 0; il < n_layer_run; il++)
        if (cfg->layer[il].indexed && !cfg->layer[il].index_shared) ix->slot[il] = n++;
    ix->cache = moe_xcalloc((uint64_t)c->p.n_seq * c->p.n_ctx * per_token, sizeof(float));
    ix->k = moe_xcalloc(rows * id, sizeof(float));
    ix->q = moe_xcalloc(rows * ih * id, sizeof(float));
    ix->w = moe_xcalloc(rows * ih, sizeof(float));
    ix->n_pool_max = c->p.n_ctx / cfg->idx_kpool + 1;
    ix->scores = moe_xcalloc((uint64_t)n_threads * ix->n_pool_max, sizeof(float));
    ix->sel = moe_xcalloc((uint64_t)n_threads * max_selected(cfg), sizeof(int32_t));
    ix->chosen = moe_xcalloc(rows * max_selected(cfg), sizeof(int32_t));
    ix->n_chosen = moe_xcalloc(rows, sizeof(int32_t));
    ix->gather = moe_xcalloc((uint64_t)n_threads * max_selected(cfg), c->k_row_bytes);
    ix->seconds = moe_xcalloc((uint64_t)n_threads * 2, sizeof(double));
}

moe_indexer_time moe_ctx_indexer_time(const moe_ctx *c) {
    moe_indexer_time t = {0};
    for (int i = 0; c->idx.seconds && i < moe_pool_n_threads(c->pool); i++) {
        t.score_seconds += c->idx.seconds[2 * i];
        t.attend_seconds += c->idx.seconds[2 * i + 1];
    }
    return t;
}

void moe_indexer_free(moe_ctx *c) {
    moe_index_ctx *ix = &c->idx;
    free(ix->slot);
    free(ix->cache);
    free(ix->k);
    free(ix->q);
    free(ix->w);
    free(ix->scores);
    free(ix->sel);
    free(ix->chosen);
    free(ix->n_chosen);
    free(ix->gather);
    free(ix->seconds);
    memset(ix, 0, sizeof *ix);
}

float *moe_indexer_row(const moe_ctx *c, int32_t seq, uint32_t layer, uint32_t pos) {
    const uint64_t index = ((uint64_t)seq * c->idx.n_layer + c->idx.slot[layer]) * c->p.n_ctx + pos;
    return c->idx.cache + index * row_floats(&c->m->cfg);
}

/* The key of pool j of seq: per channel, its members' keys weighted by the softmax over the
 * members of their pooling logits plus the position embedding (ape[member][channel]). */
static void pool_key(moe_ctx *c, const moe_mla_weights *w, int32_t seq, uint32_t il, uint32_t j) {
    const moe_model_config *cfg = &c->m->cfg;
    const int64_t id = cfg->idx_head_dim, kp = cfg->idx_kpool;
    const float *ape = (const float *)w->idx_ape->data;
    float *first = moe_indexer_row(c, seq, il, j * (uint32_t)kp), *out = first + 2 * id;
    const int64_t stride = (int64_t)row_floats(cfg);
    for (int64_t ch = 0; ch < id; ch++) {
        float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
        for (int64_t m = 0; m < kp; m++)
            mx = fmaxf(mx, first[m * stride + id + ch] + ape[m * id + ch]);
        for (int64_t m = 0; m < kp; m++) {
            const float e = expf(first[m * stride + id + ch] + ape[m * id + ch] - mx);
            sum += e;
            acc += e * first[m * stride + ch];
        }
        out[ch] = acc / sum;
    }
}

void moe_indexer_update(moe_ctx *c, const moe_layer_weights *l, uint32_t il, const moe_row *rows,
                        uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_mla_weights *w = &l->mla;
    moe_index_ctx *ix = &c->idx;
    const int64_t id = cfg->idx_head_dim;
    const moe_rope_params rope = moe_rope_params_from_config(cfg);
    moe_matmul(c->pool, w->idx_k, 0, c->xn, n_rows, ix->k, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *key = moe_indexer_row(c, rows[r].seq, il, (uint32_t)rows[r].pos);
        moe_layernorm(key, ix->k + r * id, (const float *)w->idx_k_norm->data,
                      (const float *)w->idx_k_bias->data, id, cfg->idx_norm_eps);
        if (cfg->idx_rope) moe_rope(key, 1, (int)id, rows[r].pos, &rope);
    }
    if (cfg->idx_kpool == 1) return; /* a position is its own pool */
    moe_matmul(c->pool, w->idx_gate, 0, c->xn, n_rows, ix->k, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++)
        memcpy(moe_indexer_row(c, rows[r].seq, il, (uint32_t)rows[r].pos) + id, ix->k + r * id,
               sizeof(float) * (size_t)id);
    /* pools closed by these rows, once every row's key is in place */
    for (uint32_t r = 0; r < n_rows; r++)
        if ((uint32_t)(rows[r].pos + 1) % cfg->idx_kpool == 0)
            pool_key(c, w, rows[r].seq, il, (uint32_t)rows[r].pos / cfg->idx_kpool);
}

/* Is pool a ranked before pool b (higher score; on a tie the earlier pool)? */
static bool ranks_before(const float *score, int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
}

/* The n best of pools 0..n_pool by score into sel[0..n), then in ascending order: a heap whose
 * root is the worst kept pool. */
static void top_pools(const float *score, int32_t n_pool, int32_t n, int32_t *sel) {
    for (int32_t j = 0; j < n_pool; j++) {
        int32_t at;
        if (j < n) {
            at = j; /* grow the heap: sift the new pool up */
            while (at > 0 && ranks_before(score, sel[(at - 1) / 2], j)) {
                sel[at] = sel[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            sel[at] = j;
            continue;
        }
        if (!ranks_before(score, j, sel[0])) continue;
        at = 0; /* replace the root and sift it down */
        for (;;) {
            int32_t child = 2 * at + 1;
            if (child >= n) break;
            if (child + 1 < n && ranks_before(score, sel[child], sel[child + 1])) child++;
            if (!ranks_before(score, j, sel[child])) break;
            sel[at] = sel[child];
            at = child;
        }
        sel[at] = j;
    }
    for (int32_t i = 1; i < n; i++) /* insertion sort: n is top_k / kpool, small */
        for (int32_t k = i; k > 0 && sel[k - 1] > sel[k]; k--) {
            const int32_t t = sel[k];
            sel[k] = sel[k - 1];
            sel[k - 1] = t;
        }
}

typedef struct indexed_job {
    moe_ctx *c;
    const moe_attn_shape *shape;
    const moe_row *rows;
    uint32_t layer;
    bool shared; /* attend to what the last scoring layer chose */
    int parts;   /* query head ranges per row (the fast path splits a row's heads in decode) */
    int64_t n_stretch; /* stretches of pools a row's scores split into (decode) */
} indexed_job;

/* Pools row r scores: its complete ones, or 0 when it keeps every position (no more of them
 * than it keeps). */
static int32_t pools_scored(const moe_model_config *cfg, const moe_row *row) {
    const int32_t n_pool = (row->pos + 1) / (int32_t)cfg->idx_kpool;
    return n_pool <= (int32_t)(cfg->idx_top_k / cfg->idx_kpool) ? 0 : n_pool;
}

/* Row r's scores of pools p0 .. p1 - 1 into score[p0 ..]: the sum over indexer heads in order
 * of hw[h] ReLU(q_h . K_p) (the kernels' index_scores). */
static void score_pools(const indexed_job *j, int64_t r, int32_t p0, int32_t p1, float *score) {
    const moe_model_config *cfg = &j->c->m->cfg;
    const moe_index_ctx *ix = &j->c->idx;
    const int64_t id = cfg->idx_head_dim, ih = cfg->idx_n_head;
    const int64_t key_stride = cfg->idx_kpool * (int64_t)row_floats(cfg);
    const float *keys = moe_indexer_row(j->c, j->rows[r].seq, j->layer, 0) + pool_key_at(cfg);
    moe_kernels_get()->index_scores(ix->q + r * ih * id, ix->w + r * ih, (int)ih, (int)id,
                                    keys + p0 * key_stride, key_stride, p1 - p0, score + p0);
}

/* Row r's selection from its scores into ix->chosen (cell positions, ascending) and
 * ix->n_chosen (-1: every position, dense). */
static void select_cells(const indexed_job *j, int64_t r, const float *score, int thread) {
    moe_ctx *c = j->c;
    const moe_model_config *cfg = &c->m->cfg;
    moe_index_ctx *ix = &c->idx;
    const moe_row *row = &j->rows[r];
    const int32_t kp = (int32_t)cfg->idx_kpool, n_keep = (int32_t)(cfg->idx_top_k / kp);
    const int32_t n_pool = pools_scored(cfg, row);
    if (!n_pool) {
        ix->n_chosen[r] = -1;
        return;
    }
    int32_t *sel = ix->sel + (int64_t)thread * max_selected(cfg);
    top_pools(score, n_pool, n_keep, sel);
    int32_t *cells = ix->chosen + r * max_selected(cfg), n = 0;
    for (int32_t i = 0; i < n_keep; i++) /* the chosen pools' cells, then the tail */
        for (int32_t m = 0; m < kp; m++) cells[n++] = sel[i] * kp + m;
    for (int32_t p = n_pool * kp; p <= row->pos; p++) cells[n++] = p;
    ix->n_chosen[r] = n;
}

/* Rows at least as many as the threads: each row scored and selected by one thread, in its
 * own scores. */
static void select_rows(void *arg, int64_t begin, int64_t end, int thread) {
    const indexed_job *j = arg;
    double *seconds = j->c->idx.seconds + 2 * thread;
    float *score = j->c->idx.scores + (int64_t)thread * j->c->idx.n_pool_max;
    for (int64_t r = begin; r < end; r++) {
        const double t0 = moe_now();
        score_pools(j, r, 0, pools_scored(&j->c->m->cfg, &j->rows[r]), score);
        select_cells(j, r, score, thread);
        seconds[0] += moe_now() - t0;
    }
}

/* Fewer rows than threads (decode, a verify step): row r's pools in SPLIT_POOLS stretches on
 * every thread into scores r, then each row selected. A pool's score is the same whoever
 * computes it. */
#define SPLIT_POOLS 256

static void score_stretches(void *arg, int64_t begin, int64_t end, int thread) {
    const indexed_job *j = arg;
    const moe_index_ctx *ix = &j->c->idx;
    const double t0 = moe_now();
    for (int64_t item = begin; item < end; item++) {
        const int64_t r = item / j->n_stretch;
        const int32_t p0 = (int32_t)(item % j->n_stretch) * SPLIT_POOLS;
        const int32_t n_pool = pools_scored(&j->c->m->cfg, &j->rows[r]);
        if (p0 < n_pool)
            score_pools(j, r, p0, p0 + SPLIT_POOLS < n_pool ? p0 + SPLIT_POOLS : n_pool,
                        ix->scores + r * ix->n_pool_max);
    }
    j->c->idx.seconds[2 * thread] += moe_now() - t0;
}

static void select_split(void *arg, int64_t begin, int64_t end, int thread) {
    const indexed_job *j = arg;
    const double t0 = moe_now();
    for (int64_t r = begin; r < end; r++)
        select_cells(j, r, j->c->idx.scores + r * j->c->idx.n_pool_max, thread);
    j->c->idx.seconds[2 * thread] += moe_now() - t0;
}

/* Every row's selection. */
static void select_all(indexed_job *j, uint32_t n_rows) {
    moe_ctx *c = j->c;
    if (n_rows >= (uint32_t)moe_pool_n_threads(c->pool)) {
        moe_pool_for(c->pool, n_rows, 1, select_rows, j);
        return;
    }
    int32_t most = 0;
    for (uint32_t r = 0; r < n_rows; r++) {
        const int32_t n = pools_scored(&c->m->cfg, &j->rows[r]);
        most = n > most ? n : most;
    }
    j->n_stretch = (most + SPLIT_POOLS - 1) / SPLIT_POOLS;
    if (j->n_stretch) moe_pool_for(c->pool, n_rows * j->n_stretch, 1, score_stretches, j);
    moe_pool_for(c->pool, n_rows, 1, select_split, j);
}

/* Items (row, head range) of the attention: each row over its selected cells, gathered, or over
 * every position when it keeps them all. The exact path runs ggml's order, head after head over
 * every key (moe_attention_row); the fast one the tiled attention, the row a block of one whose
 * K / V tiles are converted once for the range's heads, tiles at fixed positions of what the row
 * reads (so its bits depend on nothing else in the batch). */
static void attend_items(void *arg, int64_t begin, int64_t end, int thread) {
    const indexed_job *j = arg;
    moe_ctx *c = j->c;
    const moe_model_config *cfg = &c->m->cfg;
    moe_index_ctx *ix = &c->idx;
    const moe_attn_shape *s = j->shape;
    const int64_t q_w = (int64_t)s->n_head * s->head_dim_k;
    const int64_t att_w = (int64_t)s->n_head * s->head_dim_v;
    uint8_t *gather = ix->gather + (uint64_t)thread * max_selected(cfg) * c->k_row_bytes;
    float *att_scores = c->scores + (int64_t)thread * c->p.n_ctx;
    double *seconds = ix->seconds + 2 * thread;
    const int chunk = (s->n_head + j->parts - 1) / j->parts;
    for (int64_t item = begin; item < end; item++) {
        const int64_t r = item / j->parts;
        const int h0 = (int)(item % j->parts) * chunk;
        const int h1 = h0 + chunk < s->n_head ? h0 + chunk : s->n_head;
        if (h0 >= h1) continue;
        const moe_row *row = &j->rows[r];
        const double t0 = moe_now();
        const moe_kv_span latent = moe_kv_span_of(c, false, row->seq, j->layer); /* one head */
        const uint64_t row_bytes = latent.stride;
        const uint8_t *k = latent.at;
        int64_t n = ix->n_chosen[r];
        if (n < 0) {
            n = row->pos + 1;
        } else {
            const int32_t *cells = ix->chosen + r * max_selected(cfg);
            for (int64_t i = 0; i < n; i++)
                memcpy(gather + i * row_bytes, k + cells[i] * row_bytes, row_bytes);
            k = gather;
        }
        const moe_attn_kv kv = {
            .k = k, .v = k, .k_stride = (int64_t)row_bytes, .v_stride = (int64_t)row_bytes};
        if (moe_exact()) {
            moe_attention_row(s, c->q + r * q_w, &kv, n, c->att + r * att_w, att_scores);
        } else {
            const int64_t first = 0, last = n - 1;
            const moe_attn_block b = {.q = c->q + r * q_w,
                                      .out = c->att + r * att_w,
                                      .first = &first,
                                      .last = &last,
                                      .n_rows = 1,
                                      .kv = kv,
                                      .scratch =
                                          c->attn_scratch + (size_t)thread * c->attn_scratch_n};
            moe_attention_tiled(s, &b, h0, h1);
        }
        seconds[1] += moe_now() - t0;
    }
}

void moe_attend_rows_indexed(moe_ctx *c, const moe_attn_shape *shape, const moe_layer_weights *l,
                             uint32_t il, const moe_row *rows, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_mla_weights *w = &l->mla;
    moe_index_ctx *ix = &c->idx;
    const int64_t ih = cfg->idx_n_head, id = cfg->idx_head_dim;
    indexed_job job = {
        .c = c, .shape = shape, .rows = rows, .layer = il, .shared = l->plan.index_shared};
    if (!job.shared) {
        moe_matmul(c->pool, w->idx_q_b, 0, c->mla_qa, n_rows, ix->q, c->mm_scratch);
        moe_matmul(c->pool, w->idx_proj, 0, c->xn, n_rows, ix->w, c->mm_scratch);
        const moe_rope_params rope = moe_rope_params_from_config(cfg);
        if (cfg->idx_rope)
            for (uint32_t r = 0; r < n_rows; r++)
                moe_rope(ix->q + r * ih * id, (int)ih, (int)id, rows[r].pos, &rope);
        const float w_scale = 1.0f / sqrtf((float)(id * ih));
        for (int64_t i = 0; i < (int64_t)n_rows * ih; i++) ix->w[i] *= w_scale;
    }
    double start = moe_profile_start();
    if (!job.shared) select_all(&job, n_rows);
    moe_profile_part("indexer: pool scores + top-k", start);
    /* a row's heads in parts as the tiled attention splits a group (one latent head) */
    job.parts = moe_exact() ? 1 : moe_attn_split(c, n_rows, shape->n_head);
    start = moe_profile_start();
    moe_pool_for(c->pool, (int64_t)n_rows * job.parts, 1, attend_items, &job);
    moe_profile_part("sparse attention (selected cells)", start);
}
