/* model: a model file turned into a config, a per-layer plan and named weights.
 *
 * Each architecture is one file, src/model/arch_<name>.c, holding one descriptor
 * (moe_arch_desc): how its config is read from `<arch>.*` metadata, which kind of mixer and FFN
 * each layer runs (the plan), and which tensors each layer binds, every shape checked against
 * the config so a broken file fails at load with the tensor's name. The config and plan come from
 * metadata alone, so `moe budget` and `moe inspect` read them from a remote header too. Weights
 * stay in the mapped file (never copied, never dequantized here). The trap: GGUF shapes are
 * ggml's ne[] order, so a projection from n_embd to n_out is ne = {n_embd, n_out}: ne[0] is the
 * input (row) length. */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "../format/format.h"

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
    MOE_ACT_GELU,       /* gelu(gate) * up (GEGLU, tanh form: Gemma) */
} moe_ffn_act;

typedef enum moe_rope_kind {
    MOE_ROPE_NORM, /* rotate adjacent pairs (x[2i], x[2i+1]): llama */
    MOE_ROPE_NEOX, /* rotate halves (x[i], x[i + d/2]): qwen, gpt-neox */
    MOE_ROPE_NONE, /* no rotation; rope_dims only sizes MLA's q_pe / k_pe part (kimi-linear) */
} moe_rope_kind;

/* What mixes tokens in a layer: softmax attention over a KV cache, or a linear-attention
 * recurrence over a fixed-size per-sequence state (hybrid models have both kinds of layer). */
typedef enum moe_mixer {
    MOE_MIXER_ATTENTION, /* grouped-query attention over a per-head K/V cache */
    MOE_MIXER_MLA,       /* multi-head latent attention over a latent cache (DeepSeek) */
    MOE_MIXER_GDN,       /* Gated DeltaNet: scalar decay per head (Qwen3-Next) */
    MOE_MIXER_KDA,       /* Kimi Delta Attention: decay per key channel (Kimi-Linear) */
    MOE_MIXER_COUNT
} moe_mixer;

typedef enum moe_ffn_kind {
    MOE_FFN_DENSE,   /* one gated FFN n_ff wide */
    MOE_FFN_EXPERTS, /* a router, routed experts and optional shared experts */
} moe_ffn_kind;

/* What the forward pass runs in one layer. The attention widths and rope are the config's in
 * every layer (moe_config_transformer fills them in) unless the architecture says otherwise
 * (Gemma 4's sliding layers: narrower heads, their own rope base and dims). */
typedef struct moe_layer_plan {
    moe_mixer mixer;
    moe_ffn_kind ffn;
    uint32_t n_head_kv; /* attention.head_count_kv of this layer (0 in linear layers) */
    uint32_t window;    /* sliding window in positions (0: full attention) */
    uint32_t head_dim_k, head_dim_v; /* this layer's attention head widths (<= the config's) */
    uint32_t rope_dims;              /* leading dims of each head that rotate (<= head_dim_k) */
    float rope_base;                 /* this layer's theta */
    bool indexed;      /* MLA attending only to the keys its lightning indexer selects */
    bool index_shared; /* ... those the previous indexed layer selected (no indexer of its own) */
    float clamp_exp;   /* SwiGLU clamp of the routed experts (0: none): silu(min(gate, L)) *
                        * clamp(up, -L, L) */
    float clamp_ffn;   /* the same for the shared experts and the dense FFN */
} moe_layer_plan;

#define MOE_CONV_MAX_TAPS 16 /* short-conv kernel of linear attention: real models use 4 */
#define MOE_MAX_HC        16 /* hyper-connection streams per token: real models use 4 */

typedef struct moe_arch_desc moe_arch_desc;

