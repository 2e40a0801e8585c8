/* fast_avx2.c: the fast path's AVX2 kernels (quant.h, "The two paths"), written once and
 * compiled twice (Makefile): as fast_avx2.o for the avx2 fast table (MOE_AVX_VNNI=0: int8
 * products with maddubs + madd) and as avxvnni/fast_avx2.o for the avxvnni one (MOE_AVX_VNNI=1:
 * the int8 tile's multiplies on the VEX vpdpbusd of AVX-VNNI; the lanes, where it measured no
 * faster, are the same instructions in both). Each build exports its own fill function;
 * everything else is static. Both builds form the same exact integer block sums and meet the
 * scales in the same float order, so avxvnni's logits are avx2's bit for bit; vpdpbusd does not
 * saturate, so at avxvnni the int8 tile also takes IQ4_XS (|v| <= 127) and the 32-value types
 * (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4). The K quants (Q4_K, Q5_K, Q6_K) reuse x86_avx2.h's exact
 * decodes and block sums in the lanes, and go into the tile as chunks. The trap: maddubs
 * saturates where vpdpbusd does not, so whatever the avx2 build multiplies must keep the bound of
 * x86_avx2.h (u x 127 x 2 < 32768), or the two builds part. */
#include "x86_avx2_iq.h"

#ifndef MOE_AVX_VNNI
#error "build fast_avx2.c with -DMOE_AVX_VNNI=0 or 1 (the Makefile does)"
#elif MOE_AVX_VNNI && !defined(__AVXVNNI__)
#error "MOE_AVX_VNNI=1 needs the avxvnni flags (-mavxvnni)"
#endif

/* ==== The two builds: the int8 multiply-accumulates ====
 *
 * A sub-block's scaled sum goes begin / step per 4 values / end: at avx2 each step is maddubs
 * (pairs) then madd by the int16 scale pair (fast_scale: the scale in both halves of a dword),
 * straight into the sum; at avxvnni the steps' vpdpbusd sum the sub-block's products unscaled
 * in int32 (no int16 stage to saturate), and the end multiplies them by the int32 scale once. */

#if MOE_AVX_VNNI
#define FAST_LEVEL MOE_ISA_AVXVNNI
#define FAST_FILL  moe_kernels_fill_fast_avxvnni
/* A sub-block scale (8 int16, one per weight row) as the steps want it: int32. */
MOE_INLINE __m256i fast_scale(__m128i s16) {
    return _mm256_cvtepi16_epi32(s16);
}
MOE_INLINE __m256i fast_sub_begin(__m256i sum) {
    (void)sum;
    return _mm256_setzero_si256();
}
MOE_INLINE __m256i fast_sub_step(__m256i part, __m256i u, __m256i s, __m256i scale) {
    (void)scale;
    return _mm256_dpbusd_avx_epi32(part, u, s);
}
MOE_INLINE __m256i fast_sub_end(__m256i sum, __m256i part, __m256i scale) {
    return _mm256_add_epi32(sum, _mm256_mullo_epi32(part, scale));
}
#else
#define FAST_LEVEL MOE_ISA_AVX2
#define FAST_FILL  moe_kernels_fill_fast_avx2
/* the int16 scale in both halves of each dword (zero-extended, so its bits, either sign) */
MOE_INLINE __m256i fast_scale(__m128i s16) {
    const __m256i s = _mm256_cvtepu16_epi32(s16);
    return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
}
MOE_INLINE __m256i fast_sub_begin(__m256i sum) {
    return sum;
}
MOE_INLINE __m256i fast_sub_step(__m256i part, __m256i u, __m256i s, __m256i scale) {
    return _mm256_add_epi32(part, _mm256_madd_epi16(avx2_mul_u8_i8(u, s), scale));
}
MOE_INLINE __m256i fast_sub_end(__m256i sum, __m256i part, __m256i scale) {
    (void)sum, (void)scale;
    return part;
}
#endif

/* ==== The lanes ====
 *
 * The same decodes and integer block sums as the exact kernels above, in another float order:
 * the weight rows of a tile go 8 at a time (a register's lanes), and for each block the 8
 * rows' int32 lanes are summed by one transposing tree into lane v of a register, which meets
 * the block's scales in one vector fma per activation row: acc = fma(d_w d_x mult, sum, acc),
 * blocks in order, the scalar reference's bits (ref_fast.c) at any tile width and row count;
 * Q4_K and Q5_K's mins likewise, through a second fma per block (fast_block_min). At avx2,
 * IQ4_XS and the 32-value types stay in the lanes at every row count: a tile's biased
 * activations against Q8_0's, IQ4_NL's or IQ4_XS's weights would saturate maddubs. */

/* The weight blocks are read a block of each of the 8 rows at a time, 8 streams a row apart:
 * each row's block FAST_LANES_AHEAD blocks on is requested as a block is decoded (as
 * fast_avx512vnni.c's lanes do). */
#define FAST_LANES_AHEAD 4

