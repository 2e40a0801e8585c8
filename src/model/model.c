/* model.c: architecture config from GGUF metadata and binding of named tensors.
 *
 * Every required key and tensor is looked up with a message naming it when absent; every
 * tensor's type and shape is checked against the config before any forward pass may touch it.
 * Binding is by name only (blk.N.attn_q.weight, ...), the names llama.cpp's converters write. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOE_MAX_LAYERS  1024 /* deepest real models have ~100; caps the per-layer allocation */
#define MOE_MAX_WIDTH   (1u << 20) /* widths, heads, vocab: far above any real model */
#define MOE_MAX_EXPERTS 1024       /* routed experts per layer (real: <= 384); routing's tables */

static const char *const arch_names[MOE_ARCH_COUNT] = {
    [MOE_ARCH_LLAMA] = "llama",         [MOE_ARCH_QWEN3MOE] = "qwen3moe",
    [MOE_ARCH_DEEPSEEK2] = "deepseek2", [MOE_ARCH_GPT_OSS] = "gpt-oss",
    [MOE_ARCH_QWEN3NEXT] = "qwen3next", [MOE_ARCH_KIMI_LINEAR] = "kimi-linear",
    [MOE_ARCH_GLM4MOE] = "glm4moe",
};

const char *moe_arch_name(moe_arch arch) {
    return (unsigned)arch < MOE_ARCH_COUNT ? arch_names[arch] : "unknown";
}

/* ==== Metadata ==== */

typedef struct binder {
    moe_model *m;
    const char *path;
    moe_error *err;
    uint32_t *head_kv_layer; /* [n_layer] attention.head_count_kv per layer (an array in hybrids) */
} binder;

static bool key_u32(binder *b, const char *suffix, bool required, uint32_t fallback,
                    uint32_t *out) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", b->m->cfg.arch_name, suffix);
    uint64_t v;
    if (!moe_gguf_get_u64(b->m->gguf, key, &v)) {
        if (required || moe_gguf_find(b->m->gguf, key)) {
            moe_error_set(b->err, MOE_ERR_FORMAT, "%s: %s key '%s'", b->path,
                          moe_gguf_find(b->m->gguf, key) ? "non-integer" : "missing required", key);
            return false;
        }
        *out = fallback;
        return true;
    }
    if (v > MOE_MAX_WIDTH) {
        moe_error_set(b->err, MOE_ERR_RANGE, "%s: key '%s' = %llu is larger than %u", b->path, key,
                      (unsigned long long)v, MOE_MAX_WIDTH);
        return false;
    }
    *out = (uint32_t)v;
    return true;
}

static bool key_f32(binder *b, const char *suffix, bool required, float fallback, float *out) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", b->m->cfg.arch_name, suffix);
    double v;
    if (!moe_gguf_get_f64(b->m->gguf, key, &v)) {
        if (required) {
            moe_error_set(b->err, MOE_ERR_FORMAT, "%s: missing required key '%s'", b->path, key);
            return false;
        }
        *out = fallback;
        return true;
    }
    if (!isfinite(v)) {
        moe_error_set(b->err, MOE_ERR_RANGE, "%s: key '%s' is not finite", b->path, key);
        return false;
    }
    *out = (float)v;
    return true;
}

/* An integer key that may be one value or an array of n values (per layer): out[0..n). */
static bool key_u32_per_layer(binder *b, const char *suffix, uint32_t fallback, uint32_t n,
                              uint32_t *out) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", b->m->cfg.arch_name, suffix);
    const moe_gguf_value *v = moe_gguf_find(b->m->gguf, key);
    if (!v || v->type != MOE_GGUF_ARRAY) {
        if (!key_u32(b, suffix, false, fallback, &out[0])) return false;
        for (uint32_t i = 1; i < n; i++) out[i] = out[0];
        return true;
    }
    const moe_gguf_vtype et = v->arr.elem_type;
    const unsigned size = moe_gguf_vtype_size(et);
    const bool is_signed =
        et == MOE_GGUF_I8 || et == MOE_GGUF_I16 || et == MOE_GGUF_I32 || et == MOE_GGUF_I64;
    if (!size || et == MOE_GGUF_F32 || et == MOE_GGUF_F64 || v->arr.n != n) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: key '%s' must be an integer or %u integers "
                      "(one per layer)",
                      b->path, key, n);
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t u = 0;
        memcpy(&u, (const uint8_t *)v->arr.data + (uint64_t)i * size, size);
        const unsigned bits = 8 * size;
        const bool neg = is_signed && ((u >> (bits - 1)) & 1);
        if (neg || u > MOE_MAX_WIDTH) {
            moe_error_set(b->err, MOE_ERR_RANGE, "%s: key '%s'[%u] is out of range", b->path, key,
                          i);
            return false;
        }
        out[i] = (uint32_t)u;
    }
    return true;
}

/* ==== Tensors ==== */

/* Find `name` and check its shape: ne0 x ne1 x ne2 (ne1 = 0 for a vector, ne2 = 0 for a
 * matrix), and that moe can compute with its type. */
