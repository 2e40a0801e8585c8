/* pretok.c: the byte-level BPE pre-tokenizer -- regexes that cut text into words before merges.
 *
 * Owns the named regex sets GGUF files select with tokenizer.ggml.pre (the strings llama.cpp
 * uses, which follow each model's tokenizer.json), their compilation with PCRE2 (UTF, Unicode
 * properties, JIT) and the split itself. Several regexes apply in sequence: each one runs over
 * every piece the previous one left, and both the matches and the unmatched text between them
 * become pieces (Hugging Face's Split with behaviour "Isolated"). It does not map bytes or merge.
 * The trap: `(?i:'s|'t|...)` under Unicode case folding would also match "'\u017f" (long s),
 * which the reference tokenizers do not; the contraction groups are rewritten to ASCII-only
 * classes ('[sS]) before compiling, as llama.cpp does. Non-ASCII characters in the presets are
 * written as \x{...} so this file stays ASCII and no editor can normalise them. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdlib.h>
#include <string.h>

#include "text_internal.h"

/* ==== Presets (regex strings as in llama.cpp's llama-vocab.cpp) ==== */

#define RE_GPT2         "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define RE_LLAMA3                                                                                  \
    RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"   \
                    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                   \
    RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"        \
                    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* The original Hugging Face forms, to recognise a tokenizer.json's regex. */
#define RE_LLAMA3_HF                                                                               \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+" \
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2_HF                                                                                \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"      \
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_GPT2_HF RE_GPT2 "|\\s+"
/* CJK ideographs, CJK extension ranges and Hangul, as DeepSeek's tokenizers group them. */
#define RE_DEEPSEEK_CJK "[\\x{4e00}-\\x{9fa5}\\x{800}-\\x{4e00}\\x{ac00}-\\x{d7ff}]+"
/* Cased letters (Lu, Ll, Lt) of the alphabetic scripts, from DeepSeek LLM's tokenizer.json. */
#define RE_DEEPSEEK_LLM_LETTERS                                                                    \
    "\\s?[A-Za-z\\x{b5}\\x{c0}-\\x{d6}\\x{d8}-\\x{f6}\\x{f8}-\\x{1ba}\\x{1bc}-\\x{1bf}"            \
    "\\x{1c4}-\\x{293}\\x{295}-\\x{2af}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37b}-\\x{37d}"         \
    "\\x{37f}\\x{386}\\x{388}-\\x{38a}\\x{38c}\\x{38e}-\\x{3a1}\\x{3a3}-\\x{3f5}\\x{3f7}-"         \
    "\\x{481}\\x{48a}-\\x{52f}\\x{531}-\\x{556}\\x{10a0}-\\x{10c5}\\x{13a0}-\\x{13f5}"             \
    "\\x{13f8}-\\x{13fd}\\x{1c90}-\\x{1cba}\\x{1cbd}-\\x{1cbf}\\x{1d00}-\\x{1d2b}\\x{1d6b}-"       \
    "\\x{1d77}\\x{1d79}-\\x{1d9a}\\x{1e00}-\\x{1f15}\\x{1f18}-\\x{1f1d}\\x{1f20}-\\x{1f45}"        \
    "\\x{1f48}-\\x{1f4d}\\x{1f50}-\\x{1f57}\\x{1f59}\\x{1f5b}\\x{1f5d}\\x{1f5f}-\\x{1f7d}"         \
    "\\x{1f80}-\\x{1fb4}\\x{1fb6}-\\x{1fbc}\\x{1fbe}\\x{1fc2}-\\x{1fc4}\\x{1fc6}-\\x{1fcc}"        \
    "\\x{1fd0}-\\x{1fd3}\\x{1fd6}-\\x{1fdb}\\x{1fe0}-\\x{1fec}\\x{1ff2}-\\x{1ff4}\\x{1ff6}-"       \
    "\\x{1ffc}\\x{2102}\\x{2107}\\x{210a}-\\x{2113}\\x{2115}\\x{2119}-\\x{211d}\\x{2124}"          \
    "\\x{2126}\\x{2128}\\x{212a}-\\x{212d}\\x{212f}-\\x{2134}\\x{2139}\\x{213c}-\\x{213f}"         \
    "\\x{2145}-\\x{2149}\\x{214e}\\x{2183}\\x{2184}\\x{2c00}-\\x{2c7b}\\x{2c7e}-\\x{2ce4}"         \
    "\\x{2ceb}-\\x{2cee}\\x{2cf2}\\x{2cf3}\\x{a640}-\\x{a66d}\\x{a680}-\\x{a69b}\\x{a722}-"        \
    "\\x{a76f}\\x{a771}-\\x{a787}\\x{a78b}-\\x{a78e}\\x{ab70}-\\x{abbf}\\x{fb00}-\\x{fb06}"        \
    "\\x{fb13}-\\x{fb17}\\x{ff21}-\\x{ff3a}\\x{ff41}-\\x{ff5a}\\x{10400}-\\x{1044f}\\x{104b0}-"    \
    "\\x{104d3}\\x{104d8}-\\x{104fb}\\x{10c80}-\\x{10cb2}\\x{10cc0}-\\x{10cf2}\\x{118a0}-"         \
    "\\x{118df}\\x{1e900}-\\x{1e943}]+"

