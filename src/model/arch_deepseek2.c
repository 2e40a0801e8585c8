/* arch_deepseek2.c: DeepSeek-V2 / V3 (and the models converted as deepseek2).
 *
 * Multi-head latent attention in every layer (latent KV cache, absorbed attn_k_b / attn_v_b,
 * YaRN with its magnitude in the attention scale), a few leading dense layers, then routed
 * experts with shared experts beside them. Gating, the selection bias (exp_probs_b) and expert
 * groups come from the file's keys; older files without expert_gating_func use softmax. */
#include "model_internal.h"

static bool deepseek2_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NORM, false) || !moe_config_mla(r, c) ||
        !moe_config_rope(r, c, true) ||
        !moe_config_experts(r, c, MOE_GATING_SOFTMAX, false, MOE_ACT_SILU,
                            "expert_feed_forward_length"))
        return false;
    for (uint32_t il = 0; il < moe_config_n_planned(c); il++)
        moe_config_plan_mixer(c, il, MOE_MIXER_MLA);
    return true;
}

static void deepseek2_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_mla(b, il, &l->mla);
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_deepseek2 = {
    .name = "deepseek2",
    .config = deepseek2_config,
    .bind_layer = deepseek2_bind_layer,
};
