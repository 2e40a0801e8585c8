/* hf.c: a Hugging Face checkpoint (config.json, safetensors, tokenizer files) seen as the GGUF
 * llama.cpp's converter would write from it -- the converter's metadata keys, tensor names and
 * tensor edits -- so the engine and every tool read one model description, and `moe repack`
 * writes the same keys and names to a file (one table for both).
 *
 * Architectures: gemma4 (conversion/gemma.py, Gemma4Model: names renamed, norms stored as they
 * are used, token_embd cut to the tokenizer's size, rope_freqs made from the config) and llama
 * (conversion/llama.py, LlamaModel: q / k rows permuted from HF's rotate-half order to ggml's
 * adjacent pairs, per head; rope scaling linear only) and qwen3moe (conversion/qwen.py,
 * Qwen3MoeModel: one tensor per expert stacked into *_exps) and qwen35 (conversion/qwen.py,
 * Qwen3_5TextModel: norms 1 + w, A_log to -exp(A_log), conv1d squeezed, the linear attention's
 * value heads from HF's grouped order to ggml's tiled one, the mtp.* block as the last layer's
 * NextN tensors). moe repack writes gemma4's. The edits (tensor_edit) are row and column
 * reorderings and value changes applied as each row is filled. Tensors:
 * bf16 / f16 / f32 weights stay in their type (1-D tensors, norms and the router become F32, as
 * the converter writes them). compressed-tensors W4A16 modules become Q4_0 without loss: a Q4_0
 * block is an f16 scale and the 32 levels + 8 of the same symmetric int4 grid, so a module
 * converts exactly when every bf16 scale is an f16 number (bf16's 8 mantissa bits fit f16's 11;
 * only the exponent range can fail: past 65504, or below 2^-14 where f16 subnormals drop bits;
 * checked scale by scale). A module with a scale outside
 * f16 is dequantized to F32 instead (exact too) and named on stderr. Experts written one tensor
 * or module per expert (P.experts.E.gate_proj / up_proj / down_proj, as HF qwen3moe and moe
 * repack's W4A16 write them) are stacked into one tensor (gemma4: gate and up fused); a stack
 * mixing modules and plain tensors is F32. The tokenizer travels as tokenizer.json's text under
 * tokenizer.huggingface.json (the GGUF spec's key) and tokenizer_config.json's under
 * tokenizer.huggingface.config (text/ reads both); the chat template from tokenizer_config.json
 * or chat_template.jinja becomes tokenizer.chat_template.
 * The trap: the view holds every weight in anonymous memory (converted or copied), as
 * moe_gguf_to_memory does for a GGUF file, and has no file of its own to read experts from. */
#include "format.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool is_float(moe_st_dtype d) {
    return d == MOE_ST_BF16 || d == MOE_ST_F16 || d == MOE_ST_F32;
}
static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* ==== Tensor edits: the converter's reorderings and value changes ==== */

/* A reordering of one axis (rows, or the values of a row) as the converter makes it: from
 * index `first` to the axis's end, each run of a x b x c indices is an [a][b][c] array in the
 * checkpoint and its [b][a][c] transpose in the GGUF. a == 0: the axis keeps its order. */
typedef struct axis_perm {
    int64_t first, a, b, c;
} axis_perm;

typedef enum value_edit {
    EDIT_NONE,
    EDIT_NEG_EXP,  /* -exp(x): a linear-attention A_log stored as A */
    EDIT_PLUS_ONE, /* 1 + x: a norm whose model multiplies by (1 + weight) */
} value_edit;

/* What the converter does to one tensor beyond renaming it. Values are edited in f32 (bf16
 * sources widened first, as the converter does before its edits; an f16 source's result is
 * rounded to f16, since the converter computes on f16 tensors in f16). */
typedef struct tensor_edit {
    axis_perm rows, cols;
    value_edit value;
    bool squeeze; /* dimensions of 1 dropped (torch's squeeze) */
} tensor_edit;

/* The source index of output index i along an axis reordered by p. */
static int64_t perm_source(const axis_perm *p, int64_t i) {
    if (!p->a || i < p->first) return i;
    const int64_t run = p->a * p->b * p->c, k = (i - p->first) % run, q = k / p->c;
    return i - k + ((q % p->a) * p->b + q / p->a) * p->c + k % p->c;
}

/* ==== Names and metadata: gemma4 (llama.cpp conversion/gemma.py, Gemma4Model) ==== */

typedef struct name_pair {
    const char *hf, *gguf; /* a layer's tensor after "layers.N." -> after "blk.N." */
} name_pair;

/* The names every architecture shares (llama.cpp's tensor_mapping.py is one table for all);
 * an architecture's own table is searched first. */
static const name_pair common_layer_names[] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
};

static const name_pair gemma4_layer_names[] = {
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
    {"post_feedforward_layernorm_1.weight", "post_ffw_norm_1.weight"},
    {"pre_feedforward_layernorm_2.weight", "pre_ffw_norm_2.weight"},
    {"post_feedforward_layernorm_2.weight", "post_ffw_norm_2.weight"},
    {"router.proj.weight", "ffn_gate_inp.weight"},
    {"router.scale", "ffn_gate_inp.scale"},
    {"router.per_expert_scale", "ffn_down_exps.scale"},
    {"experts.gate_up_proj", "ffn_gate_up_exps.weight"},
    {"experts.down_proj", "ffn_down_exps.weight"},
    {"layer_scalar", "layer_output_scale.weight"},
};

/* The GGUF name of an HF tensor into out, with a layer's names from table[n] (then the common
 * ones): 0 when mapped, 1
 * when the converter leaves it out (the vision / audio towers, which go to an mmproj file;
 * rotary inv_freq buffers), -1 when unknown. */
static int map_name(const name_pair *table, size_t n, const char *hf, char *out, size_t cap) {
    const char *p = hf;
    if (strncmp(p, "model.language_model.", 21) == 0)
        p += 21;
    else if (strncmp(p, "model.", 6) == 0)
        p += 6;
    else if (strcmp(p, "lm_head.weight") == 0)
        return snprintf(out, cap, "output.weight"), 0;
    if (strstr(hf, "vision") || strstr(hf, "visual.") || strstr(hf, "audio") ||
        ends_with(hf, "rotary_emb.inv_freq"))
        return 1;
    if (strcmp(p, "embed_tokens.weight") == 0) return snprintf(out, cap, "token_embd.weight"), 0;
    if (strcmp(p, "norm.weight") == 0) return snprintf(out, cap, "output_norm.weight"), 0;
    if (strncmp(p, "layers.", 7) != 0) return -1;
    char *end;
    long layer = strtol(p + 7, &end, 10);
    if (end == p + 7 || *end != '.' || layer < 0) return -1;
    const size_t n_common = sizeof common_layer_names / sizeof common_layer_names[0];
    for (size_t i = 0; i < n + n_common; i++) {
        const name_pair *pair = i < n ? &table[i] : &common_layer_names[i - n];
        if (strcmp(end + 1, pair->hf) == 0) {
            snprintf(out, cap, "blk.%ld.%s", layer, pair->gguf);
            return 0;
        }
    }
    return -1;
}

