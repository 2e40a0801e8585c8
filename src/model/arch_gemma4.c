/* arch_gemma4.c: Gemma 4 (26B-A4B, the MoE form; the dense 31B as well).
 *
 * Sliding-window and full attention layers by attention.sliding_window_pattern (true: sliding).
 * Sliding layers have their own head widths (key_length_swa), rope dims and base
 * (rope.freq_base_swa); full layers the config's widths, rope over their head with the shared
 * rope_freqs (proportional rope: pairs with a huge factor do not turn), and may lack attn_v (V is
 * then the raw K projection). q and k are RMSNormed by attn_q_norm / attn_k_norm, v by an RMSNorm
 * without a weight, and the attention scale is 1. Every block's output is RMSNormed before the
 * residual (post_attention_norm, post_ffw_norm), and the layer's output is scaled by
 * layer_output_scale. In the MoE form the FFN is a dense GELU MLP on ffn_norm(x) (normed by
 * post_ffw_norm_1: a shared expert) plus routed experts on pre_ffw_norm_2(x) (normed by
 * post_ffw_norm_2), routed by ffn_gate_inp . (RMSNorm(x) / sqrt(n_embd) * ffn_gate_inp.scale),
 * softmax over all experts, top-k renormalised, each expert's output times ffn_down_exps.scale;
 * gate and up fused in ffn_gate_up_exps. Embeddings are scaled by sqrt(n_embd), the logits
 * soft-capped (final_logit_softcapping), the head tied to the embeddings.
 *
 * Not run: KV shared across layers and per-layer input embeddings (E2B / E4B): such files are
 * refused by name. */
#include "model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* attention.sliding_window_pattern into sliding[il]: one bool per layer, or one for all. */
static bool read_swa_pattern(moe_meta *r, uint32_t n, uint32_t *sliding) {
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", r->arch);
    const moe_gguf_value *v = moe_gguf_find(r->g, key);
    if (!v) return moe_meta_fail(r, MOE_ERR_FORMAT, "missing required key '%s'", key);
    if (v->type == MOE_GGUF_ARRAY)
        return moe_meta_u32_per_layer(r, "attention.sliding_window_pattern", 0, n, sliding);
    bool all = false;
    if (!moe_meta_bool(r, "attention.sliding_window_pattern", false, &all)) return false;
    for (uint32_t il = 0; il < n; il++) sliding[il] = all;
    return true;
}

/* Keys of the parts moe does not run: they must be absent or zero. */
static bool refuse_unsupported(moe_meta *r) {
    static const char *const keys[] = {"attention.shared_kv_layers",
                                       "embedding_length_per_layer_input"};
    static const char *const what[] = {"KV sharing across layers", "per-layer input embeddings"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        uint32_t v = 0;
        if (!moe_meta_u32(r, keys[i], false, 0, &v)) return false;
        if (v)
            return moe_meta_fail(r, MOE_ERR_UNSUPPORTED,
                                 "%s.%s = %u: moe does not run %s (Gemma 4 E2B / E4B) yet", r->arch,
                                 keys[i], v, what[i]);
    }
    return true;
}

