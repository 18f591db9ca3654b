"""Messages posted from threads (engine listener, loader and reply workers) to the app.

Threads never touch widgets: they only `post_message` one of these (thread-safe)."""
from __future__ import annotations

from textual.message import Message


class EngineLoading(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class EngineReady(Message):
    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine


class EngineFailed(Message):
    def __init__(self, error: str, fix: str) -> None:
        super().__init__()
        self.error = error
        self.fix = fix


class ReplyDelta(Message):
    def __init__(self, turn_id: int, user: str, text: str) -> None:
        super().__init__()
        self.turn_id = turn_id
        self.user = user
        self.text = text

    def can_replace(self, message: Message) -> bool:
        # A newer accumulated text for the same turn makes the queued one redundant.
        return isinstance(message, ReplyDelta) and message.turn_id == self.turn_id


class ReplyDone(Message):
    def __init__(self, turn_id: int, user: str, result) -> None:
        super().__init__()
        self.turn_id = turn_id
        self.user = user
        self.result = result


class ReplyFailed(Message):
    def __init__(self, turn_id: int, user: str, error: str) -> None:
        super().__init__()
        self.turn_id = turn_id
        self.user = user
        self.error = error
