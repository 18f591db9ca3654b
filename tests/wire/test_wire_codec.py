"""vLLM's KV-event wire: encode/decode of map-tagged and legacy positional events, int and bytes
hashes, frames and the replay end marker."""
from __future__ import annotations

import hashlib

import msgpack
import pytest

from kvplay.wire.codec import (
    END_SEQ, END_SEQ_BYTES, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WireError,
    decode_batch, encode_batch, encode_frames, end_marker_frames, hash_hex,
    hex_to_wire_hash, pack_seq, parse_frames, replay_request, unpack_seq)


def _stored(**kw):
    base = dict(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                medium="GPU")
    base.update(kw)
    return BlockStored(**base)


def test_map_tagged_roundtrip_and_field_names():
    batch = EventBatch(1.5, [_stored(session_id="alice", kv_cache_spec_kind="full_attention"),
                             BlockRemoved([11], "GPU"), AllBlocksCleared()], 0)
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw[0] == 1.5 and raw[2] == 0 and len(raw) == 3
    stored, removed, cleared = raw[1]
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [11, 12] and stored["token_ids"] == list(range(8))
    assert stored["session_id"] == "alice" and stored["kv_cache_spec_kind"] == "full_attention"
    # fields without a default in vLLM's struct are always written (its decoder requires them) ...
    assert "lora_id" in stored and stored["lora_id"] is None and "lora_name" in stored
    assert "parent_block_hash" in stored and stored["parent_block_hash"] is None
    # ... defaulted ones only when set
    assert "extra_keys" not in stored and "group_idx" not in stored
    assert removed == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch


def test_batch_without_rank_is_two_elements():
    payload = encode_batch(EventBatch(2.0, [AllBlocksCleared()]))
    assert len(msgpack.unpackb(payload)) == 2
    assert decode_batch(payload).data_parallel_rank is None


def test_legacy_positional_events_decode():
    # vLLM <= 0.25 (array_like=True, tag=True): ["BlockStored", block_hashes, parent, token_ids,
    # block_size, lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]
    payload = msgpack.packb([3.25, [
        ["BlockStored", [5, 6], 4, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
        ["BlockRemoved", [5], "GPU"],
        ["AllBlocksCleared"],
    ], 0])
    b = decode_batch(payload)
    s, r, c = b.events
    assert isinstance(s, BlockStored) and s.block_hashes == [5, 6] and s.parent_block_hash == 4
    assert s.block_size == 4 and s.medium == "GPU" and s.session_id is None
    assert s.block_tokens(1) == [5, 6, 7, 8]
    assert isinstance(r, BlockRemoved) and r.block_hashes == [5] and r.medium == "GPU"
    assert isinstance(c, AllBlocksCleared)


def test_legacy_encode_matches_the_old_layout_and_roundtrips():
    batch = EventBatch(1.0, [_stored(parent_block_hash=3), BlockRemoved([11], "GPU")], 0)
    raw = msgpack.unpackb(encode_batch(batch, legacy=True), raw=False)
    assert raw[1][0] == ["BlockStored", [11, 12], 3, list(range(8)), 4, None, "GPU", None]
    assert raw[1][1] == ["BlockRemoved", [11], "GPU"]
    assert decode_batch(encode_batch(batch, legacy=True)) == batch


def test_bytes_hashes_decode_and_hex():
    digest = hashlib.sha256(b"x").digest()
    payload = encode_batch(EventBatch(0.0, [_stored(block_hashes=[digest], parent_block_hash=None)]))
    ev = decode_batch(payload).events[0]
    assert ev.block_hashes == [digest] and isinstance(ev.block_hashes[0], bytes)
    assert hash_hex(digest) == digest.hex()
    assert hash_hex(0xAB) == "00000000000000ab"
    # kvplay's hex hash as vLLM sends it: the low 64 bits, or the whole digest
    assert hex_to_wire_hash(digest.hex()) == int.from_bytes(digest[-8:], "big")
    assert hex_to_wire_hash(digest.hex(), as_int=False) == digest


def test_unknown_event_type_is_skipped_and_sglang_metadata_session():
    payload = msgpack.packb([0.0, [{"type": "SomethingNew", "x": 1},
                                   {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                    "token_ids": [1, 2], "block_size": 2,
                                    "metadata": {"session_id": "bob", "cache_salt": "s"}}]])
    b = decode_batch(payload)
    assert len(b.events) == 1 and b.events[0].session_id == "bob"
    assert b.unknown_events == 1 and b.bad_events == 0
    b = decode_batch(msgpack.packb([0.0, [["SomethingNew", 1, 2], {"type": 9}]]))
    assert b.events == [] and b.unknown_events == 1 and b.bad_events == 1


def test_sglang_metadata_session_in_a_batch_of_known_events():
    """The one-call decode of a batch of known events lifts SGLang's metadata session too, from
    bytes or any other buffer."""
    payload = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                    "token_ids": [1, 2], "block_size": 2, "medium": "GPU",
                                    "metadata": {"session_id": "bob", "cache_salt": "s"}},
                                   {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]])
    for buf in (payload, bytearray(payload), memoryview(payload)):
        b = decode_batch(buf)
        assert b.events[0].session_id == "bob" and b.bad_events == b.unknown_events == 0


