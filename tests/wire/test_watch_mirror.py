"""The per-pod mirror fed by its wire translator (wire/translate.FromWire): creators, holders,
counts, attribution by session_id and by token chain."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from kvplay.engine import events as ev_
from kvplay.wire.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvplay.wire.mirror import Fleet, Mirror, SlotMap
from kvplay.wire.translate import SOMEONE_ELSE, FromWire, Slots, counts

BS = 4


def st(hashes, parent, tokens, session=None, **kw):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, kw.pop("medium", "GPU"), None,
                       session_id=session, **kw)


def batch(*events):
    return EventBatch(0.0, list(events))


def feed(w: FromWire, b: EventBatch, seq: int = -1) -> ev_.EngineBatch:
    """A wire batch through a pod's translator, then applied to its mirror (what the subscriber
    does); the engine batch."""
    eb = w(b, seq)
    w.mirror.apply(eb)
    return eb


def wired(m: Mirror) -> FromWire:
    return FromWire(m)


def test_store_reuse_evict_counts():
    m = Mirror(pod="p")
    w = wired(m)
    sys_tokens = list(range(8))
    # alice stores a 2-block system prompt and 1 own block
    assert counts(feed(w, batch(st([1, 2, 3], None, sys_tokens + [50, 51, 52, 53], "alice")), 0)) == (3, 0, 0)
    # bob reuses the system prompt (report mode "full" re-announces it with bob's session) + 1 own
    feed(w, batch(st([1, 2], None, sys_tokens, "bob"), st([4], 2, [60, 61, 62, 63], "bob")), 1)
    assert m.blocks[1].creator == "alice" and m.blocks[1].holders == ("alice", "bob")
    assert m.blocks[4].tokens == [60, 61, 62, 63] and m.blocks[4].parent == 2
    assert m.blocks[3].tokens == [50, 51, 52, 53] and m.blocks[3].parent == 2
    s = m.summary()
    assert s["blocks"] == 4 and s["stored"] == 6 and m.new_blocks == 4 and m.reannounced == 2
    assert s["by_session"] == {"alice": 3, "bob": 3}
    assert s["stored_by_session"] == {"alice": 3, "bob": 3}
    assert m.creators() == {"alice": 3, "bob": 1}
    # eviction: one BlockRemoved per block, as vLLM sends them
    assert counts(feed(w, batch(BlockRemoved([3], "GPU"), BlockRemoved([1], "GPU")), 2)) == (0, 2, 0)
    assert m.summary()["by_session"] == {"alice": 1, "bob": 2} and m.removed == 2
    feed(w, batch(BlockRemoved([999], "GPU")), 3)  # never seen: tolerated, counted
    assert m.removed_unknown == 1 and m.removed == 2
    assert counts(feed(w, batch(AllBlocksCleared()), 4)) == (0, 0, 1)
    assert m.blocks == {} and m.summary()["by_session"] == {} and m.cleared == 1
    assert m.summary()["stored_by_session"] == {"alice": 3, "bob": 3}  # in all, kept
    assert m.last_seq == 4 and m.batches == 5


def test_attribution_by_registered_prompt_then_someone_else():
    fleet = Fleet()
    m, w = fleet.pod("p"), fleet.from_wire("p")
    fleet.register_prompt("carol", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # no session_id on the wire: carol's prompt chain matches both full blocks
    feed(w, batch(st([10, 11], None, [1, 2, 3, 4, 5, 6, 7, 8])), 0)
    assert m.blocks[10].creator == "carol" and m.blocks[11].creator == "carol"
    # same second block's tokens under another parent: not carol's chain
    feed(w, batch(st([20, 21], None, [9, 9, 9, 9, 5, 6, 7, 8])), 1)
    assert m.blocks[20].creator == SOMEONE_ELSE and m.blocks[21].creator == SOMEONE_ELSE
    # a child of carol's block, stored in a later batch with tokens she sent later
    fleet.register_prompt("carol", [1, 2, 3, 4, 5, 6, 7, 8, 42, 42, 42, 42])
    feed(w, batch(st([12], 11, [42, 42, 42, 42])), 2)
    assert m.blocks[12].creator == "carol"
    # a parent we never saw: no chain, no guess
    feed(w, batch(st([30], 777, [1, 2, 3, 4])), 3)
    assert m.blocks[30].creator == SOMEONE_ELSE
    assert m.summary()["by_session"] == {"carol": 3, SOMEONE_ELSE: 3}


def test_deep_chain_attribution_is_iterative():
    fleet = Fleet()
    m, w = fleet.pod("p"), fleet.from_wire("p")
    n = 3000  # deeper than Python's recursion limit
    toks = [i % 97 for i in range(n * BS)]
    feed(w, batch(st(range(1, n + 1), None, toks, "x")), 0)
    fleet.register_prompt("y", toks + [1, 2, 3, 4])
    feed(w, batch(st([n + 1], n, [1, 2, 3, 4])), 1)
    assert m.blocks[n + 1].creator == "y"


def test_other_medium_and_groups():
    m = Mirror(pod="p")
    w = wired(m)
    feed(w, batch(st([1], None, [1, 2, 3, 4], "a", medium="CPU")), 0)
    assert m.blocks == {} and m.other_medium == 1
    feed(w, batch(st([1], None, [1, 2, 3, 4], "a", group_idx=1), st([1], None, [1, 2, 3, 4], "a")), 1)
    assert len(m.blocks) == 2  # group 1's hash 1 is not group 0's hash 1
    feed(w, batch(BlockRemoved([1], "GPU", group_idx=1)), 2)
    assert list(m.blocks) == [1]


def test_restart_reset_and_fleet_totals():
    fleet = Fleet()
    a, b = fleet.pod("a"), fleet.pod("b")
    feed(fleet.from_wire("a"), batch(st([1, 2], None, list(range(8)), "u")), 0)
    feed(fleet.from_wire("b"), batch(st([3], None, list(range(4)), "v")), 0)
    assert fleet.totals()["blocks"] == 3 and fleet.totals()["by_session"] == {"u": 2, "v": 1}
    a.apply(fleet.from_wire("a").restart())
    assert a.blocks == {} and a.restarts == 1 and a.last_seq == -1
    s = fleet.summary()
    assert s["summary"] is True and set(s["pods"]) == {"a", "b"}
    assert set(s["pods"]["a"]) == {"blocks", "by_session", "stored_by_session", "stored", "removed", "gaps",
                                  "replayed", "restarts"}


def test_mirror_bench_runs_small():
    from kvplay.bench.mirror_bench import count_events, run, synthetic_stream

    payloads = synthetic_stream(3000, pool_blocks=400, seed=3)
    events, blocks = count_events(payloads)
    assert events >= 3000 and blocks > events // 2
    m = Mirror(pod="b")
    w = wired(m)
    from kvplay.wire.codec import decode_batch

    for seq, p in enumerate(payloads):
        feed(w, decode_batch(p), seq)
    assert len(m.blocks) <= 400 and m.removed > 0 and m.reannounced > 0
    r = run(2000, 400, socket=True, record=True)  # every path runs (no timing asserted)
    assert r["events"] >= 2000 and r["socket_events_per_s"] > 0 and r["record_events_per_s"] > 0
    r = run(2000, 400, socket=False, misses=True, pairs=3)
    lo, hi = r["misses_ratio_median_ci"]
    assert r["misses_runs"] == 3 and lo <= r["misses_ratio_median"] <= hi
    mem = run(2000, 400, socket=False, pairs=1, memory=True)["memory"]  # (`--memory`)
    assert mem["on_mib"] > mem["off_mib"] > 0 and mem["held_mib"] == round(mem["on_mib"] - mem["off_mib"], 1)
    assert mem["summary"]["chain_slots"] >= 400 and 0 < mem["summary"]["removed_recent"] <= 2000


def test_mirror_bench_prompts_content_reads_as_one_templates_requests():
    """`--content prompts`: a tokenizer's ids (not Python's shared small ints), and prompts at the
    root that part within their first block: the attribution calls them diverged, where the
    default pattern's repeat the same tokens under another hash (config)."""
    from kvplay.bench.mirror_bench import run, synthetic_stream
    from kvplay.wire.codec import decode_batch
    from kvplay.wire.miss_watch import MissWatch

    counts = {}
    for content in ("pattern", "prompts"):
        fleet = Fleet()
        m, w, pm = fleet.pod("b"), fleet.from_wire("b"), MissWatch(fleet).pod("b")
        top = 0
        for seq, p in enumerate(synthetic_stream(3000, pool_blocks=400, seed=3, content=content)):
            b = w(decode_batch(p), seq)
            m.apply(b)
            pm.apply(b)
            top = max([top] + [max(e.token_ids or [0]) for e in b.events if hasattr(e, "token_ids")])
        counts[content] = (dict(pm.counts["blocks"]), top)
    (pattern, top_p), (prompts, top_q) = counts["pattern"], counts["prompts"]
    assert top_p < 80 <= 256 < top_q < 49_152
    assert pattern["config"] > 0 and pattern["diverged"] == 0
    assert prompts["diverged"] > 0 and prompts["config"] == 0 and prompts["cold"] > 0
    r = run(1000, 400, socket=False, misses=True, pairs=1, content="prompts", inside=1)
    assert r["content"] == "prompts" and r["inside_s"] > 0 and r["inside_share"] > 0
    # (inside_s is rounded to 0.1 ms: the figure per event is the unrounded one's)
    assert r["inside_ns_per_event"] == pytest.approx(1e9 * r["inside_s"] / r["events"], abs=1e5 / r["events"] + 0.1)
    with pytest.raises(ValueError, match="content"):
        synthetic_stream(10, content="words")


