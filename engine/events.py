"""Typed engine events: one set of msgspec tagged structs, for memory, recording and replay.

Cache events are shaped like vLLM's KV events (``BlockStored{block_hashes, parent_block_hash,
token_ids, block_size}``, ``BlockRemoved{block_hashes}``, ``AllBlocksCleared``) plus our own
creator/request fields, so a recorded session and a real vLLM stream could feed the same block
map. Every event carries a monotonically increasing ``seq`` and a wall-clock ``ts``.

Hashes travel as lowercase hex strings (JSON- and SQLite-friendly).

The events are msgspec structs tagged by ``"kind"`` (the class name), the way vLLM's and SGLang's
own KV events are: building one costs what a plain object does (no validation on construction),
and `encode_events` / `decode_events` are the one place they are turned into bytes and back.
Decoding validates every field's type and size (the bounds below): a recorded row is hostile
input, so a malformed or oversized event is counted and skipped, never a traceback.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec

# Bounds on one decoded event (what a recorded row may hold; generous for real sessions).
MAX_EVENT_BLOCKS = 1 << 20     # block ids / hashes in one event
MAX_EVENT_TOKENS = 1 << 22     # token ids in one BlockStored
MAX_EVENT_TEXT = 4096          # users, request ids, hashes, reasons, errors
MAX_EVENT_MAP = 4096           # keys of by_creator, stats, changes
MAX_BATCH_EVENTS = 1 << 20     # events in one encoded batch
MAX_BATCH_BYTES = 256 << 20    # bytes of one encoded batch (checked before decoding)

_Text = Annotated[str, msgspec.Meta(max_length=MAX_EVENT_TEXT)]
_Ids = Annotated[list[int], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Hashes = Annotated[list[_Text], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Texts = Annotated[list[_Text], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_EVENT_TOKENS)]
_Map = Annotated[dict[_Text, Any], msgspec.Meta(max_length=MAX_EVENT_MAP)]


class Event(msgspec.Struct, kw_only=True, tag_field="kind", tag=True):
    seq: int = 0
    ts: float = 0.0

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict:
        """The event as plain data, its kind under "kind" (what recorded-session readers use)."""
        return msgspec.to_builtins(self)


# --- cache events (vLLM KV-event names) ---------------------------------------------------
class BlockStored(Event):
    """A full block was computed and entered the prefix index (one event per block here)."""
    block_hashes: _Hashes = []
    parent_block_hash: Optional[_Text] = None
    token_ids: _Tokens = []
    block_size: int = 0
    block_ids: _Ids = []
    user: _Text = ""
    request_id: _Text = ""


class BlockRemoved(Event):
    """Cached blocks were evicted (their hash leaves the index)."""
    block_hashes: _Hashes = []
    block_ids: _Ids = []
    reason: _Text = "evicted"  # evicted | cleared | reconfigured
    creators: _Texts = []
    by_user: _Text = ""  # evicted: the user whose request's allocation pushed them out
    by_request: _Text = ""  # ... and that request
    policy: _Text = ""  # evicted: the eviction policy that picked them (lru | lfu | fifo | belady)


class BlocksAllocated(Event):
    """Blocks were handed to a request (ref count 1; whatever they held is gone: an eviction
    that freed them comes first, as a BlockRemoved). With BlocksTouched and BlocksReleased it
    tells a mirror which blocks are in use, so the pool's state follows from events alone."""
    block_ids: _Ids = []


class BlocksTouched(Event):
    """A request took another reference to cached or in-use blocks (a prefix hit, or a
    preempted request re-admitted)."""
    block_ids: _Ids = []


class BlocksReleased(Event):
    """One reference to each block was dropped; at none a block is cached when indexed, else free."""
    block_ids: _Ids = []


class AllBlocksCleared(Event):
    reason: _Text = "cleared"


class BlockHit(Event):
    """A request reused cached blocks; `by_creator` is tokens per creating user."""
    request_id: _Text = ""
    user: _Text = ""
    block_ids: _Ids = []
    block_hashes: _Hashes = []
    cached_tokens: int = 0
    by_creator: Annotated[dict[_Text, int], msgspec.Meta(max_length=MAX_EVENT_MAP)] = {}


_Span = tuple[int, int, _Text, _Text, _Text]


