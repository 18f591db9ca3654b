"""From the engine's thread-side RequestHandle to asyncio, without blocking the event loop and
without a thread per request.

The handle forwards each TokenDelta, then the RequestResult, straight from the thread that has
them (the engine thread, or the engine-core link's reader) to the loop with
``call_soon_threadsafe`` (``forward_to``). The event loop never waits on the engine; the threads
a server uses do not grow with the number of requests or choices.
"""
from __future__ import annotations

import asyncio


class HandleStream:
    def __init__(self, handle, loop: asyncio.AbstractEventLoop | None = None):
        self.handle = handle
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result = None
        self._cancelled = False
        handle.forward_to(self._put)

    def _put(self, item) -> None:
        """On the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._arrived, item)
        except RuntimeError:  # the loop is closed (server shut down): nobody listens any more
            if hasattr(item, "token_id"):
                self.handle.cancel()

    def _arrived(self, item) -> None:
        """On the loop."""
        self.queue.put_nowait(item)

    async def next(self, timeout: float | None = None):
        """The next TokenDelta, or the RequestResult (last). Raises asyncio.TimeoutError."""
        item = await (self.queue.get() if timeout is None else asyncio.wait_for(self.queue.get(), timeout))
        if not hasattr(item, "token_id"):
            self.result = item
        return item

    def cancel(self) -> None:
        if self.result is None and not self._cancelled:
            self._cancelled = True
            self.handle.cancel()
