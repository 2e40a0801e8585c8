/* model_internal.h: what the architecture files share -- the metadata reader, the tensor binder,
 * and the config readers and binders of the layer kinds several architectures have.
 *
 * Not a public header: only the files of src/model include it. An architecture file reads its
 * config with the moe_config_* steps it needs (each names the key it found wrong), fills the plan,
 * and binds a layer with the moe_bind_* helpers of the kinds its plan says. Every helper keeps the
 * first error and does nothing after one, so a binder runs straight through and is checked once at
 * the end. */
#ifndef MOE_MODEL_INTERNAL_H
#define MOE_MODEL_INTERNAL_H

#include "model.h"

/* Reads `<arch>.<suffix>` keys of one file; errors name the file and the key. */
struct moe_meta {
    const moe_gguf *g;
    const char *path;
    const char *arch;
    moe_error *err;
};

/* Looks up and shape-checks tensors of one model; or, declaring (no file), reports each
 * tensor it would look up and goes on as if the file had the ones the callback takes. */
struct moe_binder {
    moe_model *m;
    const char *path;
    moe_error *err;
    bool (*declare)(void *ctx, const moe_tensor_decl *d); /* NULL: bind from m->gguf */
    void *declare_ctx;
};

/* ==== Metadata ==== */

bool moe_meta_u32(moe_meta *r, const char *suffix, bool required, uint32_t fallback, uint32_t *out);
bool moe_meta_f32(moe_meta *r, const char *suffix, bool required, float fallback, float *out);
bool moe_meta_bool(moe_meta *r, const char *suffix, bool fallback, bool *out);
/* An integer key that may be one value or an array of n values (per layer): out[0..n). */
bool moe_meta_u32_per_layer(moe_meta *r, const char *suffix, uint32_t fallback, uint32_t n,
                            uint32_t *out);
/* A float key that may be one value or an array of n values (per layer). */
bool moe_meta_f32_per_layer(moe_meta *r, const char *suffix, float fallback, uint32_t n,
                            float *out);
