/* fuzz/gguf.c: libFuzzer target for the GGUF reader (`make fuzz`, FUZZ_SECONDS=600).
 *
 * Parses the input as a whole file with moe_gguf_parse() and walks everything it returns --
 * every key, every (nested) array element, every string byte, every tensor and the first and
 * last byte of its data -- so ASan sees any pointer the reader hands out that leaves the input.
 * The trap: the walk must only touch what the API promises is valid (e.g. arr.data of length
 * arr.n elements), or a crash here is a bug in the fuzzer, not in the reader. A crash found
 * becomes a file under tests/data/gguf/, which the gguf suite replays. */
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

static void walk_value(const moe_gguf_value *v) {
    if (v->type == MOE_GGUF_STRING) {
        touch(v->s.ptr, v->s.len + 1); /* the NUL is promised too */
    } else if (v->type == MOE_GGUF_ARRAY) {
        sink += v->arr.n;
        if (v->arr.elem_type == MOE_GGUF_STRING) {
            const moe_str *s = v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) touch(s[i].ptr, s[i].len + 1);
        } else if (v->arr.elem_type == MOE_GGUF_ARRAY) {
            const moe_gguf_value *a = v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) walk_value(&a[i]);
        } else {
            touch(v->arr.data, v->arr.n * moe_gguf_vtype_size(v->arr.elem_type));
        }
    } else {
        sink += v->u;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_parse(data, size, true, &err);
    if (!g) {
        if (err.code == MOE_OK || strchr(err.msg, '\n')) abort(); /* errors are one line */
        return 0;
    }
    sink += moe_gguf_alignment(g) + moe_gguf_n_shards(g);
    const moe_gguf_shard *sh = moe_gguf_shard_get(g, 0);
    if (sh->header_bytes + sh->tensor_bytes + sh->padding_bytes != sh->file_size) abort();
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        touch(kv->key.ptr, kv->key.len + 1);
        walk_value(&kv->value);
        if (moe_gguf_find(g, kv->key.ptr) == NULL && strlen(kv->key.ptr) == kv->key.len) abort();
        uint64_t u;
        int64_t s;
        double f;
        bool b;
        sink += moe_gguf_get_u64(g, kv->key.ptr, &u) + moe_gguf_get_i64(g, kv->key.ptr, &s) +
                moe_gguf_get_f64(g, kv->key.ptr, &f) + moe_gguf_get_bool(g, kv->key.ptr, &b) +
                (moe_gguf_get_str(g, kv->key.ptr) != NULL);
    }
    uint64_t bytes = 0;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        touch(t->name.ptr, t->name.len + 1);
        if (!t->data || t->file_offset + t->n_bytes > size) abort();
        touch(t->data, t->n_bytes);
        bytes += t->n_bytes;
        if (strlen(t->name.ptr) == t->name.len && !moe_gguf_tensor_find(g, t->name.ptr)) abort();
    }
    if (bytes != sh->tensor_bytes) abort();
    moe_gguf_close(g);
    return 0;
}
