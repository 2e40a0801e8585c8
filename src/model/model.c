/* model.c: the architecture table, metadata readers, tensor binding, the config readers and
 * binders that several architectures share, and loading.
 *
 * Every required key and tensor is looked up with a message naming it when absent; every
 * tensor's type and shape is checked against the config before any forward pass may touch it.
 * Binding is by name only (blk.N.attn_q.weight, ...), the names llama.cpp's converters write.
 * What one architecture does differently lives in its own arch_<name>.c. */
#include "model_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOE_MAX_LAYERS  1024 /* deepest real models have ~100; caps the per-layer allocation */
#define MOE_MAX_WIDTH   (1u << 20) /* widths, heads, vocab: far above any real model */
#define MOE_MAX_EXPERTS 1024       /* routed experts per layer (real: <= 384); routing's tables */

/* ==== The architectures ==== */

extern const moe_arch_desc moe_arch_llama, moe_arch_qwen3moe, moe_arch_deepseek2, moe_arch_gpt_oss,
    moe_arch_qwen3next, moe_arch_kimi_linear, moe_arch_glm4moe, moe_arch_qwen35, moe_arch_glm5next,
    moe_arch_glm_dsa, moe_arch_qwen35moe, moe_arch_gemma4;

static const moe_arch_desc *const archs[] = {
    &moe_arch_llama,     &moe_arch_qwen3moe,    &moe_arch_deepseek2, &moe_arch_gpt_oss,
    &moe_arch_qwen3next, &moe_arch_kimi_linear, &moe_arch_glm4moe,   &moe_arch_qwen35,
    &moe_arch_glm5next,  &moe_arch_glm_dsa,     &moe_arch_qwen35moe, &moe_arch_gemma4,
};
#define N_ARCHS (sizeof archs / sizeof archs[0])

const moe_arch_desc *moe_arch_find(const char *name) {
    for (size_t i = 0; name && i < N_ARCHS; i++)
        if (strcmp(archs[i]->name, name) == 0) return archs[i];
    return NULL;
}

const char *moe_arch_names(void) {
    static char names[256];
    if (!names[0])
        for (size_t i = 0, used = 0; i < N_ARCHS && used < sizeof names; i++)
            used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", i ? " " : "",
                                     archs[i]->name);
    return names;
}

/* ==== Metadata ==== */

bool moe_meta_fail(moe_meta *r, moe_status code, const char *fmt, ...) {
    if (r->err->code) return false;
    char msg[sizeof r->err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_error_set(r->err, code, "%s: %s", r->path, msg);
    return false;
}

static void meta_key(const moe_meta *r, const char *suffix, char *key, size_t size) {
    snprintf(key, size, "%s.%s", r->arch, suffix);
}

bool moe_meta_u32(moe_meta *r, const char *suffix, bool required, uint32_t fallback,
                  uint32_t *out) {
    char key[256];
    meta_key(r, suffix, key, sizeof key);
    uint64_t v;
    if (!moe_gguf_get_u64(r->g, key, &v)) {
        if (required || moe_gguf_find(r->g, key))
            return moe_meta_fail(r, MOE_ERR_FORMAT, "%s key '%s'",
                                 moe_gguf_find(r->g, key) ? "non-integer" : "missing required",
                                 key);
        *out = fallback;
        return true;
    }
    if (v > MOE_MAX_WIDTH)
        return moe_meta_fail(r, MOE_ERR_RANGE, "key '%s' = %llu is larger than %u", key,
                             (unsigned long long)v, MOE_MAX_WIDTH);
    *out = (uint32_t)v;
    return true;
}

bool moe_meta_f32(moe_meta *r, const char *suffix, bool required, float fallback, float *out) {
    char key[256];
    meta_key(r, suffix, key, sizeof key);
    double v;
    if (!moe_gguf_get_f64(r->g, key, &v)) {
        if (required) return moe_meta_fail(r, MOE_ERR_FORMAT, "missing required key '%s'", key);
        *out = fallback;
        return true;
    }
    if (!isfinite(v)) return moe_meta_fail(r, MOE_ERR_RANGE, "key '%s' is not finite", key);
    *out = (float)v;
    return true;
}

bool moe_meta_bool(moe_meta *r, const char *suffix, bool fallback, bool *out) {
    char key[256];
    meta_key(r, suffix, key, sizeof key);
    *out = fallback;
    if (moe_gguf_find(r->g, key) && !moe_gguf_get_bool(r->g, key, out))
        return moe_meta_fail(r, MOE_ERR_FORMAT, "key '%s' is not a bool", key);
    return true;
}

bool moe_meta_u32_per_layer(moe_meta *r, const char *suffix, uint32_t fallback, uint32_t n,
                            uint32_t *out) {
    char key[256];
    meta_key(r, suffix, key, sizeof key);
    const moe_gguf_value *v = moe_gguf_find(r->g, key);
    if (!v || v->type != MOE_GGUF_ARRAY) {
        if (!moe_meta_u32(r, suffix, false, fallback, &out[0])) return false;
        for (uint32_t i = 1; i < n; i++) out[i] = out[0];
        return true;
    }
    const moe_gguf_vtype et = v->arr.elem_type;
    const unsigned size = moe_gguf_vtype_size(et);
    const bool is_signed =
        et == MOE_GGUF_I8 || et == MOE_GGUF_I16 || et == MOE_GGUF_I32 || et == MOE_GGUF_I64;
    if (!size || et == MOE_GGUF_F32 || et == MOE_GGUF_F64 || v->arr.n != n)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "key '%s' must be an integer or %u integers (one per layer)", key, n);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t u = 0;
        memcpy(&u, (const uint8_t *)v->arr.data + (uint64_t)i * size, size);
        const unsigned bits = 8 * size;
        const bool neg = is_signed && ((u >> (bits - 1)) & 1);
        if (neg || u > MOE_MAX_WIDTH)
            return moe_meta_fail(r, MOE_ERR_RANGE, "key '%s'[%u] is out of range", key, i);
        out[i] = (uint32_t)u;
    }
    return true;
}

bool moe_meta_f32_per_layer(moe_meta *r, const char *suffix, float fallback, uint32_t n,
                            float *out) {
    char key[256];
    meta_key(r, suffix, key, sizeof key);
    const moe_gguf_value *v = moe_gguf_find(r->g, key);
    if (!v || v->type != MOE_GGUF_ARRAY) {
        if (!moe_meta_f32(r, suffix, false, fallback, &out[0])) return false;
        for (uint32_t i = 1; i < n; i++) out[i] = out[0];
        return true;
    }
    if (v->arr.elem_type != MOE_GGUF_F32 || v->arr.n != n)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "key '%s' must be a float or %u floats (one per layer)", key, n);
    for (uint32_t i = 0; i < n; i++) {
        memcpy(&out[i], (const uint8_t *)v->arr.data + (uint64_t)i * sizeof(float), sizeof(float));
        if (!isfinite(out[i]))
            return moe_meta_fail(r, MOE_ERR_RANGE, "key '%s'[%u] is not finite", key, i);
    }
    return true;
}

/* ==== Config steps ==== */

