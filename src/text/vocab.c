/* vocab.c: the vocabulary both loaders fill -- tokens, merges, special ids -- and its indexes.
 *
 * Owns the builders the loaders call, the finishing step that turns a filled vocabulary into a
 * usable tokenizer (text index, merge index, special-token list, decoded pieces, end-of-
 * generation set), the read-only queries of text.h and the GGUF writer of a vocabulary. It does
 * not parse files (load_gguf.c, load_json.c) or tokenize (encode.c, decode.c).
 * The trap: a GGUF vocabulary may hold the same text twice; like llama.cpp the later id wins
 * the text -> id lookup, while both ids still decode. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text_internal.h"

/* ==== GPT-2 byte <-> unicode mapping ==== */

/* Printable bytes stand for themselves; the other 68 bytes map, in order, to U+0100.. */
static bool byte_is_printable(uint32_t b) {
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

uint32_t moe_bytelevel_cp(uint8_t byte) {
    if (byte_is_printable(byte)) return byte;
    if (byte <= 0x20) return 256u + byte;
    if (byte <= 0xa0) return 256u + 33u + (byte - 0x7fu);
    return 256u + 33u + 34u; /* 0xad */
}

int moe_bytelevel_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 33 + 34) return (int)(cp - 256 - 33 + 0x7f);
    if (cp == 256 + 33 + 34) return 0xad;
    return -1;
}

static size_t utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decode one well-formed UTF-8 sequence at s[0..n); 0 bytes consumed when it is not one. */
static size_t utf8_get(const uint8_t *s, size_t n, uint32_t *cp) {
    size_t len = moe_utf8_len(s[0]);
    if (len == 1) {
        *cp = s[0];
        return s[0] < 0x80 ? 1 : 0;
    }
    if (len > n) return 0;
    uint32_t v = s[0] & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    *cp = v;
    return len;
}

/* ==== Hash index: text -> id ==== */

static uint64_t hash_bytes(uint64_t h, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
#define HASH_SEED 0xcbf29ce484222325ull

static const char *token_text(const moe_tokenizer *tok, int32_t id) {
    return tok->text_buf + tok->tokens[id].text_off;
}

/* Find text a followed by b (b may be empty) in the index. */
static int32_t index_get2(const moe_tokenizer *tok, const char *a, size_t na, const char *b,
                          size_t nb) {
    const moe_str_index *ix = &tok->by_text;
    if (!ix->cap) return MOE_TOKEN_NONE;
    uint64_t h = hash_bytes(hash_bytes(HASH_SEED, a, na), b, nb);
    for (uint32_t i = (uint32_t)h & (ix->cap - 1);; i = (i + 1) & (ix->cap - 1)) {
        int32_t id = ix->slots[i];
        if (id < 0) return MOE_TOKEN_NONE;
        const moe_vocab_token *t = &tok->tokens[id];
        if (t->text_len == na + nb && memcmp(token_text(tok, id), a, na) == 0 &&
            memcmp(token_text(tok, id) + na, b, nb) == 0)
            return id;
    }
}

int32_t moe_str_index_get(const moe_tokenizer *tok, const char *text, size_t len) {
    return index_get2(tok, text, len, "", 0);
}

void moe_vocab_index_texts(moe_tokenizer *tok) {
    moe_str_index *ix = &tok->by_text;
    free(ix->slots);
    uint32_t cap = 16;
    while (cap < 2 * (uint64_t)tok->n_vocab) cap *= 2;
    ix->slots = moe_xmalloc(cap * sizeof *ix->slots);
    memset(ix->slots, 0xff, cap * sizeof *ix->slots);
    ix->cap = cap;
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        const moe_vocab_token *t = &tok->tokens[id];
        if (t->type == MOE_TOKEN_UNDEFINED) continue; /* a hole, named at finish */
        uint64_t h = hash_bytes(HASH_SEED, token_text(tok, (int32_t)id), t->text_len);
        uint32_t i = (uint32_t)h & (cap - 1);
        for (;; i = (i + 1) & (cap - 1)) {
            int32_t other = ix->slots[i];
            if (other < 0) break;
            if (tok->tokens[other].text_len == t->text_len &&
                memcmp(token_text(tok, other), token_text(tok, (int32_t)id), t->text_len) == 0)
                break; /* duplicate text: the later id wins, as in llama.cpp */
        }
        ix->slots[i] = (int32_t)id;
    }
}

