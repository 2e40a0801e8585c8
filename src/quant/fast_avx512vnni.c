/* fast_avx512vnni.c: the fast path's kernels at the avx512vnni level (quant.h, "The two paths").
 *
 * Weight rows go 16 at a time into the lanes of a register: each weight block of the 16 rows is
 * decoded once into an L1 tile of signed bytes, tile[g] holding values 4g .. 4g + 3 of row v in
 * int32 lane v, and every activation row meets the tile through one vpdpbusd per 4 values with
 * its 4 activation bytes broadcast (16 rows x 4 values = 64 multiply-adds an instruction). The
 * activation bytes are made unsigned by adding 128, and 128 x (the row's sum of weights), worked
 * out once per tile, comes off again: the int32 block sums are exact. Then, lane for lane, one
 * multiply-add per block: the scalar reference's order (ref_fast.c), so a dot gives the same bits
 * alone, in a batch, at any tile width. Under FAST_TILE_MIN_ROWS activation rows the super-block
 * types skip the tile (the lanes section) with the same bits. Q4_K and Q5_K differ in two ways:
 * their values are unsigned (0..31), so the tile is vpdpbusd's unsigned side and the activation
 * bytes go in as they are, with no bias; and a second multiply-add per block takes their mins
 * against the activations' 16-value sums (vpdpwssd, the mins of 16 rows in the lanes). Q6_K's
 * values are unsigned too (stored + 32); the 32 x scale x the 16-value sums come off each block's
 * integer sum. On MOE_LAYOUT_ROWS16 the tiles are loads (ROWS16 sections). The trap:
 * an activation byte of -128 would overflow the unsigned bias; the Q8 activation quantizers
 * clamp to +-127. */
#define MOE_AVX512_VNNI 1
#include <math.h>

#include "x86_avx512_iq.h" /* the codebook decodes (VBMI) */

#if !(defined(__AVX512VNNI__) && defined(__AVX512VBMI__))
#error "fast_avx512vnni.c needs the avx512vnni flags (Makefile)"
#endif

#define FAST_CHUNK    8  /* 32-value blocks decoded per pass (Q8_0: 5 KiB touched) */
#define FAST_IQ_CHUNK 2  /* super-blocks decoded per pass (10 KiB) */
#define FAST_GROUP    64 /* activation rows per decode of a chunk (the amx level's) */
/* The same for fast_drive: a chunk's tiles are decoded again for every group of rows, and
 * matmul hands a tile kernel up to ~80 rows of a 2048-wide input (224 of a 768-wide) at once.
 * Only the rows' float accumulators grow with it (16 KiB of stack); the tiles, not the rows,
 * are what stays in L1. Zen 5, bench/kernels --tile, 4 MiB, against the exact path's rate in
 * the same run (load 5-6), 64 -> 256: IQ2_S 1.2x at 80 and 256 rows, IQ3_S 1.3x at 256, Q8_0
 * ROWS16 1.08x at 80. */
#define FAST_DRIVE_GROUP 256
/* Activation rows per pass over the tiles (fast_rows' R): a tile register is loaded once for 8
 * vpdpbusd, and 8 chains cover its latency (Zen 5: ~4 cycles, two issue a cycle). Q8_0, 64 rows,
 * L2-resident weights, 1 thread (load 8-10): ROWS16 145 -> 170 G MAC/s over 4 rows, the file's
 * layout 125 -> 150; Q6_K, IQ2_S, Q4_K within noise. */
#define FAST_ROWS 8
/* Activation rows from which a block is decoded into a tile; under that, the lanes sections. */
#define FAST_TILE_MIN_ROWS 8

/* Rows r .. n_rows - 1 as MOE_ROW_GROUPS, FAST_ROWS at a time while that many are left. */
#define FAST_ROW_GROUPS(r, n_rows, STEP, ...)                                                      \
    do {                                                                                           \
        for (; (r) + FAST_ROWS <= (n_rows); (r) += FAST_ROWS) STEP(FAST_ROWS, __VA_ARGS__);        \
        MOE_ROW_GROUPS(r, n_rows, STEP, __VA_ARGS__);                                              \
    } while (0)

/* One block of 16 weight rows, ready for the multiply. The 32-value types fill tile[0 .. 7] and
 * no scales (the rest is never touched, so costs no cache). */
typedef struct {
    __m512i tile[64];  /* lane v of tile[g]: values 4g .. 4g + 3 of row v, int8 with signs */
    __m512i scale[16]; /* lane v of scale[j]: row v's integer scale of values 16j .. 16j + 15 */
    __m512i mins[8];   /* Q4_K / Q5_K: lane v of mins[c]: row v's int16 min of values 32c ..
                        * 32c + 31, twice (against the activation's bsums 2c and 2c + 1) */
    __m512i bias;      /* signed types: 128 x sum_j scale[j] x (row v's values in sub-block j) */
    __m512 d, dmin;    /* row v's block scale (and min scale) */
} fast_tile;

/* The mins of a Q4_K / Q5_K block: sixteen int16, the min of values 16j .. 16j + 15 in lane j
 * (each sub-block's twice), and the float min scale. */
typedef void (*fast_mins_fn)(const void *block, __m256i *mins, float *dmin);

/* What a tile kernel needs of its type: the decode (regs for the super-block types, q32 for the
 * 32-value ones, the other NULL), the mins (NULL: no min term), the block size, the values that
 * share an integer scale (16 or 32: a vpmulld per row and that many values; 32 for the 32-value
 * types, whose block has none), the power of two the block scale is multiplied by after the
 * activations', and the offset (Q6_K: 32) its unsigned values are stored with: the value is
 * stored - offset, and offset x scale x (the activations' 16-value sums) comes off the integer
 * block sum, so a block keeps one float term (ref_k.c's fast order). */
typedef struct {
    z_iqb_fn regs;
    q32_decode_fn q32;
    fast_mins_fn mins;
    size_t block_bytes;
    int scale_values;
    float mult;
    int offset;
} fast_type;

/* Block i of n_w <= 16 rows ws bytes apart into a tile (rows past n_w repeat row 0). */
typedef void (*fast_decode_fn)(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile);
/* Values 4g .. 4g + 3 of a MOE_LAYOUT_ROWS16 block's 16 rows, as tile[g] holds them. */
typedef __m512i (*fast_values_fn)(const uint8_t *block, int g);
/* R activation rows (xs bytes apart, block c0 on) against nc tiles; the rows' accumulators in
 * and out through accbuf. values NULL: the tiles hold the values; else they hold the rest
 * (scales, mins, d) and the values come from ROWS16 blocks on, from vsrc, as each is needed. */
typedef void (*fast_rows_fn)(int R, fast_type t, const void *tiles, int64_t nc, const uint8_t *x,
                             size_t xs, int64_t c0, __m512 *accbuf, fast_values_fn values,
                             const uint8_t *vsrc);

/* A tile kernel: FAST_DRIVE_GROUP activation rows at a time; per chunk of blocks, each block of the
 * 16 rows decoded once into `tiles`, then every group of rows run over the chunk. */
MOE_INLINE void fast_drive(fast_type t, fast_decode_fn decode, fast_rows_fn rows, void *tiles,
                           size_t tile_bytes, int64_t chunk, const void *w, size_t ws, int n_w,
                           const void *x, size_t xs, int64_t n_rows, int64_t nb, float *out,
                           int64_t os) {
    const __mmask16 lanes = (__mmask16)((1u << n_w) - 1);
#define FAST_STEP(R, unused)                                                                       \
    rows(R, t, tiles, nc, (const uint8_t *)x + (size_t)(g0 + r) * xs, xs, c0, accbuf + r, NULL,    \
         NULL)
    MOE_TILE_LOOP(__m512, _mm512_setzero_ps, FAST_DRIVE_GROUP, chunk, n_rows, nb,
                  decode(t, w, ws, n_w, c0 + j, (uint8_t *)tiles + (size_t)j * tile_bytes),
                  FAST_ROW_GROUPS, FAST_STEP,
                  _mm512_mask_storeu_ps(out + (g0 + r) * os, lanes, accbuf[r]));
#undef FAST_STEP
}

/* The int32 sum of a Q4_K / Q5_K tile's mins against an activation block's bsums, lane v for
 * weight row v: two bsums at a time (vpdpwssd). */
MOE_INLINE __m512i fast_mins_sum(const moe_block_q8_k *y, const fast_tile *t) {
    __m512i msum = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        int32_t pair;
        memcpy(&pair, y->bsums + 2 * c, sizeof pair);
        msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(pair), t->mins[c]);
    }
    return msum;
}

/* acc + the dot of u's unsigned bytes with the 4 signed bytes at p, broadcast (vpdpbusd's
 * {1to16} memory operand: one instruction where _mm512_set1_epi32 and the intrinsic give two, as
 * GCC 12 does not fold the broadcast). Only the signed operand can be one, so only where the
 * activations are signed (the types with mins or an offset; the 32-value types' ROWS16 lanes). Q6_K
 * ROWS16, L2-resident, 1 thread (load 8): 1.10x at 16 rows, 1.03x at 64. */
MOE_INLINE __m512i fast_dpbusd_bcast(__m512i acc, __m512i u, const uint8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* A zeroed register by the zeroing idiom (vpxord r, r, r: the renamer's, no uop executed),
 * where GCC 12 would copy one zero register into every chain with a vmovdqa32. Zen 5, IQ2_S,
 * the kernel's perf samples against the exact path's in the same run (medians of 3, load 5):
 * 0.48 -> 0.44 at 64 rows, 0.70 -> 0.68 at 16: near the noise, but never slower. */
MOE_INLINE __m512i fast_zero(void) {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z)); /* volatile: one per chain, not CSEd */
    return z;
}

/* fast_rows' values under scale s of one block (tile t, the activations' block i): each row's
 * chain of vpdpbusd (from the offset's term), times the scale, into sum[r]. A vpdpbusd waits ~4
 * cycles on its chain and two issue a cycle (Zen 5), so 8 chains keep the multiply busy: from
 * FAST_ROWS rows on, a row's values under one scale are one chain; under that, chains of 4. */
MOE_INLINE void fast_rows_scale(int R, fast_type type, const fast_tile *t, int s,
                                const uint8_t *const *bytes, const uint8_t *x, size_t xs, int64_t i,
                                __m512i *sum, fast_values_fn values, const uint8_t *block) {
    const bool q32 = type.regs == NULL, plain = type.mins != NULL || type.offset;
    const int per = type.scale_values / 16;      /* groups of 4 x 4 values under one scale */
    const int chains = R >= FAST_ROWS ? 1 : per; /* per row */
    __m512i part[2][FAST_ROWS];
#pragma GCC unroll 2
    for (int h = 0; h < chains; h++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) { /* the offset's term for the 16-value groups of chain h */
            const int16_t *bsums = ((const moe_block_q8_k *)(x + (size_t)r * xs) + i)->bsums;
            int32_t off = 0;
            for (int k = h; type.offset && k < per; k += chains)
                off -= type.offset * bsums[per * s + k];
            part[h][r] = type.offset ? _mm512_set1_epi32(off) : fast_zero();
        }
#pragma GCC unroll 8
    for (int c = 0; c < 4 * per; c++) {
        const int g = 4 * per * s + c, h = c / 4 % chains;
        const __m512i tg = values ? values(block, g) : _mm512_load_si512(&t->tile[g]);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (plain)
                part[h][r] = fast_dpbusd_bcast(part[h][r], tg, bytes[r] + 4 * g);
            else {
                int32_t four;
                memcpy(&four, bytes[r] + 4 * g, sizeof four);
                part[h][r] = _mm512_dpbusd_epi32(part[h][r], _mm512_set1_epi32(four), tg);
            }
        }
    }
    const __m512i scale = t->scale[per * s];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const __m512i p = chains == 2 ? _mm512_add_epi32(part[0][r], part[1][r]) : part[0][r];
        sum[r] = _mm512_add_epi32(sum[r], q32 ? p : _mm512_mullo_epi32(p, scale));
    }
}

/* The ROWS16 lanes (fast_rows16_lanes, values given) read one stream, group after group, but the
 * hardware prefetcher starts over at every 4 KiB page and falls behind the multiply: so as each
 * integer scale's values are multiplied, its share of the lines of the block
 * FAST_ROWS16_LANES_AHEAD bytes on is requested (past the group: the next group's, which starts
 * there; past the matrix: nothing, a prefetch never faults), at every row count under the tile's
 * and non-temporal (the lines are read once, within a block's time). Zen 5, bench/kernels --tile
 * 256 MiB, medians of 4 alternated runs (load 5-7), into L2 (T1, Intel's choice below) -> NTA:
 * Q4_K 20.7 -> 22.9 GB/s at one row, 20.1 -> 27.0 at two, 9.6 -> 18.1 at four (where Intel had
 * measured Q4_K 0.86x with it and left Q4_K and Q5_K without); Q6_K 23.7 -> 25.9, 20.5 -> 25.9,
 * 14.1 -> 18.0; 7 rows unchanged (11.3-11.5); T0 within noise of NTA. On Intel, Q6_K, the output
 * head's 151936 x 2048 through moe_matmul, one activation row, 1 thread, CPU ms
 * (load 3.7-4.3): 21.2 with no prefetch (the matmul's, a group at a time), 16.3-16.8 at 7-20 KiB
 * into L2; into L1 19-24 at 1-7 KiB; a whole block's lines at once 0.82-0.95x of none.
 * bench/kernels --tile, 512 MiB (load 5-6): Q6_K 0.81-0.84x of the file's layout at one row and
 * 0.83-0.85x at 4 before, 0.98-0.99x at both with it; Q5_K 1.04-1.05x at one row (0.97-1.00x
 * before); Q4_K unchanged. */
#define FAST_ROWS16_LANES_AHEAD (10u << 10)

/* Part `part` of `parts` of the lines of a ROWS16 block (bytes long) FAST_ROWS16_LANES_AHEAD on
 * requested (as part of its multiply is done). */
MOE_INLINE void fast_rows16_prefetch_part(const uint8_t *block, size_t bytes, int part, int parts) {
    for (size_t at = (bytes * (size_t)part / (size_t)parts + 63) & ~(size_t)63;
         at < bytes * (size_t)(part + 1) / (size_t)parts; at += 64)
        _mm_prefetch((const char *)block + FAST_ROWS16_LANES_AHEAD + at, _MM_HINT_NTA);
}

