/* quantize_iq.c: weight quantizers for the codebook types IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S
 * IQ3_XXS IQ3_S, following ggml's algorithms (ggml-quants.c) so the same floats and importance
 * vector give the same bytes.
 *
 * Each type snaps groups of 8 (IQ1 / IQ2) or 4 (IQ3) magnitudes to a lattice codebook. A group's
 * rounded levels l (0..2 or 0..7 per coordinate) form an index into a map; an index that is not
 * a codebook point has a precomputed list of its nearest codebook points (all points within the
 * nwant smallest distances, in order of distance then index), and the quantizer picks the one
 * with the smallest weighted error. Those lattices are built once per type from the codebooks of
 * iq_tables.c (levels = rank of the byte value), thread-safely, on first use.
 *
 * The trap: byte-exactness with ggml depends on float operation order (each expression here is
 * evaluated in the order ggml writes it) and on the neighbour order, which breaks ties. */
#include "blocks.h"
#include "quantize_internal.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define GROUP_MAX_EPS         1e-15f
#define GROUP_MAX_EPS_IQ3_XXS 1e-8f
#define GROUP_MAX_EPS_IQ2_S   1e-8f
#define GROUP_MAX_EPS_IQ1_M   1e-7f
#define GROUP_MAX_EPS_IQ1_S   1e-12f