static const moe_tensor *bind3(binder *b, const char *name, int64_t ne0, int64_t ne1, int64_t ne2,
                               bool required) {
    if (b->err->code) return NULL;
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
    return t;
}

static const moe_tensor *bind(binder *b, const char *name, int64_t ne0, int64_t ne1,
                              bool required) {
    return bind3(b, name, ne0, ne1, 0, required);
}

/* blk.<il>.<what>.<suffix> ("weight" or "bias"; NULL: blk.<il>.<what>, as ssm_a), shaped
 * ne0 x ne1 x ne2. */
static const moe_tensor *bind_blk(binder *b, uint32_t il, const char *what, const char *suffix,
                                  int64_t ne0, int64_t ne1, int64_t ne2, bool required) {
    char name[128];
    if (suffix)
        snprintf(name, sizeof name, "blk.%u.%s.%s", il, what, suffix);
    else
        snprintf(name, sizeof name, "blk.%u.%s", il, what);
    return bind3(b, name, ne0, ne1, ne2, required);
}

static const moe_tensor *bind_layer(binder *b, uint32_t il, const char *what, int64_t ne0,
                                    int64_t ne1) {
    return bind_blk(b, il, what, "weight", ne0, ne1, 0, true);
}

/* A vector or bias the forward pass reads as floats directly: it must be F32. */
static const moe_tensor *bind_f32_3(binder *b, uint32_t il, const char *what, const char *suffix,
                                    int64_t ne0, int64_t ne1, int64_t ne2, bool required) {
    const moe_tensor *t = bind_blk(b, il, what, suffix, ne0, ne1, ne2, required);
    if (t && t->type != MOE_TYPE_F32) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED, "%s: tensor '%s' is %s; moe reads it as F32",
                      b->path, t->name.ptr, moe_type_name(t->type));
        return NULL;
    }
    return t;
}

static const moe_tensor *bind_f32(binder *b, uint32_t il, const char *what, const char *suffix,
                                  int64_t ne0, int64_t ne1, bool required) {
    return bind_f32_3(b, il, what, suffix, ne0, ne1, 0, required);
}

/* ==== Transformer family: GQA attention + dense or routed SwiGLU FFN ==== */

/* What distinguishes one architecture of the family from another. */
typedef struct arch_entry {
    moe_arch arch;
    moe_rope_kind rope_kind;
    bool qk_norm;          /* attn_q_norm / attn_k_norm per head */
    bool qk_norm_optional; /* ... bound when the file has them (GLM-4.5: only the 355B) */
    bool experts;          /* routed experts (expert_* keys, *_exps tensors) */
    moe_gating gating;     /* default when <arch>.expert_gating_func is absent */
    bool norm_topk;        /* default when <arch>.expert_weights_norm is absent */
    bool mla;              /* multi-head latent attention instead of attn_q/k/v */
    bool attn_bias;        /* q/k/v/o biases and per-head attn_sinks */
    bool qkv_bias;         /* q/k/v biases only */
    uint32_t swa_pattern;  /* n: layer il is windowed when il % n < n - 1 (llama.cpp's) */
    moe_ffn_act act;       /* the routed experts' activation */
    const char *ffn_norm;  /* name of the FFN's input norm (NULL: ffn_norm) */
    moe_mixer linear;      /* mixer of a hybrid's recurrent layers (ATTENTION: not hybrid) */
    bool attn_output_gate; /* attn_q holds [q, gate] per head */
} arch_entry;

static const arch_entry archs[] = {
    {.arch = MOE_ARCH_LLAMA, .rope_kind = MOE_ROPE_NORM, .gating = MOE_GATING_SOFTMAX},
    {.arch = MOE_ARCH_QWEN3MOE,
     .rope_kind = MOE_ROPE_NEOX,
     .qk_norm = true,
     .experts = true,
     .gating = MOE_GATING_SOFTMAX,
     .norm_topk = true},
    /* sigmoid gating, selection bias and groups come from its keys (older files: softmax) */
    {.arch = MOE_ARCH_DEEPSEEK2,
     .rope_kind = MOE_ROPE_NORM,
     .experts = true,
     .gating = MOE_GATING_SOFTMAX,
     .mla = true},
    {.arch = MOE_ARCH_GPT_OSS,
     .rope_kind = MOE_ROPE_NEOX,
     .experts = true,
     .gating = MOE_GATING_SOFTMAX_WEIGHT,
     .attn_bias = true,
     .swa_pattern = 2,
     .act = MOE_ACT_SWIGLU_OAI,
     .ffn_norm = "post_attention_norm"},
    {.arch = MOE_ARCH_QWEN3NEXT,
     .rope_kind = MOE_ROPE_NEOX,
     .qk_norm = true,
     .experts = true,
     .gating = MOE_GATING_SOFTMAX,
     .norm_topk = true,
     .linear = MOE_MIXER_GDN,
     .attn_output_gate = true,
     .ffn_norm = "post_attention_norm"},
    /* KDA layers (head_count_kv 0) and MLA layers without q LoRA or rope */
    {.arch = MOE_ARCH_KIMI_LINEAR,
     .rope_kind = MOE_ROPE_NONE,
     .experts = true,
     .gating = MOE_GATING_SIGMOID,
     .norm_topk = true,
     .mla = true,
     .linear = MOE_MIXER_KDA},
    /* GLM-4.5/4.6/4.7: DeepSeek-style routing (sigmoid, exp_probs_b, shared expert, dense lead)
     * under GQA attention with q/k/v biases and partial NEOX rope; the trailing NextN (MTP)
     * layers are skipped, as llama.cpp does */
    {.arch = MOE_ARCH_GLM4MOE,
     .rope_kind = MOE_ROPE_NEOX,
     .qk_norm_optional = true,
     .qkv_bias = true,
     .experts = true,
     .gating = MOE_GATING_SIGMOID,
     .ffn_norm = "post_attention_norm"},
};

