/* chat: conversations in and out of the model -- chat templates (moe's own Jinja2 interpreter),
 * the prompt tokens of a client's conversation, and the parsers of what a model writes back.
 *
 * A chat template is the model's own Jinja2 program (GGUF `tokenizer.chat_template`) that turns
 * OpenAI-style messages and tools into the prompt text; moe runs it with its own interpreter (a
 * Jinja2 subset that matches Python Jinja2 byte for byte as Hugging Face transformers configures
 * it). The output parsers split what a model writes back into reasoning, content and tool calls,
 * incrementally, so a server can stream. This folder uses text/ (tokenizers) and never the
 * reverse. A parsed template is immutable: any number of threads may render with it at once. The
 * trap: a template's output is exact -- whitespace, newlines, special-token strings -- and a
 * single byte of difference changes the tokens the model sees; compare renderings byte for byte,
 * never after trimming. */
#ifndef MOE_CHAT_H
#define MOE_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"
#include "../format/format.h"
#include "../text/text.h"

/* ==== Chat templates ==== */

#define MOE_CHAT_MAX_JSON_DEPTH 128 /* nesting of messages/tools JSON: each level is a C frame */

typedef struct moe_chat_template moe_chat_template;

/* Parse a template; syntax errors name the line and column. */
moe_chat_template *moe_chat_template_parse(const char *source, size_t len, moe_error *err);
moe_chat_template *moe_chat_template_load_file(const char *path, moe_error *err);
/* The model's own: `tokenizer.chat_template`, or `tokenizer.chat_template.<name>` (name may be
 * NULL). MOE_ERR_NOT_FOUND when the file carries none. */
moe_chat_template *moe_chat_template_from_gguf(const moe_gguf *g, const char *name, moe_error *err);
void moe_chat_template_free(moe_chat_template *t);
const char *moe_chat_template_source(const moe_chat_template *t);

/* Render the prompt. messages_json: an OpenAI-style array of messages (roles system, developer,
 * user, assistant, tool; content a string or a list of parts; assistant `tool_calls`, whose
 * `function.arguments` may be a JSON string -- it is decoded to an object, as templates expect;
 * `reasoning_content`). tools_json: an OpenAI-style tools array, or NULL (the template sees
 * `tools` = none). kwargs_json: an object whose members become template variables
 * (add_generation_prompt, bos_token, eos_token, enable_thinking, reasoning_effort, ...), or
 * NULL. `add_generation_prompt` defaults to false and `documents` is none, as in transformers.
 * strftime_now() reads the clock, or the environment's MOE_FIXED_DATE ("YYYY-MM-DD[THH:MM:SS]")
 * when set, so tests can agree with a reference. *out is malloc'd and NUL-terminated;
 * raise_exception() and every runtime error give MOE_ERR_FORMAT with the template line. */
moe_status moe_chat_render(const moe_chat_template *t, const char *messages_json,
                           const char *tools_json, const char *kwargs_json, char **out,
                           moe_error *err);
/* The same with the output's length: strings of the JSON may hold \u0000 (a NUL byte), which
 * reaches the output as it is. */
moe_status moe_chat_render_n(const moe_chat_template *t, const char *messages_json,
                             const char *tools_json, const char *kwargs_json, char **out,
                             size_t *out_len, moe_error *err);

/* The prompt of a conversation whose strings come from a client, as tokens. Renders like
 * moe_chat_render with `bos_token` / `eos_token` set to tok's (over any in kwargs), then
 * tokenizes with special-token parsing such that only the template's own markers become control
 * tokens: the text of a control token written inside any string of messages, tools or kwargs
 * (values and keys) is swapped for a private-use marker before rendering, put back afterwards,
 * and tokenized as plain text (moe_tokenizer_encode_spans). BOS is added when the tokenizer
 * asks for it and the prompt does not already begin with its text (templates that write
 * {{ bos_token }} get one BOS, not two). *text (when not NULL) receives the prompt exactly as
 * tokenized, and *text_len (when not NULL) its length (a NUL from a message may be inside);
 * *ids and *text are malloc'd. Errors as moe_chat_render. */
