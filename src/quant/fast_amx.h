/* fast_amx.h: the amx level's many-row multiply, included by fast_avx512vnni.c (whose tiles,
 * decodes and row kernel it uses; nothing else may include it).
 *
 * The weight tile that fast_drive decodes is already AMX's "B" operand: tile[g] holds values
 * 4g .. 4g + 3 of the 16 weight rows, so K values of a block are K / 4 rows of 64 bytes. The
 * activations are the "A" operand as they lie: 16 activation rows, xs bytes apart, K = 32
 * quantized bytes each from the block's qs. One TDPBSSD (Q4_K / Q5_K, whose values are unsigned:
 * TDPBSUD) gives the 16 x 16 exact int32 sums of K values that vpdpbusd gives per lane in fast_rows
 * (there less the +128 bias: the same integers, and int32 sums wrap alike in any order), stored to
 * L1, then per activation row, lane for lane, fast_rows's epilogue: the super-block types' integer
 * scales (vpmulld) and mins, one fma per block in block order. So the bits are fast_rows's, at
 * any row count and in any batch (tested against it and the scalar reference).
 *
 * Rows go 16 at a time through the tiles; the n_rows % 16 left over, and a call under 16 rows,
 * through fast_rows (the same bits). K is 32: a Q8_0 block, or the values under one integer
 * scale of Q4_K and Q5_K. The other super-block types take the scales into the weights instead
 * (the scaled tiles, below: K = 64, no vpmulld, the rows left over reaching back). Two tile
 * configurations (K = 32 and 64), loaded by a thread when it needs the other (it is per thread;
 * the OS's permission was asked at detection, cpu.c).
 * The trap: the tile instructions are written here as inline asm with a memory clobber, so the
 * compiler cannot move the tiles' and activations' stores past the loads that read them. */

#define FAST_AMX_ROWS 16 /* activation rows per tile multiply: a tile's rows */
#define FAST_AMX_K    32 /* values per tile multiply: a Q8_0 block, a super-block's scale */

/* tmm0, tmm1: B (K / 4 rows of 64 bytes); tmm2, tmm3: A (16 rows of K bytes); tmm4, tmm5: C
 * (16 rows of 16 int32). tileloadd reads memory the compiler cannot see: hence the clobber. */
#define FAST_AMX_MEM "memory"
#define FAST_AMX_LOAD(tmm, base, stride)                                                           \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"((long)(stride))            \
                     : FAST_AMX_MEM)
#define FAST_AMX_STORE(tmm, base, stride)                                                          \
    __asm__ volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"(base), "r"((long)(stride))        \
                     : FAST_AMX_MEM)
#define FAST_AMX_ZERO(tmm)       __asm__ volatile("tilezero %%tmm" #tmm ::)
#define FAST_AMX_DP(op, c, a, b) __asm__ volatile(#op " %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

/* Load the tile configuration for K values per multiply (FAST_AMX_K, or FAST_AMX_SCALED_K for
 * tmm0 .. tmm7) unless this thread has it loaded. */
