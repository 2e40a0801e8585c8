/* ctx.c: the engine context -- KV cache, scratch, and the batched forward pass with its layer
 * loop, which owns the residual stream.
 *
 * Owns every buffer the forward pass touches; all of it is sized and allocated in
 * moe_ctx_new() from the model config and the requested limits. The layer loop runs each
 * layer's plan: the mixer block its plan names, then the FFN block, each on the normed input
 * the stream ops hand it, each output handed back to them. The forward pass reads weights only
 * through ops/ (matmul via the quant trait table), so faster kernels slot in below without
 * touching this file. */
#include "engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/ops.h"

#define MOE_CTX_MAX_DEFAULT 4096  /* default context when the model's is larger (memory) */
#define MOE_MAX_SEQ         4096  /* sequences per context: caps the per-sequence tables */
#define MOE_MAX_ROWS        65536 /* rows per forward call: caps scratch */
#define MOE_MAX_VERIFY      64 /* rows of one sequence a verify step takes back: drafts are few */

/* struct moe_ctx lives in engine_internal.h */

static uint64_t max_u64(uint64_t a, uint64_t b) {
    return a > b ? a : b;
}

/* Layers the context runs: the trunk, then the MTP layers the model can run. */
static uint32_t n_layer_run(const moe_model *m) {
    return m->cfg.n_layer + m->n_layer_mtp;
}

/* Layers with a KV cache (attention or latent) among those the context runs. */
static uint64_t n_layer_kv(const moe_model *m) {
    uint64_t n = 0;
    for (uint32_t il = 0; il < n_layer_run(m); il++)
        n += moe_layer_state_of(&m->cfg, il).k_values != 0;
    return n;
}

/* Bytes of one position of one attention layer in the K and V caches: every attention layer
 * gets the widest layer's row. MLA caches only the latent row; V lives inside it, so v is 0. */
static void kv_row_bytes(const moe_model *m, moe_type kv_type, uint64_t *k, uint64_t *v) {
    const moe_model_config *c = &m->cfg;
    uint64_t k_values = 0, v_values = 0;
    for (uint32_t il = 0; il < n_layer_run(m); il++) {
        const moe_layer_state s = moe_layer_state_of(c, il);
        k_values = max_u64(k_values, s.k_values);
        v_values = max_u64(v_values, s.v_values);
    }
    *k = moe_type_row_bytes(kv_type, (int64_t)k_values);
    *v = moe_type_row_bytes(kv_type, (int64_t)v_values);
}

/* The limits a context is created with, defaults filled in. */
static moe_status resolve_params(const moe_model *m, const moe_ctx_params *p, moe_ctx_params *out,
                                 moe_error *err) {
    const moe_model_config *c = &m->cfg;
    *out = *p;
    if (out->n_ctx == 0)
        out->n_ctx = c->n_ctx_train < MOE_CTX_MAX_DEFAULT ? c->n_ctx_train : MOE_CTX_MAX_DEFAULT;
    if (out->n_seq == 0) out->n_seq = 1;
    if (out->max_rows == 0) out->max_rows = 512;
    if (out->n_snapshots == 0) out->n_snapshots = 2 * out->n_seq;
    if (out->n_threads < 1) out->n_threads = 1;
    if (out->kv_type != MOE_TYPE_F32 && out->kv_type != MOE_TYPE_F16 &&
        out->kv_type != MOE_TYPE_Q8_0)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "context: KV cache type %s is not supported (f32, f16 or q8_0)",
                             moe_type_name(out->kv_type));
    if (out->kv_type == MOE_TYPE_Q8_0) /* every head (and MLA's latent) whole 32-value blocks */
        for (uint32_t il = 0; il < n_layer_run(m); il++) {
            const moe_layer_plan *pl = &m->layers[il].plan;
            const uint32_t hk = c->n_lora_kv ? c->n_lora_kv + c->rope_dims : pl->head_dim_k,
                           hv = c->n_lora_kv ? c->n_lora_kv : pl->head_dim_v;
            if (moe_layer_state_of(c, il).k_values && (hk % 32 || hv % 32))
                return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                     "context: --kv-type q8_0 needs head widths in whole blocks of "
                                     "32 values; layer %u has K %u, V %u",
                                     il, hk, hv);
        }
    if ((unsigned)out->split >= MOE_SPLIT_COUNT)
        return moe_error_set(err, MOE_ERR_ARG, "context: split mode %d is not one moe knows",
                             (int)out->split);
    if (out->split != MOE_SPLIT_NONE && moe_dist_init(err) != MOE_OK) return err->code;
    if (out->split_dense && out->split == MOE_SPLIT_NONE)
        return moe_error_set(err, MOE_ERR_ARG, "context: --split-dense needs --split experts|rows");
    if (out->split == MOE_SPLIT_ROWS && out->expert_cache_bytes)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "context: --split rows holds every expert's slice resident; it does "
                             "not go with an expert cache (--split experts does)");
    if (out->n_seq > MOE_MAX_SEQ || out->max_rows > MOE_MAX_ROWS ||
        out->n_snapshots > 2 * MOE_MAX_SEQ || out->n_verify > MOE_MAX_VERIFY)
        return moe_error_set(err, MOE_ERR_ARG,
                             "context: %u sequences / %u rows / %u snapshots / %u verify rows "
                             "exceed the limits %u / %u / %u / %u",
                             out->n_seq, out->max_rows, out->n_snapshots, out->n_verify,
                             MOE_MAX_SEQ, MOE_MAX_ROWS, 2 * MOE_MAX_SEQ, MOE_MAX_VERIFY);
    return MOE_OK;
}

