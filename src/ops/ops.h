/* ops: the numerical building blocks of a forward pass, each over a block of rows.
 *
 * Everything here is stateless: callers pass weights (moe_tensor, still quantized), activations
 * (float32 rows) and scratch they own. Matmuls go through the quant trait table: each activation
 * row is converted once to the weight type's dot_type, then every weight row is dotted against
 * it. The trap: scratch sizes come from the *_scratch_bytes helpers; the token loop must not
 * allocate, so callers size their arenas with them at load. */
#ifndef MOE_OPS_H
#define MOE_OPS_H

#include <stdint.h>

#include "../format/format.h"
#include "../model/model.h"
#include "../quant/quant.h"

/* ==== Elementwise and norms ==== */

/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] (w NULL: no weight); out may alias x. */
void moe_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* out = (x - mean(x)) / sqrt(var(x) + eps) * w + b (LayerNorm); out may alias x. */
void moe_layernorm(float *out, const float *x, const float *w, const float *b, int64_t n,
                   float eps);
/* The index of the largest of v[0..n) (the first on a tie). */
int32_t moe_argmax(const float *v, uint32_t n);
/* x[i] = silu(gate[i]) * x[i] (SwiGLU: x holds `up`). */
void moe_swiglu(float *x, const float *gate, int64_t n);
/* gpt-oss's clamped SwiGLU (ggml swiglu_oai): g = min(gate, limit), u = clamp(x, +-limit),
 * x[i] = g * sigmoid(alpha * g) * (u + 1). */
#define MOE_SWIGLU_OAI_ALPHA 1.702f
#define MOE_SWIGLU_OAI_LIMIT 7.0f
void moe_swiglu_oai(float *x, const float *gate, int64_t n);
/* The tanh form of GELU, in f32: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). (ggml's CPU
 * GELU goes through an fp16 table; this one does not.) */
float moe_gelu(float x);
/* x[i] = gelu(gate[i]) * x[i] (GEGLU: x holds `up`). */
void moe_geglu(float *x, const float *gate, int64_t n);
/* x[i] = act(gate[i]) * x[i] for the activation kind. */
/* SwiGLU with both inputs clamped (GLM-5.3): x = silu(min(gate, limit)) * clamp(x, -limit, limit).
 */
void moe_swiglu_clamped(float *x, const float *gate, int64_t n, float limit);
/* x = act(gate) * x; limit > 0 clamps a SwiGLU (MOE_ACT_SILU) as moe_swiglu_clamped. */
void moe_glu(moe_ffn_act act, float limit, float *x, const float *gate, int64_t n);
/* On all of the pool's threads, the same bits (few values: on the caller): moe_glu over n
 * values, and moe_rmsnorm of n_rows rows of n values (out row r from x row r). */
void moe_glu_pool(moe_pool *pool, moe_ffn_act act, float limit, float *x, const float *gate,
                  int64_t n);
void moe_rmsnorm_rows(moe_pool *pool, float *out, const float *x, const float *w, int64_t n_rows,
                      int64_t n, float eps);
/* Values a plain-C elementwise loop takes at a time with a constant trip count: GCC -O2
 * vectorises such a loop (its cheap cost model refuses one that would need a scalar epilogue). */
#define MOE_VEC_STEP 16
/* x[i] += y[i] for i < n, on all of the pool's threads (few values: on the caller). */
void moe_add_pool(moe_pool *pool, float *x, const float *y, int64_t n);
/* y[r][i] += b[i] for n_rows rows of n values, b = row `index` of the F32 tensor bias (0 for a
 * vector; e.g. an expert's row of a [n] x n_expert bias). NULL bias: nothing. */
void moe_add_bias(float *y, const moe_tensor *bias, int64_t index, int64_t n_rows, int64_t n);
/* In-place softmax; returns nothing, handles -inf entries (masked) as zero probability. */
void moe_softmax(float *x, int64_t n);

/* ==== Rotary position embedding ==== */