int moe_hf_gguf_name(const char *hf, char *out, size_t cap) {
    return map_name(gemma4_layer_names, sizeof gemma4_layer_names / sizeof gemma4_layer_names[0],
                    hf, out, cap);
}

/* The HF config: text_config when the checkpoint is multimodal, else the top level. */
static json_t *text_config(json_t *config) {
    json_t *t = json_object_get(config, "text_config");
    return json_is_object(t) ? t : config;
}

/* First of the keys present in c, as a number. */
static bool cfg_num(json_t *c, const char *const *keys, double *out) {
    for (; *keys; keys++) {
        json_t *v = json_object_get(c, *keys);
        if (json_is_number(v)) {
            *out = json_number_value(v);
            return true;
        }
    }
    return false;
}

#define CFG_KEYS(...) ((const char *const[]){__VA_ARGS__, NULL})

typedef struct gguf_meta_ctx {
    moe_gguf_writer *w;
    json_t *c;
    const char *path;
    moe_error *err;
    moe_status st;
} gguf_meta_ctx;

/* key = the first config key present, as u32 / f32; missing: an error naming both. */
static double need(gguf_meta_ctx *m, const char *const *keys) {
    double v = 0;
    if (!cfg_num(m->c, keys, &v))
        m->st = moe_error_set(m->err, MOE_ERR_FORMAT, "%s: config has no \"%s\"", m->path, keys[0]);
    return v;
}
static void meta_u32(gguf_meta_ctx *m, const char *key, const char *const *cfg_keys) {
    double v = need(m, cfg_keys);
    moe_gguf_writer_set_u32(m->w, key, (uint32_t)v);
}
static void meta_f32(gguf_meta_ctx *m, const char *key, const char *const *cfg_keys) {
    double v = need(m, cfg_keys);
    moe_gguf_writer_set_f32(m->w, key, (float)v);
}

/* rope_parameters[kind].rope_theta (the transformers 5 layout), else rope_theta. */
static double rope_theta(json_t *c, const char *kind, double fallback) {
    json_t *params = json_object_get(c, "rope_parameters"); /* per kind, or one for all (NULL) */
    json_t *v = json_object_get(kind ? json_object_get(params, kind) : params, "rope_theta");
    if (json_is_number(v)) return json_number_value(v);
    v = json_object_get(c, "rope_theta");
    return json_is_number(v) ? json_number_value(v) : fallback;
}
static double partial_rotary(json_t *c, const char *kind) {
    json_t *v = json_object_get(json_object_get(json_object_get(c, "rope_parameters"), kind),
                                "partial_rotary_factor");
    return json_is_number(v) ? json_number_value(v) : 1.0;
}

/* The checkpoint's directory name: general.name, as the converter takes it. */
static void dir_name(const char *dir, char *out, size_t cap) {
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    size_t start = len;
    while (start > 0 && dir[start - 1] != '/') start--;
    snprintf(out, cap, "%.*s", (int)(len - start), dir + start);
}

/* The keys llama.cpp's converter writes for gemma4 (Gemma3Model + Gemma4Model
 * set_gguf_parameters), from the HF config; the tokenizer's keys are not written (see README). */
moe_status moe_hf_write_metadata(moe_gguf_writer *w, json_t *config, const char *path,
                                 moe_error *err) {
    json_t *c = text_config(config);
    gguf_meta_ctx m = {w, c, path, err, MOE_OK};
    json_t *types = json_object_get(c, "layer_types");
    size_t n_layer = json_array_size(types);
    double blocks = need(&m, CFG_KEYS("num_hidden_layers"));
    if (m.st == MOE_OK && (!json_is_array(types) || n_layer != (size_t)blocks))
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: layer_types must list the %zu layers' attention kinds", path,
                             (size_t)blocks);
    moe_gguf_writer_set_str(w, "general.architecture", "gemma4");
    moe_gguf_writer_set_str(w, "general.type", "model");
    char name[256];
    dir_name(path, name, sizeof name);
    moe_gguf_writer_set_str(w, "general.name", name);
    meta_u32(&m, "gemma4.block_count", CFG_KEYS("num_hidden_layers"));
    meta_u32(&m, "gemma4.context_length", CFG_KEYS("max_position_embeddings"));
    meta_u32(&m, "gemma4.embedding_length", CFG_KEYS("hidden_size"));
    meta_u32(&m, "gemma4.feed_forward_length", CFG_KEYS("intermediate_size"));
    meta_u32(&m, "gemma4.attention.head_count", CFG_KEYS("num_attention_heads"));
    moe_gguf_writer_set_f32(w, "gemma4.rope.freq_base",
                            (float)rope_theta(c, "full_attention", 1e6));
    moe_gguf_writer_set_f32(w, "gemma4.rope.freq_base_swa",
                            (float)rope_theta(c, "sliding_attention", 1e4));
    meta_f32(&m, "gemma4.attention.layer_norm_rms_epsilon", CFG_KEYS("rms_norm_eps"));
    double v;
    if (cfg_num(c, CFG_KEYS("num_experts", "num_local_experts"), &v)) /* absent: a dense model */
        moe_gguf_writer_set_u32(w, "gemma4.expert_count", (uint32_t)v);
    if (cfg_num(c, CFG_KEYS("top_k_experts", "num_experts_per_tok"), &v))
        moe_gguf_writer_set_u32(w, "gemma4.expert_used_count", (uint32_t)v);
    if (cfg_num(c, CFG_KEYS("final_logit_softcapping"), &v) && v != 0)
        moe_gguf_writer_set_f32(w, "gemma4.final_logit_softcapping", (float)v);
    meta_u32(&m, "gemma4.attention.sliding_window", CFG_KEYS("sliding_window"));
    meta_u32(&m, "gemma4.attention.shared_kv_layers", CFG_KEYS("num_kv_shared_layers"));
    moe_gguf_writer_set_u32(w, "gemma4.embedding_length_per_layer_input",
                            cfg_num(c, CFG_KEYS("hidden_size_per_layer_input"), &v) ? (uint32_t)v
                                                                                    : 0);
    uint8_t *swa = moe_xcalloc(n_layer + 1, 1);
    int32_t *kv = moe_xcalloc(n_layer + 1, sizeof *kv);
    double kv_swa = need(&m, CFG_KEYS("num_key_value_heads"));
    double kv_full = kv_swa;
    bool kv_array = cfg_num(c, CFG_KEYS("num_global_key_value_heads"), &kv_full);
    for (size_t i = 0; i < n_layer; i++) {
        const char *k = json_string_value(json_array_get(types, i));
        swa[i] = k && strcmp(k, "sliding_attention") == 0;
        kv[i] = (int32_t)(swa[i] ? kv_swa : kv_full);
    }
    moe_gguf_writer_set_arr(w, "gemma4.attention.sliding_window_pattern", MOE_GGUF_BOOL, swa,
                            n_layer);
    double head_full = need(&m, CFG_KEYS("global_head_dim"));
    double head_swa = need(&m, CFG_KEYS("head_dim"));
    moe_gguf_writer_set_u32(w, "gemma4.attention.key_length", (uint32_t)head_full);
    moe_gguf_writer_set_u32(w, "gemma4.attention.value_length", (uint32_t)head_full);
    moe_gguf_writer_set_u32(w, "gemma4.attention.key_length_swa", (uint32_t)head_swa);
    moe_gguf_writer_set_u32(w, "gemma4.attention.value_length_swa", (uint32_t)head_swa);
    if (cfg_num(c, CFG_KEYS("expert_intermediate_size", "moe_intermediate_size"), &v))
        moe_gguf_writer_set_u32(w, "gemma4.expert_feed_forward_length", (uint32_t)v);
    if (kv_array) /* the converter writes per-layer heads only when global layers differ */
        moe_gguf_writer_set_arr(w, "gemma4.attention.head_count_kv", MOE_GGUF_I32, kv, n_layer);
    else
        moe_gguf_writer_set_u32(w, "gemma4.attention.head_count_kv", (uint32_t)kv_swa);
    if (json_is_true(json_object_get(c, "use_double_wide_mlp"))) {
        /* layers from the first KV-sharing one on have twice the MLP (E2B / E4B) */
        double ff = 0, shared = 0;
        cfg_num(c, CFG_KEYS("intermediate_size"), &ff);
        cfg_num(c, CFG_KEYS("num_kv_shared_layers"), &shared);
        size_t first_shared =
            shared >= 0 && shared < (double)n_layer ? n_layer - (size_t)shared : 0;
        for (size_t i = 0; i < n_layer; i++) kv[i] = (int32_t)(i < first_shared ? ff : 2 * ff);
        moe_gguf_writer_set_arr(w, "gemma4.feed_forward_length", MOE_GGUF_I32, kv, n_layer);
    }
    double partial_swa = 1.0;
    cfg_num(c, CFG_KEYS("partial_rotary_factor"), &partial_swa);
    moe_gguf_writer_set_u32(w, "gemma4.rope.dimension_count", (uint32_t)head_full);
    moe_gguf_writer_set_u32(w, "gemma4.rope.dimension_count_swa",
                            (uint32_t)(head_swa * partial_swa));
    moe_gguf_writer_set_u32(w, "general.quantization_version", 2);
    free(swa);
    free(kv);
    return m.st;
}

