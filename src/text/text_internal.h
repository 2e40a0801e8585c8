/* text_internal: the vocabulary struct both loaders fill and the algorithms read; not public.
 *
 * Loading is split from tokenizing: load_gguf.c and load_json.c only append tokens, merges and
 * settings through the vocab_* builders below, then call moe_vocab_finish(), which builds every
 * index (text -> id, merge pair -> rank, special tokens by length, pieces, end-of-generation
 * set) and compiles the pre-tokenizer. The trap: ids are dense 0..n_vocab-1 once finished; a
 * tokenizer.json may leave holes, which become UNUSED tokens named "[PAD<id>]" (as llama.cpp's
 * converter names them) so every id has a unique text. */
#ifndef MOE_TEXT_INTERNAL_H
#define MOE_TEXT_INTERNAL_H

#include "text.h"

/* ==== Hash tables (open addressing, power-of-two capacity, never more than half full) ==== */

/* Token text -> id, over texts held in the vocab's text buffer. */
typedef struct moe_str_index {
    int32_t *slots; /* [cap] token id, or -1 when empty */
    uint32_t cap;
} moe_str_index;

/* (left id, right id) -> (rank, merged id). */
typedef struct moe_merge_entry {
    uint64_t key; /* left << 32 | right; UINT64_MAX when empty */
    uint32_t rank;
    int32_t merged;
} moe_merge_entry;

typedef struct moe_merge_index {
    moe_merge_entry *slots; /* [cap] */
    uint32_t cap;
} moe_merge_index;

/* ==== Vocabulary ==== */

typedef struct moe_vocab_token {
    uint64_t text_off; /* into text_buf, NUL-terminated there */
    uint32_t text_len;
    float score;
    uint8_t type;       /* moe_token_type */
    uint64_t piece_off; /* into piece_buf: the decoded bytes */
    uint32_t piece_len;
} moe_vocab_token;

typedef struct moe_pretok {
    void *code[MOE_TOKENIZER_MAX_REGEXES]; /* pcre2_code_8 *, JIT-compiled when possible */
    char *source[MOE_TOKENIZER_MAX_REGEXES];
    uint32_t n;
} moe_pretok;

struct moe_tokenizer {
    moe_tokenizer_kind kind;
    uint32_t n_vocab;
    moe_vocab_token *tokens; /* [n_vocab] */
    uint32_t tokens_cap;
    char *text_buf; /* every token's text, each followed by a NUL */
    uint64_t text_len, text_cap;
    char *piece_buf; /* every token's decoded bytes */
    uint32_t max_piece_len;

    moe_str_index by_text;

    /* merges in rank order, as token ids (BPE only) */
    int32_t (*merges)[2];
    uint32_t n_merges, merges_cap;
    moe_merge_index merge_index;

    int32_t bos, eos, unk, pad, eot, eom;
    bool add_bos, add_eos, add_space_prefix;
    bool ignore_merges; /* a pre-token that is itself a token is not split (Llama 3) */

    int32_t byte_ids[256]; /* the token for each byte (SPM <0xNN>; BPE mapped char), or -1 */

    int32_t *special; /* ids cut out of the text before tokenizing, longest text first */
    uint32_t n_special;
    int32_t *eog; /* end-of-generation ids, sorted */
    uint32_t n_eog;

    char *pre_name; /* GGUF tokenizer.ggml.pre, or NULL */
    moe_pretok pretok;
};

/* ==== Builders (loaders only) ==== */

moe_tokenizer *moe_vocab_new(moe_tokenizer_kind kind);
/* Append or place a token at id (grows the vocab; a hole becomes UNUSED). */
moe_status moe_vocab_set_token(moe_tokenizer *tok, uint32_t id, const char *text, size_t len,
                               float score, moe_token_type type, moe_error *err);
/* Resolve merge texts to ids; merges whose parts or result are not tokens are skipped. Call
 * after every token is set, in rank order. */
moe_status moe_vocab_add_merge(moe_tokenizer *tok, const char *left, size_t left_len,
                               const char *right, size_t right_len, moe_error *err);
/* Build the text index early (the loaders need lookups for merges and named specials). */
void moe_vocab_index_texts(moe_tokenizer *tok);
/* Build every remaining index and check the settings; frees tok and returns NULL on error. */
moe_tokenizer *moe_vocab_finish(moe_tokenizer *tok, moe_error *err);

/* ==== Pre-tokenizer (pretok.c) ==== */

/* The regexes llama.cpp uses for a GGUF tokenizer.ggml.pre name; false if unknown. */
bool moe_pretok_preset(const char *pre_name, const char *const **regexes, uint32_t *n,
                       bool *ignore_merges);
/* Which GGUF pre name a tokenizer.json regex list corresponds to, or NULL. */
const char *moe_pretok_name_for(const char *const *regexes, uint32_t n, bool ignore_merges);
/* Compile (rewriting `(?i:...)` to ASCII-only case classes); on error fills err. */
moe_status moe_pretok_compile(moe_pretok *p, const char *const *regexes, uint32_t n,
                              moe_error *err);
void moe_pretok_free(moe_pretok *p);

/* A chunk of the input: [off, off + len). */
typedef struct moe_span {
    size_t off, len;
} moe_span;

/* Split text into pre-tokens, each regex applied to the pieces the previous left, matched and
 * unmatched parts both kept (Hugging Face's "Isolated"). *spans is allocated. */
moe_status moe_pretok_split(const moe_pretok *p, const char *text, size_t len, moe_span **spans,
                            size_t *n_spans, moe_error *err);

/* ==== Shared helpers ==== */

/* Bytes in the UTF-8 sequence a lead byte starts (1 for an invalid lead). */
static inline size_t moe_utf8_len(uint8_t lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xe0) == 0xc0) return 2;
    if ((lead & 0xf0) == 0xe0) return 3;
    if ((lead & 0xf8) == 0xf0) return 4;
    return 1;
}

/* GPT-2's byte -> code point mapping (printable bytes map to themselves). */
uint32_t moe_bytelevel_cp(uint8_t byte);
/* Inverse; -1 when the code point is not one of the 256. */
int moe_bytelevel_byte(uint32_t cp);

int32_t moe_str_index_get(const moe_tokenizer *tok, const char *text, size_t len);
/* The merge of (left, right), or NULL when the pair never merges. */
const moe_merge_entry *moe_merge_find(const moe_tokenizer *tok, int32_t left, int32_t right);

#endif
