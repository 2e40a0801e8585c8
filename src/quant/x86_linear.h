/* x86_linear.h: linear attention's products (quant.h: moe_rows_times_fn, moe_rows_update_fn,
 * moe_delta_row_fn), the lightning indexer's scores (moe_index_scores_fn) and the fast path's
 * SwiGLU, SiLU and sigmoid (moe_swiglu_fn, moe_silu_fn), written once for both vector widths;
 * linear_avx2.c and linear_avx512.c include it after defining LIN_T, LIN_W          the float
 * vector type and its lanes; LIN_(op)              the intrinsic of op on it (LIN_(mul_ps) ->
 * _mm512_mul_ps); LIN_M, LIN_MASK(l)    a lane mask type, and the mask of lane l (none outside 0 ..
 * LIN_W - 1); LIN_ONE_WHERE(v, m)   v with 1.0 in the lanes of mask m; LIN_GE(a, b)          the
 * mask of the lanes where a >= b (false for NaN); LIN_BLEND(m, a, b)    b in the lanes of mask m, a
 * in the others; LIN_EXP(x)            moe_attn_exp lane by lane; LIN_FN(name)          the level's
 * name for a function. The vectors run across the output index, each lane the scalar reference's
 * operations in its order (a product, then an add: no fma), so every width gives the reference's
 * bits. Register blocks: LIN_ROWS rows x LIN_VECS vectors of outputs (16 accumulators), the row's
 * factor broadcast once per LIN_VECS loads. */
#ifndef MOE_QUANT_X86_LINEAR_H
#define MOE_QUANT_X86_LINEAR_H

#include <string.h>

#include "x86_avx2.h" /* MOE_INLINE, blocks.h */

/* the level's names of this file's functions */
#define LIN_ROWS_BLOCK   LIN_FN(rows_block)
#define LIN_ROWS_TIMES   LIN_FN(rows_times)
#define LIN_UPDATE_BLOCK LIN_FN(update_block)
#define LIN_ROWS_UPDATE  LIN_FN(rows_update)
#define LIN_DELTA_BLOCK  LIN_FN(delta_block)
#define LIN_DELTA_ROW    LIN_FN(delta_row)
#define LIN_INDEX_BLOCK  LIN_FN(index_block)
#define LIN_INDEX_SCORES LIN_FN(index_scores)
#define LIN_SIGMOID_VEC  LIN_FN(sigmoid_vec)
#define LIN_SWIGLU       LIN_FN(swiglu)
#define LIN_SILU         LIN_FN(silu)
#define LIN_SIGMOID      LIN_FN(sigmoid)
#define LIN_FILL         LIN_FN(fill)

#define LIN_ROWS 4
#define LIN_VECS 4

/* out rows r0 .. r0 + nr - 1, vectors v0 .. v0 + nv - 1 of moe_rows_times (nr <= LIN_ROWS,
 * nv <= LIN_VECS: constants where the loops below call it, so acc stays in registers). */
MOE_INLINE void LIN_ROWS_BLOCK(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                               int64_t os, int nr, int nv, int k) {
    LIN_T acc[LIN_ROWS][LIN_VECS];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = LIN_(setzero_ps)();
    for (int i = 0; i < k; i++) {
        LIN_T bv[LIN_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) bv[v] = LIN_(loadu_ps)(b + i * bs + v * LIN_W);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            const LIN_T x = LIN_(set1_ps)(a[r * as + i]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                acc[r][v] = LIN_(add_ps)(acc[r][v], LIN_(mul_ps)(x, bv[v]));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) LIN_(storeu_ps)(out + r * os + v * LIN_W, acc[r][v]);
}

static void LIN_ROWS_TIMES(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                           int64_t os, int m, int k, int n) {
    const int nvec = n / LIN_W;
    int r = 0;
    for (; r + LIN_ROWS <= m; r += LIN_ROWS) {
        int v = 0;
        for (; v + LIN_VECS <= nvec; v += LIN_VECS)
            LIN_ROWS_BLOCK(a + r * as, as, b + v * LIN_W, bs, out + r * os + v * LIN_W, os,
                           LIN_ROWS, LIN_VECS, k);
        for (; v < nvec; v++)
            LIN_ROWS_BLOCK(a + r * as, as, b + v * LIN_W, bs, out + r * os + v * LIN_W, os,
                           LIN_ROWS, 1, k);
    }
    for (; r < m; r++)
        for (int v = 0; v < nvec; v++)
            LIN_ROWS_BLOCK(a + r * as, as, b + v * LIN_W, bs, out + r * os + v * LIN_W, os, 1, 1,
                           k);
    if (nvec * LIN_W < n) /* the columns past the last whole vector */
        moe_ref_rows_times(a, as, b + nvec * LIN_W, bs, out + nvec * LIN_W, os, m, k,
                           n - nvec * LIN_W);
}

/* Vectors 0 .. nv - 1 of one row of moe_rows_update (nv <= LIN_VECS; y_scale: the row's, or
 * NULL). */
MOE_INLINE void LIN_UPDATE_BLOCK(float *y, const float *y_scale, const float *c, const float *x,
                                 int64_t xs, int n_s, int nv) {
    LIN_T acc[LIN_VECS];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
        acc[v] = LIN_(loadu_ps)(y + v * LIN_W);
        if (y_scale) acc[v] = LIN_(mul_ps)(acc[v], LIN_(set1_ps)(*y_scale));
    }
    for (int s = 0; s < n_s; s++) {
        const LIN_T cs = LIN_(set1_ps)(c[s]);
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[v] = LIN_(add_ps)(acc[v], LIN_(mul_ps)(cs, LIN_(loadu_ps)(x + s * xs + v * LIN_W)));
    }
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) LIN_(storeu_ps)(y + v * LIN_W, acc[v]);
}

