"""The scrubber: the pool rebuilt from recorded events equals the live pool after each turn, and
`kvplay scrub` steps, plays and seeks through a recorded session with no model."""
from __future__ import annotations

import asyncio

import pytest

from kvplay.engine.config import EngineConfig
from kvplay.engine.sampling import SamplingParams
from kvplay.sessions.history import History, pool_state
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import session_events

N = 24  # blocks: small enough for evictions
SYSTEM = "You are a helpful assistant for a small bakery. Answer briefly and plainly, please."
TURNS = [("alice", "Are you open on Mondays?"), ("bob", "Are you open on Mondays, too?"),
         ("carol", "Which breads do you bake?"), ("alice", "And on Sundays?"),
         ("bob", "Is the rye nut free?"), ("carol", "Can I order a cake?")]


def _live(engine) -> list[tuple]:
    engine.call(lambda: None)  # between steps: the published snapshot is current
    return [(v.state, v.hash, v.creator, v.hits, v.users) for v in engine.snapshot()]


def _rebuilt(state) -> list[tuple]:
    return [(b.state, b.hash, b.creator, b.hits, b.users) for b in state.blocks]


@pytest.fixture(scope="module")
def recorded(tiny_llama, tmp_path_factory):
    """A sequential tiny-model session, recorded, with the live pool after every turn; the pool
    is small enough (shared isolation, N blocks) for evictions."""
    from kvplay.engine.engine import Engine

    db = str(tmp_path_factory.mktemp("scrub") / "s.db")
    config = EngineConfig(model="tiny:llama", num_blocks=N, isolation="shared")
    engine = Engine(config, tiny_llama).start()
    seen: list = []
    engine.subscribe(seen.append)
    rec = Recorder.open(db, config, engine.model_name, "run", SYSTEM)
    rec.attach(engine)
    for u in ("alice", "bob", "carol"):
        rec.add_user(u)
    history: dict[str, list] = {}
    live = []
    try:
        for user, text in TURNS:
            msgs = [{"role": "system", "content": SYSTEM}, *history.get(user, []), {"role": "user", "content": text}]
            sp = SamplingParams(max_tokens=24, seed=1)
            res = engine.submit(user, msgs, sp).result(60)
            assert res.error is None
            rec.record_turn(user, text, msgs, sp, res)
            history.setdefault(user, []).extend([{"role": "user", "content": text},
                                                 {"role": "assistant", "content": res.text}])
            live.append((len(seen), _live(engine)))
        stats = engine.stats()
    finally:
        rec.close()
        engine.shutdown()
    d = open_db(db)
    sid = next(d.query("select id from sessions"))["id"]
    events = session_events(d, sid)
    d.close()
    return {"db": db, "sid": sid, "events": events, "live": live, "stats": stats, "seen": seen}


def test_rebuilt_pool_equals_the_live_pool_after_every_turn(recorded):
    events, live = recorded["events"], recorded["live"]
    assert [e["kind"] for e in events] == [ev.kind for ev in recorded["seen"]]
    assert recorded["stats"]["evictions"] > 0 and recorded["stats"]["hit_tokens"] > 0
    for n, blocks in live:
        state = pool_state(events, n, N)
        assert _rebuilt(state) == blocks, f"after {n} events"
    last = pool_state(events, len(events), N)
    assert last.hit_tokens == recorded["stats"]["hit_tokens"]
    assert last.query_tokens == recorded["stats"]["query_tokens"]
    assert last.evictions == recorded["stats"]["evictions"]
    assert last.count("cached") == recorded["stats"]["blocks_cached"]


def test_history_seeks_back_and_forth_like_the_pure_function(recorded):
    events = recorded["events"]
    h = History(events, N, every=7)
    for n in (len(events), 3, 0, 40, len(events) // 2, 41, 15, len(events)):
        assert h.state(n).blocks == pool_state(events, n, N).blocks, n
    mid = pool_state(events, len(events) // 2, N)
    assert mid.count("in_use") + mid.count("cached") > 0
