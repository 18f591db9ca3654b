"""The engine's cache events as vLLM's KV events: one EventBatch per engine step.

Listens on the engine thread (``Engine.subscribe`` + ``Engine.on_step_end``), turns kvplay's
events into vLLM's wire events (wire/codec.py) and hands one batch per step to the ZMQ
publisher (wire/publisher.py):

- ``BlockStored``: consecutive blocks a request stored in the same step go out as one event
  (as vLLM does), ``session_id`` = the user who created them (the identity the server bound).
- ``BlockRemoved``: one event per evicted block. Blocks dropped by a reset are not listed:
  ``AllBlocksCleared`` says it (vLLM sends only that).
- With ``kv_cache_report_mode = "full"`` (per request through ``vllm_xargs``, or the server's
  default), the cached prefix a request reuses is re-announced as a ``BlockStored`` carrying the
  *reusing* user's ``session_id``, so a consumer sees who reuses whose blocks.
"""
from __future__ import annotations

import os
import time

from kvplay.engine.cbor_hash import vllm_extra_keys
from kvplay.wire.codec import BlockRemoved, BlockStored, EventBatch, MEDIUM_GPU, from_engine_event, hex_to_wire_hash

SPEC_KIND = "full_attention"  # what vLLM 0.32 sends for a plain decoder's one KV-cache group

REPORT_MODES = ("incremental", "full")


def int_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default on: uint64 hashes on the wire)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


class EngineEventPublisher:
    def __init__(self, engine, publisher, report_full: bool = False, as_int: bool | None = None):
        self.engine = engine
        self.publisher = publisher
        self.report_full_default = report_full
        self.as_int = int_hashes() if as_int is None else as_int
        self._pending: list = []
        self._open = None  # the BlockStored that consecutive stores of one chain extend
        self._modes: dict[str, bool] = {}  # request id -> report reuse ("full")
        self._unsubs = [engine.subscribe(self._on_event), engine.on_step_end(self._flush)]

    def set_mode(self, request_id: str, mode: str | None) -> None:
        """Before submitting `request_id`: its kv_cache_report_mode (None: the server default)."""
        if mode is not None:
            self._modes[request_id] = mode == "full"

    def forget(self, request_id: str) -> None:
        """The request never reached the engine (submit refused it)."""
        self._modes.pop(request_id, None)

    def close(self) -> None:
        for unsub in self._unsubs:
            unsub()
        self._flush()

    # --- on the engine thread -----------------------------------------------------------------
    def _add_stored(self, ev: BlockStored) -> None:
        last = self._pending[-1] if self._pending else None
        if (last is not None and last is self._open and last.session_id == ev.session_id
                and last.block_size == ev.block_size and ev.parent_block_hash == last.block_hashes[-1]):
            last.block_hashes.extend(ev.block_hashes)
            last.token_ids.extend(ev.token_ids)
            last.extra_keys.extend(ev.extra_keys)
        else:
            self._pending.append(ev)
            self._open = ev  # later blocks of the same chain join it (a re-announcement never does)

    def _on_event(self, ev) -> None:
        kind = type(ev).__name__
        if kind == "BlockStored":
            wire = from_engine_event(ev, session_id=ev.user or None, as_int=self.as_int)
            self._vllm_fields(wire, ev.block_ids)
            self._add_stored(wire)
        elif kind == "BlockRemoved":
            if ev.reason == "evicted":
                for h in ev.block_hashes:
                    self._pending.append(BlockRemoved([hex_to_wire_hash(h, self.as_int)], MEDIUM_GPU, 0))
        elif kind == "AllBlocksCleared":
            self._pending.append(from_engine_event(ev))
        elif kind == "BlockHit":
            if self._modes.get(ev.request_id, self.report_full_default):
                self._reannounce(ev)
        elif kind == "RequestFinished":
            self._modes.pop(ev.request_id, None)

    def _vllm_fields(self, wire: BlockStored, block_ids) -> None:
        """What vLLM adds to every BlockStored: one extra-keys entry per block (None, or the
        block's cache salt untagged), KV-cache group 0, its spec kind."""
        blocks = self.engine.pool.blocks
        extra = []
        for bid in block_ids:
            keys = vllm_extra_keys(blocks[bid].extra)
            extra.append(None if keys is None else tuple(v for _, v in keys))
        wire.extra_keys = extra
        wire.group_idx = 0
        wire.kv_cache_spec_kind = SPEC_KIND

    def _reannounce(self, ev) -> None:
        """The reused prefix as one BlockStored with the reusing user's session_id."""
        blocks = self.engine.pool.blocks
        hashes = [hex_to_wire_hash(h, self.as_int) for h in ev.block_hashes]
        tokens: list[int] = []
        for bid in ev.block_ids:
            tokens.extend(blocks[bid].token_ids)
        wire = BlockStored(hashes, None, tokens, self.engine.pool.block_size, None, MEDIUM_GPU, None,
                           session_id=ev.user or None)
        self._vllm_fields(wire, ev.block_ids)
        self._pending.append(wire)

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.publisher.publish(EventBatch(time.time(), batch))
