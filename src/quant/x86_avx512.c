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

#include <math.h>

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

#include "x86_avx512_iq.h" /* the helpers and the codebook decodes */

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

/* ---- Q4_K / Q5_K (q5: the fifth bits in qh). A register of 64 qs bytes (z_k4_values) holds
 * the AVX2 kernel's steps j = 2jj (low half) and 2jj + 1 (high half); the halves are added
 * before the float step, which gives the AVX2 kernel's eight integer lanes. ---- */
MOE_INLINE void z_k4_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                          int64_t os, bool q5) {
    const uint8_t *xb = x;
    __m256 acc[MOE_DOT_ROWS];
    __m128 acc_min[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), acc_min[r] = _mm_setzero_ps();
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        const avx2_k4_block b = avx2_k4_at(w, i, q5);
        const __m512i sc = z_from_128(_mm_cvtepu8_epi16(b.sm));
        const __m512i hb = z_k4_fifth_bits(b.qh);
        const moe_block_q8_k *y[MOE_DOT_ROWS];
        __m512i sumi[MOE_DOT_ROWS];
        avx2_k4_rows_begin(R, xb, xs, i, &b, y, acc_min);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int jj = 0; jj < 2; jj++) {
            __m512i lo, hi;
            z_k4_values(b.qs, hb, jj, q5, &lo, &hi);
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

/* Q6_K: the values of each half (z_q6_k_values) against the activations; q6 - 32 as in the
 * AVX2 kernel (the -32 from the bsums). */
MOE_INLINE void z_q6_k_rows(const void *w, const void *x, size_t xs, int R, int64_t n, float *out,
                            int64_t os, int unused) {
    (void)unused;
    const moe_block_q6_k *b = w;
    const uint8_t *xb = x;
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
            __m512i vlo, vhi;
            z_q6_k_values(&b[i], h, &vlo, &vhi);
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

/* ==== IQ types (their decodes: x86_avx512_iq.h) ==== */

/* ---- The multiply, shared by every codebook type ---- */

/* acc[r] += row r's dot with one block (y[r]: row r's Q8_K block): magnitudes g, sign words
 * neg, sixteen scales sc, float scale d. */
MOE_INLINE void z_iq_madd(int R, const __m512i *g, const uint64_t *neg, __m256i sc, float d,
                          const moe_block_q8_k *const *y, float mult, __m512 *acc) {
    __m512i scale[4], sumi[MOE_DOT_ROWS];
    z_scales4(z_from_256(sc), scale);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        z_rows_signed_madd(R, g[k], _cvtu64_mask64(neg[k]), scale[k], y, 64 * k, sumi);
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

/* Block j of the nb at w into b[0] (with a pair decode, block j + 1 into b[1] where there is one).
 */
MOE_INLINE void z_iq_decode_step(z_iq_type t, z_iqb2_fn pair, const void *w, int64_t j, int64_t nb,
                                 z_iqb b[2]) {
    const uint8_t *block = (const uint8_t *)w + (size_t)j * t.block_bytes;
    if (pair)
        pair(block, j + 1 < nb ? block + t.block_bytes : block, b);
    else
        t.regs(block, &b[0]);
}

/* nc blocks at w decoded into buf. For copying decodes, the offsets of the whole chunk come
 * first: their vector stores have retired by the time the copies read them back (a 16-bit load
 * from a fresh 512-bit store waits for it). */
MOE_INLINE void z_iqd_decode_chunk(z_iq_type t, const uint8_t *w, int64_t nc, z_iqd *buf,
                                   uint16_t (*at)[64]) {
    if (t.regs) {
        const z_iqb2_fn pair = z_iqb2_of(t.regs);
        const int64_t step = pair ? 2 : 1;
        for (int64_t j = 0; j < nc; j += step) {
            z_iqb b[2];
            z_iq_decode_step(t, pair, w, j, nc, b);
            for (int64_t h = 0; h < step && j + h < nc; h++) z_iqd_from_regs(&b[h], &buf[j + h]);
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
        const z_iqb2_fn pair = z_iqb2_of(t.regs);
        const int64_t step = pair ? 2 : 1;
        for (int64_t i = 0; i < nb; i += step) {
            z_iqb b[2];
            z_iq_decode_step(t, pair, w, i, nb, b);
            for (int64_t h = 0; h < step && i + h < nb; h++) {
                const moe_block_q8_k *yi = &y[i + h];
                z_iq_madd(1, b[h].g, b[h].neg, b[h].sc, b[h].d, &yi, t.mult, &acc);
            }
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
Z_IQ_KERNELS(iq2_s, Z_IQB_IQ2_S, false, NULL, NULL, 0.125f)
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
Z_IQ_KERNELS(iq2_xs, z_iqb_iq2_xs_one, false, NULL, NULL, 0.125f)
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

/* F32 against two weight rows: z_float_rows' four chains per (weight row, activation row) --
 * chain u over values 64k + 16u .. 64k + 16u + 15, the 16-value steps after the last 64 in chain
 * 0 -- and its sum of them, so the same bits. Each activation load serves both weight rows and
 * each weight load R rows; the chains go Z_F32_CHAINS at a time (2 x R x Z_F32_CHAINS
 * accumulators: 16 at R = 4). For the f32 MoE router at prefill (2048 x 128, 256 rows, 1
 * thread's CPU time, Zen 5 under load 5): 18 -> 24 G MAC/s (one chain at a time: 22; z_float_rows
 * alone: 18). */
#define Z_F32_CHAINS 2
MOE_INLINE void z_f32_pair_rows(const void *w, size_t ws, const void *x, size_t xs, int R,
                                int64_t n, float *out, int64_t os) {
    const float *wv[2] = {w, (const float *)((const uint8_t *)w + ws)};
    const uint8_t *xb = x;
    const int64_t n64 = n / 64 * 64, n16 = n / 16 * 16;
    __m512 part[2][MOE_DOT_ROWS][4];
#define Z_F32_PAIR_STEP(i, acc)                                                                    \
    do {                                                                                           \
        const __m512 w0 = _mm512_loadu_ps(wv[0] + (i)), w1 = _mm512_loadu_ps(wv[1] + (i));         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                      \
            const __m512 xr = _mm512_loadu_ps((const float *)(xb + (size_t)r * xs) + (i));         \
            acc[0][r] = _mm512_fmadd_ps(w0, xr, acc[0][r]);                                        \
            acc[1][r] = _mm512_fmadd_ps(w1, xr, acc[1][r]);                                        \
        }                                                                                          \
    } while (0)
#pragma GCC unroll 2
    for (int u0 = 0; u0 < 4; u0 += Z_F32_CHAINS) {
        __m512 acc[Z_F32_CHAINS][2][MOE_DOT_ROWS];
#pragma GCC unroll 2
        for (int u = 0; u < Z_F32_CHAINS; u++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[u][0][r] = acc[u][1][r] = _mm512_setzero_ps();
        for (int64_t i = 16 * u0; i < n64; i += 64)
#pragma GCC unroll 2
            for (int u = 0; u < Z_F32_CHAINS; u++) Z_F32_PAIR_STEP(i + 16 * u, acc[u]);
        if (u0 == 0)
            for (int64_t i = n64; i < n16; i += 16) Z_F32_PAIR_STEP(i, acc[0]);
#pragma GCC unroll 2
        for (int u = 0; u < Z_F32_CHAINS; u++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                part[0][r][u0 + u] = acc[u][0][r], part[1][r][u0 + u] = acc[u][1][r];
    }
#undef Z_F32_PAIR_STEP
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < R; r++) {
            const __m512 *p = part[v][r];
            const float *xr = (const float *)(xb + (size_t)r * xs);
            float sum = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
            if (n16 < n) sum += moe_ref_f32_dot(wv[v] + n16, xr + n16, n - n16);
            out[r * os + v] = sum;
        }
}
static void z_dot_rows2_f32(const void *w, size_t ws, const void *x, size_t xs, int64_t n_rows,
                            int64_t n, float *out, int64_t os) {
    const uint8_t *xb = x;
    int64_t r = 0;
#define Z_F32_PAIR(R, unused)                                                                      \
    z_f32_pair_rows(w, ws, xb + (size_t)r * xs, xs, R, n, out + r * os, os)
    MOE_ROW_GROUPS(r, n_rows, Z_F32_PAIR, 0);
#undef Z_F32_PAIR
}

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

/* ==== The fast path's attention tile (quant.h: moe_attn_tile_fn) ====
 *
 * A score is one lane's fma chain over d, the softmax a lane's own running max and sum, all in
 * the reference's order. More than 8 query vectors (prefill) lie in the lanes, 16 per register:
 * scores of 4 keys (broadcast from the f32 tile) x up to 4 registers of vectors, or 8 keys x 1
 * (8 chains in flight either way: an fma's latency times its ports). Up to 8 (decode: one row's
 * group of heads) take two keys per register, lane 2i + e holding vector i against key 2p + e of
 * the tile's pair p, so they fill the 16 lanes too. A Q8_0 cache's scores are integer work with
 * the vectors in the lanes whatever their number (below). Mix: 4 query vectors (broadcast
 * weights) x 64 output values from the f32 tile, the values loaded once for the 4; up to 8
 * vectors read the values from the cache instead, converted in registers, all the vectors at
 * once (z_attn_mix_pairs). The strides are the caller's: the engine's cache keeps a KV head's
 * positions side by side (a key's rows 256 bytes apart in f16 on Qwen3-30B-A3B), so the tiles
 * and the prefetches a tile ahead read one run of memory; a head's keys a whole position's row
 * apart (1 KiB) shared a quarter of the L1's sets and lost prefetched lines before use. */

/* The running max's move (old -> mx), the rescale c of the old sum and outputs, and the old sum
 * l rescaled: the first steps of the reference's softmax on 16 lanes. */
MOE_INLINE __m512 z_attn_rescale(__m512 old, __m512 mx, __m512 l, __m512 *c) {
    *c = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, old, _CMP_GT_OQ), _mm512_set1_ps(1.0f),
                              z_attn_exp(_mm512_sub_ps(old, mx)));
    return _mm512_mul_ps(l, *c);
}

/* The first n (of 16) lanes; none for n <= 0. */
MOE_INLINE __mmask16 z_mask16(int n) {
    return n >= 16 ? 0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
}

/* Values d..d+15 of a KV row as f32, zeros past dim (a Q8_0 row is whole blocks). */
MOE_INLINE __m512 z_load16_kv_upto(const void *row, moe_type kv_type, int d, int dim) {
    if (d + 16 <= dim) return z_load16_kv(row, kv_type, d);
    if (kv_type == MOE_TYPE_F16)
        return _mm512_cvtph_ps(
            _mm256_maskz_loadu_epi16(z_mask16(dim - d), (const uint16_t *)row + d));
    return _mm512_maskz_loadu_ps(z_mask16(dim - d), (const float *)row + d);
}

/* n_key rows of a KV tile as f32, dim values each, into out [n_key][dim], rows padded with
 * zeros to a multiple of 16. */
static void z_attn_convert(const void *x, int64_t stride, moe_type kv_type, int n_key, int dim,
                           float *out) {
    for (int j = 0; j < n_key; j++) {
        const void *row = (const uint8_t *)x + j * stride;
        for (int d = 0; d < dim; d += 16)
            _mm512_mask_storeu_ps(out + (int64_t)j * dim + d, z_mask16(dim - d),
                                  z_load16_kv_upto(row, kv_type, d, dim));
    }
    avx2_attn_pad_keys(out, n_key, dim);
}

/* The next tile's key j, K and V rows, on their way. The lanes' f32 / f16 scores send them a few
 * keys at a time between their fmas rather than all at once in the converts: a burst of 512
 * prefetches stalled there (the converts took ~19% of pp256@d8192 with an f16 cache, nearly all
 * on the prefetches and the loads after them); spread, bench/attention --tiled-only pp256@d8192
 * f16, one thread, medians of 5 under load ~5, 11 alternations, Zen 5: 4.22 -> 3.89 ns per row x
 * head x key. */
MOE_INLINE void z_attn_prefetch_key(const moe_attn_tile_args *a, int j) {
    avx2_attn_prefetch_next((const uint8_t *)a->k + j * a->k_stride, a->k_stride,
                            (int64_t)moe_type_row_bytes(a->kv_type, a->dk));
    avx2_attn_prefetch_next((const uint8_t *)a->v + j * a->v_stride, a->v_stride,
                            (int64_t)moe_type_row_bytes(a->kv_type, a->dv));
}

/* Scaled scores of keys j..j+nk-1 of the tile for nv registers of query vectors from vector i0
 * (nk x nv <= 16), into st[key][vector] (-inf where a vector does not see the key); their maxima
 * into mx. */
MOE_INLINE void z_attn_scores_keys(const moe_attn_tile_args *a, const float *kc, int j, int nk,
                                   int i0, int nv, const __m512i *lo, const __m512i *hi,
                                   float (*st)[MOE_ATTN_TILE_QV], __m512 *mx) {
    __m512 acc[8][4];
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++)
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[u][v] = _mm512_setzero_ps();
    const float *k0 = kc + (int64_t)j * a->dk;
    for (int u = 0; i0 == 0 && u < nk && j + u < a->n_key; u++) z_attn_prefetch_key(a, j + u);
    for (int d = 0; d < a->dk; d++) {
        __m512 q[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) q[v] =
            _mm512_loadu_ps(a->qt + (int64_t)d * MOE_ATTN_TILE_QV + i0 + 16 * v);
        _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) {
            const __m512 k = _mm512_set1_ps(k0[(int64_t)u * a->dk + d]);
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[u][v] =
                _mm512_fmadd_ps(q[v], k, acc[u][v]);
        }
    }
    for (int u = 0; u < nk && j + u < a->n_key; u++) {
        const __m512i key = _mm512_set1_epi32(j + u);
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            const __mmask16 sees = _mm512_cmpge_epi32_mask(key, lo[i0 / 16 + v]) &
                                   _mm512_cmple_epi32_mask(key, hi[i0 / 16 + v]);
            const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), sees, acc[u][v],
                                                _mm512_set1_ps(a->scale));
            _mm512_storeu_ps(&st[j + u][i0 + 16 * v], s);
            mx[i0 / 16 + v] = _mm512_max_ps(mx[i0 / 16 + v], s);
        }
    }
}

