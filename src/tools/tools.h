/* tools: the audit and maintenance tools behind `moe inspect`, `moe budget`, `moe audit` (and
 * later repack, bench, eval, synth) and the built-in demo model. Each computes facts into a struct;
 * cli/ prints them as text or JSON.
 *
 * The trap: a tensor's role comes from its llama.cpp name alone (`blk.N.ffn_up_exps.weight`),
 * so a file with unconventional names lands in "norms/other" -- never guess from shapes. */
#ifndef MOE_TOOLS_H
#define MOE_TOOLS_H

#include <stdbool.h>
#include <stdint.h>

#include "../base/base.h"
#include "../engine/engine.h"
#include "../format/format.h"

/* ==== Tensor roles, from llama.cpp tensor names ==== */

typedef enum moe_role {
    MOE_ROLE_ROUTED_EXPERTS, /* *_exps*: the MoE experts a router chooses among */
    MOE_ROLE_SHARED_EXPERTS, /* *_shexp*: experts every token runs */
    MOE_ROLE_ATTENTION,      /* attn_* (MLA's attn_kv_a_mqa, attn_q_a/b, attn_k_b/v_b too),
                                the lightning indexer's indexer* and linear attention ssm_*:
                                the token mixers */
    MOE_ROLE_DENSE_FFN,      /* ffn_gate/up/down(/gate_up) outside the experts */
    MOE_ROLE_HYPER,          /* hc_*: the hyper-connection mixers around every block */
    MOE_ROLE_EMBEDDINGS,     /* token_embd, output (embeddings and the LM head) */
    MOE_ROLE_OTHER,          /* norms, routers (ffn_gate_inp), biases of the above, the rest */
    MOE_ROLE_COUNT
} moe_role;

moe_role moe_tensor_role(const char *name);
/* The same for HF (safetensors) names: model.layers.N.self_attn.q_proj.weight, ...experts... */
moe_role moe_hf_tensor_role(const char *name);
int64_t moe_hf_tensor_layer(const char *name); /* N of "layers.N.", else -1 */
const char *moe_role_name(moe_role role);      /* "routed experts", ... */
const char *moe_role_id(moe_role role);        /* "routed_experts", ... (JSON keys) */
/* N for "blk.N.<rest>", else -1. */
int64_t moe_tensor_layer(const char *name);
/* The name after "blk.N." ("ffn_down_exps.weight"), N in *layer; the whole name (and -1) when it
 * has no such prefix. */
const char *moe_tensor_layer_part(const char *name, int64_t *layer);

/* ==== moe inspect ==== */

typedef struct moe_inspect_type {
    uint32_t type;    /* moe_type (GGUF) or moe_st_dtype (safetensors) */
    const char *name; /* its name, static */
    uint64_t count, bytes;
} moe_inspect_type;

typedef struct moe_inspect_layer {
    int64_t layer;
    uint64_t count, bytes;
    uint64_t role_bytes[MOE_ROLE_COUNT];
} moe_inspect_layer;

/* One run of layers whose tensors of one role use the same formats. */
typedef struct moe_inspect_format {
    moe_role role;
    char *formats;     /* "gate/up IQ2_S, down IQ3_S": parts grouped by type, in file order */
    char *layers;      /* "0-38" or "0-3,7" ; "" for tensors outside any layer */
    uint32_t n_layers; /* 0 for tensors outside any layer */
} moe_inspect_format;

typedef enum moe_layer_kind {
    MOE_LAYER_FULL,    /* full attention: K and V of n_kv heads per token */
    MOE_LAYER_SLIDING, /* sliding-window attention: as full, capped at the window */
    MOE_LAYER_MLA,     /* multi-head latent attention: kv_lora_rank + rope dims per token */
    MOE_LAYER_LINEAR,  /* linear attention (Gated DeltaNet, KDA): fixed state per sequence */
    MOE_LAYER_KIND_COUNT
} moe_layer_kind;
const char *moe_layer_kind_name(moe_layer_kind k);
struct moe_layer_plan;
moe_layer_kind moe_layer_kind_of(const struct moe_layer_plan *p);

/* What the architecture's descriptor (src/model/arch_<name>.c) reads from the metadata. */
typedef struct moe_inspect_plan {
    bool known;     /* moe runs this architecture and its config reads */
    char note[512]; /* why not, when !known */
    uint32_t n_layer, n_layer_nextn;
    uint32_t kind_count[MOE_LAYER_KIND_COUNT]; /* layers by mixer kind */
    uint32_t n_dense_ffn, n_expert_ffn;        /* layers by FFN kind */
    uint32_t n_expert, n_expert_used;
    uint64_t kv_values_per_token;    /* K + V values over all layers (MLA: the latent row) */
    uint64_t index_values_per_token; /* f32 lightning-indexer rows over the indexed layers */
    uint64_t state_values_per_seq;   /* f32 recurrent state over the linear layers */
    uint64_t trunk_routed_bytes;     /* routed experts of the trunk's layers */
    uint64_t nextn_bytes;            /* every tensor of the NextN / MTP layers */
} moe_inspect_plan;

typedef struct moe_inspect_report {
    uint64_t n_tensors;
    /* totals over every shard; tensor + header + padding == file exactly, else !reconciles */
    uint64_t file_bytes, header_bytes, padding_bytes, tensor_bytes;
    bool reconciles;
    moe_inspect_type *types; /* [n_types], most bytes first */
    size_t n_types;
    uint64_t role_count[MOE_ROLE_COUNT], role_bytes[MOE_ROLE_COUNT];
    moe_inspect_layer *layers; /* [n_layers], ascending layer number (blk.N only) */
    size_t n_layers;
    moe_inspect_format *formats; /* [n_formats], by role, then first layer */
    size_t n_formats;
    moe_inspect_plan plan;
} moe_inspect_report;

