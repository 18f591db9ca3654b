"""Talking to `kvplay serve` (the `serve` fixture, tests/conftest.py): two users' API keys, a chat
turn over HTTP."""
from __future__ import annotations

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