/* ---- A Q8_0 cache: integer scores (quant.h), 4 values per int32 lane ----
 * A lane holds 4 values of one query vector, the 4 values of a key broadcast beside it.
 * vpdpbusd (VNNI) wants the key's bytes unsigned: it takes k + 128 (xor 0x80) and 128 x the
 * query block's sum comes off after; without VNNI the key's sign moves onto the query (|k| x
 * +-q: pairs <= 2 x 128 x 127, so vpmaddubsw never saturates). Either way the int32 sums are
 * exact, then one fma per block as the reference does it. */

/* Scores of keys j..j+nk-1 against query registers v0..v0+nv-1 (16 vectors each) over block
 * blk: the float chain carried in st between blocks; after the last, scaled and masked as
 * z_attn_scores_keys does, maxima into mx. */
MOE_INLINE void z_attn_q8_keys(const moe_attn_tile_args *a, int blk, int j, int nk, int v0, int nv,
                               const __m512i *bias, const __m512i *lo, const __m512i *hi,
                               float (*st)[MOE_ATTN_TILE_QV], __m512 *mx) {
    const moe_block_q8_0 *kb[8];
    __m512i acc[8][4];
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) { /* keys past the tile: the last's */
        const int key = j + u < a->n_key ? j + u : a->n_key - 1;
        kb[u] = (const moe_block_q8_0 *)((const uint8_t *)a->k + key * a->k_stride) + blk;
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[u][v] = _mm512_setzero_si512();
    }
    const int8_t *qq = a->qq + (int64_t)blk * 8 * MOE_ATTN_TILE_QV * 4 + 64 * v0;
    _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
        __m512i q[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) q[v] =
            _mm512_loadu_si512(qq + (int64_t)t * MOE_ATTN_TILE_QV * 4 + 64 * v);
        _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) {
            int32_t k4;
            memcpy(&k4, kb[u]->qs + 4 * t, sizeof k4);
#if MOE_AVX512_VNNI
            /* broadcast from memory, then the xor: the xor on the scalar before needed the
             * broadcast from a general register, 2 uops (tg1@d4096 q8_0, one thread, Zen 5:
             * 5.62 -> 5.18 ns per row x head x key, medians of 7 under load ~3.5) */
            const __m512i ku =
                _mm512_xor_si512(_mm512_set1_epi32(k4), _mm512_set1_epi8((char)0x80));
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[u][v] =
                z_dp_u8_i8(acc[u][v], ku, q[v]);
#else
            const __m512i k = _mm512_set1_epi32(k4), ku = _mm512_abs_epi8(k);
            const __mmask64 neg = _mm512_movepi8_mask(k);
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) acc[u][v] = z_dp_u8_i8(
                acc[u][v], ku, _mm512_mask_sub_epi8(q[v], neg, _mm512_setzero_si512(), q[v]));
