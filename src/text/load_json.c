/* load_json.c: a vocabulary from a Hugging Face tokenizer.json (byte-level BPE, or Gemma's
 * SentencePiece-style BPE), via jansson.
 *
 * Reads model.vocab, model.merges (both the "a b" string form and the ["a", "b"] array form),
 * model.ignore_merges, added_tokens (special -> control, otherwise user-defined), the
 * pre_tokenizer tree (Sequence, Split with a Regex or String pattern, ByteLevel, Digits) from
 * which it takes the regexes, and BOS/EOS from the post_processor template or from a
 * tokenizer_config.json beside the file. It does not tokenize. Everything not understood is
 * refused with MOE_ERR_UNSUPPORTED rather than tokenized differently from the reference. A BPE
 * model with byte_fallback is read as Gemma's form (MOE_TOKENIZER_SPM_BPE) when its normalizer
 * replaces ' ' with U+2581 and its pre-tokenizer is none or a Split (none: newline runs, as
 * llama.cpp splits gemma4 text); its <0xNN> entries are byte tokens (the ByteFallback decoder).
 * The trap: an NFC normalizer is accepted but not applied -- text that is not already in NFC
 * (rare: decomposed accents) may tokenize differently from Hugging Face. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text_internal.h"

#define JSON_MAX_PRETOK_NEST 8 /* Sequence inside Sequence: each level is a stack frame */

typedef struct regex_list {
    const char *v[MOE_TOKENIZER_MAX_REGEXES];
    char *owned[MOE_TOKENIZER_MAX_REGEXES];
    uint32_t n;
    bool byte_level;
} regex_list;

static moe_status add_regex(regex_list *l, const char *re, bool copy, moe_error *err) {
    if (l->n >= MOE_TOKENIZER_MAX_REGEXES)
        return moe_error_set(err, MOE_ERR_RANGE, "pre_tokenizer: more than %d regexes",
                             MOE_TOKENIZER_MAX_REGEXES);
    l->owned[l->n] = copy ? moe_xstrdup(re) : NULL;
    l->v[l->n] = copy ? l->owned[l->n] : re;
    l->n++;
    return MOE_OK;
}

/* A literal string as a regex: PCRE2's \Q...\E, with any \E inside split out. */
static char *quote_literal(const char *s) {
    size_t n = strlen(s);
    char *out = moe_xmalloc(6 * n + 5);
    size_t o = 0;
    memcpy(out, "\\Q", 2);
    o = 2;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\\' && s[i + 1] == 'E') {
            memcpy(out + o, "\\E\\\\E\\Q", 7);
            o += 7;
            i++;
            continue;
        }
        out[o++] = s[i];
    }
    memcpy(out + o, "\\E", 3);
    return out;
}

static const char *str_field(const json_t *obj, const char *key) {
    return json_string_value(json_object_get(obj, key));
}

static moe_status walk_pretok(const json_t *node, regex_list *l, int depth, moe_error *err) {
    if (!node || json_is_null(node)) return MOE_OK;
    if (depth > JSON_MAX_PRETOK_NEST)
        return moe_error_set(err, MOE_ERR_RANGE, "pre_tokenizer: nested deeper than %d",
                             JSON_MAX_PRETOK_NEST);
    const char *type = str_field(node, "type");
    if (!type) return moe_error_set(err, MOE_ERR_FORMAT, "pre_tokenizer: an entry has no type");
    if (strcmp(type, "Sequence") == 0) {
        const json_t *arr = json_object_get(node, "pretokenizers");
        if (!json_is_array(arr))
            return moe_error_set(err, MOE_ERR_FORMAT, "pre_tokenizer: Sequence without a list");
        for (size_t i = 0; i < json_array_size(arr); i++) {
            moe_status st = walk_pretok(json_array_get(arr, i), l, depth + 1, err);
            if (st != MOE_OK) return st;
        }
        return MOE_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const char *behavior = str_field(node, "behavior");
        if (json_is_true(json_object_get(node, "invert")) ||
            (behavior && strcmp(behavior, "Isolated") != 0))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "pre_tokenizer: Split with behavior %s%s is not supported",
                                 behavior ? behavior : "?",
                                 json_is_true(json_object_get(node, "invert")) ? " (inverted)"
                                                                               : "");
        const json_t *pattern = json_object_get(node, "pattern");
        const char *re = str_field(pattern, "Regex");
        if (re) return add_regex(l, re, true, err);
        const char *lit = str_field(pattern, "String");
        if (!lit) return moe_error_set(err, MOE_ERR_FORMAT, "pre_tokenizer: Split has no pattern");
        char *q = quote_literal(lit);
        moe_status st = add_regex(l, q, true, err);
        free(q);
        return st;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (json_is_true(json_object_get(node, "add_prefix_space")))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "pre_tokenizer: ByteLevel with add_prefix_space is not supported");
        l->byte_level = true;
        const json_t *use_regex = json_object_get(node, "use_regex");
        if (!use_regex || json_is_true(use_regex)) /* GPT-2's own split */
            return add_regex(l,
                             "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
                             "\\s+(?!\\S)|\\s+",
                             false, err);
        return MOE_OK;
    }
    if (strcmp(type, "Digits") == 0) {
        bool single = json_is_true(json_object_get(node, "individual_digits"));
        return add_regex(l, single ? "\\p{N}" : "\\p{N}+", false, err);
    }
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "pre_tokenizer type %s is not supported", type);
}