moe_status moe_chat_render_tokens(const moe_chat_template *t, const moe_tokenizer *tok,
                                  const char *messages_json, const char *tools_json,
                                  const char *kwargs_json, char **text, size_t *text_len,
                                  int32_t **ids, size_t *n_ids, moe_error *err);

/* The built-in template for a model that carries none: ChatML, with tools described and called
 * Hermes-style (<tools>, <tool_call>, <tool_response>). */
extern const char moe_chat_template_chatml[];

/* ==== Output parsers: reasoning and tool calls ==== */

typedef enum moe_chat_format {
    MOE_CHAT_FORMAT_HERMES,      /* <tool_call>{"name": .., "arguments": {..}}</tool_call> */
    MOE_CHAT_FORMAT_QWEN3_CODER, /* <tool_call><function=f><parameter=k>v</parameter>... */
    MOE_CHAT_FORMAT_GLM,         /* <tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>... */
    MOE_CHAT_FORMAT_MINIMAX_M2,  /* <minimax:tool_call><invoke name="f"><parameter name="k">v.. */
    MOE_CHAT_FORMAT_DEEPSEEK_V3, /* <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{..}\n```
                                  */
    MOE_CHAT_FORMAT_DEEPSEEK_V31, /* <｜tool▁call▁begin｜>f<｜tool▁sep｜>{..}<｜tool▁call▁end｜> */
    MOE_CHAT_FORMAT_DSML, /* DeepSeek V3.2/V4: <｜DSML｜invoke name="f"><｜DSML｜parameter.. */
    MOE_CHAT_FORMAT_KIMI_K2, /* <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{..} */
    MOE_CHAT_FORMAT_LLAMA3,  /* the whole reply {"name": .., "parameters": {..}} */
    MOE_CHAT_FORMAT_MISTRAL, /* [TOOL_CALLS][{"name": .., "arguments": ..}] or f[ARGS]{..} */
    MOE_CHAT_FORMAT_HARMONY, /* gpt-oss channels: analysis, commentary to=functions.f, final */
    MOE_CHAT_FORMAT_GEMMA4,  /* <|tool_call>call:f{k:v,..}<tool_call|>, strings in <|"|> */
    MOE_CHAT_FORMAT_COUNT
} moe_chat_format;

const char *moe_chat_format_name(moe_chat_format f);
/* By name ("hermes", "qwen3-coder", ...); false when unknown. */
bool moe_chat_format_from_name(const char *name, moe_chat_format *out);

typedef struct moe_chat_parse_options {
    moe_chat_format format;
    const char *think_open, *think_close; /* reasoning tags; NULL: the model has none */
    bool reasoning_open;    /* the prompt ends inside a reasoning block (e.g. "...<think>\n") */
    const char *tools_json; /* the request's tools: their schemas type the arguments; or NULL */
    bool no_tool_calls;     /* the request offered no tools: call markup stays content */
} moe_chat_parse_options;

/* What the template says: the tool-call format (unknown templates: Hermes), the reasoning tags,
 * and -- from the rendered prompt, when given -- whether the reply starts inside reasoning. */
void moe_chat_parse_options_detect(const char *template_source, const char *prompt,
                                   moe_chat_parse_options *out);

typedef struct moe_chat_tool_call {
    char *name;
    char *arguments; /* a JSON object, compact */
} moe_chat_tool_call;

/* One run of a delta, in the order the model wrote them: kind 'c' content, 'r' reasoning (len
 * bytes of the delta's text of that kind), or 't' one tool call (len 1). */
typedef struct moe_chat_delta_part {
    char kind;
    size_t len;
} moe_chat_delta_part;

/* What a feed produced: text is held back while it may still be the start of a tag, so the
 * concatenation of all deltas equals the parse of the whole text at once. `parts` says how
 * content, reasoning and calls interleave (a stream must send them in that order). */
