/* chat.c: `moe chat [MODEL]` -- an interactive loop on the terminal. Until chat templates land
 * (their own issue), turns are wrapped in plain ChatML markers; the conversation's tokens stay
 * in the KV cache, so each turn only prefills what it adds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "generate.h"

#define CHAT_LINE_MAX 65536 /* one typed turn */

int moe_cmd_chat(int argc, char **argv) {
    moe_gen_options o;
    moe_gen_options_default(&o);
    o.n_predict = -1;
    const char *system = NULL;
    for (int i = 0; i < argc; i++) {
        int r = moe_gen_parse_option("chat", &o, argc, argv, &i);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (strcmp(argv[i], "--system") == 0 && i + 1 < argc) system = argv[++i];
        else if (argv[i][0] == '-') return moe_cli_usage_error("chat", "unknown option '%s'", argv[i]);
        else if (!o.model_path) o.model_path = argv[i];
        else return moe_cli_usage_error("chat", "unexpected argument '%s'", argv[i]);
    }
    moe_gen g;
    if (!moe_gen_open(&g, &o, "chat")) return 1;
    fprintf(stderr, "moe chat: type a message and press enter; an empty line or end of input quits.\n");
    char *line = moe_xmalloc(CHAT_LINE_MAX);
    char *turn = moe_xmalloc(CHAT_LINE_MAX + 4096);
    moe_error err = {0};
    bool first = true;
    int rc = 0;
    for (;;) {
        fprintf(stderr, "> ");
        if (!fgets(line, CHAT_LINE_MAX, stdin)) break;
        line[strcspn(line, "\n")] = '\0';
        if (!line[0]) break;
        int len = snprintf(turn, CHAT_LINE_MAX + 4096, "%s%s%s%s<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
                           first && system ? "<|im_start|>system\n" : "", first && system ? system : "",
                           first && system ? "<|im_end|>\n" : "", first ? "" : "\n", line);
        int32_t *ids = NULL;
        size_t n = 0;
        unsigned flags = MOE_ENCODE_PARSE_SPECIAL | (first ? MOE_ENCODE_ADD_SPECIAL : 0);
        if (moe_tokenizer_encode(g.tok, turn, (size_t)len, flags, &ids, &n, &err) != MOE_OK ||
            !moe_gen_prefill(&g, ids, n, &err) || !moe_gen_run(&g, o.n_predict, "<|im_end|>", &err)) {
            free(ids);
            fprintf(stderr, "\nmoe chat: %s\n", err.msg);
            rc = 1;
            break;
        }
        free(ids);
        printf("\n");
        first = false;
    }
    moe_gen_print_stats(&g);
    free(line);
    free(turn);
    moe_gen_close(&g);
    return rc;
}
