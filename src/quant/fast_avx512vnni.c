/* fast_avx512vnni.c: the fast path's kernels at the avx512vnni level (quant.h, "The two paths").
 *
 * Weight rows go 16 at a time into the lanes of a register: each weight block of the 16 rows is
 * decoded once into an L1 tile of signed bytes, tile[g] holding values 4g .. 4g + 3 of row v in
 * int32 lane v, and every activation row meets the tile through one vpdpbusd per 4 values with
 * its 4 activation bytes broadcast (16 rows x 4 values = 64 multiply-adds an instruction). The
 * activation bytes are made unsigned by adding 128, and 128 x (the row's sum of weights), worked
 * out once per tile, comes off again: the int32 block sums are exact. Then, lane for lane, one
 * multiply-add per block: the scalar reference's order (ref_fast.c), so a dot gives the same bits
 * alone, in a batch, at any tile width. Under FAST_TILE_MIN_ROWS activation rows the codebook
 * types skip the tile (the lanes section) with the same bits. The trap: an activation byte of -128
 * would overflow the unsigned bias; the Q8 activation quantizers clamp to +-127. */
#define MOE_AVX512_VNNI 1
#include <math.h>

#include "x86_avx512_iq.h" /* the codebook decodes (VBMI) */

#if !(defined(__AVX512VNNI__) && defined(__AVX512VBMI__))
#error "fast_avx512vnni.c needs the avx512vnni flags (Makefile)"
#endif

#define FAST_CHUNK    8  /* 32-value blocks decoded per pass (Q8_0: 5 KiB touched) */
#define FAST_IQ_CHUNK 2  /* super-blocks decoded per pass (10 KiB) */
#define FAST_GROUP    64 /* activation rows per decode of a chunk */

/* One block of 16 weight rows, ready for the multiply. Q8_0 fills tile[0 .. 7] and no scales
 * (the rest is never touched, so costs no cache). */
typedef struct {
    __m512i tile[64];  /* lane v of tile[g]: values 4g .. 4g + 3 of row v, int8 with signs */
    __m512i scale[16]; /* lane v of scale[j]: row v's integer scale of values 16j .. 16j + 15 */
    __m512i bias;      /* 128 x sum_j scale[j] x (row v's values in sub-block j, summed) */
    __m512 d;          /* row v's block scale */
} fast_tile;

/* What a tile kernel needs of its type: the codebook types' decode (NULL for Q8_0), the block
 * size, the power of two the block scale is multiplied by after the activations'. */
typedef struct {
    z_iqb_fn regs;
    size_t block_bytes;
    float mult;
} fast_type;

/* Block i of n_w <= 16 rows ws bytes apart into a tile (rows past n_w repeat row 0). */
typedef void (*fast_decode_fn)(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile);
/* R activation rows (xs bytes apart, block c0 on) against nc tiles; the rows' accumulators in
 * and out through accbuf. */
typedef void (*fast_rows_fn)(int R, fast_type t, const void *tiles, int64_t nc, const uint8_t *x,
                             size_t xs, int64_t c0, __m512 *accbuf);

/* A tile kernel: FAST_GROUP activation rows at a time; per chunk of blocks, each block of the 16
 * rows decoded once into `tiles`, then every group of rows run over the chunk. */
MOE_INLINE void fast_drive(fast_type t, fast_decode_fn decode, fast_rows_fn rows, void *tiles,
                           size_t tile_bytes, int64_t chunk, const void *w, size_t ws, int n_w,
                           const void *x, size_t xs, int64_t n_rows, int64_t nb, float *out,
                           int64_t os) {
    const __mmask16 lanes = (__mmask16)((1u << n_w) - 1);
#define FAST_STEP(R, unused)                                                                       \
    rows(R, t, tiles, nc, (const uint8_t *)x + (size_t)(g0 + r) * xs, xs, c0, accbuf + r)
    MOE_TILE_LOOP(__m512, _mm512_setzero_ps, FAST_GROUP, chunk, n_rows, nb,
                  decode(t, w, ws, n_w, c0 + j, (uint8_t *)tiles + (size_t)j * tile_bytes),
                  FAST_STEP, _mm512_mask_storeu_ps(out + (g0 + r) * os, lanes, accbuf[r]));
#undef FAST_STEP
}

