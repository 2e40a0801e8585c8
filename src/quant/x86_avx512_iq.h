/* x86_avx512_iq.h: the AVX-512 helpers, the K quants' value decodes and the codebook decodes
 * shared by the kernel files built with the AVX-512 flags: x86_avx512.c (both of its builds) and
 * fast_avx512vnni.c.
 *
 * Everything is static: each file gets its own copy, and its own copy of the lookup tables
 * (z_iq_tables_fill fills them; call it from the file's fill function before any kernel runs).
 * MOE_AVX512_VNNI (0 or 1) must be defined first: with 1 the decodes use VBMI, GFNI and BMI2
 * (src/base/cpu.c requires them at the avx512vnni level). The trap: the tables are per file, so
 * a file that decodes without filling its own reads zeros. */
#ifndef MOE_QUANT_X86_AVX512_IQ_H
#define MOE_QUANT_X86_AVX512_IQ_H

#include "x86_avx2.h"

#ifndef MOE_AVX512_VNNI
#error "define MOE_AVX512_VNNI before including x86_avx512_iq.h"
#elif MOE_AVX512_VNNI && !(defined(__GFNI__) && defined(__BMI2__))
#error "MOE_AVX512_VNNI=1 needs -mgfni -mbmi2 (the Makefile's avx512vnni flags)"
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
/* The sixteen scales of sc (int16 lanes 0..15) spread over four 64-value chunks: out[k] holds
 * scale 4k + L in every int16 lane of its 128-bit lane L (z_scales(sc, z_idx4(4k)) for k = 0..3).
 * One vpermw puts scales L, 4 + L, 8 + L, 12 + L at the bottom of lane L, and unpacks repeat
 * them: one shuffle where four vpermw were. Zen 5 issues the unpacks four a cycle but the
 * shuffles (vpermw, vpermb, vpermi2b, vpmultishiftqb) two, and the codebook decodes are short of
 * those. The fast path's IQ2_S lanes, bench/kernels --tile --mib 1 (L2), 1 thread, 3 alternated
 * runs (load 6): 10.4 -> 10.9 GB/s at one row, 8.2 -> 8.8 at two, 5.9 -> 6.3 at four; IQ3_S
 * within noise. */
MOE_INLINE void z_scales4(__m512i sc, __m512i out[4]) {
    const __m512i bottom =
        _mm512_permutexvar_epi16(_mm512_setr_epi64(0x000c000800040000, 0, 0x000d000900050001, 0,
                                                   0x000e000a00060002, 0, 0x000f000b00070003, 0),
                                 sc);
    const __m512i twice = _mm512_unpacklo_epi16(bottom, bottom);
    const __m512i lo = _mm512_unpacklo_epi32(twice, twice),
                  hi = _mm512_unpackhi_epi32(twice, twice);
    out[0] = _mm512_unpacklo_epi64(lo, lo), out[1] = _mm512_unpackhi_epi64(lo, lo);
    out[2] = _mm512_unpacklo_epi64(hi, hi), out[3] = _mm512_unpackhi_epi64(hi, hi);
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

/* ==== K quants' values (x86_avx512.c's exact kernels and the fast tiles) ==== */

/* Q5_K's 32 qh bytes in both halves of a register (zero for Q4_K: qh NULL). */
MOE_INLINE __m512i z_k4_fifth_bits(const uint8_t *qh) {
    return qh ? _mm512_broadcast_i64x4(avx2_load(qh)) : _mm512_setzero_si512();
}
/* Q4_K / Q5_K: the 64 qs bytes at qs + 64 jj as values 0..15 (0..31 with q5, the fifth bits
 * from hb = z_k4_fifth_bits): lo holds values 128 jj + l (low half) and 128 jj + 64 + l (high
 * half), hi the same + 32, l = 0..31. The fifth bit of value 64p + 32h + l is bit 2p + h of
 * qh[l]. */
MOE_INLINE void z_k4_values(const uint8_t *qs, __m512i hb, int jj, bool q5, __m512i *lo,
                            __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i q = z_load(qs + 64 * jj);
    *lo = _mm512_and_si512(q, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    if (q5) {
        const __m512i blo = _mm512_mask_blend_epi64(0xf0, _mm512_set1_epi8((char)(1 << (4 * jj))),
                                                    _mm512_set1_epi8((char)(1 << (4 * jj + 2))));
        const __m512i bhi = _mm512_add_epi8(blo, blo);
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(hb, blo), *lo, bit4);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(hb, bhi), *hi, bit4);
    }
}
/* Q6_K, half h (128 values): 64 ql bytes hold values 0..63 of the half in their low nibbles
 * and 64..127 in their high ones, in order; qh (32 bytes, broadcast) gives each its top two
 * bits. vlo gets values 0..63, vhi 64..127, unsigned (0..63: q6 + 32). */
MOE_INLINE void z_q6_k_values(const moe_block_q6_k *b, int h, __m512i *vlo, __m512i *vhi) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i ql = z_load(b->ql + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(avx2_load(b->qh + 32 * h));
    *vlo = _mm512_or_si512(
        _mm512_and_si512(ql, low4),
        _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, z_idx2(0, 2)), 4), top2));
    *vhi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
        _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, z_idx2(4, 6)), 4), top2));
}

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
/* Some types decode two blocks at once, cheaper than one by one (z_grid2_plane): blocks b0, b1
 * into o[0], o[1]. Their single-block decode, z_iqb_<t>_one (Z_IQB_ONE), gives the pair decode
 * z_iqb2_<t> the block twice, and z_iqb2_of finds the pair decode behind it. */