typedef struct moe_model_config {
    const moe_arch_desc *arch;
    const char *arch_name; /* general.architecture */
    uint32_t n_vocab;      /* rows of token_embd */
    uint32_t n_ctx_train;  /* <arch>.context_length */
    uint32_t n_embd;       /* residual width */
    uint32_t n_layer;
    uint32_t n_layer_nextn; /* trailing NextN/MTP layers in the file, not run */
    uint32_t n_head;        /* query heads */
    uint32_t n_head_kv;     /* key/value heads of the attention layers (the most of any layer) */
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
    moe_ffn_act ffn_act;   /* the dense FFN's and shared experts' activation (default SiLU) */
    bool attn_output_gate; /* attn_q yields [q, gate] per head; out *= sigmoid(gate) */
    bool attn_v_norm;      /* RMSNorm of every v head, without a weight (Gemma 4) */
    float embd_scale;      /* token embeddings times this (0: not scaled; Gemma: sqrt(n_embd)) */
    float final_softcap;   /* logits = cap * tanh(logits / cap) (0: none) */
    /* multi-head latent attention (n_lora_kv == 0: none). The cache row of a position is the
     * latent [n_lora_kv] then the roped key [rope_dims]: head_dim_k = n_lora_kv + rope_dims,
     * head_dim_v = n_lora_kv, one kv head. */
    uint32_t n_lora_q;       /* q down-projection rank (0: a plain attn_q) */
    uint32_t n_lora_kv;      /* latent width cached per position */
    uint32_t head_dim_k_mla; /* per-head q/k width before absorption: nope + rope_dims */
    uint32_t head_dim_v_mla; /* per-head value width after attn_v_b */
    /* linear attention (n_layer_linear == 0: none). q and k have ssm_n_k_heads heads, v has
     * ssm_n_v_heads (a multiple): v head h reads k head h / (n_v / n_k), or h % n_k when the
     * k heads are tiled over the v heads (ssm_tiled_heads, Qwen3.5/3.8's converter). */
    uint32_t n_layer_linear; /* layers whose mixer is GDN or KDA */
    uint32_t ssm_d_conv;     /* short-conv taps */
    uint32_t ssm_head_dim;   /* key = value width of one linear-attention head */
    uint32_t ssm_n_k_heads;
    uint32_t ssm_n_v_heads;
    bool ssm_tiled_heads;
    float kda_gate_bound; /* KDA decay g = bound * sigmoid(exp(A_log) (f_b f_a x + dt_bias)) when
                           * negative (GLM-5.3); 0: g = -exp(A_log) softplus(...) (Kimi) */
    float l2_eps;         /* q/k L2 norm of linear attention: x / max(|x|, l2_eps) */
    /* hyper-connections (n_hc == 0: the plain residual). n_hc streams per token; every block's
     * input is a weighted sum of them and its output is added back to each after the streams are
     * mixed by a doubly stochastic matrix (Sinkhorn iterations). */
    uint32_t n_hc;
    uint32_t hc_sinkhorn_iters;
    float hc_eps;
    /* lightning indexer of sparse MLA layers (plan.indexed): idx_n_head heads of idx_head_dim
     * score pools of idx_kpool cached keys; a query attends to the idx_top_k / idx_kpool best
     * complete pools and the incomplete tail, or to everything while that is no more */
    uint32_t idx_n_head, idx_head_dim, idx_top_k, idx_kpool;
    float idx_norm_eps;    /* the LayerNorm of the indexer keys */
    bool idx_rope;         /* rope (the model's, rope_dims) on the indexer's queries and keys */
    moe_layer_plan *layer; /* [n_layer + n_layer_nextn] what each layer runs */
} moe_model_config;

/* ==== Weights by layer kind ==== */

