/* x86_avx2.h: the AVX2 building blocks the x86 kernel files share -- horizontal sums, nibble
 * and bit unpacking, sign application, the signed 8-bit dot -- as always-inline functions.
 *
 * Included only by files built with at least the AVX2 flags (x86_avx2.c, fast_avx2.c,
 * x86_avx512.c), never by baseline code. The trap: _mm256_maddubs_epi16 saturates its int16 pair
 * sums, so its unsigned operand must stay small enough that 2 * u * 127 < 32768 (u <= 128): every
 * caller says why its operand does (nibbles, grid magnitudes, |q8| via the sign trick). Activation
 * bytes are never -128 (the Q8 quantizers clamp to +-127), which the sign trick also relies on. */
#ifndef MOE_QUANT_X86_AVX2_H
#define MOE_QUANT_X86_AVX2_H

#include <immintrin.h>
#include <math.h>

#include "blocks.h"
#include "kernels.h"

#define MOE_INLINE static inline __attribute__((always_inline))

/* ==== Many-row kernels ====
 *
 * A kernel written once as `rows_fn(w, x, x_stride, R, n, out, out_stride)` -- decode a weight
 * block, then for each of R activation rows the same integer sums and the same float
 * accumulation as a single row would do -- becomes both table entries: dot is R = 1, dot_rows
 * runs R = MOE_DOT_ROWS at a time and the remainder with R = 1..3. R is a constant in every
 * call, so the compiler unrolls the row loops and keeps the R accumulators in registers; the
 * floats of each row are the single-row kernel's, bit for bit (test_kernels checks). */
#define MOE_DOT_ROWS 4

/* Rows r .. n_rows - 1 in groups: STEP(R, ...) for R = MOE_DOT_ROWS while a whole group is left,
 * then once for the 1..3 left; R is a constant in every expansion, so the kernels' row loops
 * unroll. STEP reads r (the first row of its group); the other arguments pass through. */
