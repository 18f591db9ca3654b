"""The engine's cache events as vLLM's KV events: one EventBatch per engine step.

Subscribes to the engine's batches (``Engine.subscribe_batches``, on the engine thread), turns
each into vLLM's wire form (wire/translate.py `to_wire`: consecutive stored blocks as one
``BlockStored`` with the creating user as ``session_id``, one ``BlockRemoved`` per evicted block,
``AllBlocksCleared`` for a reset) and hands it to the ZMQ publisher (wire/publisher.py). With
``kv_cache_report_mode = "full"`` (per request through ``vllm_xargs``, or the server's default),
the cached prefix a request reuses is re-announced as a ``BlockStored`` carrying the *reusing*
user's ``session_id``, so a consumer sees who reuses whose blocks.
"""
from __future__ import annotations

import os

from kvplay.engine.events import RequestFinished
from kvplay.wire.translate import to_wire

REPORT_MODES = ("incremental", "full")


def int_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default on: uint64 hashes on the wire)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


class EngineEventPublisher:
    def __init__(self, engine, publisher, report_full: bool = False, as_int: bool | None = None):
        self.publisher = publisher
        self.report_full_default = report_full
        self.as_int = int_hashes() if as_int is None else as_int
        self._modes: dict[str, bool] = {}  # request id -> report reuse ("full")
        self._unsub = engine.subscribe_batches(self._on_batch)

    def set_mode(self, request_id: str, mode: str | None) -> None:
        """Before submitting `request_id`: its kv_cache_report_mode (None: the server default)."""
        if mode is not None:
            self._modes[request_id] = mode == "full"

    def forget(self, request_id: str) -> None:
        """The request never reached the engine (submit refused it)."""
        self._modes.pop(request_id, None)

    def close(self) -> None:
        self._unsub()

    def _report_full(self, request_id: str) -> bool:
        return self._modes.get(request_id, self.report_full_default)

    # --- on the engine thread -----------------------------------------------------------------
    def _on_batch(self, batch) -> None:
        wire = to_wire(batch, self.as_int, self._report_full)
        for ev in batch.events:
            if type(ev) is RequestFinished:
                self._modes.pop(ev.request_id, None)
        if wire.events:
            self.publisher.publish(wire)