/* Grouped-query attention (MOE_MIXER_ATTENTION). */
typedef struct moe_attn_weights {
    const moe_tensor *wq;     /* [n_embd] -> [n_head * head_dim_k] (x 2 with an output gate) */
    const moe_tensor *wk;     /* [n_embd] -> [n_head_kv * head_dim_k] */
    const moe_tensor *wv;     /* [n_embd] -> [n_head_kv * head_dim_v] */
    const moe_tensor *wo;     /* [n_head * head_dim_v] -> [n_embd] */
    const moe_tensor *q_norm; /* [head_dim_k] f32 RMSNorm per q head, or NULL */
    const moe_tensor *k_norm; /* [head_dim_k] f32 RMSNorm per k head, or NULL */
    const moe_tensor *bq, *bk, *bv; /* f32 biases of wq, wk, wv, or NULL */
    const moe_tensor *bo;           /* f32 [n_embd] bias of wo, or NULL */
    const moe_tensor *sinks;        /* f32 [n_head]: per-head logit in the softmax denominator */
    const moe_tensor *rope_freqs;   /* f32 [rope_dims / 2]: pair i rotates by angle / freqs[i]
                                     * (Gemma 4's proportional rope), or NULL */
} moe_attn_weights;

/* Multi-head latent attention (MOE_MIXER_MLA): the cache row of a position is the normed
 * latent [n_lora_kv] then the roped shared key [rope_dims]. */
typedef struct moe_mla_weights {
    const moe_tensor *wq;        /* [n_embd] -> [n_head * head_dim_k_mla] when n_lora_q == 0 */
    const moe_tensor *wq_a;      /* [n_embd] -> [n_lora_q] */
    const moe_tensor *q_a_norm;  /* [n_lora_q] f32 */
    const moe_tensor *wq_b;      /* [n_lora_q] -> [n_head * head_dim_k_mla] */
    const moe_tensor *wkv_a_mqa; /* [n_embd] -> [n_lora_kv + rope_dims] */
    const moe_tensor *kv_a_norm; /* [n_lora_kv] f32 */
    const moe_tensor *wk_b;      /* [head_dim_k_mla - rope_dims] -> [n_lora_kv], x n_head */
    const moe_tensor *wv_b;      /* [n_lora_kv] -> [head_dim_v_mla], x n_head */
    const moe_tensor *wo;        /* [n_head * head_dim_v_mla] -> [n_embd] */
    /* the pooled lightning indexer (plan.indexed; ih = idx_n_head, id = idx_head_dim) */
    const moe_tensor *idx_q_b;    /* [n_lora_q] -> [ih * id] queries from the q latent */
    const moe_tensor *idx_k;      /* [n_embd] -> [id] per-token key, then LayerNorm: */
    const moe_tensor *idx_k_norm; /* [id] f32 weight */
    const moe_tensor *idx_k_bias; /* [id] f32 bias */
    const moe_tensor *idx_proj;   /* [n_embd] -> [ih] per-head weights of a query's score */
    const moe_tensor *idx_gate;   /* [n_embd] -> [id] per-token pooling logits */
    const moe_tensor *idx_ape;    /* f32 [id] x kpool: pooling logit by position in the pool */
} moe_mla_weights;

/* Linear attention (MOE_MIXER_GDN, MOE_MIXER_KDA); K = n_k_heads * head_dim,
 * V = n_v_heads * head_dim. */
typedef struct moe_linear_weights {
    const moe_tensor *conv1d[3]; /* f32 taps [d_conv] per channel of q|k|v: GDN one tensor over
                                  * all K + K + V channels, KDA one each for q, k, v */
    const moe_tensor *a;         /* f32 [n_v_heads]: -exp(A_log), decay rate per head */
    const moe_tensor *dt_b;      /* f32 dt bias: GDN [n_v_heads], KDA [V] */
    const moe_tensor *norm;      /* f32 [head_dim]: RMSNorm of each head's output */
    const moe_tensor *out;       /* [V] -> [n_embd] */
    /* GDN */
    const moe_tensor *qkv;   /* attn_qkv: [n_embd] -> [K + K + V] */
    const moe_tensor *gate;  /* attn_gate z: [n_embd] -> [V] */
    const moe_tensor *ba;    /* [n_embd] -> per k head [beta x r, alpha x r], r = n_v / n_k;
                              * or NULL and beta, alpha apart: */
    const moe_tensor *alpha; /* [n_embd] -> [n_v_heads] (GDN without ba) */
    /* KDA */
    const moe_tensor *wq, *wk, *wv; /* [n_embd] -> [K], [K], [V] */
    const moe_tensor *beta;         /* [n_embd] -> [n_v_heads] (KDA, GDN without ba) */
    const moe_tensor *f_a, *f_b;    /* decay: [n_embd] -> [head_dim] -> [V] */
    const moe_tensor *g_a, *g_b;    /* output gate: [n_embd] -> [head_dim] -> [V] */
} moe_linear_weights;

