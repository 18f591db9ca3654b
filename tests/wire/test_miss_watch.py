"""Why a watched server computed what it did, from its KV events alone (wire/miss_watch.py):
recomputed after an eviction (when, and whose stores were around it), branches (where, from
whom), the same tokens under other keys, other cache tiers; exact block counts, bounded memory,
hostile input. Through the translator and the mirror (as `kvplay watch` applies a batch), through
`kvplay watch --json` against a scripted publisher, and against `kvplay serve`, whose engine
explains the same requests at admission."""
from __future__ import annotations

import gc
import json
import random
import time

import httpx
import pytest

from support.serve import ALICE, BOB, chat, keys
from support.wait import wait_for

from kvplay.engine import cbuild
from kvplay.engine.miss import Removal, RemovedLog
from kvplay.wire import miss_native
from kvplay.wire import miss_watch as mw
from kvplay.wire.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvplay.wire.mirror import Fleet
from kvplay.wire.miss_watch import MissWatch
from kvplay.wire.publisher import KVEventsConfig, ZmqEventPublisher

BS = 4
A, B, C, D = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


def st(hashes, parent, tokens, sid, medium="GPU", extra=None, locality=None, group=None):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, medium, None, extra_keys=extra,
                       group_idx=group, session_id=sid, locality=locality)


def rm(*hashes, medium="GPU", locality=None):
    return [BlockRemoved([h], medium, locality=locality) for h in hashes]


class Pod:
    """A pod as `kvplay watch` runs it: each wire batch translated, applied, then attributed.
    Attributed three times over the same mirror, and checked to agree batch by batch: the
    compiled loop with the batch's details (as `watch --json`), the compiled loop without them
    (as `watch` and attach: the usual branches inline) and the Python loop."""

    def __init__(self, **kw):
        self.fleet = Fleet()
        self.wire = self.fleet.from_wire("p")
        self.mirror = self.fleet.pod("p")
        self.why = MissWatch(self.fleet, **kw)
        self.bare = MissWatch(self.fleet, **kw)
        self.ref = MissWatch(self.fleet, **kw)
        self.ref.pod("p").native = False
        self.seq = 0

    def __call__(self, *events, ts=None):
        self.seq += 1
        return self.apply(self.wire(EventBatch(float(self.seq) if ts is None else ts, list(events)), self.seq))

    def apply(self, b):
        """An engine batch applied and attributed: what this batch added (`watch --json`'s)."""
        self.mirror.apply(b)
        got = self.why.on_batch("p", b, detail=True)
        assert self.bare.on_batch("p", b) is None
        assert self.ref.on_batch("p", b, detail=True) == got
        agree(self.why.pod("p"), self.bare.pod("p"), self.ref.pod("p"))
        return got

    @property
    def misses(self):
        return self.why.pod("p")


def agree(*pods) -> None:
    """PodMisses that saw the same batches hold the same counts, marks and memory."""
    first = pods[0]
    for pm in pods[1:]:
        assert pm.summary() == first.summary()
        assert pm.marks() == first.marks()
        assert list(pm.removed.recent.items()) == list(first.removed.recent.items())
        assert all(type(r) is Removal for _, r in pm.removed.recent.items())
        assert pm.by_at == first.by_at and pm.last_top == first.last_top
        assert [None if r is None else tuple(r) for r in pm.chain_at] == \
            [None if r is None else tuple(r) for r in first.chain_at]


@pytest.mark.skipif(cbuild.compiler() is None or not miss_native.has_headers(),
                    reason="no C compiler or no Python headers here: the Python loop runs alone")
def test_the_compiled_loop_is_here_and_can_be_switched_off(monkeypatch):
    assert miss_native.module() is not None, miss_native.why_not()
    assert Pod().why.pod("p")._compiled is not None
    monkeypatch.setenv("KVPLAY_NATIVE", "0")
    monkeypatch.setattr(miss_native, "_state", {})
    assert miss_native.scan(mw._AT) is None and miss_native.why_not() == "KVPLAY_NATIVE=0"
    p = Pod()
    assert p.why.pod("p")._compiled is None and p.why.pod("p").removed._flusher is None
    assert p(st([1, 2], None, A + B, "alice"))["blocks"] == {"cold": 2}


def random_stream(rng: random.Random, batches: int, users: int = 5, per_batch: int = 12) -> list[list]:
    """Wire batches of a pool under churn that makes every reason: chains that continue, branch
    (inside a block and at its boundary), repeat a prefix under a salt or a group, come back after
    an eviction (with and without an evicting session named), another tier's blocks, clears."""
    tokens = {}  # hash -> its block's tokens (a hash always names the same tokens)

    def toks(h):
        if h not in tokens:
            base = [rng.randrange(1, 6) for _ in range(BS)]
            tokens[h] = base
        return tokens[h]

    live: list = []
    out = []
    for _ in range(batches):
        events = []
        for _ in range(rng.randint(1, per_batch)):
            x = rng.random()
            if x < 0.45:
                n = rng.randint(1, 5)
                parent = rng.choice(live) if live and rng.random() < 0.6 else None
                hs = [rng.randrange(1, 400) for _ in range(n)]
                if len(set(hs)) != n or parent in hs:
                    continue
                extra = [["salt-%d" % rng.randrange(2)]] + [None] * (n - 1) if rng.random() < 0.1 else None
                group = 1 if rng.random() < 0.05 else None
                medium = rng.choice(["CPU", "STORAGE"]) if rng.random() < 0.05 else "GPU"
                events.append(st(hs, parent, [t for h in hs for t in toks(h)], "u%d" % rng.randrange(users),
                                 medium=medium, extra=extra, group=group))
                if medium == "GPU" and group is None:
                    live.extend(hs)
            elif x < 0.9 and live:
                k = rng.randint(1, 4)
                gone = [live.pop(rng.randrange(len(live))) for _ in range(min(k, len(live)))]
                events.extend(rm(*gone, medium=rng.choice(["GPU", "GPU", "GPU", "CPU"])))
            elif x < 0.91:
                events.append(AllBlocksCleared())
                live.clear()
        out.append(events)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_loop_agrees_with_the_python_one_on_random_churn(seed, monkeypatch):
    """Every count, mark, per-batch detail and remembered removal, batch by batch (`Pod`); with
    more sessions than are counted by name, and batches that evict many sessions' blocks."""
    rng = random.Random(seed)
    if seed % 2:
        monkeypatch.setattr(mw, "MAX_SESSIONS", 3)
    p = Pod()
    for events in random_stream(rng, 150, users=5 if seed < 4 else 80, per_batch=12 if seed < 4 else 120):
        p(*events)
    s = p.misses.summary()
    assert sum(s["blocks"].values()) > 200
    assert sum(1 for v in s["blocks"].values() if v) >= 5  # most reasons made


