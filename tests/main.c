/* tests/run: one runner, suites by name (`tests/run --suite quant`, `tests/run --list`); `--test
 * PATTERN` runs only the tests whose names match (cmocka's filter: * and ? wildcards).
 *
 * Each tests/test_<suite>.c defines moe_suite_<suite>() returning cmocka's failure count; the
 * table comes from the Makefile. Exit status is non-zero when any suite failed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "suites.h"

int main(int argc, char **argv) {
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--suite") == 0 && i + 1 < argc) {
            only = argv[++i];
        } else if (strcmp(argv[i], "--test") == 0 && i + 1 < argc) {
            cmocka_set_test_filter(argv[++i]);
        } else if (strcmp(argv[i], "--list") == 0) {
            for (size_t s = 0; s < sizeof moe_suites / sizeof moe_suites[0]; s++)
                printf("%s\n", moe_suites[s].name);
            return 0;
        } else {
            fprintf(stderr, "usage: %s [--suite NAME] [--test PATTERN] [--list]\n", argv[0]);
            return 2;
        }
    }
    int failed = 0, ran = 0;
    for (size_t s = 0; s < sizeof moe_suites / sizeof moe_suites[0]; s++) {
        if (only && strcmp(only, moe_suites[s].name) != 0) continue;
        ran++;
        failed += moe_suites[s].run() != 0;
    }
    if (only && !ran) {
        fprintf(stderr, "no suite named '%s' (try --list)\n", only);
        return 2;
    }
    printf("suites: %d passed, %d failed\n", ran - failed, failed);
    return failed ? 1 : 0;
}
