"""The block pool, eviction policies and hashing, without a model."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplay.engine.errors import EngineError
from kvplay.engine.pool import BlockPool, NoFreeBlocks
from kvplay.engine.prefix import BlockHasher, block_extras, parse_hash_name


def fill(pool, n, tag, user="u"):
    ids = pool.allocate(n)
    for j, bid in enumerate(ids):
        pool.register(bid, hash((tag, j)), ids[j - 1] if j else None, [j] * pool.block_size, (), user, tag)
    return ids


def test_lru_evicts_least_recent_and_chain_tail_first():
    pool = BlockPool(6, 4, "lru")
    a = fill(pool, 3, "a")
    pool.release(a)  # released together: tail (a[2]) becomes evictable first
    b = fill(pool, 3, "b")
    pool.release(b)
    pool.touch([a[0]])
    pool.release([a[0]])  # a[0] is now most recent
    got = pool.allocate(3)
    assert got == [a[2], a[1], b[2]]
    pool.check()


def test_lfu_evicts_fewest_hits():
    pool = BlockPool(3, 4, "lfu")
    ids = fill(pool, 3, "x")
    pool.release(ids)
    for _ in range(3):
        pool.touch([ids[0], ids[2]])
        pool.release([ids[0], ids[2]])
    assert pool.allocate(1) == [ids[1]]


def test_fifo_evicts_oldest_created():
    pool = BlockPool(3, 4, "fifo")
    first = fill(pool, 1, "first")
    later = fill(pool, 2, "later")
    pool.release(later)
    pool.release(first)  # released last, but created first
    assert pool.allocate(1) == first


def test_touch_without_a_hit_re_references_only():
    pool = BlockPool(4, 4, "lfu")
    a = fill(pool, 2, "a")
    pool.release(a)
    pool.touch(a, hit=False)  # a preempted request re-admitted: no new hit, no new user
    assert [pool.blocks[b].ref_count for b in a] == [1, 1] and [pool.blocks[b].hits for b in a] == [0, 0]
    assert pool.num_cached() == 0 and pool.num_in_use() == 2
    pool.touch(a[:1])
    assert pool.blocks[a[0]].hits == 1 and pool.blocks[a[0]].ref_count == 2
    pool.release(a)
    pool.release(a[:1])
    pool.check()


def test_free_blocks_are_used_before_evicting():
    pool = BlockPool(4, 4)
    a = fill(pool, 2, "a")
    pool.release(a)
    pool.allocate(2)
    assert pool.evictions == 0 and pool.num_cached() == 2
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)


def test_duplicate_hash_stays_unindexed_and_returns_free():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    assert pool.register(a[0], 123, None, [1, 2, 3, 4], (), "alice", "r1")
    assert not pool.register(a[1], 123, None, [1, 2, 3, 4], (), "bob", "r2")
    pool.release(a)
    assert pool.num_cached() == 1 and pool.num_free() == 3
    pool.check()


def test_clear_keeps_in_use_blocks_but_unindexes_them():
    pool = BlockPool(4, 4)
    a = fill(pool, 2, "a")
    b = fill(pool, 1, "b")
    pool.release(a)
    assert pool.clear() == 2
    assert pool.lookup(hash(("b", 0))) is None
    pool.release(b)
    assert pool.num_free() == 4
    pool.check()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / register / release / evict / clear / preempt sequences keep
    ref counts, the free queue and the hash index consistent."""

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, 2, self.policy)
        self.held: list[list[int]] = []  # block tables of live "requests"
        self.n = 0

    @rule(n=st.integers(1, 5), share=st.booleans())
    def allocate(self, n, share):
        table = []
        if share and self.pool.index:
            bid = next(iter(self.pool.index.values()))
            self.pool.touch([bid], hit=self.n % 2 == 0)
            self.pool.add_user(bid, f"user{self.n % 3}")
            table.append(bid)
        try:
            new = self.pool.allocate(n)
        except NoFreeBlocks:
            if table:
                self.pool.release(table)
            return
        for bid in new:
            self.n += 1
            if self.n % 3:
                self.pool.register(bid, self.n % 7, None, [self.n, 0], (), "u", "r")
        self.held.append(table + new)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.pool.release(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held)
    @rule()
    def preempt_newest(self):
        self.pool.release(self.held.pop())

    @rule()
    def clear(self):
        self.pool.clear()

    @invariant()
    def consistent(self):
        self.pool.check()
        refs = {}
        for t in self.held:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        for blk in self.pool.blocks:
            assert blk.ref_count == refs.get(blk.block_id, 0)
        assert self.pool.num_free() + self.pool.num_cached() + self.pool.num_in_use() == 12


