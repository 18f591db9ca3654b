"""The prefix tree everywhere: in the playground (ctrl+r), in the scrubber (t) from the same
session's recording, through `kvplay attach` on a real `kvplay serve` (its KV events), and
predicted vs delivered cached tokens per attached turn."""
from __future__ import annotations

import httpx
from rich.color import Color
from rich.style import Style
from textual.widgets import Static, Tree

from support.attach import attach_args
from support.recorded import as_batch
from support.serve import chat
from support.tui import badges, wait_until

from kvplay.engine.config import EngineConfig
from kvplay.engine.events import EngineBatch
from kvplay.sessions.script import TurnSpec, UserSpec
from kvplay.tui.app import KvplayApp
from kvplay.tui.attach import AttachApp
from kvplay.commands.attach import open_backend
from kvplay.tui.blockmap import BlockMap
from kvplay.tui.tree_view import MirrorTrees, TreeScreen
from kvplay.wire.mirror import Mirror
from kvplay.wire.publisher import KVEventsConfig
from kvplay.wire.tree import PrefixTree

SYSTEM = "You are the assistant of a small bakery. Answer every customer briefly and kindly. " * 3
USERS = [UserSpec("alice", max_tokens=4), UserSpec("bob", max_tokens=4), UserSpec("carol", max_tokens=4)]
TURNS = [TurnSpec("alice", "Do you sell rye bread?"), TurnSpec("bob", "Are croissants baked daily?"),
         TurnSpec("carol", "Is anything nut free?")]


def by_tokens(tree: PrefixTree) -> set:
    """A tree's shape independent of hash spelling: each node as (its prefix's tokens, its own
    tokens, creator, holders)."""
    out = set()
    for n in tree.nodes:
        prefix = tuple(t for p in tree.path(n)[:-1] for k in p.keys for t in tree.blocks[k].tokens)
        own = tuple(t for k in n.keys for t in tree.blocks[k].tokens)
        out.add((prefix, own, n.creator, tuple(sorted(n.holders))))
    return out


def screen_lines(screen: TreeScreen) -> list[str]:
    def walk(tn, out):
        for c in tn.children:
            out.append(str(c.label))
            if c.is_expanded:
                walk(c, out)
        return out
    return walk(screen.query_one(Tree).root, [])


async def test_tree_in_the_app_and_in_the_scrubber_of_its_recording(tiny_llama, tmp_path):
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), list(USERS), SYSTEM, turns=list(TURNS),
                    db=str(tmp_path / "s.db"), loaded=tiny_llama, timings=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.chat.autoplay_done.is_set() and app.settled, timeout=120)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)
        screen = app.screen
        live = screen.trees[None]
        root = live.roots[0]
        assert root.creator == "alice" and set(root.reusers) == {"bob", "carol"} and len(root.children) == 3
        lines = screen_lines(screen)
        assert lines[0].startswith("A ") and "→ B C" in lines[0] and "You are the" in lines[0]
        await pilot.press("right", "down", "down")  # open the shared prompt; its second branch
        node = app.screen.query_one(Tree).cursor_node.data[2]
        assert node is root.children[1] and node.creator in ("bob", "carol", "alice")
        bm = screen.query_one("#tree-map", BlockMap)
        ids = app.screen.source.block_ids(None, node.keys)
        assert ids and bm.hit == frozenset(ids)  # its blocks marked on the map
        assert all(app.backend.block(i).creator == node.creator for i in ids)
        # a block of carol's branch on the map finds carol's node
        carol = next(c for c in root.children if c.creator == "carol")
        assert screen.find_block(app.screen.source.block_ids(None, carol.keys)[-1])
        assert app.screen.query_one(Tree).cursor_node.data[2].keys == carol.keys
        await pilot.press("escape")
        assert not isinstance(app.screen, TreeScreen)
        app.recorder.flush()
        sid = app.recorder.session_id
        live_shape = by_tokens(live)
    # the same tree from the session's recording, in the scrubber at its end
    from kvplay.sessions.history import load_recording
    from kvplay.sessions.store import open_db
    from kvplay.tui.scrub import ScrubApp, ScrubScreen

    db = open_db(str(tmp_path / "s.db"), create=False)
    rec = load_recording(db, sid)
    db.close()
    scrub = ScrubApp(rec)
    async with scrub.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(scrub.screen, ScrubScreen) and scrub.screen.is_mounted)
        await pilot.press("t")
        await wait_until(pilot, lambda: isinstance(scrub.screen, TreeScreen) and scrub.screen.ready)
        assert by_tokens(scrub.screen.trees[None]) == live_shape
        await wait_until(pilot, lambda: "You are the" in screen_lines(scrub.screen)[0])  # the tokenizer, loaded aside
        await pilot.press("escape")
        await pilot.press("left_square_bracket", "left_square_bracket", "t")  # two turns back: one branch
        await wait_until(pilot, lambda: isinstance(scrub.screen, TreeScreen) and scrub.screen.ready)
        assert len(scrub.screen.trees[None].roots) == 1 and len(scrub.screen.trees[None].roots[0].children) == 0


