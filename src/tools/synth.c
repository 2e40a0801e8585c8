/* synth.c: GGUF models of a supported architecture with seeded random weights -- `moe synth`
 * and the built-in demo model. Shapes come from presets or flags, weight types from rules
 * "REGEX=TYPE" matched against tensor names (first match wins, as written on the command
 * line); norms and routers stay F32 as llama.cpp keeps them. Weights are quantized with the
 * real quantizers of quant/ (IQ1 / IQ2 with an all-ones importance vector). With random_blocks,
 * quantized tensors are random valid blocks instead (any type with a decoder; much faster for
 * large presets, whose IQ searches take minutes), each block scaled to the same N(0, 1/n_in)
 * magnitude: for speed measurements random valid blocks are as good as real ones.
 * general.file_type names the type holding the most bytes, as llama-quantize names a mix.
 *
 * Everything derives from one seed, so a file is the same on every machine. Values are
 * N(0, 1/n_in) per matrix so activations keep their scale through the layers. The trap:
 * tensors are generated and quantized one at a time, but the writer holds all of them until
 * it writes, so a synthetic model needs its file size in memory. */
#include "tools.h"

#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../model/model.h"

#define SYNTH_CHUNK_ROWS 256 /* rows drawn, then quantized together on the pool */

/* ==== Presets ==== */

/* What GLM-5.3-Flash's sizes share: one latent KV head, one shared expert, one MTP layer,
 * sigmoid routing scaled 2.5, every 4th trunk layer attention, 4-tap KDA convs with decay bound
 * -5, 4 hyper-connection streams (20 Sinkhorn iterations), indexer pools of 4, SwiGLU clamp 10. */
#define GLM5NEXT_COMMON                                                                            \
    .arch = "glm5next", .n_head_kv = 1, .n_shared_expert = 1, .n_nextn = 1, .gating = 2,           \
    .expert_weights_scale = 2.5f, .rms_eps = 1e-5f, .linear_interval = 4, .d_conv = 4,             \
    .kda_gate_bound = -5.0f, .n_hc = 4, .hc_iters = 20, .hc_eps = 1e-6f, .idx_kpool = 4,           \
    .idx_norm_eps = 1e-6f, .swiglu_clamp_exp = 10.0f, .swiglu_clamp_shexp = 10.0f,                 \
    .optional = "output\\.weight|.*exp_probs_b\\.bias|.*nextn\\.shared_head_norm\\.weight"