/* The n bytes at p requested, a cache line at a time. */
MOE_INLINE void fast_prefetch(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* s[v] summed over its lanes into lane v (integer adds: exact in any order). */
MOE_INLINE __m256i fast_sum8x8(const __m256i s[8]) {
    const __m256i a =
        _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b =
        _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    /* a: rows 0..3 of the low 128 bits, then of the high; b: rows 4..7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* acc + (d_w d_x mult) x sum: a block's one float step, the same order on every path. */
MOE_INLINE __m256 fast_block_fma(__m256 dw, float dx, float mult, __m256i sum, __m256 acc) {
    return _mm256_fmadd_ps(
        _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_set1_ps(mult)),
        _mm256_cvtepi32_ps(sum), acc);
}
/* The lanes of the first n_w <= 8 weight rows, for the masked stores. */
MOE_INLINE __m256i fast_lane_mask(int n_w) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n_w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* acc - (dmin_w d_x) x msum in one rounding: the min term of Q4_K / Q5_K, after fast_block_fma. */
MOE_INLINE __m256 fast_block_min(__m256 dmin, float dx, __m256i msum, __m256 acc) {
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(msum), acc);
}

/* Eight int16 as eight dwords, each twice (against a pair of int16 in madd). */
MOE_INLINE __m256i fast_pair16(__m128i s16) {
    const __m256i s = _mm256_cvtepu16_epi32(s16);
    return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
}

/* A type's block sums for R activation rows (block i of each, rows xs bytes apart): sumi[r]
 * (zero on entry) gets the 8 int32 lanes of row r, *dx[r] its activation scale; returns d_w.
 * The types with mins (Q4_K, Q5_K) also give msumi[r] (the mins against row r's bsums, 8 lanes)
 * and *dmin. */
typedef float (*fast_sums_fn)(int R, const uint8_t *w_block, const uint8_t *x, size_t xs, int64_t i,
                              __m256i *sumi, __m256i *msumi, float *dmin, float *dx);

/* The 32-value types against Q8_0 (x86_avx2.h's decodes: signed values, |v| <= 127). */
MOE_INLINE float fast_sums_q32(int R, q32_decode_fn decode, const uint8_t *w_block,
                               const uint8_t *x, size_t xs, int64_t i, __m256i *sumi, float *dx) {
    float d, m;
    const __m256i q = decode(w_block, &d, &m);
    const __m256i u = _mm256_sign_epi8(q, q);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const moe_block_q8_0 *y = (const moe_block_q8_0 *)(x + (size_t)r * xs) + i;
        /* maddubs + madd in both builds: vpdpbusd measured 8-13 % slower here at 4..64 rows */
        sumi[r] = _mm256_madd_epi16(avx2_mul_u8_i8(u, _mm256_sign_epi8(avx2_load(y->qs), q)),
                                    _mm256_set1_epi16(1));
        dx[r] = avx2_fp16(y->d);
    }
    return d;
}
#define FAST_SUMS_Q32(t)                                                                           \
    static inline float fast_sums_##t(int R, const uint8_t *w_block, const uint8_t *x, size_t xs,  \
                                      int64_t i, __m256i *sumi, __m256i *msumi, float *dmin,       \
                                      float *dx) {                                                 \
        (void)msumi, (void)dmin;                                                                   \
        return fast_sums_q32(R, decode_##t, w_block, x, xs, i, sumi, dx);                          \
    }
FAST_SUMS_Q32(q8_0)
FAST_SUMS_Q32(q4_0)
FAST_SUMS_Q32(q5_0)
FAST_SUMS_Q32(iq4_nl)
FAST_SUMS_Q32(mxfp4)

/* Block i of R Q8_K activation rows: y[r], and dx[r] its scale. */
MOE_INLINE void fast_q8_k_rows(int R, const uint8_t *x, size_t xs, int64_t i,
                               const moe_block_q8_k **y, float *dx) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        y[r] = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
        dx[r] = y[r]->d;
    }
}

/* The 8 mins of a Q4_K / Q5_K block (int16) and its float min scale. */
_Static_assert(offsetof(moe_block_q5_k, dmin) == offsetof(moe_block_q4_k, dmin) &&
                   offsetof(moe_block_q5_k, scales) == offsetof(moe_block_q4_k, scales),
               "Q4_K and Q5_K blocks start alike");
MOE_INLINE __m128i fast_mins_k4(const void *block, float *dmin) {
    const moe_block_q4_k *b = block; /* d, dmin, scales: both types */
    *dmin = avx2_fp16(b->dmin);
    return _mm_cvtepu8_epi16(_mm_srli_si128(avx2_k4_scales(b->scales), 8));
}

/* Q4_K / Q5_K: x86_avx2.h's exact sums (values 0..31 unsigned), the mins against the bsums
 * (each 32-value min against its pair of 16-value sums). */
MOE_INLINE float fast_sums_k4(int R, bool q5, const uint8_t *w_block, const uint8_t *x, size_t xs,
                              int64_t i, __m256i *sumi, __m256i *msumi, float *dmin, float *dx) {
    const moe_block_q8_k *y[MOE_DOT_ROWS];
    fast_q8_k_rows(R, x, xs, i, y, dx);
    const avx2_k4_block b = avx2_k4_at(w_block, 0, q5);
    avx2_k4_sums(R, &b, y, sumi);
    const __m256i mins = fast_pair16(fast_mins_k4(w_block, dmin));
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) msumi[r] = _mm256_madd_epi16(mins, avx2_load(y[r]->bsums));
    return avx2_fp16(b.d16);
}
static inline float fast_sums_q4_k(int R, const uint8_t *w_block, const uint8_t *x, size_t xs,
                                   int64_t i, __m256i *sumi, __m256i *msumi, float *dmin,
                                   float *dx) {
    return fast_sums_k4(R, false, w_block, x, xs, i, sumi, msumi, dmin, dx);
}
static inline float fast_sums_q5_k(int R, const uint8_t *w_block, const uint8_t *x, size_t xs,
                                   int64_t i, __m256i *sumi, __m256i *msumi, float *dmin,
                                   float *dx) {
    return fast_sums_k4(R, true, w_block, x, xs, i, sumi, msumi, dmin, dx);
}
/* Q6_K: x86_avx2.h's exact sums (stored values 0..63, the offset off through the bsums). */
static inline float fast_sums_q6_k(int R, const uint8_t *w_block, const uint8_t *x, size_t xs,
                                   int64_t i, __m256i *sumi, __m256i *msumi, float *dmin,
                                   float *dx) {
    (void)msumi, (void)dmin;
    const moe_block_q8_k *y[MOE_DOT_ROWS];
    fast_q8_k_rows(R, x, xs, i, y, dx);
    const moe_block_q6_k *b = (const moe_block_q6_k *)w_block;
    avx2_q6_k_sums(R, b, y, sumi);
    return avx2_fp16(b->d);
}