bool moe_config_transformer(moe_meta *r, moe_model_config *c, moe_rope_kind rope,
                            bool ff_required) {
    if (!moe_meta_u32(r, "embedding_length", true, 0, &c->n_embd) ||
        !moe_meta_u32(r, "block_count", true, 0, &c->n_layer) ||
        !moe_meta_u32(r, "nextn_predict_layers", false, 0, &c->n_layer_nextn) ||
        !moe_meta_u32(r, "feed_forward_length", ff_required, 0, &c->n_ff) ||
        !moe_meta_u32(r, "attention.head_count", true, 0, &c->n_head) ||
        !moe_meta_u32(r, "context_length", false, 4096, &c->n_ctx_train))
        return false;
    if (c->n_head == 0 || c->n_embd == 0 || c->n_layer == 0)
        return moe_meta_fail(r, MOE_ERR_RANGE,
                             "%s.embedding_length, block_count and attention.head_count must be "
                             "positive",
                             r->arch);
    if (c->n_layer_nextn >= c->n_layer)
        return moe_meta_fail(r, MOE_ERR_RANGE,
                             "%s.nextn_predict_layers = %u leaves no layers of %u", r->arch,
                             c->n_layer_nextn, c->n_layer);
    if (c->n_layer > MOE_MAX_LAYERS)
        return moe_meta_fail(r, MOE_ERR_RANGE, "%s.block_count = %u exceeds %u", r->arch,
                             c->n_layer, MOE_MAX_LAYERS);
    const uint32_t n_planned = c->n_layer;
    c->n_layer -= c->n_layer_nextn; /* the MTP layers at the end predict drafts: not run */
    uint32_t *head_kv = moe_xcalloc(n_planned, sizeof *head_kv);
    c->layer = moe_xcalloc(n_planned, sizeof *c->layer);
    const bool ok =
        moe_meta_u32_per_layer(r, "attention.head_count_kv", c->n_head, n_planned, head_kv);
    c->n_head_kv = 0; /* a hybrid's recurrent layers may say 0: the attention layers' count */
    for (uint32_t il = 0; ok && il < n_planned; il++) {
        c->layer[il] = (moe_layer_plan){.mixer = MOE_MIXER_ATTENTION, .n_head_kv = head_kv[il]};
        if (head_kv[il] > c->n_head_kv) c->n_head_kv = head_kv[il];
    }
    free(head_kv);
    if (!ok ||
        !moe_meta_u32(r, "attention.key_length", false, c->n_embd / c->n_head, &c->head_dim_k) ||
        !moe_meta_u32(r, "attention.value_length", false, c->head_dim_k, &c->head_dim_v) ||
        !moe_meta_u32(r, "rope.dimension_count", false, c->head_dim_k, &c->rope_dims) ||
        !moe_meta_f32(r, "rope.freq_base", false, 10000.0f, &c->rope_base) ||
        !moe_meta_f32(r, "attention.layer_norm_rms_epsilon", true, 0, &c->rms_eps) ||
        !moe_meta_u32(r, "attention.sliding_window", false, 0, &c->n_swa))
        return false;
    c->l2_eps = c->rms_eps;
    c->rope_kind = rope;
    if (c->n_head_kv == 0 || c->n_head % c->n_head_kv != 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "head_count %u is not a multiple of head_count_kv %u", c->n_head,
                             c->n_head_kv);
    for (uint32_t il = 0; il < n_planned; il++) {
        moe_layer_plan *p = &c->layer[il];
        if (p->n_head_kv && c->n_head % p->n_head_kv != 0)
            return moe_meta_fail(r, MOE_ERR_FORMAT,
                                 "head_count %u is not a multiple of layer %u's head_count_kv %u",
                                 c->n_head, il, p->n_head_kv);
        p->head_dim_k = c->head_dim_k;
        p->head_dim_v = c->head_dim_v;
        p->rope_dims = c->rope_dims;
        p->rope_base = c->rope_base;
    }
    if (c->head_dim_k == 0 || c->rope_dims > c->head_dim_k || c->rope_dims % 2)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "rope.dimension_count %u must be even and at most the head "
                             "dimension %u",
                             c->rope_dims, c->head_dim_k);
    return true;
}

/* llama.cpp's YaRN magnitude for a scaling factor (llama-context.cpp get_mscale). */
static float yarn_get_mscale(float scale, float mscale) {
    return scale <= 1.0f ? 1.0f : 0.1f * mscale * logf(scale) + 1.0f;
}

/* Rope scaling: none, linear, or YaRN set up as llama.cpp does (llama-context.cpp): ext_factor
 * 1, correction range from beta_fast / beta_slow and the original context, and a magnitude
 * that, with yarn_log_multiplier, cancels the 1 + 0.1 ln(factor) rope applies by itself.
 * MLA (deepseek2) moves that magnitude into the attention scale: mscale^2 / sqrt(q/k width). */
bool moe_config_rope(moe_meta *r, moe_model_config *c, bool mla) {
    float factor = 1.0f, log_mul = 0.0f, attn_factor = 1.0f;
    if (!moe_meta_f32(r, "rope.scaling.factor", false, 1.0f, &factor) ||
        !moe_meta_f32(r, "rope.scaling.yarn_beta_fast", false, 32.0f, &c->rope_beta_fast) ||
        !moe_meta_f32(r, "rope.scaling.yarn_beta_slow", false, 1.0f, &c->rope_beta_slow) ||
        !moe_meta_f32(r, "rope.scaling.yarn_log_multiplier", false, 0.0f, &log_mul) ||
        !moe_meta_f32(r, "rope.scaling.attn_factor", false, 1.0f, &attn_factor) ||
        !moe_meta_u32(r, "rope.scaling.original_context_length", false, c->n_ctx_train,
                      &c->rope_n_ctx_orig))
        return false;
    char key[256];
    meta_key(r, "rope.scaling.type", key, sizeof key);
    const char *scaling = moe_gguf_get_str(r->g, key);
    const bool linear = scaling && strcmp(scaling, "linear") == 0;
    const bool yarn = scaling && strcmp(scaling, "yarn") == 0;
    if (scaling && strcmp(scaling, "none") != 0 && !linear && !yarn)
        return moe_meta_fail(r, MOE_ERR_UNSUPPORTED, "rope scaling type '%s' is not supported yet",
                             scaling);
    c->rope_freq_scale = (linear || yarn) && factor > 0 ? 1.0f / factor : 1.0f;
    c->rope_ext_factor = yarn ? 1.0f : 0.0f;
    /* deepseek2's converter writes 0.1 * mscale_all_dim; llama.cpp divides it back out */
    if (mla) log_mul /= 0.1f;
    float yarn_attn = 1.0f;
    if (yarn) {
        const float f = 1.0f / c->rope_freq_scale;
        if (log_mul != 0.0f) {
            const float mscale = mla && log_mul != 1.0f ? log_mul : 1.0f;
            yarn_attn = yarn_get_mscale(f, mscale) / yarn_get_mscale(f, log_mul);
        } else {
            yarn_attn = yarn_get_mscale(f, 1.0f);
        }
        yarn_attn *= 1.0f / (1.0f + 0.1f * logf(f));
    }
    c->rope_attn_factor = yarn_attn * attn_factor;
    c->kq_scale = 1.0f / sqrtf((float)c->head_dim_k);
    if (mla) {
        const float fs = c->rope_freq_scale;
        const float attn_factor_org = c->rope_attn_factor * (1.0f + 0.1f * logf(1.0f / fs));
        const float mscale = attn_factor_org * (1.0f + 0.1f * log_mul * logf(1.0f / fs));
        c->kq_scale = 1.0f * mscale * mscale / sqrtf((float)c->head_dim_k_mla);
    }
    return true;
}