/* The multiply of both kinds (regs NULL: Q8_0 against Q8_0, 8 groups of 4 and no scales;
 * else a super-block against Q8_K, 64 groups, a scale per 16 values): each activation row's
 * bytes made unsigned (+128) into xb, then per sub-block of 4 groups one vpdpbusd per group with
 * its 4 bytes broadcast, times the rows' scales; the bias off, then one fma per block. */
MOE_INLINE void fast_rows(int R, fast_type type, const void *tile_buf, int64_t nc, const uint8_t *x,
                          size_t xs, int64_t c0, __m512 *accbuf) {
    const fast_tile *tiles = tile_buf;
    const bool q8_0 = type.regs == NULL;
    const int groups = q8_0 ? MOE_QK32 / 4 : MOE_QK_K / 4;
    uint32_t xb[MOE_DOT_ROWS][MOE_QK_K / 4] __attribute__((aligned(64)));
    __m512 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = accbuf[r];
    for (int64_t j = 0; j < nc; j++) {
        const fast_tile *t = &tiles[j];
        __m512 dx[MOE_DOT_ROWS];
        __m512i sum[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *xr = x + (size_t)r * xs;
            if (q8_0) {
                const moe_block_q8_0 *y = (const moe_block_q8_0 *)xr + c0 + j;
                _mm256_store_si256(
                    (__m256i *)xb[r],
                    _mm256_xor_si256(avx2_load(y->qs), _mm256_set1_epi8((char)0x80)));
                dx[r] = _mm512_set1_ps(avx2_fp16(y->d));
            } else {
                const moe_block_q8_k *y = (const moe_block_q8_k *)xr + c0 + j;
                for (int k = 0; k < 4; k++)
                    _mm512_store_si512(
                        xb[r] + 16 * k,
                        _mm512_xor_si512(z_load(y->qs + 64 * k), _mm512_set1_epi8((char)0x80)));
                dx[r] = _mm512_set1_ps(y->d);
            }
            sum[r] = _mm512_setzero_si512();
        }
        for (int s = 0; s < groups / 4; s++) {
            __m512i part[MOE_DOT_ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) part[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i tg = _mm512_load_si512(&t->tile[4 * s + c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    part[r] =
                        _mm512_dpbusd_epi32(part[r], _mm512_set1_epi32((int)xb[r][4 * s + c]), tg);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                sum[r] = _mm512_add_epi32(sum[r], q8_0 ? part[r]
                                                       : _mm512_mullo_epi32(part[r], t->scale[s]));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_mul_ps(t->d, dx[r]), _mm512_set1_ps(type.mult)),
                _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], t->bias)), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) accbuf[r] = acc[r];
}

/* ==== Q8_0 ==== */

/* 16 rows of 8 dwords (two to a register: row j in the low half, j + 8 in the high) to 8
 * registers of 16 rows: an 8 x 8 transpose in each half, then the halves' 128-bit lanes put in
 * row order. */