static inline int clamp_int(int v, int lo, int hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

/* ==== Lattices: codebook levels, index map, neighbour lists ==== */

typedef struct {
    int grid_size;        /* codebook entries */
    int dims;             /* values per entry: 8 (IQ1 / IQ2) or 4 (IQ3) */
    int bits;             /* bits per coordinate in a map index: 2 or 3 */
    int8_t *grid;         /* [grid_size][dims] odd levels 2l+1 */
    int8_t *soa;          /* per off-grid index: its neighbours' levels, [dims][count rounded up
                             to 8] (padded with the first), for the distance kernels */
    uint32_t *soa_at;     /* [1 << bits*dims] where an off-grid index's block of soa starts */
    int32_t *map;         /* [1 << bits*dims]: >= 0 entry; < 0 -(offset + 1) into neighbours */
    uint16_t *neighbours; /* per off-grid index: count, then entry indices */
} iq_lattice;

/* The distance kernel: scalar here, AVX2 in quantize_iq_avx2.c (bit-identical: each lane sums
 * in the scalar order), chosen once from moe_cpu_isa(). */
void moe_iq_neighbour_d2_ref(const int8_t *soa, int count, int dims, const float *xval,
                             const float *w, float scale, float a, float b, float *d2) {
    const int padded = (count + 7) & ~7;
    for (int j = 0; j < count; ++j) {
        float s = 0;
        for (int i = 0; i < dims; ++i) {
            float q = (float)soa[i * padded + j] * a + b;
            float diff = scale * q - xval[i];
            s += w[i] * diff * diff;
        }
        d2[j] = s;
    }
}

static moe_iq_neighbour_d2_fn neighbour_d2 = moe_iq_neighbour_d2_ref;
static pthread_once_t neighbour_d2_once = PTHREAD_ONCE_INIT;
static void neighbour_d2_choose(void) {
    if (moe_cpu_isa() >= MOE_ISA_AVX2) neighbour_d2 = moe_iq_neighbour_d2_avx2;
}

enum { LAT_IQ2_XXS, LAT_IQ2_XS, LAT_IQ2_S, LAT_IQ1, LAT_IQ3_XXS, LAT_IQ3_S, LAT_COUNT };

static iq_lattice lattices[LAT_COUNT];
static pthread_once_t lattice_once[LAT_COUNT] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT,
                                                 PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT,
                                                 PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

/* Byte k (0..dims-1) of codebook entry e, as a signed value. */
static int codebook_byte(int lat, int e, int k) {
    switch (lat) {
    case LAT_IQ2_XXS:
        return (int8_t)(moe_iq2xxs_grid[e] >> (8 * k));
    case LAT_IQ2_XS:
        return (int8_t)(moe_iq2xs_grid[e] >> (8 * k));
    case LAT_IQ2_S:
        return (int8_t)(moe_iq2s_grid[e] >> (8 * k));
    case LAT_IQ1:
        return (int8_t)(moe_iq1s_grid[e] >> (8 * k));
    case LAT_IQ3_XXS:
        return (int8_t)(moe_iq3xxs_grid[e] >> (8 * k));
    default:
        return (int8_t)(moe_iq3s_grid[e] >> (8 * k));
    }
}

/* The levels a search may produce: 0..2 per coordinate for IQ1 / IQ2 (kMaxQ - 1 = 2, the
 * codebooks use three values), 0..7 for IQ3; only those indices get neighbour lists. */
static int max_level(const iq_lattice *g) {
    return g->bits == 2 ? 2 : 7;
}

static void lattice_build(int lat) {
    static const struct {
        int grid_size, dims, bits, nwant, levels;
    } spec[LAT_COUNT] = {
        [LAT_IQ2_XXS] = {256, 8, 2, 2, 3}, [LAT_IQ2_XS] = {512, 8, 2, 2, 3},
        [LAT_IQ2_S] = {1024, 8, 2, 1, 3},  [LAT_IQ1] = {2048, 8, 2, 3, 3},
        [LAT_IQ3_XXS] = {256, 4, 3, 2, 8}, [LAT_IQ3_S] = {512, 4, 3, 3, 8},
    };
    iq_lattice *g = &lattices[lat];
    g->grid_size = spec[lat].grid_size, g->dims = spec[lat].dims, g->bits = spec[lat].bits;
    const int n = g->grid_size, dims = g->dims, nwant = spec[lat].nwant;

    /* levels: the rank of each byte value among the codebook's distinct values */
    int values[16], n_values = 0;
    for (int e = 0; e < n; e++)
        for (int k = 0; k < dims; k++) {
            int v = codebook_byte(lat, e, k), j = 0;
            while (j < n_values && values[j] != v) j++;
            if (j == n_values) {
                if (n_values == 16) moe_die("iq lattice %d: too many codebook values", lat);
                values[n_values++] = v;
            }
        }
    if (n_values != spec[lat].levels)
        moe_die("iq lattice %d: %d distinct codebook values, expected %d", lat, n_values,
                spec[lat].levels);
    for (int a = 1; a < n_values; a++) /* insertion sort, ascending */
        for (int b = a; b > 0 && values[b - 1] > values[b]; b--) {
            int t = values[b];
            values[b] = values[b - 1], values[b - 1] = t;
        }
    g->grid = moe_xmalloc((size_t)n * (size_t)dims);
    const int map_size = 1 << (g->bits * dims);
    g->map = moe_xmalloc((size_t)map_size * sizeof(int32_t));
    for (int i = 0; i < map_size; i++) g->map[i] = -1;
    for (int e = 0; e < n; e++) {
        int index = 0;
        for (int k = 0; k < dims; k++) {
            int v = codebook_byte(lat, e, k), l = 0;
            while (values[l] != v) l++;
            g->grid[e * dims + k] = (int8_t)(2 * l + 1);
            index |= l << (g->bits * k);
        }
        g->map[index] = e;
    }

    /* neighbour lists of every reachable off-grid index: the entries within the nwant smallest
     * distinct squared distances, by distance then entry index (ggml's qsort order) */
    const int maxl = max_level(g), mask = (1 << g->bits) - 1;
    int *d2 = moe_xmalloc((size_t)n * sizeof(int));
    size_t cap = 1 << 16, used = 1; /* list[0] unused: map -1 stays "no list" */
    uint16_t *list = moe_xmalloc(cap * sizeof(uint16_t));
    list[0] = 0;
    for (int i = 0; i < map_size; i++) {
        if (g->map[i] >= 0) continue;
        int pos[8], reachable = 1;
        for (int k = 0; k < dims; k++) {
            int l = (i >> (g->bits * k)) & mask;
            if (l > maxl) reachable = 0;
            pos[k] = 2 * l + 1;
        }
        if (!reachable) continue;
        int dmax = 0;
        for (int e = 0; e < n; e++) {
            int s = 0;
            for (int k = 0; k < dims; k++) {
                int diff = g->grid[e * dims + k] - pos[k];
                s += diff * diff;
            }
            d2[e] = s;
            if (s > dmax) dmax = s;
        }
        /* the nwant smallest distinct distances, ascending */
        int chosen[4], n_chosen = 0, floor_d = -1;
        while (n_chosen < nwant) {
            int best = dmax + 1;
            for (int e = 0; e < n; e++)
                if (d2[e] > floor_d && d2[e] < best) best = d2[e];
            if (best > dmax) break;
            chosen[n_chosen++] = best, floor_d = best;
        }
        size_t count = 0;
        for (int c = 0; c < n_chosen; c++)
            for (int e = 0; e < n; e++) count += d2[e] == chosen[c];
        while (used + count + 1 > cap) {
            cap *= 2;
            list = realloc(list, cap * sizeof(uint16_t));
            if (!list) moe_die("out of memory building the iq lattice");
        }
        g->map[i] = -(int32_t)(used + 1);
        list[used++] = (uint16_t)count;
        for (int c = 0; c < n_chosen; c++)
            for (int e = 0; e < n; e++)
                if (d2[e] == chosen[c]) list[used++] = (uint16_t)e;
    }
    free(d2);
    g->neighbours = list;

    /* the neighbours' levels, transposed for the distance kernels */
    size_t soa_size = 0;
    for (int i = 0; i < map_size; i++)
        if (g->map[i] < -1) soa_size += (size_t)((list[-g->map[i] - 1] + 7) & ~7) * dims;
    g->soa = moe_xmalloc(soa_size ? soa_size : 1);
    g->soa_at = moe_xmalloc((size_t)map_size * sizeof(uint32_t));
    size_t at = 0;
    for (int i = 0; i < map_size; i++) {
        g->soa_at[i] = (uint32_t)at;
        if (g->map[i] >= -1) continue;
        const uint16_t *nb = list + (-g->map[i] - 1);
        const int padded = (nb[0] + 7) & ~7;
        for (int k = 0; k < dims; k++)
            for (int j = 0; j < padded; j++)
                g->soa[at + (size_t)k * padded + j] =
                    g->grid[nb[1 + (j < nb[0] ? j : 0)] * dims + k];
        at += (size_t)padded * dims;
    }
}

#define DEFINE_LATTICE_INIT(L)                                                                     \
    static void lattice_init_##L(void) {                                                           \
        lattice_build(L);                                                                          \
    }
DEFINE_LATTICE_INIT(LAT_IQ2_XXS)
DEFINE_LATTICE_INIT(LAT_IQ2_XS)
DEFINE_LATTICE_INIT(LAT_IQ2_S)
DEFINE_LATTICE_INIT(LAT_IQ1)
DEFINE_LATTICE_INIT(LAT_IQ3_XXS)
DEFINE_LATTICE_INIT(LAT_IQ3_S)

static const iq_lattice *lattice_get(int lat) {
    pthread_once(&neighbour_d2_once, neighbour_d2_choose);
    static void (*const init[LAT_COUNT])(void) = {
        lattice_init_LAT_IQ2_XXS, lattice_init_LAT_IQ2_XS,  lattice_init_LAT_IQ2_S,
        lattice_init_LAT_IQ1,     lattice_init_LAT_IQ3_XXS, lattice_init_LAT_IQ3_S,
    };
    pthread_once(&lattice_once[lat], init[lat]);
    return &lattices[lat];
}

