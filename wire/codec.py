"""vLLM's KV events on the wire: the event types, msgpack encode/decode, and the ZMQ frames.

A message is three frames ``[topic, seq, payload]``: the topic as bytes (empty for ""), the
sequence number as 8 bytes big-endian (counting from 0 per publisher), and a msgpack
``EventBatch`` — a positional array ``[ts, events, data_parallel_rank]`` (the rank is left out
when it is None). A replay answer ends with a marker whose seq is -1 (eight 0xff bytes) and whose
payload is empty.

Events are msgpack maps tagged by ``"type"`` (vLLM since PR #42892, SGLang since #37482).
Older releases sent tagged positional arrays (``["BlockStored", block_hashes, parent, ...]``,
fields in declaration order; SGLang appended ``{"cache_salt": ...}`` as an 8th element):
`decode_batch` reads both. Block hashes are a uint64 by default (the low 64 bits of vLLM's
sha256 digest), a signed int64 (SGLang) or the full digest as bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); all decode, and are kept as they came.

**Typed at the boundary.** The event classes are msgspec structs and a payload is decoded
straight into them, so every field is checked for type and size before anything else sees it:
a hash that is a list, ``block_size: "4"``, ``token_ids: 7``, a list or a 10 MiB string as
``session_id`` is rejected. A bad *event* is skipped and counted on its batch
(``EventBatch.bad_events``), an event of a type we do not know is skipped and counted
(``unknown_events``); a payload that is not a batch at all raises `WireError` (one line).

Encoding follows vLLM's msgspec structs (``omit_defaults=True``): fields without a default
(``lora_id``, ``medium``, ``lora_name`` on BlockStored; ``medium`` on BlockRemoved) are always
written, even as nil, because vLLM's own decoder requires them; fields whose default is None are
left out when None. The wire as vLLM defines it: ``vllm/distributed/kv_events.py`` (the structs and
``ZmqEventPublisher``); as vLLM 0.32 sends it: tests/fixtures/vllm_capture*.msgpack, captured from
a real server by scripts/capture_vllm_events.py.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

import msgpack
import msgspec

from kvplay.engine.errors import EngineError
from kvplay.engine.events import MAX_BATCH_EVENTS, MAX_BLOCK_SIZE, MAX_EVENT_BLOCKS, MAX_EVENT_TOKENS

WireHash = Union[int, bytes]

END_SEQ = -1
END_SEQ_BYTES = b"\xff" * 8
MEDIUM_GPU = "GPU"

# Bounds on one decoded event or batch: the one set (engine/events.py), plus what only the wire
# has; a publisher's message is also capped at the socket (wire/subscriber.py MAX_MESSAGE_BYTES).
MAX_HASH_BYTES = 64          # vLLM's sha256 digest is 32
MAX_NAME = 256               # session ids, medium, LoRA names, spec kinds, localities

_Hash = Union[int, Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]
_Token = Union[int, tuple[int, int]]  # SGLang's EAGLE bigram pages send token pairs


class WireError(EngineError):
    """A frame or payload that is not a vLLM KV-event message (one line)."""


class SGLangMetadata(msgspec.Struct, gc=False):
    """SGLang's ``metadata`` map on BlockStored (``{cache_salt, session_id}``)."""
    session_id: Optional[_Name] = None
    cache_salt: Optional[_Name] = None


