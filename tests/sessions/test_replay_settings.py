"""Settings changes (isolation, eviction, determinism, clear, group) are engine events: recorded
where they happened, replayed and exported at their turn; replay compares cached tokens and
their creators, not only the text."""
from __future__ import annotations

import json

import pytest

from kvplay.cli import main as cli
from kvplay.engine.events import SettingsChanged
from kvplay.engine.sampling import SamplingParams
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.script import parse_script

from support.recorded import drop_recorded, recorded

SYSTEM = "You are a helpful assistant for a bakery. Answer briefly and never invent prices or opening hours."
QUESTION = "How do I keep a sourdough starter alive over a long holiday away from home?"


def json_lines(out):
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def say(engine, rec, user, text=QUESTION):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    sampling = SamplingParams(max_tokens=4, seed=7)
    res = engine.submit(user, messages, sampling).result(60)
    rec.record_turn(user, text, messages, sampling, res)
    return res.stats


# The session the app makes when its user presses F2, F5, F3 and F4 between turns (the app's
# controls call these same engine methods from a worker thread).
STEPS = [
    ("alice", None),
    ("bob", {"isolation": "user"}),        # F2: bob's identical prompt no longer hits alice's blocks
    ("carol", {"isolation": "shared"}),    # F2 again: alice's blocks are reachable again
    ("dave", {"deterministic": True}),     # F5 (needs a fresh cache: it empties it)
    ("erin", {"eviction": "lfu"}),         # F3: dave's blocks still hit
    ("frank", "clear"),                    # F4
]


def record_app_style(make_engine, db):
    engine = make_engine(num_blocks=96)
    rec = Recorder.open(db, engine.config.replace(), engine.model_name, "app", SYSTEM)
    rec.attach(engine)
    for name, _ in STEPS:
        rec.add_user(name)
    cached = []
    for user, change in STEPS:
        if change == "clear":
            engine.clear_cache()
        elif change:
            engine.reconfigure(**change)
        st = say(engine, rec, user)
        cached.append((st.cached_tokens, dict(st.cached_from)))
    sid = rec.session_id
    rec.close()
    return sid, cached


def test_app_style_changes_are_recorded_replayed_and_exported(make_engine, tmp_path, capsys):
    db = str(tmp_path / "s.db")
    sid, cached = record_app_style(make_engine, db)
    # what the session is about: the changes decided these hits
    assert cached[0][0] == 0 and cached[1][0] == 0  # bob, isolated
    assert cached[2][0] > 0 and set(cached[2][1]) == {"alice"}
    assert cached[3][0] == 0  # the fresh cache
    assert cached[4][0] > 0 and set(cached[4][1]) == {"dave"}
    assert cached[5][0] == 0  # cleared

    rows = recorded(db, sid)
    settings = [e["changes"] for e in rows if e["kind"] == "SettingsChanged"]
    assert settings == [{"isolation": "user"}, {"isolation": "shared"}, {"deterministic": True}, {"eviction": "lfu"}]
    # each change sits right before the request it preceded
    kinds = [e["kind"] for e in rows if e["kind"] in ("SettingsChanged", "RequestQueued", "AllBlocksCleared")]
    assert kinds == ["RequestQueued", "SettingsChanged", "RequestQueued", "SettingsChanged", "RequestQueued",
                     "SettingsChanged", "AllBlocksCleared", "RequestQueued", "SettingsChanged", "RequestQueued",
                     "AllBlocksCleared", "RequestQueued"]

    assert cli(["replay", sid, "--db", db, "--headless", "--json", "--no-record"]) == 0
    objs = json_lines(capsys.readouterr().out)
    comps, summ = {c["turn"]: c for c in objs[:-1]}, objs[-1]
    assert [(comps[i + 1]["cached_now"], comps[i + 1]["cached_from_now"]) for i in range(len(STEPS))] == cached
    assert all(c["cache_equal"] and c["miss_equal"] and c["reproduces"] for c in comps.values())
    assert comps[4]["miss_then"]["reasons"]["config"] > 0  # dave: the F5 emptied the cache (a config change)
    assert comps[6]["miss_now"]["reasons"]["cleared"] > 0  # frank: the F4
    assert summ["reproduces"] and summ["cache_differs"] == 0

    out = tmp_path / "exported.toml"
    assert cli(["export", sid, "--db", db, "--format", "toml", "-o", str(out)]) == 0
    capsys.readouterr()
    script = parse_script(out.read_text())
    assert script.engine["isolation"] == "shared" and script.engine["deterministic"] is False  # as it began
    assert [(t.engine, t.clear) for t in script.turns] == [
        (None, None), ({"isolation": "user"}, None), ({"isolation": "shared"}, None),
        ({"deterministic": True}, None), ({"eviction": "lfu"}, None), (None, True)]  # the F5 clears by itself
    # and the exported script, run, makes the same hits
    assert cli(["run", str(out), "--json", "--no-record"]) == 0
    again = json_lines(capsys.readouterr().out)[:-1]
    assert [(t["cached_tokens"], t["cached_from"]) for t in again] == cached


