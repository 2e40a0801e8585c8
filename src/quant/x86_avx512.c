/* x86_avx512.c: the AVX-512 kernels, written once and compiled twice (Makefile): as
 * x86_avx512.o for the avx512 table (MOE_AVX512_VNNI=0: F/BW/VL/DQ, 8-bit dots with
 * vpmaddubsw + vpmaddwd) and as avx512vnni/x86_avx512.o for the avx512vnni table
 * (MOE_AVX512_VNNI=1: the same code with vpdpbusd / vpdpwssd, and VBMI). Each build exports
 * its own fill function (moe_kernels_fill_avx512 / _avx512vnni); everything else is static.
 *
 * 64 values per register. What AVX-512 adds over the AVX2 file: sign bits become a __mmask64,
 * applied to the activations with one masked subtract; vpermw spreads sub-block scales; the
 * codebook types decode a block once into registers or an L1 record for every activation row
 * (z_iqb / z_iqd), with VBMI looking IQ3 grids and ksigns up by vpermi2b; the types that carry
 * ggml parity (Q8_0, Q4_K and kin) reproduce the AVX2 kernels' floats. Types without a kernel
 * here keep the AVX2 one (kernels.c copies the lower table first). The trap: vpdpbusd does not
 * saturate where vpmaddubsw does, so the unsigned operand must obey the AVX2 file's bound
 * (<= 128) for both builds to give the same integers.
 *
 * Costs quoted in comments are TSC cycles (2.6 GHz here) per 256 values: the best of many
 * passes of the table's dot / dot_rows over rows of 2048 in L2, one thread. The machine is
 * shared, so they move by 10 % or more between runs; `make bench` gives medians in GB/s. */
#include "x86_avx2.h"

#ifndef MOE_AVX512_VNNI
#error "build x86_avx512.c with -DMOE_AVX512_VNNI=0 or 1 (the Makefile does)"
#elif MOE_AVX512_VNNI && !(defined(__AVX512VNNI__) && defined(__AVX512VBMI__))
#error "MOE_AVX512_VNNI=1 needs the avx512vnni flags (-mavx512vnni -mavx512vbmi)"
#endif

/* ==== The two builds: the 8- and 16-bit multiply-accumulates ==== */

#if MOE_AVX512_VNNI
#define Z_LEVEL MOE_ISA_AVX512VNNI
#define Z_FILL  moe_kernels_fill_avx512vnni
/* acc + sum of 4 adjacent u8 x i8 products per int32 lane */
MOE_INLINE __m512i z_dp_u8_i8(__m512i acc, __m512i u, __m512i s) {
    return _mm512_dpbusd_epi32(acc, u, s);
}
/* acc + sum of 2 adjacent i16 x i16 products per int32 lane */
MOE_INLINE __m512i z_dp_i16(__m512i acc, __m512i a, __m512i b) {
    return _mm512_dpwssd_epi32(acc, a, b);
}
#else
#define Z_LEVEL MOE_ISA_AVX512
#define Z_FILL  moe_kernels_fill_avx512
MOE_INLINE __m512i z_dp_u8_i8(__m512i acc, __m512i u, __m512i s) {
    return _mm512_add_epi32(acc,
                            _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
MOE_INLINE __m512i z_dp_i16(__m512i acc, __m512i a, __m512i b) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}
#endif

/* ==== Helpers ==== */

MOE_INLINE __m512i z_join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
MOE_INLINE __m512i z_load(const void *p) {
    return _mm512_loadu_si512(p);
}
MOE_INLINE __m512i z_load2(const void *lo, const void *hi) {
    return z_join(avx2_load(lo), avx2_load(hi));
}
MOE_INLINE uint64_t z_load_u64(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
/* x negated where bits of neg are set (one bit per byte). */
MOE_INLINE __m512i z_apply_signs(__m512i x, __mmask64 neg) {
    return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
}
/* int16 lane indices for vpermw: [a x16 | b x16] */
MOE_INLINE __m512i z_idx2(int a, int b) {
    return _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)a),
                                   _mm512_set1_epi16((short)b));
}
/* int16 lane indices for vpermw: [a x8 | a+1 x8 | a+2 x8 | a+3 x8] */
MOE_INLINE __m512i z_idx4(int a) {
    const __m512i v = z_idx2(a, a + 2);
    return _mm512_mask_add_epi16(v, 0xff00ff00u, v, _mm512_set1_epi16(1));
}
/* Scales (int16 lanes 0..15 of sc) spread over the int16 pair sums of 64 values. */
MOE_INLINE __m512i z_scales(__m512i sc, __m512i idx) {
    return _mm512_permutexvar_epi16(idx, sc);
}
MOE_INLINE __m512i z_from_256(__m256i v) {
    return _mm512_zextsi256_si512(v);
}
MOE_INLINE __m256i z_join128(__m128i lo, __m128i hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
MOE_INLINE __m512i z_from_128(__m128i v) {
    return _mm512_zextsi128_si512(v);
}

/* ==== Per-row steps of the many-row kernels ==== */

MOE_INLINE __m512 z_iq_accumulate(__m512 acc, float dw, const moe_block_q8_k *y, float mult,
                                  __m512i sumi) {
    return _mm512_fmadd_ps(_mm512_set1_ps(dw * y->d * mult), _mm512_cvtepi32_ps(sumi), acc);
}

/* The many-row kernels' per-row steps, shared by the *_rows functions. */

/* sumi[r] += scale x (g times row r's 64 activations at byte `at`, negated where neg is set). */
MOE_INLINE void z_rows_signed_madd(int R, __m512i g, __mmask64 neg, __m512i scale,
                                   const moe_block_q8_k *const *y, int at, __m512i *sumi) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m512i xs = z_apply_signs(z_load(y[r]->qs + at), neg);
        sumi[r] = z_dp_i16(sumi[r], _mm512_maddubs_epi16(g, xs), scale);
    }
}
MOE_INLINE void z_rows_accumulate(int R, __m512 *acc, float dw, const moe_block_q8_k *const *y,
                                  float mult, const __m512i *sumi) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = z_iq_accumulate(acc[r], dw, y[r], mult, sumi[r]);
}
MOE_INLINE void z_rows_store(int R, const __m512 *acc, float *out, int64_t os) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r * os] = _mm512_reduce_add_ps(acc[r]);
}

/* ==== Types whose floats follow the AVX2 kernels ====
 *
 * Q8_0 and Q4_K carry the ../shared parity models (qwen3moe-mixed, deepseek2-q8_0-q4_k), and
 * those move by 1e-2 instead of 1e-7 against llama.cpp when a dot sums its float block terms in
 * another order than ggml-cpu's x86 kernels (one rounding can flip a quantized activation in a
 * later layer). So the kernels below produce, per block, the AVX2 kernels' integer lanes and
 * then do the AVX2 kernels' float operations on them: only the integer work, which is exact
 * in any order, is done 64 bytes at a time. The same holds for the other 32-value types and
 * Q5_K, which share these kernels. */

/* ---- 32-value blocks against Q8_0: two blocks per register, as the AVX2 kernel's two
 * accumulators (block i in the low half, i+1 in the high half). W weight rows (ws bytes
 * apart) against R activation rows: each activation pair is loaded and scaled once for all W;
 * out[r * os + v] is weight row v against activation row r. ---- */
