/* model: a model file turned into a config and named weights, ready for the forward pass.
 *
 * The config comes from `<arch>.*` metadata keys; each architecture's binder looks up its
 * tensors by name and checks every shape against the config, so a broken file fails at load
 * with the tensor's name instead of producing garbage later. Weights stay in the mapped file
 * (never copied, never dequantized here). The trap: GGUF shapes are ggml's ne[] order, so a
 * projection from n_embd to n_out is ne = {n_embd, n_out}: ne[0] is the input (row) length. */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "../format/format.h"

typedef enum moe_arch {
    MOE_ARCH_LLAMA,
    MOE_ARCH_QWEN3MOE,
    MOE_ARCH_DEEPSEEK2,
    MOE_ARCH_GPT_OSS,
    MOE_ARCH_QWEN3NEXT,
    MOE_ARCH_KIMI_LINEAR,
    MOE_ARCH_GLM4MOE,
    MOE_ARCH_COUNT
} moe_arch;

/* How router logits become expert weights (llama.cpp's expert_gating_func numbering). */
typedef enum moe_gating {
    MOE_GATING_SOFTMAX = 1,        /* softmax over all experts, then top-k */
    MOE_GATING_SIGMOID = 2,        /* sigmoid per expert, then top-k (DeepSeek-V3, GLM) */
    MOE_GATING_SOFTMAX_WEIGHT = 3, /* top-k of the logits, softmax over the k (gpt-oss) */
} moe_gating;

/* The gated activation of an FFN: out = act(gate) * up. */
typedef enum moe_ffn_act {
    MOE_ACT_SILU,       /* silu(gate) * up (SwiGLU) */
    MOE_ACT_SWIGLU_OAI, /* gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1) */
} moe_ffn_act;

typedef enum moe_rope_kind {
    MOE_ROPE_NORM, /* rotate adjacent pairs (x[2i], x[2i+1]): llama */
    MOE_ROPE_NEOX, /* rotate halves (x[i], x[i + d/2]): qwen, gpt-neox */
    MOE_ROPE_NONE, /* no rotation; rope_dims only sizes MLA's q_pe / k_pe part (kimi-linear) */
} moe_rope_kind;

/* What mixes tokens in a layer: softmax attention over a KV cache, or a linear-attention
 * recurrence over a fixed-size per-sequence state (hybrid models have both kinds of layer). */
typedef enum moe_mixer {
    MOE_MIXER_ATTENTION,
    MOE_MIXER_GDN, /* Gated DeltaNet: scalar decay per head (Qwen3-Next) */
    MOE_MIXER_KDA, /* Kimi Delta Attention: decay per key channel (Kimi-Linear) */
} moe_mixer;

#define MOE_CONV_MAX_TAPS 16 /* short-conv kernel of linear attention: real models use 4 */