/* Map index of dims levels L (bits per coordinate from the lattice). */
static int lattice_index(const iq_lattice *g, const int8_t *L) {
    int u = 0;
    for (int k = 0; k < g->dims; k++) u |= L[k] << (g->bits * k);
    return u;
}

static const uint16_t *neighbours_of(const iq_lattice *g, int u) {
    return g->neighbours + (-g->map[u] - 1);
}

/* Among u's neighbours, the entry whose values (a * level + b) times scale are nearest to xval
 * under weights w (the first on ties); its levels go to L. With a = 1, b = 0 this is ggml's
 * iq2_find_best_neighbour / iq3_find_best_neighbour (w the square roots of the weights); IQ1
 * maps levels 1, 3, 5 to its value set xg[0..2] = xg[0] + 0..2 exactly with a = 1/2,
 * b = xg[0] - 1/2 (ggml's iq1_find_best_neighbour2). */
static int best_neighbour(const iq_lattice *g, int u, const float *xval, const float *w,
                          float scale, float a, float b, int8_t *L) {
    const uint16_t *nb = neighbours_of(g, u);
    float d2[320];
    neighbour_d2(g->soa + g->soa_at[u], nb[0], g->dims, xval, w, scale, a, b, d2);
    float best_d2 = FLT_MAX;
    int best = nb[1]; /* NaN distances: any neighbour keeps the block valid */
    for (int j = 0; j < nb[0]; ++j)
        if (d2[j] < best_d2) best_d2 = d2[j], best = nb[1 + j];
    const int8_t *pg = g->grid + best * g->dims;
    for (int i = 0; i < g->dims; ++i) L[i] = (int8_t)((pg[i] - 1) / 2);
    return best;
}

/* Levels of one group at inverse scale id: nearest odd level, clamped to 0..maxl. */
static void round_levels(const float *xval, float id, int n, int maxl, int8_t *L) {
    for (int i = 0; i < n; ++i)
        L[i] = (int8_t)clamp_int(moe_nearest_int(0.5f * (id * xval[i] - 1)), 0, maxl);
}

/* sum w x q and sum w q^2 with q = 2L + 1 over n values. */
static void odd_sums(const float *w, const float *xval, const int8_t *L, int n, float *sumqx,
                     float *sumq2) {
    float a = 0, b = 0;
    for (int i = 0; i < n; ++i) {
        float q = 2 * L[i] + 1;
        a += w[i] * xval[i] * q;
        b += w[i] * q * q;
    }
    *sumqx = a, *sumq2 = b;
}

/* |x| of 8 values into xval with their sign bits; with `even`, an odd number of negatives is
 * made even by flipping the value of least weight * x^2 (IQ2_XXS / IQ2_XS / IQ3_XXS store 7
 * sign bits, the eighth is the parity). */
static uint8_t split_signs(const float *xb, const float *weight, float *xval, bool even) {
    int nflip = 0;
    uint8_t s = 0;
    for (int i = 0; i < 8; ++i) {
        if (xb[i] >= 0)
            xval[i] = xb[i];
        else
            xval[i] = -xb[i], ++nflip, s |= (uint8_t)(1 << i);
    }
    if (even && nflip % 2) {
        int imin = 0;
        float min = weight[imin] * xb[imin] * xb[imin];
        for (int i = 1; i < 8; ++i) {
            float ax = weight[i] * xb[i] * xb[i];
            if (ax < min) min = ax, imin = i;
        }
        xval[imin] = -xval[imin];
        s ^= (uint8_t)(1 << imin);
    }
    return even ? (uint8_t)(s & 127) : s;
}

/* The scale of a 4-bit sub-block scale index: nearest l with (2l + 1) d ~ scale. */
static int odd_scale_index(float id, float scale, int max) {
    return clamp_int(moe_nearest_int(0.5f * (id * scale - 1)), 0, max);
}

/* ==== Shared search: one sub-block against a lattice ====
 *
 * n values in groups of g->dims; for each trial scale round to levels, snap off-grid groups to
 * their best neighbour, refit the scale by weighted least squares and keep the best. Then, where
 * `refine` says, re-snap the groups at the kept scale and refit. Returns the scale; L holds the
 * levels of each group (always codebook points). */
typedef enum {
    REFINE_ALL_FROM_GRID, /* IQ2_XXS: redo every group, levels read back from the grid */
    REFINE_OFF_GRID,      /* IQ2_XS / IQ2_S: redo only groups that were off the grid */
    REFINE_OFF_GRID_FROM_GRID /* IQ3_XXS: as above, levels read back from the grid */,
    REFINE_ALL_IF_ANY_OFF /* IQ3_S: redo every group when any was off the grid */
} refine_mode;