moe_status moe_ctx_memory_plan(const moe_model *m, const moe_ctx_params *p, moe_ctx_memory *out,
                               moe_error *err) {
    moe_ctx_params params;
    memset(out, 0, sizeof *out);
    if (resolve_params(m, p, &params, err) != MOE_OK) return err->code;
    uint64_t k_row, v_row;
    kv_row_bytes(m, params.kv_type, &k_row, &v_row);
    moe_linear_ctx lin;
    moe_linear_plan(m, &lin);
    uint32_t n_indexed;
    uint64_t index_floats;
    moe_indexer_plan(m, n_layer_run(m), &n_indexed, &index_floats);
    out->kv_bytes_per_token = n_layer_kv(m) * (k_row + v_row) + index_floats * sizeof(float);
    out->recurrent_bytes_per_seq = (uint64_t)lin.n_layer * lin.layer_floats * sizeof(float);
    uint64_t positions;
    if (moe_mul_overflow(params.n_seq, params.n_ctx, &positions) ||
        moe_mul_overflow(positions, out->kv_bytes_per_token, &out->kv_bytes) ||
        moe_mul_overflow(params.n_seq, out->recurrent_bytes_per_seq, &out->recurrent_bytes) ||
        moe_mul_overflow(params.n_snapshots, out->recurrent_bytes_per_seq, &out->snapshot_bytes) ||
        moe_mul_overflow((uint64_t)params.n_seq * moe_verify_checkpoints(&params),
                         out->recurrent_bytes_per_seq, &out->checkpoint_bytes))
        return moe_error_set(err, MOE_ERR_RANGE, "context: state size overflows");
    out->token_bytes = positions * sizeof(int32_t);
    if (moe_add_overflow(out->kv_bytes, out->recurrent_bytes, &out->total) ||
        moe_add_overflow(out->total, out->snapshot_bytes, &out->total) ||
        moe_add_overflow(out->total, out->checkpoint_bytes, &out->total) ||
        moe_add_overflow(out->total, out->token_bytes, &out->total) || out->total > SIZE_MAX / 2)
        return moe_error_set(err, MOE_ERR_RANGE, "context: state size overflows");
    return MOE_OK;
}