/* ==== Merge index: (left, right) -> (rank, merged) ==== */

#define MERGE_EMPTY UINT64_MAX

static uint64_t merge_key(int32_t left, int32_t right) {
    return (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
}

static uint32_t merge_slot(uint64_t key, uint32_t cap) {
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 32) & (cap - 1);
}

const moe_merge_entry *moe_merge_find(const moe_tokenizer *tok, int32_t left, int32_t right) {
    const moe_merge_index *ix = &tok->merge_index;
    if (!ix->cap) return NULL;
    uint64_t key = merge_key(left, right);
    for (uint32_t i = merge_slot(key, ix->cap); ix->slots[i].key != MERGE_EMPTY;
         i = (i + 1) & (ix->cap - 1))
        if (ix->slots[i].key == key) return &ix->slots[i];
    return NULL;
}

static void merge_index_build(moe_tokenizer *tok) {
    moe_merge_index *ix = &tok->merge_index;
    free(ix->slots);
    uint32_t cap = 16;
    while (cap < 2 * (uint64_t)tok->n_merges) cap *= 2;
    ix->slots = moe_xmalloc(cap * sizeof *ix->slots);
    for (uint32_t i = 0; i < cap; i++) ix->slots[i].key = MERGE_EMPTY;
    ix->cap = cap;
    for (uint32_t r = 0; r < tok->n_merges; r++) {
        int32_t l = tok->merges[r][0], rt = tok->merges[r][1];
        uint64_t key = merge_key(l, rt);
        uint32_t i = merge_slot(key, cap);
        while (ix->slots[i].key != MERGE_EMPTY && ix->slots[i].key != key) i = (i + 1) & (cap - 1);
        if (ix->slots[i].key == key) continue; /* a repeated merge keeps its first rank */
        const moe_vocab_token *a = &tok->tokens[l], *b = &tok->tokens[rt];
        ix->slots[i].key = key;
        ix->slots[i].rank = r;
        ix->slots[i].merged =
            index_get2(tok, token_text(tok, l), a->text_len, token_text(tok, rt), b->text_len);
    }
}

/* ==== Builders ==== */

moe_tokenizer *moe_vocab_new(moe_tokenizer_kind kind) {
    moe_tokenizer *tok = moe_xcalloc(1, sizeof *tok);
    tok->kind = kind;
    tok->bos = tok->eos = tok->unk = tok->pad = tok->eot = tok->eom = MOE_TOKEN_NONE;
    tok->add_space_prefix = kind == MOE_TOKENIZER_SPM;
    tok->add_bos = kind == MOE_TOKENIZER_SPM;
    return tok;
}

static uint64_t text_append(moe_tokenizer *tok, const char *text, size_t len) {
    if (tok->text_cap - tok->text_len < len + 1) {
        uint64_t cap = tok->text_cap ? tok->text_cap : 4096;
        while (cap - tok->text_len < len + 1) cap *= 2;
        tok->text_buf = moe_xrealloc(tok->text_buf, cap);
        tok->text_cap = cap;
    }
    uint64_t off = tok->text_len;
    memcpy(tok->text_buf + off, text, len);
    tok->text_buf[off + len] = '\0';
    tok->text_len += len + 1;
    return off;
}

