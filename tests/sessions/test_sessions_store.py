"""Sessions DB: migrations against the expected columns, ids, safe opening, bad DB files."""
import json
import sqlite3
import threading

import pytest
import sqlite_utils

from kvplay.cli import main as cli
from kvplay.sessions.event_log import event_dicts, read_batches
from kvplay.sessions.ids import new_ulid, ulid_time
from kvplay.sessions.migrations import MIGRATIONS, MIGRATIONS_TABLE, migrate, schema_version
from kvplay.sessions.store import StoreError, open_db

EXPECTED = {
    "sessions": {"id", "created", "ended", "source", "model", "engine_config", "versions", "system_prompt",
                 "script_path", "replay_of", "title", "stats", "dropped_events", "params"},
    "users": {"session_id", "name", "group", "colour", "seed", "temperature", "max_tokens", "top_p", "top_k"},
    "turns": {"id", "session_id", "seq", "user", "text", "reply", "messages", "sampling", "seed", "at", "started",
              "ended", "request_id", "ttft_ms", "decode_tok_s", "prompt_tokens", "cached_tokens", "computed_tokens",
              "output_tokens", "cached_from", "preemptions", "finish_reason", "error", "token_ids",
              "prompt_ids", "system_tokens", "probe"},
    "cache_events": {"id", "session_id", "seq", "ts", "kind", "block_ids", "block_hashes", "user", "request_id",
                     "payload", "forwards", "pod", "wire_seq"},
    "event_batches": {"id", "session_id", "seq", "n", "step", "ts", "forwards", "pod", "wire_seq", "events"},
}


@pytest.fixture(autouse=True)
def _short_db_timeout(monkeypatch):  # the default DB is the test's own (tests/conftest.py)
    monkeypatch.setenv("KVPLAY_DB_TIMEOUT", "0.2")


def test_migrations_in_memory():
    db = sqlite_utils.Database(memory=True)
    assert migrate(db) == len(MIGRATIONS)
    for table, cols in EXPECTED.items():
        assert set(db[table].columns_dict) == cols, table
    assert db["users"].pks == ["session_id", "name"]
    assert {r["name"] for r in db[MIGRATIONS_TABLE].rows} == {fn.__name__ for fn in MIGRATIONS}
    assert schema_version(db) == len(MIGRATIONS)
    assert migrate(db) == 0  # idempotent


def test_migrates_an_older_db(tmp_path):
    p = tmp_path / "old.db"
    db = sqlite_utils.Database(p)
    db[MIGRATIONS_TABLE].create({"name": str, "applied_at": float}, pk="name")
    MIGRATIONS[0](db)
    db[MIGRATIONS_TABLE].insert({"name": MIGRATIONS[0].__name__, "applied_at": 0.0})
    db.execute("PRAGMA user_version = 1")
    db["sessions"].insert({"id": "01OLD", "created": 1.0, "source": "run"})
    db.close()
    db = open_db(p)
    assert "stats" in db["sessions"].columns_dict and schema_version(db) == len(MIGRATIONS)
    assert db["sessions"].get("01OLD")["source"] == "run"
    db.close()


def test_foreign_sqlite_db_unchanged(tmp_path, capsys):
    p = tmp_path / "other.db"
    conn = sqlite3.connect(p)
    conn.execute("create table notes (x)")
    conn.commit()
    conn.close()
    before = p.read_bytes()
    rc, err = _cli_err(capsys, ["sessions", "--db", str(p)])
    assert rc == 2 and "not a kvplay sessions database" in err
    assert p.read_bytes() == before


def test_ulids_sort_by_time():
    ids = [new_ulid() for _ in range(200)]
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert all(len(i) == 26 for i in ids)


def test_ulid_time_decodes():
    import time

    assert abs(ulid_time(new_ulid()) - time.time()) < 5