moe_inspect_report *moe_inspect_analyze(const moe_gguf *g);
/* The same facts of a safetensors checkpoint (HF names; no plan: config.json is not read). */
moe_inspect_report *moe_inspect_analyze_st(const moe_st *s);
void moe_inspect_report_free(moe_inspect_report *r);

/* ==== moe budget: the memory plan of a model on N devices ====
 *
 * Weights by part come from the tensor directory; the KV cache, recurrent state and scratch
 * from the architecture's metadata. Routed experts are sharded across devices as rows of every
 * expert matrix, or as whole experts (split_experts); everything else (attention, shared experts,
 * embeddings, KV cache, state, scratch) is held whole by every device. */

typedef enum moe_budget_part {
    /* the first MOE_ROLE_COUNT parts are the tensor roles (of the trunk), in moe_role order */
    MOE_PART_MTP = MOE_ROLE_COUNT, /* every tensor of the NextN / MTP layers (drafting only) */
    MOE_PART_VISION,               /* v.* / mm.* tensors, or a whole mmproj (clip) file */
    MOE_PART_KV,                   /* KV cache: per token of every stream's context */
    MOE_PART_INDEX,                /* lightning-indexer cache (f32): per token, indexed layers */
    MOE_PART_STATE,                /* linear-attention state: fixed per stream */
    MOE_PART_SCRATCH,              /* activations of one step (estimate, see budget.c) */
    MOE_PART_COUNT
} moe_budget_part;

const char *moe_budget_part_name(moe_budget_part p); /* "routed experts", ..., "KV cache" */
const char *moe_budget_part_id(moe_budget_part p);   /* JSON keys */

/* A routed-expert tensor as the sharding sees it: slices (experts) of rows. */
typedef struct moe_budget_sharded {
    uint64_t rows;      /* rows per expert (ne[1]) */
    uint64_t slices;    /* experts (ne[2] * ne[3]) */
    uint64_t row_bytes; /* bytes of one row */
    bool per_expert;    /* an expert's bias or scale (fewer than 3 dims, not a stacked matrix):
                         * whole experts (split_experts) keep it on every device, as the engine
                         * does */
    bool mtp;           /* of a NextN / MTP layer (counted in MOE_PART_MTP) */
    /* split by rows, as the engine splits them (moe_split_rows_range): the slice of the layer's
     * intermediate (ff values, in the layer's down blocks of ff_block; ff_block 0: the layer has
     * no down projection here, its rows split evenly) is `rows` of gate / up (two halves of a
     * fused gate_up), the input `columns` of down and of the gate / up biases; a down bias or
     * scale is held whole */
    enum {
        MOE_BUDGET_FF_ROWS,
        MOE_BUDGET_FF_FUSED,
        MOE_BUDGET_FF_COLUMNS,
        MOE_BUDGET_FF_WHOLE
    } ff_dim;
    int64_t layer;
    uint32_t type;
    int64_t ff, ff_block;
} moe_budget_sharded;

typedef struct moe_budget_model {
    char *name; /* the path or URL given */
    char *arch;
    uint64_t file_bytes;
    uint64_t n_params;                     /* values of every tensor counted in `weights` */
    uint64_t weights[MOE_PART_VISION + 1]; /* bytes by part: roles, then vision */
    uint64_t params[MOE_PART_VISION + 1];  /* values by part */
    moe_budget_sharded *sharded;           /* [n_sharded] the routed-expert tensors */
    size_t n_sharded;
    uint32_t n_layer;
    moe_layer_kind *kind;   /* [n_layer] */
    uint64_t *k_values;     /* [n_layer] K (or MLA latent + rope) values per token */
    uint64_t *v_values;     /* [n_layer] V values per token (0 for MLA, linear) */
    uint64_t *state_values; /* [n_layer] f32 state values per sequence (linear layers) */
    uint64_t *index_values; /* [n_layer] f32 lightning-indexer values per token */
    uint32_t n_layer_nextn; /* NextN / MTP layers after the trunk (their weights: MOE_PART_MTP) */
    uint64_t mtp_sharded_bytes; /* routed-expert bytes within weights[MOE_PART_MTP] */
    uint64_t window;            /* sliding window in tokens (0: none) */
    uint64_t ctx_train;         /* <arch>.context_length (0: unknown) */
    uint64_t n_embd, n_vocab, n_head, ff_active; /* for the scratch estimate */
    uint32_t n_expert, n_expert_used;            /* routed experts per layer, per token */
} moe_budget_model;

/* Read a model's facts; false with err set when its architecture's keys are missing. */
moe_status moe_budget_model_init(moe_budget_model *m, const moe_gguf *g, const char *name,
                                 moe_error *err);
/* Count every tensor of g (an mmproj / clip file) as the model's vision tower. */
void moe_budget_model_add_vision(moe_budget_model *m, const moe_gguf *g);
void moe_budget_model_free(moe_budget_model *m);

typedef struct moe_budget_config {
    uint32_t devices;
    uint64_t mem_per_device; /* bytes */
    uint64_t ctx;            /* tokens of context per stream */
    uint64_t streams;        /* concurrent sequences */
    moe_type kv_type;        /* F16, F32 or Q8_0 */
    bool vision;             /* count the vision tower */
    uint64_t expert_cache;   /* --expert-cache: routed experts resident at most (0: all) */
    bool split_experts;      /* --split experts: whole experts per device (expert e on device e % N,
                              * as `mpirun -np N moe ... --split experts` runs them); false: rows of
                              * every expert matrix split N ways (--split rows) */
} moe_budget_config;

