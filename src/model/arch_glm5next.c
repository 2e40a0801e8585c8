/* arch_glm5next.c: GLM-5.3-Flash (320B-A18B): hyper-connections around a KDA / sparse-MLA hybrid.
 *
 * Every token keeps hyper_connection.count residual streams; each block's input is a weighted
 * sum of them and its output goes back into each after a Sinkhorn-balanced mix (hc_attn_* and
 * hc_ffn_* per layer). Trunk layers are Kimi Delta Attention with a bounded decay
 * (g = kda.gate_lower_bound * sigmoid(...), default -5), or MLA without rope whose queries attend
 * only to the key pools their lightning indexer picks. Which is which: a per-layer
 * attention.head_count_kv of 0 marks KDA; files with one value use the pattern of
 * full_attention_interval (default 4: every 4th layer MLA). Then DeepSeek-V3 routing (sigmoid,
 * exp_probs_b, normalised, scaled), a shared expert, dense leading layers, all with clamped
 * SwiGLU (swiglu_clamp_exp for routed experts, swiglu_clamp_shexp for the rest). The trailing
 * NextN layer is a plain pre-norm MLA block (no hyper-connections) attending densely; it carries
 * indexer tensors it does not use. */
#include "model_internal.h"

#include <stdlib.h>

static bool glm5next_plan(moe_meta *r, moe_model_config *c) {
    const uint32_t n = moe_config_n_planned(c);
    uint32_t interval = 0;
    bool per_layer = false;
    for (uint32_t il = 0; il < n; il++) per_layer |= c->layer[il].n_head_kv == 0;
    if (!moe_meta_u32(r, "full_attention_interval", false, 4, &interval)) return false;
    if (interval == 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT, "%s.full_attention_interval must be positive",
                             r->arch);
    float *clamp_exp = moe_xcalloc(n, sizeof *clamp_exp),
          *clamp_shexp = moe_xcalloc(n, sizeof(float));
    const bool ok = moe_meta_f32_per_layer(r, "swiglu_clamp_exp", 0.0f, n, clamp_exp) &&
                    moe_meta_f32_per_layer(r, "swiglu_clamp_shexp", 0.0f, n, clamp_shexp);
    for (uint32_t il = 0; ok && il < n; il++) {
        const bool kda =
            il < c->n_layer && (per_layer ? c->layer[il].n_head_kv == 0 : (il + 1) % interval != 0);
        c->layer[il].n_head_kv = 1;
        moe_config_plan_mixer(c, il, kda ? MOE_MIXER_KDA : MOE_MIXER_MLA);
        c->layer[il].indexed = !kda && il < c->n_layer;
        c->layer[il].clamp_exp = clamp_exp[il];
        c->layer[il].clamp_ffn = clamp_shexp[il];
    }
    free(clamp_exp);
    free(clamp_shexp);
    if (ok && (c->n_layer_linear == 0 || c->n_layer_linear == c->n_layer))
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s: %u of %u trunk layers are KDA; the model needs both kinds",
                             r->arch, c->n_layer_linear, c->n_layer);
    return ok;
}

static bool glm5next_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NONE, false)) return false;
    if (c->rope_dims != 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.rope.dimension_count is %u: this MLA has no rope (0)", r->arch,
                             c->rope_dims);
    c->n_head_kv = 1; /* the MLA layers' one latent head */
    if (!moe_config_mla(r, c) || !moe_config_rope(r, c, true) ||
        !moe_config_experts(r, c, MOE_GATING_SIGMOID, true, MOE_ACT_SILU,
                            "expert_feed_forward_length") ||
        !moe_config_kda(r, c) || !moe_config_hc(r, c) || !moe_config_indexer(r, c) ||
        !moe_meta_f32(r, "kda.gate_lower_bound", false, -5.0f, &c->kda_gate_bound))
        return false;
    if (!(c->kda_gate_bound < 0))
        return moe_meta_fail(r, MOE_ERR_FORMAT, "%s.kda.gate_lower_bound %g must be negative",
                             r->arch, c->kda_gate_bound);
    if (c->n_lora_q == 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.attention.q_lora_rank is 0: the indexer reads the q latent",
                             r->arch);
    c->l2_eps = 1e-6f; /* the reference's own constant, not the norm epsilon */
    return glm5next_plan(r, c);
}

static void glm5next_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    const bool trunk = il < b->m->cfg.n_layer;
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    if (trunk) {
        moe_bind_hc(b, il, "attn", &l->hc_attn);
        moe_bind_hc(b, il, "ffn", &l->hc_ffn);
    }
    if (l->plan.mixer == MOE_MIXER_KDA) {
        moe_bind_kda(b, il, true, &l->linear);
    } else {
        moe_bind_mla(b, il, &l->mla);
        moe_bind_indexer(b, il, &l->mla);
    }
    moe_bind_ffn(b, il, l);
    if (!trunk) moe_bind_nextn(b, il, &l->nextn);
}

const moe_arch_desc moe_arch_glm5next = {
    .name = "glm5next",
    .config = glm5next_config,
    .bind_layer = glm5next_bind_layer,
};
