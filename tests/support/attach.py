"""Driving `kvplay attach` (tui/attach.py AttachApp) with the pilot: its command line, the app
with two panes on a backend, a turn typed into a pane, the status panel's text."""
from __future__ import annotations

from kvplay.cli import build_parser
from kvplay.sessions.script import UserSpec
from kvplay.tui.attach import AttachApp
from kvplay.tui.blockmap import BlockMap

from .tui import badges, wait_until

SYSTEM = "You are the assistant of a small bakery. Answer every customer briefly and kindly. " * 3


def attach_args(*argv):
    return build_parser("attach").parse_args(["attach", *argv])


def make_app(backend, tmp_path, record=True):
    return AttachApp(backend, [UserSpec("alice", max_tokens=4), UserSpec("bob", max_tokens=4)], SYSTEM,
                     db=str(tmp_path / "s.db"), record=record, timings=False)


async def say(app, pilot, user, text):
    n = len(app.cache.requests)
    pane = app.pane(user)
    pane.input.focus()
    pane.input.value = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(app.cache.requests) > n and not app.busy)
    return app.cache.requests[-1]


async def assert_reused_from_alice(app, pilot, backend, turn, block_size: int):
    """bob's `turn` reused alice's blocks, and the turn's creators, its badge and the block map
    (mirrored from the server's KV events) say so alike; the map's hit blocks are returned."""
    assert turn.cached_from == {"alice": turn.cached_tokens}
    assert f"cached {turn.cached_tokens} (alice {turn.cached_tokens})" in badges(app, "bob")[-1]
    bm = app.query_one(BlockMap)
    await wait_until(pilot, lambda: len(bm.hit) == turn.cached_tokens // block_size)
    assert all(backend.block(i).creator == "alice" for i in bm.hit)
    return bm


def status(app) -> str:
    return str(app.query_one("#status").render())