moe_ctx *moe_ctx_new(const moe_model *m, const moe_ctx_params *p, moe_error *err) {
    const moe_model_config *c = &m->cfg;
    moe_ctx_params params;
    moe_ctx_memory plan;
    if (resolve_params(m, p, &params, err) != MOE_OK ||
        moe_ctx_memory_plan(m, &params, &plan, err) != MOE_OK)
        return NULL;
    uint64_t k_row, v_row;
    kv_row_bytes(m, params.kv_type, &k_row, &v_row);
    /* no overflow: the plan checked the sum of both */
    const uint64_t kv_rows = (uint64_t)params.n_seq * params.n_ctx * n_layer_kv(m);
    const uint64_t k_bytes = kv_rows * k_row, v_bytes = kv_rows * v_row;
    moe_ctx *x = moe_xcalloc(1, sizeof *x);
    x->m = m;
    x->p = params;
    x->k_row_bytes = k_row;
    x->v_row_bytes = v_row;
    x->seq_len = moe_xcalloc(params.n_seq, sizeof *x->seq_len);
    x->mtp_len = moe_xcalloc(params.n_seq, sizeof *x->mtp_len);
    x->verify_base = moe_xcalloc(params.n_seq, sizeof *x->verify_base);
    x->verify_rows = moe_xcalloc(params.n_seq, sizeof *x->verify_rows);
    x->layer_slot = moe_xcalloc(n_layer_run(m), sizeof *x->layer_slot);
    for (uint32_t il = 0, n_lin = 0; il < n_layer_run(m); il++)
        x->layer_slot[il] = moe_layer_state_of(c, il).k_values ? x->n_layer_kv++ : n_lin++;
    x->stream = c->n_hc ? &moe_stream_hc : &moe_stream_plain;
    if (c->n_hc) moe_hc_alloc(x);
    x->k_cache = moe_huge_alloc(k_bytes, &x->k_cache_size);
    x->v_cache = moe_huge_alloc(v_bytes, &x->v_cache_size);
    x->tokens = calloc(1, plan.token_bytes);
    x->snap_state = calloc(1, plan.snapshot_bytes ? plan.snapshot_bytes : 1);
    x->ckpt = calloc(1, plan.checkpoint_bytes ? plan.checkpoint_bytes : 1);
    if (!x->k_cache || !x->v_cache || !x->tokens || !x->snap_state || !x->ckpt) {
        moe_error_set(err, MOE_ERR_NOMEM,
                      "context: cannot allocate %.1f MiB of KV cache, "
                      "snapshots, checkpoints and token ids",
                      (double)plan.total / (1 << 20));
        moe_ctx_free(x);
        return NULL;
    }
    if (params.split != MOE_SPLIT_NONE)
        x->dist_rows = moe_xcalloc(params.max_rows, sizeof(moe_row));
    x->snaps = moe_xcalloc(params.n_snapshots, sizeof *x->snaps);
    for (uint32_t i = 0; i < params.n_snapshots; i++) x->snaps[i].seq = -1;
    const uint64_t rows = params.max_rows;
    const uint64_t q_w = (uint64_t)c->n_head * c->head_dim_k;
    const uint64_t att_w = (uint64_t)c->n_head * c->head_dim_v;
    x->x = moe_xcalloc(rows * (c->n_hc ? c->n_hc : 1) * c->n_embd, sizeof(float));
    x->xn = moe_xcalloc(rows * max_u64(c->n_embd, att_w), sizeof(float));
    x->y = moe_xcalloc(rows * c->n_embd, sizeof(float));
    x->hidden = moe_xcalloc(rows * c->n_embd, sizeof(float));
    if (m->n_layer_mtp) {
        x->mtp_in = moe_xcalloc(rows * 2 * c->n_embd, sizeof(float));
        x->mtp_h = moe_xcalloc(c->n_embd, sizeof(float));
    }
    x->q = moe_xcalloc(rows * q_w * (c->attn_output_gate ? 2 : 1), sizeof(float));
    if (c->attn_output_gate) x->att_gate = moe_xcalloc(rows * att_w, sizeof(float));
    if (c->n_ff_shexp) x->shexp_gate = moe_xcalloc(rows, sizeof(float));
    x->k = moe_xcalloc(rows * c->n_head_kv * c->head_dim_k, sizeof(float));
    x->v = moe_xcalloc(rows * c->n_head_kv * c->head_dim_v, sizeof(float));
    x->att = moe_xcalloc(rows * att_w, sizeof(float));
    const uint64_t ff_w = max_u64(c->n_ff, c->n_ff_shexp);
    x->ff_gate = moe_xcalloc(rows * ff_w, sizeof(float));
    x->ff_up = moe_xcalloc(rows * ff_w, sizeof(float));
    if (c->n_lora_kv) {
        const uint64_t head_max =
            max_u64(max_u64(c->head_dim_k_mla, c->n_lora_kv), c->head_dim_v_mla);
        x->mla_qa = moe_xcalloc(rows * (c->n_lora_q ? c->n_lora_q : 1), sizeof(float));
        x->mla_q = moe_xcalloc(rows * c->n_head * c->head_dim_k_mla, sizeof(float));
        x->mla_o = moe_xcalloc(rows * c->n_head * c->head_dim_v_mla, sizeof(float));
        x->mla_in = moe_xcalloc(rows * head_max, sizeof(float));
        x->mla_out = moe_xcalloc(rows * head_max, sizeof(float));
    }
    x->pool = moe_pool_new(params.n_threads);
    x->scores =
        moe_xcalloc((size_t)params.n_ctx * (size_t)moe_pool_n_threads(x->pool), sizeof(float));
    x->attn_block = moe_xcalloc(rows + 1, sizeof *x->attn_block);
    const uint64_t attn_dim = max_u64(max_u64(c->head_dim_k, c->head_dim_v), /* every layer's */
                                      c->n_lora_kv ? c->n_lora_kv + c->rope_dims : 0); /* MLA */
    x->attn_scratch_n = moe_attention_tiled_scratch((int)attn_dim);
    x->attn_scratch =
        moe_xcalloc(x->attn_scratch_n * (size_t)moe_pool_n_threads(x->pool), sizeof(float));
    /* The routed experts' scratch holds a group's (row, expert) pairs: room for at least one
     * row's n_expert_used pairs, so that one row's experts run as one pass of gate and up and one
     * of down (with room for `rows` pairs, a context of one row ran them an expert at a time:
     * 8 passes of each a layer, 8 conversions of the same row). */
    const uint64_t pair_rows = max_u64(rows, c->n_expert_used);
    uint64_t mm = moe_matmul_scratch_bytes(m->output, rows);
    bool fused_experts = false, expert_in_norm = false;
    for (uint32_t il = 0; il < n_layer_run(m); il++) {
        const moe_layer_weights *l = &m->layers[il];
        if (l->plan.ffn == MOE_FFN_EXPERTS) {
            fused_experts |= l->experts.gate_up != NULL;
            expert_in_norm |= l->experts.in_norm != NULL || l->experts.router_in_scale != NULL;
        }
        const moe_tensor *ts[MOE_LAYER_MAX_MATRICES + 2] = {l->nextn.eh_proj, l->nextn.head};
        const int n = 2 + moe_layer_matrices(l, ts + 2);
        for (int i = 0; i < n; i++)
            if (ts[i]) mm = max_u64(mm, moe_matmul_scratch_bytes(ts[i], pair_rows));
        mm = max_u64(mm, moe_attention_scratch_bytes(l, (uint32_t)rows));
    }
    x->mm_scratch = moe_xmalloc(mm);
    if (c->n_expert) {
        x->router = moe_xcalloc(rows * c->n_expert, sizeof(float));
        x->expert_ids = moe_xcalloc(rows * c->n_expert_used, sizeof(int32_t));
        x->expert_w = moe_xcalloc(rows * c->n_expert_used, sizeof(float));
        x->route_scratch = moe_xcalloc(2 * (size_t)c->n_expert, sizeof(float));
        x->experts.counts = moe_xcalloc(c->n_expert + 1, sizeof(int32_t));
        x->experts.pair_row = moe_xcalloc(rows * c->n_expert_used, sizeof(int32_t));
        x->experts.pair_w = moe_xcalloc(rows * c->n_expert_used, sizeof(float));
        x->experts.x = moe_xcalloc(pair_rows * c->n_embd, sizeof(float));
        x->experts.gate =
            moe_xcalloc(pair_rows * c->n_ff_exp * (fused_experts ? 2 : 1), sizeof(float));
        x->experts.up = moe_xcalloc(pair_rows * c->n_ff_exp, sizeof(float));
        x->experts.y = moe_xcalloc(pair_rows * c->n_embd, sizeof(float));
        x->experts.mm = x->mm_scratch;
        x->experts.mm_up = moe_xmalloc(mm);
        x->experts.max_rows = (int64_t)pair_rows;
        if (expert_in_norm) x->xn2 = moe_xcalloc(rows * c->n_embd, sizeof(float));
    }
    moe_linear_alloc(x);
    moe_indexer_alloc(x, n_layer_run(m));
    if ((params.split == MOE_SPLIT_ROWS || params.split_dense) && moe_dist_size() > 1 &&
        moe_rows_load(x, n_layer_run(m), err) != MOE_OK) {
        moe_ctx_free(x);
        return NULL;
    }
    if (params.expert_cache_bytes) {
        x->expert_cache = moe_expert_cache_new(m, n_layer_run(m), params.expert_cache_bytes, err);
        if (!x->expert_cache || !moe_expert_cache_prepare(x->expert_cache, params.expert_stats,
                                                          params.pin_experts, err)) {
            moe_ctx_free(x);
            return NULL;
        }
    }
    return x;
}

