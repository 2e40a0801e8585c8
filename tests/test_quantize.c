/* Suite "quantize": `moe quantize` end to end.
 *
 * What is checked and against what:
 * - the file reads as GGUF with Hugging Face's parser (@huggingface/gguf from npm, through
 *   tests/clients/gguf_read.mjs): every tensor, its ggml type as the rules and llama.cpp's mix
 *   rules say (written out here from llama.cpp's llama_tensor_get_type, not from moe), shapes,
 *   aligned offsets that leave room for each tensor's bytes, general.file_type and
 *   general.quantization_version as llama.cpp writes them;
 * - the file runs: on real F32 models (stories260K, the deepseek2 parity model) the quantized
 *   model's logits equal those of the same weights dequantized to F32 up to the engine's 8-bit
 *   activation quantization (TOL_ACT, the gap ../shared/parity/README.md documents), and every
 *   quantized tensor's rel-Frobenius error against the source is inside its type's budget;
 * - an importance matrix in llama.cpp's GGUF format (written here as its format says) lowers the
 *   error weighted by it; IQ1 / IQ2 types without one are refused with a message.
 * Needs ../shared (skips without it, fails under CI=true) and node_modules for the parser
 * check. */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../src/format/format.h"

#define CLIENTS_DIR "tests/clients"
/* quantized vs the same weights in F32: the engine quantizes activations to 8 bits for
 * quantized weights (Q8_0 / Q8_K blocks), which moves logits by up to ~2e-2 of their range */
#define TOL_ACT 2.5e-2

static const char *tmp_path(const char *name) {
    static char paths[8][512];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, 512, "%s/%s", moe_test_tmpdir(), name);
    return p;
}

static char *run_ok(const char *cmd) {
    char *out;
    const int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("`%s` exited %d:\n%s", cmd, rc, out);
    return out;
}

static void quantize(const char *in, const char *out, const char *flags) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s quantize '%s' '%s' --quiet %s", moe_test_bin(), in, out, flags);
    free(run_ok(cmd));
}

/* ==== The file as another GGUF reader sees it ==== */

/* The JSON a command prints (failing the test on a non-zero exit or no JSON). */
static json_t *run_json(const char *cmd) {
    char *out = run_ok(cmd);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    if (!j) fail_msg("`%s` printed no JSON (%s): %s", cmd, je.text, out);
    free(out);
    return j;
}

static json_t *read_with_huggingface(const char *path) {
    struct stat st;
    if (stat(CLIENTS_DIR "/node_modules/@huggingface/gguf/package.json", &st) != 0) {
        if (getenv("CI") && !strcmp(getenv("CI"), "true"))
            fail_msg("%s/node_modules lacks @huggingface/gguf and CI=true: run `make clients`",
                     CLIENTS_DIR);
        print_message("[  SKIP    ] %s/node_modules is absent (run `make clients`)\n", CLIENTS_DIR);
        skip();
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "node %s/gguf_read.mjs '%s'", CLIENTS_DIR, path);
    return run_json(cmd);
}

/* ggml type ids and block geometry (ggml-common.h), for the types this suite writes */
static const struct {
    const char *name;
    int id, block_values, block_bytes;
} GGML_TYPES[] = {
    {"F32", 0, 1, 4},       {"Q8_0", 8, 32, 34},     {"Q4_K", 12, 256, 144}, {"Q5_K", 13, 256, 176},
    {"Q6_K", 14, 256, 210}, {"IQ3_S", 21, 256, 110}, {"IQ2_S", 22, 256, 82}, {"IQ4_NL", 20, 32, 18},
};

static int ggml_id(const char *name) {
    for (size_t i = 0; i < sizeof GGML_TYPES / sizeof GGML_TYPES[0]; i++)
        if (!strcmp(GGML_TYPES[i].name, name)) return GGML_TYPES[i].id;
    fail_msg("no ggml id for %s in this test", name);
    return -1;
}

static int64_t ggml_bytes(int id, int64_t n_values) {
    for (size_t i = 0; i < sizeof GGML_TYPES / sizeof GGML_TYPES[0]; i++)
        if (GGML_TYPES[i].id == id)
            return n_values / GGML_TYPES[i].block_values * GGML_TYPES[i].block_bytes;
    fail_msg("unexpected ggml type %d", id);
    return 0;
}

