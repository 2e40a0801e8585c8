/* kernels.c: builds the per-ISA kernel tables once, on both paths, and hands out the active one.
 *
 * Level by level: scalar = the trait table's reference dots and the reference activation
 * quantizers; every higher level starts as a copy of the one below it (below(): avxvnni and
 * avx512 both sit on avx2) and lets its ISA file overwrite what it does faster. That chain is the
 * exact path. Each level's fast table is a copy of its exact one with the level's own fast
 * kernels over it (a type without one keeps its exact kernel; a fast kernel is never inherited
 * from a lower level, whose speed would not be this level's; the amx level, whose exact table is
 * avx512vnni's, has avx512vnni's fast table with AMX many-row kernels over it; avxvnni's exact
 * table is avx2's, its fast one avx2's fast kernels built with vpdpbusd, fast_avx2.c). Only levels
 * the CPU runs are built (moe_cpu_isa_runs), so no ISA file runs on a CPU without its
 * instructions. The trap: moe_kernels_get() follows MOE_ISA and
 * MOE_EXACT, moe_kernels_for_isa() / _for_path() do not (tests walk every runnable level). */
#include "kernels.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

static moe_kernels tables[2][MOE_ISA_COUNT]; /* [exact][level] */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void reference_quantize_q8_0(const float *x, void *out, int64_t n) {
    moe_ref_q8_0_from_float_act(x, out, n);
}
static void reference_quantize_q8_1(const float *x, void *out, int64_t n) {
    moe_ref_q8_1_from_float_act(x, out, n);
}

static void build_scalar(moe_kernels *k) {
    for (int t = 0; t < MOE_TYPE_COUNT; t++) {
        const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
        moe_type_kernels *e = &k->types[t];
        e->dot_isa = e->quantize_isa = MOE_ISA_SCALAR;
        e->dot_type = tr ? tr->dot_type : MOE_TYPE_COUNT;
        if (!tr || !tr->dot) continue;
        e->dot = tr->dot;
        switch (tr->dot_type) {
        case MOE_TYPE_Q8_0:
            e->quantize_row_for_dot = reference_quantize_q8_0;
            break;
        case MOE_TYPE_Q8_1:
            e->quantize_row_for_dot = reference_quantize_q8_1;
            break;
        case MOE_TYPE_Q8_K:
            e->quantize_row_for_dot = moe_ref_q8_k_from_float_act;
            break;
        default: /* F32 / F16 / BF16: the type's own converter rounds as ggml-cpu does */
            e->quantize_row_for_dot = moe_type_traits_get(tr->dot_type)->from_float;
            break;
        }
    }
}

/* The level a level's exact table starts from. */
static moe_isa below(moe_isa level) {
    return level == MOE_ISA_AVXVNNI || level == MOE_ISA_AVX512 ? MOE_ISA_AVX2 : level - 1;
}

static void build(void) {
    moe_kernels *exact = tables[1], *fast = tables[0];
    build_scalar(&exact[MOE_ISA_SCALAR]);
    exact[MOE_ISA_SCALAR].attn_scores = moe_ref_attn_scores;
    exact[MOE_ISA_SCALAR].attn_mix = moe_ref_attn_mix;
    exact[MOE_ISA_SCALAR].attn_tile = moe_ref_attn_tile;
    exact[MOE_ISA_SCALAR].rows_times = moe_ref_rows_times;
    exact[MOE_ISA_SCALAR].rows_update = moe_ref_rows_update;
    exact[MOE_ISA_SCALAR].delta_row = moe_ref_delta_row;
    exact[MOE_ISA_SCALAR].index_scores = moe_ref_index_scores;
    exact[MOE_ISA_SCALAR].swiglu = moe_ref_swiglu;
    exact[MOE_ISA_SCALAR].silu = moe_ref_silu;
    exact[MOE_ISA_SCALAR].sigmoid = moe_ref_sigmoid;
    for (int level = MOE_ISA_SCALAR + 1; level < MOE_ISA_COUNT; level++) {
        if (!moe_cpu_isa_runs((moe_isa)level)) continue;
        exact[level] = exact[below((moe_isa)level)];
        switch ((moe_isa)level) {
        case MOE_ISA_AVX2:
            moe_kernels_fill_avx2(&exact[level]);
            moe_kernels_fill_linear_avx2(&exact[level]);
            break;
        case MOE_ISA_AVX512:
            moe_kernels_fill_avx512(&exact[level]);
            moe_kernels_fill_linear_avx512(&exact[level]);
            break;
        case MOE_ISA_AVX512VNNI:
            moe_kernels_fill_avx512vnni(&exact[level]);
            break;
        default:
            break;
        }
    }
    for (int level = 0; level < MOE_ISA_COUNT; level++) {
        if (!moe_cpu_isa_runs((moe_isa)level)) continue;
        fast[level] = exact[level];
        if (level == MOE_ISA_SCALAR) moe_kernels_fill_fast_scalar(&fast[level]);
        if (level == MOE_ISA_AVX2) moe_kernels_fill_fast_avx2(&fast[level]);
        if (level == MOE_ISA_AVXVNNI) moe_kernels_fill_fast_avxvnni(&fast[level]);
        if (level == MOE_ISA_AVX512VNNI) moe_kernels_fill_fast_avx512vnni(&fast[level]);
        if (level == MOE_ISA_AMX) moe_kernels_fill_fast_amx(&fast[level]);
        for (int e = 0; e < 2; e++) {
            tables[e][level].isa = (moe_isa)level;
            tables[e][level].name = moe_isa_name((moe_isa)level);
            tables[e][level].exact = e;
        }
    }
}

const moe_kernels *moe_kernels_for_path(moe_isa isa, bool exact) {
    pthread_once(&once, build);
    if (!moe_cpu_isa_runs(isa)) return NULL;
    return &tables[exact][isa];
}

const moe_kernels *moe_kernels_for_isa(moe_isa isa) {
    return moe_kernels_for_path(isa, true);
}

const moe_kernels *moe_kernels_get(void) {
    pthread_once(&once, build);
    return moe_kernels_for_path(moe_cpu_isa(), moe_exact());
}

const moe_type_kernels *moe_kernels_type(moe_type wtype) {
    if ((unsigned)wtype >= MOE_TYPE_COUNT) return NULL;
    return &moe_kernels_get()->types[wtype];
}

void moe_dot_rows(const moe_type_kernels *k, const void *w, const void *x, size_t x_stride,
                  int64_t n_rows, int64_t n, float *out, int64_t out_stride) {
    if (k->dot_rows) {
        k->dot_rows(w, x, x_stride, n_rows, n, out, out_stride);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++)
        out[r * out_stride] = k->dot(w, (const uint8_t *)x + (size_t)r * x_stride, n);
}