/* A gated FFN: out = down(act(gate x) * up x). */
typedef struct moe_ffn_weights {
    const moe_tensor *gate; /* [n_embd] -> [width] */
    const moe_tensor *up;   /* [n_embd] -> [width] */
    const moe_tensor *down; /* [width] -> [n_embd] */
} moe_ffn_weights;

/* Routed experts (MOE_FFN_EXPERTS), with their biases where the file has them, and the
 * shared experts run on every token beside them. */
typedef struct moe_expert_weights {
    const moe_tensor *router;          /* ffn_gate_inp: [n_embd] -> [n_expert] */
    const moe_tensor *router_in_scale; /* [n_embd] f32: the router reads RMSNorm(x) / sqrt(n_embd)
                                        * * this, x the FFN's un-normed input (Gemma 4), or NULL:
                                        * the FFN's normed input */
    const moe_tensor *router_b;        /* [n_expert] f32 router bias (gpt-oss), or NULL */
    const moe_tensor *sel_bias;   /* [n_expert] f32 selection-only bias (DeepSeek-V3), or NULL */
    const moe_tensor *gate;       /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *up;         /* [n_embd] -> [n_ff_exp], x n_expert */
    const moe_tensor *gate_up;    /* [n_embd] -> [2 n_ff_exp] (gate rows, then up rows), x
                                   * n_expert: gate and up fused (Gemma 4), or NULL */
    const moe_tensor *down;       /* [n_ff_exp] -> [n_embd], x n_expert */
    const moe_tensor *down_scale; /* [n_expert] f32: expert e's output times [e], or NULL */
    const moe_tensor *in_norm;    /* [n_embd] f32: the routed experts read RMSNorm(x) * this,
                                   * x the FFN's un-normed input (Gemma 4's pre_ffw_norm_2),
                                   * or NULL: the FFN's normed input, as the shared ones */
    const moe_tensor *out_norm;   /* [n_embd] f32 RMSNorm of the routed experts' sum, or NULL */
    const moe_tensor *shared_out_norm; /* [n_embd] f32 RMSNorm of the shared output, or NULL */
    const moe_tensor *gate_b, *up_b;   /* [n_ff_exp] x n_expert f32, or NULL (gpt-oss) */
    const moe_tensor *down_b;          /* [n_embd] x n_expert f32, or NULL */
    moe_ffn_weights shared;            /* n_ff_shexp wide; all NULL without shared experts */
    const moe_tensor *shared_gate;     /* [n_embd] f32: shared out *= sigmoid(w . x), or NULL */
} moe_expert_weights;

/* What a NextN / multi-token-prediction layer has beside a plain layer's weights: the previous
 * hidden state and the next token's embedding, each normed, concatenated and projected. */
typedef struct moe_nextn_weights {
    const moe_tensor *eh_proj;   /* [2 n_embd] -> [n_embd]: [token half; hidden half] */
    const moe_tensor *enorm;     /* [n_embd] f32: norm of the token embedding */
    const moe_tensor *hnorm;     /* [n_embd] f32: norm of the hidden state */
    const moe_tensor *head_norm; /* [n_embd] f32 shared_head_norm, or NULL: output_norm */
    const moe_tensor *embed;     /* its own token embeddings, or NULL: token_embd */
    const moe_tensor *head;      /* its own LM head (shared_head_head), or NULL: output */
} moe_nextn_weights;

/* One site's hyper-connection mixer: m = fn . RMSNorm(all streams) gives n_hc pre weights,
 * n_hc post weights and the n_hc x n_hc combination logits, each scaled and offset. */