/* MLA keys. The cache holds the latent and the roped key, so the file's key_length must be
 * kv_lora_rank + rope dims and value_length kv_lora_rank over one kv head (the layout with
 * attn_k_b / attn_v_b); the *_mla keys give the per-head widths before absorption. */
bool moe_config_mla(moe_meta *r, moe_model_config *c) {
    /* value_length defaults to the latent width here (kimi-linear's converter omits it) */
    if (!moe_meta_u32(r, "attention.q_lora_rank", false, 0, &c->n_lora_q) ||
        !moe_meta_u32(r, "attention.kv_lora_rank", true, 0, &c->n_lora_kv) ||
        !moe_meta_u32(r, "attention.value_length", false, c->n_lora_kv, &c->head_dim_v) ||
        !moe_meta_u32(r, "attention.key_length_mla", false, c->head_dim_k, &c->head_dim_k_mla) ||
        !moe_meta_u32(r, "attention.value_length_mla", false, c->head_dim_v, &c->head_dim_v_mla))
        return false;
    if (c->n_head_kv != 1 || c->head_dim_k != c->n_lora_kv + c->rope_dims ||
        c->head_dim_v != c->n_lora_kv) {
        return moe_meta_fail(r, MOE_ERR_UNSUPPORTED,
                             "MLA stored as multi-head K/V (attn_kv_b; key_length %u, "
                             "value_length %u, head_count_kv %u): moe runs the latent layout "
                             "(attn_k_b / attn_v_b, key_length = kv_lora_rank + rope dims = %u); "
                             "re-convert the model with a current llama.cpp convert_hf_to_gguf.py",
                             c->head_dim_k, c->head_dim_v, c->n_head_kv,
                             c->n_lora_kv + c->rope_dims);
    }
    if (c->n_lora_kv == 0 || c->head_dim_k_mla <= c->rope_dims || c->head_dim_v_mla == 0) {
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "MLA widths kv_lora_rank %u, key_length_mla %u (rope %u), "
                             "value_length_mla %u are inconsistent",
                             c->n_lora_kv, c->head_dim_k_mla, c->rope_dims, c->head_dim_v_mla);
    }
    return true;
}

bool moe_config_experts(moe_meta *r, moe_model_config *c, moe_gating gating, bool norm_topk,
                        moe_ffn_act act, const char *width_key) {
    uint32_t func = gating;
    if (!moe_meta_bool(r, "expert_weights_norm", norm_topk, &c->norm_topk) ||
        !moe_meta_u32(r, "expert_count", true, 0, &c->n_expert) ||
        !moe_meta_u32(r, "expert_used_count", true, 0, &c->n_expert_used) ||
        !moe_meta_u32(r, width_key, true, 0, &c->n_ff_exp) ||
        !moe_meta_u32(r, "leading_dense_block_count", false, 0, &c->n_layer_dense_lead) ||
        !moe_meta_u32(r, "expert_gating_func", false, func, &func) ||
        !moe_meta_f32(r, "expert_weights_scale", false, 1.0f, &c->expert_weights_scale) ||
        !moe_meta_u32(r, "expert_group_count", false, 0, &c->n_expert_group) ||
        !moe_meta_u32(r, "expert_group_used_count", false, 0, &c->n_group_used))
        return false;
    c->expert_act = act;
    if (c->n_expert == 0 || c->n_expert > MOE_MAX_EXPERTS || c->n_expert_used == 0 ||
        c->n_expert_used > c->n_expert || c->n_ff_exp == 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.expert_count %u / expert_used_count %u / %s %u are inconsistent",
                             r->arch, c->n_expert, c->n_expert_used, width_key, c->n_ff_exp);
    if (func != MOE_GATING_SOFTMAX && func != MOE_GATING_SIGMOID &&
        func != MOE_GATING_SOFTMAX_WEIGHT)
        return moe_meta_fail(r, MOE_ERR_UNSUPPORTED, "%s.expert_gating_func = %u is unknown",
                             r->arch, func);
    c->gating = (moe_gating)func;
    if (c->n_expert_group > 1 &&
        (c->n_expert_group > 256 || c->n_expert % c->n_expert_group != 0 || c->n_group_used == 0 ||
         c->n_group_used > c->n_expert_group ||
         c->n_group_used * (c->n_expert / c->n_expert_group) < c->n_expert_used))
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.expert_group_count %u / expert_group_used_count %u do not fit %u "
                             "experts, %u used per token",
                             r->arch, c->n_expert_group, c->n_group_used, c->n_expert,
                             c->n_expert_used);
    if (c->n_layer_dense_lead > c->n_layer) c->n_layer_dense_lead = c->n_layer;
    for (uint32_t il = c->n_layer_dense_lead; il < moe_config_n_planned(c); il++)
        c->layer[il].ffn = MOE_FFN_EXPERTS;
    /* shared experts: their own width (qwen3next) or n_shared routed-expert widths (DeepSeek) */
    uint32_t n_shared = 0;
    if (!moe_meta_u32(r, "expert_shared_feed_forward_length", false, 0, &c->n_ff_shexp) ||
        !moe_meta_u32(r, "expert_shared_count", false, 0, &n_shared))
        return false;
    if (!c->n_ff_shexp) {
        const uint64_t ff = (uint64_t)n_shared * c->n_ff_exp;
        if (ff > MOE_MAX_WIDTH)
            return moe_meta_fail(r, MOE_ERR_RANGE, "%s.expert_shared_count %u x %s %u exceeds %u",
                                 r->arch, n_shared, width_key, c->n_ff_exp, MOE_MAX_WIDTH);
        c->n_ff_shexp = (uint32_t)ff;
    }
    return true;
}

/* The widths every linear-attention layer shares, checked. */
static bool config_linear_check(moe_meta *r, const moe_model_config *c) {
    if (c->ssm_d_conv == 0 || c->ssm_d_conv > MOE_CONV_MAX_TAPS || c->ssm_head_dim == 0 ||
        c->ssm_n_k_heads == 0 || c->ssm_n_v_heads % c->ssm_n_k_heads != 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "linear attention: conv kernel %u (1..%u), head dim %u, %u k heads "
                             "and %u v heads (a multiple) are inconsistent",
                             c->ssm_d_conv, MOE_CONV_MAX_TAPS, c->ssm_head_dim, c->ssm_n_k_heads,
                             c->ssm_n_v_heads);
    return true;
}

bool moe_config_gdn(moe_meta *r, moe_model_config *c) {
    uint32_t inner = 0;
    if (!moe_meta_u32(r, "ssm.conv_kernel", true, 0, &c->ssm_d_conv) ||
        !moe_meta_u32(r, "ssm.state_size", true, 0, &c->ssm_head_dim) ||
        !moe_meta_u32(r, "ssm.group_count", true, 0, &c->ssm_n_k_heads) ||
        !moe_meta_u32(r, "ssm.time_step_rank", true, 0, &c->ssm_n_v_heads) ||
        !moe_meta_u32(r, "ssm.inner_size", true, 0, &inner))
        return false;
    if ((uint64_t)c->ssm_n_v_heads * c->ssm_head_dim != inner)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.ssm.inner_size %u must be time_step_rank %u x state_size %u",
                             r->arch, inner, c->ssm_n_v_heads, c->ssm_head_dim);
    return config_linear_check(r, c);
}

