/* x86_avx2.c: AVX2 + FMA + F16C kernels -- the fused weight x activation dots of every type the
 * engine serves, and the activation conversions (Q8_0 / Q8_1 / Q8_K, F16, BF16).
 *
 * Built with -mavx2 -mfma -mf16c (Makefile, isa_of); kernels.c calls moe_kernels_fill_avx2
 * only on a CPU that runs them. Each dot decodes a block in registers into small integers,
 * forms the exact integer block sum with maddubs/madd, and accumulates block sum x float scale
 * product in float lanes: the integer part is exactly the reference's, only the float
 * summation order differs. A loop that works on several blocks at a time hands the blocks left
 * over to the scalar reference (the "scalar tail"). The codebook types' decodes and block sums
 * (x86_avx2_iq.h) serve the fast path's kernels too (fast_avx2.c). The trap: the
 * activation conversions must write the reference's bytes exactly (round half to even via cvtps,
 * the same float operations in the same order), or every dot moves by ~1e-3; test_kernels checks
 * them byte for byte. */
#include "x86_avx2_iq.h"

#include <math.h>
#include <string.h>

/* ==== Per-row steps of the many-row kernels ==== */

/* Sub-block sums are accumulated as int32 lanes; one float FMA per super-block with
 * d_w * d_x * mult (mult a power of two, so the product is what the reference forms). */
MOE_INLINE __m256 iq_accumulate(__m256 acc, float dw, const moe_block_q8_k *y, float mult,
                                __m256i sumi) {
    return _mm256_fmadd_ps(_mm256_set1_ps(dw * y->d * mult), _mm256_cvtepi32_ps(sumi), acc);
}

/* The many-row kernels' per-row steps, shared by every *_rows function below. */

/* acc[r] += d_w x d_x(r) x mult x sumi[r]: a super-block's float term, per row. */
MOE_INLINE void rows_accumulate(int R, __m256 *acc, float dw, const moe_block_q8_k *const *y,
                                float mult, const __m256i *sumi) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = iq_accumulate(acc[r], dw, y[r], mult, sumi[r]);
}
MOE_INLINE void rows_store(int R, const __m256 *acc, float *out, int64_t os) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r * os] = avx2_hsum_f32(acc[r]);
}

/* ==== 32-value blocks against Q8_0 / Q8_1 ==== */

/* Two blocks per step (two accumulators per row); an odd last block goes to the reference. */
MOE_INLINE void q32_q8_0_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                              int64_t os, size_t block_bytes, q32_decode_fn decode,
                              moe_dot_fn tail) {
    const uint8_t *p = w, *xb = x;
    const int64_t nb = n / MOE_QK32;
    __m256 acc[MOE_DOT_ROWS][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2)
        for (int u = 0; u < 2; u++) {
            float d, m;
            const __m256i q = decode(p + (size_t)(i + u) * block_bytes, &d, &m);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const moe_block_q8_0 *y = (const moe_block_q8_0 *)(xb + (size_t)r * xs) + i + u;
                const __m256 s = _mm256_cvtepi32_ps(avx2_dot_i8(q, avx2_load(y->qs)));
                acc[r][u] = _mm256_fmadd_ps(_mm256_set1_ps(d * avx2_fp16(y->d)), s, acc[r][u]);
            }
        }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const moe_block_q8_0 *y = (const moe_block_q8_0 *)(xb + (size_t)r * xs);
        float sum = avx2_hsum_f32(_mm256_add_ps(acc[r][0], acc[r][1]));
        if (i < nb) sum += tail(p + (size_t)i * block_bytes, y + i, (nb - i) * MOE_QK32);
        out[r * os] = sum;
    }
}