MOE_INLINE void z_q32_tile(int W, const void *w, size_t ws, const void *x, size_t xs, int R,
                           int64_t n, float *out, int64_t os, size_t block_bytes,
                           q32_decode_fn decode, moe_dot_fn tail) {
    const uint8_t *xb = x;
    const int64_t nb = n / MOE_QK32;
    __m512 acc[2][MOE_DOT_ROWS];
    for (int v = 0; v < W; v++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[v][r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        __m512i mag[2];
        __mmask64 neg[2];
        __m512 dw[2];
        for (int v = 0; v < W; v++) {
            const uint8_t *p = (const uint8_t *)w + v * ws + (size_t)i * block_bytes;
            float d0, d1, m;
            const __m512i q = z_join(decode(p, &d0, &m), decode(p + block_bytes, &d1, &m));
            mag[v] = _mm512_abs_epi8(q);
            neg[v] = _mm512_movepi8_mask(q);
            dw[v] = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const moe_block_q8_0 *y = (const moe_block_q8_0 *)(xb + (size_t)r * xs) + i;
            const __m512i x8 = z_load2(y[0].qs, y[1].qs);
            const __m512 dx = _mm512_insertf32x8(_mm512_set1_ps(avx2_fp16(y[0].d)),
                                                 _mm256_set1_ps(avx2_fp16(y[1].d)), 1);
            for (int v = 0; v < W; v++) {
                const __m512i s =
                    z_dp_u8_i8(_mm512_setzero_si512(), mag[v], z_apply_signs(x8, neg[v]));
                acc[v][r] =
                    _mm512_fmadd_ps(_mm512_mul_ps(dw[v], dx), _mm512_cvtepi32_ps(s), acc[v][r]);
            }
        }
    }
    for (int v = 0; v < W; v++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const moe_block_q8_0 *y = (const moe_block_q8_0 *)(xb + (size_t)r * xs);
            const __m512 a = acc[v][r];
            float sum = avx2_hsum_f32(
                _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
            if (i < nb)
                sum += tail((const uint8_t *)w + v * ws + (size_t)i * block_bytes, y + i,
                            (nb - i) * MOE_QK32);
            out[r * os + v] = sum;
        }
}
MOE_INLINE void z_q32_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                           int64_t os, size_t block_bytes, q32_decode_fn decode, moe_dot_fn tail) {
    z_q32_tile(1, w, 0, x, xs, R, n, out, os, block_bytes, decode, tail);
}
/* Two weight rows: R = MOE_DOT_ROWS at a time, then the rest in one pass. */
MOE_INLINE void z_q32_rows2(const void *w, size_t ws, const void *x, size_t xs, int64_t n_rows,
                            int64_t n, float *out, int64_t os, size_t block_bytes,
                            q32_decode_fn decode, moe_dot_fn tail) {
    const uint8_t *xb = x;
    int64_t r = 0;
#define Z_Q32_PAIR(R, unused)                                                                      \
    z_q32_tile(2, w, ws, xb + (size_t)r * xs, xs, R, n, out + r * os, os, block_bytes, decode, tail)
    MOE_ROW_GROUPS(r, n_rows, Z_Q32_PAIR, 0);
#undef Z_Q32_PAIR
}

#define Z_Q32_KERNELS(t)                                                                           \
    MOE_DOT_AND_ROWS(z_dot_##t, z_dot_rows_##t, z_q32_rows, sizeof(moe_block_##t), decode_##t,     \
                     moe_ref_##t##_dot)                                                            \
    static void z_dot_rows2_##t(const void *w, size_t ws, const void *x, size_t xs,                \
                                int64_t n_rows, int64_t n, float *out, int64_t os) {               \
        z_q32_rows2(w, ws, x, xs, n_rows, n, out, os, sizeof(moe_block_##t), decode_##t,           \
                    moe_ref_##t##_dot);                                                            \
    }
Z_Q32_KERNELS(q4_0)
Z_Q32_KERNELS(q5_0)
Z_Q32_KERNELS(q8_0)
Z_Q32_KERNELS(iq4_nl)
Z_Q32_KERNELS(mxfp4)

/* ---- Q4_K / Q5_K (q5: the fifth bits in qh). A register of 64 qs bytes holds the AVX2
 * kernel's steps j = 2jj (low half) and 2jj + 1 (high half); the halves are added before the
 * float step, which gives the AVX2 kernel's eight integer lanes. ---- */
MOE_INLINE void z_k4_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                          int64_t os, bool q5) {
    const uint8_t *xb = x;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m256 acc[MOE_DOT_ROWS];
    __m128 acc_min[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), acc_min[r] = _mm_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const avx2_k4_block b = avx2_k4_at(w, i, q5);
        const __m512i sc = z_from_128(_mm_cvtepu8_epi16(b.sm));
        const __m512i hb = q5 ? _mm512_broadcast_i64x4(avx2_load(b.qh)) : _mm512_setzero_si512();
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m512i sumi[MOE_DOT_ROWS];
        avx2_k4_rows_begin(R, xb, xs, i, &b, y, acc_min);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int jj = 0; jj < 2; jj++) {
            const __m512i q = z_load(b.qs + 64 * jj);
            __m512i lo = _mm512_and_si512(q, low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            if (q5) { /* bit 2j of qh[l] is the fifth bit of the low value, bit 2j+1 the high */
                const __m512i blo =
                    _mm512_mask_blend_epi64(0xf0, _mm512_set1_epi8((char)(1 << (4 * jj))),
                                            _mm512_set1_epi8((char)(1 << (4 * jj + 2))));
                const __m512i bhi = _mm512_add_epi8(blo, blo);
                lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hb, blo), lo, bit4);
                hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hb, bhi), hi, bit4);
            }
            const __m512i slo = z_scales(sc, z_idx2(4 * jj, 4 * jj + 2));
            const __m512i shi = z_scales(sc, z_idx2(4 * jj + 1, 4 * jj + 3));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *yq = y[r]->qs + 128 * jj;
                sumi[r] = z_dp_i16(sumi[r], _mm512_maddubs_epi16(lo, z_load2(yq, yq + 64)), slo);
                sumi[r] =
                    z_dp_i16(sumi[r], _mm512_maddubs_epi16(hi, z_load2(yq + 32, yq + 96)), shi);
            }
        }
        __m256i s8[MOE_DOT_ROWS]; /* the halves added: the AVX2 kernel's eight lanes */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            s8[r] = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]),
                                     _mm512_extracti64x4_epi64(sumi[r], 1));
        avx2_k4_rows_end(R, &b, y, s8, acc);
    }
    avx2_k4_rows_store(R, acc, acc_min, out, os);
}
MOE_DOT_AND_ROWS(z_dot_q4_k, z_dot_rows_q4_k, z_k4_rows, false)
MOE_DOT_AND_ROWS(z_dot_q5_k, z_dot_rows_q5_k, z_k4_rows, true)

/* Q6_K: 64 ql bytes hold values 0..63 of a half in their low nibbles and 64..127 in their
 * high ones, in order; qh (32 bytes, broadcast) gives each its top two bits. q6 - 32 as in
 * the AVX2 kernel (the -32 from the bsums). */
