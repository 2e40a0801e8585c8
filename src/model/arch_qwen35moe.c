/* arch_qwen35moe.c: Qwen3.5 / 3.6 MoE (35B-A3B, 122B-A10B, 397B-A17B): the qwen35 trunk with
 * Qwen3-Next's experts.
 *
 * Layers as qwen35 (Gated DeltaNet with separate beta / alpha and tiled k heads, every
 * full_attention_interval-th layer gated attention with multi-section rope; post_attention_norm
 * before the FFN; a trailing MTP block); every FFN is routed experts (softmax, renormalised,
 * scaled) plus a shared expert gated per token by sigmoid(ffn_gate_inp_shexp . x). */
#include "model_internal.h"

static bool qwen35moe_config(moe_meta *r, moe_model_config *c) {
    c->ssm_tiled_heads = true;
    return moe_config_transformer(r, c, MOE_ROPE_NEOX, false) && moe_config_rope(r, c, false) &&
           moe_config_rope_sections(r, c) &&
           moe_config_experts(r, c, MOE_GATING_SOFTMAX, true, MOE_ACT_SILU,
                              "expert_feed_forward_length") &&
           moe_config_gdn_hybrid(r, c);
}

const moe_arch_desc moe_arch_qwen35moe = {
    .name = "qwen35moe",
    .config = qwen35moe_config,
    .bind_layer = moe_bind_qwen35_layer,
};