static const moe_synth_params presets[] = {
    /* a small qwen3moe: the built-in demo model's shape */
    {.preset = "tiny",
     .arch = "qwen3moe",
     .n_vocab = 512,
     .n_ctx = 4096,
     .n_embd = 256,
     .n_layer = 4,
     .n_head = 8,
     .n_head_kv = 4,
     .head_dim = 32,
     .n_ff = 768,
     .n_expert = 16,
     .n_expert_used = 4,
     .n_ff_exp = 256,
     .rope_base = 1000000.0f,
     .optional = "output\\.weight"},
    {.preset = "llama-tiny",
     .arch = "llama",
     .n_vocab = 512,
     .n_ctx = 2048,
     .n_embd = 256,
     .n_layer = 4,
     .n_head = 8,
     .n_head_kv = 4,
     .head_dim = 32,
     .n_ff = 768,
     .rope_base = 10000.0f,
     .optional = "output\\.weight"},
    /* GLM-4.5's layout at toy size: a dense first layer, a shared expert, one NextN layer */
    {.preset = "glm4moe-tiny",
     .arch = "glm4moe",
     .n_vocab = 512,
     .n_ctx = 4096,
     .n_embd = 256,
     .n_layer = 3,
     .n_head = 8,
     .n_head_kv = 2,
     .head_dim = 32,
     .n_ff = 768,
     .n_expert = 16,
     .n_expert_used = 4,
     .n_ff_exp = 256,
     .rope_base = 1000000.0f,
     .n_dense_lead = 1,
     .n_shared_expert = 1,
     .n_nextn = 1,
     .rope_dims = 16, /* GLM-4.5's partial rope: half of each head */
     .gating = 2,     /* sigmoid */
     .expert_weights_scale = 2.5f,
     .optional = "output\\.weight|.*exp_probs_b\\.bias"},
    /* Qwen3-30B-A3B's published shape (config.json of Qwen/Qwen3-30B-A3B) */
    {.preset = "qwen3-30b-a3b",
     .arch = "qwen3moe",
     .n_vocab = 151936,
     .n_ctx = 40960,
     .n_embd = 2048,
     .n_layer = 48,
     .n_head = 32,
     .n_head_kv = 4,
     .head_dim = 128,
     .n_ff = 6144,
     .n_expert = 128,
     .n_expert_used = 8,
     .n_ff_exp = 768,
     .rope_base = 1000000.0f,
     .optional = "output\\.weight"},
    /* GLM-5.3-Flash (glm5next, 320B-A18B): hyper-connections around (KDA, KDA, KDA, sparse MLA)
     * x 11 + KDA, 288 experts, one MTP layer (blk.45). Shapes from zai-org/GLM-5.3-Flash's
     * config.json as llama.cpp's conversion/glm5next.py maps it; the RMSNorm epsilon (1e-5,
     * GLM's) is assumed, not read from the release. */
    {GLM5NEXT_COMMON,
     .preset = "glm53-flash",
     .name = "GLM-5.3-Flash layout (moe synth, random weights)",
     .n_vocab = 154880,
     .n_ctx = 1048576,
     .n_embd = 4096,
     .n_layer = 45,
     .n_head = 64,
     .head_dim = 256,
     .n_ff = 12288,
     .n_expert = 288,
     .n_expert_used = 8,
     .n_ff_exp = 2048,
     .n_dense_lead = 3,
     .n_lora_q = 1536,
     .n_lora_kv = 512,
     .head_dim_k_mla = 256,
     .head_dim_v_mla = 256,
     .kda_head_dim = 128,
     .idx_n_head = 32,
     .idx_head_dim = 128,
     .idx_top_k = 2048},
    /* glm53-flash's layout at toy size: every kind of layer and tensor, small enough for tests */
    {GLM5NEXT_COMMON,      .preset = "glm5next-tiny",
     .n_vocab = 512,       .n_ctx = 131072,
     .n_embd = 256,        .n_layer = 4,
     .n_head = 4,          .head_dim = 32,
     .n_ff = 512,          .n_expert = 16,
     .n_expert_used = 4,   .n_ff_exp = 256,
     .n_dense_lead = 1,    .n_lora_q = 64,
     .n_lora_kv = 64,      .head_dim_k_mla = 32,
     .head_dim_v_mla = 32, .kda_head_dim = 32,
     .idx_n_head = 4,      .idx_head_dim = 32,
     .idx_top_k = 16},
};

bool moe_synth_preset(const char *name, moe_synth_params *out) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(presets[i].preset, name) != 0) continue;
        *out = presets[i];
        out->seed = MOE_SYNTH_DEFAULT_SEED;
        return true;
    }
    return false;
}

const char *moe_synth_preset_names(void) {
    return "tiny, llama-tiny, glm4moe-tiny, qwen3-30b-a3b, glm53-flash, glm5next-tiny";
}

/* ==== Named type rules ==== */

/* Unsloth's UD-IQ3_XXS of GLM-5.3-Flash: the routed experts' formats by layer as its header
 * has them (layers 3-10 and 13-43 gate/up IQ2_S, down IQ3_S; layer 11 IQ3_S / IQ3_S / IQ4_XS;
 * layers 12 and 44 IQ2_S / IQ2_S / IQ4_XS). The MTP layer's experts take the common rule and
 * every other matrix Q8_0: assumptions, not read from the release. */
