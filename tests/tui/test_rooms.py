"""The app's rooms are objects of their own: the chat room and the cache room run in any Textual
app, bound to a backend, and talk to each other only through what they were given."""
from __future__ import annotations

from textual.app import App
from support.tui import wait_until

from kvplay.engine.config import EngineConfig
from kvplay.sessions.script import UserSpec
from kvplay.tui.app import KvplayApp
from kvplay.tui.backend import LocalEngineBackend
from kvplay.tui.cache_room import CacheRoom
from kvplay.tui.chat_room import ChatRoom
from kvplay.tui.controls import ControlsRoom
from kvplay.tui.recording_room import RecordingRoom
from kvplay.tui.theme import assign_looks


def test_the_app_lays_out_its_rooms_and_is_none_of_them():
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=64), [UserSpec("alice")], record=False)
    rooms = (ChatRoom, CacheRoom, ControlsRoom, RecordingRoom)
    assert not any(issubclass(KvplayApp, r) for r in rooms)
    assert (isinstance(app.chat, ChatRoom) and isinstance(app.cache, CacheRoom)
            and isinstance(app.controls, ControlsRoom) and isinstance(app.recording, RecordingRoom))


async def test_the_chat_and_cache_rooms_work_in_a_plain_app(make_engine):
    """No KvplayApp: a pane's turn streams through the chat room, and the cache room, fed by the
    engine's events alone, shows the turn's bar, the pool's counters and the request's blocks."""
    eng = make_engine(num_blocks=64)
    users = [UserSpec("alice", max_tokens=4)]
    looks = assign_looks(["alice"])

    class Host(App):
        def __init__(self) -> None:
            super().__init__()
            self.recording = RecordingRoom(None)
            self.cache = CacheRoom("tiny:llama", looks, timings=False)
            self.controls = ControlsRoom(self, eng.config, self.recording, self.cache, record=False)
            self.chat = ChatRoom(users, looks, "Be brief.", self.cache, self.recording, self.controls, record=False,
                                 timings=False)

        def compose(self):
            yield self.chat
            yield self.cache

    host = Host()
    backend = LocalEngineBackend(eng)
    host.cache.listen(eng)
    try:
        async with host.run_test(size=(120, 40)) as pilot:
            for room in (host.controls, host.cache, host.chat):
                room.bind(backend)
            pane = host.chat.pane("alice")
            pane.input.focus()
            pane.input.value = "What is a KV cache?"
            await pilot.press("enter")
            await wait_until(pilot, lambda: host.cache.requests and not host.chat.busy)
            await wait_until(pilot, lambda: host.cache.settled and host.cache.stats is not None
                             and host.cache.stats["requests_finished"] == 1)
            stats = host.cache.requests[-1]
            assert stats.user == "alice" and stats.prompt_tokens > 0
            assert host.cache.stats["query_tokens"] == stats.prompt_tokens
            assert host.cache.last_blocks  # the finished request's blocks, from its events
            assert "cached" in pane.chat.texts("badge")[-1]
    finally:
        host.cache.unsubscribe()
        host.recording.close()