/* The multiply of both kinds (regs NULL: a 32-value type against Q8_0, 8 groups of 4 and no
 * scales; else a super-block against Q8_K, 64 groups, a scale per 16 or 32 values): each
 * activation row's bytes made unsigned (+128) into xb, then per sub-block one vpdpbusd per group
 * of 4 values with its 4 bytes broadcast, times the rows' scales; the bias off, then one fma per
 * block. The types with mins (Q4_K, Q5_K) have unsigned values (0..31): their tile is vpdpbusd's
 * unsigned operand and the activation bytes, broadcast as they are, its signed one, with no bias;
 * and a second fma per block for the mins: their int32 sum against the activation's bsums, two
 * at a time (vpdpwssd). Q6_K's values are unsigned too (0..63, stored + 32): each chain of 4
 * vpdpbusd starts from -32 x its 16 activations' sum, so the block sum is the reference's. */
MOE_INLINE void fast_rows(int R, fast_type type, const void *tile_buf, int64_t nc, const uint8_t *x,
                          size_t xs, int64_t c0, __m512 *accbuf, fast_values_fn values,
                          const uint8_t *vsrc) {
    const fast_tile *tiles = tile_buf;
    const bool q32 = type.regs == NULL, mins = type.mins != NULL, plain = mins || type.offset;
    const int groups = q32 ? MOE_QK32 / 4 : MOE_QK_K / 4;
    /* the blocks' bytes made unsigned, groups dwords a block (nc <= the chunk of its type) */
    _Static_assert(FAST_CHUNK * MOE_QK32 <= FAST_IQ_CHUNK * MOE_QK_K, "xb holds a chunk");
    uint32_t xb[FAST_ROWS][FAST_IQ_CHUNK * MOE_QK_K / 4] __attribute__((aligned(64)));
    __m512 acc[FAST_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = accbuf[r];
    /* every block's unsigned bytes first, so that the broadcasts read stores made long
     * before: a broadcast of 4 bytes from a store still in flight waits for it to complete
     * (Zen 5: made as each block began, Q8_0 at R=64 ran 1.15x slower, L2-resident rows) */
    /* (a Q8_K block's 256 bytes in four 64-byte steps, unrolled: as a loop of eight 32-byte
     * steps this pass was 15 % of IQ2_S's samples at 64 rows, Zen 5, perf; so, the kernel's
     * samples against the exact path's in the same run 0.44 -> 0.42, load 5) */
    if (!plain)
        for (int64_t j = 0; j < nc; j++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t *xr = x + (size_t)r * xs;
                uint32_t *to = xb[r] + groups * j;
                if (q32)
                    _mm256_store_si256(
                        (__m256i *)to,
                        _mm256_xor_si256(avx2_load(((const moe_block_q8_0 *)xr + c0 + j)->qs),
                                         _mm256_set1_epi8((char)0x80)));
                else
#pragma GCC unroll 4
                    for (int k = 0; k < MOE_QK_K / 64; k++)
                        _mm512_store_si512(
                            to + 16 * k,
                            _mm512_xor_si512(
                                _mm512_loadu_si512(((const moe_block_q8_k *)xr + c0 + j)->qs +
                                                   64 * k),
                                _mm512_set1_epi8((char)0x80)));
            }
    for (int64_t j = 0; j < nc; j++) {
        const fast_tile *t = &tiles[j];
        __m512 dx[FAST_ROWS];
        __m512i sum[FAST_ROWS], msum[FAST_ROWS];
        const uint8_t *bytes[FAST_ROWS]; /* the 4-byte groups to broadcast */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t *xr = x + (size_t)r * xs;
            if (q32) {
                const moe_block_q8_0 *y = (const moe_block_q8_0 *)xr + c0 + j;
                dx[r] = _mm512_set1_ps(avx2_fp16(y->d));
                bytes[r] = (const uint8_t *)(xb[r] + groups * j);
            } else {
                const moe_block_q8_k *y = (const moe_block_q8_k *)xr + c0 + j;
                bytes[r] = plain ? (const uint8_t *)y->qs : (const uint8_t *)(xb[r] + groups * j);
                dx[r] = _mm512_set1_ps(y->d);
                if (mins) msum[r] = fast_mins_sum(y, t);
            }
            sum[r] = _mm512_setzero_si512();
        }
        /* the broadcasts below read xb from memory (a load port): left to itself GCC may keep
         * the bytes in registers and pick each dword out with shuffles, which cost the shuffle
         * port twice per vpdpbusd (measured a third slower on the 32-value types) */
        __asm__("" : "+m"(xb));
        /* per scale, chains of 4 vpdpbusd (a longer chain waits on its latency), then added;
         * unrolled where the values are decoded here (their shifts need constant groups) */
        const int n_scales = groups / 4 / (type.scale_values / 16);
        const uint8_t *block = values ? vsrc + (size_t)j * MOE_ROWS16 * type.block_bytes : NULL;
        if (values) {
            const size_t ahead_bytes = MOE_ROWS16 * type.block_bytes;
#pragma GCC unroll 16
            for (int s = 0; s < n_scales; s++) {
                fast_rows16_prefetch_part(block, ahead_bytes, s, n_scales);
                fast_rows_scale(R, type, t, s, bytes, x, xs, c0 + j, sum, values, block);
            }
        } else
            for (int s = 0; s < n_scales; s++)
                fast_rows_scale(R, type, t, s, bytes, x, xs, c0 + j, sum, NULL, NULL);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_mul_ps(t->d, dx[r]), _mm512_set1_ps(type.mult)),
                _mm512_cvtepi32_ps(plain ? sum[r] : _mm512_sub_epi32(sum[r], t->bias)), acc[r]);
            if (mins) /* acc - (dmin d_x) msum, one rounding: fma(-(dmin d_x), msum, acc) */
                acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(t->dmin, dx[r]),
                                          _mm512_cvtepi32_ps(msum[r]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) accbuf[r] = acc[r];
}

#include "fast_amx.h" /* the amx level's multiply: fast_rows on AMX tiles */

/* ==== 32-value types against Q8_0 (Q4_0 Q5_0 Q8_0 IQ4_NL MXFP4) ==== */

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

/* The tile's bias (128 x each row's sum of its values), from the tile. */
MOE_INLINE void fast_tile_q32_bias(fast_tile *o) {
    __m512i sum = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), o->tile[g]);
    o->bias = _mm512_slli_epi32(sum, 7);
}

/* The tiles read 16 streams a row apart, which the hardware prefetcher does not follow (as the
 * lanes section's FAST_LANES_AHEAD): so each row's line FAST_Q32_AHEAD blocks on is requested as
 * a block is decoded (past a row's end: the next row's start, read already; harmless). Q8_0,
 * rows of 4096, 512 MiB, 1 thread, one activation row: 7.3 GB/s without, 10.7-11.3 at 8 blocks,
 * 8.0-9.0 at 16 (load 2.2). */
#define FAST_Q32_AHEAD 8

/* Block i of 16 rows of a 32-value type: each row's block decoded to 32 signed bytes and its
 * scale (x86_avx2.h), two rows to a register, transposed into the tile. */
MOE_INLINE void fast_tile_q32(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                              void *tile) {
    fast_tile *o = tile;
    __m512i z[8];
    float d[16], unused;
    for (int j = 0; j < 8; j++) {
        const uint8_t *a = w + (j < n_w ? j : 0) * ws + (size_t)i * t.block_bytes;
        const uint8_t *b = w + (j + 8 < n_w ? j + 8 : 0) * ws + (size_t)i * t.block_bytes;
        _mm_prefetch((const char *)a + FAST_Q32_AHEAD * t.block_bytes, _MM_HINT_T0);
        _mm_prefetch((const char *)b + FAST_Q32_AHEAD * t.block_bytes, _MM_HINT_T0);
        z[j] = z_join(t.q32(a, &d[j], &unused), t.q32(b, &d[j + 8], &unused));
    }
    fast_transpose16x8(z, o->tile);
    fast_tile_q32_bias(o);
    o->d = _mm512_loadu_ps(d);
}

/* The values of z's low (high: its high) nibbles through map, a 16-entry book in every 128-bit
 * lane. */
MOE_INLINE __m512i fast_nibbles(__m512i z, __m512i map, bool high) {
    return _mm512_shuffle_epi8(
        map, _mm512_and_si512(high ? _mm512_srli_epi16(z, 4) : z, _mm512_set1_epi8(0x0f)));
}

/* 32 values of 16 rows from four body registers of nibbles (values 4c .. 4c + 3 in the low
 * nibbles of register c, 16 + 4c .. in the high ones) through a 16-entry book into tile[0 .. 7]. */
MOE_INLINE void fast_tile_nibbles(const uint8_t *body, const int8_t *book, __m512i *tile) {
    const __m512i map = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)book));
    for (int c = 0; c < 4; c++) {
        const __m512i z = z_load(body + 64 * c);
        tile[c] = fast_nibbles(z, map, false);
        tile[c + 4] = fast_nibbles(z, map, true);
    }
}

/* A MOE_LAYOUT_ROWS16 group is one stream, but the multiply between its loads leaves the
 * hardware prefetcher behind: so the block FAST_ROWS16_AHEAD blocks on (past the group's end: the
 * next group's, which starts there) is requested as a block is decoded. Q8_0, 512 MiB, 1 thread,
 * one activation row: 9.2-10.6 GB/s without, 11.4-11.9 at 4, 11.2-11.4 at 8 (load 3). */
#define FAST_ROWS16_AHEAD 4

/* The n bytes at p requested, a cache line at a time. */
MOE_INLINE void fast_prefetch(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* The 16 rows' block scales from the heads of a 32-value type's MOE_LAYOUT_ROWS16 block at b
 * (head: 2, f16; 1, MXFP4's e8m0 byte). */
MOE_INLINE __m512 fast_rows16_d(const uint8_t *b, size_t head) {
    if (head == 2) return _mm512_cvtph_ps(avx2_load(b));
    /* moe_e8m0_to_f32_half of 16 bytes: 2^(e - 128), as (e - 1) << 23, or the subnormals
     * 0x00200000 << e for e < 2 */
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(
        _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}

/* Block i of a MOE_LAYOUT_ROWS16 group (quant.h): the tile as it lies, no transpose. The heads
 * are the 16 rows' scales (f16; MXFP4: e8m0 bytes); the body's dword g of the 16 rows is tile[g]
 * (Q8_0), or for the nibble types (book: their 16 values) dword c holds values 4c .. 4c + 3 of
 * each row in its low nibbles (tile[c]) and values 16 + 4c .. in its high ones (tile[c + 4]). */
MOE_INLINE void fast_tile_rows16(const uint8_t *b, size_t head, const int8_t *book, void *tile) {
    fast_tile *o = tile;
    const uint8_t *body = b + MOE_ROWS16 * head;
    const size_t bytes = MOE_ROWS16 * head + (book ? 256 : 512);
    fast_prefetch(b + FAST_ROWS16_AHEAD * bytes, bytes);
    if (!book)
        for (int g = 0; g < 8; g++) o->tile[g] = z_load(body + 64 * g);
    else
        fast_tile_nibbles(body, book, o->tile);
    fast_tile_q32_bias(o);
    o->d = fast_rows16_d(b, head);
}

/* ---- 32-value types on MOE_LAYOUT_ROWS16 under FAST_TILE_MIN_ROWS rows: no tile ----
 *
 * A group's body register g is tile[g] as it lies (Q8_0; the nibble types' after their book), so
 * under FAST_TILE_MIN_ROWS activation rows each is met by the rows as it is loaded: no tile
 * stored and read back, and no bias per weight block. The weights are made vpdpbusd's unsigned
 * operand instead (value + 128: the sign bit flipped; the books' entries likewise), the
 * activations' 4 bytes its signed one, broadcast from memory (fast_dpbusd_bcast), and each
 * row's chain starts from -128 x its activation block's sum: the tile's int32 block sums, met by
 * the same fma, so the tile's bits. Rows MOE_DOT_ROWS at a time (5 .. 7 rows read a group twice,
 * the second time from cache). Zen 5, 1 thread, GB/s of weights per CPU second, the tile ->
 * this, medians of 7 runs alternated in one process (load 6): Q8_0, one group of 2048 values
 * (in L1), 47.8 -> 136 at one row (a 16-row block in 37 -> 13 cycles at 3.25 GHz), 35.8 -> 83 at
 * two, 29.9 -> 48 at four, 19.6 -> 26.2 at seven; 256 MiB of rows of 4096, 19.3 -> 20.8, 18.5 ->
 * 20.2, 16.5 -> 18.1, 14.0 -> 14.5 (8 rows, the tile: 12.4). Q4_0, IQ4_NL, MXFP4 in L1 2.35-2.4x
 * at one row, 2.0x at two, 1.3-1.4x at four; 256 MiB 1.35-1.6x, 1.15-1.25x, 1.2-1.35x. */

/* From two activation rows on, the block FAST_Q32_LANES_AHEAD blocks on is requested as a block
 * is multiplied (past the group's end: the next group's, which starts there), non-temporal; at
 * one row the hardware prefetcher keeps up alone. Zen 5, 256 MiB of rows of 4096, 1 thread,
 * medians of 9 runs alternated in one process (load 6), GB/s without -> 20 blocks ahead: Q8_0
 * 25.6 -> 25.5 at one row, 16.6 -> 19.7 at two, 14.9 -> 18.7 at four, 11.1 -> 15.8 at seven;
 * Q4_0 21.6 -> 17.9 at one row, 12.7 -> 18.5 at four; MXFP4 24.2 -> 22.9, 11.8 -> 17.4. Q8_0 at
 * 16, 20 or 24 blocks alike; at distances not a whole number of blocks less (10 KiB, 18.8 blocks:
 * 0.84-0.86x of 20 at one row and four; 16 KiB 0.82-0.84x); into L1 (T0) at 4 blocks 0.83-0.9x. */
#define FAST_Q32_LANES_AHEAD 20

/* -128 x the sum of an activation block's 32 bytes, in every lane: what a chain of vpdpbusd
 * against the weights + 128 has too much. */
MOE_INLINE __m512i fast_q32_offset(const int8_t *qs) {
    const __m256i flip = _mm256_set1_epi8((char)0x80); /* the bytes + 128, summed by 8s */
    const __m256i s =
        _mm256_sad_epu8(_mm256_xor_si256(avx2_load(qs), flip), _mm256_setzero_si256());
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t)); /* the sum + 32 x 128 */
    return _mm512_broadcastd_epi32(
        _mm_sub_epi32(_mm_set1_epi32(32 * 128 * 128), _mm_slli_epi32(t, 7)));
}

/* R <= MOE_DOT_ROWS activation rows against a ROWS16 group of nb blocks of a 32-value type
 * (head: its block's scale bytes; book: NULL for Q8_0's bytes, else its nibbles' values). */
MOE_INLINE void fast_rows16_q32_lanes(int R, const uint8_t *w, size_t head, const int8_t *book,
                                      const uint8_t *x, size_t xs, int64_t nb, float *out,
                                      int64_t os) {
    const size_t bytes = MOE_ROWS16 * head + (book ? 256 : 512);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i map = /* the book + 128 */
        book
            ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)book)), flip)
            : _mm512_setzero_si512();
    __m512 acc[MOE_DOT_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * bytes, *body = b + MOE_ROWS16 * head;
        if (R > 1)
            for (size_t at = 0; at < bytes; at += 64)
                _mm_prefetch((const char *)b + FAST_Q32_LANES_AHEAD * bytes + at, _MM_HINT_NTA);
        const moe_block_q8_0 *y[MOE_DOT_ROWS];
        __m512i sum[MOE_DOT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            y[r] = (const moe_block_q8_0 *)(x + (size_t)r * xs) + i;
            sum[r] = fast_q32_offset(y[r]->qs);
        }
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i u = book ? fast_nibbles(z_load(body + 64 * (g % 4)), map, g >= 4)
                                   : _mm512_xor_si512(z_load(body + 64 * g), flip);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                sum[r] = fast_dpbusd_bcast(sum[r], u, (const uint8_t *)y[r]->qs + 4 * g);
        }
        const __m512 d = fast_rows16_d(b, head);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(avx2_fp16(y[r]->d))),
                                     _mm512_cvtepi32_ps(sum[r]), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * os, acc[r]);
}

