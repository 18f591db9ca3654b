#!/usr/bin/env python
"""Attack a fresh `kvplay serve` on 127.0.0.1 with every case of issue 20; print a table
(case -> status -> verdict).

Starts real servers as subprocesses (`python -m kvplay serve`, tiny random-init model by
default), all on loopback:
  S1: API keys (alice, bob admin), default isolation, KV events with CURVE, recording to a
      temporary DB, --max-concurrent-requests 8;
  S2: no keys (the loopback playground), KV events in clear on 127.0.0.1 (the anonymous ZMQ attacks);
and runs `kvplay serve` with configurations that must be refused before anything binds.
Numbers (times, RSS, thread counts) are measured here and now; on a shared machine they vary.

    .venv/bin/python scripts/attack_serve.py [--model tiny:llama] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import zmq

ROWS: list[tuple[str, str, str]] = []
KEYS = """
[[keys]]
key = "sk-alice-0123456789"
user = "alice"

[[keys]]
key = "sk-bob-0123456789"
user = "bob"
admin = true
"""
ALICE = {"Authorization": "Bearer sk-alice-0123456789"}
BOB = {"Authorization": "Bearer sk-bob-0123456789"}


def row(case: str, status: str, ok: bool) -> None:
    ROWS.append((case, status, "ok" if ok else "FAIL"))
    print(f"  {'ok  ' if ok else 'FAIL'} {case}: {status}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants: `kvplay serve` is an HTTP process and its engine-core child,
    and the event sockets (the ZMQ floods' target) live in the child."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _status_sum(pid: int, field: str) -> int:
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def rss_mb(pid: int) -> float:
    """Resident MB of the server's processes together."""
    return _status_sum(pid, "VmRSS:") / 1024


def threads_of(pid: int) -> int:
    """Threads of the server's processes together."""
    return _status_sum(pid, "Threads:")


class Server:
    def __init__(self, args: list[str], model: str):
        cmd = [sys.executable, "-m", "kvplay", "serve", "--host", "127.0.0.1", "--port", "0", "--model", model,
               "--num-blocks", "256", "--log-level", "error", *args]
        self.p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        deadline = time.monotonic() + 300
        while self.url is None and time.monotonic() < deadline:
            line = self.p.stderr.readline()
            if not line:
                raise RuntimeError("server exited: " + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"on (https?://[^ ]+)/v1", line)
            if m:
                self.url = m.group(1)
        threading.Thread(target=self._drain, daemon=True).start()
        time.sleep(1.0)  # the lines printed right after "serving"

    def _drain(self):
        for line in self.p.stderr:
            self.lines.append(line)

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def refused(args: list[str], model: str, want: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "kvplay", "serve", "--model", model, "--no-record", *args],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


