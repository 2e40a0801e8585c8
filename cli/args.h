/* args: small shared helpers for the subcommands' argument parsing: numbers with range checks,
 * comma-separated token id lists, and the model path (or the built-in demo model). Each reports
 * its error naming the flag or the subcommand. */
#ifndef MOE_CLI_ARGS_H
#define MOE_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

bool moe_arg_int(const char *cmd, const char *flag, const char *text, long long min, long long max,
                 long long *out);
bool moe_arg_float(const char *cmd, const char *flag, const char *text, double min, double max,
                   double *out);
/* "1,2,3" -> ids (caller frees); false with a message on a bad or out-of-range id. */
bool moe_arg_token_list(const char *cmd, const char *flag, const char *text, int32_t **ids,
                        size_t *n);
/* The model a subcommand loads: `given`, or without one the built-in demo model (generated into
 * the cache on first use; a line on stderr says its weights are random). Malloc'd; NULL after
 * printing why the demo model could not be made. */
char *moe_arg_model_path(const char *cmd, const char *given);

#endif