moe_status moe_vocab_set_token(moe_tokenizer *tok, uint32_t id, const char *text, size_t len,
                               float score, moe_token_type type, moe_error *err) {
    if (id >= MOE_TOKENIZER_MAX_VOCAB)
        return moe_error_set(err, MOE_ERR_RANGE, "token id %u is beyond the limit of %u tokens", id,
                             MOE_TOKENIZER_MAX_VOCAB);
    if (len > MOE_TOKENIZER_MAX_TOKEN_BYTES)
        return moe_error_set(err, MOE_ERR_RANGE, "token %u is %zu bytes long (max %u)", id, len,
                             MOE_TOKENIZER_MAX_TOKEN_BYTES);
    if (type <= MOE_TOKEN_UNDEFINED || type >= MOE_TOKEN_TYPE_COUNT)
        return moe_error_set(err, MOE_ERR_FORMAT, "token %u has type %d (valid: 1..%d)", id,
                             (int)type, MOE_TOKEN_TYPE_COUNT - 1);
    if (id >= tok->tokens_cap) {
        uint32_t cap = tok->tokens_cap ? tok->tokens_cap : 1024;
        while (cap <= id) cap *= 2;
        tok->tokens = moe_xrealloc(tok->tokens, cap * sizeof *tok->tokens);
        memset(tok->tokens + tok->tokens_cap, 0, (cap - tok->tokens_cap) * sizeof *tok->tokens);
        tok->tokens_cap = cap;
    }
    if (id >= tok->n_vocab) tok->n_vocab = id + 1;
    moe_vocab_token *t = &tok->tokens[id];
    t->text_off = text_append(tok, text, len);
    t->text_len = (uint32_t)len;
    t->score = score;
    t->type = (uint8_t)type;
    return MOE_OK;
}

moe_status moe_vocab_add_merge(moe_tokenizer *tok, const char *left, size_t left_len,
                               const char *right, size_t right_len, moe_error *err) {
    if (tok->n_merges >= MOE_TOKENIZER_MAX_MERGES)
        return moe_error_set(err, MOE_ERR_RANGE, "more than %u merges", MOE_TOKENIZER_MAX_MERGES);
    int32_t l = moe_str_index_get(tok, left, left_len);
    int32_t r = moe_str_index_get(tok, right, right_len);
    if (l < 0 || r < 0) return MOE_OK; /* a merge of non-tokens can never apply */
    if (tok->n_merges == tok->merges_cap) {
        tok->merges_cap = tok->merges_cap ? 2 * tok->merges_cap : 1024;
        tok->merges = moe_xrealloc(tok->merges, tok->merges_cap * sizeof *tok->merges);
    }
    tok->merges[tok->n_merges][0] = l;
    tok->merges[tok->n_merges][1] = r;
    tok->n_merges++;
    return MOE_OK;
}

/* ==== Finishing ==== */

static int cmp_special(const void *pa, const void *pb, void *ctx) {
    const moe_tokenizer *tok = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint32_t la = tok->tokens[a].text_len, lb = tok->tokens[b].text_len;
    if (la != lb) return la > lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

static int cmp_id(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return a < b ? -1 : a > b;
}

/* Texts of control tokens that end a turn in the chat formats moe knows (llama.cpp's list). */
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "<|end_of_text|>", "<|return|>", "<|call|>",
    /* DeepSeek: <|end_of_sentence|> with fullwidth bars (U+FF5C) and U+2581 for "_" */
    ("<\xef\xbd\x9c"
     "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"), /* split: \x9c would eat the 'e' */
};

static void add_eog(moe_tokenizer *tok, int32_t id) {
    if (id < 0) return;
    for (uint32_t i = 0; i < tok->n_eog; i++)
        if (tok->eog[i] == id) return;
    tok->eog = moe_xrealloc(tok->eog, (tok->n_eog + 1) * sizeof *tok->eog);
    tok->eog[tok->n_eog++] = id;
}

