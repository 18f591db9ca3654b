"""vLLM's KV events on the wire: the event types, msgpack encode/decode, and the ZMQ frames.

A message is three frames ``[topic, seq, payload]``: the topic as bytes (empty for ""), the
sequence number as 8 bytes big-endian (counting from 0 per publisher), and a msgpack
``EventBatch`` — a positional array ``[ts, events, data_parallel_rank]`` (the rank is left out
when it is None). A replay answer ends with a marker whose seq is -1 (eight 0xff bytes) and whose
payload is empty.

Events are msgpack maps tagged by ``"type"`` (vLLM since PR #42892, SGLang since #37482).
Older releases sent tagged positional arrays (``["BlockStored", block_hashes, parent, ...]``,
fields in declaration order): `decode_batch` reads both. Block hashes are a uint64 by default
(the low 64 bits of vLLM's sha256 digest) or the full digest as bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); both decode, and are kept as they came.

Encoding follows vLLM's msgspec structs (``omit_defaults=True``): fields without a default
(``lora_id``, ``medium``, ``lora_name`` on BlockStored; ``medium`` on BlockRemoved) are always
written, even as nil, because vLLM's own decoder requires them; fields whose default is None are
left out when None. See /work/shared/research/vllm-wire.md for the observed wire.
"""
from __future__ import annotations

from typing import Any, Union

import msgpack

from kvplay.engine.errors import EngineError

WireHash = Union[int, bytes]

END_SEQ = -1
END_SEQ_BYTES = b"\xff" * 8
MEDIUM_GPU = "GPU"


class WireError(EngineError):
    """A frame or payload that is not a vLLM KV-event message (one line)."""


# --- event types (vLLM's names and field order) -------------------------------------------
class BlockStored:
    """Full blocks entered the prefix cache (or, with kv_cache_report_mode "full", were reused)."""
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
    # Positional order of the legacy array encoding (= vLLM's declaration order).
    FIELDS = __slots__[:11]
    REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                "lora_name")

    def __init__(self, block_hashes: list[WireHash], parent_block_hash: WireHash | None = None,
                 token_ids: list[int] | None = None, block_size: int = 0, lora_id: int | None = None,
                 medium: str | None = None, lora_name: str | None = None,
                 extra_keys: list | None = None, group_idx: int | None = None,
                 kv_cache_spec_kind: str | None = None, kv_cache_spec_sliding_window: int | None = None,
                 session_id: str | None = None, locality: str | None = None, ownership: str | None = None):
        self.block_hashes = block_hashes
        self.parent_block_hash = parent_block_hash
        self.token_ids = [] if token_ids is None else token_ids
        self.block_size = block_size
        self.lora_id = lora_id
        self.medium = medium
        self.lora_name = lora_name
        self.extra_keys = extra_keys
        self.group_idx = group_idx
        self.kv_cache_spec_kind = kv_cache_spec_kind
        self.kv_cache_spec_sliding_window = kv_cache_spec_sliding_window
        self.locality = locality  # "LOCAL" | "REMOTE" relative to the publisher (vLLM >= 0.30)
        self.ownership = ownership  # a secondary offloading tier's id
        self.session_id = session_id

    def block_tokens(self, i: int) -> list[int]:
        """Token ids of the i-th block of this event."""
        bs = self.block_size
        return self.token_ids[i * bs:(i + 1) * bs] if bs else []


class BlockRemoved:
    """Blocks left the prefix cache (vLLM sends one event per evicted block)."""
    __slots__ = ("block_hashes", "medium", "group_idx", "locality", "ownership")
    FIELDS = __slots__[:3]
    REQUIRED = ("block_hashes", "medium")

    def __init__(self, block_hashes: list[WireHash], medium: str | None = None, group_idx: int | None = None,
                 locality: str | None = None, ownership: str | None = None):
        self.block_hashes = block_hashes
        self.medium = medium
        self.group_idx = group_idx
        self.locality = locality
        self.ownership = ownership


class AllBlocksCleared:
    """The whole prefix cache was reset (``/reset_prefix_cache``)."""
    __slots__ = ()
    FIELDS = ()
    REQUIRED = ()


EVENT_CLASSES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def _eq(a, b) -> bool:
    return type(a) is type(b) and all(getattr(a, f) == getattr(b, f) for f in type(a).__slots__)


def _repr(self) -> str:
    body = ", ".join(f"{f}={getattr(self, f)!r}" for f in type(self).__slots__ if getattr(self, f) is not None)
    return f"{type(self).__name__}({body})"


for _cls in EVENT_CLASSES.values():
    _cls.__eq__ = _eq
    _cls.__repr__ = _repr
    _cls.__hash__ = None