def kv_server(serve, free_port):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    srv, state = serve(kv_events=cfg, num_blocks=64)
    return srv, state, ev, rep


async def test_attach_tree_and_predicted_equals_delivered(serve, tmp_path, free_port):
    srv, state, ev, rep = kv_server(serve, free_port)
    local = []
    state.side.engine.subscribe_batches(lambda b: local.extend(b.events))  # the server engine's own events: the reference tree
    backend = open_backend(attach_args(srv.url, "--events-bind", ev, "--replay", rep, "--pod", "kv"))
    app = AttachApp(backend, list(USERS), SYSTEM, turns=list(TURNS) + [TurnSpec("alice", "And rye rolls?")],
                    record=False, timings=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.chat.autoplay_done.is_set(), timeout=120)
        stats = list(app.cache.requests)
        assert len(stats) == 4 and all(s.predicted_tokens == s.cached_tokens for s in stats)
        assert stats[0].cached_tokens == 0 and all(s.cached_tokens >= 16 for s in stats[1:])
        assert all(badges(app, u)[-1].count("as predicted") == 1 for u in ("alice", "bob", "carol"))
        await wait_until(pilot, lambda: "4 of 4 turns' cached tokens as the mirror said" in
                         str(app.query_one("#stats").render()))
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)
        tree = app.screen.trees["kv"]
        mirror = Mirror()
        for e in list(local):
            mirror.apply(EngineBatch(events=[e]))
        assert by_tokens(tree) == by_tokens(PrefixTree(mirror.blocks))
        root = tree.roots[0]
        assert root.creator == "alice" and set(root.reusers) == {"bob", "carol"}
        # a node's blocks are the map's slots
        ids = app.screen.source.block_ids("kv", root.keys)
        assert len(ids) == len(root.keys) and app.screen.query_one("#tree-map", BlockMap).hit == frozenset(ids)
        # the text comes from the server's /detokenize (none on kvplay serve: ids until it answers)
        assert screen_lines(app.screen)[0].startswith("A ")


async def test_attach_flags_a_prediction_the_server_contradicts(serve, tmp_path, free_port):
    srv, state, ev, _rep = kv_server(serve, free_port)
    # a turn the mirror never hears of: sent before attaching, and no --replay to bring it back
    with httpx.Client() as c:
        assert chat(c, srv.url, system=SYSTEM, content="Do you sell rye bread?",
                    model=state.model_name).status_code == 200
    backend = open_backend(attach_args(srv.url, "--events-bind", ev, "--pod", "kv"))
    app = AttachApp(backend, [UserSpec("alice", max_tokens=4)], SYSTEM,
                    turns=[TurnSpec("alice", "Do you sell rye bread?")], record=False, timings=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.chat.autoplay_done.is_set(), timeout=120)
        s = app.cache.requests[-1]
        assert s.predicted_tokens == 0 and s.cached_tokens >= 16
        assert "predicted 0 ≠" in badges(app, "alice")[-1]
        await wait_until(pilot, lambda: "1 differ" in str(app.query_one("#stats").render()))
        assert backend.stats()["mispredicted_turns"] == 1