typedef struct moe_chat_delta {
    char *content;
    size_t content_len;
    char *reasoning;
    size_t reasoning_len;
    moe_chat_tool_call *calls;
    size_t n_calls;
    moe_chat_delta_part *parts;
    size_t n_parts;
} moe_chat_delta;

typedef struct moe_chat_parser moe_chat_parser;

moe_chat_parser *moe_chat_parser_new(const moe_chat_parse_options *o, moe_error *err);
/* Append what `text` completes to *d (d may hold earlier deltas; clear it to get only new). */
moe_status moe_chat_parser_feed(moe_chat_parser *p, const char *text, size_t len, moe_chat_delta *d,
                                moe_error *err);
/* End of output: whatever was held back is settled (an unclosed tool call that parses counts). */
moe_status moe_chat_parser_finish(moe_chat_parser *p, moe_chat_delta *d, moe_error *err);
void moe_chat_parser_free(moe_chat_parser *p);
void moe_chat_delta_clear(moe_chat_delta *d);

/* ==== Grammars for structured output (grammar.c) ==== */

/* How a format writes one tool call: open, the name (a JSON string when name_json, else raw),
 * mid, the arguments, close. The arguments are one JSON object, or -- where key_open is set --
 * one entry per parameter in the schema's order: key_open KEY key_mid VALUE key_close, entries
 * separated by sep. A string-typed VALUE is then raw text between str_open and str_close (""
 * for the XML-ish formats), which never holds '<' followed by raw_stop (the formats' closing
 * tags begin "</", Gemma 4's string quote "<|"); key_mid_string, where set, replaces key_mid
 * before such a value (DSML's string="true"). Other values are JSON, or -- nested_json false
 * (Gemma 4, whose nested values have their own syntax) -- only scalars. */
typedef struct moe_chat_call_shape {
    const char *open, *mid, *close;
    bool name_json;
    const char *key_open, *key_mid, *key_mid_string, *key_close, *sep, *str_open, *str_close;
    char raw_stop;
    bool nested_json;
} moe_chat_call_shape;
bool moe_chat_call_shape_of(moe_chat_format f, moe_chat_call_shape *out);
/* The type a parameter's schema names ("string", "integer", ...): of a type list, "string" when
 * listed, else the first that is not "null"; NULL when it names none (enum, anyOf, ...). The
 * parsers decode a parameter written as text by it, and forced calls write it by it. */
struct json_t;
const char *moe_chat_schema_type(const struct json_t *schema);

/* GBNF text (malloc'd) whose root is `prefix` (GBNF, may be NULL) then a JSON value valid
 * against the schema (JSON text): objects (properties in order, required / optional), arrays
 * (items, minItems / maxItems), enum, const, strings (min/maxLength; pattern when we can
 * translate it, else any string), integers (minimum / maximum, exclusive too), numbers,
 * booleans, null, anyOf / oneOf, type lists, $ref to #, #/$defs/X, #/definitions/X. NULL with
 * err naming the schema path of what is not supported. "{\"type\": \"object\"}" is any object. */
char *moe_chat_schema_grammar(const char *schema_json, const char *prefix, moe_error *err);
/* GBNF text for one tool call in o's format, to one of the tools (OpenAI tools JSON) or only to
 * the one named `only`, with arguments valid against its parameters schema. MOE_ERR_NOT_FOUND
 * for an unknown name; MOE_ERR_UNSUPPORTED for a format without a call shape. */
char *moe_chat_tool_grammar(const moe_chat_parse_options *o, const char *tools_json,
                            const char *only, const char *prefix, moe_error *err);
/* The tokenizer's token trie for the engine's grammars: each token's output bytes (control
 * tokens none) and its end-of-generation flag. strip_first_space: the output is decoded with
 * MOE_DECODE_STRIP_PREFIX_SPACE from its first token (the server's replies), so SPM's dummy
 * prefix space of the first piece is not part of the text the grammar must match. */
struct moe_grammar_vocab;
struct moe_grammar_vocab *moe_chat_grammar_vocab(const moe_tokenizer *tok, bool strip_first_space);

#endif
