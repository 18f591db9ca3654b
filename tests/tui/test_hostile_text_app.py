"""Issue #42 in the Textual app, with the pilot: hostile users' names and prompts played through
the real engine (panes, tabs, legend, badges, event log, block detail, the prefix tree, the
scrubber of the recording, toasts, lab and error screens), and the attach app against a hostile
server (its model id, chat replies with invalid UTF-8 and a 64 KB line, /detokenize text) and a
hostile KV-event publisher (its session ids). After each step every cell on the screen is read
back from the compositor (what the terminal gets): no raw control, bidi or invisible character,
no hyperlink from the corpus, and the tags shown literally."""
from __future__ import annotations

import pytest

from support.attach import attach_args
from support.hostile import CORPUS, LONG, MARKUP, HostilePub, HostileServer, assert_inert
from support.recorded import scrubber
from support.tui import layout, steady, wait_until

from kvplay.engine.config import EngineConfig
from kvplay.sessions.script import TurnSpec, UserSpec
from kvplay.tui.app import KvplayApp
from kvplay.tui.attach import AttachApp
from kvplay.commands.attach import open_backend
from kvplay.tui.screens import ConfirmScreen, ErrorScreen, LabScreen
from kvplay.tui.scrub import ScrubScreen
from kvplay.tui.tree_view import TreeScreen

SYSTEM = "You are terse. " + CORPUS[3]
USERS = [UserSpec("alice", max_tokens=6), UserSpec("[/b] \x1b]0;t\x07", max_tokens=6, colour="[/b]"),
         UserSpec("[link=http://e.vl]x[/link]\u202e", max_tokens=6)]


def screen_text(app) -> str:
    """The screen as the terminal gets it: every segment's text (cursor and colour codes aside),
    after checking that none carries a link the corpus asked for."""
    out = []
    for strip in app.screen._compositor.render_strips():
        for seg in strip:
            if seg.control:
                continue
            link = seg.style.link if seg.style is not None else None
            assert not link or "e.vl" not in link, seg
            out.append(seg.text)
        out.append("\n")
    return "".join(out)


async def shows_inert(app, pilot) -> str:
    await steady(pilot, lambda: layout(app))  # laid out after the last step (a hostile feed keeps the map changing)
    text = screen_text(app)
    assert_inert(text, None)
    return text


async def log_and_block_inert(app, pilot, block: int) -> str:
    """The event log shown, then block `block`'s detail (its creator, its tokens as text): each
    inert. The log's screen."""
    app.action_toggle_events()
    text = await shows_inert(app, pilot)
    app.action_toggle_events()
    app.cache.select_block(block)
    await wait_until(pilot, lambda: f"block #{block}" in str(app.query_one("#detail").render()))
    await shows_inert(app, pilot)
    return text


async def open_tree(app, pilot, key: str = "ctrl+r") -> None:
    await pilot.press(key)
    await wait_until(pilot, lambda: isinstance(app.screen, TreeScreen) and app.screen.ready)


async def test_app_panes_tree_detail_and_events_are_inert(tiny_llama, tmp_path):
    turns = [TurnSpec(USERS[i % 3].name, text) for i, text in enumerate(CORPUS)]
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=256), USERS, SYSTEM, turns=turns,
                    db=str(tmp_path / "s.db"), loaded=tiny_llama, timings=False)
    async with app.run_test(size=(200, 60)) as pilot:
        await wait_until(pilot, lambda: app.chat.autoplay_done.is_set(), timeout=180)
        await wait_until(pilot, lambda: app.settled)
        text = await shows_inert(app, pilot)
        assert "[/b]" in text and "␛]52;c" in text  # panes: names and prompts shown literally
        # a 64 KB message and reply in a pane (bounded, never wedging the view)
        pane = app.pane("alice")
        pane.add_user_message(LONG)
        await shows_inert(app, pilot)
        await log_and_block_inert(app, pilot, 0)  # the users' names in the log; a block's text
        # the prefix tree and a node's detail
        await open_tree(app, pilot)
        await pilot.press("right", "down")
        text = await shows_inert(app, pilot)
        assert "cached blocks in" in text
        await pilot.press("escape")
        # toasts, a question about a hostile user, the error and lab screens
        app.notify(CORPUS[1] + CORPUS[3], title=CORPUS[0])
        app.push_screen(ConfirmScreen(f"Remove {USERS[1].name}'s pane?"))
        text = await shows_inert(app, pilot)
        assert MARKUP[1] in text
        app.pop_screen()
        from kvplay.labs.common import LabResult, Table, renderables

        result = LabResult("leak", verdict="\n".join(CORPUS), tables=[Table("t", ["who", "said"], [[u.name, CORPUS[i]]
                                                                                                 for i, u in enumerate(USERS)])])
        app.push_screen(LabScreen("lab: leak", renderables(result)))
        await shows_inert(app, pilot)
        app.pop_screen()
        app.push_screen(ErrorScreen(CORPUS[0] + CORPUS[5], CORPUS[1]))
        await shows_inert(app, pilot)
        app.pop_screen()
        app.recorder.flush()
        sid = app.recorder.session_id
    # the scrubber of that recording: the users' panes, the event line, the tree
    scrub = scrubber(str(tmp_path / "s.db"), sid)
    async with scrub.run_test(size=(200, 60)) as pilot:
        await wait_until(pilot, lambda: isinstance(scrub.screen, ScrubScreen) and scrub.screen.is_mounted)
        await shows_inert(scrub, pilot)
        await pilot.press("end")
        text = await shows_inert(scrub, pilot)
        assert "[/b]" in text
        await open_tree(scrub, pilot, "t")
        await shows_inert(scrub, pilot)


@pytest.fixture
def hostile():
    pub = HostilePub()
    srv = HostileServer()
    yield srv, pub
    srv.close()
    pub.close()


async def test_attach_against_a_hostile_server_is_inert(hostile, tmp_path):
    srv, pub = hostile
    backend = open_backend(attach_args(srv.url, "--events", pub.endpoint))
    app = AttachApp(backend, [UserSpec("alice", max_tokens=4), UserSpec("bob", max_tokens=4)], "hi",
                    db=str(tmp_path / "a.db"), timings=False)
    async with app.run_test(size=(200, 60)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None)
        await wait_until(pilot, lambda: app.backend.stats()["blocks_cached"] > 12)
        text = await shows_inert(app, pilot)
        assert "[/b]" in text  # the model id, shown literally in the status panel
        # a turn: the reply streams the corpus, invalid UTF-8, a lone surrogate and a 64 KB line
        pane = app.pane("alice")
        pane.input.focus()
        pane.input.value = "hello [/b]"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.cache.requests) == 1 and not app.busy, timeout=60)
        reply = "".join(pane.chat.texts("reply"))
        assert "␛]52;c" in reply and "\ufffd" in reply and "characters)" in reply  # bounded
        text = await shows_inert(app, pilot)
        assert MARKUP[1] in text
        # the log names the server's session ids; a block's creator is one, its text /detokenize's
        assert "␛" in await log_and_block_inert(app, pilot, 1)
        # the tree: labels from /detokenize (fetched aside), creators the session ids
        await open_tree(app, pilot)
        await wait_until(pilot, lambda: "␛" in screen_text(app), timeout=30)  # the text arrived
        await pilot.press("down", "down")
        await shows_inert(app, pilot)