KEY_KINDS = {  # a server's block hashes, as each kind of server sends them (a stream's small ints mapped)
    "uint64": lambda h: 2**64 - 1 - h * 7919,  # vLLM's: unsigned, most from 2^63
    "int64": lambda h: -(2**63) + h * 7919 if h % 2 else h * 7919,  # SGLang's: signed
    "both": lambda h: -h if h % 2 else 2**63 + h,  # negative and from 2^63 in one chain: no one kind fits
    "wide": lambda h: 2**64 + h,  # wider than 64 bits (hostile)
    "hex": lambda h: "%016x" % h,  # vLLM's full digests, as hex
}


@pytest.mark.parametrize("kind", sorted(KEY_KINDS))
def test_the_compiled_loop_agrees_with_the_python_one_on_keys_of_every_kind(kind):
    """A compiled chain keeps its keys, and its parent's key, as 64-bit values where they are
    ints that fit one kind (unsigned or signed), as objects otherwise; either way every count,
    mark, detail and chain reads as the Python loop's, batch by batch (`Pod`)."""
    f = KEY_KINDS[kind]
    mod = miss_native.module()
    rng = random.Random(7)
    p = Pod()
    plain, grouped = set(), set()  # how the compiled chains kept their keys (a group's keys are pairs: objects)
    for events in random_stream(rng, 150):
        for e in events:
            if isinstance(e, (BlockStored, BlockRemoved)):
                e.block_hashes = [f(h) for h in e.block_hashes]
            if isinstance(e, BlockStored) and e.parent_block_hash is not None:
                e.parent_block_hash = f(e.parent_block_hash)
        p(*events)
        for c in p.misses.chain_at:
            if mod is not None and type(c) is mod.Chain:
                keys = c[mw.HDR:]
                fits = all(type(k) is int for k in keys) and (all(0 <= k < 2**64 for k in keys) or
                                                               all(-2**63 <= k < 2**63 for k in keys))
                assert c.kept()[0] == ("values" if fits else "objects")
                (grouped if type(keys[0]) is tuple else plain).add((c.kept()[0], type(keys[0])))
    assert sum(p.misses.summary()["blocks"].values()) > 200
    if mod is not None:
        t = str if kind == "hex" else int
        assert plain == {("values", t)} if kind in ("uint64", "int64") else \
            {("values", t), ("objects", t)} if kind == "both" else {("objects", t)}
        assert grouped == {("objects", tuple)}


@pytest.mark.parametrize("kept, other", [(2**64 - 1, -1), (-1, 2**64 - 1)])
def test_the_same_64_bits_under_the_other_sign_is_another_key(kept, other):
    """A chain stored under `kept` keeps it as a 64-bit value (unsigned, or signed); once the
    slot of `kept` holds `other` (the same bits, the other sign), a chain under `other` is not
    that chain's sibling: cold, as the Python loop says (the compiled one agrees, `Pod`)."""
    p = Pod()
    p(st([kept], None, A, "alice"))
    slot = p.mirror.key_slot[kept]
    p(st([7], kept, B, "alice"))  # the newest chain under the block in `slot`, its parent kept as a value
    p(*rm(kept))
    p(st([other], None, C, "bob"))
    assert p.mirror.key_slot[other] == slot  # (the slot taken again: its newest chain is still alice's)
    assert p(st([9], other, B, "carol"))["blocks"] == {"cold": 1}  # (as her sibling it would read "config")


@pytest.mark.parametrize("named", [3, 4096])
def test_counts_left_pending_across_batches_settle_to_the_python_loops(named, monkeypatch):
    """The compiled loop enters its counts later, in sums (csrc/pending.h): read only at the end,
    after hundreds of batches of a hundred sessions (its tables fill and settle themselves), the
    counters are the Python loop's, the first `MAX_SESSIONS` named in the order they came."""
    if miss_native.pending() is None:
        pytest.skip(f"no compiled loop here ({miss_native.why_not()})")
    monkeypatch.setattr(mw, "MAX_SESSIONS", named)
    rng = random.Random(11)
    fleet = Fleet()
    wire, mirror = fleet.from_wire("p"), fleet.pod("p")
    fast, ref = MissWatch(fleet), MissWatch(fleet)
    ref.pod("p").native = False
    for seq, events in enumerate(random_stream(rng, 400, users=100, per_batch=10), 1):
        b = wire(EventBatch(float(seq), events), seq)
        mirror.apply(b)
        fast.on_batch("p", b)
        ref.on_batch("p", b)
    assert fast.pod("p")._pending.waiting  # (nothing read it yet)
    agree(fast.pod("p"), ref.pod("p"))
    assert not fast.pod("p")._pending.waiting
    pm = fast.pod("p")
    assert len(pm.evicted_from) > 64 if named > 64 else set(pm.evicted_from) >= {"others"}
    assert len(pm.sessions) > 64 if named > 64 else len(pm.sessions) <= named + 1