MOE_INLINE float fast_sums_iq(int R, iq_block_fn block, const uint8_t *w_block, const uint8_t *x,
                              size_t xs, int64_t i, __m256i *sumi, float *dx) {
    const moe_block_q8_k *y[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        y[r] = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
        dx[r] = y[r]->d;
    }
    return block(R, w_block, y, sumi);
}

/* R activation rows against n_w <= 8 weight rows ws bytes apart, nb blocks of block_bytes
 * (mins: the type has them, Q4_K / Q5_K, and a second fma per block takes them). */
MOE_INLINE void fast_lanes(int R, fast_sums_fn sums, iq_block_fn block, bool mins,
                           size_t block_bytes, float mult, const uint8_t *w, size_t ws, int n_w,
                           const uint8_t *x, size_t xs, int64_t nb, float *out, int64_t os) {
    __m256 acc[MOE_DOT_ROWS];
    __m256i part[MOE_DOT_ROWS][8], mpart[MOE_DOT_ROWS][8];
    float d[8] = {0}, dmin[8] = {0}, dx[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        for (int v = n_w; v < 8; v++) part[r][v] = mpart[r][v] = _mm256_setzero_si256();
    }
    for (int64_t i = 0; i < nb; i++) {
        for (int v = 0; v < n_w; v++) {
            __m256i sumi[MOE_DOT_ROWS], msumi[MOE_DOT_ROWS];
            /* past the row's end: the next rows', read soon or never; harmless */
            fast_prefetch(w + v * ws + (size_t)(i + FAST_LANES_AHEAD) * block_bytes, block_bytes);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
            const uint8_t *wb = w + v * ws + (size_t)i * block_bytes;
            d[v] = sums ? sums(R, wb, x, xs, i, sumi, msumi, &dmin[v], dx)
                        : fast_sums_iq(R, block, wb, x, xs, i, sumi, dx);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                part[r][v] = sumi[r];
                if (mins) mpart[r][v] = msumi[r];
            }
        }
        const __m256 dw = _mm256_loadu_ps(d), dmw = _mm256_loadu_ps(dmin);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r] = fast_block_fma(dw, dx[r], mult, fast_sum8x8(part[r]), acc[r]);
            if (mins) acc[r] = fast_block_min(dmw, dx[r], fast_sum8x8(mpart[r]), acc[r]);
        }
    }
    const __m256i lanes = fast_lane_mask(n_w);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_maskstore_ps(out + r * os, lanes, acc[r]);
}

/* s's 8 int32 lanes summed (integer adds: exact in any order). */
MOE_INLINE int32_t fast_hsum(__m256i s) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

/* fast_lanes for one activation row (decode), one weight row after the other: the same block
 * sums and the same float steps per output (so the same bits), but the weights are read as one
 * stream, not as 8 a row apart, which the prefetchers follow worse (a prefetch distance of 1, 2,
 * 4, 8 or 16 blocks did not help). bench/kernels, 1 thread, 128 MiB of the file's layout, GB/s,
 * medians of 3 alternated runs under load 7 (Zen 5 at avx2): Q4_K 12.3 -> 15.0, Q6_K 15.1 ->
 * 23.4, IQ4_XS 6.6 -> 11.5, IQ2_S 4.5 -> 5.6, Q8_0 18.4 -> 19.1; the exact kernels (one row at
 * a time too) read 20, 21, 12, 6.1, 16. */
MOE_INLINE void fast_lanes_by_row(fast_sums_fn sums, iq_block_fn block, bool mins,
                                  size_t block_bytes, float mult, const uint8_t *w, size_t ws,
                                  int n_w, const uint8_t *x, int64_t nb, float *out) {
    for (int v = 0; v < n_w; v++) {
        float acc = 0.0f, dx, dmin = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            __m256i sumi = _mm256_setzero_si256(), msumi;
            const uint8_t *wb = w + v * ws + (size_t)i * block_bytes;
            const float d = sums ? sums(1, wb, x, 0, i, &sumi, &msumi, &dmin, &dx)
                                 : fast_sums_iq(1, block, wb, x, 0, i, &sumi, &dx);
            acc = fmaf(d * dx * mult, (float)fast_hsum(sumi), acc);
            if (mins) acc = fmaf(-(dmin * dx), (float)fast_hsum(msumi), acc);
        }
        out[v] = acc;
    }
}

