"""One chat pane per user: a scrolling conversation, streaming replies with a badge line under
each, and its own input. The pane only displays; the app submits to the engine. What it shows
(the user's name, messages, replies, errors) is inert (kvplay/inert.py), as Text: never markup."""
from __future__ import annotations

import re

from rich.text import Text
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input

from kvplay.inert import BODY_LIMIT, inert
from kvplay.sessions.conversation import Conversation

from .chatlog import ChatLog, Entry
from .format import badge
from .theme import UserLook


def safe_id(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def user_label(glyph: str, name: str) -> Text:
    """`A alice`: a user's glyph and name (a tab, a pane's title), the name inert."""
    return Text(f"{glyph} {inert(name, limit=64)}")


def body(text: str) -> str:
    """A message or a reply as a pane shows it: its lines kept, inert, at most BODY_LIMIT characters."""
    return inert(text, lines=True, limit=BODY_LIMIT)


class ChatPane(Vertical):
    """The conversation of one user."""

    class Submitted(Message):
        def __init__(self, pane: "ChatPane", text: str) -> None:
            super().__init__()
            self.pane = pane
            self.text = text

    def __init__(self, spec, look: UserLook, hint: str = "") -> None:
        super().__init__(id=f"pane-{safe_id(spec.name)}", classes="pane")
        self.spec = spec
        self.look = look
        self.hint = hint
        self.conversation = Conversation()  # this user's turns and replies (sessions/conversation.py)
        self.busy = False
        self.ready = False
        self._replies: dict[int, tuple[Entry, Entry]] = {}  # turn → its reply and badge entries

    @property
    def user(self) -> str:
        return self.spec.name

    @property
    def history(self) -> list[dict]:
        return self.conversation.history

    def compose(self):
        self._chat = ChatLog(classes="log")
        self._input = Input(placeholder="type now; sent once loaded", id=f"input-{safe_id(self.user)}")
        yield self._chat
        yield self._input

    def on_mount(self) -> None:
        self.styles.border = ("round", self.look.colour)
        self.styles.border_title_color = self.look.colour
        self.border_title = Text.assemble((f" {self.look.glyph} ", "reverse"), f" {inert(self.user, limit=64)}")
        self.refresh_subtitle()
        if self.hint:
            self.chat.add("hint", self.hint)

    @property
    def input(self) -> Input:
        return self._input

    @property
    def chat(self) -> ChatLog:
        return self._chat

    def refresh_subtitle(self) -> None:
        s = self.spec
        bits = [f"seed {s.seed}", f"T {s.temperature:g}"]
        if s.group:
            bits.append(f"group {inert(s.group, limit=64)}")
        if self.busy:
            bits.insert(0, "generating…")
        self.border_subtitle = Text(" · ".join(bits))

    def set_ready(self, ready: bool, placeholder: str | None = None) -> None:
        self.ready = ready
        self.input.placeholder = inert(placeholder or (f"type as {self.user}, Enter sends" if ready else "loading…"),
                                       limit=256)

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.refresh_subtitle()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value
        if not text.strip():
            self.notice("Type a message first (an empty message is ignored).")
            return
        if self.busy:
            self.notice(f"{self.user} is still waiting for a reply; send when it finishes.")
            return
        event.input.value = ""
        self.post_message(self.Submitted(self, text))

    # --- content (entries of one ChatLog: a streamed token repaints this pane only) ------------
    def notice(self, text: str, error: bool = False):
        """A one-line note in this pane only (empty input, errors); its entry, to remove later."""
        self.chat.remove_kind("hint")
        return self.chat.add("error" if error else "note", Text(inert(text, limit=1024)))

    def add_user_message(self, text: str) -> None:
        self.chat.remove_kind("hint")
        t = Text()
        t.append(f"{self.look.glyph} {inert(self.user, limit=64)} › ", style=self.look.style)
        t.append(body(text))
        self.chat.add("user", t)

    def start_reply(self, turn_id: int) -> None:
        chat = self.chat
        self._replies[turn_id] = (chat.add("reply", "…"), chat.add("badge", ""))

    def update_reply(self, turn_id: int, text: str) -> None:
        if turn_id in self._replies and self.is_attached:
            self.chat.set(self._replies[turn_id][0], Text(body(text) or "…"))

    def finish_reply(self, turn_id: int, result, looks: dict, timings: bool = True) -> None:
        if turn_id not in self._replies or not self.is_attached:
            return
        reply, meta = self._replies.pop(turn_id)
        more = {"length": " …", "pool_exhausted": " … (stopped: the pool is full)"}.get(result.finish_reason, "")
        chat = self.chat
        chat.set(reply, Text(body(result.text or "(no text)") + more))
        if result.error:
            chat.set(meta, Text(f"error: {inert(result.error, limit=1024)}", style="bold red"))
        else:
            chat.set(meta, badge(result.stats, looks, timings))

    def fail_reply(self, turn_id: int, error: str) -> None:
        if not self.is_attached:
            return
        if turn_id in self._replies:
            reply, meta = self._replies.pop(turn_id)
            self.chat.remove(reply, meta)
        self.notice(f"✗ {error}", error=True)