/* Under FAST_TILE_MIN_ROWS rows, the lanes of type t (book as fast_rows16_q32_lanes), and
 * return. */
#define FAST_Q32_LANES_STEP(R, t, book)                                                            \
    fast_rows16_q32_lanes(R, w, offsetof(moe_block_##t, qs), book,                                 \
                          (const uint8_t *)x + (size_t)r * xs, xs, n / MOE_QK32, out + r * os, os)
#define FAST_Q32_LANES(t, book)                                                                    \
    if (n_rows < FAST_TILE_MIN_ROWS) {                                                             \
        int64_t r = 0;                                                                             \
        MOE_ROW_GROUPS(r, n_rows, FAST_Q32_LANES_STEP, t, book);                                   \
        return;                                                                                    \
    }

/* The Q4_0 values as a codebook: nibble - 8. */
static const int8_t fast_q4_0_book[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

/* A 32-value type's tile kernel on the file's rows, and (head: its block's scale bytes, book:
 * NULL for Q8_0's bytes, else its nibbles' values) on MOE_LAYOUT_ROWS16 groups: the same tiles,
 * so the same bits. */
#define FAST_Q32_TYPE(t)                                                                           \
    ((fast_type){NULL, decode_##t, NULL, sizeof(moe_block_##t), MOE_QK32, 1.0f, 0})
#define FAST_Q32_KERNELS(t)                                                                        \
    static void fast_tile_rows_##t(const void *w, size_t ws, int n_w, const void *x, size_t xs,    \
                                   int64_t n_rows, int64_t n, float *out, int64_t os) {            \
        fast_tile tiles[FAST_CHUNK];                                                               \
        fast_drive(FAST_Q32_TYPE(t), fast_tile_q32, fast_rows, tiles, sizeof tiles[0], FAST_CHUNK, \
                   w, ws, n_w, x, xs, n_rows, n / MOE_QK32, out, os);                              \
    }                                                                                              \
    FAST_AMX_KERNEL(fast_amx_tile_rows_##t, fast_tile_rows_##t, FAST_Q32_TYPE(t), fast_tile_q32,   \
                    FAST_CHUNK, MOE_QK32)                                                          \
    FAST_DOT(t)
#define FAST_ROWS16_KERNEL(t, book)                                                                \
    MOE_INLINE void fast_tile_rows16_##t(fast_type ty, const uint8_t *w, size_t ws, int n_w,       \
                                         int64_t i, void *tile) {                                  \
        (void)ws, (void)n_w;                                                                       \
        fast_tile_rows16(w + (size_t)i * MOE_ROWS16 * ty.block_bytes, offsetof(moe_block_##t, qs), \
                         book, tile);                                                              \
    }                                                                                              \
    FAST_ROWS16_FN(t, FAST_Q32_TYPE(t), FAST_CHUNK, MOE_QK32, FAST_Q32_LANES(t, book))             \
    FAST_AMX_KERNEL(fast_amx_rows16_##t, fast_rows16_##t, FAST_Q32_TYPE(t), fast_tile_rows16_##t,  \
                    FAST_CHUNK, MOE_QK32)
/* The kernel on MOE_LAYOUT_ROWS16 groups of a type whose tile decode is fast_tile_rows16_<t>:
 * chunk blocks of `values` decoded per pass, after `before` (FAST_Q32_LANES or FAST_LANES_SWITCH
 * for the rows under the tile's). */
#define FAST_ROWS16_FN(t, type, chunk, values, before)                                             \
    static void fast_rows16_##t(const void *w, size_t ws, int n_w, const void *x, size_t xs,       \
                                int64_t n_rows, int64_t n, float *out, int64_t os) {               \
        MOE_CHECK(n_w == MOE_ROWS16);                                                              \
        before;                                                                                    \
        fast_tile tiles[chunk];                                                                    \
        fast_drive(type, fast_tile_rows16_##t, fast_rows, tiles, sizeof tiles[0], chunk, w, ws,    \
                   n_w, x, xs, n_rows, n / (values), out, os);                                     \
    }
/* A one-row dot through the tile kernel. */
#define FAST_DOT(t)                                                                                \
    static float fast_dot_##t(const void *w, const void *x, int64_t n) {                           \
        float out;                                                                                 \
        fast_tile_rows_##t(w, 0, 1, x, 0, 1, n, &out, 1);                                          \
        return out;                                                                                \
    }
FAST_Q32_KERNELS(q4_0)
FAST_Q32_KERNELS(q5_0)
FAST_Q32_KERNELS(q8_0)
FAST_Q32_KERNELS(iq4_nl)
FAST_Q32_KERNELS(mxfp4)
FAST_ROWS16_KERNEL(q8_0, NULL)
FAST_ROWS16_KERNEL(q4_0, fast_q4_0_book)
FAST_ROWS16_KERNEL(iq4_nl, moe_kvalues_iq4nl)
FAST_ROWS16_KERNEL(mxfp4, moe_kvalues_mxfp4)

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

/* The bias of a tile of signed values with a scale per 16 (fast_rows). */
MOE_INLINE void fast_tile_bias(fast_tile *o) {
    __m512i bias = _mm512_setzero_si512();
    for (int j = 0; j < 16; j++) {
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++)
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), o->tile[4 * j + c]);
        bias = _mm512_add_epi32(bias, _mm512_mullo_epi32(sum, o->scale[j]));
    }
    o->bias = _mm512_slli_epi32(bias, 7);
}

/* The tile decodes read 16 streams a row apart (as fast_tile_q32): so each row's block
 * FAST_IQ_AHEAD blocks on is requested as a block is decoded; past a row's end (rows ws bytes
 * apart, ws bytes long), row v + 16's start, which the matmul's next call reads (as the lanes'
 * FAST_LANES_AHEAD). */
#define FAST_IQ_AHEAD 4

/* Block i of weight row v into b[0] (its address into block[0]), and with a pair decode (pair,
 * z_iqb2_of) row v + 1's into b[1]; a row from n_w on is row `past`. Each row's block `ahead` bytes
 * on is requested. */
MOE_INLINE void fast_decode_rows(fast_type t, z_iqb2_fn pair, const uint8_t *w, size_t ws, int n_w,
                                 int v, int past, int64_t i, size_t ahead, const uint8_t *block[2],
                                 z_iqb b[2]) {
    for (int h = 0; h < (pair ? 2 : 1); h++) {
        const uint8_t *row = w + (v + h < n_w ? v + h : past) * ws;
        block[h] = row + (size_t)i * t.block_bytes;
        fast_prefetch(row + ahead, t.block_bytes);
    }
    if (pair)
        pair(block[0], block[1], b);
    else
        t.regs(block[0], &b[0]);
}

/* Block i of 16 rows of a super-block type into a tile: values, scales, d (and mins), no bias. */
MOE_INLINE void fast_tile_iq_values(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                                    void *tile) {
    fast_tile *o = tile;
    __m512i stage[4][16], sc[16];
    __m256i mins[16];
    float d[16], dmin[16];
    const size_t at = (size_t)(i + FAST_IQ_AHEAD) * t.block_bytes;
    const size_t ahead = at < ws ? at : at + (MOE_DOT_TILE_W - 1) * ws;
    const z_iqb2_fn pair = z_iqb2_of(t.regs);
    const int step = pair ? 2 : 1;
    for (int v = 0; v < 16; v += step) {
        const uint8_t *block[2];
        z_iqb b[2];
        fast_decode_rows(t, pair, w, ws, n_w, v, 0, i, ahead, block, b);
        for (int h = 0; h < step; h++) {
            for (int k = 0; k < 4; k++)
                stage[k][v + h] = z_apply_signs(b[h].g[k], _cvtu64_mask64(b[h].neg[k]));
            sc[v + h] = _mm512_cvtepi16_epi32(b[h].sc);
            d[v + h] = b[h].d;
            if (t.mins) t.mins(block[h], &mins[v + h], &dmin[v + h]);
        }
    }
    if (t.mins) { /* 16 rows of 8 min pairs: rows v and v + 8 to a register */
        __m512i z[8];
        for (int j = 0; j < 8; j++) z[j] = z_join(mins[j], mins[j + 8]);
        fast_transpose16x8(z, o->mins);
        o->dmin = _mm512_loadu_ps(dmin);
    }
    for (int k = 0; k < 4; k++) {
        fast_transpose16x16(stage[k]);
        for (int c = 0; c < 16; c++) o->tile[16 * k + c] = stage[k][c];
    }
    fast_transpose16x16(sc);
    for (int j = 0; j < 16; j++) o->scale[j] = sc[j];
    o->d = _mm512_loadu_ps(d);
}
MOE_INLINE void fast_tile_iq(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                             void *tile) {
    fast_tile_iq_values(t, w, ws, n_w, i, tile);
    if (!t.mins && !t.offset) fast_tile_bias(tile); /* signed values (fast_rows) */
}

/* ---- IQ2_S tiles from the rows' packed bytes ----
 *
 * fast_tile_iq decodes each row's block to registers in value order and transposes the values:
 * five 16 x 16 transposes a block (four of values, one of scales), its registers staged through
 * memory. Here the rows' packed bytes are transposed instead, once: qs (32 grid index bytes, 32
 * sign bytes) as sixteen dwords, qh and the scales as four, so register k of indices holds
 * entries 4k .. 4k + 3 of row v in lane v, as a ROWS16 group's body would (fast_r16_iq2_xxs).
 * Then per register of indices one lookup of 64 entries in the two code planes (z_grid2_plane:
 * 16 vpermi2b), and per tile register a vpmultishiftqb of codes, one of sign bits, a vpternlogd
 * and a vpermb: each byte's index into the signed-magnitude table is its 2-bit code (bits 0, 1)
 * and its sign (bit 2), which the multishifts put there. The same tile as fast_tile_iq's, so
 * the same bits. Zen 5, one thread, 4 MiB of rows of 4096 (L3), ns per block of 16 rows, medians
 * of 3 runs alternated (load 6.5): 470 -> 283 at 8 activation rows, 599 -> 417 at 16, 870 -> 694
 * at 32 (the decode, what the line through them leaves at 0 rows, ~310 -> ~140). */

/* The 16 bytes at offset `at` of 16 rows' blocks as four dwords: h[c] lane v holds block v's
 * dword c. Each register takes a row of every fourth into its 128-bit lanes (lane L of z[j]: row
 * 4L + j), and two unpacks leave dword c of rows 4L .. 4L + 3 in lane L. */
MOE_INLINE void fast_rows_dwords4(const uint8_t *const block[16], size_t at, __m512i h[4]) {
    __m512i z[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        z[j] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(block[j] + at)));
#pragma GCC unroll 3
        for (int L = 1; L < 4; L++)
            z[j] = _mm512_inserti32x4(z[j],
                                      _mm_loadu_si128((const __m128i *)(block[4 * L + j] + at)), L);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    h[0] = _mm512_unpacklo_epi64(t0, t2), h[1] = _mm512_unpackhi_epi64(t0, t2);
    h[2] = _mm512_unpacklo_epi64(t1, t3), h[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Byte c of each dword of words in all four of its bytes (vpshufb, within 128-bit lanes). */
MOE_INLINE __m512i fast_dword_byte(__m512i words, int c) {
    const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    return _mm512_shuffle_epi8(words,
                               _mm512_broadcast_i32x4(_mm_add_epi8(pick, _mm_set1_epi8((char)c))));
}

/* The byte mask of tile register 8s + e (values 4e .. 4e + 3 of each row's 32) from 16 rows'
 * 32-bit words for values 32s .. (bit i: value 32s + i): byte 4v + c gets bit 4e + c of lane v.
 * Each byte takes its row's byte e / 2 (vpshufb) and tests its bit. */
MOE_INLINE __mmask64 fast_bits4(__m512i words, int e) {
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8);
    const __m512i b = _mm512_broadcast_i32x4(_mm_slli_epi16(bit, 4 * (e % 2)));
    return _mm512_test_epi8_mask(fast_dword_byte(words, e / 2), b);
}

/* Block i of 16 rows of a super-block type (rows ws apart; from n_w on, row 0): row v's at
 * block[v], its f16 d (the block's first two bytes) in d[v]; each row's block FAST_IQ_AHEAD on
 * requested (fast_tile_iq's). */
MOE_INLINE void fast_iq_blocks(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               const uint8_t *block[16], uint16_t d[16]) {
    const size_t at = (size_t)(i + FAST_IQ_AHEAD) * t.block_bytes;
    const size_t ahead = at < ws ? at : at + (MOE_DOT_TILE_W - 1) * ws;
    for (int v = 0; v < 16; v++) {
        const uint8_t *row = w + (v < n_w ? v : 0) * ws;
        fast_prefetch(row + ahead, t.block_bytes);
        block[v] = row + (size_t)i * t.block_bytes;
        memcpy(&d[v], block[v], sizeof d[v]);
    }
}