MOE_INLINE void z_q6_k_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                            int64_t os, int unused) {
    (void)unused;
    const moe_block_q6_k *b = w;
    const uint8_t *xb = x;
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i shift_lo = z_idx2(0, 2), shift_hi = z_idx2(4, 6);
    __m512 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales));
        const __m512i sc = z_from_256(sc16);
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m512i sumi[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + i;
            const __m256i offset = _mm256_madd_epi16(sc16, avx2_bsums(y[r]));
            sumi[r] =
                z_from_256(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5)));
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ql = z_load(b[i].ql + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(avx2_load(b[i].qh + 32 * h));
            const __m512i vlo = _mm512_or_si512(
                _mm512_and_si512(ql, low4),
                _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, shift_lo), 4), top2));
            const __m512i vhi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, shift_hi), 4), top2));
            const __m512i slo = z_scales(sc, z_idx4(8 * h)), shi = z_scales(sc, z_idx4(8 * h + 4));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i plo = _mm512_maddubs_epi16(vlo, z_load(y[r]->qs + 128 * h));
                const __m512i phi = _mm512_maddubs_epi16(vhi, z_load(y[r]->qs + 128 * h + 64));
                sumi[r] = z_dp_i16(sumi[r], plo, slo);
                sumi[r] = z_dp_i16(sumi[r], phi, shi);
            }
        }
        z_rows_accumulate(R, acc, avx2_fp16(b[i].d), y, 1.0f, sumi); /* d_x d_w: exact as d_w d_x */
    }
    z_rows_store(R, acc, out, os);
}
MOE_DOT_AND_ROWS(z_dot_q6_k, z_dot_rows_q6_k, z_q6_k_rows, 0)

/* ==== IQ types ==== */

/* ---- Codebook types: each block decoded once into an L1 record, then read by every row ----
 *
 * A codebook lookup costs more than the multiply it feeds, so a block is decoded once into a
 * z_iqd record (magnitudes, sign bits, scales) for all the activation rows that meet it --
 * prefill, batched decode, the rows routed to one expert -- instead of once per four rows.
 * Single thread, weights in L2, 32 rows: IQ2_S 11.5 TSC cycles per row and block against 19.6
 * before, IQ3_S 11.3 against 21.4. How entries get into a record depends on the type: IQ2_S's
 * 8-byte entries are put together in registers and stored a line at a time; IQ3_S's 4-byte
 * entries are copied with plain loads and stores, their offsets computed 64 at a time in a
 * vector, a chunk of blocks ahead of the multiplies, because a line read of fresh 8-byte stores
 * waits for them to reach the cache (its matvec: 59 cycles a block, 64 with the 16-lane
 * vpgatherdd it replaces).
 *
 * The multiply is the one the fused kernels did, lane for lane (magnitudes x activations with
 * the weight's signs, pairs summed, times the scale of their 16 values, four values per int32
 * lane), so the floats are those of the earlier single-block kernels bit for bit. */
typedef struct {
    uint8_t g[256];  /* grid magnitudes, unsigned */
    uint64_t neg[4]; /* sign bits of values 64k.. */
    int16_t sc[16];  /* integer scale of values 16j..16j+15 */
    float d;         /* the block's float scale */
} __attribute__((aligned(64))) z_iqd;

/* A codebook block in registers: the magnitudes of its four 64-value chunks, its sign bits
 * (one word per chunk), its sixteen integer scales (one per 16 values), its float scale. */
typedef struct {
    __m512i g[4];
    uint64_t neg[4];
    __m256i sc;
    float d;
} z_iqb;

/* A type's decode, one of two kinds: into registers (z_iqb_fn), or into a record with the
 * magnitudes left to z_copy_entries, the byte offsets of its 64 four-byte entries written to
 * at instead (z_iqd_decode_fn). */
typedef void (*z_iqb_fn)(const void *block, z_iqb *out);
typedef void (*z_iqd_decode_fn)(const void *block, z_iqd *out, uint16_t *at);

/* The 64 four-byte grid entries at byte offsets at[] of grid, copied to dst two per 8-byte
 * store, the offsets read four per 8-byte load (the load ports are the limit). The asm keeps
 * GCC from merging the stores back into vector inserts (the cost this avoids) and from reading
 * the offsets out of the vector that stored them (vpextrw). */
MOE_INLINE void z_copy_entries(uint8_t *dst, const uint8_t *grid, const uint16_t *at) {
    __asm__ volatile("" ::: "memory");
#pragma GCC unroll 16
    for (int q = 0; q < 16; q++) {
        uint64_t four;
        memcpy(&four, at + 4 * q, 8);
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            uint32_t a, b;
            memcpy(&a, grid + (uint16_t)(four >> (32 * i)), 4);
            memcpy(&b, grid + (uint16_t)(four >> (32 * i + 16)), 4);
            const uint64_t v = a | (uint64_t)b << 32;
            __asm__("movq %1, %0" : "=m"(*(uint64_t *)(dst + 16 * q + 8 * i)) : "r"(v));
        }
    }
}

/* Four sign words into a record, one 8-byte store each: the multiply loop reads them back 8
 * bytes at a time, and a load that a wider store has to forward waits for that store to reach
 * the cache. */
MOE_INLINE void z_put_neg(z_iqd *o, const uint64_t neg[4]) {
    for (int k = 0; k < 4; k++) __asm__("movq %1, %0" : "=m"(o->neg[k]) : "r"(neg[k]));
}
/* The 32 sign bytes of a block (a bit per value) as four sign words. */
MOE_INLINE void z_sign_words(const uint8_t *src, uint64_t neg[4]) {
    for (int k = 0; k < 4; k++) neg[k] = z_load_u64(src + 8 * k);
}

#if MOE_AVX512_VNNI
/* ---- ksigns, for IQ2_XXS, IQ2_XS, IQ3_XXS (VBMI only: without it those keep the AVX2
 * kernels, whose scalar sign lookups are as fast as any this level could do) ---- */

/* Sign words from ksigns indices: value 8j + i of a block is negative where bit i of
 * moe_ksigns_iq2xs[idx[j]] is set (32 indices of 7 bits, one vpermi2b). */
MOE_INLINE void z_ksigns(__m256i idx, uint64_t neg[4]) {
    const uint8_t *t = moe_ksigns_iq2xs;
    const __m256i s = _mm512_castsi512_si256(
        _mm512_permutex2var_epi8(z_load(t), _mm512_castsi256_si512(idx), z_load(t + 64)));
    const __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
    neg[0] = (uint64_t)_mm_cvtsi128_si64(lo), neg[1] = (uint64_t)_mm_extract_epi64(lo, 1);
    neg[2] = (uint64_t)_mm_cvtsi128_si64(hi), neg[3] = (uint64_t)_mm_extract_epi64(hi, 1);
}
/* The 32 ksigns indices of 8 words holding four 7-bit fields each (bits 0, 7, 14, 21), word
 * after word: IQ2_XXS and IQ3_XXS. */
MOE_INLINE __m256i z_ksign_fields(__m256i words) {
    const __m256i at = _mm256_set1_epi64x(0x352e2720150e0700); /* 0 7 14 21 32 39 46 53 */
    return _mm256_and_si256(_mm256_multishift_epi64_epi8(at, words), _mm256_set1_epi8(0x7f));
}
/* Sixteen scales from eight 4-bit ones in the top bits of 8 words (2s + 1 for 32 values). */
MOE_INLINE __m256i z_top4_scales(__m256i words) {
    const __m256i s =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(words, 28), 1), _mm256_set1_epi32(1));
    return _mm256_or_si256(s, _mm256_slli_epi32(s, 16)); /* each word as two int16 lanes */
}
#endif

MOE_INLINE void z_iqd_from_regs(const z_iqb *b, z_iqd *o) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) _mm512_store_si512(o->g + 64 * k, b->g[k]);
    z_put_neg(o, b->neg);
    _mm256_store_si256((__m256i *)o->sc, b->sc);
    o->d = b->d;
}

/* ---- The types' decodes ---- */

/* IQ2_S: 32 entries of 8 values, index = qs byte | 2 qh bits << 8, put together in registers
 * (eight 64-bit loads per 64 values); a scale per 16 values. */
