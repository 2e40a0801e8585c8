#!/usr/bin/env python3
"""Render chat templates with Python Jinja2 the way Hugging Face transformers does.

Used by tests/test_template.c as the reference the C interpreter must match byte for byte.
The environment copies transformers' `_compile_jinja_template`: ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks, the loopcontrols extension and the `{% generation %}` tag, its
own `tojson` (json.dumps, ensure_ascii=False), `raise_exception`, and `strftime_now` -- here
on a fixed date so both sides agree. Rendering passes messages, tools, documents=None,
add_generation_prompt, then the other kwargs, as apply_chat_template does.

usage: render_jinja.py CASES.json OUT.json
  CASES.json: {"fixed_date": "YYYY-MM-DD[THH:MM:SS]",
               "cases": [{"template": PATH, "messages": [...], "tools": [...]|null,
                          "kwargs": {...}}, ...]}
  OUT.json:   [{"ok": true, "text": "..."} | {"ok": false, "error": "..."}, ...]
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(Extension):
    """transformers' {% generation %} ... {% endgeneration %}: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_env(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return now.strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    now = datetime.fromisoformat(spec["fixed_date"])
    env = make_env(now)
    compiled = {}
    results = []
    for case in spec["cases"]:
        path = case["template"]
        try:
            if path not in compiled:
                with open(path, encoding="utf-8", newline="") as f:
                    source = f.read()
                try:
                    compiled[path] = env.from_string(source)
                except Exception as e:  # a template that does not compile fails every case
                    compiled[path] = e
            tpl = compiled[path]
            if isinstance(tpl, Exception):
                raise tpl
            kwargs = dict(case.get("kwargs") or {})
            agp = kwargs.pop("add_generation_prompt", False)
            text = tpl.render(messages=case["messages"], tools=case.get("tools"), documents=None,
                              add_generation_prompt=agp, **kwargs)
            results.append({"ok": True, "text": text})
        except Exception as e:
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