/* llama.cpp's YaRN magnitude for a scaling factor (llama-context.cpp get_mscale). */
static float yarn_get_mscale(float scale, float mscale) {
    return scale <= 1.0f ? 1.0f : 0.1f * mscale * logf(scale) + 1.0f;
}

/* Rope scaling: none, linear, or YaRN set up as llama.cpp does (llama-context.cpp): ext_factor
 * 1, correction range from beta_fast / beta_slow and the original context, and a magnitude
 * that, with yarn_log_multiplier, cancels the 1 + 0.1 ln(factor) rope applies by itself.
 * MLA (deepseek2) moves that magnitude into the attention scale: mscale^2 / sqrt(q/k width). */
static bool config_rope(binder *b, const arch_entry *a) {
    moe_model_config *c = &b->m->cfg;
    float factor = 1.0f, log_mul = 0.0f, attn_factor = 1.0f;
    if (!key_f32(b, "rope.scaling.factor", false, 1.0f, &factor) ||
        !key_f32(b, "rope.scaling.yarn_beta_fast", false, 32.0f, &c->rope_beta_fast) ||
        !key_f32(b, "rope.scaling.yarn_beta_slow", false, 1.0f, &c->rope_beta_slow) ||
        !key_f32(b, "rope.scaling.yarn_log_multiplier", false, 0.0f, &log_mul) ||
        !key_f32(b, "rope.scaling.attn_factor", false, 1.0f, &attn_factor) ||
        !key_u32(b, "rope.scaling.original_context_length", false, c->n_ctx_train,
                 &c->rope_n_ctx_orig))
        return false;
    char key[256];
    snprintf(key, sizeof key, "%s.rope.scaling.type", c->arch_name);
    const char *scaling = moe_gguf_get_str(b->m->gguf, key);
    const bool linear = scaling && strcmp(scaling, "linear") == 0;
    const bool yarn = scaling && strcmp(scaling, "yarn") == 0;
    if (scaling && strcmp(scaling, "none") != 0 && !linear && !yarn) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED,
                      "%s: rope scaling type '%s' is not supported yet", b->path, scaling);
        return false;
    }
    c->rope_freq_scale = (linear || yarn) && factor > 0 ? 1.0f / factor : 1.0f;
    c->rope_ext_factor = yarn ? 1.0f : 0.0f;
    /* deepseek2's converter writes 0.1 * mscale_all_dim; llama.cpp divides it back out */
    if (a->mla) log_mul /= 0.1f;
    float yarn_attn = 1.0f;
    if (yarn) {
        const float f = 1.0f / c->rope_freq_scale;
        if (log_mul != 0.0f) {
            const float mscale = a->mla && log_mul != 1.0f ? log_mul : 1.0f;
            yarn_attn = yarn_get_mscale(f, mscale) / yarn_get_mscale(f, log_mul);
        } else {
            yarn_attn = yarn_get_mscale(f, 1.0f);
        }
        yarn_attn *= 1.0f / (1.0f + 0.1f * logf(f));
    }
    c->rope_attn_factor = yarn_attn * attn_factor;
    c->kq_scale = 1.0f / sqrtf((float)c->head_dim_k);
    if (a->mla) {
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
static bool config_mla(binder *b) {
    moe_model_config *c = &b->m->cfg;
    /* value_length defaults to the latent width here (kimi-linear's converter omits it) */
    if (!key_u32(b, "attention.q_lora_rank", false, 0, &c->n_lora_q) ||
        !key_u32(b, "attention.kv_lora_rank", true, 0, &c->n_lora_kv) ||
        !key_u32(b, "attention.value_length", false, c->n_lora_kv, &c->head_dim_v) ||
        !key_u32(b, "attention.key_length_mla", false, c->head_dim_k, &c->head_dim_k_mla) ||
        !key_u32(b, "attention.value_length_mla", false, c->head_dim_v, &c->head_dim_v_mla))
        return false;
    if (c->n_head_kv != 1 || c->head_dim_k != c->n_lora_kv + c->rope_dims ||
        c->head_dim_v != c->n_lora_kv) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED,
                      "%s: MLA stored as multi-head K/V (attn_kv_b; key_length %u, value_length "
                      "%u, head_count_kv %u): moe runs the latent layout (attn_k_b / attn_v_b, "
                      "key_length = kv_lora_rank + rope dims = %u); re-convert the model with a "
                      "current llama.cpp convert_hf_to_gguf.py",
                      b->path, c->head_dim_k, c->head_dim_v, c->n_head_kv,
                      c->n_lora_kv + c->rope_dims);
        return false;
    }
    if (c->n_lora_kv == 0 || c->head_dim_k_mla <= c->rope_dims || c->head_dim_v_mla == 0) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: MLA widths kv_lora_rank %u, key_length_mla %u "
                      "(rope %u), value_length_mla %u are inconsistent",
                      b->path, c->n_lora_kv, c->head_dim_k_mla, c->rope_dims, c->head_dim_v_mla);
        return false;
    }
    return true;
}

