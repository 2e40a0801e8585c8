/* demo.c: the built-in demo model -- a small llama with seeded random weights and a tiny
 * SentencePiece-style vocabulary, written as GGUF on first use so `moe run` works on a fresh
 * machine with nothing downloaded.
 *
 * Everything is derived from one seed, so the file (and what it generates) is the same on
 * every machine. The trap: bump DEMO_VERSION whenever the recipe changes, or old caches will
 * keep serving the previous file. */
#include "tools.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEMO_VERSION 2
#define DEMO_SEED 0x6d6f65u /* "moe" */

/* Shape: small enough to generate in well under a second, large enough to exercise GQA. */
enum { DEMO_EMBD = 256, DEMO_LAYERS = 4, DEMO_HEADS = 8, DEMO_HEADS_KV = 4, DEMO_FF = 768,
       DEMO_CTX = 2048 };

/* Words whose pieces (with every prefix, so merges can reach them) fill the vocabulary. */
static const char *const demo_words[] = {
    "the", "and", "a", "to", "of", "in", "is", "it", "was", "that", "he", "she", "they", "with",
    "on", "for", "as", "at", "by", "from", "this", "we", "you", "not", "but", "or", "have",
    "one", "all", "there", "when", "what", "so", "up", "out", "if", "about", "who", "get",
    "which", "go", "me", "make", "can", "like", "time", "no", "just", "him", "know", "take",
    "people", "into", "year", "your", "good", "some", "could", "them", "see", "other", "than",
    "then", "now", "look", "only", "come", "its", "over", "think", "also", "back", "after",
    "use", "two", "how", "our", "work", "first", "well", "way", "even", "new", "want", "because",
    "any", "these", "give", "day", "most", "us", "expert", "mixture", "model", "token", "sparse",
};

/* ==== Seeded random numbers ==== */

static uint64_t demo_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float demo_normal(uint64_t *s) {
    const double u1 = ((double)(demo_next(s) >> 11) + 0.5) * 0x1p-53;
    const double u2 = (double)(demo_next(s) >> 11) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ==== Vocabulary ==== */

typedef struct demo_vocab {
    char **tokens;
    float *scores;
    int32_t *types;
    uint32_t n, cap;
} demo_vocab;

static void vocab_add(demo_vocab *v, const char *text, float score, int32_t type) {
    for (uint32_t i = 0; i < v->n; i++)
        if (strcmp(v->tokens[i], text) == 0) return;
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 1024;
        v->tokens = moe_xrealloc(v->tokens, sizeof(char *) * v->cap);
        v->scores = moe_xrealloc(v->scores, sizeof(float) * v->cap);
        v->types = moe_xrealloc(v->types, sizeof(int32_t) * v->cap);
    }
    v->tokens[v->n] = moe_xstrdup(text);
    v->scores[v->n] = score;
    v->types[v->n] = type;
    v->n++;
}

enum { DEMO_FIRST_PIECE = 3 + 256 }; /* after <unk> <s> </s> and the 256 byte tokens */

static void demo_vocab_build(demo_vocab *v) {
    enum { NORMAL = 1, UNKNOWN = 2, CONTROL = 3, BYTE = 6 };
    vocab_add(v, "<unk>", 0, UNKNOWN);
    vocab_add(v, "<s>", 0, CONTROL);
    vocab_add(v, "</s>", 0, CONTROL);
    char piece[64];
    for (int b = 0; b < 256; b++) {
        snprintf(piece, sizeof piece, "<0x%02X>", b);
        vocab_add(v, piece, 0, BYTE);
    }
    /* single characters, then word pieces "▁w", "▁wo", ... scored so longer pieces win */
    const char *chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()";
    for (const char *c = chars; *c; c++) {
        snprintf(piece, sizeof piece, "%c", *c);
        vocab_add(v, piece, -1000.0f, NORMAL);
    }
    vocab_add(v, "\xe2\x96\x81", -1000.0f, NORMAL); /* U+2581, SentencePiece's space */
    for (size_t w = 0; w < sizeof demo_words / sizeof demo_words[0]; w++) {
        const size_t len = strlen(demo_words[w]);
        for (size_t k = 1; k <= len; k++) {
            snprintf(piece, sizeof piece, "\xe2\x96\x81%.*s", (int)k, demo_words[w]);
            vocab_add(v, piece, -(float)(100 - 10 * (float)k) - (float)w * 0.01f, NORMAL);
        }
    }
}

static void demo_vocab_free(demo_vocab *v) {
    for (uint32_t i = 0; i < v->n; i++) free(v->tokens[i]);
    free(v->tokens);
    free(v->scores);
    free(v->types);
}

/* ==== Weights ==== */

/* A [n_in] x n_out matrix of N(0, 1/n_in) values, quantized to `type`; rows below
 * `first_live_row` are zero (the output head mutes special and byte tokens that way, so the
 * random text is made of word pieces rather than stray bytes). */