#endif
        }
    }
    const bool last = blk + 1 == a->dk / MOE_QK32;
    const float *qd = a->qd + (int64_t)blk * MOE_ATTN_TILE_QV + 16 * v0;
    _Pragma("GCC unroll 8") for (int u = 0; u < nk; u++) { /* unrolled: acc stays in registers */
        if (j + u >= a->n_key) break;
        const __m512 kd = _mm512_set1_ps(avx2_fp16(kb[u]->d));
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[u][v], bias[v0 + v]));
            float *sj = &st[j + u][16 * (v0 + v)];
            const __m512 f = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(qd + 16 * v), kd), isum,
                                             blk ? _mm512_loadu_ps(sj) : _mm512_setzero_ps());
            if (!last) {
                _mm512_storeu_ps(sj, f);
                continue;
            }
            const __m512i key = _mm512_set1_epi32(j + u);
            const __mmask16 sees =
                _mm512_cmpge_epi32_mask(key, lo[v0 + v]) & _mm512_cmple_epi32_mask(key, hi[v0 + v]);
            const __m512 sc =
                _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), sees, f, _mm512_set1_ps(a->scale));
            _mm512_storeu_ps(sj, sc);
            mx[v0 + v] = _mm512_max_ps(mx[v0 + v], sc);
        }
    }
}

/* ---- Up to 8 query vectors on a Q8_0 cache: two keys per register ----
 * One key a register (z_attn_q8_keys) leaves lanes 8-15 to zero vectors in decode, half of
 * every vpdpbusd. Here lanes 0-7 hold vectors 0-7 against key 2p of pair p and lanes 8-15 the
 * same vectors against key 2p + 1: the pair's two K blocks lie side by side in one register,
 * and each 4-byte step of both goes over its half by one vpermd. Every lane's integer sum and
 * float chain are the ones z_attn_q8_keys makes, so the bits are too. bench/attention --rows 1
 * --tiled-only --kv-type q8_0, one thread, Zen 5, medians under load ~3: 4.9 -> 4.1 ns per row x
 * head x key at depth 4096 in cache, 4.85 -> 4.1 at depth 16384 over 6 layers (DRAM). */

/* Pairs p0..p0+7 over block blk (q: its 8 steps of vectors 0-7 in both halves, bias the +128's
 * share, qd the vectors' scales in both halves): the float chain carried in sp between blocks;
 * after the last, scaled and masked, keys 2p and 2p + 1 into st (lanes 8-15 of a row -inf, as
 * z_attn_q8_keys leaves vectors past 8), maxima into pmx. */
MOE_INLINE void z_attn_q8_pair_keys(const moe_attn_tile_args *a, int blk, int p0, const __m512i *q,
                                    __m512i bias, __m512 qd, __m512i lo, __m512i hi,
                                    float (*sp)[16], float (*st)[MOE_ATTN_TILE_QV], __m512 *pmx) {
    const __m512i half = _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);
    const moe_block_q8_0 *kb[8][2];
    __m512i acc[8];
    _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {
        for (int e = 0; e < 2; e++) { /* keys past the tile: the last's */
            const int key = 2 * (p0 + u) + e < a->n_key ? 2 * (p0 + u) + e : a->n_key - 1;
            kb[u][e] = (const moe_block_q8_0 *)((const uint8_t *)a->k + key * a->k_stride) + blk;
        }
        __m512i kk = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)kb[u][0]->qs)),
            _mm256_loadu_si256((const __m256i *)kb[u][1]->qs), 1);
#if MOE_AVX512_VNNI
        kk = _mm512_xor_si512(kk, _mm512_set1_epi8((char)0x80)); /* unsigned, as in q8_keys */
#endif
        acc[u] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
            const __m512i k =
                _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(t)), kk);
#if MOE_AVX512_VNNI
            acc[u] = z_dp_u8_i8(acc[u], k, q[t]);
#else
            const __mmask64 neg = _mm512_movepi8_mask(k);
            acc[u] = z_dp_u8_i8(acc[u], _mm512_abs_epi8(k),
                                _mm512_mask_sub_epi8(q[t], neg, _mm512_setzero_si512(), q[t]));