#define MOE_ROW_GROUPS(r, n_rows, STEP, ...)                                                       \
    do {                                                                                           \
        for (; (r) + MOE_DOT_ROWS <= (n_rows); (r) += MOE_DOT_ROWS)                                \
            STEP(MOE_DOT_ROWS, __VA_ARGS__);                                                       \
        switch ((n_rows) - (r)) {                                                                  \
        case 3:                                                                                    \
            STEP(3, __VA_ARGS__);                                                                  \
            break;                                                                                 \
        case 2:                                                                                    \
            STEP(2, __VA_ARGS__);                                                                  \
            break;                                                                                 \
        case 1:                                                                                    \
            STEP(1, __VA_ARGS__);                                                                  \
            break;                                                                                 \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
    } while (0)

/* The fast path's tile loop (fast_avx512vnni.c, fast_avx2.c): activation
 * rows `group` at a time, their accumulators (V, from vzero()) in accbuf; per chunk of up to
 * `chunk` blocks, DECODE (with j the block of the chunk, c0 its first) once per block, then STEP
 * per row group (GROUPS, as MOE_ROW_GROUPS: r the group's first row, g0 the group's); then STORE
 * per row. */
#define MOE_TILE_LOOP(V, vzero, group, chunk, n_rows, nb, DECODE, GROUPS, STEP, STORE)             \
    do {                                                                                           \
        V accbuf[group];                                                                           \
        for (int64_t g0 = 0; g0 < (n_rows); g0 += (group)) {                                       \
            const int64_t ng = (n_rows)-g0 < (group) ? (n_rows)-g0 : (group);                      \
            for (int64_t r = 0; r < ng; r++) accbuf[r] = vzero();                                  \
            for (int64_t c0 = 0; c0 < (nb); c0 += (chunk)) {                                       \
                const int64_t nc = (nb)-c0 < (chunk) ? (nb)-c0 : (chunk);                          \
                for (int64_t j = 0; j < nc; j++) DECODE;                                           \
                int64_t r = 0;                                                                     \
                GROUPS(r, ng, STEP, 0);                                                            \
            }                                                                                      \
            for (int64_t r = 0; r < ng; r++) STORE;                                                \
        }                                                                                          \
    } while (0)

#define MOE_DOT_AND_ROWS(dot_name, rows_name, rows_fn, ...)                                        \
    static float dot_name(const void *w, const void *x, int64_t n) {                               \
        float out;                                                                                 \
        rows_fn(w, x, 0, 1, n, &out, 0, __VA_ARGS__);                                              \
        return out;                                                                                \
    }                                                                                              \
    static void rows_name(const void *w, const void *x, size_t xs, int64_t n_rows, int64_t n,      \
                          float *out, int64_t os) {                                                \
        const uint8_t *xb = x;                                                                     \
        int64_t r = 0;                                                                             \
        MOE_ROW_GROUPS(r, n_rows, MOE_ROWS_CALL_, rows_fn, __VA_ARGS__);                           \
    }
#define MOE_ROWS_CALL_(R, rows_fn, ...)                                                            \
    rows_fn(w, xb + (size_t)r * xs, xs, R, n, out + r * os, os, __VA_ARGS__)

/* Float weights against float activations of the same type, written once for both vector
 * widths (V with L lanes; vz, vfma, vadd, vsum its zero, a*b+c, a+b and horizontal sum): four
 * accumulators over 4L-value steps, then L-value steps, the rest to the reference; each weight
 * step loaded once for the R rows. */
#define MOE_FLOAT_ROWS(name, V, L, vz, vfma, vadd, vsum)                                           \
    MOE_INLINE void name(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,    \
                         int64_t os, size_t elem, V (*load)(const void *), moe_dot_fn tail) {      \
        const uint8_t *a = w, *xb = x;                                                             \
        V acc[MOE_DOT_ROWS][4];                                                                    \
        for (int r = 0; r < R; r++)                                                                \
            for (int u = 0; u < 4; u++) acc[r][u] = vz();                                          \
        int64_t i = 0;                                                                             \
        for (; i + 4 * (L) <= n; i += 4 * (L))                                                     \
            for (int u = 0; u < 4; u++) {                                                          \
                const V wv = load(a + (size_t)(i + (L)*u) * elem);                                 \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r][u] =                    \
                    vfma(wv, load(xb + (size_t)r * xs + (size_t)(i + (L)*u) * elem), acc[r][u]);   \
            }                                                                                      \
        for (; i + (L) <= n; i += (L)) {                                                           \
            const V wv = load(a + (size_t)i * elem);                                               \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r][0] =                        \
                vfma(wv, load(xb + (size_t)r * xs + (size_t)i * elem), acc[r][0]);                 \
        }                                                                                          \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                      \
            float sum = vsum(vadd(vadd(acc[r][0], acc[r][1]), vadd(acc[r][2], acc[r][3])));        \
            if (i < n)                                                                             \
                sum += tail(a + (size_t)i * elem, xb + (size_t)r * xs + (size_t)i * elem, n - i);  \
            out[r * os] = sum;                                                                     \
        }                                                                                          \
    }

/* ==== Reductions and scalars ==== */