def chat_body(content: str, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    body.update(kw)
    return body


def stream_all(url: str, headers: dict, body: dict, out: dict, key: str) -> None:
    events = []
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as s:
                out[key + "_status"] = s.status_code
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
    except Exception as exc:
        events.append(f"exception {exc}")
    out[key] = events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--quick", action="store_true", help="smaller floods (20k subscriptions, 20k replay requests)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvplay-attack-"))
    keys = tmp / "keys.toml"
    keys.write_text(KEYS)
    curve_dir = tmp / "curve"
    subprocess.run([sys.executable, "-m", "kvplay", "serve", "--gen-curve-keys", str(curve_dir)], check=True,
                   capture_output=True)
    print(f"kvplay attack_serve: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, model {a.model}",
          file=sys.stderr)

    # --- refused before anything binds ------------------------------------------------------------
    rc, line = refused(["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                          "replay_endpoint": "tcp://0:5558"})], a.model, "")
    row("no keys, replay_endpoint tcp://0:PORT", f"exit {rc}", rc == 2 and "loopback" in line)
    rc, line = refused(["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                          "endpoint": "tcp://eth0:5557"})], a.model, "")
    row("no keys, events on an interface name (tcp://eth0:PORT)", f"exit {rc}", rc == 2 and "loopback" in line)
    rc, line = refused(["--host", "0.0.0.0"], a.model, "")
    row("no keys, --host 0.0.0.0", f"exit {rc}", rc == 2)
    rc, line = refused(["--api-keys", str(keys), "--host", "0.0.0.0", "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"})], a.model, "")
    row("keys, docs' network recipe without CURVE", f"exit {rc}", rc == 2 and "--kv-events-insecure" in line)
    if subprocess.run(["which", "openssl"], capture_output=True).returncode == 0:
        k, c = tmp / "enc.pem", tmp / "cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:pw", "-keyout", str(k),
                        "-out", str(c), "-days", "1", "-subj", "/CN=127.0.0.1"], capture_output=True, check=True)
        rc, line = refused(["--ssl-certfile", str(c), "--ssl-keyfile", str(k)], a.model, "")
        row("passphrase TLS key without --ssl-keyfile-password", f"exit {rc}, no prompt",
            rc == 2 and "--ssl-keyfile-password" in line)

    # --- S1: keys + CURVE ----------------------------------------------------------------------------
    pub_port, rep_port = free_port(), free_port()
    db = tmp / "sessions.db"
    s1 = Server(["--api-keys", str(keys), "--db", str(db), "--max-concurrent-requests", "8",
                 "--kv-events-curve", str(curve_dir), "--kv-events-config", json.dumps(
                     {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
                      "replay_endpoint": f"tcp://127.0.0.1:{rep_port}"})], a.model)
    try:
        attack_s1(s1, pub_port, rep_port, curve_dir, db)
    finally:
        s1.stop()

    # --- S2: no keys, events in clear on loopback ---------------------------------------------------
    pub_port, rep_port = free_port(), free_port()
    s2 = Server(["--no-record", "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
         "replay_endpoint": f"tcp://127.0.0.1:{rep_port}"})], a.model)
    try:
        attack_s2(s2, pub_port, rep_port, 20_000 if a.quick else 800_000, 20_000 if a.quick else 80_000)
    finally:
        s2.stop()

    width = max(len(c) for c, _, _ in ROWS)
    swidth = max(len(s) for _, s, _ in ROWS)
    print(f"| {'case'.ljust(width)} | {'status'.ljust(swidth)} | verdict |")
    print(f"|{'-' * (width + 2)}|{'-' * (swidth + 2)}|---------|")
    for c, s, v in ROWS:
        print(f"| {c.ljust(width)} | {s.ljust(swidth)} | {v.ljust(7)} |")
    bad = sum(v != "ok" for _, _, v in ROWS)
    print(f"\n{len(ROWS) - bad}/{len(ROWS)} ok", file=sys.stderr)
    return 1 if bad else 0