/* llama.cpp's use_more_bits(i_layer, n_layer) */
static bool more_bits(int i, int n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The type llama-quantize's Q4_K_M mix gives a tensor of the synthetic 4-layer qwen3moe (16
 * experts, GQA 2), after the test's rules `blk\.0\.=Q8_0` and `ffn_down_exps=IQ3_S`. */
static const char *expected_type(const char *name) {
    if (strstr(name, "norm") || strstr(name, "ffn_gate_inp")) return "F32";
    if (!strncmp(name, "blk.0.", 6)) return "Q8_0";
    if (strstr(name, "ffn_down_exps")) return "IQ3_S";
    if (!strcmp(name, "output.weight")) return "Q6_K";
    int layer = -1;
    sscanf(name, "blk.%d.", &layer);
    if (strstr(name, "attn_v.weight")) return more_bits(layer, 4) ? "Q6_K" : "Q4_K";
    return "Q4_K";
}

static void file_reads_as_llama_cpp_writes_it(void **state) {
    (void)state;
    const char *src = moe_test_synth("q-src.gguf", "--preset tiny");
    const char *out = tmp_path("q-mix.gguf");
    quantize(src, out, "--type Q4_K_M --rule 'blk\\.0\\.=Q8_0' --rule 'ffn_down_exps=IQ3_S'");
    json_t *j = read_with_huggingface(out);
    json_t *meta = json_object_get(j, "metadata");
    /* LLAMA_FTYPE_MOSTLY_Q4_K_M = 15, GGML_QNT_VERSION = 2 */
    assert_int_equal(json_integer_value(json_object_get(meta, "general.file_type")), 15);
    assert_int_equal(json_integer_value(json_object_get(meta, "general.quantization_version")), 2);
    assert_string_equal(json_string_value(json_object_get(meta, "general.architecture")),
                        "qwen3moe");
    json_t *tensors = json_object_get(j, "tensors");
    const int64_t data_offset = json_integer_value(json_object_get(j, "data_offset"));
    assert_int_equal(data_offset % 32, 0);
    struct stat st;
    assert_int_equal(stat(out, &st), 0);
    size_t i, n_quant = 0;
    json_t *t;
    int64_t prev_end = 0;
    json_array_foreach(tensors, i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        const int type = (int)json_integer_value(json_object_get(t, "type"));
        const int64_t offset = json_integer_value(json_object_get(t, "offset"));
        int64_t n_values = 1;
        size_t d;
        json_t *dim;
        json_array_foreach(json_object_get(t, "shape"), d, dim) n_values *= json_integer_value(dim);
        const char *want = expected_type(name);
        if (type != ggml_id(want))
            fail_msg("%s: ggml type %d, the rules say %s (%d)", name, type, want, ggml_id(want));
        n_quant += type != 0;
        assert_int_equal(offset % 32, 0);
        assert_true(offset >= prev_end);
        prev_end = offset + ggml_bytes(type, n_values);
    }
    assert_int_equal(json_array_size(tensors), 51); /* synth's tiny qwen3moe */
    assert_int_equal(n_quant, 30);
    assert_true(data_offset + prev_end <= (int64_t)st.st_size);
    json_decref(j);
}

/* ==== The file runs: logits against the dequantized weights ==== */

