"""Pilot tests of the playground against the real engine on the tiny random model."""
from __future__ import annotations

from support.recorded import recorded
from support.tui import SYSTEM, badges, make_app, say, wait_until

from kvplay.engine.config import EngineConfig
from kvplay.sessions.script import UserSpec
from kvplay.tui.app import KvplayApp
from kvplay.tui.blockmap import BlockMap
from kvplay.tui.screens import ErrorScreen


async def test_second_user_reuses_first_users_blocks(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        assert "cached 0" in badges(app, "alice")[-1]
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
        badge = badges(app, "bob")[-1]
        stats = app.cache.requests[-1]
        assert stats.user == "bob" and stats.cached_from.get("alice", 0) >= 16
        assert f"cached {stats.cached_tokens} (alice {stats.cached_from['alice']})" in badge
        bm = app.query_one(BlockMap)
        # the map marks the blocks bob reused, and they are alice's
        assert bm.hit and all(app.backend.block(i).creator == "alice" for i in bm.hit)
        assert all("bob" in app.backend.block(i).users for i in bm.hit)
        assert bm.bpc == 1
        row = bm.render_line(0).text
        assert "+" in row and "a" in row


async def test_map_marks_exactly_the_reused_blocks(tiny_llama):
    """As many marked cells as the badge's cached blocks, each on a band spanning its cell (the
    issue saw 8 cells for 7 blocks: `a+a+a+…a` reads as one more cell than it marks)."""
    from kvplay.tui.blockmap import HIT_BG

    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
        stats = app.cache.requests[-1]
        bm = app.query_one(BlockMap)
        banded = 0
        for y in range(bm.size.height):
            segs = list(bm.render_line(y))
            for glyph, mark in zip(segs[0::2], segs[1::2]):
                if mark.text == "+":
                    banded += 1
                    assert glyph.style.bgcolor.name == HIT_BG and mark.style.bgcolor.name == HIT_BG
                else:
                    assert glyph.style.bgcolor is None or glyph.style.bgcolor.name != HIT_BG
        assert banded == stats.cached_tokens // app.engine.config.block_size == len(bm.hit)


async def test_isolation_switch_stops_cross_user_reuse(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.controls.set_isolation("user")
        await wait_until(pilot, lambda: app.engine.config.isolation == "user")
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        await say(app, pilot, "bob", "What is a KV cache in a transformer?")
        stats = app.cache.requests[-1]
        assert stats.user == "bob" and "alice" not in stats.cached_from
        cached, _, why = badges(app, "bob")[-1].partition(" · missed ")
        assert "alice" not in cached and "isolated from alice" in why  # whose blocks would have hit
        assert not app.query_one(BlockMap).hit
        await wait_until(pilot, lambda: "isolation user" in str(app.query_one("#status").render()))


async def test_map_has_one_cell_per_pool_block(tiny_llama):
    app = make_app(tiny_llama, num_blocks=77)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await wait_until(pilot, lambda: app.query_one(BlockMap).cell_count > 0)
        bm = app.query_one(BlockMap)
        assert bm.cell_count == app.engine.pool.num_blocks == 77
        assert bm.virtual_size.height == -(-77 // bm.cols)


async def test_map_refreshes_only_changed_rows(tiny_llama):
    app = make_app(tiny_llama, num_blocks=200)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.query_one(BlockMap).cell_count == 200 and app.settled)
        bm = app.query_one(BlockMap)
        views = [app.backend.block(i) for i in range(200)]
        bm.update_blocks(views, app.looks)
        assert bm.rows_refreshed == 0
        import dataclasses
        views[bm.cols + 1] = dataclasses.replace(views[bm.cols + 1], state="cached", creator="alice")
        bm.update_blocks(views, app.looks)
        assert bm.rows_refreshed == 1


async def test_block_details_decode_tokens(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello there")
        app.cache.select_block(0)
        await wait_until(pilot, lambda: "block #0" in str(app.query_one("#detail").render()))
        detail = str(app.query_one("#detail").render())
        assert "block #0" in detail and "creator alice" in detail and "<|im_start|>system" in detail
        await pilot.press("right")
        assert app.query_one(BlockMap).cursor == 1
        assert "block #1" in str(app.query_one("#detail").render())


async def test_empty_and_too_long_messages_stay_in_their_pane(tiny_llama):
    app = make_app(tiny_llama, num_blocks=12)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        alice = app.pane("alice")
        alice.input.focus()
        alice.input.value = "   "
        await pilot.press("enter")
        assert "empty message is ignored" in alice.chat.texts("note")[-1]
        await say(app, pilot, "alice", "x" * 400)  # 12 blocks x 16 tokens cannot hold it
        err = alice.chat.texts("error")[-1]
        assert "pool holds 12 blocks" in err
        assert not app.pane("bob").chat.texts("error")
        await say(app, pilot, "bob", "Hi")
        assert "prompt" in badges(app, "bob")[-1]


async def test_engine_failure_shows_error_screen_with_fix(tiny_llama):
    app = KvplayApp(EngineConfig(model="no-such-model"), [UserSpec("alice")], SYSTEM, record=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ErrorScreen), timeout=30)
        assert "model not found" in app.screen.error
        assert "--model" in app.screen.fix


async def test_too_small_terminal_shows_notice(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(60, 20)) as pilot:
        await wait_until(pilot, lambda: app.screen.has_class("too-small"))
        assert "needs at least 80×24" in str(app.query_one("#too-small").render())


async def test_add_and_remove_user(tiny_llama):
    app = make_app(tiny_llama, users=("alice", "bob"))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.add_user(UserSpec("dave", max_tokens=4))
        await wait_until(pilot, lambda: app.pane("dave").is_mounted and app.pane("dave").input.is_mounted)
        assert [p.user for p in app.panes] == ["alice", "bob", "dave"]
        await say(app, pilot, "dave", "Hi")
        assert "prompt" in badges(app, "dave")[-1]
        assert app.looks["dave"].glyph == "D"


async def test_bindings_have_ids_and_palette_commands_read_category_action(tiny_llama):
    app = make_app(tiny_llama)
    assert all(b.id and b.description for b in KvplayApp.BINDINGS)
    async with app.run_test(size=(160, 48)):
        titles = [c.title for c in app.get_system_commands(app.screen)]
    for want in ("pane: focus next", "user: add", "user: remove", "isolation: user", "eviction: lfu",
                 "cache: clear", "mode: toggle deterministic", "prompt: edit system prompt",
                 "user: settings", "app: save screenshot", "app: quit", "app: help"):
        assert want in titles
    assert all(": " in t for t in titles[:10])


async def test_deterministic_toggle_on_an_empty_cache_does_not_ask(tiny_llama):
    """Nothing to drop, nothing to confirm (it asked about dropping "the 0 blocks"); with blocks
    cached it asks: test_deterministic_confirmation_says_on_and_the_blocks_it_drops."""
    from kvplay.tui.screens import ConfirmScreen

    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await pilot.press("f5")
        await wait_until(pilot, lambda: app.engine.config.deterministic)
        assert not isinstance(app.screen, ConfirmScreen)


def recording_app(tiny_llama, db):
    """One pane (alice, 4 tokens a turn) on the tiny model, recording to `db`."""
    return KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), [UserSpec("alice", max_tokens=4)], SYSTEM,
                     loaded=tiny_llama, record=True, db=str(db), timings=False)


