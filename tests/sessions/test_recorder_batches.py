"""The recorder writes one row per engine batch (msgpack-encoded engine events) from its own
writer thread; sessions recorded the old way (one JSON row per event) still open everywhere; a
recorded row is hostile input; a full queue drops and counts, never blocks the engine; what the
writer committed survives a kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import msgspec
import pytest

from support.recorded import recorded
from support.wait import wait_for

from kvplay.cli import main as cli
from kvplay.engine.config import EngineConfig
from kvplay.engine.events import BlockStored, EngineBatch, RequestQueued, encode_events
from kvplay.engine.sampling import SamplingParams
from kvplay.sessions import event_log, recorder as recorder_mod
from kvplay.sessions.event_log import batch_row, event_dicts, insert_batch_rows, read_batches
from kvplay.sessions.history import load_recording, pool_state, session_batches
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.store import open_db, write_txn

SYSTEM = "You are a terse assistant."
TURNS = [("alice", "Tell me about caches."), ("bob", "Tell me about caches."), ("alice", "And about pools?")]


def _record(tiny_llama, db: str, num_blocks: int = 24) -> dict:
    from kvplay.engine.engine import Engine

    config = EngineConfig(model="tiny:llama", num_blocks=num_blocks, isolation="shared")
    engine = Engine(config, tiny_llama).start()
    batches: list = []
    engine.subscribe_batches(batches.append)
    rec = Recorder.open(db, config, engine.model_name, "run", SYSTEM)
    rec.attach(engine)
    for u in ("alice", "bob"):
        rec.add_user(u, seed=1)
    try:
        for user, text in TURNS:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            sp = SamplingParams(max_tokens=8, seed=1)
            res = engine.submit(user, msgs, sp).result(60)
            assert res.error is None
            rec.record_turn(user, text, msgs, sp, res)
    finally:
        rec.close()
        engine.shutdown()
    return {"db": db, "sid": rec.session_id, "batches": [b for b in batches if b.events]}


@pytest.fixture(scope="module")
def session(tiny_llama, tmp_path_factory):
    return _record(tiny_llama, str(tmp_path_factory.mktemp("rec") / "s.db"))


def test_one_row_per_engine_batch_holding_its_events(session):
    db = open_db(session["db"], create=False)
    rows = list(db.query("select seq, n, step, ts, forwards, events from event_batches where session_id = ? "
                         "order by seq", [session["sid"]]))
    assert db.execute("select count(*) from cache_events").fetchone()[0] == 0
    db.close()
    batches = session["batches"]
    assert len(rows) == len(batches) > len(TURNS)
    for row, b in zip(rows, batches):
        assert (row["step"], row["n"], row["seq"], row["ts"]) == (b.step, len(b.events), b.events[0].seq, b.ts)
        assert row["events"] == encode_events(b.events)  # the one encoding
        assert type(row["forwards"]) is int
    got = session_batches(open_db(session["db"], create=False), session["sid"])
    assert [e.seq for b in got for e in b.events] == [e.seq for b in batches for e in b.events]
    assert got[0].events == batches[0].events  # typed, as the engine handed them over
    assert (got[0].step, got[0].ts, got[0].forwards) == (batches[0].step, batches[0].ts, rows[0]["forwards"])


def _to_old_rows(db_path: str, sid: str) -> None:
    """Rewrite a session as the recorder before schema 5 wrote it: one cache_events row per event
    (a JSON payload plus its columns), no event_batches rows."""
    db = open_db(db_path)
    batches, bad = read_batches(db, sid)
    events = event_dicts(batches)
    assert bad == 0
    rows = []
    for d in events:
        d = dict(d)
        forwards = d.pop("forwards")
        ids = d.get("block_ids")
        hashes = d.get("block_hashes")
        rows.append({"session_id": sid, "seq": d["seq"], "ts": d["ts"], "kind": d["kind"],
                     "block_ids": None if ids is None else json.dumps(ids),
                     "block_hashes": None if hashes is None else json.dumps(hashes),
                     "user": d.get("user") or None, "request_id": d.get("request_id") or None,
                     "payload": json.dumps(d), "forwards": forwards})
    with write_txn(db):
        db.execute("delete from event_batches where session_id = ?", [sid])
        db["cache_events"].insert_all(rows)
    db.close()


def test_a_session_recorded_the_old_way_still_scrubs_shows_exports_and_replays(tiny_llama, tmp_path, capsys):
    s = _record(tiny_llama, str(tmp_path / "s.db"))
    db = open_db(s["db"], create=False)
    new = session_batches(db, s["sid"])
    db.close()
    _to_old_rows(s["db"], s["sid"])
    db = open_db(s["db"], create=False)
    assert db.execute("select count(*) from event_batches").fetchone()[0] == 0
    rec = load_recording(db, s["sid"])
    db.close()
    assert rec.events == [e for b in new for e in b.events]
    assert [b.forwards for b in rec.batches for _ in b.events] == [b.forwards for b in new for _ in b.events]
    n = len(rec.events)
    assert pool_state(rec.batches, n, rec.num_blocks).blocks == pool_state(new, n, rec.num_blocks).blocks
    assert cli(["show", s["sid"], "--db", s["db"], "--json", "--events"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [e["seq"] for e in shown["events"]] == [e.seq for e in rec.events] and "bad_events" not in shown
    assert cli(["show", s["sid"], "--db", s["db"]]) == 0
    assert f"{n} engine events recorded" in capsys.readouterr().out
    out = tmp_path / "scrub.svg"
    assert cli(["scrub", s["sid"], "--db", s["db"], "--turn", "2", "--screenshot", str(out)]) == 0
    assert out.stat().st_size > 0
    assert cli(["export", s["sid"], "--db", s["db"], "--format", "vllm-jsonl", "-o", str(tmp_path / "t.jsonl")]) == 0
    assert (tmp_path / "t.jsonl").read_text().strip()
    assert cli(["replay", s["sid"], "--db", s["db"], "--headless", "--json", "--no-record"]) == 0
    summary = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()][-1]
    assert summary["reproduces"]


# --- recorded rows are hostile ------------------------------------------------------------------
def _session_with_rows(tmp_path, rows: list[tuple]) -> tuple[str, str]:
    p = str(tmp_path / "h.db")
    rec = Recorder.open(p, None, "remote", "watch", "")
    sid = rec.session_id
    rec.close()
    db = open_db(p)
    with write_txn(db):
        insert_batch_rows(db, [(sid, *r) for r in rows])
    db.close()
    return p, sid


def test_bad_rows_and_events_are_counted_and_skipped(tmp_path, capsys, monkeypatch):
    good = [BlockStored(seq=1, block_hashes=["aa"], token_ids=[1, 2], block_size=2, block_ids=[0], user="u")]
    mixed = msgspec.msgpack.encode([
        {"kind": "BlockStored", "seq": 2, "block_ids": "not a list"},       # wrong type
        {"kind": "NoSuchEvent", "seq": 3},                                    # unknown kind
        {"kind": "RequestQueued", "seq": 4, "request_id": "r" * 10_000},    # oversized string
        RequestQueued(seq=5, request_id="r1", user="u", prompt_tokens=3),   # good
    ])
    rows = [
        (1, 1, 1, 1.0, 0, None, None, encode_events(good)),
        (2, 4, 2, 2.0, 0, None, None, mixed),
        (6, 1, 3, 3.0, 0, None, None, b"\xc1garbage"),                     # not msgpack
        (7, 1, 4, 4.0, 0, None, None, "a text, not a blob"),               # wrong column type
        (8, 1, 5, 5.0, 0, None, None, msgspec.msgpack.encode({"kind": "BlockStored"})),  # not an array
        (9, 1, 6, 6.0, "x", 7, None, encode_events([RequestQueued(seq=9, request_id="r2")])),  # odd columns
        (10, 1, 7, 7.0, 0, None, None, encode_events([BlockStored(seq=10, token_ids=[1000] * 8000)])),  # valid, too big
    ]
    monkeypatch.setattr(event_log, "MAX_BATCH_BYTES", 20_000)
    p, sid = _session_with_rows(tmp_path, rows)
    db = open_db(p, create=False)
    batches, bad = read_batches(db, sid)
    events = event_dicts(batches)
    db.close()
    assert [e["seq"] for e in events] == [1, 5, 9]
    assert bad == 3 + 4
    assert events[2]["forwards"] is None and events[2]["pod"] == "7"  # (a text column)
    assert cli(["show", sid, "--db", p, "--json", "--events"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["bad_events"] == bad and len(shown["events"]) == 3
    assert cli(["show", sid, "--db", p, "--events"]) == 0
    assert "7 recorded events were damaged and skipped" in capsys.readouterr().out.replace(",", "")


def test_bad_old_rows_are_counted_and_skipped(tmp_path):
    p = str(tmp_path / "o.db")
    rec = Recorder.open(p, None, "remote", "run", "")
    sid = rec.session_id
    rec.close()
    db = open_db(p)
    good = RequestQueued(seq=3, request_id="r", user="u", prompt_tokens=1).to_dict()
    with write_txn(db):
        db["cache_events"].insert_all([
            {"session_id": sid, "seq": 1, "kind": "x", "payload": "{not json"},
            {"session_id": sid, "seq": 2, "kind": "x", "payload": "[1, 2]"},
            {"session_id": sid, "seq": 3, "kind": "RequestQueued", "payload": json.dumps(good), "forwards": "seven"},
            {"session_id": sid, "seq": 5, "kind": "x", "payload": json.dumps(dict(good, prompt_tokens="many"))},
            {"session_id": sid, "seq": 4, "kind": "x", "payload": "[" * 100_000 + "]" * 100_000},
        ])
    batches, bad = read_batches(db, sid)
    db.close()
    assert bad == 4 and event_dicts(batches) == [dict(good, forwards=None)]


# --- the writer thread ------------------------------------------------------------------------
def test_a_full_queue_drops_and_counts_and_never_blocks_the_engine(make_engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recorder_mod, "MAX_QUEUED_EVENTS", 8)
    p = str(tmp_path / "q.db")
    eng = make_engine()
    rec = Recorder.open(p, eng.config, eng.model_name, "run", "")
    rec.attach(eng)
    with rec._lock:  # the writer cannot write (as if the disk were stuck): the engine goes on
        res = eng.generate("alice", [{"role": "user", "content": "hello there, how are you " * 8}],
                           SamplingParams(max_tokens=12, seed=1), timeout=60)
        assert res.error is None
        eng.call(lambda: None)  # the step that finished the request has handed over its batch
        assert rec.dropped_events > 0 and rec.dropped_batches > 0
        queued = rec._queued
        assert 0 < queued <= 8
    rec.close()
    db = open_db(p, create=False)
    s = db["sessions"].get(rec.session_id)
    batches, bad = read_batches(db, rec.session_id)
    events = event_dicts(batches)
    db.close()
    assert s["dropped_events"] == rec.dropped_events and len(events) == queued and bad == 0
    assert cli(["show", rec.session_id, "--db", p]) == 0
    assert "recorder dropped" in capsys.readouterr().out


def test_the_writer_commits_without_a_turn_or_a_flush(tmp_path):
    p = str(tmp_path / "w.db")
    rec = Recorder.open(p, None, "remote", "watch", "")
    assert rec.record_batch(EngineBatch(1, 1.0, [RequestQueued(seq=1, request_id="a")]))
    assert rec.record_batch(EngineBatch(events=[RequestQueued(seq=2, request_id="b"), RequestQueued(seq=3, request_id="c")],
                                        pod="p", wire_seq=3))  # one row, with its envelope
    db = open_db(p, create=False)
    wait_for(lambda: len(event_dicts(read_batches(db, rec.session_id)[0])) >= 3, 20, poll=0.05)
    rows = db.execute("select n, pod, wire_seq from event_batches order by seq").fetchall()
    db.close()
    rec.close()
    assert rows == [(1, None, None), (2, "p", 3)]


CHILD = r"""
import sys, time
from kvplay.engine.events import BlockStored, EngineBatch, RequestQueued
from kvplay.sessions.recorder import Recorder
rec = Recorder.open(sys.argv[1], None, "remote", "watch", "")
print(rec.session_id, flush=True)
seq = 0
for step in range(1, 201):
    evs = []
    for _ in range(5):
        seq += 1
        evs.append(BlockStored(seq=seq, block_hashes=[format(seq, "016x")], token_ids=[seq] * 4, block_size=4,
                               block_ids=[seq % 64], user="u"))
    rec.record_batch(EngineBatch(step, float(step), evs))