static float *read_f32(const char *path, size_t *n) {
    uint8_t *data;
    size_t size;
    moe_error err = {0};
    if (moe_file_read(path, &data, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
    *n = size / sizeof(float);
    return (float *)data;
}

static const char *PROMPT = "1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426";

static float *logits_of(const char *model, const char *name, size_t *n) {
    char cmd[2048];
    const char *out = tmp_path(name);
    snprintf(cmd, sizeof cmd, "%s logits '%s' --tokens %s --out '%s'", moe_test_bin(), model,
             PROMPT, out);
    free(run_ok(cmd));
    return read_f32(out, n);
}

/* max over rows of max |a - b| / max |b| (rows of n_vocab) */
static double worst_row(const float *a, const float *b, size_t n, size_t n_vocab) {
    double worst = 0;
    for (size_t r = 0; r < n / n_vocab; r++) {
        double d = 0, m = 0;
        for (size_t k = 0; k < n_vocab; k++) {
            const double x = a[r * n_vocab + k], y = b[r * n_vocab + k];
            d = fabs(x - y) > d ? fabs(x - y) : d;
            m = fabs(y) > m ? fabs(y) : m;
        }
        worst = d / m > worst ? d / m : worst;
    }
    return worst;
}

/* rel-Frobenius budgets of moe audit's per-tensor figure, by type (~1.5x what the quant suite
 * measures on gaussian rows: these weights are trained or small) */
static double fro_budget(const char *type) {
    if (!strcmp(type, "Q8_0")) return 0.012;
    if (!strcmp(type, "IQ4_NL") || !strcmp(type, "Q4_K") || !strcmp(type, "Q5_0") ||
        !strcmp(type, "Q4_0") || !strcmp(type, "Q5_1"))
        return 0.16;
    if (!strcmp(type, "Q6_K")) return 0.04;
    return 0.0;
}

static void check_model_tol(const char *rel, size_t n_vocab, const char *flags, double tol) {
    const char *src = moe_test_shared(rel);
    if (!src) return;
    const char *q = tmp_path("m-q.gguf"), *deq = tmp_path("m-deq.gguf");
    quantize(src, q, flags);
    quantize(q, deq, "--type F32");
    size_t nq, nd;
    float *lq = logits_of(q, "lq.f32", &nq), *ld = logits_of(deq, "ld.f32", &nd);
    assert_int_equal(nq, nd);
    const double err = worst_row(lq, ld, nq, n_vocab);
    print_message("[ MEASURE  ] %s %s: logits vs the dequantized weights %.2e (tol %.1e)\n", rel,
                  flags, err, tol);
    assert_true(err <= tol);
    free(lq), free(ld);
    /* every quantized tensor against its source */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s audit '%s' '%s' --json", moe_test_bin(), q, src);
    char *out = run_ok(cmd);
    json_error_t je;
    json_t *a = json_loads(out, 0, &je);
    if (!a) fail_msg("audit json: %s", je.text);
    size_t i;
    json_t *t;
    int checked = 0;
    json_array_foreach(json_object_get(a, "tensors"), i, t) {
        const char *type = json_string_value(json_object_get(t, "format"));
        const double fro = json_real_value(json_object_get(t, "rel_fro"));
        if (!strcmp(type, "F32")) continue;
        if (!(fro <= fro_budget(type)))
            fail_msg("%s (%s): rel-Frobenius %.4f over %.3f",
                     json_string_value(json_object_get(t, "tensor")), type, fro, fro_budget(type));
        checked++;
    }
    assert_true(checked > 0);
    json_decref(a);
    free(out);
}

static void check_model(const char *rel, size_t n_vocab, const char *flags) {
    check_model_tol(rel, n_vocab, flags, TOL_ACT);
}

static void stories260k_logits_match_dequantized(void **state) {
    (void)state;
    check_model("models/stories260K/stories260K.gguf", 512, "--type Q8_0");
    /* rows of 64: Q4_K falls back to Q5_0 as llama.cpp's does; output Q6_K -> Q8_0 */
    check_model("models/stories260K/stories260K.gguf", 512, "--type Q4_K_M");
}

static void deepseek2_logits_match_dequantized(void **state) {
    (void)state;
    check_model("parity/deepseek2-f32.gguf", 512, "--type IQ4_NL --rule 'ffn_down=Q8_0'");
}

/* The hybrids: the tensors their architectures read as floats (routers, gates, the indexer's
 * vectors) stay F32, as the binder declares, so the files load and run. */
static void hybrids_logits_match_dequantized(void **state) {
    (void)state;
    check_model("parity/qwen3next-f32.gguf", 512, "--type Q8_0");
    /* glm5next's hyper-connections and indexer carry the 8-bit activation error further
     * (measured 3.9e-2 between the same weights run quantized and in F32) */
    check_model_tol("parity/glm5next-f32.gguf", 512, "--type Q8_0", 5e-2);
}

/* --split-max-tensors: llama.cpp's gguf-split naming, and the shards load as the one file does */
static void split_output_loads_as_one(void **state) {
    (void)state;
    const char *src = moe_test_shared("models/stories260K/stories260K.gguf");
    if (!src) return;
    char one[512], split[512], first[512];
    snprintf(one, sizeof one, "%s", tmp_path("one.gguf"));
    snprintf(split, sizeof split, "%s", tmp_path("split.gguf"));
    snprintf(first, sizeof first, "%s", tmp_path("split-00001-of-00003.gguf"));
    quantize(src, one, "--type Q8_0");
    quantize(src, split, "--type Q8_0 --split-max-tensors 20"); /* 48 tensors: 20 + 20 + 8 */
    struct stat st;
    assert_int_equal(stat(tmp_path("split-00003-of-00003.gguf"), &st), 0);
    assert_int_not_equal(stat(tmp_path("split-00004-of-00004.gguf"), &st), 0);
    size_t na, nb;
    float *a = logits_of(one, "one.f32", &na), *b = logits_of(first, "split.f32", &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof(float));
    free(a), free(b);
}

/* ==== Importance matrix ==== */

/* llama.cpp's GGUF imatrix for every 2-D / 3-D weight of `model`: <name>.in_sum2 [n_in, n_mat]
 * and <name>.counts [1, n_mat], F32, general.type "imatrix"; importances log-normal per column,
 * counts 10 (so the mean is sum / 10). Returns the importances of `which` ([n_mat][n_in]). */
static float *write_imatrix(const char *model, const char *path, const char *which) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(model, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.type", "imatrix");
    moe_gguf_writer_set_u32(w, "imatrix.chunk_count", 10);
    uint64_t seed = 5;
    float *kept = NULL;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        if (t->n_dims < 2) continue;
        char name[256], key[300];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        const int64_t n_in = t->ne[0], n_mat = t->n_dims > 2 ? t->ne[2] : 1;
        float *sums = moe_xmalloc((size_t)(n_in * n_mat) * sizeof(float));
        float counts[64];
        assert_true(n_mat <= 64);
        for (int64_t k = 0; k < n_in * n_mat; k++)
            sums[k] = 10.0f * (float)exp(1.5 * moe_rng_gaussian(&seed));
        for (int64_t m = 0; m < n_mat; m++) counts[m] = 10.0f;
        snprintf(key, sizeof key, "%s.in_sum2", name);
        const int64_t ne_s[2] = {n_in, n_mat}, ne_c[2] = {1, n_mat};
        assert_int_equal(
            moe_gguf_writer_add_tensor(w, key, MOE_TYPE_F32, 2, ne_s, sums, false, &err), MOE_OK);
        snprintf(key, sizeof key, "%s.counts", name);
        assert_int_equal(
            moe_gguf_writer_add_tensor(w, key, MOE_TYPE_F32, 2, ne_c, counts, false, &err), MOE_OK);
        if (!strcmp(name, which)) {
            kept = sums;
            for (int64_t k = 0; k < n_in * n_mat; k++) kept[k] /= 10.0f;
        } else {
            free(sums);
        }
    }
    assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);
    moe_gguf_close(g);
    assert_non_null(kept);
    return kept;
}