#define MOE_BUDGET_MAX_DEVICES  4096
#define MOE_BUDGET_PREFILL_ROWS 512 /* rows of one prefill step, for the scratch estimate */
#define MOE_BUDGET_ATTN_TILE    256 /* keys per attention tile, for the scratch estimate */
#define MOE_BUDGET_SEARCH_MAX   (1ull << 30) /* largest context / stream count searched */

typedef struct moe_budget_plan {
    moe_budget_config config;
    uint64_t *device;          /* [devices][MOE_PART_COUNT] bytes */
    uint64_t device_total_max; /* the fullest device */
    int64_t spare;             /* mem_per_device - device_total_max (negative: short) */
    bool fits;
    uint64_t kv_bytes_per_token;     /* full + MLA layers, all of them */
    uint64_t swa_kv_bytes_per_token; /* sliding layers (up to `window` tokens) */
    uint64_t index_bytes_per_token;  /* the indexed MLA layers' indexer rows (f32) */
    uint64_t state_bytes_per_stream;
    uint64_t max_ctx;                /* largest context that fits with config.streams (0: none) */
    uint64_t max_streams;            /* largest stream count that fits at config.ctx (0: none) */
    uint64_t expert_bytes_per_token; /* routed experts one token runs (n_used of n_expert) */
} moe_budget_plan;

void moe_budget_plan_make(const moe_budget_model *m, const moe_budget_config *c,
                          moe_budget_plan *p);
void moe_budget_plan_free(moe_budget_plan *p);
/* A KV element type as --kv-type spells it: "f32", "f16", "q8_0". */
const char *moe_budget_kv_name(moe_type kv_type);
/* Bytes of KV cache a device holds for that context and stream count (without the indexer's). */
uint64_t moe_budget_kv_bytes(const moe_budget_model *m, moe_type kv_type, uint64_t ctx,
                             uint64_t streams);
/* Bytes of lightning-indexer cache (f32 rows of the indexed layers) for that context and
 * stream count. */
uint64_t moe_budget_index_bytes(const moe_budget_model *m, uint64_t ctx, uint64_t streams);

/* ==== Importance matrices (imatrix.c): llama.cpp's GGUF imatrix format ==== */

typedef struct moe_imatrix moe_imatrix;
typedef struct moe_imatrix_entry {
    char *name;    /* the weight's name */
    float *values; /* [n_mat][n_in]: mean squared activation of each input column */
    int64_t n_in, n_mat;
} moe_imatrix_entry;

/* Every "<name>.in_sum2" / "<name>.counts" pair, as sums / counts (ones where a count is 0);
 * NULL with err set (a message naming the file) on a file that is not one. */
moe_imatrix *moe_imatrix_load(const char *path, moe_error *err);
void moe_imatrix_free(moe_imatrix *m);
size_t moe_imatrix_count(const moe_imatrix *m);
const char *moe_imatrix_dataset(const moe_imatrix *m); /* imatrix.datasets[0] or NULL */
uint32_t moe_imatrix_chunks(const moe_imatrix *m);     /* imatrix.chunk_count or 0 */
const moe_imatrix_entry *moe_imatrix_find(const moe_imatrix *m, const char *name);
/* The importance vector of matrix (expert) `mat` (the only one for a 2-D weight). */
const float *moe_imatrix_values(const moe_imatrix_entry *e, int64_t mat);

typedef struct moe_imatrix_params {
    const char *model_path, *text_path, *out_path;
    uint32_t n_ctx;      /* tokens per chunk (0: 512, llama-imatrix's default) */
    uint64_t max_chunks; /* 0: every whole chunk of the text */
    int n_threads;
    bool process_output; /* also the output head (llama-imatrix --process-output) */
    bool progress;       /* a line per chunk on stderr */
} moe_imatrix_params;

typedef struct moe_imatrix_report {
    uint64_t chunks, tokens;
    size_t entries; /* weights with statistics */
} moe_imatrix_report;

/* Run the model over the text in chunks and write the sums of squared matmul inputs per weight
 * and expert, with their counts, as llama-imatrix writes them (general.type "imatrix",
 * imatrix.datasets / chunk_count / chunk_size, <name>.in_sum2 [n_in, n_mat], <name>.counts
 * [1, n_mat]). */
moe_status moe_imatrix_collect(const moe_imatrix_params *p, moe_imatrix_report *r, moe_error *err);

/* ==== moe audit: what quantization cost, measured on chosen rows ====
 *
 * For each selected tensor of the quantized model (and each selected expert of a 3-D expert
 * tensor), the first `rows` rows are dequantized and compared with the same rows of the
 * reference model (same tensor name and shape; F32, F16 or BF16): relative Frobenius error
 * ||Wq - W|| / ||W||, cosine similarity of the flattened rows, and the matvec relative error
 * ||(Wq - W) X|| / ||W X|| for X a [cols x 64] standard-normal draw from moe_audit_normals
 * (seeded; the same X for every tensor with the same row length). Only those rows' bytes are
 * read, by one range per (tensor, expert) and file when the model is remote. */

#define MOE_AUDIT_X_COLS      64
#define MOE_AUDIT_MAX_EXPERTS 4096 /* --experts entries */

typedef struct moe_audit_options {
    const char *tensor_regex; /* POSIX extended regex on names; NULL: every quantized tensor */
    const int64_t *experts;   /* expert indices for 3-D tensors; NULL: expert 0 */
    size_t n_experts;
    uint64_t rows; /* rows per (tensor, expert); 0: all */
    uint64_t seed; /* of X */
    /* the ladder (moe audit --ladder SRC): `quant` is then an F32/F16/BF16 source, `ref` the
     * same model; each selected float matrix's rows are quantized at every rung (with the
     * importance matrix's vector for the tensor and expert, where given) and compared with
     * themselves. A rung whose block does not divide the rows is skipped for that tensor. */
    const moe_type *ladder;
    size_t n_ladder;
    const moe_imatrix *imatrix;
    moe_pool *pool; /* quantizes a rung's rows (NULL: the caller) */
} moe_audit_options;