print("queued", flush=True)
time.sleep(600)  # the subject: alive with no flush and no close (only the writer thread writes) until killed
"""


def test_what_the_writer_committed_survives_kill_9(tmp_path):
    p = str(tmp_path / "k.db")
    child = subprocess.Popen([sys.executable, "-c", CHILD, p], stdout=subprocess.PIPE, text=True)
    try:
        sid = child.stdout.readline().strip()
        assert child.stdout.readline().strip() == "queued"
        def committed() -> int:
            db = open_db(p, create=False)
            try:
                return db.execute("select coalesce(sum(n), 0) from event_batches").fetchone()[0]
            finally:
                db.close()

        wait_for(lambda: committed() >= 1000, 30, poll=0.1)  # then killed
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    db = open_db(p, create=False)
    batches, bad = read_batches(db, sid)
    s = db["sessions"].get(sid)
    db.close()
    assert bad == 0 and [e.seq for b in batches for e in b.events] == list(range(1, 1001))
    assert s["ended"] is None  # it did crash


def test_a_watched_servers_batches_keep_their_envelope(tmp_path):
    p = str(tmp_path / "e.db")
    rec = Recorder.open(p, None, "remote", "watch", "")
    evs = [RequestQueued(seq=i, request_id=f"r{i}") for i in range(1, 6)]
    batches = [EngineBatch(events=evs[:2], pod="a", wire_seq=1), EngineBatch(events=evs[2:4], pod="a", wire_seq=2),
               EngineBatch(events=evs[4:], pod="b", wire_seq=1)]
    rec.write_rows([batch_row(rec.session_id, b) for b in batches], len(evs))
    rec.close()
    db = open_db(p, create=False)
    rows = db.execute("select seq, n, pod, wire_seq from event_batches order by seq").fetchall()
    db.close()
    assert rows == [(1, 2, "a", 1), (3, 2, "a", 2), (5, 1, "b", 1)]
    assert [(e["seq"], e["pod"], e["wire_seq"]) for e in recorded(p)] == [
        (1, "a", 1), (2, "a", 1), (3, "a", 2), (4, "a", 2), (5, "b", 1)]


def test_batch_row_is_the_one_encoding():
    evs = [RequestQueued(seq=4, ts=2.5, request_id="r")]
    row = batch_row("S", EngineBatch(3, 0.0, evs, 9))
    assert row == ("S", 4, 1, 3, 2.5, 9, None, None, encode_events(evs))
