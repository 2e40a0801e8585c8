/* text: text in and out of the model -- tokenizers, the streaming detokenizer.
 *
 * Two vocabulary sources fill one internal vocabulary: GGUF metadata (`tokenizer.ggml.*`) and a
 * Hugging Face `tokenizer.json`. Three algorithms run on it: SentencePiece-style (GGUF model
 * `llama`: dummy-prefix space, spaces as U+2581, highest-score merges, `<0xNN>` byte fallback),
 * byte-level BPE (GGUF model `gpt2`: PCRE2 pre-tokenizer regexes, GPT-2's byte-to-unicode
 * mapping, merges by rank) and SentencePiece-style BPE (GGUF model `gemma4`: spaces as U+2581,
 * runs of newlines split from the rest, merges by rank over UTF-8 characters, `<0xNN>` byte
 * fallback). Special tokens are cut out of the text before any runs. A tokenizer
 * is immutable after loading: any number of threads may encode and decode with it at once. Chat
 * templates and the output parsers live beside this folder, in chat/. The trap: pieces are
 * BYTES, not characters -- one token may hold half of a UTF-8 sequence (byte fallback, byte-level
 * BPE), so a stream of pieces must go through moe_detok, which holds back an incomplete
 * sequence, before it is shown or sent anywhere. */
#ifndef MOE_TEXT_H
#define MOE_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"
#include "../format/format.h"

/* ==== Limits (each a defence against a hostile file) ==== */

#define MOE_TOKENIZER_MAX_VOCAB       (1u << 22) /* 4 Mi tokens: real vocabularies are <= 300k */
#define MOE_TOKENIZER_MAX_MERGES      (1u << 22) /* merges; real files have <= 300k */
#define MOE_TOKENIZER_MAX_TOKEN_BYTES 65536u     /* one token's text; real ones are < 1 KiB */
#define MOE_TOKENIZER_MAX_REGEXES     16         /* pre-tokenizer regexes applied in sequence */
#define MOE_TOKENIZER_MAX_REGEX_BYTES 65536u     /* one regex's source */
#define MOE_TOKENIZER_MAX_JSON_BYTES  (1u << 30) /* tokenizer.json: real ones are < 40 MiB */
#define MOE_TOKENIZER_MAX_TEXT                                                                     \
    ((size_t)1 << 31) /* one encode call's input: ids are counted in                               \
                       * int32 by callers and the engine */

/* ==== Types ==== */

typedef struct moe_tokenizer moe_tokenizer;

/* The algorithm; GGUF's tokenizer.ggml.model names it. */
typedef enum moe_tokenizer_kind {
    MOE_TOKENIZER_SPM = 0,     /* "llama": SentencePiece with byte fallback */
    MOE_TOKENIZER_BPE = 1,     /* "gpt2": byte-level BPE */
    MOE_TOKENIZER_SPM_BPE = 2, /* "gemma4": BPE over U+2581-escaped text, <0xNN> byte fallback */
    MOE_TOKENIZER_KIND_COUNT
} moe_tokenizer_kind;

/* Token types; the values are GGUF's tokenizer.ggml.token_type (and SentencePiece's). */
typedef enum moe_token_type {
    MOE_TOKEN_UNDEFINED = 0,
    MOE_TOKEN_NORMAL = 1,
    MOE_TOKEN_UNKNOWN = 2,
    MOE_TOKEN_CONTROL = 3,      /* BOS, EOS, chat markers: text only when rendered on purpose */
    MOE_TOKEN_USER_DEFINED = 4, /* added tokens: always cut out of the text, shown as-is */
    MOE_TOKEN_UNUSED = 5,
    MOE_TOKEN_BYTE = 6, /* <0xNN> */
    MOE_TOKEN_TYPE_COUNT
} moe_token_type;

#define MOE_TOKEN_NONE (-1) /* an id that is not set (no BOS, no such token) */

/* ==== Loading ==== */