static bool config_transformer(binder *b, const arch_entry *a) {
    moe_model_config *c = &b->m->cfg;
    if (!key_u32(b, "embedding_length", true, 0, &c->n_embd) ||
        !key_u32(b, "block_count", true, 0, &c->n_layer) ||
        !key_u32(b, "nextn_predict_layers", false, 0, &c->n_layer_nextn) ||
        !key_u32(b, "feed_forward_length", !a->experts, 0, &c->n_ff) ||
        !key_u32(b, "attention.head_count", true, 0, &c->n_head) ||
        !key_u32(b, "context_length", false, 4096, &c->n_ctx_train))
        return false;
    if (c->n_head == 0 || c->n_embd == 0 || c->n_layer == 0) {
        moe_error_set(b->err, MOE_ERR_RANGE,
                      "%s: %s.embedding_length, block_count and "
                      "attention.head_count must be positive",
                      b->path, c->arch_name);
        return false;
    }
    if (c->n_layer_nextn >= c->n_layer) {
        moe_error_set(b->err, MOE_ERR_RANGE,
                      "%s: %s.nextn_predict_layers = %u leaves no layers of "
                      "%u",
                      b->path, c->arch_name, c->n_layer_nextn, c->n_layer);
        return false;
    }
    c->n_layer -= c->n_layer_nextn; /* the MTP layers at the end predict drafts: not run */
    if (c->n_layer > MOE_MAX_LAYERS) {
        moe_error_set(b->err, MOE_ERR_RANGE, "%s: %s.block_count = %u exceeds %u", b->path,
                      c->arch_name, c->n_layer, MOE_MAX_LAYERS);
        return false;
    }
    b->head_kv_layer = moe_xcalloc(c->n_layer, sizeof *b->head_kv_layer);
    if (!key_u32_per_layer(b, "attention.head_count_kv", c->n_head, c->n_layer, b->head_kv_layer))
        return false;
    c->n_head_kv = 0; /* a hybrid's recurrent layers may say 0: the attention layers' count */
    for (uint32_t il = 0; il < c->n_layer; il++)
        if (b->head_kv_layer[il] > c->n_head_kv) c->n_head_kv = b->head_kv_layer[il];
    if (!key_u32(b, "attention.key_length", false, c->n_embd / c->n_head, &c->head_dim_k) ||
        !key_u32(b, "attention.value_length", false, c->head_dim_k, &c->head_dim_v) ||
        !key_u32(b, "rope.dimension_count", false, c->head_dim_k, &c->rope_dims) ||
        !key_f32(b, "rope.freq_base", false, 10000.0f, &c->rope_base) ||
        !key_f32(b, "attention.layer_norm_rms_epsilon", true, 0, &c->rms_eps) ||
        !key_u32(b, "attention.sliding_window", false, 0, &c->n_swa))
        return false;
    c->rope_kind = a->rope_kind;
    c->qk_norm = a->qk_norm;
    if (c->n_head_kv == 0 || c->n_head % c->n_head_kv != 0) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: head_count %u is not a multiple of head_count_kv %u", b->path, c->n_head,
                      c->n_head_kv);
        return false;
    }
    if (c->head_dim_k == 0 || c->rope_dims > c->head_dim_k || c->rope_dims % 2) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: rope.dimension_count %u must be even and at "
                      "most the head dimension %u",
                      b->path, c->rope_dims, c->head_dim_k);
        return false;
    }
    if ((a->mla && !config_mla(b)) || !config_rope(b, a)) return false;
    if (!a->experts) return true;

    uint32_t gating = a->gating;
    bool norm = a->norm_topk;
    char norm_key[256];
    snprintf(norm_key, sizeof norm_key, "%s.expert_weights_norm", c->arch_name);
    if (moe_gguf_find(b->m->gguf, norm_key) && !moe_gguf_get_bool(b->m->gguf, norm_key, &norm)) {
        moe_error_set(b->err, MOE_ERR_FORMAT, "%s: key '%s' is not a bool", b->path, norm_key);
        return false;
    }
    c->norm_topk = norm;
    if (!key_u32(b, "expert_count", true, 0, &c->n_expert) ||
        !key_u32(b, "expert_used_count", true, 0, &c->n_expert_used) ||
        !key_u32(b, "expert_feed_forward_length", true, 0, &c->n_ff_exp) ||
        !key_u32(b, "leading_dense_block_count", false, 0, &c->n_layer_dense_lead) ||
        !key_u32(b, "expert_gating_func", false, gating, &gating) ||
        !key_f32(b, "expert_weights_scale", false, 1.0f, &c->expert_weights_scale) ||
        !key_u32(b, "expert_group_count", false, 0, &c->n_expert_group) ||
        !key_u32(b, "expert_group_used_count", false, 0, &c->n_group_used))
        return false;
    c->expert_act = a->act;
    if (c->n_expert == 0 || c->n_expert > MOE_MAX_EXPERTS || c->n_expert_used == 0 ||
        c->n_expert_used > c->n_expert || c->n_ff_exp == 0) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: %s.expert_count %u / expert_used_count %u / "
                      "expert_feed_forward_length %u are inconsistent",
                      b->path, c->arch_name, c->n_expert, c->n_expert_used, c->n_ff_exp);
        return false;
    }
    if (gating != MOE_GATING_SOFTMAX && gating != MOE_GATING_SIGMOID &&
        gating != MOE_GATING_SOFTMAX_WEIGHT) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED, "%s: %s.expert_gating_func = %u is unknown",
                      b->path, c->arch_name, gating);
        return false;
    }
    c->gating = (moe_gating)gating;
    if (c->n_expert_group > 1 &&
        (c->n_expert_group > 256 || c->n_expert % c->n_expert_group != 0 || c->n_group_used == 0 ||
         c->n_group_used > c->n_expert_group ||
         c->n_group_used * (c->n_expert / c->n_expert_group) < c->n_expert_used)) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: %s.expert_group_count %u / "
                      "expert_group_used_count %u do not fit %u experts, %u used per token",
                      b->path, c->arch_name, c->n_expert_group, c->n_group_used, c->n_expert,
                      c->n_expert_used);
        return false;
    }
    if (c->n_layer_dense_lead > c->n_layer) c->n_layer_dense_lead = c->n_layer;
    /* shared experts: their own width (qwen3next) or n_shared routed-expert widths (DeepSeek) */
    uint32_t n_shared = 0;
    if (!key_u32(b, "expert_shared_feed_forward_length", false, 0, &c->n_ff_shexp) ||
        !key_u32(b, "expert_shared_count", false, 0, &n_shared))
        return false;
    if (!c->n_ff_shexp) {
        const uint64_t ff = (uint64_t)n_shared * c->n_ff_exp;
        if (ff > MOE_MAX_WIDTH) {
            moe_error_set(b->err, MOE_ERR_RANGE,
                          "%s: %s.expert_shared_count %u x "
                          "expert_feed_forward_length %u exceeds %u",
                          b->path, c->arch_name, n_shared, c->n_ff_exp, MOE_MAX_WIDTH);
            return false;
        }
        c->n_ff_shexp = (uint32_t)ff;
    }
    return true;
}