static const moe_synth_rule ud_iq3_xxs[] = {
    {"^blk\\.11\\.ffn_(gate|up)_exps\\.", MOE_TYPE_IQ3_S},
    {"^blk\\.(11|12|44)\\.ffn_down_exps\\.", MOE_TYPE_IQ4_XS},
    {"ffn_(gate|up)_exps\\.", MOE_TYPE_IQ2_S},
    {"ffn_down_exps\\.", MOE_TYPE_IQ3_S},
    {".*", MOE_TYPE_Q8_0},
};

static const struct {
    const char *name;
    const moe_synth_rule *rules;
    uint32_t n;
} rule_sets[] = {
    {"ud-iq3_xxs", ud_iq3_xxs, sizeof ud_iq3_xxs / sizeof ud_iq3_xxs[0]},
};

bool moe_synth_rule_set(const char *name, const moe_synth_rule **rules, uint32_t *n) {
    for (size_t i = 0; i < sizeof rule_sets / sizeof rule_sets[0]; i++) {
        if (strcmp(rule_sets[i].name, name) != 0) continue;
        *rules = rule_sets[i].rules;
        *n = rule_sets[i].n;
        return true;
    }
    return false;
}

const char *moe_synth_rule_set_names(void) {
    return "ud-iq3_xxs";
}

/* ==== Vocabulary: SentencePiece-style, bytes + characters + word pieces + fillers ==== */

/* Words whose pieces (with every prefix, so merges can reach them) fill the vocabulary. */
static const char *const vocab_words[] = {
    "the",   "and",    "a",       "to",    "of",      "in",     "is",    "it",    "was",   "that",
    "he",    "she",    "they",    "with",  "on",      "for",    "as",    "at",    "by",    "from",
    "this",  "we",     "you",     "not",   "but",     "or",     "have",  "one",   "all",   "there",
    "when",  "what",   "so",      "up",    "out",     "if",     "about", "who",   "get",   "which",
    "go",    "me",     "make",    "can",   "like",    "time",   "no",    "just",  "him",   "know",
    "take",  "people", "into",    "year",  "your",    "good",   "some",  "could", "them",  "see",
    "other", "than",   "then",    "now",   "look",    "only",   "come",  "its",   "over",  "think",
    "also",  "back",   "after",   "use",   "two",     "how",    "our",   "work",  "first", "well",
    "way",   "even",   "new",     "want",  "because", "any",    "these", "give",  "day",   "most",
    "us",    "expert", "mixture", "model", "token",   "sparse",
};

enum { TOK_NORMAL = 1, TOK_UNKNOWN = 2, TOK_CONTROL = 3, TOK_BYTE = 6 };

/* The token list and a set over its texts, so a piece already present is skipped in O(1). */
typedef struct vocab {
    char **tokens;  /* [cap] */
    float *scores;  /* [cap] */
    int32_t *types; /* [cap] */
    uint32_t n, cap;
    uint32_t *slots;  /* [n_slots] open addressing: token index + 1, 0 when empty */
    uint32_t n_slots; /* a power of two at least 2 * cap, so a probe always ends */
} vocab;

static void vocab_init(vocab *v, uint32_t cap) {
    v->tokens = moe_xmalloc(sizeof(char *) * cap);
    v->scores = moe_xmalloc(sizeof(float) * cap);
    v->types = moe_xmalloc(sizeof(int32_t) * cap);
    v->n = 0;
    v->cap = cap;
    v->n_slots = 16;
    while (v->n_slots < 2 * (uint64_t)cap) v->n_slots *= 2;
    v->slots = moe_xcalloc(v->n_slots, sizeof(uint32_t));
}

/* FNV-1a */
static uint64_t text_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Appends text unless the vocabulary already has it (false then). */
static bool vocab_add(vocab *v, const char *text, float score, int32_t type) {
    const uint32_t mask = v->n_slots - 1;
    uint32_t i = (uint32_t)text_hash(text) & mask;
    for (; v->slots[i]; i = (i + 1) & mask)
        if (strcmp(v->tokens[v->slots[i] - 1], text) == 0) return false;
    if (v->n == v->cap) moe_die("synth: vocabulary of %u tokens is full at '%s'", v->cap, text);
    v->tokens[v->n] = moe_xstrdup(text);
    v->scores[v->n] = score;
    v->types[v->n] = type;
    v->slots[i] = ++v->n;
    return true;
}