#endif
        }
    }
    const bool last = blk + 1 == a->dk / MOE_QK32;
    const __m256 none = _mm256_set1_ps(-INFINITY);
    _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {
        const int j = 2 * (p0 + u);
        if (j >= a->n_key) break;
        const __m512 kd = _mm512_insertf32x8(_mm512_set1_ps(avx2_fp16(kb[u][0]->d)),
                                             _mm256_set1_ps(avx2_fp16(kb[u][1]->d)), 1);
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[u], bias));
        const __m512 f = _mm512_fmadd_ps(_mm512_mul_ps(qd, kd), isum,
                                         blk ? _mm512_load_ps(sp[p0 + u]) : _mm512_setzero_ps());
        if (!last) {
            _mm512_store_ps(sp[p0 + u], f);
            continue;
        }
        const __m512i key = _mm512_add_epi32(_mm512_srli_epi32(half, 3), _mm512_set1_epi32(j));
        const __mmask16 sees = _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmple_epi32_mask(key, hi);
        const __m512 sc =
            _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), sees, f, _mm512_set1_ps(a->scale));
        _mm256_storeu_ps(&st[j][0], _mm512_castps512_ps256(sc));
        _mm256_storeu_ps(&st[j][8], none);
        if (j + 1 < a->n_key) {
            _mm256_storeu_ps(&st[j + 1][0], _mm512_extractf32x8_ps(sc, 1));
            _mm256_storeu_ps(&st[j + 1][8], none);
        }
        *pmx = _mm512_max_ps(*pmx, sc);
    }
}

/* All scores of the tile for up to 8 query vectors (lo / hi / mx: their register's), pairs of
 * keys 8 at a time, block after block. */
static void z_attn_q8_pair_scores(const moe_attn_tile_args *a, __m512i lo, __m512i hi,
                                  float (*st)[MOE_ATTN_TILE_QV], __m512 *mx) {
    _Alignas(64) float sp[MOE_ATTN_TILE_KEYS / 2][16]; /* the pairs' chains between blocks */
    const __m512i lo2 = _mm512_shuffle_i64x2(lo, lo, 0x44),
                  hi2 = _mm512_shuffle_i64x2(hi, hi, 0x44);
    __m512 pmx = _mm512_shuffle_f32x4(*mx, *mx, 0x44);
    for (int blk = 0; blk < a->dk / MOE_QK32; blk++) {
        __m512i q[8], bias = _mm512_setzero_si512(); /* what the key's + 128 added: 128 x sum q */
        for (int t = 0; t < 8; t++) {
            q[t] = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                (const __m256i *)(a->qq + (int64_t)(blk * 8 + t) * MOE_ATTN_TILE_QV * 4)));
#if MOE_AVX512_VNNI
            bias = z_dp_u8_i8(bias, _mm512_set1_epi8(1), q[t]);
#endif
        }
        bias = _mm512_slli_epi32(bias, 7);
        const __m512 qd = _mm512_broadcast_f32x8(_mm256_loadu_ps(a->qd + blk * MOE_ATTN_TILE_QV));
        for (int p0 = 0; p0 < (a->n_key + 1) / 2; p0 += 8)
            z_attn_q8_pair_keys(a, blk, p0, q, bias, qd, lo2, hi2, sp, st, &pmx);
    }
    /* both keys' maxima per vector, the lanes past 8 as they were (-inf: no vector) */
    const __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(pmx), _mm512_extractf32x8_ps(pmx, 1));
    *mx = _mm512_insertf32x8(*mx, _mm256_max_ps(_mm512_castps512_ps256(*mx), m8), 0);
}

/* All scores of the tile from a Q8_0 cache, block after block: 4 keys x 4 query registers, or
 * 8 keys x 1, or up to 8 vectors two keys a register. */
static void z_attn_q8_scores(const moe_attn_tile_args *a, int nv, const __m512i *lo,
                             const __m512i *hi, float (*st)[MOE_ATTN_TILE_QV], __m512 *mx) {
    for (int j = 0; j < a->n_key; j++) /* the next tile's keys on their way */
        avx2_attn_prefetch_next_l2((const uint8_t *)a->k + j * a->k_stride, a->k_stride,
                                   (int64_t)moe_type_row_bytes(MOE_TYPE_Q8_0, a->dk));
    if (a->nq <= 8) {
        z_attn_q8_pair_scores(a, lo[0], hi[0], st, mx);
        return;
    }
    for (int blk = 0; blk < a->dk / MOE_QK32; blk++) {
        __m512i bias[MOE_ATTN_TILE_QV / 16]; /* what the key's + 128 added: 128 x sum q */
        for (int v = 0; v < nv; v++) {
            bias[v] = _mm512_setzero_si512();
#if MOE_AVX512_VNNI
            for (int t = 0; t < 8; t++)
                bias[v] = z_dp_u8_i8(
                    bias[v], _mm512_set1_epi8(1),
                    _mm512_loadu_si512(a->qq +
                                       ((int64_t)(blk * 8 + t) * MOE_ATTN_TILE_QV + 16 * v) * 4));
            bias[v] = _mm512_slli_epi32(bias[v], 7);
#endif
        }
        for (int v = 0; v < nv; v += 4) switch (nv - v) {
            case 1:
                for (int j = 0; j < a->n_key; j += 8)
                    z_attn_q8_keys(a, blk, j, 8, v, 1, bias, lo, hi, st, mx);
                break;
            case 2:
                for (int j = 0; j < a->n_key; j += 4)
                    z_attn_q8_keys(a, blk, j, 4, v, 2, bias, lo, hi, st, mx);
                break;
            case 3:
                for (int j = 0; j < a->n_key; j += 4)
                    z_attn_q8_keys(a, blk, j, 4, v, 3, bias, lo, hi, st, mx);
                break;
            default:
                for (int j = 0; j < a->n_key; j += 4)
                    z_attn_q8_keys(a, blk, j, 4, v, 4, bias, lo, hi, st, mx);
                break;
            }
    }
}

/* More than 8 query vectors, or a Q8_0 cache: weights into st[key][vector], the new m, l and
 * the rescale c. */