void moe_ctx_free(moe_ctx *c) {
    if (!c) return;
    if (c->replicate && moe_dist_rank() == 0) moe_ctx_dist_op(c, MOE_OP_END, 0, 0);
    free(c->follow_h);
    free(c->follow_tokens);
    free(c->dist_rows);
    free(c->rows_slice);
    free(c->dense_slice);
    free(c->rows_mem);
    free(c->seq_len);
    free(c->mtp_len);
    free(c->verify_base);
    free(c->verify_rows);
    free(c->ckpt);
    free(c->hidden);
    free(c->mtp_in);
    free(c->mtp_h);
    free(c->tokens);
    free(c->layer_slot);
    free(c->snaps);
    free(c->snap_state);
    free(c->att_gate);
    free(c->shexp_gate);
    moe_linear_free(c);
    moe_hc_free(c);
    moe_indexer_free(c);
    moe_error err = {0};
    if (c->expert_cache && !moe_expert_cache_save_stats(c->expert_cache, &err))
        moe_log(MOE_LOG_WARN, "expert statistics not saved: %s", err.msg);
    moe_expert_cache_free(c->expert_cache);
    moe_huge_free(c->k_cache, c->k_cache_size);
    moe_huge_free(c->v_cache, c->v_cache_size);
    free(c->x);
    free(c->xn);
    free(c->xn2);
    free(c->y);
    free(c->q);
    free(c->k);
    free(c->v);
    free(c->att);
    free(c->ff_gate);
    free(c->ff_up);
    free(c->scores);
    free(c->attn_scratch);
    free(c->attn_block);
    free(c->mla_qa);
    free(c->mla_q);
    free(c->mla_o);
    free(c->mla_in);
    free(c->mla_out);
    free(c->mm_scratch);
    free(c->experts.mm_up);
    free(c->router);
    free(c->expert_ids);
    free(c->expert_w);
    free(c->route_scratch);
    free(c->experts.counts);
    free(c->experts.pair_row);
    free(c->experts.pair_w);
    free(c->experts.x);
    free(c->experts.gate);
    free(c->experts.up);
    free(c->experts.y);
    moe_pool_free(c->pool);
    free(c);
}

const moe_model *moe_ctx_model(const moe_ctx *c) {
    return c->m;
}
moe_pool *moe_ctx_pool(moe_ctx *c) {
    return c->pool;
}
int moe_ctx_n_threads(const moe_ctx *c) {
    return moe_pool_n_threads(c->pool);
}
uint32_t moe_ctx_n_ctx(const moe_ctx *c) {
    return c->p.n_ctx;
}

moe_expert_stats moe_ctx_expert_stats(const moe_ctx *c) {
    return c->stats;
}

uint64_t moe_ctx_routed_bytes(const moe_ctx *c) {
    if (!c->rows_slice)
        return moe_split_expert_bytes(c->m, c->p.split, moe_dist_rank(), moe_dist_size(), NULL);
    uint64_t bytes = 0;
    for (uint32_t il = 0; il < c->m->cfg.n_layer; il++) {
        const moe_expert_weights *w = &c->m->layers[il].experts;
        bytes += c->rows_slice[il].bytes;
        if (w->down_b) bytes += w->down_b->n_bytes;
        if (w->down_scale) bytes += w->down_scale->n_bytes;
    }
    return bytes;
}

moe_expert_cache_stats moe_ctx_expert_cache_stats(const moe_ctx *c) {
    return c->expert_cache ? moe_expert_cache_stats_of(c->expert_cache)
                           : (moe_expert_cache_stats){0};
}

uint32_t moe_ctx_seq_len(const moe_ctx *c, int32_t seq) {
    return seq >= 0 && (uint32_t)seq < c->p.n_seq ? c->seq_len[seq] : 0;
}

/* ==== KV cache addressing ==== */

moe_kv_span moe_kv_span_of(const moe_ctx *c, bool v, int32_t seq, uint32_t layer) {
    const moe_layer_plan *p = &c->m->cfg.layer[layer];
    const moe_layer_state ls = moe_layer_state_of(&c->m->cfg, layer);
    const uint64_t values = v ? ls.v_values : ls.k_values;
    /* a latent (MLA) row is one head; it has no V of its own */
    const uint32_t n_head = values == 0 ? 0 : p->mixer == MOE_MIXER_MLA ? 1 : p->n_head_kv;
    const uint64_t stride =
        n_head ? moe_type_row_bytes(c->p.kv_type, (int64_t)(values / n_head)) : 0;
    const uint64_t region = ((uint64_t)seq * c->n_layer_kv + c->layer_slot[layer]) * c->p.n_ctx *
                            (v ? c->v_row_bytes : c->k_row_bytes);
    return (moe_kv_span){.at = (v ? c->v_cache : c->k_cache) + region,
                         .stride = stride,
                         .head = (uint64_t)c->p.n_ctx * stride,
                         .n_head = n_head};
}

