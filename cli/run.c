/* run.c: `moe run [MODEL] [-p PROMPT | --tokens IDS] [options]` -- generate and stream text,
 * then one stats line on stderr. Without a model, the built-in demo model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "generate.h"

int moe_cmd_run(int argc, char **argv) {
    moe_gen_options o;
    moe_gen_options_default(&o);
    const char *prompt = NULL, *tokens_arg = NULL;
    for (int i = 0; i < argc; i++) {
        int r = moe_gen_parse_option("run", &o, argc, argv, &i);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (strcmp(argv[i], "-p") == 0 && i + 1 < argc)
            prompt = argv[++i];
        else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc)
            tokens_arg = argv[++i];
        else if (argv[i][0] == '-' && argv[i][1])
            return moe_cli_usage_error("run", "unknown option '%s'", argv[i]);
        else if (!o.model_path)
            o.model_path = argv[i];
        else
            return moe_cli_usage_error("run", "unexpected argument '%s'", argv[i]);
    }
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
    if (err.code || !moe_gen_prefill(&g, ids, n_ids, &err) ||
        !moe_gen_run(&g, o.n_predict, NULL, &err)) {
        fprintf(stderr, "\nmoe run: %s\n", err.msg);
        rc = 1;
    } else {
        printf("\n");
        moe_gen_print_stats(&g);
    }
    free(ids);
    moe_gen_close(&g);
    return rc;
}