/* A token named by a config entry: "text" or {"content": "text"}. */
static int32_t named_token(const moe_tokenizer *tok, const json_t *v) {
    const char *s = json_is_string(v) ? json_string_value(v) : str_field(v, "content");
    return s ? moe_str_index_get(tok, s, strlen(s)) : MOE_TOKEN_NONE;
}

/* BOS/EOS from a TemplateProcessing post-processor ("single": [BOS, $A, EOS]). */
static void read_template(moe_tokenizer *tok, const json_t *pp, int depth) {
    if (!pp || depth > JSON_MAX_PRETOK_NEST) return;
    const char *type = str_field(pp, "type");
    if (type && strcmp(type, "Sequence") == 0) {
        const json_t *arr = json_object_get(pp, "processors");
        for (size_t i = 0; i < json_array_size(arr); i++)
            read_template(tok, json_array_get(arr, i), depth + 1);
        return;
    }
    if (!type || strcmp(type, "TemplateProcessing") != 0) return;
    const json_t *single = json_object_get(pp, "single");
    size_t n = json_array_size(single);
    if (n == 0) return;
    const json_t *first = json_object_get(json_array_get(single, 0), "SpecialToken");
    const json_t *last = json_object_get(json_array_get(single, n - 1), "SpecialToken");
    int32_t id;
    if (first && (id = named_token(tok, json_object_get(first, "id"))) >= 0) {
        tok->bos = id;
        tok->add_bos = true;
    }
    if (n > 1 && last && (id = named_token(tok, json_object_get(last, "id"))) >= 0) {
        tok->eos = id;
        tok->add_eos = true;
    }
}

static void read_config(moe_tokenizer *tok, const json_t *cfg) {
    int32_t id;
    if ((id = named_token(tok, json_object_get(cfg, "bos_token"))) >= 0) tok->bos = id;
    if ((id = named_token(tok, json_object_get(cfg, "eos_token"))) >= 0) tok->eos = id;
    if ((id = named_token(tok, json_object_get(cfg, "pad_token"))) >= 0) tok->pad = id;
    if ((id = named_token(tok, json_object_get(cfg, "unk_token"))) >= 0) tok->unk = id;
    const json_t *b = json_object_get(cfg, "add_bos_token");
    if (json_is_boolean(b)) tok->add_bos = json_is_true(b);
    b = json_object_get(cfg, "add_eos_token");
    if (json_is_boolean(b)) tok->add_eos = json_is_true(b);
}

static moe_status read_vocab(moe_tokenizer *tok, const json_t *model, moe_error *err) {
    const json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab))
        return moe_error_set(err, MOE_ERR_FORMAT, "model.vocab is not an object");
    const char *key;
    json_t *value;
    json_object_foreach((json_t *)vocab, key, value) {
        json_int_t id = json_integer_value(value);
        if (!json_is_integer(value) || id < 0 || id >= MOE_TOKENIZER_MAX_VOCAB)
            return moe_error_set(err, MOE_ERR_RANGE, "model.vocab[\"%.64s\"]: id is not in 0..%u",
                                 key, MOE_TOKENIZER_MAX_VOCAB - 1);
        moe_status st =
            moe_vocab_set_token(tok, (uint32_t)id, key, strlen(key), 0.0f, MOE_TOKEN_NORMAL, err);
        if (st != MOE_OK) return st;
    }
    return MOE_OK;
}

