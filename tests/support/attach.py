"""Driving `kvplay attach` (tui/attach.py AttachApp) with the pilot: its command line, the app
with two panes on a backend, a turn typed into a pane, the status panel's text."""
from __future__ import annotations

from kvplay.cli import build_parser
from kvplay.sessions.script import UserSpec
from kvplay.tui.attach import AttachApp

from .tui import wait_until

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


def status(app) -> str:
    return str(app.query_one("#status").render())
