"""Typed engine events: one set of msgspec tagged structs, for memory, recording and replay.

Cache events are shaped like vLLM's KV events (``BlockStored{block_hashes, parent_block_hash,
token_ids, block_size, extra_keys}``, ``BlockRemoved{block_hashes}``, ``AllBlocksCleared``) plus
our own fields (block ids, creator, request), so the engine, a recorded session and a watched
vLLM or SGLang server feed the same Mirror with the same types (wire/translate.py turns vLLM's
wire form into these, and the engine's into it, at the two sockets). Every event carries a
monotonically increasing ``seq`` and a wall-clock ``ts``.

Hashes are the engine's as lowercase hex strings; a server's as it sent them (vLLM: a uint64,
SGLang: an int64, vLLM's full digests as hex). Extra keys (``extra_keys``, one entry per block)
are what went into a block's hash besides its parent and tokens: the engine's typed
``(kind, value)`` pairs (wire/translate.py gives vLLM its form of them), a server's as it sent them.

The pool, the KV manager, the scheduler and the output processor *queue* their events
(`EventQueue`, one per engine, so their order is kept) and the engine drains the queue once per
step into one `EngineBatch` (vLLM's ``take_events()``): the batch carries the step, the time,
the engine's forward count (its step clock) and, for a batch that came from a watched server
or a recording, the envelope that says where from (`pod`, `wire_seq`).

The events are msgspec structs tagged by ``"kind"`` (the class name), the way vLLM's and SGLang's
own KV events are: building one costs what a plain object does (no validation on construction),
and `encode_events` / `decode_events` are the one place they are turned into bytes and back.
Decoding validates every field's type and size (the bounds below): a recorded row is hostile
input, so a malformed or oversized event is counted and skipped, never a traceback.
"""
from __future__ import annotations

import itertools
import time
from typing import Annotated, Any, Optional, Union

import msgspec

# Bounds on one decoded event or batch: the one set, for recorded rows and the wire alike
# (wire/codec.py decodes vLLM's events under them too). Generous for real servers: SGLang at page
# size 1 sends one hash per token, so a 128k-token prefill is one event of 128k hashes.
MAX_BLOCKS = 1 << 22           # block ids are below this (the largest pool a Mirror holds, ~130 MB of arrays)
MAX_EVENT_BLOCKS = 1 << 20     # block ids / hashes in one event
MAX_EVENT_TOKENS = 1 << 22     # token ids in one event
MAX_BLOCK_SIZE = 1 << 20       # tokens per block
MAX_EVENT_TEXT = 4096          # users, request ids, hashes, reasons, errors
MAX_EVENT_MAP = 4096           # keys of by_creator, stats, changes
MAX_BATCH_EVENTS = 1 << 20     # events in one batch
MAX_BATCH_BYTES = 256 << 20    # bytes of one encoded batch (checked before decoding)

