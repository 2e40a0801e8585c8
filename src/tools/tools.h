/* tools: the audit and maintenance tools behind `moe inspect` (and later budget, audit, repack,
 * bench, eval, synth) and the built-in demo model. Each computes facts into a struct; cli/ prints them as text or JSON.
 *
 * The trap: a tensor's role comes from its llama.cpp name alone (`blk.N.ffn_up_exps.weight`),
 * so a file with unconventional names lands in "norms/other" -- never guess from shapes. */
#ifndef MOE_TOOLS_H
#define MOE_TOOLS_H

#include <stdbool.h>
#include <stdint.h>

#include "../base/base.h"
#include "../format/format.h"

/* ==== Tensor roles, from llama.cpp tensor names ==== */

typedef enum moe_role {
    MOE_ROLE_ROUTED_EXPERTS, /* *_exps*: the MoE experts a router chooses among */
    MOE_ROLE_SHARED_EXPERTS, /* *_shexp*: experts every token runs */
    MOE_ROLE_ATTENTION,      /* attn_* (MLA's attn_kv_a_mqa, attn_q_a/b, attn_k_b/v_b too) and
                                linear attention ssm_*: the token mixers */
    MOE_ROLE_DENSE_FFN,      /* ffn_gate/up/down(/gate_up) outside the experts */
    MOE_ROLE_EMBEDDINGS,     /* token_embd, output (embeddings and the LM head) */
    MOE_ROLE_OTHER,          /* norms, routers (ffn_gate_inp), biases of the above, the rest */
    MOE_ROLE_COUNT
} moe_role;

moe_role moe_tensor_role(const char *name);
const char *moe_role_name(moe_role role); /* "routed experts", ... */
const char *moe_role_id(moe_role role);   /* "routed_experts", ... (JSON keys) */
/* N for "blk.N.<rest>", else -1. */
int64_t moe_tensor_layer(const char *name);

/* ==== moe inspect ==== */

typedef struct moe_inspect_type {
    uint32_t type;
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
} moe_inspect_report;

moe_inspect_report *moe_inspect_analyze(const moe_gguf *g);
void moe_inspect_report_free(moe_inspect_report *r);

/* ==== Synthetic models (moe synth) ==== */

#define MOE_SYNTH_DEFAULT_SEED 0x6d6f65u /* "moe" */

typedef struct moe_synth_rule {
    const char *pattern; /* POSIX extended regex, searched in the tensor name */
    moe_type type;
} moe_synth_rule;

typedef struct moe_synth_params {
    const char *preset;        /* the preset it came from (for messages) */
    const char *arch;          /* "llama" or "qwen3moe" */
    const char *name;          /* general.name; NULL: a default that says the weights are random */
    uint32_t n_vocab, n_ctx, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    uint32_t n_expert, n_expert_used, n_ff_exp; /* 0 experts: dense */
    float rope_base;
    uint64_t seed;
    const moe_synth_rule *rules; /* weight types by name, first match wins; default F32 */
    uint32_t n_rules;
    bool mute_special_output;  /* zero the head rows of special and byte tokens (demo) */
} moe_synth_params;

/* Fill *out from a named preset (seed MOE_SYNTH_DEFAULT_SEED); false if unknown. */
bool moe_synth_preset(const char *name, moe_synth_params *out);
const char *moe_synth_preset_names(void);
/* Write the model; refuses types moe cannot quantize, naming the tensor. */
moe_status moe_synth_write(const moe_synth_params *p, const char *path, moe_error *err);

/* ==== Demo model ==== */

/* Path of the built-in demo model, generating it into the cache directory
 * ($XDG_CACHE_HOME/moe, else ~/.cache/moe) on first use. Caller frees. Its weights are random
 * (seeded, so every machine gets the same file): it exercises the engine, it does not talk. */
char *moe_demo_model_path(moe_error *err);
/* Write the demo model to `path` (what moe_demo_model_path does on a cache miss). */
moe_status moe_demo_model_write(const char *path, moe_error *err);

#endif