static void LIN_ROWS_UPDATE(float *y, int64_t ys, int m, const float *y_scale, const float *c,
                            int64_t cs, const float *x, int64_t xs, int n_s, int n) {
    const int nvec = n / LIN_W;
    for (int r = 0; r < m; r++) {
        float *yr = y + r * ys;
        const float *sr = y_scale ? y_scale + r : NULL, *cr = c + r * cs;
        int v = 0;
        for (; v + LIN_VECS <= nvec; v += LIN_VECS)
            LIN_UPDATE_BLOCK(yr + v * LIN_W, sr, cr, x + v * LIN_W, xs, n_s, LIN_VECS);
        for (; v < nvec; v++) LIN_UPDATE_BLOCK(yr + v * LIN_W, sr, cr, x + v * LIN_W, xs, n_s, 1);
        if (nvec * LIN_W < n) /* the columns past the last whole vector */
            moe_ref_rows_update(yr + nvec * LIN_W, 0, 1, sr, cr, 0, x + nvec * LIN_W, xs, n_s,
                                n - nvec * LIN_W);
    }
}

/* Columns c0 .. c0 + nv x LIN_W - 1 of moe_delta_row (nv <= LIN_VECS), e's column n - 1 set to 1
 * where it falls among them. */
MOE_INLINE void LIN_DELTA_BLOCK(const float *ka, const float *kb, const float *x, int64_t xs,
                                float *e, int64_t es, const float *d, int k, int n, int c0, int nv,
                                float *a, float *b) {
    LIN_T sa[LIN_VECS], sb[LIN_VECS];
    LIN_M last[LIN_VECS];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
        sa[v] = sb[v] = LIN_(setzero_ps)();
        last[v] = LIN_MASK(n - 1 - (c0 + v * LIN_W));
    }
    for (int i = 0; i < k; i++) {
        const LIN_T va = LIN_(set1_ps)(ka[i]), vb = LIN_(set1_ps)(kb[i]);
        const LIN_T di = e ? LIN_(set1_ps)(d[i]) : va;
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) {
            const LIN_T xv = LIN_(loadu_ps)(x + i * xs + c0 + v * LIN_W);
            LIN_T pa = LIN_(mul_ps)(xv, va), pb = LIN_(mul_ps)(xv, vb);
            if (e) {
                float *ep = e + i * es + c0 + v * LIN_W;
                const LIN_T ev = LIN_ONE_WHERE(LIN_(mul_ps)(LIN_(loadu_ps)(ep), di), last[v]);
                LIN_(storeu_ps)(ep, ev);
                pa = LIN_(mul_ps)(pa, ev), pb = LIN_(mul_ps)(pb, ev);
            }
            sa[v] = LIN_(add_ps)(sa[v], pa), sb[v] = LIN_(add_ps)(sb[v], pb);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
        LIN_(storeu_ps)(a + c0 + v * LIN_W, sa[v]);
        LIN_(storeu_ps)(b + c0 + v * LIN_W, sb[v]);
    }
}