/* The bytes a token decodes to, appended to the piece buffer. */
static void build_pieces(moe_tokenizer *tok) {
    uint64_t cap = tok->text_len + 16, used = 0;
    char *buf = moe_xmalloc(cap);
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        moe_vocab_token *t = &tok->tokens[id];
        const char *s = token_text(tok, (int32_t)id);
        if (cap - used < (uint64_t)t->text_len + 4) {
            while (cap - used < (uint64_t)t->text_len + 4) cap *= 2;
            buf = moe_xrealloc(buf, cap);
        }
        char *out = buf + used;
        size_t n = 0;
        switch ((moe_token_type)t->type) {
        case MOE_TOKEN_CONTROL:
        case MOE_TOKEN_UNKNOWN:
        case MOE_TOKEN_USER_DEFINED:
            memcpy(out, s, t->text_len);
            n = t->text_len;
            break;
        case MOE_TOKEN_BYTE: {
            unsigned v;
            char tail;
            if (t->text_len == 6 && sscanf(s, "<0x%2x%c", &v, &tail) == 2 && tail == '>') {
                out[0] = (char)v;
                n = 1;
            } else {
                memcpy(out, s, t->text_len);
                n = t->text_len;
            }
            break;
        }
        case MOE_TOKEN_NORMAL:
            if (tok->kind != MOE_TOKENIZER_BPE) { /* U+2581 back to spaces */
                for (size_t i = 0; i < t->text_len;) {
                    if (t->text_len - i >= 3 && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                        out[n++] = ' ';
                        i += 3;
                    } else {
                        out[n++] = s[i++];
                    }
                }
            } else {
                for (size_t i = 0; i < t->text_len;) {
                    uint32_t cp;
                    size_t k = utf8_get((const uint8_t *)s + i, t->text_len - i, &cp);
                    int b = k ? moe_bytelevel_byte(cp) : -1;
                    if (b >= 0) {
                        out[n++] = (char)b;
                        i += k;
                    } else { /* not a byte-level character: keep the bytes as they are */
                        size_t m = k ? k : 1;
                        memcpy(out + n, s + i, m);
                        n += m;
                        i += m;
                    }
                }
            }
            break;
        default: /* unused and holes decode to nothing, as in llama.cpp */
            break;
        }
        t->piece_off = used;
        t->piece_len = (uint32_t)n;
        if (n > tok->max_piece_len) tok->max_piece_len = (uint32_t)n;
        used += n;
    }
    tok->piece_buf = buf;
}

static moe_status check_id(const moe_tokenizer *tok, int32_t *id, const char *what,
                           moe_error *err) {
    if (*id == MOE_TOKEN_NONE) return MOE_OK;
    if (*id < 0 || (uint32_t)*id >= tok->n_vocab)
        return moe_error_set(err, MOE_ERR_RANGE, "%s token id %d is outside the vocabulary (%u)",
                             what, *id, tok->n_vocab);
    return MOE_OK;
}

moe_tokenizer *moe_vocab_finish(moe_tokenizer *tok, moe_error *err) {
    if (tok->n_vocab == 0) {
        moe_error_set(err, MOE_ERR_FORMAT, "the vocabulary is empty");
        moe_tokenizer_free(tok);
        return NULL;
    }
    /* name the holes so every id has a text of its own */
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->tokens[id].type != MOE_TOKEN_UNDEFINED) continue;
        char name[32];
        int n = snprintf(name, sizeof name, "[PAD%u]", id);
        moe_vocab_set_token(tok, id, name, (size_t)n, 0.0f, MOE_TOKEN_UNUSED, err);
    }
    moe_vocab_index_texts(tok);
    merge_index_build(tok);

    if (check_id(tok, &tok->bos, "BOS", err) || check_id(tok, &tok->eos, "EOS", err) ||
        check_id(tok, &tok->unk, "unknown", err) || check_id(tok, &tok->pad, "padding", err) ||
        check_id(tok, &tok->eot, "EOT", err) || check_id(tok, &tok->eom, "EOM", err)) {
        moe_tokenizer_free(tok);
        return NULL;
    }
    if (tok->add_bos && tok->bos == MOE_TOKEN_NONE) tok->add_bos = false;
    if (tok->add_eos && tok->eos == MOE_TOKEN_NONE) tok->add_eos = false;

    for (int b = 0; b < 256; b++) {
        char name[8];
        size_t n;
        if (tok->kind != MOE_TOKENIZER_BPE) {
            n = (size_t)snprintf(name, sizeof name, "<0x%02X>", b);
            tok->byte_ids[b] = moe_str_index_get(tok, name, n);
            if (tok->byte_ids[b] < 0 && b < 0x80) { /* no byte tokens: the character itself */
                name[0] = (char)b;
                tok->byte_ids[b] = moe_str_index_get(tok, name, 1);
            }
        } else {
            n = utf8_put(moe_bytelevel_cp((uint8_t)b), name);
            tok->byte_ids[b] = moe_str_index_get(tok, name, n);
        }
    }

    /* special tokens, longest first: cut out of the text before tokenizing */
    tok->special = moe_xmalloc((tok->n_vocab + 1) * sizeof *tok->special);
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        uint8_t t = tok->tokens[id].type;
        if ((t == MOE_TOKEN_CONTROL || t == MOE_TOKEN_USER_DEFINED || t == MOE_TOKEN_UNKNOWN) &&
            tok->tokens[id].text_len > 0)
            tok->special[tok->n_special++] = (int32_t)id;
    }
    qsort_r(tok->special, tok->n_special, sizeof *tok->special, cmp_special, tok);

    add_eog(tok, tok->eos);
    add_eog(tok, tok->eot);
    add_eog(tok, tok->eom);
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++)
        add_eog(tok, moe_str_index_get(tok, eog_texts[i], strlen(eog_texts[i])));
    if (tok->n_eog) qsort(tok->eog, tok->n_eog, sizeof *tok->eog, cmp_id);

    build_pieces(tok);
    return tok;
}