def test_mirror_bench_watch_reads_a_real_watchs_own_cost_line():
    """`--watch`: a `kvplay watch` process fed the stream over ZMQ applies all of it and reports
    the attribution's time against its mirror's, which the bench reads back."""
    from kvplay.bench.mirror_bench import measure_watch, synthetic_stream

    r = measure_watch(synthetic_stream(2000, pool_blocks=400, seed=3), timeout=120)
    assert r["watch_misses_s"] > 0 and r["watch_mirror_s"] > 0
    assert r["watch_of_mirror"] == pytest.approx(r["watch_misses_s"] / r["watch_mirror_s"], rel=0.2, abs=0.002)


def test_mirror_bench_app_runs_small():
    """The attach app fed by two publishers in another process: every event applied, frames
    drawn, one map per pod (no timing asserted: the figures are `kvplay bench` output)."""
    from kvplay.bench.mirror_bench import measure_app

    r = measure_app(rate=3000, seconds=1.0, pool_blocks=500, pods=2, record=True)
    assert r["applied"] == r["events"] >= 2900 and r["kept_up"]
    assert r["frames"] > 0 and r["frame_ms_p95"] > 0 and "blocks" in r["map"]


# --- one Mirror: a wire-fed pod answers what the block map, the tree and the recorder ask -------------
def test_a_wire_fed_mirror_is_the_block_map_source():
    """Blocks named by hash only get the lowest free slot; the slot arrays answer the map's
    questions (ranged summary, one block, counts) for the same blocks the per-hash view holds."""
    m = Mirror(8, pod="p")
    w = wired(m)
    feed(w, batch(st([1, 2], None, range(8), "alice"), st([3], 2, [9, 9, 9, 9], "bob")), 0)
    feed(w, batch(st([1], None, range(4), "carol")), 1)  # carol reuses block 1 (report mode "full")
    assert {h: b.slot for h, b in m.blocks.items()} == {1: 0, 2: 1, 3: 2}
    assert m.counts() == (5, 3, 0) and m.stats()["blocks_cached"] == 3
    v = m.block(0)
    assert v.state == "cached" and v.creator == "alice" and v.users == ("alice", "carol") and v.hits == 1
    assert v.hash == "0000000000000001" and v.token_ids == (0, 1, 2, 3)
    summ = m.summary(2)  # the block map's question: two cells of four blocks
    assert int(summ.cached.sum()) == 3 and int(summ.free.sum()) == 5
    assert m.block(2).creator == "bob" and m.blocks[3].parent == 2
    feed(w, batch(BlockRemoved([2], "GPU")), 2)
    assert m.block(1).state == "free" and m.counts() == (6, 2, 0)
    feed(w, batch(st([7], None, [5, 5, 5, 5], "dave")), 3)
    assert m.blocks[7].slot == 1  # the freed slot, the lowest free one
    assert m.by_session == {"alice": 1, "carol": 1, "bob": 1, "dave": 1}


