/* kernels.h: quant's internal interface between the table builder (kernels.c) and the per-ISA
 * kernel files (x86_avx2.c; fast_avx2.c, built at avx2 and at avxvnni; x86_avx512.c, built once
 * per AVX-512 level; fast_avx512vnni.c, which also holds the amx level's kernels, fast_amx.h).
 *
 * Each ISA file is compiled with its own -m flags (Makefile, isa_of) and exports its fill
 * functions (the exact table's, or the fast table's): each overwrites the entries of
 * a table it has a faster kernel for and leaves the rest (inherited from the level below) alone.
 * The trap: nothing may call into an ISA file before kernels.c has checked that the CPU runs that
 * level -- the file's own static initialisers and helpers may already use its instructions. */
#ifndef MOE_QUANT_KERNELS_H
#define MOE_QUANT_KERNELS_H

#include "quant.h"

/* Set the entries of a table (copied from the level below) this level has faster kernels for:
 * type dots and activation converters (entry t's *_isa names the level), attention. */
void moe_kernels_fill_avx2(moe_kernels *k);
void moe_kernels_fill_avx512(moe_kernels *k);
void moe_kernels_fill_avx512vnni(moe_kernels *k);
/* Linear attention's chunk products (x86_linear.h), by vector width. */
void moe_kernels_fill_linear_avx2(moe_kernels *k);
void moe_kernels_fill_linear_avx512(moe_kernels *k);
/* The fast path's kernels of a level, over a copy of that level's exact table (quant.h). */
void moe_kernels_fill_fast_scalar(moe_kernels *k);
void moe_kernels_fill_fast_avx2(moe_kernels *k);
/* avx2's fast kernels built with vpdpbusd (fast_avx2.c): the same bits, IQ4_XS also in the tile. */
void moe_kernels_fill_fast_avxvnni(moe_kernels *k);
void moe_kernels_fill_fast_avx512vnni(moe_kernels *k);
/* avx512vnni's, then the AMX tile kernels (fast_amx.h) over it. */
void moe_kernels_fill_fast_amx(moe_kernels *k);
/* The AVX2 attention mix, for the tails of the wider one. */
void moe_avx2_attn_mix(float *y, const float *p, const void *v, int64_t stride_bytes, int64_t n_kv,
                       moe_type kv_type, int n);

/* Helpers for the fill functions: install a dot for weight type t, or an activation converter
 * for every weight type whose dot_type is dt. */
/* dot_rows may be NULL (moe_dot_rows then loops over dot); it is always replaced together with
 * dot, so a level never pairs its dot with a lower level's many-row kernel, whose float
 * summation order may differ. */
static inline void moe_kernels_set_dot(moe_type_kernels types[MOE_TYPE_COUNT], moe_type t,
                                       moe_dot_fn dot, moe_dot_rows_fn dot_rows, moe_isa isa) {
    if (!types[t].dot) return; /* no reference dot: nothing to be faster than */
    types[t].dot = dot;
    types[t].dot_rows = dot_rows;
    types[t].dot_rows2 = NULL; /* the same rule: only the level's own, set after its dot */
    types[t].dot_tile = NULL;
    types[t].dot_tile_rows16 = NULL;
    types[t].dot_isa = isa;
}
/* A fast-path dot and its tile kernel (NULL: row by row through dot): the exact level's many-row
 * kernels go, whose float order differs. */
static inline void moe_kernels_set_fast_dot(moe_type_kernels types[MOE_TYPE_COUNT], moe_type t,
                                            moe_dot_fn dot, moe_dot_tile_fn tile, moe_isa isa) {
    moe_kernels_set_dot(types, t, dot, NULL, isa);
    if (types[t].dot) types[t].dot_tile = tile;
}
static inline void moe_kernels_set_dot_rows2(moe_type_kernels types[MOE_TYPE_COUNT], moe_type t,
                                             moe_dot_rows2_fn fn) {
    if (types[t].dot) types[t].dot_rows2 = fn;
}
static inline void moe_kernels_set_quantize(moe_type_kernels types[MOE_TYPE_COUNT], moe_type dt,
                                            moe_from_float_fn fn, moe_isa isa) {
    for (int t = 0; t < MOE_TYPE_COUNT; t++)
        if (types[t].dot && types[t].dot_type == dt) {
            types[t].quantize_row_for_dot = fn;
            types[t].quantize_isa = isa;
        }
}

#endif