/* sum over the tensor's values of imatrix[mat][col] * (deq - src)^2 */
static double weighted_error(const char *quant, const char *src, const char *name,
                             const float *im) {
    moe_error err = {0};
    moe_gguf *q = moe_gguf_open(quant, &err), *s = moe_gguf_open(src, &err);
    if (!q || !s) fail_msg("%s", err.msg);
    const moe_tensor *tq = moe_gguf_tensor_find(q, name), *ts = moe_gguf_tensor_find(s, name);
    assert_non_null(tq), assert_non_null(ts);
    assert_int_equal(ts->type, MOE_TYPE_F32);
    const int64_t n = tq->ne[0], rows = (int64_t)(tq->n_values / (uint64_t)n), per_mat = tq->ne[1];
    const uint64_t rb = moe_type_row_bytes(tq->type, n);
    float *row = moe_xmalloc((size_t)n * sizeof(float));
    double e = 0;
    for (int64_t r = 0; r < rows; r++) {
        moe_type_traits_get(tq->type)->to_float(tq->data + (uint64_t)r * rb, row, n);
        const float *x = (const float *)ts->data + r * n, *w = im + (r / per_mat) * n;
        for (int64_t k = 0; k < n; k++) e += w[k] * ((double)row[k] - x[k]) * (row[k] - x[k]);
    }
    free(row);
    moe_gguf_close(q), moe_gguf_close(s);
    return e;
}