async def test_attach_predicts_with_the_servers_salt_under_user_isolation(serve, tmp_path, free_port):
    """kvplay serve --isolation user salts each key's blocks: another key's cached chain of the same
    prompt is no hit for ours. The first turn cannot know our salt (said, not a mismatch); then
    it is learned from our session's events (the server names the user it bound to our key) and
    every prediction is what the server delivers."""
    from support.serve import ALICE, BOB, keys

    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    srv, state = serve(keys=keys(tmp_path), kv_events=cfg, isolation="user", num_blocks=64)
    with httpx.Client() as c:  # another key's user caches the same prompts first, under its own salt
        for q in ("Do you sell rye bread?", "Is anything nut free?"):
            assert chat(c, srv.url, key=BOB, system=SYSTEM, content=q, model=state.model_name).status_code == 200
    backend = open_backend(attach_args(srv.url, "--api-key", ALICE, "--events-bind", ev, "--replay", rep,
                                       "--pod", "kv"))
    panes = [UserSpec(n, max_tokens=4) for n in ("ann", "ben", "cat")]  # all three send with alice's key
    turns = [TurnSpec("ann", "Do you sell rye bread?"), TurnSpec("ben", "Are croissants baked daily?"),
             TurnSpec("cat", "Is anything nut free?"), TurnSpec("ann", "And rye rolls?")]
    app = AttachApp(backend, panes, SYSTEM, turns=turns, record=False, timings=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.chat.autoplay_done.is_set(), timeout=120)
        first, *rest = list(app.cache.requests)
        assert first.cached_tokens == 0 and first.predicted_tokens is None and first.unpredictable
        assert "salted: no prediction" in badges(app, "ann")[0]
        assert len(rest) == 3 and all(s.predicted_tokens == s.cached_tokens for s in rest)
        assert all(s.cached_tokens >= 16 for s in rest)
        st = backend.stats()
        assert (st["predicted_turns"], st["mispredicted_turns"], st["unpredictable_turns"]) == (3, 0, 1)
        await wait_until(pilot, lambda: "1 salted turns not predicted" in str(app.query_one("#stats").render()))
        assert backend.salts_of("ben") == [("salt:user:alice",)]


def test_matcher_keys_blocks_by_their_extra_keys():
    from kvplay.wire.tree import PrefixMatcher, frozen_extra

    m = PrefixMatcher()
    m.add("b0", None, [1, 2], ("salt-b",))
    m.add("b1", "b0", [3, 4])
    assert m.predicted_hit([1, 2, 3, 4, 5]) is None  # only another salt's blocks match: cannot know
    assert m.predicted_hit([1, 2, 3, 4, 5], [("salt-a",)]) == 0
    assert m.predicted_hit([1, 2, 3, 4, 5], [("salt-b",)]) == 4
    m.add("a0", None, [1, 2], ("salt-a",))
    assert m.predicted_hit([1, 2, 3, 4, 5], [("salt-a",)]) == 2
    m.add("u0", None, [1, 2])
    assert m.predicted_hit([1, 2, 3, 4, 5]) == 2  # unsalted requests match unsalted blocks
    m.remove("a0")
    assert m.predicted_hit([1, 2, 3, 4, 5], [("salt-a",)]) == 2  # back to the unsalted block
    assert m.predicted_hit([9, 9]) == 0
    deep = [[[[[["x"]]]]]]
    assert frozen_extra(deep) == ("?",) or "?" in repr(frozen_extra(deep))
    assert frozen_extra(list(range(1000))) == "?" and frozen_extra({"a": [1, b"x"]}) == (("a", (1, b"x")),)
    hash(frozen_extra([{"k": [1, {"n": None}]}, 2.5]))


