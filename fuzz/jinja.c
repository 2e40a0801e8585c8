/* fuzz/jinja.c: libFuzzer entry for the chat-template interpreter and the output parsers.
 *
 * The input is a template source, rendered against a fixed conversation with tools, tool calls
 * and reasoning; any error must come back as a status with a line and column, never a crash,
 * a leak, a hang past the interpreter's limits or a sanitizer report. The same bytes are then
 * fed to an output parser (format chosen by the first byte), whole and one byte at a time, and
 * the two results must agree. Build and run: `make fuzz-jinja`. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/chat/chat.h"

static const char messages[] =
    "[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":\"hi\"},"
    "{\"role\":\"assistant\",\"content\":\"\",\"reasoning_content\":\"r\",\"tool_calls\":[{\"id\":"
    "\"a1b2c3d4e\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{\"x\":1,"
    "\"y\":[true,null,2.5,\"s\"]}}}]},{\"role\":\"tool\",\"tool_call_id\":\"a1b2c3d4e\","
    "\"content\":\"ok\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"p\"}]}]";
static const char tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\",\"parameters\":"
    "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"},\"y\":{\"type\":"
    "\"array\"},\"z\":{\"type\":\"string\"}},\"required\":[\"x\"]}}}]";
static const char kwargs[] =
    "{\"add_generation_prompt\":true,\"bos_token\":\"<s>\",\"eos_token\":\"</s>\","
    "\"enable_thinking\":true}";

static void parse_output(const uint8_t *data, size_t size) {
    if (!size) return;
    moe_chat_parse_options o = {.format = (moe_chat_format)(data[0] % MOE_CHAT_FORMAT_COUNT),
                                .think_open = "<think>",
                                .think_close = "</think>",
                                .reasoning_open = data[0] & 0x80,
                                .tools_json = tools};
    moe_error err = {0};
    moe_chat_delta whole = {0}, bytes = {0};
    moe_chat_parser *p = moe_chat_parser_new(&o, &err);
    if (!p) abort();
    moe_chat_parser_feed(p, (const char *)data + 1, size - 1, &whole, &err);
    moe_chat_parser_finish(p, &whole, &err);
    moe_chat_parser_free(p);
    p = moe_chat_parser_new(&o, &err);
    for (size_t i = 1; i < size; i++)
        moe_chat_parser_feed(p, (const char *)data + i, 1, &bytes, &err);
    moe_chat_parser_finish(p, &bytes, &err);
    moe_chat_parser_free(p);
    if (whole.content_len != bytes.content_len || whole.reasoning_len != bytes.reasoning_len ||
        whole.n_calls != bytes.n_calls ||
        (whole.content_len && memcmp(whole.content, bytes.content, whole.content_len)) ||
        (whole.reasoning_len && memcmp(whole.reasoning, bytes.reasoning, whole.reasoning_len)))
        abort();
    for (size_t i = 0; i < whole.n_calls; i++)
        if (strcmp(whole.calls[i].name, bytes.calls[i].name) ||
            strcmp(whole.calls[i].arguments, bytes.calls[i].arguments))
            abort();
    moe_chat_delta_clear(&whole);
    moe_chat_delta_clear(&bytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    moe_error err = {0};
    moe_chat_template *t = moe_chat_template_parse((const char *)data, size, &err);
    if (t) {
        char *out = NULL;
        moe_chat_render(t, messages, tools, kwargs, &out, &err);
        free(out);
        moe_chat_template_free(t);
    } else if (!strstr(err.msg, "line ")) {
        abort(); /* syntax errors must say where */
    }
    if (size <= 4096) parse_output(data, size);
    return 0;
}