def test_a_compiled_chain_reads_as_a_tuple_and_is_no_work_for_the_collector():
    """The compiled loop's chains (csrc/miss_chains.c `Chain`) are read by the Python helpers as
    tuples are: len, [i], [-i], [a:b] (a tuple), iteration, `in`, index(key, start); and, holding
    only atoms, keys and marks, they stay outside the garbage collector (a tuple would count
    towards its next collection even untracked)."""
    mod = miss_native.module()
    if mod is None:
        pytest.skip(f"no compiled loop here ({miss_native.why_not()})")
    p = Pod()
    p(st([11, 12, 13], None, A + B + C, "alice"))
    slots = [p.mirror.key_slot[k] for k in (11, 12, 13)]
    c = p.misses.chain_at[slots[0]]
    assert type(c) is mod.Chain and c is p.misses.chain_at[slots[2]] and not gc.is_tracked(c)
    assert type(p.ref.pod("p").chain_at[slots[0]]) is tuple  # (the Python loop's)
    t = (0, None, "alice", False, None, 11, 12, 13)
    assert len(c) == 8 and tuple(c) == t and c[mw.HDR:] == t[mw.HDR:] and c[:mw.MARK] == t[:mw.MARK]
    assert c[-1] == 13 and c[::2] == t[::2] and 12 in c and c.index(12, mw.HDR) == 6
    with pytest.raises(ValueError):
        c.index(12, 7)
    with pytest.raises(IndexError):
        c[8]
    with pytest.raises(TypeError):
        c["a"]
    assert mw._find(c, 13) == (c, 7) and mw._find(c, 99) == (None, -1)
    assert repr(c) == "Chain" + repr(t)
    assert c.kept() == ("values", "objects")  # (its keys as 64-bit values; its parent, None, as an object)
    p(st([14], 13, D, "bob"))
    c2 = p.misses.chain_at[p.mirror.key_slot[14]]
    assert c2.kept() == ("values", "values") and c2[mw.PARENT] == 13 and c2.index(13) == mw.PARENT
    assert 13 in c2 and 13.0 in c2 and True not in c2 and c2[mw.HDR:] == (14,)


def test_the_compiled_flush_fills_the_filters_bit_for_bit():
    """RemovedLog.flush compiled over the compiled recent map (wire/miss_native.py) and in Python
    over a dict: the same recent map, the same Bloom bits and counts in both generations, through
    rotations."""
    rng = random.Random(7)
    if miss_native.flusher() is None:
        pytest.skip(f"no compiled flush here ({miss_native.why_not()})")
    logs = [RemovedLog(recent=100, bloom_capacity=300, flush_every=16),
            RemovedLog(recent=100, bloom_capacity=300, flush_every=16, flusher=miss_native.flusher(),
                       recent_map=miss_native.recent_map())]
    for i in range(3000):
        key = rng.choice([rng.getrandbits(64), rng.randrange(1000), -rng.getrandbits(70), 1 << 80])
        r = Removal(rng.choice(["evicted", "evicted", "cleared", "config"]), float(i))
        for log in logs:
            if i % 3 == 0:
                log.add(key, r)
            else:
                log.add_all([key, key + 1], r)
    a, b = logs
    assert list(a.recent.items()) == list(b.recent.items())
    assert a.blooms.keys() == b.blooms.keys() == {"evicted", "cleared", "config"}
    for reason, fa in a.blooms.items():
        fb = b.blooms[reason]
        assert (fa._n, fa._n_prev) == (fb._n, fb._n_prev) and fa._n_prev > 0
        assert fa._cur.tobytes() == fb._cur.tobytes() and fa._prev.tobytes() == fb._prev.tobytes()
    probes = [rng.getrandbits(64) for _ in range(2000)]
    assert [a.get(k) for k in probes] == [b.get(k) for k in probes]
    # the compiled flush reads the compiled map in place: given with a dict, the log flushes in Python
    c = RemovedLog(recent=100, bloom_capacity=300, flush_every=16, flusher=miss_native.flusher())
    c.add_all(range(500), Removal("evicted", 1.0))
    assert 100 <= len(c.recent) < 116 and c.get(3) == Removal("evicted")