MOE_INLINE float avx2_hsum_f32x4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
MOE_INLINE float avx2_hsum_f32(__m256 v) {
    return avx2_hsum_f32x4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
MOE_INLINE int32_t avx2_hsum_i32x4(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
MOE_INLINE int32_t avx2_hsum_i32(__m256i v) {
    return avx2_hsum_i32x4(
        _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
MOE_INLINE float avx2_fp16(uint16_t h) {
    return _cvtsh_ss(h);
}
MOE_INLINE __m256i avx2_load(const void *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* ==== Unpacking ==== */

/* 16 bytes of nibbles as 32 values: low nibbles -> bytes 0..15, high -> 16..31 (the Q4_0 /
 * IQ4_NL / MXFP4 / IQ4_XS order). */
MOE_INLINE __m256i avx2_nibbles32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
}

/* 32 bits -> 32 bytes, 0xff where bit j of `bits` is set (byte j). */
MOE_INLINE __m256i avx2_bits_to_mask(uint32_t bits) {
    const __m256i spread =
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
}

/* x negated where mask bytes are 0xff (a two's complement conditional negate). */
MOE_INLINE __m256i avx2_apply_signs(__m256i x, __m256i mask) {
    return _mm256_sub_epi8(_mm256_xor_si256(x, mask), mask);
}

/* Four 8-byte codebook entries as 32 bytes (entry 0 -> bytes 0..7). */
MOE_INLINE __m256i avx2_grid4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}

/* ==== Multiply-adds ==== */

/* Unsigned u times signed x, adjacent pairs summed: 16 int16 (u <= 128, see the header). */
MOE_INLINE __m256i avx2_mul_u8_i8(__m256i u, __m256i x) {
    return _mm256_maddubs_epi16(u, x);
}
/* Signed w times signed x, adjacent pairs summed: 16 int16 (the sign moves onto x). */
MOE_INLINE __m256i avx2_mul_i8_i8(__m256i w, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
/* int16 pair sums to 8 int32, each pair weighted by the int16 in `scale`. */
MOE_INLINE __m256i avx2_scale16(__m256i p16, __m256i scale) {
    return _mm256_madd_epi16(p16, scale);
}
/* Signed 8-bit dot of 32 values in 8 int32 lanes (4 values each). */
MOE_INLINE __m256i avx2_dot_i8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(avx2_mul_i8_i8(w, x), _mm256_set1_epi16(1));
}

/* The int16 weights of two 16-value sub-blocks s and s+1 (s even): bytes s and s+1 of the 16
 * int8 scales in `sc`, sign-extended, each repeated 8 times. */
MOE_INLINE __m256i avx2_scale_pair16(__m128i sc, int s) {
    const __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ull * (unsigned)(s + 1)),
                                        (long long)(0x0101010101010101ull * (unsigned)s));
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick));
}

/* ==== 32-value block decoders (Q8_0 / Q8_1 dots) ==== */

/* A decoder turns one block into 32 int8 (signed for the Q8_0 types, unsigned 0..31 for the
 * Q8_1 ones) and its scale (and min). */
typedef __m256i (*q32_decode_fn)(const uint8_t *block, float *d, float *m);

MOE_INLINE __m256i decode_q4_0(const uint8_t *p, float *d, float *m) {
    const moe_block_q4_0 *b = (const moe_block_q4_0 *)p;
    (void)m;
    *d = avx2_fp16(b->d);
    return _mm256_sub_epi8(avx2_nibbles32(b->qs), _mm256_set1_epi8(8));
}
/* Q5_0: nibble | bit4 << 4, minus 16: OR-ing 0xf0 where the bit is clear gives nibble - 16. */
MOE_INLINE __m256i decode_q5_0(const uint8_t *p, float *d, float *m) {
    const moe_block_q5_0 *b = (const moe_block_q5_0 *)p;
    (void)m;
    *d = avx2_fp16(b->d);
    const __m256i high =
        _mm256_andnot_si256(avx2_bits_to_mask(moe_load_le32(b->qh)), _mm256_set1_epi8((char)0xf0));
    return _mm256_or_si256(avx2_nibbles32(b->qs), high);
}
MOE_INLINE __m256i decode_q8_0(const uint8_t *p, float *d, float *m) {
    const moe_block_q8_0 *b = (const moe_block_q8_0 *)p;
    (void)m;
    *d = avx2_fp16(b->d);
    return avx2_load(b->qs);
}
MOE_INLINE __m256i decode_iq4_nl(const uint8_t *p, float *d, float *m) {
    const moe_block_iq4_nl *b = (const moe_block_iq4_nl *)p;
    (void)m;
    *d = avx2_fp16(b->d);
    const __m256i book =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_kvalues_iq4nl));
    return _mm256_shuffle_epi8(book, avx2_nibbles32(b->qs));
}
MOE_INLINE __m256i decode_mxfp4(const uint8_t *p, float *d, float *m) {
    const moe_block_mxfp4 *b = (const moe_block_mxfp4 *)p;
    (void)m;
    *d = moe_e8m0_to_f32_half(b->e);
    const __m256i book =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_kvalues_mxfp4));
    return _mm256_shuffle_epi8(book, avx2_nibbles32(b->qs));
}
MOE_INLINE __m256i decode_q4_1(const uint8_t *p, float *d, float *m) {
    const moe_block_q4_1 *b = (const moe_block_q4_1 *)p;
    *d = avx2_fp16(b->d), *m = avx2_fp16(b->m);
    return avx2_nibbles32(b->qs);
}
MOE_INLINE __m256i decode_q5_1(const uint8_t *p, float *d, float *m) {
    const moe_block_q5_1 *b = (const moe_block_q5_1 *)p;
    *d = avx2_fp16(b->d), *m = avx2_fp16(b->m);
    const __m256i high =
        _mm256_and_si256(avx2_bits_to_mask(moe_load_le32(b->qh)), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(avx2_nibbles32(b->qs), high);
}

/* The 16 odd scales 2s + 1 of IQ2_XS / IQ2_S (a 4-bit s per 16 values, two per byte). */
MOE_INLINE __m128i avx2_iq2_scales16(const uint8_t scales[8]) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)scales);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i s =
        _mm_unpacklo_epi8(_mm_and_si128(raw, low4), _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    return _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1));
}