typedef void (*z_iqb2_fn)(const void *b0, const void *b1, z_iqb o[2]);
#define Z_IQB_ONE(t)                                                                               \
    MOE_INLINE void z_iqb_##t##_one(const void *block, z_iqb *o) {                                 \
        z_iqb two[2];                                                                              \
        z_iqb2_##t(block, block, two);                                                             \
        *o = two[0];                                                                               \
    }

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
/* Entries of a 128-byte table t for the low 7 bits of idx (vpermi2b): the VBMI decodes' lookups. */
MOE_INLINE __m512i z_lookup128(__m512i idx, const uint8_t *t) {
    return _mm512_permutex2var_epi8(z_load(t), idx, z_load(t + 64));
}

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

#if MOE_AVX512_VNNI
/* ---- Grids of 8-value entries of the bytes 8, 25 and 43 (IQ2_S, IQ2_XS): two blocks at once ----
 *
 * Every byte of these grids' entries is one of three, so an entry is eight 2-bit codes (0, 1, 2
 * for 8, 25, 43): the codes of bytes 0..3 make one code byte, those of 4..7 another, and a grid
 * is two planes of those, looked up by vpermi2b a 128-entry table at a time, bits 7.. of the
 * index picking the table by blends. Two blocks' 64 entries go through at once (IQ2_S's 1024
 * entries: 16 vpermi2b and 14 blends), then a vpmultishiftqb and a vpermb per 64 values turn
 * codes into magnitudes. On Zen 5 that is ~13 cycles a block (one thread, weights in cache)
 * where fetching the 32 entries costs 28 as vpgatherdq (7 cycles per 8) and 16 as 8-byte vector
 * loads (2 a cycle): memory brings a block in ~11. Types with such a decode have a single-block
 * one too (the pair decode given one block twice: for odd counts and the one-block kernels).
 *
 * The entries are looked up in z_grid2_order: lane 8j + c holds entry j of chunk c (8 entries,
 * 64 values), chunks 0..3 the first block's, 4..7 the second's; so the word interleave of the
 * two planes' results leaves each block's entry j in qword j, four chunks deep (z_grid2_values).
 * z_iq2s_codes and z_iq2xs_codes are filled by the table's fill function. */
static uint8_t z_iq2s_codes[2][1024] __attribute__((aligned(64)));
static uint8_t z_iq2xs_codes[2][512] __attribute__((aligned(64)));
static uint8_t z_iq2xxs_codes[2][256] __attribute__((aligned(64))); /* z_dp_iq2_xxs, ROWS16 */

/* vpermt2b indices of z_grid2_order from two 64-byte registers holding a block's 32 entries'
 * index bytes `stride` bytes apart from byte `first` (the first block's in the first register). */
MOE_INLINE __m512i z_grid2_order(int stride, int first) {
    /* byte c of qword j: 64 (c / 4) + stride (8 (c % 4) + j) + first */
    const long long c = (stride == 1 ? 0x5850484018100800 : 0x7060504030201000) +
                        0x0101010101010101 * first,
                    j = 0x0101010101010101 * stride;
    return _mm512_setr_epi64(c, c + j, c + 2 * j, c + 3 * j, c + 4 * j, c + 5 * j, c + 6 * j,
                             c + 7 * j);
}

/* One plane's code bytes for 64 indices: low bytes idx, bits 8 and 9 in masks (tables: 128-entry
 * tables of the plane, 2 .. 8). */
MOE_INLINE __m512i z_grid2_plane(const uint8_t *plane, int tables, __m512i idx, __mmask64 bit8,
                                 __mmask64 bit9) {
    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
    __m512i r[4];
#pragma GCC unroll 4
    for (int q = 0; q < tables / 2; q++)
        r[q] = _mm512_mask_blend_epi8(bit7, z_lookup128(idx, plane + 256 * q),
                                      z_lookup128(idx, plane + 256 * q + 128));
    if (tables == 2) return r[0];
    const __m512i lo = _mm512_mask_blend_epi8(bit8, r[0], r[1]);
    if (tables == 4) return lo;
    return _mm512_mask_blend_epi8(bit9, lo, _mm512_mask_blend_epi8(bit8, r[2], r[3]));
}

/* Each byte's 2-bit code, picked from the qword's bits by at (vpmultishiftqb), as its magnitude
 * (8, 25 or 43). */
MOE_INLINE __m512i z_grid2_magnitudes(__m512i at, __m512i codes) {
    const __m512i mag = _mm512_set1_epi32(0x002b1908); /* byte c: the magnitude of code c % 4 */
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(at, codes), mag);
}

/* The magnitudes of two blocks (g0, g1: four 64-value chunks each) from their entries' code
 * bytes in z_grid2_order, plane 0's in p0 and plane 1's in p1. */
MOE_INLINE void z_grid2_values(__m512i p0, __m512i p1, __m512i g0[4], __m512i g1[4]) {
    /* 128-bit lane L: the words (codes of bytes 0..7) of entries 2L (lo) and 2L + 1 (hi), chunks
     * 0..7; then qword j of each block's: entry j's words of its chunks 0..3 */
    const __m512i lo = _mm512_unpacklo_epi8(p0, p1), hi = _mm512_unpackhi_epi8(p0, p1);
    const __m512i w0 = _mm512_unpacklo_epi64(lo, hi), w1 = _mm512_unpackhi_epi64(lo, hi);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        /* byte i of each qword: the code of byte i of word k at the bottom */
        const __m512i at = _mm512_set1_epi64(0x0e0c0a0806040200 + 0x1010101010101010 * k);
        g0[k] = z_grid2_magnitudes(at, w0);
        g1[k] = z_grid2_magnitudes(at, w1);
    }
}