/* rope_freqs.weight: 1 for the rotated pairs of a global layer, 1e30 for the rest (how the
 * converter expresses "proportional" RoPE with ggml's NEOX rope). n = global_head_dim / 2. */
float *moe_hf_rope_freqs(json_t *config, int64_t *n) {
    json_t *c = text_config(config);
    double head_full = 0;
    if (!cfg_num(c, CFG_KEYS("global_head_dim"), &head_full) || head_full < 2) return NULL;
    int64_t half = (int64_t)head_full / 2;
    int64_t rot = (int64_t)(head_full * partial_rotary(c, "full_attention") / 2);
    float *f = moe_xcalloc((size_t)half, sizeof *f);
    for (int64_t i = 0; i < half; i++) f[i] = i < rot ? 1.0f : 1e30f;
    *n = half;
    return f;
}

/* The rows of gemma's embed_tokens llama.cpp's converter keeps (Gemma3Model.modify_tensors,
 * which Gemma4Model runs): len(tokenizer.json's model.vocab) + len(added_tokens). -1 when it
 * cannot be told here: no tokenizer.json, or a tokenizer.model (the converter then counts the
 * SentencePiece pieces, a protobuf moe does not read). */
int64_t moe_hf_vocab_rows(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.model", dir);
    if (access(path, F_OK) == 0) return -1;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    json_error_t je;
    json_t *t = json_load_file(path, 0, &je);
    if (!t) return -1;
    json_t *vocab = json_object_get(json_object_get(t, "model"), "vocab");
    json_t *added = json_object_get(t, "added_tokens");
    int64_t n = -1;
    if (json_is_object(vocab) || json_is_array(vocab))
        n = (int64_t)(json_is_object(vocab) ? json_object_size(vocab) : json_array_size(vocab)) +
            (int64_t)json_array_size(added);
    json_decref(t);
    return n;
}

/* ==== Names, metadata and edits: llama (llama.cpp conversion/llama.py, LlamaModel) ==== */

static const name_pair llama_layer_names[] = {
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
};

static int llama_name(json_t *config, const char *hf, char *out, size_t cap) {
    (void)config;
    return map_name(llama_layer_names, sizeof llama_layer_names / sizeof llama_layer_names[0], hf,
                    out, cap);
}

/* ARCH.KEY as u32 / f32 from the first config key present (an error naming it when none is). */
static void arch_u32(gguf_meta_ctx *m, const char *arch, const char *key,
                     const char *const *cfg_keys) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    meta_u32(m, k, cfg_keys);
}
static void arch_f32(gguf_meta_ctx *m, const char *arch, const char *key,
                     const char *const *cfg_keys) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    meta_f32(m, k, cfg_keys);
}

/* The keys TextModel.set_gguf_parameters writes for every transformer (conversion/base.py);
 * returns the context the architecture's own keys are written with. */
static gguf_meta_ctx transformer_metadata(moe_gguf_writer *w, json_t *config, const char *path,
                                          moe_error *err, const char *arch) {
    gguf_meta_ctx ctx = {w, text_config(config), path, err, MOE_OK}, *m = &ctx;
    char name[256], key[128];
    dir_name(m->path, name, sizeof name);
    moe_gguf_writer_set_str(m->w, "general.architecture", arch);
    moe_gguf_writer_set_str(m->w, "general.type", "model");
    moe_gguf_writer_set_str(m->w, "general.name", name);
    arch_u32(m, arch, "context_length", CFG_KEYS("max_position_embeddings"));
    arch_u32(m, arch, "embedding_length", CFG_KEYS("hidden_size"));
    arch_u32(m, arch, "block_count", CFG_KEYS("num_hidden_layers"));
    arch_u32(m, arch, "feed_forward_length", CFG_KEYS("intermediate_size"));
    arch_u32(m, arch, "attention.head_count", CFG_KEYS("num_attention_heads"));
    arch_u32(m, arch, "attention.head_count_kv",
             CFG_KEYS("num_key_value_heads", "num_attention_heads"));
    arch_f32(m, arch, "attention.layer_norm_rms_epsilon", CFG_KEYS("rms_norm_eps"));
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    moe_gguf_writer_set_f32(m->w, key, (float)rope_theta(m->c, NULL, 10000.0));
    moe_gguf_writer_set_u32(m->w, "general.quantization_version", 2);
    return ctx;
}

/* head_dim, else hidden_size / num_attention_heads. */
static double head_dim(gguf_meta_ctx *m) {
    double v, heads = need(m, CFG_KEYS("num_attention_heads"));
    return cfg_num(m->c, CFG_KEYS("head_dim"), &v)
               ? v
               : need(m, CFG_KEYS("hidden_size")) / (heads > 0 ? heads : 1);
}

