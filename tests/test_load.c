/* Suite "load": a model read into anonymous memory costs its weights once, not twice. A
 * synthetic qwen3moe of ~250 MB is loaded as bench and serve load it (moe_model_load, then
 * moe_gguf_to_memory on two pool threads, 64 MiB reads, so several per thread); the peak
 * resident set it added (VmHWM after, less VmRSS before, with the high-water mark reset through
 * /proc/self/clear_refs) must stay within 10 % of its tensor bytes plus LOAD_SCRATCH, and every
 * tensor must hold the file's bytes. Measured in this process, not in a child: a child's
 * ru_maxrss carries the forking runner's resident set across exec, which would measure the
 * runner. The old path (memcpy from the mapping) peaked at twice the tensor bytes. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/model.h"

/* Resident bytes a load adds beside the weights: the header's mapped pages (the vocabulary),
 * the tensor directory, the binder's tables, the pool threads' stacks. Measured at ~3 MB for
 * this model; the allowance leaves room for allocator and kernel differences. */
#define LOAD_SCRATCH ((uint64_t)16 << 20)

/* "VmRSS:" or "VmHWM:" of this process, in bytes. */
static uint64_t status_bytes(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) fail_msg("cannot read /proc/self/status");
    char line[256];
    unsigned long long kb = 0;
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found =
            strncmp(line, key, strlen(key)) == 0 && sscanf(line + strlen(key), "%llu", &kb) == 1;
    fclose(f);
    if (!found) fail_msg("no %s in /proc/self/status", key);
    return (uint64_t)kb << 10;
}

static void load_peak_is_the_weights_once(void **state) {
    (void)state;
    const char *path =
        moe_test_synth("load.gguf", "--preset qwen3-30b-a3b --layers 1 --vocab 32000 "
                                    "--experts 64 --type '.*=Q4_K' --random-blocks");

    FILE *f = fopen("/proc/self/clear_refs", "w"); /* "5": VmHWM starts again from VmRSS */
    if (!f || fputs("5", f) < 0 || fclose(f) != 0) fail_msg("cannot reset the peak RSS");
    const uint64_t before = status_bytes("VmRSS:");
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    if (!m) fail_msg("%s", err.msg);
    moe_pool *pool = moe_pool_new(2);
    uint64_t read = 0;
    if (moe_gguf_to_memory(m->gguf, pool, &read, &err) != MOE_OK) fail_msg("%s", err.msg);
    const uint64_t peak = status_bytes("VmHWM:") - before;
    moe_pool_free(pool);

    const moe_gguf_shard *sh = moe_gguf_shard_get(m->gguf, 0);
    assert_true(read >= sh->tensor_bytes && read - sh->tensor_bytes <= sh->padding_bytes);
    assert_true(sh->tensor_bytes > (uint64_t)200 << 20); /* big enough that doubling shows */
    const uint64_t limit = (sh->tensor_bytes + LOAD_SCRATCH) / 10 * 11;
    print_message("[          ] tensors %.1f MB, load peak %.1f MB (limit %.1f MB)\n",
                  sh->tensor_bytes / 1e6, peak / 1e6, limit / 1e6);
    if (peak > limit)
        fail_msg("loading %.1f MB of tensors added %.1f MB at the peak, more than %.1f MB",
                 sh->tensor_bytes / 1e6, peak / 1e6, limit / 1e6);

    /* every byte read is the file's: compare with the file mapped again */
    moe_gguf *mapped = moe_gguf_open(path, &err);
    if (!mapped) fail_msg("%s", err.msg);
    assert_int_equal(moe_gguf_n_tensors(mapped), moe_gguf_n_tensors(m->gguf));
    for (uint64_t i = 0; i < moe_gguf_n_tensors(mapped); i++) {
        const moe_tensor *a = moe_gguf_tensor_get(mapped, i), *b = moe_gguf_tensor_get(m->gguf, i);
        assert_ptr_not_equal(a->data, b->data);
        if (memcmp(a->data, b->data, a->n_bytes) != 0)
            fail_msg("tensor '%s' differs from the file after the load", a->name.ptr);
    }
    moe_gguf_close(mapped);
    moe_model_free(m);
}

int moe_suite_load(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(load_peak_is_the_weights_once),
    };
    return cmocka_run_group_tests_name("load", tests, NULL, NULL);
}