def test_tokenize_route(serve):
    srv, state = serve(num_blocks=32)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    with httpx.Client() as c:
        r = c.post(srv.url + "/tokenize", json={"model": state.model_name, "messages": msgs})
        assert r.status_code == 200 and r.json()["tokens"] == state.side.engine.encode(msgs)[0]
        assert r.json()["count"] == len(r.json()["tokens"])
        for body in ([1], {"messages": "x"}, {"model": "nope", "prompt": "a"}):
            r = c.post(srv.url + "/tokenize", json=body)
            assert r.status_code in (400, 404) and "error" in r.json()


async def test_many_branches_are_listed_eight_at_a_time_and_a_block_finds_its_node():
    from textual.app import App

    mirror = Mirror()
    mirror.apply(as_batch({"kind": "BlockStored", "block_hashes": ["s0", "s1"], "token_ids": [1, 2, 3, 4], "block_size": 2,
                "block_ids": [0, 1], "user": "alice", "ts": 1.0}))
    for i in range(20):
        mirror.apply(as_batch({"kind": "BlockStored", "block_hashes": [f"b{i}"], "parent_block_hash": "s1",
                    "token_ids": [10 + i, 0], "block_size": 2, "block_ids": [2 + i], "user": f"u{i % 3}", "ts": 2.0}))
    mirror.apply(as_batch({"kind": "BlockHit", "block_hashes": ["s0", "s1"], "block_ids": [0, 1], "user": "bob", "ts": 3.0}))
    from kvplay.tui.blockmap import ViewsSource
    from kvplay.wire.views import BlockView

    views = [BlockView(i, "cached", 0, None, "alice", None, (), 0, 0.0, 0.0, ()) for i in range(32)]
    source = MirrorTrees(mirror, lambda ids: "t" + "".join(map(chr, (65 + i % 26 for i in ids))), ViewsSource(views))
    looks = {}

    class Host(App):
        def on_mount(self):
            self.push_screen(TreeScreen(source, looks))

    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)
        screen = app.screen
        root = screen.trees[None].roots[0]
        assert len(root.children) == 20 and root.reusers == ("bob",) and root.hits == 2
        await pilot.press("right")
        lines = screen_lines(screen)
        assert len(lines) == 1 + 8 + 1 and lines[-1].startswith("+ 12 more branches (12 blocks)")
        await pilot.press(*["down"] * 9, "enter")  # the "+ 12 more" line opens the next eight
        lines = screen_lines(screen)
        assert len(lines) == 1 + 16 + 1 and lines[-1].startswith("+ 4 more branches")
        assert screen.find_block(21)  # the last branch's block: its node, beyond those listed
        assert screen.query_one(Tree).cursor_node.data[2].keys == ["b19"]
        assert not screen.find_block(30)  # a block holding no cached prefix: a notice