/* Against Q8_1: unsigned q (<= 31) times x, plus the min times Q8_1's s = d_x * sum(x_q). */
MOE_INLINE void q32_q8_1_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                              int64_t os, size_t block_bytes, q32_decode_fn decode) {
    const uint8_t *p = w, *xb = x;
    __m256 acc[MOE_DOT_ROWS];
    float mins[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0;
    for (int64_t i = 0; i < n / MOE_QK32; i++) {
        float d, m;
        const __m256i q = decode(p + (size_t)i * block_bytes, &d, &m);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const moe_block_q8_1 *y = (const moe_block_q8_1 *)(xb + (size_t)r * xs) + i;
            const __m256i p32 =
                _mm256_madd_epi16(avx2_mul_u8_i8(q, avx2_load(y->qs)), _mm256_set1_epi16(1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * avx2_fp16(y->d)), _mm256_cvtepi32_ps(p32),
                                     acc[r]);
            mins[r] += m * avx2_fp16(y->s);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r * os] = avx2_hsum_f32(acc[r]) + mins[r];
}

#define Q32_DOT_Q8_0(t)                                                                            \
    MOE_DOT_AND_ROWS(dot_##t, dot_rows_##t, q32_q8_0_rows, sizeof(moe_block_##t), decode_##t,      \
                     moe_ref_##t##_dot)
#define Q32_DOT_Q8_1(t)                                                                            \
    MOE_DOT_AND_ROWS(dot_##t, dot_rows_##t, q32_q8_1_rows, sizeof(moe_block_##t), decode_##t)
Q32_DOT_Q8_0(q4_0)
Q32_DOT_Q8_0(q5_0)
Q32_DOT_Q8_0(q8_0)
Q32_DOT_Q8_0(iq4_nl)
Q32_DOT_Q8_0(mxfp4)
Q32_DOT_Q8_1(q4_1)
Q32_DOT_Q8_1(q5_1)

/* ==== K quants against Q8_K ==== */

/* Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; the min term comes from the
 * Q8_K bsums (pairs summed to 32-value sums). The block's nibbles (and fifth bits, Q5_K) are
 * decoded once and used for every row. */
MOE_INLINE void k4_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                        int64_t os, bool q5) {
    const uint8_t *xb = x;
    __m256 acc[MOE_DOT_ROWS];
    __m128 acc_min[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), acc_min[r] = _mm_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const avx2_k4_block b = avx2_k4_at(w, i, q5);
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m256i sumi[MOE_DOT_ROWS];
        avx2_k4_rows_begin(R, xb, xs, i, &b, y, acc_min);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        avx2_k4_sums(R, &b, y, sumi);
        avx2_k4_rows_end(R, &b, y, sumi, acc);
    }
    avx2_k4_rows_store(R, acc, acc_min, out, os);
}
MOE_DOT_AND_ROWS(dot_q4_k, dot_rows_q4_k, k4_rows, false)
MOE_DOT_AND_ROWS(dot_q5_k, dot_rows_q5_k, k4_rows, true)

MOE_INLINE void q6_k_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                          int64_t os, int unused) {
    (void)unused;
    const moe_block_q6_k *b = w;
    const uint8_t *xb = x;
    __m256 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m256i sumi[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + i;
            sumi[r] = _mm256_setzero_si256();
        }
        avx2_q6_k_sums(R, &b[i], y, sumi);
        rows_accumulate(R, acc, avx2_fp16(b[i].d), y, 1.0f, sumi); /* d_x d_w: exact as d_w d_x */
    }
    rows_store(R, acc, out, os);
}
MOE_DOT_AND_ROWS(dot_q6_k, dot_rows_q6_k, q6_k_rows, 0)

/* Q2_K: 2-bit q, 4-bit scale and min per 16 values; min term from the bsums. */
/* Q2_K and Q3_K (q3): 2-bit values and a scale per 16 values. Q2_K: 4-bit scales and mins,
 * the min term from the bsums. Q3_K: a high bit from hmask and value - 4 (the -4 from the
 * bsums), 6-bit scales. Each weight step decoded once for the R rows. */
MOE_INLINE void k23_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                         int64_t os, bool q3) {
    const uint8_t *xb = x;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc[MOE_DOT_ROWS], acc_min[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = acc_min[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const moe_block_q2_k *b2 = q3 ? NULL : (const moe_block_q2_k *)w + i;
        const moe_block_q3_k *b3 = q3 ? (const moe_block_q3_k *)w + i : NULL;
        const __m128i raw = q3 ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)b2->scales);
        const __m128i sc = q3 ? avx2_k3_scales(b3->scales) : _mm_and_si128(raw, low4);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m256i sumi[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + i;
            if (q3) {
                const __m256i offset =
                    _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), avx2_bsums(y[r]));
                sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 2));
            } else {
                const __m256i msum = _mm256_madd_epi16(mins, avx2_bsums(y[r]));
                acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r]->d * avx2_fp16(b2->dmin)),
                                             _mm256_cvtepi32_ps(msum), acc_min[r]);
                sumi[r] = _mm256_setzero_si256();
            }
        }
        const __m256i hm = q3 ? avx2_load(b3->hmask) : _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i q2 = avx2_load((q3 ? b3->qs : b2->qs) + 32 * h);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * k), _mm256_set1_epi8(3));
                if (q3) { /* the high bit of value 128h + 32k + l: bit 4h + k of hmask[l] -> 2 */
                    const int bit = 4 * h + k;
                    v = _mm256_or_si256(v,
                                        _mm256_and_si256(bit <= 2 ? _mm256_slli_epi16(hm, 2 - bit)
                                                                  : _mm256_srli_epi16(hm, bit - 2),
                                                         _mm256_set1_epi8(4)));
                }
                const __m256i scale = avx2_scale_pair16(sc, 8 * h + 2 * k);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i p = avx2_mul_u8_i8(v, avx2_load(y[r]->qs + 128 * h + 32 * k));
                    sumi[r] = _mm256_add_epi32(sumi[r], avx2_scale16(p, scale));
                }
            }
        }
        const float dw = avx2_fp16(q3 ? b3->d : b2->d);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] =
                _mm256_fmadd_ps(_mm256_set1_ps(y[r]->d * dw), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        out[r * os] =
            q3 ? avx2_hsum_f32(acc[r]) : avx2_hsum_f32(acc[r]) - avx2_hsum_f32(acc_min[r]);
}
MOE_DOT_AND_ROWS(dot_q2_k, dot_rows_q2_k, k23_rows, false)
MOE_DOT_AND_ROWS(dot_q3_k, dot_rows_q3_k, k23_rows, true)

/* ==== IQ types against Q8_K (their decodes: x86_avx2_iq.h) ==== */