def test_the_one_translator_gives_engine_events_that_rebuild_the_same_cache():
    """A wire batch becomes kvplay engine events (what the mirror applies, the watch recorder
    writes and attach's views hear); applied to a fresh Mirror they give the same blocks,
    creators and holders."""
    fleet = Fleet()
    m, w = fleet.pod("p"), fleet.from_wire("p")
    fleet.register_prompt("pane", list(range(8)))
    batches = [feed(w, batch(st([1, 2], None, range(8))), 0)]  # no session_id: the pane's prompt
    batches.append(feed(w, batch(st([3], 2, [7, 7, 7, 7], "bob"), st([1], None, range(4), "bob")), 1))
    batches.append(feed(w, batch(BlockRemoved([3], "GPU")), 2))
    events = [e for b in batches for e in b.events]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockStored", "BlockHit", "BlockRemoved"]
    assert events[0].user == "pane" and events[0].block_hashes == [1, 2]
    assert events[2].user == "bob" and events[2].by_creator == {"pane": 4} and events[2].cached_tokens == 4
    assert events[3].creators == ["bob"]
    again = Mirror()
    for b in batches:
        again.apply(b)
    assert {b.hex: (b.creator, b.holders, b.tokens) for b in again.blocks.values()} == \
        {b.hex: (b.creator, b.holders, b.tokens) for b in m.blocks.values()}
    cleared = feed(w, batch(AllBlocksCleared()), 3).events
    assert cleared[-1].reason == "cleared" and len(m.blocks) == 0