class EventBatch:
    """One engine step's events: ``[ts, events, data_parallel_rank]`` on the wire."""
    __slots__ = ("ts", "events", "data_parallel_rank")

    def __init__(self, ts: float, events: list, data_parallel_rank: int | None = None):
        self.ts = ts
        self.events = events
        self.data_parallel_rank = data_parallel_rank

    def __eq__(self, other) -> bool:
        return (isinstance(other, EventBatch) and self.ts == other.ts and self.events == other.events
                and self.data_parallel_rank == other.data_parallel_rank)

    __hash__ = None

    def __repr__(self) -> str:
        return f"EventBatch(ts={self.ts!r}, events={self.events!r}, data_parallel_rank={self.data_parallel_rank!r})"


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
    for f in cls.__slots__:
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
def _event_from_map(d: dict) -> WireEvent | None:
    tag = d.get("type")
    if tag == "BlockStored":
        ev = BlockStored.__new__(BlockStored)
        g = d.get
        ev.block_hashes = g("block_hashes") or []
        ev.parent_block_hash = g("parent_block_hash")
        ev.token_ids = g("token_ids") or []
        ev.block_size = g("block_size") or 0
        ev.lora_id = g("lora_id")
        ev.medium = g("medium")
        ev.lora_name = g("lora_name")
        ev.extra_keys = g("extra_keys")
        ev.group_idx = g("group_idx")
        ev.kv_cache_spec_kind = g("kv_cache_spec_kind")
        ev.kv_cache_spec_sliding_window = g("kv_cache_spec_sliding_window")
        ev.locality = g("locality")
        ev.ownership = g("ownership")
        sid = g("session_id")
        if sid is None:  # SGLang: metadata{cache_salt, session_id}
            meta = g("metadata")
            if isinstance(meta, dict):
                sid = meta.get("session_id")
        ev.session_id = sid
        return ev
    if tag == "BlockRemoved":
        return BlockRemoved(d.get("block_hashes") or [], d.get("medium"), d.get("group_idx"), d.get("locality"),
                            d.get("ownership"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _event_from_array(a: list) -> WireEvent | None:
    if not a:
        return None
    cls = EVENT_CLASSES.get(a[0])
    if cls is None:
        return None
    vals = a[1:]
    if len(vals) > len(cls.FIELDS):
        vals = vals[:len(cls.FIELDS)]
    return cls(*vals)


def decode_event(obj: Any) -> WireEvent | None:
    """One event from its msgpack form (map-tagged or legacy positional); None for a type we do
    not know (newer publishers may add some: skip them, keep the rest of the batch)."""
    if isinstance(obj, dict):
        ev = _event_from_map(obj)
    elif isinstance(obj, (list, tuple)):
        try:
            ev = _event_from_array(list(obj))
        except TypeError as exc:
            raise WireError(f"bad positional event {str(obj)[:80]}: {exc}") from None
    else:
        raise WireError(f"an event must be a map or an array, got {type(obj).__name__}")
    if ev is not None and type(ev) is not AllBlocksCleared and not isinstance(ev.block_hashes, list):
        raise WireError(f"{type(ev).__name__}.block_hashes must be a list")
    return ev


def decode_batch(payload: bytes) -> EventBatch:
    """An EventBatch from its msgpack payload. Raises WireError on anything else."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise WireError(f"payload is not msgpack: {exc}") from None
    if isinstance(obj, dict):  # tolerate a map-encoded batch
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and 2 <= len(obj) <= 3:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    else:
        raise WireError(f"payload is not an EventBatch [ts, events, rank]: {str(obj)[:80]}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise WireError(f"payload is not an EventBatch [ts, events, rank]: {str(obj)[:80]}")
    out = []
    for e in events:
        ev = decode_event(e)
        if ev is not None:
            out.append(ev)
    return EventBatch(float(ts), out, rank)


# --- hashes ---------------------------------------------------------------------------------
def hash_hex(h: WireHash | str | None) -> str | None:
    """A wire hash as lowercase hex (ints as 16 hex digits: vLLM's uint64 form)."""
    if h is None:
        return None
    if isinstance(h, int):
        return format(h & 0xFFFFFFFFFFFFFFFF, "016x")
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


def from_engine_event(ev, session_id: str | None = None, as_int: bool = True) -> WireEvent | None:
    """kvplay engine event -> wire event (None for events vLLM's wire does not carry)."""
    kind = type(ev).__name__
    if kind == "BlockStored":
        return BlockStored([hex_to_wire_hash(h, as_int) for h in ev.block_hashes],
                           hex_to_wire_hash(ev.parent_block_hash, as_int), list(ev.token_ids),
                           ev.block_size, None, MEDIUM_GPU, None, session_id=session_id)
    if kind == "BlockRemoved":
        return BlockRemoved([hex_to_wire_hash(h, as_int) for h in ev.block_hashes], MEDIUM_GPU)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


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