MOE_INLINE void fast_transpose16x8(const __m512i z[8], __m512i out[8]) {
    __m512i t[8], u[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm512_unpacklo_epi32(z[2 * p], z[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi32(z[2 * p], z[2 * p + 1]);
    }
    for (int q = 0; q < 2; q++) { /* rows 4q .. 4q + 3 of each half */
        u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    /* u[c] (c < 4): 128-bit lanes [rows 0-3 dword c | rows 0-3 dword c + 4 | rows 8-11 dword c |
     * rows 8-11 dword c + 4]; u[c + 4] the same for rows 4-7 and 12-15 */
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int c = 0; c < 4; c++) {
        out[c] = _mm512_permutex2var_epi64(u[c], lo, u[c + 4]);
        out[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[c + 4]);
    }
}

MOE_INLINE void fast_tile_q8_0(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile) {
    (void)t;
    fast_tile *o = tile;
    const __m512i row_at =
        _mm512_mullo_epi32(_mm512_maskz_mov_epi32((__mmask16)((1u << n_w) - 1),
                                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                    10, 11, 12, 13, 14, 15)),
                           _mm512_set1_epi32((int)ws));
    __m512i z[8];
    for (int j = 0; j < 8; j++) {
        const moe_block_q8_0 *a = (const moe_block_q8_0 *)(w + (j < n_w ? j : 0) * ws) + i;
        const moe_block_q8_0 *b = (const moe_block_q8_0 *)(w + (j + 8 < n_w ? j + 8 : 0) * ws) + i;
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(avx2_load(a->qs)), avx2_load(b->qs), 1);
    }
    fast_transpose16x8(z, o->tile);
    __m512i sum = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), o->tile[g]);
    o->bias = _mm512_slli_epi32(sum, 7);
    /* the 16 fp16 scales: a dword gathered at each row's block (d and two qs bytes) */
    const __m512i d32 = _mm512_i32gather_epi32(row_at, w + (size_t)i * sizeof(moe_block_q8_0), 1);
    o->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d32));
}

static void fast_tile_rows_q8_0(const void *w, size_t ws, int n_w, const void *x, size_t xs,
                                int64_t n_rows, int64_t n, float *out, int64_t os) {
    fast_tile tiles[FAST_CHUNK];
    fast_drive((fast_type){NULL, sizeof(moe_block_q8_0), 1.0f}, fast_tile_q8_0, fast_rows, tiles,
               sizeof tiles[0], FAST_CHUNK, w, ws, n_w, x, xs, n_rows, n / MOE_QK32, out, os);
}

/* ==== Codebook types (and IQ4_XS): 256-value super-blocks against Q8_K ====
 *
 * Each row's block is decoded to registers by its type's decode (x86_avx512_iq.h: magnitudes,
 * sign words, sixteen integer scales), signed, and the 16 rows' values transposed into the tile:
 * tile[g] lane v = values 4g .. 4g + 3 of row v. Per sub-block of 16 values (tiles 4j .. 4j + 3)
 * an activation row's int32 sums are multiplied by the rows' scales (vpmulld) and summed: the
 * mold's sum_s scale[s] sum q x, exactly (blocks.h). */

/* 16 registers of 16 dwords (row r in r[r]) transposed in place: r[c] lane v = old r[v] lane c. */
MOE_INLINE void fast_transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int p = 0; p < 8; p++) {
        t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) { /* u[4q + m] lane L: rows 4q .. 4q + 3 of column 4L + m */
        u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i lo01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
        const __m512i hi01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee);
        const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);
    }
}

MOE_INLINE void fast_tile_iq(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                             void *tile) {
    fast_tile *o = tile;
    __m512i stage[4][16], sc[16];
    float d[16];
    for (int v = 0; v < 16; v++) {
        z_iqb b;
        t.regs(w + (v < n_w ? v : 0) * ws + (size_t)i * t.block_bytes, &b);
        for (int k = 0; k < 4; k++) stage[k][v] = z_apply_signs(b.g[k], _cvtu64_mask64(b.neg[k]));
        sc[v] = _mm512_cvtepi16_epi32(b.sc);
        d[v] = b.d;
    }
    for (int k = 0; k < 4; k++) {
        fast_transpose16x16(stage[k]);
        for (int c = 0; c < 16; c++) o->tile[16 * k + c] = stage[k][c];
    }
    fast_transpose16x16(sc);
    __m512i bias = _mm512_setzero_si512();
    for (int j = 0; j < 16; j++) {
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++)
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), o->tile[4 * j + c]);
        o->scale[j] = sc[j];
        bias = _mm512_add_epi32(bias, _mm512_mullo_epi32(sum, sc[j]));
    }
    o->bias = _mm512_slli_epi32(bias, 7);
    o->d = _mm512_loadu_ps(d);
}