MOE_INLINE __m512i z_iq2_s_grid(const moe_block_iq2_s *b, int k) {
    const uint8_t *qs = b->qs + 8 * k;
    const unsigned h0 = b->qh[2 * k], h1 = b->qh[2 * k + 1];
    return z_join(avx2_grid4(moe_iq2s_grid[qs[0] | ((h0 << 8) & 0x300)],
                             moe_iq2s_grid[qs[1] | ((h0 << 6) & 0x300)],
                             moe_iq2s_grid[qs[2] | ((h0 << 4) & 0x300)],
                             moe_iq2s_grid[qs[3] | ((h0 << 2) & 0x300)]),
                  avx2_grid4(moe_iq2s_grid[qs[4] | ((h1 << 8) & 0x300)],
                             moe_iq2s_grid[qs[5] | ((h1 << 6) & 0x300)],
                             moe_iq2s_grid[qs[6] | ((h1 << 4) & 0x300)],
                             moe_iq2s_grid[qs[7] | ((h1 << 2) & 0x300)]));
}
MOE_INLINE void z_iqb_iq2_s(const void *block, z_iqb *o) {
    const moe_block_iq2_s *b = block;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) o->g[k] = z_iq2_s_grid(b, k);
    o->sc = _mm256_cvtepi8_epi16(avx2_iq2_scales16(b->scales));
    z_sign_words(b->qs + 32, o->neg);
    o->d = avx2_fp16(b->d);
}

#if MOE_AVX512_VNNI
/* IQ2_XXS: per 32 values 4 grid index bytes (8-value entries) and a word of four 7-bit ksigns
 * indices | a 4-bit scale << 28. Entries put together in registers, as IQ2_S's. */
MOE_INLINE void z_iqb_iq2_xxs(const void *block, z_iqb *o) {
    const moe_block_iq2_xxs *b = block;
    const uint8_t *q = (const uint8_t *)b->qs;
    const uint64_t *grid = moe_iq2xxs_grid;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const uint8_t *a = q + 16 * k, *c = a + 8;
        o->g[k] = z_join(avx2_grid4(grid[a[0]], grid[a[1]], grid[a[2]], grid[a[3]]),
                         avx2_grid4(grid[c[0]], grid[c[1]], grid[c[2]], grid[c[3]]));
    }
    /* the odd words of the 64 bytes: the sign-and-scale words */
    const __m256i words = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0), z_load(q)));
    z_ksigns(z_ksign_fields(words), o->neg);
    o->sc = z_top4_scales(words);
    o->d = avx2_fp16(b->d);
}

/* IQ2_XS: per 8 values a word of a 9-bit grid index | a 7-bit ksigns index << 9; a scale per
 * 16 values as IQ2_S's. */
MOE_INLINE void z_iqb_iq2_xs(const void *block, z_iqb *o) {
    const moe_block_iq2_xs *b = block;
    const uint16_t *q = b->qs;
    const uint64_t *grid = moe_iq2xs_grid;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const uint16_t *a = q + 8 * k;
        o->g[k] = z_join(
            avx2_grid4(grid[a[0] & 511], grid[a[1] & 511], grid[a[2] & 511], grid[a[3] & 511]),
            avx2_grid4(grid[a[4] & 511], grid[a[5] & 511], grid[a[6] & 511], grid[a[7] & 511]));
    }
    z_ksigns(_mm512_cvtepi16_epi8(_mm512_srli_epi16(z_load(q), 9)), o->neg);
    o->sc = _mm256_cvtepi8_epi16(avx2_iq2_scales16(b->scales));
    o->d = avx2_fp16(b->d);
}
#endif

/* IQ4_XS: 32 qs bytes (two 32-value groups) spread to [lo0 hi0 lo1 hi1] 16-byte chunks of
 * nibble codes; the codebook is sorted, so codes 0..7 are the negative values: their sign
 * becomes a sign bit and the magnitude comes from a table of |kvalues| (<= 127); a 6-bit scale
 * per 32 values, stored twice. */
/* |kvalues|, filled by the table's fill function. */
static int8_t z_iq4_mag[16] __attribute__((aligned(16)));

/* Chunk k (64 values) of an IQ4_XS block: magnitudes, and the sign bits as a mask. */
MOE_INLINE __m512i z_iq4_xs_chunk(const moe_block_iq4_xs *b, int k, __mmask64 *neg) {
    const __m512i book = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)z_iq4_mag));
    const __m512i shifts =
        _mm512_mask_blend_epi64(0xcc, _mm512_setzero_si512(), _mm512_set1_epi16(4));
    const __m512i q = _mm512_castsi256_si512(avx2_load(b->qs + 32 * k));
    const __m512i nib = _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(1, 1, 0, 0)), shifts),
        _mm512_set1_epi8(0x0f));
    *neg = _mm512_cmplt_epu8_mask(nib, _mm512_set1_epi8(8));
    return _mm512_shuffle_epi8(book, nib);
}
MOE_INLINE __m256i z_iq4_xs_scales(const moe_block_iq4_xs *b) {
    const __m128i s = avx2_iq4xs_scales(b);
    return z_join128(_mm_unpacklo_epi16(s, s), _mm_unpackhi_epi16(s, s));
}
MOE_INLINE void z_iqb_iq4_xs(const void *block, z_iqb *o) {
    const moe_block_iq4_xs *b = block;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __mmask64 neg;
        o->g[k] = z_iq4_xs_chunk(b, k, &neg);
        o->neg[k] = _cvtmask64_u64(neg);
    }
    o->sc = z_iq4_xs_scales(b);
    o->d = avx2_fp16(b->d);
}

/* IQ1_S / IQ1_M: 8-value entries of -1, 0, +1 (iq1s_grid, 11-bit index) plus a delta of
 * +-1/8 per 32 values (IQ1_S) or per 8 (IQ1_M); as in the reference, q = 8 grid +- 1 with mult
 * 1/8, so magnitudes are 1, 7 or 9 and the sign bits are q's. deltas: bit j set where entry j
 * of the chunk has the negative delta. */
MOE_INLINE __m512i z_iq1_chunk(__m512i grid, __mmask8 deltas, __mmask64 *neg) {
    const __m512i g8 = _mm512_and_si512(_mm512_slli_epi16(grid, 3), _mm512_set1_epi8((char)0xf8));
    const __m512i q = _mm512_add_epi8(
        g8, _mm512_mask_blend_epi64(deltas, _mm512_set1_epi8(1), _mm512_set1_epi8(-1)));
    *neg = _mm512_movepi8_mask(q);
    return _mm512_abs_epi8(q);
}

MOE_INLINE void z_iqb_iq1_s(const void *block, z_iqb *o) {
    const moe_block_iq1_s *b = block;
    const uint64_t *grid = moe_iq1s_grid;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const unsigned h0 = b->qh[2 * k], h1 = b->qh[2 * k + 1];
        const uint8_t *a = b->qs + 8 * k, *c = a + 4;
        const __m512i g =
            z_join(avx2_grid4(grid[a[0] | ((h0 << 8) & 0x700)], grid[a[1] | ((h0 << 5) & 0x700)],
                              grid[a[2] | ((h0 << 2) & 0x700)], grid[a[3] | ((h0 >> 1) & 0x700)]),
                   avx2_grid4(grid[c[0] | ((h1 << 8) & 0x700)], grid[c[1] | ((h1 << 5) & 0x700)],
                              grid[c[2] | ((h1 << 2) & 0x700)], grid[c[3] | ((h1 >> 1) & 0x700)]));
        __mmask64 neg;
        o->g[k] = z_iq1_chunk(g, (__mmask8)((h0 >> 15) * 0x0f | (h1 >> 15) * 0xf0), &neg);
        o->neg[k] = _cvtmask64_u64(neg);
    }
    /* 2s + 1 per 32 values from bits 12..14 of each qh word, each stored twice */
    const __m128i qh = _mm_loadu_si128((const __m128i *)b->qh);
    const __m128i sc =
        _mm_or_si128(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7)), 1),
                     _mm_set1_epi16(1));
    o->sc = z_join128(_mm_unpacklo_epi16(sc, sc), _mm_unpackhi_epi16(sc, sc));
    o->d = avx2_fp16(b->d);
}

