"""A Hypothesis state machine over the real scheduler, pool and a 1-layer tiny model (issue 9).

Rules: submit (random users, shared and private prefixes that chain over several blocks, long
prompts that press on a small pool), step, cancel, force a preemption, register a user or move
one to another group, change isolation, start a new cache generation (hash seed), clear the
cache. The test thread drives ``Scheduler.step()`` itself (no engine thread).

Invariants after every rule: the pool's own check; every block's ref count equals its
occurrences in the live block tables; no request holds (or ever hit) a block stored under other
extra keys than its own frozen ones (salt included), checked against what was recorded when the
block was stored; sha256 never reports a collision; token counters stay consistent. At teardown
every request finishes.
"""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.errors import EngineError
from kvplay.engine.events import BlockHit, BlockRemoved, BlockStored, CollisionCaught
from kvplay.engine.model import LoadedModel
from kvplay.engine.prefix import salted_extras
from kvplay.engine.request import FINISHED, RUNNING, WAITING
from kvplay.engine.sampling import SamplingParams

BS = 4  # tokens per block: short prompts still span several chained blocks
USERS = ["alice", "bob", "carol", "mallory"]
GROUPS = [None, "g1", "alice", "bob"]  # "alice", "bob": groups named like users
SHARED = [list(range(10, 22)), list(range(30, 38))]  # shared prefixes (3 and 2 blocks)
STEPS = collections.Counter()


@pytest.fixture(scope="module")
def one_layer():
    from kvplay.engine.tiny import build_tiny

    model, tok = build_tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1)
    return LoadedModel(model.float().eval(), tok, "tiny:llama", torch.device("cpu"), torch.float32)


