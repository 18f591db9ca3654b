"""`kvplay attach`: the playground on a real `kvplay serve` (tiny model, KV events on loopback),
driven with Textual's pilot: panes talk to the server's API, the map mirrors its KV events."""
from __future__ import annotations

import contextlib
import sqlite3

from support.attach import SYSTEM, attach_args, assert_reused_from_alice, make_app, say, status
from support.recorded import recorded
from support.tui import badges, wait_until

from kvplay.cli import main as cli_main
from kvplay.sessions.script import UserSpec
from kvplay.commands.attach import open_backend
from kvplay.tui.blockmap import BlockMap
from kvplay.tui.widgets import KvFooter
from kvplay.wire.publisher import KVEventsConfig


@contextlib.asynccontextmanager
async def attached_without_events(serve, tmp_path):
    """The attach app (panes only, no --events) on a fresh `kvplay serve`: (server, app, pilot)."""
    srv, _state = serve(num_blocks=64)
    app = make_app(open_backend(attach_args(srv.url)), tmp_path, record=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None)
        yield srv, app, pilot


async def test_attach_shows_bobs_reuse_of_alices_blocks(serve, tmp_path, free_port):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    srv, state = serve(kv_events=cfg, num_blocks=64)
    backend = open_backend(attach_args(srv.url + "/v1", "--events-bind", ev, "--replay", rep, "--pod", "kv"))
    app = make_app(backend, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None)
        assert app.engine is None and backend.num_blocks == 64  # the pool size from kvplay serve's /metrics
        a = await say(app, pilot, "alice", "Do you sell rye bread?")
        assert a.user == "alice" and a.cached_tokens == 0 and a.prompt_tokens > 0
        assert "cached 0" in badges(app, "alice")[-1]
        b = await say(app, pilot, "bob", "Do you sell croissants?")
        assert b.user == "bob" and b.cached_tokens >= 16
        # the map marks the blocks bob reused: alice's (mirrored from the server's KV events)
        bm = await assert_reused_from_alice(app, pilot, backend, b, 16)
        arr = backend.arrays()
        cached = arr.state == 1
        assert int(cached.sum()) == len(backend.fleet.pod("kv").blocks) == state.side.engine.stats()["blocks_cached"]
        assert {arr.users[c] for c in arr.creator[cached]} == {"alice", "bob"}
        await wait_until(pilot, lambda: "pod kv live" in status(app))
        app.add_user(UserSpec("carol", max_tokens=4))  # a pane added later talks to the server too
        await wait_until(pilot, lambda: app.pane("carol").is_mounted and app.pane("carol").input.is_mounted)
        c = await say(app, pilot, "carol", "Do you sell scones?")
        assert c.cached_from.get("alice", 0) >= 16 and "alice" in badges(app, "carol")[-1]
        assert "alice" in bm.looks and "+" in "".join(bm.render_line(y).text for y in range(bm.size.height))
        # controls the server owns say so; F4 resets the server's prefix cache
        await pilot.press("f2")
        await wait_until(pilot, lambda: any("Isolation is the server's setting" in str(n.message)
                                            for n in app._notifications))
        # the palette lists the controls the server's backend supports (Controls), no others
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert "cache: clear" in titles and "mode: toggle deterministic" not in titles
        assert not any(t.startswith(("isolation:", "eviction:", "lab:")) for t in titles)
        keep = app.query_one(KvFooter).keep  # ... and the footer offers F4, not F2/F3/F5
        assert "clear_cache" in keep and not keep & {"cycle_isolation", "cycle_eviction", "toggle_deterministic"}
        await pilot.press("f4")
        await wait_until(pilot, lambda: state.side.engine.stats()["blocks_cached"] == 0)
        await wait_until(pilot, lambda: int((backend.arrays().state == 1).sum()) == 0)
    con = sqlite3.connect(tmp_path / "s.db")
    assert con.execute("select user, cached_tokens, cached_from from turns order by rowid").fetchall() == [
        ("alice", 0, "{}"), ("bob", b.cached_tokens, '{"alice":%d}' % b.cached_tokens),
        ("carol", c.cached_tokens, '{"alice":%d}' % c.cached_from["alice"])]
    assert recorded(tmp_path / "s.db", kinds=("BlockStored",))


