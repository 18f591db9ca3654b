"""The pane's conversation widget: wraps, follows the newest line, and a streamed token never
costs a screen layout pass (one Static per message did: the whole screen reflowed per token)."""
from rich.text import Text
from textual.app import App
from textual.screen import Screen

from kvplay.tui.chatlog import ChatLog


class LogApp(App):
    def compose(self):
        yield ChatLog()


def lines(log: ChatLog) -> list[str]:
    return [log.render_line(y).text.rstrip() for y in range(log.size.height)]


async def test_wraps_follows_and_streams_without_layout(monkeypatch):
    app = LogApp()
    async with app.run_test(size=(30, 8)) as pilot:
        log = app.query_one(ChatLog)
        log.add("user", "alice › hello")
        reply = log.add("reply", "…")
        log.add("badge", "")
        await pilot.pause()
        layouts = []
        orig = Screen._refresh_layout
        monkeypatch.setattr(Screen, "_refresh_layout", lambda self, *a, **k: (layouts.append(1), orig(self, *a, **k))[1])
        text = ""
        for i in range(200):
            text += f"w{i} "
            log.set(reply, Text(text))
            if i % 20 == 0:
                await pilot.pause()
        await pilot.pause()
        # only when the scrollbar first appears (its own size follows in a second pass); none per token
        assert len(layouts) <= 2, len(layouts)
        shown = lines(log)
        assert shown[-1].endswith("w199"), shown  # the newest words are in view
        assert all(len(s) <= log.scrollable_content_region.width for s in shown)
        # scrolled up to read: new text does not pull the view down
        log.scroll_to(y=0, animate=False, immediate=True)
        await pilot.pause()
        log.set(reply, Text(text + "more words at the end"))
        await pilot.pause()
        assert log.scroll_y == 0 and lines(log)[0].startswith("alice")


async def test_entries_by_kind_and_removal():
    app = LogApp()
    async with app.run_test(size=(40, 10)) as pilot:
        log = app.query_one(ChatLog)
        log.add("hint", "type here")
        log.remove_kind("hint")
        a = log.add("reply", "first reply")
        b = log.add("badge", "prompt 3 · cached 0")
        log.add("note", "a note")
        await pilot.pause()
        assert log.texts() == ["first reply", "prompt 3 · cached 0", "a note"]
        log.remove(a, b)
        log.set(a, "ignored: gone")  # a removed entry is not drawn again
        await pilot.pause()
        assert log.texts() == ["a note"] and lines(log)[0] == "a note"
        assert log.virtual_size.height == 1


async def test_kinds_keep_their_theme_colours():
    """A badge or a note is drawn in its kind's colour ($text-muted, $warning), not the reply's."""
    app = LogApp()
    async with app.run_test(size=(40, 10)) as pilot:
        log = app.query_one(ChatLog)
        log.add("reply", "an answer")
        log.add("badge", "prompt 3 · cached 0")
        log.add("note", "a note")
        await pilot.pause()
        colour = [log.render_line(y)._segments[0].style.color for y in (0, 1, 3)]  # line 2: the note's gap
        assert colour[0] != colour[1] and colour[1] != colour[2] and colour[0] != colour[2]
        muted = log.get_component_rich_style("chatlog--badge").color
        assert colour[1] == muted