/* The exact path: each block's lanes times d_w d_x mult into float lanes, rows in groups. */
MOE_INLINE void iq_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                        int64_t os, iq_block_fn block, size_t block_bytes, float mult) {
    const uint8_t *xb = x;
    __m256 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m256i sumi[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + i,
            sumi[r] = _mm256_setzero_si256();
        const float d = block(R, (const uint8_t *)w + (size_t)i * block_bytes, y, sumi);
        rows_accumulate(R, acc, d, y, mult, sumi);
    }
    rows_store(R, acc, out, os);
}
#define IQ_DOT(t, mult)                                                                            \
    MOE_DOT_AND_ROWS(dot_##t, dot_rows_##t, iq_rows, t##_block, sizeof(moe_block_##t), mult)
IQ_DOT(iq2_xxs, 0.125f)
IQ_DOT(iq2_xs, 0.125f)
IQ_DOT(iq2_s, 0.125f)
IQ_DOT(iq3_xxs, 0.25f)
IQ_DOT(iq3_s, 1.0f)
IQ_DOT(iq1_s, 0.125f)
IQ_DOT(iq1_m, 0.125f)
IQ_DOT(iq4_xs, 1.0f)

/* ==== Float types ==== */

/* 8 floats from 8 stored values. */
MOE_INLINE __m256 load8_f32(const void *p) {
    return _mm256_loadu_ps(p);
}
MOE_INLINE __m256 load8_f16(const void *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
MOE_INLINE __m256 load8_bf16(const void *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Four accumulators over 32 values per step, then 8 at a time, then the reference's tail. The
 * products are exact in float for F16 / BF16 (11- / 8-bit mantissas), so only the sum order
 * differs from the reference. */
MOE_FLOAT_ROWS(float_rows, __m256, 8, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_add_ps,
               avx2_hsum_f32)
MOE_DOT_AND_ROWS(dot_f32, dot_rows_f32, float_rows, 4, load8_f32, moe_ref_f32_dot)
MOE_DOT_AND_ROWS(dot_f16, dot_rows_f16, float_rows, 2, load8_f16, moe_ref_f16_dot)
MOE_DOT_AND_ROWS(dot_bf16, dot_rows_bf16, float_rows, 2, load8_bf16, moe_ref_bf16_dot)

/* ==== Activation conversions (byte-identical to the reference quantizers) ==== */

MOE_INLINE __m256 abs_ps(__m256 v) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}
MOE_INLINE float hmax_f32(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* 32 int32 (four vectors, in order) to 32 int8 in order (saturating; values are |v| <= 127). */
MOE_INLINE __m256i pack32_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 activations to int8 with 127 / amax, halves to even (cvtps under the default rounding). */
MOE_INLINE float q8_32_act(const float *x, int8_t q[32], int32_t *sum) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_loadu_ps(x + 8 * k), m = _mm256_max_ps(m, abs_ps(v[k]));
    const float amax = hmax_f32(m);
    const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m256i r[4];
    for (int k = 0; k < 4; k++) r[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
    const __m256i packed = pack32_i8(r[0], r[1], r[2], r[3]);
    _mm256_storeu_si256((__m256i *)q, packed);
    *sum = avx2_hsum_i32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed), _mm256_set1_epi16(1)));
    return amax / 127.0f;
}
static void quantize_q8_0(const float *x, void *out, int64_t n) {
    moe_block_q8_0 *b = out;
    int32_t sum;
    for (int64_t i = 0; i < n / MOE_QK32; i++)
        b[i].d = moe_f32_to_fp16(q8_32_act(x + MOE_QK32 * i, b[i].qs, &sum));
}
static void quantize_q8_1(const float *x, void *out, int64_t n) {
    moe_block_q8_1 *b = out;
    int32_t sum;
    for (int64_t i = 0; i < n / MOE_QK32; i++) {
        const float d = q8_32_act(x + MOE_QK32 * i, b[i].qs, &sum);
        b[i].d = moe_f32_to_fp16(d);
        b[i].s = moe_f32_to_fp16(d * (float)sum);
    }
}

/* Q8_K: scale -127 / max (max = the first value of largest magnitude, with its sign), clamp at
 * 127, d = 1 / scale; bsums over 16 values. */
static void quantize_q8_k(const float *x, void *out, int64_t n) {
    moe_block_q8_k *b = out;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 32; k++) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8 * k)));
        const float amax = hmax_f32(m);
        if (amax == 0.0f) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        int j = 0;
        while (fabsf(x[j]) != amax) j++;
        const float iscale = -127.0f / x[j];
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i top = _mm256_set1_epi32(127);
        for (int k = 0; k < 8; k++) {
            __m256i r[4];
            for (int u = 0; u < 4; u++)
                r[u] = _mm256_min_epi32(
                    _mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 32 * k + 8 * u))),
                    top);
            const __m256i q = pack32_i8(r[0], r[1], r[2], r[3]);
            _mm256_storeu_si256((__m256i *)(b[i].qs + 32 * k), q);
            /* sums of 4, then of 16 within each 128-bit half */
            __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                                          _mm256_set1_epi16(1));
            s = _mm256_hadd_epi32(s, s);
            s = _mm256_hadd_epi32(s, s);
            b[i].bsums[2 * k] = (int16_t)_mm256_extract_epi32(s, 0);
            b[i].bsums[2 * k + 1] = (int16_t)_mm256_extract_epi32(s, 4);
        }
        b[i].d = 1 / iscale;
    }
}