def _unmix(z: int) -> int:
    """The inverse of splitmix64's finalizer (csrc/miss_chains.c `mix`): the key whose unseeded
    hash is z."""
    mask = (1 << 64) - 1

    def unshift(z: int, s: int) -> int:
        x = z
        for _ in range(64 // s + 1):
            x = z ^ (x >> s)
        return x & mask
    z = unshift(z, 31) * pow(0x94D049BB133111EB, -1, 1 << 64) & mask
    z = unshift(z, 27) * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & mask
    return unshift(z, 30)


def test_keys_crafted_against_the_hash_do_not_crowd_the_recent_map():
    """A publisher that knows the recent map's hash could send removals whose hashes share their
    low bits: in an unseeded map they fill one stretch of a generation's index that every later
    key walks (each removal ~100x dearer; a generation holds a quarter of the capacity, so no
    more than that). Each map seeds its hash at random, so the same keys spread."""
    kind = miss_native.recent_map()
    if kind is None:
        pytest.skip(f"no compiled recent map here ({miss_native.why_not()})")
    crafted = [_unmix((i << 20) | 0x77) for i in range(1, 20001)]  # one home slot unseeded
    fixed, seeded = kind(20480, seed=0), kind(20480)
    for k in crafted:
        fixed[k] = seeded[k] = None
    assert fixed.generation == 4096 and fixed.longest_run == 4096  # the attack, where the seed is known (0)
    assert seeded.longest_run < 200  # random homes at most half full: runs of tens
    assert all(seeded.get(k, 1) is None for k in crafted[::97]) and len(seeded) == 20000
    assert kind(16).longest_run == 0


def test_deleting_and_setting_keys_again_cannot_grow_the_recent_map():
    """Keys come into the newest generation; one taken out leaves a dead slot in its own until
    that generation is let go. A sender whose removals leave one live key in each generation
    would hold a generation per key: the dead slots are squeezed out instead (the dict's order
    kept), so the map holds at most about twice what its live keys need."""
    kind = miss_native.recent_map()
    if kind is None:
        pytest.skip(f"no compiled recent map here ({miss_native.why_not()})")
    m, d = kind(1024, seed=1), {}
    one = kind(1024)
    one[1] = 0
    f, nxt, most = m.generation, 0, 0
    for r in range(400):
        keys = list(range(nxt, nxt + f))
        nxt += f
        for k in keys:
            m[k] = d[k] = r
        for k in keys[1:]:  # all but one leave: each generation would be left holding one key
            del m[k], d[k]
        most = max(most, m.nbytes)
        if r % 50 == 0:
            assert m.items() == list(d.items())
    assert len(m) == 400 and m.items() == list(d.items())
    assert most <= 10 * one.nbytes  # (400 generations without the squeeze)


@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_recent_map_behaves_as_a_dict(seed):
    """RecentMap (csrc/recent_map.h) against a dict under the same random operations: setting
    (a key that is there keeps its place), deleting, popping the oldest, updating, clearing;
    keys of 64 bits, negative, and bigger ints; a small capacity, so its ring squeezes and grows."""
    kind = miss_native.recent_map()
    if kind is None:
        pytest.skip(f"no compiled recent map here ({miss_native.why_not()})")
    rng = random.Random(seed)
    m, d = kind(rng.choice([1, 5, 16, 100])), {}

    def key():
        return rng.choice([rng.randrange(50), rng.getrandbits(64), -rng.getrandbits(63), -(1 << 63), (1 << 64) - 1,
                           (1 << 64) + rng.randrange(3), -(1 << 70) - rng.randrange(3), rng.randrange(50) - 25])

    for i in range(3000):
        op, k = rng.random(), key()
        if op < 0.5:
            m[k] = d[k] = ("set", i)
        elif op < 0.65:
            assert m.pop(k, None) == d.pop(k, None)
        elif op < 0.75:
            assert m.get(k) == d.get(k) and (k in m) == (k in d)
        elif op < 0.8 and d:
            k = next(iter(d))
            del m[k], d[k]
        elif op < 0.85:
            pairs = [(key(), ("update", i, j)) for j in range(rng.randrange(5))]
            m.update(pairs)
            d.update(pairs)
        elif op < 0.86:
            m.clear()
            d.clear()
        elif op < 0.9:
            for k in list(d)[:rng.randrange(4)]:  # the oldest leave first, as a flush takes them
                assert m.pop(k) == d.pop(k)
        assert len(m) == len(d)
        if i % 97 == 0:
            assert m.items() == list(d.items()) and list(m) == list(d) and m.values() == list(d.values())
    assert m.items() == list(d.items())
    with pytest.raises(KeyError):
        m[-12345678901234567890123]
    with pytest.raises(TypeError):
        m["a str"] = 1


def test_the_compiled_filter_check_answers_as_the_python_one():
    """RemovedLog.filtered compiled (wire/miss_native.py): the same reason as the Python probes for
    every key, added or not, big, negative, over full and rotated filters of every reason."""
    if miss_native.filterer() is None:
        pytest.skip(f"no compiled filter check here ({miss_native.why_not()})")
    rng = random.Random(11)
    log = RemovedLog(recent=50, bloom_capacity=200, bits_per_item=6, probes=3, flush_every=8)  # (a high FP rate)
    added = []
    for i in range(2500):
        key = rng.choice([rng.getrandbits(64), rng.randrange(5000), -rng.getrandbits(70), (1 << 80) + i])
        added.append(key)
        log.add(key, Removal(rng.choice(["evicted", "cleared", "config"]), float(i)))
    compiled = miss_native.filterer()
    keys = added + [rng.getrandbits(64) for _ in range(3000)] + [-rng.getrandbits(64) for _ in range(500)]
    python = [log.filtered(k) for k in keys]
    assert [compiled(log, k) for k in keys] == python
    assert 0 < sum(r is not None for r in python[len(added):]) < len(keys) - len(added)  # both answers made
    assert {r.reason for r in python if r is not None} == {"evicted", "cleared", "config"}


def test_recomputed_after_eviction_with_when_and_the_stores_around_it():
    p = Pod()
    assert p(st([1, 2, 3], None, A + B + C, "alice"))["blocks"] == {"cold": 3}
    # carol's store needs room: vLLM evicts alice's tail first, in the same step
    got = p(*rm(3, 2), st([10, 11], None, D + D, "carol"), ts=50.0)
    assert got["blocks"] == {"cold": 2}
    # alice again: block 1 is still cached (a hit, not announced), blocks 2 and 3 are recomputed
    got = p(st([2, 3, 4], 1, B + C + D, "alice"), ts=60.0)
    assert got["blocks"] == {"evicted": 2, "cold": 1} and got["tokens"] == {"evicted": 8, "cold": 4}
    assert got["recomputed"] == [{"session": "alice", "reason": "evicted", "blocks": 2, "tokens": 8,
                                  "removed_at": 50.0, "evicted_by": "carol"}]
    s = p.misses.summary()
    assert s["blocks"]["evicted"] == 2 and s["blocks"]["cold"] == 6
    assert s["by_session"]["alice"] == {"blocks": {"evicted": 2, "cold": 4}, "tokens": {"evicted": 8, "cold": 16}}
    assert s["evicted_from"] == {"alice": 2}
    marks = p.misses.marks()
    assert marks == {2: {"kind": "recomputed", "reason": "evicted", "removed_at": 50.0, "evicted_by": "carol",
                         "blocks": 2}}


def test_recomputed_after_a_clear_and_after_a_publisher_restart():
    p = Pod()
    p(st([1, 2], None, A + B, "alice"))
    p(AllBlocksCleared())
    got = p(st([1, 2], None, A + B, "alice"))
    assert got["blocks"] == {"cleared": 2} and got["recomputed"][0]["reason"] == "cleared"
    assert "evicted_by" not in got["recomputed"][0]
    p.apply(p.wire.restart())  # the publisher restarted: its cache went with it
    assert p(st([1], None, A, "bob"))["blocks"] == {"cleared": 1}


def test_a_branch_says_where_and_from_whom():
    p = Pod()
    p(st([1, 2, 3], None, A + B + C, "alice"))
    # bob shares alice's first two blocks and 2 tokens of the third: the branch is at 4 * 2 + 2
    got = p(st([20, 21], 2, [9, 10, 99, 98] + D, "bob"))
    assert got["blocks"] == {"diverged": 2}
    assert got["branches"] == [{"session": "bob", "reason": "diverged", "at": 10, "within_block": 2, "blocks": 2,
                                "tokens": 8, "from": "alice"}]
    # a continuation of a cached leaf is no branch (a conversation going on)
    assert p(st([22], 21, A, "bob"))["blocks"] == {"cold": 1}
    # at the root: the same first token, then different
    got = p(st([30], None, [1, 2, 77, 78], "carol"))
    assert got["blocks"] == {"diverged": 1} and got["branches"][0]["at"] == 2
    # a root sharing no first token with any cached one is cold
    assert p(st([31], None, [50, 51, 52, 53], "dave"))["blocks"] == {"cold": 1}
    marks = p.misses.marks()
    assert marks[20] == {"kind": "diverged", "at": 10, "within_block": 2, "from": "alice", "blocks": 2}
    assert marks[30]["at"] == 2


def test_branch_at_a_block_boundary_and_unknown_depth():
    p = Pod()
    p(st([1, 2], None, A + B, "alice"))
    got = p(st([5], 1, D, "bob"))  # differs from alice's second block at its first token
    assert got["branches"][0]["at"] == 4 and got["branches"][0]["within_block"] == 0
    # a parent the watch never saw stored (joined late): no depth, no position
    p2 = Pod()
    p2(st([7, 8], 6, A + B, "alice"))
    got = p2(st([9], 7, C, "bob"))
    assert got["blocks"] == {"diverged": 1} and got["branches"][0]["at"] is None


def test_the_same_tokens_under_another_salt_are_isolated_unsalted_config():
    p = Pod()
    p(st([1, 2], None, A + B, "alice", extra=[["salt-a"], None]))
    got = p(st([11, 12], None, A + B, "bob", extra=[["salt-b"], None]))
    assert got["blocks"] == {"isolated": 2} and got["branches"][0] == {
        "session": "bob", "reason": "isolated", "blocks": 2, "tokens": 8, "from": "alice"}
    # no extra keys on either side: another hash seed or model; only the first block is the same
    p = Pod()
    p(st([1, 2], None, A + B, "alice"))
    got = p(st([21, 22], None, A + C, "carol"))
    assert got["blocks"] == {"config": 1, "cold": 1}


def test_other_tiers_are_counted_and_a_device_store_of_a_tier_block_is_a_hit():
    p = Pod()
    p(st([1, 2], None, A + B, "alice"))
    got = p(st([1, 2], None, A + B, "alice", medium="CPU"), *rm(2, 1))  # offloaded, then evicted
    assert got["tiers"] == {"CPU": {"stored": 2, "removed": 0, "hits": 0}}
    got = p(st([1, 2, 3], None, A + B + C, "bob"))  # loaded back from the CPU tier, one block new
    assert got["blocks"] == {"tier": 2, "cold": 1}
    assert got["tiers"] == {"CPU": {"stored": 0, "removed": 0, "hits": 2}}
    # any case; locality REMOTE; another tier's removal; "gpu" is the device, mirrored
    p(st([40], None, C, "x", medium="cpu_pinned"), st([41], None, D, "x", medium="Storage"),
      st([42], None, D, "x", locality="REMOTE"), *rm(40, medium="CPU_PINNED"))
    p(st([43], None, [60, 61, 62, 63], "x", medium="gpu"))
    assert 43 in p.mirror.blocks and 40 not in p.mirror.blocks
    tiers = p.misses.summary()["tiers"]
    assert tiers == {"CPU": {"stored": 2, "removed": 0, "hits": 2}, "CPU_PINNED": {"stored": 1, "removed": 1, "hits": 0},
                     "STORAGE": {"stored": 1, "removed": 0, "hits": 0},
                     "REMOTE:GPU": {"stored": 1, "removed": 0, "hits": 0}}
    assert p.mirror.other_medium == 2 + 1 + 1 + 1 + 1  # counted, as before


def test_per_session_and_tier_names_are_bounded(monkeypatch):
    monkeypatch.setattr(mw, "MAX_SESSIONS", 8)
    monkeypatch.setattr(mw, "MAX_TIERS", 3)
    p = Pod()
    for i in range(20):
        p(st([100 + i], None, [200 + i] * BS, f"user-{i}"), st([300 + i], None, A, "t", medium=f"tier-{i}"))
    s = p.misses.summary()
    assert len(s["by_session"]) == 9 and s["by_session"]["others"]["blocks"] == {"cold": 12}
    assert len(s["tiers"]) == 4 and s["tiers"]["others"]["stored"] == 17
    assert sum(d["blocks"]["cold"] for d in s["by_session"].values()) == 20


def test_batches_and_tier_keys_remembered_are_bounded_and_forgotten_oldest_first(monkeypatch):
    """Who evicted in each batch (`by_at`) and which keys another tier holds (`tier_of`) keep
    their newest entries, at most FORGET_SLACK past their bound, and forget the oldest in one go
    (both loops alike)."""
    monkeypatch.setattr(mw, "BY_AT", 40)
    monkeypatch.setattr(mw, "TIER_KEYS", 30)
    monkeypatch.setattr(mw, "FORGET_SLACK", 8)
    p = Pod()
    sizes = set()
    for i in range(200):
        p(st([1000 + i], None, [7 + i % 5] * BS, "alice"), *rm(1000 + i - 1) if i else [],
          st([5000 + i], None, A, "t", medium="CPU"))
        pm = p.misses
        assert set(range(max(2, i + 2 - 40), i + 2)) <= set(pm.by_at)  # the newest 40 batches that evicted (from the 2nd)
        assert len(pm.by_at) <= 48 and len(pm.tier_of) <= 38
        assert set(range(5000 + i - min(i, 29), 5000 + i + 1)) <= set(pm.tier_of)
        sizes.add(len(pm.by_at))
    assert max(sizes) == 48 and min(s for s in sizes if s >= 40) == 40  # (let go 8 at a time)


def test_memory_follows_the_pool_through_churn(monkeypatch):
    monkeypatch.setattr(mw, "SWEEP_SLACK", 64)
    p = Pod()
    h = 1
    for i in range(400):  # long chains, all but their first block evicted
        chain = list(range(h, h + 16))
        h += 16
        p(st(chain, None, [i % 7] * (16 * BS), "u"))
        p(*rm(*chain[1:]))
    pm = p.misses
    # a chain per mirror slot at most (a chain lives while a slot names it), and the roots swept
    # down to the cached ones once they outgrow twice the cached blocks
    assert len(pm.chain_at) == len(pm.heads_at) == p.mirror.hw
    assert len({id(r) for r in pm.chain_at if r is not None}) <= p.mirror.hw
    assert len(pm.roots) <= 2 * len(p.mirror.key_slot) + 64 + 1
    # what was removed is still remembered: the chains' tails come back as recomputed
    got = p(st(list(range(h - 15, h)), h - 16, [6] * (15 * BS), "u"))
    assert got["blocks"] == {"evicted": 15}


def test_a_sweep_keeps_tier_hits_out_of_the_tree_marks(monkeypatch):
    monkeypatch.setattr(mw, "SWEEP_SLACK", 0)
    p = Pod()
    p(st([1, 2], None, A + B, "alice"))
    p(st([1, 2], None, A + B, "alice", medium="CPU"), *rm(2, 1))  # offloaded, then evicted
    assert p(st([1, 2, 3, 4, 5], None, A + B + C + D + A, "bob"))["blocks"] == {"tier": 2, "cold": 3}
    p(*rm(3, 4, 5))  # a sweep after each batch: bob's chain keeps its two cached blocks, the tier hit's
    assert [p.misses.chain_of(k)[1] - mw.HDR for k in (1, 2, 3)] == [0, 1, -1 - mw.HDR]
    assert p.misses.marks() == {}  # a tier hit is counted, but it is no mark of the prefix tree


def test_hostile_input_is_bounded_and_never_a_traceback():
    p = Pod()
    # a huge chain, hashes of every kind, no tokens, odd block sizes, a parent that is the chain itself
    p(st(list(range(1, 5001)), None, [], "big"))
    p(BlockStored([b"\x01" * 32, b"\x02" * 32], None, A + B, BS, None, "GPU", None, session_id="digests"))
    p(BlockStored([-5, -6], None, A + B, BS, None, "GPU", None, session_id="sglang"))
    p(BlockStored([7001], 7001, A, BS, None, "GPU", None, session_id="loop"))
    p(BlockStored([7002], 7001, [], 0, None, "GPU", None, session_id="no size"))
    p(st([7003], None, A, "\u202e\x1b[31mred"))
    p(*rm(*range(1, 5001)), *rm(-5, -6, 10**30 % (1 << 64)))
    got = p(st([3, 4], 2, A + B, "big"))
    assert got["blocks"] == {"evicted": 2}
    s = p.misses.summary()
    assert sum(s["blocks"].values()) == 5000 + 2 + 2 + 1 + 1 + 1 + 2
    json.dumps(s)  # plain data
    assert len(p.misses.removed.recent) <= p.misses.removed.recent_capacity + 512


def test_watch_json_reports_recomputes_branches_and_tiers(free_port, pubs, watch_json):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    w = watch_json("--events-bind", ev, "--replay", rep, "--pod", "vllm", "--topic", "kv-events", "--json",
                   "--no-record")
    pub = ZmqEventPublisher(ev, rep, topic="kv-events")
    pubs.append(pub)
    batches = [
        [st([1, 2, 3], None, A + B + C, "alice")],
        [st([20, 21], 2, [9, 10, 99, 98] + D, "bob")],
        [*rm(3, 21, 20), st([30, 31], None, D + D, "carol")],
        [st([3], 2, C, "alice"), st([1], None, A, "alice", medium="CPU")],
    ]
    sent = iter(batches)

    def feed():
        b = next(sent, None)
        if b is not None:
            pub.publish(EventBatch(time.time(), b))
    got = w.until(lambda d: d.get("seq") == 3, feed=feed)
    rest = w.stop()
    assert w.p.returncode == 0, w.err
    by_seq = {d["seq"]: d for d in got}
    assert by_seq[1]["miss"]["branches"] == [{"session": "bob", "reason": "diverged", "at": 10, "within_block": 2,
                                              "blocks": 2, "tokens": 8, "from": "alice"}]
    m3 = by_seq[3]["miss"]
    assert m3["blocks"] == {"evicted": 1} and m3["recomputed"][0]["evicted_by"] == "carol"
    assert m3["tiers"] == {"CPU": {"stored": 1, "removed": 0, "hits": 0}}
    assert "miss" not in by_seq[0] or by_seq[0]["miss"]["blocks"] == {"cold": 3}
    pod = rest[-1]["pods"]["vllm"]
    assert pod["misses"]["blocks"] == {"tier": 0, "evicted": 1, "cleared": 0, "config": 0, "isolated": 0,
                                       "diverged": 2, "cold": 5}
    assert pod["misses"]["by_session"]["bob"]["tokens"] == {"diverged": 8}
    assert pod["other_medium"] == 1
    cost = pod["misses"]["cost"]  # (the attribution's time on this stream, and over the mirror's)
    assert pod["mirror_s"] > 0 and cost["seconds"] > 0
    assert cost["of_mirror"] == pytest.approx(cost["seconds"] / pod["mirror_s"], rel=0.01)


def test_watch_no_misses_skips_the_attribution(free_port, pubs, watch_json):
    ev = f"tcp://127.0.0.1:{free_port()}"
    w = watch_json("--events-bind", ev, "--pod", "p", "--json", "--no-record", "--no-misses")
    pub = ZmqEventPublisher(ev, None)
    pubs.append(pub)
    n = iter(range(1, 1000))

    def feed():  # no replay: send until the subscription is through
        k = next(n)
        pub.publish(EventBatch(time.time(), [st([k], None, A, "alice"), st([k + 1000], k, D, "bob")]))
    seen = []
    got = w.until(lambda d: seen.append(d) or len(seen) == 2, feed=feed)
    rest = w.stop()
    assert all("miss" not in d for d in got) and "misses" not in rest[-1]["pods"]["p"]
    assert rest[-1]["pods"]["p"]["mirror_s"] > 0


# --- against kvplay serve: the events alone agree with the engine's own attribution -----------
def test_watch_of_kvplay_serve_agrees_with_the_engines_reasons(free_port, serve, tmp_path, watch_json):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    srv, state = serve(kv_events=cfg, num_blocks=14, block_size=16)
    w = watch_json(srv.url, "--json", "--no-record")  # the endpoints come from GET /kv_event_sources
    w.wait_err("kv_event_sources", timeout=30)
    # connected and its join replay asked: a batch published before its subscription reached the
    # server would be missed until a later batch showed the gap (wire/subscriber.py), and the last
    # batch here has none after it
    w.wait_err("is replaying", timeout=30)
    rng = [10 + (k * 7) % 90 for k in range(69)]  # 69 tokens: 4 full blocks and 5 tail tokens

    def complete(user, ids):
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny:llama", "prompt": ids, "max_tokens": 1,
                                                           "temperature": 0, "user": user,
                                                           "return_miss_details": True}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["kvplay"]["miss"]

    alice1 = complete("alice", rng)
    bob = complete("bob", rng[:40] + [7] * 29)  # shares alice's first 40 tokens
    for i in range(3):  # carol fills the pool: alice's blocks go
        complete("carol", [4 + (i * 37 + k * 11) % 99 for k in range(69)])
    alice2 = complete("alice", rng)
    pub = state.side.events.publisher

    def alice_back(d):  # the batch of alice's second turn: its blocks recomputed after eviction
        return any(r.get("session") == "alice" for r in (d.get("miss") or {}).get("recomputed", []))

    # (the reply can come before the step's events are published: wait for those, then for the rest)
    got = w.until(alice_back, timeout=30)
    while pub.next_seq - 1 > max(d.get("seq", -1) for d in got):
        got += w.until(lambda d: d.get("seq") == pub.next_seq - 1, timeout=30)
    rest = w.stop()
    assert w.p.returncode == 0, w.err
    assert alice1["reasons"]["cold"] == 64 and bob["reasons"]["diverged"] == 32 and bob["diverged_at"] == 40
    assert alice2["reasons"]["evicted"] > 0, alice2
    misses = rest[-1]["pods"][next(iter(rest[-1]["pods"]))]["misses"]
    sessions = misses["by_session"]
    # the engine explains each request's prompt blocks at admission; the watch, from the events
    # alone, finds the same blocks recomputed after eviction and the same branch
    assert sessions["alice"]["tokens"].get("evicted", 0) == alice2["reasons"]["evicted"]
    assert sessions["bob"]["tokens"] == {"diverged": 32}
    branch = [b for d in got if "miss" in d for b in d["miss"]["branches"] if b["session"] == "bob"]
    assert branch == [{"session": "bob", "reason": "diverged", "at": 40, "within_block": 8, "blocks": 2,
                       "tokens": 32, "from": "alice", **({"text": branch[0]["text"]} if "text" in branch[0] else {})}]
    again = alice2["tokens"] - alice2["reasons"]["tail"]  # the full blocks alice's second turn computed
    assert sessions["alice"]["tokens"] == {k: v for k, v in {"evicted": alice2["reasons"]["evicted"],
                                                             "cold": 64 + again - alice2["reasons"]["evicted"]}.items()
                                           if v}