static const char *const re_default[] = {
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    RE_GPT2,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
};
static const char *const re_gpt2[] = {RE_GPT2};
/* o200k (GPT-4o, gpt-oss): PCRE2 has \p{Lu} and friends, so the original form is used where
 * llama.cpp spells the case classes with lookaheads for std::regex. */
static const char *const re_gpt4o[] = {
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
    "\\p{M}]+" RE_CONTRACTIONS "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" RE_CONTRACTIONS "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
static const char *const re_llama3[] = {RE_LLAMA3};
static const char *const re_qwen2[] = {RE_QWEN2};
static const char *const re_deepseek_llm[] = {
    "[\r\n]",
    RE_DEEPSEEK_LLM_LETTERS,
    "\\s?[!-/:-~\\x{ff01}-\\x{ff0f}\\x{ff1a}-\\x{ff5e}\\x{2018}-\\x{201f}\\x{3000}-\\x{3002}]+",
    "\\s+$",
    RE_DEEPSEEK_CJK,
    "\\p{N}+",
};
static const char *const re_deepseek_coder[] = {
    "[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_DEEPSEEK_CJK, "\\p{N}",
};
static const char *const re_deepseek_v3[] = {
    "\\p{N}{1,3}",
    "[\\x{4e00}-\\x{9fa5}\\x{3040}-\\x{309f}\\x{30a0}-\\x{30ff}]+",
    "[!\"#$%&'()*+,\\-./"
    ":;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
};
/* Hugging Face forms of the single-regex sets (only used to recognise tokenizer.json). */
static const char *const re_llama3_hf[] = {RE_LLAMA3_HF};
static const char *const re_qwen2_hf[] = {RE_QWEN2_HF};
static const char *const re_gpt2_hf[] = {RE_GPT2_HF};
/* SentencePiece-style BPE (Gemma 4): runs of newlines apart from everything else, as
 * llama.cpp splits "gemma4" text; a tokenizer.json says the same with a Split on "\n+". */
static const char *const re_gemma4[] = {"[^\\n]+|[\\n]+"};
static const char *const re_gemma4_hf[] = {"\\n+"};

#define N_OF(a) ((uint32_t)(sizeof(a) / sizeof((a)[0])))

typedef struct preset {
    const char *name;
    const char *const *regexes;
    uint32_t n;
    bool ignore_merges;
} preset;

/* Names as llama.cpp's converter writes them; the first name of each set is the one moe writes. */
static const preset presets[] = {
    {"default", re_default, N_OF(re_default), false},
    {"gpt-2", re_gpt2, N_OF(re_gpt2), false},
    {"gpt2", re_gpt2, N_OF(re_gpt2), false},
    {"phi-2", re_gpt2, N_OF(re_gpt2), false},
    {"jina-es", re_gpt2, N_OF(re_gpt2), false},
    {"jina-de", re_gpt2, N_OF(re_gpt2), false},
    {"roberta-bpe", re_gpt2, N_OF(re_gpt2), false},
    {"mpt", re_gpt2, N_OF(re_gpt2), false},
    {"olmo", re_gpt2, N_OF(re_gpt2), false},
    {"jais", re_gpt2, N_OF(re_gpt2), false},
    {"llama-bpe", re_llama3, N_OF(re_llama3), true},
    {"llama3", re_llama3, N_OF(re_llama3), true},
    {"llama-v3", re_llama3, N_OF(re_llama3), true},
    {"falcon3", re_llama3, N_OF(re_llama3), true},
    {"dbrx", re_llama3, N_OF(re_llama3), false},
    {"smaug-bpe", re_llama3, N_OF(re_llama3), false},
    {"qwen2", re_qwen2, N_OF(re_qwen2), false},
    {"stablelm2", re_qwen2, N_OF(re_qwen2), false},
    {"deepseek-r1-qwen", re_qwen2, N_OF(re_qwen2), false},
    {"megrez", re_qwen2, N_OF(re_qwen2), false},
    {"hunyuan", re_qwen2, N_OF(re_qwen2), false},
    {"deepseek-llm", re_deepseek_llm, N_OF(re_deepseek_llm), false},
    {"deepseek-coder", re_deepseek_coder, N_OF(re_deepseek_coder), false},
    {"deepseek-v3", re_deepseek_v3, N_OF(re_deepseek_v3), false},
    {"gpt-4o", re_gpt4o, N_OF(re_gpt4o), false},
    {"minimax-m2", re_gpt4o, N_OF(re_gpt4o), false},
    {"gemma4", re_gemma4, N_OF(re_gemma4), false},
};

bool moe_pretok_preset(const char *pre_name, const char *const **regexes, uint32_t *n,
                       bool *ignore_merges) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(presets[i].name, pre_name) != 0) continue;
        *regexes = presets[i].regexes;
        *n = presets[i].n;
        *ignore_merges = presets[i].ignore_merges;
        return true;
    }
    return false;
}

