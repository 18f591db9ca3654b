"""What a real vLLM 0.32 sent (tests/fixtures/vllm_capture*.msgpack, made by
scripts/capture_vllm_events.py): the frames decode, the seqs count from 0, the mirror matches
vLLM's own usage and /metrics, every block hash is vLLM's sha256_cbor of its tokens, and the
replay answer is the same bytes as the live stream, closed by the end marker."""
from __future__ import annotations

import msgpack
import pytest

from support import FIXTURES

from kvplay.engine.cbor_hash import block_hash, none_hash
from kvplay.wire.codec import AllBlocksCleared, BlockStored, decode_batch, parse_frames
from kvplay.wire.mirror import Mirror
from kvplay.wire.translate import FromWire

CAPTURES = sorted(FIXTURES.glob("vllm_capture*.msgpack"))


@pytest.fixture(params=CAPTURES, ids=[p.stem for p in CAPTURES])
def capture(request):
    return msgpack.unpackb(request.param.read_bytes(), raw=False)


def live(doc):
    return [parse_frames(f) for f in doc["frames"]]


def test_there_is_a_capture():
    assert any(p.name == "vllm_capture.msgpack" for p in CAPTURES), "run scripts/capture_vllm_events.py"


def test_frames_are_vllms_wire(capture):
    frames = live(capture)
    assert [seq for _, seq, _ in frames] == list(range(len(frames)))  # from 0, no gap
    assert {topic for topic, _, _ in frames} == {b"kv-events"}
    kinds = set()
    for _, _, payload in frames:
        raw = msgpack.unpackb(payload, raw=False)
        assert isinstance(raw, list) and isinstance(raw[0], float)  # [ts, events, rank]
        for e in raw[1]:
            assert isinstance(e, dict) and "type" in e  # map-tagged events (vLLM >= PR #42892)
            kinds.add(e["type"])
            if e["type"] == "BlockStored":
                assert e["block_size"] == capture["block_size"] and e["medium"] == "GPU"
                assert e["session_id"] in ("alice", "bob")
                assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
                want = int if capture["int_hashes"] else bytes
                assert all(isinstance(h, want) for h in e["block_hashes"])
    assert {"BlockStored", "AllBlocksCleared"} <= kinds


def test_mirror_matches_vllms_usage_and_metrics(capture):
    m = Mirror(pod="vllm")
    w = FromWire(m)
    bs = capture["block_size"]
    per_batch = []
    for _, seq, payload in live(capture):
        before = m.reannounced
        b = decode_batch(payload)
        m.apply(w(b, seq))
        per_batch.append((b, m.reannounced - before))
    alice, bob, bob_again = capture["requests"]
    assert bob["cached_tokens"] > 0 and bob_again["cached_tokens"] == 0  # the reset emptied the cache
    # report mode "full": what bob reused was re-announced with his session_id, block for block
    assert m.reannounced * bs == bob["cached_tokens"]
    assert m.cleared == 1
    # after the reset only bob's last request's blocks are cached
    assert set(m.by_session) == {"bob"} and m.creators() == {"bob": len(m.blocks)}
    assert len(m.blocks) >= bob_again["prompt_tokens"] // bs
    assert m.stored_by_session["alice"] >= alice["prompt_tokens"] // bs
    # vLLM's own counters agree: hit tokens = re-announced blocks
    assert capture["metrics"]["vllm:prefix_cache_hits_total"] == bob["cached_tokens"]


def test_every_block_hash_is_vllms_sha256_cbor_of_its_tokens(capture):
    root = none_hash(capture["pythonhashseed"])
    digests: dict = {}  # wire hash -> full digest
    checked = 0
    for _, _, payload in live(capture):
        for ev in decode_batch(payload).events:
            if isinstance(ev, AllBlocksCleared) or not isinstance(ev, BlockStored):
                continue
            parent = None if ev.parent_block_hash is None else digests[ev.parent_block_hash]
            for i, h in enumerate(ev.block_hashes):
                d = block_hash(parent, ev.block_tokens(i), None, root)
                assert (int.from_bytes(d[-8:], "big") if capture["int_hashes"] else d) == h
                digests[h] = parent = d
                checked += 1
    assert checked > 0


def test_replay_answer_is_the_live_stream_and_ends_with_the_marker(capture):
    payload_of = {seq: p for _, seq, p in live(capture)}
    replay = [parse_frames([b""] + f) for f in capture["replay"]]
    *batches, end = replay
    assert end[1] == -1 and end[2] == b""
    start = capture["replay_from"]
    assert [seq for _, seq, _ in batches] == list(range(start, start + len(batches)))
    assert all(payload_of[seq] == p for _, seq, p in batches if seq in payload_of)
    assert {t for t, _, _ in batches} == {b"kv-events"}  # vLLM >= 0.26 sends the topic in replays
