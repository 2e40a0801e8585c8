/* ffn.c: the feed-forward blocks -- dense SwiGLU and routed experts -- each RMSNorm, the
 * FFN, and the residual add. The expert block routes every row, then runs the grouped
 * dispatch (ops/moe.c) so each chosen expert is read once for all rows that chose it. */
#include "internal.h"

#include <string.h>

static void ffn_norm(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const float *norm_w = (const float *)l->ffn_norm->data;
    for (uint32_t r = 0; r < n_rows; r++)
        moe_rmsnorm(c->xn + (int64_t)r * cfg->n_embd, c->x + (int64_t)r * cfg->n_embd, norm_w,
                    cfg->n_embd, cfg->rms_eps);
}

void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const int64_t n_embd = cfg->n_embd, n_ff = cfg->n_ff;
    ffn_norm(c, l, n_rows);
    moe_matmul(c->pool, l->ffn_gate, 0, c->xn, n_rows, c->ff_gate, c->mm_scratch);
    moe_matmul(c->pool, l->ffn_up, 0, c->xn, n_rows, c->ff_up, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) moe_swiglu(c->ff_up + r * n_ff, c->ff_gate + r * n_ff, n_ff);
    moe_matmul(c->pool, l->ffn_down, 0, c->ff_up, n_rows, c->xn, c->mm_scratch);
    for (int64_t i = 0; i < (int64_t)n_rows * n_embd; i++) c->x[i] += c->xn[i];
}

void moe_block_ffn_experts(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    ffn_norm(c, l, n_rows);
    moe_matmul(c->pool, l->ffn_gate_inp, 0, c->xn, n_rows, c->router, c->mm_scratch);
    const moe_route_params route = {.n_expert = (int)cfg->n_expert,
                                    .n_used = (int)cfg->n_expert_used,
                                    .gating = cfg->gating,
                                    .norm = cfg->norm_topk,
                                    .scale = cfg->expert_weights_scale};
    moe_route(&route, c->router, n_rows, c->expert_ids, c->expert_w, c->route_scratch);
    /* the experts add their weighted outputs straight into the residual */
    moe_experts_forward(c->pool, l->ffn_gate_exps, l->ffn_up_exps, l->ffn_down_exps, c->xn, n_rows,
                        c->expert_ids, c->expert_w, (int)cfg->n_expert_used, c->x, &c->experts,
                        &c->stats);
}
