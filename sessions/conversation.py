"""What a user's conversation is, when a scripted turn may start, and how a turn's stream is
consumed: the one piece the app's panes (tui/chat_room.py) and `sessions/player.py` share.

- `Conversation`: one user's turns and replies; a new turn's prompt is the system prompt, then
  those, then the new text.
- `Pacing`: a turn without `at` starts after the previous turn finished; a turn with `at`
  (seconds from the start, divided by `speed`) at that offset, so timed turns overlap. Either
  way a user's turn waits for that user's previous one.
- `consume`: iterate a submitted turn's deltas (each with `.text`), then take its result.
"""
from __future__ import annotations

from typing import Callable, Iterable


class Conversation:
    """One user's conversation: what was asked and answered, in order."""

    def __init__(self) -> None:
        self.history: list[dict] = []  # user / assistant messages, alternating

    def messages(self, system: str, text: str) -> list[dict]:
        """The prompt of a new turn `text`: the system prompt (when there is one), the
        conversation so far, the new user message."""
        head = [{"role": "system", "content": system}] if system else []
        return [*head, *self.history, {"role": "user", "content": text}]

    def add(self, text: str, reply: str) -> None:
        """A turn that was answered (a failed turn is not part of the conversation)."""
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


class Pacing:
    """When each of a script's turns (their users and `at`s, in order) may start."""

    def __init__(self, turns: Iterable[tuple[str, float | None]], speed: float = 1.0) -> None:
        self.speed = speed
        self.at: list[float | None] = []
        self.after: list[list[int]] = []  # per turn, the turns that must have finished first
        last_of_user: dict[str, int] = {}
        for i, (user, at) in enumerate(turns):
            wait = [i - 1] if at is None and i > 0 else []
            prev = last_of_user.get(user)
            if prev is not None and prev not in wait:
                wait.append(prev)
            self.at.append(at)
            self.after.append(wait)
            last_of_user[user] = i

    def __len__(self) -> int:
        return len(self.at)

    def due(self, i: int) -> float:
        """Seconds from the start of play before turn `i` may start (0: no wait; speed 0 plays
        timed turns all at once)."""
        at = self.at[i]
        return 0.0 if at is None or self.speed <= 0 else at / self.speed


def consume(turn, on_text: Callable[[str], None] | None = None, timeout: float | None = None):
    """The result of a submitted turn. With `on_text`, its deltas are read as they stream and
    `on_text(text so far)` is called after each."""
    if on_text is not None:
        text = ""
        for delta in turn:
            text += delta.text
            on_text(text)
    return turn.result(timeout)
