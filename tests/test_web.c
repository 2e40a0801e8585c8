/* Suite "web": the chat page `moe serve` answers at / (src/serve/web/), in headless Chromium.
 *
 * tests/web_chat.mjs does the work (node, no npm packages: it speaks the DevTools protocol over
 * Chromium's --remote-debugging-pipe): it starts `moe serve` on stories260K written again with
 * ChatML's control tokens (moe_test_chat_model), checks the page's files as served, then loads
 * the page, types the key, sends a message, watches the streamed text grow, saves a screenshot
 * mid-stream into this run's tmpdir (its path printed; a copy stays as
 * build/web-chat-midstream.png), presses Stop and checks the server
 * cancelled (its metrics), reloads (the conversation comes back from localStorage), and renders
 * a canned stream with reasoning, code and a tool call. Without chromium or node the suite
 * skips with a message; under CI=true that is a failure. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool have(const char *tool) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null", tool);
    if (moe_test_run(cmd, NULL) == 0) return true;
    const char *ci = getenv("CI");
    if (ci && strcmp(ci, "true") == 0)
        fail_msg("%s is missing and CI=true: `make deps` installs it", tool);
    print_message("[  SKIP    ] %s is not installed: the chat page is not tried in a browser "
                  "(`make deps` installs it)\n",
                  tool);
    return false;
}

static void chat_page_in_chromium(void **state) {
    (void)state;
    if (!have("chromium") || !have("node")) {
        skip();
        return;
    }
    const char *model = moe_test_chat_model("web-chat", NULL);
    MOE_SKIP_IF_NULL(model);
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "timeout 150 node tests/web_chat.mjs --bin '%s' --model '%s' --tmp '%s' --keep "
             "build/web-chat-midstream.png",
             moe_test_bin(), model, moe_test_tmpdir());
    const int rc = moe_test_run(cmd, &out);
    print_message("%s", out);
    if (rc != 0 || !strstr(out, "web: ok\n")) fail_msg("tests/web_chat.mjs failed (exit %d)", rc);
    free(out);
}

int moe_suite_web(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(chat_page_in_chromium),
    };
    return cmocka_run_group_tests_name("web", tests, NULL, NULL);
}
