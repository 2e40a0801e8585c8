/* x86_linear.h: linear attention's products (quant.h: moe_rows_times_fn, moe_rows_update_fn,
 * moe_delta_row_fn) written once for both vector widths; linear_avx2.c and linear_avx512.c
 * include it after defining
 *   LIN_T, LIN_W          the float vector type and its lanes;
 *   LIN_(op)              the intrinsic of op on it (LIN_(mul_ps) -> _mm512_mul_ps);
 *   LIN_M, LIN_MASK(l)    a lane mask type, and the mask of lane l (none outside 0 .. LIN_W - 1);
 *   LIN_ONE_WHERE(v, m)   v with 1.0 in the lanes of mask m;
 *   LIN_FN(name)          the level's name for a function.
 * The vectors run across the output index, each lane the scalar reference's operations in its
 * order (a product, then an add: no fma), so every width gives the reference's bits. Register
 * blocks: LIN_ROWS rows x LIN_VECS vectors of outputs (16 accumulators), the row's factor
 * broadcast once per LIN_VECS loads. */
#ifndef MOE_QUANT_X86_LINEAR_H
#define MOE_QUANT_X86_LINEAR_H

#include "x86_avx2.h" /* MOE_INLINE, blocks.h */

/* the level's names of this file's functions */
#define LIN_ROWS_BLOCK   LIN_FN(rows_block)
#define LIN_ROWS_TIMES   LIN_FN(rows_times)
#define LIN_UPDATE_BLOCK LIN_FN(update_block)
#define LIN_ROWS_UPDATE  LIN_FN(rows_update)
#define LIN_DELTA_BLOCK  LIN_FN(delta_block)
#define LIN_DELTA_ROW    LIN_FN(delta_row)
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

/* The level's entries. */
MOE_INLINE void LIN_FILL(moe_kernels *k) {
    k->rows_times = LIN_ROWS_TIMES;
    k->rows_update = LIN_ROWS_UPDATE;
    k->delta_row = LIN_DELTA_ROW;
}

#endif