/* ---- Many activation rows: an int8 tile of 8 weight rows ----
 *
 * From FAST_TILE_MIN_ROWS activation rows (FAST_K_TILE_MIN_ROWS for the K quants), the codebook
 * types and K quants, whose magnitudes are <= 64 (and at avxvnni IQ4_XS too), decode each block of
 * 8 weight rows once into an L1 tile, tile[g] lane v holding values 4g .. 4g + 3 of row v with
 * their signs, and every activation row meets it with its 4 bytes made unsigned (+128) and
 * broadcast: at avx2 one maddubs (255 x 64 x 2 < 32768: it never saturates) and one madd by the 8
 * rows' sub-block scales per 4 values x 8 rows, at avxvnni one vpdpbusd, and a multiply by the
 * scales per 16 values x 8 rows; against the lanes' sign step, maddubs and madd per 32 values x 1
 * row. 128 x (the row's scaled sum of weights), worked out once per tile, comes off again: the same
 * exact block sums, so the lanes' bits. */
#define FAST_TILE_MIN_ROWS 8
/* The K quants' lanes need no sign step (their values are unsigned), so at avx2, where the tile
 * multiplies with maddubs and madd per 4 values x 8 rows too, the tile's decode pays off later.
 * bench/kernels, 1 thread, 256 MiB, GB/s of weights at 16 / 32 / 64 activation rows, tile from
 * 8 rows: Q4_K 1.44 / - / 0.57, Q6_K 1.85 / - / 0.84; the lanes at 16 and the tile from 32:
 * Q4_K 1.56 / 0.96 / 0.58, Q6_K 2.09 / 1.32 / 0.84; the exact kernels 1.57 / 0.81 / 0.41 and
 * 2.26 / 1.21 / 0.63 (load 4). */
#if MOE_AVX_VNNI
#define FAST_K_TILE_MIN_ROWS FAST_TILE_MIN_ROWS
#else
#define FAST_K_TILE_MIN_ROWS 32
#endif
#define FAST_TILE_CHUNK 4  /* blocks decoded per pass (10.5 KiB) */
#define FAST_TILE_GROUP 64 /* activation rows per decode of a chunk */

typedef struct {
    __m256i tile[64];  /* lane v of tile[g]: values 4g .. 4g + 3 of row v, int8 with signs */
    __m256i scale[16]; /* lane v of scale[j]: row v's scale of values 16j .. 16j + 15, twice */
    __m256i bias;      /* 128 x sum_j scale[j] x (row v's values in sub-block j, summed) */
    __m256 d;          /* row v's d_w */
    __m256i mins[8];   /* Q4_K / Q5_K: lane v of mins[c]: row v's min of values 32c .. 32c + 31,
                        * in both int16 halves (against the activation's bsums 2c and 2c + 1) */
    __m256 dmin;       /* Q4_K / Q5_K: row v's min scale */
} fast_tile8;

/* The mins of a block with them (fast_mins_k4): 8 int16 and the float min scale. */
typedef __m128i (*fast_mins_fn)(const void *block, float *dmin);

/* 8 rows of 8 dwords to 8 registers of 8 rows: out[c] lane v = r[v] dword c. */
MOE_INLINE void fast_transpose8x8(const __m256i r[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 2; q++) { /* rows 4q .. 4q + 3; 128-bit lane h: dwords c, c + 4 */
        u[4 * q + 0] = _mm256_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm256_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm256_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm256_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
        out[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
    }
}

/* Block i of n_w <= 8 rows ws bytes apart into a tile (rows past n_w repeat row 0); mins NULL:
 * the type has none. */
MOE_INLINE void fast_tile8_build(iq_head_fn head, iq_chunk_fn chunk, fast_mins_fn mins,
                                 size_t block_bytes, const uint8_t *w, size_t ws, int n_w,
                                 int64_t i, fast_tile8 *o) {
    __m256i stage[8][8]; /* [chunk][row]: 32 signed values */
    int16_t sc[16][8] __attribute__((aligned(16)));
    uint16_t mn[8][8] __attribute__((aligned(16))); /* [row][sub-block] */
    float d[8], dmin[8];
    for (int v = 0; v < 8; v++) {
        const uint8_t *b = w + (size_t)(v < n_w ? v : 0) * ws + (size_t)i * block_bytes;
        const iq_head h = head(b);
        if (mins) _mm_store_si128((__m128i *)mn[v], mins(b, &dmin[v]));
#pragma GCC unroll 8
        for (int ib = 0; ib < 8; ib++) {
            iq_chunk c;
            chunk(b, &h, ib, &c);
            stage[ib][v] = avx2_apply_signs(c.u, c.neg);
            sc[2 * ib][v] = (int16_t)_mm256_extract_epi16(c.scale, 0);
            sc[2 * ib + 1][v] = (int16_t)_mm256_extract_epi16(c.scale, 8);
        }
        d[v] = h.d;
    }
    for (int ib = 0; ib < 8; ib++) fast_transpose8x8(stage[ib], o->tile + 8 * ib);
    __m256i bias = _mm256_setzero_si256();
    for (int j = 0; j < 16; j++) {
        o->scale[j] = fast_scale(_mm_load_si128((const __m128i *)sc[j]));
        __m256i part = fast_sub_begin(bias);
        for (int c = 0; c < 4; c++)
            part = fast_sub_step(part, _mm256_set1_epi8(1), o->tile[4 * j + c], o->scale[j]);
        bias = fast_sub_end(bias, part, o->scale[j]);
    }
    o->bias = _mm256_slli_epi32(bias, 7);
    o->d = _mm256_loadu_ps(d);
    if (mins) {
        for (int c = 0; c < 8; c++) {
            uint16_t m[8] __attribute__((aligned(16)));
            for (int v = 0; v < 8; v++) m[v] = mn[v][c];
            o->mins[c] = fast_pair16(_mm_load_si128((const __m128i *)m));
        }
        o->dmin = _mm256_loadu_ps(dmin);
    }
}

/* Block b of R activation rows xs bytes apart (Q8_K, or Q8_0 for q8_0) for a tile: xb[r] its
 * values made unsigned (+128), dx[r] its scale; sum[r] zeroed. */
MOE_INLINE void fast_tile8_stage(int R, bool q8_0, const uint8_t *x, size_t xs, int64_t b,
                                 uint32_t (*xb)[MOE_QK_K / 4], float *dx, __m256i *sum) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const uint8_t *row = x + (size_t)r * xs;
        const int8_t *qs =
            q8_0 ? ((const moe_block_q8_0 *)row)[b].qs : ((const moe_block_q8_k *)row)[b].qs;
        for (int k = 0; k < (q8_0 ? 1 : 8); k++)
            _mm256_store_si256(
                (__m256i *)(xb[r] + 8 * k),
                _mm256_xor_si256(avx2_load(qs + 32 * k), _mm256_set1_epi8((char)0x80)));
        dx[r] = q8_0 ? avx2_fp16(((const moe_block_q8_0 *)row)[b].d)
                     : ((const moe_block_q8_k *)row)[b].d;
        sum[r] = _mm256_setzero_si256();
    }
}

