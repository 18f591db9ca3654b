"""The hostile-text corpus of issue #42 and what every human view's output must pass: text from a
user, a server, a recording or a file reaches the terminal as data, never as markup or control.

- `CORPUS`: markup tags, a link, OSC 0 (window title), OSC 8 (a file: link), OSC 52 (the
  clipboard), CSI 2J (clear screen), C1 controls, bidi overrides and isolates, NUL and friends,
  zero-width characters; `LONG`, a 64 KB line.
- `assert_inert(out)`: no raw control, bidi or invisible character in `out` beyond the
  terminal renderer's own colour and cursor sequences.
- `run_tty(argv)`: a kvplay command on a pseudo-terminal (raw mode: the bytes as written), so
  Rich renders for a real terminal (colours, links) — where an interpreted `[link=…]` would
  become an OSC 8 hyperlink.
- `HostileServer` (loopback HTTP: /v1/models, chat completions as SSE, /tokenize, /detokenize,
  /kv_event_sources, /server_info, all answering hostile strings, invalid UTF-8 among them) and
  `HostilePub` (a ZMQ PUB sending vLLM KV-event batches whose session ids are the corpus).
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
import tty
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack

CORPUS = [
    "what does [/b] mean in a forum post?",
    "[link=http://e.vl]x[/link]",
    "[bold red]loud[/] [@click=app.quit]quit[/] :thumbs_up:",
    "title \x1b]0;pwned title\x07 set",
    "see \x1b]8;;file:///etc/passwd\x1b\\here\x1b]8;;\x1b\\ now",
    "copy \x1b]52;c;cm0gLXJmIH4K\x07 done",
    "clear \x1b[2J\x1b[H screen",
    "c1 \x9b2J \x9d0;t\x9c end",
    "bidi \u202etxt.exe\u202c and \u2066iso\u2069 \u200fx",
    "nul \x00 bel \x07 bs \x08 cr \r del \x7f",
    "ad\u200bmin\u200d \ufeffbom",
]
LONG = "L" * 65536
MARKUP = ("[/b]", "[link=http://e.vl]x[/link]")  # shown literally wherever the view shows them whole

# What must never reach a terminal raw: C0 but LF and TAB, ESC, DEL, C1, bidi marks and
# controls, zero-width and invisible characters, line separators, the BOM, lone surrogates.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u180e\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064"
                 "\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")
# What a terminal renderer (Rich) writes itself: colours (SGR), a live table's cursor moves and
# erases; `LIVE` also allows the carriage returns those use.
OWN = re.compile(r"\x1b\[[0-9;]*m")
LIVE = re.compile(r"\x1b\[[0-9;]*m|\x1b\[\?25[lh]|\x1b\[[0-9]*[ABK]|\r")


def assert_inert(out: str, own: re.Pattern | None = OWN) -> None:
    rest = own.sub("", out) if own is not None else out
    m = RAW.search(rest)
    assert m is None, f"raw {m.group()!r} reached the output: …{rest[max(0, m.start() - 80):m.start() + 40]!r}…"


def run_tty(argv: list[str], timeout: float = 300.0, cols: int = 200, env: dict | None = None) -> tuple[int, str]:
    """(exit code, everything written to the terminal) of `kvplay ARGV` on a pseudo-terminal."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: what the command writes arrives as written
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, cols, 0, 0))
    e = dict(os.environ, TERM="xterm-256color", COLORTERM="truecolor", **(env or {}))
    for k in ("NO_COLOR", "COLUMNS", "LINES", "TEXTUAL"):
        e.pop(k, None)
    p = subprocess.Popen([sys.executable, "-m", "kvplay", *argv], stdin=slave, stdout=slave, stderr=slave,
                         env=e, close_fds=True)
    os.close(slave)
    chunks, end = [], time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
        else:
            p.kill()
            raise AssertionError(f"kvplay {argv[0]} did not finish within {timeout} s")
        rc = p.wait(30)
    finally:
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


# --- a hostile server ---------------------------------------------------------------------------
MODEL_ID = "m\x1b]0;pwned\x07[/b]\u202e[link=http://e.vl]x[/link]"


def detokenized(ids) -> str:
    """What the hostile server's /detokenize says token ids read as: the corpus, by the first id."""
    return CORPUS[(ids[0] if ids else 0) % len(CORPUS)] + " \x1b[2J"


class HostileServer:
    """A loopback OpenAI-ish server whose every string is hostile. `events`: the KV-event
    endpoint /kv_event_sources advertises (None: it has none); `topic` is advertised with it."""

    def __init__(self, events: str | None = None, topic: str = ""):
        self.events, self.topic = events, topic
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, obj, status: int = 200):
                self._send(status, json.dumps(obj).encode())

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})
                elif self.path == "/kv_event_sources" and outer.events:
                    self._json({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": outer.events, "topic": outer.topic}})
                else:
                    self._json({"error": {"message": "no \x1b[2J such [/b] route"}}, 404)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/detokenize":
                    self._json({"prompt": detokenized(body.get("tokens") or [])})
                elif self.path == "/tokenize":
                    self._json({"tokens": list(range(1, 33))})
                elif self.path == "/v1/chat/completions":
                    self._stream(body)
                else:
                    self._json({"error": {"message": "nope"}}, 404)

            def _stream(self, body):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def chunk(piece: str | bytes):
                    if isinstance(piece, str):
                        data = json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}).encode()
                    else:  # raw bytes inside the JSON string: invalid UTF-8 on the wire
                        data = b'{"choices": [{"index": 0, "delta": {"content": "' + piece + b'"}}]}'
                    self.wfile.write(b"data: " + data + b"\n\n")
                    self.wfile.flush()

                for piece in CORPUS:
                    chunk(piece + "\n")
                chunk(b"bad utf-8: \xff\xfe\xc3 lone surrogate: \\ud800 end")
                chunk(LONG)
                usage = {"prompt_tokens": 32, "completion_tokens": 16,
                         "prompt_tokens_details": {"cached_tokens": 16}}
                self.wfile.write(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {},
                                                                       "finish_reason": "stop"}],
                                                          "usage": usage}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# --- a hostile KV-event publisher -----------------------------------------------------------------
SESSIONS = [c for c in CORPUS] + ["S" * 4096]
BS = 16


class HostilePub:
    """A ZMQ PUB on loopback sending vLLM KV-event batches (map-tagged BlockStored), one every
    `every` seconds from a thread: each stores a new block under the last, its session id the
    next of `SESSIONS`, its tokens 1..16 shifted. `topic`: the topic frame."""

    def __init__(self, topic: bytes = b"kv", every: float = 0.05):
        import zmq

        self.topic, self.every = topic, every
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def batch(self, i: int) -> bytes:
        ev = {"type": "BlockStored", "block_hashes": [1000 + i], "parent_block_hash": None if i % 3 == 0 else 999 + i,
              "token_ids": [(i * BS + k) % 90 + 1 for k in range(BS)], "block_size": BS, "lora_id": None,
              "medium": "GPU", "lora_name": None, "session_id": SESSIONS[i % len(SESSIONS)]}
        return msgpack.packb([time.time(), [ev]], use_bin_type=True)

    def _run(self):
        i = 0
        while not self._stop.is_set() and i < 2000:
            self.sock.send_multipart([self.topic, i.to_bytes(8, "big", signed=True), self.batch(i)])
            self.sent = i = i + 1
            self._stop.wait(self.every)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