/* LlamaModel.set_gguf_parameters: the llama.* keys from the HF config. */
static moe_status llama_metadata(moe_gguf_writer *w, json_t *config, const char *path,
                                 moe_error *err) {
    gguf_meta_ctx m = transformer_metadata(w, config, path, err, "llama");
    meta_u32(&m, "llama.vocab_size", CFG_KEYS("vocab_size"));
    moe_gguf_writer_set_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim(&m));
    json_t *scaling = json_object_get(m.c, "rope_scaling");
    if (json_is_object(scaling)) {
        const char *type = json_string_value(json_object_get(scaling, "rope_type"));
        if (!type) type = json_string_value(json_object_get(scaling, "type"));
        json_t *factor = json_object_get(scaling, "factor");
        if (!type || strcmp(type, "linear") != 0 || !json_is_number(factor))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "%s: rope_scaling type '%s': moe reads linear scaling only", path,
                                 type ? type : "(none)");
        moe_gguf_writer_set_str(w, "llama.rope.scaling.type", "linear");
        moe_gguf_writer_set_f32(w, "llama.rope.scaling.factor", (float)json_number_value(factor));
    }
    return m.st;
}

/* LlamaModel.permute: q's rows go from HF's per-head [half][pair] order (rotate_half rope) to
 * the converter's [pair][half] (ggml's adjacent-pair rope), per query head; k's per KV head. */
static void llama_edit(json_t *config, const char *gguf_name, const int64_t *ne, tensor_edit *e) {
    json_t *c = text_config(config);
    double heads = 0, kv = 0;
    cfg_num(c, CFG_KEYS("num_attention_heads"), &heads);
    if (!cfg_num(c, CFG_KEYS("num_key_value_heads"), &kv)) kv = heads;
    const double n = ends_with(gguf_name, ".attn_q.weight")   ? heads
                     : ends_with(gguf_name, ".attn_k.weight") ? kv
                                                              : 0;
    if (n < 1) return;
    const int64_t head_rows = ne[1] / (int64_t)n;
    e->rows = (axis_perm){0, 2, head_rows % 2 ? 0 : head_rows / 2, 1}; /* b 0: refused */
}

/* ==== Names and metadata: qwen3moe (llama.cpp conversion/qwen.py, Qwen3MoeModel) ==== */

static const name_pair qwen3moe_layer_names[] = {
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate.weight", "ffn_gate_inp.weight"},
    {"mlp.experts.gate_proj.weight", "ffn_gate_exps.weight"}, /* the experts stacked */
    {"mlp.experts.up_proj.weight", "ffn_up_exps.weight"},
    {"mlp.experts.down_proj.weight", "ffn_down_exps.weight"},
};

static int qwen3moe_name(json_t *config, const char *hf, char *out, size_t cap) {
    (void)config;
    return map_name(qwen3moe_layer_names,
                    sizeof qwen3moe_layer_names / sizeof qwen3moe_layer_names[0], hf, out, cap);
}

static moe_status qwen3moe_metadata(moe_gguf_writer *w, json_t *config, const char *path,
                                    moe_error *err) {
    gguf_meta_ctx m = transformer_metadata(w, config, path, err, "qwen3moe");
    meta_u32(&m, "qwen3moe.expert_count", CFG_KEYS("num_experts"));
    meta_u32(&m, "qwen3moe.expert_used_count", CFG_KEYS("num_experts_per_tok"));
    moe_gguf_writer_set_u32(w, "qwen3moe.attention.key_length", (uint32_t)head_dim(&m));
    moe_gguf_writer_set_u32(w, "qwen3moe.attention.value_length", (uint32_t)head_dim(&m));
    meta_u32(&m, "qwen3moe.expert_feed_forward_length", CFG_KEYS("moe_intermediate_size"));
    return m.st;
}

/* ==== Names, metadata and edits: qwen35 (llama.cpp conversion/qwen.py, Qwen3_5TextModel) ==== */

static const name_pair qwen35_layer_names[] = {
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"linear_attn.in_proj_qkv.weight", "attn_qkv.weight"},
    {"linear_attn.in_proj_z.weight", "attn_gate.weight"},
    {"linear_attn.in_proj_a.weight", "ssm_alpha.weight"},
    {"linear_attn.in_proj_b.weight", "ssm_beta.weight"},
    {"linear_attn.conv1d.weight", "ssm_conv1d.weight"},
    {"linear_attn.A_log", "ssm_a"},
    {"linear_attn.dt_bias", "ssm_dt.bias"},
    {"linear_attn.norm.weight", "ssm_norm.weight"},
    {"linear_attn.out_proj.weight", "ssm_out.weight"},
    /* the MTP block's own tensors, once qwen35_name has given them its layer */
    {"eh_proj.weight", "nextn.eh_proj.weight"},
    {"enorm.weight", "nextn.enorm.weight"},
    {"hnorm.weight", "nextn.hnorm.weight"},
    {"shared_head.norm.weight", "nextn.shared_head_norm.weight"},
};

/* _Qwen35MtpMixin: mtp.layers.K.X (or model.mtp...) is layer num_hidden_layers + K, and
 * mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm are that layer's NextN
 * projection and norms; the rest is named as every transformer's. */
static int qwen35_name(json_t *config, const char *hf, char *out, size_t cap) {
    static const name_pair mtp_names[] = {{"fc", "eh_proj"},
                                          {"pre_fc_norm_embedding", "enorm"},
                                          {"pre_fc_norm_hidden", "hnorm"},
                                          {"norm", "shared_head.norm"}};
    const size_t n_names = sizeof qwen35_layer_names / sizeof qwen35_layer_names[0];
    const char *p = strncmp(hf, "model.mtp.", 10) == 0 ? hf + 6 : hf;
    if (strncmp(p, "mtp.", 4) != 0) return map_name(qwen35_layer_names, n_names, hf, out, cap);
    double n_layer = -1;
    cfg_num(text_config(config), CFG_KEYS("num_hidden_layers"), &n_layer);
    char moved[600];
    const char *rest = p + 4, *dot = strchr(rest, '.');
    if (n_layer < 0 || !dot) return -1;
    if (strncmp(rest, "layers.", 7) == 0) {
        char *end;
        long k = strtol(rest + 7, &end, 10);
        if (end == rest + 7 || *end != '.' || k < 0) return -1;
        snprintf(moved, sizeof moved, "model.layers.%ld.%s", (long)n_layer + k, end + 1);
        return map_name(qwen35_layer_names, n_names, moved, out, cap);
    }
    for (size_t i = 0; i < sizeof mtp_names / sizeof mtp_names[0]; i++)
        if ((size_t)(dot - rest) == strlen(mtp_names[i].hf) &&
            strncmp(rest, mtp_names[i].hf, (size_t)(dot - rest)) == 0 && !strchr(dot + 1, '.')) {
            snprintf(moved, sizeof moved, "model.layers.%ld.%s.%s", (long)n_layer,
                     mtp_names[i].gguf, dot + 1);
            return map_name(qwen35_layer_names, n_names, moved, out, cap);
        }
    return -1;
}

/* Qwen3_5TextModel.set_gguf_parameters: the transformer's keys, the Gated DeltaNet's, the
 * rope sections (mrope_section, else the converter's default [11, 11, 10, 0]) and the MTP
 * layers counted in block_count. */
