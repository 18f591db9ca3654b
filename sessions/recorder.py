"""Recorder: writes one session (its users, turns and engine events) into the sessions DB.

    rec = Recorder.open(db_path, config, model_name, source, system_prompt, script_path, replay_of)
    rec.attach(engine)        # engine events are buffered (the listener only enqueues)
    rec.add_user("alice", group=None, colour=None, seed=1, temperature=0.0)
    rec.record_turn(user, text, messages, sampling, result)   # one commit per finished turn
    rec.close()               # marks the session ended

Usable from any thread: one sqlite connection (check_same_thread=False) guarded by a lock.
A turn and the events buffered before it are written in one transaction (`write_txn`: BEGIN
IMMEDIATE around `db.atomic()`), so a `kill -9` loses at most the turn in flight.
"""
from __future__ import annotations

import collections
import importlib.metadata
import json
import sqlite3
import threading
import time

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: recording a watched server must not import torch
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.request import RequestResult
    from kvplay.engine.sampling import SamplingParams

from .ids import new_ulid
from .store import StoreError, open_db, resolve_path, write_txn

SOURCES = ("run", "app", "replay", "watch")


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


def event_row(session_id: str, ev) -> dict:
    # Event.to_dict's dataclasses.asdict deep-copies every list; a shallow copy serialises the
    # same and was most of the cost of recording a busy watched server.
    d = dict(vars(ev), kind=ev.kind)
    ids = d.get("block_ids")
    if ids is None and d.get("block_id") is not None:
        ids = [d["block_id"]]
    hashes = d.get("block_hashes")
    if hashes is None and d.get("block_hash"):
        hashes = [d["block_hash"]]
    user = d.get("user") or (",".join(d["creators"]) if d.get("creators") else None)
    return {"session_id": session_id, "seq": d.get("seq"), "ts": d.get("ts"), "kind": d["kind"],
            "block_ids": None if ids is None else _dumps(ids),
            "block_hashes": None if hashes is None else _dumps(hashes),
            "user": user, "request_id": d.get("request_id") or None, "payload": _dumps(d)}


class Recorder:
    def __init__(self, db, session_id: str):
        self.db = db
        self.session_id = session_id
        self._lock = threading.Lock()
        self._events: collections.deque = collections.deque()
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

    # --- engine events (listener runs on the engine thread: only enqueue) ----------------------
    def attach(self, engine) -> None:
        if self._unsub is None:
            self._engine = engine
            self._unsub = engine.subscribe(self._on_event)

    def _on_event(self, ev) -> None:
        # On the engine thread, between or inside steps: the forward count read here is the
        # step clock at this event (the simulator enters each request at its recorded clock).
        runner = getattr(self._engine, "runner", None)
        self._events.append((ev, getattr(runner, "forwards", None)))

    def detach(self) -> None:
        if self._unsub is not None:
            self._unsub()
            self._unsub = None

    def _drain(self) -> list[dict]:
        rows = []
        while True:
            try:
                ev, forwards = self._events.popleft()
            except IndexError:
                return rows
            row = event_row(self.session_id, ev)
            row["forwards"] = forwards
            rows.append(row)

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
            events = self._drain()
            try:
                with write_txn(self.db):
                    self.db["turns"].insert(row)
                    if events:
                        self.db["cache_events"].insert_all(events)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot record turn {self._seq} in {self.path}: {exc}") from None
        return tid

    def record_events(self, events, columns: list[dict] | None = None) -> None:
        """Write events that did not come from an attached engine (a watched server's KV events,
        as engine events), in one transaction; `columns[i]` adds to event i's row (pod, wire_seq)."""
        rows = [event_row(self.session_id, ev) for ev in events]
        for row, extra in zip(rows, columns or ()):
            row.update(extra)
        if rows:
            cols = list(rows[0])
            same = all(len(r) == len(cols) for r in rows)  # event_row's keys + the same extras
            sql = (f"insert into cache_events ({', '.join(cols)}) values ({', '.join('?' * len(cols))})"
                   if same else None)
            with self._lock:
                try:
                    with write_txn(self.db):
                        if sql is None:
                            self.db["cache_events"].insert_all(rows)
                        else:  # executemany: a busy watched server sends thousands of events a second
                            self.db.conn.executemany(sql, [[r[c] for c in cols] for r in rows])
                except sqlite3.Error as exc:
                    raise StoreError(f"cannot record {len(rows)} events in {self.path}: {exc}") from None

    def flush(self) -> None:
        with self._lock:
            events = self._drain()
            if events:
                with write_txn(self.db):
                    self.db["cache_events"].insert_all(events)

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
        self.flush()
        with self._lock:
            with write_txn(self.db):
                update = {"ended": time.time()}
                if stats is not None:
                    update["stats"] = _dumps(stats)
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
