/* testutil: what every test suite shares -- fixture paths in ../shared, file loading, temp dirs.
 *
 * Fixtures are used in place from ../shared (relative to the project root, where `make test`
 * runs). A suite whose fixtures are absent skips with a message, unless CI=true, where their
 * absence is a failure. Include after <cmocka.h>'s prerequisites via this header only. */
#ifndef MOE_TESTUTIL_H
#define MOE_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../src/base/base.h"

/* Path of a fixture under ../shared, or NULL when it is absent (then the calling test has
 * already been skipped, or failed under CI=true). The string is static per call site use. */
const char *moe_test_shared(const char *relpath);
/* Read a fixture whole; skips/fails like moe_test_shared. Caller frees. NULL when skipped. */
uint8_t *moe_test_shared_read(const char *relpath, size_t *size);
/* Path of a fetched fixture under build/fixtures (`make fixtures`), or NULL when it is absent;
 * skips or fails (CI=true) like moe_test_shared. */
const char *moe_test_fixture(const char *relpath);
/* A fresh empty directory for this process's scratch files (removed at exit). */
const char *moe_test_tmpdir(void);
/* Path of the built moe binary (MOE_BIN, default ./moe). */
const char *moe_test_bin(void);
/* Run a shell command, capturing stdout+stderr (caller frees *out); returns the exit status. */
int moe_test_run(const char *cmd, char **out);

#define MOE_SKIP_IF_NULL(p)                                                                        \
    do {                                                                                           \
        if (!(p)) {                                                                                \
            skip();                                                                                \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#endif