typedef struct moe_audit_row {
    char *tensor;
    int64_t expert; /* -1 for a 2-D tensor */
    moe_type type, ref_type;
    double bits_per_weight;
    uint64_t rows, cols;
    double rel_fro, cosine, matvec_rel;
} moe_audit_row;

typedef struct moe_audit_report {
    moe_audit_row *rows;
    size_t n_rows;
    size_t n_skipped; /* tensors matching the regex without a usable reference (ladder: also
                       * tensor x rung pairs whose rows are not whole blocks) */
} moe_audit_report;

/* X[c][j] for c < cols, j < MOE_AUDIT_X_COLS, row-major: value i = c * 64 + j is the
 * (i % 2 ? sine : cosine) half of a Box-Muller pair from two uniforms u = ((s >> 11) + 1) / 2^53
 * of consecutive splitmix64 outputs s, the stream starting at `seed` (so a test can redraw it). */
void moe_audit_normals(uint64_t seed, uint64_t cols, double *x);
moe_status moe_audit_run(const moe_gguf *quant, moe_http *quant_http, const moe_gguf *ref,
                         moe_http *ref_http, const moe_audit_options *o, moe_audit_report *r,
                         moe_error *err);
void moe_audit_report_free(moe_audit_report *r);

/* ==== SVG charts (svg.c) ==== */

/* A stacked bar per device (parts, the memory line) and, with several rungs, the ladder: each
 * build's fullest device against the memory per device. Self-contained SVG 1.1 text;
 * caller frees. */
char *moe_budget_svg(const moe_budget_model *const *models, const moe_budget_plan *plans,
                     size_t n_models, bool ladder);
/* ==== Synthetic models (moe synth) ==== */

#define MOE_SYNTH_DEFAULT_SEED 0x6d6f65u /* "moe" */

typedef struct moe_synth_rule {
    const char *pattern; /* POSIX extended regex, searched in the tensor name */
    moe_type type;
} moe_synth_rule;

typedef struct moe_synth_params {
    const char *preset; /* the preset it came from (for messages) */
    const char *arch;   /* general.architecture: any whose keys these fields cover */
    const char *name;   /* general.name; NULL: a default that says the weights are random */
    uint32_t n_vocab, n_ctx, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    uint32_t n_expert, n_expert_used, n_ff_exp; /* 0 experts: dense */
    uint32_t n_dense_lead;                      /* leading layers with a dense FFN */
    uint32_t n_shared_expert;                   /* shared experts of n_ff_exp each */
    uint32_t n_nextn;                           /* NextN/MTP layers appended after n_layer */
    uint32_t rope_dims;         /* rotated dims per head (0: the key omitted, all of them) */
    uint32_t gating;            /* expert_gating_func (0: the key omitted); also writes
                                 * expert_weights_norm = true */
    float expert_weights_scale; /* routed_scaling_factor (0: the key omitted) */
    float rope_base;
    float rms_eps; /* attention.layer_norm_rms_epsilon (0: 1e-6) */
    /* multi-head latent attention (n_lora_kv 0: none): q LoRA rank (0: a plain attn_q), the
     * cached latent width, the per-head q/k and v widths before absorption; key_length and
     * value_length are then the latent layout's (n_lora_kv + rope_dims, n_lora_kv) and
     * rope.dimension_count is written even when 0 */
    uint32_t n_lora_q, n_lora_kv, head_dim_k_mla, head_dim_v_mla;
    /* a KDA hybrid (linear_interval 0: none): every linear_interval-th trunk layer attends, the
     * others are KDA of n_head heads of kda_head_dim with d_conv conv taps; head_count_kv is
     * written per layer (0 in the KDA layers), as llama.cpp's converters mark them */
    uint32_t linear_interval, kda_head_dim, d_conv;
    float kda_gate_bound; /* kda.gate_lower_bound (0: the key omitted) */
    /* hyper-connections (n_hc 0: none): streams, Sinkhorn iterations, epsilon */
    uint32_t n_hc, hc_iters;
    float hc_eps;
    /* the pooled lightning indexer of the attention layers (idx_n_head 0: none) */
    uint32_t idx_n_head, idx_head_dim, idx_top_k, idx_kpool;
    float idx_norm_eps;                         /* attention.layer_norm_epsilon */
    float swiglu_clamp_exp, swiglu_clamp_shexp; /* per-layer SwiGLU limits (0: omitted) */
    /* the optional tensors the architecture binds that the file has (an anchored regular
     * expression over tensor names; NULL: none, so the output head is tied) */
    const char *optional;
    uint64_t seed;
    const moe_synth_rule *rules; /* weight types by name, first match wins; default F32 */
    uint32_t n_rules;
    bool mute_special_output; /* zero the head rows of special and byte tokens (demo) */
    bool random_blocks;       /* quantized tensors: random valid blocks, not quantized floats */
    bool header_only; /* keys and tensor directory only: the data is a hole (a sparse file of
                       * the full size, for inspect and budget on a real layout) */
} moe_synth_params;

/* Fill *out from a named preset (seed MOE_SYNTH_DEFAULT_SEED); false if unknown. */
bool moe_synth_preset(const char *name, moe_synth_params *out);
const char *moe_synth_preset_names(void);
/* A named set of type rules (`--types NAME`): *rules and *n, false if unknown. */
bool moe_synth_rule_set(const char *name, const moe_synth_rule **rules, uint32_t *n);
const char *moe_synth_rule_set_names(void);
/* Write the model: its keys, then every tensor its architecture's descriptor binds (as the
 * engine will load it); refuses types moe cannot quantize, naming the tensor. */