bool moe_config_kda(moe_meta *r, moe_model_config *c) {
    /* q, k and v all have n_head heads */
    uint32_t state_size = 0;
    if (!moe_meta_u32(r, "ssm.conv_kernel", true, 0, &c->ssm_d_conv) ||
        !moe_meta_u32(r, "ssm.state_size", false, 0, &state_size) ||
        !moe_meta_u32(r, "kda.head_dim", state_size == 0, state_size, &c->ssm_head_dim))
        return false;
    c->ssm_n_k_heads = c->ssm_n_v_heads = c->n_head;
    return config_linear_check(r, c);
}

bool moe_config_gdn_hybrid(moe_meta *r, moe_model_config *c) {
    uint32_t interval = 0;
    if (!moe_meta_u32(r, "full_attention_interval", false, 4, &interval) || !moe_config_gdn(r, c))
        return false;
    if (interval == 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT, "%s.full_attention_interval must be positive",
                             r->arch);
    c->attn_output_gate = true;
    if (c->head_dim_k != c->head_dim_v)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "an attention output gate needs key_length %u = value_length %u",
                             c->head_dim_k, c->head_dim_v);
    for (uint32_t il = 0; il < c->n_layer; il++)
        if ((il + 1) % interval != 0) moe_config_plan_mixer(c, il, MOE_MIXER_GDN);
    return true;
}

void moe_config_plan_mixer(moe_model_config *c, uint32_t il, moe_mixer mixer) {
    const bool was_linear =
        c->layer[il].mixer == MOE_MIXER_GDN || c->layer[il].mixer == MOE_MIXER_KDA;
    const bool linear = mixer == MOE_MIXER_GDN || mixer == MOE_MIXER_KDA;
    if (il < c->n_layer) c->n_layer_linear += (uint32_t)linear - (uint32_t)was_linear;
    c->layer[il].mixer = mixer;
    if (linear) c->layer[il].n_head_kv = 0;
}

#define ROPE_SECTIONS 4 /* rope.dimension_sections: t, h, w, e pairs */

/* The sections must cover exactly the rotated dims (text sees one position in all of them). */
bool moe_config_rope_sections(moe_meta *r, const moe_model_config *c) {
    uint32_t sections[ROPE_SECTIONS];
    char key[128];
    snprintf(key, sizeof key, "%s.rope.dimension_sections", r->arch);
    const moe_gguf_value *v = moe_gguf_find(r->g, key);
    if (!v) return true;
    if (v->type != MOE_GGUF_ARRAY || v->arr.n != ROPE_SECTIONS ||
        !moe_meta_u32_per_layer(r, "rope.dimension_sections", 0, ROPE_SECTIONS, sections))
        return moe_meta_fail(r, MOE_ERR_FORMAT, "key '%s' must be %d integers", key, ROPE_SECTIONS);
    uint32_t pairs = 0;
    for (int i = 0; i < ROPE_SECTIONS; i++) pairs += sections[i];
    if (2 * pairs != c->rope_dims)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "rope sections cover %u dims, rope.dimension_count is %u", 2 * pairs,
                             c->rope_dims);
    return true;
}

bool moe_config_hc(moe_meta *r, moe_model_config *c) {
    if (!moe_meta_u32(r, "hyper_connection.count", true, 0, &c->n_hc) ||
        !moe_meta_u32(r, "hyper_connection.sinkhorn_iterations", true, 0, &c->hc_sinkhorn_iters) ||
        !moe_meta_f32(r, "hyper_connection.epsilon", true, 0, &c->hc_eps))
        return false;
    if (c->n_hc < 1 || c->n_hc > MOE_MAX_HC || c->hc_sinkhorn_iters < 1 ||
        c->hc_sinkhorn_iters > 1000 || !(c->hc_eps >= 0))
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.hyper_connection: count %u (1..%d), sinkhorn_iterations %u "
                             "(1..1000) or epsilon %g out of range",
                             r->arch, c->n_hc, MOE_MAX_HC, c->hc_sinkhorn_iters, c->hc_eps);
    return true;
}

bool moe_config_indexer(moe_meta *r, moe_model_config *c) {
    if (!moe_meta_u32(r, "attention.indexer.head_count", true, 0, &c->idx_n_head) ||
        !moe_meta_u32(r, "attention.indexer.key_length", true, 0, &c->idx_head_dim) ||
        !moe_meta_u32(r, "attention.indexer.top_k", true, 0, &c->idx_top_k) ||
        !moe_meta_u32(r, "attention.indexer.block_size", false, 1, &c->idx_kpool) ||
        !moe_meta_f32(r, "attention.layer_norm_epsilon", false, 0.0f, &c->idx_norm_eps))
        return false;
    if (c->idx_n_head == 0 || c->idx_head_dim == 0 || c->idx_head_dim > MOE_MAX_WIDTH ||
        c->idx_kpool == 0 || c->idx_kpool > 1024 || c->idx_top_k < c->idx_kpool ||
        c->idx_top_k % c->idx_kpool != 0 || c->idx_top_k > MOE_MAX_WIDTH)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.attention.indexer: head_count %u, key_length %u, top_k %u and "
                             "block_size %u are inconsistent (top_k a positive multiple of "
                             "block_size)",
                             r->arch, c->idx_n_head, c->idx_head_dim, c->idx_top_k, c->idx_kpool);
    return true;
}

/* An architecture moe does not run, read as far as every transformer goes. */
static bool generic_config(moe_meta *r, moe_model_config *c) {
    return moe_config_transformer(r, c, MOE_ROPE_NORM, false);
}

static const moe_arch_desc generic_arch = {.name = "generic", .config = generic_config};

static moe_status config_read(const moe_gguf *g, const char *path, bool generic,
                              moe_model_config *c, moe_error *err) {
    memset(c, 0, sizeof *c);
    const char *arch = moe_gguf_get_str(g, "general.architecture");
    if (!arch)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: missing key 'general.architecture'", path);
    const moe_arch_desc *a = generic ? &generic_arch : moe_arch_find(arch);
    if (!a)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: unknown architecture '%s' (moe supports: %s)", path, arch,
                             moe_arch_names());
    c->arch = a;
    c->arch_name = generic ? arch : a->name;
    moe_meta r = {.g = g, .path = path, .arch = arch, .err = err};
    if (!a->config(&r, c)) {
        if (!err->code) moe_error_set(err, MOE_ERR_FORMAT, "%s: %s config is invalid", path, arch);
        moe_model_config_free(c);
        return err->code;
    }
    return MOE_OK;
}

moe_status moe_model_config_read(const moe_gguf *g, const char *path, moe_model_config *c,
                                 moe_error *err) {
    return config_read(g, path, false, c, err);
}

moe_status moe_model_config_read_generic(const moe_gguf *g, const char *path, moe_model_config *c,
                                         moe_error *err) {
    return config_read(g, path, true, c, err);
}

