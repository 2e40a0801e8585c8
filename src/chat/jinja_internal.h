/* jinja_internal: the Jinja2-subset interpreter's shared internals (lexer, parser, values, eval).
 *
 * A template is lexed and parsed once into an AST that lives in the template's arena; each
 * render evaluates the AST against a context in a fresh arena that is freed whole at the end,
 * so values never need freeing one by one (lists and dicts are shared by reference, as in
 * Python). Errors anywhere below the entry points longjmp back to them with the message already
 * in the moe_error, so no evaluator function checks return codes. The semantics copied are those
 * of Python Jinja2 3.x as Hugging Face transformers configures it: ImmutableSandboxedEnvironment,
 * trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`, and its own `tojson`.
 * The trap: strings are UTF-8 bytes but Python counts characters -- length, indexing and slicing
 * go through the code-point helpers here, never through byte offsets. */
#ifndef MOE_JINJA_INTERNAL_H
#define MOE_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

/* ==== Limits (each a defence against a hostile template or request) ==== */

#define JINJA_MAX_SOURCE     (1u << 24)        /* 16 MiB of template text; real ones are < 64 KiB */
#define JINJA_MAX_NEST       128               /* parser nesting: each level costs C stack frames */
#define JINJA_MAX_CALL_DEPTH 96                /* macro recursion: Python stops near 1000 frames */
#define JINJA_MAX_OUTPUT     (64u << 20)       /* rendered bytes: prompts are MBs at most */
#define JINJA_MAX_ITERATIONS 4000000u          /* loop iterations per render, all loops together */
#define JINJA_MAX_MEMORY     ((size_t)1 << 30) /* arena bytes per render (string building in loops) */
#define JINJA_MAX_RANGE      1000000           /* elements range() may create */

/* ==== Arena ==== */

typedef struct jinja_chunk jinja_chunk;
typedef struct jinja_arena {
    jinja_chunk *head;
    size_t total; /* bytes allocated from malloc so far */
    size_t limit;
} jinja_arena;

typedef struct jinja_ctx jinja_ctx;

/* ==== Values ==== */

typedef enum jinja_kind {
    JV_UNDEF = 0, /* Jinja's Undefined: prints as "", fails on attribute access and arithmetic */
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,   /* also tuples (list.tuple) */
    JV_DICT,   /* also namespace() objects (dict.ns) */
    JV_MACRO,  /* a {% macro %} or a caller() */
    JV_FUNC,   /* a builtin global: range, namespace, raise_exception, ... */
    JV_METHOD, /* a bound method: "abc".upper, d.items, loop.cycle */
    JV_LOOP,   /* the `loop` object of a for loop */
    JV_KIND_COUNT
} jinja_kind;

typedef struct jinja_str {
    size_t len;  /* bytes, without the NUL */
    char data[]; /* UTF-8, NUL-terminated */
} jinja_str;

typedef struct jinja_value jinja_value;
typedef struct jinja_list jinja_list;
typedef struct jinja_dict jinja_dict;
typedef struct jinja_macro jinja_macro;
typedef struct jinja_method jinja_method;
typedef struct jinja_loop jinja_loop;
typedef struct jinja_func jinja_func;

struct jinja_value {
    uint8_t kind;
    uint8_t safe; /* JV_STR: a markupsafe Markup (from |safe): `+` escapes the other side */
    union {
        bool b;
        int64_t i;
        double f;
        jinja_str *s; /* JV_STR; JV_UNDEF: the hint for the error message (may be NULL) */
        jinja_list *l;
        jinja_dict *d;
        jinja_macro *m;
        const jinja_func *fn;
        jinja_method *bm;
        jinja_loop *loop;
    };
};

struct jinja_list {
    size_t n, cap;
    jinja_value *items;
    bool tuple;       /* prints as (a, b) */
    uint8_t lazy;     /* JL_ITER: a generator (map, select, ...); JL_VIEW: dict.items() & co. */
    bool consumed;    /* JL_ITER: iterated once already, empty from now on */
    const char *view; /* JL_VIEW: "dict_items", "dict_keys" or "dict_values" */
};

/* Python's lazy sequences differ where templates notice: a generator has no len(), no
 * indexing, no JSON form, is always true, and can be iterated once; a dict view has a len()
 * and truth but no indexing or JSON form. */
enum { JL_LIST = 0, JL_ITER = 1, JL_VIEW = 2 };

struct jinja_dict {
    size_t n, cap;
    jinja_value *keys; /* insertion order; keys compare with Python equality */
    jinja_value *vals;
    bool ns; /* a namespace(): attributes may be assigned with {% set ns.x = ... %} */
};