async def test_turns_are_recorded_when_recording(tiny_llama, tmp_path):
    import sqlite3

    db = tmp_path / "sessions.db"
    app = recording_app(tiny_llama, db)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello")
        await wait_until(pilot, lambda: app.recorder is not None)
    assert app.recorder_error is None
    con = sqlite3.connect(db)
    rows = con.execute("select user, text, prompt_tokens from turns").fetchall()
    assert rows and rows[0][:2] == ("alice", "Hello")
    assert con.execute("select count(*) from users").fetchone()[0] == 1


async def test_hovering_a_cell_shows_its_details(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello there")
        await pilot.hover("#map", offset=(2, 0))  # second cell of the first row
        await wait_until(pilot, lambda: "block #1 " in str(app.query_one("#detail").render()))


async def test_replay_pause_and_step(tiny_llama):
    from kvplay.sessions.script import TurnSpec

    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), [UserSpec("alice", max_tokens=4),
                    UserSpec("bob", max_tokens=4)], SYSTEM, turns=[TurnSpec("alice", "one"), TurnSpec("bob", "two")],
                    speed=0, loaded=tiny_llama, record=False, timings=False)
    app.chat.paused = True
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        # the script has started (its placeholders: set just before it waits at the pause)
        await wait_until(pilot, lambda: app.pane("alice").input.placeholder.startswith("replaying"))
        assert not app.cache.requests and not app.busy  # paused: nothing was sent
        await pilot.press("f12")  # step: exactly one turn
        await wait_until(pilot, lambda: len(app.cache.requests) == 1 and not app.busy)
        await pilot.pause(0.3)  # the subject: paused again after one step, no second turn goes in this time
        assert len(app.cache.requests) == 1 and app.cache.requests[0].user == "alice"
        await pilot.press("f11")  # resume
        await wait_until(pilot, app.chat.autoplay_done.is_set)
        assert [r.user for r in app.cache.requests] == ["alice", "bob"]