# --- attach: each turn explained after the fact, against the engine's own reasons ------------
def test_attach_explains_each_turn_as_the_engine_did(free_port, serve, tmp_path):
    from kvplay.engine.miss import miss_from_event, miss_text
    from kvplay.engine.sampling import SamplingParams
    from kvplay.wire.remote import RemoteBackend
    from kvplay.wire.subscriber import PodSource

    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    srv, state = serve(kv_events=cfg, num_blocks=24, block_size=16)
    engine_says = []  # the engine's MissExplained, in order
    state.side.engine.subscribe_batches(
        lambda b: engine_says.extend(miss_from_event(e) for e in b.events if e.kind == "MissExplained"))
    backend = RemoteBackend(srv.url, sources=[PodSource("kv", ev, bind=True, replay=rep, topic="kv-events")])
    system = "You answer questions about the bakery on Elm Street, briefly. " * 2
    try:
        def turn(user, text):
            t = backend.submit(user, [{"role": "system", "content": system}, {"role": "user", "content": text}],
                               SamplingParams(temperature=0.0, max_tokens=1))
            r = t.result(60)
            assert r.error is None, r.error
            return r.stats

        turns = [turn("alice", "When do you open?"), turn("bob", "Do you sell rye?")]
        for i in range(4):  # carol fills the small pool
            turns.append(turn("carol", f"{i} " + "tell me everything about your cakes " * 3))
        turns.append(turn("alice", "When do you open?"))
    finally:
        backend.close()
    assert len(engine_says) == len(turns)
    for st_, want in zip(turns, engine_says):
        assert st_.miss is not None, st_
        assert st_.miss["reasons"] == want["reasons"], (st_.user, st_.miss, want)
        assert st_.miss["diverged_at"] == want["diverged_at"]
        assert st_.miss["evicted_by"] == want["evicted_by"]  # the stores around the eviction: carol's
        assert st_.miss["tokens"] == st_.prompt_tokens - st_.cached_tokens
    bob = turns[1].miss
    assert bob["reasons"]["diverged"] > 0 and bob["diverged_from"] == "alice"
    assert miss_text(bob, "bob").startswith(f"{bob['tokens']}: {bob['reasons']['diverged']} diverged at ")
    assert turns[-1].miss["reasons"]["evicted"] > 0, turns[-1].miss