/* Tile j of tiles against R staged activation rows: sum[r] += the rows' exact int32 sums (their
 * bias still on); *d, *bias: the tile's d_w and bias. One per kind of tile. */
typedef void (*fast_tile_sums_fn)(int R, const void *tiles, int64_t j,
                                  const uint32_t (*xb)[MOE_QK_K / 4], __m256i *sum, __m256 *d,
                                  __m256i *bias);

MOE_INLINE void fast_tile8_sums(int R, const void *tiles, int64_t j,
                                const uint32_t (*xb)[MOE_QK_K / 4], __m256i *sum, __m256 *d,
                                __m256i *bias) {
    const fast_tile8 *t = (const fast_tile8 *)tiles + j;
    for (int s = 0; s < 16; s++) {
        const __m256i scale = _mm256_load_si256(&t->scale[s]);
        __m256i part[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) part[r] = fast_sub_begin(sum[r]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i tg = _mm256_load_si256(&t->tile[4 * s + c]);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                part[r] =
                    fast_sub_step(part[r], _mm256_set1_epi32((int)xb[r][4 * s + c]), tg, scale);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sum[r] = fast_sub_end(sum[r], part[r], scale);
    }
    *d = t->d;
    *bias = t->bias;
}

/* The int32 sum of a Q4_K / Q5_K tile's mins against an activation block's bsums, lane v for
 * weight row v: two bsums at a time (madd). */
MOE_INLINE __m256i fast_tile8_mins_sum(const fast_tile8 *t, const moe_block_q8_k *y) {
    __m256i msum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        int32_t pair;
        memcpy(&pair, y->bsums + 2 * c, sizeof pair);
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(_mm256_set1_epi32(pair), t->mins[c]));
    }
    return msum;
}

/* R activation rows (xs bytes apart, block c0 on; Q8_0 blocks for q8_0, else Q8_K) against nc
 * tiles; the rows' accumulators in and out through accbuf; mins: the tiles have them (Q4_K,
 * Q5_K: fast_tile8). One function per R and kind of tile (FAST_TILE_ROWS: the row loops
 * unroll, nothing kept across). */