MOE_INLINE void z_iqb_iq1_m(const void *block, z_iqb *o) {
    const moe_block_iq1_m *b = block;
    const uint64_t *grid = moe_iq1s_grid;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        /* entries 2j, 2j + 1 of the chunk: index qs | the low, high nibble of qh byte j (bits
         * 0..2) << 8; bit 3 of that nibble the delta sign */
        const uint8_t *a = b->qs + 8 * k, *h = b->qh + 4 * k;
#define IQ1M_LO(j) grid[a[2 * (j)] | ((h[j] << 8) & 0x700)]
#define IQ1M_HI(j) grid[a[2 * (j) + 1] | ((h[j] << 4) & 0x700)]
        const __m512i g = z_join(avx2_grid4(IQ1M_LO(0), IQ1M_HI(0), IQ1M_LO(1), IQ1M_HI(1)),
                                 avx2_grid4(IQ1M_LO(2), IQ1M_HI(2), IQ1M_LO(3), IQ1M_HI(3)));
#undef IQ1M_LO
#undef IQ1M_HI
        unsigned deltas = 0;
        for (int j = 0; j < 4; j++)
            deltas |= (h[j] >> 3 & 1u) << (2 * j) | (h[j] >> 7) << (2 * j + 1);
        __mmask64 neg;
        o->g[k] = z_iq1_chunk(g, (__mmask8)deltas, &neg);
        o->neg[k] = _cvtmask64_u64(neg);
    }
    /* 16 scales of 3 bits, four to a word (3 bits apart); the fp16 d in the words' top nibbles */
    const uint64_t words = z_load_u64(b->scales);
    const __m256i w =
        _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm256_set1_epi64x((long long)words));
    const __m256i s3 = _mm256_and_si256(
        _mm256_srlv_epi16(w, _mm256_setr_epi16(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9)),
        _mm256_set1_epi16(7));
    o->sc = _mm256_or_si256(_mm256_slli_epi16(s3, 1), _mm256_set1_epi16(1));
    const uint16_t d16 = (uint16_t)((words >> 12 & 0x000f) | (words >> 24 & 0x00f0) |
                                    (words >> 36 & 0x0f00) | (words >> 48 & 0xf000));
    o->d = avx2_fp16(d16);
}

/* IQ3_S: 64 entries of 4 values, index = qs byte | qh bit << 8 (qh read as a 64-bit mask); a
 * scale per 32 values, stored twice. */
MOE_INLINE __m256i z_iq3_s_scales(const moe_block_iq3_s *b) {
    const __m128i s = avx2_odd_scales8(b->scales);
    return z_join128(_mm_unpacklo_epi16(s, s), _mm_unpackhi_epi16(s, s));
}
#if MOE_AVX512_VNNI
/* With VBMI the grid lives within reach of vpermi2b. Its bytes are 1, 3, .. 15, so byte p of
 * an entry is a 3-bit code, and the codes of bytes 0, 1 (and 2, 3) of every entry fit one byte:
 * two 512-byte planes, four 128-byte tables each (index bits 0..6; bits 7 and 8 pick the
 * table). All 64 entries of a block are looked up at once, a plane at a time, then turned to
 * values (vpshufb) and interleaved back into value order (z_lookup_planes): 8 vpermi2b a
 * block. z_iq3s_codes is filled by the table's fill function. */
static uint8_t z_iq3s_codes[2][512] __attribute__((aligned(64)));

/* Entries of a 128-byte table t for the low 7 bits of idx. */
MOE_INLINE __m512i z_lookup128(__m512i idx, const uint8_t *t) {
    return _mm512_permutex2var_epi8(z_load(t), idx, z_load(t + 64));
}

/* Entries 0..63 reordered for z_interleave4: slot 16L + 4j + i holds entry 16j + 4L + i (a
 * 4 x 4 transpose of groups of four). vpermb indices; applied to the grid indices before the
 * lookups, it saves the 128-bit lane transpose after them. */
MOE_INLINE __m512i z_slot_order(void) {
    const __m512i s = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41,
        40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i three = _mm512_set1_epi8(3);
    /* s = 16L + 4j + i -> 16j + 4L + i */
    const __m512i l = _mm512_and_si512(_mm512_srli_epi16(s, 4), three);
    const __m512i j = _mm512_and_si512(_mm512_srli_epi16(s, 2), three);
    return _mm512_or_si512(_mm512_or_si512(_mm512_slli_epi16(j, 4), _mm512_slli_epi16(l, 2)),
                           _mm512_and_si512(s, three));
}

/* The bytes of 64 entries of 4 (byte p of each in r[p], entries in z_slot_order) in value
 * order: g[k] holds entries 16k .. 16k + 15. */
MOE_INLINE void z_interleave4(const __m512i r[4], __m512i g[4]) {
    const __m512i t01l = _mm512_unpacklo_epi8(r[0], r[1]), t01h = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t23l = _mm512_unpacklo_epi8(r[2], r[3]), t23h = _mm512_unpackhi_epi8(r[2], r[3]);
    /* 128-bit lane L of these: slots 16L + 4j .. + 3, which hold entries 16j + 4L .. + 3 */
    g[0] = _mm512_unpacklo_epi16(t01l, t23l);
    g[1] = _mm512_unpackhi_epi16(t01l, t23l);
    g[2] = _mm512_unpacklo_epi16(t01h, t23h);
    g[3] = _mm512_unpackhi_epi16(t01h, t23h);
}

/* The values of the codes in the low (hi = 0) or high nibbles of c: IQ3_S's are 2c + 1, two
 * ALU operations (the 16-bit shifts pull in a neighbour's bits, the mask drops them); IQ3_XXS's
 * 4, 12, .. 52, 62 come from a vpshufb table. The shuffle unit is what these decodes wait on,
 * so arithmetic wins where it exists. */
typedef __m512i (*z_code_values_fn)(__m512i c, int hi);
MOE_INLINE __m512i z_iq3s_values(__m512i c, int hi) {
    const __m512i v = hi ? _mm512_srli_epi16(c, 3) : _mm512_slli_epi16(c, 1);
    return _mm512_ternarylogic_epi32(v, _mm512_set1_epi8(0x1e), _mm512_set1_epi8(1), 0xea);
}

/* The 64 four-byte entries of a block into o->g: idx (in z_slot_order) and its bits 7 and 8
 * (bit8 only for 512-entry grids, big) pick entries of two code planes, plane q (stride bytes
 * apart) holding the 3-bit codes of entry bytes 2q and 2q + 1 as nibbles. */
MOE_INLINE void z_lookup_planes(__m512i idx, __mmask64 bit7, __mmask64 bit8, bool big,
                                const uint8_t *planes, size_t stride, z_code_values_fn values,
                                z_iqb *o) {
    __m512i r[4];
#pragma GCC unroll 2
    for (int q = 0; q < 2; q++) {
        const uint8_t *t = planes + q * stride;
        __m512i c = _mm512_mask_blend_epi8(bit7, z_lookup128(idx, t), z_lookup128(idx, t + 128));
        if (big)
            c = _mm512_mask_blend_epi8(
                bit8, c,
                _mm512_mask_blend_epi8(bit7, z_lookup128(idx, t + 256), z_lookup128(idx, t + 384)));
        r[2 * q] = values(c, 0);
        r[2 * q + 1] = values(c, 1);
    }
    z_interleave4(r, o->g);
}