# --- event types (vLLM's names and field order) -------------------------------------------
class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """Full blocks entered the prefix cache (or, with kv_cache_report_mode "full", were reused)."""
    # Positional order of the legacy array encoding (= vLLM's declaration order).
    FIELDS: ClassVar[tuple] = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window")
    REQUIRED: ClassVar[tuple] = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium", "lora_name")
    # What a map-tagged event carries, in the order written.
    WIRE_FIELDS: ClassVar[tuple] = FIELDS + ("locality", "ownership", "session_id")

    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
    parent_block_hash: Optional[_Hash] = None
    token_ids: Annotated[list[_Token], msgspec.Meta(max_length=MAX_EVENT_TOKENS)] = []
    block_size: _Count = 0
    lora_id: Optional[int] = None
    medium: Optional[_Name] = None
    lora_name: Optional[_Name] = None
    extra_keys: Optional[Annotated[list, msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]] = None
    group_idx: Optional[_Count] = None
    kv_cache_spec_kind: Optional[_Name] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    session_id: Optional[_Name] = None
    locality: Optional[_Name] = None   # "LOCAL" | "REMOTE" relative to the publisher (vLLM >= 0.30)
    ownership: Optional[_Name] = None  # a secondary offloading tier's id
    metadata: Optional[SGLangMetadata] = None  # decode only (SGLang); its session_id is copied up

    def block_tokens(self, i: int) -> list:
        """Token ids of the i-th block of this event."""
        bs = self.block_size
        return self.token_ids[i * bs:(i + 1) * bs] if bs else []


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    """Blocks left the prefix cache (vLLM sends one event per evicted block)."""
    FIELDS: ClassVar[tuple] = ("block_hashes", "medium", "group_idx")
    REQUIRED: ClassVar[tuple] = ("block_hashes", "medium")
    WIRE_FIELDS: ClassVar[tuple] = FIELDS + ("locality", "ownership")

    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
    medium: Optional[_Name] = None
    group_idx: Optional[_Count] = None
    locality: Optional[_Name] = None
    ownership: Optional[_Name] = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    """The whole prefix cache was reset (``/reset_prefix_cache``)."""
    FIELDS: ClassVar[tuple] = ()
    REQUIRED: ClassVar[tuple] = ()
    WIRE_FIELDS: ClassVar[tuple] = ()


EVENT_CLASSES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, gc=False):
    """One engine step's events: ``[ts, events, data_parallel_rank]`` on the wire.

    `bad_events` and `unknown_events` count the events `decode_batch` skipped (wrongly typed or
    oversized; of a type we do not know); they are never encoded."""
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None
    bad_events: int = 0
    unknown_events: int = 0


# --- encode ---------------------------------------------------------------------------------
def event_to_wire(ev: WireEvent, legacy: bool = False) -> Any:
    """The msgpack-ready form of one event: a map tagged "type", or (legacy) a tagged array."""
    cls = type(ev)
    if legacy:
        vals = [getattr(ev, f) for f in cls.FIELDS]
        n = len(vals)  # msgspec's array_like + omit_defaults drops trailing default values
        while n > len(cls.REQUIRED) and vals[n - 1] is None:
            n -= 1
        return [cls.__name__, *vals[:n]]
    out: dict[str, Any] = {"type": cls.__name__}
    required = cls.REQUIRED
    for f in cls.WIRE_FIELDS:
        v = getattr(ev, f)
        if v is not None or f in required:
            out[f] = v
    return out


def encode_batch(batch: EventBatch, legacy: bool = False) -> bytes:
    """msgpack payload of one EventBatch (vLLM's current map-tagged events unless `legacy`)."""
    arr: list = [batch.ts, [event_to_wire(e, legacy) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        arr.append(batch.data_parallel_rank)
    return msgpack.packb(arr, use_bin_type=True)


# --- decode ---------------------------------------------------------------------------------
_Rank = Optional[Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]]
_Events = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]


class _BatchArray(msgspec.Struct, array_like=True):
    ts: float
    events: _Events
    data_parallel_rank: _Rank = None


class _BatchMap(msgspec.Struct):
    ts: float
    events: _Events
    data_parallel_rank: _Rank = None


class _TypedBatch(msgspec.Struct, array_like=True, gc=False):
    """The usual payload, decoded in one call: an array batch whose events are all map-tagged
    events of known types, every field valid (anything else falls back to one event at a time)."""
    ts: float
    events: Annotated[list[WireEvent], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]
    data_parallel_rank: _Rank = None