/* ==== Hybrids: which layers are linear attention, and its widths ==== */

static bool config_linear(binder *b, const arch_entry *a) {
    moe_model *m = b->m;
    moe_model_config *c = &m->cfg;
    c->attn_output_gate = a->attn_output_gate;
    if (c->attn_output_gate && c->head_dim_k != c->head_dim_v) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: an attention output gate needs key_length %u "
                      "= value_length %u",
                      b->path, c->head_dim_k, c->head_dim_v);
        return false;
    }
    m->layers = moe_xcalloc(c->n_layer, sizeof *m->layers);
    if (a->linear == MOE_MIXER_ATTENTION) return true;
    uint32_t interval = 0;
    if (a->linear == MOE_MIXER_GDN) {
        /* every interval-th layer is full attention, the others Gated DeltaNet */
        uint32_t inner = 0;
        if (!key_u32(b, "full_attention_interval", false, 4, &interval) ||
            !key_u32(b, "ssm.conv_kernel", true, 0, &c->ssm_d_conv) ||
            !key_u32(b, "ssm.state_size", true, 0, &c->ssm_head_dim) ||
            !key_u32(b, "ssm.group_count", true, 0, &c->ssm_n_k_heads) ||
            !key_u32(b, "ssm.time_step_rank", true, 0, &c->ssm_n_v_heads) ||
            !key_u32(b, "ssm.inner_size", true, 0, &inner))
            return false;
        if (interval == 0 || (uint64_t)c->ssm_n_v_heads * c->ssm_head_dim != inner) {
            moe_error_set(b->err, MOE_ERR_FORMAT,
                          "%s: %s.full_attention_interval %u must be "
                          "positive and ssm.inner_size %u = time_step_rank %u x state_size %u",
                          b->path, c->arch_name, interval, inner, c->ssm_n_v_heads,
                          c->ssm_head_dim);
            return false;
        }
    } else {
        /* KDA layers are those with no KV heads; q, k and v all have n_head heads */
        if (!key_u32(b, "ssm.conv_kernel", true, 0, &c->ssm_d_conv) ||
            !key_u32(b, "kda.head_dim", true, 0, &c->ssm_head_dim))
            return false;
        c->ssm_n_k_heads = c->ssm_n_v_heads = c->n_head;
    }
    if (c->ssm_d_conv == 0 || c->ssm_d_conv > MOE_CONV_MAX_TAPS || c->ssm_head_dim == 0 ||
        c->ssm_n_k_heads == 0 || c->ssm_n_v_heads % c->ssm_n_k_heads != 0) {
        moe_error_set(b->err, MOE_ERR_FORMAT,
                      "%s: linear attention: conv kernel %u (1..%u), "
                      "head dim %u, %u k heads and %u v heads (a multiple) are inconsistent",
                      b->path, c->ssm_d_conv, MOE_CONV_MAX_TAPS, c->ssm_head_dim, c->ssm_n_k_heads,
                      c->ssm_n_v_heads);
        return false;
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const bool linear = interval ? (il + 1) % interval != 0 : b->head_kv_layer[il] == 0;
        m->layers[il].mixer = linear ? a->linear : MOE_MIXER_ATTENTION;
        c->n_layer_linear += linear;
    }
    return true;
}