typedef struct moe_model_config {
    moe_arch arch;
    const char *arch_name; /* general.architecture */
    uint32_t n_vocab;      /* rows of token_embd */
    uint32_t n_ctx_train;  /* <arch>.context_length */
    uint32_t n_embd;       /* residual width */
    uint32_t n_layer;
    uint32_t n_layer_nextn; /* trailing NextN/MTP layers in the file, not run */
    uint32_t n_head;        /* query heads */
    uint32_t n_head_kv;     /* key/value heads (GQA: n_head is a multiple of it) */
    uint32_t head_dim_k;    /* <arch>.attention.key_length, default n_embd / n_head */
    uint32_t head_dim_v;    /* <arch>.attention.value_length, default head_dim_k */
    uint32_t n_ff;          /* dense FFN hidden width */
    uint32_t rope_dims;     /* leading dims of each head that rotate (<= head_dim_k) */
    moe_rope_kind rope_kind;
    float rope_base;        /* theta */
    float rope_freq_scale;  /* 1 / scaling factor (linear or YaRN) */
    float rope_ext_factor;  /* YaRN extrapolation mix: 1 with yarn scaling, 0 without */
    float rope_attn_factor; /* cos/sin magnitude handed to rope (llama.cpp's yarn_attn_factor) */
    float rope_beta_fast, rope_beta_slow; /* YaRN correction range, in rotations */
    uint32_t rope_n_ctx_orig;             /* YaRN: rope.scaling.original_context_length */
    float kq_scale; /* attention logit scale (1/sqrt(head_dim_k), or MLA's YaRN mscale^2) */
    uint32_t n_swa; /* attention.sliding_window of the windowed layers (0: none) */
    float rms_eps;
    bool tied_output; /* no output.weight: the head reuses token_embd */
    bool qk_norm;     /* RMSNorm of each q and k head before rope (Qwen3) */
    /* mixture of experts (n_expert == 0: dense) */
    uint32_t n_expert;           /* routed experts per MoE layer */
    uint32_t n_expert_used;      /* experts chosen per token */
    uint32_t n_ff_exp;           /* hidden width of one routed expert */
    uint32_t n_layer_dense_lead; /* leading layers with a dense FFN instead */
    moe_gating gating;
    bool norm_topk;             /* renormalise the chosen experts' weights to sum to 1 */
    float expert_weights_scale; /* routed_scaling_factor (1: none) */
    uint32_t n_expert_group;    /* expert_group_count: grouped top-k (<= 1: off) */
    uint32_t n_group_used;      /* expert_group_used_count: groups kept per token */
    uint32_t n_ff_shexp;        /* shared experts' hidden width, run on every token (0: none):
                                 * expert_shared_feed_forward_length (qwen3next), else
                                 * expert_shared_count x n_ff_exp (DeepSeek, Kimi) */
    moe_ffn_act expert_act;
    bool attn_output_gate; /* attn_q yields [q, gate] per head; out *= sigmoid(gate) */
    /* multi-head latent attention (n_lora_kv == 0: none). The cache row of a position is the
     * latent [n_lora_kv] then the roped key [rope_dims]: head_dim_k = n_lora_kv + rope_dims,
     * head_dim_v = n_lora_kv, one kv head. */
    uint32_t n_lora_q;       /* q down-projection rank (0: a plain attn_q) */
    uint32_t n_lora_kv;      /* latent width cached per position */
    uint32_t head_dim_k_mla; /* per-head q/k width before absorption: nope + rope_dims */
    uint32_t head_dim_v_mla; /* per-head value width after attn_v_b */
    /* linear attention (n_layer_linear == 0: none). q and k have ssm_n_k_heads heads, v has
     * ssm_n_v_heads (a multiple): v head h reads k head h / (n_v / n_k). */
    uint32_t n_layer_linear; /* layers whose mixer is GDN or KDA */
    uint32_t ssm_d_conv;     /* short-conv taps */
    uint32_t ssm_head_dim;   /* key = value width of one linear-attention head */
    uint32_t ssm_n_k_heads;
    uint32_t ssm_n_v_heads;
} moe_model_config;