_BATCH_ARRAY = msgspec.msgpack.Decoder(_BatchArray)
_BATCH_MAP = msgspec.msgpack.Decoder(_BatchMap)
_BATCH_TYPED = msgspec.msgpack.Decoder(_TypedBatch)
_EVENT_MAP = msgspec.msgpack.Decoder(WireEvent)
_ANY = msgspec.msgpack.Decoder()


def _is_map(first: int) -> bool:
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


class _Unknown(Exception):
    """An event of a type this decoder does not know (newer publishers add some)."""


def _event_from_array(a: list) -> WireEvent:
    """A legacy positional event (already msgpack-decoded), checked like a map-tagged one."""
    if not a or not isinstance(a[0], str):
        raise WireError("a positional event starts with its type name")
    cls = EVENT_CLASSES.get(a[0])
    if cls is None:
        raise _Unknown(a[0])
    vals = list(a[1:])
    d: dict[str, Any] = {"type": a[0]}
    if cls is BlockStored and len(vals) == 7 and isinstance(vals[6], dict):
        d["metadata"] = vals.pop()  # SGLang's BlockStoredWithMetadata: {"cache_salt": ...} 8th
    d.update(zip(cls.FIELDS, vals))  # extra trailing values (newer fields) are dropped
    return msgspec.convert(d, cls)


def _lift_session(ev: WireEvent) -> WireEvent:
    if type(ev) is BlockStored and ev.metadata is not None and ev.session_id is None:
        ev.session_id = ev.metadata.session_id  # SGLang: metadata{cache_salt, session_id}
    return ev


def _decode_event(raw) -> WireEvent:
    mv = memoryview(raw)  # a msgspec.Raw: the event's bytes, not yet decoded
    first = mv[0] if len(mv) else 0xC1
    if _is_map(first):
        try:
            ev = _EVENT_MAP.decode(raw)
        except msgspec.ValidationError:
            tag = _ANY.decode(raw).get("type")
            if isinstance(tag, str) and tag not in EVENT_CLASSES:
                raise _Unknown(tag) from None
            raise
    elif _is_array(first):
        ev = _event_from_array(_ANY.decode(raw))
    else:
        raise WireError("an event must be a map or an array")
    return _lift_session(ev)