async def test_a_scripted_group_change_moves_the_user_before_that_turn(tiny_llama):
    """A replayed or scripted turn with `group` moves its user there first (through the engine's
    registry, recorded as UserGroupChanged), so only that turn shares the group's blocks."""
    from kvplay.engine.events import UserGroupChanged
    from kvplay.sessions.script import TurnSpec

    q = "How do I keep a sourdough starter alive over a long holiday?"
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=96, isolation="group"),
                    [UserSpec("alice", group="a", max_tokens=4), UserSpec("mallory", max_tokens=4)], SYSTEM,
                    turns=[TurnSpec("alice", q), TurnSpec("mallory", q), TurnSpec("mallory", "And rye?", group="a")],
                    speed=0, loaded=tiny_llama, record=False, timings=False)
    seen = []
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.engine.subscribe_batches(lambda b: seen.extend(ev for ev in b.events if isinstance(ev, UserGroupChanged)))
        await wait_until(pilot, app.chat.autoplay_done.is_set)
        stats = list(app.cache.requests)
        assert [s.user for s in stats] == ["alice", "mallory", "mallory"]
        assert stats[1].cached_tokens == 0 and set(stats[2].cached_from) == {"alice"}
        assert app.pane("mallory").spec.group == "a"
        assert [(e.user, e.old_group, e.new_group) for e in seen] == [("mallory", None, "a")]


def test_cli_rejects_bad_users_before_opening_the_app(capsys):
    from kvplay.cli import main

    assert main(["--users", "alice,alice", "--model", "tiny:llama"]) == 2
    assert "duplicate" in capsys.readouterr().err
    assert main(["app", "--users", " , ", "--model", "tiny:llama"]) == 2


async def test_keymap_from_environment_remaps_a_binding(tiny_llama, monkeypatch):
    monkeypatch.setenv("KVPLAY_KEYMAP", "view.events=ctrl+o")
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        log = app.query_one("#events")
        await pilot.press("f10")
        assert not log.has_class("shown")  # the old key no longer toggles it
        await pilot.press("ctrl+o")
        assert log.has_class("shown")


async def test_user_settings_form_changes_seed_temperature_group(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.pane("bob").input.focus()
        await pilot.press("f7")
        await wait_until(pilot, lambda: app.screen.query("#field-seed"))
        screen = app.screen
        for name, value in (("seed", "7"), ("temperature", "0.5"), ("group", "team-b")):
            screen.query_one(f"#field-{name}").value = value
        screen.query_one("#field-group").focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: "group team-b" in str(app.pane("bob").border_subtitle))
        spec = app.pane("bob").spec
        assert (spec.seed, spec.temperature, spec.group) == (7, 0.5, "team-b")
        assert "group team-b" in str(app.pane("bob").border_subtitle)