static void z_attn_softmax_lanes(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                                 float *m, float *l, float *c) {
    int32_t lo[MOE_ATTN_TILE_QV], hi[MOE_ATTN_TILE_QV];
    const int nv = (a->nq + 15) / 16;
    for (int i = 0; i < 16 * nv; i++) { /* lanes past nq: no key seen, nothing stored */
        m[i] = i < a->nq ? a->m[i] : -INFINITY;
        l[i] = i < a->nq ? a->l[i] : 0.0f;
        lo[i] = i < a->nq ? a->lo[i] : 1;
        hi[i] = i < a->nq ? a->hi[i] : 0;
    }
    __m512i vlo[MOE_ATTN_TILE_QV / 16], vhi[MOE_ATTN_TILE_QV / 16];
    __m512 mx[MOE_ATTN_TILE_QV / 16];
    for (int v = 0; v < nv; v++) {
        vlo[v] = _mm512_loadu_si512(lo + 16 * v);
        vhi[v] = _mm512_loadu_si512(hi + 16 * v);
        mx[v] = _mm512_loadu_ps(m + 16 * v);
    }
    if (a->kv_type == MOE_TYPE_Q8_0)
        z_attn_q8_scores(a, nv, vlo, vhi, st, mx);
    else
        z_attn_convert(a->k, a->k_stride, a->kv_type, a->n_key, a->dk, a->scratch);
    for (int v = 0; v < nv && a->kv_type != MOE_TYPE_Q8_0; v += 4) /* 64 vectors at a time */
        switch (nv - v) {
        case 1:
            for (int j = 0; j < a->n_key; j += 8)
                z_attn_scores_keys(a, a->scratch, j, 8, 16 * v, 1, vlo, vhi, st, mx);
            break;
        case 2:
            for (int j = 0; j < a->n_key; j += 4)
                z_attn_scores_keys(a, a->scratch, j, 4, 16 * v, 2, vlo, vhi, st, mx);
            break;
        case 3:
            for (int j = 0; j < a->n_key; j += 4)
                z_attn_scores_keys(a, a->scratch, j, 4, 16 * v, 3, vlo, vhi, st, mx);
            break;
        default:
            for (int j = 0; j < a->n_key; j += 4)
                z_attn_scores_keys(a, a->scratch, j, 4, 16 * v, 4, vlo, vhi, st, mx);
            break;
        }
    for (int v = 0; v < nv; v++) { /* the running max moves, then the weights and their sum */
        __m512 rescale;
        __m512 sum = z_attn_rescale(_mm512_loadu_ps(m + 16 * v), mx[v], _mm512_loadu_ps(l + 16 * v),
                                    &rescale);
        for (int j = 0; j < a->n_key; j++) {
            const __m512 p = z_attn_exp(_mm512_sub_ps(_mm512_loadu_ps(&st[j][16 * v]), mx[v]));
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(&st[j][16 * v], p);
        }
        _mm512_storeu_ps(m + 16 * v, mx[v]);
        _mm512_storeu_ps(l + 16 * v, sum);
        _mm512_storeu_ps(c + 16 * v, rescale);
    }
}

/* ---- Up to 8 query vectors: two keys per register ----
 * Lane 2i + e holds vector i against key 2p + e of pair p. The scores take the tile 16 pairs at
 * a time (16 fma chains in flight: 8 left the fma's latency showing), each group converted into
 * a layout for their broadcasts: the pairs' values in 16-value chunks, each chunk as two blocks
 * of 8 values (z_attn_pair_chunk) whose 8 pair-floats of a pair lie side by side in 64 bytes,
 * block b of pair p at kp[(b * Z_PAIR_GROUP + p) * 16]. So a chunk's 16 values x 16 pairs sit
 * at fixed offsets from one pointer, and the group's K is 16 KB for 128 values (a third of the
 * L1). Pairs past the tile's keys are never zeroed: their lanes' scores are masked to -inf
 * whatever they hold. */
enum { Z_PAIR_GROUP = 16 };

/* Values d..d+15 of keys r0 and r1 (kv_type F16 or F32; past dim zeros) as the pair layout's
 * two blocks: x, the pairs of values d + 0..3 and 8..11; y, those of 4..7 and 12..15 (the order
 * of 16-bit unpacks, in-lane, which an f16 row takes before its convert). */
MOE_INLINE void z_attn_pair_chunk(const void *r0, const void *r1, moe_type kv_type, int d, int dim,
                                  __m512 *x, __m512 *y) {
    if (kv_type == MOE_TYPE_F16) {
        const __mmask16 m = z_mask16(dim - d);
        const __m256i a = d + 16 <= dim ? avx2_load((const uint16_t *)r0 + d)
                                        : _mm256_maskz_loadu_epi16(m, (const uint16_t *)r0 + d);
        const __m256i b = d + 16 <= dim ? avx2_load((const uint16_t *)r1 + d)
                                        : _mm256_maskz_loadu_epi16(m, (const uint16_t *)r1 + d);
        *x = _mm512_cvtph_ps(_mm256_unpacklo_epi16(a, b));
        *y = _mm512_cvtph_ps(_mm256_unpackhi_epi16(a, b));
        return;
    }
    const __m512 a = z_load16_kv_upto(r0, kv_type, d, dim),
                 b = z_load16_kv_upto(r1, kv_type, d, dim);
    const __m512i ix = _mm512_set_epi32(27, 11, 26, 10, 25, 9, 24, 8, 19, 3, 18, 2, 17, 1, 16, 0);
    *x = _mm512_permutex2var_ps(a, ix, b);
    *y = _mm512_permutex2var_ps(a, _mm512_add_epi32(ix, _mm512_set1_epi32(4)), b);
}

/* Pairs from key j0 of the tile, up to Z_PAIR_GROUP (and the tile's end), in the pair layout
 * (kv_type F16 or F32), the next tile's rows on their way. */
MOE_INLINE void z_attn_convert_pairs_as(const moe_attn_tile_args *a, moe_type kv_type, int j0,
                                        float *kp) {
    const int dim = a->dk;
    const int64_t stride = a->k_stride, bytes = (int64_t)moe_type_row_bytes(kv_type, dim);
    const int full = dim & ~15;
    const int end = j0 + 2 * Z_PAIR_GROUP < a->n_key ? j0 + 2 * Z_PAIR_GROUP : a->n_key;
    for (int j = j0; j < end; j += 2) {
        const void *r0 = (const uint8_t *)a->k + j * stride;
        const void *r1 = j + 1 < a->n_key ? (const uint8_t *)r0 + stride : r0; /* the pad: any */
        avx2_attn_prefetch_next(r0, stride, bytes);
        if (r1 != r0) avx2_attn_prefetch_next(r1, stride, bytes);
        float *o = kp + (int64_t)(j - j0) / 2 * 16;
        __m512 x, y;
        for (int d = 0; d < full; d += 16) {
            z_attn_pair_chunk(r0, r1, kv_type, d, d + 16, &x, &y);
            _mm512_storeu_ps(o + (int64_t)d / 8 * Z_PAIR_GROUP * 16, x);
            _mm512_storeu_ps(o + (int64_t)(d / 8 + 1) * Z_PAIR_GROUP * 16, y);
        }
        if (full == dim) continue;
        z_attn_pair_chunk(r0, r1, kv_type, full, dim, &x, &y);
        _mm512_storeu_ps(o + (int64_t)full / 8 * Z_PAIR_GROUP * 16, x);
        _mm512_storeu_ps(o + (int64_t)(full / 8 + 1) * Z_PAIR_GROUP * 16, y);
    }
}
static void z_attn_convert_pairs(const moe_attn_tile_args *a, int j0, float *kp) {
    if (a->kv_type == MOE_TYPE_F16)
        z_attn_convert_pairs_as(a, MOE_TYPE_F16, j0, kp);
    else
        z_attn_convert_pairs_as(a, MOE_TYPE_F32, j0, kp);
}

#define Z_PAIR_DCHUNK 128 /* values d of the vectors laid out in pairs per pass: an 8 KB table */

/* Where value d + t (t < 16) of pair 0 lies past its 16-value chunk's start (z_attn_pair_chunk). */
MOE_INLINE int z_pair_offset(int t) {
    return (t >> 2 & 1) * Z_PAIR_GROUP * 16 + 2 * ((t & 3) + (t >> 3 << 2));
}