static void LIN_DELTA_ROW(const float *ka, const float *kb, const float *x, int64_t xs, float *e,
                          int64_t es, const float *d, int k, int n, float *a, float *b) {
    const int nvec = (n + LIN_W - 1) / LIN_W; /* n rounded up: quant.h lets a level */
    int v = 0;
    for (; v + LIN_VECS <= nvec; v += LIN_VECS)
        LIN_DELTA_BLOCK(ka, kb, x, xs, e, es, d, k, n, v * LIN_W, LIN_VECS, a, b);
    for (; v < nvec; v++) LIN_DELTA_BLOCK(ka, kb, x, xs, e, es, d, k, n, v * LIN_W, 1, a, b);
}

/* ---- The indexer's scores: the keys in the lanes ----
 *
 * A dot in moe_attn_scores_fn's order is 32 chains, chain c the products of values d = c mod 32,
 * folded in a fixed tree. With LIN_W keys in a vector (their values transposed into kt), every
 * lane runs the same chains and the same tree on its own key, so a dot costs a vector product
 * and add per value for LIN_W keys, where one key's 16-lane dot took as many for 16 values plus
 * its fold. A head's query values are broadcast once for LIN_INDEX_VECS vectors of keys, and
 * the keys' scores stay in registers across the heads. Zen 5, one thread, 15000 pools of 128
 * values x 32 heads (GLM-5.3-Flash at 60k tokens of context): 12.6 ns a pool x head through
 * attn_scores and a scalar ReLU loop before. */
#define LIN_INDEX_VECS 2
#define LIN_INDEX_KEYS (LIN_INDEX_VECS * LIN_W) /* keys per pass */

/* Keys (nk <= LIN_INDEX_KEYS of them, key_stride apart) scored into out, the next pass's keys
 * requested when `ahead`; kt holds n x LIN_INDEX_KEYS floats. */
MOE_INLINE void LIN_INDEX_BLOCK(const float *q, const float *w, int n_head, int n,
                                const float *keys, int64_t key_stride, int nk, bool ahead,
                                float *kt, float *out) {
    for (int j = 0; j < LIN_INDEX_KEYS; j++) { /* value d of key j at kt[d][j], missing keys 0 */
        for (int d = 0; d < n; d++)
            kt[d * LIN_INDEX_KEYS + j] = j < nk ? keys[j * key_stride + d] : 0.0f;
        if (ahead) /* the same key of the next pass, into the L2 */
            for (int d = 0; d < n; d += 16)
                _mm_prefetch((const char *)(keys + (j + LIN_INDEX_KEYS) * key_stride + d),
                             _MM_HINT_T1);
    }
    const int whole = n & ~31;
    const LIN_T zero = LIN_(setzero_ps)();
    LIN_T score[LIN_INDEX_VECS];
#pragma GCC unroll 2
    for (int v = 0; v < LIN_INDEX_VECS; v++) score[v] = zero;
    for (int h = 0; h < n_head; h++) {
        const float *qh = q + (int64_t)h * n;
        LIN_T half[4][LIN_INDEX_VECS];
        for (int i = 0; i < 4; i++) {
            LIN_T lane[2][LIN_INDEX_VECS];
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                /* lane l = (chain l + chain l + 16) + (chain l + 8 + chain l + 24) */
                const int l = i + 4 * e, chain[4] = {l, l + 16, l + 8, l + 24};
                LIN_T p[4][LIN_INDEX_VECS];
#pragma GCC unroll 4
                for (int a = 0; a < 4; a++) {
#pragma GCC unroll 2
                    for (int v = 0; v < LIN_INDEX_VECS; v++) p[a][v] = zero;
                    for (int d = chain[a]; d < whole; d += 32) {
                        const LIN_T qd = LIN_(set1_ps)(qh[d]);
#pragma GCC unroll 2
                        for (int v = 0; v < LIN_INDEX_VECS; v++)
                            p[a][v] = LIN_(add_ps)(
                                p[a][v], LIN_(mul_ps)(qd, LIN_(loadu_ps)(kt + d * LIN_INDEX_KEYS +
                                                                         v * LIN_W)));
                    }
                }
#pragma GCC unroll 2
                for (int v = 0; v < LIN_INDEX_VECS; v++)
                    lane[e][v] = LIN_(add_ps)(LIN_(add_ps)(p[0][v], p[1][v]),
                                              LIN_(add_ps)(p[2][v], p[3][v]));
            }
#pragma GCC unroll 2
            for (int v = 0; v < LIN_INDEX_VECS; v++)
                half[i][v] = LIN_(add_ps)(lane[0][v], lane[1][v]);
        }
        const LIN_T wh = LIN_(set1_ps)(w[h]);
#pragma GCC unroll 2
        for (int v = 0; v < LIN_INDEX_VECS; v++) {
            LIN_T sum = LIN_(add_ps)(LIN_(add_ps)(half[0][v], half[1][v]),
                                     LIN_(add_ps)(half[2][v], half[3][v]));
            for (int d = whole; d < n; d++) /* the tail one by one, onto the folded sum */
                sum = LIN_(add_ps)(
                    sum, LIN_(mul_ps)(LIN_(set1_ps)(qh[d]),
                                      LIN_(loadu_ps)(kt + d * LIN_INDEX_KEYS + v * LIN_W)));
            /* max(x, 0) gives 0 for NaN as fmaxf does; a zero's sign never reaches the sum */
            score[v] = LIN_(add_ps)(score[v], LIN_(mul_ps)(wh, LIN_(max_ps)(sum, zero)));
        }
    }
    float all[LIN_INDEX_KEYS];
