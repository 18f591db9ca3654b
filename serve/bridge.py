"""From the engine's thread-side RequestHandle to asyncio, without blocking the event loop.

A small daemon thread per request iterates the handle (a blocking queue read, no CPU while it
waits) and hands each TokenDelta, then the RequestResult, to the loop with
``call_soon_threadsafe``. The engine keeps its one thread; the event loop never waits on it.
"""
from __future__ import annotations

import asyncio
import threading


class HandleStream:
    def __init__(self, handle, loop: asyncio.AbstractEventLoop | None = None, on_result=None):
        self.handle = handle
        self.on_result = on_result  # called with the RequestResult on the bridge thread (recording)
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result = None
        self._cancelled = False
        threading.Thread(target=self._pump, name=f"kvplay-serve-{handle.request_id}", daemon=True).start()

    def _put(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed (server shut down): nobody listens any more
            return False

    def _pump(self) -> None:
        try:
            for delta in self.handle:
                if not self._put(delta):
                    self.handle.cancel()
                    return
            result = self.handle.result()
            self._put(result)
        except BaseException as exc:  # never lose the end of a stream
            self._put(exc)
            return
        if self.on_result is not None:
            self.on_result(result)

    async def next(self, timeout: float | None = None):
        """The next TokenDelta, or the RequestResult (last). Raises asyncio.TimeoutError."""
        item = await (self.queue.get() if timeout is None else asyncio.wait_for(self.queue.get(), timeout))
        if isinstance(item, BaseException):
            raise item
        if not hasattr(item, "token_id"):
            self.result = item
        return item

    def cancel(self) -> None:
        if self.result is None and not self._cancelled:
            self._cancelled = True
            self.handle.cancel()