void moe_kv_store(const moe_ctx *c, uint8_t *dst, const float *src, uint64_t n) {
    if (c->p.kv_type == MOE_TYPE_F16) {
        uint16_t *d = (uint16_t *)dst;
        for (uint64_t i = 0; i < n; i++) d[i] = moe_f32_to_fp16(src[i]);
    } else if (c->p.kv_type == MOE_TYPE_Q8_0) { /* ggml's quantize_row_q8_0: round to nearest */
        moe_type_traits_get(MOE_TYPE_Q8_0)->from_float(src, dst, (int64_t)n);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

/* ==== The plain residual stream: x += block(norm(x)) ==== */

static void plain_begin(moe_ctx *c, const float *embd, uint32_t n_rows) {
    memcpy(c->x, embd, sizeof(float) * n_rows * c->m->cfg.n_embd);
}

static const float *plain_pre(moe_ctx *c, const moe_layer_weights *l, moe_site site,
                              uint32_t n_rows) {
    (void)l, (void)site, (void)n_rows;
    return c->x;
}

static void plain_post(moe_ctx *c, const moe_layer_weights *l, moe_site site, uint32_t n_rows) {
    const int64_t n = (int64_t)n_rows * c->m->cfg.n_embd;
    moe_add_pool(c->pool, c->x, c->y, n);
    if (site == MOE_SITE_FFN && l->out_scale) { /* the layer's output scale (Gemma 4) */
        const float s = *(const float *)l->out_scale->data;
        for (int64_t i = 0; i < n; i++) c->x[i] *= s;
    }
}

static const float *plain_final(moe_ctx *c, uint32_t r) {
    return c->x + (int64_t)r * c->m->cfg.n_embd;
}

const moe_stream_ops moe_stream_plain = {
    .begin = plain_begin,
    .pre = plain_pre,
    .post = plain_post,
    .final = plain_final,
};

/* ==== Forward ==== */

static const moe_mixer_block mixer_blocks[MOE_MIXER_COUNT] = {
    [MOE_MIXER_ATTENTION] = moe_block_attention,
    [MOE_MIXER_MLA] = moe_block_attention_mla,
    [MOE_MIXER_GDN] = moe_block_linear,
    [MOE_MIXER_KDA] = moe_block_linear,
};

/* c->xn = RMSNorm of stream s's input to layer l's block at `site`. */
static void block_input(moe_ctx *c, const moe_stream_ops *s, const moe_layer_weights *l,
                        moe_site site, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const int64_t n_embd = cfg->n_embd;
    double start = moe_profile_start();
    const float *in = s->pre(c, l, site, n_rows);
    moe_profile_part("residual stream", start);
    start = moe_profile_start();
    c->x_in = in;
    const moe_tensor *norm = site == MOE_SITE_MIXER ? l->attn_norm : l->ffn_norm;
    moe_rmsnorm_rows(c->pool, c->xn, in, (const float *)norm->data, n_rows, n_embd, cfg->rms_eps);
    moe_profile_part("rmsnorm", start);
}

void moe_rows_post_norm(moe_ctx *c, float *rows, const moe_tensor *norm, uint32_t n_rows,
                        int64_t width) {
    if (!norm) return;
    const double start = moe_profile_start();
    moe_rmsnorm_rows(c->pool, rows, rows, (const float *)norm->data, n_rows, width,
                     c->m->cfg.rms_eps);
    moe_profile_part("rmsnorm", start);
}

/* Rows must continue their sequences in order from len[seq] (the trunk's or the MTP layers'). */
static moe_status check_rows(const moe_ctx *c, const moe_row *rows, uint32_t n_rows,
                             const uint32_t *len, moe_error *err) {
    if (n_rows == 0 || n_rows > c->p.max_rows)
        return moe_error_set(err, MOE_ERR_ARG, "batch of %u rows (this context takes 1..%u)",
                             n_rows, c->p.max_rows);
    /* positions must continue each sequence in order; count them in a scratch copy */
    for (uint32_t r = 0; r < n_rows; r++) {
        const moe_row *row = &rows[r];
        if (row->seq < 0 || (uint32_t)row->seq >= c->p.n_seq)
            return moe_error_set(err, MOE_ERR_ARG, "row %u: sequence %d out of range 0..%u", r,
                                 row->seq, c->p.n_seq - 1);
        if (row->token < 0 || (uint32_t)row->token >= c->m->cfg.n_vocab)
            return moe_error_set(err, MOE_ERR_ARG, "row %u: token %d out of range 0..%u", r,
                                 row->token, c->m->cfg.n_vocab - 1);
        if (row->pos < 0 || (uint32_t)row->pos >= c->p.n_ctx)
            return moe_error_set(err, MOE_ERR_RANGE,
                                 "row %u: position %d is outside the context of %u tokens", r,
                                 row->pos, c->p.n_ctx);
        uint32_t expect = len[row->seq];
        for (uint32_t e = 0; e < r; e++)
            if (rows[e].seq == row->seq) expect++;
        if ((uint32_t)row->pos != expect)
            return moe_error_set(err, MOE_ERR_ARG,
                                 "row %u: sequence %d continues at position %u, not %d", r,
                                 row->seq, expect, row->pos);
    }
    return MOE_OK;
}

/* One layer over the rows in stream s: the mixer its plan names, then its FFN. */
static void run_layer(moe_ctx *c, const moe_stream_ops *s, uint32_t il, const moe_row *rows,
                      uint32_t n_rows) {
    const moe_layer_weights *l = &c->m->layers[il];
    block_input(c, s, l, MOE_SITE_MIXER, n_rows);
    mixer_blocks[l->plan.mixer](c, l, il, rows, n_rows);
    double start = moe_profile_start();
    s->post(c, l, MOE_SITE_MIXER, n_rows);
    moe_profile_part("residual stream", start);
    block_input(c, s, l, MOE_SITE_FFN, n_rows);
    if (l->plan.ffn == MOE_FFN_EXPERTS)
        moe_block_ffn_experts(c, l, n_rows);
    else
        moe_block_ffn_dense(c, l, n_rows);
    start = moe_profile_start();
    s->post(c, l, MOE_SITE_FFN, n_rows);
    moe_profile_part("residual stream", start);
}

/* The normed final hidden state of every row into c->hidden (what the MTP head takes), then
 * `head` times those of the rows that asked for logits, packed into logits. */
static void output_head(moe_ctx *c, const moe_stream_ops *s, const moe_row *rows, uint32_t n_rows,
                        const moe_tensor *norm, const moe_tensor *head, float *logits) {
    const moe_model_config *cfg = &c->m->cfg;
    const int64_t n_embd = cfg->n_embd;
    uint32_t n_out = 0;
    const double start = moe_profile_start();
    for (uint32_t r = 0; r < n_rows; r++) {
        float *h = c->hidden + r * n_embd;
        moe_rmsnorm(h, s->final(c, r), (const float *)norm->data, n_embd, cfg->rms_eps);
        if (rows[r].logits) /* xn is spent: the head's input, packed */
            memcpy(c->xn + n_out++ * n_embd, h, sizeof(float) * (size_t)n_embd);
    }
    moe_profile_part("rmsnorm", start);
    c->n_hidden = n_rows;
    if (!logits) return; /* a follower: rank 0 samples */
    if (n_out) moe_matmul(c->pool, head, 0, c->xn, n_out, logits, c->mm_scratch);
    const float cap = cfg->final_softcap;
    if (cap > 0.0f) /* as llama.cpp: scale by 1/cap, tanh, scale by cap */
        for (int64_t i = 0; i < (int64_t)n_out * cfg->n_vocab; i++)
            logits[i] = tanhf(logits[i] * (1.0f / cap)) * cap;
}

/* Split across ranks: every rank runs rank 0's rows, checked (check_rows against len) before any
 * rank computes, so that either every rank runs the step or none does: a rank that ran it alone
 * would wait in its first reduction for ranks that never come. Rank 0's rows and its verdict go
 * out first; a rank whose own call differs (another number of rows or logits rows: it would
 * write past its logits buffer) or that refuses what rank 0 runs ends the job, named; a
 * follower takes rank 0's rows, computing no logits. */
static moe_status dist_rows(moe_ctx *c, const moe_row **rows, uint32_t *n_rows, const uint32_t *len,
                            moe_error *err) {
    if (c->p.split == MOE_SPLIT_NONE || moe_dist_size() <= 1)
        return check_rows(c, *rows, *n_rows, len, err);
    const bool follower = c->replicate && moe_dist_rank() != 0;
    uint32_t head[3] = {*n_rows, 0, 0}; /* rows, logits rows, rank 0 refused the step */
    moe_status mine = MOE_OK;
    if (!follower) {
        for (uint32_t r = 0; r < *n_rows; r++) head[1] += (*rows)[r].logits;
        mine = check_rows(c, *rows, *n_rows, len, err);
        head[2] = mine != MOE_OK;
    }
    const uint32_t own[3] = {head[0], head[1], head[2]};
    moe_dist_bcast(head, sizeof head);
    const bool diverged =
        !follower && (head[0] != own[0] || head[1] != own[1] || head[2] != own[2]);
    if (!diverged && head[2]) /* refused everywhere: nothing runs */
        return follower ? moe_error_set(err, MOE_ERR_ARG, "rank 0 refused this step") : mine;
    if (diverged || head[0] > c->p.max_rows) {
        fprintf(stderr,
                "moe: rank %d was given %u rows (%u with logits%s), rank 0 %u (%u%s): the ranks' "
                "steps diverged; ending the job\n",
                moe_dist_rank(), own[0], own[1], own[2] ? ", refused" : "", head[0], head[1],
                head[2] ? ", refused" : "");
        moe_dist_abort(1);
        return moe_error_set(err, MOE_ERR_ARG, "the ranks' steps diverged");
    }
    if (moe_dist_rank() == 0 && *rows != c->dist_rows)
        memcpy(c->dist_rows, *rows, sizeof(moe_row) * head[0]);
    moe_dist_bcast(c->dist_rows, sizeof(moe_row) * head[0]);
    *n_rows = head[0];
    *rows = c->dist_rows;
    if (follower && check_rows(c, *rows, *n_rows, len, err) != MOE_OK) {
        fprintf(stderr,
                "moe: rank %d cannot run the step rank 0 runs (%s): the ranks' states diverged; "
                "ending the job\n",
                moe_dist_rank(), err->msg);
        moe_dist_abort(1);
        return err->code;
    }
    return MOE_OK;
}

/* ==== Replicated contexts: rank 0 leads, the others follow ==== */

void moe_ctx_dist_op(moe_ctx *c, moe_dist_op_kind kind, int32_t seq, uint32_t a) {
    if (!c->replicate) return;
    moe_dist_op op = {(int32_t)kind, seq, a};
    const moe_dist_op mine = op;
    if (c->has_pending) { /* the follow loop's call: the op it received */
        op = c->pending;
        c->has_pending = false;
    } else {
        moe_dist_bcast_idle(&op, sizeof op); /* as the follow loop takes it */
    }
    if (op.kind != mine.kind || op.seq != mine.seq || op.a != mine.a) {
        fprintf(stderr,
                "moe: rank %d is at call %d (%d, %u), rank 0 at %d (%d, %u): the ranks' states "
                "diverged; ending the job\n",
                moe_dist_rank(), mine.kind, mine.seq, mine.a, op.kind, op.seq, op.a);
        moe_dist_abort(1);
    }
}

const void *moe_ctx_dist_payload(moe_ctx *c, const void *mine, void *theirs, size_t bytes) {
    if (!c->replicate) return mine;
    const bool lead = moe_dist_rank() == 0;
    moe_dist_bcast(lead ? (void *)mine : theirs, bytes);
    return lead ? mine : theirs;
}

/* What a follower's context must share with rank 0's to replay its calls: a follower with
 * fewer sequences, positions or rows than rank 0 would refuse a step rank 0 runs. */
enum {
    SHAPE_N_CTX,
    SHAPE_N_SEQ,
    SHAPE_MAX_ROWS,
    SHAPE_KV_TYPE,
    SHAPE_N_SNAPSHOTS,
    SHAPE_N_VERIFY,
    SHAPE_SPLIT,
    SHAPE_SPLIT_DENSE,
    SHAPE_COUNT
};
static void ctx_shape(const moe_ctx *c, uint32_t *shape) {
    shape[SHAPE_N_CTX] = c->p.n_ctx;
    shape[SHAPE_N_SEQ] = c->p.n_seq;
    shape[SHAPE_MAX_ROWS] = c->p.max_rows;
    shape[SHAPE_KV_TYPE] = (uint32_t)c->p.kv_type;
    shape[SHAPE_N_SNAPSHOTS] = c->p.n_snapshots;
    shape[SHAPE_N_VERIFY] = c->p.n_verify;
    shape[SHAPE_SPLIT] = (uint32_t)c->p.split;
    shape[SHAPE_SPLIT_DENSE] = c->p.split_dense;
}

void moe_ctx_lead(moe_ctx *c) {
    c->replicate = c->p.split != MOE_SPLIT_NONE && moe_dist_size() > 1;
    uint32_t shape[SHAPE_COUNT];
    ctx_shape(c, shape);
    if (c->replicate) moe_dist_bcast_idle(shape, sizeof shape); /* as moe_ctx_follow takes it */
}

moe_status moe_ctx_follow(moe_ctx *c, moe_error *err) {
    if (c->p.split == MOE_SPLIT_NONE || moe_dist_size() <= 1 || moe_dist_rank() == 0)
        return moe_error_set(err, MOE_ERR_ARG,
                             "follow: only the other ranks of a split job follow");
    c->replicate = true;
    uint32_t mine[SHAPE_COUNT], lead[SHAPE_COUNT];
    ctx_shape(c, mine);
    moe_dist_bcast_idle(lead, sizeof lead);
    if (memcmp(mine, lead, sizeof mine) != 0) {
        fprintf(stderr,
                "moe: rank %d's context (%u positions, %u sequences, %u rows, %u snapshots, %u "
                "verify rows) is not rank 0's (%u, %u, %u, %u, %u) or its KV type or split "
                "differ: every rank must be started with the same options; ending the job\n",
                moe_dist_rank(), mine[SHAPE_N_CTX], mine[SHAPE_N_SEQ], mine[SHAPE_MAX_ROWS],
                mine[SHAPE_N_SNAPSHOTS], mine[SHAPE_N_VERIFY], lead[SHAPE_N_CTX], lead[SHAPE_N_SEQ],
                lead[SHAPE_MAX_ROWS], lead[SHAPE_N_SNAPSHOTS], lead[SHAPE_N_VERIFY]);
        moe_dist_abort(1);
        return moe_error_set(err, MOE_ERR_ARG, "follow: this rank's context is not rank 0's");
    }
    const int64_t n_embd = c->m->cfg.n_embd;
    c->follow_h = moe_xmalloc(sizeof(float) * c->p.max_rows * (size_t)n_embd);
    c->follow_tokens = moe_xmalloc(sizeof(int32_t) * c->p.n_ctx);
    for (;;) {
        moe_dist_bcast_idle(&c->pending, sizeof c->pending);
        c->has_pending = true;
        const moe_dist_op op = c->pending;
        moe_error ignored = {0}; /* rank 0 meets the same error and answers its caller */
        uint32_t reused;
        switch (op.kind) {
        case MOE_OP_END:
            c->has_pending = false;
            return MOE_OK;
        case MOE_OP_DECODE:
            moe_ctx_decode(c, c->dist_rows, op.a, NULL, &ignored);
            break;
        case MOE_OP_VERIFY:
            moe_ctx_verify(c, c->dist_rows, op.a, NULL, &ignored);
            break;
        case MOE_OP_DECODE_MTP:
            moe_ctx_decode_mtp(c, c->dist_rows, op.a, c->follow_h, NULL, &ignored);
            break;
        case MOE_OP_MTP_REWIND:
            moe_ctx_mtp_rewind(c, op.seq, op.a);
            break;
        case MOE_OP_ACCEPT:
            moe_ctx_seq_accept(c, op.seq, op.a, &ignored);
            break;
        case MOE_OP_TRUNCATE:
            moe_ctx_seq_truncate(c, op.seq, op.a, &ignored);
            break;
        case MOE_OP_SNAPSHOT:
            moe_ctx_seq_snapshot(c, op.seq, &ignored);
            break;
        case MOE_OP_RESTORE:
            moe_ctx_seq_restore(c, op.seq, (int32_t)op.a, &ignored);
            break;
        case MOE_OP_DROP:
            moe_ctx_snapshot_drop(c, (int32_t)op.a);
            break;
        case MOE_OP_REUSE:
            moe_ctx_seq_reuse(c, op.seq, c->follow_tokens, op.a, &reused, &ignored);
            break;
        default:
            fprintf(stderr,
                    "moe: rank %d: rank 0 sent call %d, which this moe does not know; "
                    "ending the job\n",
                    moe_dist_rank(), op.kind);
            moe_dist_abort(1);
            return moe_error_set(err, MOE_ERR_FORMAT, "follow: unknown call %d", op.kind);
        }
    }
}

typedef struct embed_job {
    moe_ctx *c;
    const moe_row *rows;
} embed_job;

/* Token rows per work item of the embedding lookup, and the rows from which it is shared out
 * (a decode step's few rows are not worth a hand-out). */
#define EMBED_ROWS     4
#define EMBED_MIN_ROWS 16

/* c->y's rows [begin, end): the rows' tokens' embeddings, scaled when the model says so. */
static void embed_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const embed_job *j = arg;
    const moe_model *m = j->c->m;
    const int64_t n_embd = m->cfg.n_embd;
    for (int64_t r = begin; r < end; r++) {
        float *out = j->c->y + r * n_embd;
        moe_tensor_row_f32(m->token_embd, j->rows[r].token, out);
        if (m->cfg.embd_scale != 0.0f)
            for (int64_t i = 0; i < n_embd; i++) out[i] *= m->cfg.embd_scale;
    }
}

moe_status moe_ctx_decode(moe_ctx *c, const moe_row *rows, uint32_t n_rows, float *logits,
                          moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_DECODE, 0, n_rows);
    if (dist_rows(c, &rows, &n_rows, c->seq_len, err) != MOE_OK) return err->code;
    const double start = moe_profile_on() ? moe_now() : 0;
    memset(&c->stats, 0, sizeof c->stats);
    const moe_model *m = c->m;
    if (!c->verifying) /* a plain step ends what a verify step left to accept */
        for (uint32_t r = 0; r < n_rows; r++) c->verify_rows[rows[r].seq] = 0;

    double part = moe_profile_start();
    embed_job embed = {c, rows};
    if (n_rows < EMBED_MIN_ROWS)
        embed_rows(&embed, 0, n_rows, 0);
    else
        moe_pool_for(c->pool, n_rows, EMBED_ROWS, embed_rows, &embed);
    c->stream->begin(c, c->y, n_rows);
    moe_profile_part("token embedding", part);
    for (uint32_t il = 0; il < m->cfg.n_layer; il++) run_layer(c, c->stream, il, rows, n_rows);
    if (c->p.split != MOE_SPLIT_NONE && moe_dist_lost(false, err) >= 0) /* sums never came */
        return err->code;
    if (c->expert_cache && moe_expert_cache_take_error(c->expert_cache, err)) {
        /* the step's state is half written (linear layers advanced): its sequences start over */
        for (uint32_t r = 0; r < n_rows; r++) {
            moe_error ignored = {0};
            moe_ctx_seq_truncate(c, rows[r].seq, 0, &ignored);
        }
        return err->code;
    }
    for (uint32_t r = 0; r < n_rows; r++) {
        c->seq_len[rows[r].seq] = (uint32_t)rows[r].pos + 1;
        c->tokens[(uint64_t)rows[r].seq * c->p.n_ctx + (uint32_t)rows[r].pos] = rows[r].token;
    }
    output_head(c, c->stream, rows, n_rows, m->output_norm, m->output, logits);
    if (start > 0)
        moe_profile_add(MOE_PROFILE_STEP, strlen(MOE_PROFILE_STEP), moe_now() - start, 0);
    return MOE_OK;
}