def decode_event(obj: Any) -> WireEvent | None:
    """One event from its already-decoded form (a map tagged "type", or a legacy positional
    array; e.g. a JSONL trace), checked like `decode_batch` checks one: None for a type we do not
    know, WireError (one line) for anything wrongly typed."""
    try:
        if isinstance(obj, dict):
            tag = obj.get("type")
            if isinstance(tag, str) and tag not in EVENT_CLASSES:
                return None
            return _lift_session(msgspec.convert(obj, WireEvent))
        if isinstance(obj, (list, tuple)):
            return _lift_session(_event_from_array(list(obj)))
    except _Unknown:
        return None
    except (msgspec.ValidationError, TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"bad event: {str(exc)[:120]}") from None
    raise WireError(f"an event must be a map or an array, got {type(obj).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """An EventBatch from its msgpack payload, every event checked (see the module doc): a bad or
    unknown event is skipped and counted on the batch. Raises WireError (one line) when the
    payload is not an EventBatch at all."""
    first = payload[0] if payload else 0xC1
    if _is_array(first):
        try:  # the usual case, in one call: every event map-tagged, known and valid
            t = _BATCH_TYPED.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # some event is legacy, unknown or bad (or the payload is no batch): one at a time
        else:
            for ev in t.events:
                if type(ev) is BlockStored and ev.metadata is not None:
                    _lift_session(ev)
            return EventBatch(t.ts, t.events, t.data_parallel_rank)
    try:
        if _is_array(first):
            b = _BATCH_ARRAY.decode(payload)
        elif _is_map(first):  # tolerate a map-encoded batch
            b = _BATCH_MAP.decode(payload)
        else:
            raise WireError("payload is not an EventBatch [ts, events, rank]")
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError(f"payload is not an EventBatch [ts, events, rank]: {str(exc)[:120]}") from None
    out = []
    bad = unknown = 0
    for raw in b.events:
        try:
            out.append(_decode_event(raw))
        except _Unknown:
            unknown += 1
        except (WireError, msgspec.DecodeError, msgspec.ValidationError, RecursionError, TypeError, ValueError,
                AttributeError):
            bad += 1
    return EventBatch(b.ts, out, b.data_parallel_rank, bad, unknown)


# --- hashes ---------------------------------------------------------------------------------
def hash_hex(h: WireHash | str | None) -> str | None:
    """A wire hash as lowercase hex (ints as 16 hex digits: vLLM's uint64 form)."""
    if type(h) is int:  # the usual case first: a mirror converts one per block
        return "%016x" % (h & 0xFFFFFFFFFFFFFFFF)
    if h is None:
        return None
    if isinstance(h, int):
        return "%016x" % (h & 0xFFFFFFFFFFFFFFFF)
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    return str(h)


def hex_to_wire_hash(hexstr: str | None, as_int: bool = True) -> WireHash | None:
    """kvplay's hex hash as vLLM sends it: the low 64 bits as an int (vLLM's default), or the
    whole digest as bytes (``as_int=False``, like VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    if hexstr is None:
        return None
    if len(hexstr) % 2:
        hexstr = "0" + hexstr
    raw = bytes.fromhex(hexstr)
    return int.from_bytes(raw[-8:], "big") if as_int else raw


# --- frames ---------------------------------------------------------------------------------
def pack_seq(seq: int) -> bytes:
    """8-byte big-endian seq (-1, the replay end marker, is eight 0xff bytes)."""
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(b: bytes) -> int:
    if len(b) != 8:
        raise WireError(f"a seq frame has 8 bytes, got {len(b)}")
    return int.from_bytes(b, "big", signed=True)


def topic_bytes(topic: str | bytes | None) -> bytes:
    if topic is None:
        return b""
    return topic if isinstance(topic, bytes) else topic.encode("utf-8")


def encode_frames(topic: str | bytes | None, seq: int, batch: EventBatch | bytes, legacy: bool = False) -> list[bytes]:
    """The live message ``[topic, seq8, payload]`` (batch may already be an encoded payload)."""
    payload = batch if isinstance(batch, (bytes, bytearray)) else encode_batch(batch, legacy)
    return [topic_bytes(topic), pack_seq(seq), bytes(payload)]


def end_marker_frames(topic: str | bytes | None = None) -> list[bytes]:
    """The replay end marker (after the DEALER's empty delimiter): ``[topic, -1, b""]``."""
    return [topic_bytes(topic), END_SEQ_BYTES, b""]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to vLLM's replay ROUTER to get every buffered batch with seq >= start."""
    return [b"", pack_seq(start_seq)]


def parse_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) from a live message or a replay answer as a DEALER sees it.

    Live: ``[topic, seq8, payload]``. Replay: ``[b"", topic, seq8, payload]`` (vLLM >= 0.26) or
    ``[b"", seq8, payload]`` (older, no topic). The end marker has seq -1 and an empty payload.
    """
    n = len(frames)
    if n == 3:
        a, b, c = frames
        if len(b) == 8:
            return bytes(a), unpack_seq(b), c
        raise WireError(f"bad KV-event message: seq frame of {len(b)} bytes")
    if n == 4 and len(frames[0]) == 0:
        return bytes(frames[1]), unpack_seq(frames[2]), frames[3]
    if n == 2 and len(frames[0]) == 8:  # [seq, payload] (a ROUTER answer without delimiter/topic)
        return b"", unpack_seq(frames[0]), frames[1]
    raise WireError(f"bad KV-event message: {n} frames")