static void quantize_f16(const float *x, void *out, int64_t n) {
    uint16_t *h = out;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = moe_f32_to_fp16(x[i]);
}

/* Round to nearest even in the integer domain; NaN becomes a quiet NaN (as moe_f32_to_bf16). */
static void quantize_bf16(const float *x, void *out, int64_t n) {
    uint16_t *h = out;
    int64_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int u = 0; u < 2; u++) {
            const __m256i v = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8 * u));
            const __m256i rounded =
                _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, bias),
                                                   _mm256_and_si256(_mm256_srli_epi32(v, 16), one)),
                                  16);
            const __m256i quiet =
                _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(0x40));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs_mask), inf);
            r[u] = _mm256_blendv_epi8(rounded, quiet, nan);
        }
        _mm256_storeu_si256((__m256i *)(h + i),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8));
    }
    for (; i < n; i++) h[i] = moe_f32_to_bf16(x[i]);
}

static void quantize_f32(const float *x, void *out, int64_t n) {
    memcpy(out, x, (size_t)n * sizeof(float));
}

/* ==== The table ==== */

/* ==== Attention over the KV cache (bit-exact with moe_ref_attn_*: mul then add, no FMA) ==== */

/* 8 values of a KV row from value i (a multiple of 8): F32, F16, or Q8_0 decoded as d * q. */
MOE_INLINE __m256 load8_kv(const void *x, moe_type kv_type, int i) {
    if (kv_type == MOE_TYPE_Q8_0) {
        const moe_block_q8_0 *b = (const moe_block_q8_0 *)x + i / MOE_QK32;
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + i % 32)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(avx2_fp16(b->d)));
    }
    return kv_type == MOE_TYPE_F16
               ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)))
               : _mm256_loadu_ps((const float *)x + i);
}

MOE_INLINE float attn_dot(const float *q, const void *k, moe_type kv_type, int n) {
    const int whole = n & ~31;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int i = 0; i < whole; i += 32)
        for (int a = 0; a < 4; a++)
            acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_loadu_ps(q + i + 8 * a),
                                                         load8_kv(k, kv_type, i + 8 * a)));
    /* the reference's fold: (0+2) + (1+3), lanes l + l+4, then (0+1) + (2+3) */
    const __m256 lane = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(lane), _mm256_extractf128_ps(lane, 1));
    float h[4];
    _mm_storeu_ps(h, half);
    float sum = (h[0] + h[1]) + (h[2] + h[3]);
    for (int d = whole; d < n; d++) { /* the tail one by one, onto the folded sum */
        const float prod = q[d] * moe_ref_kv_value(k, kv_type, d);
        sum += prod;
    }
    return sum;
}

static void attn_scores(const float *q, const void *k, int64_t stride_bytes, int64_t n_kv,
                        moe_type kv_type, int n, float scale, float *out) {
    for (int64_t j = 0; j < n_kv; j++)
        out[j] = attn_dot(q, (const uint8_t *)k + j * stride_bytes, kv_type, n) * scale;
}

/* y[d] += p[j] * v_j[d], key after key; 64 values of y stay in registers across all keys. */
void moe_avx2_attn_mix(float *y, const float *p, const void *v, int64_t stride_bytes, int64_t n_kv,
                       moe_type kv_type, int n) {
    int d = 0;
    for (; d + 64 <= n; d += 64) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_loadu_ps(y + d + 8 * u);
        for (int64_t j = 0; j < n_kv; j++) {
            const __m256 a = _mm256_set1_ps(p[j]);
            const void *vj = (const uint8_t *)v + (size_t)(j * stride_bytes);
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(a, load8_kv(vj, kv_type, d + 8 * u)));
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(y + d + 8 * u, acc[u]);
    }
    for (; d + 8 <= n; d += 8) {
        __m256 acc = _mm256_loadu_ps(y + d);
        for (int64_t j = 0; j < n_kv; j++) {
            const void *vj = (const uint8_t *)v + (size_t)(j * stride_bytes);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p[j]), load8_kv(vj, kv_type, d)));
        }
        _mm256_storeu_ps(y + d, acc);
    }
    if (d < n) /* F32 / F16 only: a Q8_0 row is whole blocks */
        moe_ref_attn_mix(y + d, p, (const uint8_t *)v + moe_type_row_bytes(kv_type, d),
                         stride_bytes, n_kv, kv_type, n - d);
}

/* ==== The fast path's attention tile (quant.h: moe_attn_tile_fn) ====
 *
 * The query vectors lie in the lanes (8 per register), so a score is one lane's fma chain over
 * d, the softmax a lane's own running max and sum, all in the reference's order. Scores: 4 keys
 * (broadcast from the f32 tile) x 16 query vectors, or 8 keys x 8 (8 chains in flight either
 * way: an fma's latency times its ports); mix: 4 query vectors (broadcast weights) x 16 output
 * values, the values loaded once for the 4. */

/* n_key rows of a KV tile as f32, dim values each, rows padded with zeros to a multiple of 16. */
static void attn_convert(const void *x, int64_t stride, moe_type kv_type, int n_key, int dim,
                         float *out) {
    const int64_t bytes = (int64_t)moe_type_row_bytes(kv_type, dim);
    for (int j = 0; j < n_key; j++) {
        const void *row = (const uint8_t *)x + j * stride;
        avx2_attn_prefetch_next(row, stride, bytes);
        float *o = out + (int64_t)j * dim;
        int d = 0;
        for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(o + d, load8_kv(row, kv_type, d));
        for (; d < dim; d++) o[d] = moe_ref_kv_value(row, kv_type, d);
    }
    avx2_attn_pad_keys(out, n_key, dim);
}