/* ==== K-quant scales, decoded in registers (a store + reload would stall forwarding) ==== */

/* Q4_K / Q5_K: the 8 six-bit scales (bytes 0..7) and mins (bytes 8..15), the values
 * moe_k4_scale_min gives one at a time. */
MOE_INLINE __m128i avx2_k4_scales(const uint8_t q[12]) {
    uint32_t u[3];
    memcpy(u, q, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    return _mm_setr_epi32((int)(u[0] & low6), (int)((u[2] & low4) | (((u[0] >> 6) & low2) << 4)),
                          (int)(u[1] & low6),
                          (int)(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)));
}

/* Q3_K: the 16 six-bit scales, bias removed (-32..31), as unpack_q3_k decodes them. */
MOE_INLINE __m128i avx2_k3_scales(const uint8_t q[12]) {
    uint32_t a[3];
    memcpy(a, q, 12);
    const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const __m128i v = _mm_setr_epi32((int)((a[0] & low4) | ((a[2] & low2) << 4)),
                                     (int)((a[1] & low4) | (((a[2] >> 2) & low2) << 4)),
                                     (int)(((a[0] >> 4) & low4) | (((a[2] >> 4) & low2) << 4)),
                                     (int)(((a[1] >> 4) & low4) | (((a[2] >> 6) & low2) << 4)));
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

/* 4 bytes as 8 nibbles in int16 lanes: lane 2k = low nibble of byte k, lane 2k+1 the high. */
MOE_INLINE __m128i avx2_nibbles8_i16(uint32_t bytes) {
    const __m128i v = _mm_cvtsi32_si128((int)bytes), low4 = _mm_set1_epi8(0x0f);
    return _mm_cvtepu8_epi16(
        _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
}

/* IQ4_XS: the 8 sub-block scales ls - 32 (4 low bits in scales_l, 2 high in scales_h), int16. */
MOE_INLINE __m128i avx2_iq4xs_scales(const moe_block_iq4_xs *b) {
    const __m256i h =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h),
                                           _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                         _mm256_set1_epi32(3));
    const __m128i h16 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128i ls =
        _mm_or_si128(avx2_nibbles8_i16(moe_load_le32(b->scales_l)), _mm_slli_epi16(h16, 4));
    return _mm_sub_epi16(ls, _mm_set1_epi16(32));
}

/* 8 four-bit scales s (two per byte, low nibble first) as the odd int16 2s + 1 (IQ3_S). */
MOE_INLINE __m128i avx2_odd_scales8(const uint8_t s[4]) {
    const __m128i v = avx2_nibbles8_i16(moe_load_le32(s));
    return _mm_add_epi16(_mm_add_epi16(v, v), _mm_set1_epi16(1));
}

