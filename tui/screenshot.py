"""Screenshots of the app, headless: Textual's test harness runs an app (the playground playing
a script, an attached one, the scrubber) and saves the screen as an SVG (`kvplay screenshot`,
`kvplay attach --screenshot`, `kvplay scrub --screenshot`).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from kvplay.options import KvplayError

from .screens import ErrorScreen


async def take_screenshot(app, out: Path, size: tuple[int, int], timeout: float = 600.0,
                          show_events: bool = False, select_block: int | None = None,
                          loaded_callback=None, tree: bool = False) -> Path:
    """Run `app` headless until its script has played, then save `out` (an SVG)."""
    async with app.run_test(size=size) as pilot:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not app.chat.autoplay_done.is_set():
            if isinstance(app.screen, ErrorScreen):
                raise KvplayError(f"{app.screen.error} — {app.screen.fix.splitlines()[0]}")
            if loop.time() > deadline:
                raise KvplayError(f"the script did not finish within {timeout:.0f} s")
            await pilot.pause(0.1)
        if show_events:
            app.action_toggle_events()
        app.set_focus(None)  # no focused input: no text cursor in the picture
        if select_block is not None:
            app.cache.select_block(select_block)
        if tree:
            app.action_prefix_tree()
            while not getattr(app.screen, "ready", False):
                if loop.time() > deadline:
                    raise KvplayError(f"the prefix tree was not built within {timeout:.0f} s")
                await pilot.pause(0.1)
            await pilot.press("right", "down", "down")
        await pilot.pause(0.3)
        await pilot.wait_for_scheduled_animations()
        app.save_screenshot(filename=out.name, path=str(out.parent))
    return out


async def save_svg(app, out: Path, size: tuple[int, int]) -> Path:
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.3)
        app.set_focus(None)
        await pilot.pause(0.1)
        app.save_screenshot(filename=out.name, path=str(out.parent))
    return out