/* Block i of 16 IQ2_S rows into a tile, bias and all (fast_tile_iq's tile). */
MOE_INLINE void fast_tile_iq2_s(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                                void *tile) {
    fast_tile *o = tile;
    const uint8_t *block[16];
    __m512i q[16], h[4];
    uint16_t d[16];
    fast_iq_blocks(t, w, ws, n_w, i, block, d);
    for (int v = 0; v < 16; v++) q[v] = z_load(block[v] + offsetof(moe_block_iq2_s, qs));
    fast_transpose16x16(q); /* q[k] (k < 8): index bytes 4k ..; q[8 + k]: their sign bytes */
    _Static_assert(offsetof(moe_block_iq2_s, scales) == offsetof(moe_block_iq2_s, qh) + 8,
                   "qh, then the scales");
    fast_rows_dwords4(block, offsetof(moe_block_iq2_s, qh), h);
    o->d = _mm512_cvtph_ps(avx2_load(d));
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) /* 2 x nibble j of the scales + 1 */
        o->scale[j] = _mm512_or_si512(
            _mm512_and_si512(j % 8 ? _mm512_srli_epi32(h[2 + j / 8], 4 * (j % 8) - 1)
                                   : _mm512_slli_epi32(h[2 + j / 8], 1),
                             _mm512_set1_epi32(30)),
            _mm512_set1_epi32(1));
    /* byte 8 (sign) + 4 q + c: code c of plane q (bits 0, 1), signed when bit 2 is set */
    const __m512i book = _mm512_set1_epi64(0x00d5e7f8002b1908);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        /* qh byte k of each row in all four bytes: bits 2m, 2m + 1 of byte m are bits 8, 9 of
         * entry 4k + m */
        const __m512i hk = fast_dword_byte(h[k / 4], k % 4);
        const __mmask64 bit8 = _mm512_test_epi8_mask(hk, _mm512_set1_epi32(0x40100401)),
                        bit9 = _mm512_test_epi8_mask(hk, _mm512_set1_epi32((int)0x80200802));
        const __m512i p[2] = {z_grid2_plane(z_iq2s_codes[0], 8, q[k], bit8, bit9),
                              z_grid2_plane(z_iq2s_codes[1], 8, q[k], bit8, bit9)};
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
#pragma GCC unroll 2
            for (int hq = 0; hq < 2; hq++) {
                /* byte c of row 2u + w (qword u): code c of byte m of dword w at bits 0, 1, and
                 * bit 4 hq + c of sign byte m at bit 2 (the multishift rotates: & 63) */
                uint64_t code_at = 0, sign_at = 0;
                for (int wc = 0; wc < 8; wc++) {
                    const int w2 = wc / 4, c = wc % 4;
                    code_at |= (uint64_t)(32 * w2 + 8 * m + 2 * c) << (8 * wc);
                    sign_at |= (uint64_t)((32 * w2 + 8 * m + 4 * hq + c - 2) & 63) << (8 * wc);
                }
                const __m512i codes = _mm512_multishift_epi64_epi8(
                                  _mm512_set1_epi64((long long)code_at), p[hq]),
                              signs = _mm512_multishift_epi64_epi8(
                                  _mm512_set1_epi64((long long)sign_at), q[8 + k]);
                /* codes where the mask has bits 0, 1, else signs */
                const __m512i idx =
                    _mm512_ternarylogic_epi32(codes, signs, _mm512_set1_epi8(3), 0xe4);
                o->tile[2 * (4 * k + m) + hq] = _mm512_permutexvar_epi8(idx, book);
            }
    }
    fast_tile_bias(o);
}

/* Block i of 16 IQ3_S rows into a tile, bias and all (fast_tile_iq's tile), as IQ2_S's: the
 * rows' qs transposed as dwords (q[k]: entries 4k .. 4k + 3), and the 64 bytes that end each
 * block (qs 44 .., qh, the signs, the scales) likewise, so that s[5], s[6] hold qh, s[7 + c]
 * sign dword c and s[15] the scales (a ROWS16 group's body holds them so already). Per register of
 * indices one lookup in the two code planes (z_grid2_plane, 8 vpermi2b: plane q's byte holds the
 * magnitudes of bytes 2q, 2q + 1 of the entry as nibbles); per two tile registers a vpermt2b pairs
 * the planes' bytes of their entries into words, two vpmultishiftqb spread the nibbles to bytes,
 * and the signs go on as the ROWS16 decodes put them (fast_bits4). Zen 5, one thread, 4 MiB of rows
 * of 4096, ns per block of 16 rows, medians of 3 runs alternated (load 5.4): 406 -> 315 at 8
 * activation rows, 533 -> 439 at 16, 833 -> 696 at 32. Here the tile, no bias, from the 16 rows'
 * bodies as dwords (lane v: row v): q[k] qs dword k, s[0], s[1] qh, s[2 + c] sign dword c, s[10]
 * the scales (o->d is the caller's). */
MOE_INLINE void fast_tile_iq3_s_body(const __m512i q[16], const __m512i s[11], fast_tile *o) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) /* 2 x nibble j + 1 per 32 values, twice */
        o->scale[2 * j] = o->scale[2 * j + 1] = _mm512_or_si512(
            _mm512_and_si512(j ? _mm512_srli_epi32(s[10], 4 * j - 1) : _mm512_slli_epi32(s[10], 1),
                             _mm512_set1_epi32(30)),
            _mm512_set1_epi32(1));
    /* byte 4w + c of a qword: nibble c of word w (then of word 2 + w) */
    const __m512i nib[2] = {_mm512_set1_epi64(0x1c1814100c080400),
                            _mm512_set1_epi64(0x3c3834302c282420)};
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        /* qh byte k / 2 of each row in all four bytes: bit 4 (k % 2) + m of it is bit 8 of
         * entry 4k + m */
        const __m512i hk = fast_dword_byte(s[k / 8], k / 2 % 4);
        const __mmask64 bit8 =
            _mm512_test_epi8_mask(hk, _mm512_set1_epi32(0x08040201 << 4 * (k % 2)));
        const __m512i p0 = z_grid2_plane(z_iq3s_codes[0], 4, q[k], bit8, 0),
                      p1 = z_grid2_plane(z_iq3s_codes[1], 4, q[k], bit8, 0);
#pragma GCC unroll 2
        for (int mm = 0; mm < 2; mm++) {
            /* qword u: the words (plane 0's byte, plane 1's) of rows 2u, 2u + 1 for entry
             * 4k + 2 mm, then for 4k + 2 mm + 1 */
            uint64_t pick = 0;
            for (int wd = 0; wd < 4; wd++) {
                const int m = 2 * mm + wd / 2, r = wd % 2;
                pick |= (uint64_t)(4 * r + m) << (16 * wd) | (uint64_t)(64 + 4 * r + m)
                                                                 << (16 * wd + 8);
            }
            const __m512i words = _mm512_permutex2var_epi8(
                p0,
                _mm512_add_epi8(_mm512_set1_epi64((long long)pick),
                                _mm512_setr_epi64(0, 0x0808080808080808, 0x1010101010101010,
                                                  0x1818181818181818, 0x2020202020202020,
                                                  0x2828282828282828, 0x3030303030303030,
                                                  0x3838383838383838)),
                p1);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int e = 4 * k + 2 * mm + h;
                const __m512i mag = _mm512_and_si512(_mm512_multishift_epi64_epi8(nib[h], words),
                                                     _mm512_set1_epi8(0x0f));
                o->tile[e] = z_apply_signs(mag, fast_bits4(s[2 + e / 8], e % 8));
            }
        }
    }
}
MOE_INLINE void fast_tile_iq3_s(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                                void *tile) {
    fast_tile *o = tile;
    enum { TAIL = sizeof(moe_block_iq3_s) - 64 }; /* the last 64 bytes of a block */
    _Static_assert(offsetof(moe_block_iq3_s, qh) == TAIL + 20 &&
                       offsetof(moe_block_iq3_s, signs) == TAIL + 28 &&
                       offsetof(moe_block_iq3_s, scales) == TAIL + 60,
                   "qh, signs, scales at dwords 5, 7, 15 of the block's last 64 bytes");
    const uint8_t *block[16];
    __m512i q[16], s[16];
    uint16_t d[16];
    fast_iq_blocks(t, w, ws, n_w, i, block, d);
    for (int v = 0; v < 16; v++) {
        q[v] = z_load(block[v] + offsetof(moe_block_iq3_s, qs));
        s[v] = z_load(block[v] + TAIL);
    }
    fast_transpose16x16(q);
    fast_transpose16x16(s);
    o->d = _mm512_cvtph_ps(avx2_load(d));
    fast_tile_iq3_s_body(q, s + 5, o);
    fast_tile_bias(o);
}

/* ---- Few activation rows (decode, a small expert): no tile ----
 *
 * Under FAST_TILE_MIN_ROWS rows the tile's transposes cost more than they save, so each weight
 * row's block is multiplied where the decode leaves it, values in the lanes (the exact path's
 * multiply: magnitudes x activations with the signs, pairs summed, times the scales), and the
 * 16 weight rows' int32 lanes are summed at once by a transposing tree into lane v of one
 * register: the exact block sums the tile gets, met by the same fma, so the tile's bits (Q4_K
 * and Q5_K: their mins' sums against the bsums likewise, and the second fma). */

/* The n (4, 8 or 16) registers s summed within their 128-bit lanes by fours: dword j of lane L
 * of u[q] is the sum of lane L of s[4q + j] (integer adds: exact in any order). */
MOE_INLINE void fast_sum_lanes4(const __m512i *s, int n, __m512i *u) {
    __m512i t[8];
#pragma GCC unroll 8
    for (int p = 0; p < n / 2; p++) /* 128-bit lane L: s[2p], s[2p + 1], s[2p], s[2p + 1] */
        t[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * p], s[2 * p + 1]),
                                _mm512_unpackhi_epi32(s[2 * p], s[2 * p + 1]));
#pragma GCC unroll 4
    for (int q = 0; q < n / 4; q++)
        u[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * q], t[2 * q + 1]),
                                _mm512_unpackhi_epi64(t[2 * q], t[2 * q + 1]));
}

/* s[v] summed over its lanes into lane v (integer adds: exact in any order). */
MOE_INLINE __m512i fast_sum16x16(const __m512i s[16]) {
    __m512i u[4];
    fast_sum_lanes4(s, 16, u);
    const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44),
                                       _mm512_shuffle_i32x4(u[0], u[1], 0xee));
    const __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44),
                                       _mm512_shuffle_i32x4(u[2], u[3], 0xee));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* The weight blocks are read a block of each of the 16 rows at a time, 16 streams a row apart,
 * which the hardware prefetcher does not follow (nor the matmul's prefetch, issued in row order
 * before the call): so each row's block FAST_LANES_AHEAD blocks on in that order (past the row's
 * end: the next group's row v + 16, which the matmul's next call reads) is requested as a block
 * is decoded. Q6_K, 2048-value rows, one activation row, 2 threads streaming: 2.8 GB/s without,
 * 4.5 at 1 block ahead, 5.3-5.8 at 2..6; the exact kernel, one row at a time, 4.1 (load 6.5). */
#define FAST_LANES_AHEAD 4

/* The offset from a row's start of the block to request as block i of nb is decoded: past the
 * row, row v + 16's, from its start. */
MOE_INLINE size_t fast_lanes_ahead(fast_type t, size_t ws, int64_t nb, int64_t i) {
    const int64_t a = i + FAST_LANES_AHEAD;
    return a < nb ? (size_t)a * t.block_bytes
                  : MOE_DOT_TILE_W * ws + (size_t)(a - nb) * t.block_bytes;
}
/* acc + the 16 weight rows' int32 block sums (lane v: row v) times their scales dw and the
 * activation block y's: one fma per block. */
MOE_INLINE __m512 fast_lanes_fma(fast_type t, __m512 acc, __m512 dw, const moe_block_q8_k *y,
                                 __m512i sums) {
    return _mm512_fmadd_ps(
        _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y->d)), _mm512_set1_ps(t.mult)),
        _mm512_cvtepi32_ps(sums), acc);
}

/* Weight row v's block (decoded into b) against R activation rows' block i: the int32 sums into
 * part[r][v] (mpart: the mins'), its scales into d, dmin. */
MOE_INLINE void fast_lanes_block(int R, fast_type t, const z_iqb *b, const uint8_t *block,
                                 const uint8_t *x, size_t xs, int64_t i, __m512i (*part)[16],
                                 __m512i (*mpart)[16], int v, float *d, float *dmin) {
    __m256i mins = _mm256_setzero_si256();
    if (t.mins) t.mins(block, &mins, dmin);
    const __m512i sc = _mm512_zextsi256_si512(b->sc);
    __m512i scale[4];
    z_scales4(sc, scale);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
        __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m512i xk = z_apply_signs(z_load(y->qs + 64 * k), _cvtu64_mask64(b->neg[k]));
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(b->g[k], xk), scale[k]);
        }
        if (t.offset) /* offset x sum_j scale_j bsum_j off (fast_type) */
            sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_mullo_epi32(
                                            _mm256_madd_epi16(b->sc, avx2_load(y->bsums)),
                                            _mm256_set1_epi32(t.offset))));
        part[r][v] = sum;
        if (t.mins)
            mpart[r][v] = _mm512_zextsi256_si512(_mm256_madd_epi16(mins, avx2_load(y->bsums)));
    }
    *d = b->d;
}

/* Eight pairs' sums (z_dp_dot: lanes 0..7 weight row 2p's, 8..15 row 2p + 1's) summed
 * over their lanes into lane v = row v (integer adds: exact in any order). */
MOE_INLINE __m512i fast_sum8x2(const __m512i s[8]) {
    __m512i u[2];
    fast_sum_lanes4(s, 8, u);
    /* 128-bit lanes: rows 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15 */
    const __m512i rows = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88),
                                          _mm512_shuffle_i32x4(u[0], u[1], 0xdd));
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), rows);
}

/* fast_lanes_iq for the types with a vpdpbusd decode (z_dp_type, x86_avx512_iq.h): each
 * activation row's block put in the type's order once, then every decode of the weight rows' blocks
 * met by each activation row. The same int32 block sums and the same fma as fast_lanes_iq, so its
 * bits. */
MOE_INLINE void fast_lanes_dp(int R, fast_type t, z_dp_type dp, const uint8_t *w, size_t ws,
                              int n_w, const uint8_t *x, size_t xs, int64_t nb, float *out,
                              int64_t os) {
    const int per = dp.rows, decodes = (n_w + per - 1) / per;
    __m512 acc[FAST_TILE_MIN_ROWS];
    __m512i part[FAST_TILE_MIN_ROWS][16];
    float d[16] __attribute__((aligned(64))) = {0};
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        for (int p = decodes; p < 16 / per; p++) part[r][p] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < nb; i++) {
        const size_t ahead = fast_lanes_ahead(t, ws, nb, i);
        __m512i xr[FAST_TILE_MIN_ROWS][2][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            dp.x(((const moe_block_q8_k *)(x + (size_t)r * xs) + i)->qs, xr[r]);
        for (int p = 0; p < decodes; p++) {
            const uint8_t *block[2];
#pragma GCC unroll 2
            for (int h = 0; h < per; h++) { /* a lone last row twice */
                const uint8_t *row = w + (per * p + h < n_w ? per * p + h : per * p) * ws;
                block[h] = row + (size_t)i * t.block_bytes;
                fast_prefetch(row + ahead, t.block_bytes);
            }
            z_dp g;
            dp.decode(block[0], block[per - 1], &g);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) part[r][p] = z_dp_dot(&g, per, xr[r]);
#pragma GCC unroll 2
            for (int h = 0; h < per; h++) d[per * p + h] = g.d[h];
        }
        const __m512 dw = _mm512_load_ps(d);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
            acc[r] = fast_lanes_fma(t, acc[r], dw, y,
                                    per == 2 ? fast_sum8x2(part[r]) : fast_sum16x16(part[r]));
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(out + r * os, (__mmask16)((1u << n_w) - 1), acc[r]);
}