static float search_scale(const iq_lattice *g, int n, const float *xval, const float *weight,
                          const float *waux, float scale, float max, float base, float step,
                          int is_lo, int is_hi, bool on_grid_start, refine_mode refine, int8_t *L) {
    const int maxl = max_level(g), groups = n / g->dims;
    int8_t Laux[32];
    bool on_grid[8], on_grid_aux[8];
    float best = 0;
    for (int k = 0; k < groups; ++k) on_grid[k] = on_grid_start;
    for (int is = is_lo; is <= is_hi; ++is) {
        float id = (base + is * step) / max;
        float this_scale = 1 / id;
        for (int k = 0; k < groups; ++k) {
            int8_t *Lk = Laux + g->dims * k;
            round_levels(xval + g->dims * k, id, g->dims, maxl, Lk);
            int u = lattice_index(g, Lk);
            on_grid_aux[k] = g->map[u] >= 0;
            if (!on_grid_aux[k])
                best_neighbour(g, u, xval + g->dims * k, waux + g->dims * k, this_scale, 1, 0, Lk);
        }
        float sumqx, sumq2;
        odd_sums(weight, xval, Laux, n, &sumqx, &sumq2);
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            memcpy(L, Laux, (size_t)n);
            memcpy(on_grid, on_grid_aux, sizeof on_grid);
        }
    }
    int n_off = 0;
    for (int k = 0; k < groups; ++k) n_off += !on_grid[k];
    const bool redo = refine == REFINE_ALL_FROM_GRID ? scale > 0 : n_off > 0 && scale > 0;
    if (redo) {
        const float id = 1 / scale;
        for (int k = 0; k < groups; ++k) {
            const bool all = refine == REFINE_ALL_FROM_GRID || refine == REFINE_ALL_IF_ANY_OFF;
            if (!all && on_grid[k]) continue;
            int8_t *Lk = L + g->dims * k, lv[8];
            round_levels(xval + g->dims * k, id, g->dims, maxl, lv);
            int u = lattice_index(g, lv);
            if (refine == REFINE_OFF_GRID) memcpy(Lk, lv, (size_t)g->dims);
            int e = g->map[u];
            if (e < 0)
                e = best_neighbour(g, u, xval + g->dims * k, waux + g->dims * k, scale, 1, 0, Lk);
            if (refine != REFINE_OFF_GRID) {
                const int8_t *pg = g->grid + e * g->dims;
                for (int i = 0; i < g->dims; ++i) Lk[i] = (int8_t)((pg[i] - 1) / 2);
            }
        }
        float sumqx, sumq2;
        odd_sums(weight, xval, L, n, &sumqx, &sumq2);
        if (sumq2 > 0) scale = sumqx / sumq2;
    }
    return scale;
}

/* Codebook entry of already-snapped levels. */
static int entry_of(const iq_lattice *g, const int8_t *L) {
    int e = g->map[lattice_index(g, L)];
    if (e < 0) moe_die("iq quantizer: levels off the codebook");
    return e;
}

/* ==== IQ2_XXS / IQ2_XS / IQ2_S ==== */

/* Per-value weights of a sub-block: importance-weighted, or `fallback_quarter` (IQ2_S:
 * sigma2/4 + x^2) / x^2 without an importance vector. */