static void imatrix_lowers_weighted_error_and_is_required(void **state) {
    (void)state;
    const char *src =
        moe_test_synth("im-src.gguf", "--preset tiny --layers 2 --experts 4 --experts-used 2");
    char im_path[512];
    snprintf(im_path, sizeof im_path, "%s", tmp_path("imatrix.gguf"));
    const char *name = "blk.1.ffn_down_exps.weight";
    float *im = write_imatrix(src, im_path, name);
    /* IQ2_S without an importance matrix: refused, saying why */
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s quantize '%s' '%s' --quiet --type Q4_K --rule 'exps=IQ2_S'",
             moe_test_bin(), src, tmp_path("refused.gguf"));
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "importance matrix"));
    free(out);
    char flags[1024];
    const char *types[] = {"Q4_K", "IQ3_S", "IQ2_S"};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const char *with = tmp_path("with.gguf"), *without = tmp_path("without.gguf");
        snprintf(flags, sizeof flags, "--type Q8_0 --rule 'exps=%s' --imatrix '%s'", types[t],
                 im_path);
        quantize(src, with, flags);
        /* without: all-ones importance (IQ2_S needs one), the same type */
        const char *ones = tmp_path("ones.gguf");
        if (!strcmp(types[t], "IQ2_S")) {
            moe_error err = {0};
            moe_gguf *g = moe_gguf_open(im_path, &err);
            moe_gguf_writer *w = moe_gguf_writer_new();
            for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
                const moe_tensor *x = moe_gguf_tensor_get(g, i);
                char key[300];
                snprintf(key, sizeof key, "%.*s", (int)x->name.len, x->name.ptr);
                float *v = moe_xmalloc((size_t)x->n_values * sizeof(float));
                for (uint64_t k = 0; k < x->n_values; k++) v[k] = 10.0f;
                moe_gguf_writer_add_tensor(w, key, MOE_TYPE_F32, x->n_dims, x->ne, v, false, &err);
                free(v);
            }
            assert_int_equal(moe_gguf_writer_write(w, ones, 0, &err), MOE_OK);
            moe_gguf_writer_free(w), moe_gguf_close(g);
            snprintf(flags, sizeof flags, "--type Q8_0 --rule 'exps=%s' --imatrix '%s'", types[t],
                     ones);
        } else {
            snprintf(flags, sizeof flags, "--type Q8_0 --rule 'exps=%s'", types[t]);
        }
        quantize(src, without, flags);
        const double ew = weighted_error(with, src, name, im);
        const double eo = weighted_error(without, src, name, im);
        print_message("[ MEASURE  ] %s: error weighted by the imatrix %.4g with it, %.4g without\n",
                      types[t], ew, eo);
        assert_true(ew < eo);
    }
    free(im);
}

/* ==== moe imatrix ==== */

static const json_t *find_tensor(json_t *tensors, const char *name) {
    size_t i;
    json_t *t;
    json_array_foreach(
        tensors, i, t) if (!strcmp(json_string_value(json_object_get(t, "name")), name)) return t;
    return NULL;
}

static float *tensor_f32(const char *path, const char *name, size_t n) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    const moe_tensor *t = moe_gguf_tensor_find(g, name);
    if (!t || t->type != MOE_TYPE_F32 || t->n_values != n)
        fail_msg("%s: no F32 %s[%zu]", path, name, n);
    float *v = moe_xmalloc(n * sizeof(float));
    memcpy(v, t->data, n * sizeof(float));
    moe_gguf_close(g);
    return v;
}

/* moe imatrix over a text on stories260K (dense) and the deepseek2 parity model (experts): the
 * file reads as llama.cpp's format with Hugging Face's parser (keys, shapes, counts); matmuls
 * that share an input have equal sums; expert counts add up to tokens x experts used; and
 * quantizing with it lowers the error it weights. */