MOE_INLINE void fast_lanes_iq(int R, fast_type t, const uint8_t *w, size_t ws, int n_w,
                              const uint8_t *x, size_t xs, int64_t nb, float *out, int64_t os) {
    const z_dp_type dp = z_dp_of(t.regs, R);
    if (dp.decode) {
        fast_lanes_dp(R, t, dp, w, ws, n_w, x, xs, nb, out, os);
        return;
    }
    const z_iqb2_fn pair = z_iqb2_of(t.regs); /* rows two at a time through it */
    const int step = pair ? 2 : 1;
    __m512 acc[FAST_TILE_MIN_ROWS];
    __m512i part[FAST_TILE_MIN_ROWS][16], mpart[FAST_TILE_MIN_ROWS][16];
    float d[16] __attribute__((aligned(64))) = {0}, dmin[16] __attribute__((aligned(64))) = {0};
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        for (int v = n_w; v < 16; v++) part[r][v] = mpart[r][v] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < nb; i++) {
        const size_t ahead = fast_lanes_ahead(t, ws, nb, i);
        for (int v = 0; v < n_w; v += step) {
            const uint8_t *block[2];
            z_iqb b[2];
            /* a lone row twice */
            fast_decode_rows(t, pair, w, ws, n_w, v, v, i, ahead, block, b);
            fast_lanes_block(R, t, &b[0], block[0], x, xs, i, part, mpart, v, &d[v], &dmin[v]);
            if (pair && v + 1 < n_w)
                fast_lanes_block(R, t, &b[1], block[1], x, xs, i, part, mpart, v + 1, &d[v + 1],
                                 &dmin[v + 1]);
        }
        const __m512 dw = _mm512_load_ps(d);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
            acc[r] = fast_lanes_fma(t, acc[r], dw, y, fast_sum16x16(part[r]));
            if (t.mins)
                acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_load_ps(dmin), _mm512_set1_ps(y->d)),
                                          _mm512_cvtepi32_ps(fast_sum16x16(mpart[r])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(out + r * os, (__mmask16)((1u << n_w) - 1), acc[r]);
}

/* The kernels of a super-block type: its decode to registers, mins (NULL: none), values per
 * integer scale (the decodes give one per 16 values; a type whose scales cover 32 gives each twice,
 * and says 32 here to halve the multiplies), mult, offset (fast_type), and its tile decode
 * (fast_tile_iq: through the decode to registers). Under FAST_TILE_MIN_ROWS rows a function per row
 * count (its loops unrolled, nothing kept across the others), else the tile. */
#define FAST_SB_TYPE(t, regs, mins, scale_values, mult, offset)                                    \
    ((fast_type){regs, NULL, mins, sizeof(moe_block_##t), scale_values, mult, offset})
#define FAST_LANES_FN(t, regs, mins, scale_values, mult, offset, R)                                \
    static __attribute__((noinline)) void fast_lanes_##t##_##R(                                    \
        const void *w, size_t ws, int n_w, const void *x, size_t xs, int64_t n, float *out,        \
        int64_t os) {                                                                              \
        fast_lanes_iq(R, FAST_SB_TYPE(t, regs, mins, scale_values, mult, offset), w, ws, n_w, x,   \
                      xs, n / MOE_QK_K, out, os);                                                  \
    }
#define FAST_LANES_CASE(t, R)                                                                      \
    case R:                                                                                        \
        fast_lanes_##t##_##R(w, ws, n_w, x, xs, n, out, os);                                       \
        return;
/* Under FAST_TILE_MIN_ROWS rows, fast_lanes_<t>_<n_rows> (and return). */
#define FAST_LANES_SWITCH(t)                                                                       \
    switch (n_rows) {                                                                              \
        FAST_LANES_CASE(t, 1)                                                                      \
        FAST_LANES_CASE(t, 2)                                                                      \
        FAST_LANES_CASE(t, 3)                                                                      \
        FAST_LANES_CASE(t, 4)                                                                      \
        FAST_LANES_CASE(t, 5)                                                                      \
        FAST_LANES_CASE(t, 6)                                                                      \
        FAST_LANES_CASE(t, 7)                                                                      \
    default:                                                                                       \
        break;                                                                                     \
    }
/* FN(..., R) for every R under FAST_TILE_MIN_ROWS: the functions FAST_LANES_SWITCH calls. */
#define FAST_PER_ROWS(FN, ...)                                                                     \
    FN(__VA_ARGS__, 1)                                                                             \
    FN(__VA_ARGS__, 2)                                                                             \
    FN(__VA_ARGS__, 3)                                                                             \
    FN(__VA_ARGS__, 4)                                                                             \
    FN(__VA_ARGS__, 5)                                                                             \
    FN(__VA_ARGS__, 6)                                                                             \
    FN(__VA_ARGS__, 7)
#define FAST_SB_KERNELS(t, regs, mins, scale_values, mult, offset, tile)                           \
    FAST_PER_ROWS(FAST_LANES_FN, t, regs, mins, scale_values, mult, offset)                        \
    static void fast_tile_rows_##t(const void *w, size_t ws, int n_w, const void *x, size_t xs,    \
                                   int64_t n_rows, int64_t n, float *out, int64_t os) {            \
        FAST_LANES_SWITCH(t)                                                                       \
        fast_tile tiles[FAST_IQ_CHUNK];                                                            \
        fast_drive(FAST_SB_TYPE(t, regs, mins, scale_values, mult, offset), tile, fast_rows,       \
                   tiles, sizeof tiles[0], FAST_IQ_CHUNK, w, ws, n_w, x, xs, n_rows, n / MOE_QK_K, \
                   out, os);                                                                       \
    }                                                                                              \
    FAST_AMX_SB(t, regs, mins, scale_values, mult, offset, tile) FAST_DOT(t)
/* IQ2_S's entries come two blocks at a time through the code planes (x86_avx512_iq.h); IQ3_S's
 * through vpermi2b at every row count: on Zen 5 a 16-lane vpgatherdd costs ~13 cycles, and
 * gathering at 2 .. 7 rows (1.1x at 2 and 4 on the Intel this was first tuned on) ran 0.45x the
 * lookups at 2 rows, 0.53x at 4 (one thread, weights in L2). */
FAST_SB_KERNELS(iq2_s, z_iqb_iq2_s_one, NULL, 16, 0.125f, 0, fast_tile_iq2_s)
FAST_SB_KERNELS(iq3_s, z_iqb_iq3_s, NULL, 32, 1.0f, 0, fast_tile_iq3_s)
FAST_SB_KERNELS(iq2_xxs, z_iqb_iq2_xxs, NULL, 32, 0.125f, 0, fast_tile_iq)
FAST_SB_KERNELS(iq2_xs, z_iqb_iq2_xs_one, NULL, 16, 0.125f, 0, fast_tile_iq)
FAST_SB_KERNELS(iq3_xxs, z_iqb_iq3_xxs, NULL, 32, 0.25f, 0, fast_tile_iq)
FAST_SB_KERNELS(iq4_xs, z_iqb_iq4_xs, NULL, 32, 1.0f, 0, fast_tile_iq)
FAST_SB_KERNELS(iq1_s, z_iqb_iq1_s, NULL, 32, 0.125f, 0, fast_tile_iq)
FAST_SB_KERNELS(iq1_m, z_iqb_iq1_m, NULL, 16, 0.125f, 0, fast_tile_iq)

/* ---- Codebook types (and IQ4_XS) on MOE_LAYOUT_ROWS16 ----
 *
 * In a group (quant.h) body dword k of the 16 rows is one register, lane v = row v, so what
 * a row's block holds at one place -- four grid indices, 32 sign bits, eight scales -- the 16
 * rows hold in one register, and one decode fills a tile register for all of them with no
 * transpose. IQ3_XXS: a register of grid indices is 64 four-value entries, looked up as one
 * row's block is (z_lookup_planes), its indices first put in the order that leaves entry
 * (row v, 4k + m) in lane v of tile[4k + m]. IQ2_XXS: entries of 8 values, a register of
 * indices looked up in code planes (fast_r16_iq2_xxs). Signs: a 32-bit word per row and 32
 * values (the XXS types' ksigns indices looked up into one, 16 rows at a time), turned into the
 * byte mask of each tile register by fast_bits4 (under FAST_TILE_MIN_ROWS rows the XXS types
 * skip the tile: fast_r16_cb_lanes below). IQ4_XS: the 32-value types' nibble book, eight times.
 * The tiles are those of fast_tile_iq, so the bits are the file layout's. IQ3_S: the file tile's
 * decode (fast_tile_iq3_s) from the body's registers, no transposes (under FAST_TILE_MIN_ROWS
 * rows the lanes below). IQ2_S stays in the file's layout: made the same way (its tile from the
 * body, fast_tile_iq2_s's decode; lanes as IQ3_S's, but a scale per 16 values, so each register
 * takes two entries' values i and 4 + i, their plane bytes paired by a vpshufb of the indices
 * before the lookups and two unpacks after), Zen 5, bench/kernels --tile, one thread, GB/s of
 * weights, the file's -> ROWS16: from DRAM (256 MiB, medians of 4 runs alternated, load 3-4)
 * 13.3 -> 12.9 at one row, 10.2 -> 10.4 at two, 4.0 -> 3.9 at eight, 2.9 -> 2.8 at 16 (128 MiB:
 * 1.1-1.2x at three to seven); in L2 (1 MiB, the best of 20, load 3) 13.9 -> 15.2 at one, 9.6
 * -> 10.8 at two, 4.7 -> 5.3 at seven. Its 10-bit indices cost both layouts the same 16
 * vpermi2b and 14 blends per 64 entries, half the lanes' time at one row (a two-table lookup
 * instead, wrong sums: 14 -> 27 GB/s in L2), and the ROWS16 stream, prefetched as the others'
 * (NTA, T0 or T1; 6, 10 or 20 KiB ahead: all alike), falls further behind DRAM than the file's
 * sixteen. Each byte's sign and index bits picked by vpshufbitqmb (BITALG) in place of a vpshufb
 * and a vptestmb: no gain outside the noise (more spills at seven rows). */

/* 16 rows' sign words from their XXS sign-and-scale words (four 7-bit ksigns indices each). */
MOE_INLINE __m512i fast_ksigns32(__m512i words) {
    const uint8_t *t = moe_ksigns_iq2xs;
    const __m512i at = _mm512_set1_epi64(0x352e2720150e0700); /* 0 7 14 21 32 39 46 53 */
    const __m512i idx =
        _mm512_and_si512(_mm512_multishift_epi64_epi8(at, words), _mm512_set1_epi8(0x7f));
    return _mm512_permutex2var_epi8(z_load(t), idx, z_load(t + 64));
}

/* Scales 2 s + 1 of 32 values each, s the 4 bits at `shift` of each lane, into scale[2j] and
 * scale[2j + 1] (the tile's scales are per 16 values). */
MOE_INLINE void fast_odd_scales32(fast_tile *o, int j, __m512i words, int shift) {
    const __m512i s = _mm512_and_si512(_mm512_srli_epi32(words, shift), _mm512_set1_epi32(15));
    o->scale[2 * j] = o->scale[2 * j + 1] =
        _mm512_add_epi32(_mm512_add_epi32(s, s), _mm512_set1_epi32(1));
}

/* tile[4k .. 4k + 3] from body register q of 16 rows' IQ3_XXS grid indices of entries 4k ..
 * 4k + 3 (byte 4v + m: row v's entry 4k + m), the sign words `signs` applied. */
MOE_INLINE void fast_iq3_entries(fast_tile *o, int k, __m512i q, __m512i signs) {
    /* byte 4m + q of each 128-bit lane from byte 4q + m: z_interleave4 then leaves lane v of
     * g[m] holding entry (v, 4k + m) */
    const __m512i order =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i idx = _mm512_shuffle_epi8(q, order);
    z_iqb b;
    z_lookup_planes(idx, &b);
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++)
        o->tile[4 * k + m] = z_apply_signs(b.g[m], fast_bits4(signs, 4 * (k % 2) + m));
}

/* IQ3_XXS body: grid indices dwords 0 .. 15, sign-and-scale words 16 .. 23. Unrolled whole, so
 * that fast_bits4's constants fold: left as loops, GCC computed them per tile register, 0.72x at
 * one activation row (Zen 5, one thread, weights in L2). */
MOE_INLINE void fast_r16_iq3_xxs(const uint8_t *body, fast_tile *o) {
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        const __m512i words = z_load(body + 64 * (16 + s)), signs = fast_ksigns32(words);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            fast_iq3_entries(o, 2 * s + h, z_load(body + 64 * (2 * s + h)), signs);
        fast_odd_scales32(o, s, words, 28);
    }
}

/* IQ2_XXS body: per 32 values s, grid indices dword 2s and the sign-and-scale word 2s + 1. The
 * 64 index bytes of dword 2s (row v's entry c in byte 4v + c) are looked up at once in the two
 * code planes (z_iq2xxs_codes, z_grid2_plane), which leaves the codes of entry (v, c) in byte
 * 4v + c of p[0] (values 0..3) and p[1] (4..7); so one vpmultishiftqb per tile register gives
 * each byte its 2-bit code in place (the qword of rows 2u, 2u + 1 from bits 8c + 2i and 32 + 8c +
 * 2i) and a vpermb its magnitude (z_grid2_magnitudes). Zen 5, one thread, weights in L2: the
 * entries as two vpgatherqq per 16 (~7 cycles each) cost a block of 16 rows 3.6x this. */
