"""A session's engine events in the sessions DB: the rows the recorder writes and what reads them.

Since schema 5 a recorded batch (one engine step, or one wire batch of a watched pod) is one
`event_batches` row: its events encoded by `kvplay.engine.events.encode_events` (msgpack, tagged
by kind), the first event's `seq`, how many (`n`), and the batch's envelope: the engine's `step`,
its `ts`, the engine's step clock (`forwards`) and, for a watched server, the `pod` and the
batch's `wire_seq`. Sessions recorded before keep their `cache_events` rows (one per event, a JSON
payload, the envelope in columns). `read_batches` reads both, old rows first, as typed
`EngineBatch`es (engine/events.py): the events with their envelope, never merged dicts.

A recorded pod numbers its blocks by its own slots, so the blocks of a batch from a pod are named
again by pod and hash as they are read (`name_blocks`, wire/translate.py `Slots`): one mirror then
holds every pod of a recording (recordings made before the block ids were kept have none).

Recorded rows are hostile input (a damaged or hand-made file): a row too big, a payload that is
not an event, an event that does not validate is counted in `bad` and skipped.
"""
from __future__ import annotations

import json

import msgspec

from kvplay.engine.events import (MAX_BATCH_BYTES, AllBlocksCleared, BlockHit, BlockRemoved, BlockStored,
                                  EngineBatch, EventError, decode_events, encode_events, event_from_dict)
from kvplay.wire.translate import Slots

MAX_PAYLOAD_BYTES = 16 << 20  # one old (JSON, one event) row

BATCH_COLUMNS = ("session_id", "seq", "n", "step", "ts", "forwards", "pod", "wire_seq", "events")
_INSERT = (f"insert into event_batches ({', '.join(BATCH_COLUMNS)}) "
           f"values ({', '.join('?' * len(BATCH_COLUMNS))})")


def batch_row(session_id: str, batch: EngineBatch) -> tuple:
    """One `event_batches` row (in BATCH_COLUMNS order): `batch`'s envelope and its events, encoded."""
    events = batch.events
    return (session_id, events[0].seq if events else None, len(events), batch.step or None,
            batch.ts or (events[-1].ts if events else None), batch.forwards, batch.pod, batch.wire_seq,
            encode_events(events))


def insert_batch_rows(db, rows: list[tuple]) -> None:
    """Insert `batch_row`s (inside the caller's transaction)."""
    db.conn.executemany(_INSERT, rows)


def _tables(db) -> set:
    return set(db.table_names())


def _envelope(forwards, pod, wire_seq) -> tuple:
    """A row's envelope columns, typed (a damaged row's odd values read as none, or as text)."""
    return (forwards if type(forwards) is int else None, None if pod is None else str(pod),
            wire_seq if type(wire_seq) is int else None)


def _old_batches(db, sid: str) -> tuple[list[EngineBatch], int]:
    """`cache_events` rows (one JSON event each): consecutive ones with the same envelope are one
    batch. Each is validated as a new row's events are: the same types either way."""
    out: list[EngineBatch] = []
    bad = 0
    last = None
    sql = (f"select case when length(payload) <= {MAX_PAYLOAD_BYTES} then payload end, forwards, pod, "
           f"wire_seq from cache_events where session_id = ? order by seq, id")
    for payload, forwards, pod, wire_seq in db.execute(sql, [sid]):
        try:
            d = json.loads(payload)
            if isinstance(d, dict):
                d.pop("forwards", None)  # envelope fields some old payloads carried
                d.pop("pod", None)
                d.pop("wire_seq", None)
            ev = event_from_dict(d)
        except (TypeError, ValueError, RecursionError, EventError):
            bad += 1
            continue
        env = _envelope(forwards, pod, wire_seq)
        if last is None or env != last:
            out.append(EngineBatch(0, 0.0, [], *env))
            last = env
        out[-1].events.append(ev)
    for b in out:
        b.ts = b.events[-1].ts
    return out, bad