static void sub_block_weights(const float *qw, const float *xb, int n, float sigma2,
                              bool fallback_quarter, float *weight, float *waux) {
    for (int i = 0; i < n; ++i) {
        if (qw)
            weight[i] = qw[i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else
            weight[i] = fallback_quarter ? 0.25f * sigma2 + xb[i] * xb[i] : xb[i] * xb[i];
    }
    if (waux)
        for (int i = 0; i < n; ++i) waux[i] = sqrtf(weight[i]);
}

static float max_of(const float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

/* IQ2_XXS and IQ3_XXS (ggml's quantize_row_iq2_xxs_impl / quantize_row_iq3_xxs_impl with grid
 * 256): 8 sub-blocks of 32 with 7 sign bits + parity per 8 values and a 4-bit odd scale per
 * sub-block, stored per sub-block as a uint32 of 4 x 7 sign bits | scale << 28 beside the grid
 * indices (IQ2_XXS: 4 index bytes then that word, interleaved; IQ3_XXS: 64 index bytes, then
 * the 8 words). IQ2_XXS starts its scan from the weighted positive fit, IQ3_XXS from max/15. */
static void quantize_xxs(const float *x, void *y, int64_t n, const float *qw, bool iq3) {
    const iq_lattice *g = lattice_get(iq3 ? LAT_IQ3_XXS : LAT_IQ2_XXS);
    float scales[8], weight[32], xval[32], waux[32];
    int8_t L[32];
    for (int64_t ibl = 0; ibl < n / MOE_QK_K; ++ibl) {
        const float *xbl = x + MOE_QK_K * ibl;
        uint8_t idx[64]; /* grid indices: IQ2_XXS 4 per sub-block, IQ3_XXS 8 */
        uint32_t words[8];
        memset(idx, 0, sizeof idx), memset(words, 0, sizeof words);
        float max_scale = 0;
        const float sigma2 = (iq3 ? 2 : 1) * moe_sum_sq(xbl, MOE_QK_K) / MOE_QK_K;
        for (int ib = 0; ib < 8; ++ib) {
            const float *xb = xbl + 32 * ib;
            uint8_t signs[4];
            sub_block_weights(qw ? qw + MOE_QK_K * ibl + 32 * ib : NULL, xb, 32, sigma2, false,
                              weight, waux);
            for (int k = 0; k < 4; ++k)
                signs[k] = split_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k, true);
            const float max = max_of(xval, 32);
            scales[ib] = 0;
            memset(L, 0, sizeof L);
            if (max < (iq3 ? GROUP_MAX_EPS_IQ3_XXS : GROUP_MAX_EPS)) continue;
            float scale;
            if (iq3) {
                scale = search_scale(g, 32, xval, weight, waux, max / 15, max, 15, 0.2f, -15, 15,
                                     true, REFINE_OFF_GRID_FROM_GRID, L);
            } else {
                uint8_t Lqp[32];
                const float start = moe_fit_positive(32, 4, xval, Lqp, weight);
                if (start * 3 <= 0) continue;
                scale = search_scale(g, 32, xval, weight, waux, start, start * 3, 5, 0.1f, -6, 6,
                                     true, REFINE_ALL_FROM_GRID, L);
            }
            if (scale < 0) {
                scale = -scale;
                for (int k = 0; k < 4; ++k) signs[k] = (uint8_t)(~signs[k] & 127);
            }
            const int per = iq3 ? 8 : 4; /* groups (grid entries) per sub-block */
            for (int k = 0; k < per; ++k)
                idx[per * ib + k] = (uint8_t)entry_of(g, L + (32 / per) * k);
            for (int k = 0; k < 4; ++k) words[ib] |= (uint32_t)signs[k] << (7 * k);
            scales[ib] = scale;
            max_scale = scale > max_scale ? scale : max_scale;
        }
        uint8_t *qs = iq3 ? ((moe_block_iq3_xxs *)y + ibl)->qs
                          : (uint8_t *)((moe_block_iq2_xxs *)y + ibl)->qs;
        uint16_t *dh =
            iq3 ? &((moe_block_iq3_xxs *)y + ibl)->d : &((moe_block_iq2_xxs *)y + ibl)->d;
        const size_t qs_bytes = iq3 ? 96 : 64;
        *dh = moe_f32_to_fp16(0.f);
        if (!max_scale) {
            memset(qs, 0, qs_bytes);
            continue;
        }
        const float d = max_scale / 31;
        *dh = moe_f32_to_fp16(iq3 ? d * 1.0125f : d);
        const float id = 1 / d;
        for (int ib = 0; ib < 8; ++ib) {
            words[ib] |= (uint32_t)odd_scale_index(id, scales[ib], 15) << 28;
            uint8_t *w = iq3 ? qs + 64 + 4 * ib : qs + 8 * ib + 4; /* little-endian words */
            if (iq3)
                memcpy(qs + 8 * ib, idx + 8 * ib, 8);
            else
                memcpy(qs + 8 * ib, idx + 4 * ib, 4);
            for (int k = 0; k < 4; ++k) w[k] = (uint8_t)(words[ib] >> (8 * k));
        }
    }
}

MOE_QUANTIZE_FN(iq2_xxs) {
    quantize_xxs(x, y, n, qw, false);
}

/* Sub-blocks of 16 with 4-bit scales, two 8-value groups each: IQ2_XS (9-bit index + 7 sign
 * bits) and IQ2_S (10-bit index, full sign bytes). */
static void quantize_iq2_16(const float *x, void *y, int64_t n, const float *qw, bool is_s) {
    const iq_lattice *g = lattice_get(is_s ? LAT_IQ2_S : LAT_IQ2_XS);
    float scales[16], weight[16], xval[16], waux[16];
    int8_t L[16];
    uint8_t block_signs[2];
    for (int64_t ibl = 0; ibl < n / MOE_QK_K; ++ibl) {
        const float *xbl = x + MOE_QK_K * ibl;
        moe_block_iq2_xs *bx = (moe_block_iq2_xs *)y + ibl;
        moe_block_iq2_s *bs = (moe_block_iq2_s *)y + ibl;
        uint8_t *block_scales;
        if (is_s) {
            memset(bs, 0, sizeof *bs);
            block_scales = bs->scales;
        } else {
            memset(bx, 0, sizeof *bx);
            block_scales = bx->scales;
        }
        float max_scale = 0;
        const float sigma2 = (is_s ? 2 : 1) * moe_sum_sq(xbl, MOE_QK_K) / MOE_QK_K;
        for (int ib = 0; ib < 16; ++ib) {
            const float *xb = xbl + 16 * ib;
            sub_block_weights(qw ? qw + MOE_QK_K * ibl + 16 * ib : NULL, xb, 16, sigma2, is_s,
                              weight, waux);
            for (int k = 0; k < 2; ++k)
                block_signs[k] = split_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k, !is_s);
            memset(L, 0, sizeof L);
            const float max = max_of(xval, 16);
            if (max < (is_s ? GROUP_MAX_EPS_IQ2_S : GROUP_MAX_EPS)) {
                scales[ib] = 0;
                continue;
            }
            float scale = search_scale(g, 16, xval, weight, waux, max / 5, max, 5, 0.1f, -9, 9,
                                       true, REFINE_OFF_GRID, L);
            if (scale < 0) {
                scale = -scale;
                for (int k = 0; k < 2; ++k)
                    block_signs[k] = (uint8_t)(is_s ? ~block_signs[k] : ~block_signs[k] & 127);
            }
            for (int k = 0; k < 2; ++k) {
                const int e = entry_of(g, L + 8 * k), i8 = 2 * ib + k;
                if (is_s) {
                    bs->qs[i8] = (uint8_t)(e & 255);
                    bs->qh[i8 / 4] |= (uint8_t)((e >> 8) << 2 * (i8 % 4));
                    bs->qs[32 + i8] = block_signs[k];
                } else {
                    bx->qs[i8] = (uint16_t)(e | block_signs[k] << 9);
                }
            }
            scales[ib] = scale;
            max_scale = scale > max_scale ? scale : max_scale;
        }
        if (!max_scale) {
            if (!is_s) memset(bx->qs, 0, sizeof bx->qs);
            continue;
        }
        const float d = max_scale / 31;
        if (is_s)
            bs->d = moe_f32_to_fp16(d * 0.9875f);
        else
            bx->d = moe_f32_to_fp16(d);
        const float id = 1 / d;
        for (int ib = 0; ib < 16; ++ib) {
            const int l = odd_scale_index(id, scales[ib], 15);
            if (ib % 2 == 0)
                block_scales[ib / 2] = (uint8_t)l;
            else
                block_scales[ib / 2] |= (uint8_t)(l << 4);
        }
    }
}

MOE_QUANTIZE_FN(iq2_xs) {
    quantize_iq2_16(x, y, n, qw, false);
}

MOE_QUANTIZE_FN(iq2_s) {
    quantize_iq2_16(x, y, n, qw, true);
}

/* ==== IQ3_XXS / IQ3_S ==== */

MOE_QUANTIZE_FN(iq3_xxs) {
    quantize_xxs(x, y, n, qw, true);
}