async def test_attach_without_events_shows_usage(serve, tmp_path):
    async with attached_without_events(serve, tmp_path) as (srv, app, pilot):
        await say(app, pilot, "alice", "Do you sell rye bread?")
        b = await say(app, pilot, "bob", "Do you sell croissants?")
        assert b.cached_tokens >= 16 and b.cached_from == {}  # from usage; whose: no events to tell
        assert f"cached {b.cached_tokens}" in badges(app, "bob")[-1]
        await wait_until(pilot, lambda: "no KV events" in status(app))


def test_attach_cli_bad_server_is_one_line(capsys, free_port):
    assert cli_main(["attach", f"http://127.0.0.1:{free_port()}"]) == 2
    assert capsys.readouterr().err.startswith("kvplay: error: cannot reach")
    assert cli_main(["attach", "localhost:8000"]) == 2
    assert "give the server's base URL" in capsys.readouterr().err
    assert cli_main(["attach", "http://127.0.0.1:8000", "--replay", "tcp://127.0.0.1:1"]) == 2
    assert "pair with --events" in capsys.readouterr().err


def map_text(bm) -> str:
    return "".join(bm.render_line(y).text for y in range(bm.size.height))


async def test_attach_two_pods_one_map_each(serve, tmp_path, free_port):
    import httpx

    from support.serve import chat

    eps = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(2)]
    servers = [serve(kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep,
                                               topic="kv-events"), num_blocks=32)[0] for ev, rep in eps]
    argv = [servers[0].url]
    for (ev, rep), name in zip(eps, ("a", "b")):
        argv += ["--events-bind", ev, "--replay", rep, "--pod", name]
    backend = open_backend(attach_args(*argv))
    app = make_app(backend, tmp_path, record=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None)
        await say(app, pilot, "alice", "Do you sell rye bread?")  # the panes talk to pod a
        with httpx.Client() as client:  # another client of pod b
            assert chat(client, servers[1].url, system=SYSTEM, user="zed", session_id="zed").status_code == 200
        assert backend.num_blocks == 64 and backend.pods["b"].offset == 32
        await wait_until(pilot, lambda: len(backend.pods["b"].key_slot) > 0)
        arr = backend.arrays()
        a_users = {arr.users[c] for c in arr.creator[:32][arr.state[:32] == 1]}
        b_users = {arr.users[c] for c in arr.creator[32:][arr.state[32:] == 1]}
        assert a_users == {"alice"} and b_users == {"zed"}
        await wait_until(pilot, lambda: "pod a live" in status(app) and "pod b live" in status(app))
        assert "map 0–31" in status(app) and "map 32–63" in status(app)
        # one map per pod, each titled by its pod, each showing only its own pod's blocks
        maps = list(app.query(BlockMap))
        assert [m.label for m in maps] == ["pod a", "pod b"] and [m.num_blocks for m in maps] == [32, 32]
        # alice's blocks (a) on pod a's map; zed, a client kvplay does not know, is "?" on pod b's
        await wait_until(pilot, lambda: "a" in map_text(maps[0]) and "?" in map_text(maps[1]))
        assert "?" not in map_text(maps[0]) and "a" not in map_text(maps[1])
        titles = [str(app.query_one(f"#{m.id}-title").render()) for m in maps]
        assert titles[0].startswith("pod a") and titles[1].startswith("pod b") and "32 blocks" in titles[1]
        # a click in pod b's map names pod b's block (zed's), not pod a's block with that number
        maps[1].focus()
        await wait_until(pilot, lambda: "zed" in str(app.query_one("#detail").render()))


async def test_attach_server_gone_is_one_line_in_the_pane(serve, tmp_path):
    async with attached_without_events(serve, tmp_path) as (srv, app, pilot):
        await say(app, pilot, "alice", "Do you sell rye bread?")
        srv.stop()
        r = await say(app, pilot, "bob", "Do you sell croissants?")
        assert r.user == "bob" and r.finish_reason == "error"
        err = badges(app, "bob")[-1]
        assert err.startswith("error: ConnectError") and "\n" not in err.strip()
        assert not app.pane("bob").busy  # the pane takes the next turn
