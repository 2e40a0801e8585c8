/* arch_gpt_oss.c: OpenAI gpt-oss (20B, 120B).
 *
 * GQA attention with q/k/v/o biases and a learned sink logit per head, NEOX rope (YaRN), every
 * even layer windowed to attention.sliding_window positions; routed experts in every layer
 * with biases, chosen by top-k of the logits then a softmax over the k, and the clamped
 * SwiGLU (gate * sigmoid(1.702 gate) * (up + 1)). The FFN's input norm is post_attention_norm. */
#include "model_internal.h"

static bool gpt_oss_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NEOX, false) || !moe_config_rope(r, c, false) ||
        !moe_config_experts(r, c, MOE_GATING_SOFTMAX_WEIGHT, false, MOE_ACT_SWIGLU_OAI,
                            "expert_feed_forward_length"))
        return false;
    for (uint32_t il = 0; il < moe_config_n_planned(c); il += 2) c->layer[il].window = c->n_swa;
    return true;
}

static void gpt_oss_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_gqa(b, il, &(moe_gqa_opts){.qkv_bias = true, .out_bias_sinks = true}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "post_attention_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_gpt_oss = {
    .name = "gpt-oss",
    .config = gpt_oss_config,
    .bind_layer = gpt_oss_bind_layer,
};
