"""vLLM's KV-event wire form <-> kvplay's one vocabulary (engine/events.py), at the two sockets.

Inside the process only `EngineBatch`es of engine events flow (the engine's, a watched server's,
a recording's). vLLM's wire form (wire/codec.py) is met exactly twice, here:

- **out** (`to_wire`): an engine batch as the vLLM ``EventBatch`` kvplay serve publishes (and
  `kvplay export` writes): consecutive blocks a request stored go out as one ``BlockStored``
  (as vLLM does), ``session_id`` = the user who created them (the identity the server bound),
  one extra-keys entry per block (None, or the block's cache salt: vLLM's form of the engine's
  typed keys), KV-cache group 0 and its spec kind; one ``BlockRemoved`` per evicted block (a
  reset's blocks are not listed: ``AllBlocksCleared`` says it, as vLLM sends only that); and, for
  a request whose ``kv_cache_report_mode`` is "full", the cached prefix it reused re-announced
  as a ``BlockStored`` with the *reusing* user's session_id.
- **in** (`FromWire`): a watched server's decoded batch as an engine batch (see its docstring).
"""
from __future__ import annotations

import hashlib
import time
from heapq import heappop, heappush
from typing import Callable

import msgspec

from kvplay.engine import events as ev_
from kvplay.engine.cbor_hash import vllm_extra_keys

from .codec import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, hash_hex, hex_to_wire_hash

SPEC_KIND = "full_attention"  # what vLLM 0.32 sends for a plain decoder's one KV-cache group
_MIRRORED = (MEDIUM_GPU, None)  # the media a mirror follows (the device tier; None: not said)


# --- out: the engine's batches as vLLM's --------------------------------------------------------
def _wire_hash(h, as_int: bool):
    """An event's hash as vLLM sends it: the engine's hex as a uint64 (or the digest's bytes); a
    hash that came from a server (an int) as it came; text that is no hex (a hand-made recording)
    as 8 bytes of its blake2b, so it still names one block."""
    if type(h) is not str:
        return h
    try:
        return hex_to_wire_hash(h, as_int)
    except ValueError:
        d = hashlib.blake2b(h.encode(), digest_size=8).digest()
        return int.from_bytes(d, "big") if as_int else d


def _wire_extra(extra):
    """One block's engine extra keys ((kind, value) pairs) as vLLM hashes them, untagged: None,
    or a tuple of the salts."""
    keys = vllm_extra_keys(extra) if extra else None
    return None if keys is None else tuple(v for _, v in keys)


def _stored(hashes: list, parent, tokens: list, size: int, extras: list, n: int, user: str) -> BlockStored:
    return BlockStored(hashes, parent, tokens, size, None, MEDIUM_GPU, None,
                       extra_keys=[_wire_extra(extras[i]) if i < len(extras) else None for i in range(n)],
                       group_idx=0, kv_cache_spec_kind=SPEC_KIND, session_id=user or None)


def to_wire(batch: ev_.EngineBatch, as_int: bool = True,
            report_full: Callable[[str], bool] | None = None) -> EventBatch:
    """The vLLM EventBatch of an engine batch (see the module docstring). `report_full(request_id)`
    says whether a request's reused prefix is re-announced (kv_cache_report_mode "full")."""
    out: list = []
    open_ = None  # the BlockStored that the next stored block of the same chain extends
    for ev in batch.events:
        cls = type(ev)
        if cls is ev_.BlockStored:
            hashes = [_wire_hash(h, as_int) for h in ev.block_hashes]
            if not hashes:
                continue
            parent = None if ev.parent_block_hash is None else _wire_hash(ev.parent_block_hash, as_int)
            w = _stored(hashes, parent, list(ev.token_ids), ev.block_size, ev.extra_keys, len(hashes), ev.user)
            if (open_ is not None and out[-1] is open_ and open_.session_id == w.session_id
                    and open_.block_size == w.block_size and parent == open_.block_hashes[-1]):
                open_.block_hashes.extend(w.block_hashes)
                open_.token_ids.extend(w.token_ids)
                open_.extra_keys.extend(w.extra_keys)
            else:
                out.append(w)
                open_ = w
        elif cls is ev_.BlockRemoved:
            if ev.reason == "evicted":
                out.extend(BlockRemoved([_wire_hash(h, as_int)], MEDIUM_GPU, 0) for h in ev.block_hashes)
        elif cls is ev_.AllBlocksCleared:
            out.append(AllBlocksCleared())
        elif cls is ev_.BlockHit:
            if report_full is not None and ev.block_hashes and report_full(ev.request_id):
                hashes = [_wire_hash(h, as_int) for h in ev.block_hashes]
                out.append(_stored(hashes, None, list(ev.token_ids), ev.block_size, ev.extra_keys, len(hashes),
                                   ev.user))  # a re-announcement never extends a chain
    return EventBatch(batch.ts, out)


