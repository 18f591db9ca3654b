"""Driving the playground (tui/app.py KvplayApp) with Textual's pilot: a waiting helper that
fails with what it waited for, the app on a tiny model, a turn typed into a pane, its badges."""
from __future__ import annotations

import asyncio

from kvplay.engine.config import EngineConfig
from kvplay.sessions.script import UserSpec
from kvplay.tui.app import KvplayApp

from .wait import describe

SYSTEM = "You are a helpful assistant. Answer briefly and plainly."


async def wait_until(pilot, cond, timeout: float = 60.0, what: str | None = None):
    """Let the app run (50 ms at a time) until `cond()` is true; AssertionError naming the
    condition when `timeout` seconds pass first."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not (value := cond()):
        assert loop.time() < end, f"timed out after {timeout:g} s waiting for {what or describe(cond)}"
        await pilot.pause(0.05)
    return value


async def steady(pilot, read, timeout: float = 30.0, what: str = "the screen"):
    """`read()` once two looks in a row agree, each taken after the app has processed what was
    pending and redrawn (`pilot.pause()`), 50 ms apart: what a view shows once it has stopped
    changing (a layout after a resize, a screen just pushed, text still arriving)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    await pilot.pause()
    last = read()
    while True:
        await pilot.pause(0.05)
        await pilot.pause()
        now = read()
        if now == last:
            return now
        assert loop.time() < end, f"{what} still changing after {timeout:g} s"
        last = now


def layout(app) -> list:
    """Where each widget of the screen is and whether it shows: to wait for a layout to settle
    (`steady(pilot, lambda: layout(app))`) while the widgets' content may keep changing."""
    return [(id(w), tuple(w.region), w.display) for w in app.screen.walk_children(with_self=True)]


def make_app(loaded, users=("alice", "bob", "carol"), **cfg):
    cfg.setdefault("model", "tiny:llama")
    cfg.setdefault("num_blocks", 64)
    return KvplayApp(EngineConfig(**cfg), [UserSpec(u, max_tokens=8) for u in users], SYSTEM,
                     loaded=loaded, record=False, timings=False)


async def say(app, pilot, user, text):
    pane = app.pane(user)
    pane.input.focus()
    pane.input.value = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.busy)
    await wait_until(pilot, lambda: app.settled)
    await pilot.pause()  # what the turn's end posted (badge, counters, map) is handled


def badges(app, user):
    return app.pane(user).chat.texts("badge")