/* Exactly n tokens: <unk> <s> </s>, 256 byte tokens, then pieces, then fillers. */
static void vocab_build(vocab *v, uint32_t n) {
    vocab_init(v, n);
    vocab_add(v, "<unk>", 0, TOK_UNKNOWN);
    vocab_add(v, "<s>", 0, TOK_CONTROL);
    vocab_add(v, "</s>", 0, TOK_CONTROL);
    char piece[64];
    for (int b = 0; b < 256; b++) {
        snprintf(piece, sizeof piece, "<0x%02X>", b);
        vocab_add(v, piece, 0, TOK_BYTE);
    }
    const char *chars =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()";
    for (const char *c = chars; *c && v->n < n; c++) {
        snprintf(piece, sizeof piece, "%c", *c);
        vocab_add(v, piece, -1000.0f, TOK_NORMAL);
    }
    if (v->n < n) vocab_add(v, "\xe2\x96\x81", -1000.0f, TOK_NORMAL); /* U+2581: the space */
    for (size_t w = 0; w < sizeof vocab_words / sizeof vocab_words[0]; w++) {
        const size_t len = strlen(vocab_words[w]);
        for (size_t k = 1; k <= len && v->n < n; k++) {
            snprintf(piece, sizeof piece, "\xe2\x96\x81%.*s", (int)k, vocab_words[w]);
            vocab_add(v, piece, -(100.0f - 10.0f * (float)k) - (float)w * 0.01f, TOK_NORMAL);
        }
    }
    for (uint32_t i = 0; v->n < n; i++) { /* large presets: unreachable fillers */
        snprintf(piece, sizeof piece, "<synth_%u>", i);
        vocab_add(v, piece, -10000.0f, TOK_NORMAL);
    }
}

static void vocab_free(vocab *v) {
    for (uint32_t i = 0; i < v->n; i++) free(v->tokens[i]);
    free(v->tokens);
    free(v->scores);
    free(v->types);
    free(v->slots);
}

/* ==== Tensors ==== */

typedef struct synth {
    const moe_synth_params *p;
    moe_gguf_writer *w;
    uint64_t rng;
    regex_t *rules;    /* [p->n_rules], compiled */
    regex_t optional;  /* p->optional, anchored */
    bool has_optional; /* p->optional given */
    moe_pool *pool;    /* quantizes the drawn rows (every CPU) */
    moe_error *err;
} synth;

static moe_type type_for(const synth *s, const char *name, int64_t n_in) {
    moe_type t = MOE_TYPE_F32;
    for (uint32_t i = 0; i < s->p->n_rules; i++) {
        if (regexec(&s->rules[i], name, 0, NULL, 0) == 0) {
            t = s->p->rules[i].type;
            break;
        }
    }
    /* a row that is not a whole number of blocks cannot take the type: keep F32 and say so,
     * as llama-quantize falls back for such tensors */
    if (moe_type_row_bytes(t, n_in)) return t;
    moe_log(MOE_LOG_WARN, "synth: '%s' rows of %lld values are not whole %s blocks: kept F32", name,
            (long long)n_in, moe_type_name(t));
    return MOE_TYPE_F32;
}

/* n_mat matrices of [n_in] x n_out N(0, 1/n_in) values; rows below first_live_row of each
 * are zero (the demo's head mutes special and byte tokens that way). */
