"""Helpers for the interop tests (marked `dynamo` / `radixview`): the third-party tool runs in its
own venv (scripts/dynamo-setup.sh, scripts/radixview-setup.sh) as a subprocess on 127.0.0.1; the
test is skipped when that venv is absent."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from . import tool_venv
from .wait import wait_for


def venv_python(env: str, name: str, stamp: str) -> str:
    """The tool venv's python (`$env`, else the user cache dir's kvplay/`name`), or skip the test
    (with how to set it up)."""
    venv = tool_venv(env, name)
    if not (venv / stamp).exists() or not (venv / "bin" / "python").exists():
        script = "scripts/" + stamp.split("-")[1] + "-setup.sh"
        pytest.skip(f"needs {venv} (run {script})")
    return str(venv / "bin" / "python")


class Tool:
    """A subprocess whose output goes to a log file (read back when a check fails)."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._f = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, **(env or {})))

    def text(self) -> str:
        self._f.flush()
        return self.log.read_text()[-4000:]

    def wait_http(self, url: str, timeout: float = 120) -> None:
        def answers() -> bool:
            assert self.p.poll() is None, f"exited {self.p.returncode}"
            try:
                return httpx.get(url, timeout=2).status_code < 500
            except httpx.HTTPError:
                return False

        try:
            wait_for(answers, timeout, f"{url} to answer", poll=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.text()}") from None

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._f.close()