/* ggml's quantize_row_iq3_s_impl with 32-value sub-blocks: 9-bit indices, full sign bytes. */
MOE_QUANTIZE_FN(iq3_s) {
    const iq_lattice *g = lattice_get(LAT_IQ3_S);
    moe_block_iq3_s *blocks = y;
    float scales[8], weight[32], xval[32], waux[32];
    int8_t L[32];
    for (int64_t ibl = 0; ibl < n / MOE_QK_K; ++ibl) {
        const float *xbl = x + MOE_QK_K * ibl;
        moe_block_iq3_s *b = &blocks[ibl];
        memset(b, 0, sizeof *b);
        float max_scale = 0;
        const float sigma2 = 2 * moe_sum_sq(xbl, MOE_QK_K) / MOE_QK_K;
        for (int ib = 0; ib < 8; ++ib) {
            const float *xb = xbl + 32 * ib;
            sub_block_weights(qw ? qw + MOE_QK_K * ibl + 32 * ib : NULL, xb, 32, sigma2, false,
                              weight, waux);
            uint8_t block_signs[4];
            for (int k = 0; k < 4; ++k)
                block_signs[k] = split_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k, false);
            const float max = max_of(xval, 32);
            memset(L, 0, sizeof L);
            if (!max) {
                scales[ib] = 0;
                continue;
            }
            float scale = search_scale(g, 32, xval, weight, waux, max / 15, max, 15, 0.2f, -9, 9,
                                       false, REFINE_ALL_IF_ANY_OFF, L);
            if (scale < 0) {
                scale = -scale;
                for (int k = 0; k < 4; ++k) block_signs[k] = (uint8_t)~block_signs[k];
            }
            for (int k = 0; k < 8; ++k) {
                const int e = entry_of(g, L + 4 * k);
                b->qs[8 * ib + k] = (uint8_t)(e & 255);
                b->qh[ib] |= (uint8_t)((e >> 8) << k);
            }
            memcpy(b->signs + 4 * ib, block_signs, 4);
            scales[ib] = scale;
            max_scale = scale > max_scale ? scale : max_scale;
        }
        if (!max_scale) continue;
        const float d = max_scale / 31;
        b->d = moe_f32_to_fp16(d * 1.033f);
        const float id = 1 / d;
        for (int ib = 0; ib < 8; ib += 2)
            b->scales[ib / 2] = (uint8_t)(odd_scale_index(id, scales[ib], 15) |
                                          odd_scale_index(id, scales[ib + 1], 15) << 4);
    }
}

/* ==== IQ1_S / IQ1_M ==== */

/* A value and its position, sorted by value (ties by position: a stable order). */
typedef struct {
    float v;
    int i;
} value_at;

static int value_at_cmp(const void *a, const void *b) {
    const value_at *l = a, *r = b;
    return l->v < r->v ? -1 : l->v > r->v ? 1 : l->i - r->i;
}

static const float IQ1_XP[3] = {-1 + MOE_IQ1_DELTA, MOE_IQ1_DELTA, 1 + MOE_IQ1_DELTA};
static const float IQ1_XM[3] = {-1 - MOE_IQ1_DELTA, -MOE_IQ1_DELTA, 1 - MOE_IQ1_DELTA};

/* Snap each 8-value group of levels L (0..2) to the codebook (xx[g] the group's value set),
 * writing the entries; refit the scale when a group moved. Returns the scale. */
static float iq1_snap(const iq_lattice *g, const float *xb, const float *weight, int n, float scale,
                      const float *const *xx, int8_t *L, uint16_t *index) {
    bool all_on_grid = true;
    for (int k = 0; k < n / 8; ++k) {
        const int u = lattice_index(g, L + 8 * k);
        int e = g->map[u];
        if (e < 0) {
            all_on_grid = false;
            e = best_neighbour(g, u, xb + 8 * k, weight + 8 * k, scale, 0.5f, xx[k][0] - 0.5f,
                               L + 8 * k);
        }
        index[k] = (uint16_t)e;
    }
    if (!all_on_grid) {
        float sumqx = 0, sumq2 = 0;
        for (int k = 0; k < n / 8; ++k) {
            const int8_t *pg = g->grid + index[k] * 8;
            for (int j = 0; j < 8; ++j) {
                float w = weight[8 * k + j];
                float q = xx[k][(pg[j] - 1) / 2];
                sumqx += w * q * xb[8 * k + j];
                sumq2 += w * q * q;
            }
        }
        if (sumqx > 0 && sumq2 > 0) scale = sumqx / sumq2;
    }
    return scale;
}

/* Sort the n values of xb ascending, keeping positions. */
static void sort_values(const float *xb, int n, value_at *order) {
    for (int j = 0; j < n; ++j) order[j].v = xb[j], order[j].i = j;
    qsort(order, (size_t)n, sizeof *order, value_at_cmp);
}

/* A sub-block's weights and its values sorted; returns max |x|, or 0 when that is below eps
 * (an empty sub-block: nothing sorted). */
static float iq1_prepare(const float *qw, const float *xb, int n, float sigma2, float eps,
                         float *weight, value_at *order) {
    sub_block_weights(qw, xb, n, sigma2, false, weight, NULL);
    float max = fabsf(xb[0]);
    for (int i = 1; i < n; ++i) max = fabsf(xb[i]) > max ? fabsf(xb[i]) : max;
    if (max < eps) return 0;
    sort_values(xb, n, order);
    return max;
}

/* Levels from the two split points of the sorted order: below i1 -> 0, below i2 -> 1, else 2. */
static void levels_from_split(const value_at *order, int n, int i1, int i2, int8_t *L) {
    for (int j = 0; j < n; ++j) L[order[j].i] = (int8_t)(j < i1 ? 0 : j < i2 ? 1 : 2);
}

/* The best three-level split of IQ1_S's 32 sorted values: both value sets (x_p, x_m) for every
 * pair of split points, by prefix sums. *shift: 1 for x_p, -1 for x_m, 0 when none scored. */
