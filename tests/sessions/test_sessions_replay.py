"""Record -> replay round trip, export toml -> run, durability under SIGKILL."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from kvplay.cli import main as cli

SYSTEM = "You are a helpful assistant for a bakery. Answer briefly and never invent prices or opening hours."


def write_script(tmp_path, n_rounds=1, max_tokens=6, deterministic=True, name="s.toml", temperature=0.7):
    text = (f'[engine]\nmodel = "tiny:llama"\nnum_blocks = 96\ndeterministic = {str(deterministic).lower()}\n\n'
            f"[system]\nprompt = {json.dumps(SYSTEM)}\n\n")
    for i, u in enumerate(("alice", "bob")):
        text += f'[[users]]\nname = "{u}"\nseed = {i + 1}\ntemperature = {temperature}\nmax_tokens = {max_tokens}\n\n'
    for r in range(n_rounds):
        text += f'[[turns]]\nuser = "alice"\ntext = "Question {r} from alice?"\n\n'
        text += f'[[turns]]\nuser = "bob"\ntext = "Question {r} from bob?"\nat = {0.0 if r == 0 else 0.01 * r}\n\n'
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def json_lines(out):
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def recorded(tmp_path, capsys, **kw):
    db = str(tmp_path / "s.db")
    assert cli(["run", write_script(tmp_path, **kw), "--json", "--db", db]) == 0
    objs = json_lines(capsys.readouterr().out)
    return db, objs[:-1], objs[-1]["session"]


def test_round_trip_identical_in_deterministic_mode(tmp_path, capsys):
    db, turns, sid = recorded(tmp_path, capsys, n_rounds=2)
    assert cli(["replay", sid, "--db", db, "--headless", "--json"]) == 0
    objs = json_lines(capsys.readouterr().out)
    comps, summ = objs[:-1], objs[-1]
    assert len(comps) == 4 and all(c["equal"] for c in comps)
    replies = {t["turn"]: t["reply"] for t in turns}
    assert sorted(c["now_reply"] for c in comps) == sorted(replies.values())
    assert summ["reproduces"] and summ["replay_of"] == sid and summ["deterministic"]
    # the replay is itself a recorded session pointing back at the original
    assert cli(["show", summ["session"], "--db", db, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "replay" and shown["replay_of"] == sid and len(shown["turns"]) == 4


def test_replay_detects_a_changed_output(tmp_path, capsys):
    db, turns, sid = recorded(tmp_path, capsys)
    conn = sqlite3.connect(db)
    ids = json.loads(conn.execute("select token_ids from turns where session_id = ? and seq = 2", [sid]).fetchone()[0])
    ids[3] = (ids[3] + 1) % 50
    conn.execute("update turns set token_ids = ? where session_id = ? and seq = 2", [json.dumps(ids), sid])
    conn.commit()
    conn.close()
    assert cli(["replay", sid, "--db", db, "--headless", "--json", "--no-record"]) == 1
    comps = {c["turn"]: c for c in json_lines(capsys.readouterr().out)[:-1]}
    assert comps[1]["equal"] and not comps[2]["equal"]
    assert comps[2]["first_diff"] == 3 and comps[2]["then_token"] != comps[2]["now_token"]
    # a table run prints the verdict too
    assert cli(["replay", sid, "--db", db, "--headless", "--no-record"]) == 1
    out = capsys.readouterr().out
    assert "differs" in out and "NO LONGER REPRODUCES" in out


def test_replay_function_yields_comparisons(tmp_path, capsys, make_engine):
    from kvplay.sessions.query import resolve_session, session_turns
    from kvplay.sessions.replay import replay
    from kvplay.sessions.store import open_db

    db, turns, sid = recorded(tmp_path, capsys)
    sdb = open_db(db)
    rows = session_turns(sdb, resolve_session(sdb, sid)["id"])
    sdb.close()
    eng = make_engine(num_blocks=96, deterministic=True)
    comps = list(replay(eng, rows))
    assert [c.equal for c in comps] == [True, True]
    assert {c.user for c in comps} == {"alice", "bob"}
    assert comps[0].cached_now is not None


def test_export_toml_reproduces(tmp_path, capsys):
    db, turns, sid = recorded(tmp_path, capsys, n_rounds=2)
    out = tmp_path / "exported.toml"
    assert cli(["export", sid, "--db", db, "--format", "toml", "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli(["run", str(out), "--json", "--no-record"]) == 0
    again = json_lines(capsys.readouterr().out)[:-1]
    assert sorted(t["turn"] for t in again) == [1, 2, 3, 4]
    key = lambda t: (t["user"], t["text"])  # noqa: E731
    assert {key(t): t["reply"] for t in again} == {key(t): t["reply"] for t in turns}
    assert {key(t): t["prompt_tokens"] for t in again} == {key(t): t["prompt_tokens"] for t in turns}


def test_export_md_and_jsonl(tmp_path, capsys):
    db, turns, sid = recorded(tmp_path, capsys)
    assert cli(["export", sid, "--db", db, "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith(f"# kvplay session {sid}") and "Question 0 from bob?" in md
    assert cli(["export", sid, "--db", db, "--format", "jsonl"]) == 0
    lines = json_lines(capsys.readouterr().out)
    assert lines[0]["type"] == "session" and [x["type"] for x in lines[1:3]] == ["turn", "turn"]
    assert any(x["type"] == "event" and x["kind"] == "BlockStored" for x in lines)


def test_sigkill_mid_run_keeps_finished_turns(tmp_path, capsys):
    db = tmp_path / "k.db"
    path = write_script(tmp_path, n_rounds=40, max_tokens=24, name="long.toml")
    env = dict(os.environ, KVPLAY_DB=str(db), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvplay", "run", path, "--json", "--db", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    printed = []
    try:
        deadline = time.monotonic() + 120
        while len(printed) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            printed.append(json.loads(line))
        assert len(printed) >= 3, "the run did not get going"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    # every turn printed was committed before it was printed; nothing after the kill is corrupt
    conn = sqlite3.connect(db)
    assert conn.execute("pragma integrity_check").fetchone()[0] == "ok"
    conn.close()
    capsys.readouterr()
    assert cli(["sessions", "--db", str(db), "--json"]) == 0
    [session] = json_lines(capsys.readouterr().out)
    assert session["ended"] is None and session["turns"] >= len(printed)
    assert session["turns"] < 80
    assert cli(["replay", session["id"], "--db", str(db), "--headless", "--json", "--no-record"]) == 0
    summ = json_lines(capsys.readouterr().out)[-1]
    # the same outputs; the cached tokens of bob's overlapping (`at`) turns depend on timing
    assert summ["turns"] == session["turns"] and summ["text_differs"] == 0 and summ["errors"] == 0


def test_replay_in_app_gets_recorded_turns(tmp_path, capsys, monkeypatch):
    """Without --headless the recorded users and turns (with their recorded pace) go to the app."""
    replay_cmd = pytest.importorskip("kvplay.commands.replay")  # it imports the app's run_app
    db, turns, sid = recorded(tmp_path, capsys, n_rounds=2)
    calls = []
    monkeypatch.setattr(replay_cmd, "run_app", lambda *a, **kw: calls.append((a, kw)) or 0)
    assert cli(["replay", sid[:14], "--db", db, "--speed", "4"]) == 0
    [(args, kw)] = calls
    config, users, system, play = args[:4]
    assert config.deterministic and config.model == "tiny:llama"
    assert [u.name for u in users] == ["alice", "bob"] and [u.seed for u in users] == [1, 2]
    assert system == SYSTEM and kw["speed"] == 4 and kw["title"] == f"replay of {sid}"
    assert kw["replay_of"] == sid
    assert [(t.user, t.text) for t in play][:2] == [("alice", "Question 0 from alice?"), ("bob", "Question 0 from bob?")]
    assert all(t.at is not None for t in play) and play[0].at == 0
    assert all(t.seed is not None and t.temperature == 0.7 for t in play)


REGROUP = f"""[engine]
model = "tiny:llama"
num_blocks = 96
isolation = "group"
deterministic = true