static void fast_amx_configure(int k) {
    static _Thread_local int loaded;
    if (loaded == k) return;
    struct {
        uint8_t palette, start_row, zero[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg = {.palette = 1};
    _Static_assert(sizeof cfg == 64, "the tile configuration is 64 bytes");
    for (int i = 0; i < 8; i++) {
        const bool b = i < 2, a = i >= 2 && i < 4;
        cfg.rows[i] = (uint8_t)(b ? k / 4 : FAST_AMX_ROWS);
        cfg.colsb[i] = (uint16_t)(a ? k : 64);
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    loaded = k;
}

/* Unit u of a batch: sub-block s (K values) of block j against the 16 activation rows at x, its
 * sums to c[u]. Two units in flight, in tiles 0/2/4 and 1/3/5. */
#define FAST_AMX_UNIT(u, B, A, C)                                                                  \
    do {                                                                                           \
        const int64_t j = j0 + (u) / subs, s = (u) % subs;                                         \
        FAST_AMX_LOAD(B, &tiles[j].tile[s * FAST_AMX_K / 4], 64);                                  \
        FAST_AMX_LOAD(A, x + (size_t)(c0 + j) * x_block + qs_at + (size_t)s * FAST_AMX_K, xs);     \
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
    const int subs = q32 ? 1 : MOE_QK_K / FAST_AMX_K; /* tile multiplies per block */
    const size_t x_block = q32 ? sizeof(moe_block_q8_0) : sizeof(moe_block_q8_k);
    const size_t qs_at = q32 ? offsetof(moe_block_q8_0, qs) : offsetof(moe_block_q8_k, qs);
    enum { UNITS = 16 }; /* 32-value sums per batch: 16 KiB */
    int32_t c[UNITS][FAST_AMX_ROWS][16] __attribute__((aligned(64)));
    const int64_t per_batch = UNITS / subs;
    _Static_assert(offsetof(moe_block_q8_0, d) == 0, "the gather reads d as a dword's low half");
    MOE_CHECK(xs <= INT32_MAX / FAST_AMX_ROWS);
    const __m512i row_at =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)xs));
    for (int64_t j0 = 0; j0 < nc; j0 += per_batch) {
        const int64_t nj = nc - j0 < per_batch ? nc - j0 : per_batch;
        int64_t u = 0;
        for (; u + 1 < nj * subs; u += 2) {
            FAST_AMX_UNIT(u, 0, 2, 4);
            FAST_AMX_UNIT(u + 1, 1, 3, 5);
        }
        if (u < nj * subs) FAST_AMX_UNIT(u, 0, 2, 4);
        /* the 32-value types' activation scales (f16) as floats, 16 rows at once, for the
         * epilogue to broadcast from memory: one gather of the dwords that start the rows'
         * blocks (d, then 2 bytes of qs), not 16 stores of 2 bytes read back as one vector (a
         * store-forwarding stall per block) */
        float dxf[UNITS][FAST_AMX_ROWS] __attribute__((aligned(64)));
        if (q32)
            for (int64_t jj = 0; jj < nj; jj++)
                _mm512_store_ps(dxf[jj],
                                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(
                                    row_at, (const moe_block_q8_0 *)x + c0 + j0 + jj, 1))));
        /* block after block, the 16 rows' multiply-adds in between: 16 independent chains
         * (one row's blocks back to back wait on each other's fma) */
        for (int64_t jj = 0; jj < nj; jj++) {
            const fast_tile *t = &tiles[j0 + jj];
            for (int m = 0; m < FAST_AMX_ROWS; m++) {
                const uint8_t *xr = x + (size_t)m * xs;
                __m512 a = acc[m];
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
                                                    t->scale[2 * s]));
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
                acc[m] = a;
            }
        }
    }
}
#undef FAST_AMX_UNIT

/* fast_drive with the rows 16 at a time through the tiles, the rest through fast_rows. */
MOE_INLINE void fast_amx_drive(fast_type t, fast_decode_fn decode, fast_tile *tiles, int64_t chunk,
                               const void *w, size_t ws, int n_w, const void *x, size_t xs,
                               int64_t n_rows, int64_t nb, float *out, int64_t os) {
    const __mmask16 lanes = (__mmask16)((1u << n_w) - 1);
    fast_amx_configure(FAST_AMX_K);
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
#define FAST_AMX_STEP(R, unused)                                                                   \
    fast_rows(R, t, tiles, nc, xg + (size_t)r * xs, xs, c0, accbuf + r, NULL, NULL)
            MOE_ROW_GROUPS(r, ng, FAST_AMX_STEP, 0);
#undef FAST_AMX_STEP
        }
        for (int64_t r = 0; r < ng; r++)
            _mm512_mask_storeu_ps(out + (g0 + r) * os, lanes, accbuf[r]);
    }
}