static float iq1_split_s(const float *xb, const float *weight, const value_at *order, float max,
                         int *i1_out, int *i2_out, int *shift) {
    float sumx[33], sumw[33];
    sumx[0] = sumw[0] = 0;
    for (int j = 0; j < 32; ++j) {
        const int i = order[j].i;
        sumx[j + 1] = sumx[j] + weight[i] * xb[i];
        sumw[j + 1] = sumw[j] + weight[i];
    }
    float best_score = -FLT_MAX, scale = max;
    *shift = 0;
    for (int i1 = 0; i1 <= 32; ++i1)
        for (int i2 = i1; i2 <= 32; ++i2)
            for (int s = 0; s < 2; ++s) {
                const float *v = s == 0 ? IQ1_XP : IQ1_XM;
                float sumqx = (sumx[i1] - sumx[0]) * v[0] + (sumx[i2] - sumx[i1]) * v[1] +
                              (sumx[32] - sumx[i2]) * v[2];
                float sumq2 = (sumw[i1] - sumw[0]) * v[0] * v[0] +
                              (sumw[i2] - sumw[i1]) * v[1] * v[1] +
                              (sumw[32] - sumw[i2]) * v[2] * v[2];
                if (sumq2 > 0 && sumqx * sumqx > best_score * sumq2) {
                    scale = sumqx / sumq2, best_score = scale * sumqx;
                    *i1_out = i1, *i2_out = i2, *shift = s == 0 ? 1 : -1;
                }
            }
    return scale;
}

/* The same for IQ1_M's 16 values, each half of 8 with its own value set: *shift = 2 * (first
 * half uses x_m) + (second half uses x_m), -1 when none scored. Per-half prefix sums; since
 * v[0] - v[1] = v[1] - v[2] = -1 for both sets, a split's sum is T v[2] - px[i1] - px[i2]. */
static float iq1_split_m(const float *xb, const float *weight, const value_at *order, float max,
                         int *i1_out, int *i2_out, int *shift) {
    float px[2][17], pw[2][17];
    px[0][0] = px[1][0] = pw[0][0] = pw[1][0] = 0;
    for (int j = 0; j < 16; ++j) {
        const int i = order[j].i, h = i < 8 ? 0 : 1;
        px[h][j + 1] = px[h][j] + weight[i] * xb[i];
        px[1 - h][j + 1] = px[1 - h][j];
        pw[h][j + 1] = pw[h][j] + weight[i];
        pw[1 - h][j + 1] = pw[1 - h][j];
    }
    const float txs[2] = {px[0][16], px[1][16]}, tws[2] = {pw[0][16], pw[1][16]};
    const float p2 = IQ1_XP[2], m2 = IQ1_XM[2];
    const float cp1 = IQ1_XP[0] * IQ1_XP[0] - IQ1_XP[1] * IQ1_XP[1];
    const float cp2 = IQ1_XP[1] * IQ1_XP[1] - IQ1_XP[2] * IQ1_XP[2];
    const float cm1 = IQ1_XM[0] * IQ1_XM[0] - IQ1_XM[1] * IQ1_XM[1];
    const float cm2 = IQ1_XM[1] * IQ1_XM[1] - IQ1_XM[2] * IQ1_XM[2];
    float best_score = -FLT_MAX, scale = max;
    *shift = -1;
    for (int i1 = 0; i1 <= 16; ++i1)
        for (int i2 = i1; i2 <= 16; ++i2) {
            float qx_p[2], qx_m[2], q2_p[2], q2_m[2], sumqx[4], sumq2[4];
            for (int h = 0; h < 2; ++h) {
                const float sx = px[h][i1] + px[h][i2];
                qx_p[h] = txs[h] * p2 - sx;
                qx_m[h] = txs[h] * m2 - sx;
                q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
            }
            sumqx[0] = qx_p[0] + qx_p[1], sumqx[1] = qx_p[0] + qx_m[1];
            sumqx[2] = qx_m[0] + qx_p[1], sumqx[3] = qx_m[0] + qx_m[1];
            sumq2[0] = q2_p[0] + q2_p[1], sumq2[1] = q2_p[0] + q2_m[1];
            sumq2[2] = q2_m[0] + q2_p[1], sumq2[3] = q2_m[0] + q2_m[1];
            for (int k = 0; k < 4; ++k)
                if (sumq2[k] > 0 && sumqx[k] * sumqx[k] > best_score * sumq2[k]) {
                    scale = sumqx[k] / sumq2[k], best_score = scale * sumqx[k];
                    *i1_out = i1, *i2_out = i2, *shift = k;
                }
        }
    return scale;
}

/* The value set of group k (of 8) of an IQ1 sub-block with sign choice `shift`. */
static const float *iq1_values(bool is_m, int shift, int k) {
    if (!is_m) return shift == 1 ? IQ1_XP : IQ1_XM;
    return (k == 0 ? shift < 2 : shift % 2 == 0) ? IQ1_XP : IQ1_XM;
}

/* One IQ1 sub-block (32 values for IQ1_S, 16 for IQ1_M): weights, the exact split, the flip to a
 * positive scale, the snap to the codebook. Returns the scale, 0 for a sub-block left empty
 * (*shift is then IQ1_S's 1 / IQ1_M's 0, as ggml leaves it); index gets the entries. */
static float iq1_sub_block(const iq_lattice *g, bool is_m, const float *xb, const float *qw,
                           float sigma2, uint16_t *index, int *shift) {
    const int n = is_m ? 16 : 32;
    float weight[32];
    int8_t L[32];
    value_at order[32];
    const float max = iq1_prepare(qw, xb, n, sigma2,
                                  is_m ? GROUP_MAX_EPS_IQ1_M : GROUP_MAX_EPS_IQ1_S, weight, order);
    int i1 = -1, i2 = -1;
    float scale = 0;
    if (max != 0)
        scale = is_m ? iq1_split_m(xb, weight, order, max, &i1, &i2, shift)
                     : iq1_split_s(xb, weight, order, max, &i1, &i2, shift);
    if (max == 0 || i1 < 0 || i2 < 0 || *shift == (is_m ? -1 : 0)) {
        *shift = is_m ? 0 : 1;
        return 0;
    }
    levels_from_split(order, n, i1, i2, L);
    if (scale < 0) {
        for (int j = 0; j < n; ++j) L[j] = (int8_t)(2 - L[j]);
        scale = -scale, *shift = is_m ? 3 - *shift : -*shift;
    }
    const float *xxs[4];
    for (int k = 0; k < n / 8; ++k) xxs[k] = iq1_values(is_m, *shift, k);
    return iq1_snap(g, xb, weight, n, scale, xxs, L, index);
}

