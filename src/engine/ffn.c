/* ffn.c: the feed-forward blocks -- dense SwiGLU and routed experts -- each RMSNorm, the
 * FFN, and the residual add. The expert block routes every row (router bias, selection bias,
 * groups as the config says), then runs the grouped dispatch (ops/moe.c) so each chosen expert
 * is read once for all rows that chose it, then the shared expert if the model has one
 * (qwen3next gates it per row by sigmoid(w . x)). */
#include "engine_internal.h"

#include <math.h>
#include <string.h>

static void ffn_norm(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const float *norm_w = (const float *)l->ffn_norm->data;
    for (uint32_t r = 0; r < n_rows; r++)
        moe_rmsnorm(c->xn + (int64_t)r * cfg->n_embd, c->x + (int64_t)r * cfg->n_embd, norm_w,
                    cfg->n_embd, cfg->rms_eps);
}

/* x += g[r] * down(silu(gate(xn)) * up(xn)): the dense FFN, and the shared expert beside the
 * routed ones (its width is gate->ne[1]); row_gate NULL: g = 1. Overwrites xn. */
static void swiglu_into_residual(moe_ctx *c, const moe_tensor *gate, const moe_tensor *up,
                                 const moe_tensor *down, const float *row_gate, uint32_t n_rows) {
    const int64_t n_embd = c->m->cfg.n_embd, n_ff = gate->ne[1];
    moe_matmul(c->pool, gate, 0, c->xn, n_rows, c->ff_gate, c->mm_scratch);
    moe_matmul(c->pool, up, 0, c->xn, n_rows, c->ff_up, c->mm_scratch);
    moe_swiglu(c->ff_up, c->ff_gate, (int64_t)n_rows * n_ff);
    moe_matmul(c->pool, down, 0, c->ff_up, n_rows, c->xn, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) {
        const float g = row_gate ? row_gate[r] : 1.0f;
        for (int64_t i = 0; i < n_embd; i++) c->x[r * n_embd + i] += g * c->xn[r * n_embd + i];
    }
}

void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    ffn_norm(c, l, n_rows);
    swiglu_into_residual(c, l->ffn_gate, l->ffn_up, l->ffn_down, NULL, n_rows);
}

/* x += [sigmoid(w . xn) *] shared_expert(xn); xn is consumed. */
static void shared_expert(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const int64_t n_embd = c->m->cfg.n_embd;
    if (l->ffn_gate_inp_shexp) {
        const float *w = (const float *)l->ffn_gate_inp_shexp->data;
        for (uint32_t r = 0; r < n_rows; r++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < n_embd; i++) dot += w[i] * c->xn[r * n_embd + i];
            c->shexp_gate[r] = 1.0f / (1.0f + expf(-dot));
        }
    }
    swiglu_into_residual(c, l->ffn_gate_shexp, l->ffn_up_shexp, l->ffn_down_shexp,
                         l->ffn_gate_inp_shexp ? c->shexp_gate : NULL, n_rows);
}

void moe_block_ffn_experts(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    ffn_norm(c, l, n_rows);
    moe_matmul(c->pool, l->ffn_gate_inp, 0, c->xn, n_rows, c->router, c->mm_scratch);
    moe_add_bias(c->router, l->ffn_gate_inp_b, 0, n_rows, cfg->n_expert);
    const moe_route_params route = {.n_expert = (int)cfg->n_expert,
                                    .n_used = (int)cfg->n_expert_used,
                                    .gating = cfg->gating,
                                    .norm = cfg->norm_topk,
                                    .scale = cfg->expert_weights_scale,
                                    .sel_bias =
                                        l->exp_probs_b ? (const float *)l->exp_probs_b->data : NULL,
                                    .n_group = (int)cfg->n_expert_group,
                                    .topk_group = (int)cfg->n_group_used};
    moe_route(&route, c->router, n_rows, c->expert_ids, c->expert_w, c->route_scratch);
    const moe_expert_set experts = {.gate = l->ffn_gate_exps,
                                    .up = l->ffn_up_exps,
                                    .down = l->ffn_down_exps,
                                    .gate_b = l->ffn_gate_exps_b,
                                    .up_b = l->ffn_up_exps_b,
                                    .down_b = l->ffn_down_exps_b,
                                    .act = cfg->expert_act};
    /* the experts add their weighted outputs straight into the residual */
    moe_experts_forward(c->pool, &experts, c->xn, n_rows, c->expert_ids, c->expert_w,
                        (int)cfg->n_expert_used, c->x, &c->experts, &c->stats);
    if (l->ffn_gate_shexp) shared_expert(c, l, n_rows);
}