static void imatrix_collects_llama_cpp_format(void **state) {
    (void)state;
    const char *text = moe_test_shared("models/stories260K/runc_greedy_bos_n256.txt");
    const char *dense = moe_test_shared("models/stories260K/stories260K.gguf");
    const char *moe_model = moe_test_shared("parity/deepseek2-f32.gguf");
    if (!text || !dense || !moe_model) return;
    char im[512], cmd[2048];
    snprintf(im, sizeof im, "%s", tmp_path("collected.gguf"));
    snprintf(cmd, sizeof cmd, "%s imatrix '%s' --text '%s' -o '%s' --ctx 32 --chunks 3 --quiet",
             moe_test_bin(), dense, text, im);
    free(run_ok(cmd));
    json_t *j = read_with_huggingface(im);
    json_t *meta = json_object_get(j, "metadata"), *tensors = json_object_get(j, "tensors");
    assert_string_equal(json_string_value(json_object_get(meta, "general.type")), "imatrix");
    assert_int_equal(json_integer_value(json_object_get(meta, "imatrix.chunk_count")), 3);
    assert_int_equal(json_integer_value(json_object_get(meta, "imatrix.chunk_size")), 32);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(meta, "imatrix.datasets"), "array")), 1);
    /* stories260K: 5 layers x (q k v o gate up down); the tied head is not collected */
    assert_int_equal(json_array_size(tensors), 5 * 7 * 2);
    const json_t *q = find_tensor(tensors, "blk.2.attn_q.weight.in_sum2");
    const json_t *c = find_tensor(tensors, "blk.2.ffn_down.weight.counts");
    assert_non_null(q), assert_non_null(c);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(q, "shape"), 0)), 64);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(q, "shape"), 1)), 1);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(c, "shape"), 0)), 1);
    json_decref(j);
    float *cq = tensor_f32(im, "blk.2.attn_q.weight.counts", 1);
    assert_true(cq[0] == 3 * 32);
    float *sq = tensor_f32(im, "blk.2.attn_q.weight.in_sum2", 64);
    float *sk = tensor_f32(im, "blk.2.attn_k.weight.in_sum2", 64);
    float *sg = tensor_f32(im, "blk.2.ffn_gate.weight.in_sum2", 64);
    float *su = tensor_f32(im, "blk.2.ffn_up.weight.in_sum2", 64);
    assert_memory_equal(sq, sk, 64 * sizeof(float)); /* q and k read the same normed rows */
    assert_memory_equal(sg, su, 64 * sizeof(float));
    for (int k = 0; k < 64; k++) assert_true(sq[k] > 0);
    free(cq), free(sq), free(sk), free(sg), free(su);

    /* experts: per-expert counts over the routed rows (2 of 8 per token) */
    snprintf(cmd, sizeof cmd, "%s imatrix '%s' --text '%s' -o '%s' --ctx 16 --chunks 2 --quiet",
             moe_test_bin(), moe_model, text, im);
    free(run_ok(cmd));
    float *ce = tensor_f32(im, "blk.1.ffn_down_exps.weight.counts", 8);
    double total = 0;
    for (int e = 0; e < 8; e++) total += ce[e];
    assert_true(total == 2 * 16 * 2); /* chunks x ctx x experts used */
    free(ce);
    float *cs = tensor_f32(im, "blk.1.ffn_gate_exps.weight.in_sum2", 64 * 8);
    float *cu = tensor_f32(im, "blk.1.ffn_up_exps.weight.in_sum2", 64 * 8);
    assert_memory_equal(cs, cu, 64 * 8 * sizeof(float));
    free(cs), free(cu);

    /* quantizing the dense model with the collected matrix lowers the error it weights */
    snprintf(cmd, sizeof cmd, "%s imatrix '%s' --text '%s' -o '%s' --ctx 64 --quiet",
             moe_test_bin(), dense, text, im);
    free(run_ok(cmd));
    const char *name = "blk.3.ffn_up.weight";
    float *imv = tensor_f32(im, "blk.3.ffn_up.weight.in_sum2", 64);
    char with[512], without[512], flags[1024];
    snprintf(with, sizeof with, "%s", tmp_path("dense-with.gguf"));
    snprintf(without, sizeof without, "%s", tmp_path("dense-without.gguf"));
    snprintf(flags, sizeof flags, "--type Q4_0 --imatrix '%s'", im);
    quantize(dense, with, flags);
    quantize(dense, without, "--type Q4_0");
    const double ew = weighted_error(with, dense, name, imv);
    const double eo = weighted_error(without, dense, name, imv);
    print_message("[ MEASURE  ] stories260K %s Q4_0: activation-weighted error %.4g with the "
                  "collected imatrix, %.4g without\n",
                  name, ew, eo);
    assert_true(ew < eo);
    free(imv);
}

/* The ud-iq3_xxs mix from an imatrix moe collected: Unsloth's expert map (routed gate/up IQ2_S,
 * down IQ3_S) and llama.cpp's IQ3_XXS rules elsewhere (with an imatrix: attn_q / attn_k IQ2_S,
 * attn_v IQ3_XXS at GQA 2, attn_output IQ3_S, token_embd IQ3_S, output Q5_K), file type 23
 * (LLAMA_FTYPE_MOSTLY_IQ3_XXS); the model runs. */
