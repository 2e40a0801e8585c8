/* arch_llama.c: Llama (and Mixtral-style Llama with routed experts).
 *
 * GQA attention with adjacent-pair rope, a dense SwiGLU FFN; with `llama.expert_count` the FFN is
 * routed experts (softmax over all experts, the chosen weights renormalised) whose width is
 * feed_forward_length, as llama.cpp's loader sizes them. Output may be tied to the embeddings. */
#include "model_internal.h"

static bool llama_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NORM, true) || !moe_config_rope(r, c, false))
        return false;
    uint32_t n_expert = 0;
    if (!moe_meta_u32(r, "expert_count", false, 0, &n_expert)) return false;
    return n_expert == 0 ||
           moe_config_experts(r, c, MOE_GATING_SOFTMAX, true, MOE_ACT_SILU, "feed_forward_length");
}

static void llama_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_gqa(b, il, &(moe_gqa_opts){0}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_llama = {
    .name = "llama",
    .config = llama_config,
    .bind_layer = llama_bind_layer,
};