typedef struct moe_hc_weights {
    const moe_tensor *fn;    /* f32 [n_hc n_embd] -> [(2 + n_hc) n_hc] */
    const moe_tensor *base;  /* f32 [(2 + n_hc) n_hc] */
    const moe_tensor *scale; /* f32 [3]: of the pre, post and combination logits */
} moe_hc_weights;

/* One layer: its plan, its two input norms (and output norms where the architecture has them),
 * and the weights of its mixer and FFN kinds. */
typedef struct moe_layer_weights {
    moe_layer_plan plan;
    moe_hc_weights hc_attn, hc_ffn;   /* around the mixer and the FFN (n_hc > 0, trunk layers) */
    const moe_tensor *attn_norm;      /* [n_embd] f32: the mixer's input RMSNorm */
    const moe_tensor *ffn_norm;       /* [n_embd] f32: the FFN's input RMSNorm */
    const moe_tensor *attn_post_norm; /* [n_embd] f32 RMSNorm of the mixer's output, or NULL */
    const moe_tensor *ffn_post_norm;  /* [n_embd] f32 RMSNorm of the FFN's output, or NULL */
    const moe_tensor *out_scale;      /* [1] f32: the stream times this after the layer, or NULL */
    union {                           /* by plan.mixer */
        moe_attn_weights attn;        /* MOE_MIXER_ATTENTION */
        moe_mla_weights mla;          /* MOE_MIXER_MLA */
        moe_linear_weights linear;    /* MOE_MIXER_GDN, MOE_MIXER_KDA */
    };
    union {                         /* by plan.ffn */
        moe_ffn_weights ffn;        /* MOE_FFN_DENSE */
        moe_expert_weights experts; /* MOE_FFN_EXPERTS */
    };
    moe_nextn_weights nextn; /* NextN layers only (after the n_layer trunk layers) */
} moe_layer_weights;

typedef struct moe_model {
    moe_gguf *gguf;
    moe_model_config cfg;
    const moe_tensor *token_embd;  /* [n_embd] x n_vocab rows */
    const moe_tensor *output_norm; /* [n_embd] f32 */
    const moe_tensor *output;      /* [n_embd] -> [n_vocab]; token_embd when tied */
    moe_layer_weights *layers;     /* [n_layer + n_layer_mtp]: the trunk, then the MTP layers */
    uint32_t n_layer_mtp; /* NextN / MTP layers bound and runnable (0: none, or unusable) */
    char *path;
} moe_model;

/* ==== Architectures ==== */

typedef struct moe_binder moe_binder;
typedef struct moe_meta moe_meta;

/* One architecture (src/model/arch_<name>.c). */
struct moe_arch_desc {
    const char *name; /* general.architecture */
    /* The config and every layer's plan from metadata alone (c->layer is allocated). */
    bool (*config)(moe_meta *r, moe_model_config *c);
    /* Bind layer il's norms and its plan's mixer and FFN weights, checking every shape. */
    void (*bind_layer)(moe_binder *b, uint32_t il, moe_layer_weights *l);
};

/* The descriptor of an architecture name, or NULL. */
const moe_arch_desc *moe_arch_find(const char *name);
/* "llama qwen3moe ...": the names moe runs, space-separated. */
const char *moe_arch_names(void);

/* ==== Config and state sizes ==== */

/* Read the config and plan of g's architecture from its metadata (tensor data not needed).
 * Fails with MOE_ERR_UNSUPPORTED for an architecture moe does not know. */
moe_status moe_model_config_read(const moe_gguf *g, const char *path, moe_model_config *c,
                                 moe_error *err);
/* The same for an architecture moe does not run: the keys every transformer has, every layer
 * planned as full attention with a dense FFN (what `moe budget` can still plan for it). */
moe_status moe_model_config_read_generic(const moe_gguf *g, const char *path, moe_model_config *c,
                                         moe_error *err);
void moe_model_config_free(moe_model_config *c);

