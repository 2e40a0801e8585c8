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
    MOE_ARCH_COUNT
} moe_arch;

/* How router logits become expert weights (llama.cpp's expert_gating_func numbering). */
typedef enum moe_gating {
    MOE_GATING_SOFTMAX = 1,        /* softmax over all experts, then top-k */
    MOE_GATING_SIGMOID = 2,        /* sigmoid per expert, then top-k (DeepSeek-V3, GLM) */
    MOE_GATING_SOFTMAX_WEIGHT = 3, /* top-k of the logits, softmax over the k (gpt-oss) */
} moe_gating;

typedef enum moe_rope_kind {
    MOE_ROPE_NORM, /* rotate adjacent pairs (x[2i], x[2i+1]): llama */
    MOE_ROPE_NEOX, /* rotate halves (x[i], x[i + d/2]): qwen, gpt-neox */
} moe_rope_kind;

typedef struct moe_model_config {
    moe_arch arch;
    const char *arch_name;  /* general.architecture */
    uint32_t n_vocab;       /* rows of token_embd */
    uint32_t n_ctx_train;   /* <arch>.context_length */
    uint32_t n_embd;        /* residual width */
    uint32_t n_layer;
    uint32_t n_head;        /* query heads */
    uint32_t n_head_kv;     /* key/value heads (GQA: n_head is a multiple of it) */
    uint32_t head_dim_k;    /* <arch>.attention.key_length, default n_embd / n_head */
    uint32_t head_dim_v;    /* <arch>.attention.value_length, default head_dim_k */
    uint32_t n_ff;          /* dense FFN hidden width */
    uint32_t rope_dims;     /* leading dims of each head that rotate (<= head_dim_k) */
    moe_rope_kind rope_kind;
    float rope_base;        /* theta */
    float rope_freq_scale;  /* 1 / linear scaling factor */
    float rms_eps;
    bool tied_output;       /* no output.weight: the head reuses token_embd */
    bool qk_norm;           /* RMSNorm of each q and k head before rope (Qwen3) */
    /* mixture of experts (n_expert == 0: dense) */
    uint32_t n_expert;         /* routed experts per MoE layer */
    uint32_t n_expert_used;    /* experts chosen per token */
    uint32_t n_ff_exp;         /* hidden width of one routed expert */
    uint32_t n_layer_dense_lead; /* leading layers with a dense FFN instead */
    moe_gating gating;
    bool norm_topk;            /* renormalise the chosen experts' weights to sum to 1 */
    float expert_weights_scale; /* routed_scaling_factor (1: none) */
} moe_model_config;

typedef struct moe_layer_weights {
    const moe_tensor *attn_norm;   /* [n_embd] f32 */
    const moe_tensor *wq;          /* [n_embd] -> [n_head * head_dim_k] */
    const moe_tensor *wk;          /* [n_embd] -> [n_head_kv * head_dim_k] */
    const moe_tensor *wv;          /* [n_embd] -> [n_head_kv * head_dim_v] */
    const moe_tensor *wo;          /* [n_head * head_dim_v] -> [n_embd] */
    const moe_tensor *ffn_norm;    /* [n_embd] f32 */
    const moe_tensor *attn_q_norm; /* [head_dim_k] f32, with qk_norm */
    const moe_tensor *attn_k_norm; /* [head_dim_k] f32, with qk_norm */
    /* dense FFN (NULL in MoE layers) */
    const moe_tensor *ffn_gate;    /* [n_embd] -> [n_ff] */
    const moe_tensor *ffn_up;      /* [n_embd] -> [n_ff] */
    const moe_tensor *ffn_down;    /* [n_ff] -> [n_embd] */
    /* routed experts (NULL in dense layers) */
    const moe_tensor *ffn_gate_inp;  /* router: [n_embd] -> [n_expert], f32 */
    const moe_tensor *ffn_gate_exps; /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *ffn_up_exps;   /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *ffn_down_exps; /* [n_ff_exp] -> [n_embd], x n_expert */
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
