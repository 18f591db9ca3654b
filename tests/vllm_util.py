"""A real vLLM CPU server for the `vllm`-marked tests (scripts/vllm-cpu.sh: ~1 min to start, both
cores): `with vllm_cpu(tmp_path) as url:` starts it on a free loopback port and stops it after."""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

VLLM_VENV = os.environ.get("KVPLAY_VLLM_VENV", "/work/vllm-venv")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "vllm-cpu.sh")


@contextlib.contextmanager
def vllm_cpu(tmp_path):
    if not os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
        pytest.skip(f"no vLLM venv at {VLLM_VENV} (run scripts/vllm-cpu.sh setup)")
    from test_watch_subscriber import free_port

    port = free_port()
    env = dict(os.environ, KVPLAY_VLLM_RUN=str(tmp_path / "vllm"), KVPLAY_VLLM_PORT=str(port))

    def vllm(cmd):
        out = subprocess.run([SCRIPT, cmd, "--port", str(port)], env=env, capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-2000:]

    vllm("start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        vllm("stop")