moe_status moe_synth_write(const moe_synth_params *p, const char *path, moe_error *err);

/* ==== Requantizing a model (moe quantize, quantize.c) ==== */

typedef struct moe_quantize_params {
    const char *in, *out;        /* GGUF paths (a split input: any shard; output split below) */
    const char *preset;          /* a mix (moe_quantize_preset_names), or NULL: `type` alone */
    moe_type type;               /* the base type: every quantizable weight no rule/mix picks */
    const moe_synth_rule *rules; /* per-tensor types, first match wins (searched, as written) */
    uint32_t n_rules;
    const char *imatrix_path; /* llama.cpp GGUF imatrix, or NULL */
    int n_threads;
    uint32_t split_max_tensors; /* > 0: shards of at most this many tensors */
    bool progress;              /* progress on stderr (a bar on a terminal, else lines) */
} moe_quantize_params;

typedef struct moe_quantize_report {
    uint32_t n_tensors, n_quantized;
    uint32_t tensors_by_type[MOE_TYPE_COUNT];
    uint64_t bytes_in, bytes_out;
    int file_type; /* general.file_type written (-1: none) */
    double seconds;
} moe_quantize_report;

/* "Q4_K_M, Q5_K_M, IQ4_XS, IQ3_XXS, IQ2_M, ud-iq3_xxs" */
const char *moe_quantize_preset_names(void);
/* The preset's base type; false for an unknown preset. */
bool moe_quantize_preset_base(const char *preset, moe_type *base);
/* Read, requantize and write: refuses (before writing) a type moe cannot quantize, a source it
 * cannot decode, and IQ1 / IQ2 tensors without an importance matrix entry, naming the tensor. */
moe_status moe_quantize_model(const moe_quantize_params *p, moe_quantize_report *r, moe_error *err);

/* ==== Throughput benchmark (moe bench) ==== */

#define MOE_BENCH_MAX_RUNS        64
#define MOE_BENCH_MAX_STREAMS     8         /* stream counts in one invocation */
#define MOE_BENCH_MAX_STREAM_ROWS 256       /* streams decoded together in one test */
#define MOE_BENCH_MAX_DEPTHS      8         /* context depths in one invocation */
#define MOE_BENCH_MAX_DEPTH       (1 << 20) /* tokens of context before a decode test */
#define MOE_BENCH_FILL_ROWS       512 /* rows per forward while filling the context to a depth */
#define MOE_BENCH_MAX_VERIFY      (MOE_SPEC_MAX_DRAFT + 1) /* rows of one verify step */

typedef struct moe_bench_params {
    const char *model_path;
    int n_threads;                      /* forward-pass and probe threads */
    int runs;                           /* timed runs per test, after one warm-up */
    int n_prompt;                       /* prefill test: one forward of this many rows (0: skip) */
    int n_gen;                          /* decode test: this many single-row steps (0: skip) */
    int streams[MOE_BENCH_MAX_STREAMS]; /* batched decode: streams per test */
    int n_streams;
    int stream_steps; /* steps per batched decode test */
    /* tests at depth: a prefill of n_prompt rows and n_gen decode steps after depths[i] tokens
     * of context (ascending; the context is filled once, untimed, MOE_BENCH_FILL_ROWS rows per
     * forward) */
    int depths[MOE_BENCH_MAX_DEPTHS];
    int n_depths;
    bool use_mmap;    /* keep weights in the mapped file instead of anonymous memory */
    bool no_repack;   /* keep the weights in the file's layout (else moe_model_repack, in
                       * anonymous memory, not with exact_too: the exact path has no kernels on
                       * a repacked layout) */
    bool exact_too;   /* each test on the exact path (MOE_EXACT=1) too, its runs alternated with
                       * the fast path's; the figures stay the fast path's */
    moe_type kv_type; /* KV cache elements (default F16, as llama-bench) */
    uint64_t expert_cache_bytes; /* routed experts read on demand into a cache (0: resident) */
    size_t probe_bytes;          /* bandwidth probe buffer */
    int verify_max; /* verify steps of 1..verify_max rows against a 1-row step (0: skip) */
    /* --accept: per draft position, the fraction of steps whose draft there is kept (so each is
     * at most the one before); projects decode rates with 1..n_accept drafts */
    double accept[MOE_SPEC_MAX_DRAFT];
    int n_accept;
    moe_split split;  /* across the ranks of an mpirun job (--split experts|rows) */
    bool split_dense; /* --split-dense: dense FFNs and shared experts split by rows too */
} moe_bench_params;

typedef struct moe_bench_figure {
    double median, min, max; /* tokens per second over the runs */
    double gb_s;             /* median of weight bytes read / seconds */
    double bytes_per_token;  /* weight bytes read per token, mean over the runs */
    /* with exact_too: the same on the exact path (0 when not run) */
    double exact_median, exact_min, exact_max, exact_gb_s;
} moe_bench_figure;
/* Median and range of v[0..n) (sorts v): what each figure reports of its runs. */
void moe_bench_median_range(double *v, int n, double *median, double *lo, double *hi);

typedef struct moe_bench_stream {
    int n; /* streams decoded together */
    moe_bench_figure aggregate;
    double per_stream_tok_s; /* aggregate median / n */
} moe_bench_stream;