class SchedulerMachine(RuleBasedStateMachine):
    loaded = None  # set by the test

    def __init__(self):
        super().__init__()
        self.eng = Engine(EngineConfig(model="tiny:llama", block_size=BS, num_blocks=16, prefill_budget=8,
                                       max_running=4), self.loaded)
        self.sch = self.eng.scheduler
        self.reqs = {}
        self.stored = {}  # block id -> extra keys recorded when it was stored (from its creator's keys)
        self.problems = []
        self.eng.register_user("mallory", "alice")  # the group attack, from the start
        # observe the cache events as the pool and the KV manager queue them (the requests' keys
        # and block tables are read then, before the step goes on)
        queue = self.eng.events.put

        def observed(ev):
            queue(ev)
            self._on_event(ev)
        self.eng.pool.emit = self.eng.kv.emit = observed

    # --- the independent record of what each block was stored under --------------------------
    def _expected(self, req, j):
        return tuple(salted_extras(req.keys.isolation, req.keys.salt, self.eng.kv.model_key, j + 1,
                                   req.system_tokens, BS)[j])

    @staticmethod
    def _identity(user, group, isolation):
        """Who may share a salted block under `isolation` (the definition, not salt_for)."""
        if isolation == "group" and group is not None:
            return ("group", group)
        return ("user", user)

    def _check_share(self, req, j, b, what):
        extras, creator, creator_group = self.stored[b]
        if extras != self._expected(req, j):
            self.problems.append(f"{req.user} {what} block {b} stored under {extras}")
        first_salted = req.system_tokens // BS if req.keys.isolation == "system" else 0
        if req.keys.salt is not None and j >= first_salted:  # a salted chain: owners only
            iso = req.keys.isolation
            if creator != req.user:
                STEPS[f"cross-user {iso} share"] += 1
            if self._identity(creator, creator_group, iso) != self._identity(req.user, req.group, iso):
                self.problems.append(f"{req.user} ({req.group}) {what} {creator}'s ({creator_group}) "
                                     f"block {b} under {iso} isolation")

    def _on_event(self, ev):
        if isinstance(ev, BlockStored):
            req = self.reqs[ev.request_id]
            for b in ev.block_ids:
                self.stored[b] = (self._expected(req, req.block_table.index(b)), req.user, req.group)
        elif isinstance(ev, BlockRemoved):
            for b in ev.block_ids:
                self.stored.pop(b, None)
        elif isinstance(ev, BlockHit):
            req = self.reqs[ev.request_id]
            for j, b in enumerate(ev.block_ids):
                if b not in self.stored:
                    self.problems.append(f"{req.user} hit block {b}, which was never stored")
                else:
                    self._check_share(req, j, b, "hit")
        elif isinstance(ev, CollisionCaught):
            self.problems.append(f"sha256 reported a collision: {ev}")

    # --- rules --------------------------------------------------------------------------------
    @rule(user=st.sampled_from(USERS), shared=st.sampled_from([None, 0, 1]),
          private=st.lists(st.integers(40, 60), max_size=9), max_tokens=st.integers(1, 6))
    def submit(self, user, shared, private, max_tokens):
        prefix = SHARED[shared] if shared is not None else []
        prompt = prefix + private or [1]
        req = self.eng.make_request(user, prompt_ids=prompt, system_tokens=len(prefix),
                                    sampling=SamplingParams(max_tokens=max_tokens, stop_on_eos=False))
        self.reqs[req.request_id] = req
        self.eng.take_in(req)

    @rule(user=st.sampled_from(USERS), tokens=st.integers(36, 52))
    def submit_big(self, user, tokens):
        """Presses on the pool (16 blocks of 4): preemption and pool_exhausted."""
        req = self.eng.make_request(user, prompt_ids=[61 + i % 7 for i in range(tokens)],
                                    sampling=SamplingParams(max_tokens=8, stop_on_eos=False))
        self.reqs[req.request_id] = req
        self.eng.take_in(req)

    @rule(times=st.integers(1, 3))
    def step(self, times):
        for _ in range(times):
            if self.sch.has_work():
                self.eng.step()
                STEPS["scheduler steps"] += 1

    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r in self.reqs.values() if r.status != FINISHED]
        if live:
            self.sch.cancel(data.draw(st.sampled_from(live)).request_id)

    @rule(data=st.data())
    def preempt(self, data):
        if self.sch.running:
            self.sch._preempt(data.draw(st.sampled_from(self.sch.running)))

    @rule(user=st.sampled_from(USERS), group=st.sampled_from(GROUPS))
    def regroup(self, user, group):
        self.eng.set_group(user, group)

    @rule(user=st.sampled_from(USERS), group=st.sampled_from(GROUPS))
    def register(self, user, group):
        known = self.eng.users.users()
        if user in known and known[user] != group:
            with pytest.raises(EngineError, match="set_group"):
                self.eng.register_user(user, group)
        else:
            self.eng.register_user(user, group)
            assert self.eng.users.users()[user] == group

    @rule(mode=st.sampled_from(["shared", "user", "group", "system"]))
    def isolation(self, mode):
        self.eng.reconfigure(isolation=mode)

    @rule(seed=st.sampled_from(["kvplay", "other"]))
    def hash_seed(self, seed):
        self.eng.reconfigure(hash_seed=seed)  # a new cache generation when it changes

    @rule()
    def clear(self):
        self.eng.clear_cache()

    # --- invariants ---------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        STEPS["rules"] += 1
        pool, sch = self.eng.pool, self.sch
        pool.check()
        refs = collections.Counter(b for r in sch.running for b in r.block_table)
        for blk in pool.blocks:
            assert blk.ref_count == refs.get(blk.block_id, 0), (blk, refs)
        for r in sch.waiting:
            assert r.status == WAITING and not r.block_table
        for r in sch.running:
            assert r.status == RUNNING and r.keys is not None
            assert len(r.block_table) * BS >= r.num_computed
            for j, b in enumerate(r.block_table):
                if b in self.stored:
                    self._check_share(r, j, b, "holds")
        assert not self.problems, self.problems
        assert sch.collisions_caught == 0
        assert sch.hit_tokens <= sch.query_tokens

    def teardown(self):
        for _ in range(2000):
            if not self.sch.has_work():
                break
            self.eng.step()
        try:
            assert not self.sch.has_work(), "requests left unfinished"
            for r in self.reqs.values():
                assert r.status == FINISHED and r.handle.result(0).finish_reason in (
                    "stop", "length", "pool_exhausted", "cancelled", "error"), r
            self.eng.pool.check()
            assert self.eng.pool.num_in_use() == 0
            assert not self.problems, self.problems
        finally:
            self.eng.shutdown()


def test_scheduler_state_machine(one_layer):
    SchedulerMachine.loaded = one_layer
    STEPS.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=120, stateful_step_count=100, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    print(dict(STEPS))
    assert STEPS["rules"] >= 10_000, STEPS