static bool gemma4_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NEOX, true) || !moe_config_rope(r, c, false) ||
        !refuse_unsupported(r))
        return false;
    uint32_t n_expert = 0, hd_k_swa = 0, hd_v_swa = 0, rope_dims_swa = 0;
    float base_swa = 0.0f;
    if (!moe_meta_u32(r, "expert_count", false, 0, &n_expert) ||
        !moe_meta_u32(r, "attention.key_length_swa", false, c->head_dim_k, &hd_k_swa) ||
        !moe_meta_u32(r, "attention.value_length_swa", false, hd_k_swa, &hd_v_swa) ||
        !moe_meta_u32(r, "rope.dimension_count_swa", false, hd_k_swa, &rope_dims_swa) ||
        !moe_meta_f32(r, "rope.freq_base_swa", false, c->rope_base, &base_swa) ||
        !moe_meta_f32(r, "final_logit_softcapping", false, 0.0f, &c->final_softcap))
        return false;
    if (c->head_dim_k != c->head_dim_v || hd_k_swa != hd_v_swa || hd_k_swa == 0 ||
        hd_k_swa > c->head_dim_k)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.attention.key_length %u / value_length %u and key_length_swa %u "
                             "/ value_length_swa %u must be equal pairs, the sliding ones at most "
                             "the full ones",
                             r->arch, c->head_dim_k, c->head_dim_v, hd_k_swa, hd_v_swa);
    if (rope_dims_swa > hd_k_swa || rope_dims_swa % 2 || c->final_softcap < 0.0f)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.rope.dimension_count_swa %u must be even and at most %u, "
                             "final_logit_softcapping %g not negative",
                             r->arch, rope_dims_swa, hd_k_swa, (double)c->final_softcap);
    uint32_t *sliding = moe_xcalloc(c->n_layer, sizeof *sliding);
    bool ok = read_swa_pattern(r, c->n_layer, sliding);
    for (uint32_t il = 0; ok && il < c->n_layer; il++) {
        moe_layer_plan *p = &c->layer[il];
        if (p->n_head_kv == 0) {
            ok = moe_meta_fail(r, MOE_ERR_FORMAT,
                               "%s.attention.head_count_kv is 0 for layer %u: every Gemma 4 layer "
                               "attends",
                               r->arch, il);
            break;
        }
        if (!sliding[il]) continue;
        if (c->n_swa == 0) {
            ok =
                moe_meta_fail(r, MOE_ERR_FORMAT,
                              "layer %u is a sliding-window layer, but %s.attention.sliding_window "
                              "is missing or 0",
                              il, r->arch);
            break;
        }
        p->window = c->n_swa;
        p->head_dim_k = hd_k_swa;
        p->head_dim_v = hd_v_swa;
        p->rope_dims = rope_dims_swa;
        p->rope_base = base_swa;
    }
    free(sliding);
    if (!ok) return false;
    if (n_expert) {
        if (!moe_config_experts(r, c, MOE_GATING_SOFTMAX, true, MOE_ACT_GELU,
                                "expert_feed_forward_length"))
            return false;
        c->n_ff_shexp = c->n_ff; /* the dense MLP beside the routed experts */
    }
    c->ffn_act = MOE_ACT_GELU;
    c->attn_v_norm = true;
    c->kq_scale = 1.0f;
    c->embd_scale = sqrtf((float)c->n_embd);
    return true;
}

/* The routed experts of a MoE layer and the dense MLP beside them, with their norms. */
static void bind_experts(moe_binder *b, uint32_t il, moe_expert_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t E = c->n_embd, ff = c->n_ff_exp, n = c->n_expert;
    w->router = moe_bind_matrix(b, il, "ffn_gate_inp", E, n);
    w->router_in_scale = moe_bind_f32(b, il, "ffn_gate_inp", "scale", E, 0, 0, true);
    w->in_norm = moe_bind_norm(b, il, "pre_ffw_norm_2");
    w->gate_up = moe_bind_blk(b, il, "ffn_gate_up_exps", "weight", E, 2 * ff, n, false);
    if (!w->gate_up) {
        w->gate = moe_bind_blk(b, il, "ffn_gate_exps", "weight", E, ff, n, true);
        w->up = moe_bind_blk(b, il, "ffn_up_exps", "weight", E, ff, n, true);
    }
    w->down = moe_bind_blk(b, il, "ffn_down_exps", "weight", ff, E, n, true);
    w->down_scale = moe_bind_f32(b, il, "ffn_down_exps", "scale", n, 0, 0, false);
    w->out_norm = moe_bind_norm(b, il, "post_ffw_norm_2");
    moe_bind_gated_ffn(b, il, "", c->n_ff, &w->shared);
    w->shared_out_norm = moe_bind_norm(b, il, "post_ffw_norm_1");
}

/* rope_freqs.weight: one tensor for every full layer, bound at the first (as llama.cpp does). */
static const moe_tensor *bind_rope_freqs(moe_binder *b, uint32_t il) {
    const moe_model *m = b->m;
    for (uint32_t j = 0; j < il; j++)
        if (!m->cfg.layer[j].window && m->layers[j].attn.rope_freqs)
            return m->layers[j].attn.rope_freqs;
    return moe_bind_tensor(b, "rope_freqs.weight", m->cfg.layer[il].rope_dims / 2, 0, 0, true,
                           true);
}

static void gemma4_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_gqa(b, il, &(moe_gqa_opts){.qk_norm = true, .v_optional = true}, &l->attn);
    if (!l->plan.window) l->attn.rope_freqs = bind_rope_freqs(b, il);
    l->attn_post_norm = moe_bind_norm(b, il, "post_attention_norm");
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    if (l->plan.ffn == MOE_FFN_EXPERTS)
        bind_experts(b, il, &l->experts);
    else
        moe_bind_gated_ffn(b, il, "", b->m->cfg.n_ff, &l->ffn);
    l->ffn_post_norm = moe_bind_norm(b, il, "post_ffw_norm");
    l->out_scale = moe_bind_f32(b, il, "layer_output_scale", "weight", 1, 0, 0, false);
}

const moe_arch_desc moe_arch_gemma4 = {
    .name = "gemma4",
    .config = gemma4_config,
    .bind_layer = gemma4_bind_layer,
};
