"""`kvplay run`: per-turn attribution, isolation, concurrency, conversations, failures, bad input."""
import json

import pytest

from support import EXAMPLES

from kvplay.cli import main as cli

SYSTEM = ("You are a helpful assistant for a bakery. You know the opening hours, the daily bread list, "
          "that cakes must be ordered two days ahead and that nothing is guaranteed nut free.")


def script(tmp_path, turns, engine='model = "tiny:llama"\nnum_blocks = 64', users=("alice", "bob"), name="s.toml",
           extra_users=""):
    text = f"[engine]\n{engine}\n\n[system]\nprompt = {json.dumps(SYSTEM)}\n\n"
    for u in users:
        text += f'[[users]]\nname = "{u}"\nmax_tokens = 6\n{extra_users}\n'
    for t in turns:
        text += "[[turns]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items()) + "\n"
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def run_json(capsys, argv):
    rc = cli(argv)
    out = capsys.readouterr().out
    objs = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert objs and objs[-1]["summary"] is True
    return rc, objs[:-1], objs[-1]


TWO = [{"user": "alice", "text": "When are you open?"}, {"user": "bob", "text": "Do you sell rye?"}]


def test_second_user_cached_from_first(tmp_path, capsys):
    rc, turns, summ = run_json(capsys, ["run", script(tmp_path, TWO), "--json", "--no-record"])
    assert rc == 0
    a, b = turns
    assert (a["turn"], a["user"], b["turn"], b["user"]) == (1, "alice", 2, "bob")
    assert a["cached_tokens"] == 0 and a["computed_tokens"] == a["prompt_tokens"]
    assert b["cached_tokens"] >= 100 and b["cached_from"] == {"alice": b["cached_tokens"]}
    assert b["computed_tokens"] == b["prompt_tokens"] - b["cached_tokens"]
    for t in turns:
        assert {"text", "ttft_ms", "output_tokens", "decode_tok_s", "reply", "finish_reason", "error"} <= set(t)
        assert t["error"] is None and t["output_tokens"] == 6
    assert summ["hit_rate"] > 0 and summ["failed"] == 0 and summ["session"] is None
    assert {"blocks", "evictions", "bytes_saved", "preemptions"} <= set(summ)


def test_isolation_user_flag_overrides_script(tmp_path, capsys):
    rc, turns, summ = run_json(capsys, ["run", script(tmp_path, TWO), "--json", "--no-record", "--isolation", "user"])
    assert rc == 0
    assert turns[1]["cached_tokens"] == 0 and "alice" not in turns[1]["cached_from"]
    assert summ["isolation"] == "user" and summ["hit_rate"] == 0


def test_conversation_grows_and_reuses_own_blocks(tmp_path, capsys):
    turns = [{"user": "alice", "text": "When are you open?"}, {"user": "alice", "text": "And on Sunday?"}]
    rc, out, _ = run_json(capsys, ["run", script(tmp_path, turns, users=("alice",)), "--json", "--no-record"])
    assert rc == 0
    first, second = out
    assert second["prompt_tokens"] > first["prompt_tokens"] + len("And on Sunday?") // 2
    assert set(second["cached_from"]) == {"alice"} and second["cached_tokens"] >= first["prompt_tokens"] - 16


def test_concurrent_turns_match_sequential(tmp_path, capsys):
    users = ("alice", "bob", "carol", "dave")
    qs = ["When are you open?", "Do you sell rye?", "Cake for tomorrow?", "Nut free?"]
    eng = 'model = "tiny:llama"\nnum_blocks = 96\ndeterministic = true'
    seq = [{"user": u, "text": q} for u, q in zip(users, qs)]
    conc = [dict(t, at=0) for t in seq]
    rc1, a, _ = run_json(capsys, ["run", script(tmp_path, seq, eng, users, "a.toml"), "--json", "--no-record"])
    rc2, b, _ = run_json(capsys, ["run", script(tmp_path, conc, eng, users, "b.toml"), "--json", "--no-record"])
    assert rc1 == rc2 == 0
    assert sorted(t["turn"] for t in b) == [1, 2, 3, 4]
    by_turn = {t["turn"]: t for t in b}
    for t in a:
        assert by_turn[t["turn"]]["reply"] == t["reply"], t["user"]
        assert by_turn[t["turn"]]["at"] == 0