/* A grid's code planes (n entries) from its uint64 entries. */
static void z_grid2_fill(const uint64_t *grid, int n, uint8_t *planes) {
    for (int i = 0; i < n; i++)
        for (int q = 0; q < 2; q++) {
            unsigned codes = 0;
            for (int p = 0; p < 4; p++) {
                const unsigned v = grid[i] >> (32 * q + 8 * p) & 0xff;
                codes |= (v == 0x08 ? 0u : v == 0x19 ? 1u : 2u) << (2 * p);
            }
            planes[q * n + i] = (uint8_t)codes;
        }
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
/* IQ2_S at the avx512vnni level: two blocks' codes at once (z_grid2_plane), entry e's index =
 * qs byte e | bits 2e, 2e + 1 of the qh bytes (one 64-bit word) << 8. In z_grid2_order, lane
 * 8j + c takes byte 2c + j / 4 of the blocks' qh words (the first block's bytes 0..7, the
 * second's 8..15) and tests bits 2 (j % 4) and 2 (j % 4) + 1. */
MOE_INLINE void z_iqb2_iq2_s(const void *block0, const void *block1, z_iqb o[2]) {
    const moe_block_iq2_s *b[2] = {block0, block1};
    const __m512i idx =
        _mm512_permutex2var_epi8(z_load(b[0]->qs), z_grid2_order(1, 0), z_load(b[1]->qs));
    const __m512i qh = _mm512_castsi128_si512(
        _mm_set_epi64x((long long)z_load_u64(b[1]->qh), (long long)z_load_u64(b[0]->qh)));
    const __m512i h =
        _mm512_permutexvar_epi8(_mm512_mask_blend_epi64(0xf0, _mm512_set1_epi64(0x0e0c0a0806040200),
                                                        _mm512_set1_epi64(0x0f0d0b0907050301)),
                                qh);
    const __m512i bit = _mm512_setr_epi64(
        0x0101010101010101, 0x0404040404040404, 0x1010101010101010, 0x4040404040404040,
        0x0101010101010101, 0x0404040404040404, 0x1010101010101010, 0x4040404040404040);
    const __mmask64 bit8 = _mm512_test_epi8_mask(h, bit),
                    bit9 = _mm512_test_epi8_mask(h, _mm512_add_epi8(bit, bit));
    z_grid2_values(z_grid2_plane(z_iq2s_codes[0], 8, idx, bit8, bit9),
                   z_grid2_plane(z_iq2s_codes[1], 8, idx, bit8, bit9), o[0].g, o[1].g);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        o[k].sc = _mm256_cvtepi8_epi16(avx2_iq2_scales16(b[k]->scales));
        z_sign_words(b[k]->qs + 32, o[k].neg);
        o[k].d = avx2_fp16(b[k]->d);
    }
}
Z_IQB_ONE(iq2_s)
#define Z_IQB_IQ2_S z_iqb_iq2_s_one
#else
#define Z_IQB_IQ2_S z_iqb_iq2_s
#endif

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
 * 16 values as IQ2_S's. Two blocks' codes at once (z_grid2_plane): the index bytes and bit 8 are
 * the words' low bytes and bit 0 of their high ones, picked in z_grid2_order. */
MOE_INLINE void z_iqb2_iq2_xs(const void *block0, const void *block1, z_iqb o[2]) {
    const moe_block_iq2_xs *b[2] = {block0, block1};
    const __m512i q[2] = {z_load(b[0]->qs), z_load(b[1]->qs)};
    const __m512i idx = _mm512_permutex2var_epi8(q[0], z_grid2_order(2, 0), q[1]);
    const __mmask64 bit8 = _mm512_test_epi8_mask(
        _mm512_permutex2var_epi8(q[0], z_grid2_order(2, 1), q[1]), _mm512_set1_epi8(1));
    z_grid2_values(z_grid2_plane(z_iq2xs_codes[0], 4, idx, bit8, 0),
                   z_grid2_plane(z_iq2xs_codes[1], 4, idx, bit8, 0), o[0].g, o[1].g);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        z_ksigns(_mm512_cvtepi16_epi8(_mm512_srli_epi16(q[k], 9)), o[k].neg);
        o[k].sc = _mm256_cvtepi8_epi16(avx2_iq2_scales16(b[k]->scales));
        o[k].d = avx2_fp16(b[k]->d);
    }
}
Z_IQB_ONE(iq2_xs)

/* ---- Blocks for vpdpbusd (the fast path's lanes under 8 activation rows) ----
 *
 * The decodes above leave each block in value order for the exact path's multiply (vpmaddubsw,
 * then vpdpwssd against the scales: two multiplies and two shuffles per 64 values, in one chain
 * from the lookups to the sums). The fast path needs only each block's integer sum, so at 1 .. 7
 * activation rows (fast_avx512vnni.c's fast_lanes_dp) a type may lay its blocks out for it
 * instead: each int32 lane holds values of one integer scale, so a vpdpbusd per 64 values and
 * one vpmulld per register of sums, and the activations are put in the same order once per block
 * for all the weight rows. Such a type is a z_dp_type: the activation order, the decode of one
 * block (or two, of two weight rows) into a z_dp, and how many rows a decode takes; z_dp_dot is
 * the multiply all share. The integer sums are exact, so the order changes no bits. */