typedef struct moe_rope_params {
    int n_dims;         /* leading dims of each head that rotate */
    int neox;           /* 0: adjacent pairs (x[2i], x[2i+1]); 1: halves (x[i], x[i+n_dims/2]) */
    float base;         /* theta base */
    float freq_scale;   /* position multiplier (1 / scaling factor) */
    float ext_factor;   /* YaRN: how much of the unscaled angle the low dims keep (0: off) */
    float attn_factor;  /* cos/sin magnitude; YaRN multiplies it by 1 + 0.1 ln(1/freq_scale) */
    float corr_dims[2]; /* YaRN: pairs below [0] keep the unscaled angle, above [1] the scaled */
    const float *freq_factors; /* [n_dims / 2]: pair i's angle divided by [i] (ggml's rope
                                * freq_factors, Gemma 4's proportional rope), or NULL */
} moe_rope_params;

/* The rope of a model's config (its rope_dims, kind, base, scaling and YaRN correction range,
 * computed as ggml_rope_yarn_corr_dims does). */
moe_rope_params moe_rope_params_from_config(const moe_model_config *c);
/* The same over a layer's own rope dims and base (its plan); freq_factors left NULL. */
moe_rope_params moe_rope_params_of_layer(const moe_model_config *c, const moe_layer_plan *p);
/* Rotate n_heads heads of head_dim values each, for position pos, in place (the leading
 * n_dims values of each head; pass a pointer into the head for a rope part further in). */
void moe_rope(float *x, int n_heads, int head_dim, int64_t pos, const moe_rope_params *p);

/* ==== Matmul through the trait table ==== */

/* Bytes of scratch moe_matmul needs for n_rows activation rows against weight w. */
uint64_t moe_matmul_scratch_bytes(const moe_tensor *w, int64_t n_rows);
/* y[r][o] = sum_i W[o][i] * x[r][i] for r < n_rows, o < w->ne[1]; x rows have w->ne[0]
 * values, y rows w->ne[1]. W is the 2-D slice `matrix` of w (0 for 2-D tensors). Output
 * units are split across the pool's threads. */
/* Several independent matmuls in one parallel pass (the experts of a MoE layer): their output
 * units are handed out together, so the pool synchronises once for all of them. Each task's
 * scratch holds its activation rows converted for the dot (moe_matmul_scratch_bytes). */
typedef struct moe_matmul_task {
    const moe_tensor *w;
    int64_t matrix; /* 2-D slice of w */
    const float *x; /* [n_rows][w->ne[0]] */
    int64_t n_rows;
    float *y;      /* [n_rows][w->ne[1]] */
    void *scratch; /* with x NULL: already holds the rows converted (moe_matmul_convert_rows;
                    * never while an observer is set, as it reads x) */
} moe_matmul_task;
#define MOE_MATMUL_MANY_MAX 256 /* tasks per call (a group of experts: 2 per expert) */
void moe_matmul_many(moe_pool *pool, const moe_matmul_task *tasks, int n_tasks);
void moe_matmul(moe_pool *pool, const moe_tensor *w, int64_t matrix, const float *x, int64_t n_rows,
                float *y, void *scratch);
/* Request the first `bytes` of the 2-D slice `matrix` of w from memory and return at once
 * (software prefetch): a pass about to start on it finds its first lines on their way. */
void moe_matmul_prefetch(const moe_tensor *w, int64_t matrix, uint64_t bytes);
/* An observer of every matmul's input rows (moe imatrix): called on the calling thread, once per
 * task before its product, with the weight, its 2-D slice (the expert) and the float activation
 * rows. Process-wide and not synchronised: set it before a forward pass, never while one runs;
 * NULL (the default) observes nothing. */
typedef void (*moe_matmul_observer_fn)(void *ctx, const moe_tensor *w, int64_t matrix,
                                       const float *x, int64_t n_rows);
void moe_matmul_set_observer(moe_matmul_observer_fn fn, void *ctx);
/* Whether an observer is set (it needs every task's float rows). */
bool moe_matmul_observed(void);
/* Activation rows x[0..n_rows) converted for w's dot as moe_matmul converts them, row r to
 * out + r * moe_matmul_scratch_bytes(w, 1): on the calling thread (a task's rows converted where
 * they are made, or once for several tasks), or on all of the pool's threads. False, and nothing
 * done, when w's dot takes the float rows as they are. */
