/* ffn.c: the feed-forward blocks -- the dense gated FFN and routed experts -- from the normed
 * input (c->xn) to the block's output (c->y). The expert block routes every row (router bias,
 * selection bias, groups, per-expert output scales as the config says), then runs the grouped
 * dispatch (ops/moe.c) so each chosen expert is read once for all rows that chose it, then the
 * shared expert if the model has one (qwen3next gates it per row by sigmoid(w . x)). Gemma 4
 * norms the FFN's input three ways (the router's, the routed experts' and the shared MLP's) and
 * norms each branch's output and their sum: the trap is that the router and routed experts read
 * the un-normed input (c->x_in), not c->xn. */
#include "engine_internal.h"

#include <math.h>
#include <string.h>

/* out = row_gate[r] * down(act(gate(xn)) * up(xn)) for every row r (row_gate NULL: 1), or
 * out += that (RMSNormed by post_norm first, when given) when accumulate: the dense FFN, and the
 * shared expert beside the routed ones. act is the config's ffn_act; limit clamps a SwiGLU.
 * --split-dense: this rank's rows of gate and up (c->dense_slice), the ranks' slices of the
 * intermediate joined, then its rows of down, the ranks' slices of the output joined: every dot
 * is one rank's whole, so the result is one rank's bit for bit. */
static void gated_ffn(moe_ctx *c, const moe_layer_weights *l, const moe_ffn_weights *w, float limit,
                      const float *row_gate, const moe_tensor *post_norm, bool accumulate,
                      float *out, uint32_t n_rows) {
    const moe_rows_slice *part = c->dense_slice ? &c->dense_slice[l - c->m->layers] : NULL;
    const moe_ffn_weights sliced = part ? (moe_ffn_weights){part->gate, part->up, part->down} : *w;
    const int64_t n_embd = c->m->cfg.n_embd, n_ff = sliced.gate->ne[1];
    float *down = accumulate ? c->xn : out; /* xn is spent once gate and up have read it */
    if (n_ff) {
        moe_matmul(c->pool, sliced.gate, 0, c->xn, n_rows, c->ff_gate, c->mm_scratch);
        moe_matmul(c->pool, sliced.up, 0, c->xn, n_rows, c->ff_up, c->mm_scratch);
        moe_glu_pool(c->pool, c->m->cfg.ffn_act, limit, c->ff_up, c->ff_gate,
                     (int64_t)n_rows * n_ff);
    }
    if (part) {
        moe_dist_join(c->ff_up, c->ff_up, n_rows, w->down->ne[0]);
        if (sliced.down->ne[1])
            moe_matmul(c->pool, sliced.down, 0, c->ff_up, n_rows, down, c->mm_scratch);
        moe_dist_join(down, down, n_rows, n_embd);
    } else {
        moe_matmul(c->pool, sliced.down, 0, c->ff_up, n_rows, down, c->mm_scratch);
    }
    if (!accumulate) return;
    moe_rows_post_norm(c, c->xn, post_norm, n_rows, n_embd);
    for (uint32_t r = 0; r < n_rows; r++) {
        const float g = row_gate ? row_gate[r] : 1.0f;
        for (int64_t i = 0; i < n_embd; i++) out[r * n_embd + i] += g * c->xn[r * n_embd + i];
    }
}

void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    gated_ffn(c, l, &l->ffn, l->plan.clamp_ffn, NULL, NULL, false, c->y, n_rows);
    moe_rows_post_norm(c, c->y, l->ffn_post_norm, n_rows, c->m->cfg.n_embd);
}

/* y += [sigmoid(w . xn) *] shared_expert(xn); xn is consumed. */
static void shared_expert(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_expert_weights *w = &l->experts;
    const int64_t n_embd = c->m->cfg.n_embd;
    if (w->shared_gate) {
        const float *g = (const float *)w->shared_gate->data;
        for (uint32_t r = 0; r < n_rows; r++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < n_embd; i++) dot += g[i] * c->xn[r * n_embd + i];
            c->shexp_gate[r] = 1.0f / (1.0f + expf(-dot));
        }
    }
    gated_ffn(c, l, &w->shared, l->plan.clamp_ffn, w->shared_gate ? c->shexp_gate : NULL,
              w->shared_out_norm, true, c->y, n_rows);
}

/* c->xn2 = RMSNorm(x_in) * norm for n_rows rows (norm NULL: no weight). */
static void norm_input(moe_ctx *c, const moe_tensor *norm, uint32_t n_rows) {
    const int64_t n_embd = c->m->cfg.n_embd;
    for (uint32_t r = 0; r < n_rows; r++)
        moe_rmsnorm(c->xn2 + r * n_embd, c->x_in + r * n_embd,
                    norm ? (const float *)norm->data : NULL, n_embd, c->m->cfg.rms_eps);
}

