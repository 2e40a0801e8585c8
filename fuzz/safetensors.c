/* fuzz/safetensors.c: libFuzzer target for the safetensors reader (`make fuzz-safetensors`).
 *
 * Parses the input as a whole file with moe_st_parse() and walks everything it returns -- every
 * metadata pair, every tensor's name, shape and the first and last byte of its data, and the
 * f32 conversion of its first and last value -- so ASan sees any pointer that leaves the input.
 * Checks the reader's promises: errors are one line; tensors tile the data section exactly
 * (header + tensor bytes == file size); every name is found by lookup. A crash found becomes a
 * file under tests/data/safetensors/, which the safetensors suite replays. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/format/format.h"

static volatile uint64_t sink; /* keeps the walk from being optimised away */

static void touch(const void *p, uint64_t n) {
    const uint8_t *b = p;
    if (n) sink += b[0] + b[n - 1];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    moe_error err = {0};
    moe_st *s = moe_st_parse(data, size, "fuzz", &err);
    if (!s) {
        if (err.code == MOE_OK || strchr(err.msg, '\n')) abort(); /* errors are one line */
        return 0;
    }
    const moe_st_file *f = moe_st_file_get(s, 0);
    if (f->header_bytes + f->tensor_bytes != f->file_size || f->file_size != size) abort();
    for (size_t i = 0; i < moe_st_n_meta(s); i++)
        sink += strlen(moe_st_meta_key(s, i)) + strlen(moe_st_meta_value(s, i));
    uint64_t bytes = 0;
    for (uint64_t i = 0; i < moe_st_n_tensors(s); i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        sink += strlen(t->name);
        if (t->file_offset + t->n_bytes > size || t->data != data + t->file_offset) abort();
        touch(t->data, t->n_bytes);
        for (uint32_t d = 0; d < t->n_dims; d++) sink += (uint64_t)t->shape[d];
        if (t->n_values) {
            float v[2];
            if (moe_st_to_f32(t, 0, 1, v, &err) != MOE_OK ||
                moe_st_to_f32(t, t->n_values - 1, 1, v + 1, &err) != MOE_OK)
                abort();
            sink += (uint64_t)(v[0] == v[1]);
        }
        bytes += t->n_bytes;
        if (moe_st_tensor_find(s, t->name) != t) abort();
    }
    if (bytes != f->tensor_bytes) abort();
    moe_st_close(s);
    return 0;
}
