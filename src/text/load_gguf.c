/* load_gguf.c: a vocabulary from GGUF metadata (tokenizer.ggml.*).
 *
 * Reads the keys llama.cpp's converter writes -- model, pre, tokens, scores, token_type,
 * merges, the special ids and the add_* switches -- checks each array's type and length
 * against the token count, and hands everything to the vocab builders. It does not tokenize.
 * The trap: numeric arrays arrive as packed little-endian bytes exactly as in the file (no
 * alignment promised), so every element is read with memcpy, never through a typed pointer. */
#include <string.h>

#include "text_internal.h"

/* An optional array key: NULL when absent; an error when present with the wrong shape. */
static const moe_gguf_value *get_array(const moe_gguf *g, const char *key, moe_gguf_vtype elem,
                                       uint64_t n_expected, bool required, moe_error *err) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    if (!v) {
        if (required) moe_error_set(err, MOE_ERR_NOT_FOUND, "GGUF key %s is missing", key);
        return NULL;
    }
    if (v->type != MOE_GGUF_ARRAY || v->arr.elem_type != elem) {
        moe_error_set(err, MOE_ERR_FORMAT, "GGUF key %s: expected an array of %s", key,
                      moe_gguf_vtype_name(elem));
        return NULL;
    }
    if (n_expected != UINT64_MAX && v->arr.n != n_expected) {
        moe_error_set(err, MOE_ERR_FORMAT, "GGUF key %s has %llu elements, the vocabulary %llu",
                      key, (unsigned long long)v->arr.n, (unsigned long long)n_expected);
        return NULL;
    }
    return v;
}

static int32_t get_id(const moe_gguf *g, const char *key) {
    int64_t v;
    if (!moe_gguf_get_i64(g, key, &v)) return MOE_TOKEN_NONE;
    if (v < INT32_MIN || v > INT32_MAX) return INT32_MIN; /* rejected as out of range later */
    return (int32_t)v;
}

static moe_tokenizer *load(const moe_gguf *g, moe_error *err);

moe_tokenizer *moe_tokenizer_from_gguf(const moe_gguf *g, moe_error *err) {
    /* a Hugging Face checkpoint's view (format/hf.c) carries tokenizer.json as it is */
    const moe_gguf_value *json = moe_gguf_find(g, "tokenizer.huggingface.json");
    if (!moe_gguf_find(g, "tokenizer.ggml.model") && json && json->type == MOE_GGUF_STRING) {
        const moe_gguf_value *cfg = moe_gguf_find(g, "tokenizer.huggingface.config");
        bool has_cfg = cfg && cfg->type == MOE_GGUF_STRING;
        return moe_tokenizer_from_json(json->s.ptr, json->s.len, has_cfg ? cfg->s.ptr : NULL,
                                       has_cfg ? cfg->s.len : 0, err);
    }
    /* a local error, so that "absent" and "wrong" stay apart even when the caller passes NULL */
    moe_error local = {0};
    moe_tokenizer *tok = load(g, &local);
    if (!tok) {
        moe_error_prefix(&local, "GGUF vocabulary");
        moe_error_set(err, local.code, "%s", local.msg);
    }
    return tok;
}

