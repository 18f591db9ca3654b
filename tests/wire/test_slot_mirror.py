"""One event stream, one mirror: the engine's per-step batches rebuild its pool exactly
(wire/slots.Mirror), and the app's backend reads nothing of the engine but those batches."""
from __future__ import annotations

import random

import numpy as np
import pytest

from support.pool_view import block_view, pool_summary
from support.recorded import as_batches

from kvplay.engine.config import EngineConfig
from kvplay.engine.sampling import SamplingParams
from kvplay.sessions import history
from kvplay.sessions.history import History, pool_state
from kvplay.tui.backend import LocalEngineBackend
from kvplay.wire.mirror import Mirror
from kvplay.wire.views import BlockArrays, summarize

SYSTEM = "You are a helpful assistant for a small bakery. Answer briefly and plainly, please."
USERS = ("alice", "bob", "carol", "dave")


def _engine(tiny_llama, **cfg):
    from kvplay.engine.engine import Engine

    cfg.setdefault("model", "tiny:llama")
    return Engine(EngineConfig(**cfg), tiny_llama)


def _round(backend_or_engine, k: int) -> None:
    """Every user sends one turn at once (they share the system prompt)."""
    handles = [backend_or_engine.submit(u, [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": f"Question {k} from {u}: open on day {k}?"}],
                                        SamplingParams(max_tokens=12, seed=k))
               for u in USERS]
    for h in handles:
        assert h.result(60).error is None


def _mismatches(m: Mirror, pool) -> list:
    out = []
    for b in range(pool.num_blocks):
        live, got = block_view(pool, b), m.block(b)
        if (live.state, live.ref_count, live.hits) != (got.state, got.ref_count, got.hits):
            out.append((live, got))
        elif pool.blocks[b].indexed and (live.hash, live.creator, live.users, live.token_ids) != \
                (got.hash, got.creator, got.users, got.token_ids):
            out.append((live, got))
    return out


def test_batches_rebuild_the_live_pool_after_every_step(tiny_llama):
    """Concurrent users on a small pool (evictions, preemptions, a clear): after every batch,
    on the engine thread, the mirror's blocks equal the pool's (state, refs, hits; hash,
    creator, users and tokens of indexed blocks), and its counters equal the engine's."""
    eng = _engine(tiny_llama, num_blocks=20, isolation="shared", max_running=4)
    m = Mirror(eng.num_blocks)
    bad, steps, seqs = [], [], []

    def on_batch(batch):
        steps.append(batch.step)
        seqs.extend(e.seq for e in batch.events)
        m.apply(batch)
        bad.extend(_mismatches(m, eng.pool))

    eng.subscribe_batches(on_batch)
    eng.start()
    try:
        for k in range(3):
            _round(eng, k)
        eng.clear_cache()
        _round(eng, 3)
        eng.call(lambda: None)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert not bad, bad[:3]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 10
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert stats["evictions"] > 0 and stats["hit_tokens"] > 0
    s = m.stats()
    for k in ("blocks_free", "blocks_cached", "blocks_in_use", "hit_tokens", "query_tokens", "evictions",
              "preemptions", "requests_finished", "running", "waiting"):
        assert s[k] == stats[k], k


class EventsOnly:
    """An engine as the app may see it: chat, identity, settings and the event stream; no pool,
    no observer, no stats (an attribute the backend reads beyond these fails the test)."""
    __slots__ = ("_e",)

    def __init__(self, engine):
        self._e = engine

    model_name = property(lambda self: self._e.model_name)
    tokenizer = property(lambda self: self._e.tokenizer)
    config = property(lambda self: self._e.config)
    num_blocks = property(lambda self: self._e.num_blocks)
    block_bytes = property(lambda self: self._e.block_bytes)

    def register_user(self, name, group=None):
        return self._e.register_user(name, group)

    def submit(self, *a, **kw):
        return self._e.submit(*a, **kw)

    def subscribe_batches(self, fn):
        return self._e.subscribe_batches(fn)

    def shutdown(self, timeout=10.0):
        return self._e.shutdown(timeout)


def test_the_app_backend_needs_only_the_event_stream(tiny_llama):
    eng = _engine(tiny_llama, num_blocks=24, isolation="shared")
    backend = LocalEngineBackend(EventsOnly(eng))
    eng.start()
    try:
        for u in USERS:
            backend.register_user(u)
        for k in range(2):
            _round(backend, k)
        eng.call(lambda: None)
        live = eng.stats()
        got = backend.stats()
        for k in ("blocks_total", "blocks_free", "blocks_cached", "blocks_in_use", "hit_tokens", "query_tokens",
                  "hit_rate", "evictions", "preemptions", "requests_finished", "pool_bytes", "used_bytes",
                  "dedicated_bytes", "bytes_saved", "isolation", "eviction", "hash", "block_size"):
            assert got[k] == live[k], k
        for cells, start, stop, user in ((7, 0, None, None), (24, 0, None, "alice"), (3, 5, 17, "bob")):
            a = backend.summary(cells, start, stop, user)
            b = eng.call(lambda: pool_summary(eng.pool, cells, start, stop, user))  # noqa: B023 (called now)
            for f in ("bounds", "free", "cached", "in_use", "state"):
                assert np.array_equal(getattr(a, f), getattr(b, f)), (f, cells, start, stop)
            assert [a.users[c] if c >= 0 else None for c in a.creator] == \
                   [b.users[c] if c >= 0 else None for c in b.creator]
            if user:
                assert np.array_equal(a.mine, b.mine)
        for blk in range(eng.num_blocks):
            x, y = backend.block(blk), block_view(eng.pool, blk)
            assert (x.state, x.hash, x.creator, x.hits, x.users, x.token_ids) == \
                   (y.state, y.hash, y.creator, y.hits, y.users, y.token_ids), blk
        assert backend.block(eng.num_blocks) is None
    finally:
        backend.close()


@pytest.mark.parametrize("used", [0.1, 0.6])
def test_summary_of_the_used_part_equals_the_whole_pool(used):
    """A mirror summarises only up to the highest block ever named; the rest is free."""
    rng = random.Random(1)
    n, hw = 10_000, 3_000
    m = Mirror(n)
    ids = rng.sample(range(hw), int(hw * used))
    events = []
    for i, b in enumerate(ids):
        events.append({"kind": "BlocksAllocated", "block_ids": [b]})
        events.append({"kind": "BlockStored", "block_ids": [b], "block_hashes": [f"h{b}"], "token_ids": [1, 2],
                       "block_size": 2, "user": f"u{i % 3}"})
        if i % 2:
            events.append({"kind": "BlocksReleased", "block_ids": [b]})
    for batch in as_batches(events):
        m.apply(batch)
    full = BlockArrays(0, 0, np.pad(m.state[:m.hw], (0, n - m.hw)),
                       np.pad(m.creator[:m.hw], (0, n - m.hw), constant_values=-1), tuple(m.users))
    for cells, start, stop in ((100, 0, None), (7, 2_500, 9_000), (33, 10, 2_000), (5, 4_000, 9_999)):
        part = full if start == 0 and stop is None else BlockArrays(
            0, start, full.state[start:stop], full.creator[start:stop], full.users)
        a, b = m.summary(cells, start, stop, "u1"), summarize(part, cells, "u1")
        for f in ("bounds", "free", "cached", "in_use", "state", "creator", "mine"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), (f, cells, start, stop)


def test_history_checkpoints_stay_within_their_byte_budget(monkeypatch):
    """With room for only a few checkpoints, History thins them out and still equals the pure
    function at every cursor, back and forth."""
    events = []
    for k in range(200):
        b = k % 50
        events += [{"kind": "BlocksAllocated", "block_ids": [b], "ts": k},
                   {"kind": "BlockStored", "block_ids": [b], "block_hashes": [f"h{k}"], "token_ids": [k, k],
                    "block_size": 2, "user": f"u{k % 3}", "request_id": f"r{k}", "ts": k},
                   {"kind": "BlocksReleased", "block_ids": [b], "ts": k}]
        if b == 49:
            events.append({"kind": "BlockRemoved", "block_ids": list(range(50)), "reason": "evicted", "ts": k})
    monkeypatch.setattr(history, "CHECKPOINT_BYTES", 4 * 50 * history._SLOT_BYTES)  # 50 blocks used: room for 4
    batches = as_batches(events)
    h = History(batches, 64, every=4)
    for n in (len(events), 5, 0, 301, len(events) // 2, 77, len(events), 1):
        assert h.state(n).blocks == pool_state(batches, n, 64).blocks, n
    assert len(h._marks) <= 4 and h.every > 4


def _old_rows(tmp_path, events) -> tuple:
    """A session whose events were recorded the old way (one JSON row each): (db, its id)."""
    import json

    from kvplay.sessions.recorder import Recorder
    from kvplay.sessions.store import open_db

    db_path = str(tmp_path / "s.db")
    rec = Recorder.open(db_path, None, "m", "run", "")
    sid = rec.session_id
    rec.close()
    db = open_db(db_path)
    db["cache_events"].insert_all([{"session_id": sid, "seq": i, "kind": "x",
                                    "payload": e if isinstance(e, str) else json.dumps(e)} for i, e in enumerate(events)])
    return db, sid


def test_malformed_recorded_events_are_counted_and_skipped(tmp_path):
    """A recording is untrusted: wrong types, negative or huge block ids, a hostile pool size
    are counted in `bad` and skipped where rows are read, the mirror unchanged by them and its
    arrays bounded."""
    from kvplay.sessions.event_log import read_batches
    from kvplay.sessions.history import recorded_pool_size
    from kvplay.wire.mirror import MAX_BLOCKS

    good = [{"kind": "BlocksAllocated", "block_ids": [0, 1]},
            {"kind": "BlockStored", "block_ids": [0], "block_hashes": ["aa"], "token_ids": [1, 2], "block_size": 2,
             "user": "alice", "request_id": "r1"},
            {"kind": "BlocksReleased", "block_ids": [0, 1]}]
    bad = [{"kind": "BlocksAllocated", "block_ids": [10 ** 12]},
           {"kind": "BlocksAllocated", "block_ids": [-1]},
           {"kind": "BlocksAllocated", "block_ids": "0"},
           {"kind": "BlocksTouched", "block_ids": [1.5]},
           {"kind": "BlocksReleased", "block_ids": [True]},
           {"kind": "BlockStored", "block_ids": [0], "block_hashes": [7.5], "token_ids": [1, 2], "block_size": 2},
           {"kind": "BlockStored", "block_ids": [0], "block_hashes": ["bb"], "token_ids": "xy", "block_size": 2},
           {"kind": "BlockStored", "block_hashes": ["cc"] * 3, "token_ids": [1], "block_size": -4},
           {"kind": "BlockStored", "block_ids": [0], "block_hashes": ["dd"], "user": {"x": 1}},
           {"kind": "BlockHit", "block_ids": [0], "cached_tokens": "many"},
           {"kind": "BlockRemoved", "block_ids": [MAX_BLOCKS], "reason": "evicted"},
           {"kind": "BlockRemoved", "block_hashes": [None], "pod": "p"},
           {"kind": "RequestQueued", "request_id": ["r"], "prompt_tokens": 3},
           {"kind": "RequestQueued", "request_id": "r", "prompt_tokens": "3"},
           {"kind": "BlocksAllocated", "block_ids": [2], "ts": "now"},
           {"kind": 5}, None, 7]
    m = Mirror(4)
    for b in as_batches(good):
        m.apply(b)
    before = (m.views(), m.stats())
    db, sid = _old_rows(tmp_path, good[:2] + bad + good[2:])
    batches, nbad = read_batches(db, sid)
    db.close()
    assert nbad == len(bad) and sum(len(b.events) for b in batches) == len(good)
    again = Mirror(4)
    for b in batches:
        again.apply(b)
    assert (again.views(), again.stats()) == before
    assert again.num_blocks == 4 and len(again.state) < 2048
    assert again.block(0).hash == "aa" and again.block(0).state == "cached"
    # a hostile pool size in the session row is ignored; the events' own blocks decide
    assert recorded_pool_size({"engine_config": {"num_blocks": 10 ** 15}}, batches) == 2
    assert recorded_pool_size({"stats": {"blocks_total": "lots"}}, batches) == 2


def test_history_steps_over_malformed_events(tmp_path):
    from kvplay.sessions.event_log import read_batches

    db, sid = _old_rows(tmp_path, [{"kind": "BlocksAllocated", "block_ids": [0]},
                                   {"kind": "BlocksAllocated", "block_ids": [-3]}, None,
                                   {"kind": "BlocksReleased", "block_ids": [0]}])
    batches, bad = read_batches(db, sid)
    db.close()
    h = History(batches, 2)
    st = h.state(len(h))
    assert bad == 2 and st.applied == 2 and st.count("free") == 2
    assert h.state(1).count("in_use") == 1


def test_a_damaged_recording_still_scrubs(tmp_path):
    """Rows whose payload is not a JSON object, or not an event, are skipped when loading; the
    scrubber's History reaches the end."""
    from kvplay.sessions.history import load_recording
    from kvplay.sessions.recorder import Recorder
    from kvplay.sessions.store import open_db

    db_path = str(tmp_path / "s.db")
    rec = Recorder.open(db_path, None, "m", "run", "")
    sid = rec.session_id
    rec.close()
    db = open_db(db_path)
    rows = ['{"kind": "BlocksAllocated", "block_ids": [0, 1]}', "not json", "[1, 2]", "7",
            '{"kind": "BlocksAllocated", "block_ids": [99999999999]}', '{"kind": "BlocksReleased", "block_ids": [1]}']
    db["cache_events"].insert_all([{"session_id": sid, "seq": i, "kind": "x", "payload": p} for i, p in enumerate(rows)])
    r = load_recording(db, sid)
    db.close()
    assert len(r.events) == 2 and r.num_blocks == 2
    st = History(r.batches, r.num_blocks).state(len(r.events))
    assert st.count("in_use") == 1 and st.count("free") == 1