/* int16 lane k of v (0..7) in every int16 lane of a 256-bit vector. */
MOE_INLINE __m256i avx2_splat_i16(__m128i v, int k) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v),
                               _mm256_set1_epi16((short)(0x0100 + 0x0202 * k)));
}

/* Q4_K / Q5_K min term of one block: dmin * sum_s min[s] * (32-value bsum of s), in 4 float
 * lanes added to acc; sm from avx2_k4_scales. */
MOE_INLINE __m128 avx2_k4_min_term(__m128i sm, const moe_block_q8_k *y, float dmin, __m128 acc) {
    const __m256i bs = avx2_load(y->bsums);
    const __m128i bsum32 =
        _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    return _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, bsum32)), acc);
}

/* ==== Q4_K / Q5_K parts shared by the AVX2 and AVX-512 many-row kernels ==== */

/* Block i of a Q4_K (q5 false) or Q5_K row: its 6-bit scales and mins (avx2_k4_scales), qs, qh
 * (NULL for Q4_K) and fp16 scales. */
typedef struct {
    __m128i sm;
    const uint8_t *qs, *qh;
    uint16_t d16, dmin16;
} avx2_k4_block;
MOE_INLINE avx2_k4_block avx2_k4_at(const void *w, int64_t i, bool q5) {
    const moe_block_q4_k *b4 = (const moe_block_q4_k *)w + i;
    const moe_block_q5_k *b5 = (const moe_block_q5_k *)w + i;
    return (avx2_k4_block){.sm = avx2_k4_scales(q5 ? b5->scales : b4->scales),
                           .qs = q5 ? b5->qs : b4->qs,
                           .qh = q5 ? b5->qh : NULL,
                           .d16 = q5 ? b5->d : b4->d,
                           .dmin16 = q5 ? b5->dmin : b4->dmin};
}
/* Rows' block i: y[r] set, the min term added to acc_min[r]. */
MOE_INLINE void avx2_k4_rows_begin(int R, const uint8_t *xb, size_t xs, int64_t i,
                                   const avx2_k4_block *b, const moe_block_q8_k **y,
                                   __m128 *acc_min) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + i;
        acc_min[r] = avx2_k4_min_term(b->sm, y[r], y[r]->d * avx2_fp16(b->dmin16), acc_min[r]);
    }
}
/* Rows' block i done: the eight integer lanes sumi[r] scaled into acc[r]. */
MOE_INLINE void avx2_k4_rows_end(int R, const avx2_k4_block *b, const moe_block_q8_k *const *y,
                                 const __m256i *sumi, __m256 *acc) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float d = y[r]->d * avx2_fp16(b->d16);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
}
MOE_INLINE void avx2_k4_rows_store(int R, const __m256 *acc, const __m128 *acc_min, float *out,
                                   int64_t os) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r * os] = avx2_hsum_f32(acc[r]) - avx2_hsum_f32x4(acc_min[r]);
}

/* Q4_K / Q5_K values 64j .. 64j + 31 (lo) and 64j + 32 .. 64j + 63 (hi), 0..31: qs[32j + l]
 * holds value 64j + l in its low nibble and 64j + 32 + l in its high one; Q5_K's fifth bits are
 * bits 2j and 2j + 1 of qh[l] (hb: the 32 qh bytes; q5 false: Q4_K, hb unused). */