def test_a_copy_is_a_checkpoint():
    m = Mirror(pod="p")
    w = wired(m)
    feed(w, batch(st([1, 2], None, range(8), "alice")), 0)
    c = m.copy()
    feed(w, batch(st([1], None, range(4), "bob"), BlockRemoved([2], "GPU")), 1)
    assert set(c.blocks) == {1, 2} and c.blocks[1].holders == ("alice",) and c.by_session == {"alice": 2}
    assert set(m.blocks) == {1} and m.blocks[1].holders == ("alice", "bob")


# --- the wire path against a plain model of it: every kind of event, fast path or not ----------------
class _Model:
    """What a wire-fed mirror must hold, block by block, in the plainest terms (no prompts
    registered: a block stored without a session is SOMEONE_ELSE's)."""

    def __init__(self):
        self.blocks: dict = {}  # key -> [slot, parent, tokens, creator, holders, hits]
        self.free: set = set()
        self.next = 0
        self.stored = self.new = self.removed = self.unknown = self.other = self.cleared = 0
        self.stored_by: Counter = Counter()

    def apply(self, ev) -> None:
        if type(ev) is AllBlocksCleared:
            for b in self.blocks.values():
                self.free.add(b[0])
            self.blocks.clear()
            self.cleared += 1
            return
        if (ev.medium not in (None, "GPU")) or ev.locality == "REMOTE":
            self.other += len(ev.block_hashes)
            return
        g = ev.group_idx
        if type(ev) is BlockRemoved:
            for h in ev.block_hashes:
                b = self.blocks.pop((g, h) if g else h, None)
                if b is None:
                    self.unknown += 1
                else:
                    self.free.add(b[0])
                    self.removed += 1
            return
        sid, parent, size = ev.session_id, ev.parent_block_hash, ev.block_size
        self.stored += len(ev.block_hashes)
        if sid is not None:
            self.stored_by[sid] += len(ev.block_hashes)
        for i, h in enumerate(ev.block_hashes):
            key = (g, h) if g else h
            b = self.blocks.get(key)
            if b is None:
                who = SOMEONE_ELSE if sid is None else sid
                if self.free:
                    slot = min(self.free)
                    self.free.discard(slot)
                else:
                    slot, self.next = self.next, self.next + 1
                self.blocks[key] = [slot, parent, list(ev.token_ids[i * size:(i + 1) * size]), who, [who], 0]
                self.new += 1
            else:
                who = b[3] if sid is None else sid
                if who not in b[4]:
                    b[4].append(who)
                b[5] += 1
            if sid is None:
                self.stored_by[who] += 1
            parent = h