typedef struct {
    __m512i mag[2][4];   /* magnitudes, unsigned, in the type's order */
    __mmask64 neg[2][4]; /* their sign bits */
    __m512i sc[2];       /* dword D of sc[h]: the integer scale of lane D of mag[h][0..3] */
    float d[2];          /* the blocks' float scales */
} z_dp;
/* Blocks b0, b1 (of rows weight rows a row apart; b1 = b0 at one) into o. */
typedef void (*z_dp_fn)(const void *b0, const void *b1, z_dp *o);
/* An activation block's 256 bytes in a type's order: x[h][i] holds, where mag[h][i] holds a
 * value, the activation it meets (x[0] only, at one row a decode). */
typedef void (*z_dp_x_fn)(const int8_t *qs, __m512i x[2][4]);
typedef struct {
    z_dp_fn decode; /* NULL: the type has none (at that row count) */
    z_dp_x_fn x;
    int rows; /* weight rows a decode: 2, lanes 0..7 of a dot row 2p's, 8..15 row 2p + 1's; or 1 */
} z_dp_type;

/* The int32 sums of a decode's scale groups against one activation row (x: the type's z_dp_x_fn),
 * each times its scale (rows: z_dp_type's). */
MOE_INLINE __m512i z_dp_dot(const z_dp *g, int rows, __m512i x[2][4]) {
    __m512i sum[2];
#pragma GCC unroll 2
    for (int h = 0; h < rows; h++) {
        sum[h] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            sum[h] =
                _mm512_dpbusd_epi32(sum[h], g->mag[h][i], z_apply_signs(x[h][i], g->neg[h][i]));
        sum[h] = _mm512_mullo_epi32(sum[h], g->sc[h]);
    }
    return rows == 2 ? _mm512_add_epi32(sum[0], sum[1]) : sum[0];
}

/* The grids of 8-value entries (IQ2_S, IQ2_XS) two blocks at a time, by entry and value position.
 * Layout: the two blocks' entries in their own order (byte 32 blk + e of the index register),
 * looked up in the code planes (z_grid2_plane), the planes' bytes interleaved: dword m of 128-bit
 * lane L of half h holds the codes of entries e = 16 (L % 2) + 8 h + 2 m and e + 1 of block L / 2,
 * as [plane 0 of e, plane 1 of e, plane 0 of e + 1, plane 1 of e + 1]. A code (a, b) stands for
 * 8 ^ 17 a ^ 35 b (8, 25, 43): affine over GF(2), so one gf2p8affineqb per value position i turns
 * code i of every byte into its magnitude (z_grid2_affine). mag[h][i] dword (L, m) then holds
 * values i and 4 + i of entries e and e + 1: over i = 0..3, the 16 values of scale group e / 2.
 * Zen 5, bench/kernels --tile --mib 1 (L2), one thread, one activation row, medians of 4 runs
 * alternated (load 2.6-2.9): IQ2_S 10.1 -> 11.6 GB/s (~26 -> 23 cycles a block at 3.25 GHz),
 * IQ2_XS 10.0 -> 12.5 (~24 -> 19); from DRAM (256 MiB, load 3.6-4.3) IQ2_S 8.9 -> 9.9. The
 * lookups bound it: 16 vpermi2b a pair for IQ2_S, each with both tables loaded (vpermt2b
 * overwrites one). */

/* The magnitudes of code i of every byte (bits 2i, 2i + 1: a, b): row j of the matrix (byte
 * 7 - j) picks the input bits whose parity flips output bit j, and 8 is the constant; with plus128,
 * 128 + the magnitude (bit 7 set in the constant: the magnitudes are under 128). */
MOE_INLINE __m512i z_grid2_affine(__m512i codes, int i, bool plus128) {
    const uint64_t a = 1ull << (2 * i), b = a << 1;
    const uint64_t m = (a | b) << 56 | b << 48 | a << 24 | b << 16; /* bits 0, 1, 4, 5 */
    const __m512i matrix = _mm512_set1_epi64((long long)m);
    return plus128 ? _mm512_gf2p8affine_epi64_epi8(codes, matrix, 0x88)
                   : _mm512_gf2p8affine_epi64_epi8(codes, matrix, 0x08);
}

/* o's magnitudes and signs from the two blocks' entries' code bytes (plane 0's in p0, plane 1's
 * in p1) and their sign bytes (bit v: value v of the entry), all in the blocks' order. */
MOE_INLINE void z_grid2_dp_values(__m512i p0, __m512i p1, __m512i signs, z_dp *o) {
    const __m512i u[2] = {_mm512_unpacklo_epi8(p0, p1), _mm512_unpackhi_epi8(p0, p1)};
    const __m512i s[2] = {_mm512_unpacklo_epi8(signs, signs), _mm512_unpackhi_epi8(signs, signs)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        /* byte 0 of each word tests bit i of its sign byte, byte 1 bit 4 + i */
        const __m512i bit = _mm512_set1_epi16((short)(1 << i | 1 << (12 + i)));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            o->mag[h][i] = z_grid2_affine(u[h], i, false);
            o->neg[h][i] = _mm512_test_epi8_mask(s[h], bit);
        }
    }
}