static moe_status read_added(moe_tokenizer *tok, const json_t *added, moe_error *err) {
    if (!added || json_is_null(added)) return MOE_OK;
    if (!json_is_array(added))
        return moe_error_set(err, MOE_ERR_FORMAT, "added_tokens is not an array");
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *a = json_array_get(added, i);
        const json_t *idv = json_object_get(a, "id");
        const char *content = str_field(a, "content");
        json_int_t id = json_integer_value(idv);
        if (!json_is_integer(idv) || !content || id < 0 || id >= MOE_TOKENIZER_MAX_VOCAB)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "added_tokens[%zu]: needs an id in 0..%u "
                                 "and a content string",
                                 i, MOE_TOKENIZER_MAX_VOCAB - 1);
        bool special = json_is_true(json_object_get(a, "special"));
        moe_status st =
            moe_vocab_set_token(tok, (uint32_t)id, content, strlen(content), 0.0f,
                                special ? MOE_TOKEN_CONTROL : MOE_TOKEN_USER_DEFINED, err);
        if (st != MOE_OK) return st;
    }
    return MOE_OK;
}

static moe_status read_merges(moe_tokenizer *tok, const json_t *model, moe_error *err) {
    const json_t *merges = json_object_get(model, "merges");
    if (!merges || json_is_null(merges)) return MOE_OK;
    if (!json_is_array(merges))
        return moe_error_set(err, MOE_ERR_FORMAT, "model.merges is not an array");
    for (size_t r = 0; r < json_array_size(merges); r++) {
        const json_t *m = json_array_get(merges, r);
        const char *a, *b;
        size_t na, nb;
        if (json_is_string(m)) { /* "a b" */
            const char *s = json_string_value(m);
            size_t n = json_string_length(m);
            const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
            if (!sp) return moe_error_set(err, MOE_ERR_FORMAT, "model.merges[%zu] has no space", r);
            a = s;
            na = (size_t)(sp - s);
            b = sp + 1;
            nb = n - na - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            na = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            nb = json_string_length(json_array_get(m, 1));
        } else {
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", r);
        }
        moe_status st = moe_vocab_add_merge(tok, a, na, b, nb, err);
        if (st != MOE_OK) return st;
    }
    return MOE_OK;
}

/* Gemma's normalizer: Replace the String " " with U+2581 (alone, or the one step of a
 * Sequence). */
static bool escapes_spaces(const json_t *norm) {
    const char *type = str_field(norm, "type");
    if (type && strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(norm, "normalizers");
        return json_array_size(list) == 1 && escapes_spaces(json_array_get(list, 0));
    }
    const char *from = str_field(json_object_get(norm, "pattern"), "String");
    const char *to = str_field(norm, "content");
    return type && strcmp(type, "Replace") == 0 && from && strcmp(from, " ") == 0 && to &&
           strcmp(to, "\xe2\x96\x81") == 0;
}

/* <0xNN> entries of a byte_fallback model: the bytes ByteFallback decodes them to. */
static void mark_byte_tokens(moe_tokenizer *tok) {
    for (int b = 0; b < 256; b++) {
        char name[8];
        int n = snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = moe_str_index_get(tok, name, (size_t)n);
        if (id >= 0 && tok->tokens[id].type == MOE_TOKEN_NORMAL)
            tok->tokens[id].type = MOE_TOKEN_BYTE;
    }
}

static moe_status check_normalizer(const json_t *norm, moe_error *err) {
    if (!norm || json_is_null(norm)) return MOE_OK;
    const char *type = str_field(norm, "type");
    if (type && strcmp(type, "NFC") == 0) return MOE_OK; /* see the trap above */
    if (type && strcmp(type, "Sequence") == 0 &&
        json_array_size(json_object_get(norm, "normalizers")) == 0)
        return MOE_OK;
    return moe_error_set(err, MOE_ERR_UNSUPPORTED, "normalizer %s is not supported",
                         type ? type : "(untyped)");
}