static void ud_iq3_xxs_mix_from_collected_imatrix(void **state) {
    (void)state;
    const char *text = moe_test_shared("models/stories260K/runc_greedy_bos_n256.txt");
    if (!text) return;
    const char *src = moe_test_synth("ud-src.gguf", "--preset tiny --layers 2");
    char im[512], out[512], cmd[2048];
    snprintf(im, sizeof im, "%s", tmp_path("ud-im.gguf"));
    snprintf(out, sizeof out, "%s", tmp_path("ud.gguf"));
    snprintf(cmd, sizeof cmd, "%s imatrix '%s' --text '%s' -o '%s' --ctx 32 --chunks 2 --quiet",
             moe_test_bin(), src, text, im);
    free(run_ok(cmd));
    char flags[1024];
    snprintf(flags, sizeof flags, "--type ud-iq3_xxs --imatrix '%s'", im);
    quantize(src, out, flags);
    json_t *j = read_with_huggingface(out);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "metadata"), "general.file_type")),
        23);
    static const struct {
        const char *suffix;
        int ggml_type;
    } want[] = {
        {"ffn_gate_exps.weight", 22}, {"ffn_up_exps.weight", 22}, {"ffn_down_exps.weight", 21},
        {"attn_q.weight", 22},        {"attn_k.weight", 22},      {"attn_v.weight", 18},
        {"attn_output.weight", 21},   {"token_embd.weight", 21},  {"output.weight", 13},
        {"ffn_gate_inp.weight", 0},   {"attn_norm.weight", 0},
    };
    size_t i, checked = 0;
    json_t *t;
    json_array_foreach(json_object_get(j, "tensors"), i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
            /* a layer tensor by its suffix after "blk.N.", the others by their whole name */
            const char *dot = !strncmp(name, "blk.", 4) ? strchr(name + 4, '.') : NULL;
            if (strcmp(dot ? dot + 1 : name, want[k].suffix)) continue;
            if (json_integer_value(json_object_get(t, "type")) != want[k].ggml_type)
                fail_msg("%s: ggml type %lld, the mix says %d", name,
                         (long long)json_integer_value(json_object_get(t, "type")),
                         want[k].ggml_type);
            checked++;
        }
    }
    assert_int_equal(checked, 2 * 9 + 2); /* 9 kinds per layer x 2 layers, embd and head */
    json_decref(j);
    snprintf(cmd, sizeof cmd, "%s run '%s' -n 4 -p 'the model'", moe_test_bin(), out);
    char *o = run_ok(cmd);
    assert_non_null(strstr(o, "generated: 4 tokens"));
    free(o);
}

/* ==== moe audit --ladder ==== */

static json_t *audit_json(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s audit %s --json", moe_test_bin(), args);
    return run_json(cmd);
}

/* A rung is what `moe quantize` would write: its figures equal `moe audit` of a file quantized
 * to that type, number for number; more bits, less error; IQ2_S needs the imatrix. */
static void ladder_matches_quantized_files(void **state) {
    (void)state;
    const char *src = moe_test_synth("ladder-src.gguf", "--preset tiny --layers 2");
    char q[512], im_path[512], args[2048];
    snprintf(q, sizeof q, "%s", tmp_path("ladder-q4k.gguf"));
    snprintf(im_path, sizeof im_path, "%s", tmp_path("ladder-im.gguf"));
    quantize(src, q, "--type Q4_K");
    const char *sel = "--tensor 'blk\\.1\\.ffn_(gate|down)_exps' --experts 0,3 --rows 64";
    snprintf(args, sizeof args, "--ladder '%s' --types IQ3_XXS,IQ3_S,IQ4_XS,Q4_K,Q6_K %s", src,
             sel);
    json_t *ladder = audit_json(args);
    snprintf(args, sizeof args, "'%s' '%s' %s", q, src, sel);
    json_t *file = audit_json(args);
    size_t i, matched = 0;
    json_t *a, *b;
    double prev = INFINITY;
    json_array_foreach(json_object_get(ladder, "tensors"), i, a) {
        const double fro = json_real_value(json_object_get(a, "rel_fro"));
        /* rungs in order of bits within one (tensor, expert): the error falls */
        if (i % 5 == 0) prev = INFINITY;
        assert_true(fro < prev);
        prev = fro;
        if (strcmp(json_string_value(json_object_get(a, "format")), "Q4_K")) continue;
        size_t k;
        json_array_foreach(json_object_get(file, "tensors"), k, b) {
            if (strcmp(json_string_value(json_object_get(a, "tensor")),
                       json_string_value(json_object_get(b, "tensor"))) ||
                json_integer_value(json_object_get(a, "expert")) !=
                    json_integer_value(json_object_get(b, "expert")))
                continue;
            assert_true(json_real_value(json_object_get(a, "rel_fro")) ==
                        json_real_value(json_object_get(b, "rel_fro")));
            assert_true(json_real_value(json_object_get(a, "matvec_rel")) ==
                        json_real_value(json_object_get(b, "matvec_rel")));
            matched++;
        }
    }
    assert_int_equal(matched, 4); /* 2 tensors x 2 experts */
    json_decref(ladder), json_decref(file);
    /* IQ2_S: refused without an importance matrix, measured with one */
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s audit --ladder '%s' --types IQ2_S %s", moe_test_bin(), src, sel);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "needs an importance matrix"));
    free(out);
    free(write_imatrix(src, im_path, "blk.1.ffn_down_exps.weight"));
    snprintf(args, sizeof args, "--ladder '%s' --types IQ2_S --imatrix '%s' %s", src, im_path, sel);
    json_t *im = audit_json(args);
    assert_int_equal(json_array_size(json_object_get(im, "tensors")), 4);
    json_decref(im);
}

