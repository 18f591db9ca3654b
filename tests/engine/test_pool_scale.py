"""The pool at GPU-workstation sizes: array metadata, O(1) counters, heap eviction, snapshot deltas.

No timing assertions (speed lives in `kvplay bench`, bench/scale.py): these check structure and
compare every incremental structure with a brute-force recount.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from support.pool_view import block_view

from kvplay.engine.pool import STATES, BlockPool, NoFreeBlocks
from kvplay.engine.sampling import SamplingParams
from kvplay.wire.views import BlockArrays, summarize


def test_a_million_block_pool_builds_allocates_and_releases():
    n = 1_000_000
    pool = BlockPool(n, 16, "lru")
    assert pool.num_free() == n and pool.num_cached() == 0 and pool.num_in_use() == 0
    assert len(pool.blocks) == n and pool.blocks[-1].block_id == n - 1 and pool.blocks[n - 1].state == "free"
    chain = pool.allocate(4)
    assert chain == [0, 1, 2, 3]  # never-used blocks go out in id order
    for j, bid in enumerate(chain):
        assert pool.register(bid, 1000 + j, chain[j - 1] if j else None, [j] * 16, (), "alice", "r1")
    for bid in chain:
        pool.add_user(bid, "alice")
    for bid in chain[:2]:
        pool.add_user(bid, "bob")
    pool.release(chain)
    assert pool.num_cached() == 4 and pool.num_free() == n - 4
    rest = pool.allocate(n - 4)  # numpy bulk path
    assert len(rest) == n - 4 and rest[0] == 4 and rest[-1] == n - 1
    assert pool.num_free() == 0 and pool.num_in_use() == n - 4
    state = pool.state_codes()
    assert int((state == STATES.index("in_use")).sum()) == n - 4
    assert int((state == STATES.index("cached")).sum()) == 4
    assert pool.num_dedicated() == n + 2  # two blocks served two users
    got = pool.allocate(1)  # LRU: the chain's tail was released first
    assert got == [chain[3]] and pool.evictions == 1
    assert pool.blocks[chain[3]].creator is None and pool.blocks[chain[3]].state == "in_use"
    pool.release(rest[-10:])
    assert pool.num_free() == 10 and pool.free_ids() == rest[-10:][::-1]  # released tail first
    assert pool.allocate(2) == [rest[-1], rest[-2]]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(12)
    assert pool.clear() == 3  # the three cached blocks left of the chain
    assert pool.num_cached() == 0 and pool.num_free() == 11 and not pool.index


# --- a brute-force reference ----------------------------------------------------------------------
class Reference:
    """Tracks, from the outside, the order blocks became evictable; recounts everything from
    the views; picks victims the way the O(cached) scan did."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.order: list[int] = []  # became-evictable order

    def sync(self, released=()):
        cached = {b.block_id for b in self.pool.blocks if b.state == "cached"}
        self.order = [b for b in self.order if b in cached]
        for b in reversed(released):
            if b in cached and b not in self.order:
                self.order.append(b)
        assert set(self.order) == cached

    def victim(self) -> int:
        blocks, name = self.pool.blocks, self.pool.policy.name
        if name == "lru":
            return self.order[0]
        if name == "lfu":
            return min(self.order, key=lambda b: blocks[b].hits)
        return min(self.order, key=lambda b: blocks[b].created_seq)

    def counts(self) -> dict:
        views = list(self.pool.blocks)
        resident = [b for b in views if b.state != "free"]
        return {"free": sum(b.state == "free" for b in views), "cached": sum(b.state == "cached" for b in views),
                "in_use": sum(b.state == "in_use" for b in views), "resident": len(resident),
                "dedicated": sum(max(1, len(b.users_seen)) for b in resident)}


