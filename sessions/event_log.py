"""A session's engine events in the sessions DB: the rows the recorder writes and what reads them.

Since schema 5 a recorded batch (one engine step, or one wire batch of a watched pod) is one
`event_batches` row: its events encoded by `kvplay.engine.events.encode_events` (msgpack, tagged
by kind), the first event's `seq`, how many (`n`), the engine's step clock (`forwards`) and, for a
watched server, the `pod` and the batch's `wire_seq`. Sessions recorded before keep their
`cache_events` rows (one per event, a JSON payload); `read_events` reads both, old rows first.

Recorded rows are hostile input (a damaged or hand-made file): a row too big, a payload that is
not an event, an event that does not validate is counted in `bad` and skipped.
"""
from __future__ import annotations

import json

import msgspec

from kvplay.engine.events import MAX_BATCH_BYTES, decode_events, encode_events, event_from_dict

MAX_PAYLOAD_BYTES = 16 << 20  # one old (JSON, one event) row

BATCH_COLUMNS = ("session_id", "seq", "n", "step", "ts", "forwards", "pod", "wire_seq", "events")
_INSERT = (f"insert into event_batches ({', '.join(BATCH_COLUMNS)}) "
           f"values ({', '.join('?' * len(BATCH_COLUMNS))})")


def batch_row(session_id: str, events: list, step: int | None = None, ts: float | None = None,
              forwards: int | None = None, pod: str | None = None, wire_seq: int | None = None) -> tuple:
    """One `event_batches` row (in BATCH_COLUMNS order) holding `events`, encoded."""
    return (session_id, events[0].seq if events else None, len(events), step,
            ts if ts is not None else (events[-1].ts if events else None), forwards, pod, wire_seq,
            encode_events(events))


def insert_batch_rows(db, rows: list[tuple]) -> None:
    """Insert `batch_row`s (inside the caller's transaction)."""
    db.conn.executemany(_INSERT, rows)


def _tables(db) -> set:
    return set(db.table_names())


def read_events(db, sid: str, kinds: tuple | None = None) -> tuple[list[dict], int]:
    """(the recorded events of session `sid` in order, as plain dicts — each its fields, "kind",
    `forwards` (the engine's step clock; None when not kept) and, for a watched server, `pod` and
    `wire_seq` —,
    how many rows or events were bad and skipped). `kinds`: only events of these kinds."""
    out: list[dict] = []
    bad = 0
    tables = _tables(db)
    if "cache_events" in tables:  # recorded before schema 5: one JSON row per event
        where, args = "session_id = ?", [sid]
        if kinds:
            where += f" and kind in ({', '.join('?' * len(kinds))})"
            args += list(kinds)
        sql = (f"select case when length(payload) <= {MAX_PAYLOAD_BYTES} then payload end, forwards, pod, "
               f"wire_seq from cache_events where {where} order by seq, id")
        for payload, forwards, pod, wire_seq in db.execute(sql, args):
            try:  # validated as a new row's events are: the same types either way
                d = event_from_dict(json.loads(payload)).to_dict()
            except (TypeError, ValueError, RecursionError):  # (EventError is a ValueError)
                bad += 1
                continue
            d["forwards"] = forwards if type(forwards) is int else None
            if pod is not None:
                d["pod"], d["wire_seq"] = pod, wire_seq
            out.append(d)
    if "event_batches" in tables:
        sql = (f"select case when length(events) <= {MAX_BATCH_BYTES} then events end, forwards, pod, wire_seq "
               "from event_batches where session_id = ? order by seq, id")
        for blob, forwards, pod, wire_seq in db.execute(sql, [sid]):
            events, nbad = decode_events(blob)
            bad += nbad
            if kinds:
                events = [e for e in events if e.kind in kinds]
            if not events:
                continue
            forwards = forwards if type(forwards) is int else None
            pod = pod if isinstance(pod, str) else None
            for d in msgspec.to_builtins(events):
                d["forwards"] = forwards
                if pod is not None:
                    d["pod"], d["wire_seq"] = pod, wire_seq
                out.append(d)
    return out, bad


def count_events(db, sid: str) -> int:
    """How many events session `sid` recorded (as its rows say, without decoding them)."""
    tables = _tables(db)
    n = 0
    if "cache_events" in tables:
        n += db.execute("select count(*) from cache_events where session_id = ?", [sid]).fetchone()[0]
    if "event_batches" in tables:
        n += db.execute("select coalesce(sum(max(n, 0)), 0) from event_batches where session_id = ? "
                        "and typeof(n) = 'integer'", [sid]).fetchone()[0]
    return n
