/* fast_amx.h: the amx level's many-row multiply, included by fast_avx512vnni.c (whose tiles,
 * decodes and row kernel it uses; nothing else may include it).
 *
 * The weight tile that fast_drive decodes is already AMX's "B" operand: tile[g] holds values
 * 4g .. 4g + 3 of the 16 weight rows, so K values of a block are K / 4 rows of 64 bytes. The
 * activations are the "A" operand as they lie: 16 activation rows, xs bytes apart, K quantized
 * bytes each from the block's qs. One TDPBSSD (Q4_K / Q5_K, whose values are unsigned: TDPBSUD)
 * gives the 16 x 16 exact int32 sums of K values that vpdpbusd gives per lane in fast_rows (there
 * less the +128 bias: the same integers, and int32 sums wrap alike in any order), stored to L1,
 * then per activation row, lane for lane, fast_rows's epilogue: the super-block types' integer
 * scales (vpmulld) and mins, one fma per block in block order. So the bits are fast_rows's, at
 * any row count and in any batch (tested against it and the scalar reference).
 *
 * Rows go 16 at a time through the tiles; the n_rows % 16 left over, and a call under 16 rows,
 * through fast_rows (the same bits). K is 32 (Q8_0 blocks; super-blocks with a scale per 32
 * values) or 16 (a scale per 16), one tile configuration each, loaded by a thread when it first
 * needs it (the configuration is per thread; the OS's permission was asked at detection, cpu.c).
 * The trap: the tile instructions are written here as inline asm with a memory clobber, so the
 * compiler cannot move the tiles' and activations' stores past the loads that read them. */

#define FAST_AMX_ROWS 16 /* activation rows per tile multiply: a tile's rows */

/* tmm0, tmm1: B (K / 4 rows of 64 bytes); tmm2, tmm3: A (16 rows of K bytes); tmm4, tmm5: C */
#define FAST_AMX_LOAD(tmm, base, stride)                                                           \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"((long)(stride))            \
                     : "memor"                                                                     \
                       "y")
#define FAST_AMX_STORE(tmm, base, stride)                                                          \
    __asm__ volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"(base), "r"((long)(stride))        \
                     : "memory")
#define FAST_AMX_ZERO(tmm)       __asm__ volatile("tilezero %%tmm" #tmm ::)
#define FAST_AMX_DP(op, c, a, b) __asm__ volatile(#op " %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