def test_attach_says_isolated_where_the_server_salts_by_user(free_port, serve, tmp_path):

    from kvplay.engine.miss import miss_from_event
    from kvplay.engine.sampling import SamplingParams
    from kvplay.wire.remote import RemoteBackend
    from kvplay.wire.subscriber import PodSource

    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    # the engine explains across keys here only to be the reference (a keyed server does not by
    # default: docs/miss.md, "Across keys"); the watcher's attribution is off the requests' path
    srv, state = serve(keys=keys(tmp_path), kv_events=cfg, num_blocks=64, isolation="user", explain_across_keys=True)
    engine_says = []
    state.side.engine.subscribe_batches(
        lambda b: engine_says.extend(miss_from_event(e) for e in b.events if e.kind == "MissExplained"))
    system = "You answer questions about the bakery on Elm Street, briefly. " * 2
    backend = RemoteBackend(srv.url, ALICE, sources=[PodSource("kv", ev, bind=True, replay=rep, topic="kv-events")])
    try:
        with httpx.Client(timeout=60) as c:  # bob, another tenant, asks first
            assert chat(c, srv.url, BOB, "When do you open?", system=system, max_tokens=1).status_code == 200
        wait_for(lambda: len(backend.fleet.pod("kv").blocks) > 0, what="the pod's blocks mirrored")
        t = backend.submit("alice", [{"role": "system", "content": system},
                                     {"role": "user", "content": "When do you open?"}],
                           SamplingParams(temperature=0.0, max_tokens=1))
        r = t.result(60)
    finally:
        backend.close()
    want = engine_says[-1]
    assert want["reasons"]["isolated"] > 0 and want["isolated_from"] == {"bob": want["reasons"]["isolated"]}
    assert r.stats.miss["reasons"] == want["reasons"] and r.stats.miss["isolated_from"] == want["isolated_from"]