typedef struct jinja_builtin jinja_builtin; /* a row of the evaluator's builtin tables */
struct jinja_method {
    jinja_value self;
    const jinja_builtin *def;
};

/* ==== Small helpers over values ==== */

static inline jinja_value jv_undef(void) {
    return (jinja_value){.kind = JV_UNDEF};
}
static inline jinja_value jv_none(void) {
    return (jinja_value){.kind = JV_NONE};
}
static inline jinja_value jv_bool(bool b) {
    return (jinja_value){.kind = JV_BOOL, .b = b};
}
static inline jinja_value jv_int(int64_t i) {
    return (jinja_value){.kind = JV_INT, .i = i};
}
static inline jinja_value jv_float(double f) {
    return (jinja_value){.kind = JV_FLOAT, .f = f};
}

/* A base moe_strbuf that grows inside the render arena: nothing to free, and an error's longjmp
 * leaks nothing. (The lexer builds string literals the same way in the template arena.) */
moe_strbuf jinja_strbuf(jinja_ctx *c);

/* ==== AST ==== */

typedef enum jinja_node_kind {
    /* expressions */
    JN_CONST,  /* value */
    JN_NAME,   /* name */
    JN_LIST,   /* kids */
    JN_TUPLE,  /* kids */
    JN_DICT,   /* kids: key, value, key, value ... */
    JN_ATTR,   /* a.name */
    JN_ITEM,   /* a[b] */
    JN_SLICE,  /* a[b:c:d]: kids[0..3], missing parts NULL */
    JN_CALL,   /* a(args): kids args, kwnames for keyword ones */
    JN_FILTER, /* a|name(args); a is NULL in a {% filter %} block */
    JN_TEST,   /* a is name(args) */
    JN_UNARY,  /* op a: not, -, + */
    JN_BINARY, /* a op b */
    JN_AND,
    JN_OR,
    JN_COND,   /* b if a else c: a=test, b=then, c=else (may be NULL) */
    JN_CONCAT, /* a ~ b */
    /* statements */
    JN_BODY,         /* kids: statements in order */
    JN_DATA,         /* literal text */
    JN_OUTPUT,       /* {{ a }} */
    JN_IF,           /* a = test, b = then body, c = else (an IF for elif, or a body) */
    JN_FOR,          /* target a, iter b, body c, else d, filter e; op 1: recursive */
    JN_SET,          /* target a, value b */
    JN_SET_BLOCK,    /* target a, body b, filter c */
    JN_MACRO,        /* name, params: kids (names), defaults: kwnames-parallel in defaults[] */
    JN_CALL_BLOCK,   /* call a (JN_CALL), caller macro m */
    JN_FILTER_BLOCK, /* filter chain a (innermost a == NULL), body b */
    JN_BREAK,
    JN_CONTINUE,
    JN_NODE_KIND_COUNT
} jinja_node_kind;

typedef enum jinja_op {
    JOP_NONE,
    JOP_ADD,
    JOP_SUB,
    JOP_MUL,
    JOP_DIV,
    JOP_FLOORDIV,
    JOP_MOD,
    JOP_POW,
    JOP_EQ,
    JOP_NE,
    JOP_LT,
    JOP_LE,
    JOP_GT,
    JOP_GE,
    JOP_IN,
    JOP_NOTIN,
    JOP_NOT,
    JOP_NEG,
    JOP_POS,
} jinja_op;

typedef struct jinja_node jinja_node;
struct jinja_node {
    uint8_t kind;
    uint8_t op; /* jinja_op for unary/binary; negate for tests */
    uint32_t line, col;
    jinja_node *a, *b, *c, *d, *e;
    jinja_node **kids;
    const char **kwnames; /* parallel to kids for JN_CALL/FILTER/TEST args: NULL = positional */
    size_t n_kids;
    const char *name;  /* NAME, ATTR, FILTER, TEST, MACRO */
    jinja_value value; /* CONST; DATA text in value.s */
    struct jinja_macro_def *macro;
    const jinja_builtin *builtin; /* FILTER, TEST: the row the name resolved to, or NULL */
};

typedef struct jinja_macro_def {
    const char *name;
    size_t n_params;
    const char **params;
    jinja_node **defaults; /* NULL where a parameter has none */
    jinja_node *body;
    bool uses_caller, uses_varargs, uses_kwargs;
} jinja_macro_def;

typedef struct jinja_template {
    jinja_arena arena;
    jinja_node *root;
} jinja_template;

/* ==== Errors: record and jump back to the entry point ==== */

typedef struct jinja_jump {
    jmp_buf env;
    moe_error *err;
} jinja_jump;