def pool_counts(pool: BlockPool) -> dict:
    return {"free": pool.num_free(), "cached": pool.num_cached(), "in_use": pool.num_in_use(),
            "resident": pool.num_resident(), "dedicated": pool.num_dedicated()}


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("seed", range(6))
def test_random_ops_keep_counters_and_eviction_order_equal_to_brute_force(policy, seed):
    rng = random.Random(seed)
    pool = BlockPool(24, 2, policy)
    ref = Reference(pool)
    held: list[list[int]] = []
    users = ["alice", "bob", "carol"]
    n = 0
    checked_victims = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            table = []
            if pool.index and rng.random() < 0.5:  # reuse a prefix: touch an indexed chain root
                bid = rng.choice(sorted(pool.index.values()))
                pool.touch([bid], hit=rng.random() < 0.8)
                pool.add_user(bid, rng.choice(users))
                table.append(bid)
                ref.sync()
            k = rng.randint(1, 4)
            if k > pool.available():
                if table:
                    pool.release(table)
                ref.sync(table)
                continue
            new = []
            while len(new) < k:  # one block at a time: each eviction is checked
                if pool.num_free() == 0:
                    want = ref.victim()
                    got = pool.allocate(1)
                    assert got == [want], (pool.policy.name, got, want)
                    checked_victims += 1
                    ref.sync()
                else:
                    got = pool.allocate(1)
                new += got
            user = rng.choice(users)
            for j, bid in enumerate(new):
                n += 1
                if rng.random() < 0.8:
                    parent = new[j - 1] if j else None
                    pool.register(bid, n % 11, parent, [n, 0], (), user, f"r{n}")
                    pool.add_user(bid, user)
            table += new
            held.append(table)
            ref.sync()
        elif op < 0.85 and held:
            table = held.pop(rng.randrange(len(held)))
            pool.release(table)
            ref.sync(table)
        elif op < 0.9:
            pool.clear()
            ref.sync()
        elif op < 0.92 and pool.num_cached():
            other = {"lru": "lfu", "lfu": "fifo", "fifo": "lru"}[pool.policy.name]
            from kvplay.engine.eviction import make_policy

            pool.set_policy(make_policy(other))
            assert pool.policy.ids() == ref.order  # the became-evictable order carries over
        assert pool_counts(pool) == ref.counts()
        pool.check()
    assert checked_victims > 0


def test_lfu_and_fifo_heaps_forget_removed_blocks():
    for policy in ("lfu", "fifo"):
        pool = BlockPool(200, 1, policy)
        ids = pool.allocate(200)
        for j, bid in enumerate(ids):
            pool.register(bid, j, None, [j], (), "u", "r")
        pool.release(ids)
        for _ in range(5):  # many hits and releases: stale heap entries pile up, then get dropped
            pool.touch(ids[:150])
            pool.release(ids[:150])
        assert len(pool.policy._heap) <= 2 * len(pool.policy) + 64
        order = [pool.allocate(1)[0] for _ in range(200)]
        if policy == "lfu":  # never-hit blocks first, then by the order they became evictable
            assert order[:50] == sorted(ids[150:], reverse=True)
        else:
            assert order == ids  # created first, evicted first
        pool.check()


# --- the engine's events, mirrored, on a real tiny model --------------------------------------------
def full_views(eng):
    return eng.call(lambda: [block_view(eng.pool, b) for b in range(eng.pool.num_blocks)])


def brute_stats(eng):
    views = full_views(eng)
    bb = eng.runner.store.block_bytes
    resident = [v for v in views if v.state != "free"]
    dedicated = sum(max(1, len(v.users)) for v in resident)
    return {"blocks_free": sum(v.state == "free" for v in views),
            "blocks_cached": sum(v.state == "cached" for v in views),
            "blocks_in_use": sum(v.state == "in_use" for v in views),
            "used_bytes": bb * len(resident), "dedicated_bytes": bb * dedicated,
            "bytes_saved": bb * (dedicated - len(resident))}


SYSTEM = {"role": "system", "content": "A shared system prompt for every user here. " * 3}


def test_mirror_stats_and_summary_match_a_full_recount(tiny_llama):
    """After every turn, a Mirror fed only by the engine's batches equals a full recount of
    the pool (refs, hashes, creators, tokens, hits, users), the engine's O(1) stats equal a
    brute-force count, and its ranged arrays and summaries agree with the recount."""
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.wire.mirror import Mirror

    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=48, eviction="lfu"), tiny_llama)
    mirror = Mirror(48)
    eng.subscribe_batches(mirror.apply)
    eng.start()
    try:
        assert len(mirror.views()) == 48 and all(v.state == "free" for v in mirror.views())
        for i, user in enumerate(["alice", "bob", "carol", "alice", "dave", "bob"]):
            msgs = [SYSTEM, {"role": "user", "content": f"question {i % 3} from someone " * (1 + i % 2)}]
            eng.generate(user, msgs, SamplingParams(max_tokens=4), timeout=60)
            truth = full_views(eng)
            got = eng.call(mirror.views)
            assert [(v.state, v.ref_count, v.hash, v.creator, v.token_ids, v.hits, v.users) for v in got] == \
                   [(v.state, v.ref_count, v.hash, v.creator, v.token_ids, v.hits, v.users) for v in truth]
            stats = eng.stats()
            assert {k: stats[k] for k in brute_stats(eng)} == brute_stats(eng)
    finally:
        eng.shutdown()

    arrays = mirror.arrays()
    assert [STATES[c] for c in arrays.state] == [v.state for v in truth]
    assert [arrays.users[c] if c >= 0 else None for c in arrays.creator] == [v.creator for v in truth]
    summary = mirror.summary(5, user="alice")
    assert summary.cells == 5 and summary.bounds[0] == 0 and summary.bounds[-1] == 48
    for k in range(5):
        cell = truth[summary.bounds[k]:summary.bounds[k + 1]]
        counts = {s: sum(v.state == s for v in cell) for s in STATES}
        assert (summary.free[k], summary.cached[k], summary.in_use[k]) == tuple(counts[s] for s in STATES)
        assert counts[STATES[summary.state[k]]] == max(counts.values())
        owners = [v.creator for v in cell if v.state != "free" and v.creator]
        if owners:
            top = summary.users[summary.creator[k]]
            assert owners.count(top) == max(owners.count(u) for u in owners)
        else:
            assert summary.creator[k] == -1
        assert summary.mine[k] == owners.count("alice")
    zoom = mirror.summary(100, start=10, stop=20)
    assert zoom.cells == 10 and list(zoom.bounds) == list(range(10, 21))
    assert [STATES[s] for s in zoom.state] == [v.state for v in truth[10:20]]