static moe_status qwen35_metadata(moe_gguf_writer *w, json_t *config, const char *path,
                                  moe_error *err) {
    gguf_meta_ctx m = transformer_metadata(w, config, path, err, "qwen35");
    double n_mtp = 0, interval = 4, v_heads, partial = 0.25, hd = head_dim(&m);
    cfg_num(m.c, CFG_KEYS("mtp_num_hidden_layers"), &n_mtp);
    moe_gguf_writer_set_u32(w, "qwen35.block_count",
                            (uint32_t)(need(&m, CFG_KEYS("num_hidden_layers")) + n_mtp));
    if (n_mtp > 0) moe_gguf_writer_set_u32(w, "qwen35.nextn_predict_layers", (uint32_t)n_mtp);
    moe_gguf_writer_set_u32(w, "qwen35.attention.key_length", (uint32_t)hd);
    moe_gguf_writer_set_u32(w, "qwen35.attention.value_length", (uint32_t)hd);
    meta_u32(&m, "qwen35.ssm.conv_kernel", CFG_KEYS("linear_conv_kernel_dim"));
    meta_u32(&m, "qwen35.ssm.state_size", CFG_KEYS("linear_key_head_dim"));
    meta_u32(&m, "qwen35.ssm.group_count", CFG_KEYS("linear_num_key_heads"));
    v_heads = need(&m, CFG_KEYS("linear_num_value_heads"));
    moe_gguf_writer_set_u32(w, "qwen35.ssm.time_step_rank", (uint32_t)v_heads);
    moe_gguf_writer_set_u32(w, "qwen35.ssm.inner_size",
                            (uint32_t)(v_heads * need(&m, CFG_KEYS("linear_value_head_dim"))));
    cfg_num(m.c, CFG_KEYS("full_attention_interval"), &interval);
    moe_gguf_writer_set_u32(w, "qwen35.full_attention_interval", (uint32_t)interval);
    json_t *params = json_object_get(m.c, "rope_parameters");
    if (!cfg_num(m.c, CFG_KEYS("partial_rotary_factor"), &partial))
        cfg_num(params, CFG_KEYS("partial_rotary_factor"), &partial);
    moe_gguf_writer_set_u32(w, "qwen35.rope.dimension_count", (uint32_t)(hd * partial));
    int32_t sections[4] = {11, 11, 10, 0};
    json_t *mrope = json_object_get(params, "mrope_section");
    if (json_is_array(mrope)) {
        if (json_array_size(mrope) > 4)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: mrope_section has %zu entries (4 at most)", path,
                                 json_array_size(mrope));
        for (size_t i = 0; i < 4; i++)
            sections[i] = (int32_t)json_number_value(json_array_get(mrope, i)); /* pad: 0 */
    }
    moe_gguf_writer_set_arr(w, "qwen35.rope.dimension_sections", MOE_GGUF_I32, sections, 4);
    return m.st;
}

/* Qwen3NextModel.modify_tensors and _LinearAttentionVReorderBase: A_log becomes -exp(A_log),
 * every norm but the linear attention's gated one becomes 1 + w (HF's Qwen3.5 RMSNorm scales
 * by 1 + weight), conv1d loses its middle dimension; and with fewer key heads than value heads
 * the value heads go from HF's grouped order (those of key head 0, then of key head 1, ...) to
 * ggml's tiled one (value head j of every key head, then j + 1): rows of qkv's v part, of z,
 * alpha and beta, the conv1d's v channels, A_log and dt_bias, and out_proj's columns. */
static void qwen35_edit(json_t *config, const char *gguf, const int64_t *ne, tensor_edit *e) {
    (void)ne;
    json_t *c = text_config(config);
    if (ends_with(gguf, "norm.weight") && !ends_with(gguf, ".ssm_norm.weight"))
        e->value = EDIT_PLUS_ONE;
    if (ends_with(gguf, ".ssm_a")) e->value = EDIT_NEG_EXP;
    e->squeeze = ends_with(gguf, ".ssm_conv1d.weight");
    double k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
    cfg_num(c, CFG_KEYS("linear_num_key_heads"), &k_heads);
    cfg_num(c, CFG_KEYS("linear_num_value_heads"), &v_heads);
    cfg_num(c, CFG_KEYS("linear_key_head_dim"), &k_dim);
    cfg_num(c, CFG_KEYS("linear_value_head_dim"), &v_dim);
    if (k_heads < 1 || v_heads < 1 || k_heads == v_heads) return;
    const int64_t nk = (int64_t)k_heads, per = (int64_t)v_heads / nk, qk = 2 * nk * (int64_t)k_dim;
    const axis_perm heads = {0, nk, per, (int64_t)v_dim}, scalars = {0, nk, per, 1};
    if (ends_with(gguf, ".attn_qkv.weight") || ends_with(gguf, ".ssm_conv1d.weight"))
        e->rows = (axis_perm){qk, nk, per, (int64_t)v_dim};
    else if (ends_with(gguf, ".attn_gate.weight"))
        e->rows = heads;
    else if (ends_with(gguf, ".ssm_alpha.weight") || ends_with(gguf, ".ssm_beta.weight"))
        e->rows = scalars;
    else if (ends_with(gguf, ".ssm_a") || ends_with(gguf, ".ssm_dt.bias"))
        e->cols = scalars;
    else if (ends_with(gguf, ".ssm_out.weight"))
        e->cols = heads;
}

/* ==== The architectures a checkpoint may be ==== */

typedef struct hf_arch {
    const char *model_type; /* config.json's (text_config's), as a prefix: gemma4, gemma4_text */
    int (*name)(json_t *config, const char *hf, char *out, size_t cap);
    moe_status (*metadata)(moe_gguf_writer *w, json_t *config, const char *path, moe_error *err);
    float *(*rope_freqs)(json_t *config, int64_t *n); /* NULL: no rope_freqs tensor */
    bool trim_embd;                                   /* token_embd cut to the tokenizer */
    bool fused_gate_up; /* experts' gate and up in one tensor (gemma4's experts.gate_up_proj) */
    /* the converter's edits of the tensor named gguf of shape ne (NULL: none) */
    void (*edit)(json_t *c, const char *gguf, const int64_t *ne, tensor_edit *e);
} hf_arch;

static int gemma4_name(json_t *config, const char *hf, char *out, size_t cap) {
    (void)config;
    return moe_hf_gguf_name(hf, out, cap);
}

static const hf_arch hf_archs[] = {
    {"gemma4", gemma4_name, moe_hf_write_metadata, moe_hf_rope_freqs, true, true, NULL},
    {"llama", llama_name, llama_metadata, NULL, false, false, llama_edit},
    {"qwen3_moe", qwen3moe_name, qwen3moe_metadata, NULL, false, false, NULL},
    {"qwen3_5_text", qwen35_name, qwen35_metadata, NULL, false, false, qwen35_edit},
};

/* ==== Reading config.json ==== */

json_t *moe_hf_read_config(const char *dir, moe_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!c) {
        moe_error_set(err, MOE_ERR_FORMAT, "%s: %s (line %d)", path, je.text, je.line);
        return NULL;
    }
    if (!json_is_object(c)) {
        json_decref(c);
        moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", path);
        return NULL;
    }
    return c;
}

const char *moe_hf_model_type(json_t *config) {
    return json_string_value(json_object_get(text_config(config), "model_type"));
}