@pytest.mark.parametrize("payload", [b"\xc1", b"", msgpack.packb({"a": 1}), msgpack.packb([1]),
                                     msgpack.packb(["x", []]), msgpack.packb([0.0, 7]),
                                     msgpack.packb([0.0, [], "rank"]), msgpack.packb([0.0, [], -1])])
def test_bad_payloads_raise_one_wire_error(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


GOOD = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
        "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


def _with(**kw):
    d = dict(GOOD)
    d.update(kw)
    return d


@pytest.mark.parametrize("bad", [
    7, "BlockStored", ["BlockStored"],                            # not an event
    _with(block_hashes=[[1, 2]]), _with(block_hashes=[{"a": 1}]), _with(block_hashes=5),
    _with(parent_block_hash=[1]), _with(block_hashes=[1.5]),
    _with(block_size="4"), _with(block_size=-1), _with(token_ids=7), _with(token_ids=["a"]),
    _with(session_id=["alice"]), _with(session_id={"x": 1}), _with(session_id="x" * (10 << 20)),
    _with(medium=3), _with(group_idx="0"), _with(block_hashes=[b"x" * 100]),
    _with(metadata={"session_id": 5}),
    {"type": "BlockRemoved", "block_hashes": [[1]], "medium": "GPU"},
    {"type": "BlockRemoved", "block_hashes": "ab"},
    ["BlockStored", [[1]], None, [1, 2], 2, None, "GPU"],        # legacy positional, bad hash
    ["BlockStored", [1], None, [1, 2], "2", None, "GPU"],
])
def test_a_wrongly_typed_event_is_skipped_and_counted(bad):
    """A bad event never reaches the mirror: it is dropped and counted on its batch; the good
    events of the same batch are kept."""
    b = decode_batch(msgpack.packb([1.0, [GOOD, bad, {"type": "AllBlocksCleared"}]], use_bin_type=True))
    assert b.bad_events == 1 and b.unknown_events == 0
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "AllBlocksCleared"]
    s = b.events[0]
    assert s.block_hashes == [1, 2] and s.block_size == 2 and s.session_id is None