typedef struct moe_bench_result {
    const char *isa; /* the kernel table in use */
    int threads, runs;
    bool in_memory; /* weights copied to anonymous memory (not --mmap) */
    uint64_t loaded_bytes;
    double load_seconds;
    char arch[32];
    uint32_t n_layer, n_expert, n_expert_used, moe_layers;
    moe_bandwidth bandwidth;
    double dense_bytes;       /* weights outside routed experts, read by every forward */
    double embd_row_bytes;    /* one embedding row, read per token */
    double expert_bytes;      /* one routed expert of one layer (gate + up + down) */
    double experts_per_token; /* routed experts run per token and MoE layer in the decode test */
    double active_bytes_per_token; /* decode, one stream: dense + embedding row + experts run */
    moe_bench_figure pp, tg;
    moe_bench_stream streams[MOE_BENCH_MAX_STREAMS];
    int n_streams;
    /* verify steps (speculative decoding's cost): a plain 1-row step, then verify steps of k =
     * 1..n_verify rows of one sequence, each followed by keeping only its first row (the rollback
     * of refused drafts included); figures in steps per second */
    moe_bench_figure verify_base, verify[MOE_BENCH_MAX_VERIFY];
    int n_verify;
    double verify_ratio[MOE_BENCH_MAX_VERIFY]; /* seconds of a k-row verify step / a 1-row step */
    /* with --accept: the decode rate projected with d = 1..n_accept drafts per step:
     * verify_base x (1 + accept[0] + ... + accept[d - 1]) / verify_ratio[d] */
    double projected_tok_s[MOE_SPEC_MAX_DRAFT];
    int n_projected;
    moe_bench_figure pp_depth[MOE_BENCH_MAX_DEPTHS]; /* prefill at params.depths[i] */
    moe_bench_figure tg_depth[MOE_BENCH_MAX_DEPTHS]; /* decode at params.depths[i] */
    /* ... of which, per token (mean over every step at that depth, the warm-up's too), in the
     * sparse MLA layers: scoring the indexer's pools, and attending */
    double score_ms[MOE_BENCH_MAX_DEPTHS], attend_ms[MOE_BENCH_MAX_DEPTHS];
    double fill_seconds; /* filling the context to the last depth */
    /* with --expert-cache: the cache over the decode test, and the disk it reads from */
    moe_expert_cache_stats tg_cache; /* counters of the tg test's steps (warm-up included) */
    double tg_cache_tokens;          /* tokens those steps made */
    /* under mpirun with a split: the decode test's time split (warm-up included) */
    int ranks;              /* 1: alone */
    double tg_seconds;      /* the decode test's steps, in all */
    moe_dist_times tg_dist; /* of those, in the ranks' reductions */
    double disk_mib_s;      /* sequential read of the model file (its own probe) */
    bool disk_direct;       /* ... with O_DIRECT (else through the page cache) */
} moe_bench_result;

/* Defaults: 1 thread, 5 runs, pp 512, tg 128, streams 1 2 4 8 of 32 steps, verify steps of 1..4
 * rows (stream_steps each), anonymous memory. */
void moe_bench_params_default(moe_bench_params *p);
moe_status moe_bench_run(const moe_bench_params *p, moe_bench_result *r, moe_error *err);

/* A latency distribution (moe bench --server): histograms of time to first token and of the
 * time between tokens, p50 and p99 marked. Self-contained SVG 1.1 text; caller frees. */
struct moe_bench_server_result;
char *moe_latency_svg(const struct moe_bench_server_result *r, const char *subtitle);

/* ==== Load benchmark of a running server (moe bench --server, bench_server.c) ====
 *
 * `concurrency` streaming /v1/completions requests at once, each for exactly `tokens` tokens
 * (ignore_eos), `repeats` times. Per repeat: output tokens / wall time. Over all requests: time
 * to first token (request sent -> first streamed chunk) and inter-token latency (between a
 * request's chunks), p50 and p99. A request is an error when the transfer or the status fails
 * or it streams other than `tokens` tokens. With start_cmd, the server is started by /bin/sh
 * first and time to ready is from its start to the first 200 from /health; it is stopped
 * (SIGTERM to its process group) at the end. */

#define MOE_BENCH_SERVER_MAX_CONCURRENCY 1024

typedef struct moe_bench_server_params {
    const char *url;       /* http://host:port (no trailing path) */
    const char *api_key;   /* or NULL */
    const char *start_cmd; /* or NULL */
    const char *prompt;    /* each request's prompt, its index prefixed ("17: ...") */
    int concurrency, tokens, repeats;
    double ready_timeout_s; /* for start_cmd */
} moe_bench_server_params;

typedef struct moe_bench_server_result {
    int requests, errors;
    uint64_t output_tokens;
    moe_bench_figure tok_s; /* output tok/s per repeat: median, min, max (gb_s unused) */
    double ttft_p50, ttft_p99, itl_p50, itl_p99; /* seconds */
    double time_to_ready_s;                      /* < 0: no start_cmd */
    double *ttft, *itl;                          /* every sample, sorted */
    size_t n_ttft, n_itl;
    char first_error[512];
} moe_bench_server_result;

void moe_bench_server_params_default(moe_bench_server_params *p);
moe_status moe_bench_server_run(const moe_bench_server_params *p, moe_bench_server_result *r,
                                moe_error *err);
void moe_bench_server_result_free(moe_bench_server_result *r);

/* ==== moe eval: labels by probability, paired comparisons, KL divergence (eval.c) ==== */

#define MOE_EVAL_MAX_LABELS        64          /* candidate labels of one record */
#define MOE_EVAL_MAX_LINE          (16u << 20) /* one record's JSON line */
#define MOE_EVAL_MAX_RECORDS       10000000    /* records in one file */
#define MOE_EVAL_ROWS              128 /* rows per forward call: the logits buffer is [rows][n_vocab] */
#define MOE_EVAL_DEFAULT_RESAMPLES 10000
#define MOE_EVAL_MIN_RESAMPLES     2000
/* labels scored side by side: each holds a copy of the prompt's KV cache, so 64 labels of a long
 * prompt would cost 64 caches */
#define MOE_EVAL_LABEL_SEQS 8