/* Load the tile configuration for K (16 or 32) unless this thread has it. */
static void fast_amx_configure(int K) {
    static _Thread_local int loaded; /* the K this thread's tiles are configured for, 0: none */
    if (loaded == K) return;
    struct {
        uint8_t palette, start_row, zero[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg = {.palette = 1};
    _Static_assert(sizeof cfg == 64, "the tile configuration is 64 bytes");
    for (int i = 0; i < 6; i++) {
        const bool b = i < 2, a = i >= 2 && i < 4;
        cfg.rows[i] = (uint8_t)(b ? K / 4 : FAST_AMX_ROWS);
        cfg.colsb[i] = (uint16_t)(a ? K : 64);
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    loaded = K;
}

/* Unit u of a batch: sub-block s (K values) of block j against the 16 activation rows at x, its
 * sums to c[u]. Two units in flight, in tiles 0/2/4 and 1/3/5. */
#define FAST_AMX_UNIT(u, B, A, C)                                                                  \
    do {                                                                                           \
        const int64_t j = j0 + (u) / subs, s = (u) % subs;                                         \
        FAST_AMX_LOAD(B, &tiles[j].tile[s * K / 4], 64);                                           \
        FAST_AMX_LOAD(A, x + (size_t)(c0 + j) * x_block + qs_at + (size_t)(s * K), xs);            \
        FAST_AMX_ZERO(C);                                                                          \
        if (mins)                                                                                  \
            FAST_AMX_DP(tdpbsud, C, A, B);                                                         \
        else                                                                                       \
            FAST_AMX_DP(tdpbssd, C, A, B);                                                         \
        FAST_AMX_STORE(C, c[u], 64);                                                               \
    } while (0)

/* 16 activation rows (xs bytes apart, block c0 on) against nc tiles: fast_rows with R = 16. */
MOE_INLINE void fast_amx_rows(fast_type type, const fast_tile *tiles, int64_t nc, const uint8_t *x,
                              size_t xs, int64_t c0, __m512 *acc) {
    const bool q32 = type.regs == NULL, mins = type.mins != NULL;
    const int K = type.scale_values, subs = q32 ? 1 : MOE_QK_K / K;
    const size_t x_block = q32 ? sizeof(moe_block_q8_0) : sizeof(moe_block_q8_k);
    const size_t qs_at = q32 ? offsetof(moe_block_q8_0, qs) : offsetof(moe_block_q8_k, qs);
    enum { UNITS = 16 }; /* K-value sums per batch: 16 KiB */
    int32_t c[UNITS][FAST_AMX_ROWS][16] __attribute__((aligned(64)));
    const int64_t per_batch = UNITS / subs;
    for (int64_t j0 = 0; j0 < nc; j0 += per_batch) {
        const int64_t nj = nc - j0 < per_batch ? nc - j0 : per_batch;
        int64_t u = 0;
        for (; u + 1 < nj * subs; u += 2) {
            FAST_AMX_UNIT(u, 0, 2, 4);
            FAST_AMX_UNIT(u + 1, 1, 3, 5);
        }
        if (u < nj * subs) FAST_AMX_UNIT(u, 0, 2, 4);
        /* the 32-value types' activation scales (f16) as floats, 16 rows at once, for the
         * epilogue to broadcast from memory */
        float dxf[UNITS][FAST_AMX_ROWS] __attribute__((aligned(64)));
        if (q32)
            for (int64_t jj = 0; jj < nj; jj++) {
                uint16_t h[FAST_AMX_ROWS] __attribute__((aligned(32)));
                for (int m = 0; m < FAST_AMX_ROWS; m++)
                    h[m] = ((const moe_block_q8_0 *)(x + (size_t)m * xs) + c0 + j0 + jj)->d;
                _mm512_store_ps(dxf[jj], _mm512_cvtph_ps(avx2_load(h)));
            }
        for (int m = 0; m < FAST_AMX_ROWS; m++) {
            const uint8_t *xr = x + (size_t)m * xs;
            __m512 a = acc[m];
            for (int64_t jj = 0; jj < nj; jj++) {
                const fast_tile *t = &tiles[j0 + jj];
                __m512i sum = _mm512_load_si512(c[jj * subs][m]);
                __m512 dx;
                if (q32)
                    dx = _mm512_set1_ps(dxf[jj][m]);
                else {
                    const moe_block_q8_k *y = (const moe_block_q8_k *)xr + c0 + j0 + jj;
                    sum = _mm512_mullo_epi32(sum, t->scale[0]);
                    for (int s = 1; s < subs; s++)
                        sum = _mm512_add_epi32(
                            sum, _mm512_mullo_epi32(_mm512_load_si512(c[jj * subs + s][m]),
                                                    t->scale[s * K / 16]));
                    dx = _mm512_set1_ps(y->d);
                }
                a = _mm512_fmadd_ps(
                    _mm512_mul_ps(_mm512_mul_ps(t->d, dx), _mm512_set1_ps(type.mult)),
                    _mm512_cvtepi32_ps(sum), a);
                if (mins)
                    a = _mm512_fnmadd_ps(_mm512_mul_ps(t->dmin, dx),
                                         _mm512_cvtepi32_ps(fast_mins_sum(
                                             (const moe_block_q8_k *)xr + c0 + j0 + jj, t)),
                                         a);
            }
            acc[m] = a;
        }
    }
}
#undef FAST_AMX_UNIT

/* fast_drive with the rows 16 at a time through the tiles, the rest through fast_rows. */
MOE_INLINE void fast_amx_drive(fast_type t, fast_decode_fn decode, fast_tile *tiles, int64_t chunk,
                               const void *w, size_t ws, int n_w, const void *x, size_t xs,
                               int64_t n_rows, int64_t nb, float *out, int64_t os) {
    const __mmask16 lanes = (__mmask16)((1u << n_w) - 1);
    fast_amx_configure(t.scale_values);
    __m512 accbuf[FAST_GROUP];
    for (int64_t g0 = 0; g0 < n_rows; g0 += FAST_GROUP) {
        const int64_t ng = n_rows - g0 < FAST_GROUP ? n_rows - g0 : FAST_GROUP;
        const uint8_t *xg = (const uint8_t *)x + (size_t)g0 * xs;
        for (int64_t r = 0; r < ng; r++) accbuf[r] = _mm512_setzero_ps();
        for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
            const int64_t nc = nb - c0 < chunk ? nb - c0 : chunk;
            for (int64_t j = 0; j < nc; j++) decode(t, w, ws, n_w, c0 + j, &tiles[j]);
            int64_t r = 0;
            for (; r + FAST_AMX_ROWS <= ng; r += FAST_AMX_ROWS)
                fast_amx_rows(t, tiles, nc, xg + (size_t)r * xs, xs, c0, accbuf + r);
#define FAST_AMX_STEP(R, unused) fast_rows(R, t, tiles, nc, xg + (size_t)r * xs, xs, c0, accbuf + r)
            MOE_ROW_GROUPS(r, ng, FAST_AMX_STEP, 0);
#undef FAST_AMX_STEP
        }
        for (int64_t r = 0; r < ng; r++)
            _mm512_mask_storeu_ps(out + (g0 + r) * os, lanes, accbuf[r]);
    }
}

/* The amx level's tile kernel of type t (fast_type ty, tile decode, blocks per chunk, values per
 * block): under 16 rows the avx512vnni one (vnni), else the tiles. */
#define FAST_AMX_KERNEL(name, vnni, ty, decode, chunk, values)                                     \
    static void name(const void *w, size_t ws, int n_w, const void *x, size_t xs, int64_t n_rows,  \
                     int64_t n, float *out, int64_t os) {                                          \
        if (n_rows < FAST_AMX_ROWS) {                                                              \
            vnni(w, ws, n_w, x, xs, n_rows, n, out, os);                                           \
            return;                                                                                \
        }                                                                                          \
        fast_tile tiles[chunk];                                                                    \
        fast_amx_drive(ty, decode, tiles, chunk, w, ws, n_w, x, xs, n_rows, n / (values), out,     \
                       os);                                                                        \
    }
