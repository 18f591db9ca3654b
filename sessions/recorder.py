"""Recorder: writes one session (its users, turns and engine events) into the sessions DB.

    rec = Recorder.open(db_path, config, model_name, source, system_prompt, script_path, replay_of)
    rec.attach(engine)        # the engine's (or a backend's) event batches are queued (the subscriber only enqueues)
    rec.add_user("alice", group=None, colour=None, seed=1, temperature=0.0)
    rec.record_turn(user, text, messages, sampling, result)   # one commit per finished turn
    rec.close()               # marks the session ended

Events are recorded one row per batch (sessions/event_log.py): an engine step's `EngineBatch`
(or an attached server's, wire/remote.py) becomes one `event_batches` row holding its events
msgpack-encoded and its envelope (step, time, the engine's forward count, pod, wire seq). The
engine thread only appends the batch to a bounded queue; a writer thread of the recorder's own encodes and writes
whatever is queued in one transaction each time it wakes (so a busy engine costs one commit per
wake, not one per batch). When the queue is full the batch is dropped and counted
(`dropped_events`, written to the session), never waited for: the engine is never blocked.

Usable from any thread: one sqlite connection (check_same_thread=False) guarded by a lock.
A turn and the batches queued before it are written in one transaction (`write_txn`: BEGIN
IMMEDIATE around `db.atomic()`), and the writer commits every FLUSH_S at the latest, so a
`kill -9` loses at most the turn in flight and the events of the last FLUSH_S (the connection
runs WAL with synchronous NORMAL: no fsync per commit; a power cut may lose the last commits).
"""
from __future__ import annotations

import collections
import importlib.metadata
import json
import sqlite3
import threading
import time

import msgspec

from kvplay.engine.config import EngineConfig
from kvplay.engine.events import EngineBatch
from kvplay.engine.request import RequestResult
from kvplay.engine.sampling_params import SamplingParams

from .event_log import batch_row, insert_batch_rows
from .ids import new_ulid
from .store import StoreError, open_db, resolve_path, write_txn

SOURCES = ("run", "app", "replay", "watch")
MAX_QUEUED_EVENTS = 262_144  # events waiting for the writer (beyond this a batch is dropped)
FLUSH_S = 0.2                # the writer commits what is queued at least this often