MOE_INLINE void fast_r16_iq2_xxs(const uint8_t *body, fast_tile *o) {
    for (int s = 0; s < 8; s++) {
        const __m512i q = z_load(body + 64 * 2 * s), words = z_load(body + 64 * (2 * s + 1));
        const __m512i signs = fast_ksigns32(words);
        const __m512i p[2] = {z_grid2_plane(z_iq2xxs_codes[0], 2, q, 0, 0),
                              z_grid2_plane(z_iq2xxs_codes[1], 2, q, 0, 0)};
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i at = _mm512_set1_epi64(0x2624222006040200 + 0x0808080808080808 * c);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                o->tile[8 * s + 2 * c + h] =
                    z_apply_signs(z_grid2_magnitudes(at, p[h]), fast_bits4(signs, 2 * c + h));
        }
        fast_odd_scales32(o, s, words, 28);
    }
}

/* IQ3_S's body: the file layout's tile (fast_tile_iq3_s_body) from the registers where that
 * transposes the rows' blocks into them. */
MOE_INLINE void fast_r16_iq3_s(const uint8_t *body, fast_tile *o) {
    __m512i q[16], s[11];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) q[k] = z_load(body + 64 * k);
#pragma GCC unroll 11
    for (int k = 0; k < 11; k++) s[k] = z_load(body + 64 * (16 + k));
    fast_tile_iq3_s_body(q, s, o);
}

/* IQ4_XS: heads of d, scales_h, scales_l (a qword a row); the body the qs, per 32 values four
 * dwords of nibbles as the 32-value types' (fast_tile_nibbles). */
MOE_INLINE void fast_r16_iq4_xs(const uint8_t *heads, const uint8_t *body, fast_tile *o) {
    const __m512i h0 = z_load(heads), h1 = z_load(heads + 64);
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i dh = _mm512_permutex2var_epi32(h0, even, h1); /* d | scales_h << 16 */
    const __m512i sl =
        _mm512_permutex2var_epi32(h0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), h1);
    for (int j = 0; j < 8; j++) {
        fast_tile_nibbles(body + 256 * j, moe_kvalues_iq4nl, o->tile + 8 * j);
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * j), _mm512_set1_epi32(15));
        const __m512i hi =
            _mm512_and_si512(_mm512_srli_epi32(dh, 16 + 2 * j), _mm512_set1_epi32(3));
        o->scale[2 * j] = o->scale[2 * j + 1] =
            _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
    }
    o->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
}

/* ---- IQ2_XXS, IQ3_XXS and IQ3_S on MOE_LAYOUT_ROWS16 under FAST_TILE_MIN_ROWS rows: no tile ----
 *
 * The tile holds values 4g .. 4g + 3 of each row in a lane, so each tile register costs its decode
 * a spread of codes and a lookup (IQ2_XXS: a vpmultishiftqb and a vpermb) and its signs a vpshufb,
 * and then the tile is stored, read back and biased (a vpdpbusd a register): at 1 .. 7 activation
 * rows more than the multiply. A block's int32 sum does not care which of its values share a lane,
 * only that they share the integer scale; so here a register made from a body register of grid
 * indices (entries c = 0..3 of row v in lane v) holds value j of each of its four entries: byte
 * 4v + c, value j of row v's entry c. The code planes give that in one instruction a register
 * (IQ2_XXS: z_grid2_affine of a plane's 2-bit codes; IQ3_XXS: a vpshufb of a plane's 3-bit ones;
 * IQ3_S: a vpternlogd of a plane's nibbles), as 128 + the magnitude, and a vptestmb and a masked
 * vpsubb sign it (128 - the magnitude): the weights + 128, unsigned. The activation bytes a
 * register meets are the same for all 16 rows (value j of the four entries), so each activation
 * block is put in that order once (fast_cb_order) and a row meets a register in one vpdpbusd with
 * its four bytes broadcast from memory, each row's chain starting from -128 x the activations' sum
 * of its 32 values (the block's bsums). Lane v is row v throughout, as in the tile: the same int32
 * block sums met by the same fma, so the tile's bits. The trap: the chains start from the bsums, so
 * they must be the sums of the bytes (moe_block_q8_k's are).
 *
 * Zen 5, bench/kernels --tile, one thread, GB/s, the tile -> this: 128 MiB, 2 runs alternated
 * (load 2), IQ2_XXS 11.5 -> 23.0 at one row, 9.2 -> 17.5 at two, 7.6 -> 13.2 at three, 6.3 ->
 * 11.2 at four, 4.4 -> 7.1 at seven; IQ3_XXS 12.9 -> 24.9, 10.9 -> 19.8, 9.1 -> 16.0, 7.7 -> 13.1,
 * 5.9 -> 9.2 (the file layout's lanes in the same runs: IQ3_XXS 15.7 at one row, 12.3 at two,
 * 10.2 at three, 8.8 at four, 5.6 at seven). 1 MiB (L2), medians of 15 runs alternated (load 3):
 * IQ2_XXS 11.6 -> 25.5 at one row, 9.5 -> 19.1 at two, 6.6 -> 12.2 at four, 4.6 -> 7.2 at seven;
 * IQ3_XXS 13.0 -> 28.1, 11.2 -> 22.0, 8.2 -> 15.1, 6.1 -> 8.9. The signs on the activations
 * instead (a masked vpsubb per row and register, the broadcast a separate vpbroadcastd), the
 * weights' magnitudes unsigned: 1 MiB
 * IQ2_XXS 24.0 at one row, 17.5 at two, 10.1 at four, 5.9 at seven; the same without the signs at
 * all (wrong sums: what they cost) 39.5, 28.9, 16.7, 9.6. More chains than one a row (their
 * latency) within noise at one to three rows. IQ3_S, the file layout's lanes -> this, 256 MiB,
 * medians of 4 runs alternated (load 3-4): 19.4 -> 22.1 at one row, 14.6 -> 17.3 at two (the
 * tile: 5.5 -> 6.9 at eight, 4.0 -> 4.7 at 16). */

/* Bytes of an activation row's block in the lanes' order: its 256 values, then the 8 chains' starts
 * (fast_cb_start) as int32, and padding to a whole line (the rows' 64-byte stores stay aligned).
 */
#define FAST_CB_X (MOE_QK_K + 64)

/* Block i of R activation rows (xs bytes apart) in the lanes' order, into dst[r]: byte per q +
 * 4j + c from byte per q + per / 4 c + j, per the values an index register's entries cover in a
 * row (IQ2_XXS: 32, four entries of 8; IQ3_XXS, IQ3_S: 16, four of 4), order being
 * fast_cb_order_index's; then -128 x the sum of values 32s .. 32s + 31 for each s (bsums 2s, 2s +
 * 1: one vpmaddwd), which a chain's start then broadcasts from memory. Made from the bsums per
 * chain instead (scalar work and a broadcast from a general register), Zen 5, 1 MiB, medians of 8
 * runs alternated (load 4.5): IQ3_XXS 8.6 at seven rows (9.7 this way), 20.0 at two (21.4);
 * IQ2_XXS 6.8 (7.5) at seven; one row within 2 %. */
MOE_INLINE void fast_cb_order(int R, const uint8_t *x, size_t xs, int64_t i, __m512i order,
                              uint8_t (*dst)[FAST_CB_X]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
#pragma GCC unroll 4
        for (int k = 0; k < MOE_QK_K / 64; k++)
            _mm512_store_si512(dst[r] + 64 * k,
                               _mm512_permutexvar_epi8(order, z_load(y->qs + 64 * k)));
        _mm256_store_si256((__m256i *)(dst[r] + MOE_QK_K),
                           _mm256_madd_epi16(avx2_load(y->bsums), _mm256_set1_epi16(-128)));
    }
}
MOE_INLINE __m512i fast_cb_order_index(int per) {
    uint8_t at[64] __attribute__((aligned(64)));
    for (int o = 0; o < 64; o++) at[o] = (uint8_t)(o / per * per + per / 4 * (o % 4) + o % per / 4);
    return _mm512_load_si512(at);
}

/* The R rows' value j of a register of 16 rows' entries (u: 128 + the magnitudes; neg: their
 * sign bits) against the activations' dword `dword` of the order (fast_cb_order), into part[r]:
 * the weights signed where they lie and the activation bytes broadcast (fast_dpbusd_bcast), so
 * that the signs cost an instruction per register, not per row, and a row a vpdpbusd. */
MOE_INLINE void fast_cb_meet(int R, __m512i u, __mmask64 neg, const uint8_t (*xp)[FAST_CB_X],
                             int dword, __m512i *part) {
    u = _mm512_mask_sub_epi8(u, neg, _mm512_setzero_si512(), u); /* 128 - m: 256 - (128 + m) */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) part[r] = fast_dpbusd_bcast(part[r], u, xp[r] + 4 * dword);
}

/* The chains of the R rows' 32 values s, from -128 x the activations' sum of them (xp's, from the
 * bsums): the weights are 128 + their signed values. */
MOE_INLINE void fast_cb_start(int R, const uint8_t (*xp)[FAST_CB_X], int s, __m512i *part) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        int32_t off;
        memcpy(&off, xp[r] + MOE_QK_K + 4 * s, sizeof off);
        part[r] = _mm512_set1_epi32(off);
    }
}

/* sum[r] + part[r] x scale (lane v: row v's integer scale of the chain's values). */
MOE_INLINE void fast_cb_scaled(int R, const __m512i *part, __m512i scale, __m512i *sum) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(part[r], scale));
}

/* The integer scales 2 s + 1, s the 4 bits at `shift` of each lane of words. */
MOE_INLINE __m512i fast_cb_odd_scales(__m512i words, int shift) {
    const __m512i twice = shift ? _mm512_srli_epi32(words, shift - 1) : _mm512_slli_epi32(words, 1);
    return _mm512_ternarylogic_epi32(twice, _mm512_set1_epi32(30), _mm512_set1_epi32(1),
                                     0xea); /* & 30 | 1 */
}

/* IQ2_XXS, 32 values s of a ROWS16 block (body: after its heads) against R rows' activations in
 * the order, into sum[r]: index register 2s looked up in the two code planes (p[q] byte 4v + c:
 * the codes of values 4q .. 4q + 3 of row v's entry 4s + c), the sign-and-scale words register
 * 2s + 1. */
MOE_INLINE void fast_cb_iq2_xxs(int R, const uint8_t *body, int s, const uint8_t (*xp)[FAST_CB_X],
                                __m512i *sum) {
    const __m512i q = z_load(body + 64 * 2 * s), words = z_load(body + 64 * (2 * s + 1));
    const __m512i signs = fast_ksigns32(words);
    const __m512i p[2] = {z_grid2_plane(z_iq2xxs_codes[0], 2, q, 0, 0),
                          z_grid2_plane(z_iq2xxs_codes[1], 2, q, 0, 0)};
    __m512i part[FAST_TILE_MIN_ROWS];
    fast_cb_start(R, xp, s, part);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        fast_cb_meet(R, z_grid2_affine(p[j / 4], j % 4, true),
                     _mm512_test_epi8_mask(signs, _mm512_set1_epi8((char)(1 << j))), xp, 8 * s + j,
                     part);
    fast_cb_scaled(R, part, fast_cb_odd_scales(words, 28), sum);
}

/* The signs of 16 rows' 4-value entries 4k + c (c = 0..3, byte 4v + c of a register), value j of
 * each at bit 4 (c % 2) + j of byte 2 (k % 2) + c / 2 of sign dword `bytes` (lane v: row v): each
 * byte given its entry's sign byte, to be tested with 0x10011001 << j. */
MOE_INLINE __m512i fast_cb_signs4(__m512i bytes, int k) {
    return _mm512_shuffle_epi8(
        bytes, _mm512_broadcast_i32x4(
                   _mm_add_epi8(_mm_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13),
                                _mm_set1_epi8((char)(2 * (k % 2))))));
}

/* IQ3_XXS and IQ3_S likewise, 4-value entries: index registers 2s + h (h = 0, 1: entries 8s + 4h
 * + c) looked up in the two code planes (c[q] byte 4v + c: the codes of values 2q, 2q + 1 of row
 * v's entry as nibbles), and their signs in a dword per 32 values as fast_cb_signs4 reads them.
 * IQ3_XXS (iq3_s false): the codes are 3 bits, turned into values by a vpshufb; the signs are the
 * ksigns bytes of the sign-and-scale words, body register 16 + s. IQ3_S (body: qs dwords 0..15,
 * qh 16, 17, signs 18..25, the scales 26): 9-bit indices through the planes' four tables (bit 8
 * of entry 4k + c is bit 4 (k % 2) + c of qh byte k / 2), whose nibbles are the magnitudes; sign
 * dword 18 + s; the scale of the 32 values nibble s of dword 26. */
MOE_INLINE void fast_cb_grid4(int R, const uint8_t *body, int s, bool iq3_s,
                              const uint8_t (*xp)[FAST_CB_X], __m512i *sum) {
    const __m512i words = z_load(body + 64 * (16 + (iq3_s ? s / 4 : s))); /* IQ3_S: its qh */
    const __m512i bytes = iq3_s ? z_load(body + 64 * (18 + s)) : fast_ksigns32(words);
    __m512i part[FAST_TILE_MIN_ROWS];
    fast_cb_start(R, xp, s, part);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const int k = 2 * s + h;
        const __m512i q = z_load(body + 64 * k);
        __m512i u[4];
        if (iq3_s) {
            const __mmask64 bit8 = _mm512_test_epi8_mask(fast_dword_byte(words, s % 4),
                                                         _mm512_set1_epi32(0x08040201 << 4 * h));
            const __m512i c[2] = {z_grid2_plane(z_iq3s_codes[0], 4, q, bit8, 0),
                                  z_grid2_plane(z_iq3s_codes[1], 4, q, bit8, 0)};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) /* (nibble & 15) | 128 */
                u[j] = _mm512_ternarylogic_epi32(j % 2 ? _mm512_srli_epi16(c[j / 2], 4) : c[j / 2],
                                                 _mm512_set1_epi8(0x0f),
                                                 _mm512_set1_epi8((char)0x80), 0xea);
        } else {
            const __m512i c[2] = {z_grid2_plane(z_iq3xxs_codes[0], 2, q, 0, 0),
                                  z_grid2_plane(z_iq3xxs_codes[1], 2, q, 0, 0)};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) u[j] = z_iq3xxs_values(c[j / 2], j % 2, true);
        }
        const __m512i signs = fast_cb_signs4(bytes, k);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            fast_cb_meet(R, u[j], _mm512_test_epi8_mask(signs, _mm512_set1_epi32(0x10011001 << j)),
                         xp, 4 * k + j, part);
    }
    fast_cb_scaled(R, part,
                   iq3_s ? fast_cb_odd_scales(z_load(body + 64 * 26), 4 * s)
                         : fast_cb_odd_scales(words, 28),
                   sum);
}
MOE_INLINE void fast_cb_iq3_xxs(int R, const uint8_t *body, int s, const uint8_t (*xp)[FAST_CB_X],
                                __m512i *sum) {
    fast_cb_grid4(R, body, s, false, xp, sum);
}
MOE_INLINE void fast_cb_iq3_s(int R, const uint8_t *body, int s, const uint8_t (*xp)[FAST_CB_X],
                              __m512i *sum) {
    fast_cb_grid4(R, body, s, true, xp, sum);
}