/* ==== Bad input ==== */

static void bad_arguments_are_refused(void **state) {
    (void)state;
    const char *src =
        moe_test_synth("bad-src.gguf", "--preset tiny --layers 1 --experts 4 --experts-used 2");
    const struct {
        const char *flags, *says;
        int rc;
    } cases[] = {
        {"--type Q9_Z", "neither a mix", 2},
        {"--rule 'x=NOPE'", "REGEX=TYPE", 2},
        {"--rule '(=Q4_K'", "not a valid regular expression", 1},
        {"--imatrix /nonexistent.gguf", "/nonexistent.gguf", 1},
        {"--type Q4_K --rule 'attn_q=TQ1_0'", "no quantizer for TQ1_0", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[2048], *out;
        snprintf(cmd, sizeof cmd, "%s quantize '%s' '%s' --quiet %s", moe_test_bin(), src,
                 tmp_path("bad.gguf"), cases[i].flags);
        const int rc = moe_test_run(cmd, &out);
        if (rc != cases[i].rc || !strstr(out, cases[i].says))
            fail_msg("`%s`: exit %d (want %d), output lacks '%s':\n%s", cases[i].flags, rc,
                     cases[i].rc, cases[i].says, out);
        free(out);
    }
    /* a NaN in the source: refused, naming the tensor, row and column (a copy of the file with
     * one value overwritten where the directory says it lies) */
    char nan_path[512];
    snprintf(nan_path, sizeof nan_path, "%s", tmp_path("nan.gguf"));
    uint8_t *bytes;
    size_t size;
    moe_error err = {0};
    assert_int_equal(moe_file_read(src, &bytes, &size, &err), MOE_OK);
    moe_gguf *g = moe_gguf_open(src, &err);
    if (!g) fail_msg("%s", err.msg);
    const moe_tensor *k = moe_gguf_tensor_find(g, "blk.0.attn_k.weight");
    assert_non_null(k);
    assert_int_equal(k->type, MOE_TYPE_F32);
    const float nan_value = NAN;
    memcpy(bytes + k->file_offset + (3 * (uint64_t)k->ne[0] + 7) * sizeof(float), &nan_value,
           sizeof nan_value);
    moe_gguf_close(g);
    assert_int_equal(moe_file_write(nan_path, bytes, size, &err), MOE_OK);
    free(bytes);
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s quantize '%s' '%s' --quiet --type Q4_K", moe_test_bin(), nan_path,
             tmp_path("x.gguf"));
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "tensor 'blk.0.attn_k.weight' row 3 column 7 is NaN"));
    free(out);
    struct stat st;
    assert_int_not_equal(stat(tmp_path("x.gguf"), &st), 0); /* nothing half-written left */
    snprintf(cmd, sizeof cmd, "%s quantize /nonexistent.gguf '%s'", moe_test_bin(),
             tmp_path("x.gguf"));
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "/nonexistent.gguf"));
    free(out);
}

int moe_suite_quantize(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(file_reads_as_llama_cpp_writes_it),
        cmocka_unit_test(stories260k_logits_match_dequantized),
        cmocka_unit_test(deepseek2_logits_match_dequantized),
        cmocka_unit_test(hybrids_logits_match_dequantized),
        cmocka_unit_test(split_output_loads_as_one),
        cmocka_unit_test(imatrix_lowers_weighted_error_and_is_required),
        cmocka_unit_test(imatrix_collects_llama_cpp_format),
        cmocka_unit_test(ud_iq3_xxs_mix_from_collected_imatrix),
        cmocka_unit_test(ladder_matches_quantized_files),
        cmocka_unit_test(bad_arguments_are_refused),
    };
    return cmocka_run_group_tests_name("quantize", tests, NULL, NULL);
}
