/* web.c: the chat page `moe serve` answers at / -- index.html, chat.js and chat.css from
 * src/serve/web/, embedded in the binary by the assembler's .incbin (no build step, no copy of
 * the files to keep in step) and served with their Content-Type and a Content-Security-Policy
 * that lets the page talk to this server only. The page itself is plain HTML/CSS/JS that uses
 * the OpenAI chat completions API like any other client; it needs no key to load (the user types
 * the key into it). The trap: .incbin paths are relative to the directory the compiler runs in
 * (the project root, as the Makefile does), and the Makefile names the files as this object's
 * prerequisites, since the compiler's dependency output does not see them. */
#include "serve_internal.h"

#include <string.h>

/* ==== The embedded files ==== */

#define WEB_EMBED(sym, file)                                                                       \
    __asm__(".pushsection .rodata\n"                                                               \
            ".balign 16\n" #sym "_start:\n"                                                        \
            ".incbin \"" file "\"\n" #sym "_end:\n"                                                \
            ".byte 0\n"                                                                            \
            ".popsection\n");                                                                      \
    extern const char sym##_start[], sym##_end[]

WEB_EMBED(web_index_html, "src/serve/web/index.html");
WEB_EMBED(web_chat_js, "src/serve/web/chat.js");
WEB_EMBED(web_chat_css, "src/serve/web/chat.css");

typedef struct web_asset {
    const char *path, *content_type;
    const char *start, *end;
} web_asset;

/* The page may load its own script and style and talk to this origin; nothing else (no inline
 * script, no other hosts, no framing). */
#define WEB_CSP                                                                                    \
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "                \
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

void serve_web_asset(serve_http *h) {
    const web_asset assets[] = {
        {"/", "text/html; charset=utf-8", web_index_html_start, web_index_html_end},
        {"/chat.js", "text/javascript; charset=utf-8", web_chat_js_start, web_chat_js_end},
        {"/chat.css", "text/css; charset=utf-8", web_chat_css_start, web_chat_css_end},
    };
    static const char *const headers[] = {"Content-Security-Policy",
                                          WEB_CSP,
                                          "X-Content-Type-Options",
                                          "nosniff",
                                          "Referrer-Policy",
                                          "no-referrer",
                                          "Cache-Control",
                                          "no-cache",
                                          NULL};
    for (size_t i = 0; i < sizeof assets / sizeof assets[0]; i++) {
        if (strcmp(h->path, assets[i].path) != 0) continue;
        h->extra_headers = headers;
        serve_reply_text(h, 200, assets[i].content_type, assets[i].start,
                         (size_t)(assets[i].end - assets[i].start));
        return;
    }
    serve_reply_error(h, SERVE_API_OPENAI, 404, NULL, "unknown_url", "no such page: %s", h->path);
}