moe_status moe_ctx_verify(moe_ctx *c, const moe_row *rows, uint32_t n_rows, float *logits,
                          moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_VERIFY, 0, n_rows);
    if ((c->replicate ? dist_rows(c, &rows, &n_rows, c->seq_len, err)
                      : check_rows(c, rows, n_rows, c->seq_len, err)) != MOE_OK)
        return err->code;
    for (uint32_t r = 0; r < n_rows; r++) c->verify_rows[rows[r].seq] = 0;
    for (uint32_t r = 0; r < n_rows; r++) {
        const int32_t seq = rows[r].seq;
        if (c->verify_rows[seq]++ == 0) c->verify_base[seq] = c->seq_len[seq];
        if (c->verify_rows[seq] > c->p.n_verify) {
            for (uint32_t e = 0; e < n_rows; e++) c->verify_rows[rows[e].seq] = 0;
            return moe_error_set(err, MOE_ERR_ARG,
                                 "verify step: sequence %d has more than %u rows (the context's "
                                 "n_verify)",
                                 seq, c->p.n_verify);
        }
    }
    c->verifying = true;
    const moe_status st = moe_ctx_decode(c, rows, n_rows, logits, err);
    c->verifying = false;
    if (st != MOE_OK)
        for (uint32_t r = 0; r < n_rows; r++) c->verify_rows[rows[r].seq] = 0;
    return st;
}

