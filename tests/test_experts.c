/* Suite "experts": routed experts streamed from the model file through a resident cache
 * (--expert-cache). The bytes are the file's, so on every MoE fixture the logits with a cache
 * holding a quarter of the experts (at least 2) equal the fully resident run bit for bit, for one
 * sequence and for interleaved ones; the cache really was smaller than the experts (it evicted).
 * Loading with the experts left out reads only the rest. A file truncated after loading makes
 * the step fail with an error naming the file, never a crash or a silently wrong token, and a
 * size the cache cannot work with is refused with the size it needs. Use counts kept in a file
 * warm the next run's cache (its first step already hits), pinned experts are resident from the
 * start, and a malformed list is an error naming its line. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/engine/engine_internal.h"

static const char *const moe_fixtures[] = {
    "parity/qwen3moe-mixed.gguf", "parity/deepseek2-q8_0-q4_k.gguf", "parity/gpt-oss-mxfp4.gguf",
    "parity/qwen3next-f32.gguf",  "parity/kimi-linear-f32.gguf",     "parity/glm5next-f32.gguf",
    "parity/gemma4-moe-q4_0.gguf"};

/* 1/div of the model's experts, at least 2 slots. */
static uint64_t share(const moe_model *m, uint32_t div) {
    const uint32_t n_layer = m->cfg.n_layer + m->n_layer_mtp;
    const uint64_t slot = moe_expert_cache_slot_bytes(m, n_layer);
    uint64_t slots = (uint64_t)n_layer * m->cfg.n_expert / div;
    return (slots < 2 ? 2 : slots) * slot;
}

static uint64_t quarter(const moe_model *m) {
    return share(m, 4);
}

/* 16 prompt ids in one call, then 16 one at a time, for n_seq sequences interleaved (sequence s
 * gets ids shifted by s); logits [n_seq][32][n_vocab]. */
static moe_status run(const moe_model *m, uint64_t cache_bytes, uint32_t n_seq, float *logits,
                      moe_expert_cache_stats *stats, moe_error *err) {
    moe_ctx_params cp = {.n_ctx = 64,
                         .n_seq = n_seq,
                         .max_rows = 16 * n_seq,
                         .kv_type = MOE_TYPE_F32,
                         .n_threads = 2,
                         .expert_cache_bytes = cache_bytes};
    moe_ctx *c = moe_ctx_new(m, &cp, err);
    if (!c) return err->code;
    const uint32_t nv = m->cfg.n_vocab;
    moe_row rows[64];
    float *out = malloc(sizeof(float) * 16 * n_seq * nv);
    moe_status st = MOE_OK;
    for (uint32_t step = 0; step < 17 && st == MOE_OK; step++) {
        const uint32_t per = step == 0 ? 16 : 1, pos0 = step == 0 ? 0 : 15 + step;
        uint32_t n = 0;
        for (uint32_t i = 0; i < per; i++)
            for (uint32_t s = 0; s < n_seq; s++)
                rows[n++] = (moe_row){(int32_t)s, (int32_t)(pos0 + i),
                                      (int32_t)(1 + (7 * (pos0 + i) + 13 * s) % (nv - 1)), true};
        st = moe_ctx_decode(c, rows, n, out, err);
        for (uint32_t r = 0; st == MOE_OK && r < n; r++)
            memcpy(logits + ((size_t)rows[r].seq * 32 + (size_t)rows[r].pos) * nv,
                   out + (size_t)r * nv, sizeof(float) * nv);
    }
    if (stats) *stats = moe_ctx_expert_cache_stats(c);
    free(out);
    moe_ctx_free(c);
    return st;
}

/* A quarter of the experts (read on demand only), then half (room for the reader thread to read
 * the next layer's experts ahead: some steps must find them already there). */
