/* arch_glm4moe.c: GLM-4.5 / 4.6 / 4.7 (and GLM-4.7-Flash).
 *
 * DeepSeek-style routing (sigmoid gating, exp_probs_b, a shared expert, leading dense layers)
 * under GQA attention with q/k/v biases, partial NEOX rope, and q/k norms only where the file
 * has them (GLM-4.5: only the 355B). The trailing NextN (MTP) layers are whole layers plus
 * their own projection and norms; they are not run yet. The FFN's input norm is
 * post_attention_norm. */
#include "model_internal.h"

static bool glm4moe_config(moe_meta *r, moe_model_config *c) {
    return moe_config_transformer(r, c, MOE_ROPE_NEOX, false) && moe_config_rope(r, c, false) &&
           moe_config_experts(r, c, MOE_GATING_SIGMOID, false, MOE_ACT_SILU,
                              "expert_feed_forward_length");
}

static void glm4moe_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_gqa(b, il, &(moe_gqa_opts){.qk_norm_optional = true, .qkv_bias = true}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "post_attention_norm");
    moe_bind_ffn(b, il, l);
    if (il >= b->m->cfg.n_layer) moe_bind_nextn(b, il, &l->nextn);
}

const moe_arch_desc moe_arch_glm4moe = {
    .name = "glm4moe",
    .config = glm4moe_config,
    .bind_layer = glm4moe_bind_layer,
};
