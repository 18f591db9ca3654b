"""KV events from `kvplay serve`, read by an independent subscriber (pyzmq + msgpack only, no
kvplay code), checked against the engine's own block changes; replay and the end marker; vLLM's
sha256_cbor; and (marked `vllm`) decoding with vLLM's own msgspec types."""
from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import msgpack
import pytest
import zmq

from support import FIXTURES, tool_venv
from support.pool_view import block_view
from support.serve import ALICE, BOB, chat, keys
from support.subscribe import Handshakes, subscribed
from support.wait import wait_for

VLLM_PY = str(tool_venv("KVPLAY_VLLM_VENV", "vllm-venv") / "bin" / "python")


# --- an independent consumer: what any vLLM KV-event subscriber does ----------------------------
class Sub:
    """Connected: returns once its handshake with the publisher is done (its subscription is on
    its way: support/subscribe.py). Bound: `handshakes.wait()` once the publisher connects."""

    def __init__(self, endpoint: str, bind: bool = False):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.handshakes = Handshakes(self.sock)
            self.sock.bind(endpoint)
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            subscribed(self.sock, endpoint)
        self.batches: list[tuple[bytes, int, list]] = []

    def drain(self, until=None, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.batches.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
            elif until is None or until(self):
                return self
        return self

    def events(self):
        return [ev for _, _, (ts, evs, rank) in self.batches for ev in evs]

    def close(self):
        if hasattr(self, "handshakes"):
            self.handshakes.close()
        self.sock.close()
        self.ctx.term()


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while d.poll(5000):
            frames = d.recv_multipart()
            out.append(frames)
            if frames[2] == b"\xff" * 8:
                break
    finally:
        d.close()
        ctx.term()
    return out


def events_config(**kw):
    from kvplay.wire.publisher import KVEventsConfig

    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
           "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv-events"}
    cfg.update(kw)
    return KVEventsConfig.from_json(json.dumps(cfg))


def low64(hexstr: str) -> int:
    return int(hexstr, 16) & 0xFFFFFFFFFFFFFFFF


# --- tests -----------------------------------------------------------------------------------
def test_sha256_cbor_matches_vllm_vector():
    """Digests computed by vLLM 0.32's hash_block_tokens(sha256_cbor) for tokens 0..31
    (block size 16, PYTHONHASHSEED unset)."""
    from kvplay.engine.prefix import BlockHasher

    if os.environ.get("PYTHONHASHSEED") is not None:
        pytest.skip("PYTHONHASHSEED is set: vLLM's NONE_HASH follows it")
    hs = BlockHasher("sha256_cbor", 16).chain(list(range(32)), [[("model", "any")], []])
    assert [format(h, "064x") for h in hs] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"]
    salted = BlockHasher("sha256_cbor", 16).chain(list(range(16)), [[("model", "m"), ("salt", "user:a")]])
    assert salted[0] != hs[0]


