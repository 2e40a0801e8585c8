/* arch_kimi_linear.c: Kimi-Linear (48B-A3B), a Kimi Delta Attention hybrid.
 *
 * Layers with no KV heads (attention.head_count_kv 0 in the per-layer array) are KDA; the others
 * are MLA without a q LoRA and without rope (rope dims only size the q_pe / k_pe part). After
 * the leading dense layers, routed experts with sigmoid gating and shared experts. */
#include "model_internal.h"

#include <stdlib.h>

static bool kimi_linear_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NONE, false)) return false;
    /* which layers are KDA, before MLA's checks see only the attention layers' head count */
    const uint32_t n = moe_config_n_planned(c);
    bool *kda = moe_xcalloc(n, sizeof *kda);
    for (uint32_t il = 0; il < n; il++) kda[il] = c->layer[il].n_head_kv == 0;
    const bool ok = moe_config_mla(r, c) && moe_config_rope(r, c, true) &&
                    moe_config_experts(r, c, MOE_GATING_SIGMOID, true, MOE_ACT_SILU,
                                       "expert_feed_forward_length") &&
                    moe_config_kda(r, c);
    for (uint32_t il = 0; ok && il < n; il++)
        moe_config_plan_mixer(c, il, kda[il] ? MOE_MIXER_KDA : MOE_MIXER_MLA);
    free(kda);
    return ok;
}

static void kimi_linear_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    if (l->plan.mixer == MOE_MIXER_KDA)
        moe_bind_kda(b, il, false, &l->linear);
    else
        moe_bind_mla(b, il, &l->mla);
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_kimi_linear = {
    .name = "kimi-linear",
    .config = kimi_linear_config,
    .bind_layer = kimi_linear_bind_layer,
};