static void cache_equals_resident(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared(moe_fixtures[0]));
    uint64_t read_ahead = 0;
    for (size_t i = 0; i < sizeof moe_fixtures / sizeof moe_fixtures[0]; i++) {
        moe_error err = {0};
        moe_model *m = moe_model_load(moe_test_shared(moe_fixtures[i]), &err);
        if (!m) fail_msg("%s", err.msg);
        for (uint32_t n_seq = 1; n_seq <= 3; n_seq += 2)
            for (uint32_t div = 4; div >= 2; div /= 2) {
                const size_t n = (size_t)n_seq * 32 * m->cfg.n_vocab;
                float *resident = calloc(n, sizeof(float)), *cached = calloc(n, sizeof(float));
                moe_expert_cache_stats st;
                if (run(m, 0, n_seq, resident, NULL, &err) != MOE_OK ||
                    run(m, share(m, div), n_seq, cached, &st, &err) != MOE_OK)
                    fail_msg("%s: %s", moe_fixtures[i], err.msg);
                print_message(
                    "%s, %u sequence(s): %u slots, hit rate %.2f, %llu evictions, %llu read "
                    "ahead\n",
                    moe_fixtures[i], n_seq, st.slots,
                    (double)st.hits / (double)(st.hits + st.misses),
                    (unsigned long long)st.evictions, (unsigned long long)st.read_ahead);
                assert_true(st.misses > 0 && (div == 2 || st.evictions > 0));
                assert_true(st.bytes_read > 0 && st.busy_seconds > 0);
                read_ahead += st.read_ahead;
                if (memcmp(resident, cached, n * sizeof(float)) != 0)
                    fail_msg("%s: logits with the expert cache differ from the resident run",
                             moe_fixtures[i]);
                free(resident);
                free(cached);
            }
        moe_model_free(m);
    }
    assert_true(read_ahead > 0);
}

/* Read with the experts left out: the bytes read are the rest's, the experts have no data, and
 * the cache still reproduces the resident logits from the file. */
static void load_without_experts(void **state) {
    (void)state;
    const char *path = moe_test_shared("parity/qwen3moe-mixed.gguf");
    MOE_SKIP_IF_NULL(path);
    moe_error err = {0};
    moe_model *full = moe_model_load(path, &err), *m = moe_model_load(path, &err);
    assert_non_null(full);
    assert_non_null(m);
    uint64_t read = 0, experts = 0, total = 0;
    for (uint64_t t = 0; t < moe_gguf_n_tensors(m->gguf); t++) {
        const moe_tensor *x = moe_gguf_tensor_get(m->gguf, t);
        total += x->n_bytes;
        if (moe_model_is_routed(x, m)) experts += x->n_bytes;
    }
    assert_true(experts > 0);
    moe_pool *pool = moe_pool_new(2);
    assert_int_equal(moe_gguf_to_memory_except(m->gguf, pool, moe_model_is_routed, m, &read, &err),
                     MOE_OK);
    moe_pool_free(pool);
    print_message("read %llu of %llu tensor bytes (experts %llu left in the file)\n",
                  (unsigned long long)read, (unsigned long long)total, (unsigned long long)experts);
    assert_true(read == total - experts);
    assert_null(m->layers[0].experts.gate->data);
    assert_non_null(m->layers[0].attn.wq->data);
    const size_t n = 32 * (size_t)m->cfg.n_vocab;
    float *a = calloc(n, sizeof(float)), *b = calloc(n, sizeof(float));
    assert_int_equal(run(full, 0, 1, a, NULL, &err), MOE_OK);
    assert_int_equal(run(m, quarter(m), 1, b, NULL, &err), MOE_OK);
    assert_memory_equal(a, b, n * sizeof(float));
    free(a);
    free(b);
    moe_model_free(full);
    moe_model_free(m);
}

/* The file cut short after loading: the step that needs a missing expert fails with the file's
 * name, and so does the next one (the cache did not keep the half-read expert). */