async def test_system_prompt_edit_changes_the_next_prompt(tiny_llama):
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await pilot.press("f6")
        await wait_until(pilot, lambda: app.screen.query("TextArea"))
        app.screen.query_one("TextArea").text = "Be terse."
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.chat.system_prompt == "Be terse.")


async def test_a_broken_database_does_not_break_the_playground(tiny_llama, tmp_path):
    bad = tmp_path / "not-a-db.sqlite"
    bad.write_text("this is not sqlite")
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), [UserSpec("alice", max_tokens=4)], SYSTEM,
                    loaded=tiny_llama, record=True, db=str(bad), timings=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello")
        await wait_until(pilot, lambda: app.recorder_error is not None)
        assert "prompt" in badges(app, "alice")[-1]


async def test_lab_runs_from_the_app_and_shows_its_verdict(tiny_llama):
    from kvplay.tui.screens import ConfirmScreen, LabScreen

    app = make_app(tiny_llama, num_blocks=128)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.action_run_lab("response-cache")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")  # the confirmation
        await wait_until(pilot, lambda: isinstance(app.screen, LabScreen), timeout=120)
        from rich.panel import Panel

        verdicts = [p for p in app.screen.parts if isinstance(p, Panel)]
        assert verdicts and "response-cache" in str(verdicts[0].title) and "response cache" in str(verdicts[0].renderable)
        assert app.engine.config.isolation == "shared"  # the lab restored the mode it found


async def test_a_lab_leaves_no_blocks_and_none_of_its_requests_in_the_apps_numbers(tiny_llama):
    from kvplay.tui.screens import LabScreen

    app = make_app(tiny_llama, num_blocks=128)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        own = app.cache.requests[-1]
        app.controls.start_lab("response-cache")
        await wait_until(pilot, lambda: isinstance(app.screen, LabScreen), timeout=120)
        app.cache.mark_dirty()
        await wait_until(pilot, lambda: app.settled and "hit rate 0%" in str(app.query_one("#stats").render()))
        st = app.cache.stats
        assert app.engine.stats()["query_tokens"] > own.prompt_tokens  # the lab did run requests
        assert (st["query_tokens"], st["hit_tokens"]) == (own.prompt_tokens, own.cached_tokens)
        assert st["blocks_free"] == st["blocks_total"]  # its blocks went with it
        assert "hit rate 0%" in str(app.query_one("#stats").render())


async def test_an_app_session_without_turns_is_not_recorded(tiny_llama, tmp_path):
    import sqlite3

    db = tmp_path / "sessions.db"
    app = recording_app(tiny_llama, db)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await pilot.pause(0.3)  # the subject: the app runs a while with no turn, and records nothing
    assert not db.exists() or sqlite3.connect(db).execute("select count(*) from sessions").fetchone()[0] == 0