void moe_model_config_free(moe_model_config *c) {
    free(c->layer);
    c->layer = NULL;
}

moe_layer_state moe_layer_state_of(const moe_model_config *c, uint32_t il) {
    moe_layer_state s = {0};
    const moe_layer_plan *p = &c->layer[il];
    switch (p->mixer) {
    case MOE_MIXER_ATTENTION:
        s.k_values = (uint64_t)p->n_head_kv * p->head_dim_k;
        s.v_values = (uint64_t)p->n_head_kv * p->head_dim_v;
        break;
    case MOE_MIXER_MLA: /* one row: the latent then the roped key; V is the latent part */
        s.k_values = (uint64_t)c->n_lora_kv + c->rope_dims;
        /* the indexer's row beside the latent (a layer sharing another's selection has none) */
        if (p->indexed && !p->index_shared) s.index_values = moe_index_row_values(c);
        break;
    case MOE_MIXER_GDN:
    case MOE_MIXER_KDA: { /* the conv tail over q|k|v channels, and a k x v matrix per v head */
        const uint64_t hd = c->ssm_head_dim,
                       channels = (2ull * c->ssm_n_k_heads + c->ssm_n_v_heads) * hd;
        s.state_values = channels * (c->ssm_d_conv - 1) + (uint64_t)c->ssm_n_v_heads * hd * hd;
        break;
    }
    default:
        break;
    }
    return s;
}

/* ==== Tensors ==== */

/* What a declaring binder hands back for a tensor the file being made will have. */
static const moe_tensor declared_tensor;

/* Find `name` and check its shape: ne0 x ne1 x ne2 (ne1 = 0 for a vector, ne2 = 0 for a
 * matrix), that moe can compute with its type, and that it is F32 where the forward pass reads
 * it as floats (f32). */
static const moe_tensor *bind_name(moe_binder *b, const char *name, int64_t ne0, int64_t ne1,
                                   int64_t ne2, bool required, bool f32) {
    if (b->err->code) return NULL;
    if (b->declare) {
        const moe_tensor_decl d = {.name = name,
                                   .n_dims = ne2   ? 3
                                             : ne1 ? 2
                                                   : 1,
                                   .ne = {ne0, ne1 ? ne1 : 1, ne2 ? ne2 : 1},
                                   .f32 = f32,
                                   .required = required};
        return b->declare(b->declare_ctx, &d) || required ? &declared_tensor : NULL;
    }
    const moe_tensor *t = moe_gguf_tensor_find(b->m->gguf, name);
    if (!t) {
        if (required)
            moe_error_set(b->err, MOE_ERR_NOT_FOUND, "%s: missing tensor '%s' (%s)", b->path, name,
                          b->m->cfg.arch_name);
        return NULL;
    }
    const int64_t want[4] = {ne0, ne1 ? ne1 : 1, ne2 ? ne2 : 1, 1};
    if (t->ne[0] != want[0] || t->ne[1] != want[1] || t->ne[2] != want[2] || t->ne[3] != 1) {
        char shape[96];
        snprintf(shape, sizeof shape,
                 ne2   ? "[%lld, %lld, %lld]"
                 : ne1 ? "[%lld, %lld]"
                       : "[%lld]",
                 (long long)want[0], (long long)want[1], (long long)want[2]);
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: tensor '%s' has shape [%lld, %lld, %lld, %lld], expected %s", b->path,
                      name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                      (long long)t->ne[3], shape);
        return NULL;
    }
    const moe_type_traits *tr = moe_type_traits_get(t->type);
    if (!tr || !tr->to_float || !tr->dot) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED,
                      "%s: tensor '%s' has type %s, which moe cannot compute with", b->path, name,
                      moe_type_name(t->type));
        return NULL;
    }
    if (!t->data) {
        moe_error_set(b->err, MOE_ERR_IO, "%s: tensor '%s' has no data mapped", b->path, name);
        return NULL;
    }
    if (f32 && t->type != MOE_TYPE_F32) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED, "%s: tensor '%s' is %s; moe reads it as F32",
                      b->path, name, moe_type_name(t->type));
        return NULL;
    }
    return t;
}

static const moe_tensor *bind_blk(moe_binder *b, uint32_t il, const char *what, const char *suffix,
                                  int64_t ne0, int64_t ne1, int64_t ne2, bool required, bool f32) {
    char name[128];
    if (suffix)
        snprintf(name, sizeof name, "blk.%u.%s.%s", il, what, suffix);
    else
        snprintf(name, sizeof name, "blk.%u.%s", il, what);
    return bind_name(b, name, ne0, ne1, ne2, required, f32);
}

const moe_tensor *moe_bind_tensor(moe_binder *b, const char *name, int64_t ne0, int64_t ne1,
                                  int64_t ne2, bool required, bool f32) {
    return bind_name(b, name, ne0, ne1, ne2, required, f32);
}

const moe_tensor *moe_bind_blk(moe_binder *b, uint32_t il, const char *what, const char *suffix,
                               int64_t ne0, int64_t ne1, int64_t ne2, bool required) {
    return bind_blk(b, il, what, suffix, ne0, ne1, ne2, required, false);
}

const moe_tensor *moe_bind_matrix(moe_binder *b, uint32_t il, const char *what, int64_t ne0,
                                  int64_t ne1) {
    return moe_bind_blk(b, il, what, "weight", ne0, ne1, 0, true);
}

static const moe_tensor *bind_matrix3(moe_binder *b, uint32_t il, const char *what, int64_t ne0,
                                      int64_t ne1, int64_t ne2) {
    return moe_bind_blk(b, il, what, "weight", ne0, ne1, ne2, true);
}

const moe_tensor *moe_bind_f32(moe_binder *b, uint32_t il, const char *what, const char *suffix,
                               int64_t ne0, int64_t ne1, int64_t ne2, bool required) {
    return bind_blk(b, il, what, suffix, ne0, ne1, ne2, required, true);
}

const moe_tensor *moe_bind_norm(moe_binder *b, uint32_t il, const char *what) {
    return moe_bind_f32(b, il, what, "weight", b->m->cfg.n_embd, 0, 0, true);
}

void moe_bind_nextn(moe_binder *b, uint32_t il, moe_nextn_weights *w) {
    const int64_t n_embd = b->m->cfg.n_embd, n_vocab = b->m->cfg.n_vocab;
    w->eh_proj = moe_bind_matrix(b, il, "nextn.eh_proj", 2 * n_embd, n_embd);
    w->enorm = moe_bind_norm(b, il, "nextn.enorm");
    w->hnorm = moe_bind_norm(b, il, "nextn.hnorm");
    w->head_norm = moe_bind_f32(b, il, "nextn.shared_head_norm", "weight", n_embd, 0, 0, false);
    w->embed = moe_bind_blk(b, il, "nextn.embed_tokens", "weight", n_embd, n_vocab, 0, false);
    w->head = moe_bind_blk(b, il, "nextn.shared_head_head", "weight", n_embd, n_vocab, 0, false);
}

/* ==== Layer kinds several architectures share ==== */