static void bind_linear(binder *b, uint32_t il, moe_layer_weights *l) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t hd = c->ssm_head_dim, nv = c->ssm_n_v_heads, d = c->ssm_d_conv;
    const int64_t K = c->ssm_n_k_heads * hd, V = nv * hd;
    if (l->mixer == MOE_MIXER_GDN) {
        l->ssm_qkv = bind_layer(b, il, "attn_qkv", c->n_embd, 2 * K + V);
        l->ssm_gate = bind_layer(b, il, "attn_gate", c->n_embd, V);
        l->ssm_conv1d[0] = bind_f32(b, il, "ssm_conv1d", "weight", d, 2 * K + V, true);
        l->ssm_a = bind_f32(b, il, "ssm_a", NULL, nv, 0, true);
        l->ssm_dt_b = bind_f32(b, il, "ssm_dt", "bias", nv, 0, true);
        l->ssm_ba = bind_layer(b, il, "ssm_ba", c->n_embd, 2 * nv);
        l->ssm_out = bind_layer(b, il, "ssm_out", V, c->n_embd);
    } else { /* KDA */
        l->wq = bind_layer(b, il, "attn_q", c->n_embd, K);
        l->wk = bind_layer(b, il, "attn_k", c->n_embd, K);
        l->wv = bind_layer(b, il, "attn_v", c->n_embd, V);
        l->ssm_conv1d[0] = bind_f32_3(b, il, "ssm_conv1d_q", "weight", d, 1, K, true);
        l->ssm_conv1d[1] = bind_f32_3(b, il, "ssm_conv1d_k", "weight", d, 1, K, true);
        l->ssm_conv1d[2] = bind_f32_3(b, il, "ssm_conv1d_v", "weight", d, 1, V, true);
        l->ssm_a = bind_f32(b, il, "ssm_a", NULL, 1, nv, true);
        l->ssm_dt_b = bind_f32(b, il, "ssm_dt", "bias", V, 0, true);
        l->ssm_beta = bind_layer(b, il, "ssm_beta", c->n_embd, nv);
        l->ssm_f_a = bind_layer(b, il, "ssm_f_a", c->n_embd, hd);
        l->ssm_f_b = bind_layer(b, il, "ssm_f_b", hd, V);
        l->ssm_g_a = bind_layer(b, il, "ssm_g_a", c->n_embd, hd);
        l->ssm_g_b = bind_layer(b, il, "ssm_g_b", hd, V);
        l->ssm_out = bind_layer(b, il, "attn_output", V, c->n_embd);
    }
    l->ssm_norm = bind_f32(b, il, "ssm_norm", "weight", hd, 0, true);
}

static const moe_tensor *bind_layer3(binder *b, uint32_t il, const char *what, int64_t ne0,
                                     int64_t ne1, int64_t ne2) {
    return bind_blk(b, il, what, "weight", ne0, ne1, ne2, true);
}