static moe_tokenizer *load(const json_t *root, const json_t *cfg, moe_error *err) {
    const json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) {
        moe_error_set(err, MOE_ERR_FORMAT, "no model object");
        return NULL;
    }
    const char *type = str_field(model, "type");
    if (type && strcmp(type, "BPE") != 0) {
        moe_error_set(err, MOE_ERR_UNSUPPORTED, "model type %s is not supported (BPE)", type);
        return NULL;
    }
    const bool spm_bpe = json_is_true(json_object_get(model, "byte_fallback"));
    const json_t *norm = json_object_get(root, "normalizer");
    if (spm_bpe && !escapes_spaces(norm)) {
        moe_error_set(
            err, MOE_ERR_UNSUPPORTED,
            "a BPE model with byte_fallback is read only with Gemma's normalizer (Replace "
            "\" \" with U+2581); use the GGUF vocabulary");
        return NULL;
    }
    if (!spm_bpe && check_normalizer(norm, err) != MOE_OK) return NULL;

    regex_list regexes = {0};
    moe_tokenizer *tok = moe_vocab_new(spm_bpe ? MOE_TOKENIZER_SPM_BPE : MOE_TOKENIZER_BPE);
    tok->add_bos = false;
    tok->add_space_prefix = false;
    if (walk_pretok(json_object_get(root, "pre_tokenizer"), &regexes, 0, err) != MOE_OK) goto fail;
    if (regexes.byte_level == spm_bpe) {
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      spm_bpe ? "pre_tokenizer: ByteLevel in a byte_fallback BPE model"
                              : "pre_tokenizer has no ByteLevel step: not a byte-level BPE "
                                "tokenizer");
        goto fail;
    }
    if (spm_bpe && regexes.n == 0) { /* no pre-tokenizer: newline runs apart, as llama.cpp */
        const char *const *re;
        uint32_t n;
        bool ignore;
        moe_pretok_preset("gemma4", &re, &n, &ignore);
        for (uint32_t i = 0; i < n; i++) add_regex(&regexes, re[i], false, err);
    }
    if (read_vocab(tok, model, err) != MOE_OK) goto fail;
    if (read_added(tok, json_object_get(root, "added_tokens"), err) != MOE_OK) goto fail;
    moe_vocab_index_texts(tok);
    if (spm_bpe) mark_byte_tokens(tok);
    if (read_merges(tok, model, err) != MOE_OK) goto fail;
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    tok->unk = named_token(tok, json_object_get(model, "unk_token"));
    read_template(tok, json_object_get(root, "post_processor"), 0);
    if (cfg) read_config(tok, cfg);

    const char *name = moe_pretok_name_for(regexes.v, regexes.n, tok->ignore_merges);
    if (name) tok->pre_name = moe_xstrdup(name);
    if (moe_pretok_compile(&tok->pretok, regexes.v, regexes.n, err) != MOE_OK) goto fail;
    for (uint32_t i = 0; i < regexes.n; i++) free(regexes.owned[i]);
    return moe_vocab_finish(tok, err);

fail:
    for (uint32_t i = 0; i < regexes.n; i++) free(regexes.owned[i]);
    moe_tokenizer_free(tok);
    return NULL;
}

static json_t *parse(const char *text, size_t len, unsigned flags, const char *what,
                     moe_error *err) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES | flags, &jerr);
    if (!root) {
        moe_error_set(err, MOE_ERR_FORMAT, "%s: line %d column %d: %s", what, jerr.line,
                      jerr.column, jerr.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        moe_error_set(err, MOE_ERR_FORMAT, "%s: not a JSON object", what);
        json_decref(root);
        return NULL;
    }
    return root;
}

moe_tokenizer *moe_tokenizer_from_json(const char *json, size_t len, const char *config_json,
                                       size_t config_len, moe_error *err) {
    if (len > MOE_TOKENIZER_MAX_JSON_BYTES) {
        moe_error_set(err, MOE_ERR_RANGE, "tokenizer.json is %zu bytes (max %u)", len,
                      MOE_TOKENIZER_MAX_JSON_BYTES);
        return NULL;
    }
    json_t *root = parse(json, len, 0, "tokenizer.json", err);
    if (!root) return NULL;
    /* configs hold numbers beyond int64 (model_max_length = 1e30) and moe reads none of them */
    json_t *cfg = config_json ? parse(config_json, config_len, JSON_DECODE_INT_AS_REAL,
                                      "tokenizer_config.json", err)
                              : NULL;
    moe_tokenizer *tok = NULL;
    if (!config_json || cfg) tok = load(root, cfg, err);
    json_decref(cfg);
    json_decref(root);
    return tok;
}

moe_tokenizer *moe_tokenizer_from_json_file(const char *path, moe_error *err) {
    uint8_t *data;
    size_t size;
    if (moe_file_read(path, &data, &size, err) != MOE_OK) return NULL;
    /* tokenizer_config.json beside it, when there is one */
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    char *cfg_path = moe_xmalloc(dir_len + sizeof "tokenizer_config.json");
    memcpy(cfg_path, path, dir_len);
    memcpy(cfg_path + dir_len, "tokenizer_config.json", sizeof "tokenizer_config.json");
    uint8_t *cfg = NULL;
    size_t cfg_size = 0;
    moe_error cfg_err = {0};
    if (moe_file_read(cfg_path, &cfg, &cfg_size, &cfg_err) != MOE_OK) cfg = NULL;
    moe_tokenizer *tok =
        moe_tokenizer_from_json((const char *)data, size, (const char *)cfg, cfg_size, err);
    if (!tok) moe_error_prefix(err, "%s", path);
    free(cfg_path);
    free(cfg);
    free(data);
    return tok;
}
