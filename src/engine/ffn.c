/* ffn.c: the feed-forward blocks -- dense SwiGLU and routed experts -- each RMSNorm, the
 * FFN, and the residual add. The expert block routes every row, then runs the grouped
 * dispatch (ops/moe.c) so each chosen expert is read once for all rows that chose it, then the
 * shared expert if the model has one (qwen3next gates it per row by sigmoid(w . x)). */
#include "internal.h"

#include <math.h>
#include <string.h>

static void ffn_norm(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const float *norm_w = (const float *)l->ffn_norm->data;
    for (uint32_t r = 0; r < n_rows; r++)
        moe_rmsnorm(c->xn + (int64_t)r * cfg->n_embd, c->x + (int64_t)r * cfg->n_embd, norm_w,
                    cfg->n_embd, cfg->rms_eps);
}

/* xn <- down(silu(gate xn) * up xn), n_ff wide in between. */
static void swiglu_ffn(moe_ctx *c, const moe_tensor *gate, const moe_tensor *up,
                       const moe_tensor *down, uint32_t n_rows) {
    const int64_t n_ff = gate->ne[1];
    moe_matmul(c->pool, gate, 0, c->xn, n_rows, c->ff_gate, c->mm_scratch);
    moe_matmul(c->pool, up, 0, c->xn, n_rows, c->ff_up, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) moe_swiglu(c->ff_up + r * n_ff, c->ff_gate + r * n_ff, n_ff);
    moe_matmul(c->pool, down, 0, c->ff_up, n_rows, c->xn, c->mm_scratch);
}

void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows) {
    const int64_t n_embd = c->m->cfg.n_embd;
    ffn_norm(c, l, n_rows);
    swiglu_ffn(c, l->ffn_gate, l->ffn_up, l->ffn_down, n_rows);
    for (int64_t i = 0; i < (int64_t)n_rows * n_embd; i++) c->x[i] += c->xn[i];
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
    swiglu_ffn(c, l->ffn_gate_shexp, l->ffn_up_shexp, l->ffn_down_shexp, n_rows);
    for (uint32_t r = 0; r < n_rows; r++) {
        const float g = l->ffn_gate_inp_shexp ? c->shexp_gate[r] : 1.0f;
        for (int64_t i = 0; i < n_embd; i++) c->x[r * n_embd + i] += g * c->xn[r * n_embd + i];
    }
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
    if (l->ffn_up_shexp) shared_expert(c, l, n_rows);
}