/* ---- Few activation rows (decode, a small expert): no tile ----
 *
 * Under FAST_TILE_MIN_ROWS rows the tile's transposes cost more than they save, so each weight
 * row's block is multiplied where the decode leaves it, values in the lanes (the exact path's
 * multiply: magnitudes x activations with the signs, pairs summed, times the scales), and the
 * 16 weight rows' int32 lanes are summed at once by a transposing tree into lane v of one
 * register: the exact block sums the tile gets, met by the same fma, so the tile's bits. */
#define FAST_TILE_MIN_ROWS 8

/* s[v] summed over its lanes into lane v (integer adds: exact in any order). */
MOE_INLINE __m512i fast_sum16x16(const __m512i s[16]) {
    __m512i t[8], u[4];
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) /* 128-bit lane L: s[2p], s[2p + 1], s[2p], s[2p + 1] */
        t[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * p], s[2 * p + 1]),
                                _mm512_unpackhi_epi32(s[2 * p], s[2 * p + 1]));
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) /* 128-bit lane L: L's part of s[4q .. 4q + 3] */
        u[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * q], t[2 * q + 1]),
                                _mm512_unpackhi_epi64(t[2 * q], t[2 * q + 1]));
    const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44),
                                       _mm512_shuffle_i32x4(u[0], u[1], 0xee));
    const __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44),
                                       _mm512_shuffle_i32x4(u[2], u[3], 0xee));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

MOE_INLINE void fast_lanes_iq(int R, fast_type t, const uint8_t *w, size_t ws, int n_w,
                              const uint8_t *x, size_t xs, int64_t nb, float *out, int64_t os) {
    __m512 acc[FAST_TILE_MIN_ROWS];
    __m512i part[FAST_TILE_MIN_ROWS][16];
    float d[16] __attribute__((aligned(64))) = {0};
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        for (int v = n_w; v < 16; v++) part[r][v] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < nb; i++) {
        for (int v = 0; v < n_w; v++) {
            z_iqb b;
            t.regs(w + v * ws + (size_t)i * t.block_bytes, &b);
            const __m512i sc = _mm512_zextsi256_si512(b.sc);
            __m512i scale[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) scale[k] = z_scales(sc, z_idx4(4 * k));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
                __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const __m512i xk =
                        z_apply_signs(z_load(y->qs + 64 * k), _cvtu64_mask64(b.neg[k]));
                    sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(b.g[k], xk), scale[k]);
                }
                part[r][v] = sum;
            }
            d[v] = b.d;
        }
        const __m512 dw = _mm512_load_ps(d);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
            acc[r] = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y->d)), _mm512_set1_ps(t.mult)),
                _mm512_cvtepi32_ps(fast_sum16x16(part[r])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(out + r * os, (__mmask16)((1u << n_w) - 1), acc[r]);
}

/* The kernels of a codebook type: under FAST_TILE_MIN_ROWS rows a function per row count (its
 * loops unrolled, nothing kept across the others), else the tile. */
