/* arch_qwen35.c: Qwen3.5 / 3.6 / 3.8 dense hybrids (Qwen3.8-27B: 64 layers).
 *
 * Every full_attention_interval-th trunk layer is gated GQA attention (attn_q yields [q, gate]
 * per head, output times sigmoid(gate); q/k norms; partial multi-section rope, which for text
 * puts every section at the token's position: NEOX rope over rope.dimension_count dims); the
 * others are Gated DeltaNet with beta and alpha from their own projections, and the k heads
 * tiled over the v heads (v head h reads k head h % n_k) as the converter stores them. Every
 * layer has a dense SwiGLU; the FFN's input norm is post_attention_norm. The trailing
 * multi-token-prediction block (nextn_predict_layers) is a full-attention layer plus its NextN
 * projection and norms (the draft head of --spec mtp). */
#include "model_internal.h"

static bool qwen35_config(moe_meta *r, moe_model_config *c) {
    c->ssm_tiled_heads = true;
    return moe_config_transformer(r, c, MOE_ROPE_NEOX, true) && moe_config_rope(r, c, false) &&
           moe_config_rope_sections(r, c) && moe_config_gdn_hybrid(r, c);
}

void moe_bind_qwen35_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    if (l->plan.mixer == MOE_MIXER_GDN)
        moe_bind_gdn(b, il, false, &l->linear);
    else
        moe_bind_gqa(b, il, &(moe_gqa_opts){.qk_norm = true}, &l->attn);
    l->ffn_norm = moe_bind_norm(b, il, "post_attention_norm");
    moe_bind_ffn(b, il, l);
    if (il >= b->m->cfg.n_layer) moe_bind_nextn(b, il, &l->nextn);
}

const moe_arch_desc moe_arch_qwen35 = {
    .name = "qwen35",
    .config = qwen35_config,
    .bind_layer = moe_bind_qwen35_layer,
};