def test_a_replay_whose_cached_tokens_differ_does_not_reproduce(make_engine, tmp_path, capsys):
    """The same session with its first F2 missing from the recording (as every app session was
    recorded before settings were events): the text may match, the cache does not."""
    db = str(tmp_path / "s.db")
    sid, cached = record_app_style(make_engine, db)
    assert drop_recorded(db, sid, lambda e: e.kind == "SettingsChanged" and e.changes == {"isolation": "user"}) == 1
    assert cli(["replay", sid, "--db", db, "--headless", "--json", "--no-record"]) == 0  # not deterministic mode
    objs = json_lines(capsys.readouterr().out)
    comps, summ = {c["turn"]: c for c in objs[:-1]}, objs[-1]
    assert comps[2]["cached_then"] == 0 and comps[2]["cached_now"] > 0  # bob now hits alice's blocks
    assert not comps[2]["cache_equal"] and not comps[2]["reproduces"]
    assert not summ["reproduces"] and summ["cache_differs"] >= 1 and summ["differs"] >= 1
    assert cli(["replay", sid, "--db", db, "--headless", "--no-record"]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert "in cached tokens" in last and "reproduces" not in last and "differs" in last


def test_settings_changed_carries_only_what_changed(make_engine):
    engine = make_engine()
    seen = []
    engine.subscribe_batches(lambda b: seen.extend(b.events))
    engine.reconfigure(isolation="shared", eviction="fifo")  # isolation unchanged
    engine.reconfigure(eviction="fifo")  # nothing changed: no event
    ev = [e for e in seen if isinstance(e, SettingsChanged)]
    assert len(ev) == 1 and ev[0].changes == {"eviction": "fifo"} and ev[0].previous == {"eviction": "lru"}
    from kvplay.tui.format import event_line

    assert "eviction lru → fifo" in event_line(ev[0], {})


@pytest.mark.parametrize("line, message", [
    ("engine = { block_size = 8 }", "block_size cannot change while the engine runs"),
    ('engine = { isolation = "nope" }', "unknown isolation mode"),
    ("engine = { colour = 1 }", "unknown engine option 'colour'"),
    ("engine = {}", "empty table"),
    ('engine = "user"', "`engine` must be a table"),
    ('clear = "yes"', "`clear` must be true or false"),
])
def test_bad_turn_settings_are_one_line(tmp_path, capsys, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(f'[engine]\nmodel = "tiny:llama"\n\n[[turns]]\nuser = "a"\ntext = "hi"\n{line}\n')
    assert cli(["run", str(path), "--no-record"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


async def test_the_apps_f2_f4_f5_are_recorded_where_they_happened(tiny_llama, tmp_path):
    """The app's keys, not only the engine methods: F2 (isolation), F5 (deterministic, after its
    question) and F4 (clear) each leave their event in the recording, between the turns."""
    from support.tui import SYSTEM as APP_SYSTEM, say, wait_until

    from kvplay.engine.config import EngineConfig
    from kvplay.sessions.script import UserSpec
    from kvplay.tui.app import KvplayApp
    from kvplay.tui.screens import ConfirmScreen

    db = tmp_path / "app.db"
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), [UserSpec("alice", max_tokens=4)],
                    APP_SYSTEM, loaded=tiny_llama, record=True, db=str(db), timings=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello")
        await wait_until(pilot, lambda: app.recorder is not None)
        await pilot.press("f2")
        await wait_until(pilot, lambda: app.engine.config.isolation == "user")
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: app.engine.config.deterministic)
        await pilot.press("f4")
        await wait_until(pilot, lambda: any("Cache cleared" in str(n.message) for n in app._notifications))
        await say(app, pilot, "alice", "Hello again")
    got = []
    for d in recorded(db, kinds=("RequestQueued", "SettingsChanged", "AllBlocksCleared")):
        kind = d["kind"]
        got.append(kind if kind == "RequestQueued" else
                   (kind, d.get("changes") or d.get("reason")))
    assert got == ["RequestQueued", ("SettingsChanged", {"isolation": "user"}),
                   ("SettingsChanged", {"deterministic": True}), ("AllBlocksCleared", "reconfigured"),
                   ("AllBlocksCleared", "cleared"), "RequestQueued"]