/* Set a format error naming the file; returns false. */
bool moe_meta_fail(moe_meta *r, moe_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ==== Config steps ==== */

/* Widths shared by every transformer: embedding, layers (less trailing NextN layers), heads
 * (head_count_kv per layer into the plan), head dims, rope dims and base, norm epsilon, sliding
 * window; c->layer allocated, every layer planned as attention + dense FFN. feed_forward_length
 * is required when ff_required. */
bool moe_config_transformer(moe_meta *r, moe_model_config *c, moe_rope_kind rope, bool ff_required);
/* Rope scaling (none, linear, YaRN) and the attention scale; mla: DeepSeek's YaRN magnitude
 * in the attention scale (call after moe_config_mla). */
bool moe_config_rope(moe_meta *r, moe_model_config *c, bool mla);
/* MLA widths (the latent layout: attn_k_b / attn_v_b); call before moe_config_rope. */
bool moe_config_mla(moe_meta *r, moe_model_config *c);
/* Routed experts: counts, widths, gating (default when the file has no expert_gating_func),
 * groups, shared experts; plans the layers after leading_dense_block_count as experts.
 * width_key names the expert width's key (expert_feed_forward_length, or the FFN's). */
bool moe_config_experts(moe_meta *r, moe_model_config *c, moe_gating gating, bool norm_topk,
                        moe_ffn_act act, const char *width_key);
/* Linear-attention widths (GDN: ssm.* keys; KDA: kda.head_dim with n_head heads) and checks. */
bool moe_config_gdn(moe_meta *r, moe_model_config *c);
bool moe_config_kda(moe_meta *r, moe_model_config *c);
/* Multi-section rope (Qwen3.5): rope.dimension_sections, when present, must be 4 sections
 * covering exactly the rotated dims (text puts one position in all of them). */
bool moe_config_rope_sections(moe_meta *r, const moe_model_config *c);
/* Hyper-connections: hyper_connection.count streams, Sinkhorn iterations and epsilon. */
bool moe_config_hc(moe_meta *r, moe_model_config *c);
/* The lightning indexer of sparse MLA: heads, key width, top_k, pool size (block_size, default
 * 1: one key per token) and the key LayerNorm's epsilon (layer_norm_epsilon, default 0). */
bool moe_config_indexer(moe_meta *r, moe_model_config *c);
/* Layers with a plan: the trunk and the NextN layers after it. */
static inline uint32_t moe_config_n_planned(const moe_model_config *c) {
    return c->n_layer + c->n_layer_nextn;
}
/* The Qwen3-Next family's trunk: every full_attention_interval-th layer (default 4) gated
 * attention (attn_q yields [q, gate] per head), the others Gated DeltaNet (moe_config_gdn);
 * NextN / MTP layers stay attention. */
bool moe_config_gdn_hybrid(moe_meta *r, moe_model_config *c);
/* Plan layer il as mixer (counting the linear ones among the trunk layers). */
void moe_config_plan_mixer(moe_model_config *c, uint32_t il, moe_mixer mixer);

/* ==== Binding ==== */

/* A tensor by its full name (one outside the blk.<il>. layers: rope_freqs.weight), shaped
 * ne0 x ne1 x ne2; f32: read as floats, must be F32. */
const moe_tensor *moe_bind_tensor(moe_binder *b, const char *name, int64_t ne0, int64_t ne1,
                                  int64_t ne2, bool required, bool f32);
/* blk.<il>.<what>.<suffix> shaped ne0 x ne1 x ne2 (0: absent dimension); suffix NULL:
 * blk.<il>.<what> (as ssm_a). A required tensor that is missing is an error. */
const moe_tensor *moe_bind_blk(moe_binder *b, uint32_t il, const char *what, const char *suffix,
                               int64_t ne0, int64_t ne1, int64_t ne2, bool required);
/* A required blk.<il>.<what>.weight matrix [ne0] -> [ne1]. */
const moe_tensor *moe_bind_matrix(moe_binder *b, uint32_t il, const char *what, int64_t ne0,
                                  int64_t ne1);
/* A vector or bias the forward pass reads as floats directly: it must be F32. */
const moe_tensor *moe_bind_f32(moe_binder *b, uint32_t il, const char *what, const char *suffix,
                               int64_t ne0, int64_t ne1, int64_t ne2, bool required);
/* blk.<il>.<what>.weight [n_embd] f32: an input norm. */
const moe_tensor *moe_bind_norm(moe_binder *b, uint32_t il, const char *what);
/* A NextN layer's own tensors (eh_proj, enorm, hnorm). */
void moe_bind_nextn(moe_binder *b, uint32_t il, moe_nextn_weights *w);

/* Grouped-query attention and its options. */
typedef struct moe_gqa_opts {
    bool qk_norm;          /* attn_q_norm / attn_k_norm required */
    bool qk_norm_optional; /* ... bound when the file has them (GLM-4.5: only the 355B) */
    bool qkv_bias;         /* attn_q/k/v biases */
    bool out_bias_sinks;   /* attn_output bias and attn_sinks (gpt-oss) */
    bool v_optional;       /* no attn_v: V is the raw K projection (Gemma 4's full layers) */
} moe_gqa_opts;
void moe_bind_gqa(moe_binder *b, uint32_t il, const moe_gqa_opts *o, moe_attn_weights *w);
void moe_bind_mla(moe_binder *b, uint32_t il, moe_mla_weights *w);
/* Gated DeltaNet; ba: beta and alpha from one interleaved ssm_ba (Qwen3-Next), else from
 * ssm_beta and ssm_alpha (Qwen3.5/3.8). */
void moe_bind_gdn(moe_binder *b, uint32_t il, bool ba, moe_linear_weights *w);
/* Kimi Delta Attention; a_flat: ssm_a stored [n_head] (GLM-5.3), else [1, n_head] (Kimi). */
void moe_bind_kda(moe_binder *b, uint32_t il, bool a_flat, moe_linear_weights *w);
/* The lightning indexer's tensors of an indexed MLA layer. */
void moe_bind_indexer(moe_binder *b, uint32_t il, moe_mla_weights *w);
/* A Qwen3.5 layer (GDN or gated attention, post_attention_norm, the plan's FFN, NextN tensors
 * after the trunk): qwen35 and qwen35moe bind alike. */
void moe_bind_qwen35_layer(moe_binder *b, uint32_t il, moe_layer_weights *l);
/* hc_<site>_fn / _base / _scale: one site's hyper-connection mixer (site "attn" or "ffn"). */
void moe_bind_hc(moe_binder *b, uint32_t il, const char *site, moe_hc_weights *w);
/* blk.<il>.ffn_{gate,up,down}<suffix>.weight, width wide (suffix "" or "_shexp"). */
void moe_bind_gated_ffn(moe_binder *b, uint32_t il, const char *suffix, int64_t width,
                        moe_ffn_weights *w);
/* The FFN the plan says: ffn_gate/up/down n_ff wide, or the router, routed and shared experts. */
void moe_bind_ffn(moe_binder *b, uint32_t il, moe_layer_weights *l);

#endif
