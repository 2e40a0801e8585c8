#!/usr/bin/env python3
"""range_server.py: a small HTTP/1.1 file server for the audit tests (python3 stdlib only).

Serves ROOT on 127.0.0.1 with single byte-range support (bytes=a-b, a-, -n -> 206 with
Content-Range; past the end -> 416), keep-alive connections, and:
  /redirect/PATH   302 to /PATH (and /redirect/redirect/PATH redirects twice)
  --no-range       ignore Range headers: answer 200 with the whole file, like a server without
                   range support
  --log FILE       one line per request: "METHOD PATH RANGE STATUS BYTES"
  --exit-with-parent  exit when the process that started it dies (a test runner killed
                   mid-suite leaves no server behind)
It prints "port N" on stdout once listening (port 0 picks a free one) and serves until killed.
"""
import argparse
import http.server
import os
import re
import sys
import threading
import time

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def make_handler(root, no_range, log_path, lock):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: the test reads --log instead
            pass

        def record(self, status, nbytes):
            if not log_path:
                return
            with lock, open(log_path, "a") as f:
                f.write("%s %s %s %d %d\n" % (self.command, self.path,
                                              self.headers.get("Range", "-"), status, nbytes))

        def reply(self, status, headers, body=b""):
            self.record(status, len(body))  # before sending: the client may be gone after
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path.startswith("/redirect/"):
                self.reply(302, [("Location", path[len("/redirect"):])])
                return
            full = os.path.realpath(os.path.join(root, path.lstrip("/")))
            if not full.startswith(os.path.realpath(root) + os.sep) or not os.path.isfile(full):
                self.reply(404, [("Content-Type", "text/plain")], b"not found\n")
                return
            size = os.path.getsize(full)
            rng = self.headers.get("Range")
            if no_range or not rng:
                with open(full, "rb") as f:
                    self.reply(200, [("Content-Type", "application/octet-stream")], f.read())
                return
            m = RANGE.match(rng.strip())
            if not m or (m.group(1) == "" and m.group(2) == ""):
                self.reply(416, [("Content-Range", "bytes */%d" % size)])
                return
            if m.group(1) == "":
                start, end = max(0, size - int(m.group(2))), size - 1
            else:
                start = int(m.group(1))
                end = int(m.group(2)) if m.group(2) else size - 1
                end = min(end, size - 1)
            if start >= size or end < start:
                self.reply(416, [("Content-Range", "bytes */%d" % size)])
                return
            with open(full, "rb") as f:
                f.seek(start)
                body = f.read(end - start + 1)
            self.reply(206, [("Content-Type", "application/octet-stream"),
                             ("Content-Range", "bytes %d-%d/%d" % (start, end, size))], body)

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--no-range", action="store_true")
    ap.add_argument("--log")
    ap.add_argument("--exit-with-parent", action="store_true")
    a = ap.parse_args()
    handler = make_handler(a.root, a.no_range, a.log, threading.Lock())
    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # a client that stops reading (moe refusing a 200 body) is expected, not news
            if not isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
                super().handle_error(request, client_address)

    srv = Server(("127.0.0.1", a.port), handler)
    srv.daemon_threads = True
    parent = os.getppid()

    def watch_parent():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    if a.exit_with_parent:
        threading.Thread(target=watch_parent, daemon=True).start()
    print("port %d" % srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