static moe_status add_weights(synth *s, const char *name, int64_t n_in, int64_t n_out,
                              int64_t n_mat, int64_t first_live_row, bool keep_f32) {
    if (s->err->code) return s->err->code;
    const moe_type type = keep_f32 ? MOE_TYPE_F32 : type_for(s, name, n_in);
    const int64_t ne[3] = {n_in, n_out, n_mat};
    const uint32_t n_dims = n_mat > 1 ? 3 : (n_out > 1 ? 2 : 1);
    if (s->p->header_only)
        return moe_gguf_writer_add_tensor(s->w, name, type, n_dims, ne, NULL, false, s->err);
    const moe_type_traits *t = moe_type_traits_get(type);
    const bool random_blocks = s->p->random_blocks && t->is_quantized;
    if (!moe_type_can_quantize(type) && !random_blocks)
        return moe_error_set(s->err, MOE_ERR_UNSUPPORTED,
                             "tensor '%s': moe has no quantizer for %s (it can read it, not "
                             "write it); --random-blocks writes random valid blocks of any type",
                             name, t->name);
    const uint64_t row_bytes = moe_type_row_bytes(type, n_in);
    const uint64_t n_rows = (uint64_t)(n_out * n_mat);
    uint8_t *blocks = malloc(row_bytes * n_rows);
    /* rows are drawn in order (one seed stream), then quantized a chunk at a time on the pool */
    const uint64_t chunk = SYNTH_CHUNK_ROWS;
    float *rows = moe_xmalloc(sizeof(float) * (size_t)(chunk * (uint64_t)n_in));
    if (!blocks) {
        free(rows);
        return moe_error_set(s->err, MOE_ERR_NOMEM, "tensor '%s': cannot allocate %llu bytes", name,
                             (unsigned long long)(row_bytes * n_rows));
    }
    const float scale = 1.0f / sqrtf((float)n_in);
    for (uint64_t r0 = 0; r0 < n_rows; r0 += chunk) {
        const uint64_t r1 = r0 + chunk < n_rows ? r0 + chunk : n_rows;
        for (uint64_t r = r0; r < r1; r++) {
            const bool live = (int64_t)(r % (uint64_t)n_out) >= first_live_row;
            if (random_blocks) {
                if (live)
                    moe_type_random_row_rms(type, &s->rng, blocks + r * row_bytes, n_in, scale);
                else
                    memset(blocks + r * row_bytes, 0, row_bytes);
                continue;
            }
            float *row = rows + (r - r0) * (uint64_t)n_in;
            for (int64_t i = 0; i < n_in; i++)
                row[i] = live ? (float)moe_rng_gaussian(&s->rng) * scale : 0.0f;
        }
        if (!random_blocks)
            moe_quantize_rows(type, rows, blocks + r0 * row_bytes, (int64_t)(r1 - r0), n_in, NULL,
                              s->pool);
    }
    moe_status st = moe_gguf_writer_add_tensor(s->w, name, type, n_dims, ne, blocks, false, s->err);
    free(rows);
    free(blocks);
    return st;
}

/* A float tensor of the declared shape: ones (scale 0: norm weights) or N(0, scale^2) values
 * (biases, conv taps, mixer vectors). */
static moe_status add_floats(synth *s, const moe_tensor_decl *d, float scale) {
    if (s->err->code) return s->err->code;
    if (s->p->header_only)
        return moe_gguf_writer_add_tensor(s->w, d->name, MOE_TYPE_F32, (uint32_t)d->n_dims, d->ne,
                                          NULL, false, s->err);
    const int64_t n = d->ne[0] * d->ne[1] * d->ne[2];
    float *v = moe_xmalloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = scale ? (float)moe_rng_gaussian(&s->rng) * scale : 1.0f;
    moe_status st = moe_gguf_writer_add_tensor(s->w, d->name, MOE_TYPE_F32, (uint32_t)d->n_dims,
                                               d->ne, v, false, s->err);
    free(v);
    return st;
}

/* ==== Keys and tensors ==== */