_Text = Annotated[str, msgspec.Meta(max_length=MAX_EVENT_TEXT)]
_Hash = Union[int, _Text]
_Ids = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)]], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Hashes = Annotated[list[_Hash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Texts = Annotated[list[_Text], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_EVENT_TOKENS)]
_Extras = Annotated[list[Any], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]
_Map = Annotated[dict[_Text, Any], msgspec.Meta(max_length=MAX_EVENT_MAP)]


class Event(msgspec.Struct, kw_only=True, tag_field="kind", tag=True, gc=False):
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
    """Full blocks were computed and entered the prefix index (the engine: one event per block;
    a server: a chain of them). `extra_keys`: one entry per block, or none when not known."""
    block_hashes: _Hashes = []
    parent_block_hash: Optional[_Hash] = None
    token_ids: _Tokens = []
    block_size: _Size = 0
    block_ids: _Ids = []
    user: _Text = ""
    request_id: _Text = ""
    extra_keys: _Extras = []
    group_idx: _Size = 0  # a hybrid model's KV-cache group (a server's; its hashes are its own)


class BlockRemoved(Event):
    """Cached blocks were evicted (their hash leaves the index)."""
    block_hashes: _Hashes = []
    block_ids: _Ids = []
    reason: _Text = "evicted"  # evicted | cleared | reconfigured
    creators: _Texts = []
    group_idx: _Size = 0
    by_user: _Text = ""  # evicted: the user whose request's allocation pushed them out
    by_request: _Text = ""  # ... and that request
    policy: _Text = ""  # evicted: the eviction policy that picked them (lru | lfu | fifo | belady)


class TierBlocks(Event):
    """A watched server stored blocks in (or removed them from) a cache tier other than the
    device's: vLLM's CPU offload ("CPU", "CPU_PINNED"), its FS/OBJ/"STORAGE" tiers, a pod's
    "REMOTE" locality (wire/translate.py). A Mirror holds the device tier only, so it applies
    nothing here; the miss attribution counts them per tier, and a device store of a block
    another tier holds as a hit from that tier (wire/miss_watch.py). `tier`: the medium
    upper-cased, "REMOTE:" in front for locality REMOTE; `user`: the event's session_id."""
    tier: _Text = ""
    removed: bool = False
    block_hashes: _Hashes = []
    user: _Text = ""
    group_idx: _Size = 0


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
    """A request reused cached blocks; `by_creator` is tokens per creating user; `token_ids`,
    `block_size` and `extra_keys` (one entry per block) are the reused blocks' (what vLLM's
    kv_cache_report_mode "full" re-announces)."""
    request_id: _Text = ""
    user: _Text = ""
    block_ids: _Ids = []
    block_hashes: _Hashes = []
    cached_tokens: int = 0
    by_creator: Annotated[dict[_Text, int], msgspec.Meta(max_length=MAX_EVENT_MAP)] = {}
    token_ids: _Tokens = []
    block_size: _Size = 0
    extra_keys: _Extras = []


_Span = tuple[int, int, _Text, _Text, _Text]


class MissExplained(Event):
    """Why the prompt tokens a request did not get from the cache were computed (engine/miss.py),
    once, at its first admission (a re-admission after preemption is recompute, not a miss):
    `spans` are [start, tokens, reason, who, by] runs that cover every uncached prompt token
    exactly once (reasons: cold, evicted, isolated, diverged, tail, cleared, config, collision;
    `who`: the user whose block is the evidence; `by`: who evicted it). `engine.miss.miss_object`
    turns it into the miss object (RequestStats.miss). `own_keys`: a salted request explained
    without looking across keys (a keyed `kvplay serve`): its `cold` tokens may be held under
    another key (`kvplay explain` finds which, offline: sessions/explain.py)."""
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
    own_keys: bool = False  # explained from the sender's own keys only: what another key held counts as cold


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


class EngineBatch(msgspec.Struct, gc=False):
    """What one engine step (or command) emitted, drained once at its end (vLLM's
    ``take_events()``): `step` counts batches from 1, `ts` is when the batch was drained,
    `forwards` the engine's forward count then (the step clock the simulator enters requests
    at). A watched server's batch (wire/translate.py) or a recorded one also says where it came
    from: `pod` (a recording of watched pods keys their blocks by pod) and `wire_seq` (the
    publisher's seq)."""
    step: int = 0
    ts: float = 0.0
    events: list = []
    forwards: Optional[int] = None
    pod: Optional[str] = None
    wire_seq: Optional[int] = None


class EventQueue:
    """Where the engine's parts queue their events as state changes (stamped with `seq` and
    `ts`); the engine takes them once per step (`take`)."""

    def __init__(self):
        self._events: list = []
        self._seq = itertools.count(1)

    def put(self, event: Event) -> None:
        event.seq = next(self._seq)
        event.ts = time.time()
        self._events.append(event)

    def take(self) -> list:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


REF_EVENTS = (BlocksAllocated, BlocksTouched, BlocksReleased)
CACHE_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, *REF_EVENTS)
EVENT_TYPES = {cls.__name__: cls for cls in (
    BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, MissExplained, *REF_EVENTS, RequestQueued,
    RequestStarted, FirstToken, RequestPreempted, RequestFinished, UserGroupChanged, SettingsChanged, TierBlocks)}
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
_BATCH_DECODER = msgspec.msgpack.Decoder(Annotated[list[AnyEvent], msgspec.Meta(max_length=MAX_BATCH_EVENTS)])
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