# --- the prefix tree marks branch points and recomputed chains -------------------------------
def test_tree_marks_branch_points_and_recomputed_chains():
    from kvplay.wire.tree import Labels, PrefixTree, to_json, to_text

    p = Pod()
    p(st([1, 2, 3], None, A + B + C, "alice"))
    p(st([20, 21], 2, [9, 10, 99, 98] + D, "\x1b[31mmallory\u202e"))
    p(*rm(3), ts=100.0)
    p(st([3], 2, C, "alice"), ts=110.0)
    tree = PrefixTree(p.mirror.blocks, None, 0, p.misses.marks())
    lines = to_text(tree, Labels(None), now=130.0)
    text = "\n".join(lines)
    assert "⑂ prompts branch at token 10" in text
    assert "⑂ diverged at 10 from " in text and "mallory" in text
    assert "↻ recomputed 1 blk, evicted 30s ago by ␛[31mmallory" in text  # the last stores before it
    assert "\x1b" not in text and "\u202e" not in text  # a server's session ids are shown inert
    js = to_json(tree, Labels(None), now=130.0)
    top = js["roots"][0]
    assert top["branch_at"] == 10 and top["marks"] == []
    kids = {c["creator"]: c for c in top["children"]}
    assert kids["alice"]["marks"][0]["kind"] == "recomputed" and kids["alice"]["marks"][0]["removed_at"] == 100.0
    assert kids["\x1b[31mmallory\u202e"]["marks"][0] == {"kind": "diverged", "at": 10, "within_block": 2,
                                                       "from": "alice", "blocks": 2}