#define FAST_LANES_FN(t, regs, mult, R)                                                            \
    static __attribute__((noinline)) void fast_lanes_##t##_##R(                                    \
        const void *w, size_t ws, int n_w, const void *x, size_t xs, int64_t n, float *out,        \
        int64_t os) {                                                                              \
        fast_lanes_iq(R, (fast_type){regs, sizeof(moe_block_##t), mult}, w, ws, n_w, x, xs,        \
                      n / MOE_QK_K, out, os);                                                      \
    }
#define FAST_LANES_CASE(t, R)                                                                      \
    case R:                                                                                        \
        fast_lanes_##t##_##R(w, ws, n_w, x, xs, n, out, os);                                       \
        return;
#define FAST_IQ_KERNELS(t, regs, mult)                                                             \
    FAST_LANES_FN(t, regs, mult, 1)                                                                \
    FAST_LANES_FN(t, regs, mult, 2)                                                                \
    FAST_LANES_FN(t, regs, mult, 3)                                                                \
    FAST_LANES_FN(t, regs, mult, 4)                                                                \
    FAST_LANES_FN(t, regs, mult, 5)                                                                \
    FAST_LANES_FN(t, regs, mult, 6)                                                                \
    FAST_LANES_FN(t, regs, mult, 7)                                                                \
    static void fast_tile_rows_##t(const void *w, size_t ws, int n_w, const void *x, size_t xs,    \
                                   int64_t n_rows, int64_t n, float *out, int64_t os) {            \
        switch (n_rows) {                                                                          \
            FAST_LANES_CASE(t, 1)                                                                  \
            FAST_LANES_CASE(t, 2)                                                                  \
            FAST_LANES_CASE(t, 3)                                                                  \
            FAST_LANES_CASE(t, 4)                                                                  \
            FAST_LANES_CASE(t, 5)                                                                  \
            FAST_LANES_CASE(t, 6)                                                                  \
            FAST_LANES_CASE(t, 7)                                                                  \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
        fast_tile tiles[FAST_IQ_CHUNK];                                                            \
        fast_drive((fast_type){regs, sizeof(moe_block_##t), mult}, fast_tile_iq, fast_rows, tiles, \
                   sizeof tiles[0], FAST_IQ_CHUNK, w, ws, n_w, x, xs, n_rows, n / MOE_QK_K, out,   \
                   os);                                                                            \
    }                                                                                              \
    static float fast_dot_##t(const void *w, const void *x, int64_t n) {                           \
        float out;                                                                                 \
        fast_lanes_##t##_1(w, 0, 1, x, 0, n, &out, 1);                                             \
        return out;                                                                                \
    }
FAST_IQ_KERNELS(iq2_s, z_iqb_iq2_s, 0.125f)
FAST_IQ_KERNELS(iq3_s, z_iqb_iq3_s, 1.0f)
FAST_IQ_KERNELS(iq2_xxs, z_iqb_iq2_xxs, 0.125f)
FAST_IQ_KERNELS(iq2_xs, z_iqb_iq2_xs, 0.125f)
FAST_IQ_KERNELS(iq3_xxs, z_iqb_iq3_xxs, 0.25f)
FAST_IQ_KERNELS(iq4_xs, z_iqb_iq4_xs, 1.0f)
FAST_IQ_KERNELS(iq1_s, z_iqb_iq1_s, 0.125f)
FAST_IQ_KERNELS(iq1_m, z_iqb_iq1_m, 0.125f)

/* ==== The table ==== */

static float fast_dot_q8_0(const void *w, const void *x, int64_t n) {
    float out;
    fast_tile_rows_q8_0(w, 0, 1, x, 0, 1, n, &out, 1);
    return out;
}

void moe_kernels_fill_fast_avx512vnni(moe_kernels *k) {
    z_iq_tables_fill();
#define FAST_SET(T, t)                                                                             \
    moe_kernels_set_fast_dot(k->types, MOE_TYPE_##T, fast_dot_##t, fast_tile_rows_##t,             \
                             MOE_ISA_AVX512VNNI)
    FAST_SET(Q8_0, q8_0);
    FAST_SET(IQ2_S, iq2_s);
    FAST_SET(IQ3_S, iq3_s);
    FAST_SET(IQ2_XXS, iq2_xxs);
    FAST_SET(IQ2_XS, iq2_xs);
    FAST_SET(IQ3_XXS, iq3_xxs);
    FAST_SET(IQ4_XS, iq4_xs);
    FAST_SET(IQ1_S, iq1_s);
    FAST_SET(IQ1_M, iq1_m);
#undef FAST_SET
}