/* o's scales and d from two blocks of 4-bit scales per 16 values (IQ2_S, IQ2_XS). */
MOE_INLINE void z_grid2_dp_scales(const uint8_t scales0[8], const uint8_t scales1[8], uint16_t d0,
                                  uint16_t d1, z_dp *o) {
    /* byte 16 blk + g: group g's scale; dword (L, m) of sc[h] from byte 16 (L / 2) + 8 (L % 2) +
     * 4 h + m */
    const __m512i n = z_from_256(z_join128(avx2_iq2_scales16(scales0), avx2_iq2_scales16(scales1)));
    const __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __mmask64 low = 0x1111111111111111;
    o->sc[0] = _mm512_maskz_permutexvar_epi8(low, at, n);
    o->sc[1] = _mm512_maskz_permutexvar_epi8(low, _mm512_add_epi32(at, _mm512_set1_epi32(4)), n);
    o->d[0] = avx2_fp16(d0), o->d[1] = avx2_fp16(d1);
}

/* An activation block's 256 bytes in the layout: x[h][i] holds, where mag[h][i] holds a value,
 * the activation it meets (the same for both blocks). Lane L, dword m, byte c: value i (c even,
 * else 4 + i) of entry 16 (L % 2) + 8 h + 2 m + c / 2. */
MOE_INLINE void z_grid2_dp_x(const int8_t *qs, __m512i x[2][4]) {
    /* i = 0: byte 16 L + 4 m + c from byte 16 m + 4 c of the first register (L even) or the
     * second (+ 64) */
    const __m512i at =
        _mm512_setr_epi32(0x0c080400, 0x1c181410, 0x2c282420, 0x3c383430, 0x4c484440, 0x5c585450,
                          0x6c686460, 0x7c787470, 0x0c080400, 0x1c181410, 0x2c282420, 0x3c383430,
                          0x4c484440, 0x5c585450, 0x6c686460, 0x7c787470);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i lo = z_load(qs + 64 * h), hi = z_load(qs + 128 + 64 * h);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            x[h][i] =
                _mm512_permutex2var_epi8(lo, _mm512_add_epi8(at, _mm512_set1_epi8((char)i)), hi);
    }
}

/* IQ2_S: the 64 index bytes in order, bits 8 and 9 of entry e bits 2e and 2e + 1 of qh (pext). */
MOE_INLINE void z_dp_iq2_s(const void *block0, const void *block1, z_dp *o) {
    const moe_block_iq2_s *b0 = block0, *b1 = block1;
    const __m512i q0 = z_load(b0->qs), q1 = z_load(b1->qs);
    const __m512i idx = _mm512_shuffle_i64x2(q0, q1, 0x44),
                  signs = _mm512_shuffle_i64x2(q0, q1, 0xee);
    const uint64_t h0 = z_load_u64(b0->qh), h1 = z_load_u64(b1->qh), even = 0x5555555555555555;
    const __mmask64 bit8 = _cvtu64_mask64(_pext_u64(h0, even) | _pext_u64(h1, even) << 32),
                    bit9 =
                        _cvtu64_mask64(_pext_u64(h0, even << 1) | _pext_u64(h1, even << 1) << 32);
    z_grid2_dp_values(z_grid2_plane(z_iq2s_codes[0], 8, idx, bit8, bit9),
                      z_grid2_plane(z_iq2s_codes[1], 8, idx, bit8, bit9), signs, o);
    z_grid2_dp_scales(b0->scales, b1->scales, b0->d, b1->d, o);
}

/* IQ2_XS: entry e's word's low byte is its index's, bit 0 of its high byte bit 8, the rest its
 * ksigns index (vpermi2b reads 7 bits: the neighbour's bit shifted in is ignored). */
MOE_INLINE void z_dp_iq2_xs(const void *block0, const void *block1, z_dp *o) {
    const moe_block_iq2_xs *b0 = block0, *b1 = block1;
    const __m512i q0 = z_load(b0->qs), q1 = z_load(b1->qs);
    const __m512i low = _mm512_setr_epi64(
        0x0e0c0a0806040200, 0x1e1c1a1816141210, 0x2e2c2a2826242220, 0x3e3c3a3836343230,
        0x4e4c4a4846444240, 0x5e5c5a5856545250, 0x6e6c6a6866646260, 0x7e7c7a7876747270);
    const __m512i idx = _mm512_permutex2var_epi8(q0, low, q1),
                  high =
                      _mm512_permutex2var_epi8(q0, _mm512_add_epi8(low, _mm512_set1_epi8(1)), q1);
    const __mmask64 bit8 = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1));
    const __m512i signs = z_lookup128(_mm512_srli_epi16(high, 1), moe_ksigns_iq2xs);
    z_grid2_dp_values(z_grid2_plane(z_iq2xs_codes[0], 4, idx, bit8, 0),
                      z_grid2_plane(z_iq2xs_codes[1], 4, idx, bit8, 0), signs, o);
    z_grid2_dp_scales(b0->scales, b1->scales, b0->d, b1->d, o);
}

/* IQ2_XXS: entry e's index is byte 8 (e / 4) + e % 4 of the block, its ksigns index field e % 4
 * of the sign-and-scale word e / 4 (the block's odd dwords), whose top 4 bits give the scale of
 * its 32 values (lane (L, m) of sc[h]: the word 4 (L % 2) + 2h + m / 2 of block L / 2). */