/* The keys: every field that is set, under the architecture's prefix, and the vocabulary. */
static void write_metadata(synth *s, const vocab *v) {
    const moe_synth_params *p = s->p;
    moe_gguf_writer *w = s->w;
    char key[128];
#define ARCH_KEY(suffix) (snprintf(key, sizeof key, "%s." suffix, p->arch), key)
    moe_gguf_writer_set_str(w, "general.architecture", p->arch);
    moe_gguf_writer_set_str(w, "general.name", p->name ? p->name : "moe synth (random weights)");
    moe_gguf_writer_set_u32(w, ARCH_KEY("context_length"), p->n_ctx);
    moe_gguf_writer_set_u32(w, ARCH_KEY("embedding_length"), p->n_embd);
    const uint32_t n_all = p->n_layer + p->n_nextn;
    moe_gguf_writer_set_u32(w, ARCH_KEY("block_count"), n_all);
    moe_gguf_writer_set_u32(w, ARCH_KEY("feed_forward_length"), p->n_ff);
    moe_gguf_writer_set_u32(w, ARCH_KEY("attention.head_count"), p->n_head);
    if (p->linear_interval) { /* per layer: 0 marks the KDA layers */
        uint32_t *kv = moe_xcalloc(n_all, sizeof *kv);
        for (uint32_t il = 0; il < n_all; il++)
            kv[il] = il < p->n_layer && (il + 1) % p->linear_interval ? 0 : p->n_head_kv;
        moe_gguf_writer_set_arr(w, ARCH_KEY("attention.head_count_kv"), MOE_GGUF_U32, kv, n_all);
        free(kv);
    } else {
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.head_count_kv"), p->n_head_kv);
    }
    const bool mla = p->n_lora_kv != 0;
    moe_gguf_writer_set_u32(w, ARCH_KEY("attention.key_length"),
                            mla ? p->n_lora_kv + p->rope_dims : p->head_dim);
    moe_gguf_writer_set_u32(w, ARCH_KEY("attention.value_length"),
                            mla ? p->n_lora_kv : p->head_dim);
    if (p->rope_base) moe_gguf_writer_set_f32(w, ARCH_KEY("rope.freq_base"), p->rope_base);
    moe_gguf_writer_set_f32(w, ARCH_KEY("attention.layer_norm_rms_epsilon"),
                            p->rms_eps ? p->rms_eps : 1e-6f);
    if (p->rope_dims || mla)
        moe_gguf_writer_set_u32(w, ARCH_KEY("rope.dimension_count"), p->rope_dims);
    if (mla) {
        if (p->n_lora_q) moe_gguf_writer_set_u32(w, ARCH_KEY("attention.q_lora_rank"), p->n_lora_q);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.kv_lora_rank"), p->n_lora_kv);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.key_length_mla"), p->head_dim_k_mla);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.value_length_mla"), p->head_dim_v_mla);
    }
    if (p->linear_interval) { /* kda.head_dim as upstream's loader reads it, ssm.* as its
                               * converter writes them */
        moe_gguf_writer_set_u32(w, ARCH_KEY("ssm.conv_kernel"), p->d_conv);
        moe_gguf_writer_set_u32(w, ARCH_KEY("ssm.inner_size"), p->n_head * p->kda_head_dim);
        moe_gguf_writer_set_u32(w, ARCH_KEY("ssm.state_size"), p->kda_head_dim);
        moe_gguf_writer_set_u32(w, ARCH_KEY("ssm.group_count"), p->n_head);
        moe_gguf_writer_set_u32(w, ARCH_KEY("kda.head_dim"), p->kda_head_dim);
    }
    if (p->kda_gate_bound)
        moe_gguf_writer_set_f32(w, ARCH_KEY("kda.gate_lower_bound"), p->kda_gate_bound);
    if (p->n_hc) {
        moe_gguf_writer_set_u32(w, ARCH_KEY("hyper_connection.count"), p->n_hc);
        moe_gguf_writer_set_u32(w, ARCH_KEY("hyper_connection.sinkhorn_iterations"), p->hc_iters);
        moe_gguf_writer_set_f32(w, ARCH_KEY("hyper_connection.epsilon"), p->hc_eps);
    }
    if (p->idx_n_head) {
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.indexer.head_count"), p->idx_n_head);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.indexer.key_length"), p->idx_head_dim);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.indexer.top_k"), p->idx_top_k);
        moe_gguf_writer_set_u32(w, ARCH_KEY("attention.indexer.block_size"), p->idx_kpool);
        moe_gguf_writer_set_f32(w, ARCH_KEY("attention.layer_norm_epsilon"), p->idx_norm_eps);
    }
    const struct {
        const char *suffix;
        float limit;
    } clamps[] = {{"swiglu_clamp_exp", p->swiglu_clamp_exp},
                  {"swiglu_clamp_shexp", p->swiglu_clamp_shexp}};
    for (size_t k = 0; k < 2; k++) { /* one per layer, as the converter writes them */
        if (!clamps[k].limit) continue;
        float *limits = moe_xmalloc(sizeof(float) * n_all);
        for (uint32_t il = 0; il < n_all; il++) limits[il] = clamps[k].limit;
        snprintf(key, sizeof key, "%s.%s", p->arch, clamps[k].suffix);
        moe_gguf_writer_set_arr(w, key, MOE_GGUF_F32, limits, n_all);
        free(limits);
    }
    if (p->n_expert) {
        moe_gguf_writer_set_u32(w, ARCH_KEY("expert_count"), p->n_expert);
        moe_gguf_writer_set_u32(w, ARCH_KEY("expert_used_count"), p->n_expert_used);
        moe_gguf_writer_set_u32(w, ARCH_KEY("expert_feed_forward_length"), p->n_ff_exp);
    }
    if (p->n_dense_lead)
        moe_gguf_writer_set_u32(w, ARCH_KEY("leading_dense_block_count"), p->n_dense_lead);
    if (p->n_shared_expert)
        moe_gguf_writer_set_u32(w, ARCH_KEY("expert_shared_count"), p->n_shared_expert);
    if (p->gating) {
        moe_gguf_writer_set_u32(w, ARCH_KEY("expert_gating_func"), p->gating);
        moe_gguf_writer_set_bool(w, ARCH_KEY("expert_weights_norm"), true);
    }
    if (p->expert_weights_scale)
        moe_gguf_writer_set_f32(w, ARCH_KEY("expert_weights_scale"), p->expert_weights_scale);
    if (p->n_nextn) moe_gguf_writer_set_u32(w, ARCH_KEY("nextn_predict_layers"), p->n_nextn);
