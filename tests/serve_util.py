"""Helpers for the `kvplay serve` tests: a real server (uvicorn in a thread, loopback, free port)
around a real engine on a tiny model."""
from __future__ import annotations

import time

import pytest


@pytest.fixture
def serve(make_engine, tmp_path):
    """serve(keys=None, kv_events=None, record=False, report_full=False, **engine_config) ->
    (ServerThread, ServeState). Everything is stopped after the test."""
    from kvplay.serve.server import ServerThread, build_state, close_state
    from kvplay.sessions.recorder import Recorder

    made = []

    def factory(keys=None, kv_events=None, record=False, report_full=False, **cfg):
        eng = make_engine(**cfg)
        rec = None
        if record:
            rec = Recorder.open(str(tmp_path / "sessions.db"), eng.config, eng.model_name, "serve", "")
        state = build_state(eng, keys, kv_events, report_full=report_full, recorder=rec)
        srv = ServerThread(state).start()
        made.append((srv, state, rec))
        return srv, state

    yield factory
    for srv, state, rec in made:
        srv.stop()
        close_state(state)
        if rec is not None:
            rec.close()


KEYS_TOML = """
[[keys]]
key = "sk-alice-0123456789"
user = "alice"
group = "team-a"

[[keys]]
key = "sk-bob-0123456789"
user = "bob"
group = "team-b"
admin = true
"""
ALICE = "sk-alice-0123456789"
BOB = "sk-bob-0123456789"
SYSTEM = "You are a careful assistant. " * 12


def keys(tmp_path):
    from kvplay.serve.keys import load_keys

    p = tmp_path / "keys.toml"
    p.write_text(KEYS_TOML)
    return load_keys(str(p))


def chat(client, url, key=None, content="hello", system=SYSTEM, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny:llama", "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0}
    body.update(extra)
    return client.post(url + "/v1/chat/completions", json=body, headers=headers)


def wait_until(pred, timeout=15.0):
    """Poll `pred` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False