def test_user_waits_for_own_previous_reply(tmp_path, capsys):
    turns = [{"user": "alice", "text": "When are you open?", "at": 0}, {"user": "alice", "text": "Sunday?", "at": 0}]
    rc, out, _ = run_json(capsys, ["run", script(tmp_path, turns, users=("alice",)), "--json", "--no-record"])
    assert rc == 0 and [t["turn"] for t in out] == [1, 2]
    assert out[1]["prompt_tokens"] > out[0]["prompt_tokens"] + 6  # includes turn 1 and its reply


def test_failed_turn_reported_and_run_continues(tmp_path, capsys):
    turns = [{"user": "alice", "text": "x " * 400}, {"user": "bob", "text": "Do you sell rye?"}]
    rc, out, summ = run_json(capsys, ["run", script(tmp_path, turns, 'model = "tiny:llama"\nnum_blocks = 24'),
                                      "--json", "--no-record"])
    assert rc == 1
    assert out[0]["error"] and "pool" in out[0]["error"] and out[0]["finish_reason"] == "error"
    assert out[1]["error"] is None and out[1]["output_tokens"] == 6
    assert summ["failed"] == 1


def test_table_output(tmp_path, capsys):
    assert cli(["run", script(tmp_path, TWO), "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "bob" in out and "hit rate" in out
    assert "(alice " in out  # bob's cached column names alice as the creator


def test_records_session(tmp_path, capsys):
    db = str(tmp_path / "s.db")
    rc, turns, summ = run_json(capsys, ["run", script(tmp_path, TWO), "--json", "--db", db])
    assert rc == 0 and summ["session"] and summ["db"] == db
    assert cli(["show", summ["session"][:12], "--db", db, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "run" and shown["engine_config"]["model"] == "tiny:llama"
    assert [t["user"] for t in shown["turns"]] == ["alice", "bob"]
    assert shown["turns"][1]["cached_from"] == turns[1]["cached_from"]
    assert shown["turns"][1]["reply"] == turns[1]["reply"]
    assert {u["name"] for u in shown["users"]} == {"alice", "bob"}
    assert shown["event_count"] > 0 and shown["ended"] is not None
    assert set(shown["versions"]) == {"kvplay", "torch", "transformers"}
    assert cli(["sessions", "--db", db, "--json"]) == 0
    listed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert listed[0]["id"] == summ["session"] and listed[0]["turns"] == 2 and listed[0]["users"] == 2


@pytest.mark.parametrize("argv_extra, body, fragment", [
    ([], "[[turns]]\nuser = 'a'\ntext = \n", "line 3"),
    ([], '[[users]]\nname = "a"\n[[turns]]\nuser = "b"\ntext = "hi"\n', "unknown user 'b'"),
    (["--block-size", "0"], '[[turns]]\nuser = "a"\ntext = "hi"\n', "--block-size"),
    (["--isolation", "nobody"], '[[turns]]\nuser = "a"\ntext = "hi"\n', "unknown isolation"),
    ([], '[engine]\nwarp = 9\n[[turns]]\nuser = "a"\ntext = "hi"\n', "unknown engine option 'warp'"),
])
def test_bad_input_exit_2(tmp_path, capsys, argv_extra, body, fragment):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    rc = cli(["run", str(p), "--no-record", "--model", "tiny:llama"] + argv_extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert fragment in err[-1] and err[-1].startswith("kvplay: error:")
    assert not any("Traceback" in line for line in err)


@pytest.mark.slow
def test_shared_system_example_on_embedded_model(capsys):
    """The issue's bar: bob reuses >= 480 of alice's tokens; --isolation user reuses none."""

    ex = str(EXAMPLES / "shared-system.toml")
    rc, (a, b), _ = run_json(capsys, ["run", ex, "--json", "--no-record", "--model", "default"])
    assert rc == 0 and b["cached_from"].get("alice", 0) >= 480 and a["cached_tokens"] == 0
    rc, (a, b), _ = run_json(capsys, ["run", ex, "--json", "--no-record", "--model", "default", "--isolation", "user"])
    assert rc == 0 and b["cached_tokens"] == 0


def test_piped_table_lists_turns_in_turn_order_with_whole_headers(tmp_path, capsys):
    # turn 1 decodes 40 tokens, turns 2 and 3 one each: they finish first, yet print after turn 1
    turns = [{"user": "alice", "text": "When are you open?", "at": 0, "max_tokens": 40},
             {"user": "bob", "text": "Do you sell rye?", "at": 0, "max_tokens": 1},
             {"user": "carol", "text": "Cake for tomorrow?", "at": 0, "max_tokens": 1}]
    users = ("alice", "bob", "carol")
    assert cli(["run", script(tmp_path, turns, users=users), "--no-record"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("turn"))
    assert lines[header].split() == ["turn", "user", "prompt", "cached", "computed", "TTFT", "ms", "tok/s", "reply"]
    rows = [line.split() for line in lines[header + 1:header + 4]]
    assert [(r[0], r[1]) for r in rows] == [("1", "alice"), ("2", "bob"), ("3", "carol")]
    assert "…" not in lines[header] and "│" not in "".join(lines)  # plain columns, not a boxed table


@pytest.mark.parametrize("width", [56, 70, 90, 200])
def test_terminal_table_fits_the_width_and_never_clips_a_header(width):
    from rich.console import Console

    from kvplay.sessions.headless import COLUMNS, make_table

    rows = [["1", "alice", "532", "512 (alice 496, own 16)", "20", "140.2", "18.3", "a reply " * 12],
            ["2", "bob", "40", "0", "40", "12.0", "220.0", "short"]]
    con = Console(width=width, record=True, force_terminal=True, color_system=None)
    con.print(make_table(None, rows, width, ["alice", "bob"]))
    text = con.export_text()
    assert all(len(line) <= width for line in text.splitlines()), text
    header = text.splitlines()[1] if text.startswith("┏") else text.splitlines()[0]
    for name in COLUMNS[:-1]:
        assert name in header, (name, header)
    if width >= 90:
        assert "reply" in header


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["sessions", "--help"], ["run", "x.toml", "--bogus"],
                                  ["export", "--help"], ["simulate", "--help"], ["lab", "nope"], ["lab"],
                                  ["lab", "collide", "--help"], ["lab", "collide", "--bits", "0"]])
def test_help_and_argument_errors_import_neither_torch_nor_transformers(argv):
    import subprocess
    import sys

    code = ("import sys\nfrom kvplay.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in out.stderr, out.stderr


def test_paths_never_create_missing_folders(tmp_path, capsys):
    """--db, -o, --plot and screenshot's OUT in a folder that does not exist: one line, exit 2,
    and no folder made (the issue saw `-o no/such/dir/x.md` create `no/such/dir/`)."""
    s = script(tmp_path, TWO)
    missing = tmp_path / "no" / "such"
    for argv in (["run", s, "--db", str(missing / "x.db")],
                 ["export", "X", "-o", str(missing / "x.md")],
                 ["simulate", "X", "--plot", str(missing / "p.png")],
                 ["screenshot", str(missing / "x.svg"), "--model", "tiny:llama"]):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "no such directory" in err and len(err.splitlines()) == 1, (argv, err)
        assert not (tmp_path / "no").exists(), argv


def test_simulate_a_missing_file_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["simulate", "nope.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope.jsonl: no such file" in err and "session id 'NOPE" not in err and len(err.splitlines()) == 1


def test_plain_lines_keep_their_columns_with_every_reason_in_computed():
    """Piped `kvplay run` prints a line per turn as it finishes: the "computed" cell of a turn
    with three reasons (docs/miss.md's dave) fits its column, so TTFT stays under its header."""
    import io

    from rich.console import Console

    from kvplay.sessions.headless import TurnTable

    out = io.StringIO()
    con = Console(file=out, force_terminal=False, width=200)
    rows = {1: ["1", "alice", "256", "0", "256: 240 cold, 16 tail", "249.8", "53.5", "a reply"],
            2: ["2", "dave", "260", "0", "260: 240 cold, 16 isolated from alice, 4 tail", "260.7", "45.6", "b"],
            3: ["3", "alice", "296", "32 (own 32)", "264: 240 evicted, 16 cold, 8 tail", "273.2", "52.3", "c"]}
    with TurnTable(con, [1, 2, 3], ["alice", "dave"]) as t:
        for turn, row in rows.items():
            t.add(turn, row)
    lines = out.getvalue().splitlines()
    ends = {line.index("TTFT ms") + len("TTFT ms") if line.startswith("turn") else line.index(row[5]) + len(row[5])
            for line, row in zip(lines, [None, *rows.values()])}
    assert len(ends) == 1, lines  # every TTFT right-aligned under its header