void moe_bind_gqa(moe_binder *b, uint32_t il, const moe_gqa_opts *o, moe_attn_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const moe_layer_plan *p = &c->layer[il];
    const uint32_t n_kv = p->n_head_kv;
    int64_t q = (int64_t)c->n_head * p->head_dim_k, k = (int64_t)n_kv * p->head_dim_k;
    int64_t v = (int64_t)n_kv * p->head_dim_v, out = (int64_t)c->n_head * p->head_dim_v;
    w->wq = moe_bind_matrix(b, il, "attn_q", c->n_embd, c->attn_output_gate ? 2 * q : q);
    w->wk = moe_bind_matrix(b, il, "attn_k", c->n_embd, k);
    w->wv = moe_bind_blk(b, il, "attn_v", "weight", c->n_embd, v, 0, !o->v_optional);
    if (!w->wv && !b->err->code && p->head_dim_k != p->head_dim_v)
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: layer %u has no attn_v, and its keys (%u wide) cannot be its values "
                      "(%u wide)",
                      b->path, il, p->head_dim_k, p->head_dim_v);
    w->wo = moe_bind_matrix(b, il, "attn_output", out, c->n_embd);
    if (o->qk_norm || o->qk_norm_optional) {
        w->q_norm = moe_bind_f32(b, il, "attn_q_norm", "weight", p->head_dim_k, 0, 0, o->qk_norm);
        w->k_norm = moe_bind_f32(b, il, "attn_k_norm", "weight", p->head_dim_k, 0, 0, o->qk_norm);
        if (!w->q_norm != !w->k_norm && !b->err->code)
            moe_error_set(b->err, MOE_ERR_FORMAT,
                          "%s: layer %u has only one of attn_q_norm and attn_k_norm", b->path, il);
    }
    if (o->qkv_bias) {
        w->bq = moe_bind_f32(b, il, "attn_q", "bias", q, 0, 0, true);
        w->bk = moe_bind_f32(b, il, "attn_k", "bias", k, 0, 0, true);
        w->bv = moe_bind_f32(b, il, "attn_v", "bias", v, 0, 0, true);
    }
    if (o->out_bias_sinks) {
        w->bo = moe_bind_f32(b, il, "attn_output", "bias", c->n_embd, 0, 0, true);
        w->sinks = moe_bind_f32(b, il, "attn_sinks", "weight", c->n_head, 0, 0, true);
    }
}

/* Multi-head latent attention: q through a LoRA (or a plain attn_q), the kv latent and the
 * shared roped key from attn_kv_a_mqa, and the per-head attn_k_b / attn_v_b that absorb
 * into the query and decompress the attended latent. */
void moe_bind_mla(moe_binder *b, uint32_t il, moe_mla_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t q = (int64_t)c->n_head * c->head_dim_k_mla;
    const int64_t nope = c->head_dim_k_mla - c->rope_dims;
    char name[128];
    snprintf(name, sizeof name, "blk.%u.attn_kv_b.weight", il);
    if (!b->declare && moe_gguf_tensor_find(b->m->gguf, name) && !b->err->code) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED,
                      "%s: '%s' is the older MLA layout; moe needs attn_k_b / attn_v_b "
                      "(re-convert with a current llama.cpp)",
                      b->path, name);
        return;
    }
    if (c->n_lora_q) {
        w->wq_a = moe_bind_matrix(b, il, "attn_q_a", c->n_embd, c->n_lora_q);
        w->q_a_norm = moe_bind_f32(b, il, "attn_q_a_norm", "weight", c->n_lora_q, 0, 0, true);
        w->wq_b = moe_bind_matrix(b, il, "attn_q_b", c->n_lora_q, q);
    } else {
        w->wq = moe_bind_matrix(b, il, "attn_q", c->n_embd, q);
    }
    w->wkv_a_mqa = moe_bind_matrix(b, il, "attn_kv_a_mqa", c->n_embd, c->n_lora_kv + c->rope_dims);
    w->kv_a_norm = moe_bind_f32(b, il, "attn_kv_a_norm", "weight", c->n_lora_kv, 0, 0, true);
    w->wk_b = bind_matrix3(b, il, "attn_k_b", nope, c->n_lora_kv, c->n_head);
    w->wv_b = bind_matrix3(b, il, "attn_v_b", c->n_lora_kv, c->head_dim_v_mla, c->n_head);
    w->wo =
        moe_bind_matrix(b, il, "attn_output", (int64_t)c->n_head * c->head_dim_v_mla, c->n_embd);
}

void moe_bind_indexer(moe_binder *b, uint32_t il, moe_mla_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t id = c->idx_head_dim, ih = c->idx_n_head;
    w->idx_q_b = moe_bind_matrix(b, il, "indexer.attn_q_b", c->n_lora_q, ih * id);
    w->idx_k = moe_bind_matrix(b, il, "indexer.attn_k", c->n_embd, id);
    w->idx_k_norm = moe_bind_f32(b, il, "indexer.k_norm", "weight", id, 0, 0, true);
    w->idx_k_bias = moe_bind_f32(b, il, "indexer.k_norm", "bias", id, 0, 0, true);
    w->idx_proj = moe_bind_matrix(b, il, "indexer.proj", c->n_embd, ih);
    if (c->idx_kpool == 1) return; /* positions are not pooled */
    w->idx_gate = moe_bind_matrix(b, il, "indexer_compressor_gate", c->n_embd, id);
    w->idx_ape = moe_bind_f32(b, il, "indexer_compressor_ape", "weight", id, c->idx_kpool, 0, true);
}

void moe_bind_hc(moe_binder *b, uint32_t il, const char *site, moe_hc_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t n_mix = (2 + (int64_t)c->n_hc) * c->n_hc;
    char name[32];
    snprintf(name, sizeof name, "hc_%s_fn", site);
    w->fn = moe_bind_matrix(b, il, name, (int64_t)c->n_hc * c->n_embd, n_mix);
    snprintf(name, sizeof name, "hc_%s_base", site);
    w->base = moe_bind_f32(b, il, name, "weight", n_mix, 0, 0, true);
    snprintf(name, sizeof name, "hc_%s_scale", site);
    w->scale = moe_bind_f32(b, il, name, "weight", 3, 0, 0, true);
}

void moe_bind_gdn(moe_binder *b, uint32_t il, bool ba, moe_linear_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t hd = c->ssm_head_dim, nv = c->ssm_n_v_heads, d = c->ssm_d_conv;
    const int64_t K = c->ssm_n_k_heads * hd, V = nv * hd;
    w->qkv = moe_bind_matrix(b, il, "attn_qkv", c->n_embd, 2 * K + V);
    w->gate = moe_bind_matrix(b, il, "attn_gate", c->n_embd, V);
    w->conv1d[0] = moe_bind_f32(b, il, "ssm_conv1d", "weight", d, 2 * K + V, 0, true);
    w->a = moe_bind_f32(b, il, "ssm_a", NULL, nv, 0, 0, true);
    w->dt_b = moe_bind_f32(b, il, "ssm_dt", "bias", nv, 0, 0, true);
    if (ba) {
        w->ba = moe_bind_matrix(b, il, "ssm_ba", c->n_embd, 2 * nv);
    } else {
        w->beta = moe_bind_matrix(b, il, "ssm_beta", c->n_embd, nv);
        w->alpha = moe_bind_matrix(b, il, "ssm_alpha", c->n_embd, nv);
    }
    w->out = moe_bind_matrix(b, il, "ssm_out", V, c->n_embd);
    w->norm = moe_bind_f32(b, il, "ssm_norm", "weight", hd, 0, 0, true);
}