bool moe_matmul_convert_rows(const moe_tensor *w, const float *x, int64_t n_rows, void *out);
bool moe_matmul_convert_pool(moe_pool *pool, const moe_tensor *w, const float *x, int64_t n_rows,
                             void *out);
/* Whether a and b convert their activation rows the same way (one conversion serves both). */
bool moe_matmul_converts_alike(const moe_tensor *a, const moe_tensor *b);
/* Row `row` of a 2-D tensor dequantized to float (embedding lookup). */
void moe_tensor_row_f32(const moe_tensor *w, int64_t row, float *out);

/* ==== Attention ==== */

/* Where one sequence's cached keys and values lie: KV head h's key at position p is head_dim_k
 * kv_type values at k + h * k_head + p * k_stride (bytes); its value likewise in v. The engine
 * keeps each KV head's positions side by side (k_stride = one head's bytes, k_head = the
 * context's positions of them), so a head's keys stream from DRAM in order. */
typedef struct moe_attn_kv {
    const void *k, *v;
    int64_t k_stride, v_stride; /* bytes between positions of a head */
    int64_t k_head, v_head;     /* bytes between KV heads */
} moe_attn_kv;

/* One query row attending over positions 0..n_kv-1 of kv.
 * q: [n_head][head_dim_k]; out: [n_head][head_dim_v]; scores: n_kv floats scratch. Positions
 * are all visible (the caller passes only the causal prefix). */
typedef struct moe_attn_shape {
    int n_head, n_head_kv, head_dim_k, head_dim_v;
    float scale;        /* usually 1/sqrt(head_dim_k) */
    moe_type kv_type;   /* MOE_TYPE_F32, MOE_TYPE_F16 or MOE_TYPE_Q8_0, both k and v */
    const float *sinks; /* [n_head] logits that join each head's softmax denominator, or NULL */
} moe_attn_shape;
void moe_attention_row(const moe_attn_shape *s, const float *q, const moe_attn_kv *kv, int64_t n_kv,
                       float *out, float *scores);

/* Tiled (flash-style) attention, the fast path: a block of query rows of one sequence against
 * that sequence's cache, key positions taken in tiles of MOE_ATTN_TILE from position 0 with a
 * running max and sum per (row, head), so no score row longer than a tile ever exists. Row r
 * sees key positions first[r]..last[r] (causal prefix, sliding window). Only heads h0..h1-1 (all
 * of one kv head's group) are computed; the caller splits work over blocks, kv heads and head
 * ranges. The (row, head) query vectors go MOE_ATTN_TILE_QV at a time through the kernel table's
 * attn_tile, which converts each K / V tile once for all of them and gives each vector the float
 * order quant.h states: it depends on the row's own first / last only (tiles are fixed in
 * absolute positions), so a row gets the same bits whatever shares its block, and a decode row
 * the same as a prefill row. A Q8_0 cache's query vectors are quantized to q8_0 once per call,
 * for integer scores (quant.h). Not ggml's order: MOE_EXACT=1 keeps moe_attention_row. */
#define MOE_ATTN_TILE       MOE_ATTN_TILE_KEYS
#define MOE_ATTN_BLOCK_ROWS 16 /* query rows per block at most */
typedef struct moe_attn_block {
    const float *q;              /* [n_rows][n_head * head_dim_k] */
    float *out;                  /* [n_rows][n_head * head_dim_v] */
    const int64_t *first, *last; /* [n_rows] visible key positions, first <= last */
    int n_rows;                  /* <= MOE_ATTN_BLOCK_ROWS */
    moe_attn_kv kv;              /* the sequence's cache from position 0 */
    float *scratch; /* moe_attention_tiled_scratch(max(head_dim_k, head_dim_v)) floats */
} moe_attn_block;
/* Floats of scratch one moe_attention_tiled call needs for heads up to dim values wide. */
size_t moe_attention_tiled_scratch(int dim);
void moe_attention_tiled(const moe_attn_shape *s, const moe_attn_block *b, int h0, int h1);

/* ==== Hyper-connections (hyper.c) ==== */

