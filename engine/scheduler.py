"""Continuous batching over the shared pool.

Each ``step()``:

1. admits waiting requests (FIFO) while blocks and running slots allow: the longest cached
   prefix is looked up block by block (verify-on-hit compares stored tokens, extra keys and
   the parent block), hit blocks are shared (ref += 1), the rest of the prompt gets new blocks;
2. runs **one batched decode forward** for every request that has a single pending token
   (a new block is allocated at a block boundary; when the pool is exhausted the newest
   running request is preempted: its blocks are freed and it is recomputed later);
3. runs **one chunked prefill forward** over prefilling requests, at most ``prefill_budget``
   tokens, so a long prompt never freezes the others' streaming. In deterministic mode chunks
   end on block boundaries;
4. registers every block that became full (BlockStored) and samples/streams tokens.

At least the last prompt token is always computed (its logits start the answer).

Hash keys are frozen at admission (``HashKeys``: cache epoch, hasher, isolation, salt): a
running request hashes, looks up and verifies under the keys it was admitted with, whatever
``reconfigure`` changes meanwhile. A preempted request drops its hashes and keys; it is
re-admitted under the isolation mode (and hasher) in force at its re-admission, with the group
it was submitted with. Blocks a request fills after a new cache epoch began (hash, seed or
determinism changed) are never indexed: nobody could reach them under the new keys.
"""
from __future__ import annotations

import time
from typing import Callable

from .events import (BlockHit, CollisionCaught, Event, FirstToken, RequestFinished,
                     RequestPreempted, RequestStarted)
from .pool import BlockPool, NoFreeBlocks
from .prefix import BlockHasher, salt_for, salted_extras
from .request import FINISHED, RUNNING, WAITING, HashKeys, Request, RequestResult, TokenDelta
from .runner import ModelRunner, Row
from .sampling import sample