/* GGUF type for a copied tensor: 1-D, norms and the router as F32 (llama.cpp's converter), the
 * rest in the source dtype. false when the dtype has no GGUF type. */
bool moe_hf_copy_type(const moe_st_tensor *t, const char *gguf_name, moe_type *out) {
    if (t->n_dims <= 1 || ends_with(gguf_name, "_norm.weight") ||
        strstr(gguf_name, "ffn_gate_inp") || strstr(gguf_name, "ssm_conv1d"))
        return is_float(t->dtype) ? (*out = MOE_TYPE_F32, true) : false;
    switch (t->dtype) {
    case MOE_ST_BF16:
        *out = MOE_TYPE_BF16;
        return true;
    case MOE_ST_F16:
        *out = MOE_TYPE_F16;
        return true;
    case MOE_ST_F32:
        *out = MOE_TYPE_F32;
        return true;
    case MOE_ST_I8:
        *out = MOE_TYPE_I8;
        return true;
    case MOE_ST_I16:
        *out = MOE_TYPE_I16;
        return true;
    case MOE_ST_I32:
        *out = MOE_TYPE_I32;
        return true;
    case MOE_ST_I64:
        *out = MOE_TYPE_I64;
        return true;
    case MOE_ST_F64:
        *out = MOE_TYPE_F64;
        return true;
    default:
        return false;
    }
}

/* ==== The checkpoint as a model: one GGUF tensor per source tensor or stack of experts ==== */

/* Where rows come from: a safetensors tensor (its rows of the last dimension), or a W4A16
 * module (scale x level). */
typedef struct view_unit {
    const moe_st_tensor *t; /* a plain tensor, or NULL for the module */
    moe_w4a16_module mod;
} view_unit;

/* One GGUF tensor: units of equal rows stacked in order (fused experts: gate then up of each
 * expert), maybe its first rows only (token_embd cut to the tokenizer). */
typedef struct view_tensor {
    char name[256];
    view_unit *units; /* [n_units] */
    size_t n_units;
    int64_t unit_rows; /* rows of each unit */
    moe_type type;
    uint32_t n_dims;
    int64_t ne[MOE_GGUF_MAX_DIMS];
    tensor_edit edit; /* the converter's reorderings and value edit */
} view_tensor;

/* Row lr of unit u, in the source's value order, as v->type into out. */
static moe_status source_row(const view_tensor *v, const view_unit *u, int64_t lr, uint8_t *out,
                             moe_error *err) {
    const int64_t cols = v->ne[0], groups = cols / MOE_GRID_GROUP;
    if (u->t && v->type == MOE_TYPE_F32 && u->t->dtype != MOE_ST_F32)
        return moe_st_to_f32(u->t, (uint64_t)(lr * cols), (uint64_t)cols, (float *)out, err);
    if (u->t) { /* the same type */
        size_t row = (size_t)cols * moe_st_dtype_size(u->t->dtype);
        memcpy(out, u->t->data + (size_t)lr * row, row);
        return MOE_OK;
    }
    if (v->type == MOE_TYPE_F32)
        return moe_w4a16_dequant_rows(&u->mod, lr, lr + 1, (float *)out, err);
    int8_t q[MOE_GRID_GROUP];
    for (int64_t g = 0; g < groups; g++) { /* Q4_0: the same levels, the scale as f16 */
        float scale;
        moe_status st = moe_st_to_f32(u->mod.scale, (uint64_t)(lr * groups + g), 1, &scale, err);
        if (st != MOE_OK) return st;
        moe_grid_unpack_int4(u->mod.packed->data + (lr * groups + g) * 16, MOE_GRID_GROUP, q);
        moe_grid_q4_0_block(moe_f32_to_fp16(scale), q, out + g * 18);
    }
    return MOE_OK;
}

/* Row r of the output (of v->ne[0] values) into out: the edit's source row, its values in the
 * edit's order (scratch: a row's bytes), edited. */
static moe_status fill_row(const view_tensor *v, int64_t r, uint8_t *out, uint8_t *scratch,
                           moe_error *err) {
    const int64_t s = perm_source(&v->edit.rows, r);
    const view_unit *u = &v->units[s / v->unit_rows];
    moe_status st = source_row(v, u, s % v->unit_rows, v->edit.cols.a ? scratch : out, err);
    if (st != MOE_OK) return st;
    if (v->edit.cols.a) { /* whole blocks move: plan_tensor made sure the runs hold whole ones */
        const moe_type_traits *tr = moe_type_traits_get(v->type);
        const int64_t bv = tr->block_values, n = v->ne[0] / bv;
        const axis_perm blocks = {v->edit.cols.first / bv, v->edit.cols.a, v->edit.cols.b,
                                  v->edit.cols.c / bv};
        for (int64_t i = 0; i < n; i++)
            memcpy(out + i * tr->block_bytes, scratch + perm_source(&blocks, i) * tr->block_bytes,
                   tr->block_bytes);
    }
    float *x = (float *)out; /* a value edit's tensor is F32 (plan_tensor) */
    for (int64_t i = 0; i < v->ne[0] && v->edit.value; i++) {
        x[i] = v->edit.value == EDIT_NEG_EXP ? -expf(x[i]) : 1.0f + x[i];
        if (u->t && u->t->dtype == MOE_ST_F16) x[i] = moe_fp16_to_f32(moe_f32_to_fp16(x[i]));
    }
    return MOE_OK;
}
static moe_status fill_view_tensor(void *ctx, const char *name, void *out, uint64_t n_bytes,
                                   moe_error *err) {
    (void)name;
    const view_tensor *v = ctx;
    const int64_t rows = (int64_t)(v->ne[1] * v->ne[2] * v->ne[3]);
    const uint64_t row_bytes = n_bytes / (uint64_t)rows;
    uint8_t *scratch = v->edit.cols.a ? moe_xmalloc(row_bytes) : NULL;
    moe_status st = MOE_OK;
    for (int64_t r = 0; r < rows && st == MOE_OK; r++)
        st = fill_row(v, r, (uint8_t *)out + (uint64_t)r * row_bytes, scratch, err);
    free(scratch);
    return st;
}

/* Every scale of a module an f16 number: Q4_0 holds it exactly. */
static bool scales_fit_f16(const moe_w4a16_module *m, moe_error *err) {
    for (uint64_t g = 0; g < m->scale->n_values; g++) {
        float s;
        if (moe_st_to_f32(m->scale, g, 1, &s, err) != MOE_OK) return false;
        if (moe_fp16_to_f32(moe_f32_to_fp16(s)) != s) return false;
    }
    return true;
}

/* The unit named `name` ("X.weight"): the tensor of that name, else the W4A16 module X.
 * MOE_ERR_NOT_FOUND when neither exists. */
static moe_status find_unit(const moe_st *s, const char *name, view_unit *u, moe_error *err) {
    memset(u, 0, sizeof *u);
    u->t = moe_st_tensor_find(s, name);
    if (u->t) return MOE_OK;
    char module[520];
    snprintf(module, sizeof module, "%.*s",
             (int)(ends_with(name, ".weight") ? strlen(name) - 7 : strlen(name)), name);
    return moe_w4a16_module_find(s, module, &u->mod, err);
}