/* Both keys of a pair at value d, in the 16 lanes: one 64-bit broadcast. */
MOE_INLINE __m512 z_pair_bcast(const float *kd) {
    double both;
    memcpy(&both, kd, sizeof both);
    return _mm512_castpd_ps(_mm512_set1_pd(both));
}

/* Lane 2i + e <- a[i] (i < nq; the lanes past: pad). */
MOE_INLINE __m512 z_pair_lanes(const float *a, int nq, float pad) {
    float t[16];
    for (int e = 0; e < 16; e++) t[e] = e / 2 < nq ? a[e / 2] : pad;
    return _mm512_loadu_ps(t);
}
MOE_INLINE __m512i z_pair_lanes_i32(const int32_t *a, int nq, int32_t pad) {
    int32_t t[16];
    for (int e = 0; e < 16; e++) t[e] = e / 2 < nq ? a[e / 2] : pad;
    return _mm512_loadu_si512(t);
}

/* Lanes 2i of x into out[i], i < nq. */
MOE_INLINE void z_pair_even(__m512 x, int nq, float *out) {
    float t[16];
    _mm512_storeu_ps(t, x);
    for (int i = 0; i < nq; i++) out[i] = t[2 * i];
}

/* Scores of pairs p0..p0+np-1 (np 8 or 16, converted into kp) over values d0..d0+nd-1, the
 * chains carried in sp between passes; after the last, scaled and masked (-inf where a vector
 * does not see the key), maxima into mx. */
MOE_INLINE void z_attn_pair_scores(const moe_attn_tile_args *a, const float *kp,
                                   const float (*q2)[16], int d0, int nd, int p0, int np,
                                   __m512i lo, __m512i hi, float (*sp)[16], __m512 *mx) {
    __m512 acc[16];
    _Pragma("GCC unroll 16") for (int u = 0; u < np; u++) acc[u] =
        d0 ? _mm512_load_ps(sp[p0 + u]) : _mm512_setzero_ps();
    int d = d0;
    for (; d + 16 <= d0 + nd; d += 16) { /* 16 values x np pairs at fixed offsets */
        const float *kb = kp + (int64_t)d / 8 * Z_PAIR_GROUP * 16;
        _Pragma("GCC unroll 16") for (int t = 0; t < 16; t++) {
            const __m512 q = _mm512_load_ps(q2[d - d0 + t]);
            const float *kt = kb + z_pair_offset(t);
            _Pragma("GCC unroll 16") for (int u = 0; u < np; u++) acc[u] =
                _mm512_fmadd_ps(q, z_pair_bcast(kt + 16 * u), acc[u]);
        }
    }
    for (; d < d0 + nd; d++) {
        const float *kt = kp + (int64_t)d / 16 * 2 * Z_PAIR_GROUP * 16 + z_pair_offset(d % 16);
        const __m512 q = _mm512_load_ps(q2[d - d0]);
        _Pragma("GCC unroll 16") for (int u = 0; u < np; u++) acc[u] =
            _mm512_fmadd_ps(q, z_pair_bcast(kt + 16 * u), acc[u]);
    }
    const bool last = d0 + nd == a->dk;
    _Pragma("GCC unroll 16") for (int u = 0; u < np; u++) {
        if (!last) {
            _mm512_store_ps(sp[p0 + u], acc[u]);
            continue;
        }
        const __m512i key =
            _mm512_add_epi32(_mm512_set_epi32(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0),
                             _mm512_set1_epi32(2 * (p0 + u)));
        const __mmask16 sees = _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmple_epi32_mask(key, hi);
        const __m512 s =
            _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), sees, acc[u], _mm512_set1_ps(a->scale));
        _mm512_store_ps(sp[p0 + u], s);
        *mx = _mm512_max_ps(*mx, s);
    }
}

static void z_attn_softmax_pairs(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                                 float *m, float *l, float *c) {
    const int n_pair = (a->n_key + 1) / 2;
    float *kp = a->scratch;
    _Alignas(64) float sp[MOE_ATTN_TILE_KEYS / 2][16],
        q2[Z_PAIR_DCHUNK][16]; /* scores by pair; the vectors' values twice */
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lo = z_pair_lanes_i32(a->lo, a->nq, 1), hi = z_pair_lanes_i32(a->hi, a->nq, 0);
    const __m512 old = z_pair_lanes(a->m, a->nq, -INFINITY);
    __m512 mx = old;
    for (int p0 = 0; p0 < n_pair; p0 += Z_PAIR_GROUP) {
        z_attn_convert_pairs(a, 2 * p0, kp);
        for (int d0 = 0; d0 < a->dk; d0 += Z_PAIR_DCHUNK) {
            const int nd = a->dk - d0 < Z_PAIR_DCHUNK ? a->dk - d0 : Z_PAIR_DCHUNK;
            /* the table once when it holds all dk values; columns past nq: pairs nobody reads */
            for (int d = 0; d < nd && (p0 == 0 || nd < a->dk); d++)
                _mm512_store_ps(q2[d],
                                _mm512_permutexvar_ps(
                                    twice, _mm512_castps256_ps512(_mm256_loadu_ps(
                                               a->qt + (int64_t)(d0 + d) * MOE_ATTN_TILE_QV))));
            if (n_pair - p0 > 8)
                z_attn_pair_scores(a, kp, (const float(*)[16])q2, d0, nd, p0, 16, lo, hi, sp, &mx);
            else
                z_attn_pair_scores(a, kp, (const float(*)[16])q2, d0, nd, p0, 8, lo, hi, sp, &mx);
        }
    }
    mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0xb1)); /* both keys' maxima in both lanes */
    __m512 rescale;
    __m512 sum = z_attn_rescale(old, mx, z_pair_lanes(a->l, a->nq, 0.0f), &rescale);
    /* lanes 2i then 2i + 1 by themselves (vector i's keys 2p, 2p + 1); weights into st */
    const __m512i split = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int p = 0; p < n_pair; p++) {
        const __m512 w = z_attn_exp(_mm512_sub_ps(_mm512_load_ps(sp[p]), mx));
        sum = _mm512_add_ps(_mm512_add_ps(sum, w), _mm512_permute_ps(w, 0xb1));
        const __m512 t = _mm512_permutexvar_ps(split, w);
        _mm256_storeu_ps(st[2 * p], _mm512_castps512_ps256(t));
        _mm256_storeu_ps(st[2 * p + 1], _mm512_extractf32x8_ps(t, 1));
    }
    z_pair_even(mx, a->nq, m);
    z_pair_even(sum, a->nq, l);
    z_pair_even(rescale, a->nq, c);
}