def test_kv_events_config_is_vllms():
    from kvplay.engine.errors import EngineError
    from kvplay.wire.publisher import KVEventsConfig, is_bind_endpoint, loopback_only

    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    assert not KVEventsConfig.from_json('{"endpoint": "tcp://*:1"}').enabled
    for bad in ('[1]', '{"enable_kv_cache_events": "yes"}', '{"endpont": "x"}', '{"publisher": "kafka"}',
                '{"buffer_steps": 0}', '{"endpoint": "http://x"}'):
        with pytest.raises(EngineError):
            KVEventsConfig.from_json(bad)
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557") and is_bind_endpoint("ipc://kvplay-events.sock")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")
    assert loopback_only("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert loopback_only("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"


def test_subscriber_sees_the_engines_blocks_and_replays(serve, tmp_path):
    srv, state = serve(keys=keys(tmp_path), kv_events=events_config())
    pub = state.side.events.publisher
    assert pub.binds  # "*" in the endpoint: bound, like vLLM
    sub = Sub(pub.endpoint)
    eng = state.side.engine
    with httpx.Client(timeout=30) as c:
        a = chat(c, srv.url, ALICE, "first")
        sub.drain(until=lambda s: any(e.get("session_id") == "alice" for e in s.events()))
        stored_by_engine = {low64(b.hash): b for b in eng.call(lambda: [block_view(eng.pool, b) for b in range(eng.num_blocks)]) if b.hash is not None and b.state != "free"}
        b = chat(c, srv.url, BOB, "second", vllm_xargs={"kv_cache_report_mode": "full"})
        sub.drain(until=lambda s: sum(e.get("session_id") == "bob" for e in s.events()) >= 2)
        assert c.post(srv.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {BOB}"}).status_code == 200
        sub.drain(until=lambda s: any(e["type"] == "AllBlocksCleared" for e in s.events()))
    evs = sub.events()
    # frames: topic, seq counting from 0 without gaps, EventBatch [ts, events, rank 0]
    assert [s for _, s, _ in sub.batches] == list(range(len(sub.batches)))
    assert all(t == b"kv-events" and isinstance(p[0], float) and p[2] == 0 for t, _, p in sub.batches)
    alice = [e for e in evs if e["type"] == "BlockStored" and e["session_id"] == "alice"]
    # alice's blocks: exactly what the engine stored, hashes = low 64 bits of the engine's, in one chain
    got = [h for e in alice for h in e["block_hashes"]]
    u = a.json()["usage"]  # every full block whose K/V was computed: prompt and reply but the last token
    assert set(got) == set(stored_by_engine) and len(got) == (u["prompt_tokens"] + u["completion_tokens"] - 1) // 16
    for e in alice:
        assert e["block_size"] == 16 and e["medium"] == "GPU" and "lora_id" in e and "lora_name" in e
        assert e["extra_keys"] == [None] * len(e["block_hashes"])  # as vLLM: one entry per block
        assert e["group_idx"] == 0 and e["kv_cache_spec_kind"] == "full_attention"
        for i, h in enumerate(e["block_hashes"]):
            assert tuple(e["token_ids"][i * 16:(i + 1) * 16]) == stored_by_engine[h].token_ids
    assert alice[0]["parent_block_hash"] is None
    # bob reused alice's prefix: re-announced with bob's session_id ("full"), then his new blocks
    bob = [e for e in evs if e["type"] == "BlockStored" and e["session_id"] == "bob"]
    cached = b.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert bob[0]["block_hashes"] == got[:cached // 16] and bob[0]["parent_block_hash"] is None
    assert bob[1]["parent_block_hash"] == bob[0]["block_hashes"][-1]
    assert evs[-1] == {"type": "AllBlocksCleared"}
    # replay from a past seq: the same payloads, then the end marker (seq -1, empty payload)
    frames = replay(pub.replay_endpoint, 1)
    assert frames[-1] == [b"", b"", b"\xff" * 8, b""]
    replayed = [(f[1], int.from_bytes(f[2], "big"), msgpack.unpackb(f[3])) for f in frames[:-1]]
    assert replayed == sub.batches[1:]
    assert replay(pub.replay_endpoint, 10 ** 6) == [[b"", b"", b"\xff" * 8, b""]]
    sub.close()


def test_evictions_are_one_removed_event_per_block(serve):
    srv, state = serve(num_blocks=10, kv_events=events_config(topic=""))
    sub = Sub(state.side.events.publisher.endpoint)
    with httpx.Client(timeout=30) as c:
        for i in range(4):  # 4 different ~70-token prompts through a 10-block pool
            assert chat(c, srv.url, content=f"{i} " * 20, system=f"system {i} " * 4, user=f"u{i}").status_code == 200
    evicted = state.side.engine.stats()["evictions"]
    sub.drain(until=lambda s: sum(e["type"] == "BlockRemoved" for e in s.events()) >= evicted)
    removed = [e for e in sub.events() if e["type"] == "BlockRemoved"]
    assert evicted > 0 and len(removed) == evicted
    assert all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" and e["group_idx"] == 0 for e in removed)
    stored = {h for e in sub.events() if e["type"] == "BlockStored" for h in e["block_hashes"]}
    assert all(e["block_hashes"][0] in stored for e in removed)
    # one step's removals come before that step's stores
    for _, _, (_, evs, _) in sub.batches:
        kinds = [e["type"] for e in evs]
        if "BlockRemoved" in kinds and "BlockStored" in kinds:
            assert max(i for i, k in enumerate(kinds) if k == "BlockRemoved") < kinds.index("BlockStored")
    sub.close()


def test_pub_connects_when_the_endpoint_is_not_a_wildcard(serve):
    sub = Sub("tcp://127.0.0.1:*", bind=True)  # vLLM semantics: the subscriber binds
    srv, state = serve(kv_events=events_config(endpoint=sub.endpoint, replay_endpoint=None))
    assert not state.side.events.publisher.binds
    sub.handshakes.wait()  # the publisher has connected
    # A connecting PUB learns of the subscription only once it sends (libzmq; vLLM's publisher is
    # the same): the very first batch can be lost, and a consumer replays it. Later ones arrive.
    with httpx.Client(timeout=30) as c:
        for i in range(5):
            chat(c, srv.url, content=f"turn {i}", user="zed")
            if sub.drain(until=lambda s: bool(s.batches), timeout=1.0).batches:
                break
    sub.drain(until=lambda s: any(e.get("session_id") == "zed" for e in s.events()))
    assert any(e.get("session_id") == "zed" for e in sub.events())
    assert [s for _, s, _ in sub.batches] == list(range(sub.batches[0][1], sub.batches[0][1] + len(sub.batches)))
    sub.close()


@pytest.mark.vllm
def test_vllm_decodes_our_events_and_hashes_agree(serve, tmp_path):
    if not os.path.exists(VLLM_PY):
        pytest.skip("no vLLM venv (scripts/vllm-cpu.sh setup)")
    srv, state = serve(kv_events=events_config(), hash="sha256_cbor")
    sub = Sub(state.side.events.publisher.endpoint)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, user="ann")
        chat(c, srv.url, content="again", user="ben", vllm_xargs={"kv_cache_report_mode": "full"})
    sub.drain(until=lambda s: any(e.get("session_id") == "ben" for e in s.events()))
    cap = tmp_path / "payloads.msgpack"
    cap.write_bytes(msgpack.packb([msgpack.packb(p) for _, _, p in sub.batches]))
    script = f"""
import os, sys, msgspec
os.environ.pop("PYTHONHASHSEED", None)
from vllm.distributed.kv_events import KVEventBatch, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
k.init_none_hash(sha256_cbor)
dec = msgspec.msgpack.Decoder(KVEventBatch)
n = checked = 0
digests = {{}}
sessions = set()
for raw in msgspec.msgpack.decode(open({str(cap)!r}, "rb").read()):
    batch = dec.decode(raw)
    for ev in batch.events:
        n += 1
        if not isinstance(ev, BlockStored):
            continue
        sessions.add(ev.session_id)
        parent = digests.get(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        for i, h in enumerate(ev.block_hashes):
            d = k.hash_block_tokens(sha256_cbor, parent, ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size], None)
            assert k.maybe_convert_block_hash(d) == h, (i, h)
            digests[h] = parent = d
            checked += 1
print(n, checked, ",".join(sorted(sessions)))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([VLLM_PY, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    n, checked, sessions = out.stdout.split()[-3:]
    assert int(checked) >= 8 and int(n) >= 2 and sessions == "ann,ben"
    sub.close()


def test_full_report_mode_as_the_server_default(serve):
    srv, state = serve(kv_events=events_config(), report_full=True)
    sub = Sub(state.side.events.publisher.endpoint)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, user="ann")
        chat(c, srv.url, content="other", user="ben")  # the default: reuse re-announced
        chat(c, srv.url, content="third", user="cid", vllm_xargs={"kv_cache_report_mode": "incremental"})
        chat(c, srv.url, content="fourth", user="dan")
    sub.drain(until=lambda s: any(e.get("session_id") == "dan" for e in s.events()))
    first = {}
    for e in sub.events():
        if e["type"] == "BlockStored":
            first.setdefault(e["session_id"], e)
    ann = [h for e in sub.events() if e.get("session_id") == "ann" for h in e["block_hashes"]]
    assert first["ben"]["parent_block_hash"] is None and first["ben"]["block_hashes"] == ann[:len(first["ben"]["block_hashes"])]
    assert first["dan"]["parent_block_hash"] is None
    assert first["cid"]["parent_block_hash"] is not None  # only cid's new blocks, chained on the reused prefix
    sub.close()


def test_publisher_keeps_the_last_buffer_steps_batches():
    from kvplay.wire.codec import AllBlocksCleared, BlockRemoved, EventBatch
    from kvplay.wire.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3, topic="t")
    try:
        for i in range(5):
            pub.publish(EventBatch(float(i), [BlockRemoved([i], "GPU")] if i % 2 else [AllBlocksCleared()]))
        wait_for(lambda: pub.next_seq >= 5, 10)
        frames = replay(pub.replay_endpoint, 0)
    finally:
        pub.shutdown()
    assert [int.from_bytes(f[2], "big", signed=True) for f in frames] == [2, 3, 4, -1]
    assert all(f[1] == b"t" for f in frames[:-1]) and frames[-1] == [b"", b"", b"\xff" * 8, b""]
    assert msgpack.unpackb(frames[1][3]) == [3.0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}], 0]


def test_a_salted_block_carries_its_salt_in_extra_keys(serve, tmp_path):
    srv, state = serve(keys=keys(tmp_path), isolation="user", kv_events=events_config())
    sub = Sub(state.side.events.publisher.endpoint)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "mine")
    sub.drain(until=lambda s: any(e.get("session_id") == "alice" for e in s.events()))
    first = next(e for e in sub.events() if e["type"] == "BlockStored")
    salt = first["extra_keys"][0]
    assert len(salt) == 1 and "alice" in salt[0]  # vLLM's untagged cache_salt entry, in block 0 only
    assert first["extra_keys"][1:] == [None] * (len(first["block_hashes"]) - 1)
    sub.close()


@pytest.mark.slow
def test_same_events_as_a_real_vllm_for_the_same_chats(serve, smollm, monkeypatch):
    """Replays the scenario of tests/fixtures/vllm_capture.msgpack (recorded from vLLM 0.32 by
    scripts/capture_vllm_events.py) against kvplay serve on the same model, block size and hash:
    the decoded events (hashes, parents, tokens, session ids, extra keys) and usage are vLLM's."""
    cap = msgpack.unpackb((FIXTURES / "vllm_capture.msgpack").read_bytes(),
                          strict_map_key=False)
    monkeypatch.setenv("PYTHONHASHSEED", cap["pythonhashseed"])  # vLLM's NONE_HASH seed at capture time
    srv, state = serve(loaded=smollm, model="default", num_blocks=None, cache_mb=64, block_size=cap["block_size"],
                       hash="sha256_cbor", kv_events=events_config())
    sub = Sub(state.side.events.publisher.endpoint)
    usages = []
    with httpx.Client(timeout=300) as c:
        def turn(user, text):
            r = c.post(srv.url + "/v1/chat/completions", json={
                "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "session_id": user, "user": user,
                "vllm_xargs": {"kv_cache_report_mode": "full"},
                "messages": [{"role": "system", "content": cap["system_prompt"]}, {"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            usages.append({"user": user, "prompt_tokens": r.json()["usage"]["prompt_tokens"],
                           "cached_tokens": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                           "reply": r.json()["choices"][0]["message"]["content"]})
        turn("alice", "When do you open on Sundays?")
        turn("bob", "Do you sell rye bread?")
        assert c.post(srv.url + "/reset_prefix_cache").status_code == 200
        turn("bob", "Do you sell rye bread?")
    want = [ev for _, _, p in cap["frames"] for ev in msgpack.unpackb(p, strict_map_key=False)[1]]
    sub.drain(until=lambda s: len(s.events()) >= len(want))
    assert sub.events() == want
    assert usages == [{k: r[k] for k in ("user", "prompt_tokens", "cached_tokens", "reply")} for r in cap["requests"]]
    sub.close()
