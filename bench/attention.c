/* bench/attention.c: prefill and decode attention at depth, one thread -- the per-row path
 * (moe_attention_row: ggml's order, what MOE_EXACT=1 runs) against the tiled one
 * (moe_attention_tiled, the default), on Qwen3-30B-A3B's shape (32 query heads over 4 KV heads
 * of 128 values).
 *
 * The cache holds --depth + --rows positions of random values in --kv-type (f16, q8_0 or f32)
 * for each of --layers layers (default 1), laid out as the engine's ([layer][kv head][position],
 * on huge pages; --layout position: [layer][position][kv head], the engine's before, whose rows
 * put one head's keys a row apart); a prefill of --rows query rows sits at positions
 * depth..depth+rows-1 (blocks of MOE_ATTN_BLOCK_ROWS for the tiled path), a decode is one row at
 * `depth`, and a pass runs it over every layer's cache in turn. Figures are the median of --runs
 * passes (default 3) in thread CPU time (what a loaded machine's wall clock would blur) and in ns
 * per (query row x head x key x layer); --tiled-only leaves the per-row path out (nan). The trap:
 * one layer's cache (32 MiB at depth 16384 in f16) may stay in the L3 from pass to pass where the
 * engine's, read once a token between the weights, comes from DRAM: --layers 6 (the engine's bench
 * model) keeps the bytes out of cache. This is attention only; `moe bench --depth` gives the whole
 * model's rate. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/ops/ops.h"

enum { N_HEAD = 32, N_HEAD_KV = 4, HEAD_DIM = 128 };

static double thread_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct cache {
    const moe_attn_shape *s;
    const uint8_t *k, *v; /* [layers][N_HEAD_KV][n_pos][HEAD_DIM] in the KV type, or by --layout */
    int64_t stride, head, layer_bytes; /* bytes between positions, kv heads, layers */
    int layers;
    const float *q;
    float *out, *scores, *scratch; /* scratch: the tiled path's */
} cache;

/* rows query rows from position `first_pos` over one layer's cache, one path */
static void run_layer(const cache *c, const uint8_t *k, const uint8_t *v, int64_t first_pos,
                      int rows, bool tiled) {
    const int64_t q_w = N_HEAD * HEAD_DIM;
    const moe_attn_kv kv = {k, v, c->stride, c->stride, c->head, c->head};
    if (!tiled)
        for (int r = 0; r < rows; r++)
            moe_attention_row(c->s, c->q + r * q_w, &kv, first_pos + r + 1, c->out + r * q_w,
                              c->scores);
    for (int r0 = 0; tiled && r0 < rows; r0 += MOE_ATTN_BLOCK_ROWS) {
        int64_t first[MOE_ATTN_BLOCK_ROWS], last[MOE_ATTN_BLOCK_ROWS];
        const int n = rows - r0 < MOE_ATTN_BLOCK_ROWS ? rows - r0 : MOE_ATTN_BLOCK_ROWS;
        for (int r = 0; r < n; r++) first[r] = 0, last[r] = first_pos + r0 + r;
        const moe_attn_block b = {.q = c->q + r0 * q_w,
                                  .out = c->out + r0 * q_w,
                                  .first = first,
                                  .last = last,
                                  .n_rows = n,
                                  .kv = kv,
                                  .scratch = c->scratch};
        const int group = N_HEAD / N_HEAD_KV;
        for (int hk = 0; hk < N_HEAD_KV; hk++)
            moe_attention_tiled(c->s, &b, hk * group, (hk + 1) * group);
    }
}

