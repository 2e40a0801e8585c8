/* arch_qwen3next.c: Qwen3-Next (80B-A3B), a Gated DeltaNet hybrid.
 *
 * Every full_attention_interval-th layer is gated GQA attention (attn_q yields [q, gate] per
 * head, the output is multiplied by sigmoid(gate); q/k norms; NEOX partial rope); the others
 * are Gated DeltaNet. Every layer has routed experts (softmax, renormalised) and a shared expert
 * gated per token by sigmoid(ffn_gate_inp_shexp . x). The FFN's input norm is
 * post_attention_norm. */
#include "model_internal.h"

static bool qwen3next_config(moe_meta *r, moe_model_config *c) {
    return moe_config_transformer(r, c, MOE_ROPE_NEOX, false) && moe_config_rope(r, c, false) &&
           moe_config_experts(r, c, MOE_GATING_SOFTMAX, true, MOE_ACT_SILU,
                              "expert_feed_forward_length") &&
           moe_config_gdn_hybrid(r, c);
}

static void qwen3next_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    if (l->plan.mixer == MOE_MIXER_GDN)
        moe_bind_gdn(b, il, true, &l->linear);
    else
        moe_bind_gqa(b, il, &(moe_gqa_opts){.qk_norm = true}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "post_attention_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_qwen3next = {
    .name = "qwen3next",
    .config = qwen3next_config,
    .bind_layer = qwen3next_bind_layer,
};