MOE_INLINE void avx2_k4_values(const uint8_t *qs, __m256i hb, bool q5, int j, __m256i *lo,
                               __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    const __m256i q4 = avx2_load(qs + 32 * j);
    *lo = _mm256_and_si256(q4, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
    if (q5) { /* 16-bit shifts leak only outside bit 4 */
        const __m256i h = _mm256_srli_epi16(hb, 2 * j);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
    }
}

/* Rows' Q4_K / Q5_K block b: sumi[r] += the exact integer sum of the scaled products (values
 * 0..31 unsigned against the q8, u x 127 x 2 < 32768), the mins left out, in 8 int32 lanes. */
MOE_INLINE void avx2_k4_sums(int R, const avx2_k4_block *b, const moe_block_q8_k *const *y,
                             __m256i *sumi) {
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(b->sm));
    const __m256i hb = b->qh ? avx2_load(b->qh) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i lo, hi;
        avx2_k4_values(b->qs, hb, b->qh != NULL, j, &lo, &hi);
        const __m256i slo =
            _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0404 * j)));
        const __m256i shi =
            _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0302 + 0x0404 * j)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i plo = avx2_mul_u8_i8(lo, avx2_load(y[r]->qs + 64 * j));
            const __m256i phi = avx2_mul_u8_i8(hi, avx2_load(y[r]->qs + 64 * j + 32));
            sumi[r] = _mm256_add_epi32(
                sumi[r], _mm256_add_epi32(avx2_scale16(plo, slo), avx2_scale16(phi, shi)));
        }
    }
}

/* Q6_K half h: v[k] = values 128h + 32k .. + 31 as stored (0..63, the value + 32). Per half,
 * ql[l] / ql[l + 32] hold values l, l + 32 (low nibbles) and l + 64, l + 96 (high), qh[l] their
 * top 2 bits at bits 0, 2, 4, 6; 16-bit shifts leak only outside 0x30. */
MOE_INLINE void avx2_q6_k_values(const moe_block_q6_k *b, int h, __m256i v[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    const uint8_t *ql = b->ql + 64 * h;
    const __m256i qa = avx2_load(ql), qb = avx2_load(ql + 32), qhb = avx2_load(b->qh + 32 * h);
    v[0] = _mm256_or_si256(_mm256_and_si256(qa, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qhb, 4), top2));
    v[1] = _mm256_or_si256(_mm256_and_si256(qb, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qhb, 2), top2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                           _mm256_and_si256(qhb, top2));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qhb, 2), top2));
}

/* Rows' Q6_K block b: sumi[r] (zero on entry) gets the exact integer block sum in 8 int32 lanes.
 * q = q6 - 32 with q6 = 0..63: sum (q6 - 32) x = sum q6 x - 32 bsum per 16-value sub-block, so
 * the offset costs one madd of the scales with the bsums per row; q6 x 127 x 2 < 32768. */
MOE_INLINE void avx2_q6_k_sums(int R, const moe_block_q6_k *b, const moe_block_q8_k *const *y,
                               __m256i *sumi) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)b->scales);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256i offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), avx2_load(y[r]->bsums));
        sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(offset, 5));
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i v[4];
        avx2_q6_k_values(b, h, v);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i scale = avx2_scale_pair16(sc, 8 * h + 2 * k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i p = avx2_mul_u8_i8(v[k], avx2_load(y[r]->qs + 128 * h + 32 * k));
                sumi[r] = _mm256_add_epi32(sumi[r], avx2_scale16(p, scale));
            }
        }
    }
}

/* Q8_K bsums (16 per block) as int16: the sums of 16 activations each. */
MOE_INLINE __m256i avx2_bsums(const moe_block_q8_k *y) {
    return avx2_load(y->bsums);
}

/* The fast attention's KV tile conversion: the next tile's rows (the same rows
 * MOE_ATTN_TILE_KEYS keys on) on their way while this one computes (a prefetch past the cache's
 * end is dropped, never a fault), and the rows past n_key up to a multiple of 16 keys zeroed. */
MOE_INLINE void avx2_attn_prefetch_next(const void *row, int64_t stride, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch((const char *)row + MOE_ATTN_TILE_KEYS * stride + b, _MM_HINT_T0);
}
/* The same into the L2 only: the AVX-512 kernels' Q8_0 tile sends its next tile's K (and V)
 * rows in one burst, which into the L1 stalled decode (bench/attention --rows 1 --tiled-only
 * --kv-type q8_0 --depth 16384 --layers 6, one thread, Zen 5, medians of 5 under load ~4-5:
 * 4.98 -> 4.24 ns per row x head x key; f16, whose prefetches go a few keys at a time, lost with
 * it: 5.33 -> 5.43; the AVX2 kernels' Q8_0 tile neither won nor lost: 6.98 -> 6.99). */
