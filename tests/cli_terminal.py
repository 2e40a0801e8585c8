#!/usr/bin/python3
"""`moe run` / `moe chat` as a user at a terminal sees them (the cli suite runs this):

  cli_terminal.py MOE MODEL CHAT_MODEL

run_interrupt: Ctrl-C (SIGINT) during `moe run` stops generating and still prints the stats line
  (exit 130, as a shell reports an interrupted command).
chat_interrupt: Ctrl-C during a `moe chat` reply ends that reply, the session goes on (the next
  message gets a reply), and end of input then ends it cleanly.
tty_escapes: on a terminal (a pty) control characters the model writes come out escaped; into a
  pipe the same run's bytes are raw (so the model did write some).
Prints "ok NAME" per check; exits 1 with the reason on the first failure."""
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time

moe, model, chat_model = sys.argv[1:4]
LONG = ["--ctx", "100000", "-n", "100000", "--ignore-eos"]  # far longer than the test waits


def fail(msg):
    print("FAIL " + msg)
    sys.exit(1)


class Drain:
    """Collects a pipe's bytes on a thread."""

    def __init__(self, f):
        self.data = b""
        self.t = threading.Thread(target=self.run, args=(f,), daemon=True)
        self.t.start()

    def run(self, f):
        while True:
            b = os.read(f.fileno(), 65536)
            if not b:
                return
            self.data += b

    def wait_for(self, what, pred, seconds=60):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if pred(self.data):
                return
            time.sleep(0.02)
        fail(f"{what}: not seen in {seconds} s; got {self.data[-500:]!r}")


def stats(err):
    m = re.search(rb"generated: (\d+) tokens", err)
    return int(m.group(1)) if m else None


# ==== run_interrupt ====
p = subprocess.Popen([moe, "run", model, "-p", "Once upon a time"] + LONG,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
out, err = Drain(p.stdout), Drain(p.stderr)
out.wait_for("run's streamed text", lambda d: len(d) > 200)
p.send_signal(signal.SIGINT)
rc = p.wait(60)
out.t.join(10), err.t.join(10)
n = stats(err.data)
if rc != 130 or b"[interrupted]" not in err.data or n is None or not 0 < n < 100000:
    fail(f"run after Ctrl-C: exit {rc}, {n} tokens, stderr {err.data[-800:]!r}")
print(f"ok run_interrupt ({n} tokens before Ctrl-C, stats printed)")

# ==== chat_interrupt ====
p = subprocess.Popen([moe, "chat", chat_model] + LONG, stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
out, err = Drain(p.stdout), Drain(p.stderr)
p.stdin.write(b"Once upon a time\n")
p.stdin.flush()
out.wait_for("the first reply", lambda d: len(d) > 200)
p.send_signal(signal.SIGINT)
err.wait_for("the first reply stopped", lambda d: d.count(b"[stopped") == 1 and d.count(b"> ") >= 2)
first = len(out.data)
p.stdin.write(b"Tell me more\n")
p.stdin.close()
out.wait_for("a second reply", lambda d: len(d) > first + 200)
p.send_signal(signal.SIGINT)
rc = p.wait(60)
out.t.join(10), err.t.join(10)
if rc != 0 or err.data.count(b"[stopped") != 2 or stats(err.data) is None:
    fail(f"chat: exit {rc}, stderr {err.data[-800:]!r}")
print(f"ok chat_interrupt (two replies stopped by Ctrl-C in one session, {stats(err.data)} tokens)")

# ==== tty_escapes ====
# near-uniform sampling over stories260K's 512 tokens: about half are byte tokens, control
# bytes among them
sample = [moe, "run", model, "--temp", "100", "--top-k", "0", "--top-p", "1", "--min-p", "0",
          "-n", "400", "--seed", "7", "--ignore-eos"]
raw = subprocess.run(sample, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
bad = set(range(0x20)) - {0x0A, 0x09} | {0x7F}
if not any(b in bad for b in raw):
    fail("the sampled text has no control characters: the check below would prove nothing")
master, slave = pty.openpty()
p = subprocess.Popen(sample, stdout=slave, stderr=subprocess.DEVNULL)
os.close(slave)
shown = b""
while True:
    try:
        b = os.read(master, 65536)
    except OSError:  # EIO: the other side closed
        break
    if not b:
        break
    shown += b
p.wait(60)
shown = shown.replace(b"\r\n", b"\n")  # the terminal's own newline translation
left = sorted({b for b in shown if b in bad})
if left or rb"\x" not in shown:
    fail(f"on a terminal, control bytes {left} came through raw: {shown[:300]!r}")
print(f"ok tty_escapes ({sum(b in bad for b in raw)} control bytes in the raw run, none on the tty)")