/* out[i..i+nq-1] += weights x values for dv values, 64 at a time (the last masked). */
MOE_INLINE void z_attn_mix_rows(const moe_attn_tile_args *a, const float *vc,
                                float (*st)[MOE_ATTN_TILE_QV], int i, int nq) {
    for (int d = 0; d < a->dv; d += 64) {
        __mmask16 mask[4];
        __m512 acc[4][4];
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
            const int w = a->dv - d - 16 * u;
            mask[u] = w >= 16 ? 0xffff : w > 0 ? (__mmask16)((1u << w) - 1) : 0;
            _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++) acc[r][u] =
                _mm512_maskz_loadu_ps(mask[u], a->out[i + r] + d + 16 * u);
        }
        for (int j = 0; j < a->n_key; j++) {
            __m512 v[4];
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) v[u] =
                _mm512_maskz_loadu_ps(mask[u], vc + (int64_t)j * a->dv + d + 16 * u);
            _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++) {
                const __m512 p = _mm512_set1_ps(st[j][i + r]);
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) acc[r][u] =
                    _mm512_fmadd_ps(p, v[u], acc[r][u]);
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < nq; r++)
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)
                _mm512_mask_storeu_ps(a->out[i + r] + d + 16 * u, mask[u], acc[r][u]);
    }
}

/* Up to 8 query vectors' mix, values d.. of nv vectors x nu registers of 16 (nv nu <= 16
 * accumulators), converted from the cache (kv_type: F16 or F32) in registers as they are loaded
 * (`tail`: the last registers masked past dv). The pass's bytes of the next tile's rows go on
 * their way a key at a time. */
MOE_INLINE void z_attn_mix_pass(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                                float *const *out, int d, int nv, int nu, moe_type kv_type,
                                bool tail) {
    const int es = kv_type == MOE_TYPE_F16 ? 2 : 4; /* bytes a value */
    __m512 acc[16];
    __mmask16 mask[16];
    _Pragma("GCC unroll 16") for (int u = 0; u < nu; u++) {
        mask[u] = tail ? z_mask16(a->dv - d - 16 * u) : 0xffff;
        _Pragma("GCC unroll 16") for (int r = 0; r < nv; r++) acc[r * nu + u] =
            _mm512_maskz_loadu_ps(mask[u], out[r] + d + 16 * u);
    }
    const uint8_t *row = (const uint8_t *)a->v + (int64_t)d * es;
    for (int j = 0; j < a->n_key; j++, row += a->v_stride) {
        for (int b = 0; b < 16 * nu * es; b += 64)
            _mm_prefetch((const char *)row + MOE_ATTN_TILE_KEYS * a->v_stride + b, _MM_HINT_T0);
        __m512 v[16];
        _Pragma("GCC unroll 16") for (int u = 0; u < nu; u++) {
            if (kv_type == MOE_TYPE_F16)
                v[u] = _mm512_cvtph_ps(
                    tail ? _mm256_maskz_loadu_epi16(mask[u], (const uint16_t *)row + 16 * u)
                         : _mm256_loadu_si256((const __m256i *)row + u));
            else
                v[u] = tail ? _mm512_maskz_loadu_ps(mask[u], (const float *)row + 16 * u)
                            : _mm512_loadu_ps((const float *)row + 16 * u);
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < nv; r++) {
            const __m512 p = _mm512_set1_ps(st[j][r]);
            _Pragma("GCC unroll 16") for (int u = 0; u < nu; u++) acc[r * nu + u] =
                _mm512_fmadd_ps(p, v[u], acc[r * nu + u]);
        }
    }
    _Pragma("GCC unroll 16") for (int u = 0; u < nu; u++)
        _Pragma("GCC unroll 16") for (int r = 0; r < nv; r++)
            _mm512_mask_storeu_ps(out[r] + d + 16 * u, mask[u], acc[r * nu + u]);
}

/* All dv values of nv vectors, 16 nu at a time. */
MOE_INLINE void z_attn_mix_vectors(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                                   float *const *out, int nv, int nu, moe_type kv_type) {
    int d = 0;
    for (; d + 16 * nu <= a->dv; d += 16 * nu)
        z_attn_mix_pass(a, st, out, d, nv, nu, kv_type, false);
    if (d < a->dv) z_attn_mix_pass(a, st, out, d, nv, nu, kv_type, true);
}

/* Up to 8 query vectors: out[i] += weights x values with the values read once per pass for all
 * of them, no f32 copy of the tile in between (its convert and stores took as long as the
 * mix's fmas: bench/attention tg1@d2048 f16, one thread, Zen 5, 5.8 -> 4.55 ns per row x head x
 * key). 2, 4 or 8 vectors a pass: the ones past nq (weight 0) go to the scratch, the K tile's
 * room, free by now. */
static void z_attn_mix_pairs(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                             moe_type kv_type) {
    float *out[8];
    for (int r = 0; r < 8; r++) out[r] = r < a->nq ? a->out[r] : a->scratch;
    if (a->nq <= 2)
        z_attn_mix_vectors(a, st, out, 2, 8, kv_type);
    else if (a->nq <= 4)
        z_attn_mix_vectors(a, st, out, 4, 4, kv_type);
    else
        z_attn_mix_vectors(a, st, out, 8, 2, kv_type);
}

/* ---- A Q8_0 cache's mix: integer sums (quant.h) ----
 * Per V block: the tile's values as int16 pairs of keys (lane e of a register: keys 2p and
 * 2p + 1's value e), the weights as int16 pairs beside them (broadcast), so one vpdpwssd takes 2
 * keys x 16 values of a query vector; 8 vectors x the block's 32 values, the values loaded once
 * for the 8. */

/* Block b of the tile's V values as pairs, out [n_pair][32][2], the pad key's zero; the first
 * block also sends the next tile's rows on their way. */
static void z_attn_v_pairs(const moe_attn_tile_args *a, int b, int16_t *out) {
    /* a's values e (lo: 0..15, hi: 16..31) with b's beside them */
    static const int16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                       37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                       11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < a->n_key; j += 2) {
        const uint8_t *r0 = (const uint8_t *)a->v + j * a->v_stride;
        const __m512i k0 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256((const __m256i *)((const moe_block_q8_0 *)r0 + b)->qs));
        __m512i k1 = _mm512_setzero_si512();
        if (j + 1 < a->n_key)
            k1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                (const __m256i *)((const moe_block_q8_0 *)(r0 + a->v_stride) + b)->qs));
        if (b == 0) {
            const int64_t bytes = (int64_t)moe_type_row_bytes(MOE_TYPE_Q8_0, a->dv);
            avx2_attn_prefetch_next_l2(r0, a->v_stride, bytes);
            if (j + 1 < a->n_key) avx2_attn_prefetch_next_l2(r0 + a->v_stride, a->v_stride, bytes);
        }
        _mm512_storeu_si512(out + 32 * j, _mm512_permutex2var_epi16(k0, lo, k1));
        _mm512_storeu_si512(out + 32 * j + 32, _mm512_permutex2var_epi16(k0, hi, k1));
    }
}

/* The weights (already x r) of a block as int16 pairs, g its keys' scales: w[p][i] = keys 2p
 * and 2p + 1's for vector i. */