static void truncated_file_is_an_error(void **state) {
    (void)state;
    size_t size;
    uint8_t *bytes = moe_test_shared_read("parity/qwen3moe-mixed.gguf", &size);
    MOE_SKIP_IF_NULL(bytes);
    char path[512];
    snprintf(path, sizeof path, "%s/cut.gguf", moe_test_tmpdir());
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bytes, 1, size, f), size);
    fclose(f);
    free(bytes);
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    assert_non_null(m);
    /* the rest resident, as moe run loads it with an expert cache (a cut mapping would fault) */
    assert_int_equal(moe_gguf_to_memory_except(m->gguf, NULL, moe_model_is_routed, m, NULL, &err),
                     MOE_OK);
    uint64_t first_expert = UINT64_MAX; /* cut before the first routed expert's bytes */
    for (uint64_t t = 0; t < moe_gguf_n_tensors(m->gguf); t++) {
        const moe_tensor *x = moe_gguf_tensor_get(m->gguf, t);
        if (moe_model_is_routed(x, m) && x->file_offset < first_expert)
            first_expert = x->file_offset;
    }
    assert_int_equal(truncate(path, (off_t)first_expert), 0);
    const size_t n = 32 * (size_t)m->cfg.n_vocab;
    float *logits = calloc(n, sizeof(float));
    for (int attempt = 0; attempt < 2; attempt++) {
        err = (moe_error){0};
        assert_int_equal(run(m, quarter(m), 1, logits, NULL, &err), MOE_ERR_IO);
        print_message("%s\n", err.msg);
        assert_non_null(strstr(err.msg, "cut.gguf"));
        assert_non_null(strstr(err.msg, "ends at byte"));
    }
    free(logits);
    moe_model_free(m);
}

/* ==== The dispatch computes what is resident while the rest is read ==== */

/* A source over a layer's resident experts that says the odd ones are still being read. The
 * matmul observer logs, in order, 'r' for a matmul of a ready expert, 'm' for one of a missing
 * expert, and wait logs 'W'. */
typedef struct fake_source {
    const moe_tensor *stacked[3]; /* gate (or gate_up), up, down */
    char log[1024];
    int n_log;
} fake_source;

static void fake_view(const moe_tensor *t, int32_t e, moe_tensor *v) {
    if (!t) {
        *v = (moe_tensor){0};
        return;
    }
    const uint64_t slice = t->n_bytes / (uint64_t)t->ne[2];
    *v = *t;
    v->ne[2] = 1;
    v->n_values = (uint64_t)t->ne[0] * (uint64_t)t->ne[1];
    v->n_bytes = slice;
    v->data = t->data + (uint64_t)e * slice;
}

static bool fake_acquire(void *ctx, const int32_t *ids, int n, moe_tensor *views, bool *ready) {
    fake_source *f = ctx;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < 3; k++) fake_view(f->stacked[k], ids[i], &views[3 * i + k]);
        ready[i] = ids[i] % 2 == 0;
    }
    return true;
}

static bool fake_wait(void *ctx, const int32_t *ids, int n) {
    (void)ids, (void)n;
    fake_source *f = ctx;
    f->log[f->n_log++] = 'W';
    return true;
}

static void fake_release(void *ctx, const int32_t *ids, int n) {
    (void)ctx, (void)ids, (void)n;
}

static void fake_observe(void *ctx, const moe_tensor *w, int64_t matrix, const float *x,
                         int64_t n_rows) {
    (void)matrix, (void)x, (void)n_rows;
    fake_source *f = ctx;
    for (int k = 0; k < 3; k++) {
        const moe_tensor *t = f->stacked[k];
        if (t && w->data >= t->data && w->data < t->data + t->n_bytes && f->n_log < 1000)
            f->log[f->n_log++] =
                (w->data - t->data) / (t->n_bytes / (uint64_t)t->ne[2]) % 2 ? 'm' : 'r';
    }
}

/* Layer 0's experts over 5 rows (row r chooses experts r, r + 1, ... mod n_expert), once from
 * the stacked tensors, once through the source: the ready experts' matmuls all come before the
 * wait, the others' all after, and the outputs are the same bits. Separate gate and up, biases
 * (gpt-oss) and fused gate_up (Gemma 4). */