def _new_batches(db, sid: str) -> tuple[list[EngineBatch], int]:
    out: list[EngineBatch] = []
    bad = 0
    sql = (f"select case when length(events) <= {MAX_BATCH_BYTES} then events end, step, ts, forwards, pod, "
           "wire_seq from event_batches where session_id = ? order by seq, id")
    for blob, step, ts, forwards, pod, wire_seq in db.execute(sql, [sid]):
        events, nbad = decode_events(blob)
        bad += nbad
        if events:
            out.append(EngineBatch(step if type(step) is int else 0,
                                   float(ts) if type(ts) in (int, float) else events[-1].ts, events,
                                   *_envelope(forwards, pod, wire_seq)))
    return out, bad


def name_blocks(batch: EngineBatch, slots: Slots) -> EngineBatch:
    """`batch` with its blocks named by pod and hash when it came from a watched pod (its `pod`
    set): each (pod, hash) gets a slot of `slots` (the lowest free one), a removed one gives it
    back, a pod's reset frees all of its own. Other batches are returned as they are."""
    pod = batch.pod
    if pod is None:
        return batch
    of = slots.of
    out = []
    for ev in batch.events:
        cls = type(ev)
        if cls is BlockStored:
            ids = []
            for h in ev.block_hashes:
                s = of.get((pod, h))
                if s is None and slots.room():
                    s = slots.take((pod, h))
                if s is not None:
                    ids.append(s)
            ev = msgspec.structs.replace(ev, block_ids=ids, block_hashes=ev.block_hashes[:len(ids)])
        elif cls is BlockHit:
            ev = msgspec.structs.replace(ev, block_ids=[s for s in (of.get((pod, h)) for h in ev.block_hashes)
                                                        if s is not None])
        elif cls is BlockRemoved:
            ev = msgspec.structs.replace(ev, block_ids=[s for s in (slots.give_back((pod, h)) for h in ev.block_hashes)
                                                        if s is not None])
        elif cls is AllBlocksCleared:  # what the pod still holds goes (older recordings listed none)
            left = [k for k in of if k[0] == pod]
            if left:
                out.append(BlockRemoved(seq=ev.seq, ts=ev.ts, block_hashes=[k[1] for k in left],
                                        block_ids=[slots.give_back(k) for k in left], reason=ev.reason))
        out.append(ev)
    return msgspec.structs.replace(batch, events=out)


def read_batches(db, sid: str, kinds: tuple | None = None) -> tuple[list[EngineBatch], int]:
    """(the recorded batches of session `sid` in order — each its events and envelope: `step`,
    `ts`, `forwards` (the engine's step clock; None when not kept) and, for a watched server,
    `pod` and `wire_seq` —, how many rows or events were bad and skipped). `kinds`: only events
    of these kinds (class names); a batch left with none is left out."""
    tables = _tables(db)
    batches: list[EngineBatch] = []
    bad = 0
    for table, read in (("cache_events", _old_batches), ("event_batches", _new_batches)):
        if table in tables:
            got, nbad = read(db, sid)
            batches += got
            bad += nbad
    if any(b.pod is not None for b in batches):
        slots = Slots()
        batches = [name_blocks(b, slots) for b in batches]
    if kinds:
        batches = [msgspec.structs.replace(b, events=[e for e in b.events if e.kind in kinds]) for b in batches]
        batches = [b for b in batches if b.events]
    return batches, bad


def event_dicts(batches: list[EngineBatch]) -> list[dict]:
    """The batches' events as plain data for JSON (`kvplay show --events`, `export`): each its
    fields, "kind", `forwards` and, for a watched server, `pod` and `wire_seq`."""
    out = []
    for b in batches:
        for d in msgspec.to_builtins(b.events):
            d["forwards"] = b.forwards
            if b.pod is not None:
                d["pod"], d["wire_seq"] = b.pod, b.wire_seq
            out.append(d)
    return out


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