static void z_attn_w_pairs(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV],
                           const float *g, int32_t (*w)[MOE_ATTN_TILE_QV]) {
    const int nv = (a->nq + 15) / 16;
    for (int j = 0; j < a->n_key; j += 2) {
        const __m512 g0 = _mm512_set1_ps(g[j]), g1 = _mm512_set1_ps(g[j + 1]);
        for (int v = 0; v < nv; v++) {
            const __m512 p1 =
                j + 1 < a->n_key ? _mm512_loadu_ps(&st[j + 1][16 * v]) : _mm512_setzero_ps();
            const __m512i w0 =
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(&st[j][16 * v]), g0));
            const __m512i w1 = _mm512_cvtps_epi32(_mm512_mul_ps(p1, g1));
            _mm512_storeu_si512(&w[j / 2][16 * v],
                                _mm512_mask_blend_epi16(0xaaaaaaaa, w0, _mm512_slli_epi32(w1, 16)));
        }
    }
}

#if MOE_AVX512_VNNI
/* z_dp_i16 written out: around the intrinsic GCC 12 copies every accumulator twice and spills
 * (the mix's loop below ran slower than the f32 one it replaces, Zen 5). */
MOE_INLINE __m512i z_attn_dp_i16(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#else
#define z_attn_dp_i16 z_dp_i16
#endif

/* out[i..i+nq-1]'s values of block b += unit[i..] x the integer sums over the tile's pairs. */
MOE_INLINE void z_attn_mix_q8_rows(const moe_attn_tile_args *a, const int16_t *vp,
                                   int32_t (*w)[MOE_ATTN_TILE_QV], int b, const float *unit, int i,
                                   int nq) {
    __m512i acc[8][2];
    _Pragma("GCC unroll 8") for (int r = 0; r < nq; r++) acc[r][0] = acc[r][1] =
        _mm512_setzero_si512();
    for (int p = 0; p < (a->n_key + 1) / 2; p++) {
        const __m512i v0 = _mm512_loadu_si512(vp + 64 * p),
                      v1 = _mm512_loadu_si512(vp + 64 * p + 32);
        _Pragma("GCC unroll 8") for (int r = 0; r < nq; r++) {
            const __m512i wr = _mm512_set1_epi32(w[p][i + r]);
            acc[r][0] = z_attn_dp_i16(acc[r][0], v0, wr);
            acc[r][1] = z_attn_dp_i16(acc[r][1], v1, wr);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < nq; r++)
        _Pragma("GCC unroll 2") for (int u = 0; u < 2; u++) {
        float *y = a->out[i + r] + MOE_QK32 * b + 16 * u;
        _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_set1_ps(unit[i + r]),
                                            _mm512_cvtepi32_ps(acc[r][u]), _mm512_loadu_ps(y)));
    }
}

static void z_attn_mix_q8(const moe_attn_tile_args *a, float (*st)[MOE_ATTN_TILE_QV]) {
    _Alignas(64) int32_t w[MOE_ATTN_TILE_KEYS / 2][MOE_ATTN_TILE_QV];
    float mk[MOE_ATTN_TILE_KEYS], unit[MOE_ATTN_TILE_QV];
    const float *vd = a->scratch; /* the scales, then one block's value pairs */
    int16_t *vp = avx2_attn_v_scales(a, mk);
    for (int v = 0; v < (a->nq + 15) / 16; v++) { /* top, r and unit; the weights x r in st */
        __m512 top = _mm512_setzero_ps();
        for (int j = 0; j < a->n_key; j++)
            top = _mm512_max_ps(
                _mm512_mul_ps(_mm512_loadu_ps(&st[j][16 * v]), _mm512_set1_ps(mk[j])), top);
        const __mmask16 ok = _mm512_cmp_ps_mask(top, _mm512_setzero_ps(), _CMP_GT_OQ) &
                             _mm512_cmp_ps_mask(top, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
        const __m512 w16 = _mm512_set1_ps((float)MOE_ATTN_W16),
                     r = _mm512_maskz_div_ps(ok, w16, top);
        _mm512_storeu_ps(unit + 16 * v, _mm512_maskz_div_ps(ok, top, w16));
        for (int j = 0; j < a->n_key; j++)
            _mm512_storeu_ps(&st[j][16 * v], _mm512_mul_ps(_mm512_loadu_ps(&st[j][16 * v]), r));
    }
    for (int b = 0; b < a->dv / MOE_QK32; b++) {
        z_attn_v_pairs(a, b, vp);
        z_attn_w_pairs(a, st, vd + b * AVX2_ATTN_VD, w);
        int i = 0;
        for (; i + 8 <= a->nq; i += 8) z_attn_mix_q8_rows(a, vp, w, b, unit, i, 8);
        for (; i < a->nq; i++) z_attn_mix_q8_rows(a, vp, w, b, unit, i, 1);
    }
}

static void z_attn_tile(const moe_attn_tile_args *a) {
    _Alignas(64) float st[MOE_ATTN_TILE_KEYS][MOE_ATTN_TILE_QV]; /* weights: st[key][vector] */
    float m[MOE_ATTN_TILE_QV], l[MOE_ATTN_TILE_QV], c[MOE_ATTN_TILE_QV];
    if (a->nq <= 8 && a->kv_type != MOE_TYPE_Q8_0)
        z_attn_softmax_pairs(a, st, m, l, c);
    else
        z_attn_softmax_lanes(a, st, m, l, c);
    for (int i = 0; i < a->nq; i++) {
        a->m[i] = m[i], a->l[i] = l[i];
        if (c[i] == 1.0f) continue;
        const __m512 ci = _mm512_set1_ps(c[i]);
        for (int d = 0; d < a->dv; d += 16) {
            const __mmask16 mask = a->dv - d >= 16 ? 0xffff : (__mmask16)((1u << (a->dv - d)) - 1);
            const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, a->out[i] + d), ci);
            _mm512_mask_storeu_ps(a->out[i] + d, mask, _mm512_add_ps(y, _mm512_setzero_ps()));
        }
    }
    if (a->kv_type == MOE_TYPE_Q8_0) {
        z_attn_mix_q8(a, st);
        return;
    }
    if (a->nq > 8) {
        z_attn_convert(a->v, a->v_stride, a->kv_type, a->n_key, a->dv, a->scratch);
        int i = 0;
        for (; i + 4 <= a->nq; i += 4) z_attn_mix_rows(a, a->scratch, st, i, 4);
        for (; i < a->nq; i++) z_attn_mix_rows(a, a->scratch, st, i, 1);
    } else if (a->kv_type == MOE_TYPE_F16)
        z_attn_mix_pairs(a, st, MOE_TYPE_F16);
    else
        z_attn_mix_pairs(a, st, MOE_TYPE_F32);
}

/* ==== The table ==== */

void Z_FILL(moe_kernels *k) {
    moe_type_kernels *types = k->types;
    z_iq_tables_fill();
    k->attn_scores = z_attn_scores;
    k->attn_mix = z_attn_mix;
    k->attn_tile = z_attn_tile;
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
    moe_kernels_set_dot_rows2(types, MOE_TYPE_F32, z_dot_rows2_f32);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q4_0, z_dot_rows2_q4_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q5_0, z_dot_rows2_q5_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_Q8_0, z_dot_rows2_q8_0);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_IQ4_NL, z_dot_rows2_iq4_nl);
    moe_kernels_set_dot_rows2(types, MOE_TYPE_MXFP4, z_dot_rows2_mxfp4);
}