def attack_s1(s: Server, pub_port: int, rep_port: int, curve_dir: Path, db: Path) -> None:
    from kvplay.wire.curve import ClientCurve

    url = s.url
    pid = s.p.pid
    head = "".join(s.lines)
    row("keys: default isolation", "isolation user" if "isolation user" in head else "not user",
        "isolation user" in head)
    # events: a plain SUB and DEALER get nothing; the allowed CURVE key reads
    ctx = zmq.Context()
    plain = ctx.socket(zmq.SUB)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(f"tcp://127.0.0.1:{pub_port}")
    good = ctx.socket(zmq.SUB)
    good.setsockopt(zmq.SUBSCRIBE, b"")
    ClientCurve.load(str(curve_dir / "server.key"), str(curve_dir / "client.key_secret")).apply(good)
    good.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)
    with httpx.Client(timeout=120) as c:
        secret = "my bank PIN is 9921. " * 20
        a1 = c.post(url + "/v1/chat/completions", json=chat_body(secret), headers=ALICE)
        time.sleep(0.5)
        got_plain = 0
        while plain.poll(200):
            plain.recv_multipart()
            got_plain += 1
        got_good = 0
        while good.poll(200):
            good.recv_multipart()
            got_good += 1
        row("plain SUB on the CURVE event port", f"{got_plain} batches", got_plain == 0)
        row("allowed CURVE key on the event port", f"{got_good} batches", got_good > 0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{rep_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        row("plain DEALER asks the replay port for history", "answered" if dealer.poll(1000) else "no answer",
            not dealer.poll(0))
        # bob guesses alice's prompt
        b1 = c.post(url + "/v1/chat/completions", json=chat_body(secret), headers=BOB).json()
        cached = b1["usage"]["prompt_tokens_details"]["cached_tokens"]
        row("bob sends alice's prompt (guess confirmation)", f"cached_tokens {cached}, cached_from "
            f"{b1['kvplay']['cached_from']}", a1.status_code == 200 and cached == 0)
        m_open = c.get(url + "/metrics").text
        m_alice = c.get(url + "/metrics", headers=ALICE).text
        m_bob = c.get(url + "/metrics", headers=BOB).text
        series = "# TYPE kvplay:cached_tokens_total"
        row("/metrics per-user series: open / alice / bob (admin)",
            f"{series in m_open} / {series in m_alice} / {series in m_bob}",
            series not in m_open and series not in m_alice and series in m_bob)
        # one request cannot stop another's
        out: dict = {}
        t = threading.Thread(target=stream_all, args=(url, BOB, chat_body("tell me a story", max_tokens=64,
                                                                              temperature=0.8, ignore_eos=True),
                                                      out, "bob"))
        t.start()
        time.sleep(0.3)
        tiny = c.post(url + "/v1/chat/completions", json=chat_body("x", temperature=1e-300), headers=ALICE)
        inf = c.post(url + "/v1/chat/completions", headers={**ALICE, "content-type": "application/json"},
                     content=b'{"messages":[{"role":"user","content":"x"}],"temperature":Infinity}')
        t.join(120)
        bob_ok = out.get("bob") and out["bob"][-1] == "[DONE]" and not any('"error"' in e for e in out["bob"])
        health = c.get(url + "/health").status_code
        row("temperature 1e-300 (alice) while bob streams", f"{tiny.status_code}", tiny.status_code == 200)
        row("temperature Infinity", f"{inf.status_code}", inf.status_code == 400)
        row("bob's stream during both", "completed" if bob_ok else "cut", bool(bob_ok))
        row("/health after them", f"{health}", health == 200)
        # bounded work before admission
        out = {}
        t0 = time.perf_counter()
        big = threading.Thread(target=lambda: out.__setitem__("big", c.post(
            url + "/v1/completions", json={"prompt": "9921 " * ((8 << 20) // 5 - 8)}, headers=ALICE)))
        big.start()
        time.sleep(0.05)
        t1 = time.perf_counter()
        small = httpx.post(url + "/v1/chat/completions", json=chat_body("hi", max_tokens=2), headers=BOB, timeout=120)
        small_ms = (time.perf_counter() - t1) * 1000
        big.join(120)
        big_ms = (time.perf_counter() - t0) * 1000
        row("~8 MB prompt", f"{out['big'].status_code} in {big_ms:.0f} ms", out["big"].status_code == 400)
        row("another user's 2-token chat meanwhile", f"{small.status_code} in {small_ms:.0f} ms",
            small.status_code == 200)
        t0 = time.perf_counter()
        many = c.post(url + "/v1/chat/completions", headers=ALICE,
                      json={"messages": [{"role": "user", "content": "hi"}] * 200_000})
        row("200k messages", f"{many.status_code} in {(time.perf_counter() - t0) * 1000:.0f} ms",
            many.status_code == 400)
        # small ones
        deep = c.post(url + "/v1/chat/completions", headers={**ALICE, "content-type": "application/json"},
                      content=b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        sur = c.post(url + "/v1/chat/completions", headers={**ALICE, "content-type": "application/json"},
                     content=b'{"messages":[{"role":"user","content":"\\ud800"}]}')
        opts = c.post(url + "/v1/chat/completions", headers=ALICE,
                      json=chat_body("x", stream_options={"include_usage": True}))
        for name, r in (("100k-deep JSON", deep), ("lone surrogate \\ud800", sur),
                        ("stream_options without stream", opts)):
            msg = r.json()["error"]["message"] if r.headers.get("content-type", "").startswith("application/json") else ""
            row(name, f"{r.status_code}", r.status_code == 400 and "Error:" not in msg)
    # concurrency cap and threads
    before_threads = threads_of(pid)
    outs: dict = {}
    ts = [threading.Thread(target=stream_all, args=(url, ALICE, chat_body("go", max_tokens=256, n=16,
                                                                          temperature=0.7, ignore_eos=True),
                                                    outs, f"s{i}")) for i in range(8)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 120
    while sum(k.endswith("_status") for k in list(outs)) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)  # all 8 streams admitted and running
    peak = threads_of(pid)
    r = httpx.post(url + "/v1/chat/completions", json=chat_body("one more"), headers=BOB, timeout=60)
    for t in ts:
        t.join(300)
    row("9th request with --max-concurrent-requests 8", f"{r.status_code}, Retry-After {r.headers.get('retry-after')}",
        r.status_code == 503 and r.headers.get("retry-after") is not None)
    row("server threads: idle -> 8 streams x n=16", f"{before_threads} -> {peak}", peak - before_threads < 16)
    # slowloris
    socks = []
    for i in range(100):
        k = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
        if i % 2:
            k.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(k)
    t0 = time.monotonic()
    closed = 0
    for k in socks:
        try:
            if k.recv(1) == b"":
                closed += 1
        except OSError:
            pass
        k.close()
    row("100 idle / slow-header connections", f"{closed} closed by the server within "
        f"{time.monotonic() - t0:.0f} s", closed == 100)
    mode = oct(os.stat(db).st_mode & 0o777)
    row("sessions DB mode", mode, mode == "0o600")
    ctx.destroy(linger=0)


def attack_s2(s: Server, pub_port: int, rep_port: int, n_subs: int, n_replay: int) -> None:
    url, pid = s.url, s.p.pid
    ctx = zmq.Context()
    good = ctx.socket(zmq.SUB)
    good.setsockopt(zmq.SUBSCRIBE, b"")
    good.connect(f"tcp://127.0.0.1:{pub_port}")
    with httpx.Client(timeout=120) as c:
        c.post(url + "/v1/chat/completions", json=chat_body("warm up " * 40, user="u"))
        time.sleep(0.5)
        rss0 = rss_mb(pid)
        rss = []
        for wave in range(2):  # two floods of distinct subscriptions, from two peers
            flood = ctx.socket(zmq.XSUB)
            flood.setsockopt(zmq.SNDHWM, 0)
            flood.connect(f"tcp://127.0.0.1:{pub_port}")
            for i in range(n_subs):
                flood.send(b"\x01" + b"sub-%d-%08d" % (wave, i))
            time.sleep(10.0)
            rss.append(rss_mb(pid))
            flood.close()
        # libzmq keeps every subscription a peer sends until it leaves; the server cuts a
        # connection past its byte budget and trims the heap (before issue 20: 2.0 -> 4.7 GB for
        # 800k, kept; with the XPUB_MANUAL socket of the first fix: 416 -> 582 -> 654 MB)
        row(f"2 x {n_subs // 1000}k subscriptions from XSUBs (server RSS: before, after 1st, after 2nd)",
            f"{rss0:.0f} -> {rss[0]:.0f} -> {rss[1]:.0f} MB", max(rss) - rss0 < 50)
        while good.poll(0):
            good.recv_multipart()
        hammer = ctx.socket(zmq.DEALER)
        hammer.setsockopt(zmq.SNDHWM, 0)
        hammer.setsockopt(zmq.RCVHWM, 1000)
        hammer.connect(f"tcp://127.0.0.1:{rep_port}")
        stop = threading.Event()

        def hammer_it():
            req = [b"", (0).to_bytes(8, "big")]
            for _ in range(n_replay):
                hammer.send_multipart(req)
            stop.wait()

        h = threading.Thread(target=hammer_it, daemon=True)
        t0 = time.perf_counter()
        h.start()
        live = 0
        times = []
        for i in range(5):
            t1 = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json=chat_body(f"during the hammer {i} " * 10, user=f"v{i}"))
            times.append((time.perf_counter() - t1) * 1000)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if good.poll(50):
                    good.recv_multipart()
                    live += 1
                    if r.status_code == 200:
                        break
        stop.set()
        h.join(120)
        row(f"{n_replay // 1000}k replay requests: live batches during", f"{live} received, chats "
            f"{min(times):.0f}-{max(times):.0f} ms", live >= 5)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