MOE_INLINE void z_dp_iq2_xxs(const void *block0, const void *block1, z_dp *o) {
    const moe_block_iq2_xxs *b0 = block0, *b1 = block1;
    const __m512i q0 = z_load(b0->qs), q1 = z_load(b1->qs);
    const __m512i idx = _mm512_permutex2var_epi8(
        q0,
        _mm512_setr_epi64(0x0b0a090803020100, 0x1b1a191813121110, 0x2b2a292823222120,
                          0x3b3a393833323130, 0x4b4a494843424140, 0x5b5a595853525150,
                          0x6b6a696863626160, 0x7b7a797873727170),
        q1);
    const __m512i words = _mm512_permutex2var_epi32(/* dword 8 blk + s */
                                                    q0,
                                                    _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17,
                                                                      19, 21, 23, 25, 27, 29, 31),
                                                    q1);
    /* byte 4d + c: field c of word d (vpermi2b reads its low 7 bits) */
    const __m512i fields =
        _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700), words);
    z_grid2_dp_values(z_grid2_plane(z_iq2xxs_codes[0], 2, idx, 0, 0),
                      z_grid2_plane(z_iq2xxs_codes[1], 2, idx, 0, 0),
                      z_lookup128(fields, moe_ksigns_iq2xs), o);
    const __m512i at = _mm512_setr_epi32(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) /* 2 x the top 4 bits + 1 */
        o->sc[h] = _mm512_or_si512(
            _mm512_srli_epi32(
                _mm512_permutexvar_epi32(_mm512_add_epi32(at, _mm512_set1_epi32(2 * h)), words),
                27),
            _mm512_set1_epi32(1));
    o->d[0] = avx2_fp16(b0->d), o->d[1] = avx2_fp16(b1->d);
}

#endif

/* The pair decode behind a single-block one (NULL: none): the kernels that decode many blocks
 * take them two at a time through it. */
MOE_INLINE z_iqb2_fn z_iqb2_of(z_iqb_fn one) {
#if MOE_AVX512_VNNI
    return one == z_iqb_iq2_s_one ? z_iqb2_iq2_s : one == z_iqb_iq2_xs_one ? z_iqb2_iq2_xs : NULL;
#else
    (void)one;
    return NULL;
#endif
}

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
/* With VBMI the grid lives within reach of vpermi2b. Its bytes are 1, 3, .. 15, four bits each,
 * so the magnitudes of bytes 0, 1 (and 2, 3) of every entry fit one byte as nibbles: two
 * 512-byte planes, four 128-byte tables each (index bits 0..6; bits 7 and 8 pick the table,
 * z_grid2_plane). All 64 entries of a block are looked up at once in the file's order, a plane
 * at a time (8 vpermi2b); two vpermt2b pair each entry's plane bytes into a 16-bit word of four
 * nibbles, in any order of entries the caller asks for (z_iq3s_order), and a vpmultishiftqb and
 * an and per 64 values spread the nibbles to bytes. z_iq3s_codes is filled by the table's fill
 * function. */
static uint8_t z_iq3s_codes[2][512] __attribute__((aligned(64)));

/* vpermt2b indices (plane 0 in the first operand, plane 1 in the second) of the two word
 * registers z_iq3s_magnitudes expands; filled by the table's fill function. Word 4q + 2b + w of
 * register a holds entry Z_IQ3S_VALUES: 32a + 16b + 2q + w, so register k = 2a + b gets entries
 * 16k .. 16k + 15 in order (z_iqb's g); Z_IQ3S_GROUPED: 8q + 4a + 2b + w, so int32 lane D of
 * register k holds entry 8 (D / 2) + 2k + D % 2, values of the 32 that share scale D / 2 in
 * every register (fast_avx512vnni.c's IQ3_S lanes). */
enum { Z_IQ3S_VALUES, Z_IQ3S_GROUPED };
static uint8_t z_iq3s_order[2][2][64] __attribute__((aligned(64)));

/* The magnitudes of a block's 256 values in order `order` (z_iq3s_order) into g[0..3]. */
MOE_INLINE void z_iq3s_magnitudes(const moe_block_iq3_s *b, int order, __m512i g[4]) {
    const __m512i idx = z_load(b->qs);
    const __mmask64 bit8 = _cvtu64_mask64(z_load_u64(b->qh));
    const __m512i p0 = z_grid2_plane(z_iq3s_codes[0], 4, idx, bit8, 0),
                  p1 = z_grid2_plane(z_iq3s_codes[1], 4, idx, bit8, 0);
    /* byte i of a qword: nibble i % 4 of word i / 4 (words 0, 1) or 2 + i / 4 (words 2, 3) */
    const __m512i at[2] = {_mm512_set1_epi64(0x1c1814100c080400),
                           _mm512_set1_epi64(0x3c3834302c282420)};
#pragma GCC unroll 2
    for (int a = 0; a < 2; a++) {
        const __m512i words = _mm512_permutex2var_epi8(p0, z_load(z_iq3s_order[order][a]), p1);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            g[2 * a + h] = _mm512_and_si512(_mm512_multishift_epi64_epi8(at[h], words),
                                            _mm512_set1_epi8(0x0f));
    }
}

MOE_INLINE void z_iqb_iq3_s(const void *block, z_iqb *o) {
    const moe_block_iq3_s *b = block;
    z_iq3s_magnitudes(b, Z_IQ3S_VALUES, o->g);
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
 * of four 7-bit ksigns indices | a 4-bit scale << 28. The 3-bit codes of entry bytes 0, 1 (2, 3)
 * are looked up in a 256-byte plane, two vpermi2b tables each (bit 7 picks), then codes to
 * values with vpshufb. z_iq3xxs_codes is filled by the table's fill function. */
static uint8_t z_iq3xxs_codes[2][256] __attribute__((aligned(64)));
static const uint8_t z_iq3xxs_grid_bytes[16] = {4, 12, 20, 28, 36, 44, 52, 62};
/* The values of the 3-bit codes in c's low (hi: high) nibbles, + 128 with plus128. */
MOE_INLINE __m512i z_iq3xxs_values(__m512i c, int hi, bool plus128) {
    const __m512i lut = _mm512_or_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)z_iq3xxs_grid_bytes)),
        _mm512_set1_epi8(plus128 ? (char)0x80 : 0));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    return _mm512_shuffle_epi8(lut, _mm512_and_si512(hi ? _mm512_srli_epi16(c, 4) : c, low4));
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