MOE_INLINE void z_iqb_iq3_s(const void *block, z_iqb *o) {
    const moe_block_iq3_s *b = block;
    const __m512i order = z_slot_order();
    const __m512i idx = _mm512_permutexvar_epi8(order, z_load(b->qs));
    const __mmask64 bit8 = _mm512_movepi8_mask(
        _mm512_permutexvar_epi8(order, _mm512_movm_epi8(_cvtu64_mask64(z_load_u64(b->qh)))));
    z_lookup_planes(idx, _mm512_movepi8_mask(idx), bit8, true, z_iq3s_codes[0], 512, z_iq3s_values,
                    o);
    o->sc = z_iq3_s_scales(b);
    z_sign_words(b->signs, o->neg);
    o->d = avx2_fp16(b->d);
}
#define Z_IQB_IQ3_S    z_iqb_iq3_s
#define Z_DECODE_IQ3_S NULL
#define Z_GRID4_IQ3_S  NULL
#else
/* Without VBMI: the entries are copied (z_copy_entries), offsets computed here. */
MOE_INLINE void z_decode_iq3_s(const void *block, z_iqd *o, uint16_t *at) {
    const moe_block_iq3_s *b = block;
    const uint64_t qh = z_load_u64(b->qh);
    const __m512i bit8 = _mm512_set1_epi16(256);
    for (int half = 0; half < 2; half++) {
        const __m512i lo = _mm512_cvtepu8_epi16(avx2_load(b->qs + 32 * half));
        const __m512i idx = _mm512_mask_add_epi16(lo, (__mmask32)(qh >> (32 * half)), lo, bit8);
        _mm512_storeu_si512(at + 32 * half, _mm512_slli_epi16(idx, 2));
    }
    uint64_t neg[4];
    z_sign_words(b->signs, neg);
    z_put_neg(o, neg);
    _mm256_store_si256((__m256i *)o->sc, z_iq3_s_scales(b));
    o->d = avx2_fp16(b->d);
}
#define Z_IQB_IQ3_S    NULL
#define Z_DECODE_IQ3_S z_decode_iq3_s
#define Z_GRID4_IQ3_S  (const void *)moe_iq3s_grid
#endif

#if MOE_AVX512_VNNI
/* IQ3_XXS: 64 grid index bytes (4-value entries of 4, 12, .. 52, 62), then per 32 values a word
 * of four 7-bit ksigns indices | a 4-bit scale << 28. Looked up as IQ3_S: the 3-bit codes of entry
 * bytes 0, 1 (2, 3) in a 256-byte plane, two vpermi2b tables each (bit 7 picks), then codes to
 * values with vpshufb. z_iq3xxs_codes is filled by the table's fill function. */
static uint8_t z_iq3xxs_codes[2][256] __attribute__((aligned(64)));
static const uint8_t z_iq3xxs_grid_bytes[16] = {4, 12, 20, 28, 36, 44, 52, 62};
MOE_INLINE __m512i z_iq3xxs_values(__m512i c, int hi) {
    const __m512i lut =
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)z_iq3xxs_grid_bytes));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    return _mm512_shuffle_epi8(lut, _mm512_and_si512(hi ? _mm512_srli_epi16(c, 4) : c, low4));
}

MOE_INLINE void z_iqb_iq3_xxs(const void *block, z_iqb *o) {
    const moe_block_iq3_xxs *b = block;
    const __m512i idx = _mm512_permutexvar_epi8(z_slot_order(), z_load(b->qs));
    z_lookup_planes(idx, _mm512_movepi8_mask(idx), 0, false, z_iq3xxs_codes[0], 256,
                    z_iq3xxs_values, o);
    const __m256i words = avx2_load(b->qs + 64);
    z_ksigns(z_ksign_fields(words), o->neg);
    o->sc = z_top4_scales(words);
    o->d = avx2_fp16(b->d);
}
#endif

/* ---- The multiply, shared by every codebook type ---- */

/* acc[r] += row r's dot with one block (y[r]: row r's Q8_K block): magnitudes g, sign words
 * neg, sixteen scales sc, float scale d. */
MOE_INLINE void z_iq_madd(int R, const __m512i *g, const uint64_t *neg, __m256i sc, float d,
                          const moe_block_q8_k *const *y, float mult, __m512 *acc) {
    const __m512i sc512 = z_from_256(sc);
    __m512i sumi[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        z_rows_signed_madd(R, g[k], _cvtu64_mask64(neg[k]), z_scales(sc512, z_idx4(4 * k)), y,
                           64 * k, sumi);
    z_rows_accumulate(R, acc, d, y, mult, sumi);
}

MOE_INLINE void z_iqd_consume(int R, const z_iqd *blk, const moe_block_q8_k *const *y, float mult,
                              __m512 *acc) {
    __m512i g[4];
    for (int k = 0; k < 4; k++) g[k] = _mm512_load_si512(blk->g + 64 * k);
    z_iq_madd(R, g, blk->neg, _mm256_load_si256((const __m256i *)blk->sc), blk->d, y, mult, acc);
}

/* Rows r0..r0+R-1 of x against decoded blocks c0..c0+nc-1; acc in / out through accbuf unless
 * the chunk is the row's first (zero) or last (reduced into out). */
MOE_INLINE void z_iqd_rows_chunk(int R, const z_iqd *buf, int64_t c0, int64_t nc, int64_t nb,
                                 const uint8_t *xb, size_t xs, float mult, __m512 *accbuf,
                                 float *out, int64_t os) {
    __m512 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = c0 == 0 ? _mm512_setzero_ps() : accbuf[r];
    for (int64_t j = 0; j < nc; j++) {
        const moe_block_q8_k *y[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) y[r] = (const moe_block_q8_k *)(xb + (size_t)r * xs) + c0 + j;
        z_iqd_consume(R, &buf[j], y, mult, acc);
    }
    if (c0 + nc < nb)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) accbuf[r] = acc[r];
    else
        z_rows_store(R, acc, out, os);
}

#define Z_IQD_CHUNK 8  /* blocks decoded per pass: 3 KiB */
#define Z_IQD_GROUP 64 /* rows per decode of a chunk (accbuf: 4 KiB) */

/* A codebook type: its decode (regs, else decode + copies from grid4); whether a matvec
 * should decode a block ahead (ahead: pays where the decode is one long dependency chain, as
 * IQ3_S's lookups; costs the copy of a block's registers where it is not, as IQ2_S's inserts);
 * the float its block scale is multiplied by after the activations' (IQ2_S: 1/8); its size. */
typedef struct {
    z_iqb_fn regs;
    bool ahead;
    z_iqd_decode_fn decode;
    const void *grid4;
    float mult;
    size_t block_bytes;
} z_iq_type;

/* nc blocks at w decoded into buf. For copying decodes, the offsets of the whole chunk come
 * first: their vector stores have retired by the time the copies read them back (a 16-bit load
 * from a fresh 512-bit store waits for it). */
MOE_INLINE void z_iqd_decode_chunk(z_iq_type t, const uint8_t *w, int64_t nc, z_iqd *buf,
                                   uint16_t (*at)[64]) {
    if (t.regs) {
        for (int64_t j = 0; j < nc; j++) {
            z_iqb b;
            t.regs(w + (size_t)j * t.block_bytes, &b);
            z_iqd_from_regs(&b, &buf[j]);
        }
        return;
    }
    for (int64_t j = 0; j < nc; j++) t.decode(w + (size_t)j * t.block_bytes, &buf[j], at[j]);
    for (int64_t j = 0; j < nc; j++) z_copy_entries(buf[j].g, t.grid4, at[j]);
}