/* Grouped-query attention: attn_q/k/v/output, optional QK-norm, biases and sinks. */
static void bind_attention_gqa(binder *b, const arch_entry *a, uint32_t il, moe_layer_weights *l) {
    const moe_model_config *c = &b->m->cfg;
    int64_t q = (int64_t)c->n_head * c->head_dim_k, k = (int64_t)c->n_head_kv * c->head_dim_k;
    int64_t v = (int64_t)c->n_head_kv * c->head_dim_v, o = (int64_t)c->n_head * c->head_dim_v;
    l->wq = bind_layer(b, il, "attn_q", c->n_embd, a->attn_output_gate ? 2 * q : q);
    l->wk = bind_layer(b, il, "attn_k", c->n_embd, k);
    l->wv = bind_layer(b, il, "attn_v", c->n_embd, v);
    l->wo = bind_layer(b, il, "attn_output", o, c->n_embd);
    if (a->qk_norm || a->qk_norm_optional) {
        l->attn_q_norm = bind_blk(b, il, "attn_q_norm", "weight", c->head_dim_k, 0, 0, a->qk_norm);
        l->attn_k_norm = bind_blk(b, il, "attn_k_norm", "weight", c->head_dim_k, 0, 0, a->qk_norm);
        if (!l->attn_q_norm != !l->attn_k_norm && !b->err->code)
            moe_error_set(b->err, MOE_ERR_FORMAT,
                          "%s: layer %u has only one of attn_q_norm and "
                          "attn_k_norm",
                          b->path, il);
    }
    if (a->attn_bias || a->qkv_bias) {
        l->bq = bind_f32(b, il, "attn_q", "bias", q, 0, true);
        l->bk = bind_f32(b, il, "attn_k", "bias", k, 0, true);
        l->bv = bind_f32(b, il, "attn_v", "bias", v, 0, true);
    }
    if (a->attn_bias) {
        l->bo = bind_f32(b, il, "attn_output", "bias", c->n_embd, 0, true);
        l->attn_sinks = bind_f32(b, il, "attn_sinks", "weight", c->n_head, 0, true);
    }
    if (a->swa_pattern && il % a->swa_pattern < a->swa_pattern - 1) l->attn_window = c->n_swa;
}

/* Multi-head latent attention: q through a LoRA (or a plain attn_q), the kv latent and the
 * shared roped key from attn_kv_a_mqa, and the per-head attn_k_b / attn_v_b that absorb
 * into the query and decompress the attended latent. */
static void bind_attention_mla(binder *b, uint32_t il, moe_layer_weights *l) {
    const moe_model_config *c = &b->m->cfg;
    const int64_t q = (int64_t)c->n_head * c->head_dim_k_mla;
    const int64_t nope = c->head_dim_k_mla - c->rope_dims;
    char name[128];
    snprintf(name, sizeof name, "blk.%u.attn_kv_b.weight", il);
    if (moe_gguf_tensor_find(b->m->gguf, name) && !b->err->code) {
        moe_error_set(b->err, MOE_ERR_UNSUPPORTED,
                      "%s: '%s' is the older MLA layout; moe needs "
                      "attn_k_b / attn_v_b (re-convert with a current llama.cpp)",
                      b->path, name);
        return;
    }
    if (c->n_lora_q) {
        l->wq_a = bind_layer(b, il, "attn_q_a", c->n_embd, c->n_lora_q);
        l->attn_q_a_norm = bind_f32(b, il, "attn_q_a_norm", "weight", c->n_lora_q, 0, true);
        l->wq_b = bind_layer(b, il, "attn_q_b", c->n_lora_q, q);
    } else {
        l->wq = bind_layer(b, il, "attn_q", c->n_embd, q);
    }
    l->wkv_a_mqa = bind_layer(b, il, "attn_kv_a_mqa", c->n_embd, c->n_lora_kv + c->rope_dims);
    l->attn_kv_a_norm = bind_f32(b, il, "attn_kv_a_norm", "weight", c->n_lora_kv, 0, true);
    l->wk_b = bind_layer3(b, il, "attn_k_b", nope, c->n_lora_kv, c->n_head);
    l->wv_b = bind_layer3(b, il, "attn_v_b", c->n_lora_kv, c->head_dim_v_mla, c->n_head);
    l->wo = bind_layer(b, il, "attn_output", (int64_t)c->n_head * c->head_dim_v_mla, c->n_embd);
}

/* Router, routed experts (with their biases where the file has them) and shared experts. */
static void bind_experts(binder *b, uint32_t il, moe_layer_weights *l) {
    const moe_model_config *c = &b->m->cfg;
    l->ffn_gate_inp = bind_layer(b, il, "ffn_gate_inp", c->n_embd, c->n_expert);
    l->ffn_gate_exps = bind_layer3(b, il, "ffn_gate_exps", c->n_embd, c->n_ff_exp, c->n_expert);
    l->ffn_up_exps = bind_layer3(b, il, "ffn_up_exps", c->n_embd, c->n_ff_exp, c->n_expert);
    l->ffn_down_exps = bind_layer3(b, il, "ffn_down_exps", c->n_ff_exp, c->n_embd, c->n_expert);
    l->ffn_gate_inp_b = bind_f32(b, il, "ffn_gate_inp", "bias", c->n_expert, 0, false);
    l->exp_probs_b = bind_f32(b, il, "exp_probs_b", "bias", c->n_expert, 0, false);
    l->ffn_gate_exps_b = bind_f32(b, il, "ffn_gate_exps", "bias", c->n_ff_exp, c->n_expert, false);
    l->ffn_up_exps_b = bind_f32(b, il, "ffn_up_exps", "bias", c->n_ff_exp, c->n_expert, false);
    l->ffn_down_exps_b = bind_f32(b, il, "ffn_down_exps", "bias", c->n_embd, c->n_expert, false);
    if (c->n_ff_shexp) {
        const int64_t ff = c->n_ff_shexp;
        l->ffn_gate_shexp = bind_layer(b, il, "ffn_gate_shexp", c->n_embd, ff);
        l->ffn_up_shexp = bind_layer(b, il, "ffn_up_shexp", c->n_embd, ff);
        l->ffn_down_shexp = bind_layer(b, il, "ffn_down_shexp", ff, c->n_embd);
        l->ffn_gate_inp_shexp =
            bind_f32(b, il, "ffn_gate_inp_shexp", "weight", c->n_embd, 0, false);
    }
}