/* One row's hyper-connection weights for n streams from its mixing logits m [(2 + n) n], each
 * logit scaled by scale[part] and offset by base: pre[s] = sigmoid(.) + eps (the block input's
 * weights), post[s] = 2 sigmoid(.) (the block output's weight into stream s), and comb [n][n]
 * (comb[src * n + dst]: how much of stream src goes to dst): a softmax over dst plus eps, made
 * doubly stochastic by `iters` Sinkhorn normalisations (columns first, each sum + eps). */
void moe_hc_mix_weights(const float *m, const float *base, const float *scale, int n, int iters,
                        float eps, float *pre, float *post, float *comb);

/* ==== Linear attention (linear_attn.c) ==== */

#define MOE_DELTA_CHUNK 64 /* tokens per chunk of the chunked delta rule */

float moe_softplus(float x); /* log(1 + e^x), x itself above 20 (ggml) */
/* x /= max(||x||_2, eps) (ggml_l2_norm). */
void moe_l2norm(float *x, int64_t n, float eps);

typedef enum moe_gate_act { MOE_GATE_SIGMOID, MOE_GATE_SILU } moe_gate_act;
/* x[i] *= sigmoid(gate[i]) or silu(gate[i]): output gates of gated norms and attention (the
 * fast path's vector ones, quant.h: moe_silu_fn; libm's expf on the exact path). */
void moe_gate_mul(float *x, const float *gate, int64_t n, moe_gate_act act);

/* Causal depthwise conv1d then SiLU over n_tok consecutive tokens of one sequence, in place.
 * x: token t's n_ch channels at x + t * x_stride. w: [n_ch][d_conv] taps, oldest first (ggml's
 * ssm_conv1d ne = {d_conv, n_ch}). state: [n_ch][d_conv - 1], each channel's inputs of the
 * previous d_conv - 1 tokens, oldest first; on return it holds the latest ones. The SiLU is the
 * fast path's vector one (quant.h: moe_silu_fn), libm's expf on the exact path. */
void moe_conv1d_silu(float *x, int64_t x_stride, int64_t n_tok, int64_t n_ch, const float *w,
                     int d_conv, float *state);

/* One head of the gated delta rule over consecutive tokens of one sequence. Per token t:
 *   S <- S diag(exp(g_t));  S <- S + beta_t (v_t - S k_t) k_t^T;  o_t = scale * S q_t
 * state S^T: [d_k][d_v] floats, the value index contiguous. g: log decays (<= 0), one per token
 * (Gated DeltaNet: scalar per head) or d_k per token (KDA: per key channel). q and k are
 * expected L2-normalised. Row t of each input is at base + t * stride (in floats). */
typedef struct moe_delta_args {
    int d_k, d_v;
    int n_g;            /* 1 or d_k */
    float scale;        /* on the output (1/sqrt(d_k)) */
    const float *q, *k; /* d_k values each, stride qk_stride */
    const float *v;     /* d_v values, stride v_stride */
    const float *g;     /* n_g values, stride g_stride */
    const float *beta;  /* one value, stride beta_stride */
    float *out;         /* d_v values, stride out_stride */
    int64_t qk_stride, v_stride, g_stride, beta_stride, out_stride;
} moe_delta_args;

/* Floats of scratch either form needs (one head at a time). */
uint64_t moe_delta_scratch_floats(int d_k, int d_v);
/* Token by token (decode, short runs). */
void moe_delta_rule_recurrent(const moe_delta_args *a, int64_t n_tok, float *state, float *scratch);
/* Chunks of MOE_DELTA_CHUNK tokens (prefill); the same result to float rounding. */
void moe_delta_rule_chunked(const moe_delta_args *a, int64_t n_tok, float *state, float *scratch);

/* ==== Mixture of experts ==== */

typedef struct moe_route_params {
    int n_expert, n_used;
    moe_gating gating;
    bool norm;                 /* renormalise the chosen weights to sum to 1 */
    float scale;               /* multiply the chosen weights (routed_scaling_factor) */
    const float *sel_bias;     /* [n_expert] added for selection only (exp_probs_b), or NULL */
    int n_group, topk_group;   /* grouped top-k (n_group <= 1: off) */
    const float *expert_scale; /* [n_expert]: a chosen expert's weight times [e] last (Gemma 4's
                                * per-expert output scale), or NULL */
} moe_route_params;