/* One record of a --records file (a JSON object per line): "prompt" (text) or "messages" (an
 * OpenAI-style chat, rendered with the model's chat template and its generation prompt);
 * "labels" (2..MOE_EVAL_MAX_LABELS strings); optional "id", "answer" (the right label's index,
 * or its text) and "options" (one string per label: the text "{options}" in the prompt or in
 * a message's content becomes one line per label, "<label without surrounding spaces>. <option>",
 * which --reverse-options lists in reverse order for three-label records). */
typedef struct moe_eval_record {
    char *id;       /* "id" (a string or a number's text), else the line number */
    size_t line;    /* 1-based line of the file */
    char *prompt;   /* with "{options}" filled in; NULL for a chat record */
    char *messages; /* chat: the messages array as JSON text, options filled in; else NULL */
    char **labels;  /* [n_labels] */
    uint32_t n_labels;
    int32_t answer; /* index into labels, -1 when not given */
    bool reversed;  /* the --reverse-options copy of the record before it */
} moe_eval_record;

/* Read every record; with reverse_options each three-label record with options is followed by
 * its reversed copy (options in reverse order, the answer index mirrored). Errors name the
 * file, the line and the field. */
moe_status moe_eval_records_read(const char *path, bool reverse_options, moe_eval_record **out,
                                 size_t *n, moe_error *err);
void moe_eval_records_free(moe_eval_record *r, size_t n);

/* What a scorer makes of a record: the label whose tokens have the highest summed
 * log-probability after the prompt's tokens. Prompt tokens: the text with the vocabulary's BOS
 * and special tokens parsed (a chat: the template's rendering); label tokens: the label's text
 * alone, special tokens parsed, no BOS -- so `/tokenize` of a server gives the same ids. */
typedef struct moe_eval_score {
    double logprob[MOE_EVAL_MAX_LABELS];    /* sum over the label's tokens */
    uint32_t n_tokens[MOE_EVAL_MAX_LABELS]; /* the label's tokens */
    uint32_t n_prompt;                      /* the prompt's tokens */
    int32_t pred;                           /* the highest sum (the first of equals) */
    /* the ids scored (malloc'd; moe_eval_score_free): prompt, then each label's */
    int32_t *prompt_ids;
    int32_t *label_ids[MOE_EVAL_MAX_LABELS];
} moe_eval_score;

void moe_eval_score_free(moe_eval_score *s);

typedef struct moe_eval_scorer moe_eval_scorer;

typedef struct moe_eval_engine_params {
    int n_threads;
    moe_type kv_type;          /* KV cache elements (F32: exact) */
    const char *chat_template; /* a .jinja file over the model's own template, or NULL */
    bool no_repack;            /* the weights in the file's layout (else moe_model_repack) */
} moe_eval_engine_params;

/* The engine: prompts run once per record, then the labels' rows batched together (a sequence
 * per label, up to MOE_EVAL_LABEL_SEQS at once, the prompt's KV copied into each). The context
 * is sized for the records given. */
moe_eval_scorer *moe_eval_scorer_engine(const char *model_path, const moe_eval_engine_params *p,
                                        const moe_eval_record *records, size_t n_records,
                                        moe_error *err);
/* An OpenAI-compatible server at url (its root or its /v1): ids from POST /tokenize
 * ({"content", "add_special"} as llama-server and `moe serve` read it, and vLLM's "prompt",
 * "add_special_tokens"), chat prompts from POST
 * /apply-template, and each label's log-probabilities from POST /v1/completions with the
 * prompt and label ids, "echo": true, "logprobs": 0, "max_tokens": 1 (the generated token is
 * ignored). api_key and model may be NULL. */
moe_eval_scorer *moe_eval_scorer_url(const char *url, const char *api_key, const char *model,
                                     moe_error *err);
/* Score one record into *out (free it with moe_eval_score_free, also after a failure). */
moe_status moe_eval_scorer_run(moe_eval_scorer *s, const moe_eval_record *r, moe_eval_score *out,
                               moe_error *err);
void moe_eval_scorer_free(moe_eval_scorer *s);

/* One line of a labels results file, as `moe eval compare` reads it back. */
typedef struct moe_eval_result {
    char *id;
    bool reversed;
    int32_t pred, answer; /* answer -1: unknown */
} moe_eval_result;

moe_status moe_eval_results_read(const char *path, moe_eval_result **out, size_t *n,
                                 moe_error *err);
void moe_eval_results_free(moe_eval_result *r, size_t n);

/* Paired bootstrap of accuracy(B) - accuracy(A) over the records both files scored with a
 * known answer (paired by id and reversed). Resample r = 0..resamples-1 draws n indices in
 * turn, index = moe_rng_u64(&state) % n with state starting at `seed` (splitmix64, one stream
 * for all resamples); its difference is (sum over the draws of correct_B - correct_A) / n. The
 * interval is the 2.5 and 97.5 percentiles of the sorted differences, linearly interpolated at
 * q * (resamples - 1) (numpy's default percentile). */
typedef struct moe_eval_compare {
    size_t n;                  /* paired records with an answer */
    size_t n_only_a, n_only_b; /* records in one file only (not compared) */
    size_t correct_a, correct_b;
    double acc_a, acc_b, diff, ci_low, ci_high;
    uint32_t resamples;
    uint64_t seed;
    size_t a_right_b_wrong, a_wrong_b_right, pred_changed;
    char **flipped; /* [n_flipped] ids whose correctness differs ("id (reversed)") */
    size_t n_flipped;
} moe_eval_compare;

moe_status moe_eval_compare_run(const moe_eval_result *a, size_t n_a, const moe_eval_result *b,
                                size_t n_b, uint32_t resamples, uint64_t seed,
                                moe_eval_compare *out, moe_error *err);