MOE_INLINE void fast_tile_rows(int R, fast_tile_sums_fn sums, bool q8_0, bool mins,
                               const void *tiles, int64_t nc, const uint8_t *x, size_t xs,
                               int64_t c0, float mult, __m256 *accbuf) {
    __m256 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = accbuf[r];
    for (int64_t j = 0; j < nc; j++) {
        uint32_t xb[MOE_DOT_ROWS][MOE_QK_K / 4] __attribute__((aligned(32)));
        float dx[MOE_DOT_ROWS];
        __m256i sum[MOE_DOT_ROWS], bias;
        __m256 d;
        fast_tile8_stage(R, q8_0, x, xs, c0 + j, xb, dx, sum);
        sums(R, tiles, j, (const uint32_t(*)[MOE_QK_K / 4]) xb, sum, &d, &bias);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r] = fast_block_fma(d, dx[r], mult, _mm256_sub_epi32(sum[r], bias), acc[r]);
            if (mins) {
                const fast_tile8 *t = (const fast_tile8 *)tiles + j;
                const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + c0 + j;
                acc[r] = fast_block_min(t->dmin, dx[r], fast_tile8_mins_sum(t, y), acc[r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) accbuf[r] = acc[r];
}
/* name_R for R = 1..4: fast_tile_rows(R, sums, q8_0, mins, ...), one function each. */
#define FAST_TILE_ROWS(name, sums, q8_0, mins)                                                     \
    FAST_TILE_ROWS_R(name, sums, q8_0, mins, 1)                                                    \
    FAST_TILE_ROWS_R(name, sums, q8_0, mins, 2)                                                    \
    FAST_TILE_ROWS_R(name, sums, q8_0, mins, 3)                                                    \
    FAST_TILE_ROWS_R(name, sums, q8_0, mins, 4)
#define FAST_TILE_ROWS_R(name, sums, q8_0, mins, R)                                                \
    static __attribute__((noinline)) void name##_##R(const void *tiles, int64_t nc,                \
                                                     const uint8_t *x, size_t xs, int64_t c0,      \
                                                     float mult, __m256 *accbuf) {                 \
        fast_tile_rows(R, sums, q8_0, mins, tiles, nc, x, xs, c0, mult, accbuf);                   \
    }
FAST_TILE_ROWS(fast_tile8_rows, fast_tile8_sums, false, false)
FAST_TILE_ROWS(fast_tile8_min_rows, fast_tile8_sums, false, true)
#define FAST_TILE8_STEP_(R, ...) FAST_TILE8_CALL_(R, __VA_ARGS__)
#define FAST_TILE8_CALL_(R, unused)                                                                \
    (mins ? fast_tile8_min_rows_##R : fast_tile8_rows_##R)(tiles, nc, x + (size_t)(g0 + r) * xs,   \
                                                           xs, c0, mult, accbuf + r)

/* n_rows activation rows against n_w <= 8 weight rows: FAST_TILE_GROUP rows at a time; per
 * chunk of blocks, each block of the 8 rows decoded once into a tile, then every row group. */
MOE_INLINE void fast_tile8_drive(iq_head_fn head, iq_chunk_fn chunk, fast_mins_fn mins,
                                 size_t block_bytes, float mult, const uint8_t *w, size_t ws,
                                 int n_w, const uint8_t *x, size_t xs, int64_t n_rows, int64_t nb,
                                 float *out, int64_t os) {
    fast_tile8 tiles[FAST_TILE_CHUNK];
    const __m256i lanes = fast_lane_mask(n_w);
    MOE_TILE_LOOP(__m256, _mm256_setzero_ps, FAST_TILE_GROUP, FAST_TILE_CHUNK, n_rows, nb,
                  fast_tile8_build(head, chunk, mins, block_bytes, w, ws, n_w, c0 + j, &tiles[j]),
                  MOE_ROW_GROUPS, FAST_TILE8_STEP_,
                  _mm256_maskstore_ps(out + (g0 + r) * os, lanes, accbuf[r]));
}

/* ---- The K quants in the int8 tile ----
 *
 * Their chunks (iq_chunk, x86_avx2_iq.h) from x86_avx2.h's value decodes: Q4_K / Q5_K's values
 * 0..31 with no signs and a scale per 32 values (twice), their mins into the tile beside
 * (fast_tile8_build); Q6_K's the stored values - 32 (-32..31) with their signs, and its int8
 * scale per 16 values of either sign (the tile's scales take any int16). All within the tile's
 * bound (|v| <= 64). */
MOE_INLINE iq_head fast_k4_head(const void *block) {
    const moe_block_q4_k *b = block; /* d, dmin, scales: Q5_K's too */
    return (iq_head){_mm_cvtepu8_epi16(avx2_k4_scales(b->scales)), avx2_fp16(b->d)};
}
MOE_INLINE void fast_k4_chunk(const void *block, const iq_head *h, int ib, bool q5, iq_chunk *c) {
    const moe_block_q5_k *b5 = block;
    __m256i lo, hi;
    avx2_k4_values(q5 ? b5->qs : ((const moe_block_q4_k *)block)->qs,
                   q5 ? avx2_load(b5->qh) : _mm256_setzero_si256(), q5, ib / 2, &lo, &hi);
    c->u = ib % 2 ? hi : lo;
    c->neg = _mm256_setzero_si256();
    c->scale = avx2_splat_i16(h->sc, ib);
}
#define q4_k_head fast_k4_head
#define q5_k_head fast_k4_head
MOE_INLINE void q4_k_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    fast_k4_chunk(block, h, ib, false, c);
}
MOE_INLINE void q5_k_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    fast_k4_chunk(block, h, ib, true, c);
}
MOE_INLINE iq_head q6_k_head(const void *block) {
    const moe_block_q6_k *b = block;
    return (iq_head){_mm_loadu_si128((const __m128i *)b->scales), avx2_fp16(b->d)};
}
MOE_INLINE void q6_k_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    __m256i v[4];
    avx2_q6_k_values(block, ib / 4, v);
    iq_chunk_signed(_mm256_sub_epi8(v[ib % 4], _mm256_set1_epi8(32)),
                    avx2_scale_pair16(h->sc, 2 * ib), c);
}

#if MOE_AVX_VNNI
/* ---- The 32-value types in the int8 tile (avxvnni only) ----
 *
 * From FAST_TILE_MIN_ROWS activation rows, block i of 8 weight rows (Q8_0, Q4_0, Q5_0, IQ4_NL,
 * MXFP4: x86_avx2.h's decodes, signed values) goes into a tile as the codebook types' does
 * (tile[g] lane v: values 4g .. 4g + 3 of row v, bias lane v: 128 x row v's sum), and each
 * activation row meets it with its 4 bytes made unsigned (+128, any int8: 0 .. 255) and
 * broadcast, one vpdpbusd per 4 values x 8 rows, the bias off once per block: the lanes' exact
 * int32 block sums (|sum| <= 32 x 255 x 128), then the lanes' one fma per block, so avx2's
 * bits. Not at avx2: maddubs would saturate on Q8_0's and IQ4_NL's 255 x 128 x 2 (Q4_0, Q5_0
 * and MXFP4, whose values are small, stay in the lanes there too: an avx2 tile of them, maddubs
 * and madd per 4 values x 8 rows against the lanes' per 32 values x 1 row, is not written). */
#define FAST_Q8_CHUNK 32 /* blocks decoded per pass (10 KiB) */

typedef struct {
    __m256i tile[8]; /* lane v of tile[g]: values 4g .. 4g + 3 of row v */
    __m256i bias;    /* 128 x (row v's values, summed) */
    __m256 d;        /* row v's d_w */
} fast_tile8_q32;

