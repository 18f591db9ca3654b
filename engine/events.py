"""Typed engine events.

Cache events are shaped like vLLM's KV events (``BlockStored{block_hashes, parent_block_hash,
token_ids, block_size}``, ``BlockRemoved{block_hashes}``, ``AllBlocksCleared``) plus our own
creator/request fields, so a recorded session and a real vLLM stream could feed the same block
map. Every event carries a monotonically increasing ``seq`` and a wall-clock ``ts``.

Hashes travel as lowercase hex strings (JSON- and SQLite-friendly).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Event:
    seq: int = 0
    ts: float = 0.0

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        return d


# --- cache events (vLLM KV-event names) ---------------------------------------------------
@dataclass
class BlockStored(Event):
    """A full block was computed and entered the prefix index (one event per block here)."""
    block_hashes: list[str] = field(default_factory=list)
    parent_block_hash: str | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    block_ids: list[int] = field(default_factory=list)
    user: str = ""
    request_id: str = ""


@dataclass
class BlockRemoved(Event):
    """Cached blocks were evicted (their hash leaves the index)."""
    block_hashes: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    reason: str = "evicted"  # evicted | cleared | reconfigured
    creators: list[str] = field(default_factory=list)


@dataclass
class BlocksAllocated(Event):
    """Blocks were handed to a request (ref count 1; whatever they held is gone: an eviction
    that freed them comes first, as a BlockRemoved). With BlocksTouched and BlocksReleased it
    tells a mirror which blocks are in use, so the pool's state follows from events alone."""
    block_ids: list[int] = field(default_factory=list)


@dataclass
class BlocksTouched(Event):
    """A request took another reference to cached or in-use blocks (a prefix hit, or a
    preempted request re-admitted)."""
    block_ids: list[int] = field(default_factory=list)


@dataclass
class BlocksReleased(Event):
    """One reference to each block was dropped; at none a block is cached when indexed, else free."""
    block_ids: list[int] = field(default_factory=list)


@dataclass
class AllBlocksCleared(Event):
    reason: str = "cleared"


@dataclass
class BlockHit(Event):
    """A request reused cached blocks; `by_creator` is tokens per creating user."""
    request_id: str = ""
    user: str = ""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    by_creator: dict[str, int] = field(default_factory=dict)


@dataclass
class CollisionCaught(Event):
    """Verify-on-hit found a block whose hash matched but whose contents did not."""
    request_id: str = ""
    user: str = ""
    block_id: int = -1
    block_hash: str = ""
    position: int = 0  # block index within the prompt


# --- request lifecycle ---------------------------------------------------------------------
@dataclass
class RequestQueued(Event):
    request_id: str = ""
    user: str = ""
    prompt_tokens: int = 0


@dataclass
class RequestStarted(Event):
    request_id: str = ""
    user: str = ""
    cached_tokens: int = 0


@dataclass
class FirstToken(Event):
    request_id: str = ""
    user: str = ""
    ttft_ms: float = 0.0


@dataclass
class RequestPreempted(Event):
    request_id: str = ""
    user: str = ""
    freed_blocks: int = 0


@dataclass
class RequestFinished(Event):
    request_id: str = ""
    user: str = ""
    stats: dict = field(default_factory=dict)  # RequestStats.to_dict()
    finish_reason: str = "stop"  # stop | length | pool_exhausted | cancelled | error
    error: str | None = None


# --- identity ------------------------------------------------------------------------------
@dataclass
class UserGroupChanged(Event):
    """`Engine.set_group` moved a user to another group (requests submitted afterwards use it)."""
    user: str = ""
    old_group: str | None = None
    new_group: str | None = None


# --- settings ------------------------------------------------------------------------------
@dataclass
class SettingsChanged(Event):
    """`Engine.reconfigure` changed settings on the engine thread (isolation, eviction,
    determinism, hashing, verify-on-hit): `changes` holds the new values of the fields that
    changed, `previous` their old ones. A cache clear is `AllBlocksCleared` (reason "cleared";
    "reconfigured" when a change here needed a fresh cache); a user's group is
    `UserGroupChanged`."""
    changes: dict = field(default_factory=dict)
    previous: dict = field(default_factory=dict)


@dataclass
class EngineBatch:
    """What one engine step (or command) emitted, drained once at its end (vLLM's
    ``take_events()``): `step` counts batches from 1, `ts` is when the batch was drained."""
    step: int
    ts: float
    events: list


REF_EVENTS = (BlocksAllocated, BlocksTouched, BlocksReleased)
CACHE_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, *REF_EVENTS)
EVENT_TYPES = {cls.__name__: cls for cls in (
    BlockStored, BlockRemoved, AllBlocksCleared, BlockHit, CollisionCaught, *REF_EVENTS, RequestQueued,
    RequestStarted, FirstToken, RequestPreempted, RequestFinished, UserGroupChanged, SettingsChanged)}


def event_from_dict(d: dict) -> Event:
    """Inverse of Event.to_dict (used by replay and recorded-session viewers)."""
    d = dict(d)
    cls = EVENT_TYPES[d.pop("kind")]
    return cls(**d)
