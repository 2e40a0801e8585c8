/* layout.c: the weight layouts a matrix may have in memory besides the file's, and the byte
 * moves between them (quant.h, "Weight layouts in memory").
 *
 * MOE_LAYOUT_ROWS16 interleaves 16 rows block by block so that a fast kernel finds the 16 rows'
 * values already where its register lanes want them (fast_avx512vnni.c: lane v = row v) and
 * never transposes. The bytes are the file's, moved: a group of 16 rows takes the space the
 * file's 16 rows take, so repacking costs no memory and a row group starts where it did. Plain
 * C and ISA-free: the loader packs with it and the tests read the layout back with it (unpack is
 * how the scalar reference reads a packed group). The trap: only whole groups are packed; a
 * matrix's last rows % 16 rows stay in the file's layout. */
#include "blocks.h"

#include <string.h>

/* Where a block's head lies in MOE_LAYOUT_ROWS16 (its float scales: *at, *bytes); false: the
 * type has no such layout. The rest of the block, before and after the head in that order, is
 * the body and must be whole dwords. The K quants' integer scales stay in the body, so a kernel
 * finds them already in the lanes: Q4_K / Q5_K's head is d and dmin, Q6_K's its d, at the end of
 * the block; IQ4_XS's head is d and its scales, the XXS types' their d (their grid indices, then
 * sign-and-scale words, are the body). */
_Static_assert(offsetof(moe_block_q8_0, qs) == 2 && offsetof(moe_block_q4_0, qs) == 2 &&
                   offsetof(moe_block_iq4_nl, qs) == 2 && offsetof(moe_block_iq3_xxs, qs) == 2 &&
                   offsetof(moe_block_iq2_xxs, qs) == 2 && offsetof(moe_block_iq3_s, qs) == 2,
               "these blocks are an f16 d, then the body");
static bool rows16_head(moe_type t, size_t *at, size_t *bytes) {
    *at = 0;
    switch (t) {
    case MOE_TYPE_Q8_0:
    case MOE_TYPE_Q4_0:
    case MOE_TYPE_IQ4_NL:
    case MOE_TYPE_IQ3_XXS:
    case MOE_TYPE_IQ2_XXS:
    case MOE_TYPE_IQ3_S:
        *bytes = sizeof(uint16_t); /* d */
        return true;
    case MOE_TYPE_MXFP4:
        *bytes = offsetof(moe_block_mxfp4, qs);
        return true;
    case MOE_TYPE_IQ4_XS: /* d, scales_h, scales_l */
        *bytes = offsetof(moe_block_iq4_xs, qs);
        return true;
    case MOE_TYPE_Q4_K:
        *bytes = offsetof(moe_block_q4_k, scales);
        return true;
    case MOE_TYPE_Q5_K:
        *bytes = offsetof(moe_block_q5_k, scales);
        return true;
    case MOE_TYPE_Q6_K:
        *at = offsetof(moe_block_q6_k, d);
        *bytes = sizeof(uint16_t);
        return true;
    default:
        *bytes = 0;
        return false;
    }
}

bool moe_layout_has_type(moe_layout layout, moe_type t) {
    size_t at, bytes;
    return layout == MOE_LAYOUT_FILE ||
           (layout == MOE_LAYOUT_ROWS16 && rows16_head(t, &at, &bytes));
}

/* One group both ways: pack (file rows -> group) or not (group -> file rows). */
static void rows16_move(moe_type t, const uint8_t *from, uint8_t *to, int64_t n, bool pack) {
    const moe_type_traits *tr = moe_type_traits_get(t);
    size_t at, head;
    MOE_CHECK(rows16_head(t, &at, &head));
    const size_t bb = tr->block_bytes, words = (bb - head) / 4;
    MOE_CHECK(at % 4 == 0 && (bb - head) % 4 == 0 && n % tr->block_values == 0);
    const int64_t nb = n / tr->block_values;
    const size_t row_bytes = (size_t)nb * bb;
    for (int64_t i = 0; i < nb; i++) {
        const size_t g = (size_t)i * MOE_ROWS16 * bb; /* the group's block i */
        for (int v = 0; v < MOE_ROWS16; v++) {
            const size_t f = (size_t)v * row_bytes + (size_t)i * bb; /* row v's block i */
            const size_t gh = g + (size_t)v * head;
            if (pack)
                memcpy(to + gh, from + f + at, head);
            else
                memcpy(to + f + at, from + gh, head);
            for (size_t k = 0; k < words; k++) {
                const size_t gw = g + MOE_ROWS16 * head + (k * MOE_ROWS16 + (size_t)v) * 4;
                const size_t fw = f + (4 * k < at ? 4 * k : 4 * k + head); /* around the head */
                if (pack)
                    memcpy(to + gw, from + fw, 4);
                else
                    memcpy(to + fw, from + gw, 4);
            }
        }
    }
}

void moe_layout_rows16_pack(moe_type t, const void *rows, void *group, int64_t n) {
    rows16_move(t, rows, group, n, true);
}

void moe_layout_rows16_unpack(moe_type t, const void *group, void *rows, int64_t n) {
    rows16_move(t, group, rows, n, false);
}

void moe_layout_pack_matrix(moe_layout layout, moe_type t, void *m, int64_t n_rows, int64_t n,
                            void *scratch) {
    MOE_CHECK(layout == MOE_LAYOUT_ROWS16);
    const size_t group_bytes = MOE_ROWS16 * moe_type_row_bytes(t, n);
    uint8_t *p = m;
    for (int64_t r = 0; r + MOE_ROWS16 <= n_rows; r += MOE_ROWS16, p += group_bytes) {
        memcpy(scratch, p, group_bytes);
        moe_layout_rows16_pack(t, scratch, p, n);
    }
}