/* Scaled scores of keys j..j+nk-1 of the tile for nv registers of query vectors from vector
 * i0 (nk x nv = 8), into st[key][vector] (-inf where a vector does not see the key); maxima into
 * mx. */
MOE_INLINE void attn_scores8(const moe_attn_tile_args *a, const float *kc, int j, int nk, int i0,
                             int nv, const int32_t *lo, const int32_t *hi,
                             float (*st)[MOE_ATTN_TILE_QV], __m256 *mx) {
    __m256 acc[8][2];
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++)
        _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) acc[u][v] = _mm256_setzero_ps();
    const float *k0 = kc + (int64_t)j * a->dk;
    for (int d = 0; d < a->dk; d++) {
        __m256 q[2];
        _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) q[v] =
            _mm256_loadu_ps(a->qt + (int64_t)d * MOE_ATTN_TILE_QV + i0 + 8 * v);
        _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) {
            const __m256 k = _mm256_set1_ps(k0[(int64_t)u * a->dk + d]);
            _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) acc[u][v] =
                _mm256_fmadd_ps(q[v], k, acc[u][v]);
        }
    }
    for (int u = 0; u < nk && j + u < a->n_key; u++) {
        const __m256i key = _mm256_set1_epi32(j + u);
        for (int v = 0; v < nv; v++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(lo + i0 + 8 * v));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(hi + i0 + 8 * v));
            const __m256i blind =
                _mm256_or_si256(_mm256_cmpgt_epi32(l, key), _mm256_cmpgt_epi32(key, h));
            const __m256 s =
                _mm256_blendv_ps(_mm256_mul_ps(acc[u][v], _mm256_set1_ps(a->scale)),
                                 _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(blind));
            _mm256_storeu_ps(&st[j + u][i0 + 8 * v], s);
            mx[i0 / 8 + v] = _mm256_max_ps(mx[i0 / 8 + v], s);
        }
    }
}

/* A Q8_0 cache: integer scores (quant.h). A lane holds 4 values of one query vector, the key's
 * 4 values broadcast beside it, its sign moved onto the query (|k| x +-q: pairs <= 2 x 128 x
 * 127, so vpmaddubsw never saturates); exact int32 sums, then one fma per block. Keys
 * j..j+nk-1 against query registers v0.. (8 vectors each) over block blk, the float chain
 * carried in st between blocks; after the last, scaled and masked as attn_scores8 does. */
MOE_INLINE void attn_q8_keys8(const moe_attn_tile_args *a, int blk, int j, int nk, int v0, int nv,
                              const int32_t *lo, const int32_t *hi, float (*st)[MOE_ATTN_TILE_QV],
                              __m256 *mx) {
    const moe_block_q8_0 *kb[8];
    __m256i acc[8][2];
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) { /* keys past the tile: the last's */
        const int key = j + u < a->n_key ? j + u : a->n_key - 1;
        kb[u] = (const moe_block_q8_0 *)((const uint8_t *)a->k + key * a->k_stride) + blk;
        _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) acc[u][v] = _mm256_setzero_si256();
    }
    const int8_t *qq = a->qq + (int64_t)blk * 8 * MOE_ATTN_TILE_QV * 4 + 32 * v0;
    _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
        __m256i q[2];
        _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) q[v] =
            _mm256_loadu_si256((const __m256i *)(qq + (int64_t)t * MOE_ATTN_TILE_QV * 4 + 32 * v));
        _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) {
            int32_t k4;
            memcpy(&k4, kb[u]->qs + 4 * t, sizeof k4);
            const __m256i k = _mm256_set1_epi32(k4), ku = _mm256_abs_epi8(k);
            _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) acc[u][v] = _mm256_add_epi32(
                acc[u][v], _mm256_madd_epi16(_mm256_maddubs_epi16(ku, _mm256_sign_epi8(q[v], k)),
                                             _mm256_set1_epi16(1)));
        }
    }
    const bool last = blk + 1 == a->dk / MOE_QK32;
    const float *qd = a->qd + (int64_t)blk * MOE_ATTN_TILE_QV + 8 * v0;
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) { /* unrolled: acc stays in registers */
        if (j + u >= a->n_key) break;
        const __m256 kd = _mm256_set1_ps(avx2_fp16(kb[u]->d));
        const __m256i key = _mm256_set1_epi32(j + u);
        _Pragma("GCC unroll 2") for (int v = 0; v < nv; v++) {
            float *sj = &st[j + u][8 * (v0 + v)];
            const __m256 f = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(qd + 8 * v), kd),
                                             _mm256_cvtepi32_ps(acc[u][v]),
                                             blk ? _mm256_loadu_ps(sj) : _mm256_setzero_ps());
            if (!last) {
                _mm256_storeu_ps(sj, f);
                continue;
            }
            const __m256i l = _mm256_loadu_si256((const __m256i *)(lo + 8 * (v0 + v)));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(hi + 8 * (v0 + v)));
            const __m256i blind =
                _mm256_or_si256(_mm256_cmpgt_epi32(l, key), _mm256_cmpgt_epi32(key, h));
            const __m256 sc =
                _mm256_blendv_ps(_mm256_mul_ps(f, _mm256_set1_ps(a->scale)),
                                 _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(blind));
            _mm256_storeu_ps(sj, sc);
            mx[v0 + v] = _mm256_max_ps(mx[v0 + v], sc);
        }
    }
}