/* The fewest activation rows a call takes to the tiles (fewer: all through avx512vnni's kernel),
 * measured (1 thread, against avx512vnni's, 2048 values, 16/32/48/64 rows): the 32-value types
 * 1.35-1.6x from 16 rows; Q4_K and Q5_K, whose tile decode costs as much as the multiply at 16
 * rows and whose mins add to the epilogue, from 64 (0.91-0.96x at 32, 1.04-1.17x at 64). The
 * other super-block types, through the scaled tiles, from 16 (rows of 4096, 128 MiB, 16/32/64
 * rows: IQ2_S 1.3-1.5x, 1.55-1.9x, 1.9-2.1x of avx512vnni's; IQ3_S 1.04x, 1.13x, 1.23x of a tile
 * multiply and vpmulld per 32 values, itself 0.9-1.05x of avx512vnni's at 16). */
MOE_INLINE int64_t fast_amx_min_rows(fast_type t) {
    return t.mins ? 4 * FAST_AMX_ROWS : FAST_AMX_ROWS;
}

/* The amx level's tile kernel of type t (fast_type ty, tile decode, blocks per chunk, values per
 * block): under fast_amx_min_rows the avx512vnni one (vnni), else the tiles: the scaled ones for
 * the super-block types without mins (below; Q6_K's offset goes into them, so the others have
 * none), a tile multiply per 32 values for the rest. */
#define FAST_AMX_KERNEL(name, vnni, ty, decode, chunk, values)                                     \
    static void name(const void *w, size_t ws, int n_w, const void *x, size_t xs, int64_t n_rows,  \
                     int64_t n, float *out, int64_t os) {                                          \
        if (n_rows < fast_amx_min_rows(ty)) {                                                      \
            vnni(w, ws, n_w, x, xs, n_rows, n, out, os);                                           \
            return;                                                                                \
        }                                                                                          \
        if ((ty).regs && !(ty).mins) {                                                             \
            fast_amx_scaled_drive(ty, decode, w, ws, n_w, x, xs, n_rows, n / (values), out, os);   \
            return;                                                                                \
        }                                                                                          \
        fast_tile tiles[chunk];                                                                    \
        fast_amx_drive(ty, decode, tiles, chunk, w, ws, n_w, x, xs, n_rows, n / (values), out,     \
                       os);                                                                        \
    }
/* A super-block type's amx kernel (FAST_SB_KERNELS): its tile decode, or for the scaled tiles
 * fast_tile_iq's without the bias (the tile decode of every type without mins). */
#define FAST_AMX_SB(t, regs, min_fn, scale_values, mult, offset, tile)                             \
    FAST_AMX_KERNEL(fast_amx_tile_rows_##t, fast_tile_rows_##t,                                    \
                    FAST_SB_TYPE(t, regs, min_fn, scale_values, mult, offset),                     \
                    FAST_SB_TYPE(t, regs, min_fn, scale_values, mult, offset).mins                 \
                        ? (tile)                                                                   \
                        : fast_tile_iq_values,                                                     \
                    FAST_IQ_CHUNK, MOE_QK_K)

/* ---- The super-block types without mins: the scaled tiles ----
 *
 * A tile multiply and a vpmulld per 16 (or 32) values cost more than they save, so the integer
 * scales go into the weights instead: each value (less Q6_K's offset) times its scale, p = 256 hi +
 * lo, as two tiles of bytes, hi signed and lo unsigned (p's high and low byte: |p| <= 4096, from
 * Q6_K's 32 x 128 and IQ4_XS's 127 x 32, within int16). Then a block is 4 + 4 tile multiplies of K
 * = 64 into two int32 sums, hi's (TDPBSSD) and lo's (TDPBSUD), and 256 hi + lo is the block's exact
 * integer sum that fast_rows gets (|sum| <= 256 x 127 x 4096 < 2^31), met by the same fma: the
 * same bits. The rows go 16 at a time; the last 16 of a group of FAST_GROUP may reach back over
 * rows done already (a call has 16 rows at least), whose sums are not added twice. */