void moe_tokenizer_free(moe_tokenizer *tok) {
    if (!tok) return;
    free(tok->tokens);
    free(tok->text_buf);
    free(tok->piece_buf);
    free(tok->by_text.slots);
    free(tok->merges);
    free(tok->merge_index.slots);
    free(tok->special);
    free(tok->eog);
    free(tok->pre_name);
    moe_pretok_free(&tok->pretok);
    free(tok);
}

/* ==== Queries ==== */

moe_tokenizer_kind moe_tokenizer_get_kind(const moe_tokenizer *tok) {
    return tok->kind;
}
uint32_t moe_tokenizer_n_vocab(const moe_tokenizer *tok) {
    return tok->n_vocab;
}
int32_t moe_tokenizer_bos(const moe_tokenizer *tok) {
    return tok->bos;
}
int32_t moe_tokenizer_eos(const moe_tokenizer *tok) {
    return tok->eos;
}
int32_t moe_tokenizer_unk(const moe_tokenizer *tok) {
    return tok->unk;
}
int32_t moe_tokenizer_pad(const moe_tokenizer *tok) {
    return tok->pad;
}
bool moe_tokenizer_adds_bos(const moe_tokenizer *tok) {
    return tok->add_bos;
}
bool moe_tokenizer_adds_eos(const moe_tokenizer *tok) {
    return tok->add_eos;
}

bool moe_tokenizer_adds_space_prefix(const moe_tokenizer *tok) {
    return tok->add_space_prefix;
}
const char *moe_tokenizer_pre_name(const moe_tokenizer *tok) {
    return tok->pre_name;
}

bool moe_tokenizer_is_eog(const moe_tokenizer *tok, int32_t id) {
    return id >= 0 && tok->n_eog &&
           bsearch(&id, tok->eog, tok->n_eog, sizeof *tok->eog, cmp_id) != NULL;
}

moe_token_type moe_tokenizer_token_type(const moe_tokenizer *tok, int32_t id) {
    if (id < 0 || (uint32_t)id >= tok->n_vocab) return MOE_TOKEN_UNDEFINED;
    return (moe_token_type)tok->tokens[id].type;
}

const char *moe_tokenizer_token_text(const moe_tokenizer *tok, int32_t id, size_t *len) {
    if (id < 0 || (uint32_t)id >= tok->n_vocab) return NULL;
    if (len) *len = tok->tokens[id].text_len;
    return token_text(tok, id);
}

uint32_t moe_tokenizer_n_special(const moe_tokenizer *tok) {
    return tok->n_special;
}

int32_t moe_tokenizer_special(const moe_tokenizer *tok, uint32_t k) {
    return k < tok->n_special ? tok->special[k] : MOE_TOKEN_NONE;
}