/* out[i..i+nq-1] += weights x values over the tile's keys for output values d..d+8 nd - 1. */
MOE_INLINE void attn_mix_rows8(const moe_attn_tile_args *a, const float *vc,
                               float (*st)[MOE_ATTN_TILE_QV], int i, int nq, int d, int nd) {
    __m256 acc[4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++)
        _Pragma("GCC unroll 2") for (int u = 0; u < nd; u++) acc[r][u] =
            _mm256_loadu_ps(a->out[i + r] + d + 8 * u);
    for (int j = 0; j < a->n_key; j++) {
        __m256 v[2];
        _Pragma("GCC unroll 2") for (int u = 0; u < nd; u++) v[u] =
            _mm256_loadu_ps(vc + (int64_t)j * a->dv + d + 8 * u);
        _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++) {
            const __m256 p = _mm256_set1_ps(st[j][i + r]);
            _Pragma("GCC unroll 2") for (int u = 0; u < nd; u++) acc[r][u] =
                _mm256_fmadd_ps(p, v[u], acc[r][u]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++)
        _Pragma("GCC unroll 2") for (int u = 0; u < nd; u++)
            _mm256_storeu_ps(a->out[i + r] + d + 8 * u, acc[r][u]);
}

/* The same for nq (1 or 4) query vectors over all dv output values: 16, then 8, then one by one. */
MOE_INLINE void attn_mix_block8(const moe_attn_tile_args *a, const float *vc,
                                float (*st)[MOE_ATTN_TILE_QV], int i, int nq) {
    int d = 0;
    for (; d + 16 <= a->dv; d += 16) attn_mix_rows8(a, vc, st, i, nq, d, 2);
    if (d + 8 <= a->dv) attn_mix_rows8(a, vc, st, i, nq, d, 1), d += 8;
    for (int r = 0; r < nq; r++)
        for (int e = d; e < a->dv; e++) {
            float y = a->out[i + r][e];
            for (int j = 0; j < a->n_key; j++)
                y = fmaf(st[j][i + r], vc[(int64_t)j * a->dv + e], y);
            a->out[i + r][e] = y;
        }
}

/* A Q8_0 cache's mix: integer sums (quant.h). Block b of the tile's V values as int16 pairs of
 * keys, out [n_pair][32][2] (the pad key's zero); the first block also sends the next tile's
 * rows on their way. */
static void attn_v_pairs8(const moe_attn_tile_args *a, int b, int16_t *out) {
    for (int j = 0; j < a->n_key; j += 2) {
        const uint8_t *r0 = (const uint8_t *)a->v + j * a->v_stride;
        const int8_t *q0 = ((const moe_block_q8_0 *)r0 + b)->qs;
        const int8_t *q1 =
            j + 1 < a->n_key ? ((const moe_block_q8_0 *)(r0 + a->v_stride) + b)->qs : NULL;
        if (b == 0) {
            const int64_t bytes = (int64_t)moe_type_row_bytes(MOE_TYPE_Q8_0, a->dv);
            avx2_attn_prefetch_next(r0, a->v_stride, bytes);
            if (q1) avx2_attn_prefetch_next(r0 + a->v_stride, a->v_stride, bytes);
        }
        for (int e = 0; e < MOE_QK32; e += 8) { /* values e..e+7: 8 pairs, one register */
            const __m128i k0 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(q0 + e)));
            const __m128i k1 = q1 ? _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(q1 + e)))
                                  : _mm_setzero_si128();
            _mm256_storeu_si256(
                (__m256i *)(out + 32 * j + 2 * e),
                _mm256_set_m128i(_mm_unpackhi_epi16(k0, k1), _mm_unpacklo_epi16(k0, k1)));
        }
    }
}

/* out[i..i+nq-1]'s values of block b += unit[i..] x the integer sums of the weights (int16
 * pairs beside the values' pairs, vpmaddwd) over the tile's pairs. */
MOE_INLINE void attn_mix_q8_rows8(const moe_attn_tile_args *a, const int16_t *vp,
                                  int32_t (*w)[MOE_ATTN_TILE_QV], int b, const float *unit, int i,
                                  int nq) {
    __m256i acc[2][4];
    _Pragma("GCC unroll 2") for (int r = 0; r < nq; r++)
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) acc[r][u] = _mm256_setzero_si256();
    for (int p = 0; p < (a->n_key + 1) / 2; p++) {
        __m256i v[4];
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) v[u] =
            _mm256_loadu_si256((const __m256i *)(vp + 64 * p + 16 * u));
        _Pragma("GCC unroll 2") for (int r = 0; r < nq; r++) {
            const __m256i wr = _mm256_set1_epi32(w[p][i + r]);
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) acc[r][u] =
                _mm256_add_epi32(acc[r][u], _mm256_madd_epi16(v[u], wr));
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < nq; r++)
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
        float *y = a->out[i + r] + MOE_QK32 * b + 8 * u;
        _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_set1_ps(unit[i + r]),
                                            _mm256_cvtepi32_ps(acc[r][u]), _mm256_loadu_ps(y)));
    }
}