#define FAST_AMX_SCALED_K     64 /* values per tile multiply of the scaled tiles */
#define FAST_AMX_SCALED_CHUNK 2  /* blocks decoded per pass, in flight at once (tmm4 .. tmm7) */

/* One block of 16 weight rows with the scales in: lane v of hi[g], lo[g] holds values 4g .. 4g + 3
 * of row v, each times its scale, as 256 hi + lo. */
typedef struct {
    __m512i hi[64], lo[64];
    __m512 d;
} fast_scaled_tile;

/* Block i of 16 rows (ws bytes apart) through the tile decode `values` (no bias), the scales in. */
MOE_INLINE void fast_amx_scaled_tile(fast_type t, fast_decode_fn values, const uint8_t *w,
                                     size_t ws, int n_w, int64_t i, void *tile) {
    fast_scaled_tile *o = tile;
    fast_tile u;
    values(t, w, ws, n_w, i, &u);
    const __m512i offset = _mm512_set1_epi8((char)t.offset), low = _mm512_set1_epi16(0x00ff);
    for (int j = 0; j < 16; j++) {
        /* the scale (int32, |scale| < 2^15) in both int16 halves of each lane */
        const __m512i sc =
            _mm512_mask_blend_epi16(0xaaaaaaaau, u.scale[j], _mm512_slli_epi32(u.scale[j], 16));
        for (int c = 0; c < 4; c++) {
            const int g = 4 * j + c;
            const __m512i v = _mm512_sub_epi8(u.tile[g], offset);
            const __m512i even =
                _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), sc);
            const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(v, 8), sc);
            /* lo: (even & 0x00ff) | odd << 8; hi: even >> 8 | (odd & 0xff00) */
            o->lo[g] = _mm512_ternarylogic_epi32(low, even, _mm512_slli_epi16(odd, 8), 0xea);
            o->hi[g] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(even, 8), odd, 0xce);
        }
    }
    o->d = u.d;
}

/* Quarter q of block j (K = 64 values) against the 16 activation rows at x: into tmm CH (hi) and
 * CL (lo), the activations through tmm A. */
#define FAST_AMX_SCALED_QUARTER(j, q, A, CH, CL)                                                   \
    do {                                                                                           \
        FAST_AMX_LOAD(A,                                                                           \
                      x + (size_t)(c0 + (j)) * sizeof(moe_block_q8_k) +                            \
                          offsetof(moe_block_q8_k, qs) + (q)*FAST_AMX_SCALED_K,                    \
                      xs);                                                                         \
        FAST_AMX_LOAD(0, tiles[j].hi + (q)*FAST_AMX_SCALED_K / 4, 64);                             \
        FAST_AMX_DP(tdpbssd, CH, A, 0);                                                            \
        FAST_AMX_LOAD(1, tiles[j].lo + (q)*FAST_AMX_SCALED_K / 4, 64);                             \
        FAST_AMX_DP(tdpbsud, CL, A, 1);                                                            \
    } while (0)

/* 16 activation rows (xs bytes apart, block c0 on) against nc <= FAST_AMX_SCALED_CHUNK tiles: the
 * rows from `from` on into acc[from .. 15] (one fma per block, in block order). */