def test_kvplay_tree_of_a_watch_recording_shows_the_marks(free_port, pubs, watch_json, tmp_path, capsys):
    from kvplay.cli import main

    ev = f"tcp://127.0.0.1:{free_port()}"
    db = tmp_path / "s.db"
    w = watch_json("--events-bind", ev, "--pod", "p", "--json", "--db", str(db))
    w.wait_err("recording")
    pub = ZmqEventPublisher(ev, None)
    pubs.append(pub)
    n = iter(range(1, 1000))

    def feed():  # no replay: resend the story under new hashes until it all went through
        k = 100 * next(n)
        pub.publish(EventBatch(time.time(), [st([k + 1, k + 2], None, [k % 97] * 4 + B, "alice"),
                                             st([k + 3], k + 1, C, "bob")]))
    seen = []
    w.until(lambda d: seen.append(d) or len(seen) == 2, feed=feed)
    w.stop()
    sid = next(e for e in w.err if "recording the watched events as session" in e).split("session ")[1].split()[0]
    assert main(["tree", sid, "--db", str(db), "--ids"]) == 0
    out = capsys.readouterr().out
    assert "⑂ prompts branch at token 4" in out and "⑂ diverged at 4 from alice" in out


def test_the_watch_line_says_why_in_words_and_shows_tier_names_inert():
    from kvplay.sessions.watch import misses_text

    blocks = {"tier": 6, "evicted": 10, "cleared": 2, "config": 0, "isolated": 4, "diverged": 40, "cold": 9}
    tiers = {"CPU": {"stored": 12, "removed": 4, "hits": 6}, "\x1b[2Jevil": {"stored": 1, "removed": 0, "hits": 0}}
    text = misses_text(blocks, tiers)
    assert text.startswith("recomputed 12 (evicted 10, cleared 2) · diverged 40 · isolated 4 · CPU +12 -4 hits 6 · ")
    assert "\x1b" not in text and "evil" in text
    assert misses_text(dict.fromkeys(blocks, 0)) == ""