static void attn_mix_q8(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV]) {
    int32_t w[MOE_ATTN_TILE_KEYS / 2][MOE_ATTN_TILE_QV];
    float mk[MOE_ATTN_TILE_KEYS], unit[MOE_ATTN_TILE_QV];
    const float *vd = a->scratch; /* the scales, then one block's value pairs */
    int16_t *vp = avx2_attn_v_scales(a, mk);
    const int nv = (a->nq + 7) / 8;
    for (int v = 0; v < nv; v++) { /* top, r and unit; the weights x r in st */
        __m256 top = _mm256_setzero_ps();
        for (int j = 0; j < a->n_key; j++)
            top = _mm256_max_ps(
                _mm256_mul_ps(_mm256_loadu_ps(&st[j][8 * v]), _mm256_set1_ps(mk[j])), top);
        const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(top, _mm256_setzero_ps(), _CMP_GT_OQ),
                                        _mm256_cmp_ps(top, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
        const __m256 w16 = _mm256_set1_ps((float)MOE_ATTN_W16);
        const __m256 r = _mm256_and_ps(ok, _mm256_div_ps(w16, top));
        _mm256_storeu_ps(unit + 8 * v, _mm256_and_ps(ok, _mm256_div_ps(top, w16)));
        for (int j = 0; j < a->n_key; j++)
            _mm256_storeu_ps(&st[j][8 * v], _mm256_mul_ps(_mm256_loadu_ps(&st[j][8 * v]), r));
    }
    for (int b = 0; b < a->dv / MOE_QK32; b++) {
        attn_v_pairs8(a, b, vp);
        for (int j = 0; j < a->n_key; j += 2) /* the weights: w[p][i] keys 2p, 2p + 1's */
            for (int v = 0; v < nv; v++) {
                const __m256 p1 =
                    j + 1 < a->n_key ? _mm256_loadu_ps(&st[j + 1][8 * v]) : _mm256_setzero_ps();
                const __m256i w0 = _mm256_cvtps_epi32(_mm256_mul_ps(
                    _mm256_loadu_ps(&st[j][8 * v]), _mm256_set1_ps(vd[b * AVX2_ATTN_VD + j])));
                const __m256i w1 = _mm256_cvtps_epi32(
                    _mm256_mul_ps(p1, _mm256_set1_ps(vd[b * AVX2_ATTN_VD + j + 1])));
                _mm256_storeu_si256((__m256i *)&w[j / 2][8 * v],
                                    _mm256_blend_epi16(w0, _mm256_slli_epi32(w1, 16), 0xaa));
            }
        int i = 0;
        for (; i + 2 <= a->nq; i += 2) attn_mix_q8_rows8(a, vp, w, b, unit, i, 2);
        for (; i < a->nq; i++) attn_mix_q8_rows8(a, vp, w, b, unit, i, 1);
    }
}

static void attn_tile8(const moe_attn_tile_args *a) {
    _Alignas(64) float st[MOE_ATTN_TILE_KEYS][MOE_ATTN_TILE_QV]; /* scores, then weights */
    float m[MOE_ATTN_TILE_QV], l[MOE_ATTN_TILE_QV], c[MOE_ATTN_TILE_QV];
    int32_t lo[MOE_ATTN_TILE_QV], hi[MOE_ATTN_TILE_QV];
    const int nv = (a->nq + 7) / 8;
    for (int i = 0; i < 8 * nv; i++) { /* lanes past nq: no key seen, nothing stored */
        m[i] = i < a->nq ? a->m[i] : -INFINITY;
        l[i] = i < a->nq ? a->l[i] : 0.0f;
        lo[i] = i < a->nq ? a->lo[i] : 1;
        hi[i] = i < a->nq ? a->hi[i] : 0;
    }
    __m256 mx[MOE_ATTN_TILE_QV / 8];
    for (int v = 0; v < nv; v++) mx[v] = _mm256_loadu_ps(m + 8 * v);
    if (a->kv_type == MOE_TYPE_Q8_0) {
        for (int j = 0; j < a->n_key; j++) /* the next tile's keys on their way */
            avx2_attn_prefetch_next((const uint8_t *)a->k + j * a->k_stride, a->k_stride,
                                    (int64_t)moe_type_row_bytes(MOE_TYPE_Q8_0, a->dk));
        for (int blk = 0; blk < a->dk / MOE_QK32; blk++)
            for (int v = 0; v < nv; v += 2) {
                if (v + 1 < nv)
                    for (int j = 0; j < a->n_key; j += 4)
                        attn_q8_keys8(a, blk, j, 4, v, 2, lo, hi, st, mx);
                else
                    for (int j = 0; j < a->n_key; j += 8)
                        attn_q8_keys8(a, blk, j, 8, v, 1, lo, hi, st, mx);
            }
    } else
        attn_convert(a->k, a->k_stride, a->kv_type, a->n_key, a->dk, a->scratch);
    for (int v = 0; v < nv && a->kv_type != MOE_TYPE_Q8_0; v += 2) {
        if (v + 1 < nv)
            for (int j = 0; j < a->n_key; j += 4)
                attn_scores8(a, a->scratch, j, 4, 8 * v, 2, lo, hi, st, mx);
        else
            for (int j = 0; j < a->n_key; j += 8)
                attn_scores8(a, a->scratch, j, 8, 8 * v, 1, lo, hi, st, mx);
    }
    for (int v = 0; v < nv; v++) { /* the running max moves, then the weights and their sum */
        const __m256 old = _mm256_loadu_ps(m + 8 * v);
        const __m256 rescale =
            _mm256_blendv_ps(_mm256_set1_ps(1.0f), avx2_attn_exp(_mm256_sub_ps(old, mx[v])),
                             _mm256_cmp_ps(mx[v], old, _CMP_GT_OQ));
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(l + 8 * v), rescale);
        for (int j = 0; j < a->n_key; j++) {
            const __m256 p = avx2_attn_exp(_mm256_sub_ps(_mm256_loadu_ps(&st[j][8 * v]), mx[v]));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(&st[j][8 * v], p);
        }
        _mm256_storeu_ps(m + 8 * v, mx[v]);
        _mm256_storeu_ps(l + 8 * v, sum);
        _mm256_storeu_ps(c + 8 * v, rescale);
    }
    for (int i = 0; i < a->nq; i++) {
        a->m[i] = m[i], a->l[i] = l[i];
        if (c[i] == 1.0f) continue;
        float *y = a->out[i];
        int d = 0;
        for (; d + 8 <= a->dv; d += 8)
            _mm256_storeu_ps(
                y + d, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(y + d), _mm256_set1_ps(c[i])),
                                     _mm256_setzero_ps()));
        for (; d < a->dv; d++) y[d] = y[d] * c[i] + 0.0f;
    }
    if (a->kv_type == MOE_TYPE_Q8_0) {
        attn_mix_q8(a, st);
        return;
    }
    attn_convert(a->v, a->v_stride, a->kv_type, a->n_key, a->dv, a->scratch);
    int i = 0;
    for (; i + 4 <= a->nq; i += 4) attn_mix_block8(a, a->scratch, st, i, 4);
    for (; i < a->nq; i++) attn_mix_block8(a, a->scratch, st, i, 1);
}

