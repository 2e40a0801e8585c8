/* arch_qwen3moe.c: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).
 *
 * GQA attention with an RMSNorm of every q and k head before NEOX rope, and routed experts in
 * every layer: softmax over all experts, top-k, the chosen weights renormalised. */
#include "model_internal.h"

static bool qwen3moe_config(moe_meta *r, moe_model_config *c) {
    return moe_config_transformer(r, c, MOE_ROPE_NEOX, false) && moe_config_rope(r, c, false) &&
           moe_config_experts(r, c, MOE_GATING_SOFTMAX, true, MOE_ACT_SILU,
                              "expert_feed_forward_length");
}

static void qwen3moe_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_gqa(b, il, &(moe_gqa_opts){.qk_norm = true}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_qwen3moe = {
    .name = "qwen3moe",
    .config = qwen3moe_config,
    .bind_layer = qwen3moe_bind_layer,
};