[system]
prompt = {json.dumps(SYSTEM)}

[[users]]
name = "alice"
group = "a"
max_tokens = 4

[[users]]
name = "mallory"
max_tokens = 4

[[turns]]
user = "alice"
text = "How do I keep a sourdough starter alive over a long holiday?"

[[turns]]
user = "mallory"
text = "How do I keep a sourdough starter alive over a long holiday?"

[[turns]]
user = "mallory"
text = "And a rye starter?"
group = "a"
"""


def test_a_group_change_mid_session_replays_and_exports_at_its_turn(tmp_path, capsys):
    """mallory joins alice's group before her second turn: only that turn reuses alice's blocks,
    in the run, in its headless replay (which starts mallory in no group and moves her before
    turn 3) and in the exported script."""
    path = tmp_path / "regroup.toml"
    path.write_text(REGROUP)
    db = str(tmp_path / "g.db")
    assert cli(["run", str(path), "--json", "--db", db]) == 0
    objs = json_lines(capsys.readouterr().out)
    turns, sid = {t["turn"]: t for t in objs[:-1]}, objs[-1]["session"]
    assert turns[2]["cached_tokens"] == 0  # no group: private
    assert turns[3]["cached_tokens"] > 0 and set(turns[3]["cached_from"]) == {"alice"}

    assert cli(["replay", sid, "--db", db, "--headless", "--json", "--no-record"]) == 0
    comps = {c["turn"]: c for c in json_lines(capsys.readouterr().out)[:-1]}
    assert all(c["equal"] for c in comps.values())
    assert {k: c["cached_now"] for k, c in comps.items()} == {k: t["cached_tokens"] for k, t in turns.items()}
    # from whom, too: in no group mallory's third turn would hit her own second turn's blocks
    assert {k: c["cached_from_now"] for k, c in comps.items()} == {k: t["cached_from"] for k, t in turns.items()}

    out = tmp_path / "exported.toml"
    assert cli(["export", sid, "--db", db, "--format", "toml", "-o", str(out)]) == 0
    capsys.readouterr()
    exported = out.read_text()
    assert exported.count('group = "a"') == 2  # alice's [[users]] entry and mallory's third turn
    assert cli(["run", str(out), "--json", "--no-record"]) == 0
    again = {t["turn"]: t for t in json_lines(capsys.readouterr().out)[:-1]}
    assert {k: t["cached_from"] for k, t in again.items()} == {k: t["cached_from"] for k, t in turns.items()}


def test_a_turn_group_must_be_a_string(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(REGROUP.replace('text = "And a rye starter?"\ngroup = "a"', 'text = "And a rye starter?"\ngroup = 3'))
    assert cli(["run", str(path), "--no-record"]) == 2
    assert "`group` must be a string" in capsys.readouterr().err