static bool same_list(const char *const *a, uint32_t na, const char *const *b, uint32_t nb) {
    if (na != nb) return false;
    for (uint32_t i = 0; i < na; i++)
        if (strcmp(a[i], b[i]) != 0) return false;
    return true;
}

const char *moe_pretok_name_for(const char *const *regexes, uint32_t n, bool ignore_merges) {
    static const struct {
        const char *const *re;
        uint32_t n;
        const char *name, *name_ignore_merges;
    } known[] = {
        {re_llama3_hf, 1, "dbrx", "llama-bpe"},
        {re_llama3, 1, "dbrx", "llama-bpe"},
        {re_qwen2_hf, 1, "qwen2", NULL},
        {re_qwen2, 1, "qwen2", NULL},
        {re_gpt2_hf, 1, "gpt-2", NULL},
        {re_gpt2, 1, "gpt-2", NULL},
        {re_deepseek_llm, N_OF(re_deepseek_llm), "deepseek-llm", NULL},
        {re_deepseek_coder, N_OF(re_deepseek_coder), "deepseek-coder", NULL},
        {re_deepseek_v3, N_OF(re_deepseek_v3), "deepseek-v3", NULL},
        {re_gemma4, 1, "gemma4", NULL},
        {re_gemma4_hf, 1, "gemma4", NULL},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if (!same_list(regexes, n, known[i].re, known[i].n)) continue;
        return ignore_merges ? known[i].name_ignore_merges : known[i].name;
    }
    return NULL;
}

/* ==== Compiling ==== */

/* Copy an escape (`\x`, `\p{..}`, `\x{..}`) starting at src[i]; returns the index after it. */
static size_t copy_escape(const char *src, size_t n, size_t i, char *dst, size_t *o) {
    dst[(*o)++] = src[i++]; /* the backslash */
    if (i >= n) return i;
    char c = src[i];
    dst[(*o)++] = src[i++];
    if ((c == 'p' || c == 'P' || c == 'x' || c == 'N' || c == 'o') && i < n && src[i] == '{') {
        while (i < n && src[i] != '}') dst[(*o)++] = src[i++];
        if (i < n) dst[(*o)++] = src[i++];
    }
    return i;
}

/* Rewrite each `(?i:...)` group without a character class into `(?:...)` with every ASCII
 * letter L spelled [Ll]. Groups it cannot rewrite are left as they are. The result is at most
 * four times the source plus one: *out is allocated. */
static char *rewrite_caseless(const char *src) {
    size_t n = strlen(src);
    char *dst = moe_xmalloc(4 * n + 1);
    size_t o = 0, i = 0;
    while (i < n) {
        if (src[i] == '\\') {
            i = copy_escape(src, n, i, dst, &o);
            continue;
        }
        if (strncmp(src + i, "(?i:", 4) != 0) {
            dst[o++] = src[i++];
            continue;
        }
        /* find the group's end and check it holds no class or nested group */
        size_t j = i + 4;
        bool simple = true;
        while (j < n && src[j] != ')') {
            if (src[j] == '[' || src[j] == '(') simple = false;
            if (src[j] == '\\' && j + 1 < n) j++;
            j++;
        }
        if (!simple || j >= n) {
            dst[o++] = src[i++];
            continue;
        }
        memcpy(dst + o, "(?:", 3);
        o += 3;
        for (i += 4; i < j;) {
            char c = src[i];
            if (c == '\\') {
                i = copy_escape(src, n, i, dst, &o);
            } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
                char lower = (char)(c | 0x20), upper = (char)(c & ~0x20);
                dst[o++] = '[';
                dst[o++] = lower;
                dst[o++] = upper;
                dst[o++] = ']';
                i++;
            } else {
                dst[o++] = src[i++];
            }
        }
    }
    dst[o] = '\0';
    return dst;
}

