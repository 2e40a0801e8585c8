/* args: the subcommands' shared argument parsing: numbers with range checks, comma-separated
 * token id lists, the model path (or the built-in demo model), and the engine options every
 * command that runs a model takes (--ctx, -t / --threads, --kv-type), parsed here once. Each
 * reports its error naming the flag or the subcommand. */
#ifndef MOE_CLI_ARGS_H
#define MOE_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../src/engine/engine.h"
#include "../src/quant/quant.h"

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

/* A "REGEX=TYPE" rule (moe synth --type, moe quantize --rule): the pattern before the last '='
 * (malloc'd into *pattern) and a type name after it; false with a message naming `flag`. */
bool moe_arg_type_rule(const char *cmd, const char *flag, const char *text, char **pattern,
                       moe_type *type);

/* --kv-type's value: f32, f16 or q8_0. */
bool moe_arg_kv_type(const char *cmd, const char *text, moe_type *out);

/* --spec's value: ngram, mtp or none. */
bool moe_arg_spec(const char *cmd, const char *text, moe_spec_kind *out);

/* The engine options of run, chat, logits, serve and bench. The caller sets the defaults. */
typedef struct moe_engine_args {
    uint32_t n_ctx;              /* --ctx: positions per sequence (0: the model's, capped) */
    int n_threads;               /* -t, --threads */
    moe_type kv_type;            /* --kv-type: KV cache elements, F32, F16 or Q8_0 */
    uint64_t expert_cache_bytes; /* --expert-cache SIZE: routed experts read on demand into a
                                  * cache of this size (0: all resident) */
    const char *expert_stats;    /* --expert-stats FILE: the cache's use counts across runs */
    const char *pin_experts;     /* --pin-experts FILE: experts the cache always holds */
    moe_split split;             /* --split experts|rows: share the routed experts among the ranks
                                  * of an mpirun job (needs `make MPI=1`) */
    bool split_dense;            /* --split-dense: dense FFNs and shared experts split by rows */
    bool no_repack;              /* --no-repack: the matrices stay in the file's layout */
} moe_engine_args;

/* A byte size: a positive number with an optional binary unit K, M, G or T (KiB, GB, ...). */
bool moe_arg_size(const char *cmd, const char *flag, const char *text, uint64_t *out);

/* argv[*i] if it is one of them: 1 consumed (*i moved past its value), 0 not one of them, -1 a
 * usage error (reported). */
int moe_engine_args_parse(const char *cmd, moe_engine_args *a, int argc, char **argv, int *i);
/* After the model is loaded (and read into memory, if it is): its matrices repacked for the
 * active kernel table unless --no-repack (moe_model_repack; the routed experts kept as they are
 * under an expert cache or a split), and what was done printed; false after printing why not. */
bool moe_engine_args_repack(const char *cmd, moe_model *m, const moe_engine_args *a);
/* Their --help lines, defaults taken from `defaults`. */
void moe_engine_args_print(FILE *out, const moe_engine_args *defaults);

/* ==== Option tables: one row per flag, parsed and listed in --help from the same row ==== */

typedef enum moe_opt_kind {
    MOE_OPT_INT,     /* an integer in lo..hi, into a 1-, 4- or 8-byte field */
    MOE_OPT_FLOAT,   /* a number in lo..hi, into a float */
    MOE_OPT_SWITCH,  /* no value: the bool field becomes true */
    MOE_OPT_STRING,  /* the argument itself, into a const char * */
    MOE_OPT_CHOICE,  /* one of `choices`, its index into an int-sized field */
    MOE_OPT_SIZE,    /* moe_arg_size, into a uint64_t */
    MOE_OPT_KV_TYPE, /* moe_arg_kv_type (f32 | f16), into a moe_type */
    MOE_OPT_COUNT
} moe_opt_kind;

typedef struct moe_cli_option {
    const char *flag, *alias; /* "--threads", "-t" (alias may be NULL) */
    const char *value;        /* the value's name in --help ("N"); NULL for a switch */
    const char *help;         /* one line; a default is appended unless it says "default" */
    moe_opt_kind kind;
    size_t offset, size;        /* the field in the options struct (MOE_OPT_FIELD) */
    double lo, hi;              /* INT / FLOAT range */
    const char *const *choices; /* CHOICE: the names, NULL-terminated */
} moe_cli_option;

#define MOE_OPT_FIELD(type, field) offsetof(type, field), sizeof(((type *)0)->field)

/* argv[*i] if it is one of table's n flags: 1 consumed (stored into the struct at `base`, *i
 * moved past its value), 0 not one of them, -1 a usage error (reported). */
int moe_cli_option_parse(const char *cmd, const moe_cli_option *table, size_t n, void *base,
                         int argc, char **argv, int *i);
/* One --help line per option; the defaults read from the struct at `defaults` (may be NULL). */
void moe_cli_options_print(FILE *out, const moe_cli_option *table, size_t n, const void *defaults);
/* Once every flag is in: combinations that need another flag (reported; false). */
bool moe_engine_args_check(const char *cmd, const moe_engine_args *a);

/* A GBNF grammar file's text (malloc'd), checked to parse; NULL after printing why. */
char *moe_cli_read_grammar(const char *cmd, const char *path);

#endif