def test_listing_an_empty_file_says_so_and_leaves_it_empty(tmp_path, capsys):
    from kvplay.cli import main

    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    assert main(["sessions", "--db", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty file" in err[0] and "left unchanged" in err[0]
    assert empty.stat().st_size == 0


async def test_map_of_a_big_pool_shows_its_scale_zooms_jumps_and_filters(tiny_llama):
    from kvplay.tui.blockmap import BlockMap

    app = make_app(tiny_llama, num_blocks=100_000)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
        bm = app.query_one(BlockMap)
        await wait_until(pilot, lambda: bm._row_keys)
        rows = bm.virtual_size.height
        assert rows <= 12 and bm.bpc > 1 and bm.cell_count <= bm.cols * 12  # the whole pool at a glance
        title = str(app.query_one("#map-title").render())
        assert f"1 cell = {bm.bpc:,} blocks · 100,000 blocks · whole pool" in title
        bm.focus()
        await pilot.press("plus")
        assert bm.bpc == bm.overview_bpc // 4 and bm.zoomed
        await pilot.press("j")  # the last request's blocks, one cell each
        await wait_until(pilot, lambda: bm.bpc == 1)
        first = min(app.cache.last_blocks)
        assert bm.cursor == first and "1 cell = 1 block ·" in str(app.query_one("#map-title").render())
        assert f"block #{first} " in str(app.query_one("#detail").render())
        await pilot.press("slash")  # alice's blocks only
        assert bm.user_filter == "alice" and "only alice's" in str(app.query_one("#map-title").render())
        await pilot.press("0")
        assert not bm.zoomed and bm.bpc == bm.overview_bpc


async def test_small_terminal_shows_one_pane_and_panels_follow_resizes(tiny_llama):
    from kvplay.tui.widgets import RequestBars

    app = make_app(tiny_llama)
    async with app.run_test(size=(200, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello there")
        bars = app.query_one(RequestBars)
        wide = max(len(line) for line in bars.render().plain.splitlines())
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: app.screen.has_class("compact") and app.pane("alice").region.width >= 70)
        shown = [p.user for p in app.panes if p.display and p.region.width]
        assert shown == ["alice"] and app.pane("alice").region.width >= 70
        await pilot.press("ctrl+t")  # the cache panel as a tab
        await wait_until(pilot, lambda: app.query_one("#side").region.width >= 70 and not app.pane("alice").region.width)
        await pilot.press("ctrl+t")
        await pilot.resize_terminal(200, 48)
        await wait_until(pilot, lambda: not app.screen.has_class("compact") and all(p.region.width for p in app.panes)
                         and max(len(line) for line in bars.render().plain.splitlines()) == wide)
        assert max(len(line) for line in bars.render().plain.splitlines()) == wide >= 40


async def test_live_timeline_shows_each_request_and_each_users_ttft(tiny_llama):
    """The playground's timeline (the scrubber's widget, live): one column per finished turn on
    the wall-clock axis, bob's reused tokens in his colour, a TTFT row per user, the cursor at
    now on the right edge; drawn to the panel's width at 80×24 (cache tab) and back at 200."""
    from kvplay.tui.timeline import Timeline

    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64),
                    [UserSpec(u, max_tokens=8) for u in ("alice", "bob")], SYSTEM,
                    loaded=tiny_llama, record=False, timings=True)
    async with app.run_test(size=(200, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
        tl = app.query_one(Timeline)
        assert [s["user"] for s in tl.spans] == ["alice", "bob"]
        alice, bob = tl.spans
        assert alice["cached"] == 0 and bob["cached"] == app.cache.requests[-1].cached_tokens > 0
        assert bob["cached_from"].get("alice", 0) > 0
        assert alice["queued"] < bob["queued"] and all(s["ttft_ms"] is not None for s in tl.spans)
        assert tl.users == ["alice", "bob"]
        lines = tl.render().plain.splitlines()
        assert len(lines) == tl.bar_rows + 2 + 1 and tl.region.height == len(lines)
        ttft_rows = [ln for ln in lines if "TTFT" in ln]
        assert len(ttft_rows) == 2 and all(any(c in ln[9:] for c in "▁▂▃▄▅▆▇█") for ln in ttft_rows)
        bars = lines[:tl.bar_rows]
        assert bars[0].startswith("computed") and bars[-1].startswith("reused")
        # bob's column (the later one): at the bottom alice's blocks, in her colour; alice's
        # column: all computed, in hers
        from rich.color import Color

        bottom = tl.render().split("\n")[tl.bar_rows - 1]
        filled = [i for i, ch in enumerate(bottom.plain) if i >= 9 and ch != " "]
        assert len(filled) == 2

        def colour_at(i):
            return next(sp.style.color for sp in bottom.spans if sp.start <= i < sp.end)

        alice_colour = Color.parse(app.looks["alice"].colour)
        assert bottom.plain[filled[1]] == "█" and colour_at(filled[1]) == alice_colour
        assert bottom.plain[filled[0]] == "░" and colour_at(filled[0]) == alice_colour
        axis = lines[-1]
        assert axis.rstrip().endswith("▲ now") and tl.cursor_ts == tl.t1 >= bob["first"]
        wide = len(axis)
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: app.screen.has_class("compact"))
        await pilot.press("ctrl+t")  # the cache tab
        await wait_until(pilot, lambda: tl.region.width >= 70)
        narrow = tl.render().plain.splitlines()
        assert all(len(ln) <= tl.size.width for ln in narrow) and narrow[-1].rstrip().endswith("▲ now")
        await pilot.press("ctrl+t")
        await pilot.resize_terminal(200, 48)
        await wait_until(pilot, lambda: len(tl.render().plain.splitlines()[-1]) == wide)


async def test_too_small_notice_follows_each_resize(tiny_llama):
    """The notice names the size the terminal has now (on_resize read the old one: one behind)."""
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()  # mounted, its first size handled
        assert not app.screen.has_class("too-small")
        await pilot.resize_terminal(60, 20)
        await wait_until(pilot, lambda: app.screen.has_class("too-small")
                         and "is 60×20" in str(app.query_one("#too-small").render()))
        await pilot.resize_terminal(70, 22)
        await wait_until(pilot, lambda: "is 70×22" in str(app.query_one("#too-small").render()))
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: not app.screen.has_class("too-small"))


async def test_cache_tab_then_wide_then_small_again_shows_the_pane_and_ctrl_t_works(tiny_llama):
    from kvplay.tui.widgets import CACHE_TAB, PaneSwitcher

    app = make_app(tiny_llama)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: app.screen.has_class("show-cache"))
        await pilot.resize_terminal(200, 50)
        await wait_until(pilot, lambda: not app.screen.has_class("compact"))
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: app.screen.has_class("compact") and app.pane("alice").region.width)
        switcher = app.query_one(PaneSwitcher)
        shown = [p.user for p in app.panes if p.display and p.region.width]
        assert not app.screen.has_class("show-cache") and shown == ["alice"]
        assert switcher.active == app._tab_id("alice")  # the tab bar names what is shown
        await pilot.press("ctrl+t")  # at once, no alt+→ needed first
        await wait_until(pilot, lambda: app.screen.has_class("show-cache") and switcher.active == CACHE_TAB)