/* Router logits into c->router: of the normed input, or (Gemma 4) of
 * RMSNorm(x_in) / sqrt(n_embd) * router_in_scale. */
static void router_logits(moe_ctx *c, const moe_expert_weights *w, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const float *in = c->xn;
    if (w->router_in_scale) {
        const int64_t n_embd = cfg->n_embd;
        const float *s = (const float *)w->router_in_scale->data;
        const float inv_sqrt = 1.0f / sqrtf((float)n_embd);
        norm_input(c, NULL, n_rows);
        for (uint32_t r = 0; r < n_rows; r++)
            for (int64_t i = 0; i < n_embd; i++)
                c->xn2[r * n_embd + i] = c->xn2[r * n_embd + i] * inv_sqrt * s[i];
        in = c->xn2;
    }
    moe_matmul(c->pool, w->router, 0, in, n_rows, c->router, c->mm_scratch);
    moe_add_bias(c->router, w->router_b, 0, n_rows, cfg->n_expert);
}

moe_expert_set moe_expert_set_of(const moe_model_config *cfg, const moe_layer_weights *l) {
    const moe_expert_weights *w = &l->experts;
    return (moe_expert_set){.gate = w->gate,
                            .up = w->up,
                            .gate_up = w->gate_up,
                            .down = w->down,
                            .gate_b = w->gate_b,
                            .up_b = w->up_b,
                            .down_b = w->down_b,
                            .act = cfg->expert_act,
                            .limit = l->plan.clamp_exp};
}

/* y = the routed experts' weighted sum (in expert order; normed by out_norm when given), then
 * + the shared expert's output: the order llama.cpp sums them in, before the loop adds y to the
 * residual; then the block's output norm. */
void moe_block_ffn_experts(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_expert_weights *w = &l->experts;
    router_logits(c, w, n_rows);
    const moe_route_params route = {
        .n_expert = (int)cfg->n_expert,
        .n_used = (int)cfg->n_expert_used,
        .gating = cfg->gating,
        .norm = cfg->norm_topk,
        .scale = cfg->expert_weights_scale,
        .sel_bias = w->sel_bias ? (const float *)w->sel_bias->data : NULL,
        .n_group = (int)cfg->n_expert_group,
        .topk_group = (int)cfg->n_group_used,
        .expert_scale = w->down_scale ? (const float *)w->down_scale->data : NULL};
    const double start = moe_profile_start();
    moe_route(&route, c->router, n_rows, c->expert_ids, c->expert_w, c->route_scratch);
    moe_profile_part("router top-k", start);
    /* split by rows: this rank's slices of every expert (the rank whose slice starts the
     * intermediate alone adds the down bias; ranks before it hold empty slices) */
    const moe_rows_slice *rows = c->rows_slice ? &c->rows_slice[l - c->m->layers] : NULL;
    moe_expert_set experts = moe_expert_set_of(cfg, l);
    if (rows) {
        experts.gate = rows->gate;
        experts.up = rows->up;
        experts.gate_up = rows->gate_up;
        experts.down = rows->down;
        experts.gate_b = rows->gate_b;
        experts.up_b = rows->up_b;
        if (rows->ff.begin != 0) experts.down_b = NULL;
    }
    if (c->expert_cache)
        experts.source = moe_expert_cache_source(c->expert_cache, (uint32_t)(l - c->m->layers));
    experts.shard = c->p.split == MOE_SPLIT_EXPERTS ? moe_dist_rank() : 0;
    experts.n_shards = c->p.split == MOE_SPLIT_EXPERTS ? moe_dist_size() : 1;
    const float *in = c->xn;
    if (w->in_norm) {
        norm_input(c, w->in_norm, n_rows);
        in = c->xn2;
    }
    memset(c->y, 0, sizeof(float) * n_rows * cfg->n_embd);
    const bool ok = (rows && rows->ff.end == rows->ff.begin) || /* an empty slice adds zeros */
                    moe_experts_forward(c->pool, &experts, in, n_rows, c->expert_ids, c->expert_w,
                                        (int)cfg->n_expert_used, c->y, &c->experts, &c->stats);
    /* split: each rank added only its experts, or its slices of them; the ranks' partials are
     * summed in rank order (even after a failed read, so no rank waits for one that left) */
    if (c->p.split != MOE_SPLIT_NONE) moe_dist_sum(c->y, (size_t)n_rows * cfg->n_embd);
    if (!ok) return; /* the cache keeps the read error; the step fails with it */
    moe_rows_post_norm(c, c->y, w->out_norm, n_rows, cfg->n_embd);
    if (w->shared.gate) shared_expert(c, l, n_rows);
    moe_rows_post_norm(c, c->y, l->ffn_post_norm, n_rows, cfg->n_embd);
}