/* From a GGUF file's metadata (a vocab-only GGUF works), or, where it has no
 * tokenizer.ggml.model, from the tokenizer.json text in tokenizer.huggingface.json (with
 * tokenizer.huggingface.config as its tokenizer_config.json): a Hugging Face checkpoint's view. */
moe_tokenizer *moe_tokenizer_from_gguf(const moe_gguf *g, moe_error *err);
/* From a Hugging Face tokenizer.json (model type BPE: byte-level, or with byte_fallback and a
 * normalizer replacing ' ' by U+2581, Gemma's form). A tokenizer_config.json in the same
 * folder, when present, supplies bos/eos tokens and add_bos_token/add_eos_token. */
moe_tokenizer *moe_tokenizer_from_json_file(const char *path, moe_error *err);
/* The same from a buffer; config_json may be NULL. */
moe_tokenizer *moe_tokenizer_from_json(const char *json, size_t len, const char *config_json,
                                       size_t config_len, moe_error *err);
void moe_tokenizer_free(moe_tokenizer *tok);

/* Write the vocabulary as GGUF metadata (tokenizer.ggml.*), the way llama.cpp's converter does;
 * moe_tokenizer_from_gguf() of the result tokenizes identically. Fails when the pre-tokenizer
 * has no GGUF name (a tokenizer.json regex moe does not recognise). */
moe_status moe_tokenizer_write_gguf(const moe_tokenizer *tok, moe_gguf_writer *w, moe_error *err);

/* ==== Properties ==== */

moe_tokenizer_kind moe_tokenizer_get_kind(const moe_tokenizer *tok);
uint32_t moe_tokenizer_n_vocab(const moe_tokenizer *tok);
int32_t moe_tokenizer_bos(const moe_tokenizer *tok); /* MOE_TOKEN_NONE when absent */
int32_t moe_tokenizer_eos(const moe_tokenizer *tok);
int32_t moe_tokenizer_unk(const moe_tokenizer *tok);
int32_t moe_tokenizer_pad(const moe_tokenizer *tok);
bool moe_tokenizer_adds_bos(const moe_tokenizer *tok);
bool moe_tokenizer_adds_eos(const moe_tokenizer *tok);
/* SPM's dummy prefix: a space is put before the text (and decoding may take it off again). */
bool moe_tokenizer_adds_space_prefix(const moe_tokenizer *tok);
/* The GGUF pre-tokenizer name ("llama-bpe", "qwen2", ...), or NULL (SPM, unrecognised regex). */
const char *moe_tokenizer_pre_name(const moe_tokenizer *tok);
/* End of generation: EOS, EOT, EOM and the control tokens known to end a turn. */
bool moe_tokenizer_is_eog(const moe_tokenizer *tok, int32_t id);
/* MOE_TOKEN_UNDEFINED for an id out of range. */
moe_token_type moe_tokenizer_token_type(const moe_tokenizer *tok, int32_t id);
/* The token's stored text (U+2581 for spaces in SPM, GPT-2's byte mapping in BPE), NUL-ended;
 * NULL for an id out of range. */
const char *moe_tokenizer_token_text(const moe_tokenizer *tok, int32_t id, size_t *len);
/* The id whose stored text is exactly these bytes, or MOE_TOKEN_NONE. */
int32_t moe_tokenizer_find(const moe_tokenizer *tok, const char *text, size_t len);
/* The tokens cut out of a text before either algorithm runs (see MOE_ENCODE_PARSE_SPECIAL),
 * longest text first: k in [0, moe_tokenizer_n_special); MOE_TOKEN_NONE past the end. */
uint32_t moe_tokenizer_n_special(const moe_tokenizer *tok);
int32_t moe_tokenizer_special(const moe_tokenizer *tok, uint32_t k);

/* ==== Encoding ==== */