def versions() -> dict:
    out = {}
    for dist in ("kvplay", "torch", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder, reused:
# json.dumps with arguments builds a new one per call, a third of the cost of a small event


class Recorder:
    def __init__(self, db, session_id: str):
        self.db = db
        self.session_id = session_id
        self._lock = threading.Lock()
        # queued EngineBatches; appended on the engine thread, taken under _lock (deque appends
        # and pops are atomic)
        self._queue: collections.deque = collections.deque()
        self._queued = 0  # events in _queue
        self._qlock = threading.Lock()  # _queue and _queued; never held while writing
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._stop = False
        self.dropped_events = 0
        self.dropped_batches = 0
        self.write_error: str | None = None
        self._unsub = None
        self._engine = None
        self._seq = 0
        self._closed = False
        self.path = None

    @classmethod
    def open(cls, db_path: str | None, config: EngineConfig, model_name: str, source: str,
             system_prompt: str, script_path: str | None = None, replay_of: str | None = None,
             title: str | None = None) -> "Recorder":
        db = open_db(db_path)
        # WAL with synchronous NORMAL: a commit survives the process dying (kill -9), only the
        # last ones may be lost if the machine loses power; no fsync per commit of a busy writer
        db.execute("PRAGMA synchronous = NORMAL")
        sid = new_ulid()
        with write_txn(db):
            db["sessions"].insert({
                "id": sid, "created": time.time(), "ended": None, "source": source, "model": model_name,
                "engine_config": None if config is None else _dumps(config.to_dict()), "versions": _dumps(versions()),
                "system_prompt": system_prompt, "script_path": script_path, "replay_of": replay_of,
                "title": title,
            })
        rec = cls(db, sid)
        rec.path = str(resolve_path(db_path))
        return rec

    # --- engine events (subscribers run on the engine thread: only enqueue) --------------------
    def attach(self, engine) -> None:
        """Record the event batches of `engine` (an Engine, or a backend that offers the same
        `subscribe_batches`: wire/remote.py)."""
        if self._unsub is None:
            self._engine = engine
            self._unsub = engine.subscribe_batches(self.record_batch)
            self._start_writer()

    def record_batch(self, batch: EngineBatch) -> bool:
        """Queue one batch (engine/events.py `EngineBatch`: its events and envelope) for the
        writer thread (never blocks, any thread): False when the queue is full and the batch was
        dropped (counted in `dropped_events`). A batch without events writes nothing."""
        n = len(batch.events)
        if not n:
            return True
        with self._qlock:
            full = self._queued + n > MAX_QUEUED_EVENTS or self._closed
            if not full:
                self._queued += n
                self._queue.append(batch)
        if full:
            self._dropped(n, 1)
            return False
        if self._writer is None:
            self._start_writer()
        self._wake.set()
        return True

    def _dropped(self, events: int, batches: int) -> None:
        with self._qlock:
            self.dropped_events += events
            self.dropped_batches += batches

    def detach(self) -> None:
        if self._unsub is not None:
            self._unsub()
            self._unsub = None

    # --- the writer thread --------------------------------------------------------------------
    def _start_writer(self) -> None:
        with self._qlock:
            if self._writer is not None or self._closed:
                return
            self._writer = threading.Thread(target=self._write_loop, name="kvplay-recorder", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while not self._stop:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            rows: list = []
            try:
                with self._lock:
                    if self._closed:
                        return
                    rows = self._take_rows()
                    self._insert(rows)
            except Exception as exc:  # a locked or broken DB: the rows count as dropped (in the
                self.write_error = f"{type(exc).__name__}: {exc}"  # session's dropped_events)
                self._dropped(sum(r[2] for r in rows), len(rows))

    def _take_rows(self) -> list[tuple]:
        """The queued batches as `event_batches` rows (under _lock). A batch that cannot be
        encoded (an event holding something that is not plain data) is dropped and counted."""
        with self._qlock:
            taken = list(self._queue)
            self._queue.clear()
            self._queued = 0
        rows = []
        for batch in taken:
            try:
                rows.append(batch_row(self.session_id, batch))
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
                self._dropped(len(batch.events), 1)
        return rows

    def _prompt_ids(self, messages: list[dict], result: RequestResult) -> tuple[list[int] | None, int | None]:
        """The prompt the engine computed for this turn (encoded again the way submit does), so
        the simulator can replay it without the model. None when it cannot be recovered."""
        encode = getattr(self._engine, "encode", None)
        if encode is None or not messages:
            return None, None
        try:
            ids, system_tokens = encode(messages)
        except Exception:
            return None, None
        if len(ids) != result.stats.prompt_tokens:
            return None, None
        return list(ids), system_tokens

    # --- writes -------------------------------------------------------------------------------
    def add_user(self, name: str, group: str | None = None, colour: str | None = None, seed: int | None = None,
                 temperature: float | None = None, max_tokens: int | None = None,
                 top_p: float | None = None, top_k: int | None = None) -> None:
        with self._lock, write_txn(self.db):
            self.db["users"].upsert({
                "session_id": self.session_id, "name": name, "group": group, "colour": colour, "seed": seed,
                "temperature": temperature, "max_tokens": max_tokens, "top_p": top_p, "top_k": top_k,
            }, pk=("session_id", "name"))

    def record_turn(self, user: str, text: str, messages: list[dict], sampling: SamplingParams,
                    result: RequestResult, at: float | None = None, started: float | None = None,
                    prompt: tuple[list[int], int] | None = None) -> str:
        """Write one finished turn (and the events buffered so far) in one transaction. `prompt`:
        the (token ids, system tokens) the engine was given, when the caller has them (a server's
        completion turn has no messages to encode again)."""
        ended = time.time()
        st = result.stats
        if started is None:
            started = ended - (st.total_ms or 0.0) / 1000
        tid = new_ulid()
        sampled = sampling.to_dict()
        if sampled.get("seed") is None:  # the engine drew one: record it, so the turn replays
            sampled["seed"] = st.seed
        prompt_ids, system_tokens = prompt if prompt is not None else self._prompt_ids(messages, result)
        with self._lock:
            self._seq += 1
            row = {
                "id": tid, "session_id": self.session_id, "seq": self._seq, "user": user, "text": text,
                "reply": result.text, "messages": _dumps(messages), "sampling": _dumps(sampled),
                "seed": sampled["seed"], "at": at, "started": started, "ended": ended,
                "request_id": result.request_id, "ttft_ms": st.ttft_ms, "decode_tok_s": st.decode_tok_s,
                "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
                "computed_tokens": st.computed_tokens, "output_tokens": st.output_tokens,
                "cached_from": _dumps(st.cached_from), "preemptions": st.preemptions,
                "finish_reason": result.finish_reason, "error": result.error,
                "token_ids": _dumps(list(result.token_ids)),
                "prompt_ids": None if prompt_ids is None else _dumps(prompt_ids), "system_tokens": system_tokens,
            }
            rows = self._take_rows()
            try:
                with write_txn(self.db):
                    self.db["turns"].insert(row)
                    if rows:
                        insert_batch_rows(self.db, rows)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot record turn {self._seq} in {self.path}: {exc}") from None
        return tid

    def write_rows(self, rows: list[tuple], events: int = 0) -> None:
        """Write `event_batches` rows (`event_log.batch_row`, `events` events in all) now, in one
        transaction."""
        if rows:
            with self._lock:
                try:
                    self._insert(rows)
                except sqlite3.Error as exc:
                    raise StoreError(f"cannot record {events} events in {self.path}: {exc}") from None

    def flush(self) -> None:
        """Write every queued batch now."""
        with self._lock:
            if self._closed:
                return
            self._insert(self._take_rows())

    def _insert(self, rows: list[tuple]) -> None:
        """`event_batches` rows in one transaction (under _lock)."""
        if rows:
            with write_txn(self.db):
                insert_batch_rows(self.db, rows)

    def close(self) -> None:
        if self._closed:
            return
        stats = None
        if self._engine is not None:
            try:
                stats = self._engine.stats()
            except Exception:  # the engine may be gone; the session still ends cleanly
                stats = None
        self.detach()
        self._stop = True
        self._wake.set()
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(10)
        self.flush()
        with self._lock:
            with write_txn(self.db):
                update = {"ended": time.time()}
                if stats is not None:
                    update["stats"] = _dumps(stats)
                if self.dropped_events:
                    update["dropped_events"] = self.dropped_events
                self.db["sessions"].update(self.session_id, update)
            self.db.close()
            self._closed = True

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_run(rec: "Recorder | None", engine) -> None:
    """End a recorded run: close the recorder (if any), then shut the engine down — even when
    closing the recorder fails (a locked DB), so no engine thread is left behind."""
    try:
        if rec is not None:
            rec.close()
    finally:
        engine.shutdown()