MOE_INLINE void fast_amx_scaled_rows(fast_type type, const fast_scaled_tile *tiles, int64_t nc,
                                     const uint8_t *x, size_t xs, int64_t c0, int from,
                                     __m512 *acc) {
    int32_t c[FAST_AMX_SCALED_CHUNK][2][FAST_AMX_ROWS][16] __attribute__((aligned(64)));
    FAST_AMX_ZERO(4);
    FAST_AMX_ZERO(5);
    if (nc > 1) {
        FAST_AMX_ZERO(6);
        FAST_AMX_ZERO(7);
    }
    for (int q = 0; q < MOE_QK_K / FAST_AMX_SCALED_K; q++) {
        FAST_AMX_SCALED_QUARTER(0, q, 2, 4, 5);
        if (nc > 1) FAST_AMX_SCALED_QUARTER(1, q, 3, 6, 7);
    }
    FAST_AMX_STORE(4, c[0][0], 64);
    FAST_AMX_STORE(5, c[0][1], 64);
    if (nc > 1) {
        FAST_AMX_STORE(6, c[1][0], 64);
        FAST_AMX_STORE(7, c[1][1], 64);
    }
    for (int m = from; m < FAST_AMX_ROWS; m++) {
        const moe_block_q8_k *y = (const moe_block_q8_k *)(x + (size_t)m * xs) + c0;
        __m512 a = acc[m];
        for (int64_t j = 0; j < nc; j++) {
            const __m512i sum =
                _mm512_add_epi32(_mm512_slli_epi32(z_load(c[j][0][m]), 8), z_load(c[j][1][m]));
            a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(tiles[j].d, _mm512_set1_ps(y[j].d)),
                                              _mm512_set1_ps(type.mult)),
                                _mm512_cvtepi32_ps(sum), a);
        }
        acc[m] = a;
    }
}
#undef FAST_AMX_SCALED_QUARTER

/* The scaled tiles' kernel: FAST_GROUP activation rows at a time, per chunk of blocks each
 * block of the 16 weight rows decoded once, then the rows 16 at a time. */
MOE_INLINE void fast_amx_scaled_drive(fast_type t, fast_decode_fn values, const void *w, size_t ws,
                                      int n_w, const void *x, size_t xs, int64_t n_rows, int64_t nb,
                                      float *out, int64_t os) {
    const __mmask16 lanes = (__mmask16)((1u << n_w) - 1);
    fast_scaled_tile tiles[FAST_AMX_SCALED_CHUNK];
    __m512 accbuf[FAST_GROUP];
    MOE_CHECK(n_rows >= FAST_AMX_ROWS);
    fast_amx_configure(FAST_AMX_SCALED_K);
    for (int64_t g0 = 0; g0 < n_rows; g0 += FAST_GROUP) {
        const int64_t ng = n_rows - g0 < FAST_GROUP ? n_rows - g0 : FAST_GROUP;
        for (int64_t r = 0; r < ng; r++) accbuf[r] = _mm512_setzero_ps();
        for (int64_t c0 = 0; c0 < nb; c0 += FAST_AMX_SCALED_CHUNK) {
            const int64_t nc = nb - c0 < FAST_AMX_SCALED_CHUNK ? nb - c0 : FAST_AMX_SCALED_CHUNK;
            for (int64_t j = 0; j < nc; j++)
                fast_amx_scaled_tile(t, values, w, ws, n_w, c0 + j, &tiles[j]);
            for (int64_t r = 0; r < ng; r += FAST_AMX_ROWS) {
                /* the last 16 rows of the call, reaching back over rows done */
                const int64_t at =
                    g0 + r + FAST_AMX_ROWS <= n_rows ? g0 + r : n_rows - FAST_AMX_ROWS;
                __m512 acc[FAST_AMX_ROWS];
                const int from = (int)(g0 + r - at);
                for (int m = from; m < FAST_AMX_ROWS; m++) acc[m] = accbuf[at + m - g0];
                fast_amx_scaled_rows(t, tiles, nc, (const uint8_t *)x + (size_t)at * xs, xs, c0,
                                     from, acc);
                for (int m = from; m < FAST_AMX_ROWS; m++) accbuf[at + m - g0] = acc[m];
            }
        }
        for (int64_t r = 0; r < ng; r++)
            _mm512_mask_storeu_ps(out + (g0 + r) * os, lanes, accbuf[r]);
    }
}
