"""`kvplay watch` as a user runs it: a publisher with vLLM's semantics that connects (so watch
binds), a batch lost in transit, a publisher restart; JSON lines, the summary, the recording."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import time

import pytest

from support.recorded import recorded
from support.watch import KVPLAY, Watch, restart
from support.wait import wait_for

from kvplay.wire.codec import BlockRemoved, BlockStored, EventBatch
from kvplay.wire.publisher import ZmqEventPublisher

BS = 4


def stored(hashes, parent, session):
    return BlockStored(list(hashes), parent, [h % 100 for h in hashes for _ in range(BS)], BS, None, "GPU", None,
                       session_id=session)


def test_watch_json_gap_restart_and_recording(tmp_path, pubs, free_port):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    db = tmp_path / "s.db"
    # seq 3 is lost in transit (a test hook): watch must replay it, in order
    w = Watch("--events-bind", ev, "--replay", rep, "--pod", "vllm-0", "--topic", "kv-events", "--json",
              "--db", str(db), "--drop", "vllm-0:3")
    try:
        w.wait_err("recording")
        pub = ZmqEventPublisher(ev, rep, topic="kv-events")  # not a wildcard: it connects, watch binds
        pubs.append(pub)
        batches = [
            [stored([1, 2], None, "alice")],                          # 0
            [stored([1], None, "bob"), stored([3], 1, "bob")],        # 1: bob reuses 1, stores 3
            [stored([4], 2, "alice")],                                # 2
            [stored([5], 4, "alice")],                                # 3: lost live, replayed
            [BlockRemoved([5], "GPU"), BlockRemoved([3], "GPU")],     # 4: must not be undone by the replay
            [stored([6], None, None)],                                # 5: someone else
        ]
        sent = iter(batches[:3])

        def feed():
            b = next(sent, None)
            if b is not None:
                pub.publish(EventBatch(time.time(), b))
        # the first batches may be published before the subscription is through: a late-join replay
        # or a gap replay brings them back either way
        got = w.until(lambda d: d.get("seq") == 2, feed=feed)
        # joined, no replay in flight: seq 3 is lost live, seq 4 shows a gap
        wait_for(lambda: [e for e in w.err if " is " in e][-1:] == ["kvplay: pod vllm-0 is live"], 20)
        sent = iter(batches[3:])
        got += w.until(lambda d: d.get("seq") == 5, feed=feed)
        seqs = [d["seq"] for d in got]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)) == 6
        assert any(d.get("replayed") for d in got if d["seq"] == 3)
        fields = ("pod", "seq", "stored", "removed", "cleared")
        assert {k: got[4][k] for k in fields} == {"pod": "vllm-0", "seq": 4, "stored": 0, "removed": 2, "cleared": 0}
        # the server restarts: its seq starts at 0 again, its cache is empty
        pub.shutdown()
        pub2 = restart(lambda e, r: ZmqEventPublisher(e, r, topic="kv-events"), ev, rep)
        pubs.append(pub2)
        again = iter([[stored([7], None, "carol")], [stored([8], 7, "carol")]])

        def feed2():
            b = next(again, None)
            if b is not None:
                pub2.publish(EventBatch(time.time(), b))
        w.until(lambda d: d.get("seq") == 1 and d["stored"] == 1, feed=feed2)
        rest = w.stop()
    finally:
        if w.p.poll() is None:
            w.p.kill()
    assert w.p.returncode == 0, w.err
    summary = rest[-1]
    assert summary["summary"] is True
    pod = summary["pods"]["vllm-0"]
    assert pod["blocks"] == 2 and pod["by_session"] == {"carol": 2}
    assert pod["restarts"] == 1 and pod["gaps"] >= 1 and pod["replayed"] >= 1, (got, w.err, pod)
    assert pod["stored_by_session"] == {"alice": 4, "bob": 2, "carol": 2, "someone else": 1}
    assert pod["removed"] == 2 and pod["stored"] == 9
    # recorded like any session: kvplay's event names, pod and wire seq on every row
    con = sqlite3.connect(db)
    assert con.execute("select source from sessions").fetchall() == [("watch",)]
    rows = [(e["kind"], e.get("user"), e.get("pod"), e.get("wire_seq"), json.dumps(e.get("block_hashes") or []), json.dumps(e))
            for e in recorded(db)]
    assert {r[2] for r in rows} == {"vllm-0"} and all(type(r[3]) is int for r in rows)
    kinds = [r[0] for r in rows]
    assert kinds.count("BlockHit") == 1
    assert sum(len(json.loads(r[4])) for r in rows if r[0] == "BlockRemoved" and json.loads(r[5])["reason"] == "evicted") == 2
    assert ("AllBlocksCleared", "publisher restarted") in [(r[0], json.loads(r[5]).get("reason")) for r in rows]
    # replaying the recording gives the mirror's final blocks
    alive = set()
    for kind, _user, _pod, _seq, hashes, _payload in rows:
        hs = set(json.loads(hashes or "[]"))
        if kind == "BlockStored":
            alive |= hs
        elif kind == "BlockRemoved":
            alive -= hs
        elif kind == "AllBlocksCleared":
            alive.clear()
    assert alive == {7, 8}  # hashes as the server sent them


def test_watch_human_output_and_no_record(tmp_path, free_port):
    ev = f"tcp://127.0.0.1:{free_port()}"
    r = subprocess.run(KVPLAY + ["watch", "--events", ev, "--duration", "1.5", "--no-record"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "[waiting]" in r.stdout and "blocks 0" in r.stdout
    assert "recording" not in r.stderr


@pytest.mark.parametrize("argv, msg", [
    ([], "--events EP"),
    (["--events", "127.0.0.1:5557"], "ZeroMQ endpoint"),
    (["--events", "tcp://127.0.0.1:1", "--replay", "x"], "--replay"),
    (["--events", "tcp://127.0.0.1:1", "--pod", "a", "--pod", "b"], "--pod"),
    (["--events", "tcp://127.0.0.1:1", "--events", "tcp://127.0.0.1:2", "--pod", "a", "--pod", "a"], "named"),
    (["--events", "tcp://127.0.0.1:1", "--duration", "0"], "--duration"),
])
def test_watch_bad_input_is_one_line_exit_2(argv, msg, capsys, tmp_path):
    from kvplay.cli import main

    assert main(["watch", *argv, "--db", str(tmp_path / "x.db")]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.db").exists()  # nothing recorded for a refused watch


def test_watch_bad_db_is_one_line_and_left_unchanged(capsys, tmp_path, free_port):
    from kvplay.cli import main

    bad = tmp_path / "notes.db"
    bad.write_text("not a database")
    assert main(["watch", "--events", f"tcp://127.0.0.1:{free_port()}", "--db", str(bad), "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert "not a SQLite database" in err and err.count("\n") == 1
    assert bad.read_text() == "not a database"


def test_watch_bind_conflict_is_one_line(capsys, tmp_path):
    import zmq

    from kvplay.cli import main

    s = zmq.Context.instance().socket(zmq.SUB)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert main(["watch", "--events-bind", f"tcp://127.0.0.1:{port}", "--no-record", "--duration", "1"]) == 2
    finally:
        s.close(0)
    err = capsys.readouterr().err
    assert "--events-bind" in err and "in use" in err and err.count("\n") == 1