async def test_kvplay_tree_of_a_server(serve, capsys, free_port):
    import json

    from kvplay.cli import main as cli

    srv, state, ev, rep = kv_server(serve, free_port)
    with httpx.Client() as c:
        for q in ("Do you sell rye bread?", "Are croissants baked daily?"):
            assert chat(c, srv.url, system=SYSTEM, content=q, model=state.model_name, user="alice").status_code == 200
    # joined after the fact: the replay endpoint brings back what the server published before
    assert cli(["tree", srv.url, "--events-bind", ev, "--replay", rep, "--pod", "kv", "--duration", "1.5",
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pod = out["pods"]["kv"]
    assert pod["blocks"] == state.side.engine.stats()["blocks_cached"] > 0
    assert len(pod["roots"]) == 1 and len(pod["roots"][0]["children"]) == 2
    # no --events: the endpoints the server advertises (GET /kv_event_sources), as `watch URL` finds them
    assert cli(["tree", srv.url, "--duration", "1.5", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["pods"]
    assert [p["blocks"] for p in found.values()] == [pod["blocks"]]
    assert cli(["tree", srv.url, "--at", "3", "--events-bind", ev]) == 2


# --- animation: stores fade in, reuses pulse, evictions show struck then go -----------------------
def _ev(kind, hashes, user, ids=(), parent=None, ts=1.0):
    ev = {"kind": kind, "block_hashes": list(hashes), "block_ids": list(ids), "user": user, "ts": ts}
    if kind == "BlockStored":
        ev.update(token_ids=[7 + len(h) for h in hashes for _ in range(2)], block_size=2, parent_block_hash=parent)
    return as_batch(ev)


def _tree_host(source, looks, **kw):
    from textual.app import App

    class Host(App):
        def on_mount(self):
            self.push_screen(TreeScreen(source, looks, **kw))
    return Host()


async def _rebuilt(pilot, screen):
    """The screen's trees show the source's current version (a rebuild asked for if needed)."""
    def done():
        if screen._built_version != screen.source.version:
            screen.rebuild()
            return False
        return not screen._building
    await wait_until(pilot, done)
    await pilot.pause()


def _line(screen, key):
    tn = screen._tn.get(key)
    return None if tn is None else tn.label


async def test_a_store_fades_in_a_reuse_pulses_an_eviction_shows_struck_then_goes():
    from kvplay.wire.views import BlockView
    from kvplay.tui.blockmap import ViewsSource
    from kvplay.tui.theme import assign_looks

    feed = Mirror()
    feed.apply(_ev("BlockStored", ["s0", "s1"], "alice", [0, 1]))
    feed.apply(_ev("BlockStored", ["a0"], "alice", [2], parent="s1"))
    feed.apply(_ev("BlockStored", ["b0"], "bob", [3], parent="s1"))
    views = [BlockView(i, "cached", 0, None, "alice", None, (), 0, 0.0, 0.0, ()) for i in range(16)]
    looks = assign_looks(["alice", "bob", "carol"])
    app = _tree_host(MirrorTrees(feed, None, ViewsSource(views)), looks)
    t = [100.0]
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)
        screen = app.screen
        screen.clock = lambda: t[0]
        assert not screen.anims  # the first tree: nothing "happened"
        await pilot.press("right")  # open the shared prompt
        # carol stores a branch: it appears with "new" on her colour, and its block flashes on the map
        feed.apply(_ev("BlockStored", ["c0"], "carol", [4], parent="s1"))
        await _rebuilt(pilot, screen)
        key = ("n", None, "c0")
        first = _line(screen, key)
        assert first is not None and first.plain.startswith(" new ")
        assert first.spans[0].style.bgcolor.get_truecolor() == Color.parse(looks["carol"].colour).get_truecolor()
        assert screen.query_one("#tree-map", BlockMap).flash == frozenset({4})
        t[0] += 1.0  # two thirds of the way: faded, no longer flashing
        screen.animate()
        mid = _line(screen, key)
        assert mid.plain.startswith(" new ") and mid.spans[0].style.bgcolor != first.spans[0].style.bgcolor
        assert screen.query_one("#tree-map", BlockMap).flash == frozenset()
        t[0] += 1.0  # done: the plain line, nothing left to animate, the frames stop
        screen.animate()
        assert not _line(screen, key) and not screen.anims
        settled = [str(tn.label) for tn in screen.query_one(Tree).root.children[0].children]
        assert any("C 1 blk" in line and "new" not in line for line in settled)
        assert screen._frames._active.is_set() is False
        # bob reuses the shared prompt: it pulses with "reused by B"
        feed.apply(_ev("BlockHit", ["s0", "s1"], "bob", [0, 1]))
        await _rebuilt(pilot, screen)
        pulse = [str(tn.label) for tn in screen.query_one(Tree).root.children][0]
        assert pulse.startswith(" reused by B ")
        t[0] += 5
        screen.animate()
        assert not str(screen.query_one(Tree).root.children[0].label).startswith(" reused")
        # bob's branch is evicted: a struck ghost under the shared prompt, then gone
        feed.apply(as_batch({"kind": "BlockRemoved", "block_hashes": ["b0"], "block_ids": [3], "ts": 2.0}))
        await _rebuilt(pilot, screen)
        ghost = _line(screen, ("g", None, "b0"))
        assert ghost is not None and ghost.plain.startswith(" evicted ")
        assert any(s.style.strike for s in ghost.spans if isinstance(s.style, Style))
        assert len(screen.trees[None].roots[0].children) == 2  # the tree itself no longer has it
        t[0] += 5
        screen.animate()
        lines = [str(tn.label) for tn in screen.query_one(Tree).root.children[0].children]
        assert len(lines) == 2 and not any("evicted" in line for line in lines)


async def test_a_recording_at_a_fixed_point_marks_what_that_step_changed_and_does_not_animate():
    from kvplay.tui.theme import assign_looks

    feed = Mirror()
    feed.apply(_ev("BlockStored", ["s0", "s1"], "alice", [0, 1]))
    feed.apply(_ev("BlockStored", ["a0"], "alice", [2], parent="s1"))
    feed.apply(_ev("BlockStored", ["b0"], "bob", [3], parent="s1"))
    before = MirrorTrees(feed).snapshot()
    feed.apply(as_batch({"kind": "BlockRemoved", "block_hashes": ["b0"], "block_ids": [3], "ts": 2.0}))
    feed.apply(_ev("BlockStored", ["c0"], "carol", [4], parent="s1"))
    app = _tree_host(MirrorTrees(feed, before=before), assign_looks(["alice", "bob", "carol"]), at=5.0)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)
        screen = app.screen
        head = str(screen.query_one("#tree-head", Static).render())
        assert "this step: 1 new, 1 evicted" in head
        await pilot.press("right")  # open the shared prompt: alice's branch, carol's (new here), bob's ghost
        lines = [str(tn.label) for tn in screen.query_one(Tree).root.children]
        lines += [str(c.label) for tn in screen.query_one(Tree).root.children for c in tn.children]
        assert any(line.startswith(" new here ") for line in lines)
        assert any(line.startswith(" evicted here ") for line in lines)
        screen.clock = lambda: 1e9
        screen.animate()  # still: nothing moves or goes
        assert len(screen.anims) == 2


async def test_the_tree_is_in_the_footer_and_the_help_and_t_in_the_scrubbers_help(tiny_llama, tmp_path):
    from textual.widgets import Markdown
    from textual.widgets._footer import FooterKey

    from kvplay.tui.screens import HelpScreen

    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=32), list(USERS), SYSTEM, loaded=tiny_llama,
                    record=False, timings=False)
    for size in ((160, 48), (80, 24)):
        async with app.run_test(size=size) as pilot:
            await wait_until(pilot, lambda: app.engine is not None)
            await wait_until(pilot, lambda: any(k.key == "ctrl+r" and k.region.width
                                                for k in app.screen.query(FooterKey)), timeout=10)
            if size == (80, 24):
                break
            await pilot.press("f1")
            await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
            text = app.screen.query_one(Markdown).source
            assert "| ctrl+r |" in text and "The prefix tree (ctrl+r)" in text and "struck" in text
        app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=32), list(USERS), SYSTEM, loaded=tiny_llama,
                        record=False, timings=False)
    from kvplay.sessions.history import Recording
    from kvplay.tui.scrub import ScrubApp

    scrub = ScrubApp(Recording({"id": "s", "model": "tiny:llama"}, [], [], [], 32))
    async with scrub.run_test(size=(80, 24)) as pilot:  # the footer is laid out once mounted: wait for it
        await wait_until(pilot, lambda: any(k.key == "t" for k in scrub.screen.query(FooterKey)), timeout=10)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(scrub.screen, HelpScreen))
        assert "| t | the prefix tree at the cursor" in scrub.screen.query_one(Markdown).source