def test_typed_fields_keep_every_publishers_forms():
    """uint64 (vLLM), signed int64 (SGLang) and bytes hashes; EAGLE token pairs; SGLang's
    positional array with the 8th {cache_salt} element and its metadata session."""
    digest = hashlib.sha256(b"y").digest()
    events = [_with(block_hashes=[2**64 - 1, -(2**63), digest], parent_block_hash=-5),
              _with(token_ids=[[1, 2], [3, 4], [5, 6], [7, 8]]),
              ["BlockStored", [9], None, [1, 2], 2, None, "GPU", {"cache_salt": "s", "session_id": "carol"}],
              _with(lora_id=None, medium="CPU_PINNED", cache_salt="s", session_id="dave")]
    b = decode_batch(msgpack.packb([1.0, events, 3], use_bin_type=True))
    assert b.bad_events == 0 and b.data_parallel_rank == 3
    a, eagle, legacy, sg = b.events
    assert a.block_hashes == [2**64 - 1, -(2**63), digest] and a.parent_block_hash == -5
    assert eagle.block_tokens(1) == [(5, 6), (7, 8)]
    assert legacy.block_hashes == [9] and legacy.session_id == "carol" and legacy.lora_name is None
    assert sg.session_id == "dave" and sg.medium == "CPU_PINNED"


def test_frames_seq_and_end_marker():
    assert pack_seq(0) == b"\x00" * 8 and pack_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert pack_seq(END_SEQ) == END_SEQ_BYTES and unpack_seq(END_SEQ_BYTES) == -1
    batch = EventBatch(1.0, [AllBlocksCleared()])
    live = encode_frames("kv-events", 7, batch)
    assert live[0] == b"kv-events" and live[1] == pack_seq(7)
    assert parse_frames(live) == (b"kv-events", 7, encode_batch(batch))
    # replay as a DEALER sees it: new (with topic) and old (without)
    assert parse_frames([b"", b"kv-events", pack_seq(7), b"p"]) == (b"kv-events", 7, b"p")
    assert parse_frames([b"", pack_seq(7), b"p"]) == (b"", 7, b"p")
    assert parse_frames([b""] + end_marker_frames("t")) == (b"t", -1, b"")
    assert replay_request(5) == [b"", pack_seq(5)]
    with pytest.raises(WireError):
        parse_frames([b"t", b"123", b"p"])
    with pytest.raises(WireError):
        unpack_seq(b"\x00")


def test_to_wire():
    """An engine batch in vLLM's form (wire/translate.to_wire, what kvplay serve publishes)."""
    from kvplay.engine.events import AllBlocksCleared as EC, BlockRemoved as ER, BlockStored as ES, EngineBatch
    from kvplay.wire.translate import to_wire

    h1, h0 = "ab" * 32, "cd" * 32
    out = to_wire(EngineBatch(1, 2.5, [ES(block_hashes=[h1], parent_block_hash=h0, token_ids=[1, 2], block_size=2,
                                          user="u"), ER(block_hashes=[h1]), EC()]))
    w = out.events[0]
    assert w.block_hashes == [int("ab" * 8, 16)] and w.parent_block_hash == int("cd" * 8, 16)
    assert w.session_id == "u" and w.medium == "GPU"
    assert isinstance(out.events[1], BlockRemoved) and isinstance(out.events[2], AllBlocksCleared)
    assert out.ts == 2.5


def test_decode_event_from_a_decoded_form_is_checked_too():
    """`decode_event` (JSONL traces) types its input like `decode_batch`: None for a type we do
    not know, one WireError line for a wrong type."""
    from kvplay.wire.codec import decode_event

    ev = decode_event({"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2,
                       "metadata": {"session_id": "bob"}})
    assert ev.block_hashes == [1] and ev.session_id == "bob"
    assert decode_event({"type": "SomethingNew"}) is None and decode_event(["SomethingNew", 1]) is None
    assert isinstance(decode_event(["AllBlocksCleared"]), AllBlocksCleared)
    for bad in ({"type": "BlockStored", "block_hashes": "ab"}, {"type": "BlockStored", "block_hashes": [1],
                                                                "block_size": "4"}, 7, ["BlockStored"]):
        with pytest.raises(WireError):
            decode_event(bad)
