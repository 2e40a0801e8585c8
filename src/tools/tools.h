/* tools: the commands' work that sits on top of the library layers -- inspection, the demo
 * model, and (later) budget, audit, repack, bench, eval and synth. */
#ifndef MOE_TOOLS_H
#define MOE_TOOLS_H

#include "../format/format.h"

/* ==== Demo model ==== */

/* Path of the built-in demo model, generating it into the cache directory
 * ($XDG_CACHE_HOME/moe, else ~/.cache/moe) on first use. Caller frees. Its weights are random
 * (seeded, so every machine gets the same file): it exercises the engine, it does not talk. */
char *moe_demo_model_path(moe_error *err);
/* Write the demo model to `path` (what moe_demo_model_path does on a cache miss). */
moe_status moe_demo_model_write(const char *path, moe_error *err);

#endif