void moe_kernels_fill_avx2(moe_kernels *k) {
    moe_type_kernels *types = k->types;
    k->attn_scores = attn_scores;
    k->attn_mix = moe_avx2_attn_mix;
    k->attn_tile = attn_tile8;
    static const struct {
        moe_type type;
        moe_dot_fn dot;
        moe_dot_rows_fn dot_rows; /* NULL: row by row through dot */
    } dots[] = {
        {MOE_TYPE_F32, dot_f32, dot_rows_f32},
        {MOE_TYPE_F16, dot_f16, dot_rows_f16},
        {MOE_TYPE_BF16, dot_bf16, dot_rows_bf16},
        {MOE_TYPE_Q4_0, dot_q4_0, dot_rows_q4_0},
        {MOE_TYPE_Q4_1, dot_q4_1, dot_rows_q4_1},
        {MOE_TYPE_Q5_0, dot_q5_0, dot_rows_q5_0},
        {MOE_TYPE_Q5_1, dot_q5_1, dot_rows_q5_1},
        {MOE_TYPE_Q8_0, dot_q8_0, dot_rows_q8_0},
        {MOE_TYPE_IQ4_NL, dot_iq4_nl, dot_rows_iq4_nl},
        {MOE_TYPE_MXFP4, dot_mxfp4, dot_rows_mxfp4},
        {MOE_TYPE_Q2_K, dot_q2_k, dot_rows_q2_k},
        {MOE_TYPE_Q3_K, dot_q3_k, dot_rows_q3_k},
        {MOE_TYPE_Q4_K, dot_q4_k, dot_rows_q4_k},
        {MOE_TYPE_Q5_K, dot_q5_k, dot_rows_q5_k},
        {MOE_TYPE_Q6_K, dot_q6_k, dot_rows_q6_k},
        {MOE_TYPE_IQ2_XXS, dot_iq2_xxs, dot_rows_iq2_xxs},
        {MOE_TYPE_IQ2_XS, dot_iq2_xs, dot_rows_iq2_xs},
        {MOE_TYPE_IQ2_S, dot_iq2_s, dot_rows_iq2_s},
        {MOE_TYPE_IQ3_XXS, dot_iq3_xxs, dot_rows_iq3_xxs},
        {MOE_TYPE_IQ3_S, dot_iq3_s, dot_rows_iq3_s},
        {MOE_TYPE_IQ1_S, dot_iq1_s, dot_rows_iq1_s},
        {MOE_TYPE_IQ1_M, dot_iq1_m, dot_rows_iq1_m},
        {MOE_TYPE_IQ4_XS, dot_iq4_xs, dot_rows_iq4_xs},
    };
    for (size_t i = 0; i < sizeof dots / sizeof dots[0]; i++)
        moe_kernels_set_dot(types, dots[i].type, dots[i].dot, dots[i].dot_rows, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_Q8_0, quantize_q8_0, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_Q8_1, quantize_q8_1, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_Q8_K, quantize_q8_k, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_F16, quantize_f16, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_BF16, quantize_bf16, MOE_ISA_AVX2);
    moe_kernels_set_quantize(types, MOE_TYPE_F32, quantize_f32, MOE_ISA_AVX2);
}