/* Block i of n_w <= 8 rows ws bytes apart into a tile (rows past n_w repeat row 0). */
MOE_INLINE void fast_tile8_q32_build(q32_decode_fn decode, size_t block_bytes, const uint8_t *w,
                                     size_t ws, int n_w, int64_t i, fast_tile8_q32 *o) {
    __m256i rows[8];
    float d[8], m;
    for (int v = 0; v < 8; v++)
        rows[v] = decode(w + (size_t)(v < n_w ? v : 0) * ws + (size_t)i * block_bytes, &d[v], &m);
    fast_transpose8x8(rows, o->tile);
    __m256i bias = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++)
        bias = _mm256_dpbusd_avx_epi32(bias, _mm256_set1_epi8(1), o->tile[g]);
    o->bias = _mm256_slli_epi32(bias, 7);
    o->d = _mm256_loadu_ps(d);
}

/* Tile j against R staged rows: one vpdpbusd per 4 values x 8 rows (fast_tile_sums_fn). */
MOE_INLINE void fast_tile8_q32_sums(int R, const void *tiles, int64_t j,
                                    const uint32_t (*xb)[MOE_QK_K / 4], __m256i *sum, __m256 *d,
                                    __m256i *bias) {
    const fast_tile8_q32 *t = (const fast_tile8_q32 *)tiles + j;
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const __m256i tg = _mm256_load_si256(&t->tile[g]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            sum[r] = _mm256_dpbusd_avx_epi32(sum[r], _mm256_set1_epi32((int)xb[r][g]), tg);
    }
    *d = t->d;
    *bias = t->bias;
}
FAST_TILE_ROWS(fast_tile8_q32_rows, fast_tile8_q32_sums, true, false)
#define FAST_Q32_STEP_(R, ...) FAST_Q32_CALL_(R, __VA_ARGS__)
#define FAST_Q32_CALL_(R, unused)                                                                  \
    fast_tile8_q32_rows_##R(tiles, nc, x + (size_t)(g0 + r) * xs, xs, c0, 1.0f, accbuf + r)

MOE_INLINE void fast_many_q32(q32_decode_fn decode, size_t block_bytes, const uint8_t *w, size_t ws,
                              int n_w, const uint8_t *x, size_t xs, int64_t n_rows, int64_t n,
                              float *out, int64_t os) {
    fast_tile8_q32 tiles[FAST_Q8_CHUNK];
    const __m256i lanes = fast_lane_mask(n_w);
    MOE_TILE_LOOP(__m256, _mm256_setzero_ps, FAST_TILE_GROUP, FAST_Q8_CHUNK, n_rows, n / MOE_QK32,
                  fast_tile8_q32_build(decode, block_bytes, w, ws, n_w, c0 + j, &tiles[j]),
                  MOE_ROW_GROUPS, FAST_Q32_STEP_,
                  _mm256_maskstore_ps(out + (g0 + r) * os, lanes, accbuf[r]));
}
#define FAST_MANY_Q32(t)                                                                           \
    static void fast_many_##t(const uint8_t *w, size_t ws, int n_w, const uint8_t *x, size_t xs,   \
                              int64_t n_rows, int64_t n, float *out, int64_t os) {                 \
        fast_many_q32(decode_##t, sizeof(moe_block_##t), w, ws, n_w, x, xs, n_rows, n, out, os);   \
    }
FAST_MANY_Q32(q8_0)
FAST_MANY_Q32(q4_0)
FAST_MANY_Q32(q5_0)
FAST_MANY_Q32(iq4_nl)
FAST_MANY_Q32(mxfp4)
#define FAST_MANY_Q32_FN(t) fast_many_##t
#else
#define FAST_MANY_Q32_FN(t) NULL /* the lanes at every row count */
#endif

/* The tile kernel (quant.h, moe_dot_tile_fn): weight rows 8 at a time, activation rows in
 * groups of MOE_DOT_ROWS (a block is decoded once per group). Each group size is a function of
 * its own (fast_lanes_<t>_<R>), so the loop constants of one are not kept, spilled, across the
 * others. */
#define FAST_LANES_R(t, R, sums, block, mins, values, mult)                                        \
    static __attribute__((noinline)) void fast_lanes_##t##_##R(                                    \
        const uint8_t *w, size_t ws, int n_w, const uint8_t *x, size_t xs, int64_t n, float *out,  \
        int64_t os) {                                                                              \
        if (R == 1)                                                                                \
            fast_lanes_by_row(sums, block, mins, sizeof(moe_block_##t), mult, w, ws, n_w, x,       \
                              n / (values), out);                                                  \
        else                                                                                       \
            fast_lanes(R, sums, block, mins, sizeof(moe_block_##t), mult, w, ws, n_w, x, xs,       \
                       n / (values), out, os);                                                     \
    }
#define FAST_KERNELS(t, sums, block, mins, values, mult, many, min_rows)                           \
    FAST_LANES_R(t, 1, sums, block, mins, values, mult)                                            \
    FAST_LANES_R(t, 2, sums, block, mins, values, mult)                                            \
    FAST_LANES_R(t, 3, sums, block, mins, values, mult)                                            \
    FAST_LANES_R(t, 4, sums, block, mins, values, mult)                                            \
    static void fast_tile_##t(const void *w, size_t ws, int n_w, const void *x, size_t xs,         \
                              int64_t n_rows, int64_t n, float *out, int64_t os) {                 \
        for (int v0 = 0; v0 < n_w; v0 += 8) {                                                      \
            const uint8_t *wv = (const uint8_t *)w + (size_t)v0 * ws, *xb = x;                     \
            const int nv = n_w - v0 < 8 ? n_w - v0 : 8;                                            \
            int64_t r = 0;                                                                         \
            const fast_many_fn many_ = many; /* NULL: the lanes for every row count */             \
            if (n_rows >= (min_rows) && many_) {                                                   \
                many_(wv, ws, nv, xb, xs, n_rows, n, out + v0, os);                                \
                continue;                                                                          \
            }                                                                                      \
            MOE_ROW_GROUPS(r, n_rows, FAST_STEP_, t, wv, ws, nv, xb, xs, n, out, os, v0);          \
        }                                                                                          \
    }                                                                                              \
    static float fast_dot_##t(const void *w, const void *x, int64_t n) {                           \
        float out;                                                                                 \
        fast_lanes_##t##_1(w, 0, 1, x, 0, n, &out, 1);                                             \
        return out;                                                                                \
    }
