"""The scrubber: the pool rebuilt from recorded events equals the live pool after each turn, and
`kvplay scrub` steps, plays and seeks through a recorded session with no model."""
from __future__ import annotations

import asyncio

import pytest

from support.pool_view import block_view
from support.recorded import as_batches
from support.tui import wait_until

from kvplay.engine.config import EngineConfig
from kvplay.engine.sampling import SamplingParams
from kvplay.sessions.history import History, flat_events, pool_state, session_batches
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.store import open_db

N = 24  # blocks: small enough for evictions
SYSTEM = "You are a helpful assistant for a small bakery. Answer briefly and plainly, please."
TURNS = [("alice", "Are you open on Mondays?"), ("bob", "Are you open on Mondays, too?"),
         ("carol", "Which breads do you bake?"), ("alice", "And on Sundays?"),
         ("bob", "Is the rye nut free?"), ("carol", "Can I order a cake?")]


def _live(engine) -> list[tuple]:
    views = engine.call(lambda: [block_view(engine.pool, b) for b in range(engine.num_blocks)])  # between steps
    return [(v.state, v.hash, v.creator, v.hits, v.users) for v in views]


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
    engine.subscribe_batches(lambda b: seen.extend(b.events))
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
            live.append((engine.call(lambda: len(seen)), _live(engine)))  # after the step's batch
        stats = engine.stats()
    finally:
        rec.close()
        engine.shutdown()
    d = open_db(db)
    sid = next(d.query("select id from sessions"))["id"]
    batches = session_batches(d, sid)
    d.close()
    return {"db": db, "sid": sid, "batches": batches, "live": live, "stats": stats, "seen": seen}


def test_rebuilt_pool_equals_the_live_pool_after_every_turn(recorded):
    batches, live = recorded["batches"], recorded["live"]
    events = flat_events(batches)
    assert [e.kind for e in events] == [ev.kind for ev in recorded["seen"]]
    assert recorded["stats"]["evictions"] > 0 and recorded["stats"]["hit_tokens"] > 0
    for n, blocks in live:
        state = pool_state(batches, n, N)
        assert _rebuilt(state) == blocks, f"after {n} events"
    last = pool_state(batches, len(events), N)
    assert last.hit_tokens == recorded["stats"]["hit_tokens"]
    assert last.query_tokens == recorded["stats"]["query_tokens"]
    assert last.evictions == recorded["stats"]["evictions"]
    assert last.count("cached") == recorded["stats"]["blocks_cached"]


def test_history_seeks_back_and_forth_like_the_pure_function(recorded):
    batches = recorded["batches"]
    events = flat_events(batches)
    h = History(batches, N, every=7)
    for n in (len(events), 3, 0, 40, len(events) // 2, 41, 15, len(events)):
        assert h.state(n).blocks == pool_state(batches, n, N).blocks, n
    mid = pool_state(batches, len(events) // 2, N)
    assert mid.count("in_use") + mid.count("cached") > 0


# --- the scrubber app (no model loaded) ---------------------------------------------------------
def _app(recorded, cursor=None):
    from kvplay.sessions.history import load_recording
    from kvplay.tui.scrub import ScrubApp

    d = open_db(recorded["db"])
    try:
        rec = load_recording(d, recorded["sid"])
    finally:
        d.close()
    return ScrubApp(rec, cursor)


def _map(screen):
    from kvplay.tui.blockmap import BlockMap

    return screen.query_one(BlockMap)


async def test_keys_step_turns_play_and_seek(recorded):
    from kvplay.tui.scrub import ScrubScreen, Timeline

    events = flat_events(recorded["batches"])
    app = _app(recorded, cursor=0)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ScrubScreen) and app.screen.is_mounted)
        scr = app.screen
        assert isinstance(scr, ScrubScreen) and scr.cursor == 0
        assert _map(scr).source is scr.state.mirror
        assert all(v.state == "free" for v in _map(scr).source.views())
        await pilot.press("right", "right")
        assert scr.cursor == 2
        await pilot.press("right_square_bracket")  # to the end of the first turn
        n1, live1 = recorded["live"][0]
        assert scr.cursor == n1
        assert _rebuilt(scr.state) == live1  # the map shows what the live pool held then
        assert _map(scr).source.views() == scr.state.blocks
        await pilot.press("right_square_bracket", "right_square_bracket", "left_square_bracket")
        assert scr.cursor == recorded["live"][1][0]
        await pilot.press("g", "4", "enter")  # go to turn 4
        assert scr.cursor == recorded["live"][3][0]
        assert _rebuilt(scr.state) == recorded["live"][3][1]
        await pilot.press("s", "s")  # 1x -> 2x -> 4x
        assert scr.speed == 4
        await pilot.press("2")
        assert scr.speed == 2
        await pilot.press("8")
        assert scr.speed == 8
        await pilot.press("home")
        assert scr.cursor == 0
        await pilot.press("space")  # plays at 8x the recorded pace (this session lasts under a second)
        assert scr._timer is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while scr.cursor < len(events):
            assert loop.time() < end, "playing did not reach the end"
            await pilot.pause(0.05)
        assert not scr.playing
        # click the middle of the timeline: the cursor lands among the events of that time
        tl = scr.query_one(Timeline)
        x = 9 + tl.span_w // 2
        await pilot.click(Timeline, offset=(x, 1))
        await wait_until(pilot, lambda: 0 < scr.cursor < len(events))
        ts = tl.ts_at(x)
        assert 0 < scr.cursor < len(events)
        assert (events[scr.cursor - 1].ts or 0) <= ts
        assert scr.cursor == len(events) or events[scr.cursor].ts > ts