const float *moe_ctx_hidden(const moe_ctx *c, uint32_t *n_rows) {
    *n_rows = c->n_hidden;
    return c->hidden;
}

uint32_t moe_ctx_mtp_len(const moe_ctx *c, int32_t seq) {
    return seq >= 0 && (uint32_t)seq < c->p.n_seq ? c->mtp_len[seq] : 0;
}

void moe_ctx_mtp_rewind(moe_ctx *c, int32_t seq, uint32_t n) {
    moe_ctx_dist_op(c, MOE_OP_MTP_REWIND, seq, n);
    if (seq >= 0 && (uint32_t)seq < c->p.n_seq && c->mtp_len[seq] > n) c->mtp_len[seq] = n;
}

moe_status moe_ctx_decode_mtp(moe_ctx *c, const moe_row *rows, uint32_t n_rows, const float *h,
                              float *logits, moe_error *err) {
    const moe_model *m = c->m;
    moe_ctx_dist_op(c, MOE_OP_DECODE_MTP, 0, n_rows);
    if (!m->n_layer_mtp)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s has no MTP layer moe can run",
                             m->path ? m->path : "the model");
    if (c->replicate) {
        if (dist_rows(c, &rows, &n_rows, c->mtp_len, err) != MOE_OK) return err->code;
        h = moe_ctx_dist_payload(c, h, c->follow_h, sizeof(float) * n_rows * m->cfg.n_embd);
    } else if (check_rows(c, rows, n_rows, c->mtp_len, err) != MOE_OK) {
        return err->code;
    }
    memset(&c->stats, 0, sizeof c->stats);
    const int64_t n_embd = m->cfg.n_embd;
    const uint32_t il = m->cfg.n_layer; /* the first MTP layer drafts the next token */
    const moe_nextn_weights *w = &m->layers[il].nextn;
    /* x = eh_proj [RMSNorm(embedding of the token) enorm ; RMSNorm(h) hnorm] */
    for (uint32_t r = 0; r < n_rows; r++) {
        float *in = c->mtp_in + (int64_t)r * 2 * n_embd;
        moe_tensor_row_f32(w->embed ? w->embed : m->token_embd, rows[r].token, c->y);
        moe_rmsnorm(in, c->y, (const float *)w->enorm->data, n_embd, m->cfg.rms_eps);
        moe_rmsnorm(in + n_embd, h + (int64_t)r * n_embd, (const float *)w->hnorm->data, n_embd,
                    m->cfg.rms_eps);
    }
    moe_matmul(c->pool, w->eh_proj, 0, c->mtp_in, n_rows, c->y, c->mm_scratch);
    const moe_stream_ops *plain = &moe_stream_plain; /* the NextN block: a plain pre-norm one */
    plain->begin(c, c->y, n_rows);
    run_layer(c, plain, il, rows, n_rows);
    if (c->p.split != MOE_SPLIT_NONE && moe_dist_lost(false, err) >= 0) return err->code;
    if (c->expert_cache && moe_expert_cache_take_error(c->expert_cache, err)) return err->code;
    for (uint32_t r = 0; r < n_rows; r++) c->mtp_len[rows[r].seq] = (uint32_t)rows[r].pos + 1;
    output_head(c, plain, rows, n_rows, w->head_norm ? w->head_norm : m->output_norm,
                w->head ? w->head : m->output, logits);
    return MOE_OK;
}
