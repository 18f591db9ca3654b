"""The KV manager: what a request may reuse from the shared pool and what it must allocate.

It owns the request-facing side of the prefix cache (vLLM v1's ``kv_cache_manager``), on top of
the block pool (``pool.py``: blocks, free queue, index, eviction):

- **hashing**: a request's full blocks are hashed in a chain under *frozen* keys (``HashKeys``:
  cache generation, hasher, isolation, salt), fixed before each admission attempt and kept while
  it runs, whatever ``reconfigure`` changes meanwhile; a preempted request drops them and is
  re-admitted under the keys in force then;
- **lookup and verify-on-hit**: the longest cached prefix, each hit compared with the stored
  tokens, extra keys and parent (a mismatch is a caught collision, counted once per request);
- **allocate / free**: the blocks a request is admitted with (cached ones shared, ref += 1),
  one more at each decode boundary, all of them back when it stops;
- **register**: every block that became full enters the prefix index (BlockStored), unless the
  request was admitted under an older cache generation (then nobody could reach it);
- the token-level cache counters and the BlockHit event (first admission only: recomputing
  after a preemption is no hit, cf. vllm#25780);
- **miss attribution** (engine/miss.py): at a first admission, a reason for every prompt token
  not served from the cache (``RequestStats.miss``, the ``MissExplained`` event), from the
  cache as the lookup saw it, before the allocation evicts anything; the pool tells the tracker
  what leaves the index and whose allocation pushed it out.

It decides nothing about *when* a request runs: that is the scheduler's job.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .events import BlockHit, CollisionCaught, Event, MissExplained
from .miss import MissTracker
from .pool import BlockPool, NoFreeBlocks
from .prefix import BlockHasher, salt_for, salted_extras
from .request import HashKeys, Request


@dataclass
class Admission:
    """What admitting a request reused: its cached prefix, attributed to who computed it."""
    matched: list[int]
    cached_tokens: int
    by_creator: dict[str, int]
    miss: dict | None = None  # why the rest was computed (first admission, attribution on)


class KVManager:
    def __init__(self, config, pool: BlockPool, hasher: BlockHasher, model_key: str,
                 emit: Callable[[Event], None], decode: Callable[[list[int]], str] | None = None):
        self.config = config
        self.pool = pool
        self.hasher = hasher
        self.model_key = model_key
        self.emit = emit
        self.epoch = 0  # cache generation: a new one when the hash, seed or determinism changes
        self.query_tokens = 0  # prompt tokens of first admissions
        self.hit_tokens = 0  # of those, tokens whose K/V came from the pool
        self.collisions_caught = 0
        self.miss: MissTracker | None = None
        self._decode = decode
        # whether a salted request's miss is explained from other salts' blocks too (isolated,
        # config): that lookup walks as far as another tenant's identical prefix goes, so its
        # time on the request's path tells the sender whether another key cached the prompt
        # (`kvplay serve` with keys turns it off; docs/miss.md, "Across keys")
        self.across_keys = True
        self.set_attribution(True)

    def set_attribution(self, on: bool) -> None:
        """Turn miss attribution on (a fresh tracker: it knows the blocks stored from now on)
        or off (no tracker, no MissExplained, RequestStats.miss stays None): `kvplay bench`'s A/B."""
        if on and self.miss is None:
            self.miss = MissTracker(self.bs, self._decode)
            self.pool.on_removed = self.miss.removed_blocks
        elif not on:
            self.miss = None
            self.pool.on_removed = None

    @property
    def bs(self) -> int:
        return self.pool.block_size

    def new_generation(self, hasher: BlockHasher) -> None:
        """The cache starts over under `hasher` (the caller clears the pool): running requests
        keep their keys, and their blocks filled from now on stay out of the index."""
        self.hasher = hasher
        self.epoch += 1

    # --- hashing under frozen keys --------------------------------------------------------------
    def freeze_keys(self, req: Request) -> None:
        """Before an admission attempt: fix the keys `req` is hashed under to those in force now
        (a waiting request whose keys changed drops its hashes)."""
        iso = self.config.isolation
        keys = HashKeys(self.epoch, self.hasher, iso, salt_for(iso, req.user, req.group))
        if req.keys != keys:
            req.keys = keys
            req.hashes = []

    def sig(self, req: Request, j: int) -> tuple:
        """What block j of `req` is hashed under besides its tokens: (cache generation, salt),
        the salt None for blocks wholly inside the system prompt in `system` isolation."""
        k = req.keys
        if k.salt is not None and k.isolation == "system" and j < req.system_tokens // self.bs:
            return (k.epoch, None)
        return (k.epoch, k.salt)

    def extras(self, req: Request, n_blocks: int):
        k = req.keys
        return salted_extras(k.isolation, k.salt, self.model_key, n_blocks, req.system_tokens, self.bs)

    def ensure_hashes(self, req: Request) -> None:
        """Extend req.hashes to cover every full block of its tokens (under its frozen keys)."""
        full = req.num_tokens // self.bs
        if len(req.hashes) >= full:
            return
        extras = self.extras(req, full)
        parent = req.hashes[-1] if req.hashes else None
        req.hashes.extend(req.keys.hasher.chain(req.tokens, extras, start_parent=parent,
                                                start_block=len(req.hashes)))

    def reusable_blocks(self, req: Request) -> int:
        """How many of the request's leading full blocks may come from the cache: all but the
        one holding the last token (its logits start the answer, so it is always computed)."""
        self.ensure_hashes(req)
        return min((req.num_tokens - 1) // self.bs, len(req.hashes))

    # --- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, req: Request, verify: bool = True) -> list[int]:
        """Ids of the cached blocks that hold the request's longest prefix (verified on hit)."""
        toks, bs = req.tokens, self.bs
        limit = self.reusable_blocks(req)
        extras = self.extras(req, len(req.hashes))
        matched: list[int] = []
        for j in range(limit):
            blk = self.pool.lookup(req.hashes[j])
            if blk is None:
                break
            if verify and self.config.verify_on_hit:
                parent_ok = blk.parent_id == (matched[-1] if matched else None)
                if blk.token_ids != tuple(toks[j * bs:(j + 1) * bs]) or blk.extra != tuple(extras[j]) \
                        or not parent_ok:
                    self._caught(req, j, blk.block_id)
                    break
            matched.append(blk.block_id)
        return matched

    def _caught(self, req: Request, j: int, block_id: int) -> None:
        seen = (j, req.hashes[j])
        if seen in req.collisions_seen:  # once per request, not at every admission retry
            return
        req.collisions_seen.add(seen)
        self.collisions_caught += 1
        req.stats.collisions_caught += 1
        self.emit(CollisionCaught(request_id=req.request_id, user=req.user, block_id=block_id, position=j,
                                  block_hash=req.keys.hasher.hex(req.hashes[j])))

    def inflight_hashes(self, running: list[Request]) -> set[int]:
        """Hashes of the prompt blocks that running requests are computing right now."""
        out: set[int] = set()
        for r in running:
            if r.pending > 1:
                out.update(r.hashes[r.registered:len(r.prompt_ids) // self.bs])
        return out

    def computed_elsewhere(self, req: Request, inflight: set[int]) -> bool:
        """Would `req` recompute a prompt block another running request is about to store?"""
        if not inflight:
            return False
        j = len(self.match_prefix(req, verify=False))
        return j < self.reusable_blocks(req) and req.hashes[j] in inflight

    # --- allocate / free ------------------------------------------------------------------------
    def admit(self, req: Request) -> Admission | None:
        """Give `req` its block table (cached prefix shared, the rest new), or None when the pool
        cannot hold it now."""
        matched = self.match_prefix(req)
        need = -(-req.num_tokens // self.bs) - len(matched)
        matched_evictable = sum(1 for b in matched if self.pool.blocks[b].ref_count == 0)
        if need > self.pool.available() - matched_evictable:
            return None
        now = time.time()
        first = not req.admitted_once
        miss = None
        if first and self.miss is not None:  # the cache as the lookup saw it, before any eviction
            miss = self.miss.explain(self.pool, req.prompt_ids, req.hashes, self.reusable_blocks(req), matched,
                                     lambda j: self.sig(req, j), len(req.prompt_ids),
                                     across_keys=self.across_keys or req.keys.salt is None)
        self.pool.touch(matched, now, hit=first)  # a re-admission re-references, it is no new hit
        req.block_table = matched + self.pool.allocate(need, now, by=(req.user, req.request_id))
        req.num_computed = len(matched) * self.bs
        req.registered = len(matched)
        cached = req.num_computed
        by: dict[str, int] = {}
        for b in matched:
            c = self.pool.blocks[b].creator or "?"
            by[c] = by.get(c, 0) + self.bs
        if first:
            for b in matched:
                self.pool.blocks[b].users_seen.add(req.user)
            self.query_tokens += len(req.prompt_ids)
            self.hit_tokens += cached
            if matched:
                blocks, tokens = self.pool.blocks, []
                for b in matched:
                    tokens.extend(self.pool.token_ids(b))
                self.emit(BlockHit(request_id=req.request_id, user=req.user, block_ids=list(matched),
                                   block_hashes=[req.keys.hasher.hex(blocks[b].hash) for b in matched],
                                   cached_tokens=cached, by_creator=dict(by), token_ids=tokens, block_size=self.bs,
                                   extra_keys=[[list(k) for k in blocks[b].extra] for b in matched]))
            if miss is not None:
                req.stats.miss = miss
                ex = miss["excerpt"] or {}
                self.emit(MissExplained(
                    request_id=req.request_id, user=req.user, prompt_tokens=len(req.prompt_ids), cached_tokens=cached,
                    spans=[tuple(s) for s in miss["spans"]], diverged_at=miss["diverged_at"],
                    excerpt_prompt=ex.get("prompt", ""), excerpt_cached=ex.get("cached", ""),
                    evicted_at=miss["evicted_at"], eviction_policy=miss["eviction_policy"] or "",
                    cleared_at=miss["cleared_at"], own_keys=miss.get("own_keys", False)))
        return Admission(matched, cached, by, miss)

    def reserve_slot(self, req: Request) -> bool:
        """Make sure the block for position req.num_computed exists; False when the pool has
        no block left (the scheduler then preempts someone)."""
        while req.num_computed // self.bs >= len(req.block_table):
            try:
                req.block_table += self.pool.allocate(1, by=(req.user, req.request_id))
            except NoFreeBlocks:
                return False
        return True

    def free(self, req: Request) -> int:
        """Return every block of `req` (tail first); returns how many."""
        n = len(req.block_table)
        if req.block_table:
            self.pool.release(req.block_table)
            req.block_table = []
        req.num_computed = 0
        req.registered = 0
        return n

    def forget(self, req: Request) -> None:
        """Preemption: the request will be hashed again, under the keys in force when it returns."""
        req.hashes, req.keys = [], None

    # --- register -------------------------------------------------------------------------------
    def register_full_blocks(self, req: Request) -> None:
        """Index every block of `req` that became full since the last call (BlockStored)."""
        full = req.num_computed // self.bs
        if full <= req.registered:
            return
        if req.keys.epoch != self.epoch:  # admitted before the cache changed generation
            req.registered = full
            return
        self.ensure_hashes(req)
        toks, bs = req.tokens, self.bs
        extras = self.extras(req, full)
        for j in range(req.registered, full):
            bid = req.block_table[j]
            parent = req.block_table[j - 1] if j > 0 else None
            tokens = tuple(toks[j * bs:(j + 1) * bs])
            if self.pool.register(bid, req.hashes[j], parent, tokens, extras[j], req.user, req.request_id) \
                    and self.miss is not None:
                self.miss.stored(bid, parent, tokens, self.sig(req, j))
            self.pool.blocks[bid].users_seen.add(req.user)
        req.registered = full