#define FAST_STEP_(R, ...) FAST_CALL_(R, __VA_ARGS__) /* R expanded (MOE_DOT_ROWS) first */
#define FAST_CALL_(R, t, wv, ws, nv, xb, xs, n, out, os, v0)                                       \
    fast_lanes_##t##_##R(wv, ws, nv, xb + (size_t)r * xs, xs, n, out + r * os + v0, os)
typedef void (*fast_many_fn)(const uint8_t *w, size_t ws, int n_w, const uint8_t *x, size_t xs,
                             int64_t n_rows, int64_t n, float *out, int64_t os);
#define FAST_Q32(t)                                                                                \
    FAST_KERNELS(t, fast_sums_##t, NULL, false, MOE_QK32, 1.0f, FAST_MANY_Q32_FN(t),               \
                 FAST_TILE_MIN_ROWS)
FAST_Q32(q8_0)
FAST_Q32(q4_0)
FAST_Q32(q5_0)
FAST_Q32(iq4_nl)
FAST_Q32(mxfp4)
#undef FAST_Q32
/* A super-block type through the int8 tile from FAST_TILE_MIN_ROWS rows: its head and chunk
 * decodes (and mins: NULL for none, has_mins saying so), and in the lanes its block sums (sums:
 * the K quants') or the codebook types' (sums NULL: block, fast_sums_iq). */
#define FAST_SB(t, sums, block, mins, has_mins, mult, min_rows)                                    \
    static void fast_many_##t(const uint8_t *w, size_t ws, int n_w, const uint8_t *x, size_t xs,   \
                              int64_t n_rows, int64_t n, float *out, int64_t os) {                 \
        fast_tile8_drive(t##_head, t##_chunk, mins, sizeof(moe_block_##t), mult, w, ws, n_w, x,    \
                         xs, n_rows, n / MOE_QK_K, out, os);                                       \
    }                                                                                              \
    FAST_KERNELS(t, sums, block, has_mins, MOE_QK_K, mult, fast_many_##t, min_rows)
#define FAST_IQ(t, mult) FAST_SB(t, NULL, t##_block, NULL, false, mult, FAST_TILE_MIN_ROWS)
FAST_IQ(iq2_xxs, 0.125f)
FAST_IQ(iq2_xs, 0.125f)
FAST_IQ(iq2_s, 0.125f)
FAST_IQ(iq3_xxs, 0.25f)
FAST_IQ(iq3_s, 1.0f)
FAST_IQ(iq1_s, 0.125f)
FAST_IQ(iq1_m, 0.125f)
#if MOE_AVX_VNNI /* no int16 stage to saturate */
FAST_IQ(iq4_xs, 1.0f)
#else
FAST_KERNELS(iq4_xs, NULL, iq4_xs_block, false, MOE_QK_K, 1.0f, NULL, FAST_TILE_MIN_ROWS)
#endif
#undef FAST_IQ
FAST_SB(q4_k, fast_sums_q4_k, NULL, fast_mins_k4, true, 1.0f, FAST_K_TILE_MIN_ROWS)
FAST_SB(q5_k, fast_sums_q5_k, NULL, fast_mins_k4, true, 1.0f, FAST_K_TILE_MIN_ROWS)
FAST_SB(q6_k, fast_sums_q6_k, NULL, NULL, false, 1.0f, FAST_K_TILE_MIN_ROWS)

void FAST_FILL(moe_kernels *k) {
#define FAST_SET(T, t)                                                                             \
    moe_kernels_set_fast_dot(k->types, MOE_TYPE_##T, fast_dot_##t, fast_tile_##t, FAST_LEVEL)
    FAST_SET(Q8_0, q8_0);
    FAST_SET(Q4_0, q4_0);
    FAST_SET(Q5_0, q5_0);
    FAST_SET(IQ4_NL, iq4_nl);
    FAST_SET(MXFP4, mxfp4);
    FAST_SET(Q4_K, q4_k);
    FAST_SET(Q5_K, q5_k);
    FAST_SET(Q6_K, q6_k);
    FAST_SET(IQ2_XXS, iq2_xxs);
    FAST_SET(IQ2_XS, iq2_xs);
    FAST_SET(IQ2_S, iq2_s);
    FAST_SET(IQ3_XXS, iq3_xxs);
    FAST_SET(IQ3_S, iq3_s);
    FAST_SET(IQ1_S, iq1_s);
    FAST_SET(IQ1_M, iq1_m);
    FAST_SET(IQ4_XS, iq4_xs);
#undef FAST_SET
}
