/* run.c: `moe run [MODEL] [-p PROMPT | --tokens IDS] [options]` -- generate and stream text,
 * then one stats line on stderr. Without a model, the built-in demo model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "generate.h"

typedef struct run_args {
    const char *prompt, *tokens;
} run_args;

static const moe_cli_option run_options[] = {
    {"--prompt", "-p", "TEXT", "the prompt (default: none, generation starts from BOS)",
     MOE_OPT_STRING, MOE_OPT_FIELD(run_args, prompt), 0, 0, NULL},
    {"--tokens", NULL, "ID,...", "the prompt as token ids (instead of -p)", MOE_OPT_STRING,
     MOE_OPT_FIELD(run_args, tokens), 0, 0, NULL},
};
#define N_RUN_OPTIONS (sizeof run_options / sizeof run_options[0])

void moe_cmd_run_options(FILE *out) {
    moe_gen_options d;
    moe_gen_options_default(&d);
    moe_cli_options_print(out, run_options, N_RUN_OPTIONS, NULL);
    moe_gen_print_options(out, &d);
}

int moe_cmd_run(int argc, char **argv) {
    moe_gen_options o;
    moe_gen_options_default(&o);
    run_args ra = {0};
    for (int i = 0; i < argc; i++) {
        int r = moe_gen_parse_option("run", &o, argc, argv, &i);
        if (!r) r = moe_cli_option_parse("run", run_options, N_RUN_OPTIONS, &ra, argc, argv, &i);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (argv[i][0] == '-' && argv[i][1])
            return moe_cli_unknown_option("run", argv[i]);
        else if (!o.model_path)
            o.model_path = argv[i];
        else
            return moe_cli_usage_error("run", "unexpected argument '%s'", argv[i]);
    }
    const char *prompt = ra.prompt, *tokens_arg = ra.tokens;
    if (prompt && tokens_arg) return moe_cli_usage_error("run", "give -p or --tokens, not both");
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (tokens_arg && !moe_arg_token_list("run", "--tokens", tokens_arg, &ids, &n_ids)) return 2;

    moe_gen g;
    if (!moe_engine_args_check("run", &o.engine)) return 2;
    if (!moe_gen_open(&g, &o, "run")) {
        free(ids);
        return 1;
    }
    moe_error err = {0};
    if (!tokens_arg) {
        const char *text = prompt ? prompt : "";
        moe_tokenizer_encode(g.tok, text, strlen(text),
                             MOE_ENCODE_ADD_SPECIAL | MOE_ENCODE_PARSE_SPECIAL, &ids, &n_ids, &err);
    }
    if (!err.code && n_ids == 0)
        moe_error_set(&err, MOE_ERR_ARG,
                      "the prompt is empty and this vocabulary adds no BOS: "
                      "give -p TEXT or --tokens IDS");
    if (!err.code) {
        if (o.print_ids) {
            for (size_t i = 0; i < n_ids; i++) printf(i ? ",%d" : "%d", ids[i]);
        } else if (prompt && prompt[0]) {
            fputs(prompt, stdout);
            g.text_started = true;
        }
        fflush(stdout);
    }
    int rc = 0;
    moe_gen_catch_interrupt(); /* Ctrl-C: stop generating, still print the stats */
    if (err.code || !moe_gen_prefill(&g, ids, n_ids, &err) ||
        !moe_gen_run(&g, o.n_predict, NULL, &err)) {
        fprintf(stderr, "\nmoe run: %s\n", err.msg);
        rc = 1;
    } else {
        printf("\n");
        fflush(stdout);
        if (g.interrupted) {
            fprintf(stderr, "[interrupted]");
            rc = 130; /* as a shell reports a process ended by SIGINT */
        }
        moe_gen_print_stats(&g);
    }
    free(ids);
    moe_gen_close(&g);
    return rc;
}