class MissExplained(Event):
    """Why the prompt tokens a request did not get from the cache were computed (engine/miss.py),
    once, at its first admission (a re-admission after preemption is recompute, not a miss):
    `spans` are [start, tokens, reason, who, by] runs that cover every uncached prompt token
    exactly once (reasons: cold, evicted, isolated, diverged, tail, cleared, config, collision;
    `who`: the user whose block is the evidence; `by`: who evicted it). `engine.miss.miss_object`
    turns it into the miss object (RequestStats.miss)."""
    request_id: _Text = ""
    user: _Text = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spans: Annotated[list[_Span], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)] = []
    diverged_at: Optional[int] = None
    excerpt_prompt: _Text = ""
    excerpt_cached: _Text = ""
    evicted_at: Optional[float] = None
    eviction_policy: _Text = ""
    cleared_at: Optional[float] = None


class CollisionCaught(Event):
    """Verify-on-hit found a block whose hash matched but whose contents did not."""
    request_id: _Text = ""
    user: _Text = ""
    block_id: int = -1
    block_hash: _Text = ""
    position: int = 0  # block index within the prompt


# --- request lifecycle ---------------------------------------------------------------------
class RequestQueued(Event):
    request_id: _Text = ""
    user: _Text = ""
    prompt_tokens: int = 0


class RequestStarted(Event):
    request_id: _Text = ""
    user: _Text = ""
    cached_tokens: int = 0


class FirstToken(Event):
    request_id: _Text = ""
    user: _Text = ""
    ttft_ms: float = 0.0


class RequestPreempted(Event):
    request_id: _Text = ""
    user: _Text = ""
    freed_blocks: int = 0


class RequestFinished(Event):
    request_id: _Text = ""
    user: _Text = ""
    stats: _Map = {}  # RequestStats.to_dict()
    finish_reason: _Text = "stop"  # stop | length | pool_exhausted | cancelled | error
    error: Optional[_Text] = None


# --- identity ------------------------------------------------------------------------------
class UserGroupChanged(Event):
    """`Engine.set_group` moved a user to another group (requests submitted afterwards use it)."""
    user: _Text = ""
    old_group: Optional[_Text] = None
    new_group: Optional[_Text] = None


# --- settings ------------------------------------------------------------------------------
class SettingsChanged(Event):
    """`Engine.reconfigure` changed settings on the engine thread (isolation, eviction,
    determinism, hashing, verify-on-hit): `changes` holds the new values of the fields that
    changed, `previous` their old ones. A cache clear is `AllBlocksCleared` (reason "cleared";
    "reconfigured" when a change here needed a fresh cache); a user's group is
    `UserGroupChanged`."""
    changes: _Map = {}
    previous: _Map = {}


class EngineBatch(msgspec.Struct):
    """What one engine step (or command) emitted, drained once at its end (vLLM's
    ``take_events()``): `step` counts batches from 1, `ts` is when the batch was drained."""
    step: int
    ts: float
    events: list


REF_EVENTS = (BlocksAllocated, BlocksTouched, BlocksReleased)
CACHE_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, *REF_EVENTS)
EVENT_TYPES = {cls.__name__: cls for cls in (
    BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, MissExplained, *REF_EVENTS, RequestQueued,
    RequestStarted, FirstToken, RequestPreempted, RequestFinished, UserGroupChanged, SettingsChanged)}
AnyEvent = Union[tuple(EVENT_TYPES.values())]


class EventError(ValueError):
    """An event (or an encoded batch of them) that does not validate (one line)."""


def event_from_dict(d: dict) -> Event:
    """Inverse of Event.to_dict (recorded-session viewers, traces), validated like a decoded
    event; keys an event does not have are ignored. Raises EventError (one line)."""
    try:
        return msgspec.convert(d, AnyEvent)
    except (msgspec.ValidationError, TypeError, ValueError, RecursionError) as exc:
        raise EventError(f"bad event: {str(exc)[:120]}") from None


# --- encoding: the one place events become bytes and back ---------------------------------
_ENCODER = msgspec.msgpack.Encoder()
_BATCH_DECODER = msgspec.msgpack.Decoder(list[AnyEvent])
_RAW_DECODER = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)])
_EVENT_DECODER = msgspec.msgpack.Decoder(AnyEvent)


def encode_events(events: list) -> bytes:
    """One batch of events as msgpack: an array of maps tagged by "kind"."""
    return _ENCODER.encode(events)


def decode_events(blob: bytes) -> tuple[list[Event], int]:
    """(the events of an encoded batch, how many were skipped): each event is checked on its
    own, so one bad or unknown event costs only itself. A blob that is not a batch at all (not
    bytes, too big, not an array) counts as one bad event."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) > MAX_BATCH_BYTES:
        return [], 1
    try:
        return _BATCH_DECODER.decode(blob), 0  # the usual case: every event is good
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        raws = _RAW_DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return [], 1
    out, bad = [], 0
    for raw in raws:
        try:
            out.append(_EVENT_DECODER.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            bad += 1
    return out, bad