static moe_status add_matrix(moe_gguf_writer *w, uint64_t *rng, const char *name, moe_type type,
                             int64_t n_in, int64_t n_out, int64_t first_live_row, moe_error *err) {
    const moe_type_traits *t = moe_type_traits_get(type);
    float *values = moe_xmalloc(sizeof(float) * (size_t)(n_in * n_out));
    const float scale = 1.0f / sqrtf((float)n_in);
    for (int64_t i = 0; i < n_in * n_out; i++)
        values[i] = i / n_in < first_live_row ? 0.0f : demo_normal(rng) * scale;
    const uint64_t bytes = moe_type_row_bytes(type, n_in) * (uint64_t)n_out;
    void *blocks = moe_xmalloc(bytes);
    t->from_float(values, blocks, n_in * n_out);
    const int64_t ne[2] = {n_in, n_out};
    moe_status st = moe_gguf_writer_add_tensor(w, name, type, 2, ne, blocks, false, err);
    free(blocks);
    free(values);
    return st;
}

static moe_status add_norm(moe_gguf_writer *w, const char *name, int64_t n, moe_error *err) {
    float *ones = moe_xmalloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) ones[i] = 1.0f;
    moe_status st = moe_gguf_writer_add_tensor(w, name, MOE_TYPE_F32, 1, &n, ones, false, err);
    free(ones);
    return st;
}

moe_status moe_demo_model_write(const char *path, moe_error *err) {
    moe_gguf_writer *w = moe_gguf_writer_new();
    demo_vocab v = {0};
    demo_vocab_build(&v);
    moe_gguf_writer_set_str(w, "general.architecture", "llama");
    moe_gguf_writer_set_str(w, "general.name", "moe built-in demo (random weights)");
    moe_gguf_writer_set_u32(w, "llama.context_length", DEMO_CTX);
    moe_gguf_writer_set_u32(w, "llama.embedding_length", DEMO_EMBD);
    moe_gguf_writer_set_u32(w, "llama.block_count", DEMO_LAYERS);
    moe_gguf_writer_set_u32(w, "llama.feed_forward_length", DEMO_FF);
    moe_gguf_writer_set_u32(w, "llama.attention.head_count", DEMO_HEADS);
    moe_gguf_writer_set_u32(w, "llama.attention.head_count_kv", DEMO_HEADS_KV);
    moe_gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    moe_gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    moe_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.tokens", MOE_GGUF_STRING, v.tokens, v.n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.scores", MOE_GGUF_F32, v.scores, v.n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOE_GGUF_I32, v.types, v.n);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    moe_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    moe_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true);

    uint64_t rng = DEMO_SEED;
    const int64_t kv = (int64_t)DEMO_EMBD / DEMO_HEADS * DEMO_HEADS_KV;
    char name[96];
    moe_status st = add_matrix(w, &rng, "token_embd.weight", MOE_TYPE_Q8_0, DEMO_EMBD, v.n, 0, err);
    for (int il = 0; il < DEMO_LAYERS && st == MOE_OK; il++) {
        const struct { const char *what; int64_t n_in, n_out; } mats[] = {
            {"attn_q", DEMO_EMBD, DEMO_EMBD}, {"attn_k", DEMO_EMBD, kv},
            {"attn_v", DEMO_EMBD, kv},        {"attn_output", DEMO_EMBD, DEMO_EMBD},
            {"ffn_gate", DEMO_EMBD, DEMO_FF}, {"ffn_up", DEMO_EMBD, DEMO_FF},
            {"ffn_down", DEMO_FF, DEMO_EMBD},
        };
        for (size_t i = 0; i < sizeof mats / sizeof mats[0] && st == MOE_OK; i++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", il, mats[i].what);
            st = add_matrix(w, &rng, name, MOE_TYPE_Q8_0, mats[i].n_in, mats[i].n_out, 0, err);
        }
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", il);
        if (st == MOE_OK) st = add_norm(w, name, DEMO_EMBD, err);
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", il);
        if (st == MOE_OK) st = add_norm(w, name, DEMO_EMBD, err);
    }
    if (st == MOE_OK) st = add_norm(w, "output_norm.weight", DEMO_EMBD, err);
    if (st == MOE_OK) st = add_matrix(w, &rng, "output.weight", MOE_TYPE_Q8_0, DEMO_EMBD, v.n, DEMO_FIRST_PIECE, err);
    if (st == MOE_OK) st = moe_gguf_writer_write(w, path, 0, err);
    moe_gguf_writer_free(w);
    demo_vocab_free(&v);
    return st;
}

/* ==== Cache ==== */

static bool make_dirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        const bool ok = mkdir(path, 0755) == 0 || errno == EEXIST;
        *p = '/';
        if (!ok) return false;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST;
}

char *moe_demo_model_path(moe_error *err) {
    char dir[4096];
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && xdg[0] == '/') snprintf(dir, sizeof dir, "%s/moe", xdg);
    else if (home && home[0]) snprintf(dir, sizeof dir, "%s/.cache/moe", home);
    else snprintf(dir, sizeof dir, "/tmp/moe-cache");
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/demo-llama-v%d.gguf", dir, DEMO_VERSION);
    struct stat st;
    if (stat(path, &st) == 0) return moe_xstrdup(path);
    if (!make_dirs(dir)) {
        moe_error_set(err, MOE_ERR_IO, "cannot create cache directory %s: %s", dir, strerror(errno));
        return NULL;
    }
    /* write aside and rename, so a concurrent or interrupted run never sees half a file */
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    if (moe_demo_model_write(tmp, err) != MOE_OK) {
        unlink(tmp);
        return NULL;
    }
    if (rename(tmp, path) != 0) {
        moe_error_set(err, MOE_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return NULL;
    }
    return moe_xstrdup(path);
}