class Scheduler:
    def __init__(self, config, pool: BlockPool, runner: ModelRunner, hasher: BlockHasher,
                 tokenizer, model_key: str, emit: Callable[[Event], None], eos_ids: set[int]):
        self.config = config
        self.pool = pool
        self.runner = runner
        self.hasher = hasher
        self.tokenizer = tokenizer
        self.model_key = model_key
        self.emit = emit
        self.eos_ids = eos_ids
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # token-level prefix-cache counters (first admission only: recompute after
        # preemption is not a "hit", cf. vllm#25780)
        self.query_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.collisions_caught = 0
        self.finished = 0
        self.epoch = 0  # cache generation: bumped when the hash, seed or determinism changes

    # --- bookkeeping --------------------------------------------------------------------------
    @property
    def bs(self) -> int:
        return self.pool.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _freeze_keys(self, req: Request) -> None:
        """Before an admission attempt: fix the keys the request is hashed under to those in
        force now (a waiting request whose keys changed drops its hashes)."""
        iso = self.config.isolation
        keys = HashKeys(self.epoch, self.hasher, iso, salt_for(iso, req.user, req.group))
        if req.keys != keys:
            req.keys = keys
            req.hashes = []

    def _extras(self, req: Request, n_blocks: int):
        k = req.keys
        return salted_extras(k.isolation, k.salt, self.model_key, n_blocks, req.system_tokens, self.bs)

    def _ensure_hashes(self, req: Request) -> None:
        """Extend req.hashes to cover every full block of its tokens (under its frozen keys)."""
        full = req.num_tokens // self.bs
        if len(req.hashes) >= full:
            return
        toks = req.tokens
        extras = self._extras(req, full)
        parent = req.hashes[-1] if req.hashes else None
        req.hashes.extend(req.keys.hasher.chain(toks, extras, start_parent=parent, start_block=len(req.hashes)))

    # --- admission ----------------------------------------------------------------------------
    def _reusable_blocks(self, req: Request) -> int:
        """How many of the request's leading full blocks may come from the cache: all but the
        one holding the last token (its logits start the answer, so it is always computed)."""
        self._ensure_hashes(req)
        return min((req.num_tokens - 1) // self.bs, len(req.hashes))

    def _match_prefix(self, req: Request, verify: bool = True) -> list[int]:
        """Ids of the cached blocks that hold the request's longest prefix (verified on hit)."""
        toks = req.tokens
        limit = self._reusable_blocks(req)
        extras = self._extras(req, len(req.hashes))
        matched: list[int] = []
        for j in range(limit):
            blk = self.pool.lookup(req.hashes[j])
            if blk is None:
                break
            if verify and self.config.verify_on_hit:
                want = tuple(toks[j * self.bs:(j + 1) * self.bs])
                parent_ok = blk.parent_id == (matched[-1] if matched else None)
                if blk.token_ids != want or blk.extra != tuple(extras[j]) or not parent_ok:
                    seen = (j, req.hashes[j])
                    if seen not in req.collisions_seen:  # once per request, not per admission retry
                        req.collisions_seen.add(seen)
                        self.collisions_caught += 1
                        req.stats.collisions_caught += 1
                        self.emit(CollisionCaught(request_id=req.request_id, user=req.user,
                                                  block_id=blk.block_id, position=j,
                                                  block_hash=req.keys.hasher.hex(req.hashes[j])))
                    break
            matched.append(blk.block_id)
        return matched

    def _try_admit(self, req: Request) -> bool:
        matched = self._match_prefix(req)
        need = -(-req.num_tokens // self.bs) - len(matched)
        matched_evictable = sum(1 for b in matched if self.pool.blocks[b].ref_count == 0)
        if need > self.pool.available() - matched_evictable:
            return False
        now = time.time()
        first = not req.admitted_once
        self.pool.touch(matched, now, hit=first)  # a re-admission re-references, it is no new hit
        new = self.pool.allocate(need, now)
        req.block_table = matched + new
        req.num_computed = len(matched) * self.bs
        req.registered = len(matched)
        if first:
            for b in matched:
                self.pool.blocks[b].users_seen.add(req.user)
        cached = req.num_computed
        if first:
            req.admitted_once = True
            req.start_time = time.perf_counter()
            req.stats.queued_ms = (req.start_time - req.arrival) * 1000
            req.stats.cached_tokens = cached
            req.stats.computed_tokens = len(req.prompt_ids) - cached
            by: dict[str, int] = {}
            for b in matched:
                c = self.pool.blocks[b].creator or "?"
                by[c] = by.get(c, 0) + self.bs
            req.stats.cached_from = by
            self.query_tokens += len(req.prompt_ids)
            self.hit_tokens += cached
            if matched:
                self.emit(BlockHit(request_id=req.request_id, user=req.user, block_ids=list(matched),
                                   block_hashes=[req.keys.hasher.hex(self.pool.blocks[b].hash) for b in matched],
                                   cached_tokens=cached, by_creator=dict(by)))
        else:
            req.stats.recomputed_tokens += max(0, req.high_water - cached)
        req.status = RUNNING
        self.emit(RequestStarted(request_id=req.request_id, user=req.user, cached_tokens=cached))
        return True

    def _inflight_hashes(self) -> set[int]:
        """Hashes of full blocks that running requests are computing right now."""
        out: set[int] = set()
        for r in self.running:
            if r.pending > 1:
                full = len(r.prompt_ids) // self.bs
                out.update(r.hashes[r.registered:full])
        return out

    def _waits_for_inflight(self, req: Request, inflight: set[int]) -> bool:
        """Would `req` recompute a block another running request is about to store?

        Then it waits a step or more and reuses that block instead (requests that arrive
        together with the same system prompt compute it once, not once each)."""
        if not inflight or req.admitted_once:
            return False
        j = len(self._match_prefix(req, verify=False))
        return j < self._reusable_blocks(req) and req.hashes[j] in inflight

    def _admit(self) -> None:
        inflight = self._inflight_hashes()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.config.max_running:
            req = self.waiting[i]
            self._freeze_keys(req)
            if self._waits_for_inflight(req, inflight):
                i += 1  # later arrivals may still be admitted; this one retries next step
                continue
            if not self._try_admit(req):
                if not self.running:  # nothing will free blocks: the request can never fit
                    self.waiting.pop(i)
                    self._finish(req, "error", error=(
                        f"message needs {-(-req.num_tokens // self.bs)} blocks of {self.bs} tokens; "
                        f"{self.config.pool_size_hint(self.pool.num_blocks)}"))
                    continue
                break
            self.waiting.pop(i)
            self.running.append(req)
            inflight |= self._inflight_hashes()

    # --- preemption ---------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        freed = len(victim.block_table)
        self.pool.release(victim.block_table)
        victim.block_table = []
        victim.num_computed = 0
        victim.registered = 0
        victim.hashes, victim.keys = [], None  # re-admitted under the keys in force then
        victim.status = WAITING
        victim.stats.preemptions += 1
        self.preemptions += 1
        self.running.remove(victim)
        self.waiting.insert(0, victim)
        self.emit(RequestPreempted(request_id=victim.request_id, user=victim.user, freed_blocks=freed))

    def _reserve_decode_slot(self, req: Request) -> bool:
        """Make sure the block for position req.num_computed exists; preempt if the pool is full.
        Returns False when `req` itself had to be preempted or stopped."""
        while req.num_computed // self.bs >= len(req.block_table):
            try:
                req.block_table += self.pool.allocate(1)
            except NoFreeBlocks:
                victim = max(self.running, key=lambda r: r.arrival)
                if victim is req and len(self.running) == 1:
                    self._finish(req, "pool_exhausted", error=None)  # alone and the pool is full
                    return False
                self._preempt(victim)
                if victim is req:
                    return False
        return True

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step. Returns True if any model work was done."""
        self._admit()
        worked = False
        decoders = [r for r in self.running if r.pending == 1]
        for r in decoders:  # reserving a slot may preempt others in this list (or r itself)
            if r.status == RUNNING:
                self._reserve_decode_slot(r)
        decoders = [r for r in decoders if r.status == RUNNING]
        if decoders:
            rows = [Row(r.block_table, r.num_computed, [r.tokens[-1]]) for r in decoders]
            logits = self.runner.forward(rows, self.config.deterministic)
            for r, lg in zip(decoders, logits):
                r.num_computed += 1
                self._after_compute(r, lg)
            worked = True
        prefill = self._plan_prefill()
        if prefill:
            rows = [Row(r.block_table, r.num_computed, r.tokens[r.num_computed:r.num_computed + n])
                    for r, n in prefill]
            logits = self.runner.forward(rows, self.config.deterministic)
            for (r, n), lg in zip(prefill, logits):
                r.num_computed += n
                self._after_compute(r, lg if r.pending == 0 else None)
            worked = True
        return worked

    def _plan_prefill(self) -> list[tuple[Request, int]]:
        budget = self.config.prefill_budget
        out = []
        for r in self.running:
            if r.status != RUNNING or r.pending <= 1 or budget <= 0:
                continue
            n = min(r.pending, budget)
            if self.config.deterministic and n < r.pending:
                end = (r.num_computed + n) // self.bs * self.bs  # end chunks on block boundaries
                n = end - r.num_computed
                if n <= 0:
                    continue
            out.append((r, n))
            budget -= n
        return out

    def _after_compute(self, req: Request, logits) -> None:
        req.high_water = max(req.high_water, req.num_computed)
        self._register_full_blocks(req)
        if logits is None:
            return
        if req.logits_trace is not None:
            req.logits_trace.append(logits.detach().cpu().clone())
        tok = sample(logits, req.sampling, req.generator)
        self._emit_token(req, tok)

    def _register_full_blocks(self, req: Request) -> None:
        full = req.num_computed // self.bs
        if full <= req.registered:
            return
        if req.keys.epoch != self.epoch:  # admitted before the cache changed generation
            req.registered = full
            return
        self._ensure_hashes(req)
        toks = req.tokens
        extras = self._extras(req, full)
        for j in range(req.registered, full):
            parent = req.block_table[j - 1] if j > 0 else None
            self.pool.register(req.block_table[j], req.hashes[j], parent, toks[j * self.bs:(j + 1) * self.bs],
                               extras[j], req.user, req.request_id)
            self.pool.blocks[req.block_table[j]].users_seen.add(req.user)
        req.registered = full

    def _emit_token(self, req: Request, tok: int) -> None:
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
            req.stats.ttft_ms = (now - req.arrival) * 1000
            self.emit(FirstToken(request_id=req.request_id, user=req.user, ttft_ms=req.stats.ttft_ms))
        is_eos = tok in self.eos_ids and req.sampling.stop_on_eos
        if not is_eos:
            req.output_ids.append(tok)
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                delta = ""  # wait for the rest of a multi-byte character
            else:
                delta, req.text = text[len(req.text):], text
            if req.handle is not None:
                req.handle._put(TokenDelta(req.request_id, delta, tok, len(req.output_ids) - 1))
        if is_eos:
            self._finish(req, "stop")
        elif len(req.output_ids) >= req.sampling.max_tokens:
            self._finish(req, "length")
        elif req.num_tokens >= self.runner.max_positions:
            self._finish(req, "length")

    # --- finishing ----------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status == FINISHED:
            return
        if req.block_table:
            self.pool.release(req.block_table)
            req.block_table = []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        now = time.perf_counter()
        st = req.stats
        st.output_tokens = len(req.output_ids)
        st.finish_reason = reason
        st.total_ms = (now - req.arrival) * 1000
        if req.first_token_time is not None and st.output_tokens > 1:
            st.decode_tok_s = (st.output_tokens - 1) / max(now - req.first_token_time, 1e-9)
        full_text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if req.output_ids else ""
        self.finished += 1
        self.emit(RequestFinished(request_id=req.request_id, user=req.user, stats=st.to_dict(),
                                  finish_reason=reason, error=error))
        if req.handle is not None:
            req.handle._put(RequestResult(req.request_id, req.user, full_text, list(req.output_ids), st,
                                          reason, error))

    def cancel(self, request_id: str) -> bool:
        for req in self.running + self.waiting:
            if req.request_id == request_id:
                self._finish(req, "cancelled")
                return True
        return False

    def fail_all(self, error: str) -> None:
        for req in list(self.running + self.waiting):
            self._finish(req, "error", error=error)
