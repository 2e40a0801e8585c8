#!/usr/bin/python3
"""The references the grammar suite compares against; nothing here comes from moe's own code.

  grammar_check.py mask GGUF REGEX STEPS.json
      Reads the vocabulary straight from the GGUF (its own reader, SPM pieces: U+2581 is a space,
      <0xNN> a byte, control and unknown tokens nothing), and for every step that moe recorded
      ({"prefix": hex bytes, "allowed": [ids]}) computes which tokens may come next under the
      regular expression (the `regex` module's partial matching): a token is allowed when
      prefix + its bytes is a prefix of some match; an end-of-generation token (EOS) when the
      prefix is a whole match. Prints every difference; exit 1 if there is one.

  grammar_check.py serve MOE MODEL CASES.json OUT_DIR
      Starts `moe serve MODEL --port 0`, sends each case's request N times (seeds 1..N), and
      checks every reply with Python's json and jsonschema (Draft 2020-12): "content" cases need
      message content that parses and validates against the case's schema; "tool" cases need
      exactly one tool call to an allowed name whose arguments validate against that tool's
      parameters; "status" cases need that HTTP status. Prints one line per case; exit 1 when one
      fails.
"""
import json
import os
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request

import regex


def gguf_vocab(path):
    """tokenizer.ggml.tokens and token_type from a GGUF file (v2/v3, little-endian)."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n]
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
              12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et = take("I")
            n = take("Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert data[:4] == b"GGUF"
    pos = 4
    take("I")  # version
    take("Q")  # tensors
    n_kv = take("Q")
    kv = {}
    for _ in range(n_kv):
        key = string().decode()
        kv[key] = value(take("I"))
    return kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"], kv.get(
        "tokenizer.ggml.eos_token_id")


def pieces(tokens, types):
    out = []
    for text, ty in zip(tokens, types):
        if ty == 6:  # byte
            out.append(bytes([int(text[3:5], 16)]))
        elif ty in (2, 3):  # unknown, control
            out.append(b"")
        else:
            out.append(text.replace("\u2581".encode(), b" "))
    return out


def can_continue(rx, b):
    """Is b (bytes) the start of some match? An unfinished UTF-8 character at the end counts
    when one of its completions keeps a partial match."""
    for cut in range(0, 4):
        head, tail = b[:len(b) - cut], b[len(b) - cut:]
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tail:
            return rx.fullmatch(text, partial=True) is not None
        lead = tail[0]
        need = 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4 if lead >> 3 == 30 else 0
        if not need or len(tail) >= need or any(c >> 6 != 2 for c in tail[1:]):
            return False
        # every character whose UTF-8 begins with these bytes
        for cp in candidates:
            enc = chr(cp).encode("utf-8")
            if enc.startswith(tail) and rx.fullmatch(text + chr(cp), partial=True):
                return True
        return False
    return False


candidates = []


def check_mask(gguf, pattern, steps_path):
    global candidates
    tokens, types, eos = gguf_vocab(gguf)
    ps = pieces(tokens, types)
    rx = regex.compile(pattern)
    # non-ASCII characters only matter through the pattern's own (literal) characters
    candidates = sorted({ord(c) for c in pattern if ord(c) > 127})
    steps = json.load(open(steps_path))
    bad = 0
    for k, step in enumerate(steps):
        prefix = bytes.fromhex(step["prefix"])
        want = set()
        for t, p in enumerate(ps):
            if t == eos:
                try:
                    if rx.fullmatch(prefix.decode("utf-8")):
                        want.add(t)
                except UnicodeDecodeError:
                    pass
            elif p and can_continue(rx, prefix + p):
                want.add(t)
        got = set(step["allowed"])
        if want != got:
            bad += 1
            print(f"step {k} after {prefix!r}: moe allows {len(got)}, the regex {len(want)}; "
                  f"only moe: {[ps[t] for t in sorted(got - want)][:10]} "
                  f"only regex: {[ps[t] for t in sorted(want - got)][:10]}")
    print(f"{len(steps)} steps, {bad} differ")
    return 1 if bad else 0


def complete_json_prefix(text):
    """A JSON text cut anywhere, made whole by the shortest ending we can name: close an open
    string (dropping a half-written escape), supply a missing value, close the brackets. The
    result must then parse: a cut reply that was not on its way to valid JSON fails here."""
    stack, in_str, esc, i = [], False, False, 0
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append(ch)
        elif ch in "]}":
            stack.pop()
    out = text
    if in_str:
        out = regex.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", out) + '"'
    tail = out.rstrip()
    if tail.endswith(","):
        out = tail[:-1]
    elif tail.endswith(":"):
        out = tail + "null"
    elif stack and stack[-1] == "{" and tail.endswith('"'):
        # a key without its value, or a value: try both
        closers = "".join("]" if b == "[" else "}" for b in reversed(stack))
        for cand in (tail + ":null" + closers, tail + closers):
            try:
                return json.loads(cand)
            except ValueError:
                pass
    else:
        out = regex.sub(r"(-|\.|[eE][-+]?|[-+])$", lambda m: m.group(0) + "0", out)
        for word in ("true", "false", "null"):
            for k in range(1, len(word)):
                if out.endswith(word[:k]):
                    out = out + word[k:]
                    break
    return json.loads(out + "".join("]" if b == "[" else "}" for b in reversed(stack)))


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:  # generous: sanitizer builds
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def check_serve(moe, model, cases_path, out_dir):
    import jsonschema
    cases = json.load(open(cases_path))
    log = open(os.path.join(out_dir, "serve.log"), "w")
    srv = subprocess.Popen([moe, "serve", model, "--port", "0", "--parallel", "8", "--ctx", "2048"],
                           stdout=subprocess.PIPE, stderr=log, text=True)
    url = None
    for line in srv.stdout:
        if "listening on " in line:
            url = line.split("listening on ")[1].split()[0]
        if "ready" in line:
            break
    failed = 0
    try:
        if not url:
            print("moe serve did not start")
            return 1
        for case in cases:
            name, n = case["name"], case.get("n", 1)
            errors, shown, truncated = [], [], 0
            for seed in range(1, n + 1):
                body = dict(case["request"])
                body["seed"] = seed
                status, reply = post(url + case.get("path", "/v1/chat/completions"), body)
                try:
                    if "status" in case:
                        assert status == case["status"], f"status {status}, want {case['status']}"
                        if "error_contains" in case:
                            msg = json.dumps(reply)
                            assert case["error_contains"] in msg, f"error {msg}"
                        continue
                    assert status == 200, f"status {status}: {reply}"
                    if case["kind"] == "content":
                        text = reply["choices"][0]["message"]["content"]
                        if case.get("allow_length") and reply["choices"][0]["finish_reason"] == "length":
                            truncated += 1  # cut by max_tokens: it must have been valid so far
                            jsonschema.validate(complete_json_prefix(text), case["schema"])
                            continue
                        if len(shown) < 2:
                            shown.append(text)
                        jsonschema.validate(json.loads(text), case["schema"])
                    elif case["kind"] == "responses":
                        text = reply["output_text"] if "output_text" in reply else "".join(
                            c["text"] for o in reply["output"] if o["type"] == "message"
                            for c in o["content"])
                        jsonschema.validate(json.loads(text), case["schema"])
                    elif case["kind"] == "tool":
                        calls = reply["choices"][0]["message"].get("tool_calls") or []
                        assert len(calls) == 1, f"{len(calls)} tool calls: {reply}"
                        fn = calls[0]["function"]
                        tools = {t["function"]["name"]: t["function"]["parameters"]
                                 for t in body["tools"]}
                        assert fn["name"] in case["names"], f"called {fn['name']}"
                        if len(shown) < 2:
                            shown.append(fn["name"] + " " + fn["arguments"])
                        jsonschema.validate(json.loads(fn["arguments"]), tools[fn["name"]])
                    elif case["kind"] == "anthropic_tool":
                        uses = [c for c in reply["content"] if c["type"] == "tool_use"]
                        assert len(uses) == 1, f"{len(uses)} tool_use blocks: {reply}"
                        tools = {t["name"]: t["input_schema"] for t in body["tools"]}
                        assert uses[0]["name"] in case["names"], f"called {uses[0]['name']}"
                        jsonschema.validate(uses[0]["input"], tools[uses[0]["name"]])
                    elif case["kind"] == "regex":
                        text = reply["choices"][0]["text"]
                        if len(shown) < 2:
                            shown.append(text)
                        assert regex.fullmatch(case["regex"], text), f"{text!r} does not match"
                except Exception as e:  # noqa: BLE001 -- every failure is the case's
                    what = ""
                    if isinstance(reply, dict) and "choices" in reply:
                        c = reply["choices"][0]
                        what = f" [finish {c.get('finish_reason')}: " + repr(
                            (c.get("message") or {}).get("content") or c.get("text"))[:300] + "]"
                    errors.append(f"seed {seed}: {type(e).__name__}: {str(e)[:300]}{what}")
            if errors:
                failed += 1
                print(f"FAIL {name}: {len(errors)} of {n}")
                for e in errors[:5]:
                    print("   ", e)
            else:
                cut = f", {truncated} cut by max_tokens" if truncated else ""
                print(f"ok {name}: {n - truncated} of {n} valid{cut}" +
                      (f" (e.g. {shown[0][:160]!r})" if shown else ""))
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            rc = srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()
            rc = "killed"
    if rc != 0:  # a crash, or a sanitizer's report at exit
        failed += 1
        print(f"FAIL moe serve exited with {rc}; the end of its log:")
        print(open(os.path.join(out_dir, "serve.log")).read()[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "mask":
        sys.exit(check_mask(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit(check_serve(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]))