/* A type's 32 values s of a ROWS16 block against R rows' activations, into sum[r]. */
typedef void (*fast_cb_fn)(int R, const uint8_t *body, int s, const uint8_t (*xp)[FAST_CB_X],
                           __m512i *sum);

/* R < FAST_TILE_MIN_ROWS activation rows against a ROWS16 group of nb blocks of a codebook type
 * whose heads are its d (per: fast_cb_order's; sub: its fast_cb_<t>). Each activation
 * block is put in order a block ahead of its multiply, so that the broadcasts read stores long
 * done (fast_rows' reason). */
MOE_INLINE void fast_r16_cb_lanes(int R, size_t block_bytes, int per, float mult, fast_cb_fn sub,
                                  const uint8_t *w, const uint8_t *x, size_t xs, int64_t nb,
                                  float *out, int64_t os) {
    const size_t bytes = MOE_ROWS16 * block_bytes;
    const __m512i order = fast_cb_order_index(per);
    uint8_t xp[2][FAST_TILE_MIN_ROWS][FAST_CB_X] __attribute__((aligned(64)));
    __m512 acc[FAST_TILE_MIN_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    fast_cb_order(R, x, xs, 0, order, xp[0]);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * bytes;
        if (i + 1 < nb) fast_cb_order(R, x, xs, i + 1, order, xp[(i + 1) % 2]);
        __m512i sum[FAST_TILE_MIN_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_si512();
        const uint8_t *body = b + MOE_ROWS16 * sizeof(uint16_t);
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            fast_rows16_prefetch_part(b, bytes, s, 8);
            sub(R, body, s, (const uint8_t(*)[FAST_CB_X])xp[i % 2], sum);
        }
        const __m512 d = _mm512_cvtph_ps(avx2_load(b));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)r * xs) + i;
            acc[r] = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(y->d)), _mm512_set1_ps(mult)),
                _mm512_cvtepi32_ps(sum[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * os, acc[r]);
}
/* A codebook type's lanes: its block, fast_cb_order's per, its mult. */
#define FAST_R16_CB_LANES(t, per, mult)                                                            \
    MOE_INLINE void fast_r16_lanes_##t(int R, const uint8_t *w, const uint8_t *x, size_t xs,       \
                                       int64_t nb, float *out, int64_t os) {                       \
        fast_r16_cb_lanes(R, sizeof(moe_block_##t), per, mult, fast_cb_##t, w, x, xs, nb, out,     \
                          os);                                                                     \
    }
FAST_R16_CB_LANES(iq2_xxs, 32, 0.125f)
FAST_R16_CB_LANES(iq3_xxs, 16, 0.25f)
FAST_R16_CB_LANES(iq3_s, 16, 1.0f)

/* The ROWS16 kernel of a super-block type t at R rows (FAST_LANES_SWITCH(rows16_<t>) calls it):
 * its fast_r16_lanes_<t>, R a constant. */
#define FAST_ROWS16_LANES_FN(t, R)                                                                 \
    static __attribute__((noinline)) void fast_lanes_rows16_##t##_##R(                             \
        const void *w, size_t ws, int n_w, const void *x, size_t xs, int64_t n, float *out,        \
        int64_t os) {                                                                              \
        (void)ws, (void)n_w;                                                                       \
        fast_r16_lanes_##t(R, w, x, xs, n / MOE_QK_K, out, os);                                    \
    }
FAST_PER_ROWS(FAST_ROWS16_LANES_FN, iq2_xxs)
FAST_PER_ROWS(FAST_ROWS16_LANES_FN, iq3_xxs)
FAST_PER_ROWS(FAST_ROWS16_LANES_FN, iq3_s)

/* The kernel on ROWS16 groups of a codebook type (d the f16 heads) and of IQ4_XS. */
#define FAST_SB_ROWS16(t, regs, scale_values, mult, decode, before)                                \
    MOE_INLINE void fast_tile_rows16_##t(fast_type ty, const uint8_t *w, size_t ws, int n_w,       \
                                         int64_t i, void *tile) {                                  \
        (void)ws, (void)n_w;                                                                       \
        fast_tile *o = tile;                                                                       \
        const uint8_t *b = w + (size_t)i * MOE_ROWS16 * ty.block_bytes;                            \
        for (size_t at = 0; at < MOE_ROWS16 * ty.block_bytes; at += 64)                            \
            _mm_prefetch((const char *)b + FAST_ROWS16_LANES_AHEAD + at, _MM_HINT_T1);             \
        decode;                                                                                    \
        fast_tile_bias(o);                                                                         \
    }                                                                                              \
    FAST_ROWS16_FN(t, FAST_SB_TYPE(t, regs, NULL, scale_values, mult, 0), FAST_IQ_CHUNK, MOE_QK_K, \
                   before)                                                                         \
    FAST_AMX_KERNEL(fast_amx_rows16_##t, fast_rows16_##t,                                          \
                    FAST_SB_TYPE(t, regs, NULL, scale_values, mult, 0), fast_tile_rows16_##t,      \
                    FAST_IQ_CHUNK, MOE_QK_K)
#define FAST_R16_F16(t) (fast_r16_##t(b + MOE_ROWS16 * 2, o), o->d = _mm512_cvtph_ps(avx2_load(b)))
FAST_SB_ROWS16(iq3_xxs, z_iqb_iq3_xxs, 32, 0.25f, FAST_R16_F16(iq3_xxs),
               FAST_LANES_SWITCH(rows16_iq3_xxs))
FAST_SB_ROWS16(iq2_xxs, z_iqb_iq2_xxs, 32, 0.125f, FAST_R16_F16(iq2_xxs),
               FAST_LANES_SWITCH(rows16_iq2_xxs))
FAST_SB_ROWS16(iq3_s, z_iqb_iq3_s, 32, 1.0f, FAST_R16_F16(iq3_s), FAST_LANES_SWITCH(rows16_iq3_s))
FAST_SB_ROWS16(iq4_xs, z_iqb_iq4_xs, 32, 1.0f,
               fast_r16_iq4_xs(b, b + MOE_ROWS16 * offsetof(moe_block_iq4_xs, qs), o), )

/* ==== K quants: the super-block machinery with unsigned values (no sign words): Q4_K and Q5_K
 * with mins, Q6_K with its offset (fast_type) ==== */

/* Q4_K / Q5_K: values 0..31 in value order (z_k4_values gives them a half-block apart: lo holds
 * values 128 jj .. + 31 and 128 jj + 64 .., hi the 32 after each), scales per 32 values stored
 * twice. */
MOE_INLINE void fast_k4_regs(const uint8_t *qs, const uint8_t *qh, const uint8_t scales[12],
                             uint16_t d, z_iqb *o) {
    const __m512i hb = z_k4_fifth_bits(qh);
#pragma GCC unroll 2
    for (int jj = 0; jj < 2; jj++) {
        __m512i lo, hi;
        z_k4_values(qs, hb, jj, qh != NULL, &lo, &hi);
        o->g[2 * jj] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
        o->g[2 * jj + 1] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
        o->neg[2 * jj] = o->neg[2 * jj + 1] = 0;
    }
    const __m128i sm = avx2_k4_scales(scales);
    o->sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm, sm));
    o->d = avx2_fp16(d);
}
MOE_INLINE void fast_k4_mins(const uint8_t scales[12], uint16_t dmin16, __m256i *mins,
                             float *dmin) {
    const __m128i sm = avx2_k4_scales(scales);
    *mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    *dmin = avx2_fp16(dmin16);
}
MOE_INLINE void fast_regs_q4_k(const void *block, z_iqb *o) {
    const moe_block_q4_k *b = block;
    fast_k4_regs(b->qs, NULL, b->scales, b->d, o);
}
MOE_INLINE void fast_mins_q4_k(const void *block, __m256i *mins, float *dmin) {
    const moe_block_q4_k *b = block;
    fast_k4_mins(b->scales, b->dmin, mins, dmin);
}
MOE_INLINE void fast_regs_q5_k(const void *block, z_iqb *o) {
    const moe_block_q5_k *b = block;
    fast_k4_regs(b->qs, b->qh, b->scales, b->d, o);
}
MOE_INLINE void fast_mins_q5_k(const void *block, __m256i *mins, float *dmin) {
    const moe_block_q5_k *b = block;
    fast_k4_mins(b->scales, b->dmin, mins, dmin);
}

/* Tile 16p + 8 high + m of Q4_K / Q5_K from the 16 rows' qs dword 8p + m (q) and qh dword m (qh:
 * Q5_K only): its low nibbles (high: the high ones), and bit 2p + high of each qh byte put at bit
 * 4, in the byte's own 16-bit lane. */
MOE_INLINE __m512i fast_k4_group(__m512i q, __m512i qh, bool q5, int p, int high) {
    const __m512i v = _mm512_and_si512(high ? _mm512_srli_epi16(q, 4) : q, _mm512_set1_epi8(0x0f));
    if (!q5) return v;
    const int bit = 2 * p + high;
    return _mm512_ternarylogic_epi32(
        v, bit <= 4 ? _mm512_slli_epi16(qh, 4 - bit) : _mm512_srli_epi16(qh, bit - 4),
        _mm512_set1_epi8(0x10), 0xf8); /* a | (b & c) */
}

/* The Q4_K / Q5_K tile straight from the blocks: the 16 rows' packed qs transposed as dwords
 * (qs dword 8p + m holds values 64p + 4m .. + 3 in its low nibbles and the 32 after them in its
 * high ones), then split into nibbles, so half the bytes go through the shuffles that the
 * decode to registers would; Q5_K's fifth bits (qh dword m: bit 2p + h of each byte for the
 * values of qs dword 8p + m, h = 0 low nibbles, 1 high) transposed likewise and put at bit 4.
 * Scales and mins go through one transpose: per row 8 scales, then 8 mins each twice in a dword
 * (against the bsum pairs). No bias: the values are unsigned (fast_rows). */
_Static_assert(offsetof(moe_block_q5_k, dmin) == offsetof(moe_block_q4_k, dmin) &&
                   offsetof(moe_block_q5_k, scales) == offsetof(moe_block_q4_k, scales),
               "Q4_K and Q5_K blocks start alike");
MOE_INLINE void fast_tile_k4(const uint8_t *w, size_t ws, int n_w, int64_t i, size_t block_bytes,
                             size_t qs_at, size_t qh_at, void *tile) {
    fast_tile *o = tile;
    __m512i q[2][16], sm[16];
    __m256i h[16];
    float d[16], dmin[16];
    for (int v = 0; v < 16; v++) {
        const uint8_t *b = w + (v < n_w ? v : 0) * ws + (size_t)i * block_bytes;
        const moe_block_q4_k *head = (const moe_block_q4_k *)b; /* d, dmin, scales: both types */
        q[0][v] = z_load(b + qs_at);
        q[1][v] = z_load(b + qs_at + 64);
        if (qh_at) h[v] = avx2_load(b + qh_at);
        const __m512i s = _mm512_cvtepu8_epi32(avx2_k4_scales(head->scales));
        sm[v] = _mm512_mask_or_epi32(s, 0xff00, s, _mm512_slli_epi32(s, 16));
        d[v] = avx2_fp16(head->d);
        dmin[v] = avx2_fp16(head->dmin);
    }
    __m512i hb[8];
    if (qh_at) {
        for (int m = 0; m < 8; m++) hb[m] = z_join(h[m], h[m + 8]);
        fast_transpose16x8(hb, hb);
    }
    for (int half = 0; half < 2; half++) {
        fast_transpose16x16(q[half]);
        for (int k = 0; k < 16; k++) { /* qs dword 16 half + k = 8p + m */
            const int p = 2 * half + k / 8, m = k % 8;
            o->tile[16 * p + m] = fast_k4_group(q[half][k], hb[m], qh_at, p, 0);
            o->tile[16 * p + 8 + m] = fast_k4_group(q[half][k], hb[m], qh_at, p, 1);
        }
    }
    fast_transpose16x16(sm);
    for (int s = 0; s < 8; s++) o->scale[2 * s] = sm[s], o->mins[s] = sm[8 + s];
    o->d = _mm512_loadu_ps(d);
    o->dmin = _mm512_loadu_ps(dmin);
}
MOE_INLINE void fast_tile_q4_k(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile) {
    fast_tile_k4(w, ws, n_w, i, t.block_bytes, offsetof(moe_block_q4_k, qs), 0, tile);
}
MOE_INLINE void fast_tile_q5_k(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile) {
    fast_tile_k4(w, ws, n_w, i, t.block_bytes, offsetof(moe_block_q5_k, qs),
                 offsetof(moe_block_q5_k, qh), tile);
}

FAST_SB_KERNELS(q4_k, fast_regs_q4_k, fast_mins_q4_k, 32, 1.0f, 0, fast_tile_q4_k)
FAST_SB_KERNELS(q5_k, fast_regs_q5_k, fast_mins_q5_k, 32, 1.0f, 0, fast_tile_q5_k)

/* Q6_K from the file's blocks: its values stored + 32 (0..63) in value order, a scale per 16;
 * the tile through the decode to registers and the transposes (fast_tile_iq). */
MOE_INLINE void fast_regs_q6_k(const void *block, z_iqb *o) {
    const moe_block_q6_k *b = block;
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        z_q6_k_values(b, h, &o->g[2 * h], &o->g[2 * h + 1]);
        o->neg[2 * h] = o->neg[2 * h + 1] = 0;
    }
    o->sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    o->d = avx2_fp16(b->d);
}
#define FAST_Q6_K_TYPE FAST_SB_TYPE(q6_k, fast_regs_q6_k, NULL, 16, 1.0f, 32)
FAST_SB_KERNELS(q6_k, fast_regs_q6_k, NULL, 16, 1.0f, 32, fast_tile_iq)

/* ---- Super-block types on MOE_LAYOUT_ROWS16 ----
 *
 * A type's meta decode (fast_decode_fn: a block's scales, mins and d into a tile, not its values)
 * and its values (fast_values_fn) read the layout's registers as they lie: body dword k of the 16
 * rows is one load with row v in lane v, as the tile wants it, so nothing is transposed. From 8
 * activation rows on, a block is decoded whole into a tile (fast_drive); under that, each value
 * group is decoded where fast_rows needs it and meets the rows at once: the same integer sums
 * and floats, so the same bits. */

