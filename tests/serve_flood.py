#!/usr/bin/python3
"""Connections under fire, against a running `moe serve` (tests/test_serve.c starts it).

Opens IDLE idle TCP connections and TRICKLE clients that send a request header one byte at a
time, from the same address as the checks, then checks that /health and a chat request are still
answered, that the server's threads and memory (read from /proc/PID/status) stay bounded while
they are held, that another address (127.0.0.2) is answered too, that tricklers are closed once
--read-timeout passes, and that once the clients close, the server's descriptors and
open-connection gauge come back to where they were.

Prints the measured figures (times are reported, not asserted) and exits non-zero with a
message on the first failed check.

usage: serve_flood.py --url http://127.0.0.1:PORT --pid PID --key KEY [--idle 1000] [--trickle 50]
"""
import argparse
import http.client
import json
import os
import resource
import socket
import sys
import time
import urllib.parse


def fail(msg):
    print(f"FAIL {msg}")
    sys.exit(1)


def proc_status(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return {
        "threads": int(fields["Threads"]),
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


class Server:
    def __init__(self, url, key):
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.key = u.hostname, u.port, key

    def request(self, method, path, body=None, timeout=30, source=None):
        """(status, body, seconds) of one request on a new connection (from address source)."""
        t0 = time.monotonic()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout,
                                       source_address=(source, 0) if source else None)
        headers = {"Authorization": f"Bearer {self.key}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
            body = json.dumps(body)
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, time.monotonic() - t0

    def metric(self, name):
        status, text, _ = self.request("GET", "/metrics")
        if status != 200:
            fail(f"/metrics answered {status}")
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split(" ")[1])
        fail(f"/metrics has no {name}")


def wait_for(what, cond, seconds):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if cond():
            return
        time.sleep(0.05)
    fail(f"waited {seconds} s for {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--trickle", type=int, default=50)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = a.idle + a.trickle + 64
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    srv = Server(a.url, a.key)
    limit = srv.metric("moe_connections_limit")
    limit_ip = srv.metric("moe_connections_limit_per_ip")
    read_timeout = srv.metric("moe_read_timeout_seconds")
    before = proc_status(a.pid)
    open0 = srv.metric("moe_connections_open")

    # the siege: idle sockets, then tricklers that keep sending header bytes
    idle, refused = [], 0
    for _ in range(a.idle):
        s = socket.socket()
        try:
            s.connect((srv.host, srv.port))
            idle.append(s)
        except OSError:
            refused += 1
            s.close()
    trick = []
    for i in range(a.trickle):
        s = socket.socket()
        try:
            s.connect((srv.host, srv.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow-")
            trick.append(s)
        except OSError:
            refused += 1
            s.close()

    def trickle_once():
        for s in trick:
            try:
                s.send(b"a")
            except OSError:
                pass

    trickle_once()
    during = proc_status(a.pid)
    status_h, _, t_health = srv.request("GET", "/health")
    trickle_once()
    status_c, body, t_chat = srv.request(
        "POST", "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    # another address (127.0.0.2 is loopback too) is not held back by the flooding one's limit
    status_o, _, t_other = srv.request("GET", "/health", source="127.0.0.2")
    held = srv.metric("moe_connections_open")
    evicted = srv.metric("moe_connections_evicted_total")
    print(f"flood: {len(idle)} idle + {len(trick)} trickling connections opened ({refused} refused "
          f"at connect), server holds {held:.0f} (limits {limit:.0f}, {limit_ip:.0f} per address), "
          f"{evicted:.0f} idle ones closed for newcomers; /health {status_h} in {t_health * 1e3:.1f} "
          f"ms, chat {status_c} in {t_chat * 1e3:.1f} ms, /health from 127.0.0.2 {status_o} in "
          f"{t_other * 1e3:.1f} ms; threads {before['threads']} -> "
          f"{during['threads']}, RSS {before['rss_kib'] / 1024:.1f} -> "
          f"{during['rss_kib'] / 1024:.1f} MiB, fds {before['fds']} -> {during['fds']}")
    if status_h != 200:
        fail(f"/health answered {status_h} under the flood")
    if status_o != 200:
        fail(f"/health from another address answered {status_o} under the flood")
    if status_c != 200:
        fail(f"the chat request answered {status_c} under the flood: {body[:200]!r}")
    reply = json.loads(body)
    if reply["usage"]["completion_tokens"] != 4:
        fail(f"the chat request generated {reply['usage']['completion_tokens']} tokens, not 4")
    if during["threads"] > before["threads"]:
        fail(f"threads grew from {before['threads']} to {during['threads']} with the connections")
    if held > limit + 64:
        fail(f"the server holds {held:.0f} connections, past its limit {limit:.0f} and reserve")
    if during["rss_kib"] - before["rss_kib"] > 64 * 1024:
        fail(f"RSS grew by {(during['rss_kib'] - before['rss_kib']) / 1024:.1f} MiB")

    # tricklers never finish a request: closed once --read-timeout passes, however they trickle
    timeouts0 = srv.metric("moe_connections_read_timeouts_total")

    def tricklers_closed():
        trickle_once()
        return srv.metric("moe_connections_read_timeouts_total") > timeouts0 or not trick

    wait_for("the read timeout to close slow connections", tricklers_closed, read_timeout + 10)
    print(f"flood: read timeouts closed "
          f"{srv.metric('moe_connections_read_timeouts_total'):.0f} connections")

    # everything closes: nothing stays behind
    for s in idle + trick:
        s.close()
    wait_for("the connections to close",
             lambda: srv.metric("moe_connections_open") <= open0 + 1 and
             proc_status(a.pid)["fds"] <= before["fds"], 15)
    after = proc_status(a.pid)
    print(f"flood: after closing: fds {after['fds']} (before {before['fds']}), threads "
          f"{after['threads']}, RSS {after['rss_kib'] / 1024:.1f} MiB")
    status_h, _, _ = srv.request("GET", "/health")
    if status_h != 200:
        fail(f"/health answered {status_h} after the flood")
    print("ok flood")


if __name__ == "__main__":
    main()