enum {
    /* Add BOS / EOS as the vocabulary's metadata asks (add_bos_token / add_eos_token). */
    MOE_ENCODE_ADD_SPECIAL = 1u << 0,
    /* Control and unknown tokens written in the text ("<|im_start|>") become their ids.
     * User-defined tokens always do, as in llama.cpp and Hugging Face. */
    MOE_ENCODE_PARSE_SPECIAL = 1u << 1,
    /* The text continues one already tokenized (a tag fed after generated tokens): SPM adds no
     * dummy-prefix space before its first fragment. */
    MOE_ENCODE_CONTINUATION = 1u << 2,
};

/* Encode len bytes of text (any bytes; invalid UTF-8 survives through byte tokens). *ids is
 * allocated (free() it), *n_ids its count. */
moe_status moe_tokenizer_encode(const moe_tokenizer *tok, const char *text, size_t len,
                                unsigned flags, int32_t **ids, size_t *n_ids, moe_error *err);

/* A byte range of a text: where a client's own words sit inside a rendered prompt. */
typedef struct moe_text_span {
    size_t off, len;
} moe_text_span;

/* moe_tokenizer_encode, except that a control or unknown token whose text touches one of the
 * `plain` ranges (sorted by offset, disjoint) is not parsed even with PARSE_SPECIAL: its text is
 * tokenized as text, together with the text around it. User-defined tokens are still cut out
 * everywhere, as in moe_tokenizer_encode. */
moe_status moe_tokenizer_encode_spans(const moe_tokenizer *tok, const char *text, size_t len,
                                      unsigned flags, const moe_text_span *plain, size_t n_plain,
                                      int32_t **ids, size_t *n_ids, moe_error *err);

/* ==== Decoding ==== */

enum {
    /* Drop BOS and EOS ids wherever they appear (they are control tokens: this matters only
     * together with RENDER_SPECIAL). */
    MOE_DECODE_SKIP_SPECIAL = 1u << 0,
    /* Write control and unknown tokens' text (otherwise they produce no bytes). */
    MOE_DECODE_RENDER_SPECIAL = 1u << 1,
    /* Remove the one space the SPM dummy prefix put before the first piece, so that
     * decode(encode(s)) == s. (llama.cpp removes it only when no BOS was skipped.) */
    MOE_DECODE_STRIP_PREFIX_SPACE = 1u << 2,
};

/* The bytes one token stands for (spaces restored, byte tokens and byte-level mapping undone);
 * empty for control tokens unless render_special. Points into the tokenizer; never NULL. */
const char *moe_tokenizer_token_piece(const moe_tokenizer *tok, int32_t id, bool render_special,
                                      size_t *len);
/* Decode ids into an allocated NUL-terminated string (free() it); *len its byte count. An id
 * out of range is an error. The bytes are what the tokens hold: possibly invalid UTF-8. */
moe_status moe_tokenizer_decode(const moe_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                unsigned flags, char **text, size_t *len, moe_error *err);

/* ==== Streaming detokenizer ==== */

/* Turns ids, one at a time, into text that is always whole, valid UTF-8: an incomplete
 * sequence at the end is held back until the next piece completes it, and bytes that can never
 * become valid UTF-8 come out as U+FFFD. Allocates only when created. */
typedef struct moe_detok moe_detok;

/* flags: the MOE_DECODE_* set, meaning what they mean for moe_tokenizer_decode(). */
moe_detok *moe_detok_new(const moe_tokenizer *tok, unsigned flags);
void moe_detok_free(moe_detok *d);
/* Feed one id; returns the text now complete (possibly empty), valid until the next call on d.
 * An id out of range yields MOE_ERR_RANGE and no text. */
moe_status moe_detok_push(moe_detok *d, int32_t id, const char **text, size_t *len, moe_error *err);
/* End of stream: what is still held back, as U+FFFD per incomplete sequence. */
const char *moe_detok_flush(moe_detok *d, size_t *len);
/* Start a new stream (forget held bytes and the first-piece state). */
void moe_detok_reset(moe_detok *d);

#endif