void moe_bind_kda(moe_binder *b, uint32_t il, bool a_flat, moe_linear_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t hd = c->ssm_head_dim, nv = c->ssm_n_v_heads, d = c->ssm_d_conv;
    const int64_t K = c->ssm_n_k_heads * hd, V = nv * hd;
    w->wq = moe_bind_matrix(b, il, "attn_q", c->n_embd, K);
    w->wk = moe_bind_matrix(b, il, "attn_k", c->n_embd, K);
    w->wv = moe_bind_matrix(b, il, "attn_v", c->n_embd, V);
    w->conv1d[0] = moe_bind_f32(b, il, "ssm_conv1d_q", "weight", d, 1, K, true);
    w->conv1d[1] = moe_bind_f32(b, il, "ssm_conv1d_k", "weight", d, 1, K, true);
    w->conv1d[2] = moe_bind_f32(b, il, "ssm_conv1d_v", "weight", d, 1, V, true);
    w->a = moe_bind_f32(b, il, "ssm_a", NULL, a_flat ? nv : 1, a_flat ? 0 : nv, 0, true);
    w->dt_b = moe_bind_f32(b, il, "ssm_dt", "bias", V, 0, 0, true);
    w->beta = moe_bind_matrix(b, il, "ssm_beta", c->n_embd, nv);
    w->f_a = moe_bind_matrix(b, il, "ssm_f_a", c->n_embd, hd);
    w->f_b = moe_bind_matrix(b, il, "ssm_f_b", hd, V);
    w->g_a = moe_bind_matrix(b, il, "ssm_g_a", c->n_embd, hd);
    w->g_b = moe_bind_matrix(b, il, "ssm_g_b", hd, V);
    w->out = moe_bind_matrix(b, il, "attn_output", V, c->n_embd);
    w->norm = moe_bind_f32(b, il, "ssm_norm", "weight", hd, 0, 0, true);
}

void moe_bind_gated_ffn(moe_binder *b, uint32_t il, const char *suffix, int64_t width,
                        moe_ffn_weights *w) {
    const int64_t n_embd = b->m->cfg.n_embd;
    char name[32];
    snprintf(name, sizeof name, "ffn_gate%s", suffix);
    w->gate = moe_bind_matrix(b, il, name, n_embd, width);
    snprintf(name, sizeof name, "ffn_up%s", suffix);
    w->up = moe_bind_matrix(b, il, name, n_embd, width);
    snprintf(name, sizeof name, "ffn_down%s", suffix);
    w->down = moe_bind_matrix(b, il, name, width, n_embd);
}

/* Router, routed experts (with their biases where the file has them) and shared experts. */
static void bind_experts(moe_binder *b, uint32_t il, moe_expert_weights *w) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t E = c->n_embd, ff = c->n_ff_exp, n = c->n_expert;
    w->router = moe_bind_matrix(b, il, "ffn_gate_inp", E, n);
    w->gate = bind_matrix3(b, il, "ffn_gate_exps", E, ff, n);
    w->up = bind_matrix3(b, il, "ffn_up_exps", E, ff, n);
    w->down = bind_matrix3(b, il, "ffn_down_exps", ff, E, n);
    w->router_b = moe_bind_f32(b, il, "ffn_gate_inp", "bias", n, 0, 0, false);
    w->sel_bias = moe_bind_f32(b, il, "exp_probs_b", "bias", n, 0, 0, false);
    w->gate_b = moe_bind_f32(b, il, "ffn_gate_exps", "bias", ff, n, 0, false);
    w->up_b = moe_bind_f32(b, il, "ffn_up_exps", "bias", ff, n, 0, false);
    w->down_b = moe_bind_f32(b, il, "ffn_down_exps", "bias", E, n, 0, false);
    if (c->n_ff_shexp) {
        moe_bind_gated_ffn(b, il, "_shexp", c->n_ff_shexp, &w->shared);
        w->shared_gate = moe_bind_f32(b, il, "ffn_gate_inp_shexp", "weight", E, 0, 0, false);
    }
}

void moe_bind_ffn(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    if (l->plan.ffn == MOE_FFN_EXPERTS)
        bind_experts(b, il, &l->experts);
    else
        moe_bind_gated_ffn(b, il, "", b->m->cfg.n_ff, &l->ffn);
}

bool moe_model_is_routed(const moe_tensor *t, void *model) {
    const moe_model *m = model;
    for (uint32_t il = 0; il < m->cfg.n_layer + m->n_layer_mtp; il++) {
        const moe_layer_weights *l = &m->layers[il];
        if (l->plan.ffn == MOE_FFN_EXPERTS && (t == l->experts.gate || t == l->experts.up ||
                                               t == l->experts.down || t == l->experts.gate_up))
            return true;
    }
    return false;
}

int moe_layer_matrices(const moe_layer_weights *l, const moe_tensor **out) {
    int n = 0;
#define ADD(t) (out[n] = (t), n += (t) != NULL)
    switch (l->plan.mixer) {
    case MOE_MIXER_ATTENTION:
        ADD(l->attn.wq), ADD(l->attn.wk), ADD(l->attn.wv), ADD(l->attn.wo);
        break;
    case MOE_MIXER_MLA:
        ADD(l->mla.wq), ADD(l->mla.wq_a), ADD(l->mla.wq_b), ADD(l->mla.wkv_a_mqa);
        ADD(l->mla.wk_b), ADD(l->mla.wv_b), ADD(l->mla.wo);
        ADD(l->mla.idx_q_b), ADD(l->mla.idx_k), ADD(l->mla.idx_proj), ADD(l->mla.idx_gate);
        break;
    default: /* linear attention */
        ADD(l->linear.qkv), ADD(l->linear.gate), ADD(l->linear.ba), ADD(l->linear.alpha);
        ADD(l->linear.wq);
        ADD(l->linear.wk), ADD(l->linear.wv), ADD(l->linear.beta), ADD(l->linear.f_a);
        ADD(l->linear.f_b), ADD(l->linear.g_a), ADD(l->linear.g_b), ADD(l->linear.out);
        break;
    }
    const moe_ffn_weights *f = l->plan.ffn == MOE_FFN_EXPERTS ? &l->experts.shared : &l->ffn;
    if (l->plan.ffn == MOE_FFN_EXPERTS) {
        ADD(l->experts.router), ADD(l->experts.gate), ADD(l->experts.up), ADD(l->experts.down);
        ADD(l->experts.gate_up);
    }
    ADD(f->gate), ADD(f->up), ADD(f->down);
    ADD(l->hc_attn.fn), ADD(l->hc_ffn.fn);
#undef ADD
    return n;
}

/* ==== Repacking the matrices (quant.h, "Weight layouts in memory") ==== */

/* Whether t's rows are read one by one (moe_tensor_row_f32: token embeddings), which needs
 * the file's layout. */
static bool read_by_rows(const moe_model *m, const moe_tensor *t) {
    if (t == m->token_embd) return true;
    for (uint32_t il = 0; il < m->cfg.n_layer + m->n_layer_mtp; il++)
        if (t == m->layers[il].nextn.embed) return true;
    return false;
}