/* The 64 four-byte entries of an IQ3_XXS block (or of 16 rows' ROWS16 indices) into o->g: idx
 * (in z_slot_order) and its bit 7 pick entries of the two code planes. */
MOE_INLINE void z_lookup_planes(__m512i idx, z_iqb *o) {
    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
    __m512i r[4];
#pragma GCC unroll 2
    for (int q = 0; q < 2; q++) {
        const uint8_t *t = z_iq3xxs_codes[q];
        const __m512i c =
            _mm512_mask_blend_epi8(bit7, z_lookup128(idx, t), z_lookup128(idx, t + 128));
        r[2 * q] = z_iq3xxs_values(c, 0, false);
        r[2 * q + 1] = z_iq3xxs_values(c, 1, false);
    }
    z_interleave4(r, o->g);
}

MOE_INLINE void z_iqb_iq3_xxs(const void *block, z_iqb *o) {
    const moe_block_iq3_xxs *b = block;
    z_lookup_planes(_mm512_permutexvar_epi8(z_slot_order(), z_load(b->qs)), o);
    const __m256i words = avx2_load(b->qs + 64);
    z_ksigns(z_ksign_fields(words), o->neg);
    o->sc = z_top4_scales(words);
    o->d = avx2_fp16(b->d);
}

/* ---- 4-value entries with a scale per 32 values (IQ3_S, IQ3_XXS) for vpdpbusd, one block a
 * decode (z_dp_type) ----
 *
 * Grouped order: int32 lane D of mag[0][k] holds entry 8 (D / 2) + 2k + D % 2, so every lane of
 * the four registers holds values of the 32 that share scale D / 2, and one vpmulld scales them
 * (sc[0] dword D), where the value-order lanes need a vpmaddubsw and a vpdpwssd per 64 values
 * and the scales spread over four registers. The sign bits are a byte transpose of the block's
 * 32 sign bytes, per weight block. */

/* An activation block in the grouped order: x[0][k] qword q = values 32q + 8k .. 32q + 8k + 7. */
MOE_INLINE void z_dp_x_grouped(const int8_t *qs, __m512i x[2][4]) {
    const __m512i v[4] = {z_load(qs), z_load(qs + 64), z_load(qs + 128), z_load(qs + 192)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512i at = _mm512_setr_epi64(k, 4 + k, 8 + k, 12 + k, k, 4 + k, 8 + k, 12 + k);
        x[0][k] = _mm512_mask_blend_epi64(0xf0, _mm512_permutex2var_epi64(v[0], at, v[1]),
                                          _mm512_permutex2var_epi64(v[2], at, v[3]));
    }
}

/* The grouped sign masks from a block's 32 sign bytes (bytes 0..31 of signs; bit j of byte s:
 * value 8s + j): byte 8q + j of register k tests bit j of sign byte 4q + k (a vpermb and a
 * vptestmb; a byte transpose and four kmovq, through general registers or a store, ran no faster
 * at one row, 0.9x at four). */
MOE_INLINE void z_dp_grouped_signs(__m512i signs, __mmask64 neg[4]) {
    const long long four = 0x0404040404040404;
    const __m512i pick = _mm512_setr_epi64(0, four, 2 * four, 3 * four, 4 * four, 5 * four,
                                           6 * four, 7 * four),
                  bit = _mm512_set1_epi64((long long)0x8040201008040201);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        neg[k] = _mm512_test_epi8_mask(
            _mm512_permutexvar_epi8(_mm512_add_epi8(pick, _mm512_set1_epi8((char)k)), signs), bit);
}

/* The grouped scales, 2 s + 1 in lane D, s the 4 bits at shift (D / 2) + first of scales. */
MOE_INLINE __m512i z_dp_grouped_scales(__m512i scales, __m512i shift) {
    const __m512i s = _mm512_srlv_epi32(scales, shift);
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(s, 1), _mm512_set1_epi32(0x1e),
                                     _mm512_set1_epi32(1), 0xea);
}

/* IQ3_S: the magnitudes in Z_IQ3S_GROUPED order; the scales' nibble D / 2 of one word. */
MOE_INLINE void z_dp_iq3_s(const void *block, const void *unused, z_dp *o) {
    (void)unused;
    const moe_block_iq3_s *b = block;
    z_iq3s_magnitudes(b, Z_IQ3S_GROUPED, o->mag[0]);
    z_dp_grouped_signs(_mm512_castsi256_si512(avx2_load(b->signs)), o->neg[0]);
    uint32_t scales;
    memcpy(&scales, b->scales, sizeof scales);
    o->sc[0] = z_dp_grouped_scales(
        _mm512_set1_epi32((int)scales),
        _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28));
    o->d[0] = avx2_fp16(b->d);
}

/* IQ3_XXS: the grid indices put in the grouped order before the lookups (z_iq3xxs_grouped:
 * z_interleave4 leaves slot 16L + 4k + m in dword 4L + m of g[k]); the sign bytes from the
 * ksigns indices; the scales from the top nibble of word D / 2. */