/* Block i of a ROWS16 group into a tile: the meta decode, then every value group. The block
 * FAST_ROWS16_LANES_AHEAD bytes on is requested as this one is decoded (non-temporal, as the
 * lanes do): without, the hardware prefetcher fell behind the multiply and the tile ran at half
 * its rate in cache. Zen 5, bench/kernels --tile 8,16 --mib 256, ROWS16, 1 thread, medians of 3
 * runs alternated (load 6-7), GB/s: Q6_K 5.96 -> 16.4 at 8 rows, 4.34 -> 8.59 at 16; Q4_K
 * 7.63 -> 11.2, 4.65 -> 6.69; Q5_K 5.77 -> 14.0, 4.35 -> 8.43 (T1 instead: Q6_K at 8 rows
 * 0.85x of NTA). */
MOE_INLINE void fast_tile_rows16_sb(fast_type t, fast_decode_fn meta, fast_values_fn values,
                                    const uint8_t *w, int64_t i, void *tile) {
    fast_tile *o = tile;
    meta(t, w, 0, MOE_ROWS16, i, tile);
    const uint8_t *block = w + (size_t)i * MOE_ROWS16 * t.block_bytes;
    for (size_t at = 0; at < MOE_ROWS16 * t.block_bytes; at += 64)
        _mm_prefetch((const char *)block + FAST_ROWS16_LANES_AHEAD + at, _MM_HINT_NTA);
#pragma GCC unroll 64
    for (int g = 0; g < MOE_QK_K / 4; g++) o->tile[g] = values(block, g);
}

/* R < FAST_TILE_MIN_ROWS activation rows against a ROWS16 group of nb blocks, no tile. */
MOE_INLINE void fast_rows16_lanes(int R, fast_type t, fast_decode_fn meta, fast_values_fn values,
                                  const uint8_t *w, const uint8_t *x, size_t xs, int64_t nb,
                                  float *out, int64_t os) {
    __m512 acc[FAST_TILE_MIN_ROWS];
    fast_tile m;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        meta(t, w, 0, MOE_ROWS16, i, &m);
        const uint8_t *block = w + (size_t)i * MOE_ROWS16 * t.block_bytes;
        int64_t r = 0;
#define FAST_ROWS16_STEP(RG, unused)                                                               \
    fast_rows(RG, t, &m, 1, x + (size_t)r * xs, xs, i, acc + r, values, block)
        MOE_ROW_GROUPS(r, R, FAST_ROWS16_STEP, 0);
#undef FAST_ROWS16_STEP
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * os, acc[r]);
}

/* The ROWS16 kernels of a super-block type (its fast_type, meta decode and values). */
#define FAST_ROWS16_SB_KERNELS(t, type, meta, values)                                              \
    MOE_INLINE void fast_r16_lanes_##t(int R, const uint8_t *w, const uint8_t *x, size_t xs,       \
                                       int64_t nb, float *out, int64_t os) {                       \
        fast_rows16_lanes(R, type, meta, values, w, x, xs, nb, out, os);                           \
    }                                                                                              \
    FAST_PER_ROWS(FAST_ROWS16_LANES_FN, t)                                                         \
    MOE_INLINE void fast_tile_rows16_##t(fast_type ty, const uint8_t *w, size_t ws, int n_w,       \
                                         int64_t i, void *tile) {                                  \
        (void)ws, (void)n_w;                                                                       \
        fast_tile_rows16_sb(ty, meta, values, w, i, tile);                                         \
    }                                                                                              \
    FAST_ROWS16_FN(t, type, FAST_IQ_CHUNK, MOE_QK_K, FAST_LANES_SWITCH(rows16_##t))

/* Q6_K in ROWS16 (quant.h): per block the 16 rows' d, then body dword k in register k: ql in
 * 0..31, qh in 32..47, the scales in 48..51. The values 4g .. 4g + 3 (g = 32h + 8q + m: half h,
 * quarter q of the half, m = 0..7) are nibble q / 2 of ql dword 16h + 8 (q % 2) + m with bits
 * 2q, 2q + 1 of qh dword 32 + 8h + m; scale j is byte j % 4 of dword 48 + j / 4. */
MOE_INLINE __m512i fast_values_q6_k(const uint8_t *block, int g) {
    const uint8_t *body = block + MOE_ROWS16 * sizeof(uint16_t);
    const int h = g / 32, q = g % 32 / 8, m = g % 8;
    const __m512i ql = z_load(body + 64 * (16 * h + 8 * (q % 2) + m));
    const __m512i qh = z_load(body + 64 * (32 + 8 * h + m));
    const __m512i lo = q < 2 ? ql : _mm512_srli_epi16(ql, 4);
    const __m512i hi = q < 2   ? _mm512_slli_epi16(qh, 4 - 2 * q)
                       : q > 2 ? _mm512_srli_epi16(qh, 2)
                               : qh; /* bits 2q, 2q + 1 to bits 4, 5 */
    /* (lo & 0x0f) | (hi & 0x30) */
    return _mm512_ternarylogic_epi32(lo, _mm512_and_si512(hi, _mm512_set1_epi8(0x30)),
                                     _mm512_set1_epi8(0x0f), 0xec);
}
MOE_INLINE void fast_meta_q6_k(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                               void *tile) {
    (void)ws, (void)n_w;
    fast_tile *o = tile;
    const uint8_t *b = w + (size_t)i * MOE_ROWS16 * t.block_bytes;
    const uint8_t *body = b + MOE_ROWS16 * sizeof(uint16_t);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512i sc = z_load(body + 64 * (48 + k));
        o->scale[4 * k] = _mm512_srai_epi32(_mm512_slli_epi32(sc, 24), 24);
        o->scale[4 * k + 1] = _mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 24);
        o->scale[4 * k + 2] = _mm512_srai_epi32(_mm512_slli_epi32(sc, 8), 24);
        o->scale[4 * k + 3] = _mm512_srai_epi32(sc, 24);
    }
    o->d = _mm512_cvtph_ps(avx2_load(b));
}
FAST_ROWS16_SB_KERNELS(q6_k, FAST_Q6_K_TYPE, fast_meta_q6_k, fast_values_q6_k)
FAST_AMX_KERNEL(fast_amx_rows16_q6_k, fast_rows16_q6_k, FAST_Q6_K_TYPE, fast_tile_rows16_q6_k,
                FAST_IQ_CHUNK, MOE_QK_K)

/* Q4_K and Q5_K in ROWS16 (quant.h): per block the 16 rows' d and dmin, then body dword k in
 * register k: the packed scales and mins in 0..2, Q5_K's qh in 3..10, qs from qs_at (3 or 11) on.
 * Value group 16p + 8 high + m is fast_k4_group of qs dword 8p + m and qh dword m. */
MOE_INLINE __m512i fast_values_k4(const uint8_t *block, int g, bool q5) {
    const uint8_t *body = block + MOE_ROWS16 * 2 * sizeof(uint16_t);
    const int p = g / 16, high = g % 16 / 8, m = g % 8, qs_at = q5 ? 11 : 3;
    return fast_k4_group(z_load(body + 64 * (qs_at + 8 * p + m)),
                         q5 ? z_load(body + 64 * (3 + m)) : _mm512_setzero_si512(), q5, p, high);
}
MOE_INLINE __m512i fast_values_q4_k(const uint8_t *block, int g) {
    return fast_values_k4(block, g, false);
}
MOE_INLINE __m512i fast_values_q5_k(const uint8_t *block, int g) {
    return fast_values_k4(block, g, true);
}
/* The scales and mins as moe_k4_scale_min unpacks them, 16 rows at once from the packed bytes
 * (dwords 0..2 of the body: bytes 0..3, 4..7, 8..11 of each row's scales[12]): sub-block s < 4
 * has scale byte s & 63 and min byte 4 + s & 63; s = 4 + k has (byte 8 + k & 15) | (byte k >> 6)
 * << 4 and (byte 8 + k >> 4) | (byte 4 + k >> 6) << 4. Scale s goes to scale[2s] (int32), min s
 * to mins[s] (int16, twice: against the bsum pair 2s, 2s + 1). */
MOE_INLINE void fast_meta_k4(fast_type t, const uint8_t *w, size_t ws, int n_w, int64_t i,
                             void *tile) {
    (void)ws, (void)n_w;
    fast_tile *o = tile;
    const uint8_t *b = w + (size_t)i * MOE_ROWS16 * t.block_bytes;
    const uint8_t *body = b + MOE_ROWS16 * 2 * sizeof(uint16_t);
    const __m512i heads = z_load(b); /* lane v: row v's d, dmin */
    o->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads));
    o->dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16)));
    const __m512i b0 = z_load(body), b4 = z_load(body + 64), b8 = z_load(body + 128);
    const __m512i low6 = _mm512_set1_epi8(0x3f), low4 = _mm512_set1_epi8(0x0f),
                  top2 = _mm512_set1_epi8(0x30), byte = _mm512_set1_epi32(0xff);
    const __m512i sc[2] = {_mm512_and_si512(b0, low6),
                           _mm512_or_si512(_mm512_and_si512(b8, low4),
                                           _mm512_and_si512(_mm512_srli_epi32(b0, 2), top2))};
    const __m512i mn[2] = {_mm512_and_si512(b4, low6),
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b8, 4), low4),
                                           _mm512_and_si512(_mm512_srli_epi32(b4, 2), top2))};
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        o->scale[2 * s] = _mm512_and_si512(_mm512_srli_epi32(sc[s / 4], 8 * (s % 4)), byte);
        const __m512i m = _mm512_and_si512(_mm512_srli_epi32(mn[s / 4], 8 * (s % 4)), byte);
        o->mins[s] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
}
#define FAST_Q4_K_TYPE FAST_SB_TYPE(q4_k, fast_regs_q4_k, fast_mins_q4_k, 32, 1.0f, 0)
#define FAST_Q5_K_TYPE FAST_SB_TYPE(q5_k, fast_regs_q5_k, fast_mins_q5_k, 32, 1.0f, 0)
FAST_ROWS16_SB_KERNELS(q4_k, FAST_Q4_K_TYPE, fast_meta_k4, fast_values_q4_k)
FAST_ROWS16_SB_KERNELS(q5_k, FAST_Q5_K_TYPE, fast_meta_k4, fast_values_q5_k)
FAST_AMX_KERNEL(fast_amx_rows16_q4_k, fast_rows16_q4_k, FAST_Q4_K_TYPE, fast_tile_rows16_q4_k,
                FAST_IQ_CHUNK, MOE_QK_K)
FAST_AMX_KERNEL(fast_amx_rows16_q5_k, fast_rows16_q5_k, FAST_Q5_K_TYPE, fast_tile_rows16_q5_k,
                FAST_IQ_CHUNK, MOE_QK_K)

/* ==== The table ==== */

/* The kernels on MOE_LAYOUT_ROWS16 (named prefix##type) into table k. */
#define FAST_ROWS16_SET(prefix)                                                                    \
    (k->types[MOE_TYPE_Q8_0].dot_tile_rows16 = prefix##q8_0,                                       \
     k->types[MOE_TYPE_Q4_0].dot_tile_rows16 = prefix##q4_0,                                       \
     k->types[MOE_TYPE_IQ4_NL].dot_tile_rows16 = prefix##iq4_nl,                                   \
     k->types[MOE_TYPE_MXFP4].dot_tile_rows16 = prefix##mxfp4,                                     \
     k->types[MOE_TYPE_Q4_K].dot_tile_rows16 = prefix##q4_k,                                       \
     k->types[MOE_TYPE_Q5_K].dot_tile_rows16 = prefix##q5_k,                                       \
     k->types[MOE_TYPE_Q6_K].dot_tile_rows16 = prefix##q6_k,                                       \
     k->types[MOE_TYPE_IQ3_XXS].dot_tile_rows16 = prefix##iq3_xxs,                                 \
     k->types[MOE_TYPE_IQ2_XXS].dot_tile_rows16 = prefix##iq2_xxs,                                 \
     k->types[MOE_TYPE_IQ3_S].dot_tile_rows16 = prefix##iq3_s,                                     \
     k->types[MOE_TYPE_IQ4_XS].dot_tile_rows16 = prefix##iq4_xs)

void moe_kernels_fill_fast_avx512vnni(moe_kernels *k) {
    z_iq_tables_fill();
#define FAST_SET(T, t)                                                                             \
    moe_kernels_set_fast_dot(k->types, MOE_TYPE_##T, fast_dot_##t, fast_tile_rows_##t,             \
                             MOE_ISA_AVX512VNNI)
    FAST_SET(Q4_0, q4_0);
    FAST_SET(Q5_0, q5_0);
    FAST_SET(Q8_0, q8_0);
    FAST_SET(IQ4_NL, iq4_nl);
    FAST_SET(MXFP4, mxfp4);
    FAST_SET(Q4_K, q4_k);
    FAST_SET(Q5_K, q5_k);
    FAST_SET(Q6_K, q6_k);
    FAST_SET(IQ2_S, iq2_s);
    FAST_SET(IQ3_S, iq3_s);
    FAST_SET(IQ2_XXS, iq2_xxs);
    FAST_SET(IQ2_XS, iq2_xs);
    FAST_SET(IQ3_XXS, iq3_xxs);
    FAST_SET(IQ4_XS, iq4_xs);
    FAST_SET(IQ1_S, iq1_s);
    FAST_SET(IQ1_M, iq1_m);
#undef FAST_SET
    FAST_ROWS16_SET(fast_rows16_);
}

void moe_kernels_fill_fast_amx(moe_kernels *k) {
    moe_kernels_fill_fast_avx512vnni(k);
#define AMX_SET(T, t)                                                                              \
    (k->types[MOE_TYPE_##T].dot_tile = fast_amx_tile_rows_##t,                                     \
     k->types[MOE_TYPE_##T].dot_isa = MOE_ISA_AMX)
    AMX_SET(Q4_0, q4_0);
    AMX_SET(Q5_0, q5_0);
    AMX_SET(Q8_0, q8_0);
    AMX_SET(IQ4_NL, iq4_nl);
    AMX_SET(MXFP4, mxfp4);
    AMX_SET(Q4_K, q4_k);
    AMX_SET(Q5_K, q5_k);
    AMX_SET(IQ3_S, iq3_s);
    AMX_SET(IQ2_XXS, iq2_xxs);
    AMX_SET(IQ3_XXS, iq3_xxs);
    AMX_SET(IQ4_XS, iq4_xs);
    AMX_SET(IQ1_S, iq1_s);
    AMX_SET(IQ2_S, iq2_s);
    AMX_SET(IQ2_XS, iq2_xs);
    AMX_SET(IQ1_M, iq1_m);
    AMX_SET(Q6_K, q6_k);
#undef AMX_SET
    FAST_ROWS16_SET(fast_amx_rows16_);
}