def test_stats_never_wait_with_timeout_zero_and_are_o1_counters(make_engine):
    from kvplay.wire.mirror import Mirror

    eng = make_engine(num_blocks=32)
    mirror = Mirror(32)
    eng.subscribe_batches(mirror.apply)
    eng.generate("alice", [SYSTEM, {"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), timeout=60)
    with eng._lock:  # the engine busy in a step: the published copy comes back at once
        published = eng.stats(timeout=0)
    assert published == eng.stats()
    assert published["blocks_cached"] > 0
    arr = eng.call(mirror.arrays)
    assert isinstance(arr.state, np.ndarray) and arr.state.dtype == np.int8


def test_branching_prefixes_and_odd_token_rows():
    pool = BlockPool(8, 2, "fifo")
    root = pool.allocate(1)[0]
    assert pool.register(root, 1, None, [7, 8], (("model", "m"),), "alice", "r1")
    kids = pool.allocate(3)
    for j, bid in enumerate(kids):  # three users continue the same first block differently
        assert pool.register(bid, 10 + j, root, [j, 2**40] if j == 2 else [j, j], (), f"user{j}", f"r{j}")
    grand = pool.allocate(1)[0]
    assert pool.register(grand, 20, kids[0], [5], (), "user0", "r0")  # a short (partial) row
    assert pool.blocks[kids[2]].token_ids == (2, 2**40) and pool.blocks[grand].token_ids == (5,)
    assert pool.blocks[root].extra == (("model", "m"),) and pool.blocks[kids[1]].extra == ()
    pool.check()
    pool.release([grand])
    pool.release(kids)
    pool.release([root])
    pool.check()
    assert pool.num_cached() == 5
    pool.allocate(4)  # 3 free blocks, then FIFO evicts the root: every descendant goes with it
    assert pool.evictions == 5 and not pool.index and not pool.children
    assert pool.num_free() == 4 and pool.blocks[kids[2]].token_ids == ()
    pool.check()


@pytest.mark.parametrize("used_fraction", [0.0, 0.05, 0.9])
def test_summary_cells_equal_a_brute_force_count(used_fraction):
    rng = np.random.default_rng(7)
    n, users = 997, ("alice", "bob", "carol")
    state = np.where(rng.random(n) < used_fraction, rng.integers(1, 3, n), 0).astype(np.int8)
    creator = np.where((state > 0) & (rng.random(n) < 0.9), rng.integers(0, 3, n), -1).astype(np.int32)
    arrays = BlockArrays(3, 100, state, creator, users)
    for cells in (1, 7, 200, 997, 5000):
        s = summarize(arrays, cells, user="bob")
        assert s.cells == min(cells, n) and s.bounds[0] == 100 and s.bounds[-1] == 100 + n
        assert all(b - a in (n // s.cells, n // s.cells + 1) for a, b in zip(s.bounds[:-1], s.bounds[1:]))
        for k in range(s.cells):
            a, b = s.bounds[k] - 100, s.bounds[k + 1] - 100
            st, cr = state[a:b].tolist(), creator[a:b].tolist()
            assert (s.free[k], s.cached[k], s.in_use[k]) == (st.count(0), st.count(1), st.count(2))
            owned = [c for x, c in zip(st, cr) if x and c >= 0]
            assert s.mine[k] == owned.count(1)
            if owned:
                assert owned.count(s.creator[k]) == max(owned.count(c) for c in set(owned))
            else:
                assert s.creator[k] == -1