moe_status moe_pretok_compile(moe_pretok *p, const char *const *regexes, uint32_t n,
                              moe_error *err) {
    if (n > MOE_TOKENIZER_MAX_REGEXES)
        return moe_error_set(err, MOE_ERR_RANGE, "pre-tokenizer has %u regexes (max %d)", n,
                             MOE_TOKENIZER_MAX_REGEXES);
    for (uint32_t k = 0; k < n; k++) {
        size_t len = strlen(regexes[k]);
        if (len > MOE_TOKENIZER_MAX_REGEX_BYTES)
            return moe_error_set(err, MOE_ERR_RANGE, "pre-tokenizer regex %u is %zu bytes (max %u)",
                                 k, len, MOE_TOKENIZER_MAX_REGEX_BYTES);
        char *src = rewrite_caseless(regexes[k]);
        int code;
        PCRE2_SIZE at;
        pcre2_code *re =
            pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &code, &at, NULL);
        if (!re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(code, msg, sizeof msg);
            moe_error_set(err, MOE_ERR_FORMAT, "pre-tokenizer regex %u: %s at offset %zu", k,
                          (const char *)msg, (size_t)at);
            free(src);
            return MOE_ERR_FORMAT;
        }
        /* JIT is an optimisation: where it is unavailable the interpreter gives the same result */
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
        p->code[p->n] = re;
        p->source[p->n] = src;
        p->n++;
    }
    return MOE_OK;
}

void moe_pretok_free(moe_pretok *p) {
    for (uint32_t k = 0; k < p->n; k++) {
        pcre2_code_free((pcre2_code *)p->code[k]);
        free(p->source[k]);
    }
    p->n = 0;
}

/* ==== Splitting ==== */

#define PRETOK_JIT_STACK_MIN (32u << 10)
#define PRETOK_JIT_STACK_MAX (4u << 20) /* long whitespace runs backtrack; 4 MiB covers MBs */

typedef struct span_list {
    moe_span *v;
    size_t n, cap;
} span_list;

static void span_push(span_list *l, size_t off, size_t len) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->v = moe_xrealloc(l->v, l->cap * sizeof *l->v);
    }
    l->v[l->n].off = off;
    l->v[l->n].len = len;
    l->n++;
}

/* Split one chunk text[off, off+len) with one regex, appending the pieces to out. */
static moe_status split_chunk(const pcre2_code *re, pcre2_match_data *md, pcre2_match_context *mc,
                              const char *text, size_t off, size_t len, span_list *out,
                              moe_error *err) {
    const PCRE2_SPTR subject = (PCRE2_SPTR)(text + off);
    size_t pos = 0, last = 0;
    while (pos < len) {
        int rc = pcre2_match(re, subject, len, pos, 0, md, mc);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return moe_error_set(err, MOE_ERR_UNSUPPORTED, "pre-tokenizer match at byte %zu: %s",
                                 off + pos, (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t start = ov[0], end = ov[1];
        if (end <= start) { /* empty match: move on one character */
            pos = start + moe_utf8_len((uint8_t)text[off + start]);
            continue;
        }
        if (start > last) span_push(out, off + last, start - last);
        span_push(out, off + start, end - start);
        last = pos = end;
    }
    if (last < len) span_push(out, off + last, len - last);
    return MOE_OK;
}

moe_status moe_pretok_split(const moe_pretok *p, const char *text, size_t len, moe_span **spans,
                            size_t *n_spans, moe_error *err) {
    span_list cur = {0}, next = {0};
    *spans = NULL;
    *n_spans = 0;
    if (len == 0) return MOE_OK;
    span_push(&cur, 0, len);
    if (p->n == 0) {
        *spans = cur.v;
        *n_spans = cur.n;
        return MOE_OK;
    }
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    pcre2_jit_stack *js = pcre2_jit_stack_create(PRETOK_JIT_STACK_MIN, PRETOK_JIT_STACK_MAX, NULL);
    if (!md || !mc || !js) moe_die("pcre2: out of memory");
    pcre2_jit_stack_assign(mc, NULL, js);
    moe_status st = MOE_OK;
    for (uint32_t k = 0; k < p->n && st == MOE_OK; k++) {
        next.n = 0;
        for (size_t c = 0; c < cur.n && st == MOE_OK; c++)
            st = split_chunk(p->code[k], md, mc, text, cur.v[c].off, cur.v[c].len, &next, err);
        span_list t = cur;
        cur = next;
        next = t;
    }
    pcre2_jit_stack_free(js);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    free(next.v);
    if (st != MOE_OK) {
        free(cur.v);
        return st;
    }
    *spans = cur.v;
    *n_spans = cur.n;
    return MOE_OK;
}