async def test_event_log_is_on_screen_when_opened_with_four_users(tiny_llama):
    app = make_app(tiny_llama, users=("alice", "bob", "carol", "dave"))
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "Hello there")
        await pilot.press("f10")
        log, side = app.query_one("#events"), app.query_one("#side")
        await wait_until(pilot, lambda: log.region.height >= 3 and side.region.contains_region(log.region))
        assert log.region.height >= 3 and side.region.contains_region(log.region), (log.region, side.region, side.scroll_y, side.max_scroll_y, side.virtual_size, app.size)


async def test_loading_note_goes_when_the_queued_message_is_sent(tiny_llama, monkeypatch):
    import threading

    go = threading.Event()
    real_open = KvplayApp.open_backend

    def slow_open(self):  # the real engine, opened once the test has typed (a model still loading)
        go.wait(30)
        return real_open(self)

    monkeypatch.setattr(KvplayApp, "open_backend", slow_open)
    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.pane("alice")
        pane.input.value = "Hello there"
        pane.input.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("still loading" in t for t in pane.chat.texts("note")))
        go.set()
        await wait_until(pilot, lambda: app.engine is not None and not app.busy and pane.chat.texts("badge"))
        assert not any("still loading" in t for t in pane.chat.texts("note"))
        assert pane.chat.texts("user") and "Hello there" in pane.chat.texts("user")[-1]