def test_open_creates_wal_db(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLAY_DB", str(tmp_path / "sub" / "s.db"))  # the default place: its folders are made
    db = open_db()
    assert db.journal_mode == "wal"
    assert set(EXPECTED) <= set(db.table_names())
    db.close()


def test_a_named_db_in_a_missing_folder_is_refused_and_no_folder_made(tmp_path):
    with pytest.raises(StoreError, match="no such directory"):
        open_db(tmp_path / "no" / "such" / "s.db")
    assert not (tmp_path / "no").exists()


def test_recorder_from_another_thread(tmp_path, make_engine):
    from kvplay.engine.sampling import SamplingParams
    from kvplay.sessions.recorder import Recorder

    eng = make_engine()
    rec = Recorder.open(str(tmp_path / "r.db"), eng.config, eng.model_name, "app", "sys")
    rec.attach(eng)
    rec.add_user("alice", seed=3)
    sp = SamplingParams(max_tokens=3, seed=3)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    res = eng.submit("alice", msgs, sp).result(60)
    out = []
    t = threading.Thread(target=lambda: out.append(rec.record_turn("alice", "hi", msgs, sp, res)))
    t.start()
    t.join()
    rec.close()
    db = open_db(tmp_path / "r.db")
    turns = list(db["turns"].rows)
    assert [t["id"] for t in turns] == out
    assert turns[0]["token_ids"] == str(list(res.token_ids)).replace(" ", "")
    batches, bad = read_batches(db, rec.session_id)
    events = event_dicts(batches)
    kinds = {e["kind"] for e in events}
    assert {"RequestQueued", "RequestStarted", "RequestFinished", "BlockStored"} <= kinds and bad == 0
    stored = next(e for e in events if e["kind"] == "BlockStored")
    assert stored["user"] == "alice" and stored["block_ids"] and stored["request_id"] == res.request_id
    assert db.execute("select count(*) from cache_events").fetchone()[0] == 0  # one row per batch now
    assert db.execute("select sum(n) from event_batches").fetchone()[0] == len(events)
    session = db["sessions"].get(rec.session_id)
    assert session["ended"] is not None
    assert json.loads(session["stats"])["requests_finished"] == 1


# --- bad DB files: one line, exit 2, file unchanged ------------------------------------------
def _cli_err(capsys, argv):
    rc = cli(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def test_not_sqlite_unchanged(tmp_path, capsys):
    p = tmp_path / "notes.db"
    p.write_bytes(b"just some text\n" * 100)
    before = p.read_bytes()
    for argv in (["sessions", "--db", str(p)], ["show", "X", "--db", str(p)],
                 ["export", "X", "--db", str(p)], ["replay", "X", "--db", str(p), "--headless"]):
        rc, err = _cli_err(capsys, argv)
        assert rc == 2, argv
        assert "not a SQLite database" in err and err.count("\n") == 0
    assert p.read_bytes() == before
    with pytest.raises(StoreError):
        open_db(p)
    assert p.read_bytes() == before


def test_newer_schema_refused(tmp_path, capsys):
    p = tmp_path / "s.db"
    open_db(p).close()
    conn = sqlite3.connect(p)
    conn.execute(f"insert into {MIGRATIONS_TABLE} values ('m999_future', 0)")
    conn.execute("PRAGMA user_version = 999")
    conn.commit()
    conn.close()
    before = p.read_bytes()
    rc, err = _cli_err(capsys, ["sessions", "--db", str(p)])
    assert rc == 2 and "newer kvplay" in err and err.count("\n") == 0
    assert p.read_bytes() == before


def test_locked_db(tmp_path, capsys):
    p = tmp_path / "locked.db"
    conn = sqlite3.connect(p, isolation_level=None)
    conn.execute("create table t (x)")
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("insert into t values (1)")
    try:
        rc, err = _cli_err(capsys, ["sessions", "--db", str(p)])
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    assert rc == 2 and "locked" in err and err.count("\n") == 0


def test_unwritable_path(tmp_path, capsys):
    f = tmp_path / "plainfile"
    f.write_text("x")
    script = tmp_path / "s.toml"
    script.write_text('[engine]\nmodel = "tiny:llama"\nnum_blocks = 16\n[[turns]]\nuser = "a"\ntext = "hi"\nmax_tokens = 2\n')
    rc, err = _cli_err(capsys, ["run", str(script), "--db", str(f / "x.db")])
    assert rc == 2 and "cannot create a database" in err and err.count("\n") == 0
    assert f.read_text() == "x"


def test_directory_as_db(tmp_path, capsys):
    rc, err = _cli_err(capsys, ["sessions", "--db", str(tmp_path)])
    assert rc == 2 and "is a directory" in err


def test_unknown_session_id(tmp_path, capsys):
    p = tmp_path / "s.db"
    open_db(p).close()
    for argv in (["show", "01NOPE", "--db", str(p)], ["export", "01NOPE", "--db", str(p), "--format", "md"],
                 ["replay", "01NOPE", "--db", str(p), "--headless"]):
        rc, err = _cli_err(capsys, argv)
        assert rc == 2 and "unknown session id" in err and err.count("\n") == 0, argv


def test_missing_db_for_show(tmp_path, capsys):
    rc, err = _cli_err(capsys, ["show", "X", "--db", str(tmp_path / "none.db")])
    assert rc == 2 and "no sessions database" in err
    assert not (tmp_path / "none.db").exists()
    assert cli(["sessions", "--db", str(tmp_path / "none.db")]) == 0
    assert not (tmp_path / "none.db").exists()


def test_two_writers_share_one_db(tmp_path, make_engine):
    """The app and a headless run/replay can record into the same DB at the same time (WAL)."""
    from kvplay.engine.sampling import SamplingParams
    from kvplay.sessions.recorder import Recorder

    eng = make_engine()
    path = str(tmp_path / "shared.db")
    sp = SamplingParams(max_tokens=2, seed=1)
    msgs = [{"role": "user", "content": "hi"}]
    res = eng.submit("a", msgs, sp).result(60)
    recs = [Recorder.open(path, eng.config, eng.model_name, src, "") for src in ("app", "replay")]

    def write(rec):
        for _ in range(20):
            rec.record_turn("a", "hi", msgs, sp, res)

    threads = [threading.Thread(target=write, args=(r,)) for r in recs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in recs:
        r.close()
    db = open_db(path)
    counts = {r["session_id"]: r["n"] for r in db.query("select session_id, count(*) n from turns group by session_id")}
    assert counts == {recs[0].session_id: 20, recs[1].session_id: 20}


def test_locked_db_is_one_line_not_a_traceback(tmp_path):
    import os
    import sqlite3
    import subprocess
    import sys

    from kvplay.sessions.store import open_db

    db = tmp_path / "lock.db"
    open_db(str(db)).close()
    script = tmp_path / "s.toml"
    script.write_text('[[turns]]\nuser = "a"\ntext = "hi"\nmax_tokens = 2\n')
    holder = sqlite3.connect(db)
    holder.execute("BEGIN IMMEDIATE")
    try:
        r = subprocess.run([sys.executable, "-m", "kvplay", "run", str(script), "--model", "tiny:llama",
                            "--num-blocks", "32", "--db", str(db)], capture_output=True, text=True,
                           env=dict(os.environ, KVPLAY_DB_TIMEOUT="0.5"), timeout=120)
    finally:
        holder.rollback()
        holder.close()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "locked" in r.stderr.strip().splitlines()[-1]


def _listed_db(tmp_path):
    """Six example runs (as the issue's new user made them), an app session and a lab's."""
    p = tmp_path / "list.db"
    db = open_db(p)
    scripts = ["am-i-pretty", "concurrent", "eviction-pressure", "group-attack", "multi-turn", "shared-system"]
    rows = [(new_ulid(), "run", f"/home/someone/kvplay/examples/{s}.toml") for s in scripts]
    rows += [(new_ulid(), "app", None), (new_ulid(), "lab:leak", None)]
    for i, (sid, source, script) in enumerate(rows):
        db["sessions"].insert({"id": sid, "created": 1.7e9 + i, "ended": 1.7e9 + i + 5, "source": source,
                               "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "script_path": script})
        db["users"].insert({"session_id": sid, "name": "alice"})
        db["turns"].insert({"session_id": sid, "seq": 1, "user": "alice", "text": "hi",
                            "prompt_tokens": 100, "cached_tokens": 32 + i})
    db.close()
    return p, rows


def test_sessions_at_80_columns_keep_whole_ids_and_numbers(tmp_path):
    import io

    from rich.console import Console

    from kvplay.commands.sessions import table_of
    from kvplay.sessions.query import list_sessions

    p, rows = _listed_db(tmp_path)
    db = open_db(p, create=False)
    listed = list_sessions(db)
    db.close()
    out = io.StringIO()
    Console(file=out, width=80).print(table_of(listed, f"sessions in {p}", 80))
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    header = next(line for line in lines if "id" in line and "hit" in line)
    for col in ("when", "users", "turns", "hit", "what"):
        assert col in header, (col, header)
    for (sid, source, _), i in zip(rows, range(len(rows))):
        line = next(line for line in lines if sid in line)  # the whole id, never `s…`
        assert f"{(32 + i) / 100:.1%}" in line and source in line, line
    assert "run shared-system " in text and "run eviction-pressure " in text


def test_sessions_piped_are_whole_and_runs_name_their_script(tmp_path, capsys):
    p, rows = _listed_db(tmp_path)
    assert cli(["sessions", "--db", str(p)]) == 0
    out = capsys.readouterr().out
    assert "…" not in out, out
    for sid, source, script in rows:
        line = next(line for line in out.splitlines() if sid in line)
        assert "SmolLM2-135M-Instruct" in line
        if script:
            assert f"run {script.rsplit('/', 1)[-1][:-5]} " in line, line
