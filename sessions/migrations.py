"""Numbered schema migrations (the `llm` pattern): each function runs once, in order, and is
recorded by name in `_kvplay_migrations`; `PRAGMA user_version` holds how many ran, so a DB
from a newer kvplay (more migrations than we know) is recognised and refused."""
from __future__ import annotations

import time

import sqlite_utils

from .txn import write_txn

MIGRATIONS_TABLE = "_kvplay_migrations"
MIGRATIONS = []


def migration(fn):
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    db["sessions"].create({
        "id": str, "created": float, "ended": float, "source": str, "model": str,
        "engine_config": str, "versions": str, "system_prompt": str, "script_path": str,
        "replay_of": str, "title": str,
    }, pk="id")
    db["users"].create({
        "session_id": str, "name": str, "group": str, "colour": str, "seed": int,
        "temperature": float, "max_tokens": int, "top_p": float, "top_k": int,
    }, pk=("session_id", "name"), foreign_keys=[("session_id", "sessions", "id")])
    db["turns"].create({
        "id": str, "session_id": str, "seq": int, "user": str, "text": str, "reply": str,
        "messages": str, "sampling": str, "seed": int, "at": float, "started": float, "ended": float,
        "request_id": str, "ttft_ms": float, "decode_tok_s": float, "prompt_tokens": int,
        "cached_tokens": int, "computed_tokens": int, "output_tokens": int, "cached_from": str,
        "preemptions": int, "finish_reason": str, "error": str, "token_ids": str,
    }, pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["turns"].create_index(["session_id", "seq"], unique=True)
    db["cache_events"].create({
        "id": int, "session_id": str, "seq": int, "ts": float, "kind": str, "block_ids": str,
        "block_hashes": str, "user": str, "request_id": str, "payload": str,
    }, pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["cache_events"].create_index(["session_id", "seq"])


@migration
def m002_session_stats(db: sqlite_utils.Database) -> None:
    """Engine counters at the end of a session (hit rate, evictions, bytes saved, ...)."""
    db["sessions"].add_column("stats", str)


@migration
def m003_replay_clock(db: sqlite_utils.Database) -> None:
    """What the simulator and the scrubber need to replay a session without its model: each
    turn's prompt token ids (and how many belong to the system prompt), and for each event the
    engine's forward count when it happened (the step clock: when a request entered the queue)."""
    db["turns"].add_column("prompt_ids", str)
    db["turns"].add_column("system_tokens", int)
    db["cache_events"].add_column("forwards", int)


@migration
def m004_watched_pods(db: sqlite_utils.Database) -> None:
    """Events of a watched server (`kvplay watch`/`attach`): which pod sent them and the seq of
    their batch on that pod's wire (`seq` stays the order they were applied in)."""
    db["cache_events"].add_column("pod", str)
    db["cache_events"].add_column("wire_seq", int)


@migration
def m005_event_batches(db: sqlite_utils.Database) -> None:
    """Engine events recorded one row per batch (an engine step, or a watched pod's wire batch):
    `events` holds the batch's events msgpack-encoded by `kvplay.engine.events.encode_events`,
    `seq` the first event's seq and `n` how many there are. Sessions recorded before keep their
    `cache_events` rows (one per event, JSON); readers read both (sessions/event_log.py).
    `dropped_events` counts the events a session's recorder could not keep up with."""
    db["event_batches"].create({
        "id": int, "session_id": str, "seq": int, "n": int, "step": int, "ts": float, "forwards": int,
        "pod": str, "wire_seq": int, "events": bytes,
    }, pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["event_batches"].create_index(["session_id", "seq"])
    db["sessions"].add_column("dropped_events", int)


@migration
def m006_audit_probes(db: sqlite_utils.Database) -> None:
    """`kvplay audit URL` records every request it sends as a turn of a session of source
    "audit": `turns.probe` says what the request was in the procedure (JSON: procedure, kind,
    role, level, attempt, server time …), `sessions.params` holds the run's parameters (JSON),
    so `kvplay audit --resume ID` continues a run where it stopped."""
    db["turns"].add_column("probe", str)
    db["sessions"].add_column("params", str)


def schema_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def applied(db: sqlite_utils.Database) -> set[str]:
    if MIGRATIONS_TABLE not in db.table_names():
        return set()
    return {r["name"] for r in db[MIGRATIONS_TABLE].rows}


def is_newer(db: sqlite_utils.Database) -> bool:
    """Was this DB migrated by a kvplay that knows migrations we do not?"""
    known = {fn.__name__ for fn in MIGRATIONS}
    return schema_version(db) > len(MIGRATIONS) or bool(applied(db) - known)


def migrate(db: sqlite_utils.Database) -> int:
    """Apply pending migrations; returns how many ran."""
    ran = 0
    for n, fn in enumerate(MIGRATIONS, 1):
        if fn.__name__ in applied(db):
            continue
        with write_txn(db):
            if fn.__name__ in applied(db):  # another process migrated while we waited
                continue
            if MIGRATIONS_TABLE not in db.table_names():
                db[MIGRATIONS_TABLE].create({"name": str, "applied_at": float}, pk="name")
            fn(db)
            db[MIGRATIONS_TABLE].insert({"name": fn.__name__, "applied_at": time.time()})
            db.execute(f"PRAGMA user_version = {n}")
        ran += 1
    return ran