typedef struct moe_layer_weights {
    moe_mixer mixer;
    const moe_tensor *attn_norm;   /* [n_embd] f32 */
    const moe_tensor *wq;          /* [n_embd] -> [n_head * head_dim_k] */
    const moe_tensor *wk;          /* [n_embd] -> [n_head_kv * head_dim_k] */
    const moe_tensor *wv;          /* [n_embd] -> [n_head_kv * head_dim_v] */
    const moe_tensor *wo;          /* [n_head * head_dim_v] -> [n_embd] */
    const moe_tensor *ffn_norm;    /* [n_embd] f32 */
    const moe_tensor *attn_q_norm; /* [head_dim_k] f32, with qk_norm */
    const moe_tensor *attn_k_norm; /* [head_dim_k] f32, with qk_norm */
    /* dense FFN (NULL in MoE layers) */
    const moe_tensor *ffn_gate; /* [n_embd] -> [n_ff] */
    const moe_tensor *ffn_up;   /* [n_embd] -> [n_ff] */
    const moe_tensor *ffn_down; /* [n_ff] -> [n_embd] */
    /* routed experts (NULL in dense layers) */
    const moe_tensor *ffn_gate_inp;    /* router: [n_embd] -> [n_expert], f32 */
    const moe_tensor *ffn_gate_exps;   /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *ffn_up_exps;     /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *ffn_down_exps;   /* [n_ff_exp] -> [n_embd], x n_expert */
    const moe_tensor *ffn_gate_inp_b;  /* [n_expert] f32 router bias (gpt-oss) */
    const moe_tensor *exp_probs_b;     /* [n_expert] f32 selection-only bias (DeepSeek-V3) */
    const moe_tensor *ffn_gate_exps_b; /* [n_ff_exp] x n_expert f32 (gpt-oss) */
    const moe_tensor *ffn_up_exps_b;   /* [n_ff_exp] x n_expert f32 */
    const moe_tensor *ffn_down_exps_b; /* [n_embd] x n_expert f32 */
    /* shared experts beside the routed ones (NULL: none), one SwiGLU n_ff_shexp wide */
    const moe_tensor *ffn_gate_shexp;     /* [n_embd] -> [n_ff_shexp] */
    const moe_tensor *ffn_up_shexp;       /* [n_embd] -> [n_ff_shexp] */
    const moe_tensor *ffn_down_shexp;     /* [n_ff_shexp] -> [n_embd] */
    const moe_tensor *ffn_gate_inp_shexp; /* [n_embd] f32: out *= sigmoid(w . x), or NULL */
    /* attention biases and sinks (gpt-oss) */
    const moe_tensor *bq, *bk,
        *bv; /* f32 [n_head * head_dim_k], [n_head_kv * head_dim_k], [n_head_kv * head_dim_v] */
    const moe_tensor *bo;         /* f32 [n_embd] */
    const moe_tensor *attn_sinks; /* f32 [n_head]: per-head logit in the softmax denominator */
    uint32_t attn_window;         /* sliding window in positions (0: full attention) */
    /* multi-head latent attention (deepseek2, kimi-linear; wq then holds attn_q when n_lora_q == 0)
     */
    const moe_tensor *wq_a;           /* [n_embd] -> [n_lora_q] */
    const moe_tensor *attn_q_a_norm;  /* [n_lora_q] f32 */
    const moe_tensor *wq_b;           /* [n_lora_q] -> [n_head * head_dim_k_mla] */
    const moe_tensor *wkv_a_mqa;      /* [n_embd] -> [n_lora_kv + rope_dims] */
    const moe_tensor *attn_kv_a_norm; /* [n_lora_kv] f32 */
    const moe_tensor *wk_b;           /* [head_dim_k_mla - rope_dims] -> [n_lora_kv], x n_head */
    const moe_tensor *wv_b;           /* [n_lora_kv] -> [head_dim_v_mla], x n_head */
    /* linear attention (GDN / KDA layers); with K = n_k_heads * head_dim, V = n_v_heads * head_dim
     */
    const moe_tensor *ssm_qkv;       /* GDN attn_qkv: [n_embd] -> [K + K + V] (KDA: wq, wk, wv) */
    const moe_tensor *ssm_conv1d[3]; /* taps [d_conv] per channel of q|k|v: GDN one tensor over
                                      * all K + K + V channels, KDA one each for q, k, v */
    const moe_tensor *ssm_a;         /* f32 [n_v_heads]: -exp(A_log), decay rate per head */
    const moe_tensor *ssm_dt_b;      /* f32 dt bias: GDN [n_v_heads], KDA [V] */
    const moe_tensor *ssm_ba;   /* GDN: [n_embd] -> per k head [beta x r, alpha x r], r = n_v/n_k */
    const moe_tensor *ssm_beta; /* KDA: [n_embd] -> [n_v_heads] */
    const moe_tensor *ssm_f_a, *ssm_f_b; /* KDA decay: [n_embd] -> [head_dim] -> [V] */
    const moe_tensor *ssm_gate;          /* GDN attn_gate z: [n_embd] -> [V] */
    const moe_tensor *ssm_g_a, *ssm_g_b; /* KDA output gate: [n_embd] -> [head_dim] -> [V] */
    const moe_tensor *ssm_norm;          /* f32 [head_dim]: RMSNorm of each head's output */
    const moe_tensor *ssm_out;           /* [V] -> [n_embd] (KDA: attn_output) */
} moe_layer_weights;

typedef struct moe_model {
    moe_gguf *gguf;
    moe_model_config cfg;
    const moe_tensor *token_embd;  /* [n_embd] x n_vocab rows */
    const moe_tensor *output_norm; /* [n_embd] f32 */
    const moe_tensor *output;      /* [n_embd] -> [n_vocab]; token_embd when tied */
    moe_layer_weights *layers;     /* [n_layer] */
    char *path;
} moe_model;

moe_model *moe_model_load(const char *path, moe_error *err);
/* Bind a model from an already opened file; on success the model owns g. */
moe_model *moe_model_from_gguf(moe_gguf *g, const char *path, moe_error *err);
void moe_model_free(moe_model *m);
const char *moe_arch_name(moe_arch arch);

#endif
