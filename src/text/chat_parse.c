#include "text.h"
const char *moe_chat_format_name(moe_chat_format f) { (void)f; return "hermes"; }
bool moe_chat_format_from_name(const char *name, moe_chat_format *out) { (void)name; *out = 0; return true; }
void moe_chat_parse_options_detect(const char *s, const char *p, moe_chat_parse_options *o) { (void)s; (void)p; *o = (moe_chat_parse_options){0}; }
moe_chat_parser *moe_chat_parser_new(const moe_chat_parse_options *o, moe_error *err) { (void)o; moe_error_set(err, MOE_ERR_UNSUPPORTED, "x"); return NULL; }
moe_status moe_chat_parser_feed(moe_chat_parser *p, const char *t, size_t l, moe_chat_delta *d, moe_error *err) { (void)p; (void)t; (void)l; (void)d; (void)err; return MOE_OK; }
moe_status moe_chat_parser_finish(moe_chat_parser *p, moe_chat_delta *d, moe_error *err) { (void)p; (void)d; (void)err; return MOE_OK; }
void moe_chat_parser_free(moe_chat_parser *p) { (void)p; }
void moe_chat_delta_clear(moe_chat_delta *d) { (void)d; }