int32_t moe_tokenizer_find(const moe_tokenizer *tok, const char *text, size_t len) {
    return moe_str_index_get(tok, text, len);
}

/* ==== GGUF writing ==== */

/* A string array with lengths (set_arr takes C strings; a token text may hold any byte). */
static void set_strings(moe_gguf_writer *w, const char *key, const moe_str *s, uint64_t n) {
    moe_gguf_value v = {.type = MOE_GGUF_ARRAY};
    v.arr.elem_type = MOE_GGUF_STRING;
    v.arr.n = n;
    v.arr.data = s;
    moe_gguf_writer_set_value(w, key, &v);
}

moe_status moe_tokenizer_write_gguf(const moe_tokenizer *tok, moe_gguf_writer *w, moe_error *err) {
    const bool spm = tok->kind == MOE_TOKENIZER_SPM;
    if (!spm && !tok->pre_name)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "the pre-tokenizer regex has no GGUF name; it cannot be written");
    const uint32_t n = tok->n_vocab;
    moe_str *texts = moe_xmalloc(n * sizeof *texts);
    float *scores = moe_xmalloc(n * sizeof *scores);
    int32_t *types = moe_xmalloc(n * sizeof *types);
    for (uint32_t id = 0; id < n; id++) {
        texts[id].ptr = token_text(tok, (int32_t)id);
        texts[id].len = tok->tokens[id].text_len;
        scores[id] = tok->tokens[id].score;
        types[id] = tok->tokens[id].type;
    }
    static const char *const models[MOE_TOKENIZER_KIND_COUNT] = {[MOE_TOKENIZER_SPM] = "llama",
                                                                 [MOE_TOKENIZER_BPE] = "gpt2",
                                                                 [MOE_TOKENIZER_SPM_BPE] =
                                                                     "gemma4"};
    moe_gguf_writer_set_str(w, "tokenizer.ggml.model", models[tok->kind]);
    moe_gguf_writer_set_str(w, "tokenizer.ggml.pre", spm ? "default" : tok->pre_name);
    set_strings(w, "tokenizer.ggml.tokens", texts, n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.scores", MOE_GGUF_F32, scores, n);
    moe_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOE_GGUF_I32, types, n);
    free(texts);
    free(scores);
    free(types);

    if (!spm) {
        /* "left right": byte-level and U+2581-escaped token texts hold no space, so the split is
         * unambiguous */
        moe_str *merges = moe_xmalloc((tok->n_merges + 1) * sizeof *merges);
        char **owned = moe_xmalloc((tok->n_merges + 1) * sizeof *owned);
        for (uint32_t r = 0; r < tok->n_merges; r++) {
            const moe_vocab_token *a = &tok->tokens[tok->merges[r][0]];
            const moe_vocab_token *b = &tok->tokens[tok->merges[r][1]];
            char *s = moe_xmalloc((size_t)a->text_len + b->text_len + 2);
            memcpy(s, token_text(tok, tok->merges[r][0]), a->text_len);
            s[a->text_len] = ' ';
            memcpy(s + a->text_len + 1, token_text(tok, tok->merges[r][1]), b->text_len);
            s[a->text_len + 1 + b->text_len] = '\0';
            owned[r] = s;
            merges[r].ptr = s;
            merges[r].len = (uint64_t)a->text_len + 1 + b->text_len;
        }
        set_strings(w, "tokenizer.ggml.merges", merges, tok->n_merges);
        for (uint32_t r = 0; r < tok->n_merges; r++) free(owned[r]);
        free(owned);
        free(merges);
    }
    if (tok->bos >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)tok->bos);
    if (tok->eos >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)tok->eos);
    if (tok->unk >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", (uint32_t)tok->unk);
    if (tok->pad >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)tok->pad);
    if (tok->eot >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.eot_token_id", (uint32_t)tok->eot);
    if (tok->eom >= 0)
        moe_gguf_writer_set_u32(w, "tokenizer.ggml.eom_token_id", (uint32_t)tok->eom);
    moe_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", tok->add_bos);
    moe_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", tok->add_eos);
    if (spm) moe_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", tok->add_space_prefix);
    return MOE_OK;
}