static bool bind_transformer(binder *b, const arch_entry *a) {
    moe_model *m = b->m;
    moe_model_config *c = &m->cfg;
    const moe_tensor *embd = moe_gguf_tensor_find(m->gguf, "token_embd.weight");
    if (!embd) {
        moe_error_set(b->err, MOE_ERR_NOT_FOUND, "%s: missing tensor 'token_embd.weight'", b->path);
        return false;
    }
    if (embd->ne[1] <= 0 || embd->ne[1] > MOE_MAX_WIDTH) {
        moe_error_set(b->err, MOE_ERR_RANGE, "%s: token_embd.weight has %lld rows", b->path,
                      (long long)embd->ne[1]);
        return false;
    }
    c->n_vocab = (uint32_t)embd->ne[1];
    m->token_embd = bind(b, "token_embd.weight", c->n_embd, c->n_vocab, true);
    m->output_norm = bind(b, "output_norm.weight", c->n_embd, 0, true);
    m->output = bind(b, "output.weight", c->n_embd, c->n_vocab, false);
    c->tied_output = !m->output;
    if (!m->output) m->output = m->token_embd;
    for (uint32_t il = 0; il < c->n_layer && !b->err->code; il++) {
        moe_layer_weights *l = &m->layers[il];
        l->attn_norm = bind_layer(b, il, "attn_norm", c->n_embd, 0);
        if (l->mixer != MOE_MIXER_ATTENTION)
            bind_linear(b, il, l);
        else if (a->mla)
            bind_attention_mla(b, il, l);
        else
            bind_attention_gqa(b, a, il, l);
        l->ffn_norm = bind_layer(b, il, a->ffn_norm ? a->ffn_norm : "ffn_norm", c->n_embd, 0);
        if (a->experts && il >= c->n_layer_dense_lead) {
            bind_experts(b, il, l);
        } else {
            l->ffn_gate = bind_layer(b, il, "ffn_gate", c->n_embd, c->n_ff);
            l->ffn_up = bind_layer(b, il, "ffn_up", c->n_embd, c->n_ff);
            l->ffn_down = bind_layer(b, il, "ffn_down", c->n_ff, c->n_embd);
        }
    }
    return !b->err->code;
}

/* ==== Loading ==== */

moe_model *moe_model_from_gguf(moe_gguf *g, const char *path, moe_error *err) {
    const char *arch = moe_gguf_get_str(g, "general.architecture");
    if (!arch) {
        moe_error_set(err, MOE_ERR_FORMAT, "%s: missing key 'general.architecture'", path);
        return NULL;
    }
    const arch_entry *entry = NULL;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (strcmp(arch_names[archs[i].arch], arch) == 0) entry = &archs[i];
    if (!entry) {
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "%s: unknown architecture '%s' (moe supports:", path, arch);
        size_t used = strlen(err->msg);
        for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
            used += (size_t)snprintf(err->msg + used, sizeof err->msg - used, " %s",
                                     arch_names[archs[i].arch]);
        if (used < sizeof err->msg - 1) snprintf(err->msg + used, sizeof err->msg - used, ")");
        return NULL;
    }
    moe_model *m = moe_xcalloc(1, sizeof *m);
    m->gguf = g;
    m->path = moe_xstrdup(path);
    m->cfg.arch = entry->arch;
    m->cfg.arch_name = arch_names[entry->arch];
    binder b = {.m = m, .path = path, .err = err};
    const bool ok =
        config_transformer(&b, entry) && config_linear(&b, entry) && bind_transformer(&b, entry);
    free(b.head_kv_layer);
    if (!ok) {
        m->gguf = NULL; /* the caller keeps the file on failure */
        moe_model_free(m);
        return NULL;
    }
    return m;
}

moe_model *moe_model_load(const char *path, moe_error *err) {
    moe_gguf *g = moe_gguf_open(path, err);
    if (!g) return NULL;
    moe_model *m = moe_model_from_gguf(g, path, err);
    if (!m) moe_gguf_close(g);
    return m;
}

void moe_model_free(moe_model *m) {
    if (!m) return;
    if (m->gguf) moe_gguf_close(m->gguf);
    free(m->layers);
    free(m->path);
    free(m);
}