static uint8_t z_iq3xxs_grouped[64] __attribute__((aligned(64)));
MOE_INLINE void z_dp_iq3_xxs(const void *block, const void *unused, z_dp *o) {
    (void)unused;
    const moe_block_iq3_xxs *b = block;
    z_iqb v;
    z_lookup_planes(_mm512_permutexvar_epi8(z_load(z_iq3xxs_grouped), z_load(b->qs)), &v);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) o->mag[0][k] = v.g[k];
    const __m256i words = avx2_load(b->qs + 64);
    const uint8_t *t = moe_ksigns_iq2xs;
    z_dp_grouped_signs(_mm512_permutex2var_epi8(z_load(t),
                                                _mm512_castsi256_si512(z_ksign_fields(words)),
                                                z_load(t + 64)),
                       o->neg[0]);
    o->sc[0] = z_dp_grouped_scales(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                 _mm512_castsi256_si512(words)),
        _mm512_set1_epi32(28));
    o->d[0] = avx2_fp16(b->d);
}

/* The vpdpbusd pair decode of a type with a single-block decode one, for `rows` activation rows
 * (decode NULL: none, or slower there than the value-order decode). IQ2_S only up to 2 rows: Zen 5,
 * bench/kernels --tile --mib 256, 1 thread, 3 runs alternated (load 3.6-4.8), GB/s before ->
 * after: 8.9 -> 9.9 at one row, 7.5 -> 8.4 at two, but 6.7 -> 6.0 at three, 5.9 -> 5.7 at four,
 * 4.0 -> 3.8 at seven (its 16 lookups and 14 blends a pair leave the rows' work fewer registers);
 * IQ2_XS (8 lookups) gains at every count: 5.2 -> 6.6 at four, 3.6 -> 4.4 at seven. IQ3_XXS
 * grouped against its value-order lanes, Zen 5, the file's layout (the engine repacks IQ3_XXS to
 * ROWS16, which has lanes of its own: fast_avx512vnni.c), medians of 3 alternated runs
 * (load 3.5-4.2): 4 MiB 12.6 -> 16.1 GB/s at one row, 10.3 -> 11.8 at two, 7.4 -> 8.3 at four; 256
 * MiB 13.0 -> 15.4, 9.8 -> 12.0, 7.4 -> 8.6. IQ2_XXS (its rows the engine leaves in the file's
 * layout: --no-repack, a matrix's last rows % 16) against its value-order lanes, whose entries are
 * 8-byte loads, 128 MiB, means of 2 runs alternated (load 4): 7.1 -> 13.9 GB/s at one row, 6.4
 * -> 9.5 at two, 5.5
 * -> 7.8 at three, 4.5 -> 6.5 at four, 3.0 -> 4.2 at seven (1 MiB, medians of 6: 6.5 -> 16.2 at
 * one row, 3.1 -> 3.8 at seven). */
MOE_INLINE z_dp_type z_dp_of(z_iqb_fn one, int rows) {
    if (one == z_iqb_iq2_s_one && rows <= 2) return (z_dp_type){z_dp_iq2_s, z_grid2_dp_x, 2};
    if (one == z_iqb_iq2_xs_one) return (z_dp_type){z_dp_iq2_xs, z_grid2_dp_x, 2};
    if (one == z_iqb_iq2_xxs) return (z_dp_type){z_dp_iq2_xxs, z_grid2_dp_x, 2};
    if (one == z_iqb_iq3_s) return (z_dp_type){z_dp_iq3_s, z_dp_x_grouped, 1};
    if (one == z_iqb_iq3_xxs) return (z_dp_type){z_dp_iq3_xxs, z_dp_x_grouped, 1};
    return (z_dp_type){NULL, NULL, 0};
}

#endif

/* The decodes' lookup tables, from the shared codebooks. */
static void z_iq_tables_fill(void) {
    for (int i = 0; i < 16; i++) z_iq4_mag[i] = (int8_t)abs(moe_kvalues_iq4nl[i]);
#if MOE_AVX512_VNNI
    z_grid2_fill(moe_iq2s_grid, 1024, z_iq2s_codes[0]);
    z_grid2_fill(moe_iq2xs_grid, 512, z_iq2xs_codes[0]);
    z_grid2_fill(moe_iq2xxs_grid, 256, z_iq2xxs_codes[0]);
    for (int i = 0; i < 512; i++)
        for (int q = 0; q < 2; q++) {
            const unsigned lo = moe_iq3s_grid[i] >> (16 * q) & 0xff,
                           hi = moe_iq3s_grid[i] >> (16 * q + 8) & 0xff;
            z_iq3s_codes[q][i] = (uint8_t)(lo | hi << 4);
        }
    /* entry e in word 4q + 2b + w of register a (z_iq3s_order): plane 0's byte, then plane 1's */
    for (int a = 0; a < 2; a++)
        for (int q = 0; q < 8; q++)
            for (int bw = 0; bw < 4; bw++) {
                const int e[2] = {32 * a + 16 * (bw / 2) + 2 * q + bw % 2, 8 * q + 4 * a + bw};
                for (int o = 0; o < 2; o++) {
                    z_iq3s_order[o][a][2 * (4 * q + bw)] = (uint8_t)e[o];
                    z_iq3s_order[o][a][2 * (4 * q + bw) + 1] = (uint8_t)(64 + e[o]);
                }
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
    for (int slot = 0; slot < 64; slot++) { /* slot 16L + 4k + m: entry 8 (D / 2) + 2k + D % 2 */
        const int L = slot / 16, k = slot / 4 % 4, m = slot % 4;
        z_iq3xxs_grouped[slot] = (uint8_t)(16 * L + 8 * (m / 2) + 2 * k + m % 2);
    }
#endif
}

#endif
