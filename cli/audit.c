#include "cli.h"
int moe_cmd_audit(int argc, char **argv) { (void)argc; (void)argv; return 2; }
