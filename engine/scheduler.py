"""The scheduler: decides what runs in each step over the shared pool (continuous batching).

``schedule()`` returns a ``SchedulerOutput``, the step's decision:

1. **admission** (FIFO, at most ``max_running`` running): a waiting request gets its block table
   from the KV manager (``kv_manager.py``: cached prefix shared, the rest allocated). A request
   whose next prompt block another running request is computing right now waits a step and
   reuses it instead (users arriving together compute a shared system prompt once). A request
   that cannot fit even in an idle pool finishes with an error;
2. **decode**: every running request with a single pending token gets the slot for it (a new
   block at a block boundary); when the pool is exhausted the newest running request is
   preempted (its blocks are freed, it is recomputed later), and a request alone in a full pool
   stops with ``pool_exhausted``;
3. **chunked prefill**: prompt chunks of at most ``prefill_budget`` tokens in all, so a long
   prompt never freezes the others' streaming (deterministic mode ends chunks on block
   boundaries). At least the last prompt token is always computed (its logits start the answer).

The scheduler runs no model: the engine (``engine.py``, ``Engine.step``) has the model runner
(``runner.py``) execute the decision's rows (decode rows and prefill rows in one batched forward,
as vLLM v1 mixes them: on CPU a step costs mostly one pass over the weights, so two forwards cost
nearly twice one) and hands the logits back to ``update``, which advances each request, has the
KV manager register the blocks that became full, and gives the logits to the output processor
(``output.py``: sampling, incremental detokenising, streaming, stats), finishing the requests it
says are done. The engine builds the KV manager and the output processor and hands them in.

A preempted request drops its blocks and hash keys; it is re-admitted under the isolation mode
in force at its re-admission (with the group it was submitted with). See kv_manager.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .events import Event, RequestPreempted, RequestStarted
from .kv_manager import KVManager
from .output import OutputProcessor
from .request import FINISHED, RUNNING, WAITING, Request
from .runner import Row


@dataclass
class SchedulerOutput:
    """One step's decision: who decodes a token, and which prompt chunks are computed."""
    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)

    def decode_rows(self) -> list[Row]:
        return [Row(r.block_table, r.num_computed, [r.tokens[-1]]) for r in self.decode]

    def prefill_rows(self) -> list[Row]:
        return [Row(r.block_table, r.num_computed, r.tokens[r.num_computed:r.num_computed + n])
                for r, n in self.prefill]

    def rows(self) -> list[Row]:
        """What the model runner computes: the decode rows, then the prefill rows."""
        return self.decode_rows() + self.prefill_rows()

    def computed(self) -> list[tuple[Request, int]]:
        """(request, tokens computed) per row, in `rows` order."""
        return [(r, 1) for r in self.decode] + self.prefill

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, config, kv: KVManager, output: OutputProcessor, emit: Callable[[Event], None]):
        self.config = config
        self.kv = kv
        self.pool = kv.pool
        self.output = output
        self.emit = emit
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0
        self.finished = 0

    # --- counters kept by the KV manager (read by stats, the simulator and tests) ----------------
    @property
    def query_tokens(self) -> int:
        return self.kv.query_tokens

    @property
    def hit_tokens(self) -> int:
        return self.kv.hit_tokens

    @property
    def collisions_caught(self) -> int:
        return self.kv.collisions_caught

    @property
    def bs(self) -> int:
        return self.pool.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # --- the decision -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Admit what fits, reserve decode slots (preempting when the pool is full), plan the
        prefill chunks. Changes queue and block state, runs no model."""
        self._admit()
        out = SchedulerOutput()
        decoders = [r for r in self.running if r.pending == 1]
        for r in decoders:  # reserving a slot may preempt others in this list (or r itself)
            if r.status == RUNNING:
                self._reserve_decode_slot(r)
        out.decode = [r for r in decoders if r.status == RUNNING]
        out.prefill = self._plan_prefill()
        return out

    def _admit(self) -> None:
        inflight = self.kv.inflight_hashes(self.running)
        i = 0
        while i < len(self.waiting) and len(self.running) < self.config.max_running:
            req = self.waiting[i]
            self.kv.freeze_keys(req)
            if not req.admitted_once and self.kv.computed_elsewhere(req, inflight):
                i += 1  # later arrivals may still be admitted; this one retries next step
                continue
            adm = self.kv.admit(req)
            if adm is None:
                if not self.running:  # nothing will free blocks: the request can never fit
                    self.waiting.pop(i)
                    self._finish(req, "error", error=(
                        f"message needs {-(-req.num_tokens // self.bs)} blocks of {self.bs} tokens; "
                        f"{self.config.pool_size_hint(self.pool.num_blocks)}"))
                    continue
                break
            self.waiting.pop(i)
            self.running.append(req)
            self._started(req, adm.cached_tokens, adm.by_creator)
            inflight |= self.kv.inflight_hashes([req])

    def _started(self, req: Request, cached: int, by_creator: dict[str, int]) -> None:
        st = req.stats
        if not req.admitted_once:
            req.admitted_once = True
            req.start_time = time.perf_counter()
            st.queued_ms = (req.start_time - req.arrival) * 1000
            st.cached_tokens = cached
            st.computed_tokens = len(req.prompt_ids) - cached
            st.cached_from = dict(by_creator)
        else:
            st.recomputed_tokens += max(0, req.high_water - cached)
        req.status = RUNNING
        self.emit(RequestStarted(request_id=req.request_id, user=req.user, cached_tokens=cached))

    def _preempt(self, victim: Request) -> None:
        freed = self.kv.free(victim)
        self.kv.forget(victim)  # re-admitted under the keys in force then
        victim.status = WAITING
        victim.stats.preemptions += 1
        self.preemptions += 1
        self.running.remove(victim)
        self.waiting.insert(0, victim)
        self.emit(RequestPreempted(request_id=victim.request_id, user=victim.user, freed_blocks=freed))

    def _reserve_decode_slot(self, req: Request) -> bool:
        """The block for position req.num_computed; preempt the newest request while the pool is
        full. Returns False when `req` itself was preempted or stopped."""
        while not self.kv.reserve_slot(req):
            victim = max(self.running, key=lambda r: r.arrival)
            if victim is req and len(self.running) == 1:
                self._finish(req, "pool_exhausted")  # alone and the pool is full
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

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

    # --- after the engine ran the decision ------------------------------------------------------
    def update(self, decision: SchedulerOutput, logits) -> None:
        """After the forward of `decision.rows()`: `n` more tokens of each request are in the
        pool; register the blocks that became full; a request with nothing left pending gets its
        next token (`logits`: one per row, None for a row whose logits are not needed)."""
        for (r, n), lg in zip(decision.computed(), logits):
            r.num_computed += n
            r.high_water = max(r.high_water, r.num_computed)
            self.kv.register_full_blocks(r)
            if r.pending == 0 and lg is not None:
                try:
                    reason = self.output.process(r, lg)
                except Exception as exc:  # one request's sampling/output fails that request only
                    self._finish(r, "error", error=f"request failed in sampling: {type(exc).__name__}: {exc}")
                    continue
                if reason is not None:
                    self._finish(r, reason)

    # --- finishing ------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status == FINISHED:
            return
        self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        self.finished += 1
        self.output.finish(req, reason, error)

    def cancel(self, request_id: str) -> bool:
        for req in self.running + self.waiting:
            if req.request_id == request_id:
                self._finish(req, "cancelled")
                return True
        return False

    def fail_all(self, error: str) -> None:
        for req in list(self.running + self.waiting):
            self._finish(req, "error", error=error)