async def test_added_user_gets_the_focus(tiny_llama):
    app = make_app(tiny_llama, users=("alice", "bob"))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        app.pane("alice").input.focus()
        await pilot.press("f8")
        await wait_until(pilot, lambda: app.screen.query("#field-name"))
        app.screen.query_one("#field-name").value = "dave"
        app.screen.query_one("#field-name").focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current_pane().user == "dave" and app.pane("dave").input.has_focus)
        assert app.current_pane().user == "dave" and app.pane("dave").input.has_focus


async def test_deterministic_confirmation_says_on_and_the_blocks_it_drops(tiny_llama):
    from kvplay.tui.screens import ConfirmScreen

    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        n = app.engine.stats()["blocks_cached"]
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert isinstance(app.screen, ConfirmScreen) and n > 0
        q = app.screen.question
        assert "deterministic on" in q and f"the {n} cached blocks" in q and "True" not in q
        await pilot.press("y")
        await wait_until(pilot, lambda: app.engine.config.deterministic)
        assert app.engine.stats()["blocks_cached"] == 0


async def test_footer_shows_f5_f8_f9(tiny_llama):
    from textual.widgets._footer import FooterKey

    app = make_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)

        def shown():  # the footer recomposes after a layout (KvFooter.set_keep): wait for it
            keys = {k.key: k.region.width for k in app.screen.query(FooterKey)}
            return all(keys.get(k) for k in ("f5", "f8", "f9")) and keys.get("ctrl+p")

        await wait_until(pilot, shown, timeout=10)


def test_a_missing_model_path_is_named_not_an_install_hint():
    from kvplay.tui.app import fix_for

    err = ("model not found: 'does/not/exist' is neither a local directory nor an org/name Hugging Face id "
           "(use --model default for the embedded model)")
    fix = fix_for(err, EngineConfig(model="does/not/exist"))
    assert fix.startswith("does/not/exist does not exist") and "pip install" not in fix


def test_app_with_a_corrupt_db_is_one_line_at_start(tmp_path, capsys):
    from kvplay.cli import main

    bad = tmp_path / "bad.db"
    bad.write_text("this is not sqlite")
    assert main(["app", "--db", str(bad), "--model", "tiny:llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a SQLite database" in err and len(err.splitlines()) == 1
    assert bad.read_text() == "this is not sqlite"


async def test_a_lab_from_the_palette_records_its_own_session_not_into_the_apps(tiny_llama, tmp_path):
    """The app's session keeps the app's turns and their events only; the lab's requests go to a
    session of its own (lab:NAME), and the dialog says so; progress shows while it runs."""
    import sqlite3

    from kvplay.tui.screens import ConfirmScreen, LabScreen

    db = str(tmp_path / "s.db")
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=128),
                    [UserSpec(u, max_tokens=8) for u in ("alice", "bob")], SYSTEM,
                    loaded=tiny_llama, record=True, db=db, timings=False)
    seen = []
    real_show = app.cache.show_lab_progress

    def spy(text):
        seen.append(text)
        real_show(text)

    app.cache.show_lab_progress = spy
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.engine is not None)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        app.action_run_lab("response-cache")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert isinstance(app.screen, ConfirmScreen) and "session of their own (lab:response-cache)" in app.screen.question
        await pilot.press("y")
        await wait_until(pilot, lambda: isinstance(app.screen, LabScreen), timeout=120)
        await pilot.press("escape")
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
    assert any(t and "lab response-cache: asking" in t and "/9" in t for t in seen), seen
    assert seen[-1] is None  # the progress line goes when the lab is done
    con = sqlite3.connect(db)
    sessions = dict(con.execute("select source, id from sessions").fetchall())
    assert set(sessions) == {"app", "lab:response-cache"}
    app_sid, lab_sid = sessions["app"], sessions["lab:response-cache"]
    turns = con.execute("select count(*) from turns where session_id = ?", [app_sid]).fetchone()[0]
    finished = len(recorded(db, app_sid, kinds=("RequestFinished",)))
    assert turns == finished == 2  # alice's and bob's, none of the lab's
    assert con.execute("select count(*) from turns where session_id = ?", [lab_sid]).fetchone()[0] > 0