/* IQ1_M's super-block scale: refitted over all sub-blocks at their rounded 3-bit scales l,
 * which go to sc[4] (3 bits each) with the shift bits to qh, as ggml's impl does. */
static float iq1_m_refit(const iq_lattice *g, moe_block_iq1_m *b, const float *xbl, const float *qw,
                         float sigma2, const float *scales, const int *shifts, float max_scale,
                         uint16_t sc[4]) {
    static const uint8_t masks[4] = {0x00, 0x80, 0x08, 0x88};
    float weight[16], d = max_scale / 15;
    const float id = 1 / d;
    float sumqx_f = 0, sumq2_f = 0;
    for (int ib = 0; ib < 16; ++ib) {
        const int l = odd_scale_index(id, scales[ib], 7);
        sc[ib / 4] |= (uint16_t)(l << 3 * (ib % 4));
        b->qh[ib] |= masks[shifts[ib]];
        const float *xb = xbl + 16 * ib;
        sub_block_weights(qw ? qw + 16 * ib : NULL, xb, 16, sigma2, false, weight, NULL);
        for (int k = 0; k < 2; ++k) {
            const float *xx = iq1_values(true, shifts[ib], k);
            const int e = b->qs[2 * ib + k] | ((b->qh[ib] << (8 - 4 * k)) & 0x700);
            const int8_t *pg = g->grid + e * 8;
            for (int j = 0; j < 8; ++j) {
                float w = weight[8 * k + j];
                float q = xx[(pg[j] - 1) / 2] * (2 * l + 1);
                sumqx_f += w * q * xb[8 * k + j];
                sumq2_f += w * q * q;
            }
        }
    }
    return sumq2_f > 0 ? sumqx_f / sumq2_f : d;
}

/* ggml's quantize_row_iq1_s_impl (8 sub-blocks of 32, a 3-bit scale and one delta sign each) and
 * quantize_row_iq1_m_impl (16 sub-blocks of 16, 3-bit scales, a delta sign per 8 values, the
 * fp16 super-block scale spread over the scale words' top nibbles). */
static void quantize_iq1(const float *x, void *y, int64_t n, const float *qw, bool is_m) {
    const iq_lattice *g = lattice_get(LAT_IQ1);
    const int sub = is_m ? 16 : 32, n_sub = MOE_QK_K / sub;
    float scales[16];
    int shifts[16];
    for (int64_t ibl = 0; ibl < n / MOE_QK_K; ++ibl) {
        const float *xbl = x + MOE_QK_K * ibl, *qwb = qw ? qw + MOE_QK_K * ibl : NULL;
        moe_block_iq1_s *bs = (moe_block_iq1_s *)y + ibl;
        moe_block_iq1_m *bm = (moe_block_iq1_m *)y + ibl;
        is_m ? memset(bm, 0, sizeof *bm) : memset(bs, 0, sizeof *bs);
        float max_scale = 0;
        const float sigma2 = 2 * moe_sum_sq(xbl, MOE_QK_K) / MOE_QK_K;
        for (int ib = 0; ib < n_sub; ++ib) {
            uint16_t index[4];
            scales[ib] = iq1_sub_block(g, is_m, xbl + sub * ib, qwb ? qwb + sub * ib : NULL, sigma2,
                                       index, &shifts[ib]);
            if (scales[ib] == 0) continue;
            if (is_m) {
                bm->qs[2 * ib + 0] = (uint8_t)(index[0] & 255);
                bm->qs[2 * ib + 1] = (uint8_t)(index[1] & 255);
                bm->qh[ib] = (uint8_t)((index[0] >> 8) | ((index[1] >> 8) << 4));
            } else {
                for (int k = 0; k < 4; ++k) {
                    bs->qs[4 * ib + k] = (uint8_t)(index[k] & 255);
                    bs->qh[ib] |= (uint16_t)((index[k] >> 8) << 3 * k);
                }
            }
            max_scale = scales[ib] > max_scale ? scales[ib] : max_scale;
        }
        if (!max_scale) continue;
        if (is_m) {
            uint16_t sc[4] = {0, 0, 0, 0};
            const float d = iq1_m_refit(g, bm, xbl, qwb, sigma2, scales, shifts, max_scale, sc);
            const uint16_t s = moe_f32_to_fp16(d * 1.1125f);
            sc[0] |= (uint16_t)((s & 0x000f) << 12);
            sc[1] |= (uint16_t)((s & 0x00f0) << 8);
            sc[2] |= (uint16_t)((s & 0x0f00) << 4);
            sc[3] |= (uint16_t)(s & 0xf000);
            for (int j = 0; j < 4; ++j) {
                bm->scales[2 * j] = (uint8_t)(sc[j] & 0xff);
                bm->scales[2 * j + 1] = (uint8_t)(sc[j] >> 8);
            }
        } else {
            const float d = max_scale / 15;
            bs->d = moe_f32_to_fp16(d * 1.125f);
            const float id = 1 / d;
            for (int ib = 0; ib < 8; ++ib) {
                int l = odd_scale_index(id, scales[ib], 7);
                if (shifts[ib] == -1) l |= 8;
                bs->qh[ib] |= (uint16_t)(l << 12);
            }
        }
    }
}

MOE_QUANTIZE_FN(iq1_s) {
    quantize_iq1(x, y, n, qw, false);
}

MOE_QUANTIZE_FN(iq1_m) {
    quantize_iq1(x, y, n, qw, true);
}