# --- in: a watched server's batches as engine batches --------------------------------------------
SOMEONE_ELSE = "someone else"


class PromptIndex:
    """Prompts kvplay's own panes sent, indexed by token chain per block size, so blocks stored
    without a session_id can still be attributed to the pane that caused them."""

    def __init__(self):
        self._prompts: list[tuple[str, tuple[int, ...]]] = []
        self._by_size: dict[int, dict[int, str]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def register(self, session: str, token_ids) -> None:
        toks = tuple(token_ids)
        self._prompts.append((session, toks))
        for size, index in self._by_size.items():
            self._index(index, session, toks, size)

    @staticmethod
    def _index(index: dict, session: str, toks: tuple, size: int) -> None:
        chain = None
        for start in range(0, len(toks) - size + 1, size):
            chain = hash((chain, toks[start:start + size]))
            index.setdefault(chain, session)  # the first pane that sent a prefix stored it

    def lookup(self, chain: int, size: int) -> str | None:
        index = self._by_size.get(size)
        if index is None:
            index = self._by_size[size] = {}
            for session, toks in self._prompts:
                self._index(index, session, toks, size)
        return index.get(chain)


class Slots:
    """Slots for blocks named by key only (every server's wire; a recording of watched pods): a
    new key takes the lowest free slot, a removed one gives its slot back."""

    def __init__(self):
        self.of: dict = {}         # key -> slot
        self.free: list[int] = []  # a heap of freed slots below `next`
        self.next = 0              # the lowest slot never taken

    def room(self) -> int:
        """How many more keys fit."""
        return len(self.free) + ev_.MAX_BLOCKS - self.next

    def take(self, key) -> int:
        """A slot for a key not held yet (the caller checked `room`)."""
        if self.free:
            s = heappop(self.free)
        else:
            s = self.next
            self.next = s + 1
        self.of[key] = s
        return s

    def give_back(self, key) -> int | None:
        s = self.of.pop(key, None)
        if s is not None:
            heappush(self.free, s)
        return s

    def clear(self) -> None:
        self.of.clear()
        self.free.clear()
        self.next = 0


def hash_key(h):
    """A wire hash as the engine events (and so the Mirror) name it: digests (bytes) as hex, the
    one vocabulary's hashes being ints or text."""
    return h.hex() if h.__class__ is bytes else h


def _hex_hashes(ev):
    """A wire event whose hashes are digests (bytes) with them as hex (`hash_key`)."""
    hx = [hash_hex(h) for h in ev.block_hashes]
    if type(ev) is BlockRemoved:
        return msgspec.structs.replace(ev, block_hashes=hx)
    return msgspec.structs.replace(ev, block_hashes=hx, parent_block_hash=hash_hex(ev.parent_block_hash))


def _other_tier(ev, medium, ts: float, out: list) -> bool:
    """A wire event of a cache tier other than the device's as a ``TierBlocks`` on `out`; False
    (nothing added) when it is the device's after all: a local "gpu" in another case."""
    remote = ev.locality == "REMOTE"
    tier = (medium or MEDIUM_GPU).upper()
    if tier == MEDIUM_GPU and not remote:
        return False
    stored = type(ev) is BlockStored
    out.append(ev_.TierBlocks(ts=ts, tier="REMOTE:" + tier if remote else tier, removed=not stored,
                              block_hashes=[hash_key(h) for h in ev.block_hashes],
                              user=(ev.session_id or "") if stored else "", group_idx=ev.group_idx or 0))
    return True


class FromWire:
    """One pod's translator: its decoded wire batches (wire/codec.py) as engine batches of the one
    vocabulary, which its `mirror` (wire/mirror.py) then applies like any other.

    vLLM and SGLang send no block ids, so each block named by hash gets a slot (`Slots`: the
    lowest free one, `mirror.offset` added: the pod's place in a fleet's numbering), and events
    say whose it is:

    - a new block is a ``BlockStored`` whose ``user`` is, in order: the event's ``session_id``
      (vLLM copies it from the request; SGLang sends it in metadata); else the session whose
      registered prompt (`PromptIndex`, kvplay's own panes register what they send) has the same
      token chain up to this block; else `SOMEONE_ELSE` (another client of a shared server).
      Consecutive new blocks of one chain are one event, as the engine's would be;
    - a block announced again (vLLM's kv_cache_report_mode "full") is a ``BlockHit`` of the
      reusing session (its own, else the block's creator), with ``by_creator`` and the blocks'
      tokens and extra keys;
    - an evicted block is a ``BlockRemoved`` (with its creators; consecutive ones in one event), a
      removal of a block never seen is counted (`mirror.removed_unknown`) and dropped;
    - a reset (``AllBlocksCleared``, or the publisher restarting: `restart`) is a ``BlockRemoved``
      of every slot (reason "cleared") and an ``AllBlocksCleared``, as the engine says a clear.

    Only the device tier is mirrored: events for another medium (vLLM's CPU offload tier "CPU",
    "STORAGE"; the medium in any case, "gpu" being the device) or with locality "REMOTE" are
    counted (`mirror.other_medium`) and passed on as ``TierBlocks`` (`_other_tier`), which no
    mirror applies. A
    hybrid model's group other than 0 keys its blocks (group, hash). The watch counters (module
    docstring of wire/mirror.py) are kept on the mirror. Hashes stay as the server sent them
    (ints), but for full digests, which become hex (`hash_key`).

    Translation and application alternate batch by batch (the subscriber applies each batch
    before it translates the next): a new block's parent chain is read from the mirror."""

    def __init__(self, mirror, prompts: PromptIndex | None = None):
        self.mirror = mirror
        self.prompts = prompts if prompts is not None else PromptIndex()
        self.slots = Slots()
        self.owner: list[str] = []  # slot -> who stored it (as long as `slots.next`; a free slot's is stale)
        self._chain: dict[int, int] = {}  # slot -> token-chain id (attribution by registered prompts)
        self._taken: set[int] = set()  # slots taken in the batch being translated (while prompts exist)
        self._digests: bool | None = None  # the pod's hashes are digests (bytes): a publisher uses one form

    def __call__(self, batch: EventBatch, seq: int = -1) -> ev_.EngineBatch:
        m = self.mirror
        out: list = []
        try:
            self._translate(batch.events, batch.ts, out)
        finally:
            self._taken.clear()
        m.batches += 1
        m.events += len(batch.events)
        if seq >= 0:
            m.last_seq = seq
        m.last_ts = batch.ts
        return ev_.EngineBatch(m.batches, batch.ts, out, wire_seq=seq if seq >= 0 else None)

    def restart(self) -> ev_.EngineBatch:
        """The publisher restarted (its seq went backwards): its cache is gone with it."""
        m = self.mirror
        out: list = []
        self._clear(time.time(), out, "publisher restarted")
        m.restarts += 1
        m.last_seq = -1
        return ev_.EngineBatch(m.batches, time.time(), out)

    def _clear(self, ts: float, out: list, reason: str) -> None:
        of, owner, off = self.slots.of, self.owner, self.mirror.offset
        if of:
            hashes, ids, creators = [], [], []
            for key, s in of.items():
                hashes.append(key[1] if type(key) is tuple else key)
                ids.append(s + off)
                creators.append(owner[s])
            out.append(ev_.BlockRemoved(ts=ts, block_hashes=hashes, block_ids=ids, creators=creators, reason=reason))
        out.append(ev_.AllBlocksCleared(ts=ts, reason=reason))
        self.slots.clear()
        owner.clear()
        self._chain.clear()

    def _translate(self, events, ts: float, out: list) -> None:
        """The batch's events in one loop with what it touches held in locals (a busy server
        sends dozens of small events a batch: per-call set-up would cost more than the blocks).
        The usual events take the shortest way: an eviction extends the BlockRemoved before it,
        a store of new blocks with a session is one BlockStored, a re-announcement of cached
        blocks one BlockHit (their hashes and tokens handed on as they came); anything else goes
        block by block (`_stored`)."""
        m = self.mirror
        slots = self.slots
        of, owner, chains, free = slots.of, self.owner, self._chain, slots.free
        of_get, of_pop, owner_of = of.get, of.pop, owner.__getitem__
        attrib = bool(self.prompts)  # prompts registered: new blocks' chains are kept
        digests = self._digests  # the pod sends digests (bytes, made hex); None: not known yet
        off = m.offset
        stored_by = m.stored_by_session
        Stored, Hit, Removed = ev_.BlockStored, ev_.BlockHit, ev_.BlockRemoved
        mirrored = _MIRRORED
        max_blocks = ev_.MAX_BLOCKS
        gone_g = -1  # the group of the BlockRemoved the next eviction extends (-1: none; vLLM sends one per block)
        evicted: list = []  # the block ids of each BlockRemoved of evictions
        last = None  # the BlockStored or BlockHit the next block may extend
        total = new = unknown = other = 0
        try:
            for ev in events:
                cls = ev.__class__
                if cls is BlockRemoved:
                    hashes = ev.block_hashes
                    if (ev.medium not in mirrored or ev.locality is not None and ev.locality == "REMOTE") and \
                            _other_tier(ev, ev.medium, ts, out):
                        other += len(hashes)  # another tier: not mirrored
                        gone_g, last = -1, None
                        continue
                    if digests is not False and hashes:
                        digests = self._digests = hashes[0].__class__ is bytes
                        if digests:
                            hashes = _hex_hashes(ev).block_hashes
                    g = ev.group_idx
                    for h in hashes:
                        s = of_pop((g, h) if g else h, None)
                        if s is None:
                            unknown += 1
                            continue
                        heappush(free, s)
                        if chains:
                            chains.pop(s, None)
                        if gone_g == g:
                            gone_h(h)
                            gone_i(s + off)
                            gone_c(owner[s])
                        else:
                            # (block_hashes, block_ids, reason, creators, group_idx): the hot events are
                            # made with their fields in order (a keyword costs a look-up)
                            gone = Removed([h], [s + off], "evicted", [owner[s]], g or 0, ts=ts)
                            out.append(gone)
                            gone_ids = gone.block_ids
                            evicted.append(gone_ids)
                            gone_h, gone_i, gone_c = gone.block_hashes.append, gone_ids.append, gone.creators.append
                            gone_g = g
                            last = None
                    continue
                if cls is AllBlocksCleared:
                    self._clear(ts, out, "cleared")
                    gone_g = -1
                    last = None
                    continue
                if cls is not BlockStored:
                    continue  # no wire event: nothing to translate
                hashes = ev.block_hashes
                if digests is not False and hashes:  # full digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)?
                    digests = self._digests = hashes[0].__class__ is bytes
                    if digests:
                        ev = _hex_hashes(ev)
                        hashes = ev.block_hashes
                if (ev.medium not in mirrored or ev.locality is not None and ev.locality == "REMOTE") and \
                        _other_tier(ev, ev.medium, ts, out):
                    other += len(hashes)  # another tier: not mirrored
                    gone_g, last = -1, None
                    continue
                n = len(hashes)
                if not n:
                    continue
                gone_g = -1
                g = ev.group_idx or 0
                if slots.next + n > max_blocks and n > slots.room() and \
                        sum(((g, h) if g else h) not in of for h in hashes) > slots.room():
                    raise ValueError("too many blocks")  # before any change: an event is applied whole or not at all
                sid = ev.session_id
                size = ev.block_size
                tokens = ev.token_ids if size else []
                extras = ev.extra_keys
                total += n
                if sid is not None and not g and len(tokens) == n * size:
                    s = of_get(hashes[0])
                    if s is not None:  # a re-announcement (report mode "full"): every block cached?
                        if n == 1:
                            ids = [s + off]
                            by = {owner[s]: size}
                        else:
                            ss = list(map(of_get, hashes))
                            if None in ss:
                                new += self._stored(ev, g, tokens, extras, ts, out, last)
                                last = out[-1] if out else None
                                continue
                            ids = [b + off for b in ss] if off else ss
                            cs = list(map(owner_of, ss))
                            c = cs[0]
                            if cs.count(c) == n:  # the usual: one creator
                                by = {c: n * size}
                            else:
                                by = {}
                                for c in cs:
                                    by[c] = by.get(c, 0) + size
                        stored_by[sid] += n
                        # (request_id, user, block_ids, block_hashes, cached_tokens, by_creator, token_ids,
                        # block_size, extra_keys)
                        last = Hit("", sid, ids, hashes, n * size, by, tokens, size,
                                   [None] * n if not extras else list(extras) if len(extras) == n else
                                   [extras[i] if i < len(extras) else None for i in range(n)], ts=ts)
                        out.append(last)
                        continue
                    ids = []
                    for h in hashes:  # the usual store: every block new (else undone below)
                        if h in of:
                            break
                        if free:
                            s = heappop(free)
                            owner[s] = sid
                        else:
                            s = slots.next
                            slots.next = s + 1
                            owner.append(sid)
                        of[h] = s
                        ids.append(s)
                    else:
                        new += n
                        stored_by[sid] += n
                        if chains:
                            for b in ids:
                                chains.pop(b, None)
                        if off:
                            ids = [b + off for b in ids]
                        if attrib:
                            self._chains(ev.parent_block_hash, tokens, size, ids, off, 0)
                        # (block_hashes, parent_block_hash, token_ids, block_size, block_ids, user, request_id,
                        # extra_keys)
                        last = Stored(hashes, ev.parent_block_hash, tokens, size, ids, sid, "",
                                      list(extras) if extras else [], ts=ts)
                        out.append(last)
                        continue
                    for h, b in zip(hashes, ids):  # a block was cached (or named twice): block by block
                        del of[h]
                        heappush(free, b)
                new += self._stored(ev, g, tokens, extras, ts, out, last)
                last = out[-1] if out else None
        finally:
            m.new_blocks += new
            m.reannounced += total - new
            m.stored += total
            m.removed_unknown += unknown
            m.removed += sum(map(len, evicted))
            m.other_medium += other

    def _stored(self, ev, g: int, tokens: list, extras, ts: float, out: list, last) -> int:
        """A BlockStored that is not the usual case, block by block (new ones, cached ones);
        returns how many blocks were new."""
        m = self.mirror
        slots = self.slots
        of, owner, chains = slots.of, self.owner, self._chain
        attrib = bool(self.prompts)
        off = m.offset
        stored_by = m.stored_by_session
        Stored, Hit = ev_.BlockStored, ev_.BlockHit
        sid = ev.session_id
        size = ev.block_size
        hashes = ev.block_hashes
        n = len(hashes)
        if sid is not None:
            stored_by[sid] += n
        new = 0
        tok_off = 0
        prev = ev.parent_block_hash
        for i, h in enumerate(hashes):
            key = (g, h) if g else h
            toks = tokens[tok_off:tok_off + size]
            tok_off += size
            extra = extras[i] if extras is not None and i < len(extras) else None
            s = of.get(key)
            if s is None:
                chain = self._attribute(prev, toks, size, g) if attrib else None
                who = sid if sid is not None else SOMEONE_ELSE if chain is None else \
                    self.prompts.lookup(chain, size) or SOMEONE_ELSE
                s = slots.take(key)
                if s < len(owner):
                    owner[s] = who
                else:
                    owner.append(who)
                if chain is not None:
                    chains[s] = chain
                elif chains:
                    chains.pop(s, None)
                if attrib:
                    self._taken.add(s)
                new += 1
                if (type(last) is Stored and last.user == who and last.block_size == size
                        and last.group_idx == g and last.block_hashes[-1] == prev
                        and len(last.token_ids) == len(last.block_hashes) * size and len(toks) == size):
                    last.block_hashes.append(h)  # the chain goes on: one event, like vLLM's
                    last.block_ids.append(s + off)
                    last.token_ids.extend(toks)
                    if last.extra_keys:
                        last.extra_keys.append(extra)
                else:
                    last = Stored(ts=ts, block_hashes=[h], parent_block_hash=prev, token_ids=list(toks),
                                  block_size=size, block_ids=[s + off], user=who,
                                  extra_keys=[extra] if extras else [], group_idx=g)
                    out.append(last)
            else:
                creator = owner[s]
                who = creator if sid is None else sid
                if type(last) is not Hit or last.user != who or last.block_size != size:
                    last = Hit(ts=ts, user=who, block_hashes=[], block_ids=[], cached_tokens=0, by_creator={},
                               token_ids=[], block_size=size, extra_keys=[])
                    out.append(last)
                last.block_hashes.append(h)
                last.block_ids.append(s + off)
                last.cached_tokens += size
                last.by_creator[creator] = last.by_creator.get(creator, 0) + size
                last.token_ids.extend(toks)
                last.extra_keys.append(extra)
            if sid is None:
                stored_by[who] += 1
            prev = h
        return new

    # --- attribution by token chain ----------------------------------------------------------
    def _chains(self, parent, tokens, size: int, ids: list, off: int, g: int) -> None:
        """Remember the chains of new blocks announced with a session (a later block without one
        may continue them)."""
        self._taken.update(b - off for b in ids)
        chain = None if parent is None else self._chain_of((g, parent) if g else parent, g)
        if parent is not None and chain is None:
            return
        chains = self._chain
        for i, b in enumerate(ids):
            chain = chains[b - off] = hash((chain, tuple(tokens[i * size:(i + 1) * size])))

    def _chain_of(self, key, g: int) -> int | None:
        """The token-chain id of a cached block (None when its chain leaves the pod's cache).
        Walks up iteratively (prompts can be thousands of blocks deep) through the mirror's
        parents and tokens: blocks of earlier batches are there, this batch's have their chain
        when it is known."""
        of, chains, taken = self.slots.of, self._chain, self._taken
        parents, tokens = self.mirror.parent, self.mirror.tokens
        path = []
        s = of.get(key)
        while s is not None and s not in chains:
            if s in taken:  # stored in this batch under an unknown chain (the mirror has not seen it)
                return None
            path.append(s)
            p = parents.get(s)
            if p is None:
                chain = None
                break
            s = of.get((g, p) if g else p)
        else:
            if s is None:
                return None
            chain = chains[s]
        for slot in reversed(path):
            chain = chains[slot] = hash((chain, tuple(tokens.get(slot, ()))))
        return chain

    def _attribute(self, parent, toks, size: int, g: int) -> int | None:
        """The token-chain id of a new block under `parent` holding `toks` (None: unknown chain)."""
        if not size:
            return None
        if parent is None:
            parent_chain = None
        else:
            parent_chain = self._chain_of((g, parent) if g else parent, g)
            if parent_chain is None:
                return None
        return hash((parent_chain, tuple(toks)))


def counts(batch: ev_.EngineBatch) -> tuple[int, int, int]:
    """(blocks announced, blocks evicted, caches cleared) by a translated batch: what `kvplay
    watch --json` prints per batch."""
    stored = removed = cleared = 0
    for ev in batch.events:
        cls = type(ev)
        if cls is ev_.BlockStored or cls is ev_.BlockHit:
            stored += len(ev.block_ids)
        elif cls is ev_.BlockRemoved:
            if ev.reason == "evicted":
                removed += len(ev.block_ids)
        elif cls is ev_.AllBlocksCleared:
            cleared += 1
    return stored, removed, cleared