#undef ARCH_KEY
    moe_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.tokens", MOE_GGUF_STRING, v->tokens, v->n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.scores", MOE_GGUF_F32, v->scores, v->n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOE_GGUF_I32, v->types, v->n);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    moe_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true);
}

/* One tensor the architecture binds (moe_model_declare's callback): norms are ones, other
 * float vectors small N(0, 0.02^2) values (exp_probs_b 0.05), routers stay F32, every other
 * matrix gets the type its rule says. Optional tensors only where p->optional matches. */
static bool add_declared(void *ctx, const moe_tensor_decl *d) {
    synth *s = ctx;
    if (!d->required && (!s->has_optional || regexec(&s->optional, d->name, 0, NULL, 0) != 0))
        return false;
    const int64_t *ne = d->ne;
    const size_t len = strlen(d->name);
    const bool bias = len > 5 && strcmp(d->name + len - 5, ".bias") == 0;
    if (d->f32 && d->n_dims == 1 && strstr(d->name, "norm") && !bias)
        add_floats(s, d, 0.0f);
    else if (d->f32)
        add_floats(s, d, strstr(d->name, "exp_probs_b") ? 0.05f : 0.02f);
    else
        add_weights(s, d->name, ne[0], ne[1], ne[2],
                    /* the head: special and byte tokens muted when asked, so random text is
                     * word pieces */
                    s->p->mute_special_output && strcmp(d->name, "output.weight") == 0 ? 3 + 256
                                                                                       : 0,
                    strstr(d->name, "ffn_gate_inp.weight") != NULL);
    return true;
}