/* The same over every layer in turn; seconds of thread CPU time */
static double run(const cache *c, int64_t first_pos, int rows, bool tiled) {
    const double t0 = thread_seconds();
    for (int layer = 0; layer < c->layers; layer++)
        run_layer(c, c->k + layer * c->layer_bytes, c->v + layer * c->layer_bytes, first_pos, rows,
                  tiled);
    return thread_seconds() - t0;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int64_t depth = 8192;
    int rows = 64, runs = 3, layers = 1;
    moe_type kv_type = MOE_TYPE_F16;
    bool tiled_only = false; /* the per-row path takes seconds at depth: skip it while tuning */
    bool by_position = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--depth") && v)
            depth = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && v)
            rows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && v)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && v)
            layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tiled-only"))
            tiled_only = true;
        else if (!strcmp(argv[i], "--layout") && v &&
                 (!strcmp(v, "head") || !strcmp(v, "position")))
            by_position = !strcmp(argv[++i], "position");
        else if (!strcmp(argv[i], "--kv-type") && v && moe_type_from_name(argv[++i], &kv_type) &&
                 (kv_type == MOE_TYPE_F16 || kv_type == MOE_TYPE_Q8_0 || kv_type == MOE_TYPE_F32))
            continue;
        else {
            fprintf(stderr,
                    "usage: %s [--depth N] [--rows N] [--runs N] [--layers N] "
                    "[--kv-type f16|q8_0|f32] [--tiled-only] [--layout head|position]\n",
                    argv[0]);
            return 2;
        }
    }
    if (depth < 0 || rows < 1 || runs < 1 || runs > 64 || layers < 1 || layers > 256) {
        fprintf(stderr, "attention bench: depth >= 0, rows >= 1, runs 1..64, layers 1..256\n");
        return 2;
    }
    const int64_t n_pos = depth + rows, kw = N_HEAD_KV * HEAD_DIM;
    const int64_t head_bytes = (int64_t)moe_type_row_bytes(kv_type, HEAD_DIM);
    const int64_t stride = by_position ? N_HEAD_KV * head_bytes : head_bytes;
    const int64_t head = by_position ? head_bytes : n_pos * head_bytes;
    const int64_t layer_bytes = N_HEAD_KV * head_bytes * n_pos;
    size_t k_size, v_size; /* on huge pages, as the engine's cache (a 4 KiB page every 4 keys
                            * would add a TLB miss the engine does not have) */
    uint8_t *k = moe_huge_alloc((size_t)(layer_bytes * layers), &k_size);
    uint8_t *v = moe_huge_alloc((size_t)(layer_bytes * layers), &v_size);
    if (!k || !v) {
        fprintf(stderr, "attention bench: no memory for %d layers' cache\n", layers);
        return 1;
    }
    float *row = moe_xmalloc(sizeof(float) * kw);
    float *q = moe_xmalloc(sizeof(float) * (size_t)rows * N_HEAD * HEAD_DIM);
    float *out = moe_xmalloc(sizeof(float) * (size_t)rows * N_HEAD * HEAD_DIM);
    float *scores = moe_xmalloc(sizeof(float) * (size_t)n_pos);
    float *scratch = moe_xmalloc(sizeof(float) * moe_attention_tiled_scratch(HEAD_DIM));
    uint64_t rng = 1;
    const moe_type_traits *t = moe_type_traits_get(kv_type);
    for (int64_t p = 0; p < n_pos; p++)
        for (int kv = 0; kv < 2; kv++) {
            for (int64_t i = 0; i < kw; i++) row[i] = (float)moe_rng_gaussian(&rng);
            for (int h = 0; h < N_HEAD_KV; h++)
                t->from_float(row + h * HEAD_DIM, (kv ? v : k) + h * head + p * stride, HEAD_DIM);
        }
    for (int layer = 1; layer < layers; layer++) { /* the same values, other bytes to read */
        memcpy(k + layer * layer_bytes, k, (size_t)layer_bytes);
        memcpy(v + layer * layer_bytes, v, (size_t)layer_bytes);
    }
    for (int64_t i = 0; i < (int64_t)rows * N_HEAD * HEAD_DIM; i++)
        q[i] = (float)moe_rng_gaussian(&rng);
    const moe_attn_shape s = {.n_head = N_HEAD,
                              .n_head_kv = N_HEAD_KV,
                              .head_dim_k = HEAD_DIM,
                              .head_dim_v = HEAD_DIM,
                              .scale = 1.0f / sqrtf((float)HEAD_DIM),
                              .kv_type = kv_type};
    const cache c = {&s, k, v, stride, head, layer_bytes, layers, q, out, scores, scratch};
    printf("attention, one thread, %s KV by %s, %d heads over %d, head %d, depth %lld, %d layer%s  "
           "[%s]\n",
           moe_type_name(kv_type), by_position ? "position" : "head", N_HEAD, N_HEAD_KV, HEAD_DIM,
           (long long)depth, layers, layers > 1 ? "s" : "", moe_kernels_get()->name);
    printf("%-22s %12s %12s %14s\n", "test", "per-row ms", "tiled ms", "tiled speed-up");
    for (int test = 0; test < 2; test++) { /* prefill of `rows` rows, then a decode row */
        const int n = test ? 1 : rows;
        double sec[2][64];
        for (int r = 0; r < runs; r++)
            for (int tiled = tiled_only; tiled < 2; tiled++)
                sec[tiled][r] = run(&c, depth, n, tiled);
        if (tiled_only)
            for (int r = 0; r < runs; r++) sec[0][r] = NAN;
        qsort(sec[0], (size_t)runs, sizeof(double), cmp_double);
        qsort(sec[1], (size_t)runs, sizeof(double), cmp_double);
        const double a = sec[0][runs / 2], b = sec[1][runs / 2];
        const double keys = (double)n * N_HEAD * ((double)depth + (n + 1) / 2.0) * layers;
        char label[64];
        if (test)
            snprintf(label, sizeof label, "tg1@d%lld", (long long)depth);
        else
            snprintf(label, sizeof label, "pp%d@d%lld", n, (long long)depth);
        printf("%-22s %12.2f %12.2f %13.2fx   (%.2f vs %.2f ns per row x head x key)\n", label,
               1e3 * a, 1e3 * b, a / b, 1e9 * a / keys, 1e9 * b / keys);
    }
    moe_huge_free(k, k_size), moe_huge_free(v, v_size);
    free(row), free(q), free(out), free(scores), free(scratch);
    return 0;
}