void moe_eval_compare_free(moe_eval_compare *c);

/* KL(REF || MODEL) per token as llama-perplexity --kl-divergence reports it: the tokens
 * (BOS added as the vocabulary asks) cut into chunks of n_ctx, each chunk's first token made
 * BOS when the vocabulary adds one, and in each chunk the positions n_ctx/2 .. n_ctx-2 scored
 * against the token after them: KL = sum_i p_ref(i) (log p_ref(i) - log p(i)) over the whole
 * vocabulary in double (llama.cpp skips p_ref below e^-16 and stores the reference at 16 bits),
 * nll = -log p(next), top-1 agreement = the two argmaxes (first of equals) agree. */
typedef struct moe_eval_kl_params {
    const char *model, *ref;
    const char *text_path; /* text to tokenize, or NULL when tokens are given */
    const int32_t *tokens; /* token ids as given (no BOS added) */
    size_t n_tokens;
    uint32_t n_ctx; /* chunk length (default 512) */
    int n_threads;
    moe_type kv_type;
    bool no_repack; /* both models in the file's layout (else moe_model_repack) */
} moe_eval_kl_params;

typedef struct moe_eval_kl {
    size_t n_text_tokens; /* the whole text's tokens */
    uint32_t n_ctx, n_chunks;
    size_t n_scored; /* positions scored */
    double kl_mean, kl_median, kl_p90, kl_p95, kl_p99, kl_p999, kl_max, kl_min;
    double top1_agreement; /* fraction */
    double ppl, ppl_ref;   /* exp(mean nll) of each */
    double *kl;            /* [n_scored] per position, sorted ascending */
} moe_eval_kl;

moe_status moe_eval_kl_run(const moe_eval_kl_params *p, moe_eval_kl *out, moe_error *err);
void moe_eval_kl_free(moe_eval_kl *k);
/* Linear interpolation at q * (n - 1) over sorted values (q in [0, 1]). */
double moe_eval_percentile(const double *sorted, size_t n, double q);

/* ==== Demo model ==== */

/* Path of the built-in demo model, generating it into the cache directory
 * ($XDG_CACHE_HOME/moe, else ~/.cache/moe) on first use. Caller frees. Its weights are random
 * (seeded, so every machine gets the same file): it exercises the engine, it does not talk. */
char *moe_demo_model_path(moe_error *err);
/* Write the demo model to `path` (what moe_demo_model_path does on a cache miss). */
moe_status moe_demo_model_write(const char *path, moe_error *err);

/* ==== moe repack: a QAT bf16 checkpoint to Q4_0 GGUF or compressed-tensors W4A16 ==== */

typedef enum moe_repack_target { MOE_REPACK_Q4_0_GGUF, MOE_REPACK_W4A16 } moe_repack_target;

typedef struct moe_repack_options {
    moe_repack_target to;
    int workers;              /* threads recovering groups; 0: every core */
    bool progress;            /* a progress bar on stderr */
    uint64_t max_shard_bytes; /* W4A16: data bytes per safetensors shard (0: one file) */
    const char *vocab_from;   /* GGUF: copy the tokenizer.* keys of this GGUF (NULL: none) */
} moe_repack_options;

/* A quantizable tensor kept at source precision because groups of it are off the grid. */
typedef struct moe_repack_offgrid {
    char name[256];
    uint64_t groups;     /* groups off the grid */
    int64_t first_group; /* the first of them */
} moe_repack_offgrid;

typedef struct moe_repack_report {
    uint64_t groups;         /* groups of 32 in the quantizable tensors */
    uint64_t groups_by_m[9]; /* groups recovered with step max|w|/m ([0]: all-zero groups) */
    uint64_t offgrid_groups;
    moe_repack_offgrid *offgrid; /* [n_offgrid] */
    size_t n_offgrid;
    uint64_t n_quantized, n_copied; /* source tensors (copied includes the off-grid ones) */
    uint64_t n_skipped;             /* GGUF: vision / audio tensors (mmproj), not written */
    uint64_t copied_bytes, bytes_in, bytes_out;
    uint64_t embd_rows_dropped; /* GGUF: token_embd rows past tokenizer.json's vocabulary */
    double seconds;
} moe_repack_report;

/* SRC: a safetensors checkpoint with config.json (HF layout). OUT: a .gguf file (gemma4's names
 * and metadata, as llama.cpp's converter writes them) or a directory (model.safetensors +
 * config.json with quantization_config, tokenizer files copied). One tensor in memory at a
 * time. The report is filled also on failure as far as the work went. */
moe_status moe_repack(const char *src, const char *out, const moe_repack_options *o,
                      moe_repack_report *r, moe_error *err);
void moe_repack_report_free(moe_repack_report *r);

#define MOE_REPACK_MAX_MESSAGES 10
typedef struct moe_repack_check {
    uint64_t groups, bad_groups;
    uint64_t tensors_quantized, tensors_copied, copied_bytes, skipped;
    uint64_t mismatches; /* bad groups + bad copies + missing / extra tensors */
    double
        worst_scale_rel; /* max |stored scale - least-squares step of the stored levels| / step */
    char worst_scale_tensor[340];
    char messages[MOE_REPACK_MAX_MESSAGES][512]; /* the first mismatches, naming tensor and group */
    int n_messages;
    double seconds;
} moe_repack_check;

/* Reread SRC and OUT (as moe_repack wrote it) and check every group (each stored level is the
 * source value's rank on the stored grid and reproduces it exactly) and every copied tensor. A
 * file that cannot be read is an error; mismatches are counted in v (the caller exits non-zero). */
moe_status moe_repack_verify(const char *src, const char *out, int workers, moe_repack_check *v,
                             moe_error *err);

#endif