static moe_tokenizer *load(const moe_gguf *g, moe_error *err) {
    const char *model = moe_gguf_get_str(g, "tokenizer.ggml.model");
    if (!model) {
        moe_error_set(err, MOE_ERR_NOT_FOUND, "GGUF key tokenizer.ggml.model is missing");
        return NULL;
    }
    moe_tokenizer_kind kind;
    if (strcmp(model, "llama") == 0) {
        kind = MOE_TOKENIZER_SPM;
    } else if (strcmp(model, "gpt2") == 0) {
        kind = MOE_TOKENIZER_BPE;
    } else if (strcmp(model, "gemma4") == 0) {
        kind = MOE_TOKENIZER_SPM_BPE;
    } else {
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "tokenizer.ggml.model '%s' is not supported (llama, gpt2, gemma4)", model);
        return NULL;
    }

    const moe_gguf_value *tokens =
        get_array(g, "tokenizer.ggml.tokens", MOE_GGUF_STRING, UINT64_MAX, true, err);
    if (!tokens) return NULL;
    const uint64_t n = tokens->arr.n;
    if (n == 0 || n > MOE_TOKENIZER_MAX_VOCAB) {
        moe_error_set(err, MOE_ERR_RANGE, "tokenizer.ggml.tokens has %llu tokens (1..%u)",
                      (unsigned long long)n, MOE_TOKENIZER_MAX_VOCAB);
        return NULL;
    }
    const moe_gguf_value *scores =
        get_array(g, "tokenizer.ggml.scores", MOE_GGUF_F32, n, false, err);
    const moe_gguf_value *types =
        get_array(g, "tokenizer.ggml.token_type", MOE_GGUF_I32, n, false, err);
    if (err->code != MOE_OK) return NULL;

    moe_tokenizer *tok = moe_vocab_new(kind);
    const moe_str *texts = tokens->arr.data;
    for (uint64_t i = 0; i < n; i++) {
        float score = 0.0f;
        int32_t type = MOE_TOKEN_NORMAL;
        if (scores) memcpy(&score, (const uint8_t *)scores->arr.data + 4 * i, 4);
        if (types) memcpy(&type, (const uint8_t *)types->arr.data + 4 * i, 4);
        if (type == MOE_TOKEN_UNDEFINED) type = MOE_TOKEN_NORMAL;
        if (moe_vocab_set_token(tok, (uint32_t)i, texts[i].ptr, texts[i].len, score,
                                (moe_token_type)type, err) != MOE_OK) {
            moe_error_prefix(err, "tokenizer.ggml.tokens[%llu]", (unsigned long long)i);
            moe_tokenizer_free(tok);
            return NULL;
        }
    }
    moe_vocab_index_texts(tok);

    if (kind != MOE_TOKENIZER_SPM) {
        const moe_gguf_value *merges =
            get_array(g, "tokenizer.ggml.merges", MOE_GGUF_STRING, UINT64_MAX, false, err);
        if (err->code != MOE_OK) goto fail;
        const moe_str *m = merges ? merges->arr.data : NULL;
        for (uint64_t r = 0; merges && r < merges->arr.n; r++) {
            /* "left right"; the left part is never empty, so look for the space after it */
            const char *sp = m[r].len > 1 ? memchr(m[r].ptr + 1, ' ', m[r].len - 1) : NULL;
            if (!sp) {
                moe_error_set(err, MOE_ERR_FORMAT, "tokenizer.ggml.merges[%llu] has no space",
                              (unsigned long long)r);
                goto fail;
            }
            size_t left_len = (size_t)(sp - m[r].ptr);
            if (moe_vocab_add_merge(tok, m[r].ptr, left_len, sp + 1, m[r].len - left_len - 1,
                                    err) != MOE_OK)
                goto fail;
        }
        /* gemma4 has one pre-tokenizer whatever the file says (llama.cpp sets it) */
        const char *pre = moe_gguf_get_str(g, "tokenizer.ggml.pre");
        if (kind == MOE_TOKENIZER_SPM_BPE || !pre)
            pre = kind == MOE_TOKENIZER_BPE ? "default" : "gemma4";
        const char *const *regexes;
        uint32_t n_regexes;
        if (!moe_pretok_preset(pre, &regexes, &n_regexes, &tok->ignore_merges)) {
            moe_error_set(err, MOE_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%s' is not supported",
                          pre);
            goto fail;
        }
        tok->pre_name = moe_xstrdup(pre);
        if (moe_pretok_compile(&tok->pretok, regexes, n_regexes, err) != MOE_OK) goto fail;
    }

    tok->bos = get_id(g, "tokenizer.ggml.bos_token_id");
    tok->eos = get_id(g, "tokenizer.ggml.eos_token_id");
    tok->unk = get_id(g, "tokenizer.ggml.unknown_token_id");
    tok->pad = get_id(g, "tokenizer.ggml.padding_token_id");
    tok->eot = get_id(g, "tokenizer.ggml.eot_token_id");
    tok->eom = get_id(g, "tokenizer.ggml.eom_token_id");
    bool b;
    if (moe_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b)) tok->add_bos = b;
    if (moe_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &b)) tok->add_eos = b;
    if (moe_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b)) tok->add_space_prefix = b;
    if (kind != MOE_TOKENIZER_SPM) tok->add_space_prefix = false;
    if (kind == MOE_TOKENIZER_SPM_BPE) tok->add_bos = true; /* llama.cpp forces it for Gemma 4 */
    return moe_vocab_finish(tok, err);

fail:
    moe_tokenizer_free(tok);
    return NULL;
}
