/* cli: the `moe` command's subcommands. Each takes argc/argv after the subcommand name and
 * returns the process exit status (0 ok, 1 failure, 2 usage error). Argument parsing and
 * printing live here; the work itself lives in the library layers. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include <stdio.h>

typedef struct moe_command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;        /* one line for `moe --help` */
    const char *usage;          /* the argument synopsis */
    void (*options)(FILE *out); /* --help's option lines, from the command's option table (NULL:
                                 * the synopsis names them all) */
} moe_command;

int moe_cmd_run(int argc, char **argv);
int moe_cmd_chat(int argc, char **argv);
int moe_cmd_logits(int argc, char **argv);
int moe_cmd_inspect(int argc, char **argv);
int moe_cmd_dump(int argc, char **argv);
int moe_cmd_budget(int argc, char **argv);
int moe_cmd_audit(int argc, char **argv);
int moe_cmd_synth(int argc, char **argv);
int moe_cmd_quantize(int argc, char **argv);
int moe_cmd_imatrix(int argc, char **argv);
int moe_cmd_template(int argc, char **argv);
int moe_cmd_serve(int argc, char **argv);
int moe_cmd_bench(int argc, char **argv);
int moe_cmd_repack(int argc, char **argv);
int moe_cmd_eval(int argc, char **argv);

void moe_cmd_run_options(FILE *out);
void moe_cmd_chat_options(FILE *out);
void moe_cmd_serve_options(FILE *out);
void moe_cmd_bench_options(FILE *out);

int moe_cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* "unknown option 'ARG'" with the nearest option of cmd's synopsis and option lines ("did you
 * mean"), then the usage; returns 2. `cmd` may name a subcommand after the command ("eval kl"). */
int moe_cli_unknown_option(const char *cmd, const char *arg);
/* The candidate nearest to word by edit distance, or NULL when none is near enough to be a
 * likely typo (at most a third of the word's length, at least 2, edits away; none for a one-letter
 * flag). */
const char *moe_cli_nearest(const char *word, const char *const *candidates, size_t n);

#endif
