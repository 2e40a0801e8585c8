/* cli: the `moe` command's subcommands. Each takes argc/argv after the subcommand name and
 * returns the process exit status (0 ok, 1 failure, 2 usage error). Argument parsing and
 * printing live here; the work itself lives in the library layers. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

typedef struct moe_command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary; /* one line for `moe --help` */
    const char *usage;   /* the argument synopsis */
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

int moe_cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
