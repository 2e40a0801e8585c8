/* format_internal.h: what the files of format/ share and nothing outside it may call. */
#ifndef MOE_FORMAT_INTERNAL_H
#define MOE_FORMAT_INTERNAL_H

#include "format.h"

/* Give a one-shard model parsed from a header alone (tensor data NULL) a data section of `bytes`
 * in anonymous memory that the model owns (freed by moe_gguf_close), and point every tensor at
 * its offset there. Returns the section for the caller to fill before anyone reads it; NULL with
 * err set when the memory cannot be had or a tensor lies outside `bytes`. */
uint8_t *moe_gguf_alloc_data(moe_gguf *g, uint64_t bytes, moe_error *err);

#endif