/* "P.experts.E.KIND.weight" (KIND gate_proj, up_proj or down_proj): *stem_len = strlen("P."
 * "experts."), *expert = E, *kind the KIND; false for any other name. */
static bool expert_unit(const char *name, size_t *stem_len, long *expert, const char **kind) {
    const char *e = strstr(name, ".experts.");
    if (!e || !ends_with(name, ".weight")) return false;
    char *end;
    *expert = strtol(e + 9, &end, 10);
    if (end == e + 9 || *end != '.' || *expert < 0) return false;
    *kind = end + 1;
    *stem_len = (size_t)(e + 9 - name);
    return strcmp(*kind, "gate_proj.weight") == 0 || strcmp(*kind, "up_proj.weight") == 0 ||
           strcmp(*kind, "down_proj.weight") == 0;
}

/* The units of the GGUF tensor the unit `name` starts, in row order, and the HF name of that
 * tensor (stacked experts: "P.experts.gate_up_proj" fused as gemma4 stores them, else
 * "P.experts.KIND.weight"). 0 units: a tensor another unit starts holds this one. */
static moe_status tensor_units(const moe_st *s, const hf_arch *a, const char *name, char *hf_name,
                               size_t cap, view_tensor *v, moe_error *err) {
    size_t stem;
    long expert;
    const char *kind;
    if (!expert_unit(name, &stem, &expert, &kind)) {
        snprintf(hf_name, cap, "%s", name);
        v->units = moe_xcalloc(1, sizeof *v->units);
        v->n_units = 1;
        return find_unit(s, name, &v->units[0], err);
    }
    bool gate_up = a->fused_gate_up && strcmp(kind, "down_proj.weight") != 0;
    if (expert != 0 || (gate_up && strcmp(kind, "up_proj.weight") == 0)) return MOE_OK;
    if (gate_up)
        snprintf(hf_name, cap, "%.*sgate_up_proj", (int)stem, name);
    else if (a->fused_gate_up)
        snprintf(hf_name, cap, "%.*sdown_proj", (int)stem, name);
    else
        snprintf(hf_name, cap, "%.*s%s", (int)stem, name, kind);
    const char *parts[2] = {gate_up ? "gate_proj.weight" : kind, gate_up ? "up_proj.weight" : NULL};
    char unit_name[600];
    for (long e = 0;; e++)
        for (int p = 0; p < 2 && parts[p]; p++) {
            snprintf(unit_name, sizeof unit_name, "%.*s%ld.%s", (int)stem, name, e, parts[p]);
            view_unit u;
            moe_error local = {0};
            if (find_unit(s, unit_name, &u, &local) != MOE_OK) {
                if (p == 0 && e > 0 && local.code == MOE_ERR_NOT_FOUND) return MOE_OK;
                return moe_error_set(err, local.code, "%s", local.msg);
            }
            v->units = moe_xrealloc(v->units, (v->n_units + 1) * sizeof *v->units);
            v->units[v->n_units++] = u;
        }
}

/* Rows and columns of a unit (a plain tensor's rows along its last dimension). */
static void unit_shape(const view_unit *u, int64_t *rows, int64_t *cols) {
    if (!u->t) {
        *rows = u->mod.rows;
        *cols = u->mod.cols;
        return;
    }
    *cols = u->t->n_dims ? u->t->shape[u->t->n_dims - 1] : 1;
    *rows = *cols ? (int64_t)(u->t->n_values / (uint64_t)*cols) : 0;
}

/* Name, type and shape of the GGUF tensor of v's units; *skip for tensors the converter leaves
 * out (the vision / audio towers go to an mmproj file). */
static moe_status plan_tensor(const moe_st *s, const hf_arch *a, json_t *config,
                              const char *hf_name, view_tensor *v, bool *skip, moe_error *err) {
    const char *dir = moe_st_dir(s);
    int k = a->name(config, hf_name, v->name, sizeof v->name);
    *skip = k == 1;
    if (k < 0)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: tensor '%s' has no GGUF name", dir,
                             hf_name);
    if (*skip) return MOE_OK;
    const view_unit *u0 = &v->units[0];
    int64_t rows, cols;
    unit_shape(u0, &rows, &cols);
    bool all_plain = true, all_w4 = true, same_dtype = true;
    for (size_t i = 0; i < v->n_units; i++) {
        int64_t r, c;
        unit_shape(&v->units[i], &r, &c);
        if (r != rows || c != cols)
            return moe_error_set(err, MOE_ERR_FORMAT, "%s: the parts of '%s' differ in shape", dir,
                                 hf_name);
        all_plain &= v->units[i].t != NULL;
        all_w4 &= v->units[i].t == NULL;
        same_dtype &= v->units[i].t && u0->t && v->units[i].t->dtype == u0->t->dtype;
    }
    for (uint32_t d = 0; d < MOE_GGUF_MAX_DIMS; d++) v->ne[d] = 1;
    v->unit_rows = rows;
    if (v->n_units == 1 && u0->t) { /* one tensor: its own shape */
        if (u0->t->n_dims > MOE_GGUF_MAX_DIMS)
            return moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: tensor '%s' has %u dimensions", dir,
                                 hf_name, u0->t->n_dims);
        v->n_dims = u0->t->n_dims ? u0->t->n_dims : 1;
        for (uint32_t d = 0; d < u0->t->n_dims; d++) v->ne[d] = u0->t->shape[u0->t->n_dims - 1 - d];
    } else { /* a module, or experts stacked: [experts][rows of each][cols] */
        int64_t per_expert = ends_with(hf_name, "gate_up_proj") ? 2 : 1;
        v->n_dims = v->n_units == 1 ? 2 : 3;
        v->ne[0] = cols;
        v->ne[1] = rows * per_expert;
        v->ne[2] = (int64_t)v->n_units / per_expert;
    }
    if (a->edit) a->edit(config, v->name, v->ne, &v->edit);
    if (v->edit.squeeze) {
        uint32_t kept = 0;
        for (uint32_t d = 0; d < v->n_dims; d++)
            if (v->ne[d] != 1) v->ne[kept++] = v->ne[d];
        for (uint32_t d = kept; d < MOE_GGUF_MAX_DIMS; d++) v->ne[d] = 1;
        v->n_dims = kept ? kept : 1;
    }
    if (all_plain && same_dtype) {
        if (!moe_hf_copy_type(u0->t, v->name, &v->type))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "%s: tensor '%s': dtype %s has no GGUF "
                                 "type",
                                 dir, hf_name, moe_st_dtype_name(u0->t->dtype));
    } else {
        v->type = all_w4 ? MOE_TYPE_Q4_0 : MOE_TYPE_F32;
        for (size_t i = 0; i < v->n_units && v->type == MOE_TYPE_Q4_0; i++) {
            moe_error local = {0};
            if (!scales_fit_f16(&v->units[i].mod, &local)) {
                if (local.code) return moe_error_set(err, local.code, "%s", local.msg);
                v->type = MOE_TYPE_F32;
                fprintf(stderr,
                        "%s: %s: a scale outside f16's range: dequantized to F32 (not "
                        "Q4_0)\n",
                        dir, hf_name);
            }
        }
    }
    if (v->edit.value) v->type = MOE_TYPE_F32;
    const int64_t bv = moe_type_traits_get(v->type)->block_values;
    if (v->edit.cols.a && (v->edit.cols.first % bv || v->edit.cols.c % bv))
        v->type = MOE_TYPE_F32; /* Q4_0 blocks would be cut: the values move one by one */
    const axis_perm *axes[2] = {&v->edit.rows, &v->edit.cols};
    const int64_t lens[2] = {v->ne[1] * v->ne[2] * v->ne[3], v->ne[0]};
    for (int i = 0; i < 2; i++) {
        const axis_perm *p = axes[i];
        if (p->a && (p->b < 1 || p->c < 1 || p->first > lens[i] ||
                     (lens[i] - p->first) % (p->a * p->b * p->c) != 0))
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: %s: %lld %s from %lld do not split into the converter's "
                                 "[%lld][%lld][%lld] reordering (config.json's head counts?)",
                                 dir, v->name, (long long)lens[i], i ? "columns" : "rows",
                                 (long long)p->first, (long long)p->a, (long long)p->b,
                                 (long long)p->c);
    }
    if (a->trim_embd && strcmp(v->name, "token_embd.weight") == 0 && v->n_dims == 2) {
        int64_t keep = moe_hf_vocab_rows(dir);
        if (keep >= 0 && keep < v->ne[1]) v->ne[1] = keep;
    }
    return MOE_OK;
}

