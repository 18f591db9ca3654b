"""`kvplay watch` on a real vLLM CPU server (scripts/vllm-cpu.sh): two users chat, a batch is
lost in transit (replayed), vLLM is killed and restarted; the mirror agrees with vLLM's usage
and /metrics, and holds no block of the dead server."""
from __future__ import annotations

import json
import time

import pytest

from support.recorded import recorded
from support.vllm import VllmServer, chat, hits_total
from support.watch import Watch

from kvplay.engine.cbor_hash import block_hash, none_hash


def quiet(w, seconds=2.0, timeout=60):
    """Read watch's JSON lines until none came for `seconds` (vLLM publishes after each step)."""
    got = []
    end = time.monotonic() + timeout
    last = time.monotonic()
    while time.monotonic() < end and time.monotonic() - last < seconds:
        try:
            got.append(json.loads(w.lines.get(timeout=0.1)))
            last = time.monotonic()
        except Exception:
            pass
    return got


@pytest.mark.vllm
def test_watch_real_vllm_gap_and_restart(tmp_path, free_port):
    vllm = VllmServer(tmp_path, free_port)
    ev, rep_ep, base = vllm.events, vllm.replay, vllm.base
    db = tmp_path / "s.db"

    # vLLM connects to a non-wildcard endpoint, so watch binds; seq 1 (bob's) is lost in transit
    w = Watch("--events-bind", ev, "--replay", rep_ep, "--pod", "vllm", "--topic", "kv-events", "--json",
              "--db", str(db), "--drop", "vllm:1")
    try:
        w.wait_err("recording")
        vllm.start()
        alice = chat(base, "alice", "When do you open on Sundays?")
        bob = chat(base, "bob", "Do you sell rye bread?")
        again = chat(base, "alice", "And cakes?")  # a later batch: only it reveals the lost one
        first = quiet(w)
        hits = hits_total(base)
        assert bob[1] > 0 and hits == alice[1] + bob[1] + again[1]
        assert any(d.get("replayed") for d in first), (first, w.err)  # the lost batch came back by replay
        # kill vLLM and start it again: a new publisher, seq from 0, an empty cache
        vllm("stop")
        vllm.start()
        carol = chat(base, "carol", "Can I order a cake?")
        quiet(w)
        rest = w.stop()
    finally:
        if w.p.poll() is None:
            w.p.kill()
        vllm.stop()
    assert w.p.returncode == 0, w.err
    pod = rest[-1]["pods"]["vllm"]
    assert pod["restarts"] == 1 and pod["gaps"] >= 1 and pod["replayed"] >= 1
    # nothing of the dead server is left; carol's blocks are all there
    assert set(pod["by_session"]) == {"carol"} and pod["blocks"] >= carol[0] // 32
    assert carol[1] == 0
    # before the restart: bob's re-announced blocks are exactly what vLLM said it reused
    rows = [(e["kind"], e.get("user"), json.dumps(e)) for e in recorded(db)]
    restart_at = [i for i, r in enumerate(rows) if r[0] == "AllBlocksCleared"
                  and json.loads(r[2])["reason"] == "publisher restarted"]
    assert len(restart_at) == 1
    before = rows[:restart_at[0]]
    bob_hit = sum(json.loads(p)["cached_tokens"] for k, u, p in before if k == "BlockHit" and u == "bob")
    assert bob_hit == bob[1]
    # every recorded block's hash is vLLM's sha256_cbor of its tokens under its parent
    root = none_hash("0")  # scripts/vllm-cpu.sh runs vLLM with PYTHONHASHSEED=0
    digests, checked = {}, 0
    for k, _u, p in rows:
        if k != "BlockStored":
            continue
        d = json.loads(p)
        parent = None if d["parent_block_hash"] is None else digests.get(d["parent_block_hash"])
        if d["parent_block_hash"] is not None and parent is None:
            continue  # parent stored before a batch we could not see
        bs = d["block_size"]
        for i, h in enumerate(d["block_hashes"]):  # a chain of new blocks is one event
            parent = block_hash(parent, d["token_ids"][i * bs:(i + 1) * bs], None, root)
            assert int.from_bytes(parent[-8:], "big") == h  # recorded as vLLM sent it: the digest's low 64 bits
            digests[h] = parent
            checked += 1
    # alice's blocks before the restart and carol's after it (the same system prompt hashes the same)
    assert checked >= alice[0] // 32 + carol[0] // 32