def _random_events(rng: random.Random, n: int, odd: bool) -> list:
    """A hostile-ish stream: few hashes (so reuse, in-event repeats and removals of cached blocks
    are common), sessions and none, other tiers, remote blocks, block size 0, unknown removals,
    cache resets; `odd`: also group 1 and short token lists (which engine events, keyed by hex
    hash and sliced by block size, cannot say)."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.02:
            out.append(AllBlocksCleared())
        elif r < 0.35:
            out.append(BlockRemoved([rng.randrange(1, 60) for _ in range(rng.choice((1, 1, 1, 3)))],
                                    rng.choice(("GPU", "GPU", None, "CPU")), rng.choice((None, None, 0, int(odd)))))
        else:
            k = rng.choice((1, 1, 2, 4, 8))
            start = rng.randrange(1, 60)
            hashes = list(range(start, start + k)) if rng.random() < 0.8 else [rng.randrange(1, 60) for _ in range(k)]
            size = 0 if rng.random() < 0.03 else BS
            ntok = rng.randrange(k * size + 1) if odd and rng.random() < 0.1 else k * size
            out.append(BlockStored(hashes, rng.choice((None, rng.randrange(1, 60))),
                                   [rng.randrange(100) for _ in range(ntok)], size, None,
                                   rng.choice(("GPU", "GPU", "GPU", None, "CPU")), None,
                                   group_idx=rng.choice((None, None, None, 0, int(odd))),
                                   session_id=rng.choice(("a", "b", "c", None)),
                                   locality="REMOTE" if rng.random() < 0.03 else None))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_wire_path_holds_what_a_plain_model_says(seed):
    """Random batches of every kind of event: each block's slot (the lowest free one), parent,
    tokens, creator, holders and hits, and every counter, equal a plain model's, whether the
    batches come one by one or in one; and the engine events (as a recording of the pod is read
    back: its blocks named again by pod and hash) rebuild the same blocks."""
    rng = random.Random(seed)
    odd = seed % 2 == 1
    model, m, conv = _Model(), Mirror(pod="p"), Mirror(pod="p")
    w, wc = wired(m), wired(conv)
    batches = []
    for seq in range(60):
        evs = _random_events(rng, rng.randrange(1, 16), odd)
        for ev in evs:
            model.apply(ev)
        for ev in evs:  # the same events one batch each
            feed(wc, EventBatch(float(seq), [ev]))
        batches.append(feed(w, EventBatch(float(seq), evs), seq))
        want = {k: (b[0], b[1], b[2], b[3], tuple(b[4]), b[5]) for k, b in model.blocks.items()}
        for mirror in (m, conv):
            got = {k: (b.slot, b.parent, b.tokens, b.creator, b.holders, b.hits) for k, b in mirror.blocks.items()}
            assert got == want, f"batch {seq}"
            assert {s: k for k, s in mirror.key_slot.items()} == mirror.key  # both ways, nothing stale
            assert set(mirror.tokens) == set(mirror.users_of) == set(mirror.key)
            assert mirror.by_session == Counter(h for b in model.blocks.values() for h in b[4])
            assert mirror.extra_users == sum(len(b[4]) - 1 for b in model.blocks.values())
            assert mirror.stored_by_session == model.stored_by
            assert (mirror.stored, mirror.new_blocks, mirror.reannounced, mirror.removed, mirror.removed_unknown,
                    mirror.other_medium, mirror.cleared) == \
                (model.stored, model.new, model.stored - model.new, model.removed, model.unknown, model.other,
                 model.cleared)
            assert mirror.counts()[1] == len(model.blocks)
            assert sorted(mirror.creators().elements()) == sorted(b[3] for b in model.blocks.values())
    if odd:
        return
    from kvplay.sessions.event_log import name_blocks

    again, slots = Mirror(), Slots()
    for b in batches:
        b.pod = "p"
        again.apply(name_blocks(b, slots))
    assert sorted((b.hex, b.creator, b.holders, tuple(b.tokens)) for b in again.blocks.values()) == \
        sorted((b.hex, b.creator, b.holders, tuple(b.tokens)) for b in m.blocks.values())


def test_slot_map_reads_as_a_dict_of_the_slots_that_hold_something():
    """A mirror's key, parent, tokens and holders are lists by slot read as mappings: only slots
    with a value are keys; no index wraps (a negative slot), a slot past the list or no int at
    all is missing; a copy is independent."""
    sm = SlotMap([None, "a", None, ("x",)])
    assert dict(sm) == {1: "a", 3: ("x",)} == sm and len(sm) == 2 and sorted(sm) == [1, 3]
    assert sm.get(1) == "a" and sm.get(0) is None and sm.get(-1) is None and sm.get(9, "d") == "d"
    assert sm.get("1") is None and sm.get(np.int64(3)) == ("x",) and 3 in sm and -1 not in sm and 0 not in sm
    with pytest.raises(KeyError):
        sm[2]
    sm[6] = "far"
    del sm[1]
    assert sm.items() == [(3, ("x",)), (6, "far")] and sm.pop(6) == "far" and sm.pop(6, None) is None
    c = sm.copy()
    c[0] = "only in the copy"
    assert 0 not in sm and bool(sm) and not SlotMap([None, None])
    m = Mirror()
    assert m.key == {} and not m.tokens and len(m.users_of) == 0