/* The keys read back through the architecture's own config reader, then its tensors. */
static void write_tensors(synth *s) {
    moe_gguf *keys = moe_gguf_writer_read_keys(s->w, s->err);
    if (!keys) return;
    moe_model_config c;
    if (moe_model_config_read(keys, s->p->arch, &c, s->err) == MOE_OK) {
        c.n_vocab = s->p->n_vocab;
        moe_model_declare(&c, add_declared, s, s->err);
        moe_model_config_free(&c);
    }
    moe_gguf_close(keys);
}

/* ==== Entry ==== */

moe_status moe_synth_write(const moe_synth_params *p, const char *path, moe_error *err) {
    if (!moe_arch_find(p->arch))
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "synth: unknown architecture '%s' (moe runs: %s)", p->arch,
                             moe_arch_names());
    if (!p->n_embd || !p->n_layer || !p->n_head || !p->n_head_kv || !p->head_dim ||
        p->n_head % p->n_head_kv || p->n_vocab < 3 + 256 + 1 ||
        (p->n_expert && (!p->n_expert_used || p->n_expert_used > p->n_expert || !p->n_ff_exp)) ||
        (!p->n_expert && !p->n_ff))
        return moe_error_set(err, MOE_ERR_ARG,
                             "synth: inconsistent shape (embd %u, layers %u, "
                             "heads %u/%u, head_dim %u, vocab %u >= 260, experts %u/%u, ff %u/%u)",
                             p->n_embd, p->n_layer, p->n_head, p->n_head_kv, p->head_dim,
                             p->n_vocab, p->n_expert_used, p->n_expert, p->n_ff, p->n_ff_exp);
    if (p->linear_interval && p->n_layer < p->linear_interval)
        return moe_error_set(err, MOE_ERR_ARG,
                             "synth: %u layers: %s runs attention in every %u-th layer, so it "
                             "needs at least %u (--layers)",
                             p->n_layer, p->arch, p->linear_interval, p->linear_interval);
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    synth s = {.p = p,
               .w = moe_gguf_writer_new(),
               .rng = p->seed,
               .pool = moe_pool_new(cpus > 1 ? (int)(cpus < 64 ? cpus : 64) : 1),
               .err = err};
    s.rules = moe_xcalloc(p->n_rules ? p->n_rules : 1, sizeof(regex_t));
    uint32_t compiled = 0;
    for (; compiled < p->n_rules; compiled++) {
        if (regcomp(&s.rules[compiled], p->rules[compiled].pattern, REG_EXTENDED | REG_NOSUB) !=
            0) {
            moe_error_set(err, MOE_ERR_ARG,
                          "synth: --type pattern '%s' is not a valid regular "
                          "expression",
                          p->rules[compiled].pattern);
            break;
        }
    }
    if (!err->code && p->optional) {
        char *anchored = moe_xmalloc(strlen(p->optional) + 5);
        sprintf(anchored, "^(%s)$", p->optional);
        s.has_optional = regcomp(&s.optional, anchored, REG_EXTENDED | REG_NOSUB) == 0;
        free(anchored);
        if (!s.has_optional)
            moe_error_set(err, MOE_ERR_ARG, "synth: optional-tensor pattern '%s' is not valid",
                          p->optional);
    }
    if (!err->code) {
        vocab v = {0};
        vocab_build(&v, p->n_vocab);
        write_metadata(&s, &v);
        vocab_free(&v);
        write_tensors(&s);
        moe_gguf_writer_set_file_type(s.w); /* none for a file led by Q8_1 / Q8_K */
    }
    if (!err->code && p->header_only)
        moe_gguf_writer_write_header_only(s.w, path, err);
    else if (!err->code)
        moe_gguf_writer_write(s.w, path, 0, err);
    for (uint32_t i = 0; i < compiled; i++) regfree(&s.rules[i]);
    if (s.has_optional) regfree(&s.optional);
    free(s.rules);
    moe_gguf_writer_free(s.w);
    moe_pool_free(s.pool);
    return err->code;
}