/* One row, accumulator in a register: register decodes straight into the multiply (a block
 * ahead where the type asks); copying decodes a chunk of records ahead. */
MOE_INLINE float z_iqd_dot1(z_iq_type t, const void *w, const void *x, int64_t n) {
    const moe_block_q8_k *y = x;
    const int64_t nb = n / MOE_QK_K;
    __m512 acc = _mm512_setzero_ps();
    if (t.regs && t.ahead && nb > 0) { /* block i + 1 decoded before block i's multiplies */
        z_iqb cur, next;
        t.regs(w, &cur);
        for (int64_t i = 0; i < nb; i++) {
            if (i + 1 < nb) t.regs((const uint8_t *)w + (size_t)(i + 1) * t.block_bytes, &next);
            const moe_block_q8_k *yi = &y[i];
            z_iq_madd(1, cur.g, cur.neg, cur.sc, cur.d, &yi, t.mult, &acc);
            cur = next;
        }
        return _mm512_reduce_add_ps(acc);
    }
    if (t.regs) {
        for (int64_t i = 0; i < nb; i++) {
            z_iqb b;
            t.regs((const uint8_t *)w + (size_t)i * t.block_bytes, &b);
            const moe_block_q8_k *yi = &y[i];
            z_iq_madd(1, b.g, b.neg, b.sc, b.d, &yi, t.mult, &acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
    z_iqd buf[Z_IQD_CHUNK];
    uint16_t at[Z_IQD_CHUNK][64];
    for (int64_t c0 = 0; c0 < nb; c0 += Z_IQD_CHUNK) {
        const int64_t nc = nb - c0 < Z_IQD_CHUNK ? nb - c0 : Z_IQD_CHUNK;
        z_iqd_decode_chunk(t, (const uint8_t *)w + (size_t)c0 * t.block_bytes, nc, buf, at);
        for (int64_t j = 0; j < nc; j++) {
            const moe_block_q8_k *yj = &y[c0 + j];
            z_iqd_consume(1, &buf[j], &yj, t.mult, &acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

MOE_INLINE void z_iqd_dot_rows(z_iq_type t, const void *w, const void *x, size_t xs, int64_t n_rows,
                               int64_t n, float *out, int64_t os) {
    if (n_rows == 1) { /* a lone row (decode; an expert one stream routed to): no records */
        *out = z_iqd_dot1(t, w, x, n);
        return;
    }
    const int64_t nb = n / MOE_QK_K;
    const uint8_t *xb = x;
    const float mult = t.mult;
    z_iqd buf[Z_IQD_CHUNK];
    uint16_t at[Z_IQD_CHUNK][64];
    __m512 accbuf[Z_IQD_GROUP];
    for (int64_t g0 = 0; g0 < n_rows; g0 += Z_IQD_GROUP) {
        const int64_t ng = n_rows - g0 < Z_IQD_GROUP ? n_rows - g0 : Z_IQD_GROUP;
        for (int64_t c0 = 0; c0 < nb; c0 += Z_IQD_CHUNK) {
            const int64_t nc = nb - c0 < Z_IQD_CHUNK ? nb - c0 : Z_IQD_CHUNK;
            z_iqd_decode_chunk(t, (const uint8_t *)w + (size_t)c0 * t.block_bytes, nc, buf, at);
            int64_t r = 0;
#define Z_IQD_GROUP_STEP(R, unused)                                                                \
    z_iqd_rows_chunk(R, buf, c0, nc, nb, xb + (size_t)(g0 + r) * xs, xs, mult, accbuf + r,         \
                     out + (g0 + r) * os, os)
            MOE_ROW_GROUPS(r, ng, Z_IQD_GROUP_STEP, 0);
#undef Z_IQD_GROUP_STEP
        }
    }
}

#define Z_IQ_KERNELS(t, regs, ahead, decode, grid4, mult)                                          \
    static void z_dot_rows_##t(const void *w, const void *x, size_t xs, int64_t n_rows, int64_t n, \
                               float *out, int64_t os) {                                           \
        z_iqd_dot_rows((z_iq_type){regs, ahead, decode, grid4, mult, sizeof(moe_block_##t)}, w, x, \
                       xs, n_rows, n, out, os);                                                    \
    }                                                                                              \
    static float z_dot_##t(const void *w, const void *x, int64_t n) {                              \
        return z_iqd_dot1((z_iq_type){regs, ahead, decode, grid4, mult, sizeof(moe_block_##t)}, w, \
                          x, n);                                                                   \
    }
Z_IQ_KERNELS(iq3_s, Z_IQB_IQ3_S, true, Z_DECODE_IQ3_S, Z_GRID4_IQ3_S, 1.0f)
Z_IQ_KERNELS(iq2_s, z_iqb_iq2_s, false, NULL, NULL, 0.125f)
Z_IQ_KERNELS(iq1_s, z_iqb_iq1_s, false, NULL, NULL, 0.125f)
Z_IQ_KERNELS(iq1_m, z_iqb_iq1_m, false, NULL, NULL, 0.125f)
static void z_dot_rows_iq4_xs(const void *w, const void *x, size_t xs, int64_t n_rows, int64_t n,
                              float *out, int64_t os) {
    z_iqd_dot_rows((z_iq_type){z_iqb_iq4_xs, false, NULL, NULL, 1.0f, sizeof(moe_block_iq4_xs)}, w,
                   x, xs, n_rows, n, out, os);
}
/* The IQ4_XS matvec keeps its signs as masks (a block's register form holds them as words,
 * and the round trip through a general register cost a fifth here) and its eight scales as
 * they come (the same lanes as sixteen doubled ones): z_iq_madd's steps otherwise. */
static float z_dot_iq4_xs(const void *w, const void *x, int64_t n) {
    const moe_block_iq4_xs *b = w;
    const moe_block_q8_k *y = x;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const __m512i sc = z_from_128(avx2_iq4xs_scales(&b[i])); /* one per 32: idx2 */
        const moe_block_q8_k *yi = &y[i];
        __m512i sumi = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __mmask64 neg;
            const __m512i g = z_iq4_xs_chunk(&b[i], k, &neg);
            z_rows_signed_madd(1, g, neg, z_scales(sc, z_idx2(2 * k, 2 * k + 1)), &yi, 64 * k,
                               &sumi);
        }
        z_rows_accumulate(1, &acc, avx2_fp16(b[i].d), &yi, 1.0f, &sumi);
    }
    return _mm512_reduce_add_ps(acc);
}
#if MOE_AVX512_VNNI
Z_IQ_KERNELS(iq2_xxs, z_iqb_iq2_xxs, false, NULL, NULL, 0.125f)
Z_IQ_KERNELS(iq2_xs, z_iqb_iq2_xs, false, NULL, NULL, 0.125f)
Z_IQ_KERNELS(iq3_xxs, z_iqb_iq3_xxs, true, NULL, NULL, 0.25f)
#endif

/* ==== Float types ==== */

MOE_INLINE __m512 z_load16_f32(const void *p) {
    return _mm512_loadu_ps(p);
}
MOE_INLINE __m512 z_load16_f16(const void *p) {
    return _mm512_cvtph_ps(avx2_load(p));
}
MOE_INLINE __m512 z_load16_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(avx2_load(p)), 16));
}

MOE_FLOAT_ROWS(z_float_rows, __m512, 16, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_add_ps,
               _mm512_reduce_add_ps)
MOE_DOT_AND_ROWS(z_dot_f32, z_dot_rows_f32, z_float_rows, 4, z_load16_f32, moe_ref_f32_dot)
MOE_DOT_AND_ROWS(z_dot_f16, z_dot_rows_f16, z_float_rows, 2, z_load16_f16, moe_ref_f16_dot)
MOE_DOT_AND_ROWS(z_dot_bf16, z_dot_rows_bf16, z_float_rows, 2, z_load16_bf16, moe_ref_bf16_dot)

/* ==== Attention over the KV cache: the AVX2 kernels' operations, 16 lanes at a time ==== */

/* 16 values of a KV row from value i (a multiple of 16): F32, F16, or Q8_0 decoded as d * q. */
MOE_INLINE __m512 z_load16_kv(const void *x, moe_type kv_type, int i) {
    if (kv_type == MOE_TYPE_Q8_0) {
        const moe_block_q8_0 *b = (const moe_block_q8_0 *)x + i / MOE_QK32;
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + i % 32)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(avx2_fp16(b->d)));
    }
    return kv_type == MOE_TYPE_F16 ? _mm512_cvtph_ps(avx2_load((const uint16_t *)x + i))
                                   : _mm512_loadu_ps((const float *)x + i);
}

/* The AVX2 dot's four 8-lane accumulators as two registers: [0 | 1] and [2 | 3]; their sum is
 * [0+2 | 1+3], whose halves added give the AVX2 fold (0+2) + (1+3) lane for lane. */
MOE_INLINE float z_attn_dot(const float *q, const void *k, moe_type kv_type, int n) {
    const int whole = n & ~31;
    __m512 a01 = _mm512_setzero_ps(), a23 = _mm512_setzero_ps();
    for (int i = 0; i < whole; i += 32) {
        a01 = _mm512_add_ps(a01, _mm512_mul_ps(_mm512_loadu_ps(q + i), z_load16_kv(k, kv_type, i)));
        a23 = _mm512_add_ps(
            a23, _mm512_mul_ps(_mm512_loadu_ps(q + i + 16), z_load16_kv(k, kv_type, i + 16)));
    }
    const __m512 s = _mm512_add_ps(a01, a23);
    const __m256 lane = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
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

static void z_attn_scores(const float *q, const void *k, int64_t stride_bytes, int64_t n_kv,
                          moe_type kv_type, int n, float scale, float *out) {
    for (int64_t j = 0; j < n_kv; j++)
        out[j] = z_attn_dot(q, (const uint8_t *)k + j * stride_bytes, kv_type, n) * scale;
}

/* y[d] += p[j] * v_j[d], key after key; 128 values of y stay in registers across all keys. */
static void z_attn_mix(float *y, const float *p, const void *v, int64_t stride_bytes, int64_t n_kv,
                       moe_type kv_type, int n) {
    int d = 0;
    for (; d + 128 <= n; d += 128) {
        __m512 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm512_loadu_ps(y + d + 16 * u);
        for (int64_t j = 0; j < n_kv; j++) {
            const __m512 a = _mm512_set1_ps(p[j]);
            const void *vj = (const uint8_t *)v + (size_t)(j * stride_bytes);
            for (int u = 0; u < 8; u++)
                acc[u] =
                    _mm512_add_ps(acc[u], _mm512_mul_ps(a, z_load16_kv(vj, kv_type, d + 16 * u)));
        }
        for (int u = 0; u < 8; u++) _mm512_storeu_ps(y + d + 16 * u, acc[u]);
    }
    if (d < n)
        moe_avx2_attn_mix(y + d, p, (const uint8_t *)v + moe_type_row_bytes(kv_type, d),
                          stride_bytes, n_kv, kv_type, n - d);
}

/* ==== The table ==== */

void Z_FILL(moe_kernels *k) {
    moe_type_kernels *types = k->types;
    for (int i = 0; i < 16; i++) z_iq4_mag[i] = (int8_t)abs(moe_kvalues_iq4nl[i]);
#if MOE_AVX512_VNNI
    for (int i = 0; i < 512; i++)
        for (int q = 0; q < 2; q++) {
            const unsigned lo = moe_iq3s_grid[i] >> (16 * q) & 0xff,
                           hi = moe_iq3s_grid[i] >> (16 * q + 8) & 0xff;
            z_iq3s_codes[q][i] = (uint8_t)((lo - 1) / 2 | (hi - 1) / 2 << 4); /* 2c + 1 */
        }
    for (int i = 0; i < 256; i++)
        for (int q = 0; q < 2; q++) {
            unsigned c[2];
            for (int h = 0; h < 2; h++) {
                const unsigned v = moe_iq3xxs_grid[i] >> (16 * q + 8 * h) & 0xff;
                c[h] = 0;
                while (z_iq3xxs_grid_bytes[c[h]] != v) c[h]++;
            }
            z_iq3xxs_codes[q][i] = (uint8_t)(c[0] | c[1] << 4);
        }
#endif
    k->attn_scores = z_attn_scores;
    k->attn_mix = z_attn_mix;
    static const struct {
        moe_type type;
        moe_dot_fn dot;
        moe_dot_rows_fn dot_rows; /* NULL: row by row through dot */
    } dots[] = {
        {MOE_TYPE_F32, z_dot_f32, z_dot_rows_f32},
        {MOE_TYPE_F16, z_dot_f16, z_dot_rows_f16},
        {MOE_TYPE_BF16, z_dot_bf16, z_dot_rows_bf16},
        {MOE_TYPE_Q4_0, z_dot_q4_0, z_dot_rows_q4_0},
        {MOE_TYPE_Q5_0, z_dot_q5_0, z_dot_rows_q5_0},
        {MOE_TYPE_Q8_0, z_dot_q8_0, z_dot_rows_q8_0},
        {MOE_TYPE_IQ4_NL, z_dot_iq4_nl, z_dot_rows_iq4_nl},
        {MOE_TYPE_MXFP4, z_dot_mxfp4, z_dot_rows_mxfp4},
        {MOE_TYPE_Q4_K, z_dot_q4_k, z_dot_rows_q4_k},
        {MOE_TYPE_Q5_K, z_dot_q5_k, z_dot_rows_q5_k},
        {MOE_TYPE_Q6_K, z_dot_q6_k, z_dot_rows_q6_k},
        {MOE_TYPE_IQ4_XS, z_dot_iq4_xs, z_dot_rows_iq4_xs},
        {MOE_TYPE_IQ3_S, z_dot_iq3_s, z_dot_rows_iq3_s},
        {MOE_TYPE_IQ2_S, z_dot_iq2_s, z_dot_rows_iq2_s},
        {MOE_TYPE_IQ1_S, z_dot_iq1_s, z_dot_rows_iq1_s},
        {MOE_TYPE_IQ1_M, z_dot_iq1_m, z_dot_rows_iq1_m},
#if MOE_AVX512_VNNI
        {MOE_TYPE_IQ2_XXS, z_dot_iq2_xxs, z_dot_rows_iq2_xxs},
        {MOE_TYPE_IQ2_XS, z_dot_iq2_xs, z_dot_rows_iq2_xs},
        {MOE_TYPE_IQ3_XXS, z_dot_iq3_xxs, z_dot_rows_iq3_xxs},
#endif
    };
    for (size_t i = 0; i < sizeof dots / sizeof dots[0]; i++)
        moe_kernels_set_dot(types, dots[i].type, dots[i].dot, dots[i].dot_rows, Z_LEVEL);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q4_0, z_dot_rows2_q4_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q5_0, z_dot_rows2_q5_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q8_0, z_dot_rows2_q8_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_IQ4_NL, z_dot_rows2_iq4_nl);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_MXFP4, z_dot_rows2_mxfp4);
}