/* What one layer keeps: values per token of context (K and V cache rows; the MLA latent row
 * counts as K) and f32 values per sequence (a linear layer's recurrent state). */
typedef struct moe_layer_state {
    uint64_t k_values, v_values, state_values;
    uint64_t index_values; /* f32 values per token of an indexed layer's indexer cache */
} moe_layer_state;
moe_layer_state moe_layer_state_of(const moe_model_config *c, uint32_t il);
/* f32 values of one position's indexer row: the key, and with pools (idx_kpool > 1) its pooling
 * logits and the pooled key (kept in a pool's first cell). */
static inline uint64_t moe_index_row_values(const moe_model_config *c) {
    return (c->idx_kpool > 1 ? 3ull : 1ull) * c->idx_head_dim;
}

/* ==== Declaring a model's tensors (moe synth) ==== */

typedef struct moe_tensor_decl {
    const char *name;
    int n_dims;
    int64_t ne[3];
    bool f32;      /* read as floats by the forward pass: must be F32 */
    bool required; /* else bound only when a file has it */
} moe_tensor_decl;

/* Every tensor c's architecture binds, trunk and NextN layers, in binding order, without a
 * file: `tensor` is told each one and answers whether the file being made will have it (its
 * answer for a required tensor must be yes). c->n_vocab must be set. */
moe_status moe_model_declare(const moe_model_config *c,
                             bool (*tensor)(void *ctx, const moe_tensor_decl *d), void *ctx,
                             moe_error *err);

/* ==== Loading ==== */

moe_model *moe_model_load(const char *path, moe_error *err);
/* Bind a model from an already opened file; on success the model owns g. */
moe_model *moe_model_from_gguf(moe_gguf *g, const char *path, moe_error *err);
void moe_model_free(moe_model *m);
/* Whether t is one of m's routed-expert matrices (ffn_*_exps of a layer it runs); takes the
 * model as void * to serve as moe_gguf_to_memory_except's skip. */
bool moe_model_is_routed(const moe_tensor *t, void *model);
/* What moe_model_repack did. */
typedef struct moe_layout_report {
    uint32_t n_matrices;   /* tensors repacked (a stacked expert tensor counts once) */
    uint64_t bytes;        /* their bytes (moved, not added) */
    uint64_t mapped_bytes; /* of those, bytes that were mapped: now the process's own memory */
    moe_isa isa;           /* the kernel table they were repacked for */
    double seconds;        /* the repack's wall time */
} moe_layout_report;
/* Repack m's projection matrices (every layer's moe_layer_matrices and an untied output head)
 * into the layout the active kernel table reads fastest (quant.h, "Weight layouts in memory"):
 * those of a type whose fast tile kernel has a repacked twin at this level (today
 * avx512vnni's Q8_0, Q4_0, IQ4_NL, MXFP4; MOE_EXACT=1 and lower levels have none, so nothing is
 * repacked), in memory or mapped (moe_gguf_tensor_repack; the file is never written), at
 * least 16 rows; routed experts only with `routed` (an expert cache or a split reads them from
 * the file apart); over the pool's threads (NULL: the caller's). Logits do not change by a bit: the
 * repacked kernels give the file layout's bits. Call once, after moe_gguf_to_memory(_except) if at
 * all and before the first forward pass; the kernel table must not change after (a repacked matrix
 * on a table without its kernel stops the process, naming it). */
moe_status moe_model_repack(moe_model *m, bool routed, moe_pool *pool, moe_layout_report *out,
                            moe_error *err);
/* "LABEL: repacked N matrices (X MiB, Y MiB of them out of the mapping) ... in S s"
 * on stderr, when anything was. */
void moe_layout_report_print(const char *label, const moe_layout_report *r);

/* The projection matrices of a layer (those moe_matmul reads), by its plan: *n of them. */
#define MOE_LAYER_MAX_MATRICES 24
int moe_layer_matrices(const moe_layer_weights *l, const moe_tensor **out);

#endif