/* tokenizer.json and tokenizer_config.json as they are, and the chat template, as keys. */
static void add_tokenizer_keys(moe_gguf_writer *w, const char *dir) {
    char path[4096];
    uint8_t *data;
    size_t size;
    moe_error ignored = {0};
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (moe_file_read(path, &data, &size, &ignored) == MOE_OK) {
        moe_gguf_writer_set_str(w, "tokenizer.huggingface.json", (const char *)data);
        free(data);
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (moe_file_read(path, &data, &size, &ignored) == MOE_OK) {
        moe_gguf_writer_set_str(w, "tokenizer.huggingface.config", (const char *)data);
        free(data);
    }
    moe_hf_write_chat_template(w, dir);
}

void moe_hf_write_chat_template(moe_gguf_writer *w, const char *dir) {
    char path[4096];
    uint8_t *data;
    size_t size;
    moe_error ignored = {0};
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    json_t *template = NULL;
    if (moe_file_read(path, &data, &size, &ignored) == MOE_OK) {
        json_error_t je;
        json_t *cfg = json_loadb((const char *)data, size, JSON_DECODE_INT_AS_REAL, &je);
        template = json_incref(json_object_get(cfg, "chat_template"));
        json_decref(cfg);
        free(data);
    }
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    if (moe_file_read(path, &data, &size, &ignored) == MOE_OK) {
        moe_gguf_writer_set_str(w, "tokenizer.chat_template", (const char *)data);
        free(data);
    } else if (json_is_string(template)) {
        moe_gguf_writer_set_str(w, "tokenizer.chat_template", json_string_value(template));
    } else if (json_is_array(template)) { /* [{"name", "template"}]: the default and the rest */
        for (size_t i = 0; i < json_array_size(template); i++) {
            const char *name =
                json_string_value(json_object_get(json_array_get(template, i), "name"));
            const char *text =
                json_string_value(json_object_get(json_array_get(template, i), "template"));
            if (!name || !text) continue;
            char key[300];
            if (strcmp(name, "default") == 0)
                snprintf(key, sizeof key, "tokenizer.chat_template");
            else
                snprintf(key, sizeof key, "tokenizer.chat_template.%s", name);
            moe_gguf_writer_set_str(w, key, text);
        }
    }
    json_decref(template);
}

moe_gguf *moe_hf_open(const char *path, bool keys_only, moe_error *err) {
    moe_st *s = moe_st_open(path, err);
    if (!s) return NULL;
    const char *dir = moe_st_dir(s);
    json_t *config = moe_hf_read_config(dir, err);
    const char *model_type = config ? moe_hf_model_type(config) : NULL;
    moe_status st = config ? MOE_OK : err->code;
    const hf_arch *a = NULL;
    for (size_t i = 0; i < sizeof hf_archs / sizeof hf_archs[0] && model_type; i++)
        if (strncmp(model_type, hf_archs[i].model_type, strlen(hf_archs[i].model_type)) == 0)
            a = &hf_archs[i];
    if (st == MOE_OK && !a)
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "%s/config.json: model_type '%s': moe maps the HF names of gemma4, "
                           "llama, qwen3_moe and qwen3_5_text",
                           dir, model_type ? model_type : "(none)");
    if (st == MOE_OK && json_object_get(config, "quantization_config"))
        st = moe_w4a16_config_check(dir, err);
    moe_gguf_writer *w = moe_gguf_writer_new();
    if (st == MOE_OK) st = a->metadata(w, config, dir, err);
    if (st == MOE_OK) add_tokenizer_keys(w, dir);
    uint64_t n = moe_st_n_tensors(s), n_view = 0;
    view_tensor *views = moe_xcalloc((size_t)n + 1, sizeof *views);
    for (uint64_t i = 0; i < n && st == MOE_OK && !keys_only; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        view_tensor *v = &views[n_view]; /* a slot left by a skipped tensor is used again */
        free(v->units);
        memset(v, 0, sizeof *v);
        if (ends_with(t->name, ".weight_scale") || ends_with(t->name, ".weight_shape")) continue;
        char unit[520], hf_name[600];
        if (ends_with(t->name, ".weight_packed")) /* the module M as the unit "M.weight" */
            snprintf(unit, sizeof unit, "%.*s.weight", (int)(strlen(t->name) - 14), t->name);
        else
            snprintf(unit, sizeof unit, "%s", t->name);
        st = tensor_units(s, a, unit, hf_name, sizeof hf_name, v, err);
        if (st != MOE_OK || !v->n_units) continue;
        bool skip = false;
        st = plan_tensor(s, a, config, hf_name, v, &skip, err);
        if (st == MOE_OK && !skip)
            st = moe_gguf_writer_add_tensor_deferred(w, v->name, v->type, v->n_dims, v->ne,
                                                     fill_view_tensor, v, err);
        if (st == MOE_OK && !skip) n_view++;
    }
    int64_t n_freqs = 0;
    float *freqs =
        st == MOE_OK && !keys_only && a->rope_freqs ? a->rope_freqs(config, &n_freqs) : NULL;
    if (freqs)
        st = moe_gguf_writer_add_tensor(w, "rope_freqs.weight", MOE_TYPE_F32, 1, &n_freqs, freqs,
                                        true, err);
    moe_gguf *g = NULL;
    if (st == MOE_OK)
        g = keys_only ? moe_gguf_writer_read_keys(w, err) : moe_gguf_writer_to_memory(w, dir, err);
    for (uint64_t i = 0; i <= n_view && i < n; i++) free(views[i].units);
    free(views);
    free(freqs);
    moe_gguf_writer_free(w);
    json_decref(config);
    moe_st_close(s);
    return g;
}

moe_gguf *moe_gguf_open_model(const char *path, moe_error *err) {
    return moe_st_is_checkpoint(path) ? moe_hf_open(path, false, err) : moe_gguf_open(path, err);
}