#pragma GCC unroll 2
    for (int v = 0; v < LIN_INDEX_VECS; v++) LIN_(storeu_ps)(all + v * LIN_W, score[v]);
    memcpy(out, all, sizeof(float) * (size_t)nk);
}

static void LIN_INDEX_SCORES(const float *q, const float *w, int n_head, int n, const float *keys,
                             int64_t key_stride, int64_t n_keys, float *out) {
    if (n > MOE_INDEX_SCORES_MAX_N) { /* not a width any indexer has */
        moe_ref_index_scores(q, w, n_head, n, keys, key_stride, n_keys, out);
        return;
    }
    float kt[MOE_INDEX_SCORES_MAX_N * LIN_INDEX_KEYS];
    for (int64_t p = 0; p < n_keys; p += LIN_INDEX_KEYS) {
        const int nk = n_keys - p < LIN_INDEX_KEYS ? (int)(n_keys - p) : LIN_INDEX_KEYS;
        const bool ahead = n_keys - p >= 2 * LIN_INDEX_KEYS; /* a whole pass after this one */
        LIN_INDEX_BLOCK(q, w, n_head, n, keys + p * key_stride, key_stride, nk, ahead, kt, out + p);
    }
}

/* ---- The fast path's SwiGLU and SiLU: the reference's operations lane by lane ---- */

MOE_INLINE LIN_T LIN_SIGMOID_VEC(LIN_T g) {
    const LIN_T one = LIN_(set1_ps)(1.0f);
    const LIN_T e = LIN_EXP(LIN_(or_ps)(g, LIN_(set1_ps)(-0.0f))), d = LIN_(add_ps)(one, e);
    return LIN_(div_ps)(LIN_BLEND(LIN_GE(g, LIN_(setzero_ps)()), e, one), d);
}

static void LIN_SWIGLU(float *x, const float *gate, int64_t n, float limit) {
    const LIN_T lo = LIN_(set1_ps)(-limit), hi = LIN_(set1_ps)(limit);
    int64_t i = 0;
    for (; i + LIN_W <= n; i += LIN_W) {
        LIN_T g = LIN_(loadu_ps)(gate + i), u = LIN_(loadu_ps)(x + i);
        if (limit > 0) /* a NaN takes the bound, as fminf / fmaxf give it */
            g = LIN_(min_ps)(g, hi), u = LIN_(min_ps)(LIN_(max_ps)(u, lo), hi);
        LIN_(storeu_ps)(x + i, LIN_(mul_ps)(u, LIN_(mul_ps)(g, LIN_SIGMOID_VEC(g))));
    }
    if (i < n) moe_ref_swiglu(x + i, gate + i, n - i, limit);
}

static void LIN_SILU(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + LIN_W <= n; i += LIN_W) {
        const LIN_T g = LIN_(loadu_ps)(x + i);
        LIN_(storeu_ps)(x + i, LIN_(mul_ps)(g, LIN_SIGMOID_VEC(g)));
    }
    if (i < n) moe_ref_silu(x + i, n - i);
}

static void LIN_SIGMOID(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + LIN_W <= n; i += LIN_W)
        LIN_(storeu_ps)(x + i, LIN_SIGMOID_VEC(LIN_(loadu_ps)(x + i)));
    if (i < n) moe_ref_sigmoid(x + i, n - i);
}

/* The level's entries. */
MOE_INLINE void LIN_FILL(moe_kernels *k) {
    k->rows_times = LIN_ROWS_TIMES;
    k->rows_update = LIN_ROWS_UPDATE;
    k->delta_row = LIN_DELTA_ROW;
    k->index_scores = LIN_INDEX_SCORES;
    k->swiglu = LIN_SWIGLU;
    k->silu = LIN_SILU;
    k->sigmoid = LIN_SIGMOID;
}

#endif