/* Router logits [n_rows][n_expert] -> chosen experts ids [n_rows][n_used] (best first) and
 * their weights [n_rows][n_used]. scratch: 2 * n_expert floats. */
void moe_route(const moe_route_params *p, const float *logits, int64_t n_rows, int32_t *ids,
               float *weights, float *scratch);

/* Counters of one expert dispatch, for metrics and the dedup claim: pairs / experts touched is
 * how many rows share each expert read. */
typedef struct moe_expert_stats {
    uint64_t rows;    /* activation rows routed */
    uint64_t pairs;   /* (row, expert) pairs */
    uint64_t experts; /* distinct experts run (each one's weights read once) */
} moe_expert_stats;

/* Where a layer's experts come from when they are not all resident (an expert cache). Before a
 * group of experts runs, acquire keeps them for the group (until release) and starts reading the
 * ones not resident; views [3 n] get, for ids[i], its gate (or fused gate_up), up (unused when
 * fused) and down matrix as one-matrix tensors, and ready[i] says whether its bytes are there
 * now. The dispatch computes the ready experts first, then waits for the rest (wait). acquire or
 * wait false: they could not be read (the source keeps the error and has let the group go); the
 * dispatch stops. */
typedef struct moe_expert_source {
    bool (*acquire)(void *ctx, const int32_t *ids, int n, moe_tensor *views, bool *ready);
    bool (*wait)(void *ctx, const int32_t *ids, int n);
    void (*release)(void *ctx, const int32_t *ids, int n);
    void *ctx;
    int max_group; /* experts resident at once at most */
} moe_expert_source;

/* One layer's routed experts as the dispatch runs them: gate and up apart, or fused. */
typedef struct moe_expert_set {
    const moe_tensor *gate, *up;     /* [n_in] -> [n_ff], x n_expert; NULL with gate_up */
    const moe_tensor *gate_up;       /* [n_in] -> [2 n_ff] (gate rows, then up), x n_expert */
    const moe_tensor *down;          /* [n_ff] -> [n_in], x n_expert */
    const moe_tensor *gate_b, *up_b; /* F32 [n_ff] x n_expert biases, or NULL */
    const moe_tensor *down_b;        /* F32 [n_in] x n_expert, or NULL */
    moe_ffn_act act;
    float limit;                     /* SwiGLU clamp (0: none), see moe_glu */
    const moe_expert_source *source; /* NULL: gate, up and down are resident */
    int shard, n_shards; /* run only the experts e with e % n_shards == shard, the others adding
                          * nothing (n_shards <= 1: every expert): one rank's share */
} moe_expert_set;

/* Buffers for moe_experts_forward, sized by the caller for its largest batch. */
typedef struct moe_expert_scratch {
    int32_t *counts;   /* [n_expert + 1] */
    int32_t *pair_row; /* [max_rows * n_used] rows grouped by expert */
    float *pair_w;     /* [max_rows * n_used] their weights */
    float *x;          /* [max_rows][n_in] gathered rows of one expert */
    float *gate, *up;  /* [max_rows][n_ff_exp] ([max_rows][2 n_ff_exp] gate with gate_up) */
    float *y;          /* [max_rows][n_in] one expert's outputs */
    void *mm, *mm_up;  /* moe_matmul scratch for max_rows rows of the widest input, twice: the
                          gate and up matmuls of a group of experts convert their rows at once */
    int64_t max_rows;  /* the rows the buffers above hold: a group's (row, expert) pairs */
} moe_expert_scratch;

/* out[r] += sum_k weights[r][k] * (down_e(act(gate_e(x[r]) + gb_e) * (up_e(x[r]) + ub_e)) + db_e)
 * with e = ids[r][k] (biases where present). Rows are grouped by expert so each expert runs
 * once over all rows routed to it. */
/* Returns false when the set's source could not provide an expert (out is then incomplete). */
bool moe_experts_forward(moe_pool *pool, const moe_expert_set *e, const float *x, int64_t n_rows,
                         const int32_t *ids, const float *weights, int n_used, float *out,
                         const moe_expert_scratch *s, moe_expert_stats *stats);

#endif