_Noreturn void jinja_fail(jinja_jump *j, uint32_t line, uint32_t col, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ==== Arena ==== */

void jinja_arena_init(jinja_arena *a, size_t limit);
void jinja_arena_free(jinja_arena *a);
/* NULL when the arena's limit would be passed (callers turn that into an error). */
void *jinja_arena_alloc(jinja_arena *a, size_t n);

/* ==== Lexer and parser ==== */

/* Parse source into t (arena already initialised); false with err set on a syntax error. */
bool jinja_parse(jinja_template *t, const char *src, size_t len, moe_error *err);

/* ==== Values (jinja_value.c); every allocation goes through the render context ==== */

struct jinja_ctx {
    jinja_arena *arena;
    jinja_jump *jump;
    uint32_t line, col; /* of the node being evaluated, for messages */
};

_Noreturn void jinja_raise(jinja_ctx *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void *jinja_alloc(jinja_ctx *c, size_t n);
jinja_value jv_str(jinja_ctx *c, const char *s, size_t n);
jinja_value jv_cstr(jinja_ctx *c, const char *s);
jinja_value jv_str_buf(jinja_ctx *c, moe_strbuf *b); /* copies and frees the buffer */
jinja_value jv_list(jinja_ctx *c, size_t cap);
jinja_value jv_dict(jinja_ctx *c, size_t cap);
void jv_list_push(jinja_ctx *c, jinja_list *l, jinja_value v);
/* Set (replace in place or append); get returns false when absent. */
void jv_dict_set(jinja_ctx *c, jinja_dict *d, jinja_value key, jinja_value v);
bool jv_dict_get(const jinja_dict *d, jinja_value key, jinja_value *out);
bool jv_dict_get_str(const jinja_dict *d, const char *key, jinja_value *out);

bool jv_truthy(jinja_value v);
bool jv_is_num(jinja_value v); /* int, float, bool (Python's numbers) */
double jv_as_double(jinja_value v);
bool jv_equal(jinja_value a, jinja_value b); /* Python == */
/* Python < for sortable pairs; raises on types Python cannot order. */
int jv_compare(jinja_ctx *c, jinja_value a, jinja_value b);
const char *jv_type_name(jinja_value v);

/* str(v) and repr(v) as Python prints them, appended to b. */
void jv_to_str(jinja_ctx *c, moe_strbuf *b, jinja_value v);
void jv_to_repr(jinja_ctx *c, moe_strbuf *b, jinja_value v);
jinja_value jv_stringify(jinja_ctx *c, jinja_value v); /* str(v) as a value (a str stays) */
/* Python's repr(float): shortest round-trip digits, 'e' form outside 1e-4 .. 1e16. */
void jinja_format_float(moe_strbuf *b, double f);
/* json.dumps(v, ensure_ascii, indent (NULL/"" string or count), separators, sort_keys) */
typedef struct jinja_json_opts {
    bool ensure_ascii;
    bool sort_keys;
    const char *indent; /* NULL: no newlines */
    const char *item_sep, *key_sep;
} jinja_json_opts;
void jv_to_json(jinja_ctx *c, moe_strbuf *b, jinja_value v, const jinja_json_opts *o, int depth);

/* UTF-8 as code points. */
size_t jinja_utf8_count(const char *s, size_t n);
/* Byte offset of code point index i (i <= count). */
size_t jinja_utf8_offset(const char *s, size_t n, size_t i);
/* Decode one code point at s[*pos], advancing; invalid bytes decode as themselves. */
uint32_t jinja_utf8_next(const char *s, size_t n, size_t *pos);
void jinja_utf8_put(moe_strbuf *b, uint32_t cp);
bool jinja_py_space(uint32_t cp); /* str.isspace() */

/* ==== Evaluation (jinja_eval.c) ==== */

typedef struct jinja_render_opts {
    const char *fixed_now; /* "YYYY-MM-DD[THH:MM:SS]" for strftime_now, or NULL for the clock */
} jinja_render_opts;

/* Render with `vars` (a dict of globals); *out is malloc'd and NUL-terminated. The context's
 * values must have been made in `arena`, which the caller frees after the call. */
bool jinja_render(const jinja_template *t, jinja_arena *arena, jinja_jump *jump, jinja_dict *vars,
                  const jinja_render_opts *opts, char **out, size_t *out_len, moe_error *err);

/* The filter and test rows by name, or NULL for names Jinja2 does not know (a compile error
 * outside an `if`). The parser resolves every filter and test node once. */
const jinja_builtin *jinja_filter_find(const char *name);
const jinja_builtin *jinja_test_find(const char *name);

#endif