static void resident_experts_compute_first(void **state) {
    (void)state;
    static const char *const fixtures[] = {
        "parity/qwen3moe-mixed.gguf", "parity/gpt-oss-mxfp4.gguf", "parity/gemma4-moe-q4_0.gguf"};
    MOE_SKIP_IF_NULL(moe_test_shared(fixtures[0]));
    moe_pool *pool = moe_pool_new(2);
    for (size_t fi = 0; fi < sizeof fixtures / sizeof fixtures[0]; fi++) {
        moe_error err = {0};
        moe_model *m = moe_model_load(moe_test_shared(fixtures[fi]), &err);
        if (!m) fail_msg("%s", err.msg);
        const moe_model_config *cfg = &m->cfg;
        uint32_t il = 0;
        while (m->layers[il].plan.ffn != MOE_FFN_EXPERTS) il++;
        const moe_expert_weights *w = &m->layers[il].experts;
        const int64_t rows = 5, n_used = cfg->n_expert_used, n_embd = cfg->n_embd;
        const int64_t n_ff = w->down->ne[0];
        const moe_tensor *in_w = w->gate_up ? w->gate_up : w->gate;
        uint64_t mm = moe_matmul_scratch_bytes(in_w, rows);
        if (moe_matmul_scratch_bytes(w->down, rows) > mm)
            mm = moe_matmul_scratch_bytes(w->down, rows);
        const moe_expert_scratch s = {.counts = calloc(cfg->n_expert + 1, sizeof(int32_t)),
                                      .pair_row = calloc((size_t)(rows * n_used), sizeof(int32_t)),
                                      .pair_w = calloc((size_t)(rows * n_used), sizeof(float)),
                                      .x = calloc((size_t)(rows * n_used * n_embd), sizeof(float)),
                                      .gate =
                                          calloc((size_t)(rows * n_used * n_ff * 2), sizeof(float)),
                                      .up = calloc((size_t)(rows * n_used * n_ff), sizeof(float)),
                                      .y = calloc((size_t)(rows * n_used * n_embd), sizeof(float)),
                                      .mm = malloc(mm * (size_t)n_used),
                                      .mm_up = malloc(mm * (size_t)n_used),
                                      .max_rows = rows * n_used};
        float *x = malloc(sizeof(float) * (size_t)(rows * n_embd));
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(rows * n_used));
        float *weights = malloc(sizeof(float) * (size_t)(rows * n_used));
        uint32_t seed = 7;
        for (int64_t i = 0; i < rows * n_embd; i++) {
            seed = seed * 1664525u + 1013904223u;
            x[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < n_used; k++) {
                ids[r * n_used + k] = (int32_t)((r + k) % cfg->n_expert);
                weights[r * n_used + k] = 1.0f / (float)(k + 1 + r);
            }
        fake_source f = {.stacked = {in_w, w->gate_up ? NULL : w->up, w->down}};
        const moe_expert_source src = {fake_acquire, fake_wait, fake_release, &f, 128};
        moe_expert_set set = moe_expert_set_of(cfg, &m->layers[il]);
        float *a = calloc((size_t)(rows * n_embd), sizeof(float));
        float *b = calloc((size_t)(rows * n_embd), sizeof(float));
        assert_true(
            moe_experts_forward(pool, &set, x, rows, ids, weights, (int)n_used, a, &s, NULL));
        set.source = &src;
        moe_matmul_set_observer(fake_observe, &f);
        assert_true(
            moe_experts_forward(pool, &set, x, rows, ids, weights, (int)n_used, b, &s, NULL));
        moe_matmul_set_observer(NULL, NULL);
        f.log[f.n_log] = 0;
        print_message("%s: %s\n", fixtures[fi], f.log);
        const size_t n_ready = strspn(f.log, "r");
        assert_true(n_ready > 0 && f.log[n_ready] == 'W' && f.log[n_ready + 1] == 'm');
        assert_int_equal(strspn(f.log + n_ready + 1, "m"), strlen(f.log + n_ready + 1));
        assert_memory_equal(a, b, sizeof(float) * (size_t)(rows * n_embd));
        free(a), free(b), free(x), free(ids), free(weights);
        free(s.counts), free(s.pair_row), free(s.pair_w), free(s.x), free(s.gate), free(s.up);
        free(s.y), free(s.mm), free(s.mm_up);
        moe_model_free(m);
    }
    moe_pool_free(pool);
}

static moe_ctx *cache_ctx(const moe_model *m, const char *stats, const char *pins, moe_error *err) {
    moe_ctx_params cp = {.n_ctx = 64,
                         .n_seq = 1,
                         .max_rows = 16,
                         .n_threads = 2,
                         .expert_cache_bytes = 2 * quarter(m),
                         .expert_stats = stats,
                         .pin_experts = pins};
    return moe_ctx_new(m, &cp, err);
}