class LFUPoolMachine(PoolMachine):
    policy = "lfu"


class FIFOPoolMachine(PoolMachine):
    policy = "fifo"


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLFUPoolMachine = LFUPoolMachine.TestCase
TestLFUPoolMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestFIFOPoolMachine = FIFOPoolMachine.TestCase
TestFIFOPoolMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


def test_hash_names_and_widths():
    assert parse_hash_name("sha256").bits == 256
    assert parse_hash_name("blake2b64").bits == 64
    h = parse_hash_name("trunc:12")
    assert h.bits == 12 and all(h(bytes([i])) < 4096 for i in range(50))
    for bad in ("trunc:0", "trunc:257", "trunc:x", "md5"):
        with pytest.raises(EngineError):
            parse_hash_name(bad)


def test_chain_depends_on_parent_and_typed_extra_keys():
    hs = BlockHasher("sha256", 4)
    toks = list(range(12))
    base = hs.chain(toks)
    assert len(base) == 3 and len(set(base)) == 3
    salted = hs.chain(toks, [[("salt", "user:alice")]])
    assert all(x != y for x, y in zip(base, salted))  # salt in block 0 changes every later hash
    # A salt and a model key with the same string never collide (vllm#44701)
    assert hs.block_hash(None, toks[:4], [("salt", "X")]) != hs.block_hash(None, toks[:4], [("model", "X")])
    # same tokens after a different prefix -> different hash
    other = hs.chain([99] + toks[1:])
    assert other[1] != base[1]


def test_system_isolation_salts_after_the_system_prompt():
    ex = block_extras("system", "alice", None, "m", num_blocks=5, system_tokens=33, block_size=16)
    assert ex[0] == [("model", "m")] and ex[1] == []
    assert ex[2] == [("salt", "user:alice")]  # block 2 (tokens 32..47) reaches past the system prompt
    assert block_extras("shared", "a", None, "m", 2, 0, 16) == [[("model", "m")], []]
    assert block_extras("group", "a", "g", "m", 1, 0, 16)[0][1] == ("salt", "group:g")


def test_blocks_registered_after_a_clear_are_not_indexed_under_an_unindexed_parent():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    assert pool.register(a[0], 10, None, [1] * 4, (), "alice", "r1")
    pool.clear()  # a[0] is in use: it leaves the index but keeps serving its request
    assert not pool.register(a[1], 11, a[0], [2] * 4, (), "alice", "r1")
    pool.release(a)
    assert pool.num_free() == 6
    b = pool.allocate(2)  # the same prefix computed again is indexed normally
    assert pool.register(b[0], 10, None, [1] * 4, (), "bob", "r2")
    assert pool.register(b[1], 11, b[0], [2] * 4, (), "bob", "r2")
    pool.check()


def test_evicting_a_parent_drops_its_unreachable_descendants():
    pool = BlockPool(3, 4, "fifo")
    chain = fill(pool, 3, "c")
    pool.release(chain)
    got = pool.allocate(1)  # FIFO evicts the oldest: the chain's root
    assert got == [chain[0]]
    assert pool.lookup(hash(("c", 1))) is None and pool.lookup(hash(("c", 2))) is None
    assert pool.num_free() == 2 and pool.num_cached() == 0
    pool.check()