/* Repack one matrix if the active table has a kernel on a layout for its type. */
static moe_status repack_one(moe_model *m, const moe_tensor *t, bool routed, moe_pool *pool,
                             moe_layout_report *out, moe_error *err) {
    if (!t || !t->data || t->layout != MOE_LAYOUT_FILE || t->n_dims < 2 || t->ne[1] < MOE_ROWS16 ||
        read_by_rows(m, t) || (!routed && moe_model_is_routed(t, m)))
        return MOE_OK;
    const moe_type_kernels *k = moe_kernels_type(t->type);
    if (!k || !k->dot_tile_rows16) return MOE_OK;
    const moe_status st =
        moe_gguf_tensor_repack(m->gguf, t, MOE_LAYOUT_ROWS16, pool, &out->mapped_bytes, err);
    if (st == MOE_OK) out->n_matrices++, out->bytes += t->n_bytes;
    return st;
}

moe_status moe_model_repack(moe_model *m, bool routed, moe_pool *pool, moe_layout_report *out,
                            moe_error *err) {
    *out = (moe_layout_report){.isa = moe_kernels_get()->isa};
    const double t0 = moe_now();
    for (uint32_t il = 0; il < m->cfg.n_layer + m->n_layer_mtp; il++) {
        const moe_tensor *mats[MOE_LAYER_MAX_MATRICES];
        const int n = moe_layer_matrices(&m->layers[il], mats);
        for (int i = 0; i < n; i++)
            if (repack_one(m, mats[i], routed, pool, out, err) != MOE_OK) return err->code;
    }
    const moe_status st = repack_one(m, m->output, routed, pool, out, err);
    out->seconds = moe_now() - t0;
    return st;
}

void moe_layout_report_print(const char *label, const moe_layout_report *r) {
    if (!r->n_matrices) return;
    char mapped[96] = "";
    if (r->mapped_bytes)
        snprintf(mapped, sizeof mapped, ", %.1f MiB of them mapped, now private memory",
                 r->mapped_bytes / 1048576.0);
    fprintf(stderr,
            "%s: repacked %u matrices (%.1f MiB, no bytes added%s) into 16-row groups for %s's "
            "fast kernels in %.2f s (--no-repack: the file's layout)\n",
            label, r->n_matrices, r->bytes / 1048576.0, mapped, moe_isa_name(r->isa), r->seconds);
}

/* ==== Loading ==== */

/* A file's NextN / MTP layers: runnable when every one binds with its NextN projection; a file
 * whose MTP layers do not bind still loads (with a warning), without them. */
static void bind_mtp(moe_binder *b) {
    moe_model *m = b->m;
    const moe_model_config *c = &m->cfg;
    moe_error err = {0};
    moe_binder mtp = {.m = m, .path = b->path, .err = &err};
    for (uint32_t il = c->n_layer; il < moe_config_n_planned(c) && !err.code; il++) {
        m->layers[il].plan = c->layer[il];
        c->arch->bind_layer(&mtp, il, &m->layers[il]);
        if (!err.code && !m->layers[il].nextn.eh_proj)
            moe_error_set(&err, MOE_ERR_UNSUPPORTED,
                          "%s: layer %u: moe does not run %s's NextN layers yet", b->path, il,
                          c->arch_name);
    }
    if (err.code)
        moe_log(MOE_LOG_WARN, "MTP layers not used: %s", err.msg);
    else
        m->n_layer_mtp = c->n_layer_nextn;
}

/* The embeddings, head and every layer: the trunk's, then the NextN layers (declared all; from
 * a file, bound where they can run). */
static bool bind_model(moe_binder *b) {
    moe_model *m = b->m;
    moe_model_config *c = &m->cfg;
    if (!b->declare) {
        const moe_tensor *embd = moe_gguf_tensor_find(m->gguf, "token_embd.weight");
        if (!embd) {
            moe_error_set(b->err, MOE_ERR_NOT_FOUND, "%s: missing tensor 'token_embd.weight'",
                          b->path);
            return false;
        }
        if (embd->ne[1] <= 0 || embd->ne[1] > MOE_MAX_WIDTH) {
            moe_error_set(b->err, MOE_ERR_RANGE, "%s: token_embd.weight has %lld rows", b->path,
                          (long long)embd->ne[1]);
            return false;
        }
        c->n_vocab = (uint32_t)embd->ne[1];
    }
    m->token_embd = bind_name(b, "token_embd.weight", c->n_embd, c->n_vocab, 0, true, false);
    const uint32_t n_planned = moe_config_n_planned(c);
    m->layers = moe_xcalloc(n_planned, sizeof *m->layers);
    for (uint32_t il = 0; il < n_planned && !b->err->code; il++) {
        m->layers[il].plan = c->layer[il];
        c->arch->bind_layer(b, il, &m->layers[il]);
        if (il + 1 == c->n_layer && !b->declare) {
            bind_mtp(b);
            break;
        }
    }
    m->output_norm = bind_name(b, "output_norm.weight", c->n_embd, 0, 0, true, true);
    m->output = bind_name(b, "output.weight", c->n_embd, c->n_vocab, 0, false, false);
    c->tied_output = !m->output;
    if (!m->output) m->output = m->token_embd;
    return !b->err->code;
}

moe_status moe_model_declare(const moe_model_config *c,
                             bool (*tensor)(void *ctx, const moe_tensor_decl *d), void *ctx,
                             moe_error *err) {
    moe_model m = {.cfg = *c}; /* borrows c's plan */
    moe_binder b = {
        .m = &m, .path = "(declared)", .err = err, .declare = tensor, .declare_ctx = ctx};
    bind_model(&b);
    free(m.layers);
    return err->code;
}

moe_model *moe_model_from_gguf(moe_gguf *g, const char *path, moe_error *err) {
    moe_model *m = moe_xcalloc(1, sizeof *m);
    if (moe_model_config_read(g, path, &m->cfg, err) != MOE_OK) {
        free(m);
        return NULL;
    }
    m->gguf = g;
    m->path = moe_xstrdup(path);
    moe_binder b = {.m = m, .path = path, .err = err};
    if (!bind_model(&b)) {
        m->gguf = NULL; /* the caller keeps the file on failure */
        moe_model_free(m);
        return NULL;
    }
    return m;
}

moe_model *moe_model_load(const char *path, moe_error *err) {
    moe_gguf *g = moe_gguf_open_model(path, err);
    if (!g) return NULL;
    for (uint32_t i = 0; i < moe_gguf_n_shards(g); i++)
        if (moe_gguf_shard_data_is_hole(g, i)) {
            moe_error_set(err, MOE_ERR_FORMAT,
                          "%s: the tensor data is a hole (a --header-only file?): it has the keys "
                          "and tensor directory for inspect and budget, not the weights",
                          moe_gguf_shard_get(g, i)->path);
            moe_gguf_close(g);
            return NULL;
        }
    moe_model *m = moe_model_from_gguf(g, path, err);
    if (!m) moe_gguf_close(g);
    return m;
}

void moe_model_free(moe_model *m) {
    if (!m) return;
    if (m->gguf) moe_gguf_close(m->gguf);
    moe_model_config_free(&m->cfg);
    free(m->layers);
    free(m->path);
    free(m);
}