/* One 16-token prefill; the cache's counters after it. */
static moe_expert_cache_stats prefill(moe_ctx *c) {
    moe_row rows[16];
    for (int i = 0; i < 16; i++) rows[i] = (moe_row){0, i, 10 + 3 * i, i == 15};
    float *logits = malloc(sizeof(float) * moe_ctx_model(c)->cfg.n_vocab);
    moe_error err = {0};
    if (moe_ctx_decode(c, rows, 16, logits, &err) != MOE_OK) fail_msg("%s", err.msg);
    free(logits);
    return moe_ctx_expert_cache_stats(c);
}

static void stats_and_pins(void **state) {
    (void)state;
    const char *path = moe_test_shared("parity/qwen3moe-mixed.gguf");
    MOE_SKIP_IF_NULL(path);
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    assert_non_null(m);
    char stats[512], pins[512];
    snprintf(stats, sizeof stats, "%s/experts.stats", moe_test_tmpdir());
    snprintf(pins, sizeof pins, "%s/experts.pin", moe_test_tmpdir());
    unlink(stats);
    moe_ctx *c = cache_ctx(m, stats, NULL, &err);
    assert_non_null(c);
    const moe_expert_cache_stats cold = prefill(c);
    moe_ctx_free(c); /* writes the counts */
    FILE *f = fopen(stats, "r");
    assert_non_null(f);
    char head[64] = "";
    assert_non_null(fgets(head, sizeof head, f));
    fclose(f);
    assert_non_null(strstr(head, "moe-expert-stats 1 2 8"));
    c = cache_ctx(m, stats, NULL, &err);
    assert_non_null(c);
    const moe_expert_cache_stats warm = prefill(c);
    moe_ctx_free(c);
    print_message("16-token prefill: cold hit rate %.2f, warmed from the statistics %.2f\n",
                  (double)cold.hits / (double)(cold.hits + cold.misses),
                  (double)warm.hits / (double)(warm.hits + warm.misses));
    assert_true(warm.hits > cold.hits);

    f = fopen(pins, "w");
    fputs("# layer expert\n0 1\n1:5\n", f);
    fclose(f);
    c = cache_ctx(m, NULL, pins, &err);
    if (!c) fail_msg("%s", err.msg);
    moe_expert_cache_stats st = moe_ctx_expert_cache_stats(c);
    assert_int_equal(st.misses, 0); /* the pins were read before counting started */
    moe_ctx_free(c);
    /* 6 of the 8 slots pinned to layer 0: layer 1's experts go through the other 2 */
    f = fopen(pins, "w");
    fputs("0 0\n0 1\n0 2\n0 3\n0 4\n0 5\n", f);
    fclose(f);
    c = cache_ctx(m, NULL, pins, &err);
    if (!c) fail_msg("%s", err.msg);
    st = prefill(c);
    assert_true(st.misses > 2);
    moe_ctx_free(c);
    f = fopen(pins, "w");
    fputs("0 1\n7 1\n", f); /* there are 2 layers */
    fclose(f);
    err = (moe_error){0};
    assert_null(cache_ctx(m, NULL, pins, &err));
    print_message("%s\n", err.msg);
    assert_non_null(strstr(err.msg, "experts.pin:2"));
    moe_model_free(m);
}

static void option_errors(void **state) {
    (void)state;
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s run --expert-cache 12X -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--expert-cache expects a size"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run --pin-experts x.pin -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--pin-experts needs --expert-cache"));
    free(out);
    const char *model = moe_test_shared("parity/qwen3moe-mixed.gguf");
    MOE_SKIP_IF_NULL(model);
    snprintf(cmd, sizeof cmd, "%s run %s --expert-cache 1K -n 1", moe_test_bin(), model);
    assert_int_not_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "give it at least 2"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s --expert-cache 1M -n 4 --temp 0 --print-ids",
             moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "expert cache: "));
    free(out);
}

int moe_suite_experts(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(cache_equals_resident), cmocka_unit_test(resident_experts_compute_first),
        cmocka_unit_test(load_without_experts),  cmocka_unit_test(truncated_file_is_an_error),
        cmocka_unit_test(stats_and_pins),        cmocka_unit_test(option_errors),
    };
    return cmocka_run_group_tests_name("experts", tests, NULL, NULL);
}