def test_cli_screenshot_and_bad_input(recorded, tmp_path, capsys):
    from kvplay.cli import main as cli

    out = tmp_path / "scrub.svg"
    assert cli(["scrub", recorded["sid"][:10], "--db", recorded["db"], "--turn", "3", "--screenshot", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and "turn&#160;3/6" in svg
    assert cli(["scrub", "NOSUCH", "--db", recorded["db"]]) == 2
    assert cli(["scrub", recorded["sid"], "--db", recorded["db"], "--turn", "99"]) == 2
    err = capsys.readouterr().err
    assert "unknown session" in err and "--turn 99" in err and "Traceback" not in err


async def test_palette_opens_the_scrubber_on_the_recorded_session(tiny_llama, tmp_path):
    from kvplay.sessions.script import UserSpec
    from kvplay.tui.app import KvplayApp
    from kvplay.tui.scrub import ScrubScreen

    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=32), [UserSpec("alice", max_tokens=8)], SYSTEM,
                    loaded=tiny_llama, db=str(tmp_path / "app.db"), record=True, timings=False)
    async with app.run_test(size=(160, 48)) as pilot:
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while app.engine is None:
            assert loop.time() < end
            await pilot.pause(0.05)
        assert "session: scrub" in [c.title for c in app.get_system_commands(app.screen)]
        pane = app.pane("alice")
        pane.input.focus()
        pane.input.value = "Are you open on Mondays?"
        await pilot.press("enter")
        while app.busy or app.recorder is None or app.recorder._seq < 1:
            assert loop.time() < end
            await pilot.pause(0.05)
        live = _live(app.engine)
        app.action_scrub()
        await wait_until(pilot, lambda: isinstance(app.screen, ScrubScreen) and app.screen.is_mounted)
        scr = app.screen
        assert isinstance(scr, ScrubScreen) and scr.cursor == len(scr.rec.events) > 0
        assert _rebuilt(scr.state) == live
        await pilot.press("escape")
        assert not isinstance(app.screen, ScrubScreen)


def test_events_named_by_hash_only_get_slots():
    """A watched server's events carry hashes, not block ids: each (pod, hash) gets the lowest
    free slot while it is cached; a reset empties that pod's slots only."""
    def stored(h, pod, user="u"):
        return {"kind": "BlockStored", "block_hashes": [h], "token_ids": [1, 2], "block_size": 2, "user": user, "pod": pod}

    events = as_batches([stored("a", "p0"), stored("b", "p0"), stored("a", "p1", "v"),
                         {"kind": "BlockRemoved", "block_hashes": ["a"], "pod": "p0", "reason": "evicted"},
                         stored("c", "p0"), {"kind": "AllBlocksCleared", "pod": "p1"}])
    st = pool_state(events, 3, 0)
    assert [(b.hash, b.creator, b.state) for b in st.blocks] == [("a", "u", "cached"), ("b", "u", "cached"), ("a", "v", "cached")]
    st = pool_state(events, 5, 0)  # a left p0; c takes its slot
    assert [b.hash for b in st.blocks] == ["c", "b", "a"] and st.evictions == 1
    st = pool_state(events, 6, 0)  # p1 was reset
    assert [b.state for b in st.blocks] == ["cached", "cached", "free"]