MOE_INLINE void avx2_attn_prefetch_next_l2(const void *row, int64_t stride, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch((const char *)row + MOE_ATTN_TILE_KEYS * stride + b, _MM_HINT_T1);
}
MOE_INLINE void avx2_attn_pad_keys(float *out, int n_key, int dim) {
    memset(out + (int64_t)n_key * dim, 0, sizeof(float) * (size_t)((-n_key & 15) * dim));
}

/* A Q8_0 cache's tile, for the integer mix (quant.h): its V block scales as f32 into the scratch,
 * block b's at scratch + b * AVX2_ATTN_VD (the pad key of a pair 0), and each key's largest
 * |scale| mk[j] (a NaN passed over), as the scalar reference takes them. Returns the scratch past
 * the scales, room for one block's value pairs (64 keys x 32 x 4 bytes). */
#define AVX2_ATTN_VD (MOE_ATTN_TILE_KEYS + 16) /* floats per block: the rows on cache lines */
MOE_INLINE int16_t *avx2_attn_v_scales(const moe_attn_tile_args *a, float *mk) {
    float *vd = a->scratch;
    for (int j = 0; j < a->n_key; j++) {
        const moe_block_q8_0 *vb =
            (const moe_block_q8_0 *)((const uint8_t *)a->v + j * a->v_stride);
        float m = 0.0f;
        for (int b = 0; b < a->dv / MOE_QK32; b++) {
            const float d = avx2_fp16(vb[b].d);
            vd[b * AVX2_ATTN_VD + j] = d;
            m = fabsf(d) > m ? fabsf(d) : m;
        }
        mk[j] = m;
    }
    for (int b = 0; b < a->dv / MOE_QK32 && a->n_key & 1; b++) vd[b * AVX2_ATTN_VD + a->n_key] = 0;
    return (int16_t *)(vd + a->dv / MOE_QK32 * AVX2_ATTN_VD);
}

/* moe_attn_exp's polynomial at either width (P: _mm256 or _mm512, T: its float vector): from x
 * and n = its nearest multiple of 1 / ln 2, the y that 2^n then scales. */
#define AVX_ATTN_EXP_POLY_FN(name, P, T)                                                           \
    MOE_INLINE T name(T x, T n) {                                                                  \
        T r = P##_fmadd_ps(n, P##_set1_ps(MOE_ATTN_EXP_LN2_A), x);                                 \
        r = P##_fmadd_ps(n, P##_set1_ps(MOE_ATTN_EXP_LN2_B), r);                                   \
        T p = P##_fmadd_ps(P##_set1_ps(MOE_ATTN_EXP_P0), r, P##_set1_ps(MOE_ATTN_EXP_P1));         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(MOE_ATTN_EXP_P2));                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(MOE_ATTN_EXP_P3));                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(MOE_ATTN_EXP_P4));                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(MOE_ATTN_EXP_P5));                                      \
        return P##_add_ps(P##_fmadd_ps(p, P##_mul_ps(r, r), r), P##_set1_ps(1.0f));                \
    }
AVX_ATTN_EXP_POLY_FN(avx2_attn_exp_poly, _mm256, __m256)

/* moe_attn_exp on 8 lanes, in its operations. */
MOE_INLINE __m256 avx2_attn_exp(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(MOE_ATTN_EXP_MIN), _CMP_GE_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(MOE_ATTN_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 y = avx2_attn_exp_poly(x, n);
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_and_ps(live, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e)));
}

#ifdef __AVX512F__ /* the files built with the avx512 flags */
/* moe_attn_exp on 16 lanes, in the AVX2 one's operations (half the instructions of running it
 * on each half). */
AVX_ATTN_EXP_POLY_FN(z_attn_exp_poly, _mm512, __m512)
MOE_INLINE __m512 z_attn_exp(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(MOE_ATTN_EXP_MIN), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(MOE_ATTN_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 y = z_attn_exp_poly(x, n);
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_maskz_mov_ps(live,
                               _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), e)));
}
#endif

#endif
